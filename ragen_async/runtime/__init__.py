"""Where a run's parts live: the runtime seam (:mod:`.base`), the in-process runtime (:mod:`.local`), the Ray
runtime (:mod:`.ray_runtime`) and its warm rollout actors (:mod:`.engine_pool`)."""

from ragen_async.runtime.base import Admission, Runtime
from ragen_async.runtime.local import LocalAdmission, LocalRuntime

__all__ = ["Admission", "LocalAdmission", "LocalRuntime", "Runtime"]
