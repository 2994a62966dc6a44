"""Sweeps: grid expansion, run names, up-front validation, the manifest, failures and resume."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from ragen_async.study.sweep import (
    Sweep,
    SweepError,
    SweepSpec,
    expand,
    format_override,
    plan_sweep,
    run_name,
    run_sweep,
)

TINY_BANDIT = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "starpo_s_bandit.yaml"
STALENESS_GRID = {"staleness.max_staleness": [0, 1, 2, 4], "staleness.fixed_lag": [False, True], "seed": [0, 1]}
K0_FIXED = {"staleness.max_staleness": 0, "staleness.fixed_lag": True}


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def output(console: Console) -> str:
    return console.file.getvalue()


# ---------------------------------------------------------------------------- expansion and names
def test_grid_times_exclude(bandit_spec):
    spec = SweepSpec.load(bandit_spec(STALENESS_GRID, exclude=[K0_FIXED]))
    points, excluded = expand(spec)
    assert (len(points), excluded) == (4 * 2 * 2 - 2, 2)
    assert all(not (p["staleness.max_staleness"] == 0 and p["staleness.fixed_lag"]) for p in points)
    assert list(points[0]) == list(STALENESS_GRID)  # grid order is kept


def test_exclude_value_list_means_any_of(bandit_spec):
    spec = SweepSpec.load(bandit_spec({"algo.off_policy": ["none", "tis", "decoupled"], "seed": [0, 1]},
                                      exclude=[{"algo.off_policy": ["tis", "decoupled"], "seed": 1}]))
    names = [run_name(p, spec.labels) for p in expand(spec)[0]]
    assert names == ["nocorr-s0", "nocorr-s1", "tis-s0", "decoupled-s0"]


def test_names_are_readable_unique_and_stable(bandit_spec):
    grid = {"staleness.max_staleness": [0, 1, 2, 4], "staleness.fixed_lag": [False, True],
            "algo.off_policy": ["none", "tis"], "seed": [0, 1]}
    path = bandit_spec(grid, exclude=[K0_FIXED])
    first = [r.name for r in plan_sweep(SweepSpec.load(path)).runs]
    again = [r.name for r in plan_sweep(SweepSpec.load(path)).runs]
    assert first == again
    assert len(set(first)) == len(first)
    assert first[0] == "k0-bounded-nocorr-s0"
    assert "k1-fixed-tis-s0" in first


def test_labels_from_the_spec(bandit_spec):
    spec = SweepSpec.load(bandit_spec({"learner.actor_lr": [1e-4, 3e-4], "staleness.fixed_lag": [False, True]},
                                      labels={"learner.actor_lr": "lr{}",
                                              "staleness.fixed_lag": {False: "float", True: "lag"}}))
    assert [run_name(p, spec.labels) for p in expand(spec)[0]] == [
        "lr0.0001-float", "lr0.0001-lag", "lr0.0003-float", "lr0.0003-lag"]


def test_clashing_names_are_refused(bandit_spec):
    path = bandit_spec({"learner.actor_lr": [1e-4, 2e-4]}, labels={"learner.actor_lr": "lr"})
    with pytest.raises(SweepError, match="share the run name"):
        plan_sweep(SweepSpec.load(path))


def test_where_sets_overrides_on_the_matching_points_only(bandit_spec):
    """The study's placement: at k = 0 rollout and learner take turns and share both cores; at k >= 1 they
    overlap and each gets its own. A rule's ``set`` comes after the spec's overrides and before the command
    line's; it never changes a run's name."""
    split = {"rollout.cpus_per_worker": 1, "rollout.cpu_affinity": [0], "learner.cpu_affinity": [1]}
    spec = SweepSpec.load(bandit_spec({"staleness.max_staleness": [0, 1, None], "seed": [0, 1]},
                                      overrides={"runtime": "ray", "rollout.cpus_per_worker": 2},
                                      where=[{"match": {"staleness.max_staleness": [1, None]}, "set": split},
                                             {"match": {"seed": 1}, "set": {"learner.torch_threads": 2}}]))
    runs = {r.name: r.config for r in plan_sweep(spec, ["learner.cpu_affinity=[0]"]).runs}
    assert list(runs) == ["k0-s0", "k0-s1", "k1-s0", "k1-s1", "kinf-s0", "kinf-s1"]
    for name, cfg in runs.items():
        k0 = name.startswith("k0")
        assert cfg.rollout.cpus_per_worker == (2 if k0 else 1)
        assert cfg.rollout.cpu_affinity == (None if k0 else [0])
        assert cfg.learner.cpu_affinity == [0]  # the command line wins
        assert cfg.learner.torch_threads == (2 if name.endswith("s1") else 1)
    assert SweepSpec.from_dict(spec.to_dict()).where == spec.where  # kept in the manifest as given


def test_where_can_give_the_matching_points_another_base_config(bandit_spec, tmp_path):
    """A placement defined once, in a config file, and chosen per grid point: the matching points start from
    that file (its own overrides and the grid still apply on top); the last matching rule's base wins."""
    other = tmp_path / "one_core_each.yaml"
    other.write_text(f"inherit: {TINY_BANDIT}\nrollout:\n  cpu_affinity: [0]\nlearner:\n  cpu_affinity: [1]\n")
    spec = SweepSpec.load(bandit_spec({"staleness.max_staleness": [0, 1, 2]},
                                      where=[{"match": {"staleness.max_staleness": [1, 2]}, "base": other.name},
                                             {"match": {"staleness.max_staleness": 2},
                                              "set": {"learner.cpu_affinity": [0]}}]))
    assert spec.where[0]["base"] == str(other)  # resolved against the spec's folder
    runs = {r.name: r.config for r in plan_sweep(spec).runs}
    assert runs["k0"].rollout.cpu_affinity is None and runs["k0"].learner.cpu_affinity is None
    assert runs["k1"].rollout.cpu_affinity == [0] and runs["k1"].learner.cpu_affinity == [1]
    assert runs["k2"].rollout.cpu_affinity == [0] and runs["k2"].learner.cpu_affinity == [0]  # base, then set
    assert runs["k1"].staleness.max_staleness == 1  # the grid on top of the other base
    assert SweepSpec.from_dict(spec.to_dict()).where == spec.where


@pytest.mark.parametrize("value", [1e-6, 0.25, None, True, "none", "true", 4,
                                   [{"tag": "Bandit", "n_groups": 8}], {"a": 1}])
def test_overrides_read_back_exactly(value):
    assert yaml.safe_load(format_override("x", value).split("=", 1)[1]) == value


# ---------------------------------------------------------------------------- validation up front
def test_a_bad_key_fails_the_whole_sweep_before_anything_runs(bandit_spec, fake_model, fake_train, tmp_path):
    path = bandit_spec({"seed": [0, 1], "algo.clip_eps_hgih": [0.3]})
    train = fake_train()
    with pytest.raises(SweepError) as err:
        run_sweep(path, out=tmp_path / "sweep", overrides=[f"model.path={fake_model}"], train_fn=train,
                  console=quiet())
    message = str(err.value)
    assert "2 of 2 runs" in message and "nothing was run" in message
    assert "run 's0-clip_eps_hgih0.3'" in message and "algo.clip_eps_hgih" in message
    assert train.calls == [] and not (tmp_path / "sweep").exists()


def test_a_bad_value_names_the_one_run_it_breaks(bandit_spec):
    with pytest.raises(SweepError) as err:
        plan_sweep(SweepSpec.load(bandit_spec({"staleness.max_staleness": [1, -2]})))
    assert "1 of 2 runs" in str(err.value) and "'k-2'" in str(err.value)
    assert "'k1'" not in str(err.value)


@pytest.mark.parametrize("spec, message", [
    ({"grid": {"seed": [0]}}, "missing 'base'"),
    ({"base": "nope.yaml", "grid": {"seed": [0]}}, "base config not found"),
    ({"base": "BASE", "grid": {"seed": 0}}, "non-empty list"),
    ({"base": "BASE", "grid": {"seed": [0]}, "exclude": [{"sede": 0}]}, "not grid keys"),
    ({"base": "BASE", "grid": {"seed": [0]}, "overrides": {"seed": 1}}, "both fixed overrides and grid keys"),
    ({"base": "BASE", "grdi": {"seed": [0]}}, "unknown key"),
    ({"base": "BASE", "grid": {"seed": [0]}, "exclude": [{"seed": 0}]}, "every grid point is excluded"),
    ({"base": "BASE", "grid": {"seed": [0]}, "where": [{"match": {"sede": 0}, "set": {"learner.torch_threads": 2}}]},
     "not grid keys"),
    ({"base": "BASE", "grid": {"seed": [0]}, "where": [{"match": {"seed": 0}, "set": {"seed": 1}}]},
     "flatten the grid"),
    ({"base": "BASE", "grid": {"seed": [0]}, "where": [{"match": {"seed": 0}}]}, "a list of"),
    ({"base": "BASE", "grid": {"seed": [0]}, "where": [{"match": {}, "set": {"learner.torch_threads": 2}}]}, "non-empty"),
    ({"base": "BASE", "grid": {"seed": [0]}, "where": [{"match": {"seed": 0}, "base": "gone.yaml"}]},
     r"where\[0\].base config not found"),
    ({"base": "BASE", "grid": {"seed": [0]}, "where": [{"match": {"seed": 0}, "bsae": "x.yaml"}]}, "a list of"),
])
def test_malformed_specs_say_what_is_wrong(tmp_path, spec, message):
    if spec.get("base") == "BASE":
        spec = {**spec, "base": str(TINY_BANDIT)}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepError, match=message):
        plan_sweep(SweepSpec.load(path))


def test_grid_keys_cannot_be_overridden_from_the_command_line(bandit_spec):
    with pytest.raises(SweepError, match="sets a grid key"):
        plan_sweep(SweepSpec.load(bandit_spec({"seed": [0, 1]})), ["seed=3"])


# ---------------------------------------------------------------------------- dry run
def test_dry_run_prints_the_plan_and_touches_nothing(bandit_spec, tmp_path, fake_train):
    path = bandit_spec(STALENESS_GRID, exclude=[K0_FIXED], overrides={"runtime": "ray"})
    console, train = quiet(), fake_train()
    assert run_sweep(path, out=tmp_path / "sweep", dry_run=True, train_fn=train, console=console) is None
    text = output(console)
    assert "14 runs (2 grid points excluded)" in text and "every run: runtime=ray" in text
    for name in ("k0-bounded-s0", "k1-fixed-s1", "k4-bounded-s0"):
        assert name in text
    assert "k0-fixed" not in text
    assert train.calls == [] and not (tmp_path / "sweep").exists()


# ---------------------------------------------------------------------------- running
def run_small(bandit_spec, fake_model, tmp_path, train, **kw):
    path = bandit_spec({"staleness.max_staleness": [0, 1], "seed": [0, 1]}, overrides={"runtime": "ray"})
    return run_sweep(path, out=tmp_path / "sweep", overrides=[f"model.path={fake_model}", "total_steps=4"],
                     train_fn=train, console=quiet(), report=False, **kw)


def test_a_sweep_trains_every_run_and_writes_its_manifest(bandit_spec, fake_model, tmp_path, fake_train):
    train = fake_train()
    sweep = run_small(bandit_spec, fake_model, tmp_path, train)
    assert [c for c, _ in train.calls] == ["k0-s0", "k0-s1", "k1-s0", "k1-s1"]
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert list(manifest["runs"]) == ["k0-s0", "k0-s1", "k1-s0", "k1-s1"]
    rec = manifest["runs"]["k1-s0"]
    assert rec["status"] == "done" and rec["overrides"] == {"staleness.max_staleness": 1, "seed": 0}
    assert rec["val"] == {"val/Bandit/success": pytest.approx(0.6)}
    assert (sweep.directory / rec["run_dir"] / "metrics.jsonl").is_file()
    assert rec["run_dir"].startswith("runs/k1-s0/")
    saved = yaml.safe_load((sweep.directory / rec["config"]).read_text())
    assert saved["staleness"]["max_staleness"] == 1 and saved["total_steps"] == 4 and saved["runtime"] == "ray"
    assert saved["name"] == "t-k1-s0"
    assert (sweep.directory / "spec.yaml").read_text().startswith("# copied from")
    # W&B: one group per sweep, the run's grid values as tags.
    run_cfg = yaml.safe_load((sweep.directory / rec["run_dir"] / "config.yaml").read_text())
    assert run_cfg["logging"]["wandb_group"] == sweep.directory.name
    assert run_cfg["logging"]["wandb_tags"] == ["staleness.max_staleness=1", "seed=0"]


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(bandit_spec, fake_model, tmp_path, fake_train):
    sweep = run_small(bandit_spec, fake_model, tmp_path, fake_train(fail={"k0-s1"}))
    runs = sweep.manifest.runs
    assert [r.status for r in runs.values()] == ["done", "failed", "done", "done"]
    assert runs["k0-s1"].error == "RuntimeError: engine died in k0-s1"
    assert runs["k0-s1"].run_dir is not None  # found on disk, though train never returned it
    assert "second line of detail" in (sweep.directory / "errors" / "k0-s1.txt").read_text()


def test_resume_skips_finished_runs_and_continues_the_partial_one(bandit_spec, fake_model, tmp_path, fake_train,
                                                                  monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        run_small(bandit_spec, fake_model, tmp_path, fake_train(interrupt={"k0-s1"}))
    sweep = Sweep.open(tmp_path / "sweep")
    statuses = {n: r.status for n, r in sweep.manifest.runs.items()}
    assert statuses == {"k0-s0": "done", "k0-s1": "interrupted", "k1-s0": "pending", "k1-s1": "pending"}
    partial = sweep.manifest.runs["k0-s1"].run_dir
    assert partial is not None

    from ragen_async import orchestrator

    train = fake_train()
    monkeypatch.setattr(orchestrator, "train", train)  # the real entry point, replaced
    console = quiet()
    sweep = run_sweep(resume=tmp_path / "sweep", console=console, report=False)
    assert train.calls == [("k0-s1", "resume"), ("k1-s0", "new"), ("k1-s1", "new")]
    from ragen_async.runtime.engine_pool import EnginePool

    assert isinstance(train.pools[0], EnginePool) and all(p is train.pools[0] for p in train.pools)  # one, shared
    assert all(r.status == "done" for r in sweep.manifest.runs.values())
    assert sweep.manifest.runs["k0-s1"].run_dir == partial
    assert "run 2/4" in output(console) and "run 1/4" not in output(console)


def test_the_ray_session_a_sweep_starts_holds_its_largest_run(bandit_spec, fake_model, tmp_path, fake_train,
                                                              monkeypatch):
    """The study's sweep started its Ray session in a run that needed 2 CPUs (one core each for engine and
    learner) and its next run, needing 3 (k = 0: two for the engine), failed: "the config needs 3 CPUs ... but
    the Ray cluster has 2". The pool every run gets now says how many CPUs a session it starts must advertise:
    the largest run's, known before the first run starts (RayRuntime reads it)."""
    from ragen_async import orchestrator

    path = bandit_spec({"seed": [0], "staleness.max_staleness": [1, 0]},
                       overrides={"runtime": "ray", "rollout.num_workers": 1, "learner.num_ranks": 1},
                       where=[{"match": {"staleness.max_staleness": 0}, "set": {"rollout.cpus_per_worker": 2}}])
    train = fake_train()
    seen = []
    monkeypatch.setattr(orchestrator, "train", lambda cfg=None, **kw: (seen.append(kw["pool"].session_cpus),
                                                                       train(cfg, **kw))[1])
    run_sweep(path, out=tmp_path / "sweep", overrides=[f"model.path={fake_model}"], console=quiet(), report=False)
    assert [name for name, _ in train.calls] == ["s0-k1", "s0-k0"]
    assert seen == [3.0, 3.0]  # already at the first run, which itself needs 2


def test_resume_dry_run_shows_the_state(bandit_spec, fake_model, tmp_path, fake_train):
    run_small(bandit_spec, fake_model, tmp_path, fake_train(fail={"k1-s1"}))
    console = quiet()
    run_sweep(resume=tmp_path / "sweep", dry_run=True, console=console)
    text = output(console)
    assert "3 done, 1 failed" in text and "engine died in k1-s1" in text


def test_resume_refuses_new_overrides_and_a_taken_directory_is_refused(bandit_spec, fake_model, tmp_path,
                                                                       fake_train):
    run_small(bandit_spec, fake_model, tmp_path, fake_train())
    with pytest.raises(SweepError, match="saved configs"):
        run_sweep(resume=tmp_path / "sweep", overrides=["seed=1"], console=quiet())
    with pytest.raises(SweepError, match="already holds a sweep"):
        run_small(bandit_spec, fake_model, tmp_path, fake_train())
    with pytest.raises(SweepError, match="not a sweep directory"):
        run_sweep(resume=tmp_path, console=quiet())


def test_a_missing_model_stops_the_sweep_before_it_starts(bandit_spec, tmp_path, fake_train):
    train = fake_train()
    with pytest.raises(SweepError, match="model.path"):
        run_sweep(bandit_spec({"seed": [0]}), out=tmp_path / "sweep", overrides=[f"model.path={tmp_path}/none"],
                  train_fn=train, console=quiet())
    assert train.calls == [] and not (tmp_path / "sweep").exists()


def test_the_sweep_writes_its_report_at_the_end(bandit_spec, fake_model, tmp_path, fake_train):
    path = bandit_spec({"staleness.max_staleness": [0, 2]}, overrides={"runtime": "ray"})
    sweep = run_sweep(path, out=tmp_path / "sweep", overrides=[f"model.path={fake_model}"], train_fn=fake_train(),
                      console=quiet())
    report = (sweep.directory / "report" / "report.md").read_text()
    assert "| k0 |" in report and "| k2 |" in report
