"""Configs: every file in the repository parses; bad input is a clear error naming the key."""

from pathlib import Path

import pytest

from ragen_async.config import ConfigError, RunConfig, dump_config, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_parses(path):
    cfg = load_config(path)
    assert cfg.rollout.groups_per_step >= 1
    # The resolved config written to a run directory loads back to the same config.
    again = RunConfig.model_validate(__import__("yaml").safe_load(dump_config(cfg)))
    assert again == cfg


def test_paper_configs_use_ragen_defaults():
    cfg = load_config(ROOT / "configs/paper/starpo_s_sokoban.yaml")
    assert (cfg.rollout.groups_per_step, cfg.rollout.group_size, cfg.total_steps) == (8, 16, 200)
    assert (cfg.learner.actor_lr, cfg.learner.critic_lr) == (1e-6, 1e-5)
    assert (cfg.agent.max_turns, cfg.agent.max_actions_per_turn, cfg.agent.max_tokens_per_turn) == (5, 5, 400)
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high, cfg.algo.filter_ratio, cfg.algo.kl_coef) == (0.2, 0.28, 0.25, 0)
    vanilla = load_config(ROOT / "configs/paper/starpo_sokoban.yaml")
    assert (vanilla.algo.filter_mode, vanilla.algo.clip_eps_high, vanilla.algo.kl_coef) == ("none", 0.2, 0.001)


def test_typo_names_the_key():
    with pytest.raises(ConfigError, match=r"algo\.clip_eps_hgih: unknown key"):
        load_config(ROOT / "configs/demo.yaml", ["algo.clip_eps_hgih=0.3"])


def test_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=r"algo\.filter_mode"):
        load_config(None, ["algo.filter_mode=median"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        load_config(None, ["rollout.group_size=0"])


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["justakey"])


def test_inheritance_and_cycles(tmp_path):
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\ntotal_steps: 7\n")
    (tmp_path / "b.yaml").write_text("total_steps: 3\nseed: 5\n")
    cfg = load_config(tmp_path / "a.yaml")
    assert (cfg.total_steps, cfg.seed) == (7, 5)
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="runtime: local"):
        load_config(None, ["staleness.max_staleness=2"])
    with pytest.raises(ConfigError, match="fixed_lag"):
        load_config(None, ["runtime=ray", "staleness.max_staleness=null", "staleness.fixed_lag=true"])
    with pytest.raises(ConfigError, match="keeps no group"):
        load_config(None, ["algo.filter_ratio=0.05", "rollout.envs=[{tag: Bandit, n_groups: 4}]"])


def test_tensor_parallel_engines_need_a_gpu_per_worker():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 runs 2 engine workers, each on its own GPU, but "
                                          r"rollout\.gpus_per_worker=1 .* set rollout\.gpus_per_worker=2"):
        load_config(None, ["rollout.gpus_per_worker=1", "inference.tensor_parallel_size=2"])
    off = "weight_sync.verify_first=false"  # the byte-exact check refuses tensor-parallel engines
    load_config(None, ["rollout.gpus_per_worker=2", "inference.tensor_parallel_size=2", off])
    load_config(None, ["rollout.gpus_per_worker=0.5"])  # one worker: a share of a GPU is enough
    load_config(None, ["inference.tensor_parallel_size=2", off])  # CPU engines: no GPUs to count


def test_runs_consume_in_order_by_default_and_a_run_saved_without_the_key_reads_as_arrival(tmp_path):
    import yaml

    from ragen_async.config import load_saved_config

    assert RunConfig().staleness.consume == "in_order"
    data = yaml.safe_load(dump_config(RunConfig()))
    del data["staleness"]["consume"]  # a run saved before staleness.consume existed
    old = tmp_path / "old" / "config.yaml"
    old.parent.mkdir()
    old.write_text(yaml.safe_dump(data))
    assert load_saved_config(old).staleness.consume == "arrival"
    new = tmp_path / "new" / "config.yaml"
    new.parent.mkdir()
    new.write_text(dump_config(RunConfig()))
    assert load_saved_config(new).staleness.consume == "in_order"


def test_the_adaptive_bounds_old_names_still_read_and_mean_the_same(tmp_path):
    """The adaptive bound's limits are named after the bound (``adaptive_min_staleness`` ...); configs and saved
    runs that use the old ``_k`` names load to the same config, which is written back under the new names;
    giving a limit under both names is refused."""
    import yaml

    from ragen_async.config import load_saved_config

    base = ["runtime=ray", "staleness.adaptive=true", "staleness.kl_target=0.002", "staleness.max_staleness=4"]
    new = load_config(None, [*base, "staleness.adaptive_min_staleness=1", "staleness.adaptive_max_staleness=16"])
    old = load_config(None, [*base, "staleness.adaptive_min_k=1", "staleness.adaptive_max_k=16"])
    assert old == new and (new.staleness.adaptive_min_staleness, new.staleness.adaptive_max_staleness) == (1, 16)
    written = yaml.safe_load(dump_config(old))["staleness"]
    assert written["adaptive_max_staleness"] == 16 and "adaptive_max_k" not in written
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({"runtime": "ray", "staleness": {"max_staleness": None, "adaptive": True,
                                                                      "adaptive_engage_k": 4}}))
    assert load_saved_config(saved).staleness.adaptive_engage_staleness == 4
    with pytest.raises(ConfigError, match="adaptive_min"):
        load_config(None, [*base, "staleness.adaptive_min_staleness=1", "staleness.adaptive_min_k=2"])


def test_the_weight_check_is_on_at_the_first_sync_and_tensor_parallel_engines_must_turn_it_off(tmp_path):
    """Every config checks the weights byte for byte at the first sync; a tensor-parallel engine holds shards, so
    with the check on it is refused at load, naming the keys (not at the first sync); runs saved before
    ``weight_sync.verify_first`` existed read as they ran (no check with ``verify_every`` 0)."""
    import yaml

    from ragen_async.config import load_saved_config

    for path in CONFIGS:
        assert load_config(path).weight_sync.checks, path
    with pytest.raises(ConfigError, match=r"inference\.tensor_parallel_size=2 with the byte-exact weight check on "
                                          r"\(weight_sync\.verify_first=True, weight_sync\.verify_every=0\).*set "
                                          r"weight_sync\.verify_first=false and weight_sync\.verify_every=0"):
        load_config(None, ["inference.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"verify_first=False, weight_sync\.verify_every=5"):
        load_config(None, ["inference.tensor_parallel_size=2", "weight_sync.verify_first=false",
                           "weight_sync.verify_every=5"])
    off = load_config(None, ["inference.tensor_parallel_size=2", "weight_sync.verify_first=false"])
    assert not off.weight_sync.checks
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({"weight_sync": {"verify_every": 0}}))
    assert not load_saved_config(saved).weight_sync.verify_first


def test_nucleus_sampling_with_an_off_policy_correction_is_refused():
    """With ``rollout.top_p < 1`` the engine's log-probs are those of the truncated distribution, so an
    off-policy weight pi_old/mu would carry the truncation: refused at load, saying why; either alone loads."""
    for correction in ("tis", "decoupled", "opsm", "geo_mask", "geo_tis"):
        with pytest.raises(ConfigError, match=rf"rollout\.top_p=0\.9 with algo\.off_policy={correction}: the engine's "
                                              r"log-probs \(mu\) are then those of the truncated nucleus distribution"):
            load_config(None, ["rollout.top_p=0.9", f"algo.off_policy={correction}"])
    assert load_config(None, ["rollout.top_p=0.9"]).rollout.top_p == 0.9
    assert load_config(None, ["algo.off_policy=tis"]).algo.off_policy == "tis"
    # age reads each token's age, not mu: nucleus sampling beside it loads
    assert load_config(None, ["rollout.top_p=0.9", "algo.off_policy=age"]).algo.off_policy == "age"


def test_the_stale_sample_corrections_load_and_their_bounds_are_checked():
    """Each ``algo.off_policy`` correction loads with its bound; a bound out of range is refused naming the key and
    the range; the default stays ``none``."""
    assert load_config(None, []).algo.off_policy == "none"
    for mode, bound in (("opsm", "algo.opsm_delta=0.01"), ("geo_mask", "algo.geo_cap=1.1"),
                        ("geo_tis", "algo.geo_cap=1.1"), ("age", "algo.age_tau=3")):
        assert load_config(None, [f"algo.off_policy={mode}", bound]).algo.off_policy == mode
    for bad, says in (("algo.opsm_delta=-0.1", r"algo\.opsm_delta: Input should be greater than or equal to 0"),
                      ("algo.geo_cap=1", r"algo\.geo_cap: Input should be greater than 1"),
                      ("algo.age_tau=0", r"algo\.age_tau: Input should be greater than 0"),
                      ("algo.off_policy=opsm2", r"algo\.off_policy: Input should be 'none', 'tis', 'decoupled', "
                                                r"'opsm', 'geo_mask', 'geo_tis' or 'age'")):
        with pytest.raises(ConfigError, match=says):
            load_config(None, [bad])


def test_a_run_that_trains_stale_tokens_uncorrected_says_so():
    """k above 0 (or unbounded) with algo.off_policy=none: the run's first lines say it trains stale tokens as
    they are and what that cost; k = 0, or a correction, say nothing."""
    assert load_config(None, []).uncorrected_staleness() is None  # k = 0 (local)
    ray = ["runtime=ray"]
    for k, shown in (("2", "k = 2"), ("null", "unbounded")):
        line = load_config(None, [*ray, f"staleness.max_staleness={k}"]).uncorrected_staleness()
        assert line is not None and shown in line and "algo.off_policy=none" in line and "opsm or age" in line
    assert load_config(None, [*ray, "staleness.max_staleness=null", "algo.off_policy=opsm"]).uncorrected_staleness() is None
