"""Weight plane: learner rank 0 publishes versioned weights to every inference engine.

``InProcessPublisher`` (same process), ``GlooBroadcastPublisher`` (CPU / any host, a dedicated
gloo group) and ``NcclPublisher`` (GPU, vLLM's native NCCL weight transfer) implement
:class:`WeightPublisher`; :class:`RingBuffer` keeps recent versions for fixed-lag publishing.
"""

from ragen_async.weight_sync.base import (
    Manifest,
    RingBuffer,
    WeightPublisher,
    WeightSyncError,
    WeightSyncTimeout,
    make_manifest,
)
from ragen_async.weight_sync.gloo import (
    GlooBroadcastPublisher,
    broadcast_to_engines,
    connect_engines,
)
from ragen_async.weight_sync.inproc import InProcessPublisher
from ragen_async.weight_sync.nccl import LocalEnginesClient, NcclPublisher

__all__ = ["GlooBroadcastPublisher", "InProcessPublisher", "LocalEnginesClient", "Manifest",
           "NcclPublisher", "RingBuffer", "WeightPublisher", "WeightSyncError", "WeightSyncTimeout",
           "broadcast_to_engines", "connect_engines", "make_manifest"]
