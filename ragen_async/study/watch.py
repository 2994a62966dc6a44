"""``ragen-async watch RUN_DIR``: a run's key curves in the terminal, redrawn as ``metrics.jsonl`` grows.

For a person without W&B (or on a cluster login node): one row per signal the staleness study watches,
each with a sparkline of its last ``width`` points, its lowest, highest and latest value, and
whether the collapse alert (``alert/collapse``) has fired.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ragen_async.study.report import RunData

CURVES = (
    ("val/success", "validation success", True),
    ("rollout/success", "rollout success", False),
    ("rollout/reward_mean", "rollout reward", False),
    ("rollout/in_group_reward_std", "in-group reward std", False),
    ("actor/entropy", "entropy", False),
    ("actor/grad_norm", "grad norm", False),
    ("staleness/mean", "staleness (versions)", False),
    ("staleness/max_staleness", "staleness bound (adaptive)", False),
    ("staleness/controller_kl", "stale KL (controller)", False),
    ("throughput/tokens_per_s", "tokens/s", False),
)
"""(metric, label, from the validation records)."""
ADAPTIVE_ONLY = {"staleness/max_staleness", "staleness/controller_kl"}
"""Rows shown only for a run whose bound moves (it logs ``staleness/bound_change``)."""
SHOWN_MOVES = 4
"""How many of the bound's latest moves the status lines name."""
BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: np.ndarray, width: int) -> str:
    """The last ``width`` values as block characters scaled between their min and max."""
    values = values[-width:]
    if not values.size:
        return ""
    lo, hi = float(values.min()), float(values.max())
    if hi - lo < 1e-12:
        return BLOCKS[len(BLOCKS) // 2] * values.size
    scaled = (values - lo) / (hi - lo) * (len(BLOCKS) - 1)
    return "".join(BLOCKS[int(round(x))] for x in scaled)


def _number(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def render(run_dir: Path, width: int = 30) -> Group:
    """The run's curves as a rich renderable (what one refresh of the watch shows)."""
    run = RunData.load(Path(run_dir))
    table = Table(box=None, pad_edge=False)
    table.add_column("signal", no_wrap=True)
    table.add_column(f"last {width} points", no_wrap=True, min_width=width)
    for column in ("min", "max", "latest"):
        table.add_column(column, justify="right", no_wrap=True)
    adaptive = run.series("staleness/bound_change")[1].size > 0
    for key, label, validation in CURVES:
        _, values = run.series(key, validation=validation)
        values = values[np.isfinite(values)] if key in ADAPTIVE_ONLY else values
        if not values.size or (key in ADAPTIVE_ONLY and not adaptive):
            continue
        table.add_row(label, sparkline(values, width), *(_number(v) for v in (values.min(), values.max(), values[-1])))
    steps = run.last_step
    total = run.total_steps
    alerts = run.series("alert/collapse", validation=True)
    fired = [int(s) for s, v in zip(*alerts, strict=True) if v > 0]
    header = Text(f"{run.name}: step {steps}" + (f" of {total}" if total else ""), style="bold")
    status = (Text(f"collapse alert at step(s) {', '.join(map(str, fired))}", style="bold red") if fired
              else Text("no collapse alert", style="green"))
    if not run.train and not run.val:
        return Group(header, Text("no metrics yet", style="yellow"))
    moves = bound_moves(run)[-SHOWN_MOVES:]
    if moves:
        return Group(header, table, status, Text("bound moves: " + "; ".join(moves), style="cyan"))
    return Group(header, table, status)


def bound_moves(run: RunData) -> list[str]:
    """Each move of the adaptive bound with its reason as the run's metrics give it: the bound it came to, and
    what the controller read at that step (the averaged stale KL, or the warnings that fired), oldest first."""
    steps, change = run.series("staleness/bound_change")
    if not steps.size:
        return []
    series = {key: dict(zip(*run.series(key), strict=True)) for key in
              ("staleness/max_staleness", "staleness/controller_kl")}
    warned = {key.removeprefix("warning/"): dict(zip(*run.series(key), strict=True))
              for key in {k for r in run.train for k in r} if key.startswith("warning/")}
    bounds = series["staleness/max_staleness"]
    out = []
    for step, c in zip(steps, change, strict=True):
        if not c:
            continue
        after = bounds.get(step + 1, math.nan)  # the bound is logged with the step it applies to
        kl = series["staleness/controller_kl"].get(step)
        if kl is not None and math.isfinite(kl):
            why = f"stale KL {kl:.2g}"
        else:
            why = ", ".join(sorted(s for s, fired in warned.items() if fired.get(step))) or "quiet"
        to = "unbounded" if not math.isfinite(after) and c > 0 else "?" if not math.isfinite(after) else f"{after:.0f}"
        out.append(f"step {int(step)} {'up' if c > 0 else 'down'} to {to} ({why})")
    return out


def watch(run_dir: Path, interval_s: float = 5.0, width: int = 30, once: bool = False) -> None:
    """Draw once, or redraw every ``interval_s`` until interrupted (Ctrl-C)."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if once:
        console.print(render(run_dir, width))
        return
    with Live(render(run_dir, width), console=console, refresh_per_second=1) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(render(run_dir, width))
        except KeyboardInterrupt:
            pass
