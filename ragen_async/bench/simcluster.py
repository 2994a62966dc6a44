"""``ragen-async bench cluster``: the real driver loop, admission gate, buffer and transport with N simulated
rollout actors, to see where the system stops scaling.

What is real and what stands in:

* **Real:** the driver loop (``orchestrator.Trainer``: collect, buffer, batch, filter, shards, provenance,
  metrics), the ``TrajectoryBuffer``, the runtime (:class:`SimRuntime` is ``RayRuntime``: its receiver,
  health checks, shard sending, broadcast and shutdown run unchanged), the **control plane**: the run's
  admission gate is the production Ray actor (``GateActor``, opened by ``RayRuntime._open_planes``) and
  every simulated actor asks it for groups with the production call (``await gate.admit.remote(worker_id, n,
  ADMIT_WAIT_S)``), while the loop resolves, publishes and reads state through
  ``RayAdmission``; the rollout loop ``RolloutWorker.run`` of every actor (admission, concurrency,
  accounting); the codec (signing, validation) and ZeroMQ: every group is encoded by its actor and pushed
  through its own sender to the driver's receiver; every batch shard is pushed to its learner rank.
* **Stand-ins:** the engine (:class:`SimEngine`, continuous batching: any number of sequences decode at
  once, each token at the latency the real engine showed) and the agent/environment: an actor replays a
  group recorded on the real vLLM engine (``simprofile``: token counts, per-token latencies, agent time
  between turns, scores), so group durations, sizes and score spreads are the real ones; every sampled token
  is stamped with the weight version the actor's engine served when the token was due. The learner ranks
  (:class:`SimLearner`, one Ray actor) receive their shards (bytes, not decoded) and a step takes
  ``learner_step_s``; a weight sync takes ``sync_s`` in every actor host before it acknowledges the version.

Placement on one machine (a local Ray): the driver in this process; the gate actor, the learner stand-in and
``senders`` actor hosts (:class:`ActorHost`, N simulated actors as asyncio tasks, split evenly: 128 Ray actor
processes would not fit in 24 GiB). The data plane is TCP loopback, the control plane Ray's. Each host
counts every admission call and what it got (the gate's admission rate), and times a no-op call to the gate
every 50 ms (its responsiveness under that load: an admission call may wait for a slot, so its own
duration is not the gate's latency). The cluster scales
weakly: ``groups_per_step = groups_per_actor x N`` and one learner rank per ``actors_per_rank`` actors, each
rank's step taking the same time, so an ideal system's groups/s grow linearly with N. A benchmark
measures; nothing here asserts a speed.

Its length (over the project's ~600 lines per module): the stand-ins (engine, actor host, learner) and the
simulated runtime speak one simulated protocol and are read together; each piece is used only here.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from ragen_async.bench.cputime import process_cpu_s
from ragen_async.bench.simprofile import DEFAULT_PROFILE, Profile, load_profile
from ragen_async.config import RunConfig
from ragen_async.inference.base import Generation, InferenceEngine, SamplingConfig
from ragen_async.learner.learner import TrainResult
from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup, TurnRecord
from ragen_async.rollout.actor import ADMIT_WAIT_S
from ragen_async.rollout.worker import RolloutWorker, assign_group
from ragen_async.runtime.ray_runtime import RayRuntime
from ragen_async.staleness.ids import format_group_id
from ragen_async.transport import TransportTimeout, encode, make_sender

ADMISSIONS = ("wait", "poll")
"""Admission protocols the simulated actors can use (``ClusterSpec.admission``)."""

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
                           "(weight_sync.verify_first=false, verify_every=0)")

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
                 worker_id: str = "w0", speed: float = 1.0):
        self.cfg, self.engine, self.worker_id, self.templates = cfg, engine, worker_id, templates
        self.speed = speed
        """How many times faster than the recorded one this engine plays a group (its whole timeline)."""
        self.groups_played = 0
        self.busy_s = 0.0
        self.admission_wait_s = 0.0

    async def play_group(self, index: int) -> TrajectoryGroup:
        a = assign_group(index, self.cfg.rollout.envs, self.cfg.rollout.seed)  # the real index -> (env, seed)
        episodes = self.templates[int(np.random.default_rng(a.seed).integers(len(self.templates)))]
        created, t0 = time.time(), time.monotonic()
        versions = await self.engine.decode(np.concatenate([t0 + e.token_offsets_s / self.speed
                                                                   for e in episodes]))
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


# ---- the stand-in rollout actors and learner, as Ray actors -----------------------------------


class ActorHost:
    """Several simulated rollout actors in one Ray actor process (128 processes of their own would not fit
    in this machine's memory). Each is a :class:`SimRolloutWorker` running the real rollout loop with its
    own engine stand-in and ``ZmqSender``, and asks the run's admission gate actor for groups with the call a
    production rollout actor makes (``RolloutActor._admit``); the host records each of those calls and times a
    no-op gate call every ``PING_S``. The hosts answer the runtime's calls that ``RolloutActor`` answers
    (``start``, ``check``, ``receive_weights``, ``shutdown``); ``stats`` gives one entry per simulated actor."""

    PING_S = 0.05
    """How often the host times a no-op call to the gate."""

    def __init__(self, cfg_data: dict, worker_ids: list[str], buffer_address: str, secret: bytes, gate: Any,
                 profile: str, index: int, sync_s: float, speed: float = 1.0, admission: str = "wait"):
        self.cfg = RunConfig.model_validate(cfg_data)
        self.secret, self.gate, self.sync_s, self.admission = secret, gate, sync_s, admission
        self.profile = load_profile(Path(profile))
        templates = episode_templates(self.profile, seed=index)
        self.clock = VersionClock(0)
        self.workers = [SimRolloutWorker(self.cfg, SimEngine(self.profile, self.clock, seed=int(w[1:])), templates,
                                         worker_id=w, speed=speed) for w in worker_ids]
        self.senders = [make_sender(self.cfg.transport.kind, buffer_address, secret,
                                    hwm=self.cfg.transport.high_water_mark) for _ in worker_ids]
        self.sent = [0] * len(worker_ids)
        self.calls: list[tuple[float, float, int]] = []
        """Per admission call: (monotonic start, seconds until the answer, indices it got)."""
        self.pings: list[tuple[float, float]] = []
        """Per ``gate.ping`` call: (monotonic start, round trip s)."""
        self._stop = False
        self._tasks: list[asyncio.Task] = []
        self._started_at = 0.0

    def pid(self) -> int:
        return os.getpid()

    def _admit(self, worker_id: str) -> Callable[[int], Any]:
        async def admit(n: int) -> list[int]:
            t0 = time.monotonic()
            if self.admission == "wait":
                got = await self.gate.admit.remote(worker_id, n, ADMIT_WAIT_S)
            else:  # "poll": one at a time, at once; the loop asks again a tick after an empty answer
                index = await self.gate.try_admit.remote(worker_id)
                got = [] if index is None else [index]
            self.calls.append((t0, time.monotonic() - t0, len(got)))
            return got
        return admit

    async def _ping(self) -> None:
        while not self._stop:
            t0 = time.monotonic()
            await self.gate.ping.remote()
            self.pings.append((t0, time.monotonic() - t0))
            await asyncio.sleep(self.PING_S)

    def _send(self, i: int) -> Callable[[TrajectoryGroup], Any]:
        async def send(group: TrajectoryGroup) -> None:
            frames = encode(group, self.secret)  # once; a full pipe is retried with the same frames
            while True:
                try:
                    self.senders[i].send_frames(frames, timeout_s=0)
                    break
                except TransportTimeout:
                    await asyncio.sleep(0.005)  # this actor waits; the others in this process carry on
            self.sent[i] += 1
        return send

    async def start(self) -> None:
        self._started_at = time.perf_counter()
        self._tasks = [asyncio.create_task(w.run(self._admit(w.worker_id), self._send(i), lambda: self._stop))
                       for i, w in enumerate(self.workers)] + [asyncio.create_task(self._ping())]

    async def check(self) -> None:
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def stats(self) -> list[dict[str, float]]:
        elapsed = time.perf_counter() - self._started_at if self._started_at else 0.0
        return [{"busy_s": w.busy_s, "admission_wait_s": w.admission_wait_s, "elapsed_s": elapsed,
                 "groups_sent": float(n), "policy_version": float(self.clock.current)}
                for w, n in zip(self.workers, self.sent, strict=True)]

    async def receive_weights(self, ticket: dict) -> dict:
        """The weight transfer and load take ``sync_s``; then every engine stand-in here serves the version."""
        t0 = time.perf_counter()
        await asyncio.sleep(self.sync_s)
        self.clock.switch(int(ticket["version"]), time.monotonic())
        return {"receive_s": time.perf_counter() - t0}

    async def admission_calls(self) -> tuple[np.ndarray, np.ndarray]:
        """Every admission call so far as rows of (start, duration s, indices got), every ping as (start, s)."""
        return (np.asarray(self.calls, dtype=np.float64).reshape(-1, 3),
                np.asarray(self.pings, dtype=np.float64).reshape(-1, 2))

    async def stop(self) -> None:
        """Stop every rollout loop (each finishes the admission call it is in)."""
        self._stop = True
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)
        for t in self._tasks:
            t.cancel()

    async def shutdown(self) -> None:
        await self.stop()
        for s in self.senders:
            s.close()
        self.senders = []


class SimLearner:
    """The learner pool's stand-in, all ranks in one Ray actor: one PULL socket per rank takes that rank's
    shard of each step (bytes counted, not decoded: that work belongs to the learner machines), then the
    step takes ``step_s`` and returns version + 1. It answers the runtime's learner calls (``train_step``,
    ``weight_ticket``, ``publish``, ``shutdown``); the hosts' ``receive_weights`` does the sync's work."""

    def __init__(self, ranks: int, step_s: float, hwm: int = 2):
        import zmq

        self.zmq, self.step_s = zmq, step_s
        ctx = zmq.Context.instance()
        self.pulls = []
        for _ in range(ranks):
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.RCVHWM, hwm)
            self.pulls.append((sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"))
        self.poller = zmq.Poller()
        for sock, _ in self.pulls:
            self.poller.register(sock, zmq.POLLIN)
        self.got, self.nbytes, self.version = [0] * ranks, 0, 0

    def pid(self) -> int:
        return os.getpid()

    def shard_addresses(self) -> list[str]:
        return [a for _, a in self.pulls]

    def train_step(self) -> TrainResult:
        deadline = time.monotonic() + 300
        socks = [s for s, _ in self.pulls]
        while min(self.got) < self.version + 1:  # every rank has its shard of this step
            if time.monotonic() > deadline:
                raise RuntimeError(f"learner stand-in: shards of step {self.version} missing: {self.got}")
            for sock in dict(self.poller.poll(10)):
                while True:
                    try:
                        frames = sock.recv_multipart(self.zmq.NOBLOCK, copy=False)
                    except self.zmq.Again:
                        break
                    self.got[socks.index(sock)] += 1
                    self.nbytes += sum(len(f.buffer) for f in frames)
        time.sleep(self.step_s)
        self.version += 1
        return TrainResult(self.version, {"transport/shard_bytes": float(self.nbytes)})

    def weight_ticket(self, version: int) -> dict:
        return {"version": version}

    def publish(self, version: int) -> None:
        """Rank 0's side of a sync: nothing to send, the hosts' ``receive_weights`` takes ``sync_s``."""

    def shutdown(self) -> None:
        for sock, _ in self.pulls:
            sock.close(linger=0)


# ---- the driver's runtime: RayRuntime with the stand-ins -------------------------------------


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
    """A weight sync in every actor host (the tiny model's gloo sync, docs/benchmarks.md)."""
    senders: int = 2
    """Ray actor processes the simulated actors are spread over."""
    profile: Path = DEFAULT_PROFILE
    engine_speed: float = 1.0
    """Each stand-in engine plays a group this many times faster than the profile's engine (a faster engine,
    e.g. a GPU's, raises the group rate and with it the load on the gate at the same N)."""
    admission: str = "wait"
    """How the actors ask the gate. ``wait``: the production protocol (``RolloutActor._admit``: up to the free
    slots per call, a blocked request waits at the gate for a slot). ``poll``: the earlier protocol,
    for comparison: one ``gate.try_admit`` per group, answered at once, a refused actor asking again 50 ms
    (one rollout-loop tick) later."""

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, not {self.admission!r}")

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
        "weight_sync": {"verify_first": False, "verify_every": 0},
        "logging": {"console": False, "wandb_mode": "disabled", "episodes_every": 0},
    })


class SimRuntime(RayRuntime):
    """``RayRuntime`` with stand-in actors: the production receiver and admission gate actor
    (``RayRuntime._open_planes``), ``receive`` with its health checks, ``train`` (shards over ZeroMQ to the
    ranks), ``publish`` and its broadcast (every host acknowledges the version before the loop opens
    admission for it) and ``close`` all run unchanged; only what sits behind the actor handles stands in."""

    BUFFER_SAMPLE_S = 0.25
    """How often ``receive`` samples the bytes the trajectory buffer holds."""

    def __init__(self, cfg: RunConfig, spec: ClusterSpec, log_dir: Path | None = None):
        self.spec = spec
        self.hosts: list[Any] = []
        self.buffer_probe: Callable[[], tuple[int, int]] | None = None
        """Set by the caller: (bytes, groups) the trajectory buffer holds."""
        self.buffer_samples: list[tuple[float, int, int]] = []
        self._last_sample = 0.0
        super().__init__(cfg, log_dir)

    def _build(self) -> None:
        cfg, spec = self.cfg, self.spec
        self.weight_backend = "simulated"
        secret = self._open_planes()
        host = ray.remote(ActorHost).options(num_cpus=0, max_concurrency=1000)
        ids = [f"w{i}" for i in range(spec.actors)]
        n_proc = min(spec.senders, spec.actors)
        data = cfg.model_dump(mode="json")
        self.rollouts = self.hosts = [host.remote(data, ids[i::n_proc], self.receiver.address, secret, self.gate,
                                                  str(spec.profile), i, spec.sync_s, spec.engine_speed,
                                                  spec.admission)
                                             for i in range(n_proc)]
        self.learners = [ray.remote(SimLearner).options(num_cpus=0).remote(spec.ranks, spec.learner_step_s)]
        self.shard_senders = [make_sender("zmq", a, secret, hwm=2, send_timeout_s=cfg.transport.send_timeout_s)
                              for a in ray.get(self.learners[0].shard_addresses.remote())]
        self.pids = {"gate": ray.get(self.gate.__ray_call__.remote(lambda _: os.getpid())),
                     "learner": ray.get(self.learners[0].pid.remote()),
                     "hosts": ray.get([h.pid.remote() for h in self.hosts])}
        self._vocab_size = SIM_VOCAB

    async def receive(self, timeout_s: float) -> TrajectoryGroup | None:
        now = time.perf_counter()
        if self.buffer_probe is not None and now - self._last_sample > self.BUFFER_SAMPLE_S:
            self.buffer_samples.append((now, *self.buffer_probe()))
            self._last_sample = now
        return await super().receive(timeout_s)

    async def rollout_stats(self) -> list[dict[str, float]]:
        """One entry per simulated actor (a host reports all of its own)."""
        return [s for per_host in await asyncio.gather(*[h.stats.remote() for h in self.hosts]) for s in per_host]

    def cpu_s(self) -> tuple[float, float, float]:
        """CPU seconds so far of (the gate actor, the actor hosts together, the learner stand-in)."""
        return (process_cpu_s(self.pids["gate"]), sum(process_cpu_s(p) for p in self.pids["hosts"]),
                process_cpu_s(self.pids["learner"]))

    def admission_calls(self) -> tuple[np.ndarray, np.ndarray]:
        """Every host's admission calls (monotonic start, duration s, indices got) and pings (start, s)."""
        per_host = ray.get([h.admission_calls.remote() for h in self.hosts])
        return np.concatenate([c for c, _ in per_host]), np.concatenate([p for _, p in per_host])

    async def probe(self, token_ids: list[int], version: int) -> tuple[list[float], list[list[float]]]:
        raise RuntimeError("the simulated cluster has no weights to probe (weight_sync.verify_first=false, verify_every=0)")

    async def served_weights(self) -> list[tuple[int, list]]:
        raise RuntimeError("the simulated cluster has no weights to check (weight_sync.verify_first=false, verify_every=0)")

    async def published_digests(self, version: int, needed: list[tuple[str, str]]) -> dict:
        raise RuntimeError("the simulated cluster has no weights to check (weight_sync.verify_first=false, verify_every=0)")

    async def validate(self) -> dict[str, float]:
        raise RuntimeError("the simulated cluster has no policy to validate (validation.every=0)")

    async def save(self, path: Path, step: int) -> None:
        (path / "simulated.json").write_text(json.dumps({"step": step, "note": "a simulated learner has no state"}))

    async def load(self, path: Path) -> int:
        raise RuntimeError("a simulated cluster cannot resume")


# ---- one run, a sweep, the table -------------------------------------------------------------


@dataclass
class ClusterRow:
    actors: int
    admission: str
    """The admission protocol (``ClusterSpec.admission``)."""
    groups_per_step: int
    ranks: int
    steps: int
    wall_s: float
    groups_per_s: float
    admissions_per_s: float
    """Groups the gate admitted per second over the measured steps (indices the admission calls got)."""
    gate_calls_per_s: float
    """Admission calls per second, answered with indices or with none."""
    gate_p50_ms: float
    gate_p99_ms: float
    """Round trip of a no-op gate call (``gate.ping``) from the actor hosts: how long any call waits for the
    gate under this load."""
    gate_cpu: float
    """The gate actor's CPU seconds per wall second (1.0 = one core: saturated)."""
    driver_cpu: float
    """Driver process CPU seconds per wall second over the measured steps (1.0 = one core)."""
    sender_cpu: float
    """The actor hosts' CPU seconds per wall second (all of them together)."""
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
    """Indices the gate handed out in the whole run (its own count)."""
    calls_admitted: int
    """Indices the hosts' admission calls got in the whole run (their own count)."""
    calls_empty: int
    """The hosts' admission calls in the whole run that came back with none."""
    records: list[dict] = field(default_factory=list, repr=False)

    @property
    def gate_capacity(self) -> float:
        """Admissions per second the gate actor would serve with one core to itself, at its measured CPU per
        admission (calls, empty answers and pings included)."""
        return self.admissions_per_s / self.gate_cpu if self.gate_cpu > 0 else math.inf


def _proc_stat_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (``/proc/stat``)."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def run_cluster(spec: ClusterSpec, steps: int = 10, warmup: int = 3) -> ClusterRow:
    """The real loop on a simulated cluster for ``warmup + steps`` learner steps; rates over the last ``steps``."""
    from ragen_async.orchestrator import Trainer
    from ragen_async.records.metrics import MetricsSink
    from ragen_async.records.rundir import RunDir

    profile = load_profile(spec.profile)
    group_size = len(profile.groups[0])
    with tempfile.TemporaryDirectory(prefix="simcluster-") as tmp:
        cfg = cluster_config(spec, warmup + steps, Path(tmp), group_size)
        marks: list[tuple[float, ...]] = []
        records: list[dict] = []
        runtime = SimRuntime(cfg, spec, log_dir=Path(tmp))

        class Sink(MetricsSink):
            def log(self, record) -> None:  # noqa: ANN001
                if "timing/step_s" not in record:
                    return
                records.append(dict(record))
                if int(record["learner/step"]) in (warmup, warmup + steps):
                    busy, _ = _proc_stat_busy()
                    marks.append((time.perf_counter(), process_cpu_s(), *runtime.cpu_s(), busy, time.monotonic()))

        try:
            trainer = Trainer(cfg, RunDir.create(cfg), Sink(), runtime)
            runtime.buffer_probe = lambda: (trainer.buffer.nbytes, len(trainer.buffer))

            async def main() -> dict:
                await trainer.run()
                await asyncio.gather(*[h.stop.remote() for h in runtime.hosts])  # no call after the gate's count
                return await runtime.admission.state()

            try:
                admission = asyncio.run(main())
                calls, pings = runtime.admission_calls()
            finally:
                trainer.close()
        finally:
            runtime.close()
    (t0, c0, g0, s0, _, b0, m0), (t1, c1, g1, s1, _, b1, m1) = marks[0], marks[-1]
    wall = t1 - t0
    hz = os.sysconf("SC_CLK_TCK")
    measured = records[warmup:]
    samples = [(b, g) for t, b, g in runtime.buffer_samples if t0 <= t <= t1] or [(0, 0)]
    window = calls[(calls[:, 0] >= m0) & (calls[:, 0] < m1)]
    ping_ms = pings[(pings[:, 0] >= m0) & (pings[:, 0] < m1), 1] * 1e3
    latency_ms = ping_ms if len(ping_ms) else np.zeros(1)
    return ClusterRow(
        actors=spec.actors, admission=spec.admission, groups_per_step=spec.groups_per_step, ranks=spec.ranks, steps=len(measured),
        wall_s=wall, groups_per_s=spec.groups_per_step * len(measured) / wall,
        admissions_per_s=float(window[:, 2].sum()) / (m1 - m0), gate_calls_per_s=len(window) / (m1 - m0),
        gate_p50_ms=float(np.percentile(latency_ms, 50)), gate_p99_ms=float(np.percentile(latency_ms, 99)),
        gate_cpu=(g1 - g0) / wall, driver_cpu=(c1 - c0) / wall, sender_cpu=(s1 - s0) / wall,
        machine_busy=(b1 - b0) / hz / wall,
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
        consumed=int(admission["consumed"]), admitted=int(admission["next_index"]),
        calls_admitted=int(calls[:, 2].sum()), calls_empty=int((calls[:, 2] == 0).sum()), records=records)


def linear_ratios(rows: list[ClusterRow]) -> list[float]:
    """groups/s of each row over linear scaling from the smallest N run with the same admission protocol."""
    out = []
    for r in rows:
        base = min((b for b in rows if b.admission == r.admission), key=lambda b: b.actors)
        out.append(r.groups_per_s / (base.groups_per_s / base.actors * r.actors))
    return out


def knee(rows: list[ClusterRow], threshold: float = 0.8) -> tuple[int | None, int | None]:
    """(the largest N up to which every ratio to linear is >= threshold, the first N below it or None); the
    rows of one admission protocol."""
    last_ok, first_bad = None, None
    for r, ratio in sorted(zip(rows, linear_ratios(rows), strict=True), key=lambda x: x[0].actors):
        if ratio < threshold:
            first_bad = r.actors
            break
        last_ok = r.actors
    return last_ok, first_bad


def format_cluster(rows: list[ClusterRow]) -> str:
    lines = ["| admission | N actors | groups/step | learner ranks | groups/s | ratio to linear | admissions/s | "
             "gate calls/s (with indices or none) | gate round trip p50 / p99 ms | gate CPU (cores) | gate admissions/s "
             "at one core | driver CPU (cores) | actor hosts CPU | machine busy (cores, all processes) | buffer MB "
             "mean / max (groups max) | admission wait (share of actor time) | admission refusals | per step: "
             "collect / train / publish s | max staleness | dropped |", "|" + "---|" * 20]
    for r, ratio in zip(rows, linear_ratios(rows), strict=True):
        lines.append(
            f"| {r.admission} | {r.actors} | {r.groups_per_step} | {r.ranks} | {r.groups_per_s:.1f} | {ratio:.2f} | "
            f"{r.admissions_per_s:.1f} | {r.gate_calls_per_s:.0f} | {r.gate_p50_ms:.2f} / {r.gate_p99_ms:.2f} | "
            f"{r.gate_cpu:.2f} | {r.gate_capacity:.0f} | {r.driver_cpu:.2f} | {r.sender_cpu:.2f} | "
            f"{r.machine_busy:.2f} | {r.buffer_mb_mean:.1f} / {r.buffer_mb_max:.1f} ({r.buffer_groups_max}) | "
            f"{r.admission_wait:.2f} | {r.refusals} | {r.collect_s:.2f} / {r.train_s:.2f} / {r.publish_s:.3f} | "
            f"{r.staleness_max:.0f} | {r.dropped} |")
    lines.append("")
    for mode in dict.fromkeys(r.admission for r in rows):
        ok, bad = knee([r for r in rows if r.admission == mode])
        if bad is None:
            lines.append(f"{mode}: scaling stays >= 0.8 x linear up to N = {ok}, the largest N run: no knee in this range")
        else:
            lines.append(f"{mode}: scaling >= 0.8 x linear up to N = {ok}; below it from N = {bad}")
    return "\n".join(lines)


def bench_cluster(ns: list[int], steps: int, warmup: int, admissions: tuple[str, ...] = ("wait",),
                  **spec: Any) -> list[ClusterRow]:
    """Every N with every admission protocol, interleaved (N outer), so that drift hits both alike."""
    rows = [run_cluster(ClusterSpec(actors=n, admission=mode, **spec), steps, warmup)
            for n in sorted(ns) for mode in admissions]
    return sorted(rows, key=lambda r: (admissions.index(r.admission), r.actors))
