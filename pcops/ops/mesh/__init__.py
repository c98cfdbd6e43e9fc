"""Mesh ops: distance and signed distance to triangle meshes (``mesh_distance``, ``mesh_bvh``), the
point-to-face loss, sampling points on meshes, and meshes from grids of values (``marching_cubes``)."""

from .distance import MeshBVH, MeshDistance, mesh_bvh, mesh_distance
from .marching_cubes import MarchingCubes, MarchingCubesPadded, marching_cubes
from .loss import point_mesh_face_distance
from .sample import MeshSamples, sample_points_on_mesh

__all__ = ["MeshBVH", "MeshDistance", "mesh_bvh", "mesh_distance"]
__all__ += ["MeshSamples", "sample_points_on_mesh"]
__all__ += ["point_mesh_face_distance"]
__all__ += ["MarchingCubes", "MarchingCubesPadded", "marching_cubes"]
