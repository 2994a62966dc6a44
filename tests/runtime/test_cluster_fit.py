"""A Ray cluster that can never hold the configured actors is an error at start, not an endless wait."""

import pytest

from ragen_async.config import load_config
from ragen_async.runtime.ray_runtime import check_cluster_fits


def test_a_cluster_without_the_gpus_the_config_needs_is_refused():
    cfg = load_config("configs/paper/starpo_s_sokoban.yaml")
    gpus = cfg.rollout.num_workers * cfg.rollout.gpus_per_worker + cfg.learner.num_ranks * cfg.learner.gpus_per_rank
    assert gpus > 0
    with pytest.raises(RuntimeError, match=rf"needs {gpus:g} GPUs .* the Ray cluster has 0"):
        check_cluster_fits(cfg, {"CPU": 1024.0})
    check_cluster_fits(cfg, {"CPU": 1024.0, "GPU": float(gpus)})


def test_too_few_cpus_are_refused():
    cfg = load_config("configs/tiny/starpo_s_bandit.yaml", ["rollout.num_workers=3", "learner.num_ranks=2"])
    with pytest.raises(RuntimeError, match=r"needs 5 CPUs .* has 4"):
        check_cluster_fits(cfg, {"CPU": 4.0})
    check_cluster_fits(cfg, {"CPU": 5.0})
