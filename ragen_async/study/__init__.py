"""The staleness study on top of the orchestrator: sweeps, their statistics and the reports that compare runs.

* :mod:`ragen_async.study.sweep`: a base config x a grid of dotted overrides -> named runs, validated up
  front, trained one after another, resumable from the sweep directory's manifest.
* :mod:`ragen_async.study.stats`: collapse events, early-warning lead times, cells of seeds with 95 %
  intervals, trends against staleness.
* :mod:`ragen_async.study.report`: ``metrics.jsonl`` of runs or sweeps -> ``report.md``, a CSV summary and
  matplotlib plots of staleness against stability.
* :mod:`ragen_async.study.watch`: a running run's curves in the terminal.
* :mod:`ragen_async.study.rllib_ref`: the classic reference, RLlib's APPO on the same Sokoban levels.
"""
