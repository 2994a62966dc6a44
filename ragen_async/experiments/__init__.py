"""Experiments on top of the orchestrator: staleness sweeps and the reports that compare their runs.

* :mod:`ragen_async.experiments.sweep`: a base config x a grid of dotted overrides -> named runs,
  validated up front, trained one after another, resumable from the sweep directory's manifest.
* :mod:`ragen_async.experiments.report`: ``metrics.jsonl`` of runs or sweeps -> ``report.md``, a CSV
  summary and matplotlib plots of staleness against stability.
"""
