"""Builders of realistic protocol messages for the transport tests."""

from __future__ import annotations

import secrets
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest

from ragen_async.protocol import NO_VERSION, BatchShard, GroupMeta, Trajectory, TrajectoryGroup, TurnRecord
from ragen_async.transport.codec import _BODIES


class Fields(dict):
    """A struct written as an array on the wire, as a map from its field names (what tests edit by name)."""

    def __init__(self, cls: type, values: dict[str, Any]) -> None:
        super().__init__(values)
        self.cls = cls


def _as_maps(value: Any, info: msgspec.inspect.Type) -> Any:
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, list):
        return Fields(info.cls, {f.name: _as_maps(v, f.type) for f, v in zip(info.fields, value, strict=False)})
    if isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)) and isinstance(value, list):
        return [_as_maps(v, info.item_type) for v in value]
    return value


def _as_arrays(value: Any) -> Any:
    """Inverse of :func:`_as_maps`: fields in declaration order up to the first one missing (a removed field
    makes the array short), then any added ones (which make it long)."""
    if isinstance(value, Fields):
        names, out = value.cls.__struct_fields__, []
        for name in names:
            if name not in value:
                break
            out.append(_as_arrays(value[name]))
        return out + [_as_arrays(v) for k, v in value.items() if k not in names]
    if isinstance(value, list):
        return [_as_arrays(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_arrays(v) for k, v in value.items()}
    return value


def header_maps(frame: object) -> dict:
    """A received header with its body (an array, as every struct inside it) turned into maps by field name."""
    header = msgpack.unpackb(bytes(frame), raw=False)  # type: ignore[call-overload]
    if isinstance(header, dict) and header.get("kind") in _BODIES:
        header["body"] = _as_maps(header["body"], msgspec.inspect.type_info(_BODIES[header["kind"]]))
    return header


def pack_header(header: dict) -> bytes:
    """:func:`header_maps` undone (edits included), packed as the codec packs a header."""
    return msgpack.packb(_as_arrays(header), use_bin_type=True)


def random_trajectory(rng: np.random.Generator, group_id: str, i: int, num_turns: int = 3) -> Trajectory:
    """Prompt, then per turn a sampled reply and env feedback, tagged as a real rollout would tag them."""
    ids, mask, logprobs, versions, turns = [], [], [], [], []
    prompt = int(rng.integers(5, 30))
    ids.append(rng.integers(0, 32_000, prompt))
    mask.append(np.zeros(prompt, np.int8))
    logprobs.append(np.zeros(prompt, np.float32))
    versions.append(np.full(prompt, NO_VERSION, np.int32))
    version = int(rng.integers(0, 5))
    for _ in range(num_turns):
        reply, feedback = int(rng.integers(1, 40)), int(rng.integers(1, 20))
        start = version
        ids += [rng.integers(0, 32_000, reply), rng.integers(0, 32_000, feedback)]
        mask += [np.ones(reply, np.int8), np.zeros(feedback, np.int8)]
        logprobs += [-rng.random(reply, dtype=np.float32) * 5, np.zeros(feedback, np.float32)]
        per_token = np.full(reply, version, np.int32)
        if rng.random() < 0.3:  # weights changed mid-turn
            version += 1
            per_token[reply // 2 :] = version
        versions += [per_token, np.full(feedback, NO_VERSION, np.int32)]
        actions = tuple(rng.choice(["up", "down", "left", "right"], int(rng.integers(0, 3))).tolist())
        turns.append(
            TurnRecord(
                reward=float(rng.normal()),
                actions=actions,
                num_dropped_actions=int(rng.integers(0, 2)),
                format_ok=bool(rng.random() < 0.8),
                policy_version=start,
                end_policy_version=version,
                response_tokens=reply,
                generate_s=float(rng.random()),
                env_step_s=float(rng.random() / 10),
            )
        )
    return Trajectory(
        traj_id=f"{group_id}/t{i}",
        env_tag="sokoban",
        seed=int(rng.integers(0, 2**31)),
        group_id=group_id,
        token_ids=np.concatenate(ids).astype(np.int32),
        loss_mask=np.concatenate(mask),
        behaviour_logprobs=np.concatenate(logprobs),
        token_versions=np.concatenate(versions),
        turns=tuple(turns),
        format_penalty=-0.1 * int(rng.integers(0, 3)),
        success=bool(rng.random() < 0.5),
        truncated_by_context=bool(rng.random() < 0.1),
        timings={"generate_s": float(rng.random()), "env_s": float(rng.random())},
    )


def random_group(rng: np.random.Generator, index: int = 7, size: int = 4) -> TrajectoryGroup:
    group_id = f"g{index:08d}"
    return TrajectoryGroup(
        group_id=group_id,
        index=index,
        env_tag="sokoban",
        seed=index,
        trajectories=tuple(random_trajectory(rng, group_id, i) for i in range(size)),
        worker_id="rollout-3",
        created_at=1000.25,
        finished_at=1012.5,
    )


def random_shard(rng: np.random.Generator) -> BatchShard:
    trajs = random_group(rng, 1).trajectories + random_group(rng, 2).trajectories
    n = len(trajs)
    return BatchShard(
        step=5,
        learner_version=5,
        trajectories=trajs,
        scores=rng.normal(size=n).astype(np.float32),
        normalized_scores=rng.normal(size=n).astype(np.float32),
        batch_num_tokens=sum(t.num_response_tokens for t in trajs),
        batch_num_seqs=n,
        rank=1,
        world_size=2,
    )


def assert_same_message(a: object, b: object) -> None:
    """Field-by-field equality with bit-exact arrays (dataclass == cannot compare numpy arrays). A received
    group (``GroupMeta``) is compared through the group it describes."""
    if isinstance(b, GroupMeta):
        b = b.materialize()
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:  # type: ignore[attr-defined]
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
        elif isinstance(x, tuple) and x and hasattr(x[0], "__dataclass_fields__"):
            assert len(x) == len(y), name
            for u, v in zip(x, y, strict=True):
                assert_same_message(u, v)
        else:
            assert x == y and type(x) is type(y), name


class Messages:
    """The builders above behind one seeded generator (a fixture, so tests never import conftest)."""

    assert_same = staticmethod(assert_same_message)

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def group(self, index: int = 7, size: int = 4) -> TrajectoryGroup:
        return random_group(self.rng, index, size)

    def shard(self) -> BatchShard:
        return random_shard(self.rng)


@pytest.fixture
def secret() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def msgs() -> Messages:
    return Messages()
