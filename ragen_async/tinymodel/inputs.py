"""What a tiny-model build was made from, as digests: its tokenizer corpus, its tokenizer, its SFT data and the
code of its build procedure. ``build_tiny_model`` records them in ``build_info.json`` (``inputs``), next to the
cache key (the build config, seed, format version and env text); :mod:`.shipped` recomputes them from the current
code and says when the model in the repository is not what that code would build.

The digests are of what the code produces, not of its text, wherever that is cheap to produce: the corpus, the
tokenizer and the SFT data take about 20 s on 2 cores (the SFT itself minutes), so a change to the envs, the
prompts, the corpus or the tokenizer code shows up exactly when it changes what the build trains on. The SFT loop
and the model's initialisation have no cheap product: for them the digest is of the code itself
(:func:`build_code_digest`), the definitions ``build_tiny_model`` reaches in ``build.py`` with comments,
docstrings and layout left out.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import platform
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BUILD_ENTRY = "build_tiny_model"
"""The function of ``build.py`` whose reach :func:`build_code_digest` covers."""


def _sha(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()


def corpus_digest(texts: Iterable[str]) -> str:
    """SHA-256 over the tokenizer's training conversations, in order."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(_sha(text).encode())
    return digest.hexdigest()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""What ``save_pretrained`` writes of the tokenizer (the files :func:`tokenizer_files_digest` covers)."""


def tokenizer_files_digest(directory: Path | str) -> str:
    """SHA-256 over a model directory's tokenizer files (:data:`TOKENIZER_FILES`; a missing one counts as empty)."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(directory) / name
        digest.update(f"{name}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes() if path.is_file() else b"").digest())
    return digest.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """:func:`tokenizer_files_digest` of the files ``tokenizer.save_pretrained`` writes: a freshly trained
    tokenizer and the shipped files compare byte for byte. (Loaded back with ``AutoTokenizer`` the tokenizer is a
    ``Qwen2Tokenizer`` whose in-memory form differs from the trained one's, so the files are what is compared.)"""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return tokenizer_files_digest(tmp)


def sft_data_digest(examples: Iterable[Any]) -> str:
    """SHA-256 over the SFT examples (``build.SFTExample``: tag, token ids, the three masks' sources, group), in
    order."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(_sha(json.dumps([e.tag, e.token_ids, e.loss_mask, e.grid_mask, e.group])).encode())
    return digest.hexdigest()


def _strip_docstrings(node: ast.AST) -> ast.AST:
    """A copy of ``node`` without the string statements in its bodies (docstrings, attribute docstrings)."""
    node = copy.deepcopy(node)
    for parent in ast.walk(node):
        body = getattr(parent, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                           and isinstance(s.value.value, str))]
            parent.body = kept or [ast.Pass()]
    return node


def build_code_digest(source: str | None = None, entry: str = BUILD_ENTRY) -> str:
    """SHA-256 of the build procedure's code: the module-level definitions of ``source`` (default: ``build.py``)
    that ``entry`` reaches by name, transitively (functions, classes, constants), as ``ast.dump`` without
    docstrings, so comments, docstrings and formatting do not count and the module's other functions
    (``ensure_tiny_model``, the cache checks) do not either. What other modules do is covered by the other
    digests (corpus, tokenizer, SFT data) or, for transformers and torch, by the recorded versions."""
    if source is None:
        source = (Path(__file__).with_name("build.py")).read_text()
    defs: dict[str, ast.AST] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    defs[target.id] = node
    if entry not in defs:
        raise ValueError(f"{entry} is not defined at module level")
    reached: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in reached or name not in defs:
            continue
        reached.add(name)
        todo.extend(n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name))
    return _sha("\n".join(f"{name}: {ast.dump(_strip_docstrings(defs[name]))}" for name in sorted(reached)))


def machine_info() -> dict[str, Any]:
    """The machine a build ran on: a build's bits depend on its CPU (the instruction set torch's kernels pick)."""
    info: dict[str, Any] = {"machine": platform.machine(), "system": platform.platform(), "python": platform.python_version()}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    info["cpu"] = fields.get("model name", "")
    info["cpus"] = sum(1 for line in lines if line.startswith("processor"))
    flags = set(fields.get("flags", "").split())
    info["cpu_isa"] = sorted(flags & {"avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                                      "amx_tile"})
    return info
