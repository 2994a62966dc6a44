"""Benchmarks (``ragen-async bench``) and the paper-shape check, apart from the study.

* :mod:`ragen_async.bench.pipeline`: the whole pipeline at each k, and the helpers every benchmark shares
  (the machine's description, CPU splits).
* :mod:`ragen_async.bench.components`: transport, weight sync and buffer on synthetic groups.
* :mod:`ragen_async.bench.learner`: one learner step at a model shape, per dtype, and its MFU;
  :mod:`ragen_async.bench.flops`: the FLOP count (as torchtitan and verl count it) and the devices' peaks.
* :mod:`ragen_async.bench.learns`: does the learner learn (a bandit with a known optimum, bf16 beside fp32).
* :mod:`ragen_async.bench.decode`: one vLLM engine's decode rate, with or without CUDA graphs.
* :mod:`ragen_async.bench.device_verdicts`: the end of ``scripts/device_check.sh`` (its JSON and verdict lines).
* :mod:`ragen_async.bench.step_profile`: where a training step's time goes, replayed.
* :mod:`ragen_async.bench.simcluster`, :mod:`ragen_async.bench.simprofile`: the control plane at N simulated
  actors, through the real admission gate.
* :mod:`ragen_async.bench.paper_shape`: the paper's config end to end at the 0.5B shape (``make paper-shape``).
* :mod:`ragen_async.bench.cputime`: process CPU time for the benchmarks' tables.
* :mod:`ragen_async.bench.peer`: TRL's GRPOTrainer beside ours on the same model, environments and algorithm.
"""
