"""Worker extension injected into vLLM's worker class (``worker_extension_cls``).

Runs inside vLLM's worker process; the engine drives it through ``collective_rpc(method, args)``.
Arguments travel through msgspec, so everything is plain data: tensors as ``bytes`` + dtype name +
shape (numpy arrays would arrive as lists).

Loading weights: ``model.load_weights`` fails on CPU after the initial load (the CPU backend replaces
linear weights by kernel-format tensors without ``weight_loader``), so we use the worker's own
``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (layerwise reload: checkpoint
names and layouts in, the model's fused/kernel layout out) under ``torch.no_grad()``. All weights of
a layer must arrive in one call: a fused layer (q/k/v, gate/up) that gets only some of its parts is
rebuilt from uninitialised memory for the missing ones. Every method here therefore loads what it
received in a single reload call.

Tied weights (Qwen2.5's ``lm_head`` is ``embed_tokens``): the learner publishes only
``model.embed_tokens.weight``. vLLM 0.32's layerwise reload (``reload_weights``, and its NCCL update: the same
``initialize_layerwise_reload`` / ``model.load_weights`` / ``finalize_layerwise_reload``) copies it into the
embedding's kernel tensor, which the head shares, and then puts the head's kernel tensors back without
redoing the head's post-load step (``model_loader/reload/layerwise.py``: ``finalize_layerwise_processing``,
"ParallelLMHead: Failed to load weights", ``_place_kernel_tensors``). The Parameter stays tied and holds
the new values, but a head whose kernel captured its weight at load time keeps version 0's: on CPU the GEMM
of ``dispatch_cpu_unquantized_gemm`` (measured: 5-9 nats off on the tiny model), and any quantisation that
repacks the head. (An unquantized CUDA head reads the shared Parameter, so there it is right either way.)
Every weight update therefore ends in :meth:`WeightSyncWorkerExtension._ragen_retie`: the gloo and RPC
paths (:meth:`~WeightSyncWorkerExtension._ragen_reload`) and vLLM's NCCL path alike (the NCCL receiver calls
it after vLLM's ``finish_weight_update``).

Captured CUDA graphs (GPU engines without ``enforce_eager``) read the addresses their tensors had at capture, so
an update must copy into that storage: a tensor it reallocated would leave the graphs computing with the old
memory, which no check that reads the weights eagerly (the byte-exact one included) would see. With graphs
captured, the address and size of every parameter and buffer are therefore recorded before the first update
(:meth:`WeightSyncWorkerExtension._ragen_record_ties`) and compared after each one, at its re-tie; any change
stops the run with :class:`GraphAddressChanged`, naming the tensor and the version.

Attribute names carry a ``_ragen`` prefix: vLLM refuses extensions whose names collide with the
worker's (the CPU worker already has e.g. ``update_weights``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ragen_async.weight_sync.base import WeightSyncError
from ragen_async.weight_sync.gloo import ReceiveBuffers, group_name, open_group, receive_weights
from ragen_async.weight_sync.wire import dtype_from_name


class GraphAddressChanged(WeightSyncError):
    """A weight update moved or resized a tensor that captured CUDA graphs read."""


def captures_graphs(vllm_config: Any) -> bool:
    """Whether the engine of ``vllm_config`` replays captured CUDA graphs (not ``enforce_eager``, and a
    ``compilation_config.cudagraph_mode`` other than ``NONE``)."""
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", True):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def storage_map(model: torch.nn.Module) -> dict[str, list[int]]:
    """``{name: [data_ptr, numel]}`` of every parameter and buffer of ``model``, tied ones under each name."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: [int(t.data_ptr()), int(t.numel())] for name, t in named}


def moved_tensors(before: dict[str, list[int]], after: dict[str, list[int]]) -> list[str]:
    """How ``after`` differs from ``before`` (:func:`storage_map`), one line per tensor (empty: no change)."""
    lines = []
    for name, (ptr, numel) in before.items():
        if name not in after:
            lines.append(f"{name}: gone")
        elif after[name][0] != ptr:
            lines.append(f"{name}: moved from address {ptr:#x} to {after[name][0]:#x}")
        elif after[name][1] != numel:
            lines.append(f"{name}: resized from {numel} to {after[name][1]} elements")
    lines += [f"{name}: new" for name in after if name not in before]
    return lines


def _shared_parameters(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, str]]:
    """(module, attr, source_module, source_attr) for every parameter that is the same object as an
    earlier module's parameter (tied weights)."""
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    shared = []
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in first:
                if first[id(param)][0] is not module:
                    shared.append((module, attr, *first[id(param)]))
            else:
                first[id(param)] = (module, attr)
    return shared



def _aliases(model: torch.nn.Module, buffers: Sequence[torch.Tensor]) -> bool:
    """Whether any parameter or buffer of ``model`` shares memory with one of ``buffers``."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
    for t in (*model.parameters(), *model.buffers()):
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and any(lo <= ptr < hi for lo, hi in spans):
            return True
    return False


PROBE_OUT_BYTES = 64 << 20
"""Largest output of one identity block when a linear layer's weight is read back through its kernel."""


def kernel_weight(layer: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The weight ``layer``'s kernel computes with, read back through that kernel: its quant method's
    ``apply`` (what the forward calls; on CPU a GEMM handle that packed the weight at load time, which is not
    the ``weight`` Parameter) on blocks of the identity, without the bias. Each output is a weight times 1
    summed with zeros, so in any float dtype the result holds the weight's exact values, ``[out, in]``."""
    k = int(getattr(layer, "input_size_per_partition", 0) or getattr(layer, "embedding_dim", 0))

    def block(start: int, rows: int) -> torch.Tensor:  # columns start .. start + rows of the weight
        eye = torch.zeros(rows, k, dtype=dtype, device=device)
        idx = torch.arange(rows, device=device)
        eye[idx, start + idx] = 1
        return layer.quant_method.apply(layer, eye, bias=None).t()

    with torch.no_grad():
        first = block(0, 1)
        out = torch.empty(first.shape[0], k, dtype=first.dtype, device=first.device)
        out[:, :1] = first
        step = max(1, PROBE_OUT_BYTES // max(1, first.numel() * first.element_size()))
        for start in range(1, k, step):
            rows = min(step, k - start)
            out[:, start: start + rows] = block(start, rows)
    return out


def served_tensors(model: torch.nn.Module, dtype: torch.dtype, device: torch.device
                   ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(checkpoint name, module, values)`` for every tensor the model's forward reads, one at a time: linear
    layers' and the output head's weights through their kernels (:func:`kernel_weight`), split back into the
    checkpoint's tensors where vLLM fused them (``packed_modules_mapping``: q/k/v, gate/up); biases, norms
    and the embedding as they are (their forward reads the Parameter). A tied head stands for the
    embedding's checkpoint tensor. Tensor parallelism > 1 is refused: a worker holds shards then."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    embedding = ""
    for mname, module in model.named_modules():
        if int(getattr(module, "tp_size", 1)) > 1:
            raise WeightSyncError(f"byte-exact weight check: {mname} is split over {module.tp_size} tensor-parallel "
                                  "workers; the check needs tensor_parallel_size 1 (weight_sync.verify_every: 0 "
                                  "turns it off)")
        prefix = f"{mname}." if mname else ""
        if isinstance(module, ParallelLMHead):
            if tied and not embedding:
                raise WeightSyncError(f"byte-exact weight check: {mname} is tied, but no embedding came before it")
            yield (embedding if tied else f"{prefix}weight"), mname, \
                kernel_weight(module, dtype, device)[: module.org_vocab_size]
            continue
        if isinstance(module, VocabParallelEmbedding):
            embedding = f"{prefix}weight"
            yield embedding, mname, module.weight[: module.org_vocab_size]
            continue
        if isinstance(module, LinearBase):
            parts = packed.get(mname.rsplit(".", 1)[-1], [])
            sizes = list(getattr(module, "output_partition_sizes", []))
            names = ([f"{mname.rsplit('.', 1)[0]}.{p}" if "." in mname else p for p in parts]
                     if parts and len(parts) == len(sizes) else [mname])
            sizes = sizes if len(names) > 1 else [-1]
            weight = kernel_weight(module, dtype, device)
            for name, part in zip(names, weight.split(sizes) if len(names) > 1 else [weight], strict=True):
                yield f"{name}.weight", mname, part
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                for name, part in zip(names, bias.split(sizes) if len(names) > 1 else [bias], strict=True):
                    yield f"{name}.bias", mname, part
            continue
        for pname, param in module.named_parameters(recurse=False):
            yield f"{prefix}{pname}", mname, param


class WeightSyncWorkerExtension:
    """Methods callable through ``collective_rpc``; ``self`` is the vLLM worker."""

    _ragen_pg: Any = None
    _ragen_group: str = ""
    _ragen_timeout_s: float = 60.0
    _ragen_my_rank: int = -1
    _ragen_buffers: ReceiveBuffers | None = None
    """Receive buffers kept between broadcasts (each worker's own list, made on first use)."""

    _ragen_ties: list[tuple[torch.nn.Module, str, torch.nn.Module, str]] | None = None
    """The model's tied parameters as loaded, recorded before any update can loosen them."""
    _ragen_addresses: dict[str, list[int]] | None = None
    """With captured CUDA graphs: every parameter's and buffer's ``[data_ptr, numel]`` before the first update."""

    # ---- loading ----------------------------------------------------------------------------
    def _ragen_record_ties(self) -> int:
        """Record which parameters are tied (once: before the first update); returns how many. The engine
        calls it before its first update; the re-tie records them itself if nobody did."""
        if self._ragen_ties is None:
            model = self.model_runner.get_model()
            self._ragen_ties = _shared_parameters(model)
            if captures_graphs(self.vllm_config):  # the addresses the graphs were captured with
                self._ragen_addresses = storage_map(model)
        return len(self._ragen_ties)

    def _ragen_check_addresses(self, version: int | None) -> None:
        """With captured CUDA graphs: raise :class:`GraphAddressChanged` if any parameter or buffer no longer
        has the address and size it had before the first update."""
        if self._ragen_addresses is None:
            return
        changed = moved_tensors(self._ragen_addresses, storage_map(self.model_runner.get_model()))
        if changed:
            more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
            raise GraphAddressChanged(
                f"the weight update to version {version if version is not None else '?'} changed "
                f"{len(changed)} tensor(s) the captured CUDA graphs read: " + "; ".join(changed[:3]) + more
                + ". The graphs would go on computing with the old memory; stopping (inference.enforce_eager=true "
                "runs without graphs)")

    def _ragen_retie(self, version: int | None = None) -> int:
        """After any weight update (a layerwise reload here, or vLLM's NCCL ``start_weight_update`` /
        ``update_weights`` / ``finish_weight_update``): make every tied parameter the same object as its
        source again and let its layer redo its post-load step (on CPU that rebuilds the GEMM handle, which
        captured the weight), so the output head computes with the embedding just loaded; then, with captured
        CUDA graphs, check that no tensor moved (:meth:`_ragen_check_addresses`, naming ``version``). Returns
        the number of tied parameters."""
        self._ragen_record_ties()
        assert self._ragen_ties is not None
        with torch.no_grad():
            for module, attr, source, source_attr in self._ragen_ties:
                setattr(module, attr, getattr(source, source_attr))
                quant_method = getattr(module, "quant_method", None)
                if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
                    quant_method.process_weights_after_loading(module)
        self._ragen_check_addresses(version)
        return len(self._ragen_ties)

    def _ragen_served(self) -> list:
        """The byte-exact weight check's report (:mod:`ragen_async.weight_sync.verify`): a
        :data:`~ragen_async.weight_sync.verify.ServedEntry` for every tensor this worker's forward reads."""
        from ragen_async.weight_sync.verify import served_entry

        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        return [served_entry(name, by, t)
                for name, by, t in served_tensors(model, self.vllm_config.model_config.dtype, device)]

    def _ragen_reload(self, named: Sequence[tuple[str, torch.Tensor]], version: int) -> dict:
        t0 = time.perf_counter()
        self._ragen_record_ties()
        with torch.no_grad():
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        self._ragen_retie(version)
        return {"num_tensors": len(named), "reload_s": time.perf_counter() - t0,
                "version": int(version)}

    def load_weights_from_bytes(self, items: Sequence[Sequence[Any]], version: int) -> dict:
        """``items``: ``(name, dtype_name, shape, raw_bytes)`` per tensor (checkpoint names)."""
        named = []
        for name, dtype, shape, raw in items:
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            named.append((str(name), buf.view(dtype_from_name(dtype)).view(tuple(int(s) for s in shape))))
        return self._ragen_reload(named, version)

    def _ragen_storage(self) -> dict[str, list[int]]:
        """``{name: [data_ptr, numel]}`` of every parameter and buffer of the model, tied ones under each name
        (``lm_head.weight`` beside ``model.embed_tokens.weight``): where each tensor lives. Captured CUDA graphs
        read those addresses, so they stay valid only while weight updates leave every entry unchanged. On CPU
        the linear layers' ``weight`` is an empty placeholder (numel 0): their weights live in the GEMM handle
        vLLM packs at load time, which this cannot see."""
        return storage_map(self.model_runner.get_model())

    # ---- gloo broadcast group ---------------------------------------------------------------
    def init_weight_group(self, master_address: str, master_port: int, world_size: int, rank: int,
                          timeout_s: float = 60.0) -> int:
        """Join the publisher's gloo group (a separate group, not vLLM's). ``rank`` is this engine's
        first rank; each worker joins at ``rank + its vLLM rank``. Returns the rank joined."""
        self.close_weight_group()
        my_rank = int(rank) + int(getattr(self, "rank", 0))
        self._ragen_group = group_name(master_address, int(master_port))
        self._ragen_timeout_s = float(timeout_s)
        self._ragen_pg = open_group(master_address, int(master_port), int(world_size), my_rank,
                                    float(timeout_s))
        self._ragen_my_rank = my_rank
        return my_rank

    def receive_broadcast(self, manifest: Sequence[Sequence[Any]], version: int, bucket_bytes: int | None = None) -> dict:
        """Receive one version broadcast by the publisher (see ``weight_sync.gloo``) and load it;
        ``bucket_bytes`` is the plan the ticket announced (``None``: read it from the header first)."""
        if self._ragen_pg is None:
            raise WeightSyncError("receive_broadcast: no weight group; call init_weight_group first")
        where = (f"weight broadcast from learner rank 0 at {self._ragen_group} "
                 f"(receiver rank {self._ragen_my_rank})")
        t0 = time.perf_counter()
        try:
            if self._ragen_buffers is None:
                self._ragen_buffers = ReceiveBuffers()
            named = receive_weights(self._ragen_pg, manifest, int(version), self._ragen_timeout_s,
                                    where, buffers=self._ragen_buffers, bucket_bytes=bucket_bytes)
        except WeightSyncError:
            self.close_weight_group()  # the group is unusable after a failed collective
            raise
        recv_s = time.perf_counter() - t0
        stats = self._ragen_reload(named, version)
        # The receive buffers are reused by the next sync, which is only safe if the model copied the
        # weights out of them; if any parameter still points into them, the next sync gets new ones.
        stats["buffers_reused"] = not _aliases(self.model_runner.get_model(), self._ragen_buffers.raws)
        if not stats["buffers_reused"]:
            self._ragen_buffers = None
        stats["recv_s"] = recv_s
        return stats

    def close_weight_group(self) -> None:
        self._ragen_pg = None
        self._ragen_group = ""
        self._ragen_buffers = None
