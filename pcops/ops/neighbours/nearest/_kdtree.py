"""kNN with Warp, on CPU and CUDA: a balanced kd-tree, searched per query with a short stack.

Build (Warp kernels on the CPU, O(N log N)): the reference points are copied (sorted by group
id for batches) and split recursively at the middle index: node ``i`` at depth ``d`` holds the
points ``N i / 2^d .. N (i + 1) / 2^d`` (integer division), and its two children are the
halves of that range, so no pointer is stored. A node's points are partitioned (quickselect)
along the widest axis of its bounding box so that its left half lies below the split value and
its right half above; a node whose range spans several groups is split between groups
instead (its points stay in group order). Every node stores its bounding box, its group range
(batches), its split axis and value. Leaves hold at most ``LEAF`` points. A split only has to
be exact for speed: the boxes are those of the points actually in each range, so a
partition stopped early (after ``_ROUNDS`` rounds, e.g. on adversarial inputs) keeps the
search exact; such a split is marked (axis + 3) and gives no plane bound. A CPU batch gets a
forest instead (``_forest``): each sample its own implicit tree over its points, the nodes of
the trees one after another, each query walking its own sample's tree; unless each sample is
one node of the batch's tree (equal samples, 2^j of them), where the two are the same. On GPUs, where the
top levels' splits would run on few threads, the same implicit tree is laid over the points in
Morton order instead (one sort, two launches: ``_ordered_tree``), every split marked so.

Search (one Warp thread per query, the queries in Morton order, see ``search``): from the root, the
query goes down to the child on its side of each split (the nearer child first), pushing each
farther child on its stack (at most one entry per depth) with a lower bound of its squared
distance: the largest squared distance to the split planes between it and the query (its points
lie beyond them). Then it pops the entries, skipping those whose bound already exceeds the
current k-th distance, and goes down from each in the same way. A node whose box is farther
than the current k-th distance (or holds no point of the query's group) is skipped too
(faster than a stackless walk back up through every parent: docs/benchmarks.md, design
choices). Each query keeps its k best
(squared distance, index) pairs in its output row by insertion, in the order of the distances
(squares a few ulps apart are compared by their roots, which may be equal), so the order is
exact, ties by the smaller index: a skipped box is farther than the k-th distance, so it cannot
even hold a tie. The roots are taken once, at the end (not a root per
insertion). On the CPU, where one thread runs a range of queries in order, a query starts from a
bound instead of infinity: the k-th distance of the query before it plus the step between the
two (its k neighbours are that near), widened for rounding and underflow (``_CHAIN``;
most useful on grid queries and surfaces (docs/benchmarks.md, design choices)). There a leaf's
points are measured on vectors in native code (``_VECTOR_LEAVES``, :func:`._scan_rows.native_leaf`;
batches of one tree per sample too), those within the bound inserted as the Warp loop would.
Memory is O(N + M).

A query with a non-finite coordinate finds nothing (idx -1, dist inf); a NaN or inf reference
point is never a neighbour (a NaN coordinate sorts as +inf in the splits), and every walk
ends: it visits each node at most once. The search writes every row whole (inf / -1 past what
it found): its outputs need no fill.

Small CPU searches (every pair measured in one slice, or a tree of at most ``_KEPT_POINTS``
points and queries) are kept by the calling thread (:func:`_kept_plan`), a plan for a range of
sizes (:func:`_plan_key`): a call that finds its plan has nothing to decide, and a self-query
(``ref is query``) walks the tree's own points in the tree's order (no query order to compute).
A kept tree's self-query also serves ``knn_graph``: its search then writes the graph's edges
from each row as the row is done (:func:`graph_edges`).

The loops over points (a leaf, a scan, a partition, the query order) are while loops: on the CPU, Warp's
``for j in range(a, b)`` costs more per step (docs/benchmarks.md, design choices).
"""

import functools
import itertools
import math
from typing import Optional

import torch
import warp as wp

from .... import _morton, _threads, _warp, _warp_funcs
from . import _scan_rows
from ._registry import backend

# Points per leaf at most (more than LEAF / 2): with the stack walk, faster than 32 or 8
# (docs/benchmarks.md, design choices).
LEAF = 16
_ROUNDS = 64  # partition rounds per split at most (an unfinished split slows the search only)
_GPU_BUILD = False  # True: the GPUs' build (:func:`_ordered_tree`) on the CPU too (tests)
_BITS = 10  # Morton bits per axis of the query order (torch sorts)
_CPU_BITS = 5  # at most, of the CPU's counting sort of ungrouped queries
_STACK = 32  # entries of a query's stack: one per depth at most (depth < 32 up to 2^35 points)
_PURE = 64  # added to a stack entry's depth: the node holds points of the query's group only
_CHAIN = True  # CPU: each query's first bound from the previous query's (tests compare with False)
# CPU: a leaf's points measured on vectors (:func:`._scan_rows.native_leaf`; tests compare with False)
_VECTOR_LEAVES = True
_SORT_QUERIES_ABOVE = 1 << 16  # reference points (per sample) above which grouped CPU queries go in Morton order
# Grouped CPU searches over a forest, a tree per sample (:func:`_forest`), unless each sample is
# a node of the batch's one tree; False: that tree always, split between samples where a node
# spans several, which cuts a sample across a node's middle into subtrees that each span all of
# it (the GPUs' way; tests compare both; docs/benchmarks.md, design choices)
FOREST = [True]
# CPU: at most this many (query, reference point) pairs are measured one by one (``_scan_kernel``)
# instead of building and searching the tree, fewer for k > 11 (the insertion of each point grows
# with k) and against a prepared small tree (:func:`scan_pairs`); the same result, one launch
# (docs/ops/knn.md; the crossover measured in docs/benchmarks.md, design choices)
SCAN_PAIRS = 1 << 17
_CPU_SLICES = 1  # ranges of the points per query in a CPU scan (tests: the CUDA scan's split on the CPU)
_SLICE_POINTS = 64  # points per thread at least in a split CUDA scan
_SCRATCH = 1 << 25  # entries of a split scan's partial rows at most


def _scans(m: int, n: int, k: int, cpu: bool = True, grouped: bool = False) -> bool:
    """Whether a search of m queries in n points for k neighbours measures every pair (on the
    CPU: :func:`scan_pairs`, or on CUDA: :func:`pcops._warp.cuda_scans`). A pair costs more with
    k (the insertion into longer rows), on CUDA faster than on the CPU: there the tree beat the
    scan from about 12,000^2 pairs at k = 16 and 45,000^2 at k = 3 (docs/benchmarks.md, GPU)."""
    if cpu:
        return m * n <= scan_pairs(m, n, k, grouped)
    return _warp.cuda_scans(m, n, max(1, (k * k) >> 4))


def scan_pairs(m: int, n: int, k: int, grouped: bool) -> int:
    """The most pairs a CPU search measures one by one: SCAN_PAIRS / (k^2 / 128) against a tree
    built and searched per call; against a prepared small tree (ungrouped, :func:`_small_tree`),
    which starts faster, SCAN_PAIRS * 5 / 8 for k up to 16 (the scan's rows on vectors,
    :mod:`._scan_rows`; 286 x 286 points) and SCAN_PAIRS / 8 / (k / 2) above (the crossovers
    measured in docs/benchmarks.md, design choices)."""
    if not grouped and not _GPU_BUILD and _warp.PREPARED[0] and _small_tree(m, n):
        return (SCAN_PAIRS >> 1) + (SCAN_PAIRS >> 3) if k <= 16 else (SCAN_PAIRS >> 3) // max(1, k >> 1)
    return SCAN_PAIRS // max(1, (k * k) >> 7)


@_warp.kernels
def _funcs(dtype: torch.dtype):
    """``key(p, a)``: coordinate a of p, NaN as +inf (a total order for the splits);
    ``sample_pivot(x0..x4, rank)``: the rank-th smallest of five keys."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)

    @wp.func(module="unique")
    def key(p: v, a: int):
        x = p[a]
        if x != x:
            x = s(wp.inf)
        return x

    @wp.func(module="unique")
    def sample_pivot(x0: s, x1: s, x2: s, x3: s, x4: s, rank: int):
        """The rank-th smallest (0..4) of five keys (a sorting network of nine exchanges)."""
        a, b = wp.min(x0, x1), wp.max(x0, x1)
        d, e = wp.min(x3, x4), wp.max(x3, x4)
        c, e = wp.min(x2, e), wp.max(x2, e)
        c, d = wp.min(c, d), wp.max(c, d)
        a, d = wp.min(a, d), wp.max(a, d)
        a, c = wp.min(a, c), wp.max(a, c)
        b, e = wp.min(b, e), wp.max(b, e)
        b, d = wp.min(b, d), wp.max(b, d)
        b, c = wp.min(b, c), wp.max(b, c)
        out = a
        if rank == 1:
            out = b
        elif rank == 2:
            out = c
        elif rank == 3:
            out = d
        elif rank >= 4:
            out = e
        return out

    return key, sample_pivot


@_warp.kernels
def chain_func(dtype: torch.dtype):
    """``chained(r, dq)``: the squared bound a CPU query's walk starts from, given the query
    before it on the same thread (its k-th distance r, inf where it found fewer than k, and the
    step dq between the two): its k neighbours are within r + |dq|, widened by relative rounding
    (16 eps), by an absolute term for squares below the smallest normal number, and by the walk's
    slack ((1 + 64 eps)^2): the kNN search's and the crowded balls' walk (``_ball_tree``)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    eps = torch.finfo(dtype).eps
    slack = s((1.0 + 64.0 * eps) ** 2)
    widen, reach0 = s(1.0 + 16.0 * eps), s(16.0 * math.sqrt(torch.finfo(dtype).tiny))

    @wp.func(module="unique")
    def chained(r: s, dq: v):
        reach = (r + wp.sqrt(wp.dot(dq, dq))) * widen + reach0
        return reach * reach * slack

    return chained


@_warp.kernels
def _search_kernel(dtype: torch.dtype, grouped: bool, forest: bool = False, vectors: bool = True):
    """``search``: a thread per query (see the module docs). ``forest``: a batch of per-sample
    trees (:func:`_forest_kernel`): ``query_group`` holds each query's tree (-1: none), which
    holds points ``tree_first[t] .. tree_first[t + 1] - 1`` and nodes from ``tree_node[t]`` on,
    its leaves at ``tree_depth[t]``; each query walks its own tree as an ungrouped search does.
    ``edge_k`` > 0 (a self-query's knn_graph through a kept tree, :func:`graph_edges`): query i
    also writes its row's first ``edge_k`` neighbours but itself (itself too with ``loop``) as
    edges (neighbour, i) into columns ``i edge_k ..`` of ``edges``, and sets ``cut[0]`` where it
    has fewer (what :func:`pcops.ops.neighbours.graph._rows_kernel` writes from the rows)."""
    _, finite_point = _warp_funcs.finite(dtype)
    fill = _warp_funcs.fill_row(dtype)
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    insert = _warp_funcs.sorted_insert(dtype, True)  # rows of squared distances (roots taken at the end)

    # A box (or point) is skipped only when its squared distance exceeds slack = (1 + 64 eps)^2
    # times the squared k-th distance: rounding (e.g. fused multiply-adds) never makes a box look
    # farther than a point inside it, nor a point farther than its rounded distance, and a
    # square whose root equals the k-th's (a tie) is still compared.
    slack = s((1.0 + 64.0 * torch.finfo(dtype).eps) ** 2)
    # The previous query's k-th distance r and the step dq between the two queries bound this
    # query's k-th distance by r + dq (its k neighbours are that near), widened (:func:`chain_func`).
    chained = chain_func(dtype)
    native_leaf = _scan_rows.native_leaf(dtype)
    below, above = _warp_funcs.root_band(dtype)  # (the insertion's)
    _nodes = wp.types.vector(length=_STACK, dtype=wp.int32)
    _bounds = wp.types.vector(length=_STACK, dtype=s)

    # One loop, no helper functions taking arrays: Warp passes arrays to functions by value,
    # and copying array descriptors per call costs more than the work itself.
    @wp.kernel(enable_backward=False, module="unique")
    def search(
        start: int,
        depth: int,
        rows: wp.array(dtype=wp.int64),
        query: wp.array(dtype=v),
        query_group: wp.array(dtype=wp.int32),
        points: wp.array(dtype=v),
        order: wp.array(dtype=wp.int64),
        point_group: wp.array(dtype=wp.int32),
        lo: wp.array(dtype=v),
        hi: wp.array(dtype=v),
        glo: wp.array(dtype=wp.int32),
        ghi: wp.array(dtype=wp.int32),
        axis: wp.array(dtype=wp.int32),
        split: wp.array(dtype=s),
        tree_first: wp.array(dtype=wp.int32),
        tree_node: wp.array(dtype=wp.int32),
        tree_depth: wp.array(dtype=wp.int32),
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
        chain: int,
        edges: wp.array2d(dtype=wp.int64),
        edge_k: int,
        loop: int,
        cut: wp.array(dtype=wp.int32),
    ):
        t = wp.tid() + start
        i = int(rows[t])
        q = query[t]  # the queries in the threads' order (query[t] is query rows[t], read directly, not through rows)
        k = dists.shape[1]
        n = int(0)
        g = int(0)
        alone = False  # a query of a sample without points (a forest's tree -1)
        if wp.static(grouped or forest):
            g = int(query_group[i])
        if wp.static(forest):
            alone = g < 0
        if not finite_point(q) or alone:
            fill(dists, idx, i, 0, k, s(wp.inf))  # (every row is written whole: the outputs need no fill)
            if edge_k > 0:  # (its edges: none)
                cut[0] = 1
            return
        npts = wp.int64(points.shape[0])
        p0 = int(0)  # the query's tree: its first point, first node and leaves' depth
        b0 = int(0)
        leaf = depth
        if wp.static(forest):
            p0 = int(tree_first[g])
            npts = wp.int64(tree_first[g + 1] - tree_first[g])
            b0 = int(tree_node[g])
            leaf = int(tree_depth[g])
        zero = v(s(0.0), s(0.0), s(0.0))
        bound = s(wp.inf)  # squared distance beyond which nothing can enter the row
        if chain != 0 and wp.tid() > 0:  # thread t - 1 ran before t on this CPU thread: its row is done
            prev = int(rows[t - 1])
            same = True  # (a query of another sample has other neighbours)
            if wp.static(grouped or forest):
                same = int(query_group[prev]) == g
            r = dists[prev, k - 1]  # a root: inf when that query found fewer than k (or was not finite)
            if same and r < s(wp.inf):
                bound = chained(r, q - query[t - 1])
        # The farther children not yet visited: node entry b (node ``node`` at depth d is entry
        # (1 << d) - 1 + node of the node arrays), depth (+ _PURE when it holds points of the
        # query's group only), and a lower bound of the squared distance to its points.
        stack_node = _nodes()
        stack_depth = _nodes()
        stack_bound = _bounds()
        top = int(1)  # the root: entry 0, depth 0, bound 0
        while top > 0:
            top = top - 1
            b = stack_node[top]
            d = stack_depth[top]
            floor = stack_bound[top]
            pure = d >= _PURE
            d = d % _PURE
            if floor > bound:
                continue
            while True:  # down to the leaf on the query's side, pushing the farther children
                if wp.static(grouped):
                    if not pure:  # this node's group range decides
                        lo_g, hi_g = glo[b], ghi[b]
                        if g < lo_g or g > hi_g:
                            break
                        pure = lo_g == hi_g
                if bound < s(wp.inf):
                    gap = wp.max(wp.max(lo[b0 + b] - q, q - hi[b0 + b]), zero)
                    if wp.dot(gap, gap) > bound:
                        break
                if d == leaf:  # a leaf: insert its points into the sorted row
                    node = b + 1 - (1 << d)
                    j0, j1 = p0 + _warp_funcs.part(node, npts, leaf), p0 + _warp_funcs.part(node + 1, npts, leaf)
                    j = j0
                    if wp.static(vectors and not grouped):  # the CPU's leaf on vectors (-1 in CUDA code)
                        held = native_leaf(q, points, order, j0, j1, dists, idx, i, n, bound, below, above, slack, s(wp.inf))
                        if held >= 0:
                            j = j1
                            n = held
                            if n == k:
                                bound = wp.min(bound, dists[i, k - 1] * slack)
                    while j < j1:
                        diff = q - points[j]
                        d2 = wp.dot(diff, diff)
                        ok = d2 <= bound and d2 < s(wp.inf)  # NaN / inf points are never neighbours
                        if wp.static(grouped):
                            ok = ok and (pure or int(point_group[j]) == g)
                        if ok:
                            n = insert(dists, idx, i, n, d2, order[j])
                            if n == k:  # a full row: nothing farther than its last (with slack) can enter
                                bound = wp.min(bound, dists[i, k - 1] * slack)
                        j += 1
                    break
                a = int(axis[b0 + b])
                side = int(0)
                far = floor
                if a >= 3:  # a split stopped early: no plane between the halves
                    side = int(q[a - 3] >= split[b0 + b])
                elif a >= 0:  # the farther child's points lie beyond the split plane
                    off = q[a] - split[b0 + b]
                    side = int(off >= s(0.0))
                    far = wp.max(floor, off * off)
                elif wp.static(grouped):  # a split between groups: the right child's first group
                    side = int(g >= glo[2 * b + 2])
                stack_node[top] = 2 * b + 2 - side
                stack_depth[top] = d + 1 + _PURE * int(pure)
                stack_bound[top] = far
                top = top + int(far <= bound)  # kept only if it may still hold a neighbour (no branch)
                b = 2 * b + 1 + side
                d = d + 1
        for c in range(n):
            dists[i, c] = wp.sqrt(dists[i, c])
        if edge_k > 0:  # knn_graph's edges: the row's first edge_k neighbours but the query itself (unless loop)
            if _warp_funcs.edge_row(idx, i, n, edge_k, loop, edges, wp.int64(i) * wp.int64(edge_k), wp.int64(edge_k)) < wp.int64(edge_k):
                cut[0] = 1  # a row cut short (a point not finite, squares that overflow): the caller's general path
        fill(dists, idx, i, n, k, s(wp.inf))  # inf / -1 where fewer than k were found

    return search


@_warp.kernels
def scan_row(dtype: torch.dtype, grouped: bool):
    """``row(q, qg, points, point_group, first, last, dists, idx, t) -> n``: the points ``first``
    .. ``last`` - 1 (of the query's group ``qg`` where ``grouped``) measured one by one from the
    query q and the k = dists.shape[1] best kept in row t with the tree search's insertion
    (squared distances; the row first set to inf / -1, and left so for a query that is not
    finite); returns how many it holds: the scan's (:func:`_scan_kernel`). (Chamfer's pass,
    :mod:`._costs`, keeps k = 1 with the same order: the same point.)"""
    _, finite_point = _warp_funcs.finite(dtype)
    fill = _warp_funcs.fill_row(dtype)
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    insert = _warp_funcs.sorted_insert(dtype, True)
    slack = s((1.0 + 64.0 * torch.finfo(dtype).eps) ** 2)  # as the tree search's: ties still compared
    below, above = _warp_funcs.root_band(dtype)  # (the insertion's)
    native = _scan_rows.native_row(dtype)

    @wp.func(module="unique")
    def row(q: v, qg: wp.int32, points: wp.array(dtype=v), point_group: wp.array(dtype=wp.int32), first: int, last: int,
            dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), t: int):
        if wp.static(not grouped):  # the CPU's row on vectors (-1 in CUDA code)
            held = native(q, points, first, last, dists, idx, t, below, above, slack, s(wp.inf))
            if held >= 0:
                return held
        k = dists.shape[1]
        fill(dists, idx, t, 0, k, s(wp.inf))
        n = int(0)
        if not finite_point(q):
            return n
        bound = s(wp.inf)
        j = first
        while j < last:
            diff = q - points[j]
            d2 = wp.dot(diff, diff)
            ok = d2 <= bound and d2 < s(wp.inf)  # NaN / inf points are never neighbours
            if wp.static(grouped):
                ok = ok and point_group[j] == qg
            if ok:
                n = insert(dists, idx, t, n, d2, wp.int64(j))
                if n == k:
                    bound = wp.min(bound, dists[t, k - 1] * slack)
            j += 1
        return n

    return row


@_warp.kernels
def _scan_kernel(dtype: torch.dtype, grouped: bool):
    """Small clouds: each query's reference points measured one by one (of its group), the k
    best kept in a row with the tree search's insertion (the same order: squared distances
    compared as their roots, ties by the smaller index), so the result is the tree's.

    ``scan``: thread t measures query t // slices against the t % slices-th of ``slices`` equal
    ranges of the points and keeps its k best in row t (inf / -1 where it found fewer; every
    row is written whole: the outputs need no fill), and, given a flag ``bad`` (one element;
    empty: no check), sets it to 1 where a query or point holds NaN or inf (the values check of
    a plain call, :func:`search_checked`: the threads look at every value between them); with one slice the row holds distances,
    with several squared distances, which ``merge`` (thread i: the rows of query i, in any
    order, since the insertion's order is total) turns into query i's row. Several slices
    spread a few queries over many GPU threads (:func:`_slices`)."""
    _, finite_point = _warp_funcs.finite(dtype)
    fill = _warp_funcs.fill_row(dtype)
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    insert = _warp_funcs.sorted_insert(dtype, True)
    slack = s((1.0 + 64.0 * torch.finfo(dtype).eps) ** 2)  # as the tree search's: ties still compared
    row = scan_row(dtype, grouped)
    flag = _warp_funcs.flag_not_finite(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def scan(
        start: int,
        slices: int,
        query: wp.array(dtype=v),
        query_group: wp.array(dtype=wp.int32),
        points: wp.array(dtype=v),
        point_group: wp.array(dtype=wp.int32),
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
        bad: wp.array(dtype=wp.int32),
    ):
        t = wp.tid() + start
        i = t // slices
        piece = wp.int64(t - i * slices)
        npts = wp.int64(points.shape[0])
        qg = wp.int32(0)
        if wp.static(grouped):
            qg = query_group[i]
        n = row(query[i], qg, points, point_group, int(npts * piece // wp.int64(slices)), int(npts * (piece + wp.int64(1)) // wp.int64(slices)),
                dists, idx, t)
        if slices == 1:
            for c in range(n):
                dists[t, c] = wp.sqrt(dists[t, c])
        if bad.shape[0] > 0:  # the values' check (a flag, not empty): thread t looks at its query and every rows-th point from t
            if piece == wp.int64(0) and not finite_point(query[i]):
                bad[0] = 1
            flag(points, t, points.shape[0], dists.shape[0], bad)

    @wp.kernel(enable_backward=False, module="unique")
    def merge(
        start: int,
        slices: int,
        found: wp.array2d(dtype=s),
        found_idx: wp.array2d(dtype=wp.int64),
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
    ):
        i = wp.tid() + start
        k = dists.shape[1]
        fill(dists, idx, i, 0, k, s(wp.inf))
        n = int(0)
        bound = s(wp.inf)
        for piece in range(slices):
            row = i * slices + piece
            for c in range(k):
                j = found_idx[row, c]
                d2 = found[row, c]
                if j >= wp.int64(0) and d2 <= bound:
                    n = insert(dists, idx, i, n, d2, j)
                    if n == k:
                        bound = wp.min(bound, dists[i, k - 1] * slack)
        for c in range(n):
            dists[i, c] = wp.sqrt(dists[i, c])

    return scan, merge


def _slices(m: int, n: int, k: int, cpu: bool) -> int:
    """Into how many ranges a scan splits each query's n points: one on the CPU (unless
    ``_CPU_SLICES``, tests), on CUDA enough for :data:`pcops._warp.CUDA_SCAN_THREADS` threads,
    each measuring at least ``_SLICE_POINTS`` points, the partial rows (m slices k) bounded."""
    if cpu:
        return max(1, min(_CPU_SLICES, n))
    return max(1, min(_warp.CUDA_SCAN_THREADS // max(m, 1), n // _SLICE_POINTS, _SCRATCH // max(m * k, 1)))


@_warp.kernels
def _split_func(dtype: torch.dtype):
    """``split_node(points, order, first, last, mid, lo, hi, rounds, axis, split, b)``: the split
    of one node of the build (see :func:`_build_kernels`)."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    key, sample_pivot = _funcs(dtype)
    widest = _warp_funcs.widest_axis(dtype)

    @wp.func(module="unique")
    def split_node(points: wp.array(dtype=v), order: wp.array(dtype=wp.int64), first: int, last: int, mid: int, l: v, h: v,
                   rounds: int, axis: wp.array(dtype=wp.int32), split: wp.array(dtype=s), b: int):
        """Node ``b`` (points first .. last - 1, box l .. h): its points split at ``mid`` along the
        widest axis of its box, and its axis and split value."""
        a = widest(h - l)
        # quickselect of the middle: each round moves the keys below a pivot (of
        # five spread samples, the one at the middle's relative rank) to the
        # front, then, if the middle is not there, the keys equal to it, unless
        # the middle is above them too and some key was below (counted in the
        # first pass: 10-13% fewer element visits); branch-free passes (every
        # element is swapped, the boundary moves by a comparison); every round
        # shrinks the range, so duplicates cannot stall it
        left = first
        rite = last
        r = int(0)
        while rite - left > 1 and r < rounds:
            span = rite - left
            pivot = sample_pivot(
                key(points[left], a),
                key(points[left + span // 4], a),
                key(points[left + span // 2], a),
                key(points[left + span // 4 * 3], a),
                key(points[rite - 1], a),
                int(wp.int64(5) * wp.int64(mid - left) // wp.int64(span)),  # no int32 overflow
            )
            for strict in range(2):
                fence = left
                equal = int(0)
                j = left
                while j < rite:
                    p = points[j]
                    o = order[j]
                    x = key(p, a)
                    below = x < pivot
                    if strict == 1:
                        below = x <= pivot
                    else:
                        equal = equal + int(x == pivot)
                    points[j] = points[fence]
                    order[j] = order[fence]
                    points[fence] = p
                    order[fence] = o
                    fence = fence + int(below)
                    j += 1
                if mid < fence:
                    rite = fence
                    if strict == 1:
                        left = rite  # the middle holds the pivot: done
                    break
                above = strict == 0 and mid >= fence + equal and fence > left
                left = fence
                if above:  # the middle is above the pivot's keys too, and the range shrank
                    break
            r = r + 1
        axis[b] = a + 3 * int(rite - left > 1)  # + 3: stopped early, no plane between the halves
        split[b] = key(points[mid], a)

    return split_node


@_warp.kernels
def _forest_kernel(dtype: torch.dtype):
    """``forest``: thread t builds the kd-tree of sample t of a batch, its own implicit tree over
    its points ``first[t] .. first[t + 1] - 1`` (sorted by sample), its nodes from ``node[t]``
    on, down to ``depth[t]``: the ungrouped build's boxes and splits (:func:`_build_kernels`);
    a sample of more than ``most`` points is left to the caller."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    box = _warp_funcs.bounds(dtype)
    split_node = _split_func(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def forest(start: int, rounds: int, most: int, first: wp.array(dtype=wp.int32), node: wp.array(dtype=wp.int32),
               depth: wp.array(dtype=wp.int32), points: wp.array(dtype=v), order: wp.array(dtype=wp.int64), lo: wp.array(dtype=v),
               hi: wp.array(dtype=v), axis: wp.array(dtype=wp.int32), split: wp.array(dtype=s)):
        t = wp.tid() + start
        p0 = int(first[t])
        n = wp.int64(first[t + 1] - first[t])
        if n > wp.int64(most):  # (built by the caller's launches)
            return
        b0 = int(node[t])
        leaf = int(depth[t])
        for e in range(leaf + 1):
            for c in range(1 << e):
                a, z = p0 + _warp_funcs.part(c, n, e), p0 + _warp_funcs.part(c + 1, n, e)
                b = b0 + (1 << e) - 1 + c
                l, h = box(points, a, z, 1)
                lo[b] = l
                hi[b] = h
                if e < leaf:
                    split_node(points, order, a, z, p0 + _warp_funcs.part(2 * c + 1, n, e + 1), l, h, rounds, axis, split, b)

    return forest


@_warp.kernels
def _build_kernels(dtype: torch.dtype):
    """Warp kernels of the build: the splits of the tree (nodes of one depth per thread range,
    each thread splitting its node's subtree down to a given depth), the Morton sort keys of
    the queries and their order on one thread (CPU)."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    key, sample_pivot = _funcs(dtype)
    box = _warp_funcs.bounds(dtype)
    _, morton = _warp_funcs.cells(dtype)

    split_node = _split_func(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def build(
        start: int,
        depth: int,
        last_depth: int,
        leaf_depth: int,
        rounds: int,
        points: wp.array(dtype=v),
        order: wp.array(dtype=wp.int64),
        groups: wp.array(dtype=wp.int32),
        grouped: int,
        lo: wp.array(dtype=v),
        hi: wp.array(dtype=v),
        glo: wp.array(dtype=wp.int32),
        ghi: wp.array(dtype=wp.int32),
        axis: wp.array(dtype=wp.int32),
        split: wp.array(dtype=s),
    ):
        """Node ``tid`` of ``depth`` and its descendants down to ``last_depth``: box, group
        range, and (above ``leaf_depth``) the split of its points at the middle index."""
        root = wp.tid() + start
        npts = wp.int64(points.shape[0])
        for e in range(depth, last_depth + 1):
            for c in range(1 << (e - depth)):
                node = (root << (e - depth)) + c
                b = (1 << e) - 1 + node
                first, last = _warp_funcs.part(node, npts, e), _warp_funcs.part(node + 1, npts, e)
                # (a NaN point is never a neighbour; a box of NaN points only is empty, and every
                # query skips it)
                l, h = box(points, first, last, 1)
                lo[b] = l
                hi[b] = h
                if grouped != 0:
                    glo[b] = groups[first]  # the points of a range are in group order, or of one group
                    ghi[b] = groups[last - 1]
                if e < leaf_depth:
                    mid = _warp_funcs.part(2 * node + 1, npts, e + 1)
                    if grouped != 0 and groups[first] != groups[last - 1]:
                        axis[b] = -1  # between groups (the right child's first group): the order stays
                        split[b] = s(0.0)
                    else:
                        split_node(points, order, first, last, mid, l, h, rounds, axis, split, b)

    @wp.kernel(enable_backward=False, module="unique")
    def keys(start: int, points: wp.array(dtype=v), frame: wp.array(dtype=s), spread: wp.array(dtype=wp.int32),
             out: wp.array(dtype=wp.int32)):
        """The Morton code of each point's cell in the frame (low corner, scale): cells 1 / scale
        wide, len(spread) a side (points outside in the border cells); ``spread``: the table of
        :func:`pcops._morton.spread_table`."""
        i = wp.tid() + start
        top = s(spread.shape[0] - 1)
        out[i] = morton(spread, (points[i] - v(frame[0], frame[1], frame[2])) * frame[3], top)

    @wp.kernel(enable_backward=False, module="unique")
    def order(start: int, points: wp.array(dtype=v), spread: wp.array(dtype=wp.int32), cells: wp.array(dtype=wp.int32),
              count: wp.array(dtype=wp.int32), rows: wp.array(dtype=wp.int64), ordered: wp.array(dtype=v)):
        """``rows``: the points in the Morton order of their cells (len(spread) a side on the
        box of about 1024 of them), by a stable counting sort on one thread, or as they are if
        they are in a spatial order already (half the steps between the first 4097 shorter than
        1/16 of the box's side: a grid, a sorted cloud); ``ordered``: the points in that order
        (``cells``: m, ``count``: len(spread)^3 + 1, scratch)."""
        m = points.shape[0]
        low, high = box(points, 0, m, wp.max(m // 1024, 1))  # a frame only
        ext = high - low
        side = wp.max(wp.max(ext[0], ext[1]), ext[2])
        near = int(0)
        steps = wp.min(m, 4097) - 1
        i = int(1)
        while i <= steps:
            d = wp.abs(points[i] - points[i - 1])
            near = near + int(wp.max(wp.max(d[0], d[1]), d[2]) < side / s(16.0))
            i += 1
        if 2 * near > steps:
            for i in range(m):
                rows[i] = wp.int64(i)
                ordered[i] = points[i]
            return
        top = s(spread.shape[0] - 1)
        scale = top / side  # inf or NaN (a box of one point or none): cell 0
        for c in range(count.shape[0]):
            count[c] = 0
        i = int(0)
        while i < m:
            c = morton(spread, (points[i] - low) * scale, top)
            cells[i] = c
            count[c + 1] = count[c + 1] + 1
            i += 1
        for c in range(1, count.shape[0]):
            count[c] = count[c] + count[c - 1]  # count[c]: the points in the cells before c
        i = int(0)
        while i < m:
            c = cells[i]
            rows[count[c]] = wp.int64(i)
            ordered[count[c]] = points[i]
            count[c] = count[c] + 1
            i += 1

    return build, keys, order


@_warp.kernels
def _ordered_kernels(dtype: torch.dtype):
    """The GPUs' build over points in (group, Morton) order (:func:`_ordered_tree`): ``boxes``
    (a thread per leaf: its box, and its coordinates into every ancestor's with atomic min /
    max) and ``splits`` (a thread per node: its group range, and which child a query visits
    first: the axis along which the right child's centre lies farthest above the left's, + 3,
    and the midpoint of the centres; no plane bound between the children)."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    box = _warp_funcs.bounds(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def boxes(start: int, depth: int, points: wp.array(dtype=v), lo: wp.array2d(dtype=s), hi: wp.array2d(dtype=s)):
        leaf = wp.tid() + start
        npts = wp.int64(points.shape[0])
        l, h = box(points, _warp_funcs.part(leaf, npts, depth), _warp_funcs.part(leaf + 1, npts, depth), 1)
        b = (1 << depth) - 1 + leaf
        for c in range(3):
            lo[b, c] = l[c]
            hi[b, c] = h[c]
        node = leaf
        for up in range(depth):
            node = node >> 1
            a = (1 << (depth - 1 - up)) - 1 + node
            for c in range(3):
                if l[c] <= h[c]:  # (NaN coordinates are left out of a box: none, none to add)
                    wp.atomic_min(lo, a, c, l[c])
                    wp.atomic_max(hi, a, c, h[c])

    @wp.kernel(enable_backward=False, module="unique")
    def splits(
        start: int,
        depth: int,
        npts: wp.int64,
        groups: wp.array(dtype=wp.int32),
        grouped: int,
        lo: wp.array(dtype=v),
        hi: wp.array(dtype=v),
        glo: wp.array(dtype=wp.int32),
        ghi: wp.array(dtype=wp.int32),
        axis: wp.array(dtype=wp.int32),
        split: wp.array(dtype=s),
    ):
        b = wp.tid() + start
        e = int(0)
        while (2 << e) - 1 <= b:
            e = e + 1
        node = b + 1 - (1 << e)
        first, last = _warp_funcs.part(node, npts, e), _warp_funcs.part(node + 1, npts, e)
        multi = False
        if grouped != 0:
            glo[b] = groups[first]  # the points are in group order
            ghi[b] = groups[last - 1]
            multi = groups[first] != groups[last - 1]
        if e < depth:
            if multi:
                axis[b] = -1  # between groups (the right child's first group)
                split[b] = s(0.0)
            else:
                d = (lo[2 * b + 2] + hi[2 * b + 2]) - (lo[2 * b + 1] + hi[2 * b + 1])  # twice the step between the centres
                a = int(0)
                if d[1] > d[a]:
                    a = 1
                if d[2] > d[a]:
                    a = 2
                axis[b] = a + 3
                split[b] = (lo[2 * b + 1][a] + hi[2 * b + 1][a] + lo[2 * b + 2][a] + hi[2 * b + 2][a]) * s(0.25)

    return boxes, splits


def _ordered_tree(ref: torch.Tensor, group, beside=None):
    """The GPUs' build (``_GPU_BUILD``: on the CPU too, for tests), in a number of launches
    independent of the size: the points in the (group, Morton) order of the queries'
    (:func:`_query_order`), one sort, then the same implicit tree over that order (node i of
    depth d holds the points N i / 2^d .. N (i + 1) / 2^d) with the boxes of its ranges (two
    launches, :func:`_ordered_kernels`). Its children are separated by no plane (axis + 3):
    the search prunes them by their boxes, which makes it exact whatever the order."""
    n, dev = ref.shape[0], ref.device
    if beside is not None:
        _warp.launch(beside[0], 1, beside[1], like=ref)
    order = _query_order(ref, group) if n else torch.arange(0, device=dev)
    points = ref[order]
    group = None if group is None else group[order].contiguous()
    depth = _depth(n)
    nodes = (2 << depth) - 1
    lo, hi = ref.new_full((nodes, 3), float("inf")), ref.new_full((nodes, 3), float("-inf"))
    glo, ghi = (torch.zeros(nodes if group is not None else 1, dtype=torch.int32, device=dev) for _ in range(2))
    axis = torch.full((nodes,), 3, dtype=torch.int32, device=dev)
    split = ref.new_zeros(nodes)
    if n:
        boxes, splits = _ordered_kernels(ref.dtype)
        vec = _warp.vec3(ref.dtype)
        leaves = 1 << depth
        # (one CPU chunk: the atomics of Warp's CPU kernels are not atomic across threads)
        _warp.launch(boxes, leaves, [depth, _warp.array(points, dtype=vec), lo, hi], like=ref, min_chunk=leaves)
        args = [depth, n, group if group is not None else glo, int(group is not None), _warp.array(lo, dtype=vec),
                _warp.array(hi, dtype=vec), glo, ghi, axis, split]
        _warp.launch(splits, nodes, args, like=ref)
    return points, order, group, lo, hi, glo, ghi, axis, split, depth


def _query_order(query: torch.Tensor, group) -> torch.Tensor:
    """The queries (or the GPUs' reference points) in (group, Morton code) order: neighbouring
    threads walk the same nodes. The frame is the box of the finite points (a NaN or inf point
    does not put every other into one cell); the others go to the border cells or cell 0."""
    finite = torch.isfinite(query).all(1, keepdim=True)
    low = torch.where(finite, query, float("inf")).amin(0)
    high = torch.where(finite, query, float("-inf")).amax(0)
    scale = (2**_BITS - 1) / (high - low).max().clamp_min(1e-30)
    frame = torch.cat([low, scale[None]])
    _, keys, _ = _build_kernels(query.dtype)
    code = torch.empty(query.shape[0], dtype=torch.int32, device=query.device)
    args = [_warp.array(query, dtype=_warp.vec3(query.dtype)), frame, _morton.spread_table(_BITS, query.device), code]
    _warp.launch(keys, query.shape[0], args, like=query)
    if group is None:
        return torch.sort(code).indices  # int32 keys: half the work of int64 ones
    return torch.sort(group.to(torch.int64) << 32 | code).indices


def _query_bits(m: int) -> int:
    """The bits per axis of the CPU's counting sort of m queries: about one cell per query, at most 2^_CPU_BITS a side."""
    return max(1, min(_CPU_BITS, round(math.log2(m + 1) / 3)))


def _cpu_query_order(query: torch.Tensor, capacity: Optional[int] = None):
    """((kernel, args), rows, ordered): the one-thread launch that writes the Morton order of
    the cells of CPU queries into ``rows`` (:func:`_query_bits` a side) and the queries in
    that order into ``ordered``; ``capacity``: their arrays hold that many queries (a kept
    plan's range of sizes), the first m passed."""
    m = query.shape[0]
    bits = _query_bits(m)
    room = m if capacity is None else capacity
    rows, ordered = torch.empty(room, dtype=torch.int64)[:m], query.new_empty(room, 3)[:m]
    scratch = [torch.empty(room, dtype=torch.int32)[:m], torch.empty((1 << 3 * bits) + 1, dtype=torch.int32)]
    vec = _warp.vec3(query.dtype)
    spread = _morton.spread_table(bits, query.device)
    args = [_warp.Typed(query, vec), spread, *scratch, rows, _warp.Typed(ordered, vec)]
    return (_build_kernels(query.dtype)[2], args), rows, ordered


def cpu_query_rows(query: torch.Tensor) -> torch.Tensor:
    """(M,) int64: ungrouped CPU queries (M, 3) in the order the search takes them
    (:func:`_cpu_query_order`, run on the calling thread): the order of other walks over the
    same queries (the mesh searches')."""
    (kernel, args), rows, _ = _cpu_query_order(query.contiguous())
    if query.shape[0]:
        _warp.launch(kernel, 1, args, like=query, kept=True)
    return rows


def _in_order(query: torch.Tensor) -> bool:
    """Whether consecutive queries already lie near each other (a grid, a sorted cloud): the
    median step between the first few thousand is under 1/16 of their box's largest side (a
    random order's is about 1/2). For the torch sort of grouped CPU queries; the ``order``
    kernel tests the same of ungrouped ones."""
    head = query[:4096]
    step = (head[1:] - head[:-1]).abs().amax(1).median()
    side = (head.amax(0) - head.amin(0)).amax()
    return bool(step < side / 16)


def _depth(n: int) -> int:
    """Depth of the leaves: the smallest d with at most LEAF points per leaf."""
    return _morton.leaf_depth(n, LEAF)


def _tree(ref: torch.Tensor, group, beside=None, queries: int = 0, depth: Optional[int] = None, in_order: Optional[bool] = None,
          serial_work: Optional[int] = None):
    """(points, order, groups, boxes lo/hi, group ranges glo/ghi, split axis/value, depth): the
    kd-tree of ``ref``, its points permuted in place into tree order (``order``: their indices).
    ``beside``: (kernel, args) of a one-thread launch over ``queries`` points run with the split
    of the root. ``depth``: of the leaves (default: at most LEAF points each); ``in_order``:
    whether ``group`` is sorted (None: read it; given, trusted); ``serial_work``: see
    :func:`build_steps`."""
    dev, n = ref.device, ref.shape[0]
    if dev.type != "cpu" or _GPU_BUILD:
        return _ordered_tree(ref, group, beside)
    # points in group order (padded batches are already)
    if in_order is None:
        in_order = group is None or bool((group[1:] >= group[:-1]).all())
    if in_order:
        order, points = torch.arange(n, device=dev), ref.clone()
    else:
        group, order = torch.sort(group, stable=True)
        points = ref[order]
    depth = _depth(n) if depth is None else depth
    nodes = (2 << depth) - 1
    lo, hi = ref.new_empty((nodes, 3)), ref.new_empty((nodes, 3))
    glo, ghi = (torch.empty(nodes if group is not None else 1, dtype=torch.int32, device=dev) for _ in range(2))
    axis = torch.empty(nodes, dtype=torch.int32, device=dev)
    split = ref.new_empty(nodes)
    vec = _warp.vec3(ref.dtype)
    args = [_warp.array(points, dtype=vec), order, group if group is not None else glo, int(group is not None),
            _warp.array(lo, dtype=vec), _warp.array(hi, dtype=vec), glo, ghi, axis, split]
    _launch_build(args, n, depth, ref, beside, queries, serial_work)
    return points, order, group, lo, hi, glo, ghi, axis, split, depth


def _launch_build(args: list, n: int, depth: int, like: torch.Tensor, beside=None, queries: int = 0, serial_work: Optional[int] = None):
    """The build's launches (:func:`build_steps`) of a tree of n points with leaves at ``depth``
    on its arrays ``args`` (the build kernel's, from ``points`` on); ``beside`` with the root's."""
    build = _build_kernels(like.dtype)[0]
    steps, work = build_steps(n, depth, queries, serial_work)
    for d, last in steps:
        _warp.launch(build, 1 << d, [d, last, depth, _ROUNDS, *args], like=like, min_chunk=1, beside=beside if d == 0 else None, work=work)


def prepared_split(points: torch.Tensor, order: torch.Tensor, depth: int, queries: int = 0, one_launch: bool = False,
                   serial_work: Optional[int] = None):
    """(launches, (lo, hi, glo, ghi, axis, split)) of the CPU build of an ungrouped kd-tree of
    ``points`` (N, 3), kept for builds of the same shapes (a caller that sets each call's
    lengths: of every size up to its arrays'): its launches (:func:`build_steps`, with
    ``queries`` ordered beside, ``serial_work``; ``one_launch``: one launch on one thread whatever the size)
    prepared (:class:`pcops._warp.Prepared`; ``order`` the argument a call points at its own (N,)
    int64 indices, 0..N-1 in, the tree's order out; ``points`` permuted in place) and the arrays
    they write; None where it is not prepared (a kernel's first run, or the GPUs' build switch)."""
    if _GPU_BUILD:
        return None
    vec = _warp.vec3(points.dtype)
    nodes = (2 << depth) - 1
    with torch.inference_mode(False):  # (arrays the launches write: never inference tensors)
        lo, hi, split = points.new_empty((nodes, 3)), points.new_empty((nodes, 3)), points.new_empty(nodes)
        glo, ghi, axis = torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.int32), torch.empty(nodes, dtype=torch.int32)
    args = [_warp.array(points, dtype=vec), order, glo, 0, _warp.array(lo, dtype=vec), _warp.array(hi, dtype=vec), glo, ghi, axis, split]
    steps, work = ([(0, depth)], 0) if one_launch else build_steps(points.shape[0], depth, queries, serial_work)
    kernel = _build_kernels(points.dtype)[0]
    launches = tuple(_warp.prepare(kernel, 1 << d, [d, last, depth, _ROUNDS, *args], work=work) for d, last in steps)
    if any(launch is None for launch in launches):
        return None
    return launches, (lo, hi, glo, ghi, axis, split)


def kept_state() -> tuple:
    """What decides a kept CPU search's or split's launches besides its shapes (:func:`_plan_state`)."""
    return _plan_state()


def build_steps(n: int, depth: int, queries: int = 0, serial_work: Optional[int] = None) -> tuple[list[tuple[int, int]], int]:
    """([(depth, last depth)] of the CPU build's launches of n points, its work estimate): one
    launch per depth down to where there is a subtree for every CPU thread, then one thread per
    subtree does the rest (faster than one thread, or several subtrees per thread, whose
    launches cost more than they balance (docs/benchmarks.md, design choices)); a small tree
    (its work, with ``queries`` ordered beside it, under :data:`pcops._warp.SERIAL_WORK`, or under
    ``serial_work`` where the caller gives one: the mesh hierarchy's split) is built by one thread
    in one launch; the work returned is then at least the launches' own threshold, so that they
    run their subtrees on the threads."""
    work = n * max(depth, 1) + queries
    parallel = work >= (_warp.SERIAL_WORK if serial_work is None else serial_work)
    serial = min(depth, (_threads.requested() - 1).bit_length()) if parallel else 0
    steps = []
    for d in range(depth + 1):
        steps.append((d, d if d < serial else depth))
        if steps[-1][1] == depth:
            break
    return steps, max(work, _warp.SERIAL_WORK) if parallel else work


def split_order(points: torch.Tensor, group: torch.Tensor, leaf: int, one: bool = False, serial_work: Optional[int] = None) -> torch.Tensor:
    """(N,) int64: points (N, 3) of the CPU in the build's order (the module docs), with leaves
    of at most ``leaf`` points: by sample id ``group`` (N,) (stable; ``one``: every id the same, the
    same order without the sort, on the CPU build), each node's range split at
    its middle index along the widest axis of its points' box (a node spanning samples between
    them; a split the quickselect stops after ``_ROUNDS`` rounds only partly ordered), so node i
    of depth d holds rows N i / 2^d .. N (i + 1) / 2^d of the order. (Elsewhere than on the CPU,
    or with ``_GPU_BUILD``, the GPUs' Morton order, whatever ``leaf``.) ``serial_work``: see
    :func:`build_steps`."""
    n = points.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=points.device)
    depth = _morton.leaf_depth(n, leaf)
    if one:
        return _tree(points, None, depth=depth, in_order=True, serial_work=serial_work)[1]
    ranks = torch.unique(group, return_inverse=True)[1].to(torch.int32)  # the build's int32 ids: each sample's rank
    return _tree(points, ranks, depth=depth, in_order=False, serial_work=serial_work)[1]  # (its stable sort by sample)


def _small_tree(m: int, n: int) -> bool:
    """Whether the CPU build of n points with m queries runs on the calling thread in one launch
    (its work under :data:`pcops._warp.SERIAL_WORK`: :func:`_tree`) in a kept plan."""
    return n * max(_depth(n), 1) + m < _warp.SERIAL_WORK and m + n <= _KEPT_POINTS


# The most points and queries (together) of a search kept as a :class:`_SmallTree`: its kept
# arrays, about 60 bytes a query or point at their capacities (at most twice the sizes), under
# two megabytes, with output templates of at most :data:`_KEEP_OUTPUTS` entries (at most 0.5 MB)
# beside them; a thread keeps them within :data:`pcops._warp.KEEP_BYTES` with its other kept
# launches.
_KEPT_POINTS = 1 << 14


class _SmallTree:
    """The calling thread's search of m queries in n CPU points (ungrouped, m + n at most
    :data:`_KEPT_POINTS`) as prepared launches (:class:`pcops._warp.Prepared`), with the tree's
    arrays kept: ``load`` copies the points (and their indices) into the arrays the build
    permutes and checks the values, then the queries' order (not for a self-query, whose queries
    are the tree's own points in the tree's order), the build (one launch or several:
    :meth:`make`) and the search, which is cut as
    :func:`pcops._warp.launch` cuts it. The kernels of :func:`find`'s own path for such a search,
    so the same neighbours (the search's result does not depend on the queries' order).

    One plan serves every size of its key (:func:`_plan_key`): the trees of one depth (n up to
    ``LEAF << depth``) and queries up to the next power of two, whose launches are cut alike.
    Its arrays are kept at those capacities, and a call of other sizes than the last sets the
    lengths its launches' kernels read (each array's shape) and the search's threads
    (:meth:`pcops._warp.Prepared.resize`): a stream of clouds of sizes never seen before meets
    kept plans (docs/benchmarks.md, small clouds)."""

    __slots__ = ("state", "same", "k", "launches", "fields", "flag", "dists", "idx", "rows", "keep", "lengths", "sizes", "edges")

    @classmethod
    def make(cls, query, ref, k: int, pair: bool = False):
        """The search of queries like ``query`` in points like ``ref`` for k neighbours; None
        before the build's and the search's kernels have run once (through :func:`find`'s own
        path). The build's launches are :func:`_tree`'s (:func:`build_steps`: one thread for a
        small tree, else the root's splits, then a subtree a thread); ``pair``: one launch on
        one thread whatever the size (:func:`find_both` runs two side by side)."""
        self = cls()
        m, n = query.shape[0], ref.shape[0]
        self.same, self.k = ref is query, k
        depth = _depth(n)
        vec = _warp.vec3(ref.dtype)
        with torch.inference_mode(False):  # (kept arrays a call writes: never inference tensors)
            points, order = ref.new_empty((LEAF << depth, 3))[:n], torch.empty(LEAF << depth, dtype=torch.int64)[:n]
            self.dists, self.idx = _outputs(query if m * k <= _KEEP_OUTPUTS else query[:0], k)  # (output templates: :func:`_plan_outputs`)
        self.rows = self.dists.shape[0]
        self.flag = _warp.values_flag()
        load_args = [_warp.array(ref, dtype=vec), _warp.array(ref[:0] if self.same else query, dtype=vec),
                     _warp.array(points, dtype=vec), order, self.flag[0]]
        load = _load_kernel(ref.dtype)
        _warp.launch(load, 1, load_args, like=ref, work=0)  # (its first run loads it)
        tree = prepared_split(points, order, depth, m, one_launch=pair)
        if tree is None:
            return None
        builds, (lo, hi, glo, ghi, axis, split) = tree
        dummy = _no_group(query.device)[1]
        if self.same:
            rows, ordered, order_launch = order, points, None
        else:
            (order_kernel, order_args), rows, ordered = _cpu_query_order(query, _warp.capacity(m))
            order_launch = _warp.prepare(order_kernel, 1, order_args, work=0)
            if order_launch is None:
                return None
        search = [depth, rows, _warp.array(ordered, dtype=vec), dummy, _warp.array(points, dtype=vec), order, dummy,
                  _warp.array(lo, dtype=vec), _warp.array(hi, dtype=vec), glo, ghi, axis, split, dummy, dummy, dummy, *_outputs(query, k), int(_CHAIN),
                  _no_edges(query.device)[1], 0, 0, self.flag[0]]
        self.launches = (_warp.prepare(load, 1, load_args, work=0), order_launch, builds,
                         _warp.prepare(_search_kernel(query.dtype, False, False, _VECTOR_LEAVES), m, search, work=None, min_chunk=_warp.QUERY_CHUNK))
        if self.launches[0] is None or self.launches[3] is None:
            return None
        self.keep = (points, order, rows, ordered, lo, hi, glo, ghi, axis, split, order_args if order_launch else None)
        self.fields = (self.launches[0].fields("ref") if self.same else self.launches[0].fields("ref", "query"),
                       None if self.same else order_launch.fields("points"), (), self.launches[3].fields("dists", "idx"))
        # the lengths each call sets: the points' (n), then the queries' (m; a self-query's: n)
        load_lengths = (("ref", "points", "order"), () if self.same else ("query",))
        self.lengths = (*self.launches[0].lengths(*load_lengths),
                        *(() if self.same else order_launch.lengths((), ("points", "cells", "rows", "ordered"))),
                        *(field for build in builds for field in build.lengths(("points", "order"))),
                        *self.launches[3].lengths(("points", "order"), ("rows", "query", "dists", "idx")))
        self.sizes = (n, m)
        self.edges = None  # (fields, lengths) of the search's edges arguments (:meth:`run_edges`), found at its first run
        return self

    def held(self) -> int:
        """The bytes this plan holds (:meth:`pcops._warp.Kept.put`)."""
        launches = (self.launches[0], self.launches[1], *self.launches[2], self.launches[3])
        return _warp.held_bytes(self.keep, self.dists, self.idx) + sum(launch.held() for launch in launches if launch is not None)

    def run(self, query, ref, dists, idx, sizes: tuple):
        """Search ``query`` in ``ref`` (``sizes``: their lengths, n and m) into ``dists``, ``idx``;
        the values flag (a NumPy view of one int32): 1 where a value of either is NaN or inf."""
        flag = self.built(query, ref, sizes)
        self.launches[3].run_at(self.fields[3], dists, idx)
        return flag

    def built(self, query, ref, sizes: tuple):
        """:meth:`load`, then the tree's build: what comes before the search; the flag."""
        flag = self.load(query, ref, sizes)
        for build in self.launches[2]:
            build.run_at(())
        return flag

    def run_edges(self, points, dists, idx, edges, k: int, loop: bool):
        """:meth:`run` of a self-query (n points, this plan's k neighbours each) that also writes
        knn_graph's edges: each point's first ``k`` neighbours but itself (itself too with
        ``loop``) into ``edges`` (2, n k), from the search's own rows (no launch after it); the
        values flag: 1 where a value is NaN or inf or a row gave fewer than k edges (the edges
        are then not the op's). The search's edge count is put back to 0 after it."""
        n = points.shape[0]
        flag = self.built(points, points, (n, n))
        search = self.launches[3]
        if self.edges is None:
            self.edges = (search.fields("dists", "idx", "edges"), search.lengths((("edges", 1),), (("edges", 0, "strides"),)))
        fields, lengths = self.edges
        search.resize(lengths, n * k, 8 * n * k)
        search.put("edge_k", k)
        search.put("loop", int(loop))
        try:
            search.run_at(fields, dists, idx, edges)
        finally:
            search.put("edge_k", 0)  # (the plan's plain searches write no edges)
        return flag

    def load(self, query, ref, sizes: tuple):
        """The launches set to these ``sizes`` (n, m; where they differ from the last call's), the
        values flag reset, the points loaded (their values checked) and the queries ordered:
        what comes before the build; the flag."""
        if sizes != self.sizes:
            self.sizes = sizes
            self.launches[3].resize(self.lengths, *sizes, threads=sizes[1])  # (every launch's lengths)
        flag = self.flag[1]
        flag[0] = 0
        load, order = self.launches[:2]
        if self.same:
            load.run_at(self.fields[0], ref)
        else:
            load.run_at(self.fields[0], ref, query)
            order.run_at(self.fields[1], query)
        return flag


# A kept tree keeps output templates (for ``torch.empty_like``) of at most this many entries
# (larger outputs are allocated by shape: their search costs far more than the allocation)
_KEEP_OUTPUTS = 1 << 15


def _outputs(query, k: int) -> tuple:
    """New (dists, idx) outputs (M, k) of a search of ``query``."""
    return query.new_empty(query.shape[0], k), torch.empty(query.shape[0], k, dtype=torch.int64, device=query.device)


@_warp.kernels
def _load_kernel(dtype: torch.dtype):
    """``load``: one thread copies ``ref`` into ``points`` and 0..n-1 into ``order`` (the arrays a
    small tree's build permutes) and sets ``bad[0]`` to 1 where a value of ``ref`` or ``query`` is
    NaN or inf (a plain call's values check)."""
    _, finite_point = _warp_funcs.finite(dtype)
    v = _warp.vec3(dtype)
    flag = _warp_funcs.flag_not_finite(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def load(start: int, ref: wp.array(dtype=v), query: wp.array(dtype=v), points: wp.array(dtype=v), order: wp.array(dtype=wp.int64),
             bad: wp.array(dtype=wp.int32)):
        n = ref.shape[0]
        j = int(0)
        while j < n:
            p = ref[j]
            points[j] = p
            order[j] = wp.int64(j)
            if not finite_point(p):
                bad[0] = 1
            j += 1
        flag(query, 0, query.shape[0], 1, bad)

    return load


@functools.cache
def _no_group(device: torch.device):
    """(tensor, its Warp view): the group argument of an ungrouped search (never read), one per
    device, kept alive here and converted once."""
    zeros = torch.zeros(1, dtype=torch.int32, device=device)
    return zeros, _warp.array(zeros)


@functools.cache
def _no_edges(device: torch.device) -> tuple:
    """(tensor, its Warp view): the edges argument of a search that writes none (its ``edge_k``
    0: never read; :func:`graph_edges` writes knn_graph's), one per device, converted once."""
    empty = torch.empty((2, 0), dtype=torch.int64, device=device)
    return empty, _warp.array(empty)


class _Scan:
    """The calling thread's prepared scan (:class:`pcops._warp.Prepared`) of queries in points for
    k neighbours (one slice, every pair measured), with what a call needs at hand: the pointer
    fields of its four array arguments, its values flag (a NumPy view of one int32), output
    templates (:func:`_plan_outputs`) and ``state`` (:func:`_plan_state`). One scan serves every
    size its key names (:func:`_plan_key`: the scans cut into as many chunks): a call of other
    sizes than the last sets its arrays' lengths and threads."""

    __slots__ = ("state", "k", "launch", "fields", "flag", "dists", "idx", "rows", "lengths", "sizes")

    @classmethod
    def make(cls, query, ref, k: int):
        """The scan of queries like ``query`` in points like ``ref``; None before its kernel has run once."""
        self = cls()
        self.k = k
        vec = _warp.vec3(query.dtype)
        flag = _warp.values_flag()
        self.dists, self.idx = _outputs(query, k)
        self.rows = query.shape[0]
        args = [1, _warp.array(query, dtype=vec), _no_group(query.device)[1], _warp.array(ref, dtype=vec), _no_group(query.device)[1],
                self.dists, self.idx, flag[0]]
        self.launch = _warp.prepare(_scan_kernel(query.dtype, False)[0], query.shape[0], args, work=query.shape[0] * ref.shape[0], keep=flag)
        if self.launch is None:
            return None
        self.fields, self.flag = self.launch.fields("query", "points", "dists", "idx"), flag[1]
        self.lengths, self.sizes = self.launch.lengths(("points",), ("query", "dists", "idx")), (ref.shape[0], query.shape[0])
        return self

    def held(self) -> int:
        """The bytes this plan holds (:meth:`pcops._warp.Kept.put`)."""
        return _warp.held_bytes(self.dists, self.idx) + self.launch.held()

    def run(self, query, ref, dists, idx, sizes: tuple):
        if sizes != self.sizes:
            self.sizes = sizes
            self.launch.resize(self.lengths, *sizes, threads=sizes[1])
        flag = self.flag
        flag[0] = 0
        self.launch.run_at(self.fields, query, ref, dists, idx)
        return flag


def _plan_state() -> tuple:
    """What decides a search's path, chunks and launches besides its shapes: the caller's thread
    count and the module's switches (which tests change)."""
    return (_threads.requested(), SCAN_PAIRS, _CPU_SLICES, _GPU_BUILD, LEAF, _warp.SERIAL_WORK, _CHAIN, _ROUNDS, _CPU_BITS, _VECTOR_LEAVES)


def _kept_plan(query, ref, k: int, slot: int = 0):
    """The calling thread's kept plan (:class:`_Scan` or :class:`_SmallTree`, in
    :data:`pcops._warp.KEPT`) of ``query`` (m, 3) in ``ref`` (n, 3) (contiguous CPU points,
    ungrouped) for k neighbours, kept by the range of sizes it serves (:func:`_plan_key`),
    dtype and whether ``ref is query`` (and
    ``slot``: 0 for :func:`find`'s, 1 and 2 for :func:`find_both`'s two, whatever their shapes)
    and made under the same :func:`_plan_state`: a caller that finds one has nothing to decide.
    None where there is none (or launches are not prepared: :data:`pcops._warp.PREPARED`)."""
    if not _warp.PREPARED[0]:
        return None
    state = _plan_state()
    key = _plan_key(query, ref, k, slot, state)
    plan = None if key is None else _warp.KEPT.get(key)
    return plan if plan is not None and plan.state == state else None


def _plan_key(query, ref, k: int, slot: int, state: Optional[tuple] = None) -> Optional[tuple]:
    """The key of the kept plan of a search (:func:`_kept_plan`), None where none is kept (a
    scan in more than one slice, a tree of more than :data:`_KEPT_POINTS` points and queries, the
    GPUs' build), by the range of sizes its plan serves: a scan's (:class:`_Scan`) by its
    chunks, a tree's (:class:`_SmallTree`) by the depth of its leaves, the queries' capacity,
    the query order's bits, the search's chunks and whether the build runs on one thread, all
    as :func:`find` decides them for these sizes, so that one plan runs the launches find
    would. Remembered for up to :data:`_KEYS_KEPT` shapes, each under the :func:`_plan_state`
    it was worked out in."""
    shapes, state = (query.shape[0], ref.shape[0], k, query.dtype, ref is query, slot), state or _plan_state()
    found = _KEYS.get(shapes)
    if found is None or found[0] != state:
        if len(_KEYS) >= _KEYS_KEPT:
            _KEYS.clear()
        found = _KEYS[shapes] = (state, _new_key(*shapes))
    return found[1]


_KEYS: dict = {}
_KEYS_KEPT = 4096


def _new_key(m: int, n: int, k: int, dtype: torch.dtype, same: bool, slot: int) -> Optional[tuple]:
    """:func:`_plan_key`, worked out (none without queries: a kept plan of no threads would check no value)."""
    if not m:
        return None
    if _scans(m, n, k):  # (the chunks :class:`_Scan`'s launch is cut into)
        return ("knn scan", _warp.chunk_count(m, m * n, 1), k, dtype, same, slot) if _slices(m, n, k, True) == 1 else None
    if _GPU_BUILD or m + n > _KEPT_POINTS:
        return None
    depth = _depth(n)
    chunks = _warp.chunk_count(m, None, _warp.QUERY_CHUNK)  # (the search's: :class:`_SmallTree`)
    return ("knn tree", depth, _warp.capacity(m), 0 if same else _query_bits(m), chunks, n * max(depth, 1) + m < _warp.SERIAL_WORK, k, dtype, same, slot)


def _new_plan(query, ref, k: int, slot: int = 0, pair: bool = False):
    """A plan (see :func:`_kept_plan`) made and kept for the search :func:`find` decides for these
    points: a scan in one slice (:func:`_scans`) or a kd-tree of at most :data:`_KEPT_POINTS`
    points and queries (a :class:`_SmallTree`; ``pair``: one of :func:`find_both`'s); None for
    any other search, where launches are not prepared, on the first miss of its key
    (:meth:`pcops._warp.Kept.admit`) or before its kernels' first run."""
    if not _warp.PREPARED[0] or not query.shape[0]:
        return None
    key = _plan_key(query, ref, k, slot)
    if key is None or not _warp.KEPT.admit(key):
        return None
    plan = _Scan.make(query, ref, k) if key[0] == "knn scan" else _SmallTree.make(query, ref, k, pair=pair)
    if plan is None:
        return None
    plan.state = _plan_state()
    _warp.KEPT.put(key, plan, plan.held())
    return plan


def _contiguous(query, ref) -> tuple:
    """``query`` and ``ref`` contiguous, one tensor where they were one (a cloud searched in
    itself stays one: a non-contiguous cloud would otherwise become two copies)."""
    contiguous = query.contiguous()
    return contiguous, contiguous if ref is query else ref.contiguous()


def search_checked(query, ref, k):
    """(dists, idx) of :func:`find` for plain CPU points (M, 3), (N, 3) of one dtype, ``k`` in
    1..N, with their values checked in the search's own launches; False where a value is NaN or
    inf (nothing returned); None where the search is not the calling thread's kept plan (no
    query, a search that is neither a one-slice scan nor a small tree, or sizes whose plan
    :func:`find` has not kept yet: nothing ran, the caller checks the values and calls
    :func:`find`, which makes the plan on its key's second sighting). The plain calls' values
    check without a torch reduction and read."""
    query, ref = _contiguous(query, ref)
    plan = _kept_plan(query, ref, k)  # kept: nothing to decide
    if plan is None:
        return None
    dists, idx, bad = _run_kept(plan, query, ref)
    return (dists, idx) if not bad else False


def find_both(x, y, k: int):
    """(idx (M, k) of x's points' k nearest in y, idx (N, k) of y's in x, whether a value of
    either is NaN or inf) of contiguous plain CPU clouds (M, 3), (N, 3) of one dtype, as
    :func:`find` finds each, where both searches are the calling thread's kept trees (kept, or
    made now: up to :data:`_KEPT_POINTS` points and queries each): their loads (which check the
    values) and orders run first, then their builds in one fork-join (a thread each, one launch
    each, whatever the size: past one thread's small trees this beats building each tree on
    every thread in turn, docs/benchmarks.md, design choices) and their searches in another; None
    for any other pair of searches (nothing ran: the caller calls :func:`find` each way)."""
    if x is y or not x.shape[0] or not y.shape[0]:
        return None
    _warp.init()
    plans = []
    for slot, (query, ref) in enumerate(((x, y), (y, x)), 1):  # (slots 1 and 2: two plans, whatever the shapes, apart from find's)
        plan = _kept_plan(query, ref, k, slot) or _new_plan(query, ref, k, slot, pair=True)
        if plan is not None and not isinstance(plan, _SmallTree):
            return None
        plans.append(plan)  # (None: not made yet, both sighted)
    a, b = plans
    if a is None or b is None:
        return None
    m, n = x.shape[0], y.shape[0]
    bad = a.load(x, y, (n, m))[0] | b.load(y, x, (m, n))[0]
    _warp.run_together((*a.launches[2], *b.launches[2]))  # (a pair's build: one launch each)
    out = []  # (dists and idx alive until the searches ran: the launches hold their addresses only)
    for plan, query in ((a, x), (b, y)):
        out.append(_plan_outputs(plan, query.shape[0]))
        plan.launches[3].point(plan.fields[3], *out[-1])
    _warp.run_together((a.launches[3], b.launches[3]))
    return out[0][1], out[1][1], bool(bad)


# knn_graph's edges at most that a kept tree's search writes itself (:func:`graph_edges`): it
# writes each point's row where its query ends, in the tree's order, scattered over the table;
# beyond a table of about an L2 cache a launch of its own, writing rows in order, costs less
# (docs/benchmarks.md, design choices)
GRAPH_EDGES = 1 << 14
# ... and from this many points on: smaller clouds are mostly searched by a scan (k + 1 up to 9 at
# 64 points), and the edges' own launch after the search costs about as much as telling which
GRAPH_FROM = 64


def graph_edges(points, k: int, loop: bool):
    """(edge_index (2, N k), whether to drop it) of a plain ``knn_graph`` of a plain CPU cloud
    (N, 3) whose search of k (+ 1 unless ``loop``) neighbours a point is the calling
    thread's kept small tree, for more than :data:`GRAPH_FROM` points and at most
    :data:`GRAPH_EDGES` edges: the search writes them
    itself (:meth:`_SmallTree.run_edges`: no launch after it, no rows read back);
    dropped where a value is NaN or inf or a row gave fewer than k edges (the caller's general
    path decides). None where the search is not such a kept tree (nothing ran: the caller
    searches and writes the edges as before)."""
    n, search = points.shape[0], k + (0 if loop else 1)
    if n <= GRAPH_FROM or n * k > GRAPH_EDGES or _scans(n, n, search):  # (a small scan: no edges of its own)
        return None
    points = points.contiguous()
    plan = _kept_plan(points, points, search)
    if not isinstance(plan, _SmallTree):
        return None
    edges = torch.empty(2, n * k, dtype=torch.int64)
    # the search's rows are scratch here: the plan's output templates where they have these rows
    dists, idx = (plan.dists, plan.idx) if plan.rows == n else _plan_outputs(plan, n)
    return edges, bool(plan.run_edges(points, dists, idx, edges, k, loop)[0])


def _plan_outputs(plan, m: int) -> tuple:
    """New (dists, idx) outputs of a kept plan's search of m queries: like its kept templates
    (``torch.empty_like`` checks less than a new shape does), by shape for another size than
    theirs (a plan serves a range of sizes; its templates are its first size's: ``plan.rows``)."""
    if plan.rows == m:
        return torch.empty_like(plan.dists), torch.empty_like(plan.idx)
    return plan.dists.new_empty(m, plan.k), torch.empty(m, plan.k, dtype=torch.int64)


def _run_kept(plan, query, ref):
    """(dists, idx, flag value) of a kept plan's search of contiguous ``query`` in ``ref``, its outputs new."""
    sizes = (ref.shape[0], query.shape[0])
    dists, idx = _plan_outputs(plan, sizes[1])
    return dists, idx, plan.run(query, ref, dists, idx, sizes)[0]


def _one_node(first: int, last: int, n: int) -> bool:
    """Whether rows first .. last - 1 (last > first) of n are the rows of one node of the
    implicit tree (node k of depth d: :func:`pcops._warp_funcs.part`)."""
    d = max((n // (last - first)).bit_length() - 1, 0)
    for e in (d, d + 1):  # (a node of depth e holds floor or ceil of n / 2^e rows)
        k = -((-first << e) // n)  # the first node of depth e starting at or after ``first``
        if (n * k) >> e == first and (n * (k + 1)) >> e == last:
            return True
    return False


def _forest(query, ref, k: int, query_group, ref_group):
    """(dists, idx) of a grouped CPU search over a forest: a kd-tree per sample, each its own
    implicit tree over the sample's points (sorted by sample, stably: each sample keeps its
    points' order), built a sample a thread (:func:`_forest_kernel`) and searched in one launch,
    each query walking its sample's tree as an ungrouped search does (the same neighbours and
    ties; a self-query in the trees' order, other queries in (sample, Morton) order); None where
    every sample is one node of the batch's tree (:func:`_tree`: equal samples, a power of two
    of them), which then holds the same trees."""
    m, n = query.shape[0], ref.shape[0]
    in_order = bool((ref_group[1:] >= ref_group[:-1]).all())  # (packed batches as PyTorch Geometric makes them)
    groups, order = (ref_group, None) if in_order else torch.sort(ref_group, stable=True)
    ids, counts = torch.unique_consecutive(groups, return_counts=True)  # the trees: the samples with points, by id
    sizes = counts.tolist()
    starts = [0, *itertools.accumulate(sizes)]  # each sample's first point, and n
    if all(_one_node(a, b, n) for a, b in itertools.pairwise(starts)):
        return None
    order, points = (torch.arange(n), ref.clone()) if in_order else (order, ref[order])
    depths = [_depth(c) for c in sizes]
    nodes = [(2 << d) - 1 for d in depths]
    firsts = [0, *itertools.accumulate(nodes)][:-1]  # each tree's first node
    first, node, depth = (torch.tensor(x, dtype=torch.int32) for x in (starts, firsts, depths))
    lo, hi, split = ref.new_empty((sum(nodes), 3)), ref.new_empty((sum(nodes), 3)), ref.new_empty(sum(nodes))
    axis = torch.empty(sum(nodes), dtype=torch.int32)
    vec = lambda x: _warp.array(x, dtype=_warp.vec3(query.dtype))  # noqa: E731
    points_w, lo_w, hi_w = vec(points), vec(lo), vec(hi)
    # a sample a thread, but those that would hold up a thread past its share and are large
    # enough to build on every thread: each with the ungrouped build's launches, in place
    share = n // (2 * _threads.requested())
    big = [size > share and size * max(d, 1) >= _warp.SERIAL_WORK for size, d in zip(sizes, depths)]
    for t in (t for t, b in enumerate(big) if b):
        p, e = slice(starts[t], starts[t + 1]), slice(firsts[t], firsts[t] + nodes[t])
        _launch_build([vec(points[p]), order[p], axis, 0, vec(lo[e]), vec(hi[e]), axis, axis, axis[e], split[e]], sizes[t], depths[t], ref)
    most = max((size for size, b in zip(sizes, big) if not b), default=0)  # (every big sample is larger: the work grows with the size)
    _warp.launch(_forest_kernel(ref.dtype), len(sizes), [_ROUNDS, most, first, node, depth, points_w, order, lo_w, hi_w, axis, split],
                 like=ref, min_chunk=1, work=n * max(depths, default=1))
    at = torch.searchsorted(ids, query_group).clamp_(max=len(sizes) - 1)
    tree = torch.where(ids[at] == query_group, at, -1).to(torch.int32)  # each query's tree (-1: its sample has no points)
    if ref is query and ref_group is query_group:  # a self-query: the trees' own points, in the trees' order
        rows, ordered = order, points_w
    else:
        rows = _query_order(query, tree)
        ordered = vec(query.index_select(0, rows))
    dists, idx = _outputs(query, k)
    dummy = _no_group(query.device)[1]
    args = [0, rows, ordered, tree, points_w, order, dummy, lo_w, hi_w, dummy, dummy, axis, split, first, node, depth, dists, idx,
            int(_CHAIN), _no_edges(query.device)[1], 0, 0, _warp.no_flag(query.device)[1]]
    _warp.launch(_search_kernel(query.dtype, False, True, _VECTOR_LEAVES), m, args, like=query, min_chunk=_warp.QUERY_CHUNK)
    return dists, idx


def find(query, ref, k, query_group=None, ref_group=None):
    """The search (see the module docs and :mod:`._registry`): the function of the ``pcops::knn_warp``
    op, which ``knn`` also calls directly for a plain eager call (:func:`pcops.ops.neighbours.nearest.knn`)."""
    m = query.shape[0]
    _warp.init()
    grouped = query_group is not None
    query, ref = _contiguous(query, ref)
    small = not grouped and query.is_cpu
    plan = _kept_plan(query, ref, k) if small else None
    if plan is not None:  # the thread's kept plan of these sizes: nothing to decide
        return _run_kept(plan, query, ref)[:2]
    vec = lambda x: _warp.array(x, dtype=_warp.vec3(query.dtype))  # noqa: E731
    if small:
        plan = _new_plan(query, ref, k)
        if plan is not None:
            return _run_kept(plan, query, ref)[:2]
    if m and _scans(m, ref.shape[0], k, query.is_cpu, grouped):  # small: every pair, one launch (two when split)
        slices = _slices(m, ref.shape[0], k, query.is_cpu)
        rows = m * slices
        dists, idx = query.new_empty(rows, k), torch.empty(rows, k, dtype=torch.int64, device=query.device)
        groups = (query_group.contiguous(), ref_group.contiguous()) if grouped else (_no_group(query.device)[1],) * 2
        points = vec(query)
        args = [slices, points, groups[0], points if ref is query else vec(ref), groups[1], dists, idx, _warp.no_flag(query.device)[1]]
        scan, merge = _scan_kernel(query.dtype, grouped)
        _warp.launch(scan, rows, args, like=query, min_chunk=1, work=m * ref.shape[0])
        if slices == 1:
            return dists, idx
        out, out_idx = query.new_empty(m, k), torch.empty(m, k, dtype=torch.int64, device=query.device)
        _warp.launch(merge, m, [slices, dists, idx, out, out_idx], like=query, min_chunk=1, work=rows * k)
        return out, out_idx
    if m and grouped and query.is_cpu and not _GPU_BUILD and FOREST[0]:
        found = _forest(query, ref, k, query_group, ref_group)
        if found is not None:
            return found
    dists, idx = _outputs(query, k)  # (the search writes every row whole)
    if m == 0:
        return dists, idx
    # The queries go in the Morton order of their cells: neighbouring threads walk the same
    # nodes. Ungrouped CPU queries are put in order by one thread (a counting sort, about one
    # cell per query, at most 2^5 a side; grids and other queries already in a spatial order
    # stay as they are) while another splits the tree's root, which is serial (docs/benchmarks.md,
    # design choices). Elsewhere (CUDA, coherent
    # warps; grouped CPU queries of large trees, unless in a spatial order already) a Morton
    # sort in torch.
    beside = None
    if query.device.type == "cpu" and not grouped:
        beside, rows, ordered = _cpu_query_order(query)
    points, order, point_group, lo, hi, glo, ghi, axis, split, depth = _tree(ref, ref_group, beside, m if beside is not None else 0)
    if beside is None:
        sort = query.device.type != "cpu"
        if grouped and not sort:  # the trees of the samples are what must fit (no sync on CPU)
            per_sample = ref.shape[0] // max(int(point_group[-1]) - int(point_group[0]) + 1, 1)
            sort = per_sample > _SORT_QUERIES_ABOVE and not _in_order(query)
        rows = _query_order(query, query_group) if sort else torch.arange(m, device=query.device)
        ordered = query.index_select(0, rows) if sort else query
    dummy = _no_group(query.device)[1]
    args = [depth, rows, vec(ordered), query_group.contiguous() if grouped else dummy, vec(points), order,
            point_group if grouped else dummy, vec(lo), vec(hi), glo, ghi, axis, split, dummy, dummy, dummy, dists, idx,
            int(_CHAIN and query.device.type == "cpu"), _no_edges(query.device)[1], 0, 0, _warp.no_flag(query.device)[1]]
    _warp.launch(_search_kernel(query.dtype, grouped, False, _VECTOR_LEAVES), m, args, like=query, min_chunk=_warp.QUERY_CHUNK)
    return dists, idx


search = backend("warp", devices=("cpu", "cuda"), requires=("warp",), install="pip install warp-lang")(find)
