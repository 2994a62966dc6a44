"""The NCCL path's control flow under engine failures, on CPU: the real ``NcclPublisher`` (timeouts,
phase tracking), ``LocalReceiversClient`` and ``NcclReceiver``, with stand-ins for what needs a GPU.

* vLLM's trainer engine is replaced by :class:`TrainerStandIn`, which calls the client in vLLM's order
  (start, update in a side thread concurrently with the broadcast, finish) and runs vLLM's hazard: the
  broadcast is a rendezvous with every engine's receive (a ``threading.Barrier``, like an NCCL collective
  without a timeout), so an engine that never arrives blocks the publisher's thread for good.
* Each engine is a ``FakeEngine`` with vLLM's two transfer hooks (``worker_rpc``, ``updating``); one of
  them dies (its worker call fails) before, during or after the transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ragen_async.inference.base import SamplingConfig
from ragen_async.inference.fake_engine import FakeEngine
from ragen_async.weight_sync import (
    LocalReceiversClient,
    NcclPublisher,
    NcclReceiver,
    WeightSyncError,
    WeightSyncTimeout,
)

pytestmark = pytest.mark.alone

TIMEOUT_S = 2.0
WORKER_CALLS = ("start_weight_update", "update_weights", "finish_weight_update", "_ragen_retie")
"""vLLM's three update calls, then the worker extension's re-tie of tied weights."""


class WorkerEngine(FakeEngine):
    """A fake engine whose "workers" run vLLM's three update calls; ``update_weights`` joins the broadcast
    rendezvous. ``dies_at`` makes that call fail as a dead worker's would."""

    model_path = "stand-in"

    def __init__(self, barrier: threading.Barrier, dies_at: str | None = None):
        super().__init__(lambda prompt, rng: [7, 8, 9])
        self.barrier, self.dies_at = barrier, dies_at
        self.calls: list[str] = []
        self.paused = False

    async def worker_rpc(self, method, *args, what, kwargs=None):
        self.calls.append(method)
        if method == self.dies_at:
            raise WeightSyncError(f"engine stand-in: {what}: the worker process died")
        if method == "update_weights":
            await asyncio.to_thread(self.barrier.wait)  # the NCCL receive: waits for every peer
        return [None]

    @contextlib.asynccontextmanager
    async def updating(self, version):
        await self.pause()
        self.paused = True
        try:
            yield
            self._version = version
        finally:
            await self.resume()
            self.paused = False


class TrainerStandIn:
    """vLLM's ``NCCLTrainerWeightTransferEngine.send_weights`` order, with a rendezvous as the broadcast."""

    def __init__(self, client, barrier: threading.Barrier):
        self.client, self.barrier = client, barrier

    def send_weights(self):
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, {"names": ["w"]})
            self.barrier.wait()  # the broadcast: no timeout, as in NCCL
            future.result()
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()

    def shutdown(self):
        pass


@pytest.fixture()
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _publisher(monkeypatch, loop, dies_at):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA checks; tensors stay on CPU
    barrier = threading.Barrier(3)  # the publisher and two engines
    engines = [WorkerEngine(barrier), WorkerEngine(barrier, dies_at=dies_at)]
    receivers = [NcclReceiver(e, TIMEOUT_S) for e in engines]
    client = LocalReceiversClient(receivers, loop, timeout_s=TIMEOUT_S + 1)
    pub = NcclPublisher("127.0.0.1", 1, num_receivers=2, client=client, timeout_s=TIMEOUT_S, device="cpu")
    pub._engine = TrainerStandIn(client, barrier)  # as if connected
    return pub, engines, barrier


def _serving(loop, engine) -> bool:
    gen = asyncio.run_coroutine_threadsafe(engine.generate([1, 2], SamplingConfig(max_tokens=3)), loop)
    return gen.result(timeout=5).token_ids == [7, 8, 9]


def test_a_healthy_sync_loads_every_engine_in_one_call_each(monkeypatch, loop):
    pub, engines, barrier = _publisher(monkeypatch, loop, dies_at=None)
    pub.publish([("w", torch.ones(3))], version=5)
    for e in engines:
        assert e.calls == list(WORKER_CALLS) and e.policy_version == 5 and not e.paused
    assert pub.client.phase == "idle"


@pytest.mark.slow
@pytest.mark.parametrize("dies_at", WORKER_CALLS)
def test_an_engine_dying_before_during_or_after_the_transfer_is_an_error_within_the_bound(monkeypatch, loop, dies_at):
    pub, (survivor, dead), barrier = _publisher(monkeypatch, loop, dies_at)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError) as info:
            pub.publish([("w", torch.ones(3))], version=5)
        elapsed = time.monotonic() - t0
        msg = str(info.value)
        # names the group, the phase and the dead engine
        assert "NCCL weight group tcp://127.0.0.1:1" in msg and "receiving version 5" in msg, msg
        assert "engine 1" in msg and "the worker process died" in msg, msg
        if dies_at in ("finish_weight_update", "_ragen_retie"):
            # after the broadcast: the error comes back at once, and the survivor serves the new version
            assert elapsed < 1.0 and not isinstance(info.value, WeightSyncTimeout)
            assert survivor.policy_version == 5 and not survivor.dead and not survivor.paused
            assert _serving(loop, survivor)
        else:
            # the survivor sits in the rendezvous with the publisher: both give up within their bounds, and
            # the survivor's update stopped part way too
            assert isinstance(info.value, WeightSyncTimeout)
            assert TIMEOUT_S <= elapsed <= pub.bound_s + 1.0, elapsed
            assert "engine 0" in msg and "timed out" in msg, msg
            assert survivor.policy_version == 0 and survivor.dead
        # an engine whose update had started holds part of it (vLLM's reload empties every layer first): it is
        # dead, so that its actor is replaced, and serves no request meanwhile
        assert dead.policy_version == 0 and dead.dead and "stopped part way" in dead.failure
        with pytest.raises(RuntimeError, match="serves no more requests"):
            _serving(loop, dead)
        # the group is unusable now, and says so instead of hanging again
        with pytest.raises(WeightSyncError, match="unusable after an earlier failure"):
            pub.publish([("w", torch.ones(3))], version=6)
    finally:
        barrier.abort()  # release the threads still waiting in the rendezvous


def test_the_receiver_refuses_to_start_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU error")
    with pytest.raises(WeightSyncError, match="needs CUDA on the rollout worker"):
        NcclReceiver(FakeEngine(lambda p, r: [1]), 1.0)


def test_an_engine_whose_update_stopped_part_way_is_failed_and_one_that_never_started_serves_on(monkeypatch, loop):
    """vLLM's update moves every layer to the meta device and fills each one when its tensors arrived: an
    update that stopped part way leaves no engine to resume. A failure before the workers started (here:
    pausing) leaves the old weights, and the engine serves on."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ticket = {"version": 5, "update_info": {"names": ["w"]}}
    part_way = WorkerEngine(threading.Barrier(1), dies_at="update_weights")
    with pytest.raises(WeightSyncError, match="the worker process died"):
        asyncio.run_coroutine_threadsafe(NcclReceiver(part_way, TIMEOUT_S).receive(ticket), loop).result(10)
    assert part_way.dead and "update to version 5 over NCCL stopped part way" in part_way.failure
    assert part_way.policy_version == 0
    with pytest.raises(RuntimeError, match="serves no more requests"):
        _serving(loop, part_way)

    class PauseFails(WorkerEngine):
        async def pause(self):
            raise WeightSyncError("engine stand-in: pausing failed")

    untouched = PauseFails(threading.Barrier(1))
    with pytest.raises(WeightSyncError, match="pausing failed"):
        asyncio.run_coroutine_threadsafe(NcclReceiver(untouched, TIMEOUT_S).receive(ticket), loop).result(10)
    assert untouched.calls == [] and not untouched.dead and _serving(loop, untouched)


@pytest.mark.slow  # vLLM's imports (about 10 s where nothing imported them yet)
def test_a_vllm_engine_marked_failed_in_an_update_stays_paused_and_refuses_requests(monkeypatch, loop):
    """The vLLM engine's side (its AsyncLLM a stand-in, no engine started): the receiver marks it failed while
    it is paused for the update; vLLM's scheduling is not resumed, a request is refused at once instead of
    waiting, and the engine is dead, so its rollout actor exits and is replaced."""
    from vllm import SamplingParams  # noqa: F401 - imported here, not on the request's first use (seconds)
    from vllm.inputs import TokensPrompt  # noqa: F401

    from ragen_async.inference.vllm_engine import VLLMEngine

    class StandInLLM:
        errored = False

        def __init__(self):
            self.calls: list[str] = []

        async def pause_generation(self, **kwargs):
            self.calls.append("pause")

        async def resume_generation(self):
            self.calls.append("resume")

        async def update_weight_version(self, version):
            self.calls.append(f"version {version}")

        async def collective_rpc(self, method, args=(), kwargs=None):
            self.calls.append(method)
            if method == "update_weights":
                raise RuntimeError("NCCL error: remote process exited")
            return [None]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    eng = VLLMEngine.__new__(VLLMEngine)  # no engine start
    eng.__dict__.update(_llm=StandInLLM(), model_path="stand-in", max_model_len=64, eos_token_ids=(), _version=0,
                        _version_sent=True, _ties_recorded=True, _update_lock=None, _running=None,
                        _user_paused=False, _closed=False, kv_on_update="keep")
    receive = NcclReceiver(eng, TIMEOUT_S).receive({"version": 5, "update_info": {"names": ["w"]}})
    with pytest.raises(WeightSyncError, match="receiving version 5 over NCCL"):
        asyncio.run_coroutine_threadsafe(receive, loop).result(10)
    assert eng._llm.calls == ["pause", "start_weight_update", "update_weights"]  # never resumed
    assert eng.dead and eng.policy_version == 0
    generate = eng.generate([1, 2], SamplingConfig(max_tokens=3))
    with pytest.raises(RuntimeError, match="serves no more requests: its update to version 5"):
        asyncio.run_coroutine_threadsafe(generate, loop).result(5)
