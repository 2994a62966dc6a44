"""Weight plane: learner rank 0 publishes versioned weights to every inference engine.

A :class:`WeightPublisher` (learner rank 0) and a :class:`WeightReceiver` (next to each engine) form
a matching pair, built from the config by :mod:`ragen_async.weight_sync.factory`: gloo (CPU / any host,
a dedicated gloo group), NCCL (GPU, vLLM's native weight transfer), rpc (tensors through the control
plane). ``InProcessPublisher`` loads engines of the same process directly; :class:`RingBuffer` keeps
recent versions for fixed-lag publishing.
"""

from ragen_async.weight_sync.base import Ticket, WeightPublisher, WeightReceiver, WeightSyncError, WeightSyncTimeout
from ragen_async.weight_sync.factory import make_publisher, make_receiver, resolve_backend
from ragen_async.weight_sync.gloo import (
    GlooBroadcastPublisher,
    GlooReceiver,
    LocalGlooReceiver,
    broadcast_to_engines,
    connect_engines,
)
from ragen_async.weight_sync.groups import group_layout
from ragen_async.weight_sync.inproc import InProcessPublisher
from ragen_async.weight_sync.nccl import LocalReceiversClient, NcclPublisher, NcclReceiver, RayActorsClient
from ragen_async.weight_sync.probe import WeightSyncDivergence, check_probe, probe_tolerance
from ragen_async.weight_sync.ring import RingBuffer
from ragen_async.weight_sync.wire import Manifest, make_manifest

__all__ = ["GlooBroadcastPublisher", "GlooReceiver", "InProcessPublisher", "LocalGlooReceiver",
           "LocalReceiversClient", "Manifest", "NcclPublisher", "NcclReceiver", "RayActorsClient", "RingBuffer",
           "Ticket", "WeightPublisher", "WeightReceiver", "WeightSyncDivergence", "WeightSyncError",
           "WeightSyncTimeout", "broadcast_to_engines", "check_probe", "connect_engines", "group_layout",
           "make_manifest", "make_publisher", "make_receiver", "probe_tolerance", "resolve_backend"]
