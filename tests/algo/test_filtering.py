"""StarPO-S reward-std group filter."""

from fractions import Fraction

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.advantages import group_normalize
from ragen_async.algo.filtering import select_groups_by_reward_std


def _scores() -> torch.Tensor:
    # std (unbiased): g0 0 | g1 [0,1,2] -> 1 | g2 [0,0,3]: mean 1, var (1+1+4)/2 = 3 -> 1.7320508 | g3 0
    return torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]])


def test_std_keeps_highest_and_metrics_by_hand() -> None:
    kept, metrics = select_groups_by_reward_std(_scores(), keep_ratio=0.5, mode="std")  # k = int(0.5 * 4) = 2
    assert kept.tolist() == [1, 2]
    assert kept.dtype == torch.long
    s3 = 3.0**0.5
    expected = {
        "in_group_std": (0.0 + 1.0 + s3 + 0.0) / 4,  # 0.6830127
        "in_group_mean": (0.0 + 1.0 + 1.0 + 1.0) / 4,  # 0.75
        "in_group_max": (0.0 + 2.0 + 3.0 + 1.0) / 4,  # 1.5
        "chosen_in_group_std": (1.0 + s3) / 2,  # 1.3660254
        "chosen_in_group_mean": 1.0,
        "chosen_in_group_max": 2.5,
        "kept_groups": 2.0,
        "kept_fraction": 0.5,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert isinstance(metrics[key], torch.Tensor)
        assert metrics[key].item() == pytest.approx(value), key


def test_std_rev_none_and_ties() -> None:
    kept, _ = select_groups_by_reward_std(_scores(), keep_ratio=0.5, mode="std_rev")
    assert kept.tolist() == [0, 3]  # the two std-0 groups
    kept, _ = select_groups_by_reward_std(_scores(), keep_ratio=0.25, mode="std_rev")
    assert kept.tolist() == [0]  # g0 and g3 tie at 0: the lower index wins
    kept, metrics = select_groups_by_reward_std(_scores(), keep_ratio=0.25, mode="none")
    assert kept.tolist() == [0, 1, 2, 3]
    assert metrics["kept_fraction"].item() == 1.0
    ties = torch.tensor([[0.0, 1.0], [5.0, 6.0], [2.0, 3.0], [0.0, 0.0]])  # three groups tie at std 0.7071
    kept, _ = select_groups_by_reward_std(ties, keep_ratio=0.5, mode="std")
    assert kept.tolist() == [0, 1]


def test_keep_count_floors_with_minimum_one() -> None:
    scores = torch.arange(40, dtype=torch.float32).reshape(8, 5) ** 1.5
    kept, _ = select_groups_by_reward_std(scores, keep_ratio=0.25, mode="std")  # int(0.25 * 8) = 2
    assert kept.numel() == 2
    kept, _ = select_groups_by_reward_std(scores, keep_ratio=0.1, mode="std")  # int(0.8) = 0 -> max(1, 0) = 1
    assert kept.numel() == 1


def test_reads_raw_scores_not_normalized_and_does_not_mutate() -> None:
    # g0: fifteen 0s and one 1 -> raw std 0.25. g1: (0, 0.1) x 8 -> raw std sqrt(16 * 0.0025 / 15) = 0.0516.
    # Raw filtering keeps g0. After asym_clip normalisation (RAGEN's in-place quirk would filter these),
    # g0 becomes (-0.25 x 15, 3.75 -> clamped 3) with std 0.8125 while g1 becomes (+-0.968) with std 1.0,
    # so filtering normalised scores would keep g1 instead.
    raw = torch.tensor([[0.0] * 15 + [1.0], [0.0, 0.1] * 8])
    before = raw.clone()
    kept, metrics = select_groups_by_reward_std(raw, keep_ratio=0.5, mode="std")
    assert kept.tolist() == [0]
    assert metrics["chosen_in_group_std"].item() == pytest.approx(0.25)
    assert_close(raw, before)
    normalized = group_normalize(raw.reshape(-1), torch.tensor([0] * 16 + [1] * 16), "asym_clip").reshape(2, 16)
    kept_norm, metrics_norm = select_groups_by_reward_std(normalized, keep_ratio=0.5, mode="std")
    assert kept_norm.tolist() == [1]
    assert metrics_norm["in_group_std"].item() == pytest.approx((0.8125 + 1.0) / 2, abs=1e-4)


def test_ragged_groups_by_hand() -> None:
    # stds: [1, 3] -> sqrt(2) = 1.414 | [5] -> 0 (singleton) | [0, 0, 6]: mean 2, var (4+4+16)/2 = 12 -> 3.464
    groups = [torch.tensor([1.0, 3.0]), torch.tensor([5.0]), torch.tensor([0.0, 0.0, 6.0])]
    kept, metrics = select_groups_by_reward_std(groups, keep_ratio=0.34, mode="std")  # int(1.02) = 1
    assert kept.tolist() == [2]
    assert metrics["in_group_std"].item() == pytest.approx((2**0.5 + 0.0 + 12**0.5) / 3)
    assert metrics["in_group_mean"].item() == pytest.approx((2.0 + 5.0 + 2.0) / 3)
    assert metrics["in_group_max"].item() == pytest.approx((3.0 + 5.0 + 6.0) / 3)
    # An equal-size list gives the same answer as the [G, N] tensor.
    as_list = list(_scores().unbind(0))
    assert select_groups_by_reward_std(as_list, 0.5, "std")[0].tolist() == [1, 2]


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="std_rev"):
        select_groups_by_reward_std(_scores(), 0.5, "max_mean")
    with pytest.raises(ValueError):
        select_groups_by_reward_std(_scores(), 0.0, "std")
    with pytest.raises(ValueError):
        select_groups_by_reward_std([], 0.5, "std")
    with pytest.raises(ValueError):
        select_groups_by_reward_std([torch.tensor([1.0]), torch.tensor([])], 0.5, "std")


def _filter_loop_reference(scores: list[list[float]], keep_ratio: float, mode: str) -> list[int]:
    """Exact (rational) variances, sort by (std, index), take k, return ascending."""
    variances = []
    for row in scores:
        vals = [Fraction(v) for v in row]
        mean = sum(vals) / len(vals)
        variances.append(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else Fraction(0))
    num_groups = len(scores)
    if mode == "none":
        return list(range(num_groups))
    k = max(1, int(keep_ratio * num_groups))
    sign = -1 if mode == "std" else 1
    order = sorted(range(num_groups), key=lambda g: (sign * variances[g], g))
    return sorted(order[:k])


@pytest.mark.parametrize("mode", ["std", "std_rev", "none"])
@pytest.mark.parametrize("keep_ratio", [0.25, 0.5, 0.9])
def test_matches_loop_reference_with_ties(mode: str, keep_ratio: float) -> None:
    # Integer scores in {0..3} with group size 4: means are multiples of 1/4, so float stds of equal
    # multisets are bit-identical and ties are real ties (as for 0/1 success rewards).
    gen = torch.Generator().manual_seed(8)
    scores = torch.randint(0, 4, (16, 4), generator=gen).to(torch.float32)
    kept, _ = select_groups_by_reward_std(scores, keep_ratio, mode)
    assert kept.tolist() == _filter_loop_reference(scores.tolist(), keep_ratio, mode)
