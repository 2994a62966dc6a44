"""Layering rules that import-linter cannot express: the pure modules never touch torch.distributed, and the
contracts cover the whole package."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ragen_async"
PURE = [PKG / "protocol.py", *sorted((PKG / "staleness").glob("*.py")), *sorted((PKG / "algo").glob("*.py"))]
FORBIDDEN = ("torch.distributed",)
"""What the pure modules must not import that import-linter's contract (ray, zmq, vllm) cannot name: a submodule
of an external package."""


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


def _contract(name: str) -> dict:
    import tomllib

    contracts = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"] == name)


def test_the_algo_contract_forbids_every_other_part_of_the_package():
    """import-linter checks that algo imports none of the modules its contract lists; this checks the list is
    the whole package (a part added later is forbidden too)."""
    forbidden = set(_contract("algo imports nothing else from the package")["forbidden_modules"])
    parts = {f"ragen_async.{name}" for name in set().union(*_layers())} - {"ragen_async.algo"}
    assert parts == forbidden


def _layers() -> list[set[str]]:
    import tomllib

    contracts = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [{m.strip().removeprefix("ragen_async.") for m in layer.split("|")} for layer in layers]


def test_every_module_is_in_the_layers_contract():
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in PKG.glob("*/__init__.py")}
    listed = set().union(*_layers())
    assert modules - listed == set(), "not in pyproject.toml's layers contract (import-linter ignores them)"
    assert listed - modules == set(), "in the layers contract but not in the package"


def test_readme_layout_is_the_layers_contract():
    readme = (PKG.parent / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    rows = [line for line in block.splitlines() if line.startswith("  ")]
    names = [{w.removesuffix(".py").removesuffix("/") for w in row.split() if w.endswith((".py", "/"))} for row in rows]
    assert names == _layers()


def test_readme_where_to_change_what_names_real_code():
    """Every ``file.py:Name[.attr]`` in README's "Where to change what" exists, and the section starts in the
    README's first 80 lines (a newcomer finds it on the first screens)."""
    import importlib
    import re

    readme = (PKG.parent / "README.md").read_text()
    head, section = readme.split("## Where to change what", 1)
    assert head.count("\n") < 80
    section = section.split("\n## ", 1)[0]
    refs = re.findall(r"`([\w/]+)\.py:([\w.]+)`", section)
    assert len(refs) >= 15, refs
    for path, name in refs:
        module = importlib.import_module("ragen_async." + path.replace("/", "."))
        obj = module
        for part in name.split("."):
            assert hasattr(obj, part), f"README's Where to change what: {path}.py has no {name}"
            obj = getattr(obj, part)
    for folder in re.findall(r"`([\w/]+/)`", section):
        assert (PKG.parent / folder).is_dir() or (PKG / folder).is_dir(), folder
