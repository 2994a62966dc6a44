"""Does the learner learn (``ragen-async bench learns``): a bandit with a known optimum, bf16 beside fp32.

The task: after a fixed prompt (random token ids) the policy emits one token; the reward is 1 when it is the
target token, else 0, so the optimum is known: P(target) = 1, expected reward 1. The target is a token whose
probability under the initial model is near :data:`START_P` (:func:`choose_task`, the fp32 forward), so the
first steps sample it now and then and the curve has a long way to rise. Each step samples
``groups`` x ``group_size`` replies from the learner's own actor (a forward under the learner's compute dtype,
fp32 softmax, inverse-CDF sampling from uniforms that are the same for every dtype: both runs see the same
draws until their probabilities differ), builds the groups as a rollout actor would (``Trajectory``: prompt,
one sampled token in the loss mask, its behaviour log-prob and version; the reward in its one turn), passes
them through the real ``TrajectoryBuffer`` (StarPO-S's std filter) and trains with ``Learner.train_step``.

The algorithm is configs/paper/starpo_s_bandit.yaml's as it stands: PPO with a critic and GAE, whitened
advantages, clip 0.2/0.28, dual clip 3, entropy bonus 0.001, seq-mean-token-mean, 8 groups x 16 with the
top quarter kept (32 trajectories: one update per step), fp32 masters; only the learning rates are raised
(:data:`ACTOR_LR`, :data:`CRITIC_LR`) so the optimum is reached in tens of steps, and ``model.dtype`` is the
setting compared. The model is the tiny one (``artifacts/tiny-model``) or any local checkpoint.

Success: P(target) >= :data:`TARGET_P` within the run, for every dtype, and each curve (P(target) after each
step) within :data:`TOLERANCE` of float32's on average over the steps (the largest gap is reported too).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

PAPER_BANDIT = "configs/paper/starpo_s_bandit.yaml"
TARGET_P = 0.9
"""P(target) a run must reach: the optimum is 1."""
TOLERANCE = 0.05
"""Largest mean over the steps of |P_dtype(target) - P_fp32(target)|. A mean, not a maximum: where a curve rises
steeply (0.04 to 0.9 in three steps for some targets) the same learning one step later is a gap of 0.15 at that
step, while a learner whose rounding swallowed updates would trail by tenths for many steps."""
START_P = 0.05
"""The target's probability under the initial model is the one nearest this."""
ACTOR_LR = 2e-4
CRITIC_LR = 1e-3
PROMPT_TOKENS = 12


@dataclass
class Curve:
    dtype: str
    compute_dtype: str
    target_p: list[float] = field(default_factory=list)
    """P(target) before step 1 (index 0) and after each step."""
    reward: list[float] = field(default_factory=list)
    """Mean reward of each step's samples (before the filter)."""
    seconds: float = 0.0

    @property
    def reached_at(self) -> int | None:
        """The first step after which P(target) >= TARGET_P (None: never)."""
        return next((i for i, p in enumerate(self.target_p) if p >= TARGET_P), None)


@dataclass
class LearnsResult:
    model: str
    device: str
    steps: int
    target: int
    prompt: list[int]
    curves: list[Curve]


def _config(model_path: str, dtype: str, overrides: list[str]):
    from ragen_async.config import load_config

    return load_config(PAPER_BANDIT, [f"model.path={model_path}", f"model.dtype={dtype}", "learner.num_ranks=1",
                                      f"learner.actor_lr={ACTOR_LR}", f"learner.critic_lr={CRITIC_LR}", *overrides])


def _next_token_probs(learner, prompt) -> np.ndarray:
    """P(next token | prompt) under the learner's actor, its forward in the learner's compute dtype."""
    import torch

    with torch.no_grad(), learner._autocast():
        logits = learner.actor(input_ids=prompt).logits[0, -1].float()
    return torch.softmax(logits / learner.temperature, dim=-1).double().cpu().numpy()


def _groups(step: int, probs: np.ndarray, target: int, prompt: list[int], version: int, n_groups: int,
            group_size: int, seed: int):
    from ragen_async.protocol import NO_VERSION, Trajectory, TrajectoryGroup, TurnRecord
    from ragen_async.staleness.ids import format_group_id

    rng = np.random.default_rng([seed, step])  # the same draws for every dtype
    cdf = np.cumsum(probs)
    groups = []
    for g in range(n_groups):
        index = step * n_groups + g
        gid = format_group_id(index)
        trajs = []
        for i, u in enumerate(rng.random(group_size)):
            token = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(probs) - 1)
            reward = 1.0 if token == target else 0.0
            n = len(prompt) + 1
            mask, logprobs, versions = np.zeros(n, np.int8), np.zeros(n, np.float32), np.full(n, NO_VERSION, np.int32)
            mask[-1], logprobs[-1], versions[-1] = 1, math.log(max(probs[token], 1e-30)), version
            turn = TurnRecord(reward=reward, actions=(str(token),), num_dropped_actions=0, format_ok=True,
                              policy_version=version, end_policy_version=version, response_tokens=1, generate_s=0.0,
                              env_step_s=0.0)
            trajs.append(Trajectory(traj_id=f"{gid}/t{i}", env_tag="TokenBandit", seed=index, group_id=gid,
                                    token_ids=np.array([*prompt, token], np.int32), loss_mask=mask,
                                    behaviour_logprobs=logprobs, token_versions=versions, turns=(turn,),
                                    format_penalty=0.0, success=reward > 0))
        groups.append(TrajectoryGroup(group_id=gid, index=index, env_tag="TokenBandit", seed=index,
                                      trajectories=tuple(trajs), worker_id="learns"))
    return groups


def choose_task(model_path: str, seed: int = 0, tries: int = 100) -> tuple[list[int], int, float]:
    """The prompt, the target token and its initial probability (fp32, on the CPU): the first prompt of random
    ids (generator ``[seed, i]``, i = 0, 1, ...) after which some token's probability lies within a factor of 2
    of :data:`START_P`, and of those tokens the one nearest it (a model sure of its next token after a prompt
    would make the first hit, and so the start of learning, a matter of luck)."""
    import torch

    from ragen_async.learner.learner import load_actor

    actor = load_actor(model_path).eval()
    vocab = actor.config.vocab_size
    for i in range(tries):
        prompt = np.random.default_rng([seed, i]).integers(0, vocab, PROMPT_TOKENS).tolist()
        with torch.no_grad():
            probs = torch.softmax(actor(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1).numpy()
        target = int(np.argmin(np.abs(np.log(probs / START_P))))
        if abs(math.log(probs[target] / START_P)) <= math.log(2):
            return prompt, target, float(probs[target])
    raise ValueError(f"{model_path}: no prompt of {tries} gives a token a probability near {START_P}")


def run_curve(model_path: str, dtype: str, device: str, steps: int, prompt: list[int], target: int, seed: int = 0,
              overrides: list[str] | None = None, on_step=None) -> Curve:
    """``steps`` learner steps on the token bandit with ``model.dtype=dtype``."""
    import torch

    cfg = _config(model_path, dtype, overrides or [])
    threads = torch.get_num_threads()
    if device == "cpu":
        # One thread: the tiny model's matmuls are too small to split, and on a loaded machine threads that
        # spin for each other made a step 50 x slower (2 cores, 6 busy processes: 6 s a step against 0.1 s).
        torch.set_num_threads(1)
    try:
        return _run_curve(cfg, device, steps, prompt, target, seed, on_step)
    finally:
        torch.set_num_threads(threads)


def _run_curve(cfg, device, steps, prompt, target, seed, on_step) -> Curve:
    import torch

    from ragen_async.learner.learner import Learner
    from ragen_async.staleness.buffer import TrajectoryBuffer

    learner = Learner(cfg, device=device)
    curve = Curve(dtype=cfg.model.dtype, compute_dtype=str(learner.compute_dtype).removeprefix("torch."))
    prompt_t = torch.tensor([prompt], device=device)
    n_groups, group_size = cfg.rollout.groups_per_step, cfg.rollout.group_size
    t0 = time.perf_counter()
    probs = _next_token_probs(learner, prompt_t)
    curve.target_p.append(float(probs[target]))
    for step in range(steps):
        version = learner.policy_version
        buffer = TrajectoryBuffer(n_groups, max_staleness=0, filter_mode=cfg.algo.filter_mode,
                                  filter_ratio=cfg.algo.filter_ratio, norm_mode=cfg.algo.grpo_norm,
                                  consume="arrival")  # a fresh buffer per step: its indices start past 0
        groups = _groups(step, probs, target, prompt, version, n_groups, group_size, seed)
        for g in groups:
            buffer.add(g, version, 0.0)
        learner.train_step(buffer.next_batch(version, step, 0.0).shards[0])
        curve.reward.append(float(np.mean([t.score for g in groups for t in g.trajectories])))
        probs = _next_token_probs(learner, prompt_t)
        curve.target_p.append(float(probs[target]))
        if on_step is not None:
            on_step(curve, step + 1)
    curve.seconds = time.perf_counter() - t0
    return curve


def bench_learns(model_path: str = "artifacts/tiny-model", device: str = "cpu", steps: int = 40,
                 dtypes: tuple[str, ...] = ("float32", "bfloat16"), seed: int = 0, overrides: list[str] | None = None,
                 on_step=None) -> LearnsResult:
    """One curve per dtype on the same task, the same draws and the same initial weights."""
    prompt, target, _ = choose_task(model_path, seed)
    curves = [run_curve(model_path, d, device, steps, prompt, target, seed, overrides, on_step) for d in dtypes]
    return LearnsResult(model=model_path, device=device, steps=steps, target=target, prompt=prompt, curves=curves)


def gaps(a: Curve, b: Curve) -> tuple[float, float]:
    """(mean, max) over the steps of |P_a(target) - P_b(target)|."""
    d = [abs(x - y) for x, y in zip(a.target_p, b.target_p, strict=True)]
    return sum(d) / len(d), max(d)


def verdict(result: LearnsResult) -> tuple[bool, str]:
    """(passed, the ``VERDICT learns: ...`` line)."""
    def name(c: Curve) -> str:
        return c.dtype if c.compute_dtype == c.dtype else f"{c.dtype} (computed in {c.compute_dtype})"

    parts, ok = [], True
    for c in result.curves:
        at = c.reached_at
        ok &= at is not None
        parts.append(f"{name(c)} reached {c.target_p[at]:.2f} at step {at}" if at is not None
                     else f"{name(c)} never reached {TARGET_P} (best {max(c.target_p):.2f})")
    fp32 = next((c for c in result.curves if c.dtype == "float32"), None)
    for c in result.curves:
        if fp32 is not None and c is not fp32:
            mean, largest = gaps(c, fp32)
            ok &= mean <= TOLERANCE
            parts.append(f"{c.dtype}'s mean gap to float32 {mean:.3f} {'<=' if mean <= TOLERANCE else '>'} "
                         f"{TOLERANCE} (max {largest:.3f})")
    head = "yes" if ok else "no"
    return ok, (f"VERDICT learns: {head} ({'; '.join(parts)}; P(target) >= {TARGET_P} within {result.steps} steps, "
                f"{result.device})")


def format_curves(result: LearnsResult, every: int = 5) -> str:
    shown = sorted({*range(0, result.steps + 1, every), result.steps})
    lines = ["| model.dtype (compute) | " + " | ".join(f"step {s}" for s in shown) + " | s |",
             "|---|" + "---|" * (len(shown) + 1)]
    for c in result.curves:
        lines.append(f"| {c.dtype} ({c.compute_dtype}) | " + " | ".join(f"{c.target_p[s]:.3f}" for s in shown)
                     + f" | {c.seconds:.1f} |")
    return "\n".join(lines)


def result_json(result: LearnsResult) -> dict:
    out = asdict(result)
    for c, d in zip(result.curves, out["curves"], strict=True):
        d["reached_at"] = c.reached_at
    return out


def result_from_json(data: dict) -> LearnsResult:
    curves = [Curve(**{k: v for k, v in c.items() if k != "reached_at"}) for c in data["curves"]]
    return LearnsResult(**{**data, "curves": curves})
