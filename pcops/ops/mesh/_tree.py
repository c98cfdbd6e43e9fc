"""The bounding volume hierarchy of the mesh ops, built in torch and two Warp kernels (no Warp object outlives a call).

The faces are sorted by sample id, then by the Morton code of their centroids (10 bits per
axis over the box of all centroids), and split at the middle index as the kd-tree of
:mod:`pcops.ops.neighbours.nearest._kdtree` splits its points: node ``i`` at depth ``d`` holds
the sorted faces ``F i / 2^d .. F (i + 1) / 2^d`` (integer division) and its children are the
halves, so no pointer is stored; the leaves, at depth ``depth(F)``, hold at most ``LEAF`` faces.
Node ``i`` at depth ``d`` is entry ``2^d - 1 + i`` of the node arrays, whose length is bounded
by ``4 ceil(F / LEAF)`` (the exact fake's size; entries past ``2^(depth + 1) - 1`` are unused).

Every node stores the box of its faces, its sample range (the faces are sorted by sample, so a
query skips the nodes of other meshes) and the data of the hierarchical fast winding number
(Barill et al. 2018): the area-weighted centroid ``center``, the sum of the area vectors
``normal`` (area times unit normal), the first moment ``moment`` = sum of a_t n_t (c_t -
center)^T, and the radius of a ball about ``center`` holding the node's box. All of it is
computed in float64 and stored in the compute dtype; the triangles are stored sorted, three
(F, 3) arrays of corners, with their sample ids and their rows in the caller's faces.
"""


from typing import NamedTuple

import torch
import warp as wp

from ... import _morton, _warp

LEAF = 4  # faces per leaf at most
THREADS = 2**31 - 1  # threads of one launch at most (Warp's thread ids are int32)
PER_LEVEL = [False]  # the CPU too builds the parent levels a launch per level, as CUDA does (tests)


class Tree(NamedTuple):
    """The tensors of a mesh's hierarchy (see the module docs); ``scale`` (0-d): the largest
    absolute coordinate of the mesh, the size its rounding is measured against."""

    order: torch.Tensor  # (F,) int64: the caller's face row of each sorted face
    a: torch.Tensor  # (F, 3) first corners of the sorted faces
    b: torch.Tensor
    c: torch.Tensor
    group: torch.Tensor  # (F,) int64 sample id of each sorted face
    lo: torch.Tensor  # (nodes, 3) boxes
    hi: torch.Tensor
    glo: torch.Tensor  # (nodes,) int64 sample range
    ghi: torch.Tensor
    center: torch.Tensor  # (nodes, 3)
    normal: torch.Tensor  # (nodes, 3)
    moment: torch.Tensor  # (nodes, 3, 3)
    radius: torch.Tensor  # (nodes,)
    scale: torch.Tensor  # () the largest absolute coordinate


def depth(n_faces: int) -> int:
    """The depth of the leaves: the smallest d with n_faces <= LEAF 2^d."""
    return _morton.leaf_depth(n_faces, LEAF)


def node_count(n_faces):
    """The length of the node arrays (works on symbolic sizes: the fake's shapes)."""
    return 4 * ((n_faces + LEAF - 1) // LEAF)


def morton_order(points: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """The order of points (M, 3) by sample id, then by Morton code (10 bits per axis over their box):
    the faces' order (by centroid) and the queries' (neighbouring threads walk the same nodes)."""
    centroid = torch.nan_to_num(points, nan=0.0, posinf=0.0, neginf=0.0)
    low, high = centroid.amin(0), centroid.amax(0)
    cells = ((centroid - low) / (high - low).clamp_min(1e-300) * 1023.0).nan_to_num(0.0).clamp(0, 1023).to(torch.int64)
    code = _morton.codes(cells)
    order = torch.argsort(code, stable=True)
    return order[torch.argsort(group[order], stable=True)]


def build(vertices: torch.Tensor, faces: torch.Tensor, group: torch.Tensor, dtype: torch.dtype) -> Tree:
    """The hierarchy of faces (F, 3) (rows of vertices (V, 3)) with sample ids ``group`` (F,)."""
    n = faces.shape[0]
    d = depth(n)
    device = vertices.device
    corners = vertices.detach().to(torch.float64).index_select(0, faces.reshape(-1)).view(n, 3, 3)
    order = morton_order(corners.mean(1), group)
    corners, group = corners.index_select(0, order), group.index_select(0, order)
    # per face: box, area vector, area, centroid (in float64)
    area_vec = 0.5 * torch.linalg.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0])
    area = torch.linalg.vector_norm(area_vec, dim=1)
    centroid = corners.mean(1)
    # the leaves: sorted faces F i / 2^d .. F (i + 1) / 2^d, as a (leaves, LEAF) table of rows
    # (row n: padding), so that every reduction is a gather and a reduction over a short axis
    # (scatters and index_add stall when another process holds a core: docs/benchmarks.md, design choices)
    leaves = 1 << d
    bounds = (n * torch.arange(leaves + 1, device=device, dtype=torch.int64)) >> d
    table = bounds[:-1, None] + torch.arange(LEAF, device=device)
    table = torch.where(table < bounds[1:, None], table, n)

    def per_leaf(values: torch.Tensor, pad: float) -> torch.Tensor:  # (n, ...) -> (leaves, LEAF, ...)
        padded = torch.cat([values, values.new_full((1, *values.shape[1:]), pad)])
        return padded.index_select(0, table.reshape(-1)).view(leaves, LEAF, *values.shape[1:])

    lo = per_leaf(corners.amin(1), float("inf")).amin(1)
    hi = per_leaf(corners.amax(1), float("-inf")).amax(1)
    sums = torch.cat([area[:, None], area[:, None] * centroid, area_vec, (area_vec[:, :, None] * centroid[:, None, :]).reshape(n, 9)], 1)
    sums = per_leaf(sums, 0.0).sum(1)
    glo, ghi = group[bounds[:-1]], group[bounds[1:] - 1]
    # every node, entry 2^depth - 1 + i: the leaves, then the parents from pairs of children up to
    # the root (one thread, in one launch)
    nodes = (2 << d) - 1
    full = [torch.empty((nodes, *t.shape[1:]), dtype=t.dtype, device=device) for t in (lo, hi, glo, ghi, sums)]
    for t, leaf in zip(full, (lo, hi, glo, ghi, sums)):
        t[leaves - 1:] = leaf
    if device.type == "cpu" and not PER_LEVEL[0]:  # one thread, every level
        _warp.launch(_parents_kernel(), 1, [d, -1, *full], like=corners, work=nodes)
    else:  # a launch per level, a thread per node
        for level in range(d - 1, -1, -1):
            _warp.launch(_parents_kernel(), 1 << level, [d, level, *full], like=corners)
    lo, hi, glo, ghi, sums = full
    area, weighted, normal, second = sums[:, 0], sums[:, 1:4], sums[:, 4:7], sums[:, 7:].reshape(-1, 3, 3)
    center = torch.where(area[:, None] > 0, weighted / area.clamp_min(1e-300)[:, None], 0.5 * (lo + hi))
    moment = second - normal[:, :, None] * center[:, None, :]  # sum a n (c - center)^T
    # the radius: the farthest corner of the node's faces from its center. Node i of depth l holds
    # leaves i 2^(d - l) .. (i + 1) 2^(d - l) - 1: per depth, each leaf's farthest corner from its
    # ancestor's center (one launch for every depth and leaf), then the largest over the node's leaves
    reach = corners.new_empty((d + 1, leaves))
    args = [corners.reshape(3 * n, 3).contiguous(), n, d, center.contiguous()]
    levels = [(0, d + 1)] if (d + 1) * leaves <= THREADS else [(level, 1) for level in range(d + 1)]
    for first, count in levels:
        _warp.launch(_reach_kernel(), count * leaves, [*args, first, reach], like=corners, work=3 * n * count)
    # node k's depth (the exponent of k + 1) and so its number of leaves: one segmented max for every node
    level = torch.frexp(torch.arange(1, nodes + 1, device=device, dtype=torch.float64))[1].long() - 1
    radius = torch.segment_reduce(reach.flatten(), "max", lengths=1 << (d - level))
    size = node_count(n)

    def out(t, fill=0):
        t = t.to(dtype) if t.dtype == torch.float64 else t
        pad = t.new_full((size - t.shape[0], *t.shape[1:]), fill)
        return torch.cat([t, pad]).contiguous()

    scale = torch.nan_to_num(corners.abs(), nan=0.0, posinf=0.0).amax().to(dtype)
    cast = lambda t: t.to(dtype, copy=True, memory_format=torch.contiguous_format)  # noqa: E731  (a copy: views of one tensor would alias)
    return Tree(order, cast(corners[:, 0]), cast(corners[:, 1]), cast(corners[:, 2]), group.contiguous(),
                out(lo), out(hi), out(glo), out(ghi), out(center), out(normal), out(moment), out(radius), scale)


@_warp.kernels
def _parents_kernel():
    """Nodes above the leaves from their two children: the box's min and max (NaN if either is),
    the first child's low sample id and the second's high one, the sum of the face sums (the
    first child's plus the second's). ``level`` -1: one thread, every node from entry 2^depth - 2
    down to 0 (the CPU); else thread t makes node t of depth ``level`` (a launch per level)."""

    @wp.kernel(enable_backward=False, module="unique")
    def parents(start: int, depth: int, level: int, lo: wp.array(dtype=wp.vec3d), hi: wp.array(dtype=wp.vec3d),
                glo: wp.array(dtype=wp.int64), ghi: wp.array(dtype=wp.int64), sums: wp.array2d(dtype=wp.float64)):
        count = int(1)
        if level < 0:
            count = (1 << depth) - 1
        for r in range(count):
            node = (1 << depth) - 2 - r
            if level >= 0:
                node = (1 << level) - 1 + wp.tid() + start
            a = 2 * node + 1
            b = a + 1
            low = lo[a]
            high = hi[a]
            for c in range(3):  # NaN wins, as in torch.minimum / maximum
                x = lo[b][c]
                if x < low[c] or x != x:
                    low[c] = x
                y = hi[b][c]
                if y > high[c] or y != y:
                    high[c] = y
            lo[node] = low
            hi[node] = high
            glo[node] = glo[a]
            ghi[node] = ghi[b]
            for c in range(sums.shape[1]):
                sums[node, c] = sums[a, c] + sums[b, c]

    return parents


@_warp.kernels
def _reach_kernel():
    """Thread (l, j) of (depths from ``first_level``, 2^d): the distance from the center of leaf j's ancestor at depth l
    to the farthest finite-distance corner of the leaf's faces (0 if none), into reach[l, j]."""

    @wp.kernel(enable_backward=False, module="unique")
    def reach(start: int, corners: wp.array(dtype=wp.vec3d), n: int, depth: int, center: wp.array(dtype=wp.vec3d),
              first_level: int, out: wp.array2d(dtype=wp.float64)):
        t = wp.tid() + start
        leaves = 1 << depth
        level = first_level + t // leaves
        j = t - (t // leaves) * leaves
        first = int((wp.int64(n) * wp.int64(j)) >> wp.int64(depth))
        last = int((wp.int64(n) * wp.int64(j + 1)) >> wp.int64(depth))
        c = center[(1 << level) - 1 + (j >> (depth - level))]
        best = wp.float64(0.0)
        for k in range(3 * first, 3 * last):
            d = wp.length(corners[k] - c)
            if d > best and d < wp.float64(wp.inf):  # NaN and inf corners do not count
                best = d
        out[level, j] = best

    return reach


def empty_like(vertices: torch.Tensor, faces: torch.Tensor, dtype: torch.dtype) -> Tree:
    """A tree's tensors with the exact shapes of :func:`build` (the fake)."""
    n = faces.shape[0]
    size = node_count(n)
    f = lambda *shape: vertices.new_empty(shape, dtype=dtype)  # noqa: E731
    i = lambda *shape: vertices.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return Tree(i(n), f(n, 3), f(n, 3), f(n, 3), i(n), f(size, 3), f(size, 3), i(size), i(size), f(size, 3), f(size, 3),
                f(size, 3, 3), f(size), f())
