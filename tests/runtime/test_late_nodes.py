"""A node that joins a multi-node run after the start is checked for the shared run directory as the nodes at the
start are (``RayRuntime._check_new_nodes``, from ``receive``'s health check): one that does not see it stops the
run naming it; nodes already checked are not asked again. Ray's node list and the marker reads stand in."""

from types import SimpleNamespace

import pytest

from ragen_async.records.rundir import UnsharedRunDir
from ragen_async.runtime import ray_runtime
from ragen_async.runtime.ray_runtime import RayRuntime


def _node(node_id: str, address: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive}


def test_a_node_that_joins_later_is_checked_and_a_blind_one_stops_the_run(tmp_path, monkeypatch):
    nodes = [_node("a", "10.0.0.1"), _node("b", "10.0.0.2")]
    asked: list[set[str] | None] = []
    sees = {"a", "b", "c"}

    def blind(marker, token, only=None):
        asked.append(only)
        return [n["NodeManagerAddress"] for n in nodes if n["Alive"] and (only is None or n["NodeID"] in only)
                and n["NodeID"] not in sees]

    monkeypatch.setattr(ray_runtime.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray_runtime, "blind_nodes", blind)
    runtime = SimpleNamespace(_run_dir_given=(str(tmp_path), "run_root"), _checked_nodes={"a", "b"})
    RayRuntime._check_new_nodes(runtime)
    assert asked == []  # nobody new: no marker, no task
    nodes.append(_node("c", "10.0.0.3"))  # joins and sees the folder
    RayRuntime._check_new_nodes(runtime)
    assert asked == [{"c"}] and runtime._checked_nodes == {"a", "b", "c"}
    nodes.append(_node("d", "10.0.0.4"))  # joins with a node-local folder of the same path
    with pytest.raises(UnsharedRunDir, match=r"not seen from node\(s\) 10\.0\.0\.4"):
        RayRuntime._check_new_nodes(runtime)
    assert asked[-1] == {"d"} and "d" not in runtime._checked_nodes
    assert not list(tmp_path.iterdir())  # the marker is gone either way


def test_without_a_run_directory_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(ray_runtime.ray, "nodes", lambda: pytest.fail("no node list needed"))
    RayRuntime._check_new_nodes(SimpleNamespace(_run_dir_given=None, _checked_nodes=set()))
