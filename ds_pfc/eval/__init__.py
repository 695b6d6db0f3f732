"""Evaluation: 1:1 verification on insightface ``.bin`` pair sets."""
from .verification import (DEFAULT_THRESHOLDS, UnsafePickleError, VerificationResult, embed, embed_pairs, load_bin,
                           verification_metrics)

__all__ = ["DEFAULT_THRESHOLDS", "UnsafePickleError", "VerificationResult", "embed", "embed_pairs", "load_bin",
           "verification_metrics"]
