"""``ragen-async``: the command-line entry point (train, audit, pack, eval, make-model, sweep, report, watch, config;
``bench``'s subcommands in :mod:`.bench`, what the handlers share in :mod:`.common`). Handlers parse and print; the
work lives in the modules they call.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from ragen_async.config import ModelConfig

from ragen_async.cli.bench import bench_app
from ragen_async.cli.common import (
    EXIT_INTERRUPTED,
    ConfigArg,
    OverridesArg,
    VerboseOpt,
    console,
    fail,
    invocation,
    load,
    pairs,
    parse_k,
    setup_logging,
)

__all__ = ["EXIT_INTERRUPTED", "app", "invocation", "main", "parse_k"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Asynchronous StarPO-S training of multi-turn LLM agents.")
app.add_typer(bench_app, name="bench")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"ragen-async {version('ragen_async')}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """Asynchronous StarPO-S training of multi-turn LLM agents."""


@app.command()
def train(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    resume: Annotated[Path | None, typer.Option(help="continue the run in this run directory")] = None,
    run_dir: Annotated[Path | None, typer.Option(
        help="directory of the new run (must not exist; default RUN_ROOT/NAME-TIMESTAMP)")] = None,
    require_val_success: Annotated[float | None, typer.Option(
        help="exit non-zero unless the final validation success (val/success) reaches this")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Train with StarPO-S; prints the run directory, then live progress (engine and worker output goes to
    RUN_DIR/logs/). SIGTERM or SIGUSR1 stops the run after the current step with a checkpoint (exit status
    75; continue with --resume)."""
    setup_logging(verbose)
    from ragen_async.orchestrator import Interrupted, summarize_val
    from ragen_async.orchestrator import train as run_train
    from ragen_async.records.logfiles import one_line
    from ragen_async.records.logfiles import verbose as verbose_console

    cfg = None if resume is not None else load(config, overrides)
    if resume is not None and (config is not None or overrides or run_dir is not None):
        fail("--resume continues a run with its saved config; do not pass a config, overrides or --run-dir")
    if run_dir is not None and run_dir.exists():
        fail(f"--run-dir {run_dir} already exists; continue that run with --resume {run_dir}")
    if cfg is not None:
        _check_model(cfg.model)
    t0 = time.perf_counter()
    try:
        path, last = run_train(cfg, resume=resume, run_dir_path=run_dir)
    except FileNotFoundError as e:
        fail(str(e))
    except Interrupted as e:
        console.print(f"[yellow]{e}[/]", highlight=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        if verbose_console():
            raise
        fail(one_line(e))  # its traceback is in the run's logs/driver.log, which the line names
    console.print(f"done in {time.perf_counter() - t0:.0f} s; run directory {path}")
    print(json.dumps({"run_dir": str(path), **summarize_val(last)}))
    if require_val_success is not None:
        got = last.get("val/success")
        if got is None or got < require_val_success:
            fail(f"final validation success {got} is below the required {require_val_success}")


def _check_model(model: ModelConfig) -> None:
    from ragen_async.modeldir import model_problem

    problem = model_problem(model.path, model.sha256)
    if problem is not None:
        from ragen_async.tinymodel.warmstart import warm_start_command, warm_start_named_by

        if model.build is not None:
            fail(f"{problem}; {model.build}")
        name = warm_start_named_by(model.path)
        command = "ragen-async make-model" if name is None else warm_start_command(name)
        fail(f"{problem}; run `{command}` or point model.path at a local checkpoint")


@app.command()
def pack(
    paths: Annotated[list[Path], typer.Argument(help="run directories, sweep directories, or folders holding them")],
    unfinished: Annotated[bool, typer.Option(
        "--unfinished", help="also pack runs that stopped before their last step (none may be writing)")] = False,
) -> None:
    """Compress runs' metrics.jsonl and provenance.jsonl (gzip, about a tenth of the size) so a study's runs are
    small enough to commit: report, audit and watch read them packed, and train --resume unpacks them first."""
    from ragen_async.records.rundir import pack_run
    from ragen_async.study.report import find_runs

    runs, warnings = find_runs(paths)
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    packed = skipped = 0
    for run in runs:
        if run.path is None:
            continue
        total = run.total_steps
        if not unfinished and (total is None or run.last_step < total):
            console.print(f"skipped {run.path}: at step {run.last_step} of {total} (still running or stopped; "
                          "--unfinished packs it)", highlight=False)
            skipped += 1
            continue
        try:
            done = pack_run(run.path)
        except OSError as e:
            fail(str(e))
        packed += bool(done)
    console.print(f"packed {packed} runs, skipped {skipped}")


@app.command()
def audit(run_dir: Annotated[Path, typer.Argument(help="a run directory")]) -> None:
    """Account for every group index a run admitted (consumed, dropped and why, or outstanding at its
    latest checkpoint) and check every consumed group's staleness against the bound in force at its step
    (config.yaml's staleness settings; the adaptive bound from metrics.jsonl); for a run that consumed in
    order, that it dropped nothing (under the adaptive bound: nothing a tightening does not explain) and took
    indices in order; prints a per-lag table and exits 1 on any duplicate or unexplained index, staleness
    violation or in-order finding."""
    from rich.markup import escape
    from rich.table import Table

    from ragen_async.records.provenance import CannotAudit, audit_run_dir

    try:
        a = audit_run_dir(run_dir)
    except CannotAudit as e:
        fail(str(e))
    result, stale = a.accounting, a.staleness
    console.print(f"{run_dir} up to step {a.step} ({a.checkpoint}): {result['admitted']} admitted = "
                  f"{result['consumed']} consumed + {result['dropped']} dropped + {result['outstanding']} "
                  f"outstanding; drops by reason: {result['drop_reasons'] or 'none'}")
    table = Table(title="staleness of consumed groups (learner version - oldest token's version)",
                  title_justify="left", header_style="bold")
    for name in ("lag", "groups", "share"):
        table.add_column(name, justify="right")
    for row in stale["lags"]:
        table.add_row(str(row["lag"]), str(row["groups"]), f"{row['share']:.1%}")
    console.print(table)
    violations = stale["violations"]
    console.print(f"staleness ({a.rule}): {stale['groups']} consumed groups, max {stale['max']}; "
                  f"{len(violations) or 'no'} violation{'s' if len(violations) != 1 else ''}", highlight=False)
    if stale["bound_unknown_steps"]:
        console.print(f"[yellow]note:[/] no staleness/max_staleness in metrics.jsonl for "
                      f"{len(stale['bound_unknown_steps'])} step(s) {stale['bound_unknown_steps'][:20]}: their groups "
                      f"were checked against max_staleness = {stale['max_staleness']}, an upper bound only",
                      highlight=False)
    if a.in_order is not None:
        console.print(f"in-order consumption (staleness.consume: in_order): {len(a.in_order['drops']) or 'no'} "
                      f"unexplained drop(s), {len(a.in_order['out_of_order']) or 'no'} step(s) out of order",
                      highlight=False)
    print(json.dumps({**result, "staleness": {**stale, "violations": violations[:100],
                                               "violation_count": len(violations)},
                      **({"in_order": a.in_order} if a.in_order is not None else {})}), flush=True)
    for line in a.errors[:21]:
        console.print(f"[bold red]error:[/] {escape(line)}", highlight=False)
    if len(a.errors) > 21:
        console.print(f"[bold red]error:[/] ... and {len(a.errors) - 21} more")
    if a.failed:
        raise typer.Exit(1)


@app.command("eval")
def eval_cmd(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    policy: Annotated[list[str] | None, typer.Option(
        help="llm | random | oracle (repeatable: every policy on the same seeds, one table); default llm")] = None,
    env: Annotated[list[str] | None, typer.Option(help="environment tag (repeatable); default: validation envs")] = None,
    seeds: Annotated[int | None, typer.Option(help="seeds per environment (default: validation n_groups)")] = None,
    seed: Annotated[int | None, typer.Option(help="first seed (default: validation.seed)")] = None,
    temperature: Annotated[float | None, typer.Option(
        help="LLM sampling temperature, 0 = greedy (default: validation's)")] = None,
    out: Annotated[Path | None, typer.Option(help="episodes jsonl path (each episode tagged with its policy)")] = None,
) -> None:
    """Play fixed seeds with the LLM (vLLM), a random-valid-action policy and/or the oracle; prints a table
    and a JSON line with each policy's summary, keyed by policy."""
    setup_logging()
    cfg = load(config, overrides)
    policies = list(dict.fromkeys(policy or ["llm"]))
    for p in policies:
        if p not in ("llm", "random", "oracle"):
            fail(f"--policy must be llm, random or oracle (got {p!r})")
    if temperature is not None and not temperature >= 0:
        fail(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    _check_model(cfg.model)
    from ragen_async.evaluation import run_eval

    try:
        summary = run_eval(cfg, policies=policies, env_tags=env, seeds=seeds, first_seed=seed,
                           temperature=temperature, out=out, console=console)
    except ValueError as e:
        fail(str(e))
    print(json.dumps(summary))


@app.command("make-model")
def make_model(
    out: Annotated[Path | None, typer.Option(help="output directory (default: artifacts/tiny-model, or "
                                             "artifacts/tiny-model-NAME with --warm-start NAME, _ written -, e.g. "
                                             "tiny-model-frozen-lake)")] = None,
    seed: Annotated[int, typer.Option(help="build seed")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if a complete build exists")] = False,
    sft_steps: Annotated[int | None, typer.Option(help="SFT steps (default: the build config's)")] = None,
    report: Annotated[bool, typer.Option(help="print the base model's numbers after the build")] = True,
    seeds_per_tag: Annotated[int, typer.Option(help="episodes per env tag in the report")] = 64,
    warm_start: Annotated[str | None, typer.Option(
        help="build a solver-derived warm start from the base model instead: sokoban (the study's specimen, "
             "`make specimen`), frozen_lake or countdown (SmallCountdown)")] = None,
    eps: Annotated[float | None, typer.Option(help="--warm-start: share of random actions (default: its config's)")] = None,
    episodes: Annotated[int | None, typer.Option(help="--warm-start: oracle episodes (default: its config's)")] = None,
    checkpoints: Annotated[bool, typer.Option(help="--warm-start: also save every tenth of the SFT steps "
                                              "to OUT.checkpoints/step-N")] = False,
) -> None:
    """Build the tiny Qwen2 model and tokenizer used on CPU (the repository ships one in artifacts/tiny-model:
    rebuild it with --force after changing the environments, the tokenizer or the build, and commit it), then print
    its base-policy numbers; or, with --warm-start, an ε-noisy-oracle warm start from it."""
    setup_logging()
    if warm_start is not None:
        from ragen_async.tinymodel.warmstart import WARM_STARTS, ensure_warm_start

        if warm_start not in WARM_STARTS:
            fail(f"--warm-start must be one of {', '.join(WARM_STARTS)} (got {warm_start!r})")
        overrides = {k: v for k, v in (("eps", eps), ("episodes", episodes), ("sft_steps", sft_steps)) if v is not None}
        try:
            ensure_warm_start(warm_start, out, seed=seed, force=force, checkpoints=checkpoints, **overrides)
        except (ValueError, FileExistsError) as e:
            fail(str(e))
        return
    if eps is not None or episodes is not None or checkpoints:
        fail("--eps, --episodes and --checkpoints apply to --warm-start builds only")
    from ragen_async.tinymodel.report import make_model as build

    build(out or Path("artifacts/tiny-model"), seed=seed, force=force, sft_steps=sft_steps, report=report,
          seeds_per_tag=seeds_per_tag)


@app.command()
def sweep(
    spec: Annotated[Path | None, typer.Argument(help="sweep spec (configs/sweeps/*.yaml); omit with --resume")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="dotted overrides for every run, e.g. total_steps=20")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the runs and their overrides; train nothing")] = False,
    resume: Annotated[Path | None, typer.Option(help="finish the sweep in this sweep directory")] = None,
    out: Annotated[Path | None, typer.Option(help="sweep directory (default runs/sweeps/NAME-TIMESTAMP)")] = None,
    report: Annotated[bool, typer.Option(help="write SWEEP_DIR/report when the sweep ends")] = True,
    verbose: VerboseOpt = False,
) -> None:
    """Run a grid of configs one after another; every config is validated before the first run starts."""
    setup_logging(verbose)
    from rich.console import Console

    from ragen_async.orchestrator import Interrupted
    from ragen_async.study.sweep import SweepError, run_sweep

    try:
        result = run_sweep(spec, resume=resume, out=out, overrides=overrides or [], dry_run=dry_run,
                           report=report, console=Console() if dry_run else console)
    except SweepError as e:
        fail(str(e))
    except Interrupted:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if result is not None and not dry_run and result.manifest.counts()["failed"]:
        console.print(f"[bold red]some runs failed[/]; rerun them with: ragen-async sweep --resume {result.directory}")
        raise typer.Exit(1)


@app.command()
def report(
    paths: Annotated[list[Path], typer.Argument(help="run directories, sweep directories, or folders of runs")],
    out: Annotated[Path | None, typer.Option(help="output folder (default: PATH/report for one path, else ./report)")] = None,
    threshold: Annotated[float, typer.Option(help="validation success that counts as solved")] = 0.9,
    smooth: Annotated[int, typer.Option(min=1, help="trailing mean over this many steps in the training curves")] = 1,
    baseline: Annotated[list[str] | None, typer.Option(
        help="NAME=SUCCESS, a reference line on the validation plots, e.g. random=0.211 (repeatable)")] = None,
    collapse_floor: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="a fall is half the way from this success to the peak lost, e.g. the random "
        "policy's success for a run from a warm start (default 0: half the peak)")] = 0.0,
    reference: Annotated[list[str] | None, typer.Option(
        help="NAME=CSV, a reference's cells (e.g. from `bench rllib --csv`) drawn beside ours against measured "
        "lag (repeatable)")] = None,
    throughput: Annotated[list[str] | None, typer.Option(
        help="K=GROUPS_PER_S from `bench pipeline` (K an integer or inf), repeatable: adds the equal-time "
        "table (minutes per budget, success at equal wall-clock)")] = None,
    registered: Annotated[list[Path] | None, typer.Option(
        "--registered", help="a predictions spec (YAML; ragen_async/study/report/registered.py), repeatable: decide "
        "each of its predictions on the runs, by its rule")] = None,
) -> None:
    """Write report.md, summary.csv and staleness/stability plots for runs or sweeps."""
    from ragen_async.study.report import ReportError, write_report

    def name(text: str) -> str:
        if not text.strip():
            raise ValueError("empty name")
        return text.strip()

    def rate(text: str) -> float:
        value = float(text)
        if not 0 < value < math.inf:
            raise ValueError("rate must be > 0")
        return value

    baselines = pairs(baseline, "--baseline", "NAME=SUCCESS, e.g. random=0.211", name, float)
    rates = pairs(throughput, "--throughput", "K=GROUPS_PER_S with K an integer >= 0 or inf and a rate > 0, "
                   "e.g. 0=1.25 or inf=2.26", parse_k, rate)
    references = pairs(reference, "--reference", "NAME=CSV, e.g. 'RLlib APPO=studies/rllib_appo/cells.csv'",
                        name, name)
    target = out if out is not None else (paths[0] / "report" if len(paths) == 1 else Path("report"))
    try:
        result = write_report(paths, target, threshold=threshold, smooth=smooth, baselines=baselines,
                              collapse_floor=collapse_floor, throughput=rates, references=references,
                              registered=registered)
    except ReportError as e:
        fail(str(e))
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    for line in result.drops:
        console.print(line, highlight=False, markup=False)
    for line in result.verdicts:
        console.print(line, highlight=False, markup=False)
    console.print(f"{len(result.summaries)} runs, {len(result.plots)} plots")
    print(result.markdown)


@app.command()
def watch(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (holding metrics.jsonl)")],
    interval: Annotated[float, typer.Option(min=0.5, help="seconds between redraws")] = 5.0,
    width: Annotated[int, typer.Option(min=10, help="points per sparkline")] = 30,
    once: Annotated[bool, typer.Option("--once", help="draw once and exit")] = False,
) -> None:
    """A run's key curves in the terminal (validation success, reward, reward std, entropy, grad norm,
    staleness, throughput, collapse alert), redrawn until Ctrl-C."""
    from ragen_async.study.watch import watch as watch_run

    if not run_dir.is_dir():
        fail(f"{run_dir} is not a directory (expected a run directory with metrics.jsonl)")
    watch_run(run_dir, interval_s=interval, width=width, once=once)


@app.command("config")
def config_cmd(
    args: Annotated[list[str] | None, typer.Argument(
        metavar="[CONFIG] [OVERRIDES]...",
        help="YAML config (defaults if omitted), then dotted overrides (key=value)")] = None,
    explain: Annotated[str | None, typer.Option(
        "--explain", metavar="KEY",
        help="describe the fields under KEY instead of printing the config: a section (algo), a field "
             "(algo.clip_eps_high) or all; type, default, the value in CONFIG if given, description")] = None,
) -> None:
    """Print the resolved config (CONFIG + overrides, or the defaults) as YAML, or with --explain what its
    fields mean."""
    from rich.markup import escape
    from rich.table import Table

    from ragen_async.config import ConfigError, dump_config, load_config
    from ragen_async.config import explain as explain_fields

    args = list(args or [])
    config = Path(args.pop(0)) if args and "=" not in args[0] else None
    overrides = args
    bad = [a for a in overrides if "=" not in a]
    if bad:
        fail(f"{bad[0]!r} is not an override (key=value); to describe a config key: --explain {bad[0]}")
    keys = [] if explain in (None, "all") else [explain]
    try:
        cfg = load_config(config, overrides) if config is not None or overrides or explain is None else None
        docs = explain_fields(keys[0] if keys else None, cfg) if explain is not None else []
    except ConfigError as e:
        fail(str(e))
    if explain is None:
        print(dump_config(cfg), end="")
        return
    # Off a terminal (a pipe, a file) the table is not squeezed into 80 columns.
    out = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    if len(docs) == 1:  # one field: its whole description on one line, easy to read and to grep
        d = docs[0]
        value = f"  (value: {d.value})" if d.value is not None else ""
        out.print(f"{d.key}: {d.type} = {d.default}{value}", markup=False, soft_wrap=True)
        out.print(f"  {d.description}", markup=False, soft_wrap=True)
        return
    table = Table(title=f"config fields{f' under {keys[0]}' if keys else ''}", title_justify="left")
    table.add_column("key", no_wrap=True)
    table.add_column("type", max_width=28, overflow="fold")
    table.add_column("default", max_width=24, overflow="fold")
    if cfg is not None:
        table.add_column("value", max_width=24, overflow="fold")
    table.add_column("description", min_width=40)
    for d in docs:
        value = [] if cfg is None else ["" if d.value is None else escape(d.value)]
        table.add_row(escape(d.key), escape(d.type), "" if d.section else escape(d.default), *value,
                      escape(d.description), style="bold" if d.section else None)
    out.print(table)


def main() -> None:  # pragma: no cover
    app()
