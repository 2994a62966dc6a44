"""scripts/device_check.sh, the device check, in its CPU dry run: the stages that run on a CPU run (small), the
others say why they are skipped, and it ends with one VERDICT line per question; and its verdicts on figures
that fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragen_async.bench import device_verdicts
from ragen_async.bench.flops import NO_PEAK, device_peak
from ragen_async.bench.learns import TARGET_P, Curve, LearnsResult, bench_learns, result_from_json, result_json, verdict

pytestmark = pytest.mark.clusters_lane

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "device_check.sh"


@pytest.mark.slow
def test_the_device_check_dry_run_answers_what_a_cpu_can_and_skips_the_rest(tmp_path, tiny_model_path):
    env = {**os.environ, "PYTHON": sys.executable, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAGEN_MODEL_PATH", None)
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path / "out")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    log = (tmp_path / "out" / "device_check.log").read_text()
    assert result.returncode == 0, result.stdout + result.stderr + log[-4000:]
    verdict_lines = [line for line in result.stdout.splitlines() if line.startswith("VERDICT ")]
    assert [line.split(":")[0].removeprefix("VERDICT ") for line in verdict_lines] == list(device_verdicts.QUESTIONS)
    summary = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert summary["dry_run"] is True and summary["machine"]["cpus"] == os.cpu_count()
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["learner_cuda_tests", "learner_learns", "learner_mfu", "decode_graphs", "decode_eager",
                            "one_gpu_run", "paper_run"]
    assert stages["learner_learns"]["exit"] == 0 and stages["learner_mfu"]["exit"] == 0
    for name in ("learner_cuda_tests", "decode_graphs", "decode_eager", "one_gpu_run", "paper_run"):
        assert "CUDA" in stages[name]["skipped"] or "GPUs" in stages[name]["skipped"], stages[name]
    passed = {q: v["passed"] for q, v in summary["verdicts"].items()}
    assert passed == {"learner_cuda": None, "learns": True, "mfu": True, "first_update": True, "cuda_graphs": None,
                      "one_gpu": None, "paper_run": None}
    # the one-GPU stage says what it would run
    assert "configs/paper/one_gpu_bandit.yaml" in stages["one_gpu_run"]["skipped"]
    assert [v["line"] for v in summary["verdicts"].values()] == verdict_lines

    # learns: both dtypes reached the optimum's neighbourhood on the CPU, from well below it
    curves = summary["learns"]["curves"]
    assert [c["dtype"] for c in curves] == ["float32", "bfloat16"]
    for c in curves:
        assert c["target_p"][0] < 0.2 and c["reached_at"] is not None and c["target_p"][c["reached_at"]] >= TARGET_P
    # mfu: the tiny model on the CPU: no spec peak (n/a), a figure against the matmul timed in the run
    fp32, bf16 = summary["learner"]
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16") and fp32["update_vs_fp32"] == 0.0
    for row in (fp32, bf16):
        assert row["shape"] == "tiny" and row["device_name"] == "cpu" and row["checkpointing"] is False
        assert row["mfu"] is None and row["spec_peak_tflops"] is None and row["peak"] == NO_PEAK
        assert f"n/a ({NO_PEAK})" in verdict_lines[2]
        assert row["model_tflop"] > 0 and row["matmul_tflops"] > 0 and 0 < row["mfu_vs_matmul"] < 1
        assert row["tokens_per_step"] > row["trained_tokens_per_step"] > 1000
        assert row["moved_frac"] > 0.99  # at lr 1e-6 (the paper config's): fp32 masters keep every update
    tables = (tmp_path / "out" / "benchmarks.md").read_text()
    for title in ("Learner learns", "Learner benchmark"):
        assert f"## {title}" in tables, title
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["benchmarks.md", "device_check.json",
                                                                    "device_check.log"]


def test_a_learner_that_does_not_move_fails_the_learns_check(tiny_model_path):
    result = bench_learns(tiny_model_path, "cpu", steps=3, dtypes=("float32",),
                          overrides=["learner.actor_lr=0", "learner.critic_lr=0"])
    ok, line = verdict(result)
    assert not ok and line.startswith("VERDICT learns: no (float32 never reached 0.9")
    assert len(set(result.curves[0].target_p)) == 1  # lr 0: the policy never moved


def _result(*curves: Curve) -> LearnsResult:
    return LearnsResult(model="m", device="cpu", steps=len(curves[0].target_p) - 1, target=1, prompt=[0],
                        curves=list(curves))


def test_the_learns_verdict_holds_bf16_to_fp32s_curve_on_average():
    fp32 = Curve("float32", "float32", target_p=[0.05, 0.3, 0.6, 0.92, 0.95])
    shifted = Curve("bfloat16", "bfloat16", target_p=[0.05, 0.3, 0.45, 0.91, 0.95])  # a step's lag at the rise
    trailing = Curve("bfloat16", "bfloat16", target_p=[0.05, 0.1, 0.3, 0.6, 0.91])  # learns, but much slower
    ok, line = verdict(_result(fp32, shifted))
    assert ok and "mean gap to float32 0.032 <= 0.05 (max 0.150)" in line
    ok, line = verdict(_result(fp32, trailing))
    assert not ok and "mean gap to float32 0.172 > 0.05 (max 0.320)" in line
    # round trip through the JSON the device check keeps
    assert verdict(result_from_json(result_json(_result(fp32, shifted))))[0]


def _stages(**exits):
    return [{"stage": name, **({"skipped": exit} if isinstance(exit, str) else {"exit": exit})}
            for name, exit in exits.items()]


def test_the_verdicts_fail_a_question_that_ran_and_failed_and_skip_the_rest(tmp_path):
    out = tmp_path / "out"
    (out / ".stages").mkdir(parents=True)
    bad = _result(Curve("float32", "float32", target_p=[0.05, 0.06, 0.05]))
    (out / ".stages" / "learns.json").write_text(json.dumps(result_json(bad)))
    stages = _stages(learner_cuda_tests=1, learner_learns=1, learner_mfu=2, decode_graphs="vllm is not installed",
                     decode_eager="vllm is not installed", one_gpu_run="no CUDA device", paper_run="needs >= 2 GPUs")
    assert device_verdicts.main([str(out), "0", json.dumps(stages)]) == 1
    summary = json.loads((out / "device_check.json").read_text())
    found = {q: (v["passed"], v["line"]) for q, v in summary["verdicts"].items()}
    assert found["learner_cuda"][0] is False and found["learns"][0] is False
    assert found["mfu"] == (False, "VERDICT mfu: no (stage learner_mfu exited 2 without figures; see device_check.log)")
    assert found["cuda_graphs"] == (None, "VERDICT cuda_graphs: skipped (vllm is not installed)")
    assert found["paper_run"] == (None, "VERDICT paper_run: skipped (needs >= 2 GPUs)")
    assert not (out / ".stages").exists()
    # every question skipped: nothing failed
    assert device_verdicts.main([str(out), "0", json.dumps(_stages(
        learner_cuda_tests="no CUDA", learner_learns="x", learner_mfu="x", decode_graphs="x", decode_eager="x",
        one_gpu_run="x", paper_run="x"))]) == 0


def test_the_paper_run_verdict_reads_val_success_from_trains_summary():
    stages = _stages(learner_cuda_tests="-", learner_learns="-", learner_mfu="-", decode_graphs="-",
                     decode_eager="-", one_gpu_run="-", paper_run=0)
    good = 'done\n{"run_dir": "r", "val/success": 0.95}\n'
    ok, line = device_verdicts.verdicts(stages, {}, good)["paper_run"]
    assert ok is True and "DDP over 2 ranks; val/success 0.950" in line
    assert "DDP not exercised" in device_verdicts.verdicts(stages, {}, good, ranks=1)["paper_run"][1]
    low = '{"run_dir": "r", "val/success": 0.5}\n'
    ok, line = device_verdicts.verdicts(stages, {}, low)["paper_run"]
    assert ok is False and "val/success 0.500, required >= 0.9" in line
    stages[-1]["exit"] = 2  # --require-val-success failed the run, or it broke
    assert device_verdicts.verdicts(stages, {}, good)["paper_run"][0] is False


def _row(dtype, ckpt, error=None, mfu=0.25, moved=1.0, gap=0.1):
    return {"dtype": dtype, "checkpointing": ckpt, "compute_dtype": dtype, "device_name": "NVIDIA H100 80GB HBM3",
            "error": error, "mfu": None if error else mfu, "hfu": None if error else mfu * 1.15,
            "spec_peak_tflops": None if error else (989.4 if dtype == "bfloat16" else 67.0),
            "peak": NO_PEAK if error else str(device_peak("NVIDIA H100 80GB HBM3", dtype)),
            "mfu_vs_matmul": None if error else mfu * 1.2, "matmul_tflops": None if error else 800.0,
            "moved_frac": None if error else moved, "update_vs_fp32": None if error else gap}


def test_the_mfu_and_first_update_verdicts_take_a_setting_out_of_memory():
    from ragen_async.bench.learner import first_update_verdict, mfu_verdict

    rows = [_row("float32", False, error="out of memory (CUDA out of memory)"), _row("float32", True, gap=0.0),
            _row("bfloat16", False, gap=None), _row("bfloat16", True)]
    ok, line = mfu_verdict(rows)
    assert ok and line.startswith("VERDICT mfu: measured on NVIDIA H100 80GB HBM3 (float32, checkpointing off: out of")
    assert ("bfloat16, checkpointing on (bfloat16 compute): MFU 25.0 % of the peak, H100 SXM bfloat16 dense 989.4 "
            "TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet") in line and "(HFU 28.7 %)" in line
    ok, line = first_update_verdict(rows)
    assert ok and "bfloat16, checkpointing off: no float32 update to compare with" in line
    # a dtype measured nowhere, or an update rounding swallowed, fails
    assert not mfu_verdict([rows[0], rows[3]])[0]
    ok, line = first_update_verdict([rows[1], _row("bfloat16", True, moved=0.004, gap=0.99)])
    assert not ok and "moved 0.4 % of the weights, 0.990 from float32's" in line


def _one_gpu_run(tmp_path, val, checked):
    """A run directory whose metrics.jsonl has validations ``val`` (step 0, then every 10) and one sync per step,
    ``checked`` of them with the byte-exact check's time."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    lines = [{"learner/step": 10 * i, "val/success": v} for i, v in enumerate(val)]
    lines += [{"learner/step": s, "weight_sync/time_s": 0.1, **({"weight_sync/verify_s": 0.02} if s <= checked else {})}
              for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return f"train log\n{json.dumps({'run_dir': str(run), 'val/success': val[-1]})}\n"


def test_the_one_gpu_verdict_wants_the_margin_over_step_0_and_a_check_at_every_sync(tmp_path):
    ok, line = device_verdicts.one_gpu_verdict(0, _one_gpu_run(tmp_path / "a", [0.445, 0.9, 1.0], checked=20))
    assert ok and "val/success 0.445 at step 0 -> 1.000, +0.555, required >= +0.3" in line
    assert "checked 20 of 20 syncs byte for byte, 20 ms mean, 20 ms max" in line
    ok, line = device_verdicts.one_gpu_verdict(0, _one_gpu_run(tmp_path / "b", [0.445, 0.6, 0.7], checked=20))
    assert not ok and "+0.255, required >= +0.3" in line
    ok, line = device_verdicts.one_gpu_verdict(0, _one_gpu_run(tmp_path / "c", [0.445, 0.9, 1.0], checked=1))
    assert not ok and "checked 1 of 20 syncs" in line
    assert device_verdicts.one_gpu_verdict(1, _one_gpu_run(tmp_path / "d", [0.445, 0.9, 1.0], checked=20))[0] is False
    ok, line = device_verdicts.one_gpu_verdict(2, "Traceback ...")
    assert not ok and "0 validation(s)" in line
