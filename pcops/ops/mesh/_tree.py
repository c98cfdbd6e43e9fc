"""The bounding volume hierarchy of the mesh ops, built in torch and two Warp kernels (no Warp object outlives a call).

The faces are sorted by sample id and split at the middle index as the kd-tree of
:mod:`pcops.ops.neighbours.nearest` splits its points: node ``i`` at depth ``d`` holds the
sorted faces ``F i / 2^d .. F (i + 1) / 2^d`` (integer division) and its children are the
halves, so no pointer is stored; the leaves, at depth ``depth(F)``, hold at most ``LEAF`` faces.
On the CPU the faces of a node are ordered as that kd-tree's build orders points (its
centroids split at the middle index along the widest axis of their box, ``nearest.split_order``),
on GPUs by the Morton code of their centroids (10 bits per axis over the box of all centroids:
two sorts). The kd splits give tighter boxes (a Morton order's halves may interleave): the
searches open fewer nodes (docs/benchmarks.md, design choices).
Node ``i`` at depth ``d`` is entry ``2^d - 1 + i`` of the node arrays, whose length is bounded
by ``4 ceil(F / LEAF)`` (the exact fake's size; entries past ``2^(depth + 1) - 1`` are unused).

Every node stores the box of its faces, its sample range (the faces are sorted by sample, so a
query skips the nodes of other meshes) and the data of the hierarchical fast winding number
(Barill et al. 2018): the area-weighted centroid ``center``, the sum of the area vectors
``normal`` (area times unit normal), the first moment ``moment`` = sum of a_t n_t (c_t -
center)^T, and the radius of a ball about ``center`` holding the node's faces (its farthest corner). All of it is
computed in float64 and stored in the compute dtype; the triangles are stored sorted, three
(F, 3) arrays of corners, with their sample ids and their rows in the caller's faces. A tree for
unsigned searches only (``winding=False``) leaves the winding number's data out (those four
arrays empty): the rest is the same, bit for bit.
"""


from typing import NamedTuple

import torch
import warp as wp

from ... import _morton, _warp, _warp_funcs
from ..neighbours import nearest

LEAF = 4  # faces per leaf at most
THREADS = 2**31 - 1  # threads of one launch at most (Warp's thread ids are int32)
PER_LEVEL = [False]  # the CPU too builds the parent levels a launch per level, as CUDA does (tests)
# One mesh's CPU queries up to this many go in the kNN search's order (:func:`query_order`): its
# counting sort costs less than the sort, and up to here its cells (at most 32 a side) hold about
# one query each; more queries share cells, whose walks then cost more than the sort saves
# (docs/benchmarks.md, meshes).
COUNTED = 1 << 15
# The CPU split of this many faces times the tree's depth (its work), or more, runs the subtrees
# below the root on the threads (level with one thread at 520-700 faces, faster from about 900;
# docs/benchmarks.md, meshes); the kd-tree of the kNN search keeps pcops._warp.SERIAL_WORK
SPLIT_WORK = 1 << 12
RADIUS_WALK = [True]  # the CPU's radii by a walk per node (:func:`_radius_kernel`); False: CUDA's launch (tests)
# The CPU launches' work (:func:`pcops._warp.launch`'s steps, about a nanosecond each on one
# thread: the threshold of their threads) per face of the leaves' launch and per node of the
# nodes' data (each with and without the winding number's data), and per face of the radii's
# walks: their one-thread times on the benchmark's meshes (docs/benchmarks.md, design choices)
LEAF_STEPS = (40, 32)
NODE_STEPS = (16, 4)
RADIUS_STEPS = 64


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
    center: torch.Tensor  # (nodes, 3); the winding number's four: 0 rows without it
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
    """The order of points (M, 3) by sample id, then by Morton code (10 bits per axis over the box
    of their coordinates, NaN and inf ones counted as 0 there and put in cell 0): the faces'
    order on GPUs (by centroid)."""
    code = _codes(points)
    order = torch.argsort(code, stable=True)
    return order[torch.argsort(group[order], stable=True)]


def query_order(points: torch.Tensor, group: torch.Tensor, one: bool = False) -> torch.Tensor:
    """The order the searches take queries (M, 3) in: by ``group << 30 | Morton code`` in one
    stable sort (:func:`morton_order` takes two). Sample ids from 0 up to 2^33 (not
    included) keep samples apart; others may interleave, which slows the walks but changes no
    result (a query's order is not what it finds). ``one``: the queries of one mesh,
    which on the CPU, up to :data:`COUNTED` of them, go in the kNN search's order instead (the
    Morton order of cells, about one a query, by a counting sort on the calling thread; queries
    in a spatial order already, such as a grid's, stay as they are)."""
    if one and points.is_cpu and points.shape[0] <= COUNTED:
        return nearest.cpu_query_rows(points)
    return torch.argsort(group << 30 | _codes(points), stable=True)


def _codes(points: torch.Tensor) -> torch.Tensor:
    """(M,) int32 Morton code of each point's cell, 1024 cells a side over the box of the finite
    coordinates (see :func:`_keys_kernel`)."""
    points = points.contiguous()
    code = torch.empty(points.shape[0], dtype=torch.int32, device=points.device)
    if points.shape[0]:
        low, high = torch.aminmax(torch.nan_to_num(points, nan=0.0, posinf=0.0, neginf=0.0), dim=0)
        _warp.launch(_keys_kernel(points.dtype), points.shape[0], [points, low, high, _morton.spread_table(10, points.device), code],
                     like=points, work=4 * points.shape[0])
    return code


@_warp.kernels
def _keys_kernel(dtype: torch.dtype):
    """Thread i: the Morton code of point i's cell, 1024 cells a side over the box ``low`` ..
    ``high`` (a NaN or infinite coordinate: 0; ``(x - low) / (high - low) * 1023`` truncated,
    clamped to 0 .. 1023)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    _, morton = _warp_funcs.cells(dtype)
    finite_value, _ = _warp_funcs.finite(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def keys(start: int, points: wp.array(dtype=v), low: wp.array(dtype=s), high: wp.array(dtype=s), spread: wp.array(dtype=wp.int32),
             out: wp.array(dtype=wp.int32)):
        i = wp.tid() + start
        p = points[i]
        x = v()
        for c in range(3):
            if finite_value(p[c]):
                x[c] = (p[c] - low[c]) / wp.max(high[c] - low[c], s(1e-300)) * s(1023.0)
        out[i] = morton(spread, x, s(1023.0))

    return keys


def build(vertices: torch.Tensor, faces: torch.Tensor, group: torch.Tensor, dtype: torch.dtype, one: bool = False,
          winding: bool = True) -> Tree:
    """The hierarchy of faces (F, 3) (rows of vertices (V, 3)) with sample ids ``group`` (F,);
    ``one``: the faces are one mesh (every id the same), whose CPU order needs no sort by id;
    ``winding``: with the winding number's data (else those arrays are empty: unsigned searches)."""
    n = faces.shape[0]
    d = depth(n)
    device = vertices.device
    v64 = vertices.detach().to(torch.float64).contiguous()
    faces = faces.contiguous()
    centroid = v64.new_empty((n, 3))
    _warp.launch(_centroid_kernel(), n, [v64, faces, centroid], like=v64, work=3 * n)
    order = nearest.split_order(centroid, group, LEAF, one, SPLIT_WORK) if device.type == "cpu" else morton_order(centroid, group)
    # the leaves (one thread each): the sorted faces' corners, sample ids, box, sample range and
    # the sums of the fast winding number (area, area x centroid, area vector, area vector x
    # centroid), in float64, into the node arrays (entry 2^depth - 1 + leaf; node_count(F) rows,
    # the fake's: the finish kernel zeroes those past the last node)
    leaves, nodes, size = 1 << d, (2 << d) - 1, node_count(n)
    corners = v64.new_empty((3 * n if winding else 0, 3))
    ta, tb, tc = (v64.new_empty((n, 3), dtype=dtype) for _ in range(3))
    sorted_group = torch.empty_like(group)
    lo, hi, sums = v64.new_empty((size, 3)), v64.new_empty((size, 3)), v64.new_empty((size, 16 if winding else 0))
    glo, ghi = (torch.empty(size, dtype=torch.int64, device=device) for _ in range(2))
    scale = v64.new_empty((leaves,))
    _warp.launch(_leaves_kernel(dtype, winding), leaves, [d, v64, faces, order, group.contiguous(), corners, ta, tb, tc, sorted_group,
                                                lo, hi, glo, ghi, sums, scale], like=v64, **leaf_cut(n, winding))
    # every node above the leaves from its two children, up to the root (one thread, in one launch)
    if device.type == "cpu" and not PER_LEVEL[0]:  # one thread, every level
        _warp.launch(_parents_kernel(), 1, [d, -1, lo, hi, glo, ghi, sums], like=corners, work=nodes)
    else:  # a launch per level, a thread per node
        for level in range(d - 1, -1, -1):
            _warp.launch(_parents_kernel(), 1 << level, [d, level, lo, hi, glo, ghi, sums], like=corners)
    # every node's center, normal and moment, and the boxes in the search's dtype (a thread a node)
    rows = size if winding else 0  # (the winding number's arrays)
    center = v64.new_empty((rows, 3))
    lo_out, hi_out = (v64.new_empty((size, 3), dtype=dtype) for _ in range(2))
    center_out, normal = (v64.new_empty((rows, 3), dtype=dtype) for _ in range(2))
    moment = v64.new_empty((rows, 9), dtype=dtype)
    _warp.launch(_finish_kernel(dtype, winding), size, [nodes, lo, hi, glo, ghi, sums, center, lo_out, hi_out, center_out, normal, moment],
                 like=v64, **node_cut(size, winding))
    radius = v64.new_zeros((rows,))
    if winding:
        _radii(corners, n, d, lo, hi, center, radius)
    return Tree(order, ta, tb, tc, sorted_group, lo_out, hi_out, glo, ghi, center_out, normal, moment.view(rows, 3, 3),
                radius.to(dtype), scale.amax().to(dtype))


# (How the CPU cuts the build's launches into chunks, as the keywords of pcops._warp.launch and
# pcops._warp.prepare: the build and its kept form (:mod:`._kept_tree`) cut them alike.)


def leaf_cut(n: int, winding: bool) -> dict:
    """The leaves' launch's cut for n faces (:data:`LEAF_STEPS`)."""
    return dict(work=LEAF_STEPS[0 if winding else 1] * n, min_chunk=16)


def node_cut(size: int, winding: bool) -> dict:
    """The nodes' data's launch's cut for ``size`` node rows (:data:`NODE_STEPS`)."""
    return dict(work=NODE_STEPS[0 if winding else 1] * size, min_chunk=64)


def radius_cut(n: int) -> dict:
    """The CPU radii's launch's cut for n faces (:data:`RADIUS_STEPS`): a thread per chunk."""
    return dict(work=RADIUS_STEPS * n, min_chunk=1)


def radius_walks(n: int) -> int:
    """The threads of the CPU radii's launch of n faces (:func:`_radius_kernel`): one per chunk,
    as :func:`pcops._warp.launch` cuts its work (:func:`radius_cut`)."""
    return _warp.chunk_count(node_count(n), radius_cut(n)["work"], 1)


def _radii(corners, n: int, d: int, lo, hi, center, radius) -> None:
    """Each node's ``radius`` (zeros in, float64, the node arrays' rows): the distance from its
    center to the farthest corner of its faces (``corners``: float64, 3 a sorted face). On the
    CPU a walk per node that skips the children whose box lies within the farthest corner found;
    elsewhere (node i of depth l holds leaves i 2^(d - l) .. (i + 1) 2^(d - l) - 1) each leaf's
    farthest corner from each ancestor's center (one launch for every depth and leaf), into the
    node's radius by an atomic max: the same value."""
    if corners.is_cpu and RADIUS_WALK[0]:
        walks = radius_walks(n)
        _warp.launch(_radius_kernel(), walks, [corners, n, d, lo, hi, center, radius, walks], like=corners, **radius_cut(n))
    else:
        leaves, args = 1 << d, [corners, n, d, center]
        levels = [(0, d + 1)] if (d + 1) * leaves <= THREADS else [(level, 1) for level in range(d + 1)]
        for first, count in levels:
            _warp.launch(_reach_kernel(), count * leaves, [*args, first, radius], like=corners, work=3 * n * count)


@wp.func(module="unique")
def nan_min(a: wp.vec3d, b: wp.vec3d):
    """The smaller of a and b per coordinate, NaN if either is (torch.minimum's rule)."""
    for c in range(3):
        if b[c] < a[c] or b[c] != b[c]:
            a[c] = b[c]
    return a


@wp.func(module="unique")
def nan_max(a: wp.vec3d, b: wp.vec3d):
    """The larger of a and b per coordinate, NaN if either is (torch.maximum's rule)."""
    for c in range(3):
        if b[c] > a[c] or b[c] != b[c]:
            a[c] = b[c]
    return a


@_warp.kernels
def _finish_kernel(dtype: torch.dtype, winding: bool = True):
    """Thread i: node i's center (the area-weighted centroid of its faces; its box's center if
    its area is not > 0), in float64 (``center``) and in the search's dtype (``center_out``), its
    normal (the sum of the area vectors), its moment (sum of a n (c - center)^T, row-major in 9
    columns) and its box, in that dtype; every array zero past the last node (``nodes``).
    Without ``winding``: the box and the sample range only (the other arrays are empty)."""
    v, s = _warp.vec3(dtype), _warp.scalar(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def finish(start: int, nodes: int, lo: wp.array(dtype=wp.vec3d), hi: wp.array(dtype=wp.vec3d), glo: wp.array(dtype=wp.int64),
               ghi: wp.array(dtype=wp.int64), sums: wp.array2d(dtype=wp.float64), center: wp.array(dtype=wp.vec3d),
               lo_out: wp.array(dtype=v), hi_out: wp.array(dtype=v), center_out: wp.array(dtype=v), normal: wp.array(dtype=v),
               moment: wp.array2d(dtype=s)):
        i = wp.tid() + start
        if i >= nodes:  # past the last node: zeros
            glo[i] = wp.int64(0)
            ghi[i] = wp.int64(0)
            lo_out[i] = v()
            hi_out[i] = v()
            if wp.static(winding):
                center[i] = wp.vec3d()
                center_out[i] = v()
                normal[i] = v()
                for r in range(9):
                    moment[i, r] = s(0.0)
            return
        lo_out[i] = v(lo[i])
        hi_out[i] = v(hi[i])
        if not wp.static(winding):
            return
        area = sums[i, 0]
        c = wp.float64(0.5) * (lo[i] + hi[i])
        if area > wp.float64(0.0):
            c = wp.vec3d(sums[i, 1], sums[i, 2], sums[i, 3]) / area
        center[i] = c
        center_out[i] = v(c)
        normal[i] = v(wp.vec3d(sums[i, 4], sums[i, 5], sums[i, 6]))
        for r in range(3):
            for q in range(3):
                moment[i, 3 * r + q] = s(sums[i, 7 + 3 * r + q] - sums[i, 4 + r] * c[q])

    return finish


@_warp.kernels
def _centroid_kernel():
    """Thread i: the centroid of face i, in float64 (the mean of its corners, as torch's mean)."""

    @wp.kernel(enable_backward=False, module="unique")
    def centroids(start: int, vertices: wp.array(dtype=wp.vec3d), faces: wp.array2d(dtype=wp.int64), out: wp.array(dtype=wp.vec3d)):
        i = wp.tid() + start
        out[i] = (vertices[faces[i, 0]] + vertices[faces[i, 1]] + vertices[faces[i, 2]]) / wp.float64(3.0)

    return centroids


@_warp.kernels
def _leaves_kernel(dtype: torch.dtype, winding: bool = True):
    """Thread j: leaf j of ``depth``, the sorted faces ``part(j, F, depth)`` .. (faces ``order``):
    their corners (float64 ``corners`` rows 3k .. 3k + 2, and ``ta``, ``tb``, ``tc`` in the
    search's dtype), sample ids, the leaf's box (NaN if a corner is), first and last sample id,
    face sums and largest finite absolute coordinate (``scale[j]``); without ``winding`` neither
    the float64 corners nor the sums (the winding number's radius and sums)."""
    v = _warp.vec3(dtype)
    Sums = wp.types.vector(16, wp.float64)

    @wp.func(module="unique")
    def largest(big: wp.float64, p: wp.vec3d):
        for c in range(3):
            x = wp.abs(p[c])
            if x > big and x < wp.float64(wp.inf):  # NaN and inf do not count
                big = x
        return big

    @wp.kernel(enable_backward=False, module="unique")
    def leaves(start: int, depth: int, vertices: wp.array(dtype=wp.vec3d), faces: wp.array2d(dtype=wp.int64),
               order: wp.array(dtype=wp.int64), group: wp.array(dtype=wp.int64), corners: wp.array(dtype=wp.vec3d),
               ta: wp.array(dtype=v), tb: wp.array(dtype=v), tc: wp.array(dtype=v), sorted_group: wp.array(dtype=wp.int64),
               lo: wp.array(dtype=wp.vec3d), hi: wp.array(dtype=wp.vec3d), glo: wp.array(dtype=wp.int64),
               ghi: wp.array(dtype=wp.int64), sums: wp.array2d(dtype=wp.float64), scale: wp.array(dtype=wp.float64)):
        j = wp.tid() + start
        first = _warp_funcs.part(j, wp.int64(order.shape[0]), depth)
        last = _warp_funcs.part(j + 1, wp.int64(order.shape[0]), depth)
        inf = wp.float64(wp.inf)
        low = wp.vec3d(inf, inf, inf)
        high = wp.vec3d(-inf, -inf, -inf)
        total = Sums()
        big = wp.float64(0.0)
        for k in range(first, last):
            f = order[k]
            a, b, c = vertices[faces[f, 0]], vertices[faces[f, 1]], vertices[faces[f, 2]]
            if wp.static(winding):  # (the radius's corners)
                corners[3 * k] = a
                corners[3 * k + 1] = b
                corners[3 * k + 2] = c
            ta[k] = v(a)
            tb[k] = v(b)
            tc[k] = v(c)
            sorted_group[k] = group[f]
            low, high = nan_min(nan_min(nan_min(low, a), b), c), nan_max(nan_max(nan_max(high, a), b), c)
            big = largest(largest(largest(big, a), b), c)
            if not wp.static(winding):
                continue
            area_vec = wp.float64(0.5) * wp.cross(b - a, c - a)
            area = wp.length(area_vec)
            centroid = ((a + b) + c) / wp.float64(3.0)
            total[0] = total[0] + area
            for r in range(3):
                total[1 + r] = total[1 + r] + area * centroid[r]
                total[4 + r] = total[4 + r] + area_vec[r]
                for q in range(3):
                    total[7 + 3 * r + q] = total[7 + 3 * r + q] + area_vec[r] * centroid[q]
        node = (1 << depth) - 1 + j
        lo[node] = low
        hi[node] = high
        glo[node] = group[order[first]]
        ghi[node] = group[order[last - 1]]
        if wp.static(winding):
            for r in range(16):
                sums[node, r] = total[r]
        scale[j] = big

    return leaves


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
            lo[node] = nan_min(lo[a], lo[b])
            hi[node] = nan_max(hi[a], hi[b])
            glo[node] = glo[a]
            ghi[node] = ghi[b]
            for c in range(sums.shape[1]):
                sums[node, c] = sums[a, c] + sums[b, c]

    return parents


@_warp.kernels
def _radius_kernel():
    """Thread t of ``walks``: the radii of part t of ``walks`` of every depth's nodes (each depth's
    walks cost about alike: the upper nodes' are the longer, and fewer), each the
    distance from the node's center to the farthest corner of its faces at a finite distance (0
    if none), by a walk down its subtree, the farther child first, that skips a child whose
    box's farthest point from the center (computed as a corner's distance is, widened by 8
    float64 eps: never below the distance computed for a corner in it) is within the farthest
    corner found: the value of :func:`_reach_kernel`'s launch, with fewer corners measured."""
    widen = wp.float64(1.0 + 8.0 * torch.finfo(torch.float64).eps)
    _stack = wp.types.vector(length=64, dtype=wp.int32)

    @wp.kernel(enable_backward=False, module="unique")
    def radius_walk(start: int, corners: wp.array(dtype=wp.vec3d), n: int, depth: int, lo: wp.array(dtype=wp.vec3d),
                    hi: wp.array(dtype=wp.vec3d), center: wp.array(dtype=wp.vec3d), radius: wp.array(dtype=wp.float64), walks: int):
        leaf0 = (1 << depth) - 1
        t = wp.tid() + start
        for level in range(depth + 1):
            width = wp.int64(1 << level)  # (its part's bounds in int64: thread count times width)
            begin = int(width * wp.int64(t) // wp.int64(walks))
            end = int(width * wp.int64(t + 1) // wp.int64(walks))
            for e in range(int(width) - 1 + begin, int(width) - 1 + end):
                c = center[e]
                best = wp.float64(0.0)  # the largest squared distance: one root at the end (a root is monotonic)
                stack = _stack()
                stack[0] = e
                top = int(1)
                while top > 0:
                    top -= 1
                    k = stack[top]
                    if k >= leaf0:  # a leaf: its corners
                        j = k - leaf0
                        first = _warp_funcs.part(j, wp.int64(n), depth)
                        last = _warp_funcs.part(j + 1, wp.int64(n), depth)
                        for q in range(3 * first, 3 * last):
                            x = corners[q] - c
                            d2 = wp.dot(x, x)
                            if d2 < wp.float64(wp.inf):  # NaN and inf (and overflowing) distances do not count
                                best = wp.max(best, d2)
                        continue
                    a = 2 * k + 1
                    ga = wp.max(wp.abs(lo[a] - c), wp.abs(hi[a] - c))
                    gb = wp.max(wp.abs(lo[a + 1] - c), wp.abs(hi[a + 1] - c))
                    ba = wp.dot(ga, ga) * widen
                    bb = wp.dot(gb, gb) * widen
                    near, far, bn, bf = a, a + 1, ba, bb
                    if ba > bb:
                        near, far, bn, bf = a + 1, a, bb, ba
                    if not (bn <= best):  # (NaN boxes are walked)
                        stack[top] = near
                        top += 1
                    if not (bf <= best):  # popped first: the farther box
                        stack[top] = far
                        top += 1
                radius[e] = wp.sqrt(best)

    return radius_walk


@_warp.kernels
def _reach_kernel():
    """Thread (l, j) of (depths from ``first_level``, 2^d): the distance from the center of leaf
    j's ancestor at depth l to the farthest corner of the leaf's faces at a finite distance (0 if
    none), into that ancestor's ``radius`` by an atomic max (the largest over its leaves)."""

    @wp.kernel(enable_backward=False, module="unique")
    def reach(start: int, corners: wp.array(dtype=wp.vec3d), n: int, depth: int, center: wp.array(dtype=wp.vec3d),
              first_level: int, radius: wp.array(dtype=wp.float64)):
        t = wp.tid() + start
        leaves = 1 << depth
        level = first_level + t // leaves
        j = t - (t // leaves) * leaves
        first = _warp_funcs.part(j, wp.int64(n), depth)
        last = _warp_funcs.part(j + 1, wp.int64(n), depth)
        node = (1 << level) - 1 + (j >> (depth - level))
        c = center[node]
        best = wp.float64(0.0)  # the largest squared distance: one root at the end (a root is monotonic)
        for k in range(3 * first, 3 * last):
            e = corners[k] - c
            d2 = wp.dot(e, e)
            if d2 < wp.float64(wp.inf):  # NaN and inf (and overflowing) distances do not count
                best = wp.max(best, d2)
        wp.atomic_max(radius, node, wp.sqrt(best))

    return reach


def empty_like(vertices: torch.Tensor, faces: torch.Tensor, dtype: torch.dtype, winding: bool = True) -> Tree:
    """A tree's tensors with the exact shapes of :func:`build` (the fake)."""
    n = faces.shape[0]
    size = node_count(n)
    rows = size if winding else 0
    f = lambda *shape: vertices.new_empty(shape, dtype=dtype)  # noqa: E731
    i = lambda *shape: vertices.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return Tree(i(n), f(n, 3), f(n, 3), f(n, 3), i(n), f(size, 3), f(size, 3), i(size), i(size), f(rows, 3), f(rows, 3),
                f(rows, 3, 3), f(rows), f())
