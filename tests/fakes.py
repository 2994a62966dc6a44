"""Fakes the tests share: groups and trajectories as the buffer sees them, a simulated rollout in ticks, a
runtime of simulated producers for the training loop (not the simulated cluster of ``bench.simcluster``, whose
``SimRuntime`` is a Ray runtime), and run directories written by hand with the keys the orchestrator logs, with
a fake ``train`` (nothing here trains a model)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ragen_async.learner.learner import TrainResult
from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup, TurnRecord
from ragen_async.runtime import LocalAdmission, Runtime
from ragen_async.staleness.buffer import TrajectoryBuffer
from ragen_async.staleness.ids import format_group_id


def make_traj(group_id: str, i: int, turn_versions: list[int], reward: float, reply: int = 3) -> Trajectory:
    """A 4-token prompt, then per turn ``reply`` sampled tokens (at that turn's version) + 2 env tokens."""
    versions = [NO_VERSION] * 4
    turns = []
    for v in turn_versions:
        versions += [v] * reply + [NO_VERSION] * 2
        turns.append(TurnRecord(reward / len(turn_versions), ("up",), 0, True, v, v, reply, 0.1, 0.01))
    tv = np.array(versions, np.int32)
    mask = (tv != NO_VERSION).astype(np.int8)
    return Trajectory(
        traj_id=f"{group_id}/{i}",
        env_tag="sokoban",
        seed=0,
        group_id=group_id,
        token_ids=np.arange(len(tv), dtype=np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        token_versions=tv,
        turns=tuple(turns),
        format_penalty=0.0,
        success=reward > 0,
    )


def make_group(
    index: int,
    version: int = 0,
    rewards: tuple[float, ...] = (0.0, 1.0),
    replies: tuple[int, ...] | None = None,
    created_at: float = 0.0,
    finished_at: float = 1.0,
) -> TrajectoryGroup:
    gid = format_group_id(index)
    replies = replies or (3,) * len(rewards)
    trajs = tuple(
        make_traj(gid, i, [version, version], r, n) for i, (r, n) in enumerate(zip(rewards, replies, strict=True))
    )
    return TrajectoryGroup(gid, index, "sokoban", index, trajs, "w0", created_at, finished_at)


def plain_buffer(groups_per_step: int = 2, max_staleness: int | None = 1, **kwargs) -> TrajectoryBuffer:
    """A buffer without filter, consuming in arrival order unless ``consume`` says otherwise."""
    kwargs = {"filter_mode": "none", "filter_ratio": 1.0, "norm_mode": "mean_std", "num_ranks": 1,
              "consume": "arrival"} | kwargs
    return TrajectoryBuffer(groups_per_step, max_staleness, **kwargs)


def advance_slots(slots: list[dict | None], ctrl, buf, rng, engine_version: int, learner_version: int,
                  tick: int) -> None:
    """One tick of simulated rollout slots: a free slot takes a group the controller admits (1-3 turns); a
    slot whose turn ends plays its next turn at ``engine_version`` or, after its last, adds the group to
    ``buf``. Slot 0 is pathologically slow (turns of up to 60 ticks, the others up to 6), so its groups are
    overtaken by younger ones."""
    for s, slot in enumerate(slots):
        if slot is None:
            if (index := ctrl.try_admit()) is None:
                continue
            slot = slots[s] = {"index": index, "versions": [], "left": 0, "turns": int(rng.integers(1, 4))}
        if slot["left"] == 0:
            if len(slot["versions"]) == slot["turns"]:
                gid = format_group_id(slot["index"])
                trajs = tuple(make_traj(gid, i, slot["versions"], float(rng.normal())) for i in range(2))
                buf.add(TrajectoryGroup(gid, slot["index"], "e", 0, trajs), learner_version, now=float(tick))
                slots[s] = None
                continue
            slot["versions"].append(engine_version)
            slot["left"] = int(rng.integers(1, 60 if s == 0 else 6))
        slot["left"] -= 1


def sim_group(index: int, turn_versions: list[int], rng: np.random.Generator) -> TrajectoryGroup:
    trajs = []
    for i in range(2):
        versions = [NO_VERSION] + [v for v in turn_versions for _ in range(3)]
        tv = np.array(versions, np.int32)
        mask = (tv != NO_VERSION).astype(np.int8)
        trajs.append(Trajectory(
            traj_id=f"g{index}/{i}", env_tag="sim", seed=index, group_id=f"g{index:08d}",
            token_ids=np.arange(len(tv), dtype=np.int32), loss_mask=mask,
            behaviour_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32), token_versions=tv, turns=(),
            format_penalty=0.0, success=bool(rng.random() < 0.5)))
    return TrajectoryGroup(f"g{index:08d}", index, "sim", index, tuple(trajs))


class TickRuntime(Runtime):
    """Producers on a tick clock. Each receive advances one tick: free producers take admitted groups
    (a fifth of them very slow); each turn is tagged with the version served when the turn starts."""

    def __init__(self, k: int | None, groups_per_step: int, producers: int, seed: int):
        self.admission = LocalAdmission(k, groups_per_step)
        self.rng = np.random.default_rng(seed)
        self.producers = producers
        self.served = 0
        self.tick = 0
        self.in_flight: list[dict] = []
        self.finished: list[TrajectoryGroup] = []
        self.admitted_at_version: dict[int, int] = {}
        self.learner_version = 0

    def _admit(self) -> None:
        ctrl = self.admission.controller
        while len(self.in_flight) < self.producers and (i := ctrl.try_admit()) is not None:
            limit = ctrl.limit()
            assert limit is None or ctrl.groups_started <= limit, (ctrl.groups_started, limit)
            turns = int(self.rng.integers(1, 4))
            slow = self.rng.random() < 0.2
            self.in_flight.append({"index": i, "versions": [], "turns": turns, "left": 0, "slow": slow})

    async def start(self) -> None:
        pass

    async def receive(self, timeout_s: float) -> TrajectoryGroup | None:
        self.tick += 1
        self._admit()
        for g in list(self.in_flight):
            if g["left"] > 0:
                g["left"] -= 1
                continue
            if len(g["versions"]) == g["turns"]:
                self.in_flight.remove(g)
                self.finished.append(sim_group(g["index"], g["versions"], self.rng))
                continue
            g["versions"].append(self.served)
            g["left"] = int(self.rng.integers(10, 40) if g["slow"] else self.rng.integers(0, 3))
        if self.finished and self.rng.random() < 0.7:
            group = self.finished.pop(int(self.rng.integers(len(self.finished))))  # random arrival order
            if self.rng.random() < 0.05:
                self.finished.append(group)  # the same frame arrives again later (a replay)
            return group
        return None

    async def train(self, shards):
        for _ in range(int(self.rng.integers(1, 6))):  # the learner takes a few ticks; producers go on
            if (g := await self.receive(0)) is not None:
                self.finished.append(g)
        self.learner_version = shards[0].learner_version + 1
        return TrainResult(self.learner_version, {"learner/num_tokens": 1.0})

    async def publish(self, version: int) -> None:
        self.served = version

    async def probe(self, token_ids):
        raise AssertionError("not used")

    async def served_weights(self):
        return [(self.served, [])]  # no weights: the byte-exact check at the first sync compares nothing

    async def published_digests(self, version, needed):
        return {}

    async def validate(self):
        return {}

    async def rollout_stats(self):
        return [{"busy_s": 0.0, "admission_wait_s": 0.0, "policy_version": float(self.served)}]

    async def save(self, path: Path, step: int) -> None:
        path.mkdir(parents=True, exist_ok=True)

    async def load(self, path: Path) -> int:
        raise AssertionError("not used")

    @property
    def vocab_size(self) -> int:
        return 16

    def close(self) -> None:
        pass


def training_record(step: int, total: int, k: int, **extra: Any) -> dict[str, Any]:
    """A learner-step record whose numbers drift the way a run's do: reward up, std and entropy down."""
    x = step / max(total, 1)
    return {
        "learner/step": step, "policy_version": step,
        "rollout/success": 0.2 + 0.7 * x, "rollout/reward_mean": -0.5 + 1.4 * x,
        "rollout/in_group_reward_std": 0.5 - 0.4 * x, "actor/entropy": 1.0 - 0.5 * x,
        "actor/grad_norm": 0.5 + (2.0 if step == total // 2 else 0.1 * x),
        "rollout/valid_action_rate": 0.9 + 0.1 * x,
        "staleness/mean": k * 0.5, "staleness/max": float(k), "mismatch/k3_kl": 1e-4 * (1 + k),
        "timing/step_s": 2.0 + k * 0.1, **extra,
    }


def write_run(path: Path, *, steps: int = 20, k: int | None = 0, fixed_lag: bool = False,
              off_policy: str = "none", seed: int = 0, val_every: int = 5, envs: tuple[str, ...] = ("Bandit",),
              val_curve=lambda step, total: min(1.0, 0.3 + step / max(total, 1)),
              partial_last_line: bool = False, extra: dict[int, dict[str, Any]] | None = None,
              config: dict[str, Any] | None = None, logged_steps: int | None = None) -> Path:
    """A run directory as the orchestrator leaves it (config.yaml, metrics.jsonl, checkpoints/); ``config``
    adds top-level config sections, ``logged_steps`` stops the log early (a run still going)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "checkpoints").mkdir(exist_ok=True)
    config = {"name": path.name, "seed": seed, "total_steps": steps,
              "staleness": {"max_staleness": k, "fixed_lag": fixed_lag}, "algo": {"off_policy": off_policy},
              **(config or {})}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    lines = []

    def val(step: int) -> None:
        scores = {f"val/{e}/success": val_curve(step, steps) for e in envs}
        lines.append({"learner/step": step, "policy_version": step,
                      "val/success": sum(scores.values()) / len(scores), **scores})

    if val_every:
        val(0)
    for step in range(1, (steps if logged_steps is None else logged_steps) + 1):
        lines.append(training_record(step, steps, k or 0, **(extra or {}).get(step, {})))
        if val_every and (step % val_every == 0 or step == steps):
            val(step)
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if partial_last_line:
        text += json.dumps(training_record(steps + 1, steps, k or 0))[:40]
    (path / "metrics.jsonl").write_text(text)
    return path


class FakeTrain:
    """Stands in for ``orchestrator.train``: makes a run directory, logs a few steps, returns."""

    def __init__(self, fail: set[str] = frozenset(), interrupt: set[str] = frozenset(), steps: int = 4):
        self.fail, self.interrupt, self.steps = set(fail), set(interrupt), steps
        self.calls: list[tuple[str, str]] = []  # (run name, "new" | "resume")
        self.pools: list = []  # the engine pool each call got (``orchestrator.train``'s ``pool``)

    def __call__(self, cfg=None, *, resume: Path | None = None, pool=None):
        from ragen_async.config import dump_config, load_config

        self.pools.append(pool)
        if resume is not None:
            run_dir = Path(resume)
            cfg = load_config(run_dir / "config.yaml")
        else:
            run_dir = Path(cfg.run_root) / f"{cfg.name}-fake"
            run_dir.mkdir(parents=True)
            (run_dir / "config.yaml").write_text(dump_config(cfg))
        short = run_dir.parent.name  # the sweep gives each run its own run_root: SWEEP_DIR/runs/<run name>
        self.calls.append((short, "resume" if resume is not None else "new"))
        with (run_dir / "metrics.jsonl").open("a") as f:
            for step in range(1, self.steps + 1):
                k = cfg.staleness.max_staleness or 0
                f.write(json.dumps(training_record(step, self.steps, k)) + "\n")
        if short in self.interrupt:
            self.interrupt.discard(short)  # interrupted once; a resume then finishes it
            raise KeyboardInterrupt
        if short in self.fail:
            raise RuntimeError(f"engine died in {short}\nsecond line of detail")
        success = 0.5 + 0.1 * (cfg.staleness.max_staleness or 0)
        last = {"learner/step": self.steps, "val/success": success, "val/Bandit/success": success,
                "val/reward_mean": math.nan}
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({k: v for k, v in last.items() if k != "val/reward_mean"}) + "\n")
        return run_dir, last
