"""Text the environments themselves generate: the corpus the tiny tokenizer is trained on and the
reply generator the tiny model is warm-started with.

Everything here goes through the real agent code (``agent.prompts`` for prompt text,
``agent.parsing.format_reply`` for reply text), so the tokenizer's merges fit exactly the text rollouts
produce. Replies are *task-agnostic*: uniformly random valid actions, a uniformly random number of
them per turn, and a short generic thought — the warm-started model learns the format and nothing
about the tasks. :class:`NoisyOraclePolicy` is the exception, for a *solver-derived* warm start
(``tinymodel.warmstart``): the oracle's moves with deliberate noise.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from ragen_async.agent.chat import ChatFormat
from ragen_async.agent.episode import AgentLimits, ReplyPolicy
from ragen_async.agent.parsing import format_reply
from ragen_async.agent.prompts import SYSTEM_PROMPT, feedback_user_message, first_user_message
from ragen_async.envs.base import TextEnv
from ragen_async.inference.base import Generation

ENV_TAGS: tuple[str, ...] = ("Bandit", "BanditTest", "SimpleSokoban", "LargerSokoban", "FrozenLake", "Countdown")
"""Every env tag the tiny model is built for (the registry's tags, as of this format version)."""

GENERIC_THOUGHTS: tuple[str, ...] = (
    "",
    "",
    "Let me try.",
    "I will act.",
    "Let me think.",
    "I am not sure.",
    "This may work.",
)
"""Think text of warm-start replies: short, generic, with no information about the task."""


ARM_NAMES: tuple[str, ...] = (
    "Tiger", "Turtle", "Eagle", "Owl", "Fox", "Wolf", "Bear", "Lion", "Rabbit", "Shark", "Falcon", "Snail",
    "Banker", "Pirate", "Monk", "Farmer", "Knight", "Wizard", "Sailor", "Miner", "Doctor", "Soldier", "Hermit",
    "Merchant", "Scholar", "Hunter", "Thief", "King", "Queen", "Rock", "River", "Storm", "Candle", "Anchor",
    "Rocket", "Mountain", "Feather", "Diamond", "Comet", "Oak", "Willow", "Lottery", "Casino", "Vault",
)
"""Extra arm names for bandit episodes in the tokenizer corpus and the warm start: with many names the
only way to name an arm is to copy it from the prompt, which is what the base policy must do."""


def make_env(tag: str) -> TextEnv:
    """A fresh environment for ``tag`` from the project's env registry, with its default options."""
    from ragen_async.envs.registry import make_env_from_tag

    return make_env_from_tag(tag)


def renamed_bandit(env: TextEnv, rng: random.Random, names: tuple[str, ...] = ARM_NAMES) -> TextEnv:
    """A copy of a bandit env (same config) whose two arm names are drawn from ``names``."""
    import dataclasses

    from ragen_async.envs.bandit import BanditEnv

    assert isinstance(env, BanditEnv)
    lo, hi = rng.sample(sorted(set(names)), 2)
    return BanditEnv(**{**dataclasses.asdict(env.config), "lo_arm_name": lo, "hi_arm_name": hi})


def is_bandit(env: TextEnv) -> bool:
    from ragen_async.envs.bandit import BanditEnv

    return isinstance(env, BanditEnv)


def random_reply_text(env: TextEnv, actions_left: int, max_actions_per_turn: int, rng: random.Random) -> str:
    """A well-formed reply (after the forced ``<think>`` prefix) with 1..max uniformly random actions."""
    n = rng.randint(1, max(1, min(max_actions_per_turn, actions_left)))
    actions = [env.random_action(rng) for _ in range(n)]
    return format_reply(actions, think=rng.choice(GENERIC_THOUGHTS))


def invalid_reply_text(env: TextEnv, actions_left: int, max_actions_per_turn: int, rng: random.Random,
                       foreign_actions: tuple[str, ...] = ()) -> str:
    """A reply a model might get wrong (an action outside the vocabulary, too many actions, an empty
    answer or no tags at all): used as *context* only, so the warm start sees how episodes continue
    after a bad turn without ever being trained to write one."""
    thought = rng.choice(GENERIC_THOUGHTS)
    cap = max(1, min(max_actions_per_turn, actions_left))
    own = set(env.valid_actions())
    foreign = [a for a in foreign_actions if a not in own] if env.action_lookup else []
    kind = rng.choice(("foreign", "too_many", "empty", "untagged"))
    if kind == "foreign" and foreign:
        return format_reply([rng.choice(foreign)], think=thought)
    if kind == "too_many":
        return format_reply([env.random_action(rng) for _ in range(cap + rng.randint(1, 2))], think=thought)
    if kind == "untagged":
        return f" {thought} {env.random_action(rng)}"
    return format_reply([], think=thought)


class RandomFormatPolicy(ReplyPolicy):
    """Scripted warm-start policy: :func:`random_reply_text` encoded through ``ChatFormat``, ending with
    the end-of-turn token — token-for-token what a model that learned the format would sample.

    With probability ``invalid_turn_prob`` a turn gets an :func:`invalid_reply_text` instead;
    ``history`` records, per reply since the last :meth:`start_episode`, whether it was one (the SFT
    loss mask leaves those replies out)."""

    def __init__(self, chat: ChatFormat, max_actions_per_turn: int, seed: int = 0, invalid_turn_prob: float = 0.0,
                 foreign_actions: tuple[str, ...] = (), agent_max_actions_per_turn: int | None = None):
        self.chat = chat
        self.max_actions_per_turn = max_actions_per_turn
        self.agent_max_actions_per_turn = agent_max_actions_per_turn or max_actions_per_turn
        """The parser's cap, which a "too many actions" invalid reply must exceed."""
        self.invalid_turn_prob = invalid_turn_prob
        self.foreign_actions = foreign_actions
        self.rng = random.Random(seed)
        self.history: list[bool] = []

    forced: tuple[str, list[str]] | None = None
    """(thought, actions) every reply uses instead of random ones while set (the bandit pairs)."""

    def start_episode(self) -> None:
        self.history = []

    async def reply(self, context_ids, env, actions_left, max_tokens, request_seed):
        invalid = self.forced is None and self.rng.random() < self.invalid_turn_prob
        if self.forced is not None:
            text = format_reply(self.forced[1], think=self.forced[0])
        elif invalid:
            text = invalid_reply_text(env, actions_left, self.agent_max_actions_per_turn, self.rng,
                                      self.foreign_actions)
        else:
            text = random_reply_text(env, actions_left, self.max_actions_per_turn, self.rng)
        self.history.append(invalid)
        ids = self.chat.encode(text) + [self.chat.end_of_turn_id]
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), start_version=0, end_version=0,
                          finish_reason="stop")


class NoisyOraclePolicy(ReplyPolicy):
    """Scripted policy of a solver-derived warm start: each reply carries ``actions_per_reply`` actions
    (fewer when fewer are left); each action is, with probability ``eps``, a uniformly random valid one,
    otherwise the oracle's next move (``env.oracle_actions``; random once no plan exists, e.g. a level
    made unsolvable). Actions after the first are planned from the state *before* the reply, as a model
    writing several moves at once would. ``kinds`` counts the actions by where they came from."""

    def __init__(self, chat: ChatFormat, eps: float, actions_per_reply: int = 1, seed: int = 0):
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"eps must be in [0, 1], got {eps}")
        if actions_per_reply < 1:
            raise ValueError(f"actions_per_reply must be >= 1, got {actions_per_reply}")
        self.chat = chat
        self.eps = eps
        self.actions_per_reply = actions_per_reply
        self.rng = random.Random(seed)
        self.kinds = {"oracle": 0, "random": 0, "no_plan": 0}

    async def reply(self, context_ids, env, actions_left, max_tokens, request_seed):
        n = max(1, min(self.actions_per_reply, actions_left))
        plan = env.oracle_actions(n)
        actions = []
        for i in range(n):
            if self.rng.random() < self.eps:
                kind, action = "random", env.random_action(self.rng)
            elif i < len(plan):
                kind, action = "oracle", plan[i]
            else:
                kind, action = "no_plan", env.random_action(self.rng)
            self.kinds[kind] += 1
            actions.append(action)
        text = format_reply(actions, think=self.rng.choice(GENERIC_THOUGHTS))
        ids = self.chat.encode(text) + [self.chat.end_of_turn_id]
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), start_version=0, end_version=0,
                          finish_reason="stop")


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """ChatML exactly as the tiny tokenizer's chat template renders it (used before a tokenizer exists)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def random_conversation(env: TextEnv, seed: int, rng: random.Random, limits: AgentLimits) -> list[dict[str, str]]:
    """One episode of ``env`` from ``seed`` played with random well-formed replies, as chat messages
    (the same messages ``play_episode`` would build; assistant turns start with the ``<think>`` prefix)."""
    state, _ = env.reset(seed=seed)
    budget = limits.max_actions_per_episode or env.max_actions_per_episode
    actions_left = budget
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": first_user_message(env, state, actions_left, budget, limits.max_tokens_per_turn)},
    ]
    for turn in range(1, limits.max_turns + 1):
        n = rng.randint(1, max(1, min(limits.max_actions_per_turn, actions_left)))
        actions = [env.random_action(rng) for _ in range(n)]
        messages.append({"role": "assistant", "content": "<think>" + format_reply(actions, rng.choice(GENERIC_THOUGHTS))})
        reward, done = 0.0, False
        for action in actions:
            state, step_reward, terminated, truncated, _ = env.step(action)
            reward += float(step_reward)
            actions_left -= 1
            if terminated or truncated:
                done = True
                break
        if done or actions_left <= 0 or turn == limits.max_turns:
            break
        messages.append({"role": "user", "content": feedback_user_message(
            reward, turn + 1, state, actions_left, limits.max_tokens_per_turn)})
    return messages


def corpus_texts(tags: tuple[str, ...], seeds_per_tag: int, seed: int = 0,
                 limits: AgentLimits | None = None, bandit_rename_prob: float = 0.0,
                 env_factory: Callable[[str], TextEnv] | None = None) -> Iterator[str]:
    """Rendered ChatML conversations: ``seeds_per_tag`` random episodes of every tag; a share
    ``bandit_rename_prob`` of bandit episodes use arm names from :data:`ARM_NAMES`."""
    limits = limits or AgentLimits()
    rng = random.Random(seed)
    for tag in tags:
        env = (env_factory or make_env)(tag)
        for episode_seed in range(seeds_per_tag):
            episode_env = renamed_bandit(env, rng) if is_bandit(env) and rng.random() < bandit_rename_prob else env
            yield render_chatml(random_conversation(episode_env, 10_000 * seed + episode_seed, rng, limits))
