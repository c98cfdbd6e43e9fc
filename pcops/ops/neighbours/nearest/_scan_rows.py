"""The kNN scan's row (:func:`native_row`), the tree search's leaf (:func:`native_leaf`), a
run of the ball search (:func:`native_ball`) and the blocks of a run that ``radius_aggregate``'s
kernels visit (:func:`native_near`, :func:`point_blocks`) on the CPU in native code on vectors.

The scan (:func:`._kdtree.scan_row`) measures every point of a range from one query and keeps
the k best in a sorted row. Measured one by one in Warp's scalar code, and inserted in the
points' order, a row spends most of its time in insertions of points that a later one pushes
out again. Here the points go 32 bytes at a time (8 float32 or 4 float64 lanes, read as
they lie, x y z after x y z, and regrouped by coordinate with shuffles: float32 points read in
16-byte pieces, so that the shuffles stay within the vectors' halves) in two passes over tiles
of :data:`TILE` points:

1. each point's squared distance, kept in a buffer of the tile, while each lane keeps its
   ``levels`` smallest distances so far (a short sorting network per vector);
2. the k-th smallest of those ``levels`` x L distances (distinct points' distances: the row's k
   best are no farther, up to the root ties the tree's slack covers) bounds the row, and only
   the buffer's distances within the bound are inserted, with the tree search's insertion.

Few more than k points are inserted (the counts and times: docs/benchmarks.md, design
choices), and the result is the scalar row's:
the same k best pairs in the same total order (by root, ties by the smaller index), whatever
order they were inserted in; NaN and infinite distances are never neighbours. In CUDA code
(compiled, not run), and for points not laid one after another (every caller's are: the search
makes them contiguous), the function returns -1 and the Warp row runs as before.

A leaf of the tree search holds at most :data:`._kdtree.LEAF` points: they go a vector at a time
(the last vector ending at the leaf's last point, its lanes before the vector's first dropped),
and those within the search's bound are inserted in the points' order, the bound tightened as
the Warp loop tightens it: the row after the leaf is the loop's, pair for pair.
"""

import torch
import warp as wp

from .... import _warp, _warp_funcs

TILE = 256  # points a tile (a multiple of 8): its distances buffered on the stack
LEVELS = 8  # smallest distances a lane keeps at most (the bound needs levels x lanes >= k)

_ROW_SNIPPET = r"""
#if defined(__CUDA_ARCH__)
return -1;
#else
if (points.strides[0] != 3 * (long long)sizeof(real))  // (points not one after another: the Warp row)
    return -1;
const int k = dists.shape[1];
real* D = wp::address(dists, t, 0);
wp::int64* I = wp::address(idx, t, 0);
const long long ds = dists.strides[1] / (long long)sizeof(real), is = idx.strides[1] / (long long)sizeof(wp::int64);
for (int c = 0; c < k; ++c) {
    D[c * ds] = inf;
    I[c * is] = -1;
}
if (!(q[0] < inf && q[0] > -inf && q[1] < inf && q[1] > -inf && q[2] < inf && q[2] > -inf))  // (NaN fails both; inline, where wp::isfinite calls out)
    return 0;
int n = 0;
real bound = inf;
INSERT
const real* P = (const real*)wp::address(points, 0);
const lanes qx = (lanes){} + q[0], qy = (lanes){} + q[1], qz = (lanes){} + q[2], far = (lanes){} + inf;
int levels = (2 * k + L - 1) / L;  // about 2 k lanes' distances: the bound near the k-th
if (levels > LEVELS)
    levels = LEVELS;
const bool bounded = levels * L >= k;
// the passes, with the lanes' levels a constant (1, 2, 4 or LEVELS: the network unrolled)
auto passes = [&](auto* size) {
    constexpr int LV = (int)sizeof(*size);
    lanes top[LV];
    for (int c = 0; c < LV; ++c)
        top[c] = far;
    real buf[TILE];
    for (int j0 = first; j0 < last; j0 += TILE) {
        const bool tops = bounded && j0 == first;  // (later tiles: the row's own bound, as tight)
        const int count = last - j0 < TILE ? last - j0 : TILE;
        const int vectors = (count + L - 1) / L;
        for (int v = 0; v < vectors; ++v) {
            const real* src = P + 3 * (long long)(j0 + v * L);
            real tail[3 * L];
            if (count - v * L < L) {  // (the range's last points, padded with inf: never neighbours)
                for (int e = 0; e < 3 * L; ++e)
                    tail[e] = e < 3 * (count - v * L) ? src[e] : inf;
                src = tail;
            }
            DISTANCES  // d: the squared distances of the L points at src from q
            __builtin_memcpy(buf + v * L, &d, sizeof d);
            lanes x = d;  // each lane's smallest, in order (NaN and inf never enter)
            for (int c = 0; c < LV && tops; ++c) {
                const mask m = x < top[c];
                const lanes low = (lanes)((m & (mask)x) | (~m & (mask)top[c]));
                x = (lanes)((m & (mask)top[c]) | (~m & (mask)x));
                top[c] = low;
            }
        }
        if (tops) {  // the k-th smallest of the lanes' distances (inf where fewer are finite)
            real kth[LV * L];
            int held = 0;
            for (int c = 0; c < LV; ++c)
                for (int l = 0; l < L; ++l) {
                    const real e = top[c][l];
                    if (held == k && !(e < kth[k - 1]))
                        continue;
                    int pos = held < k ? held++ : k - 1;
                    while (pos > 0 && kth[pos - 1] > e) {
                        kth[pos] = kth[pos - 1];
                        --pos;
                    }
                    kth[pos] = e;
                }
            if (kth[k - 1] * slack < bound)
                bound = kth[k - 1] * slack;
        }
        for (int v = 0; v < vectors; ++v) {
            lanes d;
            __builtin_memcpy(&d, buf + v * L, sizeof d);
            const mask m = (d <= (lanes){} + bound) & (d < far);
            unsigned bits = BITS(m);
            while (bits) {
                const int l = __builtin_ctz(bits);
                bits &= bits - 1;
                if (d[l] <= bound)
                    insert(d[l], (wp::int64)(j0 + v * L + l));
            }
        }
    }
};
if (levels == 1)
    passes((char(*)[1])nullptr);
else if (levels == 2)
    passes((char(*)[2])nullptr);
else if (levels <= 4)
    passes((char(*)[4])nullptr);
else
    passes((char(*)[LEVELS])nullptr);
return n;
#endif
"""

# The row's insertion (the tree search's, :func:`pcops._warp_funcs.sorted_insert`) into row D / I
# (strides ds / is) holding n pairs, tightening ``bound`` to the slack times a full row's last
_INSERT = r"""
// (a, ja) before (b, jb): by root (squares outside a band around b decide), then index
auto before = [&](real a, wp::int64 ja, real b, wp::int64 jb) -> bool {
    if (a < b * below)
        return true;
    if (a > b * above)
        return false;
    a = wp::sqrt(a);
    b = wp::sqrt(b);
    return a < b || (a == b && ja < jb);
};
auto insert = [&](real d, wp::int64 j) {
    const int last = n < k - 1 ? n : k - 1;
    if (n < k || before(d, j, D[last * ds], I[last * is])) {
        int pos = last;
        while (pos > 0 && !before(D[(pos - 1) * ds], I[(pos - 1) * is], d, j)) {
            D[pos * ds] = D[(pos - 1) * ds];
            I[pos * is] = I[(pos - 1) * is];
            --pos;
        }
        D[pos * ds] = d;
        I[pos * is] = j;
        if (n < k)
            ++n;
        if (n == k && D[(k - 1) * ds] * slack < bound)
            bound = D[(k - 1) * ds] * slack;
    }
};
"""

# A leaf of the tree search (:func:`._kdtree._search_kernel`): points first .. last - 1 (at most
# a few vectors) measured on vectors, those within the bound inserted in the points' order with
# their indices ``order[j]``, as the search's scalar loop inserts them: the same row after it.
_LEAF_SNIPPET = r"""
#if defined(__CUDA_ARCH__)
return -1;
#else
if (points.strides[0] != 3 * (long long)sizeof(real) || order.strides[0] != (long long)sizeof(wp::int64) || points.shape[0] < L)
    return -1;
const int k = dists.shape[1];
real* D = wp::address(dists, i, 0);
wp::int64* I = wp::address(idx, i, 0);
const long long ds = dists.strides[1] / (long long)sizeof(real), is = idx.strides[1] / (long long)sizeof(wp::int64);
INSERT
const real* P = (const real*)wp::address(points, 0);
const wp::int64* O = (const wp::int64*)wp::address(order, 0);
const lanes qx = (lanes){} + q[0], qy = (lanes){} + q[1], qz = (lanes){} + q[2], far = (lanes){} + inf;
LANES
return n;
#endif
"""

# The leaf's and the ball run's loop over points first .. last - 1 (``P`` their coordinates) a
# vector at a time: the vector of L points from j, or the last L up to ``last`` (its lanes before
# j dropped); DISTANCES gives their squares d, and for each lane l, in order, whose square passes
# the mask PASSES, the statements EACH run (the point's row: ``base + l``), after VECTOR's, run
# once for a vector with such lanes (the ball run's roots: one vector square root, not one a lane).
_EACH_LANE = r"""
for (int j = first; j < last; j += L) {
    const int base = j + L <= last ? j : last >= L ? last - L : 0;
    const real* src = P + 3 * (long long)base;
    DISTANCES  // d: the squared distances of the L points at src from q
    unsigned bits = BITS(PASSES) & (~0u << (j - base));
    if (last - base < L)
        bits &= (1u << (last - base)) - 1;
    if (!bits)
        continue;
    VECTOR
    while (bits) {
        const int l = __builtin_ctz(bits);
        bits &= bits - 1;
        EACH
    }
}
"""


def _each_lane(passes: str, each: str, vector: str = "") -> str:
    """:data:`_EACH_LANE` with its mask, its statements a lane and ``vector``'s once a vector
    that has such lanes (before theirs)."""
    return _EACH_LANE.replace("PASSES", passes).replace("EACH", each).replace("VECTOR", vector)


# the squared distances d of the L points at src (x y z after x y z) from q (qx, qy, qz)
_DISTANCES = """
lanes px, py, pz;
REGROUP
const lanes gx = qx - px, gy = qy - py, gz = qz - pz;
const lanes d = (gx * gx + gy * gy) + gz * gz;
"""

# the coordinates px, py, pz of the L points at src (8 float32 points, 4 float64). float32: read in
# 16-byte halves, points 0-3 in the vectors' low halves and 4-7 in their high halves, so that
# five shuffles within the halves regroup them (none across them: faster than the float64 way
# for float32); float64: three vectors of x y z triples regrouped across them (the halves' way
# measured no faster for float64)
_REGROUP = {
    torch.float32: """
        typedef real quad __attribute__((vector_size(16)));  // (4 float32)
        quad h0, h1, h2, h3, h4, h5;
        __builtin_memcpy(&h0, src, sizeof h0);  // 0x 0y 0z 1x
        __builtin_memcpy(&h1, src + 4, sizeof h1);  // 1y 1z 2x 2y
        __builtin_memcpy(&h2, src + 8, sizeof h2);  // 2z 3x 3y 3z
        __builtin_memcpy(&h3, src + 12, sizeof h3);  // 4x 4y 4z 5x
        __builtin_memcpy(&h4, src + 16, sizeof h4);  // 5y 5z 6x 6y
        __builtin_memcpy(&h5, src + 20, sizeof h5);  // 6z 7x 7y 7z
        const lanes m03 = __builtin_shufflevector(h0, h3, 0, 1, 2, 3, 4, 5, 6, 7);
        const lanes m14 = __builtin_shufflevector(h1, h4, 0, 1, 2, 3, 4, 5, 6, 7);
        const lanes m25 = __builtin_shufflevector(h2, h5, 0, 1, 2, 3, 4, 5, 6, 7);
        const lanes xy = __builtin_shufflevector(m14, m25, 2, 3, 9, 10, 6, 7, 13, 14);  // 2x 2y 3x 3y | 6x 6y 7x 7y
        const lanes yz = __builtin_shufflevector(m03, m14, 1, 2, 8, 9, 5, 6, 12, 13);  // 0y 0z 1y 1z | 4y 4z 5y 5z
        px = __builtin_shufflevector(m03, xy, 0, 3, 8, 10, 4, 7, 12, 14);
        py = __builtin_shufflevector(yz, xy, 0, 2, 9, 11, 4, 6, 13, 15);
        pz = __builtin_shufflevector(yz, m25, 1, 3, 8, 11, 5, 7, 12, 15);""",
    torch.float64: """
        lanes a, b, c;
        __builtin_memcpy(&a, src, sizeof a);
        __builtin_memcpy(&b, src + L, sizeof b);
        __builtin_memcpy(&c, src + 2 * L, sizeof c);
        const lanes abx = __builtin_shufflevector(a, b, 0, 3, 6, -1);
        const lanes aby = __builtin_shufflevector(a, b, 1, 4, 7, -1);
        const lanes abz = __builtin_shufflevector(a, b, 2, 5, -1, -1);
        px = __builtin_shufflevector(abx, c, 0, 1, 2, 5);
        py = __builtin_shufflevector(aby, c, 0, 1, 2, 6);
        pz = __builtin_shufflevector(abz, c, 0, 1, 4, 7);""",
}


@_warp.kernels
def native_row(dtype: torch.dtype):
    """``row(q, points, first, last, dists, idx, t, below, above, slack, inf) -> n``: the scan's
    row (:func:`._kdtree.scan_row`, ungrouped) of query q over ``points[first:last]`` into row t
    of ``dists`` / ``idx`` (squared distances, inf / -1 past the n it holds), on vectors (the
    module docs); ``below`` / ``above``: the band of squares compared by their roots, ``slack``
    the tree's. -1 in CUDA code and for strided points (the caller's Warp row then runs)."""
    s = _warp.scalar(dtype)
    body = _ROW_SNIPPET.replace("INSERT", _INSERT).replace("DISTANCES", _DISTANCES).replace("REGROUP", _REGROUP[dtype]).replace("TILE", str(TILE)).replace("LEVELS", str(LEVELS))

    @_warp_funcs.lanes.func_native(body, dtype, "knn_scan_row")
    def row(q: _warp.vec3(dtype), points: wp.array(dtype=_warp.vec3(dtype)), first: int, last: int, dists: wp.array2d(dtype=s),
            idx: wp.array2d(dtype=wp.int64), t: int, below: s, above: s, slack: s, inf: s) -> int: ...

    return row


@_warp.kernels
def native_leaf(dtype: torch.dtype):
    """``leaf(q, points, order, first, last, dists, idx, i, n, bound, below, above, slack, inf)
    -> n``: the tree search's leaf (:func:`._kdtree._search_kernel`, ungrouped) of points
    ``first .. last - 1`` into row i of ``dists`` / ``idx`` holding n pairs, bounded by
    ``bound`` (squared): each point within the bound inserted with its index ``order[j]``, in
    the points' order, the bound tightened by the slack times a full row's last, on vectors;
    the new count. -1 in CUDA code, for strided points or indices and for fewer than a vector's
    points in all (the caller's Warp loop then runs)."""
    s = _warp.scalar(dtype)
    lanes = _each_lane("(d <= (lanes){} + bound) & (d < far)", """if (d[l] <= bound)
            insert(d[l], O[base + l]);""")
    body = _LEAF_SNIPPET.replace("LANES", lanes).replace("INSERT", _INSERT).replace("DISTANCES", _DISTANCES).replace("REGROUP", _REGROUP[dtype])

    @_warp_funcs.lanes.func_native(body, dtype, "knn_tree_leaf")
    def leaf(q: _warp.vec3(dtype), points: wp.array(dtype=_warp.vec3(dtype)), order: wp.array(dtype=wp.int64), first: int, last: int,
             dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, n: int, bound: s, below: s, above: s, slack: s,
             inf: s) -> int: ...

    return leaf


# A run of the ball search (:mod:`pcops.ops.neighbours._ball_search`, one radius, a sorted row):
# points first .. last - 1 measured on vectors, each within the radius counted and inserted in
# the points' order with its index ``order[j]`` (distances, not squares: the band is 1), as the
# search's Warp loop inserts them. A square is let through to the root's test where it is at
# most the radius' square widened past rounding; a radius whose square may fall below the
# normal numbers takes the Warp loop.
_BALL_SNIPPET = r"""
#if defined(__CUDA_ARCH__)
return -1;
#else
if (points.strides[0] != 3 * (long long)sizeof(real) || order.strides[0] != (long long)sizeof(wp::int64) || points.shape[0] < L
    || !(reach >= least))
    return -1;
const int k = dists.shape[1];
real* D = wp::address(dists, i, 0);
wp::int64* I = wp::address(idx, i, 0);
const long long ds = dists.strides[1] / (long long)sizeof(real), is = idx.strides[1] / (long long)sizeof(wp::int64);
const real below = 1, above = 1, slack = 1;
real bound = inf;  // (the insertion's: unused here)
INSERT
const real* P = (const real*)wp::address(points, 0);
const wp::int64* O = (const wp::int64*)wp::address(order, 0);
const lanes qx = (lanes){} + q[0], qy = (lanes){} + q[1], qz = (lanes){} + q[2], wide = (lanes){} + (real)(reach * reach * widen);
int total = 0;
LANES
return total;
#endif
"""


@_warp.kernels
def native_ball(dtype: torch.dtype):
    """``run(q, points, order, first, last, dists, idx, i, n, reach, inf) -> count``: a run of
    the ball search (one radius ``reach``, row i of ``dists`` / ``idx`` sorted by distance,
    holding n pairs): the points ``first .. last - 1`` within the radius counted and inserted
    with their indices ``order[j]`` in the points' order, on vectors; the count (the row then
    holds min(n + count, K)). -1 in CUDA code, for strided points or indices, fewer than a
    vector's points in all, or a radius below the square root of the smallest normal number
    times 2^13 (the caller's Warp loop then runs)."""
    s = _warp.scalar(dtype)
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    lanes = _each_lane("d <= wide", """const real r = root[l];
        if (r <= reach) {
            ++total;
            insert(r, O[base + l]);
        }""", "const lanes root = __builtin_elementwise_sqrt(d);  // (each lane's correctly rounded root, as wp::sqrt's)")
    body = (_BALL_SNIPPET.replace("LANES", lanes).replace("INSERT", _INSERT).replace("DISTANCES", _DISTANCES).replace("REGROUP", _REGROUP[dtype])
            .replace("least", repr(float(tiny**0.5 * 2.0**13))).replace("widen", repr(1.0 + 16.0 * eps)))

    @_warp_funcs.lanes.func_native(body, dtype, "ball_run")
    def run(q: _warp.vec3(dtype), points: wp.array(dtype=_warp.vec3(dtype)), order: wp.array(dtype=wp.int64), first: int, last: int,
            dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), i: int, n: int, reach: s, inf: s) -> int: ...

    return run


# A block of up to 64 points of a run (points first .. min(last, first + 64) - 1) measured on
# vectors: bit l set where point first + l lies within ``wide`` (a squared distance, widened past
# rounding). Its caller measures each such point again in its own code, so the bits only need to
# hold every point that code keeps: all of the block's bits in CUDA code, for strided points,
# fewer than a vector's points in all, or a bound whose square may fall below the normal numbers.
_NEAR_SNIPPET = r"""
const long long end = last - first < 64 ? last : (long long)first + 64;
const unsigned long long all = end - first >= 64 ? ~0ull : (1ull << (end - first)) - 1;
#if defined(__CUDA_ARCH__)
return all;
#else
if (points.strides[0] != 3 * (long long)sizeof(real) || points.shape[0] < L || !(wide >= least))
    return all;
const real* P = (const real*)wp::address(points, 0);
const lanes qx = (lanes){} + q[0], qy = (lanes){} + q[1], qz = (lanes){} + q[2], bound = (lanes){} + (real)(wide * widen);
unsigned long long out = 0;
for (long long j = first; j < end; j += L) {
    const long long base = j + L <= end ? j : end >= L ? end - L : 0;
    const real* src = P + 3 * base;
    DISTANCES
    unsigned bits = BITS(d <= bound) & (~0u << (j - base));
    if (end - base < L)
        bits &= (1u << (end - base)) - 1;
    const long long shift = base - first;  // (negative only for a block shorter than a vector: its low lanes dropped)
    out |= shift >= 0 ? (unsigned long long)bits << shift : (unsigned long long)bits >> -shift;
}
return out;
#endif
"""


@_warp.kernels
def native_near(dtype: torch.dtype):
    """``near(q, points, first, last, wide) -> bits``: the points of ``first ..
    min(last, first + 64) - 1`` whose squared distance from q may be at most ``wide``, as the
    bits of a uint64 (bit l: point first + l), on vectors; every bit of the block in CUDA code
    and where the vectors cannot be used (see above): a superset of the points within ``wide``
    that the caller measures again, one by one, in the points' order (:func:`point_blocks`)."""
    s = _warp.scalar(dtype)
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    body = (_NEAR_SNIPPET.replace("DISTANCES", _DISTANCES).replace("REGROUP", _REGROUP[dtype])
            .replace("least", repr(float(tiny * 2.0**26))).replace("widen", repr(1.0 + 16.0 * eps)))

    @_warp_funcs.lanes.func_native(body, dtype, "near_bits")
    def near(q: _warp.vec3(dtype), points: wp.array(dtype=_warp.vec3(dtype)), first: int, last: int, wide: s) -> wp.uint64: ...

    return near


@_warp.kernels
def point_blocks(dtype: torch.dtype, near_bits: bool):
    """``(block_bits, take)``: a run of points ``first .. last - 1`` visited in blocks of 64::

        block = first
        while block < last:
            bits = block_bits(q, points, block, last, reach)  # the block's points that may be within reach
            while bits != wp.uint64(0):
                j, bits = take(block, bits)                  # the next such point, in order
                ...                                          # measured as before
            block += 64

    ``near_bits``: the bits from :func:`native_near` (on vectors, on the CPU), else every point
    of the block."""
    v, s = _warp.vec3(dtype), _warp.scalar(dtype)
    near = native_near(dtype)

    @wp.func(module="unique")
    def every_bit(block: int, last: int):
        """The bits of the points block .. min(last, block + 64) - 1 (bit l: point block + l)."""
        n = last - block
        if n >= 64:
            return ~wp.uint64(0)
        return (wp.uint64(1) << wp.uint64(n)) - wp.uint64(1)

    @wp.func(module="unique")
    def block_bits(q: v, points: wp.array(dtype=v), block: int, last: int, reach: s):
        if wp.static(near_bits):
            return near(q, points, block, last, reach)
        return every_bit(block, last)

    @wp.func(module="unique")
    def take(block: int, bits: wp.uint64):
        return block + _warp_funcs.lowest(bits), bits & (bits - wp.uint64(1))

    return block_bits, take
