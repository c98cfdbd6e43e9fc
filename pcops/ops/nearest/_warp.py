"""kNN with Warp, on CPU and CUDA: a bounding-box tree over Morton-sorted points, searched per query.

Build (torch, O(N log N)): the points are sorted by (group, Morton code); runs of ``LEAF``
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

A query with a non-finite coordinate finds nothing (idx -1, dist inf); a NaN reference
point is never a neighbour, and a box holding one is never skipped, so every walk ends.
"""

import functools

import torch
import warp as wp

from ... import _warp
from ._registry import backend

LEAF = 8  # points per leaf
FANOUT = 4  # children per inner node
_BITS = 10  # Morton bits per axis


@functools.cache
def _kernel(dtype: torch.dtype, grouped: bool, leaf: int = LEAF, fanout: int = FANOUT):
    s = _warp.scalar(dtype)
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
                    ok = d2 <= bound  # False for NaN: a NaN point is never a neighbour
                    if wp.static(grouped):
                        ok = ok and int(point_group[j]) == g
                    if ok:
                        d = wp.sqrt(d2)
                        jj = order[j]
                        last = wp.min(n, k - 1)
                        if n < k or d < dists[i, last] or (d == dists[i, last] and jj < idx[i, last]):
                            pos = last
                            while pos > 0:
                                pd = dists[i, pos - 1]
                                if pd < d or (pd == d and idx[i, pos - 1] < jj):
                                    break
                                dists[i, pos] = pd
                                idx[i, pos] = idx[i, pos - 1]
                                pos = pos - 1
                            dists[i, pos] = d
                            idx[i, pos] = jj
                            n = wp.min(n + 1, k)
                            if n == k:
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


def _spread(x: torch.Tensor) -> torch.Tensor:
    """Interleave the low 10 bits of x with two zero bits each (for 30-bit Morton codes)."""
    x = (x | (x << 16)) & 0x030000FF
    x = (x | (x << 8)) & 0x0300F00F
    x = (x | (x << 4)) & 0x030C30C3
    return (x | (x << 2)) & 0x09249249


def _keys(points: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, group) -> torch.Tensor:
    """int64 sort keys: the group id above a 30-bit Morton code of the point in the box."""
    cells = ((points - low) * scale).nan_to_num(0.0).clamp(0, 2**_BITS - 1).long()
    code = _spread(cells[:, 0]) | (_spread(cells[:, 1]) << 1) | (_spread(cells[:, 2]) << 2)
    return code if group is None else code | (group.long() << 32)


def _box(query: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low corner, cells per unit) of the box around both point sets (NaN with non-finite
    points: every key is then 0, which slows the search down but keeps it exact)."""
    low = torch.minimum(query.amin(0), ref.amin(0))
    side = (torch.maximum(query.amax(0), ref.amax(0)) - low).max().clamp_min(1e-30)
    return low, (2**_BITS - 1) / side


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with its last row repeated up to a multiple of ``multiple`` rows."""
    pad = -x.shape[0] % multiple
    return torch.cat([x, x[-1:].expand(pad, *x.shape[1:])]) if pad else x


def _tree(points: torch.Tensor, groups):
    """Boxes (lo, hi), group ranges (glo, ghi) of every node, level by level from the leaves."""
    lo, hi = _pad_to(points, LEAF).unflatten(0, (-1, LEAF)).amin(1), None
    hi = _pad_to(points, LEAF).unflatten(0, (-1, LEAF)).amax(1)
    g = None if groups is None else _pad_to(groups, LEAF).unflatten(0, (-1, LEAF))
    glo, ghi = (None, None) if g is None else (g.amin(1), g.amax(1))
    levels = [(lo, hi, glo, ghi)]
    while levels[-1][0].shape[0] > 1:
        lo, hi, glo, ghi = (None if x is None else _pad_to(x, FANOUT).unflatten(0, (-1, FANOUT)) for x in levels[-1])
        levels.append((lo.amin(1), hi.amax(1), None if glo is None else glo.amin(1), None if ghi is None else ghi.amax(1)))
    counts = [lvl[0].shape[0] for lvl in levels]
    starts = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0).to(torch.int32)
    cat = lambda j: None if levels[0][j] is None else torch.cat([lvl[j] for lvl in levels]).contiguous()  # noqa: E731
    return cat(0), cat(1), cat(2), cat(3), starts.to(points.device), torch.tensor(counts, dtype=torch.int32, device=points.device)


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
    low, scale = _box(query, ref)
    ref_keys, order = torch.sort(_keys(ref, low, scale, ref_group))
    query_keys, rows = torch.sort(_keys(query, low, scale, query_group))
    points = ref[order].contiguous()
    point_group = ref_group[order].contiguous() if grouped else None
    lo, hi, glo, ghi, starts, counts = _tree(points, point_group)
    home = _homes(ref_keys, query_keys, point_group, query_group[rows] if grouped else None)
    dummy = torch.zeros(1, dtype=torch.int32, device=query.device)
    query = query.contiguous()
    vec = lambda x: _warp.array(x, dtype=_warp.vec3(query.dtype))  # noqa: E731
    args = [rows, home, vec(query), query_group.contiguous() if grouped else dummy, vec(points), order,
            point_group if grouped else dummy, vec(lo), vec(hi), glo if grouped else dummy, ghi if grouped else dummy,
            starts, counts, dists, idx]
    _warp.launch(_kernel(query.dtype, grouped, LEAF, FANOUT), m, args, like=query)
    return dists, idx
