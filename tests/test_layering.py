"""Layering rules that import-linter cannot express: the pure modules never touch torch.distributed."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ragen_async"
PURE = [PKG / "protocol.py", PKG / "staleness.py", *sorted((PKG / "algo").glob("*.py"))]
FORBIDDEN = ("torch.distributed", "ray", "zmq", "vllm")


def _imported_modules(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def test_pure_modules_import_nothing_distributed():
    for path in PURE:
        bad = [m for m in _imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
        assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}"


def test_algo_imports_nothing_from_the_package():
    for path in sorted((PKG / "algo").glob("*.py")):
        own = [m for m in _imported_modules(path) if m.startswith("ragen_async") and not m.startswith("ragen_async.algo")]
        assert not own, f"{path.name} imports {own}"
