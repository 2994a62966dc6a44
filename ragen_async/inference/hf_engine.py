"""A real but slow engine on plain transformers: exact log-probs, in-process weight loading.

For fast unit tests and debugging where starting vLLM is not wanted. Each request decodes token by
token with a KV cache in a worker thread; the model is shared and each forward step holds a lock,
so concurrent requests interleave step by step and a weight load between two steps is seen by every
in-flight request from its next token on (the same in-flight semantics as the vLLM engine).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterable

import torch

from ragen_async.inference.base import (
    Generation,
    InferenceEngine,
    SamplingConfig,
    model_eos_token_ids,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                      top_k: int = -1) -> torch.Tensor:
    """Log-probs of the sampling distribution for ``logits`` ``(..., V)``: temperature, then top-k,
    then top-p (vLLM's order), masked tokens at ``-inf``. ``temperature == 0`` means greedy and
    returns the temperature-1 log-probs."""
    logits = logits.float()
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= 1 - top_p  # keep the smallest top set with mass >= top_p
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class HFEngine(InferenceEngine):
    """Transformers-backed engine. ``model_path`` is a local ``save_pretrained`` directory.
    Stops at ``max_tokens``, at the request's stop ids, and (``stop_at_model_eos``) at the
    checkpoint's EOS ids — the same rule as :class:`~ragen_async.inference.vllm_engine.VLLMEngine`."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 initial_version: int = 0, max_model_len: int | None = None,
                 stop_at_model_eos: bool = True):
        from transformers import AutoModelForCausalLM

        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"model path {model_path!r} does not exist or is not a directory")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (got {dtype!r})")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype])
        self.model.to(self.device).eval()
        self.max_model_len = max_model_len or int(
            getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = model_eos_token_ids(model_path) if stop_at_model_eos else ()
        self._version = initial_version
        self._seed_gen = torch.Generator().manual_seed(seed)
        self._step_lock = threading.Lock()  # one forward/load at a time
        self._resumed = threading.Event()
        self._resumed.set()
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self._closed:
            raise RuntimeError("HFEngine is shut down")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len "
                             f"{self.max_model_len}")
        seed = sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        return await asyncio.to_thread(self._generate_sync, list(prompt_ids), sampling, seed)

    def _generate_sync(self, prompt_ids: list[int], sampling: SamplingConfig, seed: int) -> Generation:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        start_version = self._version
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        past = None
        next_input = torch.tensor([prompt_ids], device=self.device)
        finish = "length"
        limit = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        stop_ids = {*sampling.stop_token_ids, *self.eos_token_ids}
        while len(out_ids) < limit:
            self._resumed.wait()
            with self._step_lock, torch.no_grad():
                version = self._version
                out = self.model(input_ids=next_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                lp = sampling_logprobs(out.logits[0, -1], sampling.temperature, sampling.top_p,
                                       sampling.top_k)
            if sampling.temperature == 0:
                tok = int(torch.argmax(lp))
            else:
                tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
            out_ids.append(tok)
            logprobs.append(float(lp[tok]))
            versions.append(version)
            if tok in stop_ids:
                finish = "stop"
                break
            next_input = torch.tensor([[tok]], device=self.device)
        # Like the vLLM engine: start/end are the versions of the first/last sampled token.
        return Generation(token_ids=out_ids, logprobs=logprobs,
                          start_version=versions[0] if versions else start_version,
                          end_version=versions[-1] if versions else self._version,
                          finish_reason=finish, token_versions=versions)

    async def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        if not token_ids:
            return []
        return await asyncio.to_thread(self._prompt_logprobs_sync, list(token_ids), temperature)

    def _prompt_logprobs_sync(self, token_ids: list[int], temperature: float) -> list[float]:
        with self._step_lock, torch.no_grad():
            ids = torch.tensor([token_ids], device=self.device)
            logits = self.model(input_ids=ids).logits[0, :-1]
        lp = sampling_logprobs(logits, temperature if temperature > 0 else 1.0)
        picked = lp.gather(-1, ids[0, 1:, None])[:, 0]
        return [0.0] + picked.tolist()

    # ---- weights & lifecycle ----------------------------------------------------------------
    async def load_state_dict(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                              version: int) -> None:
        await asyncio.to_thread(self._load_sync, list(named_tensors), version)

    def _load_sync(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        state = self.model.state_dict()
        unknown = [n for n, _ in named_tensors if n not in state]
        if unknown:
            raise KeyError(f"unknown parameter names {unknown[:5]} (model has e.g. "
                           f"{list(state)[:3]})")
        with self._step_lock, torch.no_grad():
            for name, tensor in named_tensors:
                if tuple(tensor.shape) != tuple(state[name].shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's "
                                     f"{tuple(state[name].shape)}")
                state[name].copy_(tensor.to(state[name].device))
            self._version = version

    async def served_weights(self) -> tuple[int, list]:
        """Transformers' forward reads the parameters themselves; a tied head reads the embedding."""
        from ragen_async.weight_sync.verify import served_entry

        with self._step_lock:
            out = [served_entry(n, n.removesuffix(".weight").removesuffix(".bias"), p)
                   for n, p in self.model.named_parameters()]
            head = self.model.get_output_embeddings()
            if head is not None and self.model.config.tie_word_embeddings:
                out += [served_entry(n, "lm_head", p) for n, p in self.model.named_parameters() if p is head.weight]
            return self._version, out

    async def pause(self) -> None:
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    def shutdown(self) -> None:
        self._closed = True
        self._resumed.set()
