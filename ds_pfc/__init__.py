"""ds_pfc: Partial FC heads for classifiers of millions of classes, on DeepSpeed."""
from ._versions import check_versions as _check_versions

_check_versions()     # a torch or DeepSpeed outside the tested range: an error or a warning, now

from .bank import ClassBank, DeviceBank, Placement, StaleRowError, TieredBank
from .functional import margin_cross_entropy
from .head import PartialFC
from .margins import (AdaFace, ArcFace, CombinedMargin, CosFace, CurricularFace, ElasticArcFace, ElasticCosFace,
                      MagFace, Margin)
from .optim import RowAdamW, RowSGD
from .partition import Partition

__all__ = [
    "PartialFC", "margin_cross_entropy", "ArcFace", "CosFace", "CombinedMargin", "Margin", "AdaFace", "MagFace",
    "CurricularFace", "ElasticArcFace", "ElasticCosFace",
    "ClassBank", "DeviceBank", "TieredBank", "Placement", "StaleRowError", "RowSGD", "RowAdamW", "Partition",
]
__version__ = "0.1.0"
