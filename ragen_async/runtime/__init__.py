"""Where a run's parts live: the runtime seam and the in-process runtime (:mod:`.local`), the Ray runtime
(:mod:`.ray_runtime`) and its warm rollout actors (:mod:`.engine_pool`)."""

from ragen_async.runtime.local import Admission, LocalAdmission, LocalRuntime, Runtime

__all__ = ["Admission", "LocalAdmission", "LocalRuntime", "Runtime"]
