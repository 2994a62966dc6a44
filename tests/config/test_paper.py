"""What configs/paper/README.md says about the paper configs' learner step, recomputed from the configs:
how many optimizer steps a learner step takes, and the off-policy correction of the
asynchronous runs. The README's table is parsed, so it cannot drift from the configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ragen_async.algo.filtering import select_groups_by_reward_std
from ragen_async.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
PAPER = sorted([*(ROOT / "configs/paper").glob("starpo*.yaml"), *(ROOT / "configs/paper").glob("grpo*.yaml")])
"""The paper's runs (not helpers such as make paper-shape's small-batch config)."""
SECTION = "## One optimizer pass per step"


def step_shape(cfg: RunConfig) -> dict[str, int | str | None]:
    """The numbers of the README's table for one config, as the code computes them: the filter's own count of
    kept groups (as ``TrajectoryBuffer`` asks it), and ``Learner.train_step``'s mini-batch count
    ``max(1, round(kept / mini_batch_size))`` times ``epochs``."""
    groups = cfg.rollout.groups_per_step
    kept_groups = select_groups_by_reward_std(torch.zeros(groups, 1), cfg.algo.filter_ratio,
                                              cfg.algo.filter_mode)[0].numel()
    kept = int(kept_groups) * cfg.rollout.group_size
    n_mini = max(1, round(kept / cfg.learner.mini_batch_size))
    return {"trajectories": groups * cfg.rollout.group_size, "kept": kept, "mini_batch": cfg.learner.mini_batch_size,
            "epochs": cfg.learner.epochs, "optimizer_steps": cfg.learner.epochs * n_mini,
            "max_staleness": cfg.staleness.max_staleness, "off_policy": cfg.algo.off_policy}


def readme_rows() -> dict[str, dict[str, int | str | None]]:
    """The table of the README's section on passes per step: config name -> the row's numbers."""
    text = (ROOT / "configs/paper/README.md").read_text()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8 or not cells[0].startswith("`"):
            continue
        last_int = [int(re.findall(r"\d+", c)[-1]) for c in cells[1:7]]
        numbers = dict(zip(("trajectories", "kept", "mini_batch", "epochs", "optimizer_steps", "max_staleness"),
                           last_int, strict=True))
        numbers["off_policy"] = cells[7].strip("`")
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            assert name not in rows, f"{name} in two rows"
            rows[name] = numbers
    return rows


def test_the_readme_table_covers_every_paper_config_with_the_numbers_the_configs_give():
    rows = readme_rows()
    assert sorted(rows) == [p.stem for p in PAPER]
    for path in PAPER:
        assert rows[path.stem] == step_shape(load_config(path)), path.stem


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_starpo_s_and_grpo_take_one_pass_and_vanilla_starpo_four(path):
    """With the std filter 8 x 16 trajectories keep 2 groups = 32 = the mini-batch, one epoch: one optimizer
    step per learner step, so PPO's ratio is exactly 1 and its clips never act; without the filter, four."""
    shape = step_shape(load_config(path))
    filtered = path.stem.startswith(("starpo_s_", "grpo_"))
    assert (shape["trajectories"], shape["kept"]) == ((128, 32) if filtered else (128, 128))
    assert shape["optimizer_steps"] == (1 if filtered else 4)


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_asynchronous_paper_configs_correct_their_stale_tokens(path):
    """The README: every paper run is asynchronous (a token may be a version old) and corrects its stale tokens
    with AReaL's decoupled PPO, weight cap 2."""
    cfg = load_config(path)
    assert cfg.runtime == "ray" and cfg.staleness.max_staleness != 0, "the README calls every paper run asynchronous"
    assert cfg.algo.off_policy == "decoupled" and cfg.algo.is_cap == 2.0


def test_the_synchronous_reference_the_readme_names_loads_without_a_correction():
    cfg = load_config(ROOT / "configs/paper/starpo_s_sokoban.yaml",
                      ["staleness.max_staleness=0", "algo.off_policy=none"])
    assert cfg.staleness.max_staleness == 0 and cfg.algo.off_policy == "none"
    assert "`staleness.max_staleness=0 algo.off_policy=none`" in (ROOT / "configs/paper/README.md").read_text()
