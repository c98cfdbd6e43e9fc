"""Voxel pooling: one point per occupied voxel of a regular grid, with pooled features.

Voxel v(p) = floor(p / voxel_size), computed in float64 whatever the points' dtype (cells
[k s, (k + 1) s) per axis, aligned to the origin), per sample. Occupied voxels are numbered in
lexicographic order of (sample, x, y, z), so the result is deterministic and a sample's voxels
are contiguous. For voxel c with point set P_c:

    points_out[c]   = mean_{i in P_c} p_i
    features_out[c] = mean_{i in P_c} f_i      (reduce="mean")   or   max_{i in P_c} f_i   (reduce="max")
    cluster[i]      = c, the voxel of input point i

The custom op ``pcops::voxel_cluster`` assigns the voxels (it returns indices only; the
number of voxels depends on the data and is declared in its fake as a dynamic size) with the
voxel assignment of ``pcops.ops.sampling._voxels`` that :func:`pcops.grid_sample` uses too, so
both ops put every point in the same voxel. The pooling is torch ``index_add`` /
``scatter_reduce`` on those indices, so gradients flow to the points and the features, and
``torch.compile(fullgraph=True)`` traces the whole op.

Bounded form (``max_voxels=M``): the op's ``size`` argument is M, its fake sizes follow from
the input shapes and M alone (no dynamic size), so default ``torch.compile`` (no fullgraph)
keeps the whole function in one graph. The result has exactly M rows: the first
min(V, M) voxels in the usual order, then padding (zero points and features); ``count`` is the
true V. On overflow (V > M) the voxels past the first M are dropped and their points' cluster
is -1 (no host read, no error, no warning).
"""

from typing import NamedTuple, Optional, Union

import torch

from ... import _layout, _threads, _validate
from .. import _bound
from . import _voxels


class VoxelPool(NamedTuple):
    """Result of :func:`voxel_pool`: ``points`` (V, 3), ``features`` (V, F) or None, ``cluster`` (N,) int64."""

    points: torch.Tensor
    features: Optional[torch.Tensor]
    cluster: torch.Tensor


class VoxelPoolPadded(NamedTuple):
    """Result of :func:`voxel_pool` with ``max_voxels=M``: ``points`` (M, 3) and ``features``
    (M, F) or None, zero past the first min(count, M) rows; ``cluster`` (N,) int64, -1 for a
    point whose voxel was dropped (overflow); ``count`` 0-dim int64, the true number of voxels V
    (may exceed M)."""

    points: torch.Tensor
    features: Optional[torch.Tensor]
    cluster: torch.Tensor
    count: torch.Tensor


@_threads.custom_op("pcops::voxel_cluster", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _voxel_cluster(
    points: torch.Tensor, voxel_size: float, batch: Optional[torch.Tensor], validate: bool, size: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """points (N, 3) -> (cluster (N,) int64, sample id of each voxel (V,) int64, V as a 0-dim int64).

    ``size`` >= 0: the voxel rows are exactly ``size`` (the first min(V, size) voxels, then -1)
    and points of the voxels past ``size`` get cluster -1; ``size`` = -1: V rows (data-dependent).
    """
    cluster, _, _, voxel_batch, _ = _voxels.assign(points, voxel_size, None, batch, validate, name="voxel_size", shift=False, coords=False)
    return _bounded(cluster, voxel_batch, size)


def _bounded(cluster: torch.Tensor, voxel_batch: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cluster, voxel_batch, V) cut or padded to ``size`` voxel rows (-1 padding; cluster -1
    for the points of dropped voxels); unchanged for size < 0."""
    v = voxel_batch.shape[0]
    count = _bound.count(v, cluster)
    if size < 0:
        return cluster, voxel_batch, count
    return _bound.drop(cluster, v, size), _bound.fit(voxel_batch, size, -1), count


@_voxel_cluster.register_fake
def _(points, voxel_size, batch, validate, size=-1):
    v = torch.library.get_ctx().new_dynamic_size() if size < 0 else size
    like = points.new_empty((0,), dtype=torch.int64)
    return like.new_empty((points.shape[0],)), like.new_empty((v,)), like.new_empty(())


@_threads.limits
def voxel_pool(
    points: torch.Tensor,
    voxel_size: float,
    features: Optional[torch.Tensor] = None,
    *,
    batch: Optional[torch.Tensor] = None,
    reduce: str = "mean",
    validate: bool = True,
    max_voxels: Optional[int] = None,
) -> Union[VoxelPool, VoxelPoolPadded]:
    """Pool points (and features) into the occupied voxels of a grid of cubes of side ``voxel_size``.

    Args:
        points: Tensor of shape (N, 3).
        voxel_size: Python number > 0, the side of the cubic voxels (aligned to the origin).
        features: optional Tensor of shape (N, F).
        batch: optional int tensor (N,) of sample ids (sorted or not): samples never share a voxel.
        reduce: "mean" or "max", how features are pooled (points are always averaged).
        validate: check the points for NaN/inf and the ids for range.
        max_voxels: optional int M >= 1, an upper bound on the number of voxels: the result
            has exactly M rows (static shapes, so ``torch.compile`` needs no graph break or
            dynamic size) and a ``count``. None: V rows (a data-dependent size).

    Returns:
        VoxelPool(points, features, cluster): ``points`` (V, 3), the mean of each occupied
        voxel's points; ``features`` (V, F) pooled (None without features); ``cluster`` (N,)
        int64, each input point's voxel. Voxels are ordered by (sample, x, y, z), so a
        sample's voxels are contiguous and the sample of voxel c is ``batch[cluster == c]``
        (e.g. ``torch.zeros(V, dtype=torch.long).scatter_(0, cluster, batch)``). V depends on
        the data (declared as a dynamic size under ``torch.compile``). Differentiable with
        respect to ``points`` and ``features`` (for "max", the gradient goes to the maximum,
        split evenly between tied maxima as ``scatter_reduce`` does).

        With ``max_voxels=M``: VoxelPoolPadded(points, features, cluster, count), ``points``
        (M, 3) and ``features`` (M, F): the first min(V, M) rows are those of the unbounded
        call, the rest zeros; ``count`` a 0-dim int64 tensor, the true V (not capped). If
        V > M the voxels after the first M (in the order above) are dropped and ``cluster`` is
        -1 for their points.

    Example:
        >>> import torch, pcops
        >>> points = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.1, 0.1], [1.5, 0.1, 0.1]])
        >>> out = pcops.voxel_pool(points, voxel_size=1.0)  # the mean of each voxel's points
        >>> out.points
        tensor([[0.2000, 0.1000, 0.1000],
                [1.5000, 0.1000, 0.1000]])
        >>> out.cluster
        tensor([0, 0, 1])
    """
    voxel_size = _validate.plain(voxel_size)  # NumPy scalars as Python numbers
    _validate.points("points", points)
    _validate.positive_number("voxel_size", voxel_size)
    _validate.one_of("reduce", reduce, ("mean", "max"))
    bound = _bound.bound("max_voxels", max_voxels)
    flat = _layout.single(points, features, batch=batch, validate=validate)
    dtype, out_dtype = _validate.compute_dtype(points)
    pts = points.to(dtype)
    size = -1 if bound is None else bound
    # the points as given: the op computes the cells in float64
    cluster, voxel_batch, count = _voxel_cluster(points.detach(), float(voxel_size), batch, flat.validate, size)
    if bound is None:
        v, rows = voxel_batch.shape[0], cluster
    else:  # the points of dropped voxels pool into one spare row past the bound, cut off below
        v, rows = bound + 1, torch.where(cluster >= 0, cluster, bound)
    counts = pts.new_zeros((v,)).index_add(0, rows, pts.new_ones((pts.shape[0],)))
    if bound is not None:
        counts = counts.clamp_min(1)  # empty padding rows: 0 / 1
    pooled = (pts.new_zeros((v, 3)).index_add(0, rows, pts) / counts[:, None]).to(out_dtype)
    pooled_features = None
    if features is not None:
        fdtype, f_out = _validate.compute_dtype(features)
        f = features.to(fdtype)
        if reduce == "mean":
            pooled_features = f.new_zeros((v, f.shape[1])).index_add(0, rows, f) / counts.to(fdtype)[:, None]
        else:
            index = rows[:, None].expand(-1, f.shape[1])
            pooled_features = f.new_zeros((v, f.shape[1])).scatter_reduce(0, index, f, "amax", include_self=False)
        pooled_features = pooled_features.to(f_out)
    if bound is None:
        return VoxelPool(pooled, pooled_features, cluster)
    return VoxelPoolPadded(pooled[:bound], None if pooled_features is None else pooled_features[:bound], cluster, count)


__all__ = ["VoxelPool", "VoxelPoolPadded", "voxel_pool"]
