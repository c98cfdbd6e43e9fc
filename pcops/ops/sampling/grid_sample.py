"""Grid sampling: voxel downsampling that keeps one point per occupied voxel (Pointcept's
``GridSample``, PyG's ``voxel_grid``), with each voxel's integer grid coordinates and each
input point's voxel.

Voxel of point p (per sample): ``cell(p) = floor((p - origin) / voxel_size)`` computed in
float64. With ``origin=None`` cells are aligned to the world origin and the returned grid
coordinates are shifted so that each sample's smallest cell is 0 on every axis, exactly as
Pointcept's ``GridSample`` computes ``grid_coord = floor(coord / grid_size) - min(...)`` (its
``grid_size`` is ``voxel_size`` here, as in :func:`pcops.voxel_pool`; the old keyword
``grid_size=`` still works for one release, with a ``FutureWarning``).
With an explicit ``origin`` the cells are aligned to it and the coordinates are not shifted
(they may be negative).

Occupied voxels are numbered in lexicographic order of (sample, x, y, z): deterministic, a
sample's voxels contiguous, the same order as :func:`pcops.voxel_pool`. For voxel c with points
``P_c`` (ascending indices):

    mode="first":  index[c] = min P_c                     points[c] = p[index[c]]
    mode="random": index[c] = a uniform draw from P_c     points[c] = p[index[c]]
    mode="mean":   index is None                          points[c] = mean_{i in P_c} p_i
    grid_coord[c] = the grid coordinates of voxel c;  inverse[i] = c for i in P_c

The custom op ``pcops::grid_cluster`` assigns the voxels (integer outputs only; the number of
voxels depends on the data and is declared in its fake as a dynamic size) with the voxel
assignment of ``pcops.ops.sampling._voxels`` that :func:`pcops.voxel_pool` uses too. The kept points
are gathered (or averaged) in torch, so gradients flow to ``points`` and
``torch.compile(fullgraph=True)`` traces the whole function.

Bounded form (``max_voxels=M``): the op's ``size`` argument is M and its fake sizes follow
from the input shapes and M alone (no dynamic size), so default ``torch.compile`` (no
fullgraph) keeps the whole function in one graph. The result has exactly M voxel rows: the
first min(V, M) voxels in the usual order, then padding (zero points, -1 grid_coord / index /
batch); ``count`` is the true V. On overflow (V > M) the voxels past the first M are dropped
and ``inverse`` is -1 for their points (no host read, no error, no warning).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from ... import _layout, _deprecated, _threads, _validate
from .. import _bound
from . import _voxels

_MODES = ("first", "random", "mean")


class GridSample(NamedTuple):
    """Result of :func:`grid_sample`, always packed (voxels of all samples, by (sample, x, y, z)).

    ``points`` (V, 3): the kept point (or mean) of each voxel; ``grid_coord`` (V, 3) int64: the
    voxel's grid coordinates (``coords``, the former name, warns until the next release); ``index`` (V,) int64: the kept point's row (None for "mean");
    ``inverse``: each input point's voxel, (N,) for packed input, (B, N) for padded input
    (-1 at padding rows); ``batch`` (V,) int64: each voxel's sample.
    """

    points: torch.Tensor
    grid_coord: torch.Tensor
    index: Optional[torch.Tensor]
    inverse: torch.Tensor
    batch: torch.Tensor

    coords = _deprecated.field("coords", "grid_coord", "GridSample")


class GridSamplePadded(NamedTuple):
    """Result of :func:`grid_sample` with ``max_voxels=M``: GridSample's fields with exactly M
    voxel rows (the first min(count, M) are the voxels, the rest padding: ``points`` 0,
    ``grid_coord``, ``index`` and ``batch`` -1), ``inverse`` -1 for a point whose voxel was dropped
    (overflow), and ``count`` 0-dim int64, the true number of voxels V (may exceed M)."""

    points: torch.Tensor
    grid_coord: torch.Tensor
    index: Optional[torch.Tensor]
    inverse: torch.Tensor
    batch: torch.Tensor
    count: torch.Tensor

    coords = _deprecated.field("coords", "grid_coord", "GridSamplePadded")


@_threads.custom_op("pcops::grid_cluster", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _grid_cluster(
    points: torch.Tensor,
    voxel_size: float,
    origin: Optional[torch.Tensor],
    batch: Optional[torch.Tensor],
    validate: bool,
    size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """points (N, 3), batch (N,) int64 sample ids (< 0: a row in no voxel) ->
    (inverse (N,), order (N,), coords (V, 3), voxel batch (V,), counts (V,), V as a 0-dim), all int64.

    ``order`` lists the points of voxel 0, then of voxel 1, ..., each voxel's by ascending index
    (rows in no voxel last), so voxel c's points are ``order[start_c : start_c + counts[c]]``.
    ``size`` >= 0: exactly ``size`` voxel rows (the first min(V, size), then coords / batch -1
    and counts 0), inverse -1 for the points of the dropped voxels; -1: V rows (data-dependent).
    """
    return _cut(*_voxels.assign(points, voxel_size, origin, batch, validate, name="voxel_size", shift=origin is None), size)


def _cut(inverse, order, coords, voxel_batch, counts, size: int):
    """The op's outputs cut or padded to ``size`` voxel rows, with the number of voxels V."""
    v = counts.shape[0]
    count = _bound.count(v, counts)
    if size < 0:
        return inverse, order, coords, voxel_batch, counts, count
    fit = _bound.fit
    return _bound.drop(inverse, v, size), order, fit(coords, size, -1), fit(voxel_batch, size, -1), fit(counts, size, 0), count


@_grid_cluster.register_fake
def _(points, voxel_size, origin, batch, validate, size=-1):
    v = torch.library.get_ctx().new_dynamic_size() if size < 0 else size
    n = points.shape[0]
    like = points.new_empty((0,), dtype=torch.int64)
    return (like.new_empty((n,)), like.new_empty((n,)), like.new_empty((v, 3)), like.new_empty((v,)), like.new_empty((v,)),
            like.new_empty(()))


def _lay_out(points, lengths, batch, origin, validate: bool):
    """The layout of :func:`grid_sample` through the layout layer (pcops._layout.single, which
    also checks that a tensor ``origin`` is finite, in the same host read): flat points (P, 3),
    int64 sample ids (P,) or None (< 0 for padding rows), the padded shape (B, N) or None, and
    whether the op checks values itself (``Flat.validate``)."""
    flat = _layout.single(points, lengths=lengths, batch=batch, validate=validate, finite={"origin": origin}, flatten=False)
    if points.dim() == 3:
        b, n = points.shape[0], points.shape[1]
        ids = torch.arange(b, device=points.device)[:, None].expand(b, n)
        if lengths is not None:
            ids = torch.where(torch.arange(n, device=points.device)[None, :] < lengths[:, None].to(torch.int64), ids, -1)
        return points.reshape(b * n, 3), ids.reshape(-1), (b, n), flat.validate
    return points, batch, None, flat.validate


def _origin(origin, points: torch.Tensor):
    """``origin`` (None, a number, 3 numbers or a (3,) tensor) as a float64 (3,) tensor or None.
    Numbers must be finite (free to check: always, as ``voxel_size``); a tensor's values are checked
    with the points' (``validate``)."""
    return None if origin is None else _validate.origin(origin, "points", points)


@_deprecated.renamed(grid_size="voxel_size")
@_threads.limits
def grid_sample(
    points: torch.Tensor,
    voxel_size: float,
    *,
    lengths: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
    mode: str = "first",
    generator: Optional[torch.Generator] = None,
    origin=None,
    validate: bool = True,
    max_voxels: Optional[int] = None,
) -> Union[GridSample, GridSamplePadded]:
    """Keep one point per occupied voxel of a grid of cubes of side ``voxel_size``.

    Args:
        points: Tensor of shape (N, 3) (one cloud, or packed with ``batch``) or (B, N, 3)
            (padded, with optional ``lengths``).
        voxel_size: Python number > 0, the side of the cubic voxels (named as in
            :func:`pcops.voxel_pool`; ``grid_size``, its former name, is accepted with a
            ``FutureWarning`` until the next release).
        lengths: optional int tensor (B,): real rows of each padded sample (the rest is padding).
        batch: optional int tensor (N,) of sample ids >= 0 (sorted or not) of packed points.
        mode: "first" (the voxel's point of smallest index), "random" (a uniform draw among the
            voxel's points, from ``generator`` or torch's global generator) or "mean".
        generator: optional ``torch.Generator`` for "random" (``torch.compile`` cannot trace a
            generator argument: under compile leave it None and seed with ``torch.manual_seed``).
        origin: None (cells aligned to the world origin, coordinates shifted to start at 0 per
            sample, as Pointcept's GridSample) or a finite number / 3 numbers / (3,) tensor:
            cells ``floor((p - origin) / voxel_size)``, not shifted.
        validate: check points and a tensor ``origin`` for NaN/inf and ids / lengths for range.
        max_voxels: optional int M >= 1, an upper bound on the number of voxels (of all samples
            together): the result has exactly M voxel rows (static shapes, so ``torch.compile``
            needs no graph break or dynamic size) and a ``count``. None: V rows.

    Returns:
        GridSample(points, grid_coord, index, inverse, batch), packed over all samples, voxels in
        lexicographic order of (sample, x, y, z): ``points`` (V, 3) in the input dtype;
        ``grid_coord`` (V, 3) int64; ``index`` (V,) int64 (None for "mean"): the kept point's row
        (in ``points`` for packed input, within its sample for padded input); ``inverse`` (N,)
        or (B, N) int64 (-1 at padding); ``batch`` (V,) int64 sample ids. V depends on the data
        (a dynamic size under ``torch.compile``). Differentiable with respect to ``points``.

        With ``max_voxels=M``: GridSamplePadded(points, grid_coord, index, inverse, batch, count),
        the voxel rows (M, ...): the first min(V, M) are those of the unbounded call, the rest
        padding (``points`` 0; ``grid_coord``, ``index``, ``batch`` -1); ``count`` a 0-dim int64
        tensor, the true V (not capped). If V > M the voxels after the first M (in the order
        above) are dropped and ``inverse`` is -1 for their points.

    Example:
        >>> import torch, pcops
        >>> points = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.1, 0.1], [1.5, 0.1, 0.1]])
        >>> out = pcops.grid_sample(points, voxel_size=1.0)  # the first point of each voxel
        >>> out.index
        tensor([0, 2])
        >>> out.grid_coord
        tensor([[0, 0, 0],
                [1, 0, 0]])
    """
    voxel_size = _validate.plain(voxel_size)
    _validate.positive_number("voxel_size", voxel_size)
    _validate.one_of("mode", mode, _MODES)
    if generator is not None:
        _validate.instance("generator", generator, torch.Generator, "torch.Generator")
    bound = _bound.bound("max_voxels", max_voxels)
    _validate.tensor("points", points)
    origin_t = _origin(origin, points)
    flat, ids, padded, check = _lay_out(points, lengths, batch, origin_t, validate)
    inverse, order, coords, voxel_batch, counts, count = _grid_cluster(
        flat.detach(), float(voxel_size), origin_t, ids, check, -1 if bound is None else bound
    )
    # bounded: padding rows are the voxel rows with no points (every voxel has one)
    real = None if bound is None else counts > 0
    index = None
    if mode == "mean":
        dtype, out_dtype = _validate.compute_dtype(flat)
        p = flat.to(dtype)
        rows = inverse.clamp_min(0)
        live = inverse >= 0
        total = p.new_zeros((counts.shape[0], 3)).index_add(0, rows, torch.where(live[:, None], p, 0))
        out = (total / (counts if real is None else counts.clamp_min(1)).to(dtype)[:, None]).to(out_dtype)
    else:
        starts = torch.cumsum(counts, 0) - counts
        if real is not None:  # a padding row's start may be N: read from one extra row, masked below
            order = torch.cat([order, order.new_zeros((1,))])
        if mode == "random":
            # N draws, one read per voxel (at its first sorted row): torch.compile cannot make a
            # random tensor of the data-dependent size V
            # (and the generator overload of torch.rand needs concrete sizes: not passed when None)
            draw = {} if generator is None else {"generator": generator}
            u = torch.rand(flat.shape[0], dtype=torch.float64, device=flat.device, **draw)
            if real is not None:
                u = torch.cat([u, u.new_zeros((1,))])
            u = u.index_select(0, starts)
            last = counts - 1 if real is None else (counts - 1).clamp_min(0)
            starts = starts + torch.minimum((u * counts).to(torch.int64), last)
        index = order.index_select(0, starts)
        if real is None:
            out = flat.index_select(0, index)
        else:
            out = _bound.rows(flat, index, real)
        if padded is not None:
            index = index - voxel_batch * padded[1]
        if real is not None:
            index = torch.where(real, index, -1)
    if padded is not None:
        inverse = inverse.reshape(padded)
    if bound is None:
        return GridSample(out, coords, index, inverse, voxel_batch)
    return GridSamplePadded(out, coords, index, inverse, voxel_batch, count)


__all__ = ["GridSample", "GridSamplePadded", "grid_sample"]
