"""Warp functions shared by pcops' kernels: one definition each.

Each factory returns ``@wp.func`` functions for one float dtype (and variant), cached per
arguments and created under the build lock (:func:`pcops._warp.kernels`):

* :func:`sorted_insert` -- keep a row's k best (distance, index) pairs sorted by insertion
  (ball query, in a range of columns per radius; the kd-tree search on squared distances);
* :func:`heap_insert` -- the same row, appended while not full, then kept as a max-heap, and
  sorted at the end (the ball query's rows of many columns);
* :func:`bounds` -- the box of a range of points (the kd-tree's nodes, the CPU query order);
* :func:`finite` -- whether a value or a point is finite, inline (Warp's ``isfinite`` is a
  call on the CPU);
* :func:`finite_bounds` -- the box of the finite points of a range (FPS's trees, the cell
  list's bounding box on the CPU);
* :func:`flag_not_finite` -- a flag set where a point of a strided range is NaN or inf (the
  values check of a plain call inside its own launch: the kNN scan, chamfer's pass, FPS);
* :func:`plane_normal` -- a triangle's normal in float64, accurate for thin float64 triangles
  (the mesh search's and closest-point kernels' planes);
* :func:`spread` -- the bits of an integer two zero bits apart, one axis of a 3-d Morton code:
  the one definition of the bit spread (serialize's curve codes; the table of ``morton``). A
  function, not a factory: it has no dtype, and it is created once, at import;
* :func:`part` -- the first row of a node of the implicit trees (the kd-tree, the mesh
  hierarchy, FPS's trees), which split n sorted items at the middle index: node k of depth d
  holds rows ``part(k, n, d) .. part(k + 1, n, d) - 1``. A function, created once, at import;
* :func:`edge_row` -- a point's edges (neighbour, point) from its row of a sorted neighbour
  table: ``knn_graph`` / ``radius_graph``'s edge rows, and the kd-tree search that writes a
  kept graph's edges itself. A function, created once, at import;
* :func:`cells` -- ``cell`` (a coordinate, in cells from a low corner, as a clamped cell index)
  and ``morton`` (the Morton code of a point's cell, from a table of :func:`spread`): the
  kd-tree's Morton order of queries;
* :func:`cell_offset` -- a coordinate in cells from a grid's low side, without the overflow of
  the subtraction (the cell list's keys and windows);
* :func:`cell_range` -- the first and last cell of the cell list a query must scan (the radius
  ops and the ball query);
* :func:`cell_scan` -- a query's scan of the cell list (its arrays in one struct, the cells
  of a query and the runs of sorted points in them): the loop of every kernel that scans one.

Runtime glue (device and stream binding, conversion, launches) is in :mod:`pcops._warp`. (No
``from __future__ import annotations`` in this module: Warp reads the annotations of these
closures at definition time.)
"""

import math

import torch
import warp as wp

from ._warp import kernels, scalar, vec3


def root_band(dtype: torch.dtype) -> tuple:
    """(below, above) in ``dtype``: a square a less than b * below, or more than b * above, has
    a root less, or more, than b's; between them the roots decide (they may be equal)."""
    s, eps = scalar(dtype), torch.finfo(dtype).eps
    return s(1.0 - 8.0 * eps), s(1.0 + 8.0 * eps)


@kernels
def sorted_insert(dtype: torch.dtype, squared: bool = False, columns: bool = False):
    """``insert(dists, idx, i, n, d, j) -> n``: put (d, j) into row i of (M, k) arrays that hold
    the row's n best pairs sorted by distance, ties by the smaller index; returns the new count.
    A pair worse than a full row's last is dropped.

    ``columns``: ``insert(dists, idx, i, first, k, n, d, j) -> n``, the same in the k columns
    ``first .. first + k - 1`` of row i (several sorted rows side by side: the ball queries of
    several radii). The plain form is this one on all the columns.

    ``squared``: the row holds squared distances, in the order of their square roots (the
    distances returned), ties by the smaller index: two squares a few ulps apart can have the
    same root, so squares that close are compared by their roots (rarely: a row costs a few
    square roots instead of one per insertion).
    """
    s = scalar(dtype)
    below, above = root_band(dtype)

    @wp.func(module="unique")
    def before(a: s, ja: wp.int64, b: s, jb: wp.int64):
        """Whether (a, ja) comes first: by distance, then index."""
        if wp.static(squared):
            if a < b * below:
                return True
            if a > b * above:
                return False
            a = wp.sqrt(a)
            b = wp.sqrt(b)
        return a < b or (a == b and ja < jb)

    @wp.func(module="unique")
    def insert_in(dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, first: int, k: int, n: int, d: s, j: wp.int64):
        last = first + wp.min(n, k - 1)
        if n < k or before(d, j, dists[i, last], idx[i, last]):
            pos = last
            while pos > first:
                if before(dists[i, pos - 1], idx[i, pos - 1], d, j):
                    break
                dists[i, pos] = dists[i, pos - 1]
                idx[i, pos] = idx[i, pos - 1]
                pos = pos - 1
            dists[i, pos] = d
            idx[i, pos] = j
            return wp.min(n + 1, k)
        return n

    @wp.func(module="unique")
    def insert(dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, n: int, d: s, j: wp.int64):
        return insert_in(dists, idx, i, 0, dists.shape[1], n, d, j)

    return insert_in if columns else insert


@kernels
def heap_insert(dtype: torch.dtype):
    """``(push, finish)``: :func:`sorted_insert`'s row of k pairs (the k best by distance, then
    index) made for rows that may meet many more than k points. ``push(dists, idx, i, first,
    k, n, d, j) -> n`` appends (d, j) to the k columns ``first ..`` of row i while fewer than k
    are held (n of them, unsorted); the first pair past a full row turns the row into a max-heap
    (its root the worst pair held; n becomes k + 1), and from then on a pair better than the
    root replaces it (log k moves, where a sorted row shifts up to k). ``finish(dists, idx, i,
    first, k, n)`` sorts the row at the end: a heap sort of a heap, an insertion sort of the
    appended pairs (the shifts a sorted insertion would have made as they came). The row then
    holds exactly what the sorted insertion would: the k best pairs of a strict order (no two
    pairs share an index), ascending."""
    s = scalar(dtype)
    insert_in = sorted_insert(dtype, False, True)

    @wp.func(module="unique")
    def before(a: s, ja: wp.int64, b: s, jb: wp.int64):
        return a < b or (a == b and ja < jb)

    @wp.func(module="unique")
    def down(dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, first: int, n: int, at: int, d: s, j: wp.int64):
        """Put (d, j) at position ``at`` of the heap of n pairs and sift it down."""
        pos = at
        while True:
            c = 2 * pos + 1
            if c >= n:
                break
            if c + 1 < n and before(dists[i, first + c], idx[i, first + c], dists[i, first + c + 1], idx[i, first + c + 1]):
                c = c + 1  # the later child
            if not before(d, j, dists[i, first + c], idx[i, first + c]):
                break
            dists[i, first + pos] = dists[i, first + c]
            idx[i, first + pos] = idx[i, first + c]
            pos = c
        dists[i, first + pos] = d
        idx[i, first + pos] = j

    @wp.func(module="unique")
    def push(dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, first: int, k: int, n: int, d: s, j: wp.int64):
        if n < k:
            dists[i, first + n] = d
            idx[i, first + n] = j
            return n + 1
        if n == k:  # a full row meets one more: heapify it (once)
            at = k // 2 - 1
            while at >= 0:
                down(dists, idx, i, first, k, at, s(dists[i, first + at]), wp.int64(idx[i, first + at]))
                at = at - 1
        if before(d, j, dists[i, first], idx[i, first]):  # (better than the worst held: it goes)
            down(dists, idx, i, first, k, 0, d, j)
        return k + 1

    @wp.func(module="unique")
    def finish(dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, first: int, k: int, n: int):
        if n > k:  # a heap: sorted by taking its root to the end, k times
            end = k - 1
            while end > 0:
                d = s(dists[i, first + end])  # (copies, one a statement: read as a tuple, the pair was the slot, overwritten below)
                j = wp.int64(idx[i, first + end])
                dists[i, first + end] = dists[i, first]
                idx[i, first + end] = idx[i, first]
                down(dists, idx, i, first, end, 0, d, j)
                end = end - 1
        else:  # appended: an insertion sort, each pair into the sorted ones before it
            c = int(1)
            while c < n:
                insert_in(dists, idx, i, first, c + 1, c, s(dists[i, first + c]), wp.int64(idx[i, first + c]))
                c = c + 1

    return push, finish


@kernels
def bounds(dtype: torch.dtype):
    """``box(points, first, last, step) -> (lo, hi)``: the box of points[first:last:step]."""
    s, v = scalar(dtype), vec3(dtype)

    @wp.func(module="unique")
    def box(points: wp.array(dtype=v), first: int, last: int, step: int):
        """(lo, hi): the box of points[first:last:step], by component (selects, faster than
        vector min / max); NaN coordinates are left out (NaN points only: an empty box, from
        +inf to -inf)."""
        lx, ly, lz = s(wp.inf), s(wp.inf), s(wp.inf)
        hx, hy, hz = -s(wp.inf), -s(wp.inf), -s(wp.inf)
        j = first
        while j < last:  # (step >= 1; a while loop: faster than Warp's range loop on the CPU)
            p = points[j]
            lx = wp.where(p[0] < lx, p[0], lx)
            ly = wp.where(p[1] < ly, p[1], ly)
            lz = wp.where(p[2] < lz, p[2], lz)
            hx = wp.where(p[0] > hx, p[0], hx)
            hy = wp.where(p[1] > hy, p[1], hy)
            hz = wp.where(p[2] > hz, p[2], hz)
            j += step
        return v(lx, ly, lz), v(hx, hy, hz)

    return box


@kernels
def widest_axis(dtype: torch.dtype):
    """``widest(extent) -> axis``: the axis of the largest component of a box's extent (the
    first of equals; NaN components never)."""
    v = vec3(dtype)

    @wp.func(module="unique")
    def widest(extent: v):
        axis = int(0)
        if extent[1] > extent[0]:
            axis = 1
        if extent[2] > extent[axis]:
            axis = 2
        return axis

    return widest


@kernels
def finite(dtype: torch.dtype):
    """``(value, point)``: whether a scalar, or every coordinate of a point, is neither NaN nor
    inf: its absolute value below inf (false for NaN), compared inline. Warp's ``isfinite``
    calls out to its runtime on the CPU: a conversion to double and a call a coordinate
    (docs/benchmarks.md, design choices)."""
    s, v = scalar(dtype), vec3(dtype)
    inf = s(math.inf)

    @wp.func(module="unique")
    def value(x: s) -> bool:
        return wp.abs(x) < inf

    @wp.func(module="unique")
    def point(p: v) -> bool:
        return wp.abs(p[0]) < inf and wp.abs(p[1]) < inf and wp.abs(p[2]) < inf

    return value, point


# The fill of :func:`fill_row` (the same C++ for the CPU and CUDA)
_FILL_SNIPPET = r"""
if (first >= last)
    return;
wp::int64* I = wp::address(idx, i, 0);
const long long is = idx.strides[1] / (long long)sizeof(wp::int64);
for (int c = first; c < last; ++c)
    I[c * is] = -1;
if (dists.shape[1] > 0) {
    auto* D = wp::address(dists, i, 0);
    const long long ds = dists.strides[1] / (long long)sizeof(*D);
    for (int c = first; c < last; ++c)
        D[c * ds] = inf;
}
"""


@kernels
def fill_row(dtype: torch.dtype):
    """``fill(dists, idx, i, first, last, inf)``: columns ``first .. last - 1`` of row i past a
    search's neighbours: -1 in ``idx``, ``inf`` in ``dists`` where it has columns (a search by
    index keeps none). Stores through the row's pointer in native code: Warp's indexed stores
    test every index for a negative one (Python's wrapping) and cost several times as much
    (docs/benchmarks.md, design choices)."""
    s = scalar(dtype)

    @wp.func_native(_FILL_SNIPPET)
    def fill(dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, first: int, last: int, inf: s): ...

    return fill


@kernels
def finite_bounds(dtype: torch.dtype):
    """``box(points, first, last) -> (lo, hi)``: the box of the finite points of
    points[first:last] (a point with a NaN or inf coordinate is left out; none: +inf to -inf)."""
    s, v = scalar(dtype), vec3(dtype)
    _, point = finite(dtype)

    @wp.func(module="unique")
    def box(points: wp.array(dtype=v), first: int, last: int):
        lo = v(s(wp.inf))
        hi = v(-s(wp.inf))
        for j in range(first, last):
            p = points[j]
            if point(p):
                lo = wp.min(lo, p)
                hi = wp.max(hi, p)
        return lo, hi

    return box


@kernels
def flag_not_finite(dtype: torch.dtype):
    """``flag(points, first, end, step, bad)``: ``bad[0] = 1`` where a point of
    ``points[first:end:step]`` holds NaN or inf (a launch's threads, each from its own first
    point by their number, look at every point between them; one thread: step 1)."""
    v = vec3(dtype)
    _, point = finite(dtype)

    @wp.func(module="unique")
    def flag(points: wp.array(dtype=v), first: int, end: int, step: int, bad: wp.array(dtype=wp.int32)):
        j = first
        while j < end:  # (step >= 1)
            if not point(points[j]):
                bad[0] = 1
            j += step

    return flag


@wp.func_native("""
#if defined(__CUDA_ARCH__)
return __dmul_rn(x, y);
#else
return x * y;
#endif
""")
def mul_rounded(x: wp.float64, y: wp.float64) -> wp.float64:
    """x y rounded to float64 and never fused into an FMA: CUDA code is compiled with FMA contraction
    (Warp's ``fuse_fp``), which may merge a product with a later sum across statements, and the
    error-free transformations of :func:`plane_normal` need the rounded product itself (the CPU
    compiler contracts within one expression only, and Warp emits one operation a statement)."""
    ...


@wp.func_native("""
#if defined(__CUDA_ARCH__)
return __ffsll((long long)bits) - 1;
#else
return __builtin_ctzll(bits);
#endif
""")
def lowest(bits: wp.uint64) -> int:
    """The position of the lowest set bit of ``bits`` (not 0): with ``bits & (bits - 1)``, which
    clears it, a loop over the set bits in increasing order."""
    ...


@kernels
def by_coordinate(dtype: torch.dtype):
    """``put(flat, first, n, j, p)``: point j of n points in ``flat`` by coordinate (the layout
    of :class:`lanes`' native code): its x, y, z at first + j, first + n + j, first + 2 n + j."""
    v = vec3(dtype)
    s = scalar(dtype)

    @wp.func(module="unique")
    def put(flat: wp.array(dtype=s), first: int, n: int, j: int, p: v):
        flat[first + j] = p[0]
        flat[first + n + j] = p[1]
        flat[first + 2 * n + j] = p[2]

    return put


class lanes:  # noqa: N801 (read as ``@lanes.func_native(...)``, like ``@wp.func_native``)
    """Native functions on vectors of lanes in the points' precision."""

    @staticmethod
    def func_native(body: str, dtype: torch.dtype, name: str):
        """A decorator: ``wp.func_native`` of the stub (its typed signature, renamed ``name`` and
        the precision) with ``body`` as its code, where ``real`` is float or double, and on the
        CPU ``lanes`` a vector of 32 bytes of them (8 float32 or 4 float64; GCC's vector
        extensions, since Warp's CPU loops are not vectorised), ``mask`` the integer vector of
        its comparisons, ``ints`` int32 lanes, ``L`` the lanes; no product and sum fused into a
        multiply-add (Warp's CPU code rounds each: the same values). ``OPAQUE(v)`` hides a
        vector's value from the optimiser (an empty asm with AVX): a blend of a loaded vector
        stored back to the same place then stays a whole store, where clang would make it a
        masked store (``vmaskmovps``), microcoded on AMD's Zen 2 and 3 (docs/benchmarks.md, design choices).
        ``BITS(m)``: a comparison's lanes as the low bits of an unsigned (one ``vmovmskps`` /
        ``vmovmskpd`` with AVX, where clang reduced the lanes' bits through a chain of shuffles;
        else that reduction). Vector code must sit in
        ``#if !defined(__CUDA_ARCH__)`` (the kernels compile for CUDA too). Used as a
        decorator named ``func_native``, as Warp reads a native function's return type only then."""
        real, index = ("float", "int") if dtype == torch.float32 else ("double", "long long")
        prelude = f"""
#if defined(__clang__) && !defined(__CUDA_ARCH__)
#pragma clang fp contract(off)
#endif
typedef {real} real;
#if !defined(__CUDA_ARCH__)
typedef real lanes __attribute__((vector_size(32)));
typedef {index} mask __attribute__((vector_size(32)));
const int L = (int)(sizeof(lanes) / sizeof(real));
typedef int ints __attribute__((vector_size(sizeof(int) * sizeof(lanes) / sizeof(real))));
#endif
#if defined(__AVX__) && !defined(__CUDA_ARCH__)
#define OPAQUE(v) __asm__("" : "+x"(v))
#define BITS(m) ((unsigned)__builtin_ia32_movmskp{"s" if dtype == torch.float32 else "d"}256((lanes)(m)))
#else
#define OPAQUE(v) (void)0
#define BITS(m) ((unsigned)__builtin_reduce_or((m) & (mask){{{", ".join(str(1 << l) for l in range(8 if dtype == torch.float32 else 4))}}}))
#endif
"""

        def decorate(stub):
            stub.__name__ = stub.__qualname__ = f"{name}_{real}"
            return wp.func_native("{" + prelude + body + "}")(stub)

        return decorate


@kernels
def plane_normal(dtype: torch.dtype):
    """``normal(a, b, c) -> n``: (b - a) x (c - a) of a triangle's corners (float64 vectors whose
    coordinates are of ``dtype``), in float64. float32 corners: the plain formula (their differences
    are exact in float64, and a thin face's normal then accurate). float64 corners: from the exact
    differences (two-sum) and products (Veltkamp's split, Dekker's product; no FMA needed: the
    products they rely on are :func:`mul_rounded`, which CUDA's FMA contraction cannot merge), the
    normal's components within a few float64 ulps of the exact ones: the plain formula's cancel in
    a thin face's (off by about eps over its height over its longest edge). A corner that is not
    finite: the plain formula."""
    exact = dtype == torch.float64
    d = wp.float64
    _, finite_normal = finite(torch.float64)
    splitter = d(134217729.0)  # 2^27 + 1: a float64 as two halves of 26 bits

    @wp.func(module="unique")
    def low(x: d, y: d):
        """The rounding error of x + y (two-sum's second part)."""
        total = x + y
        t = total - x
        return (x - (total - t)) + (y - t)

    @wp.func(module="unique")
    def two_product(x: d, y: d):
        p = mul_rounded(x, y)
        cx, cy = mul_rounded(splitter, x), mul_rounded(splitter, y)
        xh, yh = cx - (cx - x), cy - (cy - y)
        xl, yl = x - xh, y - yh
        return p, ((xh * yh - p) + xh * yl + xl * yh) + xl * yl

    @wp.func(module="unique")
    def component(x: d, xe: d, y: d, ye: d, z: d, ze: d, w: d, we: d):
        """x y - z w of the exact values x + xe, y + ye, z + ze, w + we (xe.. the low parts)."""
        p, pe = two_product(x, y)
        q, qe = two_product(z, w)
        hi = p - q
        return hi + (low(p, -q) + (pe - qe) + ((x * ye + xe * y) - (z * we + ze * w)))

    @wp.func(module="unique")
    def normal(a: wp.vec3d, b: wp.vec3d, c: wp.vec3d):
        u, w = b - a, c - a
        n = wp.cross(u, w)
        if wp.static(exact):
            if finite_normal(n):
                ue = wp.vec3d(low(b[0], -a[0]), low(b[1], -a[1]), low(b[2], -a[2]))
                we = wp.vec3d(low(c[0], -a[0]), low(c[1], -a[1]), low(c[2], -a[2]))
                n = wp.vec3d(component(u[1], ue[1], w[2], we[2], u[2], ue[2], w[1], we[1]),
                             component(u[2], ue[2], w[0], we[0], u[0], ue[0], w[2], we[2]),
                             component(u[0], ue[0], w[1], we[1], u[1], ue[1], w[0], we[0]))
        return n

    return normal


@wp.func(module="unique")
def spread(v: wp.int64):
    """The 21 low bits of v moved to bits 0, 3, 6, ..., 60 (two zero bits after each): one axis
    of a 3-d Morton code, ``spread(x) << 2 | spread(y) << 1 | spread(z)`` (a split by masks)."""
    v = v & wp.int64(0x1FFFFF)
    v = (v | (v << wp.int64(32))) & wp.int64(0x1F00000000FFFF)
    v = (v | (v << wp.int64(16))) & wp.int64(0x1F0000FF0000FF)
    v = (v | (v << wp.int64(8))) & wp.int64(0x100F00F00F00F00F)
    v = (v | (v << wp.int64(4))) & wp.int64(0x10C30C30C30C30C3)
    v = (v | (v << wp.int64(2))) & wp.int64(0x1249249249249249)
    return v


@wp.func(module="unique")
def part(k: int, n: wp.int64, d: int):
    """The first of the n sorted items held by node k of depth d of an implicit tree (each node
    split at its middle index): floor(k n / 2^d)."""
    return int((n * wp.int64(k)) >> wp.int64(d))


@wp.func(module="unique")
def edge_row(idx: wp.array2d(dtype=wp.int64), i: int, width: int, k: int, loop: int, edges: wp.array2d(dtype=wp.int64),
             base: wp.int64, room: wp.int64):
    """Point i's first ``k`` valid neighbours among the first ``width`` entries of its row of the
    sorted table ``idx`` (its valid entries first, -1 after them) but itself (itself too where
    ``loop`` != 0), in row order, as edges (neighbour, i) into columns ``base ..`` of ``edges``,
    at most ``room`` of them; returns how many it had (a caller compares them with ``room``)."""
    n = wp.int64(0)
    c = int(0)
    while c < width and n < wp.int64(k):
        o = idx[i, c]
        if o < wp.int64(0):
            break
        if loop != 0 or o != wp.int64(i):
            if n < room:
                edges[0, base + n] = o
                edges[1, base + n] = wp.int64(i)
            n = n + wp.int64(1)
        c = c + 1
    return n


@kernels
def cells(dtype: torch.dtype):
    """``cell(x, top)``: the cell of a coordinate x (in cells from the low side), 0 .. top
    (NaN and x <= 0: 0; x > top, +inf included: top); ``morton(spread, x, top)``: the Morton
    code of the cell at x (a 3-vector in cells from the low corner), ``spread[c]`` being
    :func:`spread` of c, a table of len(spread) = top + 1 entries (at most 2^10: the code fits
    an int32), filled once by the caller (a lookup, faster than :func:`spread` per coordinate
    (docs/benchmarks.md, design choices))."""
    s, v = scalar(dtype), vec3(dtype)

    @wp.func(module="unique")
    def cell(x: s, top: s):
        return int(wp.where(x > s(0.0), wp.min(x, top), s(0.0)))

    @wp.func(module="unique")
    def morton(spread: wp.array(dtype=wp.int32), x: v, top: s):
        return spread[cell(x[0], top)] | (spread[cell(x[1], top)] << 1) | (spread[cell(x[2], top)] << 2)

    return cell, morton


def reach_floor(dtype: torch.dtype) -> float:
    """The least reach of a radius search in ``dtype``: 128 times the square root of its smallest
    subnormal number. A kernel's test (``|q - p| <= radius`` from the summed squares, or the
    squares compared) rounds each square to a multiple of that subnormal, so it may pass a point
    whose squared distance exceeds the radius' square by a few of them, a point whose squares all
    round to 0 included; beyond this reach that excess is under 1/6,000 of the square, which
    the cell window's margin covers (:func:`cell_range`, and
    :class:`pcops.ops.neighbours._cells.CellList`'s cells)."""
    info = torch.finfo(dtype)
    return 128.0 * math.sqrt(info.tiny * info.eps)


@kernels
def cell_offset(dtype: torch.dtype):
    """``offset(x, low, inv_h)``: a coordinate x in cells from a grid's low side ``low`` (cells
    ``1 / inv_h`` wide), ``(x - low) * inv_h`` as the dtype rounds it, but from halves: the same
    value bit for bit where ``x - low`` is finite, and finite where it overflows (float32 points
    at -3e38 and 3e38) instead of inf, which put such points outside the grid."""
    s = scalar(dtype)

    @wp.func(module="unique")
    def offset(x: s, low: s, inv_h: s):
        return ((x * s(0.5) - low * s(0.5)) * inv_h) * s(2.0)

    return offset


@kernels
def cell_range(dtype: torch.dtype):
    """``box(q, radius, frame, dims) -> (lo, hi)``: the first and last cell (x, y, z) of a cell
    list (``frame``: low corner x, y, z and 1 / the cell widths in x, y, z; ``dims`` cells a
    side) that may hold a point within ``radius`` of q, clamped to the grid (lo > hi on an
    axis: none; so on the axis of a NaN or infinite coordinate of q, which the clamp takes to
    -1 or n); a radius reaches at least :func:`reach_floor`."""
    s, v = scalar(dtype), vec3(dtype)
    floor = s(reach_floor(dtype))
    offset = cell_offset(dtype)

    @wp.func(module="unique")
    def box(q: v, radius: s, frame: wp.array(dtype=s), dims: wp.vec3i):
        lo = wp.vec3i(0, 0, 0)
        hi = wp.vec3i(0, 0, 0)
        r = wp.max(radius, floor)
        for a in range(3):
            n = dims[a]
            inv_h = frame[3 + a]
            reach = r + s(1e-3) / inv_h  # a margin for rounding at cell borders
            # cell coordinates clamped to [-1, n] (inf included) before the conversion to int
            first = int(wp.floor(wp.clamp(offset(q[a] - reach, frame[a], inv_h), s(-1.0), s(n))))
            last = int(wp.floor(wp.clamp(offset(q[a] + reach, frame[a], inv_h), s(-1.0), s(n))))
            lo[a] = wp.max(first, 0)
            hi[a] = wp.min(last, n - 1)
        return lo, hi

    return box


@kernels
def _cells_struct(dtype: torch.dtype):
    """The struct of :func:`cell_scan` for ``dtype``."""
    s, v = scalar(dtype), vec3(dtype)

    class Cells:
        rows: wp.array(dtype=wp.int64)
        starts: wp.array(dtype=wp.int64)
        frame: wp.array(dtype=s)
        dims: wp.vec3i
        query: wp.array(dtype=v)
        groups: wp.array(dtype=wp.int32)
        points: wp.array(dtype=v)
        order: wp.array(dtype=wp.int64)

    return wp.struct(Cells, module="unique")  # (Warp 1.19's decorator form needs the class)


@kernels
def cell_scan(dtype: torch.dtype, dense: bool = False):
    """``(Cells, window, run)``: one query's scan of the cell list, for every kernel that scans
    one (its Python side: ``pcops.ops.neighbours._cells.CellList.scan``)::

        i = int(cells.rows[wp.tid() + start])      # queries in cell order
        q = cells.query[i]
        lo, hi = window(cells, i, q, radius)
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                first, last = run(cells, lo, hi, y, z)
                for j in range(first, last):       # cells.points[j], original index cells.order[j]

    ``Cells`` (a struct): ``rows`` the queries in cell order, ``starts`` (the sorted points of
    cell c: starts[c] .. starts[c + 1]), ``frame`` and ``dims`` (see :func:`cell_range`),
    ``query`` and ``groups`` (the query points and their sample ids), ``points`` (the
    reference points sorted by cell) and ``order`` (their original indices).
    ``window(cells, i, q, radius) -> (lo, hi)``: the cells that may hold a point within
    ``radius`` of query i at q (:func:`cell_range`), z counted from the first cell of its
    sample; none for a q with a NaN or infinite coordinate (an empty range on that axis).
    ``run(cells, lo, hi, y, z) -> (first, last)``: the sorted points of the window's cells in
    row (y, z), contiguous (cells are sorted by z, y, x).

    Two loops over y and z, not one over the window's rows (a division per row), and no
    finiteness test of q in ``window`` (the empty range does it) (docs/benchmarks.md, design choices).

    ``dense``: the same loops over every point instead, in the list's order (``window`` one
    cell, none for a q with a NaN or infinite coordinate; ``run`` all of ``cells.points``):
    reads ``rows``, ``query``, ``points`` and ``order`` only, so a kernel scans one cloud
    without a cell list (:func:`pcops.ops.neighbours._cells.every_point`), or a list of one
    cell in the order its window would.
    """
    _, finite_point = finite(dtype)
    s, v = scalar(dtype), vec3(dtype)
    box = cell_range(dtype)
    Cells = _cells_struct(dtype)  # one type for both forms

    @wp.func(module="unique")
    def window(cells: Cells, i: int, q: v, radius: s):
        lo, hi = box(q, radius, cells.frame, cells.dims)
        base = int(cells.groups[i]) * cells.dims[2]
        lo[2] = lo[2] + base
        hi[2] = hi[2] + base
        return lo, hi

    @wp.func(module="unique")
    def run(cells: Cells, lo: wp.vec3i, hi: wp.vec3i, y: int, z: int):
        row = (z * cells.dims[1] + y) * cells.dims[0]
        return int(cells.starts[row + lo[0]]), int(cells.starts[row + hi[0] + 1])

    @wp.func(module="unique")
    def one_cell(cells: Cells, i: int, q: v, radius: s):
        hi = wp.vec3i(0, 0, 0)
        if not finite_point(q):
            hi = wp.vec3i(-1, -1, -1)
        return wp.vec3i(0, 0, 0), hi

    @wp.func(module="unique")
    def every(cells: Cells, lo: wp.vec3i, hi: wp.vec3i, y: int, z: int):
        return int(0), cells.points.shape[0]

    if dense:
        return Cells, one_cell, every
    return Cells, window, run
