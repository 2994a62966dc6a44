"""With captured CUDA graphs, every weight update must leave each parameter and buffer where it was (address and
size): a graph reads the addresses it captured, so a reallocated tensor would be computed with from its old memory
while every eager read (the byte-exact check's included) sees the new one. The worker extension
(``inference/vllm_worker_ext.py``) records the addresses before the first update and stops the run, naming the
tensor and the version, when an update changed one. On CPU the extension is driven directly, as vLLM's worker
would drive it, over a small torch module; ``_Worker.reallocate`` makes its reload replace a Parameter instead
of copying into it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragen_async.inference.vllm_worker_ext import (
    GraphAddressChanged,
    WeightSyncWorkerExtension,
    captures_graphs,
)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied, as Qwen2.5's head
        self.register_buffer("cos_sin", torch.randn(6))


def _config(eager: bool, mode: str | None = "FULL_AND_PIECEWISE"):
    return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                           compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode) if mode else None))


class _Worker(WeightSyncWorkerExtension):
    """vLLM's worker as the extension sees it: ``model_runner.get_model()``, ``vllm_config`` and a layerwise
    ``reload_weights`` that copies each checkpoint tensor into the parameter of that name (vLLM's reload does,
    so that graphs stay valid) or, with ``reallocate``, puts a new Parameter in its place."""

    def __init__(self, graphs: bool, reallocate: tuple[str, ...] = ()):
        self.model = _Model()
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        self.vllm_config = _config(eager=not graphs)
        self.reallocate = reallocate

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        params = dict(self.model.named_parameters())
        for name, t in weights_iterator:
            if name in self.reallocate:
                module_name, attr = name.rsplit(".", 1)
                setattr(self.model.get_submodule(module_name), attr, torch.nn.Parameter(t.clone()))
            else:
                params[name].data.copy_(t)


def _update(worker: _Worker, version: int) -> dict:
    named = [(n, torch.randn_like(p)) for n, p in worker.model.named_parameters()]
    return worker._ragen_reload(named, version)


def test_graphs_are_on_only_without_eager_and_with_a_graph_mode():
    assert captures_graphs(_config(eager=False))
    assert not captures_graphs(_config(eager=True))
    assert not captures_graphs(_config(eager=False, mode="NONE"))
    assert not captures_graphs(_config(eager=False, mode=None))


def test_updates_that_copy_in_place_are_quiet():
    worker = _Worker(graphs=True)
    worker._ragen_record_ties()
    before = worker._ragen_storage()
    for version in (1, 2, 3):
        assert _update(worker, version)["version"] == version
    assert worker._ragen_storage() == before
    assert worker.model.head.weight is worker.model.embed.weight  # the re-tie kept the head on the embedding


@pytest.mark.parametrize("moved", ["proj.weight", "embed.weight"])
def test_an_update_that_reallocates_a_tensor_stops_naming_it_and_the_version(moved):
    worker = _Worker(graphs=True)
    worker._ragen_record_ties()  # what the engine does before its first update
    _update(worker, 1)
    worker.reallocate = (moved,)
    with pytest.raises(GraphAddressChanged) as info:
        _update(worker, 2)
    msg = str(info.value)
    assert "the weight update to version 2 changed" in msg and f"{moved}: moved from address" in msg
    assert "captured CUDA graphs" in msg


def test_a_resized_buffer_is_named_too():
    worker = _Worker(graphs=True)
    worker._ragen_record_ties()
    worker.model.cos_sin.resize_(12)  # may keep its address: only the size changed
    with pytest.raises(GraphAddressChanged, match=r"cos_sin: (resized from 6 to 12 elements|moved from address)"):
        worker._ragen_retie(version=5)  # the NCCL path's last call, after vLLM's own update


def test_without_graphs_a_reallocating_update_is_not_checked():
    worker = _Worker(graphs=False, reallocate=("proj.weight",))
    worker._ragen_record_ties()
    assert _update(worker, 1)["version"] == 1
