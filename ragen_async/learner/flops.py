"""A learner step's throughput and FLOPs, counted as verl and torchtitan count them, and the peaks MFU divides by.

Training runs log these figures and ``ragen-async bench learner`` reports them, both through this module.

**Tokens per second per GPU** (verl's ``perf/throughput``, :func:`tokens_per_s_per_gpu`): every token of the
step's trajectories, prompt and response alike (real tokens, padding not counted), over the whole step's wall
time (``timing/step_s``: waiting for the batch, the learner, the weight sync), divided by the number of learner
ranks. Beside it, ``throughput/learner_tokens_per_s`` counts only the trained (sampled) tokens over the
learner's own time.

**FLOPs** (torchtitan's ``get_num_flop_per_token``). A forward and a backward over a sequence of ``L`` tokens
cost, per token,

    6 · N  +  12 · layers · heads · head_dim · L

``N``: every parameter of the model but the embedding (each parameter once: a tied output head *is* the
embedding, so it is left out; an untied head is in ``N``). ``6 · N``: a matmul of a token by an ``[a, b]``
weight is ``2 · a · b`` FLOPs forward and twice that backward. The attention term is ``QKᵀ`` and ``softmax · V``
over the whole ``L x L`` square (causal masking not discounted), per query head. Summed over a batch's
sequences: ``6 · N · Σ L_i + 12 · layers · heads · head_dim · Σ L_i²`` (:func:`train_flops`), whose attention
term is verl's too (``12 · Σ L_i² · head_dim · heads · layers``). A forward alone is a third of it.
verl's ``N`` differs: its dense ``N`` is the attention projections' and the MLP's weights of every layer plus
``2 · V · d`` for the embedding and the output head at every token, tied or not, without biases and norms; on
Qwen2.5-0.5B it is 630.1 M against torchtitan's 357.9 M (``tests/bench/test_flops.py`` works the example).

A learner step's **model FLOPs** (:func:`learner_step_flops`) are every pass it needs once: per epoch the actor's
and the critic's forward and backward; the actor's no-grad forward for the old log-probs (not when the step is
one update: its own forward supplies them), the critic's no-grad forward for the old values (not when the step
is one update and the learner takes them from the update's forwards: ``Learner.critic_values_from_update``),
the reference's forward (KL runs). **Recompute** (activation checkpointing runs the actor's forward again in backward) is counted
apart: MFU leaves it out, HFU (hardware FLOPs utilisation) counts it.

**MFU** = model FLOPs / seconds / peak, per device. In a training run each learner rank counts its own shard over
its own step (``Learner.train_step``, as verl divides by the update's time) and the run logs the ranks' mean as
``learner/mfu``; the peak (:func:`device_peak`, :data:`PEAKS`) is the device's dense datasheet figure in the
compute dtype. A CPU, or a GPU not in the table, has none: "no peak: MFU not computed" (:data:`NO_PEAK`), and
only the achieved ``learner/tflops_per_gpu`` is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

NO_PEAK = "no peak: MFU not computed"
"""What is said instead of an MFU where the device has no tabled peak (a CPU, a GPU not in :data:`PEAKS`)."""


@dataclass(frozen=True)
class ModelDims:
    """What the count needs of one model."""

    params: int
    """torchtitan's ``N``: the model's parameters (each once) less the embedding."""
    layers: int
    heads: int
    """Query heads."""
    head_dim: int


def dims_of(model) -> ModelDims:
    """:class:`ModelDims` of a Hugging Face decoder (``…ForCausalLM``, ``…ForTokenClassification``, or one wrapped
    by DDP / FSDP2: ``numel`` of a sharded parameter is its whole size): unique parameters less the input
    embedding, as torchtitan counts them."""
    model = getattr(model, "module", model)
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelDims(params=total - model.get_input_embeddings().weight.numel(), layers=cfg.num_hidden_layers,
                     heads=cfg.num_attention_heads, head_dim=head_dim)


def flops_per_token(dims: ModelDims, seq_len: int) -> int:
    """torchtitan's training FLOPs (forward + backward) per token of a sequence of ``seq_len`` tokens."""
    return 6 * dims.params + 12 * dims.layers * dims.heads * dims.head_dim * seq_len


def train_flops(dims: ModelDims, lengths: Iterable[int]) -> int:
    """Forward + backward FLOPs over sequences of ``lengths`` real tokens: :func:`flops_per_token` summed over
    every token."""
    return sum(int(n) * flops_per_token(dims, int(n)) for n in lengths)


@dataclass(frozen=True)
class StepPlan:
    """What one learner step runs over its batch (a mini-batch split changes none of it)."""

    lengths: tuple[int, ...]
    """Real tokens per trajectory."""
    epochs: int = 1
    """Forward + backward passes of the actor and the critic (``learner.epochs``)."""
    actor_old_logprobs: bool = False
    """A no-grad actor forward for the old log-probs (not when the step is one update)."""
    critic: bool = True
    critic_old_values: bool = True
    """A no-grad critic forward for the old values (with ``critic``; not when the update's forwards supply them)."""
    reference: bool = False
    checkpointing: bool = False
    """The actor's forward runs again in backward (activation checkpointing; the critic is never checkpointed)."""


@dataclass(frozen=True)
class StepFlops:
    model: float
    """Every pass the step needs once: MFU's numerator."""
    recompute: float
    """Forwards run again in backward (activation checkpointing): HFU adds them."""

    @property
    def hardware(self) -> float:
        return self.model + self.recompute


def learner_step_flops(actor: ModelDims, critic: ModelDims | None, plan: StepPlan) -> StepFlops:
    """The FLOPs of one learner step (see the module docstring); ``critic`` is used when ``plan.critic``."""
    train = train_flops(actor, plan.lengths)
    forward = train / 3
    model = train * plan.epochs + forward * (plan.actor_old_logprobs + plan.reference)
    if plan.critic:
        if critic is None:
            raise ValueError("plan.critic needs the critic's dims")
        critic_train = train_flops(critic, plan.lengths)
        model += critic_train * plan.epochs + (critic_train / 3 if plan.critic_old_values else 0)
    return StepFlops(model=float(model), recompute=float(forward * plan.epochs if plan.checkpointing else 0.0))


# ---- peaks ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peak:
    """A device's dense peak for matmuls in one dtype: what MFU divides by."""

    flops: float
    """FLOP/s."""
    name: str
    """The device and dtype the figure is for, e.g. ``H100 SXM bfloat16 dense``."""
    source: str
    """Where the figure comes from."""

    def __str__(self) -> str:
        return f"{self.name} {self.flops / 1e12:g} TFLOP/s ({self.source})"


_H100 = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), dense: half its sparsity figures"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), dense: half its sparsity figures"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), dense: without sparsity"
PEAKS: tuple[tuple[str, str, dict[str, float] | None, str], ...] = (
    # (a substring of torch.cuda.get_device_name(), the part, dense TFLOP/s by compute dtype, source); the first
    # match wins. "tfloat32": float32 matmuls with TF32 allowed; "float32": without (the CUDA cores' rate).
    ("NVL", "H100 NVL / H200 NVL", None, "lower clocks than the SXM parts; not tabled"),
    ("H200", "H200 SXM", {"bfloat16": 989.4, "float16": 989.4, "tfloat32": 494.7, "float32": 67.0}, _H200),
    ("H100 PCIe", "H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "tfloat32": 378.0, "float32": 51.0}, _H100),
    ("H100", "H100 SXM", {"bfloat16": 989.4, "float16": 989.4, "tfloat32": 494.7, "float32": 67.0}, _H100),
    ("A100", "A100", {"bfloat16": 312.0, "float16": 312.0, "tfloat32": 156.0, "float32": 19.5}, _A100),
)
"""Dense peaks per device, by compute dtype, with their source."""


def device_peak(device_name: str | None, dtype: str, tf32: bool = False) -> Peak | None:
    """The dense peak of ``device_name`` (``torch.cuda.get_device_name()``) for matmuls in ``dtype`` (``float32``
    with ``tf32`` allowed: the TF32 tensor-core peak), or ``None`` for a CPU (``device_name`` None) or a GPU not
    in :data:`PEAKS`: then there is no MFU (:data:`NO_PEAK`)."""
    if device_name is None:
        return None
    for key, part, peaks, source in PEAKS:
        if key in device_name:
            name = "tfloat32" if dtype == "float32" and tf32 else dtype
            if peaks is None or name not in peaks:
                return None
            return Peak(flops=peaks[name] * 1e12, name=f"{part} {name} dense", source=source)
    return None


def tokens_per_s_per_gpu(tokens: float, step_s: float, ranks: int) -> float:
    """verl's ``perf/throughput``: ``tokens`` (prompt and response) over the step's wall time per learner rank."""
    return float(tokens) / max(step_s, 1e-9) / max(int(ranks), 1)


# ---- a training run's learner ---------------------------------------------------------------------------------

class StepMeter:
    """One learner rank's FLOPs and MFU per step, for the run's metrics (``Learner.train_step``)."""

    def __init__(self, learner) -> None:
        import torch

        self.actor = dims_of(learner.actor)
        self.critic = dims_of(learner.critic) if learner.critic is not None else None
        self.epochs = int(learner.cfg.learner.epochs)
        self.reference = learner.ref is not None
        self.values_from_update = bool(getattr(learner, "critic_values_from_update", False))
        self.checkpointing = bool(learner.cfg.model.gradient_checkpointing)
        device = torch.device(learner.device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        dtype = str(learner.compute_dtype).removeprefix("torch.")
        self.peak = device_peak(name, dtype, tf32=device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        if self.peak is None:
            log.info("learner on %s (%s compute): %s", name or device.type, dtype, NO_PEAK)

    def plan(self, lengths: Iterable[int], *, old_logprobs: bool) -> StepPlan:
        """The step's passes; ``old_logprobs`` False: the step is one update (its forwards supply the old
        log-probs, and the critic's old values where the learner takes them from there)."""
        return StepPlan(lengths=tuple(int(n) for n in lengths), epochs=self.epochs, actor_old_logprobs=old_logprobs,
                        critic=self.critic is not None, critic_old_values=old_logprobs or not self.values_from_update,
                        reference=self.reference, checkpointing=self.checkpointing)

    def metrics(self, lengths: Iterable[int], *, old_logprobs: bool, seconds: float) -> dict[str, float]:
        """``learner/tflops_per_gpu`` (model TFLOP over ``seconds``) and, where the device has a peak,
        ``learner/mfu``, for this rank's ``lengths`` (real tokens per trajectory of its shard)."""
        flops = learner_step_flops(self.actor, self.critic, self.plan(lengths, old_logprobs=old_logprobs)).model
        achieved = flops / max(seconds, 1e-9)
        out = {"learner/tflops_per_gpu": achieved / 1e12}
        if self.peak is not None:
            out["learner/mfu"] = achieved / self.peak.flops
        return out
