"""Datasets, sampling and transforms: synthetic faces, RecordIO and Hugging Face
datasets, the identity sampler, the micro-batch loader, stress transforms, label files, decoders.

May import: ds_pfc._checks, ds_pfc._rng, ds_pfc.devices; torch, datasets.
Never: ds_pfc.core, ds_pfc.checkpoint, ds_pfc.deepspeed_plugin, ds_pfc.bench, ds_pfc.app,
ds_pfc.cli, the root package."""
from .faces import SyntheticFaces
from .features import IdentityFeatures
from .hf import load_image_dataset
from .loader import MicroBatchLoader
from .recordio import InsightFaceRecord, RecordIOReader, unpack_header
from .relabel import RelabelledDataset, read_labels
from .sampler import DistributedIdentitySampler
from .stress import StressedDataset, StressSummary
from .synthetic import SyntheticIdentities, verification_accuracy
from .transforms import decode_image, normalize, random_flip, set_image_decoder

__all__ = ["InsightFaceRecord", "RecordIOReader", "unpack_header", "DistributedIdentitySampler",
           "load_image_dataset", "RelabelledDataset", "read_labels", "StressedDataset", "StressSummary", "SyntheticFaces", "IdentityFeatures", "MicroBatchLoader", "SyntheticIdentities", "verification_accuracy", "decode_image", "normalize",
           "random_flip", "set_image_decoder"]
