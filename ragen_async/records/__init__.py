"""A run's records: its directory and checkpoints (:mod:`.rundir`), its metrics sinks (:mod:`.metrics`), its
provenance and audit (:mod:`.provenance`), where its processes' output goes (:mod:`.logfiles`), the reaper of the
processes it started (:mod:`.reaper`) and its training-time budget (:mod:`.budget`)."""
