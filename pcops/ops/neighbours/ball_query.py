"""Ball query: the up to K CLOSEST reference points within a radius, and how many there are.

For each query q_i, with d_ij = ||q_i - p_j|| and N(i) = {j : d_ij <= radius}:

    idx[i]    = the min(K, |N(i)|) points of N(i) with the smallest d_ij, ascending, ties by
                the smaller j; padded with -1 (dists inf)
    counts[i] = |N(i)|, not capped at K, so a truncated neighbourhood is visible

Unlike caps that keep the first K points found (torch_cluster's radius, PyTorch3D's
ball_query), the result does not depend on the traversal order. The cell list of the radius
ops (``pcops.ops.neighbours._cells``: the reference points sorted by cells of the grid) yields the
candidates; each query keeps its K best (distance, index) pairs sorted in its output row by
insertion. Where a gradient to the points is asked for, the distances are recomputed in torch
from the indices, as :func:`pcops.knn` does, so they are differentiable with respect to both
point sets; otherwise they are the kernel's own. Output shapes are static: the op compiles with ``fullgraph=True``.

:func:`ball_queries` runs it at several radii in one call (one result per radius, each equal to
:func:`ball_query`'s): one layout, one check, and per group of close radii (``GROUP_RATIO``)
one cell list and one scan that tests each point against every radius of the group. Both ops
call :func:`_search` and its one kernel (``_kernel``); a group of several radii compiles a
kernel for its caps (their columns are constants of the kernel), once per set of caps.
"""

from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp, _warp_funcs
from . import _cells
from .nearest import _distances, _points_grad


class BallQuery(NamedTuple):
    """Result of :func:`ball_query`: ``dists`` and ``idx`` (..., K), ``counts`` (...) int64."""

    dists: torch.Tensor
    idx: torch.Tensor
    counts: torch.Tensor


@_warp.kernels
def _kernel(dtype: torch.dtype, columns: tuple = (), by_index: bool = False, dense: bool = False):
    """(kernel, Radii, Ints): one thread per query (in cell order) scans the cells that meet
    [q - r, q + r] for the largest of G radii r_0 <= ... <= r_{G-1} (the cell list's), and for
    each radius g keeps the K_g best (distance, original index) pairs of the points within r_g
    in its own columns of the row and counts them in column ``slot[g]`` of ``counts``: one scan
    for all the radii of a group, a point measured once and tested against each radius.

    ``columns``: the (first, K) columns of each radius, compile-time constants (offsets passed
    at run time make the insertion slower on the CPU, in register pressure); () for one
    radius in all the columns of ``dists`` and ``idx`` (which may be a view of some columns of
    a wider buffer). ``by_index`` (one radius, ``columns`` ()): a row keeps the K smallest
    indices within the radius, ascending, in ``idx`` alone (``dists`` is not read or written),
    and the test is the squared one, ``|q - p|^2 <= r^2`` (the "first K" of
    ``pcops::ball_query_by_index``): no square root per point and no distance column to
    shift, a fifth less CPU time for the op (16 x 8192 points, about 30 neighbours each).
    ``dense`` (one cloud, no groups): the thread scans every reference point, ``cells.points``
    in the order ``cells.order`` (small clouds, where building the cell list costs more than
    the pairs: the same tests and insertions, so the same result, in one launch).
    ``Radii``, ``Ints``: the vector types of the radius and slot arguments."""
    s = _warp.scalar(dtype)
    Cells, window, run = _warp_funcs.cell_scan(dtype)
    insert = _warp_funcs.sorted_insert(dtype)
    insert_in = _warp_funcs.sorted_insert(dtype, False, True)  # (not squared; in a range of columns)
    radii = max(len(columns), 1)
    Radii = wp.types.vector(radii, s)
    Ints = wp.types.vector(radii, int)
    first = Ints(*(c[0] for c in columns)) if columns else Ints()
    width = Ints(*(c[1] for c in columns)) if columns else Ints()
    last = radii - 1

    @wp.func(module="unique")
    def insert_index(idx: wp.array2d(dtype=wp.int64), i: int, n: int, j: wp.int64):
        """Put j into row i of ``idx``, which holds the row's n smallest indices so far,
        ascending; returns the new count (an index past a full row's last is dropped)."""
        k = idx.shape[1]
        last = wp.min(n, k - 1)
        if n < k or j < idx[i, last]:
            pos = last
            while pos > 0:
                if idx[i, pos - 1] < j:
                    break
                idx[i, pos] = idx[i, pos - 1]
                pos = pos - 1
            idx[i, pos] = j
            return wp.min(n + 1, k)
        return n

    @wp.kernel(enable_backward=False, module="unique")
    def search(
        start: int,
        cells: Cells,
        radius: Radii,
        slot: Ints,
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
        counts: wp.array2d(dtype=wp.int64),
    ):
        i = int(cells.rows[wp.tid() + start])
        q = cells.query[i]
        n = Ints()  # per radius: pairs held, points within it
        total = Ints()
        reach = radius[wp.static(last)]
        lo = wp.vec3i(0, 0, 0)
        hi = wp.vec3i(0, 0, 0)
        if wp.static(dense):  # every point, for a finite query (the window is empty for others)
            if not (wp.isfinite(q[0]) and wp.isfinite(q[1]) and wp.isfinite(q[2])):
                hi = wp.vec3i(-1, -1, -1)
        else:
            lo, hi = window(cells, i, q, reach)
        if wp.static(by_index):
            reach = reach * reach
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                first_j, last_j = int(0), cells.points.shape[0]
                if wp.static(not dense):
                    first_j, last_j = run(cells, lo, hi, y, z)
                for j in range(first_j, last_j):
                    if wp.static(by_index):  # squared, against reach^2; idx alone
                        e = q - cells.points[j]
                        if wp.dot(e, e) <= reach:
                            total[0] = total[0] + 1
                            n[0] = insert_index(idx, i, n[0], cells.order[j])
                    else:
                        d = wp.length(q - cells.points[j])
                        if d <= reach:
                            for g in range(wp.static(radii)):  # unrolled: g, first[g], width[g] are constants
                                if d <= radius[g]:
                                    total[g] = total[g] + 1
                                    if wp.static(len(columns) > 0):
                                        n[g] = insert_in(dists, idx, i, first[g], width[g], n[g], d, cells.order[j])
                                    else:
                                        n[g] = insert(dists, idx, i, n[g], d, cells.order[j])
        for g in range(wp.static(radii)):
            counts[i, slot[g]] = wp.int64(total[g])

    return search, Radii, Ints


# Radii of one ball_queries call share a cell list and a scan while the largest of a group is at
# most this many times its smallest. A shared scan measures each point of the largest radius'
# cells once for all the radii of the group, but tests each of them against every radius: for a
# smaller radius that costs more than its own scan once (r / R)^3 is small. Against separate
# ball_query calls, groups within 2x were never slower (docs/benchmarks.md, design choices).
GROUP_RATIO = 2.0
# One cloud on the CPU with at most this many (query, reference point) pairs: every pair is
# measured (``dense`` kernels), all radii in one scan, instead of building cell lists: the same
# result in one launch (docs/ops/ball_query.md).
SCAN_PAIRS = 1 << 18


def _groups(radii: list) -> list[list[int]]:
    """The indices of ``radii`` by ascending radius, in groups that share a cell list sized by
    their largest radius and one kernel launch (a scan of that radius' cells)."""
    order = sorted(range(len(radii)), key=lambda g: radii[g])
    groups = [[order[0]]]
    for g in order[1:]:
        if radii[g] > GROUP_RATIO * radii[groups[-1][0]]:
            groups.append([])
        groups[-1].append(g)
    return groups


def _search(query, ref, radii: list, max_neighbors: list, validate: bool, query_group, ref_group, by_index: bool = False):
    """The search of ball_query and ball_queries: (idx (M, sum K) int64, radius g's K_g columns
    after those of the radii before it; counts (M, G) int64; dists (M, sum K), the distances
    of idx's points, inf past each row's neighbours). ``by_index``: the K smallest indices
    within the radius instead of the K closest (see :func:`_kernel`), and dists (M, 0)."""
    _validate.groups_paired(query_group, ref_group)
    if validate:
        _validate.finite(query=query, ref=ref)
    m, width = query.shape[0], sum(max_neighbors)
    idx = torch.full((m, width), -1, dtype=torch.int64, device=query.device)
    counts = torch.zeros((m, len(radii)), dtype=torch.int64, device=query.device)
    dists = query.new_empty((m, 0)) if by_index else query.new_full((m, width), float("inf"))
    if m == 0 or ref.shape[0] == 0:
        return idx, counts, dists
    _warp.init()
    first = [sum(max_neighbors[:g]) for g in range(len(radii))]
    dense = query.device.type == "cpu" and query_group is None and m * ref.shape[0] <= SCAN_PAIRS
    groups = [sorted(range(len(radii)), key=lambda g: radii[g])] if dense else _groups(radii)
    extent = _cells.extent_of(query, ref, query_group, ref_group) if len(groups) > 1 else None  # one host read for all
    for group in groups:
        if len(group) == 1:  # its own columns, as a view: a kernel for any K
            (g,), columns = group, ()
            rows = [t[:, first[g]:first[g] + max_neighbors[g]] for t in (dists, idx)]
        else:
            columns, rows = tuple((first[g], max_neighbors[g]) for g in group), [dists, idx]
        kernel, Radii, Ints = _kernel(query.dtype, columns, by_index, dense)
        if dense:  # small: every pair, no cell list
            scan = _cells.every_point(query, ref)
        else:
            cells = _cells.CellList(query, ref, radii[group[-1]], query_group, ref_group, extent)  # (a host read unless shared)
            scan = cells.scan(query, query_group, _cells.permute(ref, cells.order))
        args = [scan, Radii(*(radii[g] for g in group)), Ints(*group), *rows, counts]
        _warp.launch(kernel, m, args, like=query, min_chunk=1 if dense else _warp.QUERY_CHUNK, work=m * ref.shape[0] if dense else None)
    return idx, counts, dists


@_threads.custom_op("pcops::ball_query", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _ball_query(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    max_neighbors: int,
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query (M, 3), ref (N, 3) of one float dtype -> (idx (M, K) int64, counts (M,) int64,
    dists (M, K) of the points' dtype: the distances of idx's points, inf past the counts)."""
    _validate.positive_number("radius", radius)
    idx, counts, dists = _search(query, ref, [radius], [max_neighbors], validate, query_group, ref_group)
    return idx, counts[:, 0].clone(), dists


@_ball_query.register_fake
def _(query, ref, radius, max_neighbors, validate, query_group, ref_group):
    m = query.shape[0]
    return (query.new_empty((m, max_neighbors), dtype=torch.int64), query.new_empty((m,), dtype=torch.int64),
            query.new_empty((m, max_neighbors)))


@_threads.custom_op("pcops::ball_query_by_index", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _by_index(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    max_neighbors: int,
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """query (M, 3), ref (N, 3) of one float dtype -> (idx (M, K) int64, counts (M,) int64): idx
    holds the K smallest indices within the radius, ascending, instead of the K closest
    (pcops.compat's "first K" caps), and a point is within it when ``|q - p|^2 <= radius^2`` in
    the points' dtype (the squared test: at the boundary it may differ from ``|q - p| <= radius``
    by rounding; pcops.compat searches a widened radius and tests exactly afterwards)."""
    _validate.positive_number("radius", radius)
    idx, counts, _ = _search(query, ref, [radius], [max_neighbors], validate, query_group, ref_group, by_index=True)
    return idx, counts[:, 0].clone()


@_by_index.register_fake
def _(query, ref, radius, max_neighbors, validate, query_group, ref_group):
    m = query.shape[0]
    return query.new_empty((m, max_neighbors), dtype=torch.int64), query.new_empty((m,), dtype=torch.int64)


@_threads.custom_op("pcops::ball_queries", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _ball_queries(
    query: torch.Tensor,
    ref: torch.Tensor,
    radii: list[float],
    max_neighbors: list[int],
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query (M, 3), ref (N, 3) of one float dtype -> (idx (M, sum K) int64, radius g's K_g
    columns after those of the radii before it; counts (M, G) int64; dists (M, sum K) of idx's
    points, inf past the counts)."""
    _check_radii(radii, max_neighbors)
    return _search(query, ref, list(radii), list(max_neighbors), validate, query_group, ref_group)


@_ball_queries.register_fake
def _(query, ref, radii, max_neighbors, validate, query_group, ref_group):
    m, width = query.shape[0], sum(max_neighbors)
    return (query.new_empty((m, width), dtype=torch.int64), query.new_empty((m, len(radii)), dtype=torch.int64),
            query.new_empty((m, width)))


def _check_max_neighbors(max_neighbors) -> None:
    _validate.count("max_neighbors", max_neighbors)


@_threads.limits
def ball_query(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    max_neighbors: int,
    *,
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> BallQuery:
    """The up to ``max_neighbors`` closest reference points within ``radius`` of each query.

    Args:
        query: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed.
        ref: Tensor of shape (N, 3); (B, N, 3) padded; or (N_total, 3) packed.
        radius: Python number > 0; a point is a neighbour when d_ij <= radius.
        max_neighbors: K >= 1, columns of the result (may exceed N).
        query_lengths, ref_lengths: optional int tensors (B,) for padded inputs; rows past a
            sample's length are padding (never neighbours; their own rows are -1 / inf / 0).
        query_batch, ref_batch: int sample ids (M_total,) / (N_total,) of packed inputs.
        validate: check the points for NaN/inf and lengths/ids for range.

    Returns:
        BallQuery(dists, idx, counts): ``dists``/``idx`` of shape (M, K), (B, M, K) or
        (M_total, K), sorted by distance ascending, ties by the smaller index, padded with
        inf / -1; ``idx`` int64 into ``ref`` (per sample for padded inputs, into the packed
        ref for packed ones); ``counts`` (M,), (B, M) or (M_total,) int64, the number of
        reference points within the radius (not capped at K). ``dists`` are Euclidean, in the
        promoted dtype of the points, differentiable with respect to ``query`` and ``ref``.
        float16/bfloat16 points are searched in float32.

    Example:
        >>> import torch, pcops
        >>> ref = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.2, 0.0]])
        >>> out = pcops.ball_query(torch.tensor([[0.0, 0.0, 0.0]]), ref, radius=1.0, max_neighbors=4)
        >>> out.idx  # the neighbours within the radius, nearest first, -1 padding
        tensor([[ 0,  3,  1, -1]])
        >>> out.counts
        tensor([3])
    """
    radius, max_neighbors = _validate.plain(radius), _validate.plain(max_neighbors)  # NumPy scalars as Python numbers
    flat = _layout.pair(
        query, ref, query_lengths=query_lengths, ref_lengths=ref_lengths,
        query_batch=query_batch, ref_batch=ref_batch, validate=validate,
    )
    _validate.positive_number("radius", radius)
    _check_max_neighbors(max_neighbors)
    dtype, out_dtype = _validate.compute_dtype(query, ref)
    q, p = flat.query.to(dtype), flat.ref.to(dtype)
    idx, counts, found = _ball_query(
        q.detach(), p.detach(), float(radius), max_neighbors, flat.validate, flat.query_group, flat.ref_group
    )
    return _result(flat, q, p, idx, counts, found, out_dtype, _points_grad(query, ref))


def _result(flat: _layout.Flat, q: torch.Tensor, p: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor, found: torch.Tensor,
            out_dtype, points_grad: bool) -> BallQuery:
    """The caller's BallQuery from a search's flat ``idx`` (M, K), ``counts`` (M,) and distances
    ``found`` (M, K): those distances where no gradient to the points is asked for (as
    :func:`pcops.knn` returns its search's), else recomputed in torch from the points
    (differentiable); indices as the caller indexes ref."""
    if points_grad:
        valid = idx >= 0
        rows = p if p.shape[0] else p.new_zeros((1, 3))  # an empty ref: every idx is -1, gather from a dummy row
        dists = torch.where(valid, _distances(q, _layout.select_rows(rows, idx.clamp(min=0))), float("inf")).to(out_dtype)
    else:
        dists = found.to(out_dtype)
    idx = _layout.local_index(flat, idx)
    return BallQuery(_layout.unflatten(flat, dists), _layout.unflatten(flat, idx), _layout.unflatten(flat, counts))


def _check_radii(radii, max_neighbors) -> tuple[list, list]:
    """``radii`` (a sequence of numbers > 0, at least one) and ``max_neighbors`` (an int >= 1, or
    a sequence of as many as there are radii) as lists of Python numbers, one K per radius."""
    if isinstance(radii, (torch.Tensor, str, bytes)) or not hasattr(radii, "__len__") or not hasattr(radii, "__iter__"):
        raise TypeError(f"radii must be a sequence of numbers (a list or tuple), got {type(radii).__name__}")
    radii = [_validate.plain(r) for r in radii]
    if not radii:
        raise ValueError("radii must not be empty: give at least one radius")
    for g, r in enumerate(radii):
        _validate.positive_number(f"radii[{g}]", r)
    if isinstance(max_neighbors, (torch.Tensor, str, bytes)) or not hasattr(max_neighbors, "__len__"):
        ks = [_validate.plain(max_neighbors)] * len(radii)
        _validate.count("max_neighbors", ks[0])
    else:
        ks = [_validate.plain(k) for k in max_neighbors]
        if len(ks) != len(radii):
            raise ValueError(f"max_neighbors must be an int or have one entry per radius ({len(radii)} radii), got {len(ks)} entries")
        for g, k in enumerate(ks):
            _validate.count(f"max_neighbors[{g}]", k)
    return radii, ks


@_threads.limits
def ball_queries(
    query: torch.Tensor,
    ref: torch.Tensor,
    radii,
    max_neighbors,
    *,
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> tuple[BallQuery, ...]:
    """:func:`ball_query` at several radii in one call: one result per radius, each equal to
    ``ball_query(query, ref, radii[g], max_neighbors[g], ...)``.

    The radii share the layout, the checks and the search: radii within ``GROUP_RATIO`` of
    each other share one cell list (sized by the largest) and one scan, which tests each point
    against every radius of the group (docs/ops/ball_query.md says what was measured).

    Args:
        query: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed.
        ref: Tensor of shape (N, 3); (B, N, 3) padded; or (N_total, 3) packed.
        radii: a sequence of G >= 1 Python numbers > 0 (any order, repeats allowed).
        max_neighbors: K >= 1 for every radius, or a sequence of G such ints, one per radius.
        query_lengths, ref_lengths: optional int tensors (B,) for padded inputs.
        query_batch, ref_batch: int sample ids (M_total,) / (N_total,) of packed inputs.
        validate: check the points for NaN/inf and lengths/ids for range.

    Returns:
        A tuple of G :class:`BallQuery` (dists, idx, counts), in the order of ``radii``: result g
        is the one of :func:`ball_query` at ``radii[g]`` with ``max_neighbors[g]`` columns
        (same shapes, padding, sorting, ties and gradients).

    Example:
        >>> import torch, pcops
        >>> points = torch.rand(1000, 3)
        >>> near, far = pcops.ball_queries(points, points, [0.05, 0.2], [8, 32])
        >>> near.idx.shape, far.idx.shape, far.counts.shape
        (torch.Size([1000, 8]), torch.Size([1000, 32]), torch.Size([1000]))
        >>> bool((far.counts >= near.counts).all())
        True
    """
    flat = _layout.pair(
        query, ref, query_lengths=query_lengths, ref_lengths=ref_lengths,
        query_batch=query_batch, ref_batch=ref_batch, validate=validate,
    )
    radii, ks = _check_radii(radii, max_neighbors)
    dtype, out_dtype = _validate.compute_dtype(query, ref)
    q, p = flat.query.to(dtype), flat.ref.to(dtype)
    idx, counts, found = _ball_queries(
        q.detach(), p.detach(), [float(r) for r in radii], ks, flat.validate, flat.query_group, flat.ref_group
    )
    grad = _points_grad(query, ref)
    if len(ks) == 1:
        return (_result(flat, q, p, idx, counts[:, 0], found, out_dtype, grad),)
    first = [sum(ks[:g]) for g in range(len(ks))]
    return tuple(_result(flat, q, p, idx[:, a:a + k].contiguous(), counts[:, g].contiguous(), found[:, a:a + k].contiguous(), out_dtype, grad)
                 for g, (a, k) in enumerate(zip(first, ks)))


__all__ = ["BallQuery", "ball_query", "ball_queries"]
