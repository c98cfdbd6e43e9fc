"""pcops ops: one module per op family (Warp kernels, custom op, fake, autograd, public function)."""

from .nearest import KNN, knn, knn_aggregate
from .interpolate import knn_interpolate
from .chamfer import chamfer_distance
from .normals import estimate_normals
from .radius import radius_aggregate
from .sampling import FPS, farthest_point_sample
from .ball_query import BallQuery, ball_query
from .graph import PaddedEdges, knn_graph, radius_graph
from .voxel import VoxelPool, VoxelPoolPadded, voxel_pool
from .grid_sample import GridSample, GridSamplePadded, grid_sample
from .sparse_conv import KernelMap, sparse_conv3d, sparse_kernel_map
from .serialize import Serialization, serialize
from .serialize import SerializedPool, SerializedPoolPadded, serialized_pool, serialized_unpool
from .segment import segment_reduce
from .gather import gather

__all__ = ["KNN", "knn", "knn_aggregate", "radius_aggregate"]
__all__ += ["FPS", "farthest_point_sample"]
__all__ += ["BallQuery", "ball_query"]
__all__ += ["PaddedEdges", "knn_graph", "radius_graph"]
__all__ += ["knn_interpolate"]
__all__ += ["chamfer_distance"]
__all__ += ["estimate_normals"]
__all__ += ["VoxelPool", "VoxelPoolPadded", "voxel_pool"]
__all__ += ["GridSample", "GridSamplePadded", "grid_sample"]
__all__ += ["KernelMap", "sparse_conv3d", "sparse_kernel_map"]
__all__ += ["Serialization", "serialize"]
__all__ += ["segment_reduce"]
__all__ += ["gather"]
__all__ += ["SerializedPool", "SerializedPoolPadded", "serialized_pool", "serialized_unpool"]
