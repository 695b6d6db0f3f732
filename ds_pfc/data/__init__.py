"""Datasets."""
from .recordio import InsightFaceRecord, RecordIOReader, unpack_header
from .synthetic import SyntheticIdentities, verification_accuracy

__all__ = ["InsightFaceRecord", "RecordIOReader", "unpack_header", "SyntheticIdentities", "verification_accuracy"]
