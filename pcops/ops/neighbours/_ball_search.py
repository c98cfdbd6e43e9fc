"""The search of the ball queries: for each query the up to K closest reference points within
a radius, and how many there are (:func:`pcops.ball_query`, :func:`pcops.ball_queries`, and
``pcops::ball_query_by_index``, pcops.compat's "first K" caps).

The cell list of the radius ops (``pcops.ops.neighbours._cells``: the reference points sorted by
cells of the grid) yields the candidates; each query keeps its K best (distance, index) pairs
sorted in its output row by insertion, so the result does not depend on the traversal order.
Small clouds (on the CPU at most ``SCAN_PAIRS`` pairs; on CUDA :func:`pcops._warp.cuda_scans`)
skip the cell list: the same kernel scans every pair; one CPU cloud past that and of at most
``_kept_cells.LARGEST`` points builds its list into kept buffers (:func:`_listed`). Several radii (ball_queries) are searched per group of close radii
(``GROUP_RATIO``): one cell list and one scan that tests each point against every radius of
the group. Every search calls :func:`search` and its one kernel (:func:`kernel`); a group of
several radii compiles a kernel for its caps (their columns are constants of the kernel), once
per set of caps. :func:`result` turns a search's flat rows into the caller's
:class:`BallQuery`.
"""

from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp, _warp_funcs
from . import _ball_tree, _cells, _kept_cells
from .nearest import _distances, _scan_rows


class BallQuery(NamedTuple):
    """Result of :func:`ball_query`: ``dists`` and ``idx`` (..., K), ``counts`` (...) int64."""

    dists: torch.Tensor
    idx: torch.Tensor
    counts: torch.Tensor


@_warp.kernels
def kernel(dtype: torch.dtype, columns: tuple = (), by_index: bool = False, dense: bool = False, runs: bool = False):
    """(kernel, Radii, Ints): one thread per query (in cell order) scans the cells that meet
    [q - r, q + r] for the largest of G radii r_0 <= ... <= r_{G-1} (the cell list's), and for
    each radius g keeps the K_g best (distance, original index) pairs of the points within r_g
    in its own columns of the row and counts them in column ``slot[g]`` of ``counts``: one scan
    for all the radii of a group, a point measured once and tested against each radius.

    ``columns``: the (first, K) columns of each radius, compile-time constants (offsets passed
    at run time make the insertion slower on the CPU, in register pressure); () for one
    radius in all the columns of ``dists`` and ``idx`` (which may be a view of some columns of
    a wider buffer). ``runs`` (one radius, ``columns`` (), not ``by_index``, a sorted row): on
    the CPU each run of points goes through :func:`.nearest._scan_rows.native_ball`, on vectors
    (the same counts and rows). ``by_index`` (one radius, ``columns`` ()): a row keeps the K smallest
    indices within the radius, ascending, in ``idx`` alone (``dists`` is not read or written),
    and the test is the squared one, ``|q - p|^2 <= r^2`` (the "first K" of
    ``pcops::ball_query_by_index``): no square root per point and no distance column to
    shift, a fifth less CPU time for the op (16 x 8192 points, about 30 neighbours each).
    ``dense`` (one cloud, no groups): the thread scans every reference point, ``cells.points``
    in the order ``cells.order`` (small clouds, where building the cell list costs more than
    the pairs: the same tests and insertions, so the same result, in one launch). Every thread
    fills its row past the neighbours found (-1, inf) and writes its counts: every row is a
    thread's, so the outputs need no fill before a launch. Given a flag ``bad`` (one element; empty: no check), a
    dense launch also sets it to 1 where a value of the query or reference points is NaN or
    inf (a plain call's values check; the search goes on).
    ``Radii``, ``Ints``: the vector types of the radius and slot arguments."""
    s = _warp.scalar(dtype)
    Cells, window, run = _warp_funcs.cell_scan(dtype, dense)
    insert = _warp_funcs.sorted_insert(dtype)
    insert_in = _warp_funcs.sorted_insert(dtype, False, True)  # (not squared; in a range of columns)
    push, finish = _warp_funcs.heap_insert(dtype)  # (rows of HEAP_FROM columns or more)
    flag = _warp_funcs.flag_not_finite(dtype)
    _, finite_point = _warp_funcs.finite(dtype)
    fill = _warp_funcs.fill_row(dtype)
    radii = max(len(columns), 1)
    Radii = wp.types.vector(radii, s)
    Ints = wp.types.vector(radii, int)
    first = Ints(*(c[0] for c in columns)) if columns else Ints()
    width = Ints(*(c[1] for c in columns)) if columns else Ints()
    heaps = Ints(*(int(c[1] >= HEAP_FROM) for c in columns)) if columns else Ints()  # (each radius' row a heap or sorted)
    last = radii - 1
    vectors = runs and not columns and not by_index
    native = _scan_rows.native_ball(dtype)

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
        bad: wp.array(dtype=wp.int32),
    ):
        i = int(cells.rows[wp.tid() + start])
        q = cells.query[i]
        if wp.static(dense):
            if bad.shape[0] > 0:  # the values check: its query, and every m-th point from its own number
                flag(cells.points, wp.tid() + start, cells.points.shape[0], cells.query.shape[0], bad)
                if not finite_point(q):
                    bad[0] = 1
        n = Ints()  # per radius: pairs held, points within it
        total = Ints()
        at, cols, heaped = first, width, heaps  # (the constants as locals here: read in both arms of an if below, Warp would keep one arm's copy for later reads)
        k = idx.shape[1]
        heap = not wp.static(by_index) and k >= HEAP_FROM  # (one radius in all the columns: a row of k, kept as a heap from HEAP_FROM)
        reach = radius[wp.static(last)]
        lo, hi = window(cells, i, q, reach)  # (dense: every point, for a finite query)
        if wp.static(by_index):
            reach = reach * reach
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                first_j, last_j = run(cells, lo, hi, y, z)
                if wp.static(vectors):  # one radius' sorted row: the CPU's run on vectors (-1 in CUDA code)
                    if not heap:
                        got = native(q, cells.points, cells.order, first_j, last_j, dists, idx, i, n[0], reach, s(wp.inf))
                        if got >= 0:
                            total[0] = total[0] + got
                            n[0] = wp.min(n[0] + got, k)
                            last_j = first_j
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
                                        if heaped[g] != 0:
                                            n[g] = push(dists, idx, i, at[g], cols[g], n[g], d, cells.order[j])
                                        else:
                                            n[g] = insert_in(dists, idx, i, at[g], cols[g], n[g], d, cells.order[j])
                                    elif heap:
                                        n[g] = push(dists, idx, i, 0, k, n[g], d, cells.order[j])
                                    else:
                                        n[g] = insert(dists, idx, i, n[g], d, cells.order[j])
        for g in range(wp.static(radii)):
            counts[i, slot[g]] = wp.int64(total[g])
            if wp.static(len(columns) > 0):
                if heaped[g] != 0:
                    finish(dists, idx, i, at[g], cols[g], n[g])
                    n[g] = wp.min(n[g], cols[g])
            elif heap:
                finish(dists, idx, i, 0, k, n[g])
                n[g] = wp.min(n[g], k)
        # the row whole past its neighbours (-1, inf): the outputs need no fill before a launch
        if wp.static(len(columns) > 0):
            for g in range(wp.static(radii)):
                fill(dists, idx, i, first[g] + n[g], first[g] + width[g], s(wp.inf))
        else:
            fill(dists, idx, i, n[0], idx.shape[1], s(wp.inf))  # (by index: dists has no columns)

    return search, Radii, Ints


# CPU: one radius' runs of points measured on vectors (:func:`.nearest._scan_rows.native_ball`;
# tests compare with False)
VECTOR_RUNS = True
# A row of this many columns or more (a radius' K) appends its pairs while not full, then keeps
# them in a max-heap, and sorts them at the end, instead of a sorted row: a ball holding many more
# points than K costs log K moves a point instead of up to K, a ball of fewer points the same
# shifts (the same row: docs/benchmarks.md, design choices)
HEAP_FROM = 64
# Radii of one ball_queries call share a cell list and a scan while the largest of a group is at
# most this many times its smallest. A shared scan measures each point of the largest radius'
# cells once for all the radii of the group, but tests each of them against every radius: for a
# smaller radius that costs more than its own scan once (r / R)^3 is small. Against separate
# ball_query calls, groups within 2x were never slower (docs/benchmarks.md, design choices).
GROUP_RATIO = 2.0
# One cloud on the CPU with at most this many (query, reference point) pairs: every pair is
# measured (``dense`` kernels), all radii in one scan, instead of building cell lists: the same
# result in one launch (docs/ops/ball_query.md; the crossover, with one radius' runs on vectors:
# docs/benchmarks.md, design choices).
SCAN_PAIRS = 1 << 19
# The cost of a pair in CUDA's every-pair scan (one thread per query) against the cell list's
# few launches: the scan is taken up to 2^27 pairs, about 11,600^2 (the cell list won from
# 16,384^2 on an H200, the scan up to 8,192^2: docs/benchmarks.md, GPU).
SCAN_COST = 16


def groups(radii: list) -> list[list[int]]:
    """The indices of ``radii`` by ascending radius, in groups that share a cell list sized by
    their largest radius and one kernel launch (a scan of that radius' cells)."""
    order = sorted(range(len(radii)), key=lambda g: radii[g])
    out = [[order[0]]]
    for g in order[1:]:
        if radii[g] > GROUP_RATIO * radii[out[-1][0]]:
            out.append([])
        out[-1].append(g)
    return out


def search(query, ref, radii: list, max_neighbors: list, validate: bool, query_group, ref_group, by_index: bool = False):
    """The search of ball_query and ball_queries: (idx (M, sum K) int64, radius g's K_g columns
    after those of the radii before it; counts (M, G) int64; dists (M, sum K), the distances
    of idx's points, inf past each row's neighbours). ``by_index``: the K smallest indices
    within the radius instead of the K closest (see :func:`kernel`), and dists (M, 0)."""
    _validate.groups_paired(query_group, ref_group)
    m, n, width = query.shape[0], ref.shape[0], sum(max_neighbors)
    pairs = m * n
    if m and n and query_group is None and query.is_cpu and pairs <= SCAN_PAIRS:
        # the calling thread's packed launch of clouds up to a capacity, any radii in this order: its rows come whole
        capacity = _warp.capacity(max(m, n))  # (one launch serves every size up to it, cut into as many chunks)
        order = (0,) if len(radii) == 1 else tuple(sorted(range(len(radii)), key=lambda g: radii[g]))  # (the radii's order sets the columns: in the key; their values are put)
        launch = _warp.ranged(("ball", query.dtype, capacity, order, tuple(max_neighbors), by_index, VECTOR_RUNS),
                              lambda: _dense(query, ref, radii, max_neighbors, by_index, capacity), _DENSE_GROUPS, (m, n), m, pairs,
                              values=(("radius", (float(radii[0]),) if len(radii) == 1 else tuple(float(radii[g]) for g in order)),))
        if launch is not None:
            idx, counts = torch.empty(m, width, dtype=torch.int64), torch.empty(m, len(radii), dtype=torch.int64)
            dists = query.new_empty(m, 0 if by_index else width)
            flag = launch.keep[-1][1]
            flag[0] = 0
            launch.run_at(launch.fields("cells__query", "cells__points", "dists", "idx", "counts"), query.contiguous(), ref.contiguous(), dists, idx, counts)
            if validate and flag[0]:  # (the launch's values check found NaN or inf: raises, naming them)
                _validate.finite(query=query, ref=ref)
            return idx, counts, dists
    extent = None  # (the clouds' extent, where a kept list read it)
    if m and n and query_group is None and query.is_cpu and pairs > SCAN_PAIRS and max(m, n) <= _kept_cells.LARGEST and KEPT_LISTS[0]:
        found, extent = _listed(query.contiguous(), ref.contiguous(), radii, max_neighbors, validate, by_index)
        if found is not None:
            return found
    if validate:
        _validate.finite(query=query, ref=ref)
    if m == 0 or n == 0:
        return (torch.full((m, width), -1, dtype=torch.int64, device=query.device), torch.zeros((m, len(radii)), dtype=torch.int64, device=query.device),
                query.new_empty((m, 0)) if by_index else query.new_full((m, width), float("inf")))
    # (every row and count is written by a launch: each radius' kernel thread fills its row past its neighbours)
    idx, counts = torch.empty(m, width, dtype=torch.int64, device=query.device), torch.empty(m, len(radii), dtype=torch.int64, device=query.device)
    dists = query.new_empty(m, 0 if by_index else width)
    _warp.init()
    first = [sum(max_neighbors[:g]) for g in range(len(radii))]
    dense = query_group is None and (pairs <= SCAN_PAIRS if query.is_cpu else _warp.cuda_scans(m, n, SCAN_COST))
    grouped = [sorted(range(len(radii)), key=lambda g: radii[g])] if dense else groups(radii)
    tree = not dense and not by_index and query.is_cpu  # (crowded balls may take the kd-tree)
    if extent is None and (len(grouped) > 1 or tree):
        extent = _cells.extent_of(query, ref, query_group, ref_group)  # one host read for all
    if tree:
        crowd = _ball_tree.take(query, ref, query_group, ref_group, radii, max_neighbors, first, dists, idx, counts, extent[1],
                                validate, HEAP_FROM)
        grouped = [left for left in ([g for g in group if g not in crowd] for group in grouped) if left]
    for group in grouped:
        columns, rows = _columns(group, first, max_neighbors, dists, idx)
        search_kernel, Radii, Ints = kernel(query.dtype, columns, by_index, dense, VECTOR_RUNS)
        if dense:  # small: every pair, no cell list
            scan = _cells.every_point(query, ref)
        else:
            cells = _cells.CellList(query, ref, radii[group[-1]], query_group, ref_group, extent)  # (a host read unless shared)
            scan = cells.scan(query, query_group, _cells.permute(ref, cells.order))
        args = [scan, Radii(*(radii[g] for g in group)), Ints(*group), *rows, counts, _warp.no_flag(query.device)[1]]
        _warp.launch(search_kernel, m, args, like=query, min_chunk=1 if dense else _warp.QUERY_CHUNK, work=pairs if dense else None)
    return idx, counts, dists


# One small CPU cloud above SCAN_PAIRS scans a cell list built into kept buffers (tests compare with False)
KEPT_LISTS = [True]


def _listed(query, ref, radii: list, max_neighbors: list, validate: bool, by_index: bool):
    """(result, extent): :func:`search`'s result for one small CPU cloud (contiguous) on the calling
    thread's kept cell list (:mod:`._kept_cells`: the same list as a :class:`._cells.CellList`'s,
    so the same rows and counts) and its kept scan launches (:func:`pcops._warp.ranged`); the
    result None where none is kept (yet), or where a radius takes the kd-tree (crowded balls:
    the general path, given the clouds' extent as :func:`._cells.extent_of` gives it)."""
    m, n, width = query.shape[0], ref.shape[0], sum(max_neighbors)
    plan = _kept_cells.plan(query.dtype, max(m, n))
    if plan is None:
        return None, None
    host = plan.extent(query, ref)
    if not by_index and any(_ball_tree.in_range(r, query.dtype) and _ball_tree.crowded(r, k, n, host) for r, k in zip(radii, max_neighbors)):
        return None, (None, host)
    first = [sum(max_neighbors[:g]) for g in range(len(radii))]
    idx, counts = torch.empty(m, width, dtype=torch.int64), torch.empty(m, len(radii), dtype=torch.int64)
    dists = query.new_empty(m, 0 if by_index else width)
    for group in groups(radii):
        if plan.build(query, ref, radii[group[-1]], host) and validate:
            _validate.finite(query=query, ref=ref)  # (the build found NaN or inf: raises, naming them)
        columns, rows = _columns(group, first, max_neighbors, dists, idx)
        search_kernel, Radii, Ints = kernel(query.dtype, columns, by_index, False, VECTOR_RUNS)
        args = lambda: [plan.scan(query, n), Radii(*(radii[g] for g in group)), Ints(*group), *rows, counts, _warp.no_flag(query.device)[1]]  # noqa: E731
        launch = _warp.ranged(("ball list", query.dtype, plan.capacity, tuple(group), tuple(max_neighbors), by_index, VECTOR_RUNS),
                              lambda: _warp.prepare(search_kernel, m, args(), None, _warp.QUERY_CHUNK), _LISTED_GROUPS, (m, n), m, None,
                              _warp.QUERY_CHUNK, values=(("radius", tuple(float(radii[g]) for g in group)), ("cells__dims", plan.dims)))
        if launch is None:
            _warp.launch(search_kernel, m, args(), like=query, min_chunk=_warp.QUERY_CHUNK)
        else:
            launch.run_at(launch.fields(*_kept_cells.FIELDS, "dists", "idx", "counts"), *plan.fields(), query, *rows, counts)
    return (idx, counts, dists), None


# The lengths a kept list's scan sets: its queries', its points'
_LISTED_GROUPS = (_kept_cells.LENGTHS[0] + ("dists", "idx", "counts"), _kept_cells.LENGTHS[1])


def _columns(group: list, first: list, max_neighbors: list, dists: torch.Tensor, idx: torch.Tensor) -> tuple:
    """(columns, rows) of the kernel of one group of radii: a single radius writes its own
    columns of ``dists`` and ``idx`` (views; a kernel for any K), several their column ranges."""
    if len(group) == 1:
        (g,) = group
        return (), [t[:, first[g]:first[g] + max_neighbors[g]] for t in (dists, idx)]
    return tuple((first[g], max_neighbors[g]) for g in group), [dists, idx]


# The lengths a call of the dense search sets (:func:`pcops._warp.ranged`): its queries', its points'
_DENSE_GROUPS = (("cells__query", "cells__rows", "dists", "idx", "counts"), ("cells__points", "cells__order"))


def _dense(query, ref, radii: list, max_neighbors: list, by_index: bool, capacity: int = 0):
    """The dense search of one CPU cloud as a prepared launch (:class:`pcops._warp.Prepared`):
    ``cells__query``, ``cells__points``, ``dists``, ``idx`` and ``counts`` pointed at each call's
    tensors (one group: its columns start at 0, so each output's views start at its first
    element), its indices held for clouds of up to ``capacity`` points; None before the
    kernel's first launch."""
    m, width = query.shape[0], sum(max_neighbors)
    first = [sum(max_neighbors[:g]) for g in range(len(radii))]
    group = sorted(range(len(radii)), key=lambda g: radii[g])
    idx, counts = torch.empty(m, width, dtype=torch.int64), torch.empty(m, len(radii), dtype=torch.int64)
    dists = query.new_empty(m, 0 if by_index else width)
    columns, rows = _columns(group, first, max_neighbors, dists, idx)
    search_kernel, Radii, Ints = kernel(query.dtype, columns, by_index, True, VECTOR_RUNS)
    scan = _cells.every_point(query, ref, capacity)
    flag = _warp.values_flag()
    return _warp.prepare(search_kernel, query.shape[0], [scan, Radii(*(radii[g] for g in group)), Ints(*group), *rows, counts, flag[0]],
                         work=query.shape[0] * ref.shape[0], keep=(scan.tensors[2], flag))  # (the indices, not this call's clouds; the values flag)


def search_one(query, ref, radius: float, max_neighbors: int, validate: bool, query_group, ref_group, by_index: bool = False):
    """:func:`search` at one radius (checked): (idx (M, K), counts (M,), dists (M, K) or (M, 0))."""
    _validate.positive_number("radius", radius)
    idx, counts, dists = search(query, ref, [radius], [max_neighbors], validate, query_group, ref_group, by_index)
    return idx, counts.view(-1), dists  # ((M, 1): its one column)


def result(flat: _layout.Flat, q: torch.Tensor, p: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor, found: torch.Tensor,
           out_dtype, points_grad: bool) -> BallQuery:
    """The caller's BallQuery from a search's flat ``idx`` (M, K), ``counts`` (M,) and distances
    ``found`` (M, K): those distances where no gradient to the points is asked for (as
    :func:`pcops.knn` returns its search's), else recomputed in torch from the points
    (differentiable); indices as the caller indexes ref."""
    if points_grad:
        valid = idx >= 0
        rows = p if p.shape[0] else p.new_zeros((1, 3))  # an empty ref: every idx is -1, gather from a dummy row
        dists = torch.where(valid, _distances(q, _layout.select_rows(rows, idx.clamp(min=0)), valid), float("inf")).to(out_dtype)
    else:
        dists = found.to(out_dtype)
    idx = _layout.local_index(flat, idx)
    return BallQuery(_layout.unflatten(flat, dists), _layout.unflatten(flat, idx), _layout.unflatten(flat, counts))


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
    idx, counts, _ = search_one(query, ref, radius, max_neighbors, validate, query_group, ref_group, by_index=True)
    return idx, counts


@_by_index.register_fake
def _(query, ref, radius, max_neighbors, validate, query_group, ref_group):
    m = query.shape[0]
    return query.new_empty((m, max_neighbors), dtype=torch.int64), query.new_empty((m,), dtype=torch.int64)
