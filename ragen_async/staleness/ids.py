"""Group ids and indices: admission hands out a global sequence index per group, and the group id carries it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import re

from ragen_async.protocol import AnyGroup

__all__ = ["format_group_id", "group_index", "parse_group_id"]

_GROUP_ID = re.compile(r"g(\d+)(?!\d)")


def format_group_id(index: int) -> str:
    """The group id of the group admitted with sequence ``index``: ``g00000042``.

    Producers may append a suffix that starts with a non-digit (``g00000042-sokoban``); the index is what
    orders batches deterministically, so it must come first.
    """
    if index < 0:
        raise ValueError(f"group index must be >= 0, got {index}")
    return f"g{index:08d}"


def parse_group_id(group_id: str) -> int:
    """Inverse of :func:`format_group_id` (ignores any suffix); ``ValueError`` if there is no index."""
    match = _GROUP_ID.match(group_id)
    if match is None:
        raise ValueError(f"group id {group_id!r} does not start with 'g<index>' (see format_group_id)")
    return int(match.group(1))


def group_index(group: AnyGroup) -> int:
    """The group's global sequence index (carried by the group itself, set by admission control)."""
    return group.index
