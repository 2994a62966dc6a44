"""``ragen-async``: the command-line entry point (train, eval, make-model, sweep, report, bench)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Asynchronous StarPO-S training of multi-turn LLM agents.")
console = Console(stderr=True)

ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config (configs/*.yaml); defaults if omitted")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. algo.clip_eps_high=0.28")]


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def _load(config: Path | None, overrides: list[str] | None):
    from ragen_async.config import ConfigError, load_config

    # A config path may be given as the first override-looking argument by mistake; say so clearly.
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        _fail(str(e))


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("RAGEN_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def train(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    resume: Annotated[Path | None, typer.Option(help="continue the run in this run directory")] = None,
) -> None:
    """Train with StarPO-S; prints the run directory, then live progress."""
    _setup_logging()
    from ragen_async.orchestrator import summarize_val
    from ragen_async.orchestrator import train as run_train

    cfg = None if resume is not None else _load(config, overrides)
    if resume is not None and (config is not None or overrides):
        _fail("--resume continues a run with its saved config; do not pass a config or overrides")
    if cfg is not None:
        _check_model(cfg.model.path)
    t0 = time.perf_counter()
    try:
        run_dir, last = run_train(cfg, resume=resume)
    except FileNotFoundError as e:
        _fail(str(e))
    console.print(f"done in {time.perf_counter() - t0:.0f} s; run directory {run_dir}")
    print(json.dumps({"run_dir": str(run_dir), **summarize_val(last)}))


def _check_model(path: str) -> None:
    if not (Path(path) / "config.json").is_file():
        _fail(f"model.path={path!r} does not exist or is not a model directory; "
              f"run `ragen-async make-model` or point model.path at a local checkpoint")


@app.command("eval")
def eval_cmd(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    policy: Annotated[str, typer.Option(help="llm | random | oracle")] = "llm",
    env: Annotated[list[str] | None, typer.Option(help="environment tag (repeatable); default: validation envs")] = None,
    seeds: Annotated[int | None, typer.Option(help="seeds per environment (default: validation n_groups)")] = None,
    seed: Annotated[int | None, typer.Option(help="first seed (default: validation.seed)")] = None,
    temperature: Annotated[float | None, typer.Option(help="sampling temperature (default: validation's)")] = None,
    out: Annotated[Path | None, typer.Option(help="episodes jsonl path")] = None,
) -> None:
    """Play fixed seeds with the LLM (vLLM), a random-valid-action policy, or the oracle."""
    _setup_logging()
    cfg = _load(config, overrides)
    if policy not in ("llm", "random", "oracle"):
        _fail(f"--policy must be llm, random or oracle (got {policy!r})")
    _check_model(cfg.model.path)
    from ragen_async.evaluation import run_eval

    try:
        summary = run_eval(cfg, policy=policy, env_tags=env, seeds=seeds, first_seed=seed,
                           temperature=temperature, out=out, console=console)
    except ValueError as e:
        _fail(str(e))
    print(json.dumps(summary))


@app.command("make-model")
def make_model(
    out: Annotated[Path, typer.Option(help="output directory")] = Path("artifacts/tiny-model"),
    seed: Annotated[int, typer.Option(help="build seed")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if a complete build exists")] = False,
) -> None:
    """Build (once) the tiny Qwen2 model and tokenizer used on CPU, then print its base-policy numbers."""
    _setup_logging()
    from ragen_async.tinymodel.build import ensure_tiny_model

    ensure_tiny_model(out, seed=seed, force=force)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover - needed: vLLM on CPU spawns processes
    sys.exit(app())
