"""pcops: differentiable point-cloud layers for PyTorch, compile-safe custom ops over Warp and cuML."""

from . import _vml
from . import ops
from .nn import EMDLoss, KNNAggregation, RadiusAggregation, SinkhornLoss, SparseConv3d
from .ops import *  # noqa: F403  (every op family's names, each listed once in its family's __all__)
from .warp_op import warp_op

try:  # the installed distribution's version (pyproject.toml's), read from its metadata
    __version__ = __import__("importlib.metadata").metadata.version("pcops")
except ImportError:  # importlib.metadata.PackageNotFoundError: a source tree that is not installed
    __version__ = "0+unknown"

_vml.warm_up()  # before torch's threads can first run MKL's math functions at once (see pcops._vml)

__all__ = [*ops.__all__, "KNNAggregation", "RadiusAggregation", "SparseConv3d", "EMDLoss", "SinkhornLoss", "warp_op", "__version__"]
