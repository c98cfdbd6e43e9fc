"""Lightning models and data built from pcops' public API (``from pcops import ...``).

Trained with ``python scripts/train.py --config configs/<name>.yaml``.
"""

from .data import ShapesSDFDataModule, TutorialCloudDataModule
from .files import FileSDFDataModule
from .lit import FieldRegressor, KNNProjector, RadiusProjector, SDFModel

__all__ = [
    "FieldRegressor",
    "FileSDFDataModule",
    "KNNProjector",
    "RadiusProjector",
    "SDFModel",
    "ShapesSDFDataModule",
    "TutorialCloudDataModule",
]
