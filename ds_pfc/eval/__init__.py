"""Evaluation: 1:1 verification on insightface ``.bin`` pair sets, and IJB-B/IJB-C
template verification (:mod:`ds_pfc.eval.ijb`: ``ijb.evaluate``, ``ijb.read_meta``).
Loading a model of any origin for evaluation needs the app: :mod:`ds_pfc.app.eval_models`.

May import: ds_pfc._checks, ds_pfc.devices, ds_pfc.data; torch.
Never: ds_pfc.core and any layer above it, the root package."""
from . import ijb
from .ijb import IJBMeta, IJBResult, align
from .verification import (DEFAULT_THRESHOLDS, UnsafePickleError, VerificationResult, embed, embed_pairs, load_bin,
                           verification_metrics)

__all__ = ["DEFAULT_THRESHOLDS", "IJBMeta", "IJBResult", "UnsafePickleError", "VerificationResult", "align", "embed",
           "embed_pairs", "ijb", "load_bin", "verification_metrics"]
