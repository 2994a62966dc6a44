"""`make paper-shape`'s quick variant end to end: a model with Qwen2.5-0.5B's widths, full 151,936-token
vocabulary and tied head but 2 decoder layers, through configs/paper/shape_bandit.yaml (StarPO-S with the critic,
bf16, Ray with vLLM on CPU, the paper's DDP over gloo on 2 ranks with the reference model, uneven shards, two
optimizer steps a learner step, every weight sync verified byte for byte): 2 steps, a checkpoint, --resume for a
third, every check of scripts/paper_shape.py passing.

Opt-in, like tests/system/test_soak.py: about 13 GiB (PSS, all processes) and 3-6 minutes on 2 cores, too much to run
beside another lane in `make test`:

    WANDB_MODE=disabled .venv/bin/python -m pytest -m soak -s tests/bench/test_paper_shape.py

``RAGEN_PAPER_SHAPE_VOCAB=32768`` runs it with a smaller vocabulary (about 6.5 GiB, under 2 minutes). It starts
a Ray session and a vLLM engine, so it belongs in the "ray" lane of tests/conftest.py; it is marked ``vllm`` once
it is named there (a ``vllm`` test outside every lane stops the suite's collection).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLACED = Path(__file__).name in (REPO / "tests" / "conftest.py").read_text()
pytestmark = [pytest.mark.soak, pytest.mark.slow, *([pytest.mark.vllm] if PLACED else [])]
VOCAB = int(os.environ.get("RAGEN_PAPER_SHAPE_VOCAB", "151936"))


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model_path) -> Path:
    return Path(tiny_model_path)


def test_the_quick_variant_trains_checkpoints_resumes_and_passes_every_check(tokenizer_dir, tmp_path):
    from ragen_async.bench.paper_shape import BUILD_INFO, ensure_shape_model

    model_dir = tmp_path / "model"
    _, _, built = ensure_shape_model(model_dir, layers=2, vocab=VOCAB, source=tokenizer_dir)
    assert built
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["vocab_size"], config["tie_word_embeddings"]) == \
        (896, 14, 2, 4864, VOCAB, True)
    assert config["dtype"] == "bfloat16"
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    assert {k: config[k] for k in ("eos_token_id", "pad_token_id")} == {k: tiny[k] for k in ("eos_token_id", "pad_token_id")}
    info = json.loads((model_dir / BUILD_INFO).read_text())
    assert info["complete"] and len(info["weights_sha256"]) == 64
    # The same options again: the build is reused, not redone.
    assert ensure_shape_model(model_dir, layers=2, vocab=VOCAB, source=tokenizer_dir)[2] is False

    result = subprocess.run(
        [sys.executable, "scripts/paper_shape.py", "--layers", "2", "--vocab", str(VOCAB), "--model-dir", str(model_dir),
         "--runs-root", str(tmp_path / "runs"), "--timeout-min", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=20 * 60)
    out = result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, out[-6000:]
    assert lines[-1].startswith("paper-shape: OK"), out[-6000:]
    passed = [line for line in lines if "check PASS" in line]
    assert len(passed) == 13 and not any("check FAIL" in line for line in lines), out[-6000:]
    assert "ddp over gloo, 2 ranks, 2 layers, compute bf16" in lines[-1] or "compute fp32" in lines[-1], lines[-1]
    # Every process of the run is named and measured: the learner ranks and the rollout actor by their
    # log files, the engine core by its title.
    for name in ("learner-0", "learner-1", "rollout-w0", "vllm engine core", "driver"):
        assert any(name in line and "peak RSS" in line for line in lines), name
