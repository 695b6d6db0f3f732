"""Class banks: where the persistent centers and their optimizer state live (device
and host tiers; the copy streams and slots that move rows between them).

May import: ds_pfc._checks, ds_pfc._rng, ds_pfc.devices; torch.
Never: ds_pfc.core and any layer above it, the root package."""
from .base import ClassBank, initial_centers
from .device import DeviceBank
from .streams import StreamError, debug_streams_active
from .tiered import Placement, StaleRowError, TieredBank

__all__ = ["ClassBank", "DeviceBank", "TieredBank", "Placement", "StaleRowError", "initial_centers",
           "StreamError", "debug_streams_active"]
