"""Losses: logits helpers, KL estimators, PPO policy loss (clip-higher, dual clip, off-policy), value loss."""

import math

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.losses import (
    PolicyLossInputs,
    entropy_from_logits,
    kl_estimate,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)

LN2 = math.log(2.0)


# ---------------------------------------------------------------- logits helpers


def test_entropy_from_logits_by_hand() -> None:
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [1000.0, 0.0]]])
    # [0, 0]: uniform over 2 -> ln 2 = 0.6931472
    # [0, ln 3]: p = (0.25, 0.75) -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616 = 0.5623351
    # [1000, 0]: p ~ (1, e^-1000) -> 0, and no overflow
    expected = torch.tensor([[LN2, 0.5623351, 0.0]])
    assert_close(entropy_from_logits(logits), expected, atol=1e-6, rtol=0)


def test_entropy_from_logits_equals_minus_sum_p_log_p() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 4, 11, generator=gen, dtype=torch.float64) * 3
    logp = torch.log_softmax(logits, dim=-1)
    assert_close(entropy_from_logits(logits), -(logp.exp() * logp).sum(-1))


def test_logprobs_from_logits() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    ids = torch.tensor([[1, 0]])
    # p(1) = 3/4 -> ln 0.75 = -0.2876821; uniform -> -ln 2
    assert_close(logprobs_from_logits(logits, ids), torch.tensor([[math.log(0.75), -LN2]]))
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 5, 13, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 13, (2, 5), generator=gen)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert_close(logprobs_from_logits(logits, ids), ref)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimate_by_hand() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # d = ln 0.5 - ln 0.25 = ln 2 = 0.6931472
    assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([LN2]))
    assert_close(kl_estimate(logp, ref, "kl"), torch.tensor([LN2]))
    assert_close(kl_estimate(logp, ref, "abs"), torch.tensor([LN2]))
    assert_close(kl_estimate(ref, logp, "abs"), torch.tensor([LN2]))
    assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * LN2**2]))  # 0.2402265
    assert_close(kl_estimate(logp, ref, "mse"), torch.tensor([0.5 * LN2**2]))
    # k3 = exp(-d) + d - 1 = 0.5 + 0.6931472 - 1 = 0.1931472
    assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 + LN2 - 1.0]))
    assert_close(kl_estimate(logp, ref, "low_var_kl"), torch.tensor([0.5 + LN2 - 1.0]))
    # d = -30: exp(clamp(30, max 20)) - 20 - 1 = 4.85e8 -> clamped to 10
    assert_close(kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), "k3"), torch.tensor([10.0]))
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_estimate(logp, ref, "full")


# ---------------------------------------------------------------- policy loss

# Four tokens (old log-prob 0, so r = exp(logp)), eps_low 0.2, eps_high 0.28, c = 3:
#   t0: r = 1.25, A = +1 -> inside [0.8, 1.28]: L = -1.25
#   t1: r = 4,    A = -1 -> L_clip = max(4, 1.28) = 4; dual clip min(4, 3) = 3
#   t2: r = 0.5,  A = -1 -> max(0.5, 0.8) = 0.8 (clipped below)
#   t3: r = 0.9,  A = +2 -> -1.8
RATIOS = [1.25, 4.0, 0.5, 0.9]
ADVANTAGES = [1.0, -1.0, -1.0, 2.0]


def _four_token_inputs() -> PolicyLossInputs:
    logprobs = torch.tensor([[math.log(r) for r in RATIOS]], dtype=torch.float64, requires_grad=True)
    return PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=torch.zeros(1, 4, dtype=torch.float64),
        advantages=torch.tensor([ADVANTAGES], dtype=torch.float64),
        mask=torch.ones(1, 4, dtype=torch.float64),
    )


def test_policy_loss_by_hand_with_dual_clip() -> None:
    inputs = _four_token_inputs()
    loss, metrics = policy_loss(inputs)
    # (-1.25 + 3 + 0.8 - 1.8) / 4 = 0.75 / 4
    assert_close(loss, torch.tensor(0.1875, dtype=torch.float64))
    assert metrics["pg_loss"].item() == pytest.approx(0.1875)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.25)  # only t2 takes the clipped branch
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(0.25)  # t2
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(0.0)
    assert metrics["pg_clipfrac_dual"].item() == pytest.approx(0.25)  # t1
    # k3(old || theta) = r - 1 - ln r: 0.0268564, 1.6137056, 0.1931472, 0.0053605 -> mean 0.4597674
    k3 = sum(r - 1 - math.log(r) for r in RATIOS) / 4
    assert metrics["ppo_kl"].item() == pytest.approx(k3)
    assert metrics["approx_kl_k3"].item() == pytest.approx(0.4597674, abs=1e-6)
    for value in metrics.values():
        assert not value.requires_grad
    loss.backward()
    # dL/dlogp = -A r / 4 on unclipped tokens, 0 on clipped / dual-clipped ones:
    # t0: -1.25 / 4 = -0.3125; t3: -2 * 0.9 / 4 = -0.45
    assert inputs.logprobs.grad is not None
    assert_close(inputs.logprobs.grad, torch.tensor([[-0.3125, 0.0, 0.0, -0.45]], dtype=torch.float64))


def test_policy_loss_without_dual_clip() -> None:
    loss, metrics = policy_loss(_four_token_inputs(), dual_clip_c=None)
    # t1 keeps L = 4: (-1.25 + 4 + 0.8 - 1.8) / 4 = 1.75 / 4
    assert_close(loss, torch.tensor(0.4375, dtype=torch.float64))
    assert metrics["pg_clipfrac_dual"].item() == 0.0


def test_clip_higher_asymmetry() -> None:
    # r = 1.25, A > 0: inside the clip-higher range (1.28), outside the symmetric one (1.2).
    inputs = PolicyLossInputs(
        logprobs=torch.tensor([[math.log(1.25)]], requires_grad=True),
        old_logprobs=torch.zeros(1, 1),
        advantages=torch.ones(1, 1),
        mask=torch.ones(1, 1),
    )
    loss_hi, m_hi = policy_loss(inputs, clip_eps_high=0.28)
    loss_sym, m_sym = policy_loss(inputs, clip_eps_high=0.2)
    assert loss_hi.item() == pytest.approx(-1.25)  # -A r
    assert loss_sym.item() == pytest.approx(-1.2)  # -A (1 + 0.2)
    assert m_hi["pg_clipfrac_high"].item() == 0.0 and m_hi["pg_clipfrac"].item() == 0.0
    assert m_sym["pg_clipfrac_high"].item() == 1.0 and m_sym["pg_clipfrac"].item() == 1.0
    # Clipped: no gradient; unclipped: -A r.
    (g_sym,) = torch.autograd.grad(loss_sym, inputs.logprobs)
    (g_hi,) = torch.autograd.grad(loss_hi, inputs.logprobs)
    assert g_sym.item() == 0.0
    assert g_hi.item() == pytest.approx(-1.25)


def _off_policy_inputs() -> PolicyLossInputs:
    # r = 1 everywhere, A = +1: per-token L = -1 before weighting.
    # behaviour log-probs chosen so that w = exp(old - mu) = (0.5, 3.0).
    return PolicyLossInputs(
        logprobs=torch.zeros(1, 2, dtype=torch.float64, requires_grad=True),
        old_logprobs=torch.zeros(1, 2, dtype=torch.float64),
        advantages=torch.ones(1, 2, dtype=torch.float64),
        mask=torch.ones(1, 2, dtype=torch.float64),
        behaviour_logprobs=torch.tensor([[LN2, -math.log(3.0)]], dtype=torch.float64),
    )


def test_tis_truncates_weights() -> None:
    inputs = _off_policy_inputs()
    loss, metrics = policy_loss(inputs, off_policy="tis", is_cap=2.0)
    # w = min((0.5, 3.0), 2) = (0.5, 2) -> L = (-0.5, -2) -> token-mean -1.25
    assert loss.item() == pytest.approx(-1.25)
    assert metrics["is_weight_mean"].item() == pytest.approx(1.75)  # raw (0.5 + 3) / 2
    assert metrics["is_weight_max"].item() == pytest.approx(3.0)
    assert metrics["is_capped_frac"].item() == pytest.approx(0.5)
    assert metrics["is_masked_frac"].item() == 0.0
    # k3(mu || old) = w - 1 - ln w: 0.5 - 1 + ln 2 = 0.1931472; 3 - 1 - ln 3 = 0.9013877 -> mean 0.5472674
    assert metrics["behaviour_kl_k3"].item() == pytest.approx(0.5472674, abs=1e-6)
    loss.backward()
    assert inputs.logprobs.grad is not None  # weights detached: grad = -A r w / 2 = (-0.25, -1.0)
    assert_close(inputs.logprobs.grad, torch.tensor([[-0.25, -1.0]], dtype=torch.float64))


def test_decoupled_masks_instead_of_truncating() -> None:
    inputs = _off_policy_inputs()
    loss, metrics = policy_loss(inputs, off_policy="decoupled", is_cap=2.0)
    # w = (0.5, 3.0); 3.0 > cap -> masked out, but still counted in the denominator (AReaL):
    # L = (-0.5, 0) -> (-0.5 + 0) / 2 = -0.25
    assert loss.item() == pytest.approx(-0.25)
    assert metrics["is_masked_frac"].item() == pytest.approx(0.5)
    assert metrics["is_capped_frac"].item() == pytest.approx(0.5)
    loss.backward()
    assert inputs.logprobs.grad is not None
    assert_close(inputs.logprobs.grad, torch.tensor([[-0.25, 0.0]], dtype=torch.float64))
    # No cap: plain importance weighting, (-0.5 - 3) / 2
    loss_nocap, _ = policy_loss(_off_policy_inputs(), off_policy="decoupled", is_cap=None)
    assert loss_nocap.item() == pytest.approx(-1.75)


def test_decoupled_clips_against_proximal_policy() -> None:
    # r = exp(logp - old) = 1.5 > 1.28 with A > 0 -> clipped at 1.28, then times w = exp(old - mu) = 0.5.
    inputs = PolicyLossInputs(
        logprobs=torch.tensor([[math.log(1.5)]], dtype=torch.float64),
        old_logprobs=torch.zeros(1, 1, dtype=torch.float64),
        advantages=torch.ones(1, 1, dtype=torch.float64),
        mask=torch.ones(1, 1, dtype=torch.float64),
        behaviour_logprobs=torch.tensor([[LN2]], dtype=torch.float64),
    )
    loss, _ = policy_loss(inputs, off_policy="decoupled")
    assert loss.item() == pytest.approx(-1.28 * 0.5)


def test_entropy_and_kl_terms() -> None:
    # r = 1, A = (1, -1) -> pg = (-1 + 1) / 2 = 0
    # entropy (1, 3) -> 2; k1 KL with logp = 0, ref = (-0.5, -1.5) -> (0.5, 1.5) -> 1
    # total = 0 - 0.1 * 2 + 0.5 * 1 = 0.3
    inputs = PolicyLossInputs(
        logprobs=torch.zeros(1, 2, requires_grad=True),
        old_logprobs=torch.zeros(1, 2),
        advantages=torch.tensor([[1.0, -1.0]]),
        mask=torch.ones(1, 2),
        entropy=torch.tensor([[1.0, 3.0]]),
        ref_logprobs=torch.tensor([[-0.5, -1.5]]),
    )
    loss, metrics = policy_loss(inputs, entropy_coef=0.1, kl_coef=0.5, kl_type="k1")
    assert loss.item() == pytest.approx(0.3)
    assert metrics["entropy"].item() == pytest.approx(2.0)
    assert metrics["kl_loss"].item() == pytest.approx(1.0)
    assert metrics["pg_loss"].item() == pytest.approx(0.0)
    # kl_coef = 0: the KL is still reported (tracked post hoc) but not added.
    loss0, metrics0 = policy_loss(inputs, entropy_coef=0.1)
    assert loss0.item() == pytest.approx(-0.2)
    assert metrics0["kl_loss"].item() == pytest.approx(1.0)


def test_policy_loss_argument_errors() -> None:
    inputs = _four_token_inputs()
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(inputs, off_policy="tis")
    with pytest.raises(ValueError, match="decoupled"):
        policy_loss(inputs, off_policy="vtrace")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(inputs, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(inputs, entropy_coef=0.01)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(inputs, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(inputs, loss_agg_mode="sum")


def _random_inputs(seed: int, batch: int = 6, length: int = 8) -> PolicyLossInputs:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, length, generator=gen) < 0.6).to(torch.float64)
    mask[1] = 0.0
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    return PolicyLossInputs(
        logprobs=(old + 0.4 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).requires_grad_(),
        old_logprobs=old,
        advantages=torch.randn(batch, length, generator=gen, dtype=torch.float64),
        mask=mask,
        behaviour_logprobs=old + 0.5 * torch.randn(batch, length, generator=gen, dtype=torch.float64),
        entropy=torch.rand(batch, length, generator=gen, dtype=torch.float64),
        ref_logprobs=old + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64),
    )


def _slice(inputs: PolicyLossInputs, rows: slice) -> PolicyLossInputs:
    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    return PolicyLossInputs(
        logprobs=inputs.logprobs[rows],
        old_logprobs=inputs.old_logprobs[rows],
        advantages=inputs.advantages[rows],
        mask=inputs.mask[rows],
        behaviour_logprobs=cut(inputs.behaviour_logprobs),
        entropy=cut(inputs.entropy),
        ref_logprobs=cut(inputs.ref_logprobs),
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("off_policy", ["none", "tis", "decoupled"])
def test_micro_batches_sum_to_full_batch_loss_and_grad(mode: str, off_policy: str) -> None:
    inputs = _random_inputs(11)
    kwargs = {"loss_agg_mode": mode, "off_policy": off_policy, "entropy_coef": 0.01, "kl_coef": 0.1, "kl_type": "k3"}
    full, _ = policy_loss(inputs, **kwargs)
    (full_grad,) = torch.autograd.grad(full, inputs.logprobs)
    num_tokens = inputs.mask.sum()
    num_seqs = (inputs.mask.sum(1) > 0).sum()
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, 6, 2):
        part, _ = policy_loss(
            _slice(inputs, slice(start, start + 2)), num_tokens=num_tokens, num_seqs=num_seqs, **kwargs
        )
        total = total + part
    (acc_grad,) = torch.autograd.grad(total, inputs.logprobs)
    assert_close(total, full)
    assert_close(acc_grad, full_grad)


def test_masked_out_rows_and_garbage_padding_keep_gradients_finite() -> None:
    inputs = _random_inputs(12)
    assert inputs.entropy is not None and inputs.ref_logprobs is not None
    pad = inputs.mask == 0
    nan_logprobs = torch.where(pad, torch.full_like(inputs.old_logprobs, float("nan")), inputs.logprobs.detach())
    nan_logprobs.requires_grad_()
    garbage = PolicyLossInputs(
        logprobs=nan_logprobs,
        old_logprobs=torch.where(pad, torch.full_like(inputs.old_logprobs, -1e30), inputs.old_logprobs),
        advantages=torch.where(pad, torch.full_like(inputs.advantages, float("inf")), inputs.advantages),
        mask=inputs.mask,
        behaviour_logprobs=torch.where(pad, torch.full_like(inputs.old_logprobs, float("nan")), inputs.old_logprobs),
        entropy=torch.where(pad, torch.full_like(inputs.old_logprobs, float("nan")), inputs.entropy),
        ref_logprobs=torch.where(pad, torch.full_like(inputs.old_logprobs, float("nan")), inputs.ref_logprobs),
    )
    for mode in ["none", "tis", "decoupled"]:
        loss, metrics = policy_loss(garbage, off_policy=mode, entropy_coef=0.01, kl_coef=0.1, kl_type="k3")
        (grad,) = torch.autograd.grad(loss, nan_logprobs)
        assert torch.isfinite(loss)
        assert torch.isfinite(grad).all()
        assert (grad[pad] == 0).all()
        assert grad[1].abs().sum().item() == 0.0  # the fully masked-out row gets no gradient
        assert all(torch.isfinite(v) for v in metrics.values())
    # A batch with no sampled token at all: loss 0, gradient 0.
    empty = PolicyLossInputs(
        logprobs=torch.zeros(2, 3, requires_grad=True),
        old_logprobs=torch.zeros(2, 3),
        advantages=torch.ones(2, 3),
        mask=torch.zeros(2, 3),
    )
    loss, _ = policy_loss(empty, loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    assert loss.item() == 0.0
    assert empty.logprobs.grad is not None and (empty.logprobs.grad == 0).all()


def test_clipfrac_sides_add_up_on_random() -> None:
    inputs = _random_inputs(13)
    _, metrics = policy_loss(inputs, dual_clip_c=None)
    # With A != 0 a token is clipped iff it is clipped low (A<0) or high (A>0).
    assert metrics["pg_clipfrac"].item() == pytest.approx(
        metrics["pg_clipfrac_low"].item() + metrics["pg_clipfrac_high"].item()
    )


# ---------------------------------------------------------------- value loss


def test_value_loss_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 0.0, 5.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 1.8, 1.0, 0.0]])
    returns = torch.tensor([[0.2, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # t0: (1 - 0.2)^2 = 0.64 vs clipped v = 0 + 0.5 -> (0.5 - 0.2)^2 = 0.09 -> 0.64
    # t1: (2 - 3)^2 = 1 vs clipped v = 1.8 + 0.2 = 2.0 -> 1 -> 1
    # t2: (0 - 0)^2 = 0 vs clipped v = 1 - 0.5 = 0.5 -> 0.25 -> 0.25 (clipped term active)
    # 0.5 * (0.64 + 1 + 0.25) / 3 = 0.315
    loss, metrics = value_loss(values, old_values, returns, mask, clip_range_value=0.5)
    assert loss.item() == pytest.approx(0.315)
    assert metrics["vf_loss"].item() == pytest.approx(0.315)
    assert metrics["vf_clipfrac"].item() == pytest.approx(1.0 / 3.0)
    assert metrics["vpred_mean"].item() == pytest.approx(1.0)  # (1 + 2 + 0) / 3
    loss.backward()
    # d/dv 0.5 (v - R)^2 / 3 = (v - R) / 3: t0 0.8/3, t1 -1/3; t2 clipped -> 0; t3 masked -> 0
    assert values.grad is not None
    assert_close(values.grad, torch.tensor([[0.8 / 3, -1.0 / 3, 0.0, 0.0]]))
    loss_noclip, _ = value_loss(values, old_values, returns, mask, clip_range_value=None)
    assert loss_noclip.item() == pytest.approx(0.5 * (0.64 + 1.0 + 0.0) / 3)
