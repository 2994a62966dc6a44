"""GPU weight sync through vLLM 0.32's native NCCL weight-transfer API, every blocking step under a timeout.

Trainer side (learner rank 0): :class:`NcclPublisher` runs vLLM's ``NCCLTrainerWeightTransferEngine``:
``trainer_init`` once (the NCCL rendezvous), then ``send_weights()`` per version, which calls its
*client* (``start_weight_update``, ``update_weights`` concurrently with the packed NCCL broadcast,
``finish_weight_update``). vLLM runs the broadcast in the caller's thread with no timeout, so the
publisher runs each of these in a side thread and waits at most ``timeout_s``: a dead or stuck peer is
a :class:`WeightSyncTimeout` naming the group, the phase and the peers that did not answer, never a hang.
After such an error the group is unusable (a thread may still sit in an NCCL call): close it.

The client addresses every engine's :class:`NcclReceiver` (in-process receivers:
:class:`LocalReceiversClient`; rollout actors: :class:`RayActorsClient`). It folds vLLM's three update
calls into one ``receive`` per engine, so an engine's update (pause, start, receive, finish, stamp the
version, resume) is one call. If it fails or times out before the workers start the update, the engine is
resumed on its previous weights. Once they started, it cannot be: vLLM's update moves every layer to the meta
device without a copy of its old tensors and fills each layer when its new ones arrived, so an update stopped
part way leaves layers of the new version beside empty ones. Such an engine is marked failed
(``mark_failed``): it stays paused, serves no request, and is dead, so its rollout actor exits (and, since
actors are not replaced on the NCCL path, the run stops, to be resumed from its latest checkpoint).

Ranks: vLLM's trainer tells every worker ``rank_offset=1``, right for one vLLM instance (its workers take
ranks 1..W: vLLM 0.32 ``nccl_common.worker_init_process_group`` joins at ``rank_offset`` + the worker's rank
in its engine). With several engines each gets its own offset (engine i: ``1 + workers of engines before
i``), and ``world_size`` is 1 + the total number of inference workers, engines x tensor-parallel workers
(:func:`~ragen_async.weight_sync.groups.group_layout`; :func:`~ragen_async.weight_sync.factory.make_publisher`
counts them).

Tied weights: after vLLM's ``finish_weight_update`` the receiver calls the worker extension's re-tie
(:data:`RETIE`), the same code that ends the gloo path's reload.

This path needs CUDA and the GPU ``vllm==0.32.0`` wheel; the timeouts and the client are tested on CPU,
the transfer itself by the ``gpu`` tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ragen_async.weight_sync.base import Ticket, WeightPublisher, WeightReceiver, WeightSyncError, WeightSyncTimeout
from ragen_async.weight_sync.groups import check_room, engine_workers, group_layout

RETIE = "_ragen_retie"
"""The worker-extension method every weight update ends in (``ragen_async.inference.vllm_worker_ext``)."""


def _make_source() -> Any:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateSource(WeightSource):
        """A ``WeightSource`` over the tensors of the version being published (set per publish)."""

        def __init__(self) -> None:
            self.named: list[tuple[str, torch.Tensor]] = []

        def metadata(self) -> list[Any]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(list(self.named))

    return StateSource()


def reserve_port(address: str) -> socket.socket:
    """A socket bound to a port the kernel picks on ``address``, with ``SO_REUSEADDR`` and not listening: while
    it is open the kernel gives that port to no other socket (no ephemeral bind, no outgoing connection), yet
    vLLM's rendezvous, which binds it with ``SO_REUSEADDR`` as well, can listen there. A port found free and
    closed at once could be taken by another process before the rendezvous binds it; the engines would then
    knock on that process's socket until the timeout (the race the learner group's rendezvous had)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, 0))
    except OSError:
        s.close()
        raise
    return s


def run_with_timeout(fn: Callable[[], Any], timeout_s: float, what: Callable[[], str],
                     device: torch.device | None = None) -> Any:
    """``fn()`` in a daemon thread; its result, its error re-raised, or :class:`WeightSyncTimeout` after
    ``timeout_s`` (the thread is left behind: it is blocked in a call that cannot be interrupted).
    ``what()`` is read at the time of the error, so it can name the phase reached. A CUDA ``device`` is made
    the thread's current device first: CUDA's current device is per thread (a new one starts on device 0),
    and vLLM's NCCL group and its buffers are made on the current device of the thread that calls it."""
    done = concurrent.futures.Future()

    def target() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            done.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            done.set_exception(err)

    threading.Thread(target=target, daemon=True, name="weight-sync").start()
    try:
        return done.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise WeightSyncTimeout(f"{what()}: timed out after {timeout_s:g} s") from None
    except Exception as err:  # noqa: BLE001 - re-raised with context
        detail, where = _first_line(err), what()
        cls = WeightSyncTimeout if isinstance(err, TimeoutError) else WeightSyncError
        raise cls(where if detail in where else f"{where}: failed ({detail})") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class ReceiversClient(ABC):
    """vLLM's ``VLLMWeightSyncClient`` protocol over the run's receivers. ``update_weights`` is one
    ``receive`` per engine (which starts, receives and finishes the update there); ``start`` and
    ``finish`` only record the phase. Subclasses implement :meth:`_all`."""

    def __init__(self, num_engines: int, workers_per_engine: int = 1, timeout_s: float = 120.0):
        self.num_engines = num_engines
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s
        self.version: int | None = None
        self.phase = "idle"
        self.last_error: str | None = None
        """The last failure of an engine call (the publisher quotes it when vLLM's send then hangs)."""

    @abstractmethod
    def _all(self, method: str, payloads: list[Any]) -> None:
        """Call ``method`` (``join`` or ``receive``) on every engine's receiver with its payload; raise
        :class:`WeightSyncError` naming the engines that failed or did not answer within ``timeout_s``."""

    def _call(self, method: str, payloads: list[Any]) -> None:
        try:
            self._all(method, payloads)
        except WeightSyncError as err:
            self.last_error = str(err)
            raise

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.phase = "joining the NCCL group"
        self.last_error = None
        world_size, offsets = group_layout(self.num_engines, self.workers_per_engine,
                                           first_rank=int(init_info.get("rank_offset", 1)))
        if int(init_info.get("world_size", world_size)) != world_size:
            self.last_error = (f"the publisher's group has world size {init_info['world_size']} but "
                               f"{self.num_engines} engine(s) x {self.workers_per_engine} worker(s) need "
                               f"{world_size}; count every engine's tensor-parallel workers "
                               "(make_publisher(workers_per_engine=...))")
            raise WeightSyncError(f"{self.phase}: {self.last_error}")
        self._call("join", [{**init_info, "rank_offset": offset} for offset in offsets])

    def start_weight_update(self) -> None:
        self.phase = f"starting the update to version {self.version}"

    def update_weights(self, update_info: Any) -> None:
        self.phase = f"receiving version {self.version}"
        self.last_error = None
        ticket = {"version": self.version, "update_info": update_info}
        self._call("receive", [ticket] * self.num_engines)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.phase = f"version {self.version} loaded"


class LocalReceiversClient(ReceiversClient):
    """Receivers in this process, living on ``loop`` (an event loop running in another thread; the
    publisher blocks, so it cannot share the engines' loop)."""

    def __init__(self, receivers: Sequence[WeightReceiver], loop: asyncio.AbstractEventLoop,
                 workers_per_engine: int = 1, timeout_s: float = 120.0):
        super().__init__(len(receivers), workers_per_engine, timeout_s)
        self.receivers = list(receivers)
        self.loop = loop

    def _all(self, method: str, payloads: list[Any]) -> None:
        async def run() -> list[Any]:
            tasks = [asyncio.ensure_future(getattr(r, method)(p))
                     for r, p in zip(self.receivers, payloads, strict=True)]
            _, pending = await asyncio.wait(tasks, timeout=self.timeout_s)
            for t in pending:
                t.cancel()
            return [TimeoutError(f"did not answer within {self.timeout_s:g} s") if t in pending
                    else (t.exception() or t.result()) for t in tasks]

        results = asyncio.run_coroutine_threadsafe(run(), self.loop).result()
        _raise_failures(self.phase, {f"engine {i}": r for i, r in enumerate(results)})


class RayActorsClient(ReceiversClient):
    """Rollout actors, each owning one engine and its receiver (``join_weights`` / ``receive_weights``).
    Calls block on ``ray.get`` (the publisher runs on learner rank 0, a synchronous actor)."""

    def __init__(self, actors: Sequence[Any], workers_per_engine: int = 1, timeout_s: float = 120.0):
        super().__init__(len(actors), workers_per_engine, timeout_s)
        self.actors = list(actors)

    def _all(self, method: str, payloads: list[Any]) -> None:
        import ray

        refs = [getattr(a, f"{method}_weights").remote(p) for a, p in zip(self.actors, payloads, strict=True)]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        late = [i for i, ref in enumerate(refs) if ref in pending]
        if late:
            for ref in pending:
                ray.cancel(ref)
            raise WeightSyncTimeout(f"{self.phase}: rollout actor(s) {late} did not answer within "
                                    f"{self.timeout_s:g} s")
        results = {}
        for i, ref in enumerate(refs):
            try:
                results[f"rollout actor {i}"] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - collected and re-raised with every failure named
                results[f"rollout actor {i}"] = err
        _raise_failures(self.phase, results)


def _raise_failures(phase: str, results: dict[str, Any]) -> None:
    failed = {who: r for who, r in results.items() if isinstance(r, BaseException)}
    if failed:
        detail = "; ".join(f"{who}: {_first_line(e)}" for who, e in failed.items())
        cls = WeightSyncTimeout if all(isinstance(e, TimeoutError) for e in failed.values()) else WeightSyncError
        raise cls(f"{phase}: {detail}") from next(iter(failed.values()))


class NcclPublisher(WeightPublisher):
    """Learner rank 0 → every engine, over vLLM's NCCL weight-transfer engine.

    Args:
        master_address, master_port: rendezvous (TCPStore) of the transfer group; port 0 takes a port from the
            kernel, held (:func:`reserve_port`) from here until the rendezvous listens on it in :meth:`connect`.
        num_receivers: total number of inference *workers* (engines × their TP size).
        client: a :class:`ReceiversClient` over every engine's :class:`NcclReceiver`.
        timeout_s: bound on the rendezvous and on each version's transfer.
        packed: packed broadcast (vLLM default buffers: 1 GiB × 2); vLLM ships it in the init handshake.
        device: CUDA device the trainer broadcasts from (tensors are moved there if needed).
    """

    def __init__(self, master_address: str, master_port: int, num_receivers: int, client: ReceiversClient, *,
                 timeout_s: float = 120.0, packed: bool = True, device: str | torch.device | None = None):
        if not torch.cuda.is_available():
            raise WeightSyncError("NcclPublisher needs CUDA on learner rank 0; on CPU use the gloo backend")
        self.master_address = master_address
        self._reserved = reserve_port(master_address) if int(master_port) == 0 else None
        self.master_port = int(self._reserved.getsockname()[1]) if self._reserved is not None else int(master_port)
        self.num_receivers = int(num_receivers)
        self.timeout_s = float(timeout_s)
        self.packed = packed
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda", torch.cuda.current_device())
        self.client = client
        self._source = _make_source()
        self._engine: Any = None
        self._broken: str | None = None

    @property
    def name(self) -> str:
        return f"NCCL weight group tcp://{self.master_address}:{self.master_port}"

    def _where(self) -> str:
        where = f"{self.name} (learner rank 0 and {self.num_receivers} inference worker(s)), {self.client.phase}"
        return where + (f" [engines: {self.client.last_error}]" if self.client.last_error else "")

    @property
    def bound_s(self) -> float:
        """How long the rendezvous or one version's send may take: longer than the engines' own bound, so
        that an engine's failure is recorded (and quoted) before the send gives up."""
        return 1.25 * self.timeout_s + 1.0

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WeightSyncError(f"{self.name} is unusable after an earlier failure ({self._broken}); "
                                  "close it and form a new group")

    def ticket(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        return None  # the publisher drives the receivers itself, through its client

    def connect(self) -> None:
        """Rendezvous with the engines (blocks until every worker joined, at most ``timeout_s``)."""
        self._check_usable()
        if self._engine is not None:
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        torch.cuda.set_device(self.device)
        info = NCCLTrainerInitInfo(master_address=self.master_address, master_port=self.master_port,
                                   world_size=self.num_receivers + 1, packed=self.packed, rank=0)
        try:
            self._engine = run_with_timeout(
                lambda: WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self._source),
                self.bound_s, self._where, device=self.device)
        except WeightSyncError as err:
            self._broken = str(err)
            raise
        finally:
            self._release_port()  # the rendezvous listens on it now (or failed: the group is unusable)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.connect()
        self._source.named = [(n, t.detach().to(self.device).contiguous()) for n, t in named_tensors]
        self.client.version = int(version)
        try:
            run_with_timeout(self._engine.send_weights, self.bound_s, self._where, device=self.device)
        except WeightSyncError as err:
            self._broken = str(err)
            raise
        finally:
            self._source.named = []
            self.client.phase = "idle"

    def _release_port(self) -> None:
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    def close(self) -> None:
        self._release_port()
        if self._engine is not None and self._broken is None:
            self._engine.shutdown()
        self._engine = None


class NcclReceiver(WeightReceiver):
    """An engine's side of the NCCL path. The engine provides ``worker_rpc(method, *, kwargs, what)``,
    ``updating(version)`` and ``mark_failed(reason)`` (vLLM). The CUDA check happens here, on the process that
    owns the GPU."""

    def __init__(self, engine: Any, timeout_s: float):
        if not torch.cuda.is_available():
            raise WeightSyncError("the NCCL weight receiver needs CUDA on the rollout worker; on CPU use the "
                                  "gloo backend")
        super().__init__(engine, timeout_s)

    async def join(self, info: dict | None) -> None:
        if info is None:
            return  # the publisher makes the receivers join when it connects (vLLM's handshake)
        check_room(int(info["rank_offset"]), engine_workers(self.engine), int(info["world_size"]),
                   f"engine {getattr(self.engine, 'model_path', '?')}: joining the NCCL weight group")
        await asyncio.wait_for(self.engine.worker_rpc("init_weight_transfer_engine", kwargs={"init_info": info},
                                                      what="joining the NCCL weight group"), self.timeout_s)

    async def receive(self, ticket: Ticket) -> dict:
        version = int(ticket["version"])
        engine = self.engine
        started = False

        async def transfer() -> None:
            nonlocal started
            started = True  # from here on the workers' weights may be part-loaded (see below)
            await engine.worker_rpc("start_weight_update", what=f"starting the update to version {version}")
            await engine.worker_rpc("update_weights", kwargs={"update_info": ticket["update_info"]},
                                    what=f"receiving version {version} over NCCL")
            await engine.worker_rpc("finish_weight_update", what=f"finishing the update to version {version}")
            # vLLM's update loads a tied head's source (embed_tokens) but not the head's kernel: the same
            # re-tie as every other path (see ragen_async.inference.vllm_worker_ext)
            await engine.worker_rpc(RETIE, kwargs={"version": version},
                                    what=f"re-tying the tied weights of version {version}")

        async with engine.updating(version):
            try:
                await asyncio.wait_for(transfer(), self.timeout_s)
            except BaseException as err:  # noqa: BLE001 - a cancellation part way leaves the same weights
                if started:
                    # vLLM's start_weight_update moves every layer to the meta device and keeps no copy of the
                    # old tensors; each layer gets the new ones when all of them arrived. Stopped part way, the
                    # engine holds layers of the new version beside empty ones: it must not serve again.
                    # Marked failed, it stays paused (updating) and is dead, so its rollout actor exits.
                    engine.mark_failed(f"its update to version {version} over NCCL stopped part way "
                                       f"({_first_line(err)}): its weights are of no version")
                if isinstance(err, TimeoutError):
                    raise WeightSyncTimeout(f"engine {engine.model_path}: receiving version {version} over NCCL "
                                            f"timed out after {self.timeout_s:g} s (the publisher or another engine "
                                            "is gone); its worker may still sit in the NCCL call") from None
                raise
        return {"version": version}
