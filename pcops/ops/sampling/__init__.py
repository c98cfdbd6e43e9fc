"""Sampling and pooling ops: farthest point sampling, voxel pooling, grid sampling."""

from .fps import FPS, farthest_point_sample
from .voxel import VoxelPool, VoxelPoolPadded, voxel_pool
from .grid_sample import GridSample, GridSamplePadded, grid_sample

__all__ = ["FPS", "farthest_point_sample", "VoxelPool", "VoxelPoolPadded", "voxel_pool"]
__all__ += ["GridSample", "GridSamplePadded", "grid_sample"]
