"""Mesh ops: distance and signed distance to triangle meshes (``mesh_distance``, ``mesh_bvh``)."""

from .distance import MeshBVH, MeshDistance, mesh_bvh, mesh_distance
from .loss import point_mesh_face_distance
from .sample import MeshSamples, sample_points_on_mesh

__all__ = ["MeshBVH", "MeshDistance", "mesh_bvh", "mesh_distance"]
__all__ += ["MeshSamples", "sample_points_on_mesh"]
__all__ += ["point_mesh_face_distance"]
