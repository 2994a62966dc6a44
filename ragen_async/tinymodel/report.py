"""The builder's sanity check: how the built base policy plays, per env tag.

Episodes go through the real agent path (``play_episode`` + ``ChatFormat``) with the transformers
engine (``inference.hf_engine.HFEngine``) sampling at temperature 1. Reported per tag: the share of
turns whose reply is well formed (``parse_reply(...).format_ok``), the success rate next to that of a
uniformly random valid policy on the same seeds, reply length, and how the model's actions spread over
the action vocabulary (a format-only warm start should choose roughly uniformly).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ragen_async.tinymodel import corpus
from ragen_async.tinymodel.build import DEFAULT_OUT_DIR, TinyModelConfig, ensure_tiny_model


@dataclass
class TagReport:
    tag: str
    episodes: int = 0
    turns: int = 0
    format_ok_turns: int = 0
    successes: int = 0
    random_successes: int = 0
    reply_tokens: int = 0
    actions: int = 0
    truncated_replies: int = 0
    """Replies cut off by the token limit (no end-of-turn token)."""
    action_counts: dict[str, int] = field(default_factory=dict)
    """Per action name (tags with an action vocabulary only)."""
    wall_s: float = 0.0

    @property
    def format_valid_rate(self) -> float:
        return self.format_ok_turns / max(1, self.turns)

    @property
    def success_rate(self) -> float:
        return self.successes / max(1, self.episodes)

    @property
    def random_success_rate(self) -> float:
        return self.random_successes / max(1, self.episodes)

    @property
    def mean_reply_tokens(self) -> float:
        return self.reply_tokens / max(1, self.turns)

    @property
    def action_shares(self) -> dict[str, float]:
        total = sum(self.action_counts.values())
        return {a: n / total for a, n in sorted(self.action_counts.items())} if total else {}

    @property
    def action_entropy(self) -> float | None:
        """Entropy of the action histogram over log(number of actions): 1 = perfectly uniform."""
        shares = [s for s in self.action_shares.values() if s > 0]
        if len(self.action_counts) < 2:
            return None
        return -sum(s * math.log(s) for s in shares) / math.log(len(self.action_counts))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(format_valid_rate=self.format_valid_rate, success_rate=self.success_rate,
                 random_success_rate=self.random_success_rate, mean_reply_tokens=self.mean_reply_tokens,
                 action_shares=self.action_shares, action_entropy=self.action_entropy)
        return d


async def _evaluate_tag(engine, chat, tag: str, seeds: list[int], limits, temperature: float,
                        sampling_base: int) -> TagReport:
    from ragen_async.agent.episode import EnginePolicy, ScriptedPolicy, play_episode

    report = TagReport(tag=tag)
    t0 = time.perf_counter()
    policy = EnginePolicy(engine, temperature=temperature, stop_token_ids=(chat.end_of_turn_id,))
    envs = [corpus.make_env(tag) for _ in seeds]
    trajs = await asyncio.gather(*[
        play_episode(policy, chat, env, tag, seed, limits, traj_id=f"{tag}/{seed}",
                     sampling_seed=sampling_base + 7_919 * seed + i)
        for i, (env, seed) in enumerate(zip(envs, seeds, strict=True))])
    vocab = {name for env in envs for name in (env.action_lookup or {}).values()}
    report.action_counts = dict.fromkeys(sorted(vocab), 0)
    for traj in trajs:
        report.episodes += 1
        report.successes += int(traj.success)
        for turn in traj.turns:
            report.turns += 1
            report.format_ok_turns += int(turn.format_ok)
            report.reply_tokens += turn.response_tokens
            report.actions += len(turn.actions)
            if vocab:
                for action in turn.actions:
                    report.action_counts[action] += 1
        # A reply without the end-of-turn token was cut by the token limit.
        report.truncated_replies += _count_unterminated(traj, chat.end_of_turn_id)
    random_policy = ScriptedPolicy(chat, "random", limits.max_actions_per_turn, seed=sampling_base)
    for seed in seeds:
        traj = await play_episode(random_policy, chat, corpus.make_env(tag), tag, seed, limits)
        report.random_successes += int(traj.success)
    report.wall_s = time.perf_counter() - t0
    return report


def _count_unterminated(traj, eot_id: int) -> int:
    """Sampled spans (runs of loss-mask 1) that do not end with the end-of-turn token."""
    n, prev = 0, 0
    ids, mask = traj.token_ids, traj.loss_mask
    for i in range(len(mask)):
        if prev == 1 and mask[i] == 0 and ids[i - 1] != eot_id:
            n += 1
        prev = mask[i]
    if prev == 1 and ids[-1] != eot_id:
        n += 1
    return n


def evaluate_base_policy(model_dir: Path | str, tags: tuple[str, ...] = corpus.ENV_TAGS, seeds_per_tag: int = 64,
                         temperature: float = 1.0, seed: int = 0, limits=None,
                         num_threads: int | None = 2) -> dict[str, TagReport]:
    """Play ``seeds_per_tag`` episodes (seeds 0..n-1) of every tag with the model at ``model_dir``."""
    import torch

    from ragen_async.agent.chat import ChatFormat
    from ragen_async.agent.episode import AgentLimits
    from ragen_async.inference.hf_engine import HFEngine

    limits = limits or AgentLimits()
    prev_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    engine = HFEngine(str(model_dir), dtype="float32", seed=seed)
    try:
        chat = ChatFormat.from_pretrained(model_dir)
        seeds = list(range(seeds_per_tag))
        return {tag: asyncio.run(_evaluate_tag(engine, chat, tag, seeds, limits, temperature, 1_000 * seed))
                for tag in tags}
    finally:
        engine.shutdown()
        torch.set_num_threads(prev_threads)


def format_table(reports: dict[str, TagReport]) -> str:
    header = (f"{'env tag':<14} {'episodes':>8} {'turns':>6} {'format-valid':>12} {'success':>8} "
              f"{'random succ':>11} {'reply tok':>9} {'act/turn':>8} {'uniformity':>10}  action shares")
    lines = [header, "-" * len(header)]
    for tag, r in reports.items():
        uniformity = "-" if r.action_entropy is None else f"{r.action_entropy:.3f}"
        shares = " ".join(f"{a} {s:.2f}" for a, s in r.action_shares.items()) or "(free-form)"
        lines.append(
            f"{tag:<14} {r.episodes:>8} {r.turns:>6} {r.format_valid_rate:>12.1%} {r.success_rate:>8.1%} "
            f"{r.random_success_rate:>11.1%} {r.mean_reply_tokens:>9.1f} {r.actions / max(1, r.turns):>8.2f} "
            f"{uniformity:>10}  {shares}")
    lines.append("uniformity = entropy of the action histogram / log(#actions) (1.0 = uniform); "
                 "random succ = uniformly random valid policy on the same seeds")
    return "\n".join(lines)


def report_base_policy(model_dir: Path | str, seeds_per_tag: int = 64, save: bool = True, **kwargs: Any) -> dict[str, TagReport]:
    """Evaluate, print the table and (``save``) write ``base_policy_report.json`` next to the model."""
    t0 = time.perf_counter()
    reports = evaluate_base_policy(model_dir, seeds_per_tag=seeds_per_tag, **kwargs)
    print(format_table(reports), flush=True)
    print(f"(transformers engine, temperature {kwargs.get('temperature', 1.0)}, {seeds_per_tag} seeds per tag, "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    arms = report_arm_probabilities(model_dir)
    if save:
        out = {"seeds_per_tag": seeds_per_tag, "engine": "hf", "temperature": kwargs.get("temperature", 1.0),
               "tags": {tag: r.to_dict() for tag, r in reports.items()}, "bandit_arms": arms}
        (Path(model_dir) / "base_policy_report.json").write_text(json.dumps(out, indent=2) + "\n")
    return reports


def report_arm_probabilities(model_dir: Path | str) -> dict[str, Any]:
    """Print (and return) :func:`arm_probabilities` for the default bandit: the base model's lean."""
    arms = arm_probabilities(model_dir)
    print(f"Bandit, exact from the model's probabilities: P({arms['best_arm']}) = {arms['p_best_arm']:.3f} "
          f"(unbiased: 0.5; the scored replies carry {arms['scored_mass']:.0%} of the model's probability)",
          flush=True)
    return arms


class _FirstContext:
    """A reply policy that records the context of the first turn and answers with the first action."""

    def __init__(self, chat):
        self.chat = chat
        self.context: list[int] | None = None

    def start_episode(self) -> None:
        pass

    async def reply(self, context_ids, env, actions_left, max_tokens, request_seed):
        from ragen_async.agent.parsing import format_reply
        from ragen_async.inference.base import Generation

        self.context = list(context_ids)
        ids = self.chat.encode(format_reply([env.valid_actions()[0]])) + [self.chat.end_of_turn_id]
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), start_version=0, end_version=0,
                          finish_reason="stop")


def arm_probabilities(model_dir: Path | str, tag: str = "Bandit", seeds: range = range(8)) -> dict[str, Any]:
    """The base model's exact probability of answering each arm of bandit ``tag`` (no sampling).

    Per seed, every reply ``<generic thought> </think> <answer> ARM </answer><|im_end|>`` is scored
    with the model (``corpus.GENERIC_THOUGHTS`` x arms): P(arm) = sum over thoughts of P(reply) /
    sum over all scored replies. ``scored_mass`` is how much of the model's probability those replies
    carry (the rest goes to other thoughts or malformed replies)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ragen_async.agent.chat import ChatFormat
    from ragen_async.agent.episode import AgentLimits, play_episode
    from ragen_async.agent.parsing import format_reply

    chat = ChatFormat.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    env = corpus.make_env(tag)
    arms = list(env.valid_actions())
    best = env.config.best_arm_name
    shares, masses = [], []
    for seed in seeds:
        recorder = _FirstContext(chat)
        asyncio.run(play_episode(recorder, chat, env, tag, seed, AgentLimits()))
        context = recorder.context
        replies = [(arm, chat.encode(format_reply([arm], think)) + [chat.end_of_turn_id])
                   for arm in arms for think in dict.fromkeys(corpus.GENERIC_THOUGHTS)]
        length = len(context) + max(len(r) for _, r in replies)
        ids = torch.full((len(replies), length), chat.tokenizer.pad_token_id, dtype=torch.long)
        for row, (_, reply) in enumerate(replies):
            ids[row, :len(context) + len(reply)] = torch.tensor(context + reply)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        token_logp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        seq_p = torch.stack([token_logp[row, len(context) - 1:len(context) - 1 + len(reply)].sum()
                             for row, (_, reply) in enumerate(replies)]).exp()
        total = float(seq_p.sum())
        shares.append({arm: float(sum(p for (a, _), p in zip(replies, seq_p.tolist(), strict=True) if a == arm)) / total
                       for arm in arms})
        masses.append(total)
    mean = {arm: sum(s[arm] for s in shares) / len(shares) for arm in arms}
    return {"tag": tag, "best_arm": best, "p_arm": mean, "p_best_arm": mean[best],
            "scored_mass": sum(masses) / len(masses), "seeds": len(shares)}


def make_model(out_dir: Path | str = DEFAULT_OUT_DIR, seed: int = 0, force: bool = False,
               sft_steps: int | None = None, report: bool = True, seeds_per_tag: int = 64) -> Path:
    """Build the tiny model into ``out_dir`` unless a complete build of the same config is there, then
    print the base model's exact bandit arm probabilities and (``report``) a table of how it plays
    every env tag (transformers engine, a few minutes on 2 cores)."""
    overrides = {} if sft_steps is None else {"sft_steps": sft_steps}
    path = ensure_tiny_model(Path(out_dir), seed=seed, config=TinyModelConfig(**overrides), force=force)
    if report:
        report_base_policy(path, seeds_per_tag=seeds_per_tag)
    else:
        report_arm_probabilities(path)
    return path
