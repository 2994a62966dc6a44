"""Per-sample corrections of stale tokens (``algo.corrections``): by hand, against a deliberately plain loop over
sequences, through ``policy_loss``, and what the per-lag metrics report. TRL's implementations are checked in
test_corrections_trl.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.corrections import OFF_POLICY_MODES, off_policy_correction
from ragen_async.algo.diagnostics import lag_metrics, lag_sums
from ragen_async.algo.losses import PolicyLossInputs, policy_loss

NAN = float("nan")

# Two trajectories, d = log mu - log pi_old per token (row 1's last position is padding holding garbage):
#   row 0: d = 0.1, 0.2, 0.3 -> D0 = 0.2;  A = -1, -1, +1;  ages 4, 4, 4
#   row 1: d = -0.2, 0.0     -> D1 = -0.1; A = -1, -1;      ages 1, 2
D = [[0.1, 0.2, 0.3], [-0.2, 0.0, NAN]]
ADV = [[-1.0, -1.0, 1.0], [-1.0, -1.0, NAN]]
AGE = [[4, 4, 4], [1, 2, 99]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _hand(**kwargs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    old = torch.full((2, 3), -1.5, dtype=torch.float64)
    behaviour = old + torch.tensor(D, dtype=torch.float64)
    args = dict(old_logprobs=old, behaviour_logprobs=behaviour, advantages=torch.tensor(ADV, dtype=torch.float64),
                mask=torch.tensor(MASK, dtype=torch.float64), staleness=torch.tensor(AGE))
    return old, behaviour, {**args, **kwargs}


def _weights(mode: str, **kwargs) -> list[list[float]]:
    _, _, args = _hand()
    c = off_policy_correction(mode, **args, **kwargs)
    return c.weight.tolist(), c.masked.tolist(), c.truncated.tolist()


def test_opsm_by_hand() -> None:
    w, masked, truncated = _weights("opsm", opsm_delta=0.1)
    # D0 = 0.2 > 0.1: row 0's negative tokens go; D1 = -0.1: row 1 stays although its advantages are negative
    assert w == [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    assert masked == [[True, True, False], [False, False, False]]
    assert truncated == [[False] * 3, [False] * 3]
    w, masked, _ = _weights("opsm", opsm_delta=0.25)  # D0 = 0.2 <= 0.25: nothing masked
    assert w == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]] and not any(map(any, masked))


def test_geo_mask_and_geo_tis_by_hand() -> None:
    # |log rho0| = 0.2 > log C = 0.15: row 0 (all its tokens, either sign); |log rho1| = 0.1 stays
    w, masked, _ = _weights("geo_mask", geo_cap=math.exp(0.15))
    assert w == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert masked == [[True] * 3, [False] * 3]
    # rho0 = exp(-0.2) = 0.8187308 (below the cap: its own weight); rho1 = exp(0.1) = 1.1051709 -> exp(0.05)
    w, masked, truncated = _weights("geo_tis", geo_cap=math.exp(0.05))
    assert_close(torch.tensor(w, dtype=torch.float64), torch.tensor([[math.exp(-0.2)] * 3, [math.exp(0.05)] * 2 + [0.0]],
                                               dtype=torch.float64))
    assert truncated == [[False] * 3, [True, True, False]] and not any(map(any, masked))


def test_token_tis_and_decoupled_by_hand() -> None:
    # token ratio exp(-d): 0.9048374, 0.8187308, 0.7408182 | 1.2214028, 1.0; cap 1.1
    w, masked, truncated = _weights("tis", is_cap=1.1)
    assert_close(torch.tensor(w, dtype=torch.float64), torch.tensor([[math.exp(-0.1), math.exp(-0.2), math.exp(-0.3)], [1.1, 1.0, 0.0]],
                                               dtype=torch.float64))
    assert truncated == [[False] * 3, [True, False, False]] and not any(map(any, masked))
    w, masked, truncated = _weights("decoupled", is_cap=1.1)
    assert w[1] == [0.0, 1.0, 0.0] and masked == [[False] * 3, [True, False, False]]


def test_age_by_hand() -> None:
    # tau 2: row 0's ages 4 -> 2/4 = 0.5 on its negative tokens; row 1's ages 1, 2 <= tau -> 1
    w, masked, truncated = _weights("age", age_tau=2.0)
    assert w == [[0.5, 0.5, 1.0], [1.0, 1.0, 0.0]]
    assert truncated == [[True, True, False], [False] * 3] and not any(map(any, masked))
    w, _, truncated = _weights("age", age_tau=2.0, age_negatives_only=False)
    assert w == [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]] and truncated[0] == [True] * 3
    w, _, _ = _weights("age", age_tau=0.5)  # ages 1 and 2 now count too: 0.5, 0.25
    assert w == [[0.125, 0.125, 1.0], [0.5, 0.25, 0.0]]


def test_none_is_one_on_trained_tokens() -> None:
    w, masked, truncated = _weights("none")
    assert w == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]] and not any(map(any, masked)) and not any(map(any, truncated))


# ---------------------------------------------------------------- against a plain loop over sequences


def _loop_reference(mode: str, old, behaviour, adv, mask, age, *, is_cap, opsm_delta, geo_cap, age_tau,
                    age_negatives_only) -> list[list[float]]:
    """The corrections written out sequence by sequence with Python floats (the definitions of
    docs/experiments.md, "Corrections of stale samples"), independently of the tensor code."""
    out = []
    for i in range(len(mask)):
        trained = [t for t in range(len(mask[i])) if mask[i][t] != 0]
        d = {t: min(max(behaviour[i][t] - old[i][t], -20.0), 20.0) for t in trained}
        seq = sum(d.values()) / len(trained) if trained else 0.0  # D_i, the mean of log(mu / pi_old)
        row = [0.0] * len(mask[i])
        for t in trained:
            ratio = math.exp(-d[t])
            if mode == "none":
                w = 1.0
            elif mode == "tis":
                w = min(ratio, is_cap)
            elif mode == "decoupled":
                w = 0.0 if ratio > is_cap else ratio
            elif mode == "opsm":
                w = 0.0 if (adv[i][t] < 0 and seq > opsm_delta) else 1.0
            elif mode == "geo_mask":
                rho = math.exp(-seq)
                w = 0.0 if (rho > geo_cap or rho < 1.0 / geo_cap) else 1.0
            elif mode == "geo_tis":
                w = min(math.exp(-seq), geo_cap)
            else:  # age
                applies = adv[i][t] < 0 or not age_negatives_only
                w = age_tau / age[i][t] if (applies and age[i][t] > age_tau) else 1.0
            row[t] = w
        out.append(row)
    return out


def _random_batch(seed: int, per_token_advantages: bool) -> dict[str, torch.Tensor]:
    """Trajectories of varied length and mismatch: per row a log-ratio noise scale from 0.01 to 0.6 and a shift,
    so D_i lands on both sides of the thresholds; padding holds NaN/inf garbage."""
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 10
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = 0  # a row without trained tokens
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    scale = torch.tensor([0.01, 0.05, 0.1, 0.3, 0.6, 0.2] * 2, dtype=torch.float64)[:, None]
    shift = (torch.rand(B, 1, generator=g, dtype=torch.float64) - 0.3) * 0.2
    behaviour = old + shift + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    if per_token_advantages:
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    else:
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    age = torch.randint(0, 12, (B, T), generator=g)
    garbage = torch.tensor([NAN, float("inf"), -float("inf")], dtype=torch.float64)
    pad = mask == 0
    idx = torch.randint(0, 3, (B, T), generator=g)
    behaviour = torch.where(pad, garbage[idx], behaviour)
    adv = torch.where(pad, garbage[idx], adv)
    return dict(old_logprobs=old, behaviour_logprobs=behaviour, advantages=adv, mask=mask, staleness=age)


BOUNDS = dict(is_cap=1.3, opsm_delta=0.05, geo_cap=1.05, age_tau=3.0, age_negatives_only=True)


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
@pytest.mark.parametrize("per_token_advantages", [False, True], ids=["sequence-advantage", "token-advantage"])
def test_every_mode_matches_the_loop_over_sequences(mode: str, per_token_advantages: bool) -> None:
    for seed in range(4):
        batch = _random_batch(seed, per_token_advantages)
        for bounds in (BOUNDS, {**BOUNDS, "age_negatives_only": False, "opsm_delta": 0.0, "geo_cap": 1.2}):
            c = off_policy_correction(mode, **batch, **bounds)
            ref = _loop_reference(mode, *(batch[k].tolist() for k in ("old_logprobs", "behaviour_logprobs",
                                                                       "advantages", "mask", "staleness")), **bounds)
            assert_close(c.weight, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
            trained = batch["mask"] != 0
            ref_w = torch.tensor(ref, dtype=torch.float64)
            # masked: a trained token the correction zeroed (the raw ratio is never 0)
            assert torch.equal(c.masked, trained & (ref_w == 0))
            assert not (c.masked & c.truncated).any() and not (c.masked & ~trained).any()
    # the thresholds bite on these batches (the comparison is not between two all-ones tensors)
    if mode != "none":
        acted = [(lambda c: (c.masked | c.truncated).any())(off_policy_correction(mode, **_random_batch(s, True),
                                                                                    **BOUNDS)) for s in range(4)]
        assert any(acted)


def test_the_sequence_modes_act_per_trajectory() -> None:
    batch = _random_batch(3, per_token_advantages=True)
    for mode in ("geo_mask", "geo_tis"):
        c = off_policy_correction(mode, **batch, **BOUNDS)
        for i in range(c.weight.shape[0]):
            row = c.weight[i][batch["mask"][i] != 0]
            assert row.numel() == 0 or bool((row == row[0]).all()), (mode, i)


# ---------------------------------------------------------------- through policy_loss


def test_policy_loss_applies_the_weight_in_the_one_pass_regime() -> None:
    old, behaviour, args = _hand()
    logprobs = old.clone().requires_grad_(True)  # pi_theta == pi_old: the PPO ratio is 1 and its clip never acts
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=old, advantages=args["advantages"], mask=args["mask"],
                              behaviour_logprobs=behaviour, staleness=args["staleness"])
    base, m0 = policy_loss(inputs)
    # none: per token -A: 1 + 1 - 1 + 1 + 1 = 3 over 5 tokens
    assert_close(base, torch.tensor(0.6, dtype=torch.float64))
    assert "corr_masked_frac" not in m0
    loss, m = policy_loss(inputs, off_policy="opsm", opsm_delta=0.1)
    # row 0's two negative tokens masked, still in the denominator: (0 + 0 - 1 + 1 + 1) / 5
    assert_close(loss, torch.tensor(0.2, dtype=torch.float64))
    assert m["corr_masked_frac"].item() == pytest.approx(0.4)
    assert m["corr_truncated_frac"].item() == 0.0
    assert m["corr_weight_mean"].item() == pytest.approx(0.6)
    assert m["pg_clipfrac"].item() == 0.0  # the clip did nothing: only the correction acted
    loss.backward()
    assert logprobs.grad is not None
    # dL/dlogp = -A w / 5 on trained tokens
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -0.2], [0.2, 0.2, 0.0]], dtype=torch.float64))
    loss_age, m_age = policy_loss(inputs, off_policy="age", age_tau=2.0)
    assert_close(loss_age, torch.tensor((0.5 + 0.5 - 1 + 1 + 1) / 5, dtype=torch.float64))
    assert m_age["corr_truncated_frac"].item() == pytest.approx(0.4)


def test_policy_loss_refuses_age_without_staleness() -> None:
    old, behaviour, args = _hand()
    inputs = PolicyLossInputs(logprobs=old, old_logprobs=old, advantages=args["advantages"], mask=args["mask"],
                              behaviour_logprobs=behaviour)
    with pytest.raises(ValueError, match="staleness"):
        policy_loss(inputs, off_policy="age")
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(PolicyLossInputs(logprobs=old, old_logprobs=old, advantages=args["advantages"],
                                     mask=args["mask"]), off_policy="opsm")
    with pytest.raises(ValueError, match="valid modes"):
        off_policy_correction("opsm2", **args)
    with pytest.raises(ValueError, match="geo_cap must be > 1"):
        off_policy_correction("geo_tis", **args, geo_cap=1.0)
    with pytest.raises(ValueError, match="age_tau must be > 0"):
        off_policy_correction("age", **args, age_tau=0.0)


def test_garbage_in_padding_stays_out_of_loss_and_gradient() -> None:
    batch = _random_batch(1, per_token_advantages=True)
    logprobs = torch.where(batch["mask"] != 0, batch["old_logprobs"], torch.tensor(NAN, dtype=torch.float64))
    logprobs = logprobs.requires_grad_(True)
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=batch["old_logprobs"], advantages=batch["advantages"],
                              mask=batch["mask"], behaviour_logprobs=batch["behaviour_logprobs"],
                              staleness=batch["staleness"])
    for mode in OFF_POLICY_MODES:
        loss, metrics = policy_loss(inputs, off_policy=mode, **BOUNDS)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all(), mode
        assert all(torch.isfinite(v) for v in metrics.values()), mode
        logprobs.grad = None


# ---------------------------------------------------------------- per-lag metrics


def test_lag_metrics_report_what_the_correction_did_per_lag() -> None:
    old, behaviour, args = _hand()
    c = off_policy_correction("opsm", **args, opsm_delta=0.1)
    mask = args["mask"]
    sums = lag_sums(mask, args["staleness"], behaviour, old, args["advantages"], torch.tensor([0.0, 1.0]),
                    torch.tensor([0.0, 1.0]), 9, 0.2, 0.28, correction=c)
    out = lag_metrics(sums.tolist(), correction=True)
    # lag 4: row 0's three tokens, two masked: weights 0, 0, 1
    assert out["lag/4/corr_masked"] == pytest.approx(2 / 3)
    assert out["lag/4/corr_truncated"] == 0.0
    assert out["lag/4/corr_weight"] == pytest.approx(1 / 3)
    assert out["lag/4/corr_ess"] == pytest.approx(1 / 3)  # (0 + 0 + 1)^2 / (3 * 1): the kept share
    assert out["lag/4/corr_masked_seqs"] == 1.0  # row 0 (its oldest token is at lag 4) lost tokens
    assert out["lag/4/corr_truncated_seqs"] == 0.0
    # lags 1 and 2: row 1, untouched; its trajectory sits at its oldest token's lag, 2
    assert out["lag/1/corr_masked"] == 0.0 and out["lag/1/corr_ess"] == 1.0
    assert out["lag/2/corr_masked_seqs"] == 0.0 and "lag/1/corr_masked_seqs" not in out
    # over all lags: 2 of 5 tokens, 1 of 2 trajectories; ESS (1+1+1)^2 / (5 * 3) = 0.6
    assert out["correction/masked"] == pytest.approx(0.4)
    assert out["correction/masked_seqs"] == pytest.approx(0.5)
    assert out["correction/ess"] == pytest.approx(0.6)
    assert out["correction/weight"] == pytest.approx(0.6)
    # without the flag (off_policy none) nothing about corrections is logged, and the other metrics are unchanged
    plain = lag_metrics(sums.tolist())
    assert not any("corr" in k for k in plain)
    assert {k: v for k, v in out.items() if "corr" not in k} == plain


def test_lag_metrics_of_truncating_weights() -> None:
    old, behaviour, args = _hand()
    c = off_policy_correction("age", **args, age_tau=2.0)
    sums = lag_sums(args["mask"], args["staleness"], behaviour, old, args["advantages"], torch.zeros(2),
                    torch.zeros(2), 9, 0.2, 0.28, correction=c)
    out = lag_metrics(sums.tolist(), correction=True)
    # lag 4: weights 0.5, 0.5, 1 -> truncated 2/3, ESS 2^2 / (3 * 1.5) = 0.8888889
    assert out["lag/4/corr_truncated"] == pytest.approx(2 / 3)
    assert out["lag/4/corr_ess"] == pytest.approx(4 / 4.5)
    assert out["lag/4/corr_masked"] == 0.0 and out["lag/4/corr_masked_seqs"] == 0.0
    assert out["lag/4/corr_truncated_seqs"] == 1.0 and out["lag/2/corr_truncated_seqs"] == 0.0  # row 0, row 1
    assert out["correction/truncated_seqs"] == 0.5


def test_the_functions_defaults_are_the_configs() -> None:
    """A caller that leaves a bound out gets what a config that leaves it out gets."""
    import inspect

    from ragen_async.config import AlgoConfig

    cfg = AlgoConfig()
    for fn in (policy_loss, off_policy_correction):
        params = inspect.signature(fn).parameters
        for key in ("is_cap", "opsm_delta", "geo_cap", "age_tau", "age_negatives_only"):
            assert params[key].default == getattr(cfg, key), (fn.__name__, key)
