"""The fixed-lag store: the most recent versions' weights, so the learner can publish version v - k."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from ragen_async.weight_sync.wire import flat_layout


class RingBuffer:
    """The ``capacity`` most recent state dicts, as detached CPU copies, keyed by version.

    For fixed-lag publishing: push every new version, publish ``get(v - k)``.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self._items: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def push(self, version: int, state: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]
             ) -> None:
        if self._items and version <= next(reversed(self._items)):
            raise ValueError(f"versions must increase: got {version} after "
                             f"{next(reversed(self._items))}")
        items = state.items() if isinstance(state, dict) else state
        pairs = [(n, t.detach()) for n, t in items]
        # one flat buffer per dtype, so publishing an old version sends it without packing
        copies = flat_layout([t for _, t in pairs], device="cpu")
        self._items[version] = {n: c for (n, _), c in zip(pairs, copies, strict=True)}
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._items:
            raise KeyError(f"version {version} not in ring buffer (holds {self.versions()})")
        return self._items[version]

    def __contains__(self, version: object) -> bool:
        return version in self._items

    def __len__(self) -> int:
        return len(self._items)

    def versions(self) -> list[int]:
        return list(self._items)

    def latest(self) -> int | None:
        return next(reversed(self._items)) if self._items else None
