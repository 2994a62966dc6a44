"""``bench peer``'s two sides: the same surface on both, TRL's turns batched per round, the tables and the curve
comparison (the end-to-end runs: test_peer_run.py; the losses: tests/algo/test_trl_grpo.py)."""

from __future__ import annotations

import asyncio
import builtins
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from ragen_async.bench.peer import (
    BatchedTurns,
    PeerRun,
    StepRow,
    cells,
    curve_comparison,
    format_cells,
    our_config,
    trl_args,
)
from ragen_async.cli import app


def test_both_sides_read_one_surface():
    cfg = our_config("bandit", 0, seed=2, steps=5, model="m", val_episodes=16)
    a = cfg.algo
    assert (a.adv_estimator, a.grpo_norm, a.filter_mode, a.kl_coef, a.loss_agg_mode, a.off_policy) == (
        "grpo", "mean_std", "none", 0.0, "token-mean", "none")
    assert cfg.learner.mini_batch_size == 64 and cfg.learner.epochs == 1  # one optimizer pass per step
    assert (cfg.runtime, cfg.rollout.cpus_per_worker, cfg.learner.torch_threads, cfg.rollout.cpu_affinity) == (
        "ray", 2, 2, None)  # k = 0: the study's placement
    assert (cfg.validation.every, cfg.validation.envs[0].n_groups, cfg.seed, cfg.model.path) == (5, 16, 2, "m")
    split = our_config("sokoban", None, seed=0, steps=5, model="m", val_episodes=0)
    assert (split.rollout.cpu_affinity, split.learner.cpu_affinity, split.learner.torch_threads) == ([0], [1], 1)
    assert split.staleness.max_staleness is None and split.validation.every == 0 and split.agent.max_turns == 5

    args = trl_args(cfg, reuse=3, out_dir="o")
    assert (args["learning_rate"], args["temperature"], args["num_generations"], args["per_device_train_batch_size"],
            args["max_completion_length"]) == (cfg.learner.actor_lr, cfg.rollout.temperature, 8, 64,
                                               cfg.agent.max_tokens_per_turn)
    assert (args["epsilon"], args["epsilon_high"], args["delta"], args["beta"], args["loss_type"]) == (
        0.2, 0.28, 3.0, 0.0, "bnpo")
    assert (args["entropy_coef"], args["weight_decay"], args["max_grad_norm"], args["steps_per_generation"],
            args["gradient_accumulation_steps"], args["lr_scheduler_type"]) == (
        cfg.algo.entropy_coef, cfg.learner.weight_decay, cfg.learner.grad_clip, 3, 1, "constant")
    assert args["gradient_checkpointing"] is cfg.model.gradient_checkpointing is False


def test_trls_turns_go_to_one_generation_call_per_round():
    """Four episodes that play two, two, one and three turns: three calls, of 4, 3 and 1 requests."""
    turns = [2, 2, 1, 3]
    sizes = []

    class Trainer:
        state = SimpleNamespace(global_step=7)
        eos_token_ids = [9]

        def _generate_single_turn(self, prompt_ids, images, fields, n):
            sizes.append(len(prompt_ids))
            return [[5, 9] for _ in prompt_ids], None

    policy = BatchedTurns(Trainer())

    async def episode(n: int) -> list:
        return [await policy.reply([1, 2], None, 1, 4, 0) for _ in range(n)]

    async def main():
        return await asyncio.gather(*(episode(n) for n in turns))

    gens = asyncio.run(main())
    assert sizes == [4, 3, 1] and policy.calls == 3
    assert [len(g) for g in gens] == turns
    g = gens[0][0]
    assert (g.token_ids, g.start_version, g.finish_reason) == ([5, 9], 7, "stop")


def _run(side, arm, seed, successes, step_s=1.0):
    steps = [StepRow(step=i + 1, success=s, episodes=64, generated_tokens=640, trained_tokens=600, step_s=step_s,
                     gen_s=0.5 * step_s, train_s=0.5 * step_s, sync_s=0.0, age_mean=0.0, age_max=0.0)
             for i, s in enumerate(successes)]
    return PeerRun(side=side, env="bandit", arm=arm, seed=seed, startup_s=10.0, wall_s=20.0, val_success=0.5,
                   steps=steps)


def test_the_tables_give_rates_against_trl_and_the_curves_overlap_per_step():
    runs = [_run("ours", "k=0", s, [0.2 + 0.01 * s, 0.5], step_s=0.5) for s in range(3)]
    runs += [_run("trl", "reuse=1", s, [0.21 + 0.01 * s, 0.9 + 0.01 * s], step_s=2.0) for s in range(3)]
    table = format_cells(cells(runs, warmup=0)).splitlines()
    ours = next(line for line in table if "| ours | k=0 |" in line)
    assert "| 128.0 ± 0.0 |" in ours and ours.endswith("| 4.00 |")  # 64 episodes in 0.5 s, 4x TRL's 2 s
    curve, verdict = curve_comparison(runs, "bandit")
    rows = curve.splitlines()[2:]
    assert rows[0].endswith("| yes |") and rows[1].endswith("| no |")
    assert verdict == "bandit: ours k=0 and TRL reuse=1 success per step, 95 % intervals over seeds overlap at 1 of 2 steps"
    one_seed = curve_comparison(runs[:1] + runs[3:4], "bandit")[1]
    assert one_seed == "bandit: one seed a side, no intervals to compare"
    assert curve_comparison(runs[:3], "bandit") == ("", "")


def test_without_trl_the_bench_says_how_to_install_it(monkeypatch):
    real = builtins.__import__

    def no_trl(name, *args, **kwargs):
        if name == "trl" or name.startswith("trl."):
            raise ImportError("No module named 'trl'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_trl)
    result = CliRunner().invoke(app, ["bench", "peer", "--steps", "2"])
    assert result.exit_code == 2 and "pip install -e '.[peer]'" in result.output, result.output


@pytest.mark.parametrize("args", [["--env", "frozen"], ["--steps", "2", "--warmup", "2"], ["--reuse", "0"]])
def test_bad_options_are_refused(args):
    result = CliRunner().invoke(app, ["bench", "peer", *args])
    assert result.exit_code == 2, result.output
