"""Class banks: where the persistent centers and their optimizer state live."""
from .base import ClassBank, initial_centers
from .device import DeviceBank
from .streams import StreamError, debug_streams_active
from .tiered import Placement, StaleRowError, TieredBank

__all__ = ["ClassBank", "DeviceBank", "TieredBank", "Placement", "StaleRowError", "initial_centers",
           "StreamError", "debug_streams_active"]
