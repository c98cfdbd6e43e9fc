"""pcops: differentiable point-cloud layers for PyTorch, compile-safe custom ops over Warp and cuML."""

from .nn import RadiusAggregation
from .ops import radius_aggregate

__version__ = "0.1.0"

__all__ = ["RadiusAggregation", "radius_aggregate", "__version__"]
