"""The learner benchmark's FLOP count (ragen_async/bench/flops.py) on a worked example counted here by hand,
its plan of a step checked against the passes the real learner runs, and the peaks it divides by."""

from __future__ import annotations

import pytest
import torch

from ragen_async.bench.components import PAPER, GroupShape
from ragen_async.bench.flops import (
    ModelDims,
    StepPlan,
    dims_of,
    flops_per_token,
    forward_flops,
    learner_step_flops,
    spec_peak_flops,
)
from ragen_async.bench.learner import PAPER_CONFIG, QWEN_0_5B, make_shard, step_plan
from ragen_async.config import load_config

# Qwen2.5-0.5B by hand: hidden 896, 24 layers, 14 query heads and 2 KV heads of 64, MLP 4864, vocabulary 151,936.
D, LAYERS, HEADS, KV, HD, MLP, VOCAB = 896, 24, 14, 2, 64, 4864, 151_936
LAYER = (D * HEADS * HD + HEADS * HD        # q_proj, with bias
         + 2 * (D * KV * HD + KV * HD)      # k_proj, v_proj, with biases
         + HEADS * HD * D                   # o_proj, no bias
         + 3 * D * MLP                      # gate, up, down
         + 2 * D)                           # two RMSNorms
N_ACTOR = LAYERS * LAYER + D                # + the final norm; the embedding (= the tied head) left out
N_CRITIC = N_ACTOR + D + 1                  # + the value head, Linear(896, 1) with bias
EMBEDDING = VOCAB * D


def test_the_hand_count_is_qwen2_5_0_5b():
    assert N_ACTOR == 357_898_112 and EMBEDDING == 136_134_656
    assert N_ACTOR + EMBEDDING == 494_032_768  # Qwen2.5-0.5B's 0.49 B parameters


def test_dims_of_a_qwen_0_5b_shaped_actor_and_critic_match_the_hand_count():
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

    with torch.device("meta"):  # shapes only, no memory
        actor = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN_0_5B))
        critic = AutoModelForTokenClassification.from_config(Qwen2Config(**QWEN_0_5B, num_labels=1))
    assert dims_of(actor) == ModelDims(params=N_ACTOR, layers=LAYERS, heads=HEADS, head_dim=HD, vocab_head=EMBEDDING)
    assert dims_of(critic) == ModelDims(params=N_CRITIC, layers=LAYERS, heads=HEADS, head_dim=HD, vocab_head=0)


def test_an_untied_head_leaves_n_and_is_counted_as_the_head():
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        untied = AutoModelForCausalLM.from_config(Qwen2Config(**{**QWEN_0_5B, "tie_word_embeddings": False}))
    assert sum(p.numel() for p in untied.parameters()) == N_ACTOR + 2 * EMBEDDING
    assert dims_of(untied) == ModelDims(params=N_ACTOR, layers=LAYERS, heads=HEADS, head_dim=HD, vocab_head=EMBEDDING)


ACTOR = ModelDims(params=N_ACTOR, layers=LAYERS, heads=HEADS, head_dim=HD, vocab_head=EMBEDDING)
CRITIC = ModelDims(params=N_CRITIC, layers=LAYERS, heads=HEADS, head_dim=HD)


def test_torchtitans_per_token_form():
    # 6 N + 12 l h q t (torchtitan), plus the head's 6 d V on the scored half of the tokens
    assert flops_per_token(ACTOR, 4000, scored_share=0.5) == 6 * 357_898_112 + 12 * 24 * 14 * 64 * 4000 \
        + 6 * 896 * 151_936 * 0.5 == 3_587_984_640


def test_the_worked_example_a_paper_step_at_the_0_5b_shape():
    """docs/benchmarks.md's example: one rank's share of a paper step, 8 trajectories of 4,000 tokens with
    2,000 sampled each, the paper config (critic, one update per step), activation checkpointing on."""
    lengths, scored = [4000] * 8, 8 * 2000
    attention = 4 * 24 * 14 * 64 * 8 * 4000**2               # QK^T and AV over the whole square, per forward
    actor_forward = 2 * N_ACTOR * 32_000 + attention + 2 * EMBEDDING * scored
    critic_forward = 2 * N_CRITIC * 32_000 + attention
    assert forward_flops(ACTOR, lengths, scored) == actor_forward == 38_271_836_160_000
    assert forward_flops(CRITIC, lengths) == critic_forward == 33_915_584_576_000

    plan = StepPlan(lengths=tuple(lengths), scored=scored, epochs=1, actor_old_logprobs=False, critic=True,
                    checkpointing=True, head_recomputed=scored)
    flops = learner_step_flops(ACTOR, CRITIC, plan)
    # actor forward + backward; critic: a no-grad forward for the old values, then forward + backward
    assert flops.model == 3 * actor_forward + 4 * critic_forward == 250_477_846_784_000
    # checkpointing: the layers' forward again (no head); the chunked head: its logits again
    assert flops.recompute == (2 * N_ACTOR * 32_000 + attention) + 2 * EMBEDDING * scored == 38_271_836_160_000
    assert flops.hardware == flops.model + flops.recompute
    # 250.5 TFLOP in a 1 s step on an H100 SXM: 25.3 % MFU
    assert flops.model / 1.0 / spec_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(0.2532, abs=1e-4)


def test_a_step_with_two_epochs_old_log_probs_and_a_reference_counts_each_pass():
    plan = StepPlan(lengths=(10, 20), scored=7, epochs=2, actor_old_logprobs=True, critic=False, reference=True)
    f = 2 * N_ACTOR * 30 + 4 * 24 * 14 * 64 * (100 + 400) + 2 * EMBEDDING * 7
    flops = learner_step_flops(ACTOR, None, plan)
    assert flops.model == 2 * 3 * f + f + f and flops.recompute == 0
    with pytest.raises(ValueError, match="critic"):
        learner_step_flops(ACTOR, None, StepPlan(lengths=(10,), scored=1, critic=True))


def _learner(model_path, *overrides):
    from ragen_async.learner.learner import Learner

    cfg = load_config(PAPER_CONFIG, [f"model.path={model_path}", "learner.num_ranks=1", "model.dtype=float32",
                                     *overrides])
    return cfg, Learner(cfg, device="cpu")


def test_the_plan_of_a_paper_step(tiny_model_path):
    """The paper config on one rank's share (8 trajectories < mini_batch_size 32): one update, so no separate old
    log-prob pass; micro-batches of 4 rows score 8,000 positions each, over the 512-position chunk."""
    cfg, learner = _learner(tiny_model_path, "model.gradient_checkpointing=true")
    shard = make_shard(PAPER, 8, learner.actor.config.vocab_size, cfg)
    assert step_plan(learner, shard) == StepPlan(lengths=(4000,) * 8, scored=16_000, epochs=1,
                                                 actor_old_logprobs=False, critic=True, reference=False,
                                                 checkpointing=True, head_recomputed=16_000)


class _Passes:
    """Tokens into each model's body (with and without grad) and its first decoder layer (recompute included),
    and positions into the actor's vocabulary head (the chunked head's recompute included). Pre-hooks: a
    checkpointed recompute stops once it has what backward needs, before a module's forward hooks would run."""

    def __init__(self, learner):
        self.rows: dict[str, int] = {}
        for name, model in {"actor": learner.actor, "critic": learner.critic, "ref": learner.ref}.items():
            if model is not None:
                model.base_model.register_forward_pre_hook(self._count(f"{name}_body", split=True), with_kwargs=True)
                model.base_model.layers[0].register_forward_pre_hook(self._count(f"{name}_layer0"), with_kwargs=True)
        learner.actor.get_output_embeddings().register_forward_pre_hook(self._count("actor_head"), with_kwargs=True)

    def _count(self, key: str, split: bool = False):
        def hook(module, args, kwargs):
            x = args[0] if args else next(kwargs[k] for k in ("input_ids", "hidden_states", "input") if k in kwargs)
            k = f"{key}_{'grad' if torch.is_grad_enabled() else 'nograd'}" if split else key
            # ids [B, T] and hidden states [B, T, H]: tokens; the head's input [positions, H]: positions
            self.rows[k] = self.rows.get(k, 0) + (x.shape[0] if key == "actor_head" else x.shape[0] * x.shape[1])
        return hook


@pytest.mark.parametrize("overrides", [
    # one update per step, checkpointing, a chunk small enough that two of three micro-batches recompute it
    ["model.gradient_checkpointing=true", "learner.micro_batch_size=3", "learner.logits_chunk_tokens=25"],
    # two epochs of two mini-batches (a separate old log-prob pass) with a KL reference, no checkpointing
    ["learner.epochs=2", "learner.mini_batch_size=4", "algo.kl_coef=0.1", "learner.logits_chunk_tokens=1000"],
], ids=["single-update", "epochs-minibatches-reference"])
def test_the_plan_counts_the_passes_the_learner_runs(tiny_model_path, overrides):
    cfg, learner = _learner(tiny_model_path, *overrides)
    shape = GroupShape("small", 8, prompt_tokens=20, turns=2, reply_tokens=5, feedback_tokens=7)
    shard = make_shard(shape, 8, learner.actor.config.vocab_size, cfg)
    plan = step_plan(learner, shard)
    passes = _Passes(learner)
    learner.train_step(shard)

    tokens = sum(plan.lengths)  # equal lengths: no padding, so body tokens are real tokens
    rows = passes.rows
    assert rows.get("actor_body_grad", 0) == tokens * plan.epochs
    assert rows.get("actor_body_nograd", 0) == tokens * plan.actor_old_logprobs
    assert rows.get("actor_layer0", 0) == tokens * (plan.actor_old_logprobs + plan.epochs * (1 + plan.checkpointing))
    assert rows.get("critic_body_grad", 0) == tokens * plan.epochs * plan.critic
    assert rows.get("critic_body_nograd", 0) == tokens * plan.critic
    assert rows.get("ref_body_nograd", 0) == tokens * plan.reference
    assert rows.get("actor_head", 0) == plan.scored * (plan.actor_old_logprobs + plan.epochs) \
        + plan.head_recomputed * plan.epochs
    # what each case is for: the first recomputes (layers and head), the second has the extra passes
    if plan.checkpointing:
        assert plan.head_recomputed == 2 * 3 * 10 and plan.scored == 8 * 10
    else:
        assert plan.actor_old_logprobs and plan.reference and plan.epochs == 2 and plan.head_recomputed == 0


@pytest.mark.parametrize("name, dtype, tf32, tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", False, 989.4),
    ("NVIDIA H100 80GB HBM3", "float32", False, 67.0),
    ("NVIDIA H100 80GB HBM3", "float32", True, 494.7),
    ("NVIDIA H100 PCIe", "bfloat16", False, 756.0),
    ("NVIDIA H200", "bfloat16", False, 989.4),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", False, 312.0),
    ("NVIDIA A100 80GB PCIe", "float32", False, 19.5),
    ("NVIDIA H100 NVL", "bfloat16", False, None),
    ("NVIDIA GeForce RTX 4090", "bfloat16", False, None),
    (None, "bfloat16", False, None),
])
def test_spec_peaks(name, dtype, tf32, tflops):
    peak = spec_peak_flops(name, dtype, tf32=tf32)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))
