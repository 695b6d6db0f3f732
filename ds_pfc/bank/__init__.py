"""Class banks: where the persistent centers and their optimizer state live."""
from .base import ClassBank, initial_centers
from .device import DeviceBank

__all__ = ["ClassBank", "DeviceBank", "initial_centers"]
