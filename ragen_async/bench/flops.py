"""FLOPs of a learner step and the peaks they are divided by: MFU as torchtitan and verl count it.

**The count.** A matmul of an ``[n, a]`` by an ``[a, b]`` matrix is ``2·n·a·b`` FLOPs; a backward is twice
its forward (the gradients of the input and of the weight). For one forward of a decoder over sequences of
lengths ``L_i`` (real tokens, padding not counted) with the vocabulary head applied at ``S`` positions:

    F = 2 · N · Σ L_i  +  4 · layers · heads · head_dim · Σ L_i²  +  2 · d · V · S

* ``N``: every parameter but the embedding (a lookup, no FLOPs) and the vocabulary head (counted apart):
  the decoder layers' projections, their biases and norms, the final norm, and, for the critic, its
  one-output value head. This is torchtitan's ``6 · (parameters - embedding)`` and verl's dense ``6 · N``
  per token; biases and norms (0.03 % of Qwen2.5-0.5B's N) are counted as torchtitan counts them.
* The attention term is torchtitan's ``12 · layers · heads · head_dim · seq_len`` per token fwd+bwd summed
  over each sequence's tokens (verl: ``12 · Σ L_i² · head_dim · heads · layers``): ``QKᵀ`` and ``softmax·V``,
  each ``2 · L² · head_dim`` per query head, over the whole square: like both, causal masking is not
  discounted (an exact causal count is about half of it). Query heads, not KV heads: grouped-query
  attention shares K and V, not the products.
* The head: the learner computes vocabulary logits only at the trained positions (``TokenLogits``), so the
  head's ``2 · d · V`` counts per scored position, not per token. A tied head (Qwen2.5-0.5B) is the
  embedding's matrix, and its matmul is real compute: it is counted here although torchtitan, excluding the
  embedding's parameters, would leave a tied head out. (verl's estimate for Qwen2 puts the embedding and the
  head, ``2 · V · d``, in ``N`` for every token.)

A step's **model FLOPs** (MFU's numerator) are every forward the learner's step needs and a backward (2 ×
the forward) for each trained one: the actor's no-grad forward for the old log-probs (skipped when the step
is a single update: the update's own forward supplies them), the critic's no-grad forward for the old
values, the reference model's forward (KL runs), then per epoch the actor's and critic's forward and
backward. **Recompute** is counted apart: activation checkpointing runs each decoder layer's forward again
in backward, and the chunked log-prob head (``algo.head_logprobs_entropy``) recomputes a chunk's logits in
backward when a micro-batch scores more positions than one chunk. MFU excludes it; HFU (hardware FLOPs
utilisation) includes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """What the count needs of one model."""

    params: int
    """``N``: parameters multiplying every token: all but the embedding and the vocabulary head."""
    layers: int
    heads: int
    """Query heads."""
    head_dim: int
    vocab_head: int = 0
    """Parameters of the vocabulary head (``d · V``), applied at scored positions only; 0 for a model without
    one (the critic: its one-output value head is in ``params``)."""


def dims_of(model) -> ModelDims:
    """:class:`ModelDims` of a Hugging Face decoder (``…ForCausalLM`` or ``…ForTokenClassification``) from its
    parameters, as torchtitan counts them: unique parameters (a tied head once) less the embedding, less the
    vocabulary head where the model has an untied one; a tied or untied head becomes ``vocab_head``."""
    cfg = model.config
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = output.weight if output is not None else None
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    params = total - embedding.numel()
    if head is not None and head is not embedding:
        params -= head.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelDims(params=params, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads, head_dim=head_dim,
                     vocab_head=head.numel() if head is not None else 0)


def forward_flops(dims: ModelDims, lengths: Iterable[int], scored: int = 0, *, with_head: bool = True) -> float:
    """One forward of ``dims`` over sequences of ``lengths`` with the vocabulary head at ``scored`` positions;
    ``with_head=False``: the decoder layers and attention only (what activation checkpointing recomputes)."""
    lengths = [int(n) for n in lengths]
    tokens, square = sum(lengths), sum(n * n for n in lengths)
    flops = 2 * dims.params * tokens + 4 * dims.layers * dims.heads * dims.head_dim * square
    return float(flops + (2 * dims.vocab_head * scored if with_head else 0))


def flops_per_token(dims: ModelDims, seq_len: int, scored_share: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per token of sequences of ``seq_len`` tokens, ``scored_share`` of them
    scored by the head: torchtitan's ``6 · N + 12 · layers · heads · head_dim · seq_len`` plus the head."""
    return (6 * dims.params + 12 * dims.layers * dims.heads * dims.head_dim * seq_len
            + 6 * dims.vocab_head * scored_share)


@dataclass(frozen=True)
class StepPlan:
    """What one learner step runs, over the whole batch (a mini-batch split changes none of it)."""

    lengths: tuple[int, ...]
    """Real tokens per trajectory."""
    scored: int
    """Positions the actor's head scores per pass (the trained tokens)."""
    epochs: int = 1
    """Forward + backward passes of the actor and the critic (``learner.epochs``)."""
    actor_old_logprobs: bool = False
    """A no-grad actor forward for the old log-probs (not when the step is one update)."""
    critic: bool = True
    reference: bool = False
    checkpointing: bool = False
    """The actor's decoder layers run their forward again in backward (the critic is never checkpointed)."""
    head_recomputed: int = 0
    """Scored positions per epoch whose head logits backward recomputes (micro-batches over one chunk)."""


@dataclass(frozen=True)
class StepFlops:
    model: float
    """Every forward and backward the step needs once: MFU's numerator."""
    recompute: float
    """Forwards run again in backward (activation checkpointing, the chunked head): HFU adds them."""
    by_part: Mapping[str, float]
    """``model`` and ``recompute`` by part: actor_train, actor_old_logprobs, critic_train, critic_values,
    reference, actor_checkpointing, head_chunks."""

    @property
    def hardware(self) -> float:
        return self.model + self.recompute


def learner_step_flops(actor: ModelDims, critic: ModelDims | None, plan: StepPlan) -> StepFlops:
    """The FLOPs of one learner step (see the module docstring); ``critic`` is used when ``plan.critic``."""
    f_actor = forward_flops(actor, plan.lengths, plan.scored)
    parts = {"actor_train": 3 * f_actor * plan.epochs,
             "actor_old_logprobs": f_actor if plan.actor_old_logprobs else 0.0,
             "reference": f_actor if plan.reference else 0.0}
    if plan.critic:
        if critic is None:
            raise ValueError("plan.critic needs the critic's dims")
        f_critic = forward_flops(critic, plan.lengths)
        parts.update(critic_train=3 * f_critic * plan.epochs, critic_values=f_critic)
    recompute = {
        "actor_checkpointing": (forward_flops(actor, plan.lengths, with_head=False) * plan.epochs
                                if plan.checkpointing else 0.0),
        "head_chunks": 2.0 * actor.vocab_head * plan.head_recomputed * plan.epochs,
    }
    return StepFlops(model=sum(parts.values()), recompute=sum(recompute.values()), by_part={**parts, **recompute})


# ---- peaks ------------------------------------------------------------------------------------------------------

SPEC_PEAK_TFLOPS: tuple[tuple[str, dict[str, float] | None], ...] = (
    # (a substring of torch.cuda.get_device_name(), dense peaks by compute dtype), the first match wins.
    # NVIDIA's datasheets, without sparsity; "tfloat32": float32 matmuls with TF32 allowed.
    ("NVL", None),  # H100 NVL / H200 NVL: lower clocks than the SXM parts; not tabled
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "tfloat32": 494.7, "float32": 67.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "tfloat32": 378.0, "float32": 51.0}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "tfloat32": 494.7, "float32": 67.0}),  # SXM ("H100 80GB HBM3")
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "tfloat32": 156.0, "float32": 19.5}),
)


def spec_peak_flops(device_name: str | None, dtype: str, tf32: bool = False) -> float | None:
    """The device's dense spec peak in FLOP/s for matmuls in ``dtype`` (``float32`` with ``tf32`` allowed:
    the TF32 tensor-core peak), or ``None`` for a CPU (``device_name`` None) or a GPU not in the table."""
    if device_name is None:
        return None
    for key, peaks in SPEC_PEAK_TFLOPS:
        if key in device_name:
            if peaks is None:
                return None
            name = "tfloat32" if dtype == "float32" and tf32 else dtype
            return peaks[name] * 1e12 if name in peaks else None
    return None
