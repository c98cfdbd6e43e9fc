"""Geometry ops over point clouds: Chamfer distance, normal estimation."""

from .chamfer import chamfer_distance
from .normals import estimate_normals

__all__ = ["chamfer_distance", "estimate_normals"]
