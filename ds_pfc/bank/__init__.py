"""Class banks: where the persistent centers and their optimizer state live."""
from .base import ClassBank, initial_centers
from .device import DeviceBank
from .tiered import Placement, StaleRowError, TieredBank

__all__ = ["ClassBank", "DeviceBank", "TieredBank", "Placement", "StaleRowError", "initial_centers"]
