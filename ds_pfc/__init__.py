"""ds_pfc: Partial FC heads for classifiers of millions of classes, on DeepSpeed."""
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
