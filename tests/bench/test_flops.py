"""The FLOP count of training runs and of the learner benchmark (ragen_async/learner/flops.py, through
ragen_async/bench/flops.py) held to torchtitan's and verl's published formulas on a worked example counted here by
hand (Qwen2.5-0.5B), its plan of a step checked against the passes the real learner runs, the peaks it divides
by, and the learner's own MFU metrics."""

from __future__ import annotations

import pytest
import torch

from ragen_async.bench.components import PAPER, GroupShape
from ragen_async.bench.flops import (
    NO_PEAK,
    ModelDims,
    StepPlan,
    device_peak,
    dims_of,
    flops_per_token,
    learner_step_flops,
    tokens_per_s_per_gpu,
    train_flops,
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
    assert dims_of(actor) == ModelDims(params=N_ACTOR, layers=LAYERS, heads=HEADS, head_dim=HD)
    assert dims_of(critic) == ModelDims(params=N_CRITIC, layers=LAYERS, heads=HEADS, head_dim=HD)


def test_an_untied_head_is_in_n():
    """torchtitan subtracts the embedding only: an untied output head is a parameter like any other."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        untied = AutoModelForCausalLM.from_config(Qwen2Config(**{**QWEN_0_5B, "tie_word_embeddings": False}))
    assert sum(p.numel() for p in untied.parameters()) == N_ACTOR + 2 * EMBEDDING
    assert dims_of(untied) == ModelDims(params=N_ACTOR + EMBEDDING, layers=LAYERS, heads=HEADS, head_dim=HD)


ACTOR = ModelDims(params=N_ACTOR, layers=LAYERS, heads=HEADS, head_dim=HD)
CRITIC = ModelDims(params=N_CRITIC, layers=LAYERS, heads=HEADS, head_dim=HD)

# The published formulas, worked here by hand for Qwen2.5-0.5B and sequences of 4,000 tokens:
# torchtitan (get_num_flop_per_token): 6 * (parameters less the embedding) + 12 * l * h * q * t per token.
TORCHTITAN_PER_TOKEN = 6 * 357_898_112 + 12 * 24 * 14 * 64 * 4000
# verl (flops_counter.py, _estimate_qwen2_flops): dense N = (MLP 3 * d * ffn + attention d * (q + k + v + o))
# per layer, plus embedding and head 2 * V * d; 6 * dense N per token plus 12 * L^2 * head_dim * heads * layers
# per sequence, i.e. 12 * L * head_dim * heads * layers per token.
VERL_DENSE_N = (3 * 896 * 4864 + 896 * (14 * 64 + 2 * 64 + 2 * 64 + 14 * 64)) * 24 + 2 * 151_936 * 896
VERL_PER_TOKEN = 6 * VERL_DENSE_N + 12 * 4000 * 64 * 14 * 24


def test_the_worked_example_is_torchtitans_count_and_differs_from_verls_only_in_n():
    assert TORCHTITAN_PER_TOKEN == 3_179_580_672 and VERL_DENSE_N == 630_095_872
    assert VERL_PER_TOKEN == 4_812_767_232
    assert flops_per_token(ACTOR, 4000) == TORCHTITAN_PER_TOKEN
    lengths = [4000] * 8
    assert train_flops(ACTOR, lengths) == 32_000 * TORCHTITAN_PER_TOKEN
    # The attention terms agree; N differs by verl's embedding + head (every token, tied or not) less the biases
    # and norms it leaves out: 630.1 M against 357.9 M, so our count is 0.661 of verl's at this length.
    biases_and_norms = N_ACTOR - (VERL_DENSE_N - 2 * EMBEDDING)
    assert biases_and_norms == 24 * (14 * 64 + 2 * 2 * 64 + 2 * 896) + 896 == 71_552
    assert 32_000 * VERL_PER_TOKEN - train_flops(ACTOR, lengths) == 6 * 32_000 * (VERL_DENSE_N - N_ACTOR)
    assert train_flops(ACTOR, lengths) / (32_000 * VERL_PER_TOKEN) == pytest.approx(0.6607, abs=1e-4)


def test_tokens_per_s_per_gpu_is_verls_throughput():
    # verl's perf/throughput: every token of the batch (prompt + response) / (step time * GPUs)
    assert tokens_per_s_per_gpu(32_000, 4.0, 2) == 32_000 / (4.0 * 2) == 4000.0


def test_the_worked_example_a_paper_step_at_the_0_5b_shape():
    """docs/benchmarks.md's example: one rank's share of a paper step, 8 trajectories of 4,000 tokens, the paper
    config (critic, one update per step), activation checkpointing on."""
    lengths = [4000] * 8
    attention = 12 * 24 * 14 * 64 * 8 * 4000**2               # fwd + bwd over the whole square
    actor_train = 6 * N_ACTOR * 32_000 + attention
    critic_train = 6 * N_CRITIC * 32_000 + attention
    assert train_flops(ACTOR, lengths) == actor_train == 101_746_581_504_000
    assert train_flops(CRITIC, lengths) == critic_train == 101_746_753_728_000

    plan = StepPlan(lengths=tuple(lengths), epochs=1, actor_old_logprobs=False, critic=True, checkpointing=True)
    flops = learner_step_flops(ACTOR, CRITIC, plan)
    # actor forward + backward; critic: a no-grad forward for the old values (a third), then forward + backward
    assert flops.model == actor_train + critic_train + critic_train / 3 == pytest.approx(237_408_919_808_000)
    assert flops.recompute == actor_train / 3  # checkpointing: the actor's forward again
    assert flops.hardware == flops.model + flops.recompute
    # 237.4 TFLOP in a 1 s step on an H100 SXM (bf16 dense 989.4 TFLOP/s): 24.0 % MFU
    peak = device_peak("NVIDIA H100 80GB HBM3", "bfloat16")
    assert flops.model / 1.0 / peak.flops == pytest.approx(0.2400, abs=1e-4)
    assert str(peak).startswith("H100 SXM bfloat16 dense 989.4 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet")


def test_a_critic_whose_old_values_come_from_the_update_has_no_separate_forward():
    plan = StepPlan(lengths=(4000,) * 8, critic=True, critic_old_values=False)
    assert learner_step_flops(ACTOR, CRITIC, plan).model == train_flops(ACTOR, plan.lengths) \
        + train_flops(CRITIC, plan.lengths)


def test_a_step_with_two_epochs_old_log_probs_and_a_reference_counts_each_pass():
    plan = StepPlan(lengths=(10, 20), epochs=2, actor_old_logprobs=True, critic=False, reference=True)
    f = 2 * N_ACTOR * 30 + 4 * 24 * 14 * 64 * (100 + 400)     # one forward
    flops = learner_step_flops(ACTOR, None, plan)
    assert flops.model == 2 * 3 * f + f + f and flops.recompute == 0
    with pytest.raises(ValueError, match="critic"):
        learner_step_flops(ACTOR, None, StepPlan(lengths=(10,), critic=True))


def _learner(model_path, *overrides):
    from ragen_async.learner.learner import Learner

    cfg = load_config(PAPER_CONFIG, [f"model.path={model_path}", "learner.num_ranks=1", "model.dtype=float32",
                                     *overrides])
    return cfg, Learner(cfg, device="cpu")


def test_the_plan_of_a_paper_step(tiny_model_path):
    """The paper config on one rank's share (8 trajectories < mini_batch_size 32): one update, so no separate old
    log-prob pass (nor a separate critic pass for the old values where the learner takes them from the update)."""
    cfg, learner = _learner(tiny_model_path, "model.gradient_checkpointing=true")
    shard = make_shard(PAPER, 8, learner.actor.config.vocab_size, cfg)
    from_update = getattr(learner, "critic_values_from_update", False)
    assert step_plan(learner, shard) == StepPlan(lengths=(4000,) * 8, epochs=1, actor_old_logprobs=False,
                                                 critic=True, critic_old_values=not from_update, reference=False,
                                                 checkpointing=True)


class _Passes:
    """Tokens into each model's body (with and without grad) and its first decoder layer (recompute included).
    Pre-hooks: a checkpointed recompute stops once it has what backward needs, before a module's forward hooks
    would run."""

    def __init__(self, learner):
        self.rows: dict[str, int] = {}
        for name, model in {"actor": learner.actor, "critic": learner.critic, "ref": learner.ref}.items():
            if model is not None:
                model.base_model.register_forward_pre_hook(self._count(f"{name}_body", split=True), with_kwargs=True)
                model.base_model.layers[0].register_forward_pre_hook(self._count(f"{name}_layer0"), with_kwargs=True)

    def _count(self, key: str, split: bool = False):
        def hook(module, args, kwargs):
            x = args[0] if args else next(kwargs[k] for k in ("input_ids", "hidden_states", "input") if k in kwargs)
            k = f"{key}_{'grad' if torch.is_grad_enabled() else 'nograd'}" if split else key
            self.rows[k] = self.rows.get(k, 0) + x.shape[0] * x.shape[1]  # ids [B, T], hidden states [B, T, H]
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
    assert rows.get("critic_body_nograd", 0) == tokens * plan.critic * plan.critic_old_values
    assert rows.get("ref_body_nograd", 0) == tokens * plan.reference
    # what each case is for: the first recomputes, the second has the extra passes
    if not plan.checkpointing:
        assert plan.actor_old_logprobs and plan.reference and plan.epochs == 2


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
def test_datasheet_peaks(name, dtype, tf32, tflops):
    peak = device_peak(name, dtype, tf32=tf32)
    assert (None if peak is None else peak.flops) == (None if tflops is None else pytest.approx(tflops * 1e12))
    if peak is not None:  # named, with its source
        assert "datasheet" in peak.source and peak.name.endswith(f"{'tfloat32' if tf32 else dtype} dense")


def test_a_training_runs_learner_logs_achieved_tflops_and_on_a_cpu_no_mfu(tiny_model_path, caplog):
    """The learner's step metrics: its shard's model FLOPs (learner_step_flops, the bench's count) over its step,
    per rank; on a CPU there is no peak, so no ``learner/mfu``, and the log says so."""
    import logging

    from ragen_async.learner.flops import StepMeter

    with caplog.at_level(logging.INFO, logger="ragen_async.learner.flops"):
        cfg, learner = _learner(tiny_model_path, "learner.epochs=2", "learner.mini_batch_size=4")
    assert NO_PEAK in caplog.text
    shape = GroupShape("small", 8, prompt_tokens=20, turns=2, reply_tokens=5, feedback_tokens=7)
    shard = make_shard(shape, 8, learner.actor.config.vocab_size, cfg)
    metrics = learner.train_step(shard).metrics
    assert "learner/mfu" not in metrics and metrics["learner/tflops_per_gpu"] > 0
    plan = step_plan(learner, shard)
    meter = StepMeter(learner)
    assert meter.plan(plan.lengths, old_logprobs=True) == plan  # the learner counts the bench's plan
    flops = learner_step_flops(dims_of(learner.actor), dims_of(learner.critic), plan).model
    assert meter.metrics(plan.lengths, old_logprobs=True, seconds=2.0) == {"learner/tflops_per_gpu": flops / 2e12}
    # with a tabled device the same count is divided by its peak
    meter.peak = device_peak("NVIDIA H100 80GB HBM3", "float32")
    assert meter.metrics(plan.lengths, old_logprobs=True, seconds=2.0)["learner/mfu"] == flops / 2.0 / 67e12
