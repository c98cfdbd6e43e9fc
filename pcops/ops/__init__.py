"""pcops ops, grouped by family; each module holds one op (Warp kernels, custom op, fake, autograd, public function).

- ``neighbours``: kNN search and aggregation, ball query, radius aggregation, graphs, interpolation, gather
- ``sampling``: farthest point sampling, voxel pooling, grid sampling
- ``geometry``: Chamfer distance, normal estimation
- ``sparse``: serialization, segment reductions, sparse convolution
- ``mesh``: distance and signed distance to triangle meshes
- ``transport``: the Sinkhorn divergence and the exact earth mover's distance

``_bound`` (the padded static-size forms' shared pieces) serves several families.
"""

from .neighbours import KNN, knn, knn_aggregate
from .neighbours import knn_interpolate
from .geometry import chamfer_distance
from .geometry import estimate_normals
from .neighbours import radius_aggregate
from .sampling import FPS, farthest_point_sample
from .neighbours import BallQuery, ball_queries, ball_query
from .neighbours import PaddedEdges, knn_graph, radius_graph
from .sampling import VoxelPool, VoxelPoolPadded, voxel_pool
from .sampling import GridSample, GridSamplePadded, grid_sample
from .sparse import KernelMap, sparse_conv3d, sparse_kernel_map
from .sparse import Serialization, serialize
from .sparse import SerializedPool, SerializedPoolPadded, serialized_pool, serialized_unpool
from .sparse import segment_reduce
from .neighbours import gather
from .mesh import MeshBVH, MeshDistance, mesh_bvh, mesh_distance, point_mesh_face_distance
from .mesh import MeshSamples, sample_points_on_mesh
from .transport import EarthMoversDistance, SinkhornDivergence, earth_movers_distance, sinkhorn_divergence

__all__ = ["KNN", "knn", "knn_aggregate", "radius_aggregate"]
__all__ += ["FPS", "farthest_point_sample"]
__all__ += ["BallQuery", "ball_query", "ball_queries"]
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
__all__ += ["MeshBVH", "MeshDistance", "mesh_bvh", "mesh_distance", "point_mesh_face_distance"]
__all__ += ["MeshSamples", "sample_points_on_mesh"]
__all__ += ["EarthMoversDistance", "SinkhornDivergence", "earth_movers_distance", "sinkhorn_divergence"]
