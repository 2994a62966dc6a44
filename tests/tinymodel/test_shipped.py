"""The tiny model in the repository: tracked, intact, and what the current code would build (else the suite fails
and says how to rebuild it); and the check itself fails on each kind of change it is there to catch."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from ragen_async.tinymodel import build, inputs, shipped

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / shipped.SHIPPED_DIR


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def test_the_shipped_model_is_tracked_by_git():
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout")
    tracked = set(_git("ls-files", str(shipped.SHIPPED_DIR)).stdout.split())
    assert {f"{shipped.SHIPPED_DIR}/{name}" for name in build.REQUIRED_FILES} <= tracked, tracked
    # .gitignore excepts it, and only it, from artifacts/
    assert _git("check-ignore", "-q", f"{shipped.SHIPPED_DIR}/model.safetensors").returncode == 1
    assert _git("check-ignore", "-q", "artifacts/tiny-model-sokoban/model.safetensors").returncode == 0


def test_the_shipped_model_is_what_the_current_code_builds():
    found = shipped.problems(SHIPPED, deep=True)
    assert not found, "\n".join(found + [f"{shipped.SHIPPED_DIR} is not what the current code builds: "
                                         f"{shipped.REBUILD_HINT}"])
    info = build.read_build_info(SHIPPED)
    assert info["seed"] == shipped.SHIPPED_SEED and info["config"] == build.TinyModelConfig().to_dict()
    # where and how it was built
    assert "make-model" in info["command"] and info["git_commit"] and info["machine"]["cpu"]


@pytest.fixture
def copy_of_shipped(tmp_path) -> Path:
    return Path(shutil.copytree(SHIPPED, tmp_path / "tiny-model"))


def test_the_check_names_a_changed_config_env_text_or_weights(copy_of_shipped, monkeypatch):
    assert shipped.problems(copy_of_shipped) == []
    other = dataclasses.replace(build.TinyModelConfig(), sft_steps=901)
    (found,) = shipped.problems(copy_of_shipped, config=other)
    assert "cache key" in found and "config" in found

    real_render = build.corpus.render_chatml
    with monkeypatch.context() as m:  # the envs' text as the cache key sees it
        m.setattr(build.corpus, "render_chatml", lambda *a, **k: real_render(*a, **k) + " ")
        (found,) = shipped.problems(copy_of_shipped)
        assert "envs' and prompts' text" in found

    data = bytearray((copy_of_shipped / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (copy_of_shipped / "model.safetensors").write_bytes(bytes(data))
    (found,) = shipped.problems(copy_of_shipped)
    assert "weights" in found


def test_the_deep_check_names_a_changed_corpus_tokenizer_or_sft_data(copy_of_shipped, monkeypatch):
    from ragen_async.tinymodel import tokenizer

    real_train = tokenizer.train_tokenizer
    real_texts = build.corpus.corpus_texts
    stub = [build.SFTExample("Bandit", [1, 2, 3], [0, 1, 1], [0, 0, 0], 0)]
    monkeypatch.setattr(build, "make_sft_examples", lambda chat, config, seed: stub)  # skips ~15 s of episodes
    monkeypatch.setattr(tokenizer, "train_tokenizer", lambda texts, vocab_size: real_train(texts, 700))
    found = shipped.problems(copy_of_shipped, deep=True)
    assert len(found) == 2 and "other tokenizer:" in found[0] and "other sft data:" in found[1], found

    monkeypatch.setattr(tokenizer, "train_tokenizer", real_train)
    monkeypatch.setattr(build.corpus, "corpus_texts", lambda *a, **k: list(real_texts(*a, **k))[:-1])
    found = shipped.problems(copy_of_shipped, deep=True)
    assert any("other tokenizer corpus:" in f for f in found) and "other sft data:" in found[-1], found


def test_the_build_code_digest_follows_the_build_not_comments_or_other_functions():
    source = Path(build.__file__).read_text()
    digest = inputs.build_code_digest(source)
    assert digest == inputs.build_code_digest()

    def edited(old: str, new: str) -> str:
        assert source.count(old) == 1, old
        return inputs.build_code_digest(source.replace(old, new))

    # what the build runs: the SFT loop, the model's initialisation, a helper two calls away
    assert edited("clip_grad_norm_(model.parameters(), 1.0,", "clip_grad_norm_(model.parameters(), 2.0,") != digest
    assert edited("torch.manual_seed(seed)\n        model = ", "torch.manual_seed(seed + 1)\n        model = ") != digest
    assert edited("spans, start = [], None", "spans, start = [], 0") != digest
    # what it does not: comments, docstrings, a function the build does not call
    assert edited("    model.train()\n", "    model.train()  # a comment\n") == digest
    assert edited('"""Supervised warm start; returns', '"""Supervised warm-up; returns') == digest
    assert edited('reason = "--force"', 'reason = "forced"') == digest


def test_the_check_command_says_how_to_rebuild(copy_of_shipped, capsys):
    assert shipped.main([str(copy_of_shipped)]) == 0
    assert "is what the current code builds" in capsys.readouterr().out
    (copy_of_shipped / "model.safetensors").write_bytes(b"")
    assert shipped.main([str(copy_of_shipped)]) == 1
    err = capsys.readouterr().err
    assert shipped.REBUILD_COMMAND in err and "commit" in err
    shutil.rmtree(copy_of_shipped)
    assert shipped.main([str(copy_of_shipped)]) == 1
    assert "no complete tiny-model build" in capsys.readouterr().err
