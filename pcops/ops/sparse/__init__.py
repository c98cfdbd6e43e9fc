"""Ops over integer voxel sites: serialization and serialized pooling, segment reductions, sparse convolution."""

from .serialize import Serialization, serialize
from .serialize import SerializedPool, SerializedPoolPadded, serialized_pool, serialized_unpool
from .segment import segment_reduce
from .sparse_conv import KernelMap, sparse_conv3d, sparse_kernel_map

__all__ = ["Serialization", "serialize", "SerializedPool", "SerializedPoolPadded", "serialized_pool"]
__all__ += ["serialized_unpool", "segment_reduce", "KernelMap", "sparse_conv3d", "sparse_kernel_map"]
