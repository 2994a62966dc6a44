"""Sweeps: one base config, a grid of dotted overrides, one named run per grid point.

A sweep spec is a small YAML file (see ``configs/sweeps/``)::

    base: ../tiny/starpo_s_bandit.yaml      # relative to the spec file
    overrides:                              # applied to every run
      runtime: ray
    grid:                                   # the cartesian product of these, in this order
      staleness.max_staleness: [0, 1, 2, 4]
      staleness.fixed_lag: [false, true]
      seed: [0, 1, 2]
    exclude:                                # grid points to leave out (a list = any of these values)
      - {staleness.max_staleness: 0, staleness.fixed_lag: true}
    where:                                  # overrides for the grid points that match (after ``overrides``)
      - match: {staleness.max_staleness: 0}
        set: {rollout.cpus_per_worker: 2}
      - match: {staleness.max_staleness: [1, 2, 4]}
        base: ../tiny/other.yaml            # or another base config for them (the last matching rule's)
    labels:                                 # optional: how a grid value is spelled in run names
      learner.actor_lr: "lr{}"

Each grid point becomes a run named after its values (``k1-fixed-s0``). Every run's config is
resolved and validated before anything trains, so a typo fails the whole sweep at once, naming the
run. The runs then train one after another in this process (``orchestrator.train``); a run that
fails is recorded with its error and the sweep moves on. Everything needed to finish an interrupted
sweep lives in its directory::

    SWEEP_DIR/
      sweep.json           manifest: run name -> overrides, config, run dir, status, error
      spec.yaml            the spec as it was when the sweep was created
      configs/NAME.yaml    each run's resolved config (resuming never re-reads the base file)
      runs/NAME/...        each run's run directory, made by the orchestrator
      errors/NAME.txt      the traceback of a run that failed
      report/              the report written when the sweep ends

``--resume SWEEP_DIR`` skips finished runs, continues a partial one from its latest checkpoint
(``train(resume=run_dir)``) and starts the rest.

Its length (over the project's ~600 lines per module): the spec format, planning, the manifest and resumable
execution are one contract (a sweep directory any clone continues) and change together.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ragen_async.config import ConfigError, RunConfig, dump_config, load_config
from ragen_async.modeldir import model_problem
from ragen_async.orchestrator import Interrupted
from ragen_async.runtime.engine_pool import EnginePool, actor_cpus

TrainFn = Callable[..., tuple[Path, dict[str, float]]]
"""``train(cfg, resume=None) -> (run_dir, last_val_metrics)``, as ``orchestrator.train``."""

MANIFEST = "sweep.json"
STATUSES = ("done", "failed", "interrupted", "running", "pending")


class SweepError(ValueError):
    """A sweep spec, grid point or sweep directory that cannot be used; the message says which and why."""


# ---------------------------------------------------------------------------- run names
def _seed_label(value: Any) -> str:
    return f"s{value}"


DEFAULT_LABELS: dict[str, Callable[[Any], str]] = {
    "staleness.max_staleness": lambda v: "kinf" if v is None else f"k{v}",
    "staleness.fixed_lag": lambda v: "fixed" if v else "bounded",
    "algo.off_policy": lambda v: "nocorr" if v == "none" else str(v),
    "seed": _seed_label,
    "learner.seed": _seed_label,
}
"""How the grid keys this project sweeps most are spelled in run names."""


def _generic_label(key: str, value: Any) -> str:
    leaf = key.rsplit(".", 1)[-1]
    if isinstance(value, bool):
        return leaf if value else f"no_{leaf}"
    if isinstance(value, float):
        return f"{leaf}{value:g}"
    if isinstance(value, list | dict):  # e.g. a list of env groups: name it by a short content hash
        digest = hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:6]
        return f"{leaf}{digest}"
    return f"{leaf}{'none' if value is None else value}"


def value_label(key: str, value: Any, labels: Mapping[str, Any] | None = None) -> str:
    """The piece of a run name that stands for ``key = value``.

    A spec's ``labels`` entry wins: a template (``"lr{}"``) or a mapping from value to label.
    """
    custom = (labels or {}).get(key)
    if isinstance(custom, str):
        text = custom.format(value)
    elif isinstance(custom, Mapping) and _hashable(value) and value in custom:
        text = str(custom[value])
    elif key in DEFAULT_LABELS:
        text = DEFAULT_LABELS[key](value)
    else:
        text = _generic_label(key, value)
    return re.sub(r"[^A-Za-z0-9_.+=]+", "-", text).strip("-") or "x"


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def run_name(point: Mapping[str, Any], labels: Mapping[str, Any] | None = None) -> str:
    """``{"staleness.max_staleness": 1, "staleness.fixed_lag": True, "seed": 0}`` -> ``k1-fixed-s0``."""
    return "-".join(value_label(k, v, labels) for k, v in point.items()) or "base"


def format_override(key: str, value: Any) -> str:
    """``key=value`` such that ``load_config`` reads back exactly ``value`` (YAML flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9).strip()
    text = text.removesuffix("...").strip()  # a bare scalar document ends with an explicit end marker
    return f"{key}={text}"


# ---------------------------------------------------------------------------- the spec
SPEC_KEYS = ("name", "description", "base", "overrides", "grid", "exclude", "where", "labels")


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: Path
    """The base config, resolved against the spec's directory."""
    grid: dict[str, list[Any]]
    overrides: dict[str, Any] = field(default_factory=dict)
    exclude: list[dict[str, Any]] = field(default_factory=list)
    where: list[dict[str, Any]] = field(default_factory=list)
    """``{match: {grid key: value or list}, set: {dotted key: value}, base: path}`` (``set``, ``base`` or both):
    overrides, or another base config (resolved like ``base``), for the matching points."""
    labels: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    source: Path | None = None

    @classmethod
    def load(cls, path: str | Path) -> SweepSpec:
        path = Path(path)
        if not path.is_file():
            raise SweepError(f"sweep spec not found: {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise SweepError(f"malformed YAML in {path}: {e}") from None
        return cls.from_dict(data, origin=path)

    @classmethod
    def from_dict(cls, data: Any, *, origin: Path | None = None) -> SweepSpec:
        where = str(origin) if origin else "sweep spec"
        if not isinstance(data, Mapping):
            raise SweepError(f"{where}: must be a mapping with base, grid, ...")
        unknown = sorted(set(data) - set(SPEC_KEYS))
        if unknown:
            raise SweepError(f"{where}: unknown key(s) {unknown}; a spec has {list(SPEC_KEYS)}")
        if "base" not in data:
            raise SweepError(f"{where}: missing 'base' (the config file every run starts from)")

        def config_file(value: Any, what: str) -> Path:
            path = Path(str(value))
            if not path.is_absolute() and origin is not None:
                path = Path(os.path.normpath(origin.parent / path))
            if not path.is_file():
                raise SweepError(f"{where}: {what} config not found: {path}")
            return path

        base = config_file(data["base"], "base")

        grid = data.get("grid") or {}
        if not isinstance(grid, Mapping):
            raise SweepError(f"{where}: 'grid' must map dotted keys to lists of values")
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise SweepError(f"{where}: grid.{key} must be a non-empty list of values, got {values!r}")
        overrides = data.get("overrides") or {}
        if not isinstance(overrides, Mapping):
            raise SweepError(f"{where}: 'overrides' must map dotted keys to values")
        clash = sorted(set(overrides) & set(grid))
        if clash:
            raise SweepError(f"{where}: {clash} are both fixed overrides and grid keys")

        exclude = data.get("exclude") or []
        if not isinstance(exclude, list) or not all(isinstance(rule, Mapping) and rule for rule in exclude):
            raise SweepError(f"{where}: 'exclude' must be a list of non-empty mappings (grid key -> value)")
        for i, rule in enumerate(exclude):
            stray = sorted(set(rule) - set(grid))
            if stray:
                raise SweepError(f"{where}: exclude[{i}] names {stray}, which are not grid keys {list(grid)}")

        rules = data.get("where") or []
        if not isinstance(rules, list) or not all(isinstance(r, Mapping) and "match" in r and len(r) > 1
                                                  and set(r) <= {"match", "set", "base"} for r in rules):
            raise SweepError(f"{where}: 'where' must be a list of {{match: {{grid key: value}}, set: {{key: value}}, "
                             "base: config}} (set, base or both)")
        for i, rule in enumerate(rules):
            if not isinstance(rule["match"], Mapping) or not rule["match"] or \
                    ("set" in rule and (not isinstance(rule["set"], Mapping) or not rule["set"])):
                raise SweepError(f"{where}: where[{i}] needs a non-empty 'match' and a non-empty 'set' mapping "
                                 "or a 'base'")
            stray = sorted(set(rule["match"]) - set(grid))
            if stray:
                raise SweepError(f"{where}: where[{i}].match names {stray}, which are not grid keys {list(grid)}")
            clash = sorted(set(rule.get("set") or {}) & set(grid))
            if clash:
                raise SweepError(f"{where}: where[{i}].set sets grid keys {clash}; that would flatten the grid")
        rules = [{"match": dict(r["match"]), **({"set": dict(r["set"])} if "set" in r else {}),
                  **({"base": str(config_file(r["base"], f"where[{i}].base"))} if "base" in r else {})}
                 for i, r in enumerate(rules)]

        labels = data.get("labels") or {}
        if not isinstance(labels, Mapping):
            raise SweepError(f"{where}: 'labels' must map grid keys to a template ('lr{{}}') or a value->label map")
        name = data.get("name") or (origin.stem if origin else "sweep")
        return cls(name=str(name), base=base, grid={str(k): list(v) for k, v in grid.items()},
                   overrides=dict(overrides), exclude=[dict(r) for r in exclude],
                   where=rules, labels=dict(labels),
                   description=str(data.get("description") or ""), source=origin)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "base": str(self.base),
                "overrides": self.overrides, "grid": self.grid, "exclude": self.exclude, "where": self.where,
                "labels": self.labels}


def _matches(rule: Mapping[str, Any], point: Mapping[str, Any]) -> bool:
    def one(key: str, wanted: Any) -> bool:
        value = point[key]
        return value == wanted or (isinstance(wanted, list) and value in wanted)

    return all(one(k, v) for k, v in rule.items())


def expand(spec: SweepSpec) -> tuple[list[dict[str, Any]], int]:
    """The grid points left after ``exclude`` (in grid order), and how many were excluded."""
    keys = list(spec.grid)
    points = [dict(zip(keys, values, strict=True)) for values in itertools.product(*spec.grid.values())]
    kept = [p for p in points if not any(_matches(rule, p) for rule in spec.exclude)]
    return kept, len(points) - len(kept)


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PlannedRun:
    name: str
    point: dict[str, Any]
    """This run's grid values, in grid order."""
    config: RunConfig

    @property
    def overrides(self) -> list[str]:
        return [format_override(k, v) for k, v in self.point.items()]


@dataclass(frozen=True)
class Plan:
    spec: SweepSpec
    runs: list[PlannedRun]
    excluded: int
    extra_overrides: tuple[str, ...] = ()


def plan_sweep(spec: SweepSpec, extra_overrides: Sequence[str] = ()) -> Plan:
    """Expand the grid and resolve and validate every run's config; raise before anything runs.

    ``extra_overrides`` (``key=value`` strings, e.g. from the command line) apply to every run,
    after the spec's own overrides; they may not touch a grid key, which would flatten the grid.
    """
    for item in extra_overrides:
        key = item.split("=", 1)[0].strip()
        if key in spec.grid:
            raise SweepError(f"override {item!r} sets a grid key of sweep {spec.name!r}; edit the spec instead")
    points, excluded = expand(spec)
    if not points:
        raise SweepError(f"sweep {spec.name!r}: every grid point is excluded; nothing to run")

    names = [run_name(p, spec.labels) for p in points]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise SweepError(f"sweep {spec.name!r}: grid points share the run name(s) {clashes}; "
                         f"give the grid keys distinct spellings under 'labels'")

    fixed = [format_override(k, v) for k, v in spec.overrides.items()]
    runs, errors = [], []
    for name, point in zip(names, points, strict=True):
        own = [format_override(k, v) for k, v in point.items()]
        matching = [rule for rule in spec.where if _matches(rule["match"], point)]
        where = [format_override(k, v) for rule in matching for k, v in rule.get("set", {}).items()]
        base = next((Path(rule["base"]) for rule in reversed(matching) if "base" in rule), spec.base)
        try:
            cfg = load_config(base, [*fixed, *where, *extra_overrides, *own,
                                          format_override("name", f"{spec.name}-{name}")])
        except ConfigError as e:
            detail = str(e).replace("\n", "\n    ")
            errors.append(f"  run {name!r} ({' '.join(own) or 'no grid values'}):\n    {detail}")
            continue
        runs.append(PlannedRun(name, point, cfg))
    if errors:
        raise SweepError(f"sweep {spec.name!r}: {len(errors)} of {len(points)} runs have an invalid config; "
                         f"nothing was run\n" + "\n".join(errors))
    return Plan(spec, runs, excluded, tuple(extra_overrides))


def model_problems(configs: Sequence[RunConfig]) -> list[str]:
    """Why runs of these configs cannot start from their ``model.path`` here (missing, or not the pinned
    weights), one line per distinct model."""
    models = dict.fromkeys((c.model.path, c.model.sha256) for c in configs)
    return [problem for path, sha in models if (problem := model_problem(path, sha)) is not None]


# ---------------------------------------------------------------------------- the manifest
@dataclass
class RunRecord:
    name: str
    overrides: dict[str, Any]
    config: str
    """This run's resolved config, relative to the sweep directory."""
    status: str = "pending"
    run_dir: str | None = None
    """Relative to the sweep directory once known."""
    error: str | None = None
    started: str | None = None
    finished: str | None = None
    duration_s: float | None = None
    val: dict[str, float] = field(default_factory=dict)
    """The last validation success per environment (``val/<Env>/success``)."""


@dataclass
class Manifest:
    name: str
    created: str
    spec: dict[str, Any]
    extra_overrides: list[str]
    runs: dict[str, RunRecord]
    version: int = 1

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text())
            runs = {name: RunRecord(name=name, **{k: v for k, v in rec.items() if k != "name"})
                    for name, rec in data.pop("runs").items()}
            return cls(runs=runs, **data)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise SweepError(f"cannot read sweep manifest {path}: {e}") from None

    def write(self, path: Path) -> None:
        data = {**asdict(self), "runs": {n: {k: v for k, v in asdict(r).items() if k != "name"}
                                         for n, r in self.runs.items()}}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)  # atomic: an interrupted write never leaves a half manifest

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.runs.values()) for s in STATUSES}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _orchestrator_train(cfg: RunConfig | None, *, resume: Path | None = None,
                        pool: EnginePool | None = None) -> tuple[Path, dict[str, float]]:
    from ragen_async import orchestrator  # looked up at call time (tests replace ``orchestrator.train``)

    return orchestrator.train(cfg, resume=resume, pool=pool)


def _disconnect_ray() -> None:
    """After a failed run: leave no Ray session (and its actors' resources) to the next run."""
    import sys

    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the next run's ray.init reports a real problem
        pass


def _val_success(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if k.startswith("val/") and k.endswith("/success") and k.count("/") == 2 and isinstance(v, int | float)}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


# ---------------------------------------------------------------------------- the sweep directory
class Sweep:
    """A sweep directory: its manifest, and the runs it still has to do."""

    def __init__(self, directory: Path, manifest: Manifest):
        self.directory = Path(directory)
        self.manifest = manifest
        self._pool: EnginePool | None = None

    # ---------------------------------------------------------------- creating and opening
    @classmethod
    def create(cls, plan: Plan, directory: str | Path) -> Sweep:
        directory = Path(directory)
        if (directory / MANIFEST).exists():
            raise SweepError(f"{directory} already holds a sweep; continue it with --resume {directory}")
        if directory.exists() and any(directory.iterdir()):
            raise SweepError(f"{directory} exists and is not empty; choose another --out")
        (directory / "configs").mkdir(parents=True)
        spec = plan.spec
        if spec.source is not None:
            (directory / "spec.yaml").write_text(f"# copied from {spec.source} on {_now()}\n"
                                                 + spec.source.read_text())
        runs = {}
        for run in plan.runs:
            config = Path("configs") / f"{run.name}.yaml"
            (directory / config).write_text(dump_config(run.config))
            runs[run.name] = RunRecord(name=run.name, overrides=run.point, config=str(config))
        manifest = Manifest(name=spec.name, created=_now(), spec=spec.to_dict(),
                            extra_overrides=list(plan.extra_overrides), runs=runs)
        sweep = cls(directory, manifest)
        sweep.save()
        return sweep

    @classmethod
    def open(cls, directory: str | Path) -> Sweep:
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise SweepError(f"{directory} is not a sweep directory (no {MANIFEST})")
        return cls(directory, Manifest.read(path))

    def save(self) -> None:
        self.manifest.write(self.directory / MANIFEST)

    # ---------------------------------------------------------------- paths
    def run_root(self, name: str) -> Path:
        return self.directory / "runs" / name

    def run_dir(self, record: RunRecord) -> Path | None:
        """The run directory a run already has (recorded, or found on disk after a crash), if any."""
        if record.run_dir and (self.directory / record.run_dir / "config.yaml").is_file():
            return self.directory / record.run_dir
        root = self.run_root(record.name)
        found = sorted((p.parent for p in root.glob("*/config.yaml")), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    def _relative(self, path: Path) -> str:
        return os.path.relpath(path, self.directory)

    def configs(self, todo_only: bool = True) -> list[RunConfig]:
        return [load_config(self.directory / r.config) for r in self.manifest.runs.values()
                if not todo_only or r.status != "done"]

    # ---------------------------------------------------------------- running
    def run(self, train_fn: TrainFn | None = None, console: Console | None = None,
            pool: EnginePool | None = None) -> Manifest:
        """Train every run that is not done, in order; a failure is recorded and the sweep goes on. With the
        real trainer, runs on Ray take their rollout actors warm from the previous run (an
        :class:`~ragen_async.runtime.engine_pool.EnginePool`, this sweep's unless ``pool`` is given)."""
        console = console or Console(stderr=True)
        if train_fn is not None:
            return self._run_all(train_fn, console, None)
        if pool is not None:
            return self._run_all(functools.partial(_orchestrator_train, pool=pool), console, pool)
        with EnginePool() as own:
            return self._run_all(functools.partial(_orchestrator_train, pool=own), console, own)

    def _run_all(self, train_fn: TrainFn, console: Console, pool: EnginePool | None) -> Manifest:
        self._pool = pool
        if pool is not None:  # a Ray session the first run starts must hold the largest run's actors too
            pool.session_cpus = max([pool.session_cpus, *(actor_cpus(c) for c in self.configs() if c.runtime == "ray")])
        records = list(self.manifest.runs.values())
        done = sum(r.status == "done" for r in records)
        console.print(f"[bold]sweep {self.manifest.name}[/]: {len(records)} runs, {done} already done, "
                      f"directory {self.directory}")
        for i, record in enumerate(records, 1):
            if record.status != "done":
                self._run_one(record, f"{i}/{len(records)}", train_fn, console)
        self.print_status(console, title=f"sweep {self.manifest.name}")
        return self.manifest

    def _run_one(self, record: RunRecord, position: str, train_fn: TrainFn, console: Console) -> None:
        console.rule(f"[bold]run {position}[/] {record.name}")
        existing = self.run_dir(record)
        record.status, record.error, record.started = "running", None, _now()
        record.run_dir = self._relative(existing) if existing else None
        self.save()
        t0 = time.monotonic()
        try:
            if existing is not None:
                console.print(f"continuing {existing} from its latest checkpoint")
                path, last = train_fn(None, resume=existing)
            else:
                # One W&B group per sweep; the run's grid values as tags (e.g. staleness.max_staleness=4).
                cfg = load_config(self.directory / record.config, [
                    format_override("run_root", str(self.run_root(record.name))),
                    format_override("logging.wandb_group", self.directory.name),
                    format_override("logging.wandb_tags", [f"{k}={v}" for k, v in record.overrides.items()])])
                path, last = train_fn(cfg)
        except (KeyboardInterrupt, Interrupted):
            record.status = "interrupted"
            self._note_run_dir(record)
            console.print(f"[yellow]interrupted[/]; continue with: ragen-async sweep --resume {self.directory}")
            raise
        except Exception as e:  # noqa: BLE001 - one run's failure must not end an overnight sweep
            record.status = "failed"
            first_line = (str(e).strip().splitlines() or [""])[0]
            record.error = f"{type(e).__name__}: {first_line}"[:500]
            self._note_run_dir(record)
            errors = self.directory / "errors"
            errors.mkdir(exist_ok=True)
            (errors / f"{record.name}.txt").write_text(traceback.format_exc())
            console.print(f"[bold red]failed[/] {record.name}: {escape(record.error)} "
                          f"(traceback in {errors / (record.name + '.txt')}); continuing with the next run")
            if self._pool is not None:
                self._pool.close()  # its actors belong to the session that ends here
            _disconnect_ray()
        else:
            record.status = "done"
            record.run_dir = self._relative(Path(path))
            record.val = _val_success(last or {})
            val = " ".join(f"{k.removeprefix('val/').removesuffix('/success')} {v:.3f}"
                           for k, v in record.val.items())
            console.print(f"[bold green]done[/] {record.name} in {_duration(time.monotonic() - t0)}"
                          + (f"; val success {val}" if val else ""))
        finally:
            record.finished = _now()
            record.duration_s = round(time.monotonic() - t0, 1)
            self.save()

    def _note_run_dir(self, record: RunRecord) -> None:
        found = self.run_dir(record)
        if found is not None:
            record.run_dir = self._relative(found)

    # ---------------------------------------------------------------- showing
    def print_status(self, console: Console, title: str | None = None) -> None:
        table = Table(title=title, title_justify="left", header_style="bold")
        for column in ("#", "run", "status", "val success", "time", "run dir / error"):
            table.add_column(column, no_wrap=column in ("run", "status"))
        style = {"done": "green", "failed": "red", "running": "yellow", "interrupted": "yellow", "pending": "dim"}
        for i, r in enumerate(self.manifest.runs.values(), 1):
            val = " ".join(f"{v:.2f}" for v in r.val.values()) or "—"
            where = r.error if r.status == "failed" else (r.run_dir or "—")
            table.add_row(str(i), r.name, f"[{style[r.status]}]{r.status}[/]" if r.status in style else r.status,
                          val, _duration(r.duration_s), escape(where or "—"))
        console.print(table)
        counts = {s: n for s, n in self.manifest.counts().items() if n}
        console.print(", ".join(f"{n} {s}" for s, n in counts.items()))


def print_plan(plan: Plan, console: Console) -> None:
    spec = plan.spec
    console.print(f"[bold]sweep {spec.name}[/]: {len(plan.runs)} runs"
                  + (f" ({plan.excluded} grid points excluded)" if plan.excluded else "")
                  + f", base {spec.base}")
    if spec.description:
        console.print(spec.description.strip())
    fixed = [format_override(k, v) for k, v in spec.overrides.items()] + list(plan.extra_overrides)
    if fixed:
        console.print("every run: " + " ".join(fixed))
    table = Table(header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("run", no_wrap=True)
    for key in spec.grid:
        table.add_column(key.replace(".", ".\n"))  # one dotted part per line keeps the columns narrow
    for i, run in enumerate(plan.runs, 1):
        table.add_row(str(i), run.name, *(o.split("=", 1)[1] for o in run.overrides))
    console.print(table)


def default_sweep_dir(name: str, root: str | Path = "runs/sweeps") -> Path:
    return Path(root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


# ---------------------------------------------------------------------------- the entry point
def run_sweep(
    spec_path: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    dry_run: bool = False,
    report: bool = True,
    train_fn: TrainFn | None = None,
    console: Console | None = None,
    pool: EnginePool | None = None,
) -> Sweep | None:
    """Plan (or reopen) a sweep and run what is left of it; ``dry_run`` only prints the plan.

    Returns the sweep (``None`` for a dry run of a new spec). Raises :class:`SweepError` for a
    bad spec, an invalid run config or a missing model, before anything trains.
    """
    console = console or Console(stderr=True)
    if (spec_path is None) == (resume is None):
        raise SweepError("give either a sweep spec or --resume SWEEP_DIR")
    if resume is not None:
        if overrides or out is not None:
            raise SweepError("--resume continues a sweep with its saved configs; do not pass overrides or --out")
        sweep = Sweep.open(resume)
        if dry_run:
            sweep.print_status(console, title=f"sweep {sweep.manifest.name} (dry run: nothing is trained)")
            return sweep
        configs = sweep.configs(todo_only=True)
    else:
        plan = plan_sweep(SweepSpec.load(spec_path), overrides)
        configs = [r.config for r in plan.runs]
        if dry_run:
            print_plan(plan, console)
            for problem in model_problems(configs):
                console.print(f"[yellow]note:[/] {escape(problem)}")
            return None
        sweep = None

    problems = model_problems(configs)
    if problems:
        raise SweepError("; ".join(problems) + "; run `ragen-async make-model` (or the warm start's build) "
                         "or point model.path at a local checkpoint")
    if sweep is None:
        sweep = Sweep.create(plan, out if out is not None else default_sweep_dir(plan.spec.name))
    try:
        sweep.run(train_fn=train_fn, console=console, pool=pool)
    finally:
        if report:
            _write_report(sweep, console)
    return sweep


def _write_report(sweep: Sweep, console: Console) -> None:
    if not any(r.run_dir for r in sweep.manifest.runs.values()):
        return
    from ragen_async.study.report import write_report

    try:
        result = write_report([sweep.directory], sweep.directory / "report")
        console.print(f"report: {result.markdown}")
    except Exception as e:  # noqa: BLE001 - a plotting problem must not hide the sweep's outcome
        console.print(f"[yellow]could not write the report:[/] {type(e).__name__}: {e}")
