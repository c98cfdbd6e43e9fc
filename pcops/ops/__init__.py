"""pcops ops: one module per op family (Warp kernels, custom op, fake, autograd, public function)."""

from .nearest import KNN, knn, knn_aggregate
from .nearest import knn_interpolate
from .chamfer import chamfer_distance
from .normals import estimate_normals
from .radius import radius_aggregate

__all__ = ["KNN", "knn", "knn_aggregate", "radius_aggregate"]
__all__ += ["knn_interpolate"]
__all__ += ["chamfer_distance"]
__all__ += ["estimate_normals"]
