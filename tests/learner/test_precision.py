"""Which dtype the learner computes in (``learner/precision.py``)."""

from __future__ import annotations

import torch

from ragen_async.learner import precision


def test_compute_dtype_follows_the_model_dtype_except_on_a_cpu_without_bf16(monkeypatch):
    cuda = torch.device("cuda")
    assert precision.compute_dtype("bfloat16", cuda) == torch.bfloat16
    assert precision.compute_dtype("float32", cuda) == torch.float32
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert precision.compute_dtype("bfloat16", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.compute_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
