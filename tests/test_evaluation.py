"""``ragen-async eval``: several policies in one call on the same seeds, and the temperature reaching the
sampler as given (0 = greedy). No vLLM: the scripted policies need no engine, and the LLM policy runs
on a recording fake engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.inference.base import SamplingConfig
from ragen_async.inference.fake_engine import FakeEngine

CONFIGS = Path(__file__).resolve().parents[1] / "configs/tiny"
BANDIT = str(CONFIGS / "starpo_s_bandit.yaml")  # one turn, one action
SOKOBAN = str(CONFIGS / "starpo_s_sokoban.yaml")  # 5 turns of up to 5 actions: the oracle solves SimpleSokoban


def run_eval_cli(model: str, *args: str, config: str = BANDIT):
    result = CliRunner().invoke(app, ["eval", config, f"model.path={model}", *args])
    return result, (json.loads(result.stdout.splitlines()[-1]) if result.exit_code == 0 else None)


def test_repeated_policy_evaluates_every_policy_on_the_same_seeds(tiny_model_path, tmp_path):
    out = tmp_path / "episodes.jsonl"
    result, summary = run_eval_cli(tiny_model_path, "--policy", "random", "--policy", "oracle",
                                   "--env", "Bandit", "--env", "SimpleSokoban", "--seeds", "8", "--out", str(out),
                                   config=SOKOBAN)
    assert result.exit_code == 0, result.output
    assert list(summary) == ["random", "oracle"]
    for policy, s in summary.items():
        assert s["policy"] == policy and s["episodes"] == 16
        assert sorted(s["per_env"]) == ["Bandit", "SimpleSokoban"]
        assert all(e["episodes"] == 8 for e in s["per_env"].values())
    assert summary["oracle"]["success"] == 1.0 > summary["random"]["success"]
    # one table, a row per (env, policy)
    rows = [line for line in result.stderr.splitlines() if "random" in line or "oracle" in line]
    assert sum("Bandit" in r for r in rows) == 2 and sum("SimpleSokoban" in r for r in rows) == 2, result.stderr
    # every episode, tagged with its policy, on the same seeds for both
    records = [json.loads(line) for line in out.read_text().splitlines()]
    seeds = {p: sorted((r["env_tag"], r["seed"]) for r in records if r["policy"] == p) for p in summary}
    assert len(records) == 32 and seeds["random"] == seeds["oracle"]
    # the same numbers as a call with that policy alone
    alone, random_alone = run_eval_cli(tiny_model_path, "--policy", "random", "--env", "Bandit",
                                       "--env", "SimpleSokoban", "--seeds", "8", config=SOKOBAN)
    assert alone.exit_code == 0, alone.output
    assert random_alone == {"random": summary["random"]}


def test_unknown_policy_is_one_line_error_even_when_not_last(tiny_model_path):
    result, _ = run_eval_cli(tiny_model_path, "--policy", "greedy", "--policy", "random", "--seeds", "2")
    assert result.exit_code == 2, result.output
    assert "--policy must be llm, random or oracle (got 'greedy')" in result.output
    assert "Traceback" not in result.output


class RecordingEngine(FakeEngine):
    """Replies end-of-turn at once and records every request's sampling settings."""

    built: list[RecordingEngine] = []

    def __init__(self, end_of_turn: int):
        super().__init__(lambda prompt, rng: [end_of_turn])
        self.sampling: list[SamplingConfig] = []
        RecordingEngine.built.append(self)

    async def generate(self, prompt_ids, sampling):
        self.sampling.append(sampling)
        return await super().generate(prompt_ids, sampling)


@pytest.fixture
def fake_llm(monkeypatch, tiny_model_path):
    """``make_engine`` in ``ragen_async.evaluation`` builds a :class:`RecordingEngine`; yields the list
    of engines built."""
    import ragen_async.evaluation as evaluation
    from ragen_async.agent.chat import ChatFormat

    end_of_turn = ChatFormat.from_pretrained(tiny_model_path).end_of_turn_id
    RecordingEngine.built = []
    monkeypatch.setattr(evaluation, "make_engine", lambda cfg, seed=0: RecordingEngine(end_of_turn))
    return RecordingEngine.built


@pytest.mark.parametrize(("given", "expected"), [(["--temperature", "0"], 0.0), (["--temperature", "0.7"], 0.7),
                                                 ([], 0.5)])  # 0.5: the config's validation temperature
def test_temperature_reaches_the_sampler_as_given_and_zero_is_greedy(fake_llm, tiny_model_path, given, expected):
    result, summary = run_eval_cli(tiny_model_path, "--seeds", "3", *given)
    assert result.exit_code == 0, result.output
    assert summary["llm"]["episodes"] == 3
    [engine] = fake_llm
    assert len(engine.sampling) == 3 and {s.temperature for s in engine.sampling} == {expected}


def test_negative_temperature_is_one_line_error_before_any_engine(fake_llm, tiny_model_path):
    result, _ = run_eval_cli(tiny_model_path, "--seeds", "3", "--temperature=-0.5")
    assert result.exit_code == 2, result.output
    assert "--temperature must be >= 0 (0 = greedy), got -0.5" in result.output
    assert "Traceback" not in result.output and fake_llm == []


def test_scripted_policies_build_no_engine_and_ignore_temperature(fake_llm, tiny_model_path):
    result, summary = run_eval_cli(tiny_model_path, "--policy", "oracle", "--seeds", "3", "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert summary["oracle"]["success"] == 1.0 and fake_llm == []


def test_llm_and_scripted_policies_in_one_call(fake_llm, tiny_model_path):
    result, summary = run_eval_cli(tiny_model_path, "--policy", "oracle", "--policy", "llm", "--seeds", "3")
    assert result.exit_code == 0, result.output
    assert list(summary) == ["oracle", "llm"] and len(fake_llm) == 1 and len(fake_llm[0].sampling) == 3


def test_temperature_zero_is_greedy_in_vllms_sampling_params():
    """The last hop of ``--temperature 0``: the vLLM engine's request mapping (no engine started)."""
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingType

    from ragen_async.inference.vllm_engine import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.eos_token_ids = (2,)
    p = eng._sampling_params(SamplingConfig(temperature=0, seed=4))
    assert p.temperature == 0 and p.sampling_type == SamplingType.GREEDY


def test_validation_submits_every_episode_at_once(tiny_model_path):
    """The trainer's validation (``validate_engine``) puts all of its episodes in the engine together, so the engine
    batches them in full steps; the figures are those of any other concurrency (per-episode seeds)."""
    import asyncio

    from ragen_async.agent.chat import ChatFormat
    from ragen_async.agent.episode import EnginePolicy
    from ragen_async.config import load_config
    from ragen_async.rollout.worker import agent_limits, evaluate, summarize_trajectories, validate_engine

    cfg = load_config(SOKOBAN, [f"model.path={tiny_model_path}", "validation.envs=[{tag: SimpleSokoban, n_groups: 40}]"])
    chat = ChatFormat.from_pretrained(cfg.model.path, enable_think=cfg.agent.enable_think)
    words = chat.encode("<answer>Up || Left</answer>") + [chat.end_of_turn_id]

    class Counting(FakeEngine):
        def __init__(self):
            super().__init__(lambda _prompt, rng: words[rng.randrange(2):], delay_s=0.01)
            self.running = self.peak = 0

        async def generate(self, prompt_ids, sampling):
            self.running += 1
            self.peak = max(self.peak, self.running)
            try:
                return await super().generate(prompt_ids, sampling)
            finally:
                self.running -= 1

    engine = Counting()
    metrics = asyncio.run(validate_engine(cfg, engine, chat))
    assert engine.peak == 40
    few = Counting()
    policy = EnginePolicy(few, temperature=cfg.validation.temperature, stop_token_ids=(chat.end_of_turn_id,))
    trajs = asyncio.run(evaluate(policy, chat, cfg.validation.envs, cfg.validation.seed,
                                 agent_limits(cfg.agent, cfg.inference), concurrency=3))
    assert few.peak == 3
    assert {k: v for k, v in metrics.items() if k != "val/policy_version"} == summarize_trajectories(trajs, "val")
