"""Class banks: where the persistent centers and their optimizer state live (device,
host, NVMe tiers; the copy streams and slots that move rows between them).

May import: ds_pfc._checks, ds_pfc._rng, ds_pfc.devices; torch; deepspeed only inside
ds_pfc.bank.nvme's functions.
Never: ds_pfc.core and any layer above it, the root package."""
from .base import ClassBank, initial_centers
from .device import DeviceBank
from .streams import StreamError, debug_streams_active
from .nvme_model import NvmeBudget, NvmeTierError
from .tiered import Placement, StaleRowError, TieredBank

__all__ = ["ClassBank", "DeviceBank", "TieredBank", "Placement", "StaleRowError", "NvmeBudget", "NvmeTierError",
           "initial_centers",
           "StreamError", "debug_streams_active"]
