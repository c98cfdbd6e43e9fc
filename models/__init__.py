"""Lightning models and data built from pcops' public API (``from pcops import ...``).

Trained with ``python scripts/train.py --config configs/<name>.yaml``.
"""

from .classify import DGCNNClassifier, PointNet2Classifier, PointNet2Segmenter, PointNetClassifier, PointNetSegmenter
from .data import ShapesSDFDataModule, TutorialCloudDataModule
from .files import FileSDFDataModule
from .lit import FieldRegressor, KNNProjector, RadiusProjector, SDFModel
from .modelnet import ModelNetDataModule
from .ptv3 import PointTransformerV3, PTv3Classifier, PTv3Segmenter
from .scenes import ShapesClassDataModule, ShapesSegDataModule

__all__ = [
    "DGCNNClassifier",
    "FieldRegressor",
    "FileSDFDataModule",
    "KNNProjector",
    "ModelNetDataModule",
    "PointNet2Classifier",
    "PointNet2Segmenter",
    "PointNetClassifier",
    "PointNetSegmenter",
    "PointTransformerV3",
    "PTv3Classifier",
    "PTv3Segmenter",
    "RadiusProjector",
    "SDFModel",
    "ShapesClassDataModule",
    "ShapesSDFDataModule",
    "ShapesSegDataModule",
    "TutorialCloudDataModule",
]
