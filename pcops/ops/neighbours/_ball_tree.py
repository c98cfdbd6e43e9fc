"""Crowded balls on the kNN's kd-tree: the ball search of CPU clouds (one, or a batch a sample
at a time) for radii whose balls hold many more points than their K
(``pcops.ops.neighbours._ball_search``: the same rows and counts as its cell list's).

The cell list measures every point of its cells, so a ball of the whole cloud costs the whole
cloud per query. Here each query walks the kd-tree of :mod:`.nearest._kdtree` (its build, its
query order) as its kNN search does, nearer child first, so its row of the K best (distance,
index) pairs within the radius fills with near points early; a node is then

* skipped when its box is beyond the radius (no point of it is within);
* counted whole, unmeasured, when its box is farther than the row's K-th distance (no point of
  it enters the row) and lies inside the ball (its farthest corner within the radius, with a
  margin for rounding: every point of it is within);
* walked otherwise, its leaves' points measured: counted when ``|q - p| <= r`` (the cell list's
  test: the same root, compared the same way) and inserted as the cell list inserts them (by
  their squares, whose order is their roots', or into a heap of distances from the cell list's
  ``HEAP_FROM`` columns).

Before its row fills, a query's bound on the row is the K-th distance of the query before it
on the same CPU thread plus the step between them (the queries go in the tree's Morton order),
as the kNN walk's: its K nearest are that near. So a ball of the whole cloud costs about a kNN
search of K, and a ball cut by the cloud the leaves its sphere crosses. :func:`take` picks the
radii that take it (docs/ops/ball_query.md).
"""

import math
from typing import Optional

import numpy as np
import torch
import warp as wp

from ... import _warp, _warp_funcs
from .nearest import _kdtree

# A radius takes the tree when its ball holds about this many points or more, and at least its
# K (an estimate from the clouds' boxes): from there the cell list's measuring of the ball's cells
# costs more than the walk (K = 8 to 128, 1,024 to 32,768 points: docs/benchmarks.md, design choices).
CROWDED = 128.0


@_warp.kernels
def kernel(dtype: torch.dtype, heap: bool = False):
    """``ball(start, depth, radius, slot, rows, query, points, order, lo, hi, axis, split, dists,
    idx, counts, chain)``: a thread per query (``query`` in the tree's query order, ``rows`` their
    rows), its K best pairs within ``radius`` into its row of ``dists`` / ``idx`` (every column
    written: -1 / inf past them) and the number of points within it into ``counts[i, slot]``.
    ``heap``: the row kept as the cell list's rows of many columns are (``heap_insert``), by
    distance (a root per pair that enters), else sorted by squares (a root per column at the end)."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    insert = _warp_funcs.sorted_insert(dtype, True)  # (squares, in the order of their roots)
    push, finish = _warp_funcs.heap_insert(dtype)
    eps = torch.finfo(dtype).eps
    slack = s((1.0 + 64.0 * eps) ** 2)  # as the kNN walk's: rounding never hides a point from a bound widened by it
    sure = s(1.0 - 8.0 * eps)  # a square below r^2 times this has a root <= r (no root taken)
    chained = _kdtree.chain_func(dtype)  # (the kNN walk's first bound, from the query before)
    fill = _warp_funcs.fill_row(dtype)
    _nodes = wp.types.vector(length=_kdtree._STACK, dtype=wp.int32)
    _bounds = wp.types.vector(length=_kdtree._STACK, dtype=s)

    @wp.kernel(enable_backward=False, module="unique")
    def ball(start: int, depth: int, radius: s, slot: int, rows: wp.array(dtype=wp.int64), query: wp.array(dtype=v),
             points: wp.array(dtype=v), order: wp.array(dtype=wp.int64), lo: wp.array(dtype=v), hi: wp.array(dtype=v),
             axis: wp.array(dtype=wp.int32), split: wp.array(dtype=s), dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64),
             counts: wp.array2d(dtype=wp.int64), chain: int):
        t = wp.tid() + start
        i = int(rows[t])
        q = query[t]
        k = dists.shape[1]
        npts = wp.int64(points.shape[0])
        rr = radius * radius
        reach = rr * slack  # squares beyond it: not within the radius
        inside = rr / (slack * slack)  # a box whose farthest corner's square is below it: every point within
        below = rr * sure
        bound = reach  # squares beyond it cannot enter the row (its K-th's, widened, once full)
        if chain != 0 and wp.tid() > 0:  # the query before ran on this CPU thread: its K nearest bound this one's
            r = dists[int(rows[t - 1]), k - 1]  # (inf: it found fewer than K within the radius)
            if r < s(wp.inf):
                bound = wp.min(bound, chained(r, q - query[t - 1]))
        n = int(0)
        total = wp.int64(0)
        zero = v(s(0.0), s(0.0), s(0.0))
        stack_node = _nodes()
        stack_depth = _nodes()
        stack_bound = _bounds()
        top = int(1)  # the root: entry 0, depth 0, bound 0
        while top > 0:
            top = top - 1
            b = stack_node[top]
            d = stack_depth[top]
            if stack_bound[top] > reach:
                continue
            while True:  # down to the leaf on the query's side, pushing the farther children
                gap = wp.max(wp.max(lo[b] - q, q - hi[b]), zero)
                near = wp.dot(gap, gap)
                if near > reach:
                    break
                if near > bound:  # nothing of it enters the full row: counted whole if inside the ball
                    far = wp.max(wp.abs(q - lo[b]), wp.abs(q - hi[b]))
                    if wp.dot(far, far) <= inside:
                        node = b + 1 - (1 << d)
                        total = total + wp.int64(_warp_funcs.part(node + 1, npts, d) - _warp_funcs.part(node, npts, d))
                        break
                if d == depth:  # a leaf: measure its points
                    node = b + 1 - (1 << d)
                    j = _warp_funcs.part(node, npts, d)
                    j1 = _warp_funcs.part(node + 1, npts, d)
                    while j < j1:
                        diff = q - points[j]
                        d2 = wp.dot(diff, diff)
                        if d2 <= reach:
                            if d2 <= below or wp.length(diff) <= radius:
                                total = total + wp.int64(1)
                                if d2 <= bound:
                                    if wp.static(heap):
                                        n = push(dists, idx, i, 0, k, n, wp.length(diff), order[j])
                                        if n > k:  # a heap: its root the worst held
                                            bound = wp.min(bound, dists[i, 0] * dists[i, 0] * slack)
                                    else:
                                        n = insert(dists, idx, i, n, d2, order[j])
                                        if n == k:
                                            bound = wp.min(bound, dists[i, k - 1] * slack)
                        j += 1
                    break
                a = int(axis[b])
                side = int(0)
                floor = s(0.0)
                if a >= 3:  # a split stopped early: no plane between the halves
                    side = int(q[a - 3] >= split[b])
                elif a >= 0:
                    off = q[a] - split[b]
                    side = int(off >= s(0.0))
                    floor = off * off
                stack_node[top] = 2 * b + 2 - side
                stack_depth[top] = d + 1
                stack_bound[top] = floor
                top = top + int(floor <= reach)
                b = 2 * b + 1 + side
                d = d + 1
        counts[i, slot] = total
        if wp.static(heap):
            finish(dists, idx, i, 0, k, n)
            n = wp.min(n, k)
        else:
            for c in range(n):
                dists[i, c] = wp.sqrt(dists[i, c])
        fill(dists, idx, i, n, k, s(wp.inf))

    return ball


def in_range(radius: float, dtype: torch.dtype) -> bool:
    """Whether the square of ``radius`` is a normal number of ``dtype`` by a wide margin (2^30
    both ways), so that the walk's relative margins on it hold (a square among the subnormal
    numbers keeps too few digits for them, one that overflows none): others keep the cell list."""
    info = torch.finfo(dtype)
    return info.tiny * 2.0**30 <= radius * radius <= info.max / 2.0**30


def crowded(radius: float, k: int, n: float, host: list, queries: Optional[float] = None, held: Optional[float] = None) -> bool:
    """Whether a ball of ``radius`` holds about ``CROWDED`` of the ``n`` reference points or
    more, and at least ``k``, from their box (``host[0:6]``, :func:`._cells.extent_of`'s): all
    of them where the radius spans the box's diagonal, else the share of each side the ball's
    diameter spans times a ball's share of its cube; or from ``held``, the points a ball holds
    in a sample (:func:`sampled`), where that is more (the box's share assumes points spread
    over it). ``queries``: a batch's queries a sample (``n`` its points a sample), whose balls
    must also hold ``SAMPLE_WORK`` points together."""
    sides = [hi - lo for lo, hi in zip(host[0:3], host[3:6])]
    share = 1.0
    if radius * radius < sum(x * x for x in sides):
        share = math.pi / 6.0
        for side in sides:
            share *= min(1.0, 2.0 * radius / side) if side > 0 else 1.0
    held = max(n * share, held or 0.0)
    return held >= max(CROWDED, k) and (queries is None or queries * held >= SAMPLE_WORK)


# A search of this many (query, reference point) pairs or more also counts the balls of a sample
# (:func:`sampled`: about n / 4 pairs and a fixed cost, small against such a search: its cost
# measured in docs/benchmarks.md, design choices), whose points may crowd where their box says
# they spread (clusters, scans of varying density)
SAMPLE_PAIRS = 1 << 27
SAMPLE_QUERIES = 32


@_warp.kernels
def _tally_kernel(dtype: torch.dtype):
    """``tally``: sampled query i counts, for each squared radius c, the sampled points of its
    own sample id within it into ``counts[i, c]`` (zeroed before)."""
    v = _warp.vec3(dtype)
    s = _warp.scalar(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def tally(start: int, query: wp.array(dtype=v), ref: wp.array(dtype=v), query_group: wp.array(dtype=wp.int64),
              ref_group: wp.array(dtype=wp.int64), squares: wp.array(dtype=s), counts: wp.array2d(dtype=wp.int64)):
        i = wp.tid() + start
        q = query[i]
        g = query_group[i]
        j = int(0)
        while j < ref.shape[0]:
            if ref_group[j] == g:
                e = q - ref[j]
                d2 = wp.dot(e, e)
                for c in range(squares.shape[0]):
                    if d2 <= squares[c]:
                        counts[i, c] = counts[i, c] + wp.int64(1)
            j += 1

    return tally


def sampled(query, ref, query_group, ref_group, radii: list) -> list[float]:
    """The mean number of reference points (of its own sample) a query's ball of each radius
    holds, estimated from ``SAMPLE_QUERIES`` queries and about a 128th of the points (at least
    128), each taken at a fixed stride: a ball of c points finds about c / 4 of them among
    the sampled points of all the sampled queries together. A guide for speed only: the tree
    and the cell list return the same rows."""
    m, n = query.shape[0], ref.shape[0]
    stride, step = max(1, m // SAMPLE_QUERIES), max(1, n // max(128, n // 128))
    qs, rs = query[::stride][:SAMPLE_QUERIES], ref[::step]
    # queries that are the points themselves (ball_query(p, p)): each ball holds its own point, once;
    # a sampled query that is a sampled point finds itself, which scaled as a share would add
    # n / len(rs) to every estimate
    same = query.data_ptr() == ref.data_ptr() and query.shape == ref.shape and query.stride() == ref.stride()
    selves = sum(1 for i in range(qs.shape[0]) if i * stride % step == 0 and i * stride // step < rs.shape[0]) if same else 0
    ids = [torch.zeros(t.shape[0], dtype=torch.int64) if group is None else group[::every][: t.shape[0]].to(torch.int64).contiguous()
           for t, group, every in ((qs, query_group, stride), (rs, ref_group, step))]
    squares = torch.tensor([r * r for r in radii], dtype=query.dtype)
    counts = np.zeros((qs.shape[0], len(radii)), dtype=np.int64)  # (NumPy's memory, torch's view of it: read without a torch read)
    vec = _warp.vec3(query.dtype)
    _warp.launch(_tally_kernel(query.dtype), qs.shape[0], [_warp.array(qs.contiguous(), dtype=vec), _warp.array(rs.contiguous(), dtype=vec), *ids,
                                                             squares, torch.from_numpy(counts)], like=query, work=qs.shape[0] * rs.shape[0])
    return [float(c - selves) * (n / rs.shape[0] / qs.shape[0]) + float(same) for c in counts.sum(0)]


# A batch's crowded balls take the tree, a sample at a time, where a sample's balls hold this many
# points together at least (its queries times a ball's points): below, a sample's own launches,
# gathers and scatters cost more than the walk saves on the batch's one cell-list launch
# (docs/benchmarks.md, design choices).
SAMPLE_WORK = 1 << 18
# Each query's first bound from the query before it on its CPU thread (its K-th distance plus the
# step between the two, widened as the kNN walk's): the K nearest are that near (tests turn it off)
CHAIN = [1]


def take(query, ref, query_group, ref_group, radii: list, ks: list, first: list, dists, idx, counts, host: list, validate: bool,
         heap_from: int) -> list:
    """The radii of a CPU ball search (:func:`._ball_search.search`: its outputs, columns
    ``first[g] ..`` of radius g, and extent ``host``) that are crowded (:func:`crowded`, in range:
    :func:`in_range`), searched on kd-trees (one cloud: :func:`search`; a batch: a tree a sample,
    :func:`search_groups`, judged by its samples' mean numbers of queries and points, once one
    sample of them all might be) into their columns and counts; none where the points are not
    all finite (``validate`` False: checked here)."""
    held = [None] * len(radii)

    def crowd(m: float, n: float) -> list:
        return [g for g in range(len(radii))
                if in_range(radii[g], query.dtype) and crowded(radii[g], ks[g], n, host, None if query_group is None else m, held[g])]

    chosen = crowd(query.shape[0], ref.shape[0])
    # the sample where it may add radii: one cloud's radii that the box left, or a batch's (judged again by its samples below)
    if query.shape[0] * ref.shape[0] >= SAMPLE_PAIRS and (query_group is not None or len(chosen) < sum(in_range(r, query.dtype) for r in radii)):
        held = sampled(query, ref, query_group, ref_group, radii)
        chosen = crowd(query.shape[0], ref.shape[0])
    samples = None
    if chosen and query_group is not None:
        samples = _samples(query_group, ref_group)
        points = dict(zip(*samples[1][1]))  # (each sample's points)
        shared = [(c, points[i]) for i, c in zip(*samples[0][1]) if i in points]  # (queries, points) of the samples with both
        chosen = crowd(sum(c for c, _ in shared) / len(shared), sum(c for _, c in shared) / len(shared)) if shared else []
    if not chosen or not (validate or bool(torch.isfinite(query).all() and torch.isfinite(ref).all())):
        return []
    rows = [(radii[g], g, dists[:, first[g]:first[g] + ks[g]], idx[:, first[g]:first[g] + ks[g]], counts) for g in chosen]
    if query_group is None:
        search(query, ref, rows, heap_from)
    else:
        search_groups(query, ref, samples, rows, heap_from)
    return chosen


def _samples(query_group: torch.Tensor, ref_group: torch.Tensor) -> tuple:
    """((order, (ids, counts)), (order, (ids, counts))) of the queries and the points of a batch:
    their stable sort by sample id and each id's run in it, on the host."""
    out = []
    for group in (query_group, ref_group):
        ids, order = torch.sort(group, stable=True)
        runs = [t.tolist() for t in torch.unique_consecutive(ids, return_counts=True)]  # (a host read)
        out.append((order, runs))
    return tuple(out)


def search(query: torch.Tensor, ref: torch.Tensor, rows: list, heap_from: int) -> None:
    """The balls of ``rows`` (radius, slot, dists (M, K) view, idx (M, K) view, counts) of
    finite CPU clouds on one kd-tree of ``ref``: their rows and ``counts[:, slot]`` written,
    rows of ``heap_from`` columns or more kept as heaps."""
    query, ref = query.contiguous(), ref.contiguous()  # (the tree's arrays: rows of three; the cell list takes strides)
    m = query.shape[0]
    beside, order_rows, ordered = _kdtree._cpu_query_order(query)
    points, order, _, lo, hi, _, _, axis, split, depth = _kdtree._tree(ref, None, beside, m)
    vec = lambda x: _warp.array(x, dtype=_warp.vec3(query.dtype))  # noqa: E731
    shared = [order_rows, vec(ordered), vec(points), order, vec(lo), vec(hi), axis, split]
    for radius, slot, dists, idx, counts in rows:
        ball = kernel(query.dtype, dists.shape[1] >= heap_from)
        _warp.launch(ball, m, [depth, float(radius), slot, *shared, dists, idx, counts, CHAIN[0]], like=query, min_chunk=_warp.QUERY_CHUNK)


def search_groups(query, ref, samples: tuple, rows: list, heap_from: int) -> None:
    """:func:`search` of a batch (``samples``: :func:`_samples` of its sample ids): each sample's
    queries and points gathered (in their order: the same ties), searched on a tree of their own,
    and their rows written back with the batch's indices; queries of a sample without points
    (and padding, whose ids differ) get empty rows (-1, inf, counts 0)."""
    (q_order, q_runs), (r_order, r_runs) = samples
    points = {}
    at = 0
    for sample, count in zip(*r_runs):
        points[sample] = (at, count)
        at += count
    sorted_query, sorted_ref = query.index_select(0, q_order), ref.index_select(0, r_order)
    at = 0
    for sample, count in zip(*q_runs):
        start, at = at, at + count
        if sample not in points:  # (rows the search's outputs leave unwritten: every row is written here or by a kernel)
            empty = q_order[start:at]
            for _, slot, dists, idx, counts in rows:
                dists[empty] = float("inf")
                idx[empty] = -1
                counts[empty, slot] = 0
            continue
        p0, n = points[sample]
        q_rows, r_rows = q_order[start:at], r_order[p0:p0 + n]
        mine = torch.zeros((count, rows[0][4].shape[1]), dtype=torch.int64)
        outs = [(radius, slot, dists.new_empty((count, dists.shape[1])), torch.empty((count, dists.shape[1]), dtype=torch.int64), mine)
                for radius, slot, dists, _, _ in rows]
        search(sorted_query[start:at], sorted_ref[p0:p0 + n], outs, heap_from)
        for (_, slot, dists, idx, counts), (_, _, found, local, _) in zip(rows, outs):
            dists[q_rows] = found
            idx[q_rows] = torch.where(local >= 0, r_rows[local.clamp(min=0)], -1)
            counts[q_rows, slot] = mine[:, slot]
