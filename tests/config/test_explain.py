"""Every config field explains itself: a docstring that reaches the JSON schema and ``ragen-async config --explain``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.config import AlgoConfig, ConfigError, RunConfig, explain, load_config


def _model_refs(prop: dict[str, Any]) -> Iterator[tuple[str, bool]]:
    """(``$ref``, whether it is a list's items) of each model a property holds: a section, an optional
    section, or the items of a list (``rollout.envs``)."""
    for sub in (prop, *prop.get("anyOf", ()), *prop.get("allOf", ())):
        if "$ref" in sub:
            yield sub["$ref"], False
        if "$ref" in sub.get("items", {}):
            yield sub["items"]["$ref"], True


def schema_fields(schema: dict[str, Any], node: dict[str, Any] | None = None,
                  prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted key, property schema) of every field reachable from ``node`` (the root model if None),
    recursing into nested sections and list item models; list items' fields are ``list[].field``."""
    for name, prop in (schema if node is None else node)["properties"].items():
        key = f"{prefix}{name}"
        yield key, prop
        for ref, is_item in _model_refs(prop):
            target = schema["$defs"][ref.rsplit("/", 1)[-1]]
            yield from schema_fields(schema, target, f"{key}[]." if is_item else f"{key}.")


def test_every_config_field_has_a_schema_description():
    fields = list(schema_fields(RunConfig.model_json_schema()))
    missing = [key for key, prop in fields if not str(prop.get("description", "")).strip()]
    assert not missing, (f"{len(missing)} config fields have no description; add a docstring on the line under "
                         f"each in ragen_async/config.py: {', '.join(missing)}")
    # The walk saw the whole tree: the same fields as explain(), nested sections and list items included.
    keys = [key for key, _ in fields]
    assert keys == [d.key for d in explain()]
    assert {"algo.clip_eps_high", "rollout.envs[].tag", "validation.envs[].n_groups", "logging.console"} <= set(keys)


def test_explain_a_section():
    docs = explain("algo")
    assert docs[0].key == "algo" and docs[0].section and docs[0].type == "AlgoConfig"
    assert [d.key for d in docs[1:]] == [f"algo.{name}" for name in AlgoConfig.model_fields]
    assert all(d.description for d in docs)


def test_explain_one_field_with_and_without_a_config():
    (doc,) = explain("algo.clip_eps_high")
    assert (doc.key, doc.type, doc.default, doc.value) == ("algo.clip_eps_high", "float", "0.28", None)
    assert doc.description == AlgoConfig.model_fields["clip_eps_high"].description
    (doc,) = explain("algo.clip_eps_high", load_config(None, ["algo.clip_eps_high=0.3"]))
    assert doc.value == "0.3"
    (bounded,) = explain("rollout.top_p")
    assert bounded.type == "float, > 0, <= 1"
    # A list item's field, with or without the brackets.
    assert [d.key for d in explain("rollout.envs.tag")] == [d.key for d in explain("rollout.envs[].tag")] \
        == ["rollout.envs[].tag"]
    assert explain("rollout.envs[].tag")[0].default == "(required)"


def test_explain_an_unknown_key_names_it():
    with pytest.raises(ConfigError, match=r"unknown config key 'algo\.clip_eps_hgih'.*algo\.clip_eps_high"):
        explain("algo.clip_eps_hgih")
    with pytest.raises(ConfigError, match="unknown config key 'algx'"):
        explain("algx")
    with pytest.raises(ConfigError, match="unknown config key 'algo.clip'"):
        explain("algo.clip")  # a prefix of field names is not a key


def test_cli_config_explain():
    runner = CliRunner()
    result = runner.invoke(app, ["config", "--explain", "algo.clip_eps_high"])
    assert result.exit_code == 0, result.output
    assert "algo.clip_eps_high: float = 0.28" in result.output
    assert AlgoConfig.model_fields["clip_eps_high"].description in result.output

    result = runner.invoke(app, ["config", "configs/tiny/starpo_s_bandit.yaml", "algo.clip_eps_high=0.3",
                                 "--explain", "algo.clip_eps_high"])
    assert result.exit_code == 0 and "(value: 0.3)" in result.output, result.output

    result = runner.invoke(app, ["config", "--explain", "algo"])
    assert result.exit_code == 0 and "algo.dual_clip_c" in result.output and "model.path" not in result.output

    result = runner.invoke(app, ["config", "--explain", "algo.clip_eps_hgih"])
    assert result.exit_code == 2 and "unknown config key 'algo.clip_eps_hgih'" in result.output, result.output
    assert "Traceback" not in result.output


def test_cli_config_prints_the_resolved_yaml():
    result = CliRunner().invoke(app, ["config", "configs/tiny/starpo_s_bandit.yaml", "total_steps=3"])
    assert result.exit_code == 0, result.output
    assert "total_steps: 3" in result.output
    result = CliRunner().invoke(app, ["config", "configs/tiny/starpo_s_bandit.yaml", "algo"])
    assert result.exit_code == 2 and "--explain algo" in result.output, result.output
    # The first argument without "=" is the config, whatever its name; every other one must be key=value.
    result = CliRunner().invoke(app, ["config", "algo"])
    assert result.exit_code == 2 and "algo" in result.output and "Traceback" not in result.output, result.output
    result = CliRunner().invoke(app, ["config", "--explain", "all"])
    assert result.exit_code == 0 and "algo.dual_clip_c" in result.output and "model.path" in result.output
