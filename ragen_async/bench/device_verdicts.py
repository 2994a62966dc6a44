"""The end of ``scripts/device_check.sh``: one JSON and one VERDICT line per question.

``python -m ragen_async.bench.device_verdicts OUT DRY STAGES_JSON`` reads what the stages left in ``OUT/.stages``
(learns.json, learner.json, decode_*.json, one_gpu_run.out, paper_run.out), writes ``OUT/device_check.json`` (the machine, the
stages, the verdicts and every stage's figures), removes ``OUT/.stages``, prints the verdict lines and exits 1 if
a question that ran failed (a skipped one does not count).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path

QUESTIONS = ("learner_cuda", "learns", "mfu", "first_update", "cuda_graphs", "one_gpu", "paper_run")
"""The questions, in the order of their verdict lines."""

ONE_GPU_MARGIN = 0.3
"""How far the one-GPU run's 20 steps must raise validation success above its step-0 value. The tiny model starts
near 0.5 on Bandit (0.445 in the ``make demo`` run of docs/results.md, fp32; 0.531 in this stage's command run on
a CPU, bf16, which reached 1.000 by step 10)."""


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _val_success(text: str | None) -> float | None:
    """val/success from ``ragen-async train``'s JSON summary line (its last line that parses as JSON)."""
    for line in reversed((text or "").splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "val/success" in data:
            return float(data["val/success"])
    return None


def _summary(text: str | None) -> dict | None:
    """``ragen-async train``'s JSON summary (its last stdout line that parses as a JSON object with run_dir)."""
    for line in reversed((text or "").splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "run_dir" in data:
            return data
    return None


def one_gpu_verdict(rc: int, train_out: str | None, margin: float = ONE_GPU_MARGIN) -> tuple[bool, str]:
    """The one-GPU run: from its ``metrics.jsonl``, validation success at step 0 and at the end (which must be
    ``margin`` higher), and the byte-exact weight check (``weight_sync/verify_s``) at every sync with its cost."""
    from ragen_async.records.rundir import read_record

    summary = _summary(train_out)
    records = []
    if summary is not None:
        try:
            text = read_record(Path(summary["run_dir"]) / "metrics.jsonl")
        except FileNotFoundError:
            text = ""
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    val = [r["val/success"] for r in records if "val/success" in r]
    syncs = [r for r in records if "weight_sync/time_s" in r]
    checks = [r["weight_sync/verify_s"] for r in syncs if "weight_sync/verify_s" in r]
    what = "20 Bandit steps, engine (CUDA graphs) and learner on one GPU, gloo weight sync"
    if len(val) < 2:
        return False, f"VERDICT one_gpu: no ({what}; {len(val)} validation(s) in the run's metrics; train exit {rc})"
    gain = val[-1] - val[0]
    cost = (f"checked {len(checks)} of {len(syncs)} syncs byte for byte, {1000 * sum(checks) / len(checks):.0f} ms "
            f"mean, {1000 * max(checks):.0f} ms max" if checks else f"no byte-exact check in {len(syncs)} syncs")
    ok = rc == 0 and gain >= margin and bool(syncs) and len(checks) == len(syncs)
    return ok, (f"VERDICT one_gpu: {'yes' if ok else 'no'} ({what}; val/success {val[0]:.3f} at step 0 -> "
                f"{val[-1]:.3f}, {gain:+.3f}, required >= +{margin}; {cost}; train exit {rc})")


def verdicts(stages: list[dict], data: dict, paper_run_out: str | None = None, val_threshold: float = 0.9,
             ranks: int = 2, one_gpu_out: str | None = None) -> dict[str, tuple[bool | None, str]]:
    """``question -> (passed, line)``; ``passed`` is None for a skipped question. ``data`` holds the stages'
    JSON: ``learns``, ``learner`` (rows), ``decode_graphs``, ``decode_eager``; ``paper_run_out`` the train
    command's output, run with ``ranks`` learner ranks; ``one_gpu_out`` the one-GPU run's."""
    from ragen_async.bench.learner import first_update_verdict, mfu_verdict
    from ragen_async.bench.learns import result_from_json, verdict

    by_name = {s["stage"]: s for s in stages}
    out: dict[str, tuple[bool | None, str]] = {}

    def unanswered(question: str, *names: str) -> bool:
        """Set the verdict of a question whose stage was skipped or failed without figures; True if set."""
        for name in names:
            s = by_name.get(name)
            if s is None:
                out[question] = (False, f"VERDICT {question}: no (stage {name} did not run)")
                return True
            if "skipped" in s:
                out[question] = (None, f"VERDICT {question}: skipped ({s['skipped']})")
                return True
        return False

    def failed(question: str, name: str) -> None:
        out[question] = (False, f"VERDICT {question}: no (stage {name} exited {by_name[name]['exit']} without figures; "
                                "see device_check.log)")

    if not unanswered("learner_cuda", "learner_cuda_tests"):
        rc = by_name["learner_cuda_tests"]["exit"]
        out["learner_cuda"] = (rc == 0, f"VERDICT learner_cuda: {'yes' if rc == 0 else 'no'} (tests/learner/"
                                        f"test_cuda.py: pytest exit {rc}; a CUDA step equals the CPU step)")
    if not unanswered("learns", "learner_learns"):
        if data.get("learns") is None:
            failed("learns", "learner_learns")
        else:
            out["learns"] = verdict(result_from_json(data["learns"]))
    if not unanswered("mfu", "learner_mfu"):
        rows = data.get("learner")
        if not rows:
            failed("mfu", "learner_mfu")
            out["first_update"] = (False, "VERDICT first_update: no (no learner rows)")
        else:
            out["mfu"] = mfu_verdict(rows)
            out["first_update"] = first_update_verdict(rows)
    else:
        out["first_update"] = (out["mfu"][0], out["mfu"][1].replace("VERDICT mfu", "VERDICT first_update"))
    if not unanswered("cuda_graphs", "decode_graphs", "decode_eager"):
        graphs, eager = data.get("decode_graphs"), data.get("decode_eager")
        if graphs is None or eager is None:
            failed("cuda_graphs", "decode_graphs" if graphs is None else "decode_eager")
        else:
            g, e = graphs["tokens_per_s"], eager["tokens_per_s"]
            out["cuda_graphs"] = (True, f"VERDICT cuda_graphs: yes (decode with CUDA graphs {g:,.0f} tokens/s, eager "
                                        f"{e:,.0f}: {g / e:.2f} x; {graphs['model']}, {graphs['requests']} requests x "
                                        f"{graphs['max_tokens']} tokens)")
    if not unanswered("one_gpu", "one_gpu_run"):
        out["one_gpu"] = one_gpu_verdict(by_name["one_gpu_run"]["exit"], one_gpu_out)
    if not unanswered("paper_run", "paper_run"):
        rc = by_name["paper_run"]["exit"]
        val = _val_success(paper_run_out)
        got = "no val/success" if val is None else f"val/success {val:.3f}"
        ok = rc == 0 and val is not None and val >= val_threshold
        ddp = f"DDP over {ranks} ranks" if ranks > 1 else "1 learner rank (DDP not exercised: needs 3 GPUs)"
        out["paper_run"] = (ok, f"VERDICT paper_run: {'yes' if ok else 'no'} (20 Bandit steps, Ray + vLLM on CUDA + "
                                f"NCCL weight sync verified every sync + {ddp}; {got}, required >= {val_threshold}; "
                                f"train exit {rc})")
    return {q: out[q] for q in QUESTIONS}


def _machine() -> dict:
    machine: dict = {"cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch
    except ImportError:
        return machine
    machine["torch"] = torch.__version__
    machine["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return machine


def main(argv: list[str]) -> int:
    out, dry, stages = Path(argv[0]), argv[1] == "1", json.loads(argv[2])
    tmp = out / ".stages"
    data = {name: _read(tmp / f"{name}.json") for name in ("learns", "learner", "decode_graphs", "decode_eager")}
    run_out, ranks, one_gpu = tmp / "paper_run.out", tmp / "paper_run.ranks", tmp / "one_gpu_run.out"
    found = verdicts(stages, data, run_out.read_text() if run_out.is_file() else None,
                     float(os.environ.get("RAGEN_VAL_SUCCESS", "0.9")),
                     int(ranks.read_text()) if ranks.is_file() else 2,
                     one_gpu.read_text() if one_gpu.is_file() else None)
    summary = {"dry_run": dry, "machine": _machine(), "stages": stages,
               "verdicts": {q: {"passed": ok, "line": line} for q, (ok, line) in found.items()}, **data}
    (out / "device_check.json").write_text(json.dumps(summary, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)  # in device_check.json now (a lent device hands back few files)
    print(f"[device-check] {out / 'device_check.json'}")
    for _, line in found.values():
        print(line)
    return 1 if any(ok is False for ok, _ in found.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
