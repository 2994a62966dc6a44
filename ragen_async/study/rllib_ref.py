"""A classic actor-learner reference: RLlib's APPO with a small MLP on the same Sokoban levels.

The LLM agent reads Sokoban as text; here a non-LLM policy reads the same render as a one-hot grid, so
the staleness study can ask how much more (or less) staleness-sensitive a multi-turn LLM agent is than
a classic policy on the same task.

**Environment.** :func:`make_env` wraps the project's :class:`~ragen_async.envs.sokoban.SokobanEnv`
(default preset: 6x6 room, 1 box, 10 moves, difficulty ``ragen``): :class:`OneHotGrid` turns the text
render into a float32 one-hot array (one channel per grid symbol, ``SYMBOLS``; shape (C, rows, cols),
flattened for the MLP), :class:`DiscreteMoves` maps ``Discrete(4)`` onto Up/Down/Left/Right, a
``TimeLimit`` applies the 10-move budget (the env never truncates itself), and for training
:class:`TrainingSeeds` gives every episode a level seed drawn from ``[TRAIN_SEED_LOW, 2**31)``, so training
plays the env's own generator and never the evaluation seeds. Rewards are the env's own.

**Evaluation** (:func:`evaluate`): seeds 123 .. 123 + 255 (the LLM study's validation seeds), one
episode each, success rate = share of episodes that end with the box on its target. Greedy (argmax
action) by default; ``temperature > 0`` samples from softmax(logits / temperature) instead (the LLM
study validates by sampling at temperature 0.5).

**Staleness.** RLlib has no bound on policy lag; it is an emergent property of its pipeline. In 2.60's
new API stack, APPO's EnvRunners sample asynchronously with whatever weights they last received; the
driver hands sample batches to a learner whose background thread trains from a circular buffer
(``circular_buffer_num_batches`` N batches, each trained on at most ``circular_buffer_iterations_per_batch``
K times), and the learner's weights go back to the EnvRunners only every ``broadcast_interval`` driver
training steps (``training_step()`` calls, many per ``Algorithm.train()``; the learner also publishes its
state only every ``broadcast_interval`` updates). :func:`knobs_for_k` maps the project's k onto
``broadcast_interval = k + 1``, with N = K = 1 (each batch trained on once, only the newest one kept) and
one EnvRunner with one sample request in flight: k = 0 broadcasts after every training step, and k
holds the EnvRunner's weights for k more. That is *not* our token-exact bound: a training step is not
exactly one learner update, the pipeline (a request in flight while the learner trains, weights applied
only at the EnvRunner's next ``sample()``, the learner thread's queue) adds lag even at k = 0, and
nothing drops or holds back data that is too old. Smaller settings were not tried (``num_env_runners=0``,
the driver sampling itself, might lag less). So the lag is measured instead of assumed: every RLlib
train batch carries, per timestep, the weights version (``weights_seq_no``) that acted, and
:class:`LagRecordingLearner` counts, per trained timestep, how many learner updates the weights being
trained are ahead of it: the same definition as ours (0 = on-policy), in learner updates of
``AppoSettings.train_batch_size`` env steps. RLlib's own metric ``diff_num_grad_updates_vs_sampler_policy``
is that plus one, averaged over the last batch only (kept as ``RunResult.rllib_off_policyness``).

Evaluations read the learner's module between ``Algorithm.train()`` calls while its background thread
may still be finishing a queued update (at most one batch is queued with N = 1): an evaluation can see
weights from one update later than the env-step count it is logged at.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
from gymnasium import spaces
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from ragen_async.envs.sokoban import ACTION_NAMES, SokobanEnv
from ragen_async.study.stats import UNIT, cell_table, format_mean_ci

SYMBOLS: tuple[str, ...] = tuple(SokobanEnv.grid_vocab or {})
"""Grid symbols in channel order: wall, floor, target, box on target, box, player, player on target."""
MOVES: tuple[str, ...] = tuple(ACTION_NAMES[i] for i in sorted(ACTION_NAMES))
"""Discrete action i -> the env's action name (Up, Down, Left, Right)."""
EVAL_SEED = 123
"""First evaluation seed (the LLM study's ``validation.seed``)."""
EVAL_EPISODES = 256
"""Evaluation episodes, one per seed (the LLM study's Sokoban validation ``n_groups``)."""
TRAIN_SEED_LOW = 10_000
"""Training level seeds are drawn from ``[TRAIN_SEED_LOW, 2**31)``, disjoint from the evaluation seeds."""
ENV_NAME = "ragen_async/OneHotSokoban"
"""The name :func:`train_appo` registers :func:`make_env` under with RLlib."""


def encode_grid(text: str) -> np.ndarray:
    """The one-hot (len(SYMBOLS), rows, cols) float32 array of a Sokoban text render."""
    lines = text.split("\n")
    rows, cols = len(lines), len(lines[0])
    grid = np.zeros((len(SYMBOLS), rows, cols), dtype=np.float32)
    for r, line in enumerate(lines):
        if len(line) != cols:
            raise ValueError(f"ragged Sokoban render: row {r} has {len(line)} cells, row 0 has {cols}")
        for c, symbol in enumerate(line):
            grid[SYMBOLS.index(symbol), r, c] = 1.0
    return grid


class OneHotGrid(gym.ObservationWrapper):
    """Sokoban's text render -> its flattened one-hot grid (:func:`encode_grid`, then ``ravel``)."""

    def __init__(self, env: SokobanEnv):
        super().__init__(env)
        rows, cols = env.config.dim_room
        self.grid_shape = (len(SYMBOLS), rows, cols)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(int(np.prod(self.grid_shape)),), dtype=np.float32)

    def observation(self, observation: str) -> np.ndarray:
        return encode_grid(observation).ravel()


class DiscreteMoves(gym.ActionWrapper):
    """``Discrete(4)`` -> the env's action names, in :data:`MOVES` order."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.action_space = spaces.Discrete(len(MOVES))

    def action(self, action: Any) -> str:
        return MOVES[int(action)]


class TrainingSeeds(gym.Wrapper):
    """Every reset plays a fresh level of the env's own generator: level seed drawn from
    ``[TRAIN_SEED_LOW, 2**31)`` by this wrapper's generator (re-seeded when ``reset`` gets a seed)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._seeds = np.random.default_rng()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if seed is not None:
            self._seeds = np.random.default_rng(seed)
        level_seed = int(self._seeds.integers(TRAIN_SEED_LOW, 2**31))
        observation, info = self.env.reset(seed=level_seed, options=options)
        return observation, {**info, "level_seed": level_seed}


def make_env(env_config: dict[str, Any] | None = None) -> gym.Env:
    """The wrapped Sokoban env. ``env_config``: SokobanEnv options, plus ``train`` (default True:
    add :class:`TrainingSeeds`; False: ``reset(seed=s)`` plays level ``s``, for evaluation)."""
    options = dict(env_config or {})
    train = bool(options.pop("train", True))
    base = SokobanEnv(**options)
    env: gym.Env = gym.wrappers.TimeLimit(DiscreteMoves(OneHotGrid(base)), base.max_actions_per_episode)
    return TrainingSeeds(env) if train else env


Policy = Callable[[np.ndarray], np.ndarray]
"""A batch of flattened one-hot observations (n, D) -> action logits (n, 4)."""


def evaluate(policy: Policy, seeds: Sequence[int] = range(EVAL_SEED, EVAL_SEED + EVAL_EPISODES),
             temperature: float = 0.0, env_config: dict[str, Any] | None = None, rng_seed: int = 0) -> float:
    """Success rate of ``policy`` over one episode per level seed, the episodes played in lockstep.

    ``temperature`` 0 takes the argmax action; above 0 samples from softmax(logits / temperature)
    with a generator seeded by ``rng_seed``."""
    rng = np.random.default_rng(rng_seed)
    envs = [make_env({**(env_config or {}), "train": False}) for _ in seeds]
    observations = [env.reset(seed=int(s))[0] for env, s in zip(envs, seeds, strict=True)]
    running = list(range(len(envs)))
    solved = 0
    while running:
        logits = np.asarray(policy(np.stack([observations[i] for i in running])), dtype=np.float64)
        if temperature > 0:
            z = logits / temperature
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            actions = [int(rng.choice(len(MOVES), p=row)) for row in p]
        else:
            actions = [int(a) for a in logits.argmax(axis=1)]
        still = []
        for i, action in zip(running, actions, strict=True):
            observations[i], _, terminated, truncated, info = envs[i].step(action)
            if terminated or truncated:
                solved += bool(info["success"])
            else:
                still.append(i)
        running = still
    return solved / len(envs)


@dataclass(frozen=True)
class Knobs:
    """The RLlib settings that shape policy lag (module docstring)."""

    broadcast_interval: int
    """Driver training steps between weight broadcasts to the EnvRunners (also: learner updates between
    the learner publishing its state)."""
    circular_buffer_num_batches: int = 1
    """APPO's circular buffer size N (train batches held; the oldest is dropped when a new one arrives)."""
    circular_buffer_iterations_per_batch: int = 1
    """APPO's replay coefficient K: how many times one train batch may be trained on."""
    num_env_runners: int = 1
    """Remote EnvRunner actors sampling in parallel with the learner (0: the driver samples)."""
    max_requests_in_flight_per_env_runner: int = 1
    """Sample requests queued per EnvRunner ahead of the driver."""


def knobs_for_k(k: int) -> Knobs:
    """The project's staleness bound k -> RLlib's knobs: ``broadcast_interval = k + 1``, the rest at their
    most on-policy settings (module docstring says why and what this does not guarantee)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return Knobs(broadcast_interval=k + 1)


@dataclass(frozen=True)
class AppoSettings:
    """APPO's learning settings, the same for every k."""

    hidden: tuple[int, ...] = (64, 64)
    """MLP encoder layer widths (policy and value heads are linear on top)."""
    lr: float = 1e-3
    """Adam learning rate."""
    gamma: float = 0.99
    """Discount factor."""
    entropy_coeff: float = 0.01
    """Entropy bonus coefficient."""
    train_batch_size: int = 200
    """Env steps per learner update (one weights version)."""
    num_envs_per_env_runner: int = 8
    """Vectorised Sokoban envs per EnvRunner."""
    rollout_fragment_length: int = 25
    """Env steps per env per sample request."""
    eval_every_s: float = 20.0
    """Training seconds between evaluations (evaluation time is not counted in the budget)."""
    eval_episodes: int = EVAL_EPISODES
    """Evaluation seeds, from :data:`EVAL_SEED` on."""


@dataclass
class RunResult:
    """One APPO run's measurements."""

    k: int
    """The project's staleness k this run's knobs were mapped from."""
    seed: int
    """RLlib seed (weights init, EnvRunner seeds, hence training levels)."""
    knobs: dict[str, int]
    """The RLlib knobs used (:class:`Knobs` as a dict)."""
    train_s: float
    """Training wall-clock seconds (evaluations excluded)."""
    env_steps: int
    """Env steps sampled."""
    learner_updates: int
    """Learner updates (weights versions) made."""
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """(env steps sampled, greedy success, sampled success at temperature 1) per evaluation, the last one
    after training."""
    lag_counts: dict[int, int] = field(default_factory=dict)
    """Trained timesteps per measured lag (learner updates between the acting and the trained weights)."""
    rllib_off_policyness: float = math.nan
    """RLlib's own ``diff_num_grad_updates_vs_sampler_policy`` (lag + 1, last batch only), last value seen."""

    @property
    def env_steps_per_s(self) -> float:
        return self.env_steps / self.train_s if self.train_s > 0 else math.nan

    @property
    def final_success(self) -> float:
        """Greedy success at the end of training."""
        return self.evals[-1][1] if self.evals else math.nan

    @property
    def best_success(self) -> float:
        """Best greedy success over the run's evaluations."""
        return max((e[1] for e in self.evals), default=math.nan)

    @property
    def final_success_sampled(self) -> float:
        """Success sampling actions at temperature 1 at the end of training."""
        return self.evals[-1][2] if self.evals else math.nan

    @property
    def lag_mean(self) -> float:
        n = sum(self.lag_counts.values())
        return sum(lag * c for lag, c in self.lag_counts.items()) / n if n else math.nan

    @property
    def lag_max(self) -> int | None:
        return max(self.lag_counts) if self.lag_counts else None

    def summary(self) -> dict[str, Any]:
        """A flat dict for tables: settings, successes, rates and lag."""
        return {"k": self.k, "seed": self.seed, **self.knobs, "train_s": self.train_s, "env_steps": self.env_steps,
                "learner_updates": self.learner_updates, "env_steps_per_s": self.env_steps_per_s,
                "final_success": self.final_success, "best_success": self.best_success,
                "final_success_sampled": self.final_success_sampled, "lag_mean": self.lag_mean,
                "lag_max": self.lag_max, "rllib_off_policyness": self.rllib_off_policyness}


class LagRecordingLearner(APPOTorchLearner):
    """APPO's torch learner, also counting per trained timestep the learner updates between the weights
    that acted and the weights being trained.

    ``_weights_seq_no`` is already incremented for the update in progress, so the weights being trained
    are version ``_weights_seq_no - 1``; the acting version is the batch's ``weights_seq_no`` column."""

    lag_counts: dict[int, int]
    """Trained timesteps per lag, over the learner's lifetime (padding excluded)."""

    def _compute_off_policyness(self, batch: Any) -> None:
        super()._compute_off_policyness(batch)
        counts = self.__dict__.setdefault("lag_counts", {})
        for module_batch in batch.values():
            if WEIGHTS_SEQ_NO not in module_batch:
                continue
            lag = self._weights_seq_no - 1 - module_batch[WEIGHTS_SEQ_NO]
            if Columns.LOSS_MASK in module_batch:
                lag = lag[module_batch[Columns.LOSS_MASK].bool()]
            values, n = np.unique(lag.detach().cpu().numpy().astype(np.int64), return_counts=True)
            for value, c in zip(values.tolist(), n.tolist(), strict=True):
                counts[value] = counts.get(value, 0) + c


def appo_config(k: int, seed: int, settings: AppoSettings, knobs: Knobs | None = None,
                env_config: dict[str, Any] | None = None) -> Any:
    """RLlib's ``APPOConfig`` (new API stack, torch, CPU, one local learner) for staleness ``k``."""
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.tune.registry import register_env

    knobs = knobs or knobs_for_k(k)
    register_env(ENV_NAME, make_env)
    return (
        APPOConfig()
        .api_stack(enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
        .framework("torch")
        .environment(ENV_NAME, env_config={**(env_config or {}), "train": True})
        .env_runners(num_env_runners=knobs.num_env_runners, num_envs_per_env_runner=settings.num_envs_per_env_runner,
                     rollout_fragment_length=settings.rollout_fragment_length,
                     max_requests_in_flight_per_env_runner=knobs.max_requests_in_flight_per_env_runner,
                     num_cpus_per_env_runner=1)
        .learners(num_learners=0, num_gpus_per_learner=0, learner_class=LagRecordingLearner)
        .training(lr=settings.lr, gamma=settings.gamma, entropy_coeff=settings.entropy_coeff,
                  train_batch_size_per_learner=settings.train_batch_size, broadcast_interval=knobs.broadcast_interval,
                  circular_buffer_num_batches=knobs.circular_buffer_num_batches,
                  circular_buffer_iterations_per_batch=knobs.circular_buffer_iterations_per_batch,
                  timeout_s_sampler_manager=0.1)  # the driver waits for samples instead of spinning
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=list(settings.hidden)))
        .reporting(min_time_s_per_iteration=1, min_sample_timesteps_per_iteration=0)
        .debugging(seed=seed, log_level="ERROR")
    )


def _module_policy(module: Any) -> Policy:
    import torch

    def policy(observations: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = module.forward_inference({"obs": torch.as_tensor(observations, dtype=torch.float32)})
        return out["action_dist_inputs"].cpu().numpy()

    return policy


def _evaluate_both(policy: Policy, env_steps: int, seeds: Sequence[int], env_config: dict[str, Any] | None
                   ) -> tuple[int, float, float]:
    return (env_steps, evaluate(policy, seeds, env_config=env_config),
            evaluate(policy, seeds, temperature=1.0, env_config=env_config))


def ensure_ray() -> None:
    """Start a small local Ray (2 CPUs, 200 MB object store, no dashboard) unless one is running."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False, log_to_driver=False)


def train_appo(k: int, seed: int = 0, budget_s: float = 120.0, settings: AppoSettings | None = None,
               knobs: Knobs | None = None, max_env_steps: int | None = None,
               env_config: dict[str, Any] | None = None) -> RunResult:
    """Train APPO at staleness ``k`` for ``budget_s`` training seconds (or ``max_env_steps``, if that comes
    first), evaluating the learner's weights every ``settings.eval_every_s`` seconds and at the end."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.utils.metrics import (
        DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY,
        ENV_RUNNER_RESULTS,
        LEARNER_RESULTS,
        NUM_ENV_STEPS_SAMPLED_LIFETIME,
    )

    settings = settings or AppoSettings()
    knobs = knobs or knobs_for_k(k)
    ensure_ray()
    algo = appo_config(k, seed, settings, knobs, env_config).build_algo()
    learner = algo.learner_group._learner  # num_learners=0: the learner lives in this process
    policy = _module_policy(learner.module[DEFAULT_MODULE_ID])
    seeds = range(EVAL_SEED, EVAL_SEED + settings.eval_episodes)
    result = RunResult(k=k, seed=seed, knobs=asdict(knobs), train_s=0.0, env_steps=0, learner_updates=0)
    try:
        since_eval = 0.0
        while result.train_s < budget_s and (max_env_steps is None or result.env_steps < max_env_steps):
            start = time.perf_counter()
            out = algo.train()
            elapsed = time.perf_counter() - start
            result.train_s += elapsed
            since_eval += elapsed
            result.env_steps = int(out.get(ENV_RUNNER_RESULTS, {}).get(NUM_ENV_STEPS_SAMPLED_LIFETIME, result.env_steps))
            lag = out.get(LEARNER_RESULTS, {}).get(DEFAULT_MODULE_ID, {}).get(DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY)
            if lag is not None:
                result.rllib_off_policyness = float(lag)
            if since_eval >= settings.eval_every_s:
                result.evals.append(_evaluate_both(policy, result.env_steps, seeds, env_config))
                since_eval = 0.0
        result.learner_updates = int(learner._weights_seq_no)
        result.lag_counts = dict(sorted(getattr(learner, "lag_counts", {}).items()))
        if since_eval > 0 or not result.evals:
            result.evals.append(_evaluate_both(policy, result.env_steps, seeds, env_config))
    finally:
        algo.stop()
    return result


def bench_rllib(ks: Sequence[int], seeds: int, budget_s: float, settings: AppoSettings | None = None,
                on_run: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """One :func:`train_appo` run per (k, seed), seeds 0 .. ``seeds - 1``, one after another."""
    results = []
    for k in ks:
        for seed in range(seeds):
            results.append(train_appo(k, seed=seed, budget_s=budget_s, settings=settings))
            if on_run is not None:
                on_run(results[-1])
    return results


def cells(results: Sequence[RunResult]) -> pd.DataFrame:
    """One row per k: seeds, and mean with 95 % half-width (``<col>_ci``) of every run statistic."""
    runs = pd.DataFrame([r.summary() for r in results])
    values = ["final_success", "best_success", "final_success_sampled", "env_steps_per_s", "lag_mean", "lag_max"]
    runs["lag_max"] = runs["lag_max"].astype(float)
    table = cell_table(runs, ["k", "broadcast_interval"], values, {"final_success": UNIT})
    return table.rename(columns={"n": "seeds"})


def reference_csv(table: pd.DataFrame) -> str:
    """:func:`cells` as the reference CSV ``ragen-async report --reference`` draws beside the study
    (``report.REFERENCE_COLUMNS``: measured lag, final greedy success and its interval, per k)."""
    frame = table[["k", "seeds", "lag_mean", "final_success", "final_success_lo", "final_success_hi"]].copy()
    frame.insert(0, "label", [f"APPO k = {k}" for k in frame["k"]])
    return frame.to_csv(index=False, float_format="%.4f")


def format_cells(table: pd.DataFrame) -> str:
    """The markdown table of :func:`cells`."""
    lines = ["| k | broadcast_interval | seeds | final success (greedy) | best success (greedy) | "
             "final success (sampled, T = 1) | env steps/s | measured lag mean | measured lag max |",
             "|" + "---|" * 9]
    for row in table.itertuples(index=False):
        r = row._asdict()

        def cell(col: str, spec: str = ".3f", r: dict = r) -> str:
            return format_mean_ci(r[col], r[f"{col}_ci"], spec)

        lines.append(f"| {r['k']} | {r['broadcast_interval']} | {r['seeds']} | {cell('final_success')} | "
                     f"{cell('best_success')} | {cell('final_success_sampled')} | {cell('env_steps_per_s', '.0f')} | "
                     f"{cell('lag_mean', '.2f')} | {cell('lag_max', '.1f')} |")
    return "\n".join(lines)
