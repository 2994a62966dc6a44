"""Publishing to engines in the same process (the single-process loop, tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ragen_async.weight_sync.base import WeightPublisher


class InProcessPublisher(WeightPublisher):
    """Calls ``load_state_dict`` on each in-process engine (concurrently).

    Engines are async. From async code use :meth:`apublish`. The synchronous :meth:`publish` works
    from a thread without a running event loop: it runs the engines' coroutines on ``loop`` (the
    loop the engines live on, running in another thread) when given, else on a fresh loop (fine for
    engines not bound to a loop, like the fake and transformers engines).
    """

    def __init__(self, engines: Sequence[Any], loop: asyncio.AbstractEventLoop | None = None):
        self.engines = list(engines)
        self.loop = loop
        self.last_version: int | None = None

    async def apublish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = [(n, t.detach()) for n, t in named_tensors]
        await asyncio.gather(*(e.load_state_dict(named, version) for e in self.engines))
        self.last_version = version

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        coro = self.apublish(named_tensors, version)
        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(coro, self.loop).result()
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(coro)
            return
        coro.close()
        raise RuntimeError("InProcessPublisher.publish called from a running event loop: "
                           "use `await publisher.apublish(...)`, or pass the engines' loop")

    def close(self) -> None:
        self.engines = []
