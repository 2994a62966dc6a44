"""``ragen-async bench cluster``: the real driver loop, admission gate, buffer and transport with N simulated
rollout actors, to see where the system stops scaling.

What is real and what stands in:

* **Real:** the driver loop (``orchestrator.Trainer``: collect, buffer, batch, filter, shards, provenance,
  metrics), the ``TrajectoryBuffer``, the ``AdmissionController`` (in its own process, as Ray's gate actor
  is), the rollout loop ``RolloutWorker.run`` of every actor (admission, concurrency, accounting), the codec
  (signing, validation) and ZeroMQ: every group is encoded by its actor and pushed through its own
  ``ZmqSender`` to the driver's ``ZmqReceiver``, which reads its header; every batch shard is built by the
  driver from the received frames and pushed to its learner rank, as ``RayRuntime.train`` does.
* **Stand-ins:** the engine (:class:`SimEngine`, continuous batching: any number of sequences decode at
  once, each token at the latency the real engine showed) and the agent/environment: an actor replays a
  group recorded on the real vLLM engine (``simprofile``: token counts, per-token latencies, agent time
  between turns, scores), so group durations, sizes and score spreads are the real ones; every sampled token
  is stamped with the weight version the actor's engine served when the token was due. Learner ranks receive
  their shards (bytes, not decoded) and the step takes ``learner_step_s``; a weight sync takes ``sync_s`` in
  every actor process before it acknowledges the new version.

Placement on one machine: the driver in this process; the gate, the learner pool and ``senders`` actor
processes (N actors as asyncio tasks, split evenly) spawned beside it. The data and control planes are
TCP loopback. The cluster scales weakly: ``groups_per_step = groups_per_actor x N`` and one learner rank per
``actors_per_rank`` actors, each rank's step taking the same time, so an ideal system's groups/s grow
linearly with N. A benchmark measures; nothing here asserts a speed.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import resource
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ragen_async.config import RunConfig
from ragen_async.experiments.simprofile import DEFAULT_PROFILE, Profile, load_profile
from ragen_async.inference.base import Generation, InferenceEngine, SamplingConfig
from ragen_async.learner.learner import TrainResult
from ragen_async.protocol import NO_VERSION, AnyGroup, BatchShard, Trajectory, TrajectoryGroup, TurnRecord
from ragen_async.rollout.worker import RolloutWorker, assign_group
from ragen_async.runtime import Admission, Runtime
from ragen_async.staleness import format_group_id
from ragen_async.transport import make_receiver, make_sender

SIM_VOCAB = 32_000
"""Token ids of simulated sequences are drawn below this (their values mean nothing)."""


# ---- the stand-in engine ---------------------------------------------------------------------


class VersionClock:
    """Which weight version an engine served from when (``time.monotonic`` seconds)."""

    def __init__(self, version: int = 0):
        self._times = [-math.inf]
        self._versions = [version]

    @property
    def current(self) -> int:
        return self._versions[-1]

    def switch(self, version: int, at: float) -> None:
        if version < self._versions[-1] or at < self._times[-1]:
            raise ValueError(f"versions and times only move forward ({self._versions[-1]} -> {version})")
        self._times.append(at)
        self._versions.append(version)

    def at(self, times: np.ndarray) -> np.ndarray:
        """The version served at each of ``times`` (int32)."""
        idx = np.searchsorted(np.asarray(self._times), times, side="right") - 1
        return np.asarray(self._versions, dtype=np.int32)[idx]


class SimEngine(InferenceEngine):
    """A stand-in for one vLLM engine under continuous batching: any number of sequences decode at once,
    each token taking the per-token latency the real engine showed (drawn from a :class:`Profile`). Every
    sampled token carries the version the engine served when it was due (:meth:`decode`), so weight updates
    in the middle of a reply split its versions as vLLM's do. There is no model: replies are random ids and
    log-probs, and ``prompt_logprobs`` is unavailable.
    """

    def __init__(self, profile: Profile, clock: VersionClock | None = None, seed: int = 0):
        self.clock = clock or VersionClock()
        self._turns = [(n, g / max(1, n)) for grp in profile.groups for e in grp
                       for n, g in zip(e.reply_tokens, e.generate_s, strict=True) if n > 0]
        self._rng = np.random.default_rng(seed)
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self.clock.current

    async def decode(self, token_times: np.ndarray) -> np.ndarray:
        """Wait until the last of ``token_times`` (monotonic seconds) has passed; the version of each."""
        if self._closed:
            raise RuntimeError("SimEngine is shut down")
        delay = float(token_times.max()) - time.monotonic() if token_times.size else 0.0
        if delay > 0:
            await asyncio.sleep(delay)
        return self.clock.at(token_times)

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        rng = np.random.default_rng(sampling.seed) if sampling.seed is not None else self._rng
        n, latency = self._turns[int(rng.integers(len(self._turns)))]
        n = min(n, sampling.max_tokens)
        times = time.monotonic() + latency * np.arange(1, n + 1)
        versions = await self.decode(times)
        ids = rng.integers(0, SIM_VOCAB, n).tolist()
        finish = "length"
        if sampling.stop_token_ids and n < sampling.max_tokens:
            ids[-1], finish = sampling.stop_token_ids[0], "stop"
        return Generation(token_ids=ids, logprobs=(-rng.random(n) * 3).tolist(), start_version=int(versions[0]),
                          end_version=int(versions[-1]), finish_reason=finish,
                          token_versions=[int(v) for v in versions])

    async def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        raise RuntimeError("the simulated cluster runs no model: prompt log-probs (the weight-sync probe) are not available "
                           "(weight_sync.verify_every=0)")

    async def load_state_dict(self, named_tensors, version: int) -> None:  # noqa: ANN001
        self.clock.switch(version, time.monotonic())

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    def shutdown(self) -> None:
        self._closed = True


# ---- simulated groups ------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeTemplate:
    """One recorded episode laid out as arrays once; groups share these read-only."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    sampled: np.ndarray
    """Positions of the sampled tokens."""
    token_offsets_s: np.ndarray
    """When each sampled token is due, in seconds after the episode starts."""
    turn_ends: np.ndarray
    """Cumulative sampled tokens at the end of each turn."""
    generate_s: tuple[float, ...]
    reply_tokens: tuple[int, ...]
    agent_s: float
    episode_s: float
    env_reward: float
    format_penalty: float
    success: bool


def episode_templates(profile: Profile, seed: int = 0) -> list[list[EpisodeTemplate]]:
    rng = np.random.default_rng(seed)
    out = []
    for grp in profile.groups:
        templates = []
        for e in grp:
            parts_mask, offsets, t = [np.zeros(e.prompt_tokens, np.int8)], [], 0.0
            for n, g, fb in zip(e.reply_tokens, e.generate_s, e.feedback_tokens, strict=True):
                parts_mask += [np.ones(n, np.int8), np.zeros(fb, np.int8)]
                offsets.append(t + g / max(1, n) * np.arange(1, n + 1))
                t += g + e.agent_s_per_turn
            mask = np.concatenate(parts_mask)
            sampled = np.flatnonzero(mask)
            logprobs = np.zeros(mask.size, np.float32)
            logprobs[sampled] = -rng.random(sampled.size, dtype=np.float32) * 3
            templates.append(EpisodeTemplate(
                token_ids=rng.integers(0, SIM_VOCAB, mask.size, dtype=np.int32), loss_mask=mask, logprobs=logprobs,
                sampled=sampled, token_offsets_s=np.concatenate(offsets) if offsets else np.zeros(0),
                turn_ends=np.cumsum(e.reply_tokens), generate_s=e.generate_s, reply_tokens=e.reply_tokens,
                agent_s=e.agent_s_per_turn, episode_s=e.episode_s, env_reward=e.env_reward,
                format_penalty=e.format_penalty, success=e.success))
        out.append(templates)
    return out


class SimRolloutWorker(RolloutWorker):
    """``RolloutWorker`` with its real ``run`` loop (admission, ``max_concurrent_groups``, busy and
    admission-wait accounting); :meth:`play_group` replays a recorded group on the :class:`SimEngine`
    instead of running the agent and the environment (no tokenizer, chat template or env is built)."""

    def __init__(self, cfg, engine: SimEngine, templates: list[list[EpisodeTemplate]],  # noqa: ANN001
                 worker_id: str = "w0"):
        self.cfg, self.engine, self.worker_id, self.templates = cfg, engine, worker_id, templates
        self.groups_played = 0
        self.busy_s = 0.0
        self.admission_wait_s = 0.0

    async def play_group(self, index: int) -> TrajectoryGroup:
        a = assign_group(index, self.cfg.rollout.envs, self.cfg.rollout.seed)  # the real index -> (env, seed)
        episodes = self.templates[int(np.random.default_rng(a.seed).integers(len(self.templates)))]
        created, t0 = time.time(), time.monotonic()
        versions = await self.engine.decode(np.concatenate([t0 + e.token_offsets_s for e in episodes]))
        group_id = format_group_id(index)
        trajs, at = [], 0
        for i, e in enumerate(episodes):
            v = versions[at:at + e.sampled.size]
            at += e.sampled.size
            token_versions = np.full(e.loss_mask.size, NO_VERSION, np.int32)
            token_versions[e.sampled] = v
            starts = np.concatenate([[0], e.turn_ends[:-1]])
            turns = tuple(TurnRecord(reward=e.env_reward if j == len(e.reply_tokens) - 1 else 0.0, actions=(),
                                     num_dropped_actions=0, format_ok=e.format_penalty == 0.0,
                                     policy_version=int(v[starts[j]]), end_policy_version=int(v[e.turn_ends[j] - 1]),
                                     response_tokens=n, generate_s=g, env_step_s=e.agent_s)
                          for j, (n, g) in enumerate(zip(e.reply_tokens, e.generate_s, strict=True)))
            trajs.append(Trajectory(traj_id=f"{group_id}/{i}", env_tag=a.env.tag, seed=a.seed, group_id=group_id,
                                    token_ids=e.token_ids, loss_mask=e.loss_mask, behaviour_logprobs=e.logprobs,
                                    token_versions=token_versions, turns=turns, format_penalty=e.format_penalty,
                                    success=e.success, timings={"episode_s": e.episode_s}))
        self.groups_played += 1
        return TrajectoryGroup(group_id=group_id, index=index, env_tag=a.env.tag, seed=a.seed,
                               trajectories=tuple(trajs), worker_id=self.worker_id, created_at=created,
                               finished_at=time.time())


# ---- control plane: a small JSON request/reply protocol over ZeroMQ --------------------------


class RpcClient:
    """Many concurrent requests over one DEALER socket (zmq.asyncio), matched to replies by id."""

    def __init__(self, ctx, address: str):  # noqa: ANN001 - a zmq.asyncio.Context
        import zmq

        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0
        self._reader: asyncio.Task | None = None

    async def call(self, op: str, **args: Any) -> Any:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid, self._next = self._next, self._next + 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        await self.sock.send(json.dumps({"id": rid, "op": op, **args}).encode())
        return await fut

    async def _read(self) -> None:
        while True:
            reply = json.loads(await self.sock.recv())
            fut = self._pending.pop(reply["id"])
            if "error" in reply:
                fut.set_exception(RuntimeError(reply["error"]))
            else:
                fut.set_result(reply["result"])

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close()


def _gate_main(k: int | None, groups_per_step: int, out) -> None:  # noqa: ANN001 - an mp.Queue
    """The admission gate's process: one ``AdmissionController`` behind a ROUTER socket."""
    import zmq

    from ragen_async.staleness import AdmissionController

    ctl = AdmissionController(k, groups_per_step)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    out.put(f"tcp://127.0.0.1:{port}")
    ops = {"admit": lambda r: ctl.try_admit(r["owner"]),
           "resolve": lambda r: ctl.resolve(r["consumed"], r["dropped"]),
           "publish": lambda r: ctl.set_published_version(r["version"]),
           "state": lambda r: ctl.state(),
           "set_k": lambda r: ctl.set_max_staleness(r["k"]),
           "restore": lambda r: ctl.restore(r["state"]),
           "cpu": lambda r: _cpu_s()}
    while True:
        ident, payload = sock.recv_multipart()
        req = json.loads(payload)
        try:
            reply = {"id": req["id"], "result": ops[req["op"]](req) if req["op"] != "stop" else None}
        except Exception as e:  # noqa: BLE001 - the caller gets the error and raises it
            reply = {"id": req["id"], "error": f"{type(e).__name__}: {e}"}
        sock.send_multipart([ident, json.dumps(reply).encode()])
        if req["op"] == "stop":
            sock.close(linger=1000)
            return


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _learner_main(ranks: int, step_s: float, hwm: int, out) -> None:  # noqa: ANN001 - an mp.Queue
    """The learner pool's stand-in: ``ranks`` PULL sockets take their shards (bytes counted, not decoded:
    that work belongs to the learner machines), then the step takes ``step_s`` and returns version + 1."""
    import zmq

    ctx = zmq.Context.instance()
    pulls = []
    for _ in range(ranks):
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVHWM, hwm)
        pulls.append((s, f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}"))
    ctl = ctx.socket(zmq.REP)
    out.put((f"tcp://127.0.0.1:{ctl.bind_to_random_port('tcp://127.0.0.1')}", [a for _, a in pulls]))
    poller = zmq.Poller()
    for s, _ in pulls:
        poller.register(s, zmq.POLLIN)
    got, nbytes, version = [0] * ranks, 0, 0

    def drain(timeout_ms: int) -> None:
        nonlocal nbytes
        for s, _ in dict(poller.poll(timeout_ms)).items():
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                got[[p for p, _ in pulls].index(s)] += 1
                nbytes += sum(len(f.buffer) for f in frames)

    while True:
        req = json.loads(ctl.recv())
        if req["op"] == "step":
            deadline = time.monotonic() + 300
            while min(got) < version + 1:  # every rank has its shard of this step
                if time.monotonic() > deadline:
                    raise RuntimeError(f"learner stand-in: shards of step {version} missing: {got}")
                drain(10)
            time.sleep(step_s)
            version += 1
            ctl.send(json.dumps({"version": version, "shard_bytes": nbytes}).encode())
        else:
            ctl.send(json.dumps({"version": version, "shard_bytes": nbytes, "cpu_s": _cpu_s()}).encode())
            return


# ---- the actor processes ---------------------------------------------------------------------


def _actors_main(spec: dict) -> None:
    asyncio.run(_actors(spec))


async def _actors(spec: dict) -> None:
    """One process playing ``spec["actors"]`` rollout actors as asyncio tasks, each with its own engine
    stand-in, ``SimRolloutWorker`` and ``ZmqSender``; all share this process's weight version."""
    import zmq
    import zmq.asyncio

    from ragen_async.config import RunConfig
    from ragen_async.transport import TransportTimeout, encode
    from ragen_async.transport.zmq_transport import ZmqSender

    cfg = RunConfig.model_validate(spec["cfg"])
    secret = bytes.fromhex(spec["secret"])
    ctx = zmq.asyncio.Context()
    control = ctx.socket(zmq.DEALER)
    control.setsockopt(zmq.LINGER, 1000)
    control.connect(spec["control"])
    gate = RpcClient(ctx, spec["gate"])
    profile = load_profile(Path(spec["profile"]))
    templates = episode_templates(profile, seed=spec["index"])
    clock = VersionClock(0)
    actors = [(SimRolloutWorker(cfg, SimEngine(profile, clock, seed=int(a[1:])), templates, worker_id=a),
               ZmqSender(spec["data"], secret, hwm=cfg.transport.high_water_mark)) for a in spec["actors"]]
    sent = dict.fromkeys(spec["actors"], 0)
    stop = False

    async def post(kind: str, **body: Any) -> None:
        await control.send(json.dumps({"kind": kind, "proc": spec["index"], **body}).encode())

    def stats() -> dict:
        return {w.worker_id: [w.busy_s, w.admission_wait_s, float(w.engine.policy_version), sent[w.worker_id]]
                for w, _ in actors}

    def make_send(worker_id: str, sender: ZmqSender):
        async def send(group: TrajectoryGroup) -> None:
            frames = encode(group, secret)  # once; a full pipe is retried with the same frames
            while True:
                try:
                    sender.send_frames(frames, timeout_s=0)
                    break
                except TransportTimeout:
                    await asyncio.sleep(0.005)  # this actor waits; the others in this process carry on
            sent[worker_id] += 1
        return send

    await post("hello")
    tasks: list[asyncio.Task] = []
    last_stats = 0.0
    try:
        while True:
            if await control.poll(100):
                msg = json.loads(await control.recv())
                if msg["op"] == "start":
                    for w, s in actors:
                        tasks.append(asyncio.create_task(w.run(lambda w=w: gate.call("admit", owner=w.worker_id),
                                                               make_send(w.worker_id, s), lambda: stop)))
                elif msg["op"] == "version":
                    await asyncio.sleep(msg["sync_s"])  # the weight transfer and load
                    clock.switch(msg["version"], time.monotonic())
                    await post("ack", version=msg["version"])
                elif msg["op"] == "stop":
                    break
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    await post("error", error=repr(t.exception()))
                    raise t.exception()
            if time.monotonic() - last_stats > 0.25:
                await post("stats", actors=stats(), cpu_s=_cpu_s())
                last_stats = time.monotonic()
    finally:
        stop = True
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for t in tasks:
            t.cancel()
        await post("final", actors=stats(), cpu_s=_cpu_s())
        gate.close()
        for _, s in actors:
            s.close()
        control.close()


# ---- the driver's runtime --------------------------------------------------------------------


@dataclass
class ClusterSpec:
    actors: int
    groups_per_actor: int = 4
    """Groups per learner step per actor: ``groups_per_step = groups_per_actor x actors``."""
    concurrent_groups: int = 4
    """Groups an actor plays at once (``rollout.max_concurrent_groups``)."""
    max_staleness: int = 1
    learner_step_s: float = 0.3
    actors_per_rank: int = 8
    sync_s: float = 0.007
    """A weight sync in every actor process (the tiny model's gloo sync, docs/benchmarks.md)."""
    senders: int = 2
    """Processes the actors are spread over."""
    profile: Path = DEFAULT_PROFILE

    @property
    def groups_per_step(self) -> int:
        return self.groups_per_actor * self.actors

    @property
    def ranks(self) -> int:
        return max(1, math.ceil(self.actors / self.actors_per_rank))


def cluster_config(spec: ClusterSpec, steps: int, run_root: Path, group_size: int) -> RunConfig:
    return RunConfig.model_validate({
        "name": f"simcluster-n{spec.actors}", "runtime": "ray", "total_steps": steps, "run_root": str(run_root),
        "rollout": {"envs": [{"tag": "SimpleSokoban", "n_groups": spec.groups_per_step}], "group_size": group_size,
                    "num_workers": spec.actors, "max_concurrent_groups": spec.concurrent_groups},
        "learner": {"num_ranks": spec.ranks},
        "staleness": {"max_staleness": spec.max_staleness},
        "validation": {"every": 0},
        "weight_sync": {"verify_every": 0},
        "logging": {"console": False, "wandb_mode": "disabled", "episodes_every": 0},
    })


class GateAdmission(Admission):
    """The loop's handle on the gate process (as ``RayAdmission`` is on the gate actor)."""

    def __init__(self, address: str):
        import zmq.asyncio

        self.address = address
        self.rpc = RpcClient(zmq.asyncio.Context.instance(), address)

    async def resolve(self, consumed: list[int], dropped: list[int]) -> None:
        await self.rpc.call("resolve", consumed=consumed, dropped=dropped)

    async def set_published_version(self, version: int) -> None:
        await self.rpc.call("publish", version=version)

    async def state(self) -> dict[str, Any]:
        return await self.rpc.call("state")

    async def set_max_staleness(self, k: int) -> None:
        await self.rpc.call("set_k", k=k)

    async def restore(self, state: dict[str, Any]) -> None:
        await self.rpc.call("restore", state=state)


def _sync_call(address: str, op: str, timeout_s: float = 5.0) -> Any:
    """One request to a ROUTER (gate) from a fresh socket, outside any event loop."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(json.dumps({"id": -1, "op": op}).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply from {address} to {op!r}")
        return json.loads(sock.recv()).get("result")
    finally:
        sock.close()


class SimRuntime(Runtime):
    """The runtime the loop drives on a simulated cluster; see the module docstring for what runs where."""

    BUFFER_SAMPLE_S = 0.25
    """How often ``receive`` samples the bytes the trajectory buffer holds."""

    def __init__(self, cfg: RunConfig, spec: ClusterSpec):
        self.cfg, self.spec = cfg, spec
        self.procs: list[Any] = []
        self.peers: dict[int, bytes] = {}
        self.buffer_probe: Callable[[], tuple[int, int]] | None = None
        """Set by the caller: (bytes, groups) the trajectory buffer holds."""
        self.buffer_samples: list[tuple[float, int, int]] = []
        self._last_sample = 0.0
        self.actor_ids = [f"w{i}" for i in range(spec.actors)]
        self.stats: dict[str, list] = {a: [0.0, 0.0, 0.0, 0] for a in self.actor_ids}
        """Per actor, cumulative: busy_s, admission_wait_s, engine version, groups sent (pushed by its process)."""
        self.sender_cpu: dict[int, float] = {}
        self.final: dict[int, dict] = {}
        self.learner_reply: dict = {}
        self.receiver = self.control = self.learner = self.admission = None
        self.shard_senders: list[Any] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _spawn(self, target: Callable, *args: Any) -> None:
        p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)

    def _build(self) -> None:
        import zmq

        cfg, spec = self.cfg, self.spec
        ctx = mp.get_context("spawn")
        secret = secrets.token_bytes(32)
        self.receiver = make_receiver("zmq", "tcp://127.0.0.1:*", secret, hwm=cfg.transport.high_water_mark,
                                      expected=TrajectoryGroup,
                                      max_message_bytes=int(cfg.transport.max_message_mb * 2**20))
        q_gate, q_learner = ctx.Queue(), ctx.Queue()
        self._spawn(_gate_main, spec.max_staleness, spec.groups_per_step, q_gate)
        self._spawn(_learner_main, spec.ranks, spec.learner_step_s, 2, q_learner)
        zctx = zmq.Context.instance()
        self.control = zctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        control_addr = f"tcp://127.0.0.1:{self.control.bind_to_random_port('tcp://127.0.0.1')}"
        gate_addr = q_gate.get(timeout=120)
        learner_ctl, shard_addrs = q_learner.get(timeout=120)
        self.admission = GateAdmission(gate_addr)
        self.learner = zctx.socket(zmq.REQ)
        self.learner.setsockopt(zmq.LINGER, 0)
        self.learner.connect(learner_ctl)
        self.shard_senders = [make_sender("zmq", a, secret, hwm=2, send_timeout_s=cfg.transport.send_timeout_s)
                              for a in shard_addrs]
        n_proc = min(spec.senders, spec.actors)
        for i in range(n_proc):
            self._spawn(_actors_main, {"index": i, "actors": self.actor_ids[i::n_proc],
                                       "cfg": cfg.model_dump(mode="json"), "secret": secret.hex(),
                                       "profile": str(spec.profile), "data": self.receiver.address,
                                       "control": control_addr, "gate": gate_addr})
        deadline = time.monotonic() + 180
        while len(self.peers) < n_proc:
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in self.procs):
                raise RuntimeError("the simulated actor processes did not start")
            self.poll_control(0.1)

    def poll_control(self, timeout_s: float) -> list[dict]:
        """Handle every control message waiting (waiting up to ``timeout_s`` for the first); returns the acks."""
        acks = []
        while self.control.poll(int(timeout_s * 1000)):
            timeout_s = 0
            ident, payload = self.control.recv_multipart()
            msg = json.loads(payload)
            proc = msg["proc"]
            if msg["kind"] == "hello":
                self.peers[proc] = ident
            elif msg["kind"] == "ack":
                acks.append(msg)
            elif msg["kind"] in ("stats", "final"):
                self.stats.update(msg["actors"])
                self.sender_cpu[proc] = msg["cpu_s"]
                if msg["kind"] == "final":
                    self.final[proc] = msg
            elif msg["kind"] == "error":
                raise RuntimeError(f"simulated actor process {proc} failed: {msg['error']}")
        return acks

    def _tell(self, **msg: Any) -> None:
        for ident in self.peers.values():
            self.control.send_multipart([ident, json.dumps(msg).encode()])

    async def start(self) -> None:
        self._tell(op="start")

    async def receive(self, timeout_s: float) -> AnyGroup | None:
        now = time.perf_counter()
        if self.buffer_probe is not None and now - self._last_sample > self.BUFFER_SAMPLE_S:
            self.buffer_samples.append((now, *self.buffer_probe()))
            self._last_sample = now
        return self.receiver.receive(timeout_s)  # blocks the loop briefly, as RayRuntime.receive does

    async def train(self, shards: list[BatchShard]) -> TrainResult:
        for sender, shard in zip(self.shard_senders, shards, strict=True):
            sender.send(shard)
        self.learner.send(b'{"op": "step"}')
        if not self.learner.poll(int((self.spec.learner_step_s + 300) * 1000)):
            raise RuntimeError("the learner stand-in did not answer")
        self.learner_reply = json.loads(self.learner.recv())
        metrics = self.receiver.stats.as_metrics("transport")
        metrics["transport/shard_bytes"] = float(self.learner_reply["shard_bytes"])
        return TrainResult(int(self.learner_reply["version"]), metrics)

    async def publish(self, version: int) -> None:
        """Every actor process loads ``version`` (after ``sync_s``) and acknowledges: only then does the loop
        open admission for it, as after a real broadcast."""
        self._tell(op="version", version=version, sync_s=self.spec.sync_s)
        acked: set[int] = set()
        deadline = time.monotonic() + 120
        while len(acked) < len(self.peers):
            acked |= {a["proc"] for a in self.poll_control(0) if a["version"] == version}
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated weight sync of version {version}: no ack from "
                                   f"{sorted(set(self.peers) - acked)}")
            if len(acked) < len(self.peers):
                await asyncio.sleep(0.0005)

    async def probe(self, token_ids: list[int]) -> tuple[list[float], list[list[float]]]:
        raise RuntimeError("the simulated cluster has no weights to probe (weight_sync.verify_every=0)")

    async def validate(self) -> dict[str, float]:
        raise RuntimeError("the simulated cluster has no policy to validate (validation.every=0)")

    async def rollout_stats(self) -> list[dict[str, float]]:
        self.poll_control(0)
        return [{"busy_s": s[0], "admission_wait_s": s[1], "policy_version": s[2]}
                for s in (self.stats[a] for a in self.actor_ids)]

    async def save(self, path: Path, step: int) -> None:
        (path / "simulated.json").write_text(json.dumps({"step": step, "note": "a simulated learner has no state"}))

    async def load(self, path: Path) -> int:
        raise RuntimeError("a simulated cluster cannot resume")

    @property
    def vocab_size(self) -> int:
        return SIM_VOCAB

    def close(self) -> None:
        if self.peers:
            self._tell(op="stop")
            deadline = time.monotonic() + 20
            while len(self.final) < len(self.peers) and time.monotonic() < deadline:
                try:
                    self.poll_control(0.1)
                except RuntimeError:
                    break
            self.peers = {}
        if self.learner is not None:
            self.learner.send(b'{"op": "stop"}')
            if self.learner.poll(5000):
                self.learner_reply = json.loads(self.learner.recv())
            self.learner.close()
            self.learner = None
        if self.admission is not None:
            try:
                _sync_call(self.admission.address, "stop")
            except TimeoutError:
                pass
            self.admission.rpc.close()
            self.admission = None
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for s in self.shard_senders:
            s.close()
        for sock in (self.receiver, self.control):
            if sock is not None:
                sock.close()
        self.receiver = self.control = None


# ---- one run, a sweep, the table -------------------------------------------------------------


@dataclass
class ClusterRow:
    actors: int
    groups_per_step: int
    ranks: int
    steps: int
    wall_s: float
    groups_per_s: float
    driver_cpu: float
    """Driver process CPU seconds per wall second over the measured steps (1.0 = one core)."""
    sender_cpu: float
    """The actor processes' CPU seconds per wall second (all of them together)."""
    machine_busy: float
    """Busy cores of the whole machine (every process, ours or not) over the measured steps."""
    buffer_mb_mean: float
    buffer_mb_max: float
    buffer_groups_max: int
    admission_wait: float
    """Mean share of an actor's time spent idle because admission said wait (``RolloutWorker.admission_wait_s``)."""
    rollout_idle: float
    refusals: int
    staleness_max: float
    dropped: int
    collect_s: float
    """Mean seconds per step the loop spent collecting its batch."""
    train_s: float
    publish_s: float
    driver_rss_mb: float
    consumed: int
    admitted: int
    records: list[dict] = field(default_factory=list, repr=False)


def _proc_stat_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (``/proc/stat``)."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def run_cluster(spec: ClusterSpec, steps: int = 10, warmup: int = 3) -> ClusterRow:
    """The real loop on a simulated cluster for ``warmup + steps`` learner steps; rates over the last ``steps``."""
    from ragen_async.metrics import MetricsSink
    from ragen_async.orchestrator import Trainer
    from ragen_async.rundir import RunDir

    profile = load_profile(spec.profile)
    group_size = len(profile.groups[0])
    with tempfile.TemporaryDirectory(prefix="simcluster-") as tmp:
        cfg = cluster_config(spec, warmup + steps, Path(tmp), group_size)
        marks: list[tuple[float, float, float, float, float]] = []
        records: list[dict] = []
        runtime = SimRuntime(cfg, spec)

        class Sink(MetricsSink):
            def log(self, record) -> None:  # noqa: ANN001
                if "timing/step_s" not in record:
                    return
                records.append(dict(record))
                if int(record["learner/step"]) in (warmup, warmup + steps):
                    busy, _ = _proc_stat_busy()
                    runtime.poll_control(0)
                    marks.append((time.perf_counter(), _cpu_s(), sum(runtime.sender_cpu.values()), busy,
                                  time.monotonic()))

        trainer = Trainer(cfg, RunDir.create(cfg), Sink(), runtime)

        runtime.buffer_probe = lambda: (trainer.buffer.nbytes, len(trainer.buffer))

        async def main() -> dict:
            await trainer.run()
            return await runtime.admission.state()

        try:
            admission = asyncio.run(main())
        finally:
            trainer.close()
            runtime.close()
    (t0, c0, s0, b0, _), (t1, c1, s1, b1, _) = marks[0], marks[-1]
    wall = t1 - t0
    hz = os.sysconf("SC_CLK_TCK")
    measured = records[warmup:]
    samples = [(b, g) for t, b, g in runtime.buffer_samples if t0 <= t <= t1] or [(0, 0)]
    return ClusterRow(
        actors=spec.actors, groups_per_step=spec.groups_per_step, ranks=spec.ranks, steps=len(measured),
        wall_s=wall, groups_per_s=spec.groups_per_step * len(measured) / wall,
        driver_cpu=(c1 - c0) / wall, sender_cpu=(s1 - s0) / wall, machine_busy=(b1 - b0) / hz / wall,
        buffer_mb_mean=float(np.mean([b for b, _ in samples])) / 1e6,
        buffer_mb_max=max(b for b, _ in samples) / 1e6, buffer_groups_max=max(g for _, g in samples),
        admission_wait=float(sum(r["staleness/admission_wait_s"] for r in measured)) / wall,
        rollout_idle=float(np.mean([r["rollout/idle_frac"] for r in measured])),
        refusals=int(admission["refusals"]),
        staleness_max=max(r["staleness/max"] for r in measured),
        dropped=int(admission["dropped"]),
        collect_s=float(np.mean([r["timing/wait_batch_s"] for r in measured])),
        train_s=float(np.mean([r["timing/train_s"] for r in measured])),
        publish_s=float(np.mean([r["weight_sync/time_s"] for r in measured])),
        driver_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        consumed=int(admission["consumed"]), admitted=int(admission["next_index"]), records=records)


def linear_ratios(rows: list[ClusterRow]) -> list[float]:
    """groups/s of each row over linear scaling from the smallest N of the same sweep."""
    base = min(rows, key=lambda r: r.actors)
    per_actor = base.groups_per_s / base.actors
    return [r.groups_per_s / (per_actor * r.actors) for r in rows]


def knee(rows: list[ClusterRow], threshold: float = 0.8) -> tuple[int | None, int | None]:
    """(the largest N up to which every ratio to linear is >= threshold, the first N below it or None)."""
    last_ok, first_bad = None, None
    for r, ratio in sorted(zip(rows, linear_ratios(rows), strict=True), key=lambda x: x[0].actors):
        if ratio < threshold:
            first_bad = r.actors
            break
        last_ok = r.actors
    return last_ok, first_bad


def format_cluster(rows: list[ClusterRow]) -> str:
    lines = ["| N actors | groups/step | learner ranks | groups/s | ratio to linear | driver CPU (cores) | "
             "actor processes CPU | machine busy (cores, all processes) | buffer MB mean / max (groups max) | "
             "admission wait (share of actor time) | admission refusals | per step: collect / train / publish s | "
             "max staleness | dropped |", "|" + "---|" * 14]
    for r, ratio in zip(rows, linear_ratios(rows), strict=True):
        lines.append(
            f"| {r.actors} | {r.groups_per_step} | {r.ranks} | {r.groups_per_s:.1f} | {ratio:.2f} | "
            f"{r.driver_cpu:.2f} | {r.sender_cpu:.2f} | {r.machine_busy:.2f} | {r.buffer_mb_mean:.1f} / "
            f"{r.buffer_mb_max:.1f} ({r.buffer_groups_max}) | {r.admission_wait:.2f} | {r.refusals} | "
            f"{r.collect_s:.2f} / {r.train_s:.2f} / {r.publish_s:.3f} | {r.staleness_max:.0f} | {r.dropped} |")
    ok, bad = knee(rows)
    lines.append("")
    if bad is None:
        lines.append(f"scaling stays >= 0.8 x linear up to N = {ok}, the largest N run: no knee in this range")
    else:
        lines.append(f"scaling >= 0.8 x linear up to N = {ok}; below it from N = {bad}")
    return "\n".join(lines)


def bench_cluster(ns: list[int], steps: int, warmup: int, **spec: Any) -> list[ClusterRow]:
    return [run_cluster(ClusterSpec(actors=n, **spec), steps, warmup) for n in sorted(ns)]
