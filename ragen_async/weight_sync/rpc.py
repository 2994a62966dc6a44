"""Weights through the control plane: the tensors travel inside the ticket (Ray's object store), and each
receiver loads them with the engine's ``load_state_dict``. For tests and tiny models only: every engine
gets a full copy through the driver."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ragen_async.weight_sync.base import Ticket, WeightPublisher, WeightReceiver


class RpcPublisher(WeightPublisher):
    """The ticket carries CPU copies of the tensors; :meth:`publish` has nothing left to send."""

    ticket_carries_tensors = True

    def ticket(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> Ticket:
        return {"version": int(version), "tensors": [(n, t.detach().to("cpu", copy=True)) for n, t in named_tensors]}

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        pass  # the tensors left with the ticket

    def close(self) -> None:
        pass


class RpcReceiver(WeightReceiver):
    async def receive(self, ticket: Ticket) -> dict:
        await self.engine.load_state_dict(ticket["tensors"], int(ticket["version"]))
        return {"version": int(ticket["version"]), "num_tensors": len(ticket["tensors"])}
