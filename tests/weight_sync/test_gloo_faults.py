"""Gloo weight sync with an engine that dies before, during or after a transfer (CPU stand-ins).

Each engine is a process with a ``FakeEngine`` and the real ``LocalGlooReceiver``; the publisher is the
real ``GlooBroadcastPublisher`` in this process, sending several buffers per version. One engine process
dies (``os._exit``, no goodbye on the sockets) at the chosen moment. Both the publisher and the surviving
engine must fail within the timeout, naming the group, and the survivor must still serve on its
previous weights.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import pytest
import torch

from ragen_async.weight_sync import GlooBroadcastPublisher, WeightSyncError

pytestmark = [pytest.mark.alone, pytest.mark.slow]  # waits on timeouts and process deaths by design

TIMEOUT_S = 3.0


def named_state(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [("a.weight", torch.full((256, 256), scale)), ("b.weight", torch.full((256, 256), scale + 1)),
            ("c.bias", torch.full((64,), scale))]


def report(path: str, *event) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def events(path, n: int, timeout_s: float = 60) -> list:
    """The first ``n`` events a process reported (waits for them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [tuple(json.loads(line)) for line in lines[:n]]
        time.sleep(0.1)
    raise TimeoutError(f"{path}: fewer than {n} events after {timeout_s} s")


def engine_process(info: dict, tickets: list[dict], dies: str | None, out: str) -> None:
    """Join, then receive each ticket in turn; ``dies`` = ``before`` (after joining), ``during`` (after
    the first version's header) or ``after`` (after the first version). Reports events to the file ``out``."""
    import asyncio

    from ragen_async.inference.base import SamplingConfig
    from ragen_async.inference.fake_engine import FakeEngine
    from ragen_async.weight_sync import make_receiver
    from ragen_async.weight_sync.gloo import broadcast
    from ragen_async.weight_sync.wire import HEADER_LEN

    async def main() -> None:
        engine = FakeEngine(lambda prompt, rng: [4, 5, 6])
        receiver = make_receiver("gloo", engine, TIMEOUT_S)
        await receiver.join(info)
        report(out, "joined", info["rank"])
        for i, ticket in enumerate(tickets):
            if dies == "before" or (dies == "after" and i == 1):
                os._exit(1)
            if dies == "during":
                broadcast(receiver._pg, torch.zeros(HEADER_LEN, dtype=torch.int64), TIMEOUT_S, "stand-in")
                os._exit(1)
            t0 = time.monotonic()
            try:
                await receiver.receive(ticket)
                report(out, "received", engine.policy_version)
            except WeightSyncError as err:
                gen = await asyncio.wait_for(engine.generate([1], SamplingConfig(max_tokens=3)), 5)
                report(out, "error", str(err), time.monotonic() - t0, engine.policy_version, gen.token_ids)
                return

    asyncio.run(main())


@pytest.mark.parametrize("dies", ["before", "during", "after"])
def test_an_engine_dying_is_an_error_within_the_timeout_and_the_survivor_keeps_serving(dies, tmp_path):
    pub = GlooBroadcastPublisher("127.0.0.1", 0, num_receivers=2, timeout_s=TIMEOUT_S, bucket_bytes=64 * 1024)
    versions = [(1, named_state(1.0)), (2, named_state(2.0))]
    tickets = [pub.ticket(named, v) for v, named in versions]
    ctx = mp.get_context("spawn")
    out_survivor, out_dead = tmp_path / "survivor.jsonl", tmp_path / "dead.jsonl"
    procs = [ctx.Process(target=engine_process, args=(pub.receiver_info(0), tickets, None, str(out_survivor))),
             ctx.Process(target=engine_process, args=(pub.receiver_info(1), tickets, dies, str(out_dead)))]
    for p in procs:
        p.start()
    try:
        pub.connect()
        assert events(out_survivor, 1) == [("joined", 1)] and events(out_dead, 1) == [("joined", 2)]
        if dies == "after":
            pub.publish(versions[0][1], 1)  # both engines load version 1, then one dies
            assert events(out_survivor, 2)[1] == ("received", 1)
            procs[1].join(30)
        elif dies == "before":
            procs[1].join(30)  # dead before the publisher starts
        failing = versions[1] if dies == "after" else versions[0]
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as info:
            pub.publish(failing[1], failing[0])
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        assert f"weight broadcast from learner rank 0 at tcp://127.0.0.1:{pub.master_port}" in str(info.value)

        kind, msg, elapsed, version, reply = events(out_survivor, 3 if dies == "after" else 2)[-1]
        assert kind == "error" and elapsed < TIMEOUT_S + 5, (kind, msg, elapsed)
        assert f"tcp://127.0.0.1:{pub.master_port}" in msg and "receiver rank 1" in msg, msg
        assert version == (1 if dies == "after" else 0)  # its previous weights
        assert reply == [4, 5, 6]  # and it still serves
        procs[1].join(10)
        assert procs[1].exitcode == 1  # it did die
    finally:
        pub.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
