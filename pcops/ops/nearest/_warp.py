"""kNN with Warp, on CPU and CUDA: a bounding-box tree over Morton-sorted points, searched per query.

Build (O(N log N): Warp kernels for the keys and boxes, a torch sort): the points are sorted by (group, Morton code); runs of ``LEAF``
consecutive sorted points are the leaves, and each level above groups ``FANOUT`` consecutive
nodes of the level below. Every node stores the bounding box of its points (and, for
batches, the smallest and largest group id among them). No pointer is stored: node ``n`` of
level ``l`` has the children ``n * FANOUT ..`` of level ``l - 1``.

Search (one Warp thread per query, queries in Morton order for locality): the query first
scans the leaf at its own place in Morton order, then the other children of each ancestor of
that leaf, bottom up, each subtree depth first without a stack, skipping every node whose
box is farther than the current k-th distance (or holds no point of the query's group).
Each query keeps its k best (distance, index) pairs in its output row by insertion, so the
order is exact, ties by the smaller index: a skipped box is farther than the k-th distance,
so it cannot even hold a tie. The cost of a query follows the number of points near its
k-th neighbour sphere, whatever the density of the cloud elsewhere (measured in
docs/ops/knn.md); memory is O(N + M).

A query with a non-finite coordinate finds nothing (idx -1, dist inf); a NaN or inf reference
point is never a neighbour, and a box holding one is never skipped, so every walk ends.
"""

import torch
import warp as wp

from ... import _warp
from ._registry import backend

LEAF = 8  # points per leaf
FANOUT = 4  # children per inner node
_BITS = 10  # Morton bits per axis


@_warp.kernels
def _kernel(dtype: torch.dtype, grouped: bool, leaf: int = LEAF, fanout: int = FANOUT):
    s = _warp.scalar(dtype)
    insert = _warp.sorted_insert(dtype)
    v = _warp.vec3(dtype)
    # A box (or point) is skipped only when its squared distance exceeds (1 + slack) x the
    # squared k-th distance: rounding (e.g. fused multiply-adds) never makes a box look
    # farther than a point inside it, nor a point farther than its rounded distance.
    slack = s(1.0 + 64.0 * torch.finfo(dtype).eps)

    # One loop, no helper functions taking arrays: Warp passes arrays to functions by value,
    # and copying a dozen array descriptors per call cost more than the search itself.
    @wp.kernel(enable_backward=False, module="unique")
    def search(
        start: int,
        rows: wp.array(dtype=wp.int64),
        home: wp.array(dtype=wp.int64),
        query: wp.array(dtype=v),
        query_group: wp.array(dtype=wp.int32),
        points: wp.array(dtype=v),
        order: wp.array(dtype=wp.int64),
        point_group: wp.array(dtype=wp.int32),
        lo: wp.array(dtype=v),
        hi: wp.array(dtype=v),
        glo: wp.array(dtype=wp.int32),
        ghi: wp.array(dtype=wp.int32),
        level_start: wp.array(dtype=wp.int32),
        level_count: wp.array(dtype=wp.int32),
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
    ):
        t = wp.tid() + start
        i = int(rows[t])
        q = query[i]
        if not (wp.isfinite(q[0]) and wp.isfinite(q[1]) and wp.isfinite(q[2])):
            return
        g = int(0)
        if wp.static(grouped):
            g = int(query_group[i])
        k = dists.shape[1]
        npts = points.shape[0]
        top = level_start.shape[0] - 1
        zero = v(s(0.0), s(0.0), s(0.0))
        n = int(0)
        bound = s(wp.inf)  # squared distance beyond which nothing can enter the row
        # Subtrees in this order: the leaf at the query's place in Morton order (path node
        # ``hp`` at level ``level0`` = 0), then the other children of each of its ancestors,
        # bottom up; each one depth first without a stack (next sibling, else up).
        hp = int(home[t]) // wp.static(leaf)
        level0 = int(0)
        sib = hp
        first = bool(True)
        level = int(0)
        node = hp
        done = bool(False)
        while not done:
            b = int(level_start[level]) + node
            skip = bool(False)
            if wp.static(grouped):
                skip = g < int(glo[b]) or g > int(ghi[b])
            if not skip:
                gap = wp.max(wp.max(lo[b] - q, q - hi[b]), zero)
                skip = wp.dot(gap, gap) > bound
            if not skip and level > 0:
                level = level - 1
                node = node * wp.static(fanout)
                continue
            if not skip:  # a leaf: insert its points into the sorted row
                j0 = node * wp.static(leaf)
                for j in range(j0, wp.min(j0 + wp.static(leaf), npts)):
                    diff = q - points[j]
                    d2 = wp.dot(diff, diff)
                    ok = d2 <= bound and d2 < s(wp.inf)  # NaN / inf points are never neighbours
                    if wp.static(grouped):
                        ok = ok and int(point_group[j]) == g
                    if ok:
                        n = insert(dists, idx, i, n, wp.sqrt(d2), order[j])
                        if n == k:  # a full row: nothing farther than its last (with slack) can enter
                            r = dists[i, k - 1] * slack
                            bound = r * r
            # next node inside the subtree, or the root of the next subtree
            moving = bool(True)
            while moving:
                if level == level0:
                    moving = False
                    searching = bool(True)
                    while searching:
                        if first:
                            first = False
                            sib = (hp // wp.static(fanout)) * wp.static(fanout) - 1
                        sib = sib + 1
                        if sib == hp:
                            sib = sib + 1
                        if sib < (hp // wp.static(fanout) + 1) * wp.static(fanout) and sib < int(level_count[level0]):
                            level = level0
                            node = sib
                            searching = False
                        else:
                            level0 = level0 + 1
                            hp = hp // wp.static(fanout)
                            if level0 >= top:
                                done = True
                                searching = False
                            else:
                                sib = (hp // wp.static(fanout)) * wp.static(fanout) - 1
                elif node % wp.static(fanout) != wp.static(fanout) - 1 and node + 1 < int(level_count[level]):
                    node = node + 1
                    moving = False
                else:
                    node = node // wp.static(fanout)
                    level = level + 1

    return search


@_warp.kernels
def _build_kernels(dtype: torch.dtype):
    """Warp kernels of the build: sort keys, and the boxes of one tree level (one launch each,
    instead of dozens of small torch operations)."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    top = float(2**_BITS - 1)

    @wp.func
    def spread(x: wp.int64):
        """Interleave the low 10 bits of x with two zero bits each (30-bit Morton codes)."""
        x = (x | (x << wp.int64(16))) & wp.int64(0x030000FF)
        x = (x | (x << wp.int64(8))) & wp.int64(0x0300F00F)
        x = (x | (x << wp.int64(4))) & wp.int64(0x030C30C3)
        return (x | (x << wp.int64(2))) & wp.int64(0x09249249)

    @wp.kernel(enable_backward=False, module="unique")
    def keys(
        start: int,
        points: wp.array(dtype=v),
        groups: wp.array(dtype=wp.int32),
        grouped: int,
        frame: wp.array(dtype=s),
        out: wp.array(dtype=wp.int64),
    ):
        """The group id above the 30-bit Morton code of each point in the frame's box."""
        i = wp.tid() + start
        p = points[i]
        code = wp.int64(0)
        for a in range(3):
            x = (p[a] - frame[a]) * frame[3]
            c = wp.int64(0)
            if wp.isfinite(x):
                c = wp.int64(wp.clamp(x, s(0.0), s(top)))
            code = code | (spread(c) << wp.int64(a))
        if grouped != 0:
            code = code | (wp.int64(groups[i]) << wp.int64(32))
        out[i] = code

    @wp.kernel(enable_backward=False, module="unique")
    def level(
        start: int,
        src_lo: wp.array(dtype=v),
        src_hi: wp.array(dtype=v),
        src_glo: wp.array(dtype=wp.int32),
        src_ghi: wp.array(dtype=wp.int32),
        src_start: int,
        src_count: int,
        width: int,
        grouped: int,
        lo: wp.array(dtype=v),
        hi: wp.array(dtype=v),
        glo: wp.array(dtype=wp.int32),
        ghi: wp.array(dtype=wp.int32),
        dst_start: int,
    ):
        """Node n of a level: the union of the boxes (and group ranges) of its ``width`` children."""
        n = wp.tid() + start
        first = n * width
        last = wp.min(first + width, src_count)
        l = src_lo[src_start + first]
        h = src_hi[src_start + first]
        for c in range(first + 1, last):
            l = wp.min(l, src_lo[src_start + c])
            h = wp.max(h, src_hi[src_start + c])
        lo[dst_start + n] = l
        hi[dst_start + n] = h
        if grouped != 0:
            gl = src_glo[src_start + first]
            gh = src_ghi[src_start + first]
            for c in range(first + 1, last):
                gl = wp.min(gl, src_glo[src_start + c])
                gh = wp.max(gh, src_ghi[src_start + c])
            glo[dst_start + n] = gl
            ghi[dst_start + n] = gh

    return keys, level


def _frame(query: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """(low corner x, y, z, Morton cells per unit) of the box around both point sets (NaN with
    non-finite points: every key is then 0, which slows the search down but keeps it exact)."""
    low, high = torch.aminmax(torch.cat([query, ref]), dim=0)
    scale = (2**_BITS - 1) / (high - low).max().clamp_min(1e-30)
    return torch.cat([low, scale[None]])


def _keys(points: torch.Tensor, frame: torch.Tensor, group) -> torch.Tensor:
    """int64 sort keys: the group id above a 30-bit Morton code of the point in the frame's box."""
    keys, _ = _build_kernels(points.dtype)
    out = torch.empty(points.shape[0], dtype=torch.int64, device=points.device)
    groups = group.contiguous() if group is not None else torch.zeros(1, dtype=torch.int32, device=points.device)
    args = [_warp.array(points, dtype=_warp.vec3(points.dtype)), groups, int(group is not None), frame, out]
    _warp.launch(keys, points.shape[0], args, like=points)
    return out


def _tree(points: torch.Tensor, groups):
    """Boxes (lo, hi), group ranges (glo, ghi) of every node, level by level from the leaves;
    with the first node and the node count of each level."""
    counts = [-(-points.shape[0] // LEAF)]
    while counts[-1] > 1:
        counts.append(-(-counts[-1] // FANOUT))
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    total, dev, vec = sum(counts), points.device, _warp.vec3(points.dtype)
    lo, hi = points.new_empty((total, 3)), points.new_empty((total, 3))
    grouped = groups is not None
    glo, ghi = (torch.empty(total if grouped else 1, dtype=torch.int32, device=dev) for _ in range(2))
    _, level = _build_kernels(points.dtype)
    dst = [_warp.array(lo, dtype=vec), _warp.array(hi, dtype=vec), glo, ghi]
    pts = _warp.array(points, dtype=vec)
    src = [pts, pts, groups if grouped else glo, groups if grouped else ghi]
    src_count, src_start, width = points.shape[0], 0, LEAF
    for start, count in zip(starts, counts):
        _warp.launch(level, count, [*src, src_start, src_count, width, int(grouped), *dst, start], like=points)
        src, src_start, src_count, width = dst, start, count, FANOUT
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    return lo, hi, glo, ghi, as_tensor(starts), as_tensor(counts)


def _homes(ref_keys: torch.Tensor, query_keys: torch.Tensor, ref_groups, query_groups) -> torch.Tensor:
    """(M,) the sorted reference index at each query's Morton code, inside its group if it has one."""
    pos = torch.searchsorted(ref_keys, query_keys)
    if ref_groups is None:
        return pos.clamp(max=ref_keys.shape[0] - 1)
    bounds = ref_groups.long() << 32
    first = torch.searchsorted(bounds, query_groups.long() << 32)
    last = torch.searchsorted(bounds, (query_groups.long() + 1) << 32)
    return torch.minimum(pos, last - 1).clamp(min=first).clamp(max=ref_keys.shape[0] - 1)


@backend("warp", devices=("cpu", "cuda"), requires=("warp",), install="pip install warp-lang")
def search(query, ref, k, query_group, ref_group):
    m = query.shape[0]
    dists = query.new_full((m, k), float("inf"))
    idx = torch.full((m, k), -1, dtype=torch.int64, device=query.device)
    if m == 0:
        return dists, idx
    _warp.init()
    grouped = query_group is not None
    query, ref = query.contiguous(), ref.contiguous()
    frame = _frame(query, ref)
    ref_keys, order = torch.sort(_keys(ref, frame, ref_group))
    query_keys, rows = torch.sort(_keys(query, frame, query_group))
    points = ref[order].contiguous()
    point_group = ref_group[order].contiguous() if grouped else None
    lo, hi, glo, ghi, starts, counts = _tree(points, point_group)
    home = _homes(ref_keys, query_keys, point_group, query_group[rows] if grouped else None)
    dummy = torch.zeros(1, dtype=torch.int32, device=query.device)
    vec = lambda x: _warp.array(x, dtype=_warp.vec3(query.dtype))  # noqa: E731
    args = [rows, home, vec(query), query_group.contiguous() if grouped else dummy, vec(points), order,
            point_group if grouped else dummy, vec(lo), vec(hi), glo, ghi,
            starts, counts, dists, idx]
    _warp.launch(_kernel(query.dtype, grouped, LEAF, FANOUT), m, args, like=query)
    return dists, idx
