"""A report's figures: curves per run, cells over steps and wall-clock, staleness against stability, success
against measured lag beside a reference. Each returns the PNG it wrote (``None`` or nothing where there is
nothing to draw); matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ragen_async.study import stats
from ragen_async.study.report.runs import MISSING, RunData, val_success_vs_time
from ragen_async.study.report.summary import LAGS, RunSummary, correction_order

CURVES = (
    ("val_success", "validation success", None),
    ("rollout_reward", "rollout reward (mean)", "rollout/reward_mean"),
    ("in_group_reward_std", "in-group reward std", "rollout/in_group_reward_std"),
    ("entropy", "policy entropy", "actor/entropy"),
    ("grad_norm", "gradient norm", "actor/grad_norm"),
    ("valid_action_rate", "rollout valid-action rate", "rollout/valid_action_rate"),
    ("k3_mismatch", "behaviour/learner KL (k3)", "mismatch/k3_kl"),
    ("staleness_mean", "staleness, mean (versions)", "staleness/mean"),
    ("staleness_bound", "staleness bound max_staleness (adaptive runs)", "staleness/max_staleness"),
)
LOG_CURVES = frozenset({"grad_norm", "k3_mismatch"})
"""Curves drawn on a log scale when positive and spanning more than a factor of 50."""
MARKERS = {"none": "o", "tis": "s", "decoupled": "^", "opsm": "v", "geo_mask": "P", "geo_tis": "X", "age": "*"}
"""A marker per correction (``algo.off_policy``)."""
LINESTYLES = {"bounded": "-", "fixed": "--", "adaptive": ":"}
LAG_NAMES = {"bounded": "bounded", "fixed": "fixed lag", "adaptive": "adaptive bound"}
MAX_RUN_LEGEND = 12


def _run_colors(runs: Sequence[RunData]) -> dict[Any, Any]:
    """A colour per ``max_staleness``: viridis over the finite k, red for unbounded, grey for unknown;
    a colour per run instead when every run has the same k."""
    from matplotlib import colormaps

    ks = sorted({r.k for r in runs if r.has_config and r.k is not None})
    cmap = colormaps["viridis"]
    colors: dict[Any, Any] = {k: cmap(x) for k, x in zip(ks, np.linspace(0.05, 0.85, max(len(ks), 1)), strict=False)}
    colors[None], colors["?"] = "tab:red", "0.55"
    if len({r.k if r.has_config else "?" for r in runs}) == 1 and len(runs) <= MAX_RUN_LEGEND:
        # One k for all (a method or seed comparison): colour by k would draw every run alike, and
        # the legend names each run, so give each its own colour.
        tab10 = colormaps["tab10"]
        colors.update({("run", r.name): tab10(i % 10) for i, r in enumerate(runs)})
    return colors


def _color(run: RunData, colors: dict[Any, Any]) -> Any:
    if ("run", run.name) in colors:
        return colors["run", run.name]
    return colors[run.k] if run.has_config else colors["?"]


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (the first points average what there is)."""
    if window <= 1 or values.size < 2:
        return values
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def save_figure(fig, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)
    return path


def _legend(ax, runs: Sequence[RunData], colors: dict[Any, Any]) -> None:
    from matplotlib.lines import Line2D

    if len(runs) <= MAX_RUN_LEGEND:
        ax.legend(fontsize=7, frameon=False, loc="best")
        return
    handles = [Line2D([], [], color=_color(r, colors), label=f"k = {_k_text(r)}")
               for r in {_k_text(r): r for r in runs}.values()]
    if len({r.lag for r in runs}) > 1:
        handles += [Line2D([], [], color="0.3", ls=LINESTYLES[lag], label=LAG_NAMES[lag])
                    for lag in LAGS if any(r.lag == lag for r in runs)]
    handles += [line for line in ax.get_lines() if line.get_gid() == "baseline"]
    ax.legend(handles=handles, fontsize=7, frameon=False, loc="best")


def _k_text(run: RunData) -> str:
    return "?" if not run.has_config else "∞" if run.k is None else str(run.k)


def _draw_baselines(ax, baselines: dict[str, float] | None) -> None:
    """Reference levels of validation success (e.g. the random and the oracle policy) as labelled lines."""
    for i, (name, value) in enumerate(sorted((baselines or {}).items(), key=lambda kv: kv[1])):
        ax.axhline(value, color="0.35", ls=(0, (1, 2 + i)), lw=1.1, label=f"{name} ({value:g})", gid="baseline")


def plot_curves(runs: Sequence[RunData], out: Path, smooth: int = 1,
                baselines: dict[str, float] | None = None) -> list[Path]:
    """One PNG per curve in :data:`CURVES` that any run has data for (the bound: adaptive runs only, the
    others' is their constant k); ``baselines`` are drawn on the validation-success plot."""
    from matplotlib.figure import Figure

    colors = _run_colors(runs)
    ordered = sorted(runs, key=lambda r: (not r.has_config, math.inf if r.k is None else r.k, r.name))
    written = []
    for slug, title, key in CURVES:
        fig = Figure(figsize=(7.5, 4.2), layout="constrained")
        ax = fig.add_subplot()
        drawn: list[RunData] = []
        positive = True
        for run in ordered:
            if slug == "staleness_bound" and run.lag != "adaptive":
                continue
            steps, values = run.val_success() if key is None else run.series(key)
            if not values.size:
                continue
            if key is not None:
                values = _smooth(values, smooth)
            positive &= bool(np.all(values > 0))
            ax.plot(steps, values, color=_color(run, colors), ls=LINESTYLES[run.lag], lw=1.4,
                    alpha=0.9, marker="o" if key is None else None, ms=3, label=run.name)
            drawn.append(run)
        if not drawn:
            continue
        if key is None:
            _draw_baselines(ax, baselines)
        if slug in LOG_CURVES and positive:
            lo, hi = ax.get_ylim()
            if hi / max(lo, 1e-12) > 50:
                ax.set_yscale("log")
        ax.set(xlabel="learner step", ylabel=title,
               title=title + (f" (trailing mean over {smooth} steps)" if smooth > 1 and key else ""))
        ax.grid(alpha=0.3)
        _legend(ax, drawn, colors)
        written.append(save_figure(fig, out / f"curves_{slug}.png"))
    return written


def _cell_label(cell: dict[str, str], varying: Sequence[str]) -> str:
    def value(key: str) -> str:
        text = cell.get(key, MISSING)
        return "∞" if key == "staleness.max_staleness" and text == "None" else text

    return ", ".join(f"{k.rsplit('.', 1)[-1]}={value(k)}" for k in varying) or "all runs"


def plot_cells(runs: Sequence[RunData], summaries: Sequence[RunSummary], out: Path, points: int = 50,
               baselines: dict[str, float] | None = None) -> Path | None:
    """Validation success of each cell (runs differing only in their seed) against the learner step and
    against training wall-clock: the mean over seeds, and a band of its 95 % interval where a cell has
    two or more seeds (each seed interpolated onto a common grid within the range all seeds cover);
    finished runs only."""
    from matplotlib.figure import Figure

    cells: dict[str, list[RunData]] = {}
    labels: dict[str, dict[str, str]] = {}
    for run, s in zip(runs, summaries, strict=True):
        if s.cell and s.finished and run.val_success()[0].size >= 2:
            cells.setdefault(s.cell_key, []).append(run)
            labels[s.cell_key] = s.cell
    if not cells:
        return None
    varying = [k for k in dict.fromkeys(k for c in labels.values() for k in c)
               if len({c.get(k) for c in labels.values()}) > 1]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    palette = [f"C{i}" for i in range(10)]
    for i, (key, members) in enumerate(sorted(cells.items())):
        color = palette[i % len(palette)]
        for ax, series in ((axes[0], RunData.val_success), (axes[1], val_success_vs_time)):
            curves = [series(r) for r in members]
            lo, hi = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
            if hi <= lo:
                continue
            grid = np.linspace(lo, hi, points)
            ys = np.array([np.interp(grid, x, y) for x, y in curves])
            mean = ys.mean(axis=0)
            label = f"{_cell_label(labels[key], varying)} (n={len(members)})"
            ax.plot(grid, mean, color=color, lw=1.6, label=label)
            if len(members) >= 2:
                half = stats.t95(len(members)) * ys.std(axis=0, ddof=1) / math.sqrt(len(members))
                ax.fill_between(grid, np.clip(mean - half, 0.0, 1.0), np.clip(mean + half, 0.0, 1.0),
                                color=color, alpha=0.2, lw=0)
    axes[0].set(xlabel="learner step", ylabel="validation success", title="per cell: mean over seeds, 95 % band")
    axes[1].set(xlabel="training wall-clock (minutes, validation excluded)", title="the same against time")
    for ax in axes:
        _draw_baselines(ax, baselines)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, frameon=False, loc="best")
    return save_figure(fig, out / "cells_val_success.png")


SUMMARY_PANELS = (("final_val", "final validation success", (0.0, 1.0)),
                  ("mean_val", "mean validation success after step 0", (0.0, 1.0)),
                  ("grad_norm_max", "max gradient norm", (0.0, math.inf)))
"""The summary plot's panels: attribute, label, and the range its intervals are clipped to."""


def _face(color: str, lag: str) -> Any:
    """A marker's fill by lag mode: filled for bounded, hollow for fixed lag, lightly filled for an adaptive
    bound (at one k a fixed-lag and an adaptive cell would otherwise look alike)."""
    from matplotlib.colors import to_rgba

    return color if lag == "bounded" else "none" if lag == "fixed" else to_rgba(color, 0.3)


def plot_staleness_summary(summaries: Sequence[RunSummary], out: Path) -> Path | None:
    """Final validation success, mean validation success after step 0 and largest gradient norm against k:
    every run as a point, and per
    (correction, lag, step size) the mean over seeds at each k with its 95 % interval, clipped to the
    quantity's range (a success stays in [0, 1], a norm above 0). A marker shape per correction, filled
    for bounded, hollow for fixed lag, lightly filled for an adaptive bound (``_face``), a line style per lag
    mode (``LINESTYLES``); the step size is named in the legend where it varies. Finished runs only."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    known = [s for s in summaries if s.k_known and s.finished]
    if not known or not any(math.isfinite(s.final_val) or math.isfinite(s.grad_norm_max) for s in known):
        return None
    finite = sorted({s.k for s in known if s.k is not None})
    unbounded_x = (max(finite) + 1) if finite else 0

    def arm(s: RunSummary) -> tuple[str, str, float]:
        return s.off_policy, s.lag, s.actor_lr_key

    # No correction first: its colour stays the same as arms are added.
    groups = sorted({arm(s) for s in known}, key=lambda g: (correction_order(g[0]), g[0], LAGS.index(g[1]), g[2]))
    several_lr = len({g[2] for g in groups}) > 1
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
    colors = sorted({(g[0], g[2]) for g in groups}, key=lambda c: (correction_order(c[0]), c))
    group_color = {c: palette[i % len(palette)] for i, c in enumerate(colors)}
    spacing = min(0.25, 0.8 / len(groups))  # the arms side by side at a k, all within 0.8 of it
    offsets = {g: (i - (len(groups) - 1) / 2) * spacing for i, g in enumerate(groups)}

    fig = Figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, len(SUMMARY_PANELS))
    for ax, (attr, label, (low, high)) in zip(axes, SUMMARY_PANELS, strict=True):
        for group in groups:
            mode, lag, lr = group
            members = [s for s in known if arm(s) == group and math.isfinite(getattr(s, attr))]
            if not members:
                continue
            xs = np.array([unbounded_x if s.k is None else s.k for s in members], dtype=float)
            ys = np.array([getattr(s, attr) for s in members])
            color = group_color[(mode, lr)]
            ax.scatter(xs + offsets[group], ys, marker=MARKERS.get(mode, "D"), s=36, alpha=0.8,
                       facecolors=_face(color, lag), edgecolors=color)
            cells = [(x + offsets[group], *stats.error_bar(ys[xs == x].tolist(), low, high)) for x in np.unique(xs)]
            ax.errorbar([c[0] for c in cells], [c[1] for c in cells], yerr=[[c[2] for c in cells], [c[3] for c in cells]],
                        color=color, ls=LINESTYLES[lag], lw=1, alpha=0.8, capsize=4)
        ticks = finite + ([unbounded_x] if any(s.k is None for s in known) else [])
        ax.set_xticks(ticks, [str(k) for k in finite] + (["∞"] if len(ticks) > len(finite) else []))
        ax.set(xlabel="max staleness k (policy versions)", ylabel=label, title=label + " vs k")
        ax.grid(alpha=0.3)

    def legend(mode: str, lag: str, lr: float) -> str:
        step = f" · lr {lr:g}" if several_lr and lr >= 0 else ""
        return f"{mode} · {LAG_NAMES[lag]}{step}"

    handles = [Line2D([], [], color=group_color[(m, lr)], marker=MARKERS.get(m, "D"), ls=LINESTYLES[lag],
                      markerfacecolor=_face(group_color[(m, lr)], lag), label=legend(m, lag, lr))
               for m, lag, lr in groups]
    axes[-1].legend(handles=handles, fontsize=8, frameon=False, loc="best")
    return save_figure(fig, out / "staleness_stability.png")



def plot_lag_sensitivity(summaries: Sequence[RunSummary], references: dict[str, pd.DataFrame], out: Path
                         ) -> Path | None:
    """Final success against the *measured* mean lag (policy versions), ours beside each reference (e.g.
    RLlib APPO on the same levels): every finished run of ours as a point, each of our cells (k, correction,
    lag mode, step size) at its mean lag with its success interval, each reference cell with its interval.
    Measured lag, not k, is the common axis: a k means different lags in different systems."""
    from matplotlib.figure import Figure

    known = [s for s in summaries if s.k_known and s.finished and math.isfinite(s.staleness_mean)
             and math.isfinite(s.final_val)]
    if not known or not references:
        return None
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    arms: dict[tuple[Any, ...], list[RunSummary]] = {}
    for s in known:
        arms.setdefault((s.off_policy, s.lag, s.actor_lr_key), []).append(s)
    for i, ((mode, lag, lr), members) in enumerate(sorted(arms.items())):
        color = f"C{i}"
        ax.scatter([s.staleness_mean for s in members], [s.final_val for s in members], s=14, alpha=0.5,
                   color=color, marker=MARKERS.get(mode, "D"))
        cells: dict[str, list[RunSummary]] = {}
        for s in members:
            cells.setdefault(s.k_label, []).append(s)
        xs, ys, below, above = [], [], [], []
        for group in sorted(cells.values(), key=lambda g: np.mean([s.staleness_mean for s in g])):
            mean, low, high = stats.error_bar([s.final_val for s in group], 0.0, 1.0)
            xs.append(float(np.mean([s.staleness_mean for s in group])))
            ys.append(mean)
            below.append(low)
            above.append(high)
        step = f", lr {lr:g}" if len(arms) > 1 and lr >= 0 else ""
        ax.errorbar(xs, ys, yerr=[below, above], color=color, ls=LINESTYLES[lag], capsize=4, lw=1.4,
                    marker=MARKERS.get(mode, "D"), label=f"ours: {mode}, {LAG_NAMES[lag]}{step}")
    for j, (name, frame) in enumerate(sorted(references.items())):
        frame = frame.sort_values("lag_mean")
        y = frame["final_success"].to_numpy(float)
        lo = np.nan_to_num(y - frame["final_success_lo"].to_numpy(float))
        hi = np.nan_to_num(frame["final_success_hi"].to_numpy(float) - y)
        ax.errorbar(frame["lag_mean"], y, yerr=[lo, hi], color=("black", "dimgray", "gray")[j % 3], ls=":",
                    marker="s", capsize=4, lw=1.4, label=name)
    ax.set(xlabel="measured mean lag of the trained data (policy versions)", ylabel="final success",
           title="final success vs measured lag, beside the reference")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False, loc="best")
    return save_figure(fig, out / "lag_sensitivity.png")
