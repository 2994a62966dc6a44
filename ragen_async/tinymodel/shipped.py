"""The tiny model in the repository, and the check that it is what the current code would build.

``artifacts/tiny-model`` is tracked by git (3.6 MB): a fresh clone trains, tests and demos on it without
building it, and every machine runs the same weights (a build's bits depend on the CPU that runs it). Its
``build_info.json`` says what it was built from (the cache key: build config, seed, format version, env text; and
``inputs``: the digests of its tokenizer corpus, tokenizer, SFT data and build code, :mod:`.inputs`), by which
command, at which commit and on which CPU.

:func:`problems` says why the shipped model is not what the current code would build: ``make model`` runs the
quick part (files, weights, cache key, build code: seconds), the suite (``tests/tinymodel/test_shipped.py``) the
deep part too (it trains the tokenizer and plays the SFT episodes again, about 20 s on 2 cores, and compares). A
change to the envs, the prompts, the corpus, the tokenizer or the build then fails until the model is rebuilt with
:data:`REBUILD_COMMAND` and committed with the change.

``python -m ragen_async.tinymodel.shipped [--deep] [PATH]`` prints one line when the model passes and each
problem with the rebuild command otherwise (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragen_async.modeldir import weights_sha256
from ragen_async.tinymodel import build, inputs

SHIPPED_DIR = build.DEFAULT_OUT_DIR
"""Where the shipped model lives, relative to the repository root (tracked; .gitignore excepts it)."""

SHIPPED_SEED = 0
"""The build seed of the shipped model (``make-model``'s default)."""

REBUILD_COMMAND = "make model-build"
"""How to rebuild the shipped model (``ragen-async make-model --force`` without make)."""

REBUILD_HINT = (f"rebuild it with `{REBUILD_COMMAND}` (or `ragen-async make-model --force`; about 6 min on 2 cores) "
                f"and commit {SHIPPED_DIR} with your change")


def problems(path: Path | str = SHIPPED_DIR, deep: bool = False, config: build.TinyModelConfig | None = None,
             seed: int = SHIPPED_SEED) -> list[str]:
    """Why the build at ``path`` is not what the current code builds for (``config``, ``seed``), one line each;
    empty when it is. ``deep`` also trains the tokenizer and plays the SFT episodes again (about 20 s on 2 cores)
    and compares them with the recorded digests and the shipped tokenizer."""
    path = Path(path)
    config = config or build.TinyModelConfig()
    if not build.is_complete_build(path):
        return [f"{path} holds no complete tiny-model build (missing files or build_info.json)"]
    info = build.read_build_info(path) or {}
    found: list[str] = []
    if weights_sha256(path) != info.get("weights_sha256"):
        found.append(f"{path}'s weights are not the ones its build_info.json records (weights_sha256): "
                     "they changed after the build")
    key = build.cache_key(config, seed)
    if info.get("cache_key") != key:
        found.append(f"{path} was built with cache key {info.get('cache_key')}, the current code's is {key}: "
                     "the build config, seed, format version or the envs' and prompts' text changed")
    recorded = info.get("inputs")
    if not isinstance(recorded, dict):
        found.append(f"{path}'s build_info.json records no inputs (corpus, tokenizer, SFT data, build code digests)")
        return found
    if recorded.get("build_code_sha256") != inputs.build_code_digest():
        found.append("the build code changed (build_tiny_model in ragen_async/tinymodel/build.py or what it calls "
                     "there; comments and docstrings do not count)")
    if deep:
        found += _deep_problems(path, config, seed, recorded)
    return found


def _deep_problems(path: Path, config: build.TinyModelConfig, seed: int, recorded: dict) -> list[str]:
    found = []
    if inputs.tokenizer_files_digest(path) != recorded.get("tokenizer_sha256"):
        found.append(f"{path}'s tokenizer files are not the tokenizer its build_info.json records")
    with build.deterministic(seed, config.num_threads):
        prepared = build.prepare_inputs(config, seed, log=lambda _msg: None)
    current = prepared.digests()
    what = {"tokenizer_corpus_sha256": "the tokenizer's training corpus (ragen_async/tinymodel/corpus.py, the envs)",
            "tokenizer_sha256": "the tokenizer (ragen_async/tinymodel/tokenizer.py, or its corpus)",
            "sft_data_sha256": "the SFT data (the corpus' policies, the agent's episode and chat code, the envs)"}
    for name, meaning in what.items():
        if current[name] != recorded.get(name):
            found.append(f"the current code builds other {name.removesuffix('_sha256').replace('_', ' ')}: "
                         f"{meaning} changed")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen_async.tinymodel.shipped",
                                     description="Check that the shipped tiny model is what the current code builds.")
    parser.add_argument("path", nargs="?", default=str(SHIPPED_DIR), help=f"the model directory (default {SHIPPED_DIR})")
    parser.add_argument("--deep", action="store_true",
                        help="also train the tokenizer and play the SFT episodes again (about 20 s on 2 cores)")
    args = parser.parse_args(argv)
    found = problems(args.path, deep=args.deep)
    if found:
        for line in found:
            print(f"[model] {line}", file=sys.stderr)
        print(f"[model] {args.path} is not what the current code builds: {REBUILD_HINT}", file=sys.stderr)
        return 1
    info = build.read_build_info(Path(args.path)) or {}
    print(f"[model] {args.path}: the shipped build (cache key {info.get('cache_key')}, weights sha256 "
          f"{str(info.get('weights_sha256'))[:16]}...) is what the current code builds"
          + ("" if args.deep else " (cache key and build code; --deep also rebuilds its tokenizer and SFT data)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
