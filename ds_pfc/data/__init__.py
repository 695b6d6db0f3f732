"""Datasets."""
from .synthetic import SyntheticIdentities, verification_accuracy

__all__ = ["SyntheticIdentities", "verification_accuracy"]
