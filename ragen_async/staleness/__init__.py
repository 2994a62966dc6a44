"""Staleness: the bound on how many versions old a trained token may be, and everything that enforces or reads it.

Definitions (docs/architecture.md). Policy version v = the weights after v learner steps (one consumed batch each).
A sampled token produced by version u and trained on at version v has *staleness* (age) v - u; a trajectory is as
stale as its oldest sampled token, a group as its stalest trajectory. ``staleness.max_staleness = k`` bounds it.

One object holds the bound, :class:`bound.StalenessBound`; the others ask it:

- ``bound.py``: the bound (per group under in-order consumption), its moves, its checkpoint state;
- ``controllers.py``: the adaptive bound's rules (early warnings, or the stale tokens' KL against a target);
- ``admission.py``: which group may start (AReaL's rule, ``(k + v + 1) * groups_per_step``) and the accounting
  of every group index; ``gate.py``: the same behind an event loop, the Ray runtime's gate actor;
- ``buffer.py``: the trajectory buffer: drops what exceeds the bound, consumption order, batches and shards;
- ``ages.py``: the age of tokens, trajectories and groups, and each step's age statistics;
- ``ids.py``: group ids and the sequence index they carry;
- ``collapse.py``: falls, collapses and the early warnings the adaptive bound and the report read.

The modules are pure: no ray, zmq, vllm or torch.distributed, no clock reads (every time is passed in).
"""
