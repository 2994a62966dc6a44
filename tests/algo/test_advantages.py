"""Advantages: token rewards, masked GAE, group normalisation, broadcast."""

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.advantages import (
    GROUP_NORM_MODES,
    broadcast_to_tokens,
    compute_gae,
    group_normalize,
    scores_to_token_rewards,
)

NAN = float("nan")


# ---------------------------------------------------------------- token rewards


def test_scores_to_token_rewards_by_hand() -> None:
    scores = torch.tensor([2.0, -1.0, 5.0])
    mask = torch.tensor(
        [
            [0.0, 1.0, 1.0, 0.0, 1.0, 0.0],  # last sampled token at t=4
            [1.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # at t=1
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # no sampled token: no reward anywhere
        ]
    )
    expected = torch.zeros(3, 6)
    expected[0, 4] = 2.0
    expected[1, 1] = -1.0
    assert_close(scores_to_token_rewards(scores, mask), expected)


# ---------------------------------------------------------------- GAE


def _gae_loop_reference(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    """Plain-Python GAE over the sampled tokens of each row."""
    batch, length = mask.shape
    adv = [[0.0] * length for _ in range(batch)]
    ret = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        idx = [t for t in range(length) if mask[b, t].item() != 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            next_adv = delta + gamma * lam * next_adv
            adv[b][t] = next_adv
            ret[b][t] = next_adv + values[b, t].item()
            next_value = values[b, t].item()
    return adv, ret


def test_gae_by_hand_skips_env_tokens() -> None:
    # Row 0: sampled t=0,1 | env t=2,3 | sampled t=4 | pad t=5. Row 1: fully masked out.
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [0.0] * 6], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4, NAN], [NAN] * 6], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 7.0, 0.0, 1.0, 0.0], [0.0] * 6], dtype=torch.float64)  # 7.0 on env: ignored
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.5)
    # Sampled chain V = (0.5, 0.2, 0.4), r = (0, 0, 1), gamma*lambda = 0.45:
    # delta2 = 1 + 0.9*0 - 0.4 = 0.6            A2 = 0.6
    # delta1 = 0 + 0.9*0.4 - 0.2 = 0.16         A1 = 0.16 + 0.45*0.6 = 0.43
    # delta0 = 0 + 0.9*0.2 - 0.5 = -0.32        A0 = -0.32 + 0.45*0.43 = -0.1265
    # returns = A + V: 0.3735, 0.63, 1.0
    expected_adv = torch.tensor([[-0.1265, 0.43, 0.0, 0.0, 0.6, 0.0], [0.0] * 6], dtype=torch.float64)
    expected_ret = torch.tensor([[0.3735, 0.63, 0.0, 0.0, 1.0, 0.0], [0.0] * 6], dtype=torch.float64)
    assert_close(adv, expected_adv)
    assert_close(ret, expected_ret)


def test_gae_gamma_lambda_one_gives_return_minus_value() -> None:
    gen = torch.Generator().manual_seed(5)
    mask = (torch.rand(6, 10, generator=gen) < 0.6).to(torch.float64)
    scores = torch.randn(6, generator=gen, dtype=torch.float64)
    values = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    rewards = scores_to_token_rewards(scores, mask)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, gae_lambda=1.0)
    # RAGEN's setting: A_t = R - V_t and return_t = R on every sampled token.
    assert_close(adv, (scores[:, None] - values) * mask)
    assert_close(ret, scores[:, None].expand(6, 10) * mask)


@pytest.mark.parametrize(("gamma", "lam"), [(0.95, 0.9), (1.0, 1.0), (1.0, 0.95), (0.5, 1.0)])
def test_gae_matches_loop_reference(gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(6)
    mask = (torch.rand(5, 12, generator=gen) < 0.5).to(torch.float64)
    mask[3] = 0.0
    rewards = torch.randn(5, 12, generator=gen, dtype=torch.float64) * mask  # turn-level rewards on sampled tokens
    values = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma=gamma, gae_lambda=lam)
    ref_adv, ref_ret = _gae_loop_reference(rewards, values, mask, gamma, lam)
    assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))


def test_gae_no_grad_and_inputs_untouched() -> None:
    values = torch.randn(2, 4, requires_grad=True)
    mask = torch.ones(2, 4)
    rewards = torch.zeros(2, 4)
    before = values.detach().clone()
    adv, ret = compute_gae(rewards, values, mask, gamma=0.99, gae_lambda=0.95)
    assert not adv.requires_grad and not ret.requires_grad
    assert_close(values.detach(), before)


# ---------------------------------------------------------------- group normalisation


def test_group_normalize_by_hand() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 3.0])
    group_ids = torch.tensor([7, 7, 7, 7, 2, 2, 9])
    # Group 7: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503 -> +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
    # Group 2: std 0 -> 0. Group 9: singleton (std undefined) -> 0.
    z = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    assert_close(group_normalize(scores, group_ids, "mean_std"), torch.tensor([z, -z, -z, z, 0.0, 0.0, 0.0]))
    assert_close(group_normalize(scores, group_ids, "mean"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))
    identity = group_normalize(scores, group_ids, "identity")
    assert_close(identity, scores)
    assert identity.data_ptr() != scores.data_ptr()


def test_group_normalize_asym_clip_by_hand() -> None:
    # Group 0: fifteen 0s and one 1: mean 1/16, unbiased var (15/256 + 225/256) / 15 = 1/16, std 0.25.
    #   the 1 -> 0.9375 / 0.25 = 3.75 -> clamped to 3; the 0s -> -0.0625 / 0.25 = -0.25.
    # Group 1: the mirror image: the 0 -> -3.75 -> clamped to -1; the 1s -> +0.25.
    g0 = [0.0] * 15 + [1.0]
    g1 = [1.0] * 15 + [0.0]
    scores = torch.tensor(g0 + g1)
    ids = torch.tensor([0] * 16 + [1] * 16)
    out = group_normalize(scores, ids, "asym_clip")
    expected = torch.tensor([-0.25] * 15 + [3.0] + [0.25] * 15 + [-1.0])
    assert_close(out, expected, atol=1e-5, rtol=0)
    raw = group_normalize(scores, ids, "mean_std")
    assert raw[15].item() == pytest.approx(3.75, abs=1e-4)


def test_group_normalize_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mean_std"):
        group_normalize(torch.zeros(2), torch.zeros(2, dtype=torch.long), "zscore")


def _group_norm_loop_reference(scores: list[float], ids: list[int], mode: str) -> list[float]:
    out = []
    for s, g in zip(scores, ids, strict=True):
        members = [x for x, h in zip(scores, ids, strict=True) if h == g]
        mu = statistics.fmean(members)
        sigma = statistics.stdev(members) if len(members) > 1 else 0.0
        if mode == "identity":
            out.append(s)
        elif mode == "mean":
            out.append(s - mu)
        else:
            z = (s - mu) / (sigma + 1e-6) if sigma > 1e-6 else 0.0
            out.append(min(max(z, -1.0), 3.0) if mode == "asym_clip" else z)
    return out


@pytest.mark.parametrize("mode", GROUP_NORM_MODES)
def test_group_normalize_matches_loop_reference(mode: str) -> None:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 6, (30,), generator=gen) * 11  # sparse, unsorted labels
    scores = torch.randint(0, 3, (30,), generator=gen).to(torch.float64) + 0.1 * torch.randn(
        30, generator=gen, dtype=torch.float64
    )
    ids[0] = 1000  # force a singleton group
    before = scores.clone()
    out = group_normalize(scores, ids, mode)
    expected = _group_norm_loop_reference(scores.tolist(), ids.tolist(), mode)
    assert_close(out, torch.tensor(expected, dtype=torch.float64))
    assert_close(scores, before)  # input not mutated


def test_broadcast_to_tokens_by_hand() -> None:
    values = torch.tensor([0.5, -2.0])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert_close(broadcast_to_tokens(values, mask), torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]))
