"""Serialization of integer grid coordinates along space-filling curves (Point Transformer V3).

Codes are Pointcept's ``encode`` codes for the same grid coordinates (x, y, z), each in
[0, 2**depth):

* ``"z"``: the Morton code, bit i of x, y, z at bits 3i+2, 3i+1, 3i;
* ``"hilbert"``: the Hilbert index of Skilling's algorithm ("Programming the Hilbert curve",
  2004): his inverse undo of the transposed index from the top bit down, the three transposed
  words interleaved with x's bit highest in each triple, and the Gray code decoded;
* ``"z-trans"`` / ``"hilbert-trans"``: the same curves with x and y swapped first;
* with a batch, the sample id sits above bit 3*depth: ``code = batch << 3*depth | curve``.

One Warp kernel (a thread per point, all requested curves) computes them on the CPU (all
cores through :func:`pcops._warp.launch`) and CUDA; the sort order (a stable argsort of the
codes) and its inverse are torch. Integer outputs only: nothing to differentiate.

Serialized pooling's custom op ``pcops::serialized_cluster`` numbers the parents; their number
depends on the data (a dynamic size in its fake) unless ``serialized_pool`` is given
``max_clusters=M``: then the op's ``size`` is M, its fake sizes follow from the input shapes and
M alone, and default ``torch.compile`` (no fullgraph) keeps the whole function in one graph.
The result has exactly M parent rows (the first min(V, M) parents in increasing code, then
padding: zero features / coord, -1 codes, order, inverse, grid_coord, batch and head) and the
true V as ``count``; on overflow the parents past the first M are dropped and ``cluster`` is -1
for their points (no host read, no error, no warning).
"""

import functools
from typing import NamedTuple, Optional, Sequence, Union

import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp, _warp_funcs
from ..neighbours.gather import rows_or_zeros as _rows
from .. import _bound
from . import segment as _segment

ORDERS = ("z", "z-trans", "hilbert", "hilbert-trans")
MAX_DEPTH = 16


class SerializedPool(NamedTuple):
    """Result of :func:`serialized_pool` (V parents of N points; None where no input was given)."""

    code: torch.Tensor  # (V,) or (K, V) int64: the parents' codes, code >> 3 * pooling_depth
    order: torch.Tensor  # same shape: stable argsort of the parents' codes
    inverse: torch.Tensor  # same shape: its inverse
    features: Optional[torch.Tensor]  # (V, ...) reduced with ``reduce``
    coord: Optional[torch.Tensor]  # (V, 3) mean of the points' coordinates
    grid_coord: Optional[torch.Tensor]  # (V, 3) grid_coord >> pooling_depth
    batch: Optional[torch.Tensor]  # (V,) sample id of each parent
    cluster: torch.Tensor  # (N,) int64: the parent of each point (Pointcept's pooling_inverse)
    head: torch.Tensor  # (V,) int64: each parent's first point (smallest index)


class SerializedPoolPadded(NamedTuple):
    """Result of :func:`serialized_pool` with ``max_clusters=M``: SerializedPool's fields with
    exactly M parent rows (the first min(count, M) are the parents, the rest padding: zero
    ``features`` / ``coord``, -1 in ``code``, ``order``, ``inverse``, ``grid_coord``, ``batch``,
    ``head``), ``cluster`` -1 for a point whose parent was dropped (overflow), and ``count``
    0-dim int64, the true number of parents V (may exceed M)."""

    code: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    features: Optional[torch.Tensor]
    coord: Optional[torch.Tensor]
    grid_coord: Optional[torch.Tensor]
    batch: Optional[torch.Tensor]
    cluster: torch.Tensor
    head: torch.Tensor
    count: torch.Tensor


class Serialization(NamedTuple):
    """Result of :func:`serialize`: ``code`` (int64), ``order`` = argsort(code) along the points
    (stable), ``inverse`` with ``order[inverse] = arange``; each (N,) for one order, (K, N) for K."""

    code: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor


@_warp.kernels
def _codes_kernel():
    """codes[o, i]: curve ``orders[o]`` of point i, its batch id above bit 3 * depth."""
    spread = _warp_funcs.spread  # the 21 low bits of v moved to bits 0, 3, 6, ... (one Morton axis)

    @wp.kernel(enable_backward=False, module="unique")
    def codes(
        start: int,
        grid: wp.array2d(dtype=wp.int32),
        batch: wp.array(dtype=wp.int64),
        batched: int,
        orders: wp.array(dtype=wp.int32),
        depth: int,
        out: wp.array2d(dtype=wp.int64),
    ):
        i = wp.tid() + start
        high = wp.int64(0)
        if batched != 0:
            high = batch[i] << wp.int64(3 * depth)
        for o in range(orders.shape[0]):
            kind = orders[o]  # 0 z, 1 z-trans, 2 hilbert, 3 hilbert-trans
            a = wp.int64(grid[i, 0])
            b = wp.int64(grid[i, 1])
            c = wp.int64(grid[i, 2])
            if kind == 1 or kind == 3:
                t = a
                a = b
                b = t
            if kind >= 2:
                # Skilling's inverse undo, from the top bit down (bit 0 has nothing below it)
                q = wp.int64(1) << wp.int64(depth - 1)
                while q > wp.int64(1):
                    p = q - wp.int64(1)
                    if (a & q) != wp.int64(0):
                        a = a ^ p
                    if (b & q) != wp.int64(0):
                        a = a ^ p
                    else:
                        t = (a ^ b) & p
                        a = a ^ t
                        b = b ^ t
                    if (c & q) != wp.int64(0):
                        a = a ^ p
                    else:
                        t = (a ^ c) & p
                        a = a ^ t
                        c = c ^ t
                    q = q >> wp.int64(1)
            h = (spread(a) << wp.int64(2)) | (spread(b) << wp.int64(1)) | spread(c)
            if kind >= 2:  # Gray decode: each bit XOR all bits above it
                h = h ^ (h >> wp.int64(1))
                h = h ^ (h >> wp.int64(2))
                h = h ^ (h >> wp.int64(4))
                h = h ^ (h >> wp.int64(8))
                h = h ^ (h >> wp.int64(16))
                h = h ^ (h >> wp.int64(32))
            out[o, i] = high | h

    return codes


def _check_values(grid_coord: torch.Tensor, batch: Optional[torch.Tensor], depth: int) -> None:
    """Coordinates in [0, 2**depth), batch ids >= 0 and below 2**(63 - 3 * depth): one host read."""
    checks = _validate.Checks()
    checks.in_range("grid_coord", grid_coord, 0, 2**depth - 1, lambda: f"in [0, 2**depth) = [0, {2**depth}) for depth={depth}")
    limit = 2 ** (63 - 3 * depth)
    checks.in_range("batch", batch, 0, limit - 1, lambda: f"in [0, 2**(63 - 3*depth)) = [0, {limit}) for depth={depth} (the code is an int64)")
    checks.run()


@_threads.custom_op("pcops::serialize_codes", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _serialize_codes(grid_coord: torch.Tensor, batch: Optional[torch.Tensor], depth: int, orders: list[int], validate: bool = True) -> torch.Tensor:
    """grid_coord (N, 3) int, batch (N,) int or None -> codes (K, N) int64 for the K ``orders`` (indices into ORDERS).
    ``validate``: check the values (unchecked, values out of range give unspecified codes)."""
    if validate:
        _check_values(grid_coord, batch, depth)
    n = grid_coord.shape[0]
    out = torch.empty((len(orders), n), dtype=torch.int64, device=grid_coord.device)
    if n == 0 or not orders:
        return out
    grid = grid_coord.to(torch.int32).contiguous()
    ids = grid.new_zeros((1,), dtype=torch.int64) if batch is None else batch.to(torch.int64).contiguous()
    kinds = _kinds(tuple(orders), grid.device)
    _warp.launch(_codes_kernel(), n, [grid, ids, int(batch is not None), kinds, int(depth), out], like=grid)
    return out


@functools.lru_cache(maxsize=64)
def _kinds(orders: tuple, device: torch.device) -> torch.Tensor:
    """The orders' indices as an int32 tensor on ``device``, made once per (orders, device):
    a copy from the host per call would be a synchronisation on a GPU. Read only."""
    return torch.tensor(orders, dtype=torch.int32, device=device)


@_serialize_codes.register_fake
def _(grid_coord, batch, depth, orders, validate=True):
    return grid_coord.new_empty((len(orders), grid_coord.shape[0]), dtype=torch.int64)


def _sort_rows(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable argsort of each row of (K, N) codes and its inverse, a row at a time (a 1-d sort
    per row is faster on the CPU than one argsort along dim 1 (docs/benchmarks.md, design choices))."""
    positions = torch.arange(code.shape[1], device=code.device)
    orders = [torch.sort(row, stable=True).indices for row in code.unbind(0)]
    inverses = [torch.empty_like(o).scatter_(0, o, positions) for o in orders]
    return torch.stack(orders), torch.stack(inverses)


def _lay_out(grid_coord, batch, depth, order) -> tuple[int, list[int], bool]:
    """Checks of serialize's arguments (shapes, dtypes, names): (depth, order indices, one order given)."""
    _layout.sites(grid_coord, batch)
    single = isinstance(order, str)
    names = [order] if single else order
    if not isinstance(names, (list, tuple)) or not names:
        raise TypeError(f"order must be one of {ORDERS} or a non-empty list/tuple of them, got {order!r}")
    for name in names:
        _validate.one_of("order", name, ORDERS)
    depth = _validate.plain(depth)
    _validate.compile_needs("depth", depth, "depth=None reads it from the data")
    if depth is None:
        top = int(grid_coord.max()) if grid_coord.numel() else 0
        depth = max(1, (max(top, 0) + 1).bit_length())  # (Pointcept's adaptive depth; negative values: the range check names them)
        if depth > MAX_DEPTH:  # (the data's depth: the coordinates are what is out of range)
            raise ValueError(f"grid_coord values must be below 2**{MAX_DEPTH} - 1 = {2**MAX_DEPTH - 1} with depth=None (Pointcept's adaptive "
                             f"depth, the bits of grid_coord.max() + 1, at most {MAX_DEPTH}; depth={MAX_DEPTH} takes values up to "
                             f"{2**MAX_DEPTH - 1}), got max {top}")
    depth = _validate.int_option("depth", depth, 1, MAX_DEPTH, note=" (bits per axis)")
    return depth, [ORDERS.index(name) for name in names], single


@_threads.limits
def serialize(
    grid_coord: torch.Tensor,
    batch: Optional[torch.Tensor] = None,
    depth: Optional[int] = 16,
    order: Union[str, Sequence[str]] = "z",
    validate: bool = True,
) -> Serialization:
    """Codes of integer grid coordinates along space-filling curves, their sort order and its inverse.

    The codes are Pointcept's ``encode(grid_coord, batch, depth, order)``; several orders give
    Pointcept's ``Point.serialization`` (``serialized_code``, ``serialized_order``,
    ``serialized_inverse``).

    Args:
        grid_coord: integer Tensor of shape (N, 3), each value in [0, 2**depth).
        batch: optional integer Tensor of shape (N,), sample ids >= 0 (sorted or not), placed
            above bit 3 * depth of the code (so a sample's points sort together).
        depth: bits per axis, 1 .. 16 (Pointcept's limit). None: Pointcept's adaptive depth,
            the bits of ``grid_coord.max() + 1`` (one more than the largest coordinate needs
            where that one is 2**d - 1: Pointcept's rule, kept for the same codes; eager only).
        order: "z", "z-trans", "hilbert", "hilbert-trans", or a list/tuple of them.
        validate: check the values of ``grid_coord`` and ``batch`` (one pass; in the op, so
            also under ``torch.compile``). Unchecked, values out of range give unspecified codes.

    Returns:
        Serialization(code, order, inverse), int64: ``code`` the codes, ``order`` the stable
        argsort of the codes (points of equal code keep their input order), ``inverse`` its
        inverse permutation. Each is (N,) for one order and (K, N) for a list of K orders.

    Raises ValueError/TypeError naming the argument: a non-integer or non-(N, 3) ``grid_coord``,
    a coordinate outside [0, 2**depth), a negative batch id or one too large for the code to
    fit in 63 bits (batch < 2**(63 - 3*depth)), a depth outside [1, 16], an unknown order.

    Example:
        >>> import torch, pcops
        >>> grid_coord = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0]])
        >>> out = pcops.serialize(grid_coord, depth=1, order="z")
        >>> out.code  # the Morton code, x highest
        tensor([7, 0, 4])
        >>> out.order
        tensor([1, 2, 0])
    """
    depth, kinds, single = _lay_out(grid_coord, batch, depth, order)
    code = _serialize_codes(grid_coord, batch, depth, kinds, bool(validate))
    order_, inverse = _sort_rows(code)
    if single:
        return Serialization(code[0], order_[0], inverse[0])
    return Serialization(code, order_, inverse)


@_threads.custom_op("pcops::serialized_cluster", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _serialized_cluster(code: torch.Tensor, shift: int, size: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """code (N,) int64 -> points sharing code >> shift: (cluster (N,), points sorted by parent (N,),
    a CSR pointer of the parents over them (V + 1,), V as a 0-dim int64); parents in increasing
    code, points of a parent in increasing index.

    ``size`` >= 0: exactly ``size`` parents (the first min(V, size); the pointer then stays at the
    end of the kept parents' points: empty padding parents), cluster -1 for the points of the
    dropped parents; -1: V parents (data-dependent).
    """
    key = code >> shift
    key, indices = torch.sort(key, stable=True)
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    cluster = torch.empty_like(indices)
    cluster[indices] = torch.cumsum(first, 0) - 1
    starts = torch.nonzero(first)[:, 0]
    v, n = starts.shape[0], indices.shape[0]
    count = _bound.count(v, code)
    if size < 0:
        return cluster, indices, torch.cat([starts, starts.new_full((1,), n)]), count
    cluster = _bound.drop(cluster, v, size)
    end = int(starts[size]) if v > size else n  # the kept parents' points end here
    return cluster, indices, _bound.fit(starts, size + 1, end), count  # (starts[size] is that end)


@_serialized_cluster.register_fake
def _(code, shift, size=-1):
    # the pointer's length V + 1 is the dynamic size itself (an unbacked size must be bare)
    pointer = torch.library.get_ctx().new_dynamic_size(min=1) if size < 0 else size + 1
    n = code.shape[0]
    return code.new_empty((n,)), code.new_empty((n,)), code.new_empty((pointer,)), code.new_empty(())


def _pool_layout(code, pooling_depth, features, coord, grid_coord, batch, reduce) -> int:
    """Checks of serialized_pool's arguments (shapes, dtypes, names); the number of points N."""
    shape_doc = "(N,) or (K, N) with K >= 1"
    _validate.integer("code", code, ndim=(1, 2), shape_doc=shape_doc, what="serialize's codes", dtype=torch.int64)
    if code.dim() == 2 and code.shape[0] == 0:
        raise ValueError(f"code must be a tensor of shape {shape_doc}, got shape {tuple(code.shape)}")
    n = code.shape[-1]
    _validate.int_option("pooling_depth", _validate.plain(pooling_depth), 0, MAX_DEPTH)
    _validate.one_of("reduce", reduce, _segment.REDUCTIONS)
    if features is not None:
        _validate.tensor("features", features, ndim=_validate.ROWS, shape_doc="(N, ...)")
        _validate.same_size("features", features.shape[0], "code", n, "number of points N")
    if coord is not None:
        _validate.tensor("coord", coord, ndim=2, last=3, shape_doc="(N, 3)")
        _validate.same_size("coord", coord.shape[0], "code", n, "number of points N")
    if grid_coord is not None:
        _layout.sites(grid_coord, batch, size=n)
    _validate.ids("batch", batch, n, "(N,)")
    _validate.same_device(code=code, features=features, coord=coord, grid_coord=grid_coord, batch=batch)
    return n


@_threads.limits
def serialized_pool(
    code: torch.Tensor,
    pooling_depth: int = 1,
    features: Optional[torch.Tensor] = None,
    coord: Optional[torch.Tensor] = None,
    grid_coord: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
    reduce: str = "max",
    *,
    max_clusters: Optional[int] = None,
    validate: bool = True,
) -> Union[SerializedPool, SerializedPoolPadded]:
    """Point Transformer V3's serialized pooling (Pointcept's ``SerializedPooling``, without its
    linear projection, norm and activation): points whose codes agree above bit
    3 * pooling_depth (the same cell of a grid 2**pooling_depth times coarser, same sample)
    become one parent point.

    Args:
        code: int64 Tensor of shape (N,) or (K, N): :func:`serialize`'s codes (batch in the high
            bits). Parents are the distinct values of ``code[0] >> 3 * pooling_depth``.
        pooling_depth: k >= 0 (Pointcept's stride 2**k; 1 halves the grid), at most the depth
            of :func:`serialize` that gave ``code`` (deeper, parents join samples: a ValueError
            where ``batch`` is given and ``validate``).
        features: optional Tensor (N, ...), reduced per parent with ``reduce``.
        coord: optional Tensor (N, 3) of point coordinates, averaged per parent.
        grid_coord: optional integer Tensor (N, 3), returned as ``grid_coord >> k`` per parent.
        batch: optional integer Tensor (N,) of sample ids, returned per parent.
        reduce: "max" (PTv3's default), "mean", "sum" or "min" for the features.
        max_clusters: optional int M >= 1, an upper bound on the number of parents: the result
            has exactly M parent rows (static shapes, so ``torch.compile`` needs no graph break
            or dynamic size) and a ``count``. None: V rows.
        validate: check ``features`` and ``coord`` for NaN/inf, and with ``batch`` that no parent
            joins samples (a host read each, eagerly only).

    Returns:
        SerializedPool(code, order, inverse, features, coord, grid_coord, batch, cluster, head):
        parents numbered 0 .. V-1 in increasing parent code (order 0), so the parents of a
        sample are contiguous; ``code`` the parents' codes of every order (code >> 3k: the
        codes :func:`serialize` gives ``grid_coord >> k`` at depth - k), ``order``/``inverse``
        their stable argsort and its inverse; ``cluster`` (N,) the parent of each point, for
        :func:`serialized_unpool`; ``head`` (V,) each parent's first point, to carry any other
        per-point attribute (``x[head]``). V depends on the data (a dynamic size under
        ``torch.compile``). Differentiable with respect to ``features`` and ``coord`` (max/min:
        the gradient goes to the first arg-extremum, see :func:`pcops.segment_reduce`).

        With ``max_clusters=M``: SerializedPoolPadded(..., head, count), the parent rows (M, ...)
        or (K, M): the first min(V, M) are those of the unbounded call, the rest padding (zero
        ``features`` / ``coord``; -1 in ``code``, ``order``, ``inverse``, ``grid_coord``,
        ``batch``, ``head``); ``count`` a 0-dim int64 tensor, the true V (not capped). If V > M
        the parents after the first M (in increasing code) are dropped and ``cluster`` is -1
        for their points (``serialized_unpool`` needs cluster >= 0: mask them first).

    Example:
        >>> import torch, pcops
        >>> code = pcops.serialize(torch.tensor([[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3]]), depth=2).code
        >>> out = pcops.serialized_pool(code, pooling_depth=1, features=torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
        >>> out.features  # the max of each 2x2x2 parent's points
        tensor([[2.],
                [4.]])
        >>> out.cluster
        tensor([0, 0, 1, 1])
    """
    _pool_layout(code, pooling_depth, features, coord, grid_coord, batch, reduce)
    checks = _validate.checks(validate)  # (run once the parents are known: one host read)
    if checks is not None:
        checks.finite("features", features)
        checks.finite("coord", coord)
    bound = _bound.bound("max_clusters", max_clusters)
    codes = code if code.dim() == 2 else code[None]
    shift = 3 * pooling_depth
    cluster, indices, offsets, count = _serialized_cluster(codes[0].contiguous(), shift, -1 if bound is None else bound)
    # bounded: padding parents are the empty segments of the pointer (every parent has a point)
    real = None if bound is None else offsets[1:] > offsets[:-1]
    head = _bound.rows(indices, offsets[:-1], real, -1)
    parent = (codes.index_select(1, head) if real is None else _bound.rows(codes.t(), head, real, -1).t()) >> shift
    if real is None:
        order, inverse = _sort_rows(parent)
    else:  # padding sorts last, then reads -1
        order, inverse = _sort_rows(torch.where(real, parent, torch.iinfo(torch.int64).max))
        order, inverse = torch.where(real, order, -1), torch.where(real, inverse, -1)
    if code.dim() == 1:
        parent, order, inverse = parent[0], order[0], inverse[0]
    position = None
    if features is not None or coord is not None:
        position = torch.empty_like(indices).scatter_(0, indices, torch.arange(indices.shape[0], device=indices.device))
    pooled = None if features is None else _segment.reduce_sorted(features, offsets, reduce, indices, position, name="serialized_pool")
    mean = None if coord is None else _segment.reduce_sorted(coord, offsets, "mean", indices, position, name="serialized_pool")
    coarse = None if grid_coord is None else _bound.rows(grid_coord, head, real, -1) >> pooling_depth
    parent_batch = None if batch is None else _bound.rows(batch, head, real, -1)
    if checks is not None:
        if batch is not None and cluster.numel():  # parents of one sample each: pooling_depth within serialize's depth
            mine = parent_batch.index_select(0, cluster.clamp_min(0))
            checks.add(((mine == batch) | (cluster < 0)).all(), lambda: (
                f"pooling_depth={pooling_depth} joins points of different samples in one parent: the codes were serialized at a depth "
                "below it (the sample id lies above bit 3 * depth of serialize's codes); pass pooling_depth <= that depth"))
        checks.run()
    if bound is None:
        return SerializedPool(parent, order, inverse, pooled, mean, coarse, parent_batch, cluster, head)
    return SerializedPoolPadded(parent, order, inverse, pooled, mean, coarse, parent_batch, cluster, head, count)


@_threads.limits
def serialized_unpool(features: torch.Tensor, cluster: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Parents' features back to their points (Pointcept's ``SerializedUnpooling`` gather,
    ``point.feat[inverse]``): ``features[cluster]``.

    Args:
        features: Tensor (V, ...) of the parents (e.g. ``serialized_pool(...).features`` after
            the coarser stages).
        cluster: int64 Tensor (N,), :func:`serialized_pool`'s ``cluster``.
        validate: check that every value of ``cluster`` is in [0, V) (one host read, eagerly
            only). Unchecked, a point whose cluster is out of range gets zeros (as the -1 of
            clusters dropped by ``max_clusters``), never a read out of bounds.

    Returns:
        Tensor (N, ...); differentiable with respect to ``features`` (an index_add backward).

    Example:
        >>> import torch, pcops
        >>> pcops.serialized_unpool(torch.tensor([[2.0], [4.0]]), torch.tensor([0, 0, 1, 1]))  # each point its cluster's row
        tensor([[2.],
                [2.],
                [4.],
                [4.]])
    """
    if not isinstance(features, torch.Tensor) or features.dim() < 1:
        raise TypeError(f"features must be a torch.Tensor of shape (V, ...), got {getattr(features, 'shape', type(features).__name__)}")
    _validate.integer("cluster", cluster, ndim=1, shape_doc="(N,)")
    _validate.same_device(features=features, cluster=cluster)
    _layout.values(validate, ranges={"cluster": (cluster, 0, features.shape[0] - 1)})
    return _rows(features, cluster)


__all__ = ["Serialization", "SerializedPool", "SerializedPoolPadded", "serialize", "serialized_pool", "serialized_unpool"]
