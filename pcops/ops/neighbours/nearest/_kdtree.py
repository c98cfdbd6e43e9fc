"""kNN with Warp, on CPU and CUDA: a balanced kd-tree, searched per query with a short stack.

Build (Warp kernels on the CPU, O(N log N); torch sorts on GPUs, see ``_sorted_splits``): the
reference points are copied (sorted by group id for batches) and split recursively at the
middle index: node ``i`` at depth ``d`` holds the
points ``N i / 2^d .. N (i + 1) / 2^d`` (integer division), and its two children are the
halves of that range, so no pointer is stored. A node's points are partitioned (quickselect)
along the widest axis of its bounding box so that its left half lies below the split value and
its right half above; a node whose range spans several groups is split between groups
instead (its points stay in group order). Every node stores its bounding box, its group range
(batches), its split axis and value. Leaves hold at most ``LEAF`` points. A split only has to
be exact for speed: the boxes are those of the points actually in each range, so a
partition stopped early (after ``_ROUNDS`` rounds, e.g. on adversarial inputs) keeps the
search exact; such a split is marked (axis + 3) and gives no plane bound.

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
most useful on grid queries and surfaces (docs/benchmarks.md, design choices)).
Memory is O(N + M).

A query with a non-finite coordinate finds nothing (idx -1, dist inf); a NaN or inf reference
point is never a neighbour (a NaN coordinate sorts as +inf in the splits), and every walk
ends: it visits each node at most once.
"""

import functools
import math

import torch
import warp as wp

from .... import _morton, _threads, _warp, _warp_funcs
from ._registry import backend

# Points per leaf at most (more than LEAF / 2): with the stack walk, faster than 32 or 8
# (docs/benchmarks.md, design choices).
LEAF = 16
_ROUNDS = 64  # partition rounds per split at most (an unfinished split slows the search only)
_BUILD_BY_SORTING = False  # True: the torch build of GPUs on the CPU too (tests)
_BITS = 10  # Morton bits per axis of the query order (torch sorts)
_CPU_BITS = 5  # at most, of the CPU's counting sort of ungrouped queries
_STACK = 32  # entries of a query's stack: one per depth at most (depth < 32 up to 2^35 points)
_PURE = 64  # added to a stack entry's depth: the node holds points of the query's group only
_CHAIN = True  # CPU: each query's first bound from the previous query's (tests compare with False)
_SORT_QUERIES_ABOVE = 1 << 16  # reference points (per sample) above which grouped CPU queries go in Morton order
# CPU: at most this many (query, reference point) pairs are measured one by one (``_scan_kernel``)
# instead of building and searching the tree, fewer for k > 11 (the insertion of each point grows
# with k): SCAN_PAIRS / (k^2 / 128); the same result, one launch (docs/ops/knn.md; the crossover
# measured in docs/benchmarks.md, design choices)
SCAN_PAIRS = 1 << 17


def _scans(m: int, n: int, k: int, cpu: bool = True) -> bool:
    """Whether a search of m queries in n points for k neighbours measures every pair (on the
    CPU, or on CUDA: :func:`pcops._warp.cuda_scans`)."""
    cost = max(1, (k * k) >> 7)
    return m * n <= SCAN_PAIRS // cost if cpu else _warp.cuda_scans(m, n, cost)


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
def _search_kernel(dtype: torch.dtype, grouped: bool):
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    insert = _warp_funcs.sorted_insert(dtype, True)  # rows of squared distances (roots taken at the end)

    # A box (or point) is skipped only when its squared distance exceeds slack = (1 + 64 eps)^2
    # times the squared k-th distance: rounding (e.g. fused multiply-adds) never makes a box look
    # farther than a point inside it, nor a point farther than its rounded distance, and a
    # square whose root equals the k-th's (a tie) is still compared.
    slack = s((1.0 + 64.0 * torch.finfo(dtype).eps) ** 2)
    # The previous query's k-th distance r and the step dq between the two queries bound this
    # query's k-th distance by r + dq (its k neighbours are that near), widened by relative
    # rounding (16 eps) and by an absolute term for squares below the smallest normal number.
    widen, reach0 = s(1.0 + 16.0 * torch.finfo(dtype).eps), s(16.0 * math.sqrt(torch.finfo(dtype).tiny))
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
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
        chain: int,
    ):
        t = wp.tid() + start
        i = int(rows[t])
        q = query[t]  # the queries in the threads' order (query[t] is query rows[t], read directly, not through rows)
        if not (wp.isfinite(q[0]) and wp.isfinite(q[1]) and wp.isfinite(q[2])):
            return
        g = int(0)
        if wp.static(grouped):
            g = int(query_group[i])
        k = dists.shape[1]
        npts = wp.int64(points.shape[0])
        zero = v(s(0.0), s(0.0), s(0.0))
        n = int(0)
        bound = s(wp.inf)  # squared distance beyond which nothing can enter the row
        if chain != 0 and wp.tid() > 0:  # thread t - 1 ran before t on this CPU thread: its row is done
            prev = int(rows[t - 1])
            same = True  # (a query of another sample has other neighbours)
            if wp.static(grouped):
                same = int(query_group[prev]) == g
            r = dists[prev, k - 1]  # a root: inf when that query found fewer than k (or was not finite)
            if same and r < s(wp.inf):
                dq = q - query[t - 1]
                reach = (r + wp.sqrt(wp.dot(dq, dq))) * widen + reach0
                bound = reach * reach * slack
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
                    gap = wp.max(wp.max(lo[b] - q, q - hi[b]), zero)
                    if wp.dot(gap, gap) > bound:
                        break
                if d == depth:  # a leaf: insert its points into the sorted row
                    node = b + 1 - (1 << d)
                    j0, j1 = _warp_funcs.part(node, npts, depth), _warp_funcs.part(node + 1, npts, depth)
                    for j in range(j0, j1):
                        diff = q - points[j]
                        d2 = wp.dot(diff, diff)
                        ok = d2 <= bound and d2 < s(wp.inf)  # NaN / inf points are never neighbours
                        if wp.static(grouped):
                            ok = ok and (pure or int(point_group[j]) == g)
                        if ok:
                            n = insert(dists, idx, i, n, d2, order[j])
                            if n == k:  # a full row: nothing farther than its last (with slack) can enter
                                bound = wp.min(bound, dists[i, k - 1] * slack)
                    break
                a = int(axis[b])
                side = int(0)
                far = floor
                if a >= 3:  # a split stopped early: no plane between the halves
                    side = int(q[a - 3] >= split[b])
                elif a >= 0:  # the farther child's points lie beyond the split plane
                    off = q[a] - split[b]
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

    return search


@_warp.kernels
def _scan_kernel(dtype: torch.dtype, grouped: bool):
    """Small clouds: each thread measures its query against every reference point (of its group)
    and keeps the k best in its row with the tree search's insertion (the same order: squared
    distances compared as their roots, ties by the smaller index), so the result is the tree's.
    Each thread writes its whole row (inf / -1 where nothing was found): the outputs need no fill."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    insert = _warp_funcs.sorted_insert(dtype, True)
    slack = s((1.0 + 64.0 * torch.finfo(dtype).eps) ** 2)  # as the tree search's: ties still compared

    @wp.kernel(enable_backward=False, module="unique")
    def scan(
        start: int,
        query: wp.array(dtype=v),
        query_group: wp.array(dtype=wp.int32),
        points: wp.array(dtype=v),
        point_group: wp.array(dtype=wp.int32),
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
    ):
        i = wp.tid() + start
        k = dists.shape[1]
        for c in range(k):
            dists[i, c] = s(wp.inf)
            idx[i, c] = wp.int64(-1)
        q = query[i]
        if not (wp.isfinite(q[0]) and wp.isfinite(q[1]) and wp.isfinite(q[2])):
            return
        n = int(0)
        bound = s(wp.inf)
        for j in range(points.shape[0]):
            diff = q - points[j]
            d2 = wp.dot(diff, diff)
            ok = d2 <= bound and d2 < s(wp.inf)  # NaN / inf points are never neighbours
            if wp.static(grouped):
                ok = ok and point_group[j] == query_group[i]
            if ok:
                n = insert(dists, idx, i, n, d2, wp.int64(j))
                if n == k:
                    bound = wp.min(bound, dists[i, k - 1] * slack)
        for c in range(n):
            dists[i, c] = wp.sqrt(dists[i, c])

    return scan


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
                        ext = h - l
                        a = int(0)
                        if ext[1] > ext[a]:
                            a = 1
                        if ext[2] > ext[a]:
                            a = 2
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
                                for j in range(left, rite):
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
        for i in range(1, steps + 1):
            d = wp.abs(points[i] - points[i - 1])
            near = near + int(wp.max(wp.max(d[0], d[1]), d[2]) < side / s(16.0))
        if 2 * near > steps:
            for i in range(m):
                rows[i] = wp.int64(i)
                ordered[i] = points[i]
            return
        top = s(spread.shape[0] - 1)
        scale = top / side  # inf or NaN (a box of one point or none): cell 0
        for c in range(count.shape[0]):
            count[c] = 0
        for i in range(m):
            c = morton(spread, (points[i] - low) * scale, top)
            cells[i] = c
            count[c + 1] = count[c + 1] + 1
        for c in range(1, count.shape[0]):
            count[c] = count[c] + count[c - 1]  # count[c]: the points in the cells before c
        for i in range(m):
            c = cells[i]
            rows[count[c]] = wp.int64(i)
            ordered[count[c]] = points[i]
            count[c] = count[c] + 1

    return build, keys, order


def _query_order(query: torch.Tensor, group) -> torch.Tensor:
    """The queries in (group, Morton code) order: neighbouring threads walk the same nodes."""
    low, high = torch.aminmax(query, dim=0)
    scale = (2**_BITS - 1) / (high - low).max().clamp_min(1e-30)  # NaN with non-finite points: keys 0
    frame = torch.cat([low, scale[None]])
    _, keys, _ = _build_kernels(query.dtype)
    code = torch.empty(query.shape[0], dtype=torch.int32, device=query.device)
    args = [_warp.array(query, dtype=_warp.vec3(query.dtype)), frame, _morton.spread_table(_BITS, query.device), code]
    _warp.launch(keys, query.shape[0], args, like=query)
    if group is None:
        return torch.sort(code).indices  # int32 keys: half the work of int64 ones
    return torch.sort(group.to(torch.int64) << 32 | code).indices


def _cpu_query_order(query: torch.Tensor):
    """((kernel, args), rows, ordered): the one-thread launch that writes the Morton order of
    the cells of CPU queries into ``rows`` (about one cell per query, at most 2^_CPU_BITS a
    side) and the queries in that order into ``ordered``."""
    m = query.shape[0]
    bits = max(1, min(_CPU_BITS, round(math.log2(m + 1) / 3)))
    rows, ordered = torch.empty(m, dtype=torch.int64), torch.empty_like(query)
    scratch = [torch.empty(m, dtype=torch.int32), torch.empty((1 << 3 * bits) + 1, dtype=torch.int32)]
    vec = _warp.vec3(query.dtype)
    spread = _morton.spread_table(bits, query.device)
    args = [_warp.array(query, dtype=vec), spread, *scratch, rows, _warp.array(ordered, dtype=vec)]
    return (_build_kernels(query.dtype)[2], args), rows, ordered


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


def _tree(ref: torch.Tensor, group, beside=None, queries: int = 0):
    """(points, order, groups, boxes lo/hi, group ranges glo/ghi, split axis/value, depth): the
    kd-tree of ``ref``, its points permuted in place into tree order (``order``: their indices).
    ``beside``: (kernel, args) of a one-thread launch over ``queries`` points run with the split
    of the root."""
    dev, n = ref.device, ref.shape[0]
    # points in group order (padded batches are already; the check would sync a GPU)
    in_order = group is None or (dev.type == "cpu" and bool((group[1:] >= group[:-1]).all()))
    if in_order:
        order, points = torch.arange(n, device=dev), ref.clone()
    else:
        group, order = torch.sort(group, stable=True)
        points = ref[order]
    depth = _depth(n)
    nodes = (2 << depth) - 1
    lo, hi = ref.new_empty((nodes, 3)), ref.new_empty((nodes, 3))
    glo, ghi = (torch.empty(nodes if group is not None else 1, dtype=torch.int32, device=dev) for _ in range(2))
    axis = torch.empty(nodes, dtype=torch.int32, device=dev)
    split = ref.new_empty(nodes)
    if dev.type != "cpu" or _BUILD_BY_SORTING:
        if beside is not None:
            _warp.launch(beside[0], 1, beside[1], like=ref)
        points, order = _sorted_splits(points, order, group, depth, lo, hi, glo, ghi, axis, split)
        return points, order, group, lo, hi, glo, ghi, axis, split, depth
    vec = _warp.vec3(ref.dtype)
    args = [_warp.array(points, dtype=vec), order, group if group is not None else glo, int(group is not None),
            _warp.array(lo, dtype=vec), _warp.array(hi, dtype=vec), glo, ghi, axis, split]
    build = _build_kernels(ref.dtype)[0]
    # One launch per depth down to where there is a subtree for every CPU thread; then one
    # thread per subtree does the rest (faster than one thread, or several subtrees per thread,
    # whose launches cost more than they balance (docs/benchmarks.md, design choices)).
    # (A small tree is built by one thread in one launch, its queries ordered after it.)
    work = n * max(depth, 1) + queries
    serial = min(depth, (_threads.requested() - 1).bit_length()) if work >= _warp.SERIAL_WORK else 0
    for d in range(depth + 1):
        last = d if d < serial else depth
        _warp.launch(build, 1 << d, [d, last, depth, _ROUNDS, *args], like=ref, min_chunk=1, beside=beside if d == 0 else None, work=work)
        if last == depth:
            break
    return points, order, group, lo, hi, glo, ghi, axis, split, depth


def _sorted_splits(points, order, group, depth, lo, hi, glo, ghi, axis, split):
    """The same tree with torch operations, one depth at a time, for GPUs (where the build
    kernel's top levels, one thread per node, would be serial): every node's points are sorted
    along its axis (two stable sorts: by key, then by node), not just split at the middle."""
    n, dev = points.shape[0], points.device
    j = torch.arange(n, device=dev)
    for d in range(depth + 1):
        i = torch.arange(1 << d, device=dev)
        b, first, last = (1 << d) - 1 + i, (i * n) >> d, ((i + 1) * n) >> d
        node = (((j + 1) << d) + n - 1) // n - 1  # the node at depth d holding position j
        spread = node[:, None].expand(-1, 3)
        box_lo = points.new_full((1 << d, 3), float("inf")).scatter_reduce(0, spread, points, "amin")
        box_hi = points.new_full((1 << d, 3), float("-inf")).scatter_reduce(0, spread, points, "amax")
        lo[b], hi[b] = box_lo, box_hi
        if group is not None:
            glo[b], ghi[b] = group[first], group[last - 1]
        if d == depth:
            return points, order
        mid = ((2 * i + 1) * n) >> (d + 1)
        a = (box_hi - box_lo).argmax(1)
        keys = points.gather(1, a[node][:, None])[:, 0]
        keys = torch.where(torch.isnan(keys), float("inf"), keys)
        multi = group[first] != group[last - 1] if group is not None else torch.zeros_like(i, dtype=torch.bool)
        keys = torch.where(multi[node], 0, keys)  # between samples: the order stays (a stable sort)
        perm = torch.sort(keys, stable=True).indices
        perm = perm[torch.sort(node[perm], stable=True).indices]
        points, order, keys = points[perm], order[perm], keys[perm]
        axis[b] = torch.where(multi, -1, a).to(torch.int32)
        split[b] = torch.where(multi, 0, keys[mid])
    return points, order


@functools.cache
def _no_group():
    """The group argument of an ungrouped CPU search (never read), converted once."""
    return _warp.array(torch.zeros(1, dtype=torch.int32))


def find(query, ref, k, query_group=None, ref_group=None):
    """The search (see the module docs and :mod:`._registry`): the function of the ``pcops::knn_warp``
    op, which ``knn`` also calls directly for a plain eager call (:func:`pcops.ops.neighbours.nearest.knn`)."""
    m = query.shape[0]
    _warp.init()
    grouped = query_group is not None
    query, ref = query.contiguous(), ref.contiguous()
    vec = lambda x: _warp.array(x, dtype=_warp.vec3(query.dtype))  # noqa: E731
    if m and _scans(m, ref.shape[0], k, query.is_cpu):  # small: every pair, one launch (which fills the rows)
        dists, idx = query.new_empty((m, k)), torch.empty((m, k), dtype=torch.int64, device=query.device)
        if grouped:
            groups = (query_group.contiguous(), ref_group.contiguous())
        else:
            groups = (_no_group() if query.is_cpu else torch.zeros(1, dtype=torch.int32, device=query.device),) * 2
        points = vec(query)
        args = [points, groups[0], points if ref is query else vec(ref), groups[1], dists, idx]
        pairs = m * ref.shape[0]
        _warp.launch(_scan_kernel(query.dtype, grouped), m, args, like=query, min_chunk=1, work=pairs)
        return dists, idx
    dists = query.new_full((m, k), float("inf"))
    idx = torch.full((m, k), -1, dtype=torch.int64, device=query.device)
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
    dummy = torch.zeros(1, dtype=torch.int32, device=query.device)
    args = [depth, rows, vec(ordered), query_group.contiguous() if grouped else dummy, vec(points), order,
            point_group if grouped else dummy, vec(lo), vec(hi), glo, ghi, axis, split, dists, idx, int(_CHAIN and query.device.type == "cpu")]
    _warp.launch(_search_kernel(query.dtype, grouped), m, args, like=query, min_chunk=_warp.QUERY_CHUNK)
    return dists, idx


search = backend("warp", devices=("cpu", "cuda"), requires=("warp",), install="pip install warp-lang")(find)
