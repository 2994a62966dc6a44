"""The stale-sample corrections against TRL 1.16's implementations, on identical tensors, sequence by sequence and
token by token.

TRL's own code computes its side:

- ``opsm``: ``GRPOTrainer.get_off_policy_mask`` (DeepSeek-V3.2's rule, TRL's ``off_policy_mask_threshold``), and
  the whole loss through ``GRPOTrainer._compute_loss`` with that threshold set, on a minimal trainer (the tiny
  model, offline) whose forward is replaced by the given log-probs; the loss and its gradient with respect to every
  token's log-prob are compared.
- ``geo_mask``: the same ``get_off_policy_mask`` read both ways. For a negative advantage it keeps a sequence iff
  mean(log mu - log pi) <= delta, i.e. rho = exp(mean(log pi - log mu)) >= exp(-delta); with the two log-prob
  arguments swapped, iff rho <= exp(delta). Both with delta = log(geo_cap) is our band [1/geo_cap, geo_cap].
- ``geo_tis`` and ``tis``: ``_compute_loss`` with ``loss_type="cispo"``, whose weight is
  min(exp(log pi_theta - log pi_old), epsilon_high), detached, at ``importance_sampling_level`` "sequence" (the
  length-normalised, geometric-mean ratio: GSPO's) or "token". Given the behaviour log-probs as its
  ``old_per_token_logps`` and pi_theta == pi_old (the one-pass regime), that weight is ours: min(rho_i, geo_cap) or
  min(pi_old/mu, is_cap). The gradients are compared (CISPO's loss value is -w A log pi, ours -w A pi/pi_old).

TRL's own truncated / masked importance sampling against the engine (``vllm_importance_sampling_mode``) is computed
inside ``_generate_and_score_completions`` from vLLM's log-probs, not by a function these tests can call; its
sequence level is the product of the token ratios, not their geometric mean. ``age`` has no counterpart in TRL:
test_corrections.py checks it (and every other mode) against a plain loop over sequences.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.corrections import off_policy_correction
from ragen_async.algo.losses import PolicyLossInputs, policy_loss

INSTALL = "TRL is missing: pip install -e '.[peer]' (or '.[dev]'), the pinned trl the cross-check needs"
B, T = 8, 9


def _trl():
    try:
        import trl
    except ImportError as e:  # never skipped: a missing peer is a failure that says how to fix it
        pytest.fail(f"{INSTALL} ({e})", pytrace=False)
    return trl


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """One-pass tensors (pi_theta == pi_old) with an engine mu whose per-sequence mean log(mu/pi) spans about
    -0.3 .. 0.5 nats, advantages of both signs, right padding."""
    g = torch.Generator().manual_seed(seed)
    pi = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    shift = torch.linspace(-0.3, 0.5, B, dtype=torch.float64)[:, None]
    mu = pi + shift + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 4, 7, 1, 9, 6, 3, 8])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    adv = torch.tensor([1.1, -0.7, -0.4, 0.9, -1.3, 0.4, -0.2, -1.0], dtype=torch.float64)
    return {"pi": pi, "mu": mu, "mask": mask, "adv": adv}


@pytest.fixture(scope="module")
def make_trainer(tiny_model_path, tmp_path_factory):
    """``make_trainer(**config)``: a GRPOTrainer on the tiny model whose forward returns ``trainer.fixed``."""
    _trl()
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    class FixedForward(GRPOTrainer):
        fixed: torch.Tensor

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                               **kwargs):
            return self.fixed, torch.zeros_like(self.fixed), None

    def score(prompts, completions, **kwargs):
        return [0.0] * len(prompts)

    out = tmp_path_factory.mktemp("trl_corrections")

    def make(**overrides):
        args = dict(output_dir=str(out), use_cpu=True, report_to="none", per_device_train_batch_size=B,
                    num_generations=B, max_completion_length=T, learning_rate=1e-4, beta=0.0, epsilon=0.2,
                    epsilon_high=0.28, loss_type="bnpo", save_strategy="no", logging_strategy="no")
        args.update(overrides)
        trainer = FixedForward(model=tiny_model_path, reward_funcs=score, args=GRPOConfig(**args),
                               train_dataset=datasets.Dataset.from_dict({"prompt": ["0"] * B}))
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which these calls bypass
        trainer.model.train()
        return trainer

    return make


def _trl_loss(trainer, pi: torch.Tensor, b: dict[str, torch.Tensor], adv: torch.Tensor, **extra) -> torch.Tensor:
    trainer.fixed = pi
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": b["mask"],
              "advantages": adv, "num_items_in_batch": b["mask"].sum(), **extra}
    return trainer._compute_loss(trainer.model, inputs)


def _our_loss(pi: torch.Tensor, b: dict[str, torch.Tensor], adv: torch.Tensor, mode: str, **bounds):
    adv_t = adv[:, None].expand(B, T) if adv.dim() == 1 else adv
    return policy_loss(PolicyLossInputs(logprobs=pi, old_logprobs=pi.detach(), advantages=adv_t,
                                        mask=b["mask"].double(), behaviour_logprobs=b["mu"]),
                       clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=None, loss_agg_mode="token-mean",
                       off_policy=mode, **bounds)


def _grads(trl_loss, our_loss, trl_pi, our_pi):
    (g_trl,) = torch.autograd.grad(trl_loss, trl_pi)
    (g_ours,) = torch.autograd.grad(our_loss, our_pi)
    return g_trl, g_ours


# ---------------------------------------------------------------- opsm


@pytest.mark.parametrize("delta", [0.0, 0.05, 0.2])
@pytest.mark.parametrize("token_advantages", [False, True], ids=["sequence-advantage", "token-advantage"])
def test_opsm_mask_is_trls_off_policy_mask(delta, token_advantages):
    trl = _trl()
    for seed in range(3):
        b = _batch(seed)
        g = torch.Generator().manual_seed(100 + seed)
        adv = torch.randn(B, T, generator=g, dtype=torch.float64) if token_advantages else b["adv"][:, None]
        keep = trl.GRPOTrainer.get_off_policy_mask(advantages=adv, per_token_logps=b["pi"],
                                                   sampling_per_token_logps=b["mu"], mask=b["mask"].double(),
                                                   off_policy_threshold=delta)
        ours = off_policy_correction("opsm", old_logprobs=b["pi"], behaviour_logprobs=b["mu"],
                                     advantages=adv.expand(B, T), mask=b["mask"], opsm_delta=delta)
        trained = b["mask"] != 0
        trl_masked = (keep.expand(B, T) == 0) & trained
        assert torch.equal(ours.masked, trl_masked), f"seed {seed}"
        assert torch.equal(ours.weight, keep.expand(B, T).double() * trained)
        assert trl_masked.any() and (~trl_masked & trained).any()  # both outcomes occur


@pytest.mark.parametrize("token_advantages", [False, True], ids=["sequence-advantage", "token-advantage"])
def test_opsm_loss_and_gradient_agree_with_trls_compute_loss(make_trainer, token_advantages):
    delta = 0.05
    trainer = make_trainer(off_policy_mask_threshold=delta)
    for seed in range(3):
        b = _batch(seed)
        g = torch.Generator().manual_seed(200 + seed)
        adv = torch.randn(B, T, generator=g, dtype=torch.float64) if token_advantages else b["adv"]
        trl_pi, our_pi = b["pi"].clone().requires_grad_(True), b["pi"].clone().requires_grad_(True)
        # No old_per_token_logps: TRL's one-pass path (pi_old = pi_theta, detached); mu as the sampler's log-probs.
        trl_loss = _trl_loss(trainer, trl_pi, b, adv, sampling_per_token_logps=b["mu"])
        our_loss, metrics = _our_loss(our_pi, b, adv, "opsm", opsm_delta=delta)
        assert_close(our_loss, trl_loss.to(our_loss.dtype), rtol=1e-9, atol=1e-12)
        g_trl, g_ours = _grads(trl_loss, our_loss, trl_pi, our_pi)
        assert_close(g_ours, g_trl, rtol=1e-9, atol=1e-12)
        # sequences dropped and kept, both, and the comparison would see a missing mask
        assert 0.0 < metrics["corr_masked_frac"].item() < 1.0
        plain, _ = _our_loss(b["pi"], b, adv, "none")
        assert not torch.isclose(plain, trl_loss.double(), rtol=1e-6)


# ---------------------------------------------------------------- geo_mask


@pytest.mark.parametrize("geo_cap", [1.02, 1.1, 1.3])
def test_geo_mask_is_trls_off_policy_mask_read_both_ways(geo_cap):
    trl = _trl()
    delta = math.log(geo_cap)
    negative = -torch.ones(B, 1, dtype=torch.float64)  # every sequence "negative": the mask is the KL test alone
    for seed in range(3):
        b = _batch(seed)
        mask = b["mask"].double()
        keep_low = trl.GRPOTrainer.get_off_policy_mask(advantages=negative, per_token_logps=b["pi"],
                                                       sampling_per_token_logps=b["mu"], mask=mask,
                                                       off_policy_threshold=delta)  # rho >= 1/geo_cap
        keep_high = trl.GRPOTrainer.get_off_policy_mask(advantages=negative, per_token_logps=b["mu"],
                                                        sampling_per_token_logps=b["pi"], mask=mask,
                                                        off_policy_threshold=delta)  # rho <= geo_cap
        ours = off_policy_correction("geo_mask", old_logprobs=b["pi"], behaviour_logprobs=b["mu"],
                                     advantages=b["adv"][:, None].expand(B, T), mask=b["mask"], geo_cap=geo_cap)
        trained = b["mask"] != 0
        trl_masked = ((keep_low * keep_high).expand(B, T) == 0) & trained
        assert torch.equal(ours.masked, trl_masked), f"seed {seed}"
        if geo_cap < 1.3:
            assert (keep_low == 0).any() and (keep_high == 0).any()  # both sides of the band act


# ---------------------------------------------------------------- geo_tis and tis (TRL's CISPO weight)


@pytest.mark.parametrize(("mode", "level", "cap"), [("geo_tis", "sequence", 1.05), ("geo_tis", "sequence", 1.2),
                                                     ("tis", "token", 1.1), ("tis", "token", 1.5)])
def test_truncated_weights_agree_with_trls_cispo_weight(make_trainer, mode, level, cap):
    trainer = make_trainer(loss_type="cispo", importance_sampling_level=level, epsilon_high=cap)
    bounds = {"geo_cap": cap} if mode == "geo_tis" else {"is_cap": cap}
    for seed in range(3):
        b = _batch(seed)
        trl_pi, our_pi = b["pi"].clone().requires_grad_(True), b["pi"].clone().requires_grad_(True)
        # TRL's ratio pi_theta / pi_old with mu in pi_old's place: pi_old / mu in the one-pass regime.
        trl_loss = _trl_loss(trainer, trl_pi, b, b["adv"], old_per_token_logps=b["mu"])
        our_loss, metrics = _our_loss(our_pi, b, b["adv"], mode, **bounds)
        g_trl, g_ours = _grads(trl_loss, our_loss, trl_pi, our_pi)
        assert_close(g_ours, g_trl, rtol=1e-9, atol=1e-12)
        assert 0.0 < metrics["corr_truncated_frac"].item() < 1.0  # the cap bites on some tokens, not all
