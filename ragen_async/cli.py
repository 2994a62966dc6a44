"""``ragen-async``: the command-line entry point (train, audit, pack, eval, make-model, sweep, report, watch, config,
bench).

Its length (over the project's ~600 lines per module): one handler per command, and ``bench``'s ten
subcommands with their options; handlers parse and print, the work lives in the modules they call.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from collections.abc import Callable

    from ragen_async.config import ModelConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Asynchronous StarPO-S training of multi-turn LLM agents.")
# Off a terminal (SLURM logs, CI), long lines stay whole instead of being wrapped at 80 columns.
console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
EXIT_INTERRUPTED = 75
"""``train``'s exit status after a stop signal (a checkpoint was written; ``--resume`` continues): EX_TEMPFAIL."""


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"ragen-async {version('ragen_async')}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """Asynchronous StarPO-S training of multi-turn LLM agents."""

ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config (configs/*.yaml); defaults if omitted")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. algo.clip_eps_high=0.28")]


def _fail(message: str) -> None:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)  # one line, brackets as written
    raise typer.Exit(2)


def _load(config: Path | None, overrides: list[str] | None):
    from ragen_async.config import ConfigError, load_config

    # A config path may be given as the first override-looking argument by mistake; say so clearly.
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        _fail(str(e))
    from ragen_async.envs.registry import make_env_from_tag

    # Environments are built here once, before anything is created or loaded: an unknown tag or option
    # is one line, not a traceback after the run directory exists.
    for where, specs in (("rollout.envs", cfg.rollout.envs), ("validation.envs", cfg.validation.envs)):
        for spec in specs:
            try:
                make_env_from_tag(spec.tag, **spec.overrides)
            except (ValueError, TypeError) as e:
                _fail(f"{where}: {e}")
    return cfg


VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", help="engine, Ray and worker output on the console too (default: RUN_DIR/logs/); sets RAGEN_LOG_LEVEL=INFO")]


def _setup_logging(verbose: bool = False) -> None:
    from ragen_async.records.logfiles import LOG_LEVEL_ENV

    if verbose:
        os.environ[LOG_LEVEL_ENV] = "INFO"
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
    _setup_logging(verbose)
    from ragen_async.orchestrator import Interrupted, summarize_val
    from ragen_async.orchestrator import train as run_train
    from ragen_async.records.logfiles import one_line
    from ragen_async.records.logfiles import verbose as verbose_console

    cfg = None if resume is not None else _load(config, overrides)
    if resume is not None and (config is not None or overrides or run_dir is not None):
        _fail("--resume continues a run with its saved config; do not pass a config, overrides or --run-dir")
    if run_dir is not None and run_dir.exists():
        _fail(f"--run-dir {run_dir} already exists; continue that run with --resume {run_dir}")
    if cfg is not None:
        _check_model(cfg.model)
    t0 = time.perf_counter()
    try:
        path, last = run_train(cfg, resume=resume, run_dir_path=run_dir)
    except FileNotFoundError as e:
        _fail(str(e))
    except Interrupted as e:
        console.print(f"[yellow]{e}[/]", highlight=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        if verbose_console():
            raise
        _fail(one_line(e))  # its traceback is in the run's logs/driver.log, which the line names
    console.print(f"done in {time.perf_counter() - t0:.0f} s; run directory {path}")
    print(json.dumps({"run_dir": str(path), **summarize_val(last)}))
    if require_val_success is not None:
        got = last.get("val/success")
        if got is None or got < require_val_success:
            _fail(f"final validation success {got} is below the required {require_val_success}")


def _check_model(model: ModelConfig) -> None:
    from ragen_async.modeldir import model_problem

    problem = model_problem(model.path, model.sha256)
    if problem is not None:
        from ragen_async.tinymodel.warmstart import warm_start_command, warm_start_named_by

        if model.build is not None:
            _fail(f"{problem}; {model.build}")
        name = warm_start_named_by(model.path)
        command = "ragen-async make-model" if name is None else warm_start_command(name)
        _fail(f"{problem}; run `{command}` or point model.path at a local checkpoint")


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
            _fail(str(e))
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
        _fail(str(e))
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
    _setup_logging()
    cfg = _load(config, overrides)
    policies = list(dict.fromkeys(policy or ["llm"]))
    for p in policies:
        if p not in ("llm", "random", "oracle"):
            _fail(f"--policy must be llm, random or oracle (got {p!r})")
    if temperature is not None and not temperature >= 0:
        _fail(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    _check_model(cfg.model)
    from ragen_async.evaluation import run_eval

    try:
        summary = run_eval(cfg, policies=policies, env_tags=env, seeds=seeds, first_seed=seed,
                           temperature=temperature, out=out, console=console)
    except ValueError as e:
        _fail(str(e))
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
    _setup_logging()
    if warm_start is not None:
        from ragen_async.tinymodel.warmstart import WARM_STARTS, ensure_warm_start

        if warm_start not in WARM_STARTS:
            _fail(f"--warm-start must be one of {', '.join(WARM_STARTS)} (got {warm_start!r})")
        overrides = {k: v for k, v in (("eps", eps), ("episodes", episodes), ("sft_steps", sft_steps)) if v is not None}
        try:
            ensure_warm_start(warm_start, out, seed=seed, force=force, checkpoints=checkpoints, **overrides)
        except (ValueError, FileExistsError) as e:
            _fail(str(e))
        return
    if eps is not None or episodes is not None or checkpoints:
        _fail("--eps, --episodes and --checkpoints apply to --warm-start builds only")
    from ragen_async.tinymodel.report import make_model as build

    build(out or Path("artifacts/tiny-model"), seed=seed, force=force, sft_steps=sft_steps, report=report,
          seeds_per_tag=seeds_per_tag)


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (they measure and print tables; they assert nothing, "
                                                   "except `learns`, a check).")
app.add_typer(bench_app, name="bench")


@bench_app.command("pipeline")
def bench_pipeline_cmd(
    config: Annotated[Path, typer.Argument(help="base config")] = Path("configs/tiny/starpo_s_bandit.yaml"),
    overrides: OverridesArg = None,
    k: Annotated[list[str] | None, typer.Option(
        "--max-staleness", "--k", help="staleness bounds max_staleness, inf = unbounded (repeatable)")] = None,
    steps: Annotated[int, typer.Option(help="learner steps per run")] = 8,
    warmup: Annotated[int, typer.Option(help="steps excluded from the rates")] = 2,
    mode: Annotated[list[str] | None, typer.Option(
        help="pinned (disjoint CPU sets), unpinned (shared, same threads) and/or config (the config's own "
        "placement); default pinned and unpinned")] = None,
    consume: Annotated[list[str] | None, typer.Option(
        help="staleness.consume of the runs: arrival and/or in_order (repeatable; default the config's own); the "
        "table gives each run's share of generated groups dropped")] = None,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """Throughput vs staleness k under runtime: ray, pinned (disjoint CPU sets), unpinned or as configured."""
    _setup_logging()
    from ragen_async.bench.pipeline import bench_pipeline, parse_consume, parse_mode

    try:
        ks = [parse_k(x) for x in k] if k else [0, 1, 2, 4]
        modes = [parse_mode(m) for m in mode or ["pinned", "unpinned"]]
        consumes = [parse_consume(c) for c in consume] if consume else [None]
    except ValueError as e:
        _fail(str(e))
    rows, table = bench_pipeline(config, overrides or [], ks, steps, warmup, modes, consumes)
    _print_bench("Pipeline benchmark",
                 "pinned = rollout actors+engines and learner ranks on disjoint CPU sets; unpinned = shared, same "
                 "thread counts; config = the config's own CPU sets and thread counts.", table, out)


def _cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(map(str, cpus)) or "?"


def invocation(argv: list[str] | None = None) -> str:
    """The command line as it was typed (``ragen-async`` and every argument given), for a benchmark's record: no
    flag rebuilt by hand, so none is dropped; what was not given took its default, which ``--help`` shows."""
    return shlex.join(["ragen-async", *(sys.argv[1:] if argv is None else argv)])


def _print_bench(title: str, note: str, table: str, out: Path | None) -> None:
    """Print a benchmark's tables under the machine, the command as typed (:func:`invocation`) and a note, and
    (``out``) append them to a markdown file under a dated heading."""
    from ragen_async.bench.machine import machine_description

    text = f"machine: {machine_description()}\ncommand: `{invocation()}`\n{note}\n\n{table}\n"
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(f"\n## {title} ({time.strftime('%Y-%m-%d %H:%M')})\n\n{text}")


@bench_app.command("transport")
def bench_transport_cmd(
    groups: Annotated[int, typer.Option(help="Sokoban-sized groups per run (paper-sized: a tenth)")] = 2000,
    repeats: Annotated[int, typer.Option(help="runs of each path per shape and hop (medians, and means with "
                                                "95 % intervals from 2 runs up)")] = 3,
    pin: Annotated[bool, typer.Option(help="sender and receiver on disjoint halves of the CPUs, as on two "
                                           "machines (default: they share every core)")] = False,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """Codec + ZeroMQ on loopback vs a raw send_multipart of the same bytes, two group sizes."""
    from ragen_async.bench.components import HOPS, PAPER, SOKOBAN, bench_transport, format_transport

    if groups < 10 or repeats < 1:
        raise typer.BadParameter("--groups must be >= 10 and --repeats >= 1")
    try:
        rows = bench_transport({SOKOBAN: groups, PAPER: max(1, groups // 10)}, repeats, pin=pin)
    except ValueError as e:  # --pin where it cannot pin
        _fail(str(e))
    hops = "\n".join(f"- {hop}: {what}" for hop, what in HOPS.items())
    cpus = f"sender on CPUs {_cpu_list(rows[0].sender_cpus)}, receiver on CPUs {_cpu_list(rows[0].receiver_cpus)}"
    _print_bench("Transport benchmark",
                 f"sender and receiver: two processes on loopback TCP ({cpus}); {repeats} runs per path, the paths "
                 f"alternating (a pair: a project run and the raw run after it); medians, then means with 95 % "
                 f"intervals; raw = send_multipart / recv_multipart of the same frames\n\n{hops}",
                 format_transport(rows), out)


@bench_app.command("weights")
def bench_weights_cmd(
    model: Annotated[Path, typer.Option(help="the model whose tensors are synced first")] = Path("artifacts/tiny-model"),
    repeats: Annotated[int, typer.Option(help="syncs of each kind per tensor set (the table shows medians)")] = 5,
    large: Annotated[bool, typer.Option(help="also sync Qwen2.5-0.5B-shaped bf16 tensors (about 1 GB)")] = True,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """The gloo weight-sync path (publish + receive) vs a raw broadcast of the same bytes, one receiver."""
    from ragen_async.bench.components import (
        bench_weights_one,
        format_weights,
        learner_layout,
        synthetic_qwen_tensors,
        tiny_model_tensors,
    )

    if not (model / "model.safetensors").is_file():
        raise typer.BadParameter(f"{model} has no model.safetensors (run `ragen-async make-model` first)")
    sets = [(f"tiny model ({model})", tiny_model_tensors(str(model)))]
    if large:
        sets.append(("Qwen2.5-0.5B shapes, bf16 (synthetic)", synthetic_qwen_tensors()))
    rows = []
    for name, named in sets:
        # as the learner holds its weights (flatten_parameters: one buffer per dtype, sent as it is),
        # then as separate tensors (packed into buckets first, e.g. an FSDP gather's output)
        rows.append(bench_weights_one(f"{name}, flat as the learner's", learner_layout(named), repeats))
        rows.append(bench_weights_one(f"{name}, separate tensors", named, repeats))
    _print_bench("Weight-sync benchmark",
                 "publisher and one receiver process, gloo over loopback; each sync timed on the publisher up to "
                 "a barrier after the receiver finished", format_weights(rows), out)


@bench_app.command("learner")
def bench_learner_cmd(
    shape: Annotated[str, typer.Option(help="qwen0.5b (random weights, bf16) or tiny (the tiny model, fp32)")] = "qwen0.5b",
    device: Annotated[str, typer.Option(help="torch device: cuda, cuda:1, cpu")] = "cuda",
    steps: Annotated[int, typer.Option(help="timed learner steps per setting (the table shows medians)")] = 5,
    warmup: Annotated[int, typer.Option(help="learner steps before the timed ones")] = 2,
    trajectories: Annotated[int, typer.Option(help="trajectories per step (a paper step's share of one rank: 8)")] = 8,
    checkpointing: Annotated[list[str] | None, typer.Option(
        help="activation checkpointing settings to time: off, on (repeatable; default both)")] = None,
    dtype: Annotated[list[str] | None, typer.Option(
        help="model.dtype settings to time (repeatable; default bfloat16); with float32 first, each row's first "
             "update is compared with float32's")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the rows as JSON here")] = None,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """One learner rank's StarPO-S step at paper scale: tokens/s, peak memory and MFU, with and without
    activation checkpointing, per compute dtype (fp32 master weights in every setting)."""
    from ragen_async.bench.learner import bench_learner, format_table, rows_json

    settings = checkpointing or ["off", "on"]
    if bad := [c for c in settings if c not in ("off", "on")]:
        raise typer.BadParameter(f"--checkpointing takes off or on, not {', '.join(bad)}")
    dtypes = dtype or ["bfloat16"]
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]:
        raise typer.BadParameter(f"--dtype takes float32, bfloat16 or float16, not {', '.join(bad)}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter(f"--device {device}: torch sees no CUDA device here (use --device cpu)")
    rows = bench_learner(shape, device, tuple(c == "on" for c in settings), steps, warmup, trajectories,
                         dtypes=tuple(dtypes),
                         on_row=lambda r: print(f"  {r.shape} on {r.device}, {r.dtype} ({r.compute_dtype} compute), "
                                                f"checkpointing {'on' if r.checkpointing else 'off'}: {r.error or f'{r.step_s:.3f} s/step'}",
                                                flush=True))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(rows_json(rows), indent=1))
    _print_bench("Learner benchmark",
                 "one rank's share of a paper-scale step (configs/paper/starpo_s_sokoban.yaml: 8 trajectories of up to "
                 "4,000 tokens), synthetic token ids. FLOPs as torchtitan and verl count them (docs/benchmarks.md, "
                 "ragen_async/bench/flops.py): 6 x N without the embedding per token and pass, the attention term "
                 "12 x layers x heads x head_dim x sequence length, the head at the scored positions, over every "
                 "forward and backward of the step (old values, updates); recompute (activation checkpointing, the "
                 "chunked head) apart: MFU leaves it out, HFU counts it. Peaks in TFLOP/s: the device's dense spec "
                 "peak in the compute dtype (n/a on a CPU or a GPU not tabled) and a large matmul in the compute dtype "
                 "timed in this run", format_table(rows), out)


@bench_app.command("learns")
def bench_learns_cmd(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="dotted overrides of the config, e.g. learner.micro_batch_size=32")] = None,
    model: Annotated[Path, typer.Option(help="a local checkpoint (the tiny model by default)")] = Path("artifacts/tiny-model"),
    device: Annotated[str, typer.Option(help="torch device: cpu, cuda, cuda:1")] = "cpu",
    steps: Annotated[int, typer.Option(help="learner steps per dtype")] = 40,
    dtype: Annotated[list[str] | None, typer.Option(
        help="model.dtype settings (repeatable; default float32 and bfloat16; float32 is the reference curve)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the curves as JSON here")] = None,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """Does the learner learn: a one-token bandit with a known optimum (P(target) = 1) trained with the paper
    config's StarPO-S through the real buffer and Learner, per model.dtype; prints the curves and one VERDICT line
    and, unlike the other benchmarks, exits 1 unless every dtype reaches P(target) >= 0.9 with its curve within
    0.05 of float32's on average over the steps (ragen_async/bench/learns.py)."""
    from ragen_async.bench.learns import ACTOR_LR, CRITIC_LR, bench_learns, format_curves, result_json, verdict

    dtypes = dtype or ["float32", "bfloat16"]
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]:
        raise typer.BadParameter(f"--dtype takes float32, bfloat16 or float16, not {', '.join(bad)}")
    if not (model / "config.json").is_file():
        raise typer.BadParameter(f"{model} has no config.json (run `ragen-async make-model` first)")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter(f"--device {device}: torch sees no CUDA device here (use --device cpu)")
    result = bench_learns(str(model), device, steps, tuple(dtypes), overrides=overrides or [],
                          on_step=lambda c, s: print(f"  {c.dtype}: step {s}: P(target) {c.target_p[-1]:.3f}, "
                                                     f"reward {c.reward[-1]:.3f}", flush=True))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result_json(result), indent=1))
    ok, line = verdict(result)
    _print_bench("Learner learns",
                 f"P(target token) after each step; target {result.target} (prompt {result.prompt}); "
                 f"configs/paper/starpo_s_bandit.yaml with learner.actor_lr={ACTOR_LR:g}, "
                 f"learner.critic_lr={CRITIC_LR:g}",
                 format_curves(result), out)
    print(line)
    if not ok:
        raise typer.Exit(1)


@bench_app.command("decode")
def bench_decode_cmd(
    model: Annotated[str, typer.Option(help="a local checkpoint, or qwen0.5b (its shape, random weights)")] = "qwen0.5b",
    eager: Annotated[bool, typer.Option("--eager/--graphs", help="vLLM eager mode, or CUDA graphs (GPU only)")] = False,
    requests: Annotated[int, typer.Option(help="concurrent requests")] = 64,
    max_tokens: Annotated[int, typer.Option(help="tokens sampled per request (no stop tokens)")] = 256,
    dtype: Annotated[str, typer.Option(help="engine dtype")] = "bfloat16",
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the figures as JSON here")] = None,
) -> None:
    """Decode tokens/s of one vLLM engine in one mode (eager or CUDA graphs): run once per mode, each in its own
    process (ragen_async/bench/decode.py)."""
    from ragen_async.bench.decode import bench_decode

    if not eager:
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("--graphs: CUDA graphs need a CUDA device, and torch sees none here (use --eager)")
    row = bench_decode(model, enforce_eager=eager, requests=requests, max_tokens=max_tokens, dtype=dtype)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(row, indent=1))
    print(f"decode ({'eager' if eager else 'CUDA graphs'}), {model}, {dtype}: {row['tokens']} tokens in "
          f"{row['seconds']:.2f} s = {row['tokens_per_s']:,.0f} tokens/s ({requests} requests x {max_tokens} tokens; "
          f"engine start {row['engine_start_s']:.0f} s)")


@bench_app.command("cluster")
def bench_cluster_cmd(
    n: Annotated[list[int] | None, typer.Option("--n", help="rollout actors (repeatable)")] = None,
    steps: Annotated[int, typer.Option(help="measured learner steps per N")] = 8,
    warmup: Annotated[int, typer.Option(help="learner steps before the measured ones")] = 3,
    groups_per_actor: Annotated[int, typer.Option(help="groups per learner step per actor")] = 4,
    concurrent_groups: Annotated[int, typer.Option(help="groups an actor plays at once")] = 4,
    k: Annotated[int, typer.Option("--max-staleness", "--k", help="staleness bound max_staleness")] = 1,
    learner_step_s: Annotated[float, typer.Option(help="the stand-in learner step's duration")] = 0.3,
    actors_per_rank: Annotated[int, typer.Option(help="rollout actors per learner rank")] = 8,
    senders: Annotated[int, typer.Option(help="Ray actor processes (hosts) the simulated actors are spread over")] = 2,
    admission: Annotated[list[str] | None, typer.Option(
        help="admission protocol (repeatable): wait (production) or poll (one try_admit per group, the earlier "
             "protocol, for comparison)")] = None,
    engine_speed: Annotated[float, typer.Option(help="stand-in engines play groups this many times faster than the "
                                                     "profile's engine (a GPU's rate)")] = 1.0,
    profile: Annotated[Path, typer.Option(help="engine profile (simprofile)")] = Path("configs/sim/sokoban_tiny_profile.json"),
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """The real driver loop, Ray runtime, admission gate actor, buffer and ZeroMQ transport with N simulated rollout
    actors (engine profile measured on vLLM) and a stand-in learner: groups/s vs N and where it stops scaling, and
    the gate's admissions/s, call latency and CPU."""
    from ragen_async.bench.simcluster import bench_cluster, format_cluster
    from ragen_async.bench.simprofile import load_profile

    ns = n or [2, 8, 32, 128]
    if min(ns) < 1 or steps < 1 or warmup < 1:
        raise typer.BadParameter("--n, --steps and --warmup must be >= 1")
    from ragen_async.bench.simcluster import ADMISSIONS

    modes = tuple(admission or ["wait"])
    if not set(modes) <= set(ADMISSIONS):
        raise typer.BadParameter(f"--admission must be one of {', '.join(ADMISSIONS)}, not {', '.join(modes)}")
    if engine_speed <= 0:
        raise typer.BadParameter(f"--engine-speed must be > 0, not {engine_speed}")
    if not profile.is_file():
        raise typer.BadParameter(f"{profile} does not exist (python -m ragen_async.bench.simprofile OUT)")
    summary = load_profile(profile).summary()
    rows = bench_cluster(ns, steps, warmup, groups_per_actor=groups_per_actor, concurrent_groups=concurrent_groups,
                         max_staleness=k, learner_step_s=learner_step_s, actors_per_rank=actors_per_rank,
                         senders=senders, engine_speed=engine_speed, profile=profile, admissions=modes)
    note = (f"profile {profile}: {summary['groups']} Sokoban groups of 8 recorded on vLLM (tiny model), "
            f"{summary['turns_mean']:.1f} turns and {summary['episode_tokens_mean']:.0f} tokens per episode, "
            f"{summary['reply_tokens_mean']:.1f} tokens per reply, per-token latency p50 "
            f"{summary['token_latency_ms_p50']:.1f} ms / p90 {summary['token_latency_ms_p90']:.1f} ms, "
            f"{summary['group_s_mean']:.2f} s per group; rates over the last {steps} of {steps + warmup} steps")
    _print_bench("Simulated cluster", note, format_cluster(rows), out)


@bench_app.command("step")
def bench_step_cmd(
    config: Annotated[Path, typer.Argument(help="config")] = Path("configs/tiny/starpo_s_sokoban.yaml"),
    overrides: OverridesArg = None,
    steps: Annotated[int, typer.Option(help="measured learner steps")] = 10,
    warmup: Annotated[int, typer.Option(help="steps before the measured ones")] = 2,
    out: Annotated[Path | None, typer.Option(help="append the tables to this markdown file")] = None,
) -> None:
    """Where one learner step's time goes (local runtime), and the rollout's rate vs the raw engine's."""
    _setup_logging()
    from ragen_async.bench.step_profile import format_profile, profile_steps

    cfg = _load(config, overrides)
    profile = profile_steps(cfg, steps, warmup)
    _print_bench("Step profile",
                 f"median over {profile.steps} steps after {warmup} warm-up steps", format_profile(profile), out)


@bench_app.command("rllib")
def bench_rllib_cmd(
    k: Annotated[list[int] | None, typer.Option(
        "--max-staleness", "--k", help="staleness bound max_staleness, mapped onto RLlib's knobs (repeatable)")] = None,
    seeds: Annotated[int, typer.Option(help="runs per k (RLlib seeds 0 .. N-1)")] = 1,
    budget_s: Annotated[float, typer.Option(help="training seconds per run (evaluations not counted)")] = 120.0,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
    csv: Annotated[Path | None, typer.Option(
        help="write the cells (measured lag, final success and interval) here, for `report --reference`")] = None,
) -> None:
    """Classic reference: RLlib APPO with a small MLP on one-hot Sokoban, per staleness k (needs the rllib extra:
    pip install -e '.[cpu,rllib]')."""
    try:
        import ray.rllib  # noqa: F401 - the wheel ships the package; its extra brings what it imports
    except ImportError as e:
        _fail(f"bench rllib needs RLlib, an optional extra: pip install -e '.[cpu,rllib]' (or '.[gpu,rllib]'): {e}")
    from ragen_async.study.rllib_ref import (
        EVAL_EPISODES,
        EVAL_SEED,
        bench_rllib,
        cells,
        format_cells,
        reference_csv,
    )

    ks = k or [0, 1, 2, 4, 8]
    if min(ks) < 0 or seeds < 1 or budget_s <= 0:
        raise typer.BadParameter("--max-staleness must be >= 0, --seeds >= 1 and --budget-s > 0")

    def progress(run) -> None:
        s = run.summary()
        print(f"k={s['k']} seed={s['seed']}: final {s['final_success']:.3f} best {s['best_success']:.3f} "
              f"sampled {s['final_success_sampled']:.3f}, {s['env_steps']} env steps in {s['train_s']:.0f} s, "
              f"lag mean {s['lag_mean']:.2f} max {s['lag_max']}", flush=True)

    results = bench_rllib(ks, seeds, budget_s, on_run=progress)
    note = (f"APPO (RLlib new API stack, torch, CPU), one EnvRunner, MLP 64x64 on the one-hot 6x6 grid; "
            f"k -> broadcast_interval = k + 1 (ragen_async/study/rllib_ref.py says how, and what it does not "
            f"bound); success over seeds {EVAL_SEED}..{EVAL_SEED + EVAL_EPISODES - 1}, one episode each; "
            f"mean ± 95 % t-interval over seeds (none with one seed); lag measured per trained timestep")
    table = cells(results)
    _print_bench("RLlib APPO reference", note, format_cells(table), out)
    if csv is not None:
        csv.parent.mkdir(parents=True, exist_ok=True)
        csv.write_text(f"# {invocation()}, {time.strftime('%Y-%m-%d %H:%M')}\n" + reference_csv(table))


@bench_app.command("peer")
def bench_peer_cmd(
    env: Annotated[list[str] | None, typer.Option(help="bandit and/or sokoban (repeatable; default both)")] = None,
    k: Annotated[list[str] | None, typer.Option(
        "--max-staleness", "--k", help="our staleness bounds, inf = unbounded (repeatable; default 0, 2, inf)")] = None,
    reuse: Annotated[list[int] | None, typer.Option(
        help="TRL's steps_per_generation: optimizer steps per generation batch (repeatable; default 1, 3)")] = None,
    seeds: Annotated[int, typer.Option(help="runs per arm (seeds 0 .. N-1)")] = 3,
    steps: Annotated[int, typer.Option(help="optimizer steps per run")] = 30,
    warmup: Annotated[int, typer.Option(help="steps excluded from the rates")] = 2,
    val_episodes: Annotated[int, typer.Option(
        help="validation levels per environment after the last step (0: no validation)")] = 128,
    fixed_lag: Annotated[bool, typer.Option(help="our bounded k >= 1 as fixed lags (engines always at v - k)")] = False,
    model: Annotated[str, typer.Option(help="the model both sides train")] = "artifacts/tiny-model",
    run_root: Annotated[str, typer.Option(help="where our runs' directories go")] = "runs",
    out: Annotated[Path | None, typer.Option(help="append the tables to this markdown file")] = None,
    csv: Annotated[Path | None, typer.Option(help="write every step of every run here (CSV)")] = None,
) -> None:
    """TRL's GRPOTrainer beside ours on the same model, environments, levels and algorithm surface
    (ragen_async/bench/peer.py; needs the peer extra: pip install -e '.[peer]')."""
    try:
        import trl  # noqa: F401 - only to say how to install it
    except ImportError as e:
        _fail(f"bench peer needs TRL, an optional extra: pip install -e '.[peer]': {e}")
    _setup_logging()
    from ragen_async.bench.peer import bench_peer, cells, curve_comparison, format_cells, parse_env, step_frame

    try:
        envs = [parse_env(e) for e in env or ["bandit", "sokoban"]]
        ks = [parse_k(x) for x in k] if k else [0, 2, None]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    reuses = reuse or [1, 3]
    if seeds < 1 or steps < 1 or warmup < 0 or warmup >= steps or min(reuses) < 1 or val_episodes < 0:
        raise typer.BadParameter("--seeds, --steps and --reuse must be >= 1, 0 <= --warmup < --steps, "
                                 "--val-episodes >= 0")

    def progress(run) -> None:
        s = run.summary(warmup)
        print(f"{run.env} {run.side} {run.arm} seed={run.seed}: success {s['success']:.3f} val {s['val_success']:.3f}"
              f", {s['episodes_per_s']:.1f} episodes/s, step {s['step_s']:.2f} s (gen {s['gen_s']:.2f}, train "
              f"{s['train_s']:.2f}, sync {s['sync_s']:.3f}), start-up {s['startup_s']:.0f} s, age mean "
              f"{s['age_mean']:.2f} max {s['age_max']:.0f}", flush=True)

    runs = bench_peer(envs, ks, reuses, seeds, steps, model=model, val_episodes=val_episodes, fixed_lag=fixed_lag,
                      run_root=run_root, on_run=progress)
    curve, verdict = curve_comparison(runs, "bandit")
    note = (f"both sides: {model}, GRPO (group mean/std), no critic, no KL, no std filter, clip 0.2/0.28, dual clip "
            f"3 (TRL delta), token-mean (TRL bnpo), entropy bonus and learning rate of the environment's tiny config, "
            f"one optimizer pass per step; TRL plays our environments through rollout_func with its own generation; "
            f"rates over steps {warmup + 1}..{steps}; mean ± 95 % t-interval over seeds (none with one seed)")
    tables = format_cells(cells(runs, warmup))
    if curve:
        tables += f"\n\nSuccess per step on Bandit (the episodes trained on):\n\n{curve}\n\n{verdict}"
    _print_bench("Peer: TRL GRPOTrainer beside ours", note, tables, out)
    if csv is not None:
        csv.parent.mkdir(parents=True, exist_ok=True)
        csv.write_text(f"# {invocation()}, {time.strftime('%Y-%m-%d %H:%M')}\n" + step_frame(runs).to_csv(index=False))


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
    _setup_logging(verbose)
    from rich.console import Console

    from ragen_async.orchestrator import Interrupted
    from ragen_async.study.sweep import SweepError, run_sweep

    try:
        result = run_sweep(spec, resume=resume, out=out, overrides=overrides or [], dry_run=dry_run,
                           report=report, console=Console() if dry_run else console)
    except SweepError as e:
        _fail(str(e))
    except Interrupted:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if result is not None and not dry_run and result.manifest.counts()["failed"]:
        console.print(f"[bold red]some runs failed[/]; rerun them with: ragen-async sweep --resume {result.directory}")
        raise typer.Exit(1)


def parse_k(text: str) -> int | None:
    """A staleness bound as the command line gives it: an integer >= 0, or ``inf`` for unbounded."""
    if text.strip().lower() in ("inf", "none", "null"):
        return None
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise ValueError(f"--max-staleness {text!r}: expected an integer >= 0 or inf (unbounded)")
    return k


def _pairs(items: list[str] | None, option: str, expected: str, key: Callable[[str], Any],
           value: Callable[[str], Any]) -> dict[Any, Any]:
    """Parse repeated ``KEY=VALUE`` options; a converter's ValueError fails the command naming the option."""
    parsed: dict[Any, Any] = {}
    for item in items or []:
        left, sep, right = item.partition("=")
        try:
            if not sep:
                raise ValueError("no '='")
            parsed[key(left)] = value(right)
        except ValueError:
            _fail(f"{option} {item!r}: expected {expected}")
    return parsed


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

    baselines = _pairs(baseline, "--baseline", "NAME=SUCCESS, e.g. random=0.211", name, float)
    rates = _pairs(throughput, "--throughput", "K=GROUPS_PER_S with K an integer >= 0 or inf and a rate > 0, "
                   "e.g. 0=1.25 or inf=2.26", parse_k, rate)
    references = _pairs(reference, "--reference", "NAME=CSV, e.g. 'RLlib APPO=studies/rllib_appo/cells.csv'",
                        name, name)
    target = out if out is not None else (paths[0] / "report" if len(paths) == 1 else Path("report"))
    try:
        result = write_report(paths, target, threshold=threshold, smooth=smooth, baselines=baselines,
                              collapse_floor=collapse_floor, throughput=rates, references=references,
                              registered=registered)
    except ReportError as e:
        _fail(str(e))
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
        _fail(f"{run_dir} is not a directory (expected a run directory with metrics.jsonl)")
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
        _fail(f"{bad[0]!r} is not an override (key=value); to describe a config key: --explain {bad[0]}")
    keys = [] if explain in (None, "all") else [explain]
    try:
        cfg = load_config(config, overrides) if config is not None or overrides or explain is None else None
        docs = explain_fields(keys[0] if keys else None, cfg) if explain is not None else []
    except ConfigError as e:
        _fail(str(e))
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


if __name__ == "__main__":  # pragma: no cover - needed: vLLM on CPU spawns processes
    sys.exit(app())
