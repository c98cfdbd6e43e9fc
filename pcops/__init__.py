"""pcops: differentiable point-cloud layers for PyTorch, compile-safe custom ops over Warp and cuML."""

from . import _vml
from .nn import KNNAggregation, RadiusAggregation, SparseConv3d
from .nn import EMDLoss, SinkhornLoss
from .ops import KNN, knn, knn_aggregate, radius_aggregate
from .ops import FPS, farthest_point_sample
from .ops import BallQuery, ball_queries, ball_query
from .ops import PaddedEdges, knn_graph, radius_graph
from .ops import knn_interpolate
from .ops import chamfer_distance
from .ops import estimate_normals
from .ops import VoxelPool, VoxelPoolPadded, voxel_pool
from .ops import GridSample, GridSamplePadded, grid_sample
from .ops import KernelMap, sparse_conv3d, sparse_kernel_map
from .ops import Serialization, serialize
from .ops import SerializedPool, SerializedPoolPadded, serialized_pool, serialized_unpool
from .ops import segment_reduce
from .ops import gather
from .ops import MeshBVH, MeshDistance, mesh_bvh, mesh_distance, point_mesh_face_distance
from .ops import MeshSamples, sample_points_on_mesh
from .ops import EarthMoversDistance, SinkhornDivergence, earth_movers_distance, sinkhorn_divergence
from .warp_op import warp_op

try:  # the installed distribution's version (pyproject.toml's), read from its metadata
    __version__ = __import__("importlib.metadata").metadata.version("pcops")
except ImportError:  # importlib.metadata.PackageNotFoundError: a source tree that is not installed
    __version__ = "0+unknown"

_vml.warm_up()  # before torch's threads can first run MKL's math functions at once (see pcops._vml)

__all__ = ["KNN", "KNNAggregation", "RadiusAggregation", "knn", "knn_aggregate", "radius_aggregate", "__version__"]
__all__ += ["FPS", "farthest_point_sample"]
__all__ += ["BallQuery", "ball_query", "ball_queries"]
__all__ += ["PaddedEdges", "knn_graph", "radius_graph"]
__all__ += ["knn_interpolate"]
__all__ += ["chamfer_distance"]
__all__ += ["estimate_normals"]
__all__ += ["VoxelPool", "VoxelPoolPadded", "voxel_pool"]
__all__ += ["GridSample", "GridSamplePadded", "grid_sample"]
__all__ += ["KernelMap", "SparseConv3d", "sparse_conv3d", "sparse_kernel_map"]
__all__ += ["Serialization", "serialize"]
__all__ += ["segment_reduce"]
__all__ += ["gather"]
__all__ += ["SerializedPool", "SerializedPoolPadded", "serialized_pool", "serialized_unpool"]
__all__ += ["warp_op"]
__all__ += ["MeshBVH", "MeshDistance", "mesh_bvh", "mesh_distance", "point_mesh_face_distance"]
__all__ += ["MeshSamples", "sample_points_on_mesh"]
__all__ += ["EarthMoversDistance", "SinkhornDivergence", "earth_movers_distance", "sinkhorn_divergence"]
__all__ += ["EMDLoss", "SinkhornLoss"]
