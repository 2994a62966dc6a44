"""The NCCL publisher's side thread (``nccl.run_with_timeout``) runs on the publisher's CUDA device: CUDA's
current device is per thread, so a thread that did not set it would make vLLM's NCCL group and buffers on
device 0 whatever ``learner rank 0`` trains on. On CPU, ``torch.cuda.set_device`` is replaced by a recorder."""

import threading

import pytest
import torch

from ragen_async.weight_sync.nccl import NcclPublisher, ReceiversClient, run_with_timeout


@pytest.fixture()
def set_device_calls(monkeypatch):
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name,
                                                                           torch.device(d))))
    return calls


def test_the_side_thread_sets_the_cuda_device_before_running(set_device_calls):
    ran_in = run_with_timeout(lambda: threading.current_thread().name, 5.0, lambda: "test",
                              device=torch.device("cuda", 3))
    assert ran_in != threading.current_thread().name
    assert set_device_calls == [(ran_in, torch.device("cuda", 3))]


def test_no_device_or_a_cpu_device_sets_none(set_device_calls):
    run_with_timeout(lambda: None, 5.0, lambda: "test")
    run_with_timeout(lambda: None, 5.0, lambda: "test", device=torch.device("cpu"))
    assert set_device_calls == []


class _Client(ReceiversClient):
    def _all(self, method, payloads):
        pass


class _Trainer:
    """vLLM's trainer engine: records the thread its send (the NCCL broadcast) runs in."""

    def __init__(self):
        self.sent_in: list[str] = []

    def send_weights(self):
        self.sent_in.append(threading.current_thread().name)

    def shutdown(self):
        pass


def test_the_publishers_send_runs_on_its_device(monkeypatch, set_device_calls):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pub = NcclPublisher("127.0.0.1", 1, num_receivers=1, client=_Client(1), timeout_s=5.0, device="cuda:1")
    pub._engine = trainer = _Trainer()  # as if connected
    pub.publish([], version=1)  # no tensors to move to the (absent) GPU
    assert trainer.sent_in and set_device_calls == [(trainer.sent_in[0], torch.device("cuda", 1))]
