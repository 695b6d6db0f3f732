"""Datasets, sampling and transforms."""
from .hf import load_image_dataset
from .recordio import InsightFaceRecord, RecordIOReader, unpack_header
from .sampler import DistributedIdentitySampler
from .synthetic import SyntheticIdentities, verification_accuracy
from .transforms import decode_image, normalize, random_flip, set_image_decoder

__all__ = ["InsightFaceRecord", "RecordIOReader", "unpack_header", "DistributedIdentitySampler",
           "load_image_dataset", "SyntheticIdentities", "verification_accuracy", "decode_image", "normalize",
           "random_flip", "set_image_decoder"]
