"""aggregate_loss: hand-computed modes, loop reference, micro-batch additivity."""

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.aggregation import LOSS_AGG_MODES, aggregate_loss


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2 empty
    return loss, mask


def test_modes_by_hand() -> None:
    loss, mask = _example()
    # token-mean: (1 + 2 + 3 + 5 + 6) / 5 tokens = 17 / 5
    assert_close(aggregate_loss(loss, mask, "token-mean"), torch.tensor(3.4))
    # seq-mean-token-mean: row means 6/3 = 2 and 11/2 = 5.5; empty row excluded -> (2 + 5.5) / 2
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), torch.tensor(3.75))
    # seq-mean-token-sum: row sums 6 and 11 -> (6 + 11) / 2
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum"), torch.tensor(8.5))


def test_global_denominators_override() -> None:
    loss, mask = _example()
    assert_close(aggregate_loss(loss, mask, "token-mean", num_tokens=10), torch.tensor(1.7))  # 17 / 10
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean", num_seqs=5), torch.tensor(1.5))  # 7.5 / 5
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum", num_seqs=torch.tensor(4.0)), torch.tensor(4.25))


def test_empty_mask_gives_zero_not_nan() -> None:
    loss = torch.full((2, 3), float("nan"))
    mask = torch.zeros(2, 3)
    for mode in LOSS_AGG_MODES:
        assert_close(aggregate_loss(loss, mask, mode), torch.tensor(0.0))


def test_unknown_mode_names_valid_modes() -> None:
    loss, mask = _example()
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-mean.*seq-mean-token-sum"):
        aggregate_loss(loss, mask, "seq-mean")


def _loop_reference(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    rows = []
    for b in range(loss.shape[0]):
        vals = [loss[b, t].item() for t in range(loss.shape[1]) if mask[b, t].item() == 1.0]
        rows.append(vals)
    if mode == "token-mean":
        flat = [v for row in rows for v in row]
        return sum(flat) / len(flat)
    nonempty = [row for row in rows if row]
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in nonempty) / len(nonempty)
    return sum(sum(row) for row in nonempty) / len(nonempty)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_matches_loop_reference_on_random(mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(7, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(7, 9, generator=gen) < 0.5).to(torch.float64)
    mask[2] = 0.0  # guarantee one empty row
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(_loop_reference(loss, mask, mode))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_contributions_sum_to_full_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(4)
    loss = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(8, 6, generator=gen) < 0.5).to(torch.float64)
    mask[5] = 0.0
    num_tokens = mask.sum()
    num_seqs = (mask.sum(dim=1) > 0).sum()
    full = aggregate_loss(loss, mask, mode)
    parts = [
        aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, num_tokens=num_tokens, num_seqs=num_seqs)
        for i in range(0, 8, 2)
    ]
    assert_close(torch.stack(parts).sum(), full)
