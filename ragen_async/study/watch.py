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
    ("throughput/tokens_per_s", "tokens/s", False),
)
"""(metric, label, from the validation records)."""
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
    for key, label, validation in CURVES:
        _, values = run.series(key, validation=validation)
        if not values.size:
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
    return Group(header, table, status)


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
