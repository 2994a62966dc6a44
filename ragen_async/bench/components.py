"""Component benchmarks: each of the project's data-plane paths against a raw baseline moving the same
bytes in the same run (``ragen-async bench transport`` and ``ragen-async bench weights``).

* **Transport.** A sender process pushes distinct trajectory groups to a receiver process over loopback
  TCP, on each of the three hops in :data:`HOPS` (an actor encoding and the driver reading; the driver
  alone; the driver's forwarded shard and a learner decoding it), and, separately, the already-encoded
  frames of the same messages through a bare PUSH/PULL pair (``send_multipart`` /
  ``recv_multipart(copy=False)``). The clock runs on the receiver, from the sender's start signal to the
  last message received; over the same span each process's CPU time is read (all its threads), and the
  receiving thread's own. With ``pin`` the two ends run on disjoint halves of the CPUs (ZeroMQ's I/O
  threads with them), as two machines of a cluster would, where otherwise they share every core.
* **Weight sync.** One receiver process joins the gloo weight group. Each repetition is timed on the
  publisher until a barrier after the receiver finished: the project's ``GlooBroadcastPublisher.publish``
  (header, then the buckets: sent in place when the tensors lie in one flat buffer per dtype, as the
  learner holds its parameters, packed first otherwise) with ``receive_weights`` (check, unpack) on the
  other side, vs one raw ``broadcast`` of a flat buffer holding the same number of bytes in the same
  process group. The two alternate, after one untimed round of each (it allocates the receive buffers).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ragen_async.bench.cputime import process_cpu_s
from ragen_async.bench.pipeline import split_cpus
from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup, TurnRecord


@dataclass(frozen=True)
class GroupShape:
    """The size of a synthetic trajectory group."""

    name: str
    trajectories: int
    prompt_tokens: int
    turns: int
    reply_tokens: int
    feedback_tokens: int

    @property
    def tokens_per_trajectory(self) -> int:
        return self.prompt_tokens + self.turns * (self.reply_tokens + self.feedback_tokens)


SOKOBAN = GroupShape("Sokoban, 8 x 5 turns", 8, prompt_tokens=300, turns=5, reply_tokens=30, feedback_tokens=60)
"""Like the tiny model's Sokoban groups (about 600 tokens per episode: configs/sim/sokoban_tiny_profile.json)."""
PAPER = GroupShape("paper-sized, 8 x 4,000 tokens", 8, prompt_tokens=500, turns=5, reply_tokens=400,
                   feedback_tokens=300)
"""RAGEN-scale episodes: 4,000 tokens each."""


def synthetic_group(shape: GroupShape, index: int, seed: int = 0, vocab: int = 150_000) -> TrajectoryGroup:
    """A valid group of ``shape`` whose contents are random (ids below ``vocab``, log-probs, one version per
    reply)."""
    rng = np.random.default_rng(seed * 1_000_003 + index)
    group_id = f"bench-{index:08d}"
    trajs = []
    for i in range(shape.trajectories):
        n = shape.tokens_per_trajectory
        ids = rng.integers(0, vocab, n, dtype=np.int32)
        mask = np.zeros(n, np.int8)
        logprobs = np.zeros(n, np.float32)
        versions = np.full(n, NO_VERSION, np.int32)
        turns = []
        at = shape.prompt_tokens
        for _ in range(shape.turns):
            reply = slice(at, at + shape.reply_tokens)
            mask[reply] = 1
            logprobs[reply] = -rng.random(shape.reply_tokens, dtype=np.float32) * 3
            versions[reply] = index
            turns.append(TurnRecord(reward=-0.1, actions=("Up",), num_dropped_actions=0, format_ok=True,
                                    policy_version=index, end_policy_version=index,
                                    response_tokens=shape.reply_tokens, generate_s=0.1, env_step_s=0.001))
            at += shape.reply_tokens + shape.feedback_tokens
        trajs.append(Trajectory(traj_id=f"{group_id}/t{i}", env_tag="SimpleSokoban", seed=index, group_id=group_id,
                                token_ids=ids, loss_mask=mask, behaviour_logprobs=logprobs, token_versions=versions,
                                turns=tuple(turns), format_penalty=0.0, success=False))
    return TrajectoryGroup(group_id=group_id, index=index, env_tag="SimpleSokoban", seed=index,
                           trajectories=tuple(trajs), worker_id="bench")


# ---- transport -------------------------------------------------------------------------------


HOPS: dict[str, str] = {
    "actor → driver": "one sender encodes every group (ZmqSender.send); the receiver checks and reads it "
                      "(ZmqReceiver.receive: signature, header, metadata)",
    "driver receive": "the same receiver, fed groups encoded beforehand, as many actors encoding in parallel "
                      "would feed it: the driver's own cost",
    "driver → learner": "the driver's shards (every trajectory of a group, forwarded as received) decoded by a "
                        "learner's receiver: signatures, digests, arrays rebuilt, validate",
}
"""The hops the transport benchmark times; raw is always ``send_multipart`` / ``recv_multipart`` of the
same frames."""


@dataclass(frozen=True)
class TransportRow:
    shape: str
    hop: str
    path: str
    groups: int
    mb_per_group: float
    seconds: float
    sender_cpu_s: float
    """CPU time of the sender process (all its threads: ZeroMQ's I/O thread too) while the clock ran."""
    receiver_cpu_s: float
    """The same for the receiving process."""
    receiver_thread_cpu_s: float
    """CPU time of the receiver's own thread (the Python that receives and decodes; the rest of
    ``receiver_cpu_s`` is ZeroMQ's I/O thread)."""
    sender_cpus: tuple[int, ...] = ()
    """The CPUs the sender process ran on, read from it while it ran (every CPU the host allows if unpinned)."""
    receiver_cpus: tuple[int, ...] = ()
    """The CPUs the receiving process ran on."""

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.groups * self.mb_per_group / self.seconds


def _frames(hop: str, group: TrajectoryGroup, secret: bytes) -> list:
    """The frames of ``group`` as they travel on ``hop``: the group message, or the learner shard that
    forwards all of its trajectories."""
    from ragen_async.protocol import BatchShard
    from ragen_async.transport.codec import decode, encode

    frames = [bytes(f) for f in encode(group, secret)]
    if hop != "driver → learner":
        return frames
    trajs = decode(frames, secret).trajectories
    n = len(trajs)
    shard = BatchShard(step=group.index, learner_version=0, trajectories=trajs, scores=np.zeros(n, np.float32),
                       normalized_scores=np.zeros(n, np.float32), batch_num_tokens=1, batch_num_seqs=n)
    return [bytes(f) for f in encode(shard, secret)]


def _affinity(pid: int) -> tuple[int, ...]:
    """The CPUs process ``pid`` (0: this one) may run on; empty where the OS does not say (macOS)."""
    return tuple(sorted(os.sched_getaffinity(pid))) if hasattr(os, "sched_getaffinity") else ()


def _pin_this_process(cpus: set[int]) -> None:
    """Every thread of this process (ZeroMQ's I/O threads included) on ``cpus``; threads started later
    inherit it from the thread that starts them."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing
            os.sched_setaffinity(int(task.name), cpus)


def _transport_sender(hop: str, path: str, address: str, secret: bytes, shape: GroupShape, n: int,
                      cpus: set[int] | None, ready, go, done) -> None:  # noqa: ANN001 - multiprocessing events
    if cpus:
        os.sched_setaffinity(0, cpus)  # before ZeroMQ starts its I/O thread, which inherits it
    import zmq

    from ragen_async.transport.zmq_transport import ZmqSender

    groups = [synthetic_group(shape, i) for i in range(n)]
    if path == "project" and hop == "actor → driver":
        sender = ZmqSender(address, secret, send_timeout_s=120)
        ready.set()
        go.wait()
        for g in groups:
            sender.send(g)
        done.wait()  # alive (and counted) until the receiver has everything
        sender.close()
        return
    frames = [_frames(hop, g, secret) for g in groups]
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 8)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    ready.set()
    go.wait()
    for f in frames:
        sock.send_multipart(f, copy=False)
    done.wait()
    sock.close()


def _transport_run(hop: str, path: str, shape: GroupShape, n: int, sender_cpus: set[int] | None = None
                   ) -> TransportRow:
    import zmq

    from ragen_async.protocol import BatchShard
    from ragen_async.transport.zmq_transport import ZmqReceiver

    secret = secrets.token_bytes(32)
    mb = sum(len(f) for f in _frames(hop, synthetic_group(shape, 0), secret)) / 1e6
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    learner = hop == "driver → learner"
    if path == "project":
        receiver = ZmqReceiver.bind(secret, expected=BatchShard if learner else TrajectoryGroup,
                                    max_message_bytes=1 << 30)
        address = receiver.address
    else:
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 8)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    proc = ctx.Process(target=_transport_sender,
                       args=(hop, path, address, secret, shape, n, sender_cpus, ready, go, done), daemon=True)
    proc.start()
    if not ready.wait(300):
        raise RuntimeError("transport benchmark: the sender process did not start within 300 s")
    cpus = (_affinity(proc.pid), _affinity(0))
    t0, sender0, receiver0 = time.perf_counter(), process_cpu_s(proc.pid), process_cpu_s()
    thread0 = time.thread_time()
    go.set()
    for i in range(n):
        if path == "project":
            msg = receiver.receive(timeout_s=60)
            got = None if msg is None else (msg.step if learner else msg.index)
            if got != i:
                raise RuntimeError(f"transport benchmark: expected message {i}, got {got!r}; rejected so far: "
                                   f"{ {k: v for k, v in receiver.stats.rejected.items() if v} }")
        else:
            if not sock.poll(60_000):
                raise RuntimeError(f"transport benchmark: raw message {i} did not arrive within 60 s")
            sock.recv_multipart(copy=False)
    seconds = time.perf_counter() - t0
    thread_cpu = time.thread_time() - thread0
    sender_cpu, receiver_cpu = process_cpu_s(proc.pid) - sender0, process_cpu_s() - receiver0
    done.set()
    proc.join(30)
    (receiver if path == "project" else sock).close()
    return TransportRow(shape.name, hop, path, n, mb, seconds, sender_cpu, receiver_cpu, thread_cpu, *cpus)


def bench_transport(groups: dict[GroupShape, int], repeats: int = 3, hops: tuple[str, ...] = tuple(HOPS),
                    pin: bool = False) -> list[TransportRow]:
    """Project path and raw PUSH/PULL, alternating, ``repeats`` times per shape and hop; every run is returned.
    ``pin``: the sender and the receiver (this process) on the two halves of this process's CPUs
    (:func:`~ragen_async.bench.pipeline.split_cpus`), for the whole benchmark (restored after)."""
    unknown = set(hops) - set(HOPS)
    if unknown:
        raise ValueError(f"unknown hop(s) {sorted(unknown)}; valid: {', '.join(HOPS)}")
    sender_cpus = receiver_cpus = None
    if pin:
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("pinning needs os.sched_setaffinity (Linux)")
        sender_cpus, receiver_cpus = map(set, split_cpus(sorted(os.sched_getaffinity(0))))
    allowed = os.sched_getaffinity(0)
    rows = []
    try:
        if receiver_cpus:
            _pin_this_process(receiver_cpus)
        for shape, n in groups.items():
            for hop in hops:
                for _ in range(repeats):
                    for path in ("project", "raw"):
                        rows.append(_transport_run(hop, path, shape, n, sender_cpus))
    finally:
        if receiver_cpus:
            _pin_this_process(allowed)
    return rows


def format_transport(rows: list[TransportRow]) -> str:
    """Medians per path, and the mean with its 95 % interval of the per-run figures: the project's MB/s and
    its ratio to the raw run made just after it (the paths alternate, so a pair shares the host's state);
    then what each end's process spent in CPU time per group (medians), which a busy host changes less."""
    from ragen_async.study.stats import format_mean_ci, interval

    lines = ["| groups | hop | MB per message | project MB/s | project groups/s | raw ZeroMQ MB/s | project / raw "
             "| project MB/s, mean ± 95 % | project / raw per pair, mean ± 95 % (pairs) "
             "| CPU µs per group, sender / receiver (its Python thread): project | raw |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, hop in dict.fromkeys((r.shape, r.hop) for r in rows):
        project = [r for r in rows if (r.shape, r.hop, r.path) == (shape, hop, "project")]
        raw = [r for r in rows if (r.shape, r.hop, r.path) == (shape, hop, "raw")]
        p = statistics.median(r.mb_per_s for r in project)
        q = statistics.median(r.mb_per_s for r in raw)
        rate, rate_half, _ = interval([r.mb_per_s for r in project])
        ratio, ratio_half, pairs = interval([a.mb_per_s / b.mb_per_s for a, b in zip(project, raw, strict=True)])
        lines.append(f"| {shape} ({project[0].groups} per run) | {hop} | {project[0].mb_per_group:.3f} | {p:,.0f} | "
                     f"{statistics.median(r.groups_per_s for r in project):,.0f} | {q:,.0f} | {p / q:.2f} | "
                     f"{format_mean_ci(rate, rate_half, ',.0f')} | {format_mean_ci(ratio, ratio_half, '.2f')} ({pairs}) | "
                     f"{_cpu_per_group(project)} | {_cpu_per_group(raw)} |")
    return "\n".join(lines)


def _cpu_per_group(runs: list[TransportRow]) -> str:
    """Median CPU µs per group of the sending process, the receiving one and the receiving thread."""
    def median_us(cpu_s: str) -> float:
        return statistics.median(getattr(r, cpu_s) / r.groups for r in runs) * 1e6
    return (f"{median_us('sender_cpu_s'):,.0f} / {median_us('receiver_cpu_s'):,.0f} "
            f"({median_us('receiver_thread_cpu_s'):,.0f})")


# ---- weight sync -----------------------------------------------------------------------------


def tiny_model_tensors(path: str) -> list[tuple[str, torch.Tensor]]:  # noqa: F821
    from safetensors.torch import load_file

    return list(load_file(f"{path}/model.safetensors").items())


def synthetic_qwen_tensors(hidden: int = 896, layers: int = 24, intermediate: int = 4864, vocab: int = 151_936,
                           kv_dim: int = 128) -> list[tuple[str, torch.Tensor]]:  # noqa: F821
    """Qwen2.5-0.5B's tensor shapes (about 0.49 B parameters) in bf16, zero-filled."""
    import torch

    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
                   (p + "self_attn.k_proj.weight", (kv_dim, hidden)), (p + "self_attn.k_proj.bias", (kv_dim,)),
                   (p + "self_attn.v_proj.weight", (kv_dim, hidden)), (p + "self_attn.v_proj.bias", (kv_dim,)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (intermediate, hidden)), (p + "mlp.up_proj.weight", (intermediate, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, intermediate)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    return [(name, torch.zeros(shape, dtype=torch.bfloat16)) for name, shape in shapes]


def learner_layout(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:  # noqa: F821
    """The same tensors laid out as the learner holds its parameters (one flat buffer per dtype)."""
    from ragen_async.weight_sync.wire import flat_layout

    return list(zip([n for n, _ in named], flat_layout([t for _, t in named]), strict=True))


def _weights_receiver(address: str, port: int, manifest, total_bytes: int, repeats: int, tickets) -> None:  # noqa: ANN001
    import datetime as dt

    import torch

    from ragen_async.weight_sync.gloo import ReceiveBuffers, broadcast, open_group, receive_weights

    pg = open_group(address, port, 2, 1, 120.0)
    buffers = ReceiveBuffers()  # reused between syncs, as the vLLM worker extension does
    raw = torch.empty(total_bytes, dtype=torch.uint8)
    ticket = tickets.get(timeout=120)
    for r in range(repeats + 1):  # in the publisher's order: project, raw, project, raw, ...
        receive_weights(pg, manifest, r, 120.0, "bench receiver", buffers=buffers, bucket_bytes=ticket["bucket_bytes"])
        pg.barrier().wait(dt.timedelta(seconds=120))
        broadcast(pg, raw, 120.0, "bench receiver: raw")
        pg.barrier().wait(dt.timedelta(seconds=120))
        if r < repeats:  # the next version's ticket, in hand before the next sync starts (untimed)
            ticket = tickets.get(timeout=120)
            pg.barrier().wait(dt.timedelta(seconds=120))


@dataclass(frozen=True)
class WeightsRow:
    name: str
    megabytes: float
    project_s: list[float]
    raw_s: list[float]


def bench_weights_one(name: str, named: list, repeats: int = 5) -> WeightsRow:
    import datetime as dt

    import torch

    from ragen_async.weight_sync import GlooBroadcastPublisher
    from ragen_async.weight_sync.gloo import broadcast

    total = sum(t.numel() * t.element_size() for _, t in named)
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=1, timeout_s=120)
    manifest = pub.manifest(named)
    ctx = mp.get_context("spawn")
    tickets = ctx.Queue()  # as the driver hands every receiver the ticket before the publish
    proc = ctx.Process(target=_weights_receiver,
                       args=(pub.master_address, pub.master_port, manifest, total, repeats, tickets), daemon=True)
    proc.start()
    pub.connect()
    pg = pub._pg

    def timed(fn) -> float:  # noqa: ANN001
        t0 = time.perf_counter()
        fn()
        pg.barrier().wait(dt.timedelta(seconds=120))
        return time.perf_counter() - t0

    # The same bytes in one buffer of their own. Not torch.zeros: untouched zeroed pages all map to the
    # kernel's one zero page, so a raw send from them would read a single cached page instead of memory.
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in named])
    project, raw = [], []
    tickets.put(pub.ticket(named, 0))
    for r in range(repeats + 1):  # alternating, so drift on a shared machine hits both paths alike
        project.append(timed(lambda r=r: pub.publish(named, version=r)))
        raw.append(timed(lambda: broadcast(pg, flat, 120.0, "bench: raw")))
        if r < repeats:  # the driver hands every receiver the next ticket before the sync
            tickets.put(pub.ticket(named, r + 1))
            pg.barrier().wait(dt.timedelta(seconds=120))
    project, raw = project[1:], raw[1:]  # the first round allocates the receive buffers: not timed
    proc.join(60)
    pub.close()
    return WeightsRow(name, total / 1e6, project, raw)


def format_weights(rows: list[WeightsRow]) -> str:
    lines = ["| tensors | MB | project publish + receive, median s | raw broadcast, median s | "
             "project MB/s | raw MB/s | project / raw (throughput) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p, q = statistics.median(r.project_s), statistics.median(r.raw_s)
        lines.append(f"| {r.name} | {r.megabytes:,.1f} | {p:.4f} | {q:.4f} | {r.megabytes / p:,.0f} | "
                     f"{r.megabytes / q:,.0f} | {q / p:.2f} |")
    return "\n".join(lines)
