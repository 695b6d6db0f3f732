"""ds_pfc: Partial FC heads for classifiers of millions of classes, on DeepSpeed."""
from ._versions import check_versions as _check_versions

_check_versions()     # a torch or DeepSpeed outside the tested range: an error or a warning, now

from .bank import ClassBank, DeviceBank, Placement, StaleRowError, TieredBank
from .core.functional import margin_cross_entropy
from .core.head import PartialFC
from .core.margins import (AdaFace, ArcFace, CombinedMargin, CosFace, CurricularFace, ElasticArcFace, ElasticCosFace,
                           MagFace, Margin)
from .core.optim import RowAdamW, RowSGD
from .core.partition import Partition

__all__ = [
    "PartialFC", "margin_cross_entropy", "ArcFace", "CosFace", "CombinedMargin", "Margin", "AdaFace", "MagFace",
    "CurricularFace", "ElasticArcFace", "ElasticCosFace",
    "ClassBank", "DeviceBank", "TieredBank", "Placement", "StaleRowError", "RowSGD", "RowAdamW", "Partition",
]
from ._versions import __version__  # noqa: E402

