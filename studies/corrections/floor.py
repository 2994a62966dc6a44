"""The fall rule's floor on the corrections studies' validation levels (4,000,000-4,000,255 for the unbounded test,
6,000,000-6,000,255 for the fixed-lag test): the random policy's success with the warm starts' reply format
(``warmstart.scripted_success``, the call that gave 0.176 on levels 123-378 and 0.180 on 1,000,000-1,000,255). Plays
the environments only; no model.

    .venv/bin/python studies/corrections/floor.py
"""

from __future__ import annotations

from transformers import AutoTokenizer

from ragen_async.agent.chat import ChatFormat
from ragen_async.tinymodel.warmstart import WARM_STARTS, scripted_success

FIRSTS, N = (4_000_000, 6_000_000), 256


def main() -> None:
    chat = ChatFormat(AutoTokenizer.from_pretrained("studies/specimen/warm_start"))
    for name in ("sokoban", "countdown"):
        config = WARM_STARTS[name]
        for first in (123, 1_000_000, *FIRSTS):  # the two earlier level sets check the call against the registered floors
            rate = scripted_success(config, "random", first, N, config.actions_per_reply, chat)
            print(f"{config.env_tag}: random policy on levels {first}-{first + N - 1}: {rate:.3f} "
                  f"({round(rate * N)} of {N})")


if __name__ == "__main__":
    main()
