"""Chamfer's nearest points and per-point costs of two plain CPU clouds in Warp.

``pairs(x, y, both)`` finds, in one pass over every (x, y) pair or through a grid of each
cloud, each point's nearest point of the other cloud as the kNN search finds it (squared
distances in the order of their roots, ties by the smaller index, none for a point that is not
finite or whose every squared distance overflows) and its cost; ``costs(x, y, both)`` returns
the costs alone, ``cx`` (M,), the squared distance of each point of ``x`` to its nearest point of
``y``, and (``both``) ``cy`` (N,) the other way: what :mod:`pcops.ops.geometry.chamfer`'s torch
formula computes from the kNN search's indices (``((x - y[idx]) ** 2).sum(-1)``; where a point
found no neighbour, inf if it is finite, else 0), the same values bit for bit: the nearest point
is the kNN search's (small clouds: the pass or the grids; larger ones: the search itself,
:func:`._kdtree.find`), and a cost is the differences squared and summed in torch's order,
``(dx^2 + dy^2) + dz^2``, one operation a statement (the CPU compiler fuses no multiply-add
across statements). One launch instead of about fourteen small
torch operations (docs/benchmarks.md, small clouds); chamfer calls that differentiate take the
pass's indices (:func:`pcops.ops.neighbours.nearest.plain_nearest`).

The pass measures each pair once for both directions: thread c takes block c of x's points,
each against y's points a vector at a time (native code, :func:`_native_block`: 8 float32 or 4
float64 lanes, y copied by coordinate first), and keeps y's points' nearest among its block's
in a row of its own; the rows are merged in block order (one block: by the same thread, no
second launch).

From :data:`GRID_FROM` pairs the points go in grids instead, one launch of a thread a
direction: the thread builds the other cloud's grid (columns of cells over the two widest axes
of its box, about :data:`GRID_POINTS` points a column, a counting sort), then takes each
point's own column and the rings of columns about it, and stops where a ring lies farther
along one axis than the nearest so far; a column whose box lies farther along an axis is
skipped. Each bound is one coordinate's gap, squared: at most any squared distance of a point
beyond it as the pass computes it (rounding is monotonic), so no point that could be taken is
skipped, and the nearest is taken by root, then index, whatever the order of the visits: the
pass's points.
"""

from typing import Optional

import torch
import warp as wp

from .... import _layout, _threads, _warp, _warp_funcs
from . import _kdtree

# The nearest points come from the pass over every pair (or the grids) up to this many (x, y) pairs
# (m n); above, from each way's kNN search (a tree), but for GRID_PAIRS (the crossover in
# docs/benchmarks.md, design choices)
SCAN_PAIRS = 1 << 16

# From this many pairs (m n) the nearest points come from each cloud's grid (the kernel
# ``grid_nearest``, a thread a direction) instead of the pass over every pair, up to SCAN_PAIRS,
# and for both directions up to GRID_PAIRS pairs of at most GRID_KEPT points together (the
# prepared launch keeps its grids; beyond: the kNN search's trees; the crossovers in
# docs/benchmarks.md, design choices); GRID_POINTS: the points per column of a grid (on average)
GRID_FROM = 1 << 14
GRID_PAIRS = 1 << 24
GRID_KEPT = 1 << 13
GRID_POINTS = 6

# The pass cuts x's points into this many blocks at most, and no more than torch's threads (one
# below SERIAL_WORK steps), a thread of its launch each, keeping its points' nearest of each of
# y's points (a row of N: more blocks than threads only add rows to fill and merge)
BLOCKS = 8


@_warp.kernels
def _kernels(dtype: torch.dtype):
    """``rows``: thread c is block c of ``blocks`` equal ranges of x's points; it measures each
    of them against every point of y, keeps its nearest (``ix``, its cost ``cx``) and, where
    ``col_d`` is not empty (both ways), each point of y's nearest among the block's points in
    row c (entries c n .. c n + n - 1) of ``col_d`` / ``col_i``, and with one block y's nearest
    points (``iy``, ``cy``) too; between them the threads look at every point of both clouds and
    set ``bad[0]`` to 1 where one is NaN or inf (the values check of a plain call).
    ``columns``: thread j takes y[j]'s nearest from the blocks' rows. ``from_indices``: the
    costs from the indices found by a search (-1: none, cost :func:`unmatched`'s)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    flag = _warp_funcs.flag_not_finite(dtype)
    finite_box = _warp_funcs.finite_bounds(dtype)
    _, finite_point = _warp_funcs.finite(dtype)
    widest = _warp_funcs.widest_axis(dtype)
    below, above = _warp_funcs.root_band(dtype)

    @wp.func(module="unique")
    def cost(a: v, b: v):
        """torch's ``((a - b) ** 2).sum(-1)``: each square rounded, summed left to right."""
        dx = a[0] - b[0]
        dy = a[1] - b[1]
        dz = a[2] - b[2]
        xx = dx * dx
        yy = dy * dy
        zz = dz * dz
        xy = xx + yy
        return xy + zz

    @wp.func(module="unique")
    def unmatched(q: v):
        """The cost of a point that found no neighbour (the other cloud is not empty): inf if it
        is finite (every squared distance overflowed, or no point of the other cloud is finite), else 0."""
        c = s(0.0)
        if finite_point(q):
            c = s(wp.inf)
        return c

    @wp.func(module="unique")
    def nearer(d2: s, best: s):
        """Whether a point at squared distance d2 replaces the best so far (squared distance
        ``best``, inf: none) that has a smaller index: the kNN search's order
        (:func:`pcops._warp_funcs.sorted_insert`, squared: by the roots, ties by the smaller
        index), so its root is smaller; a NaN or infinite d2 never."""
        if d2 < best * below:
            return True
        if not (d2 <= best * above):
            return False
        return wp.sqrt(d2) < wp.sqrt(best)

    @wp.func(module="unique")
    def cost_of(q: v, other: wp.array(dtype=v), near: wp.int64):
        """The cost of the point at q whose nearest point of the other cloud is ``near`` (-1: none)."""
        own = unmatched(q)
        if near >= wp.int64(0):
            own = cost(q, other[near])
        return own

    @wp.func(module="unique")
    def settle(q: v, other: wp.array(dtype=v), near: int, r: int, idx: wp.array(dtype=wp.int64), costs: wp.array(dtype=s)):
        """Point r (at q): its nearest point ``near`` of the other cloud (-1: none) and its cost."""
        idx[r] = wp.int64(near)
        costs[r] = cost_of(q, other, wp.int64(near))

    @wp.func(module="unique")
    def column(x: wp.array(dtype=v), y: wp.array(dtype=v), col_d: wp.array(dtype=s), col_i: wp.array(dtype=wp.int32), j: int,
               iy: wp.array(dtype=wp.int64), cy: wp.array(dtype=s)):
        """y[j]'s nearest point of x and its cost, from the blocks' rows in block order (a tie
        keeps the earlier block's: the smaller index)."""
        n = y.shape[0]
        best = s(wp.inf)
        near = int(-1)
        c = int(0)
        while c < col_d.shape[0]:
            if nearer(col_d[c + j], best):
                best = col_d[c + j]
                near = col_i[c + j]
            c += n
        settle(y[j], x, near, j, iy, cy)

    @wp.kernel(enable_backward=False, module="unique")
    def columns(start: int, x: wp.array(dtype=v), y: wp.array(dtype=v), col_d: wp.array(dtype=s), col_i: wp.array(dtype=wp.int32),
                iy: wp.array(dtype=wp.int64), cy: wp.array(dtype=s)):
        column(x, y, col_d, col_i, wp.tid() + start, iy, cy)

    block_pass = _native_block(dtype)
    by_coordinate = _warp_funcs.by_coordinate(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def rows(start: int, x: wp.array(dtype=v), y: wp.array(dtype=v), blocks: int, col_d: wp.array(dtype=s), col_i: wp.array(dtype=wp.int32),
             ix: wp.array(dtype=wp.int64), cx: wp.array(dtype=s), iy: wp.array(dtype=wp.int64), cy: wp.array(dtype=s), bad: wp.array(dtype=wp.int32),
             y_flat: wp.array(dtype=s)):
        c = wp.tid() + start
        m = x.shape[0]
        n = y.shape[0]
        both = col_d.shape[0] > 0
        flag(y, c, y.shape[0], blocks, bad)  # the values' check of y (x's: its block's rows below)
        base = c * n
        j = int(0)
        while j < n:  # y by coordinate (the block's own copy) for the native pass; its row of y's nearest
            by_coordinate(y_flat, 3 * base, n, j, y[j])
            if both:
                col_d[base + j] = s(wp.inf)
                col_i[base + j] = -1
            j += 1
        i = m * c // blocks  # (m * blocks fits an int: m n <= SCAN_PAIRS)
        end = m * (c + 1) // blocks
        flag(x, i, end, 1, bad)
        block_pass(x, y_flat, n, i, end, both, col_d, col_i, base, ix, below, above, s(wp.inf))
        r = i
        while r < end:
            settle(x[r], y, int(ix[r]), r, ix, cx)
            r += 1
        if both and blocks == 1:  # (one block: y's nearest points too, without a second launch)
            j = int(0)
            while j < n:
                column(x, y, col_d, col_i, j, iy, cy)
                j += 1

    @wp.kernel(enable_backward=False, module="unique")
    def from_indices(start: int, x: wp.array(dtype=v), y: wp.array(dtype=v), ix: wp.array2d(dtype=wp.int64),
                     iy: wp.array2d(dtype=wp.int64), cx: wp.array(dtype=s), cy: wp.array(dtype=s)):
        t = wp.tid() + start
        m = x.shape[0]
        if t < m:
            cx[t] = cost_of(x[t], y, ix[t, 0])
        else:
            cy[t - m] = cost_of(y[t - m], x, iy[t - m, 0])

    @wp.func(module="unique")
    def cell_of(u: s, low: s, width: s, last: s):
        """The cell of coordinate u along an axis of a grid: floor((u - low) width) clamped to 0
        .. last (monotonic in u: a point in a lower cell has a lower coordinate)."""
        w = (u - low) * width
        w = wp.where(w > s(0.0), w, s(0.0))
        return int(wp.where(w < last, w, last))

    @wp.func(module="unique")
    def place(p: v, a1: int, a2: int, low1: s, low2: s, w1: s, w2: s, last1: s, last2: s):
        """The cell (i, j) of point p in a grid over the axes a1, a2 (:func:`cell_of` along each)."""
        return cell_of(p[a1], low1, w1, last1), cell_of(p[a2], low2, w2, last2)

    @wp.func(module="unique")
    def build_grid(r: wp.array(dtype=v), order: wp.array(dtype=wp.int32), pts: wp.array(dtype=v), begin: wp.array(dtype=wp.int32),
                   cursor: wp.array(dtype=wp.int32), ext: wp.array(dtype=s), bad: wp.array(dtype=wp.int32)):
        """r's finite points in the columns of a g1 x g2 grid over the two widest axes a1, a2 of
        their box (g1 g2 <= C = ``cursor.shape[0]`` columns, g1 / g2 about the ratio of the two
        extents), each column's points in index order at ``begin[col]`` .. ``begin[col + 1] - 1``
        of ``order`` (their rows) and ``pts`` (their points), col = i g2 + j. ``ext`` (8 C):
        each column's lowest and highest coordinate along a1 and along a2 (rows 0-3 of C; an empty
        column +inf, -inf), and for each cell row i the highest a1 coordinate of the rows up to
        i and the lowest of the rows from i (rows 4, 5), the same along a2 (rows 6, 7). A NaN or
        inf point is left out and flagged in ``bad``. Returns the axes, each axis's cells
        (``low``, ``width``, ``last`` for :func:`cell_of`) and g1, g2."""
        n = r.shape[0]
        cells = cursor.shape[0]
        bl, bh = finite_box(r, 0, n)
        e = bh - bl
        a1 = widest(e)
        a2 = (a1 + 1) % 3
        if e[(a1 + 2) % 3] > e[a2]:
            a2 = (a1 + 2) % 3
        e1 = e[a1]
        e2 = e[a2]
        g1 = cells
        if e2 > s(0.0):  # (else one cell across a2)
            ratio = wp.sqrt(s(cells) * (e1 / e2))
            ratio = wp.where(ratio >= s(1.0), ratio, s(1.0))  # (NaN: 1)
            g1 = int(wp.where(ratio < s(cells), ratio, s(cells)))
        g2 = cells // g1
        w1 = s(0.0)
        if e1 > s(0.0):  # (else one cell across a1)
            w1 = s(g1) / e1
        w2 = s(0.0)
        if e2 > s(0.0):
            w2 = s(g2) / e2
        low1 = bl[a1]
        low2 = bl[a2]
        last1 = s(g1 - 1)
        last2 = s(g2 - 1)
        cols = g1 * g2
        for c in range(cols + 1):
            begin[c] = 0
        for c in range(cells):
            ext[c] = s(wp.inf)
            ext[cells + c] = -s(wp.inf)
            ext[2 * cells + c] = s(wp.inf)
            ext[3 * cells + c] = -s(wp.inf)
            ext[4 * cells + c] = -s(wp.inf)
            ext[5 * cells + c] = s(wp.inf)
            ext[6 * cells + c] = -s(wp.inf)
            ext[7 * cells + c] = s(wp.inf)
        j = int(0)
        while j < n:
            p = r[j]
            if finite_point(p):
                i1, i2 = place(p, a1, a2, low1, low2, w1, w2, last1, last2)
                begin[i1 * g2 + i2 + 1] = begin[i1 * g2 + i2 + 1] + 1
            else:
                bad[0] = 1
            j += 1
        for c in range(cols):
            begin[c + 1] = begin[c + 1] + begin[c]
            cursor[c] = begin[c]
        j = int(0)
        while j < n:
            p = r[j]
            if finite_point(p):
                u1 = p[a1]
                u2 = p[a2]
                i1, i2 = place(p, a1, a2, low1, low2, w1, w2, last1, last2)
                col = i1 * g2 + i2
                at = cursor[col]
                cursor[col] = at + 1
                order[at] = j
                pts[at] = p
                ext[col] = wp.min(ext[col], u1)
                ext[cells + col] = wp.max(ext[cells + col], u1)
                ext[2 * cells + col] = wp.min(ext[2 * cells + col], u2)
                ext[3 * cells + col] = wp.max(ext[3 * cells + col], u2)
                ext[4 * cells + i1] = wp.max(ext[4 * cells + i1], u1)
                ext[5 * cells + i1] = wp.min(ext[5 * cells + i1], u1)
                ext[6 * cells + i2] = wp.max(ext[6 * cells + i2], u2)
                ext[7 * cells + i2] = wp.min(ext[7 * cells + i2], u2)
            j += 1
        for i in range(1, g1):  # the highest up to each row, the lowest from it
            ext[4 * cells + i] = wp.max(ext[4 * cells + i], ext[4 * cells + i - 1])
            ext[5 * cells + g1 - 1 - i] = wp.min(ext[5 * cells + g1 - 1 - i], ext[5 * cells + g1 - i])
        for i in range(1, g2):
            ext[6 * cells + i] = wp.max(ext[6 * cells + i], ext[6 * cells + i - 1])
            ext[7 * cells + g2 - 1 - i] = wp.min(ext[7 * cells + g2 - 1 - i], ext[7 * cells + g2 - i])
        return a1, a2, low1, low2, w1, w2, last1, last2, g1, g2

    @wp.func(module="unique")
    def taken(d2: s, j: int, best: s, near: int):
        """Whether point j at squared distance d2 replaces the nearest so far (``near`` at
        ``best``) in the kNN search's order, taken in any order of the points: a smaller root,
        or an equal root and a smaller index (NaN or inf never)."""
        if nearer(d2, best):
            return True
        return d2 <= best * above and j < near and wp.sqrt(d2) == wp.sqrt(best)

    @wp.func(module="unique")
    def column_points(q: v, order: wp.array(dtype=wp.int32), pts: wp.array(dtype=v), b: int, e: int, best: s, lim: s, near: int):
        """The nearest so far after the points b .. e - 1 of a grid's column."""
        i = b
        while i < e:
            g = q - pts[i]
            d2 = wp.dot(g, g)  # (as the pass measures a pair)
            if d2 <= lim:  # (equal: a tie the pass's order would settle, or best 0 or subnormal, lim = best)
                j = order[i]
                if taken(d2, j, best, near):
                    best = d2
                    lim = d2 * above
                    near = j
            i += 1
        return best, lim, near

    @wp.func(module="unique")
    def way(x: wp.array(dtype=v), y: wp.array(dtype=v), order: wp.array(dtype=wp.int32), pts: wp.array(dtype=v),
            begin: wp.array(dtype=wp.int32), cursor: wp.array(dtype=wp.int32), ext: wp.array(dtype=s),
            ix: wp.array(dtype=wp.int64), cx: wp.array(dtype=s), bad: wp.array(dtype=wp.int32)):
        """Each point of x's nearest point of y (``ix``) and its cost (``cx``): y's grid
        (:func:`build_grid`), then for each point its own column and the rings of columns about it,
        until a ring's rows and columns of cells all lie farther along their axis than the
        nearest so far (the squared gap above ``lim``), a column skipped where its box does.
        Every bound is one coordinate's gap: no point beyond it could be taken."""
        a1, a2, low1, low2, w1, w2, last1, last2, g1, g2 = build_grid(y, order, pts, begin, cursor, ext, bad)
        cells = cursor.shape[0]
        r = int(0)
        while r < x.shape[0]:
            q = x[r]
            near = int(-1)
            if finite_point(q):
                q1 = q[a1]
                q2 = q[a2]
                ci, cj = place(q, a1, a2, low1, low2, w1, w2, last1, last2)
                col = ci * g2 + cj
                best, lim, near = column_points(q, order, pts, begin[col], begin[col + 1], s(wp.inf), s(wp.inf), near)
                ring = int(1)
                while True:
                    lo_i = ci - ring
                    hi_i = ci + ring
                    lo_j = cj - ring
                    hi_j = cj + ring
                    if lo_i < 0 and hi_i >= g1 and lo_j < 0 and hi_j >= g2:  # (no column left)
                        break
                    gap = s(wp.inf)  # (the points of this ring and beyond: each lies past one of these four)
                    if lo_i >= 0:
                        gap = wp.min(gap, q1 - ext[4 * cells + lo_i])
                    if hi_i < g1:
                        gap = wp.min(gap, ext[5 * cells + hi_i] - q1)
                    if lo_j >= 0:
                        gap = wp.min(gap, q2 - ext[6 * cells + lo_j])
                    if hi_j < g2:
                        gap = wp.min(gap, ext[7 * cells + hi_j] - q2)
                    if gap * gap > lim:
                        break
                    i = wp.max(lo_i, 0)
                    while i <= hi_i and i < g1:
                        edge = i == lo_i or i == hi_i  # (a row of the ring: every column; else its two ends)
                        j = lo_j
                        step = hi_j - lo_j
                        if edge:
                            j = wp.max(lo_j, 0)
                            step = 1
                        while j <= hi_j and j < g2:
                            if j >= 0:
                                col = i * g2 + j
                                if begin[col] < begin[col + 1]:
                                    # (> 0: another column's points lie past q along one axis at least, cells being monotonic)
                                    far = wp.max(wp.max(ext[col] - q1, q1 - ext[cells + col]),
                                                 wp.max(ext[2 * cells + col] - q2, q2 - ext[3 * cells + col]))
                                    if not (far * far > lim):
                                        best, lim, near = column_points(q, order, pts, begin[col], begin[col + 1], best, lim, near)
                            j += step
                        if not edge and lo_j < 0 and hi_j >= g2:  # (the middle rows hold none of the ring's columns)
                            i = hi_i
                        else:
                            i += 1
                    ring += 1
            else:
                bad[0] = 1
            settle(q, y, near, r, ix, cx)
            r += 1

    @wp.kernel(enable_backward=False, module="unique")
    def grid_nearest(start: int, x: wp.array(dtype=v), y: wp.array(dtype=v),
                     y_order: wp.array(dtype=wp.int32), y_pts: wp.array(dtype=v), y_begin: wp.array(dtype=wp.int32),
                     y_cursor: wp.array(dtype=wp.int32), y_ext: wp.array(dtype=s),
                     x_order: wp.array(dtype=wp.int32), x_pts: wp.array(dtype=v), x_begin: wp.array(dtype=wp.int32),
                     x_cursor: wp.array(dtype=wp.int32), x_ext: wp.array(dtype=s),
                     ix: wp.array(dtype=wp.int64), cx: wp.array(dtype=s), iy: wp.array(dtype=wp.int64), cy: wp.array(dtype=s),
                     bad: wp.array(dtype=wp.int32)):
        """Thread 0: x's nearest points in y (through y's grid); thread 1: y's in x."""
        if wp.tid() + start == 0:
            way(x, y, y_order, y_pts, y_begin, y_cursor, y_ext, ix, cx, bad)
        else:
            way(y, x, x_order, x_pts, x_begin, x_cursor, x_ext, iy, cy, bad)

    return rows, columns, from_indices, grid_nearest


# Chamfer's pass over a block of x against every point of y in native code (:func:`_native_block`)
_BLOCK_SNIPPET = r"""
// whether squared distance d replaces b (held by a smaller index): its root is smaller
auto nearer = [&](real d, real b) -> bool {
    if (d < b * below)
        return true;
    if (!(d <= b * above))
        return false;
    return wp::sqrt(d) < wp::sqrt(b);
};
const real* X = (const real*)wp::address(x, 0);
const real* YX = wp::address(y_flat, 3 * base);
const real* YY = YX + n;
const real* YZ = YY + n;
real* CD = both ? wp::address(col_d, base) : nullptr;
int* CI = both ? wp::address(col_i, base) : nullptr;
for (int r = i; r < end; ++r) {
    const real qx = X[3 * r], qy = X[3 * r + 1], qz = X[3 * r + 2];
    real best = inf;
    int near = -1;
    int j = 0;
#if !defined(__CUDA_ARCH__)
    // nearer, lane by lane: the squares decide outside the band, the roots inside it (rare)
    auto nearer_lanes = [&](lanes d, lanes b) -> mask {
        mask take = d < b * below;
        const mask band = (d < b * above) & ~take;
        if (__builtin_reduce_or(band))
            for (int l = 0; l < L; ++l)
                if (band[l] && wp::sqrt(d[l]) < wp::sqrt(b[l]))
                    take[l] = -1;
        return take;
    };
    lanes lane_best;
    mask lane_near, lane;
    for (int l = 0; l < L; ++l) {
        lane_best[l] = inf;
        lane_near[l] = -1;
        lane[l] = l;
    }
    for (; j + L <= n; j += L) {
        lanes px, py, pz;
        __builtin_memcpy(&px, YX + j, sizeof px);
        __builtin_memcpy(&py, YY + j, sizeof py);
        __builtin_memcpy(&pz, YZ + j, sizeof pz);
        const lanes gx = qx - px, gy = qy - py, gz = qz - pz;
        const lanes d = (gx * gx + gy * gy) + gz * gz;
        // x's point: each lane its nearest among its points (by root, the first among equals)
        const mask take = nearer_lanes(d, lane_best);
        lane_best = (lanes)((take & (mask)d) | (~take & (mask)lane_best));
        lane_near = (take & (lane + j)) | (~take & lane_near);
        if (both) {  // y's points: their nearest among x's points so far (r is the largest index yet)
            lanes cd;
            ints ci;
            __builtin_memcpy(&cd, CD + j, sizeof cd);
            const mask get = nearer_lanes(d, cd);
            if (__builtin_reduce_or(get)) {
                __builtin_memcpy(&ci, CI + j, sizeof ci);
                cd = (lanes)((get & (mask)d) | (~get & (mask)cd));
                ci = __builtin_convertvector((get & (lane * 0 + r)) | (~get & __builtin_convertvector(ci, mask)), ints);
                OPAQUE(cd);  // (whole stores, not masked ones)
                OPAQUE(ci);
                __builtin_memcpy(CD + j, &cd, sizeof cd);
                __builtin_memcpy(CI + j, &ci, sizeof ci);
            }
        }
    }
    for (int l = 0; l < L; ++l) {  // the lanes' nearest: by root, then index
        const real a = lane_best[l];
        const int ja = (int)lane_near[l];
        if (ja < 0)
            continue;
        bool first = a < best * below;
        if (!first && !(a > best * above)) {
            const real ra = wp::sqrt(a), rb = wp::sqrt(best);
            first = ra < rb || (ra == rb && ja < near);
        }
        if (first) {
            best = a;
            near = ja;
        }
    }
#endif
    for (; j < n; ++j) {  // (past the lanes' indices: each point after every earlier one)
        const real gx = qx - YX[j], gy = qy - YY[j], gz = qz - YZ[j];
        const real d = (gx * gx + gy * gy) + gz * gz;
        if (nearer(d, best)) {
            best = d;
            near = j;
        }
        if (both && nearer(d, CD[j])) {
            CD[j] = d;
            CI[j] = r;
        }
    }
    *wp::address(ix, r) = near;
}
"""


@_warp.kernels
def _native_block(dtype: torch.dtype):
    """``block(x, y_flat, n, i, end, both, col_d, col_i, base, ix, below, above, inf)``: chamfer's
    pass over x's points i .. end - 1 against y's n points (by coordinate in ``y_flat`` from
    3 base: x, y, z each contiguous, :func:`pcops._warp_funcs.by_coordinate`): each point r's nearest point of y into ``ix[r]`` (-1:
    none) and, where ``both``, y's points' nearest among them in ``col_d`` / ``col_i`` from
    ``base`` (squared distance, index; updated in place, r after every earlier point): squared
    distances as Warp's ``dot`` of the difference computes them (each product and sum rounded,
    no fused multiply-add), in the order of their roots (``below`` / ``above``: the band outside
    which the squares decide), ties by the smaller index, a NaN or infinite one never: the
    Warp pass's points. On the CPU the points of y go 32 bytes at a time (8 float32 or 4
    float64), each lane keeping x's point's nearest among its own, the lanes' best then the
    points past the last whole vector; in CUDA code (compiled, not run) one at a time."""
    s = _warp.scalar(dtype)

    @_warp_funcs.lanes.func_native(_BLOCK_SNIPPET, dtype, "chamfer_block")
    def block(x: wp.array(dtype=_warp.vec3(dtype)), y_flat: wp.array(dtype=s), n: int, i: int, end: int, both: bool,
              col_d: wp.array(dtype=s), col_i: wp.array(dtype=wp.int32), base: int, ix: wp.array(dtype=wp.int64), below: s, above: s, inf: s): ...

    return block


def _run(kernel, key, threads: int, make_args, arrays: dict, work: Optional[int], lengths: tuple, kept=None) -> tuple:
    """``kernel`` over ``threads`` threads: the calling thread's prepared launch for ``key``,
    which serves every size it names (:func:`pcops._warp.ranged`; ``lengths``: (groups of array
    names, their lengths in this call)), with ``arrays`` (its named tensors) pointed at this
    call's, or, before the kernel has run once, a launch of the arguments ``make_args()``
    returns (args, keep: the arrays the prepared launch keeps, room for every size of ``key``);
    returns the kept arrays (of the prepared launch, or of this launch). ``kept``: (the key of
    :func:`costs`' plan for these sizes, a function making that plan (:class:`_Plan`) of the
    prepared launch), the plan kept on its key's second sighting."""

    def prepare():
        args, keep = make_args()
        return _warp.prepare(kernel, threads, args, work=work, keep=keep)

    launch = _warp.ranged(key, prepare, *lengths, threads, work)
    if launch is None:  # (the kernel's first run: its arguments made again, once)
        args, keep = make_args()
        _warp.launch(kernel, threads, args, like=arrays["x"], min_chunk=1, work=work)
        return keep
    if launch.keep:
        launch.keep[1][0] = 0  # (the scan's flag, reset)
    launch.run(**arrays)
    if kept is not None and _warp.KEPT.admit(kept[0]):
        plan = kept[1](launch)
        _warp.KEPT.put(kept[0], plan, plan.held())
    return launch.keep


class _Plan:
    """What a :func:`costs` call of the pass in one launch or of the grids decides for a range of
    sizes (each cloud's up to a power of two: :func:`_plan_key`), kept by the calling thread
    (:data:`pcops._warp.KEPT`): the prepared launch (which serves the range: each run sets its
    sizes), its array fields, the lengths its arrays take for a call's sizes (``sizes(m, n,
    both)``), and the nearest points' indices as work arrays of the range's largest sizes
    (costs() returns the costs alone), so that a call only points the launch at its clouds and
    new costs."""

    __slots__ = ("launch", "groups", "sizes", "threads", "both", "fields", "ix", "iy")

    def __init__(self, launch, groups: tuple, sizes, threads: int, rooms: tuple, both: bool) -> None:
        self.launch, self.groups, self.sizes, self.threads, self.both = launch, groups, sizes, threads, both
        self.fields = launch.fields("x", "y", "ix", "cx", "iy", "cy")
        self.ix, self.iy = torch.empty(rooms[0], dtype=torch.int64), torch.empty(rooms[1] if both else 0, dtype=torch.int64)

    def held(self) -> int:
        """The bytes it holds besides its launch (counted under the launch's own key, which may drop
        it first: the plan then keeps it alive until the plan is dropped): its index arrays."""
        return 8 * (self.ix.shape[0] + self.iy.shape[0])

    def costs(self, x: torch.Tensor, y: torch.Tensor, check: bool):
        """:func:`costs` of contiguous clouds of its range and dtype: (cx, cy or None), None where ``check`` finds a value NaN or inf."""
        m, n, both = x.shape[-2], y.shape[-2], self.both
        launch = self.launch
        launch.size(self.groups, self.sizes(m, n, both), self.threads)
        cx, cy = x.new_empty(m), x.new_empty(n if both else 0)
        flag = launch.keep[1]
        flag[0] = 0
        launch.run_at(self.fields, x, y, self.ix, cx, self.iy, cy)
        if check and flag[0]:
            return None
        return cx, cy if both else None


def _blocks(m: int, n: int, both: bool) -> int:
    """The blocks of x's points the pass over every pair cuts m x n pairs into (:data:`BLOCKS`):
    one below :data:`pcops._warp.SERIAL_WORK` steps (the calling thread's launch, columns included)."""
    return 1 if m * n * (2 if both else 1) < _warp.SERIAL_WORK else min(m, BLOCKS, _threads.requested())


def _plan_key(m: int, n: int, dtype: torch.dtype, both: bool) -> Optional[tuple]:
    """The key of :func:`costs`' kept plan (:class:`_Plan`) for clouds of m and n points (for which
    :func:`by_pairs` holds): the grids or the pass in one launch, each cloud's size rounded up to
    a power of two (the range of sizes one plan serves), with the thread count and the
    crossovers it was decided under; None for the pass in blocks (two launches: not kept)."""
    if m * n >= GRID_FROM:
        path = "grid"
    elif _blocks(m, n, both) == 1:
        path = "rows"
    else:
        return None
    return ("chamfer_costs", path, _warp.capacity(m), _warp.capacity(n), dtype, both, _threads.requested(), GRID_FROM, GRID_POINTS, BLOCKS,
            _warp.SERIAL_WORK)


def _kept(key: Optional[tuple], groups: tuple, sizes, threads: int, rooms: tuple, both: bool):
    """:func:`_run`'s ``kept`` for the plan of ``key`` (None: none)."""
    return None if key is None else (key, lambda launch: _Plan(launch, groups, sizes, threads, rooms, both))


def pairs(x: torch.Tensor, y: torch.Tensor, both: bool, check: bool = False, kept=None):
    """(ix (M,), iy (N,) or None, cx (M,), cy (N,) or None) from one pass over every pair of two
    plain CPU clouds (M, 3) and (N, 3) of one dtype (float32 or float64, M and N > 0), or from
    their grids from :data:`GRID_FROM` pairs: each point's nearest point of the other cloud as
    the kNN search finds it (int64, -1 where none) and its cost (the module docs); ``iy``,
    ``cy`` where ``both``. ``check``: None where a value is NaN or inf (both ways look at every
    point). ``kept``: the key of :func:`costs`' plan for these sizes (:func:`_plan_key`; None: none)."""
    m, n = x.shape[0], y.shape[0]
    if m * n >= GRID_FROM:
        return _grid_nearest(x, y, both, check, kept)
    work = m * n * (2 if both else 1)
    blocks = _blocks(m, n, both)
    rows, columns, _, _ = _kernels(x.dtype)
    vec = _warp.vec3(x.dtype)
    ix, cx = torch.empty(m, dtype=torch.int64), x.new_empty(m)
    iy, cy = torch.empty(n if both else 0, dtype=torch.int64), x.new_empty(n if both else 0)

    room = _warp.capacity(n)  # (one launch serves every y up to it, and any x)
    columns_n = blocks * n if both else 0

    def rows_args():  # (kept: the columns and y's copies for y of ``room`` points; this call's first parts passed)
        flag = _warp.values_flag()
        col_d, col_i = x.new_empty(blocks * room if both else 0), torch.empty(blocks * room if both else 0, dtype=torch.int32)
        y_flat = x.new_empty(blocks * 3 * room)  # (each block's copy of y by coordinate)
        return ([_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), blocks, col_d[:columns_n], col_i[:columns_n], ix, cx, iy, cy, flag[0],
                 y_flat[: blocks * 3 * n]], (*flag, col_d, col_i, y_flat))

    keep = _run(rows, ("chamfer_rows", x.dtype, room, both, blocks), blocks, rows_args, dict(x=x, y=y, ix=ix, cx=cx, iy=iy, cy=cy), work,
                (_ROWS_GROUPS, _rows_sizes(m, n, both, blocks)), _kept(kept, _ROWS_GROUPS, _rows_sizes, 1, (_warp.capacity(m), room), both))
    if check and keep[1][0]:
        return None
    if not both:
        return ix, None, cx, None
    if blocks > 1:
        col_d, col_i = keep[2], keep[3]
        _run(columns, ("chamfer_columns", x.dtype, blocks), n,
             lambda: ([_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), col_d[:columns_n], col_i[:columns_n], iy, cy], ()),
             dict(x=x, y=y, col_d=col_d, col_i=col_i, iy=iy, cy=cy), n * blocks, (_COLUMNS_GROUPS, (m, n, columns_n)))
    return ix, iy, cx, cy


# The lengths a call of the pass (its rows, then its columns) and of the costs sets (:func:`_run`)
_ROWS_GROUPS = (("x", "ix", "cx"), ("y",), ("iy", "cy"), ("col_d", "col_i"), ("y_flat",))
_COLUMNS_GROUPS = (("x",), ("y", "iy", "cy"), ("col_d", "col_i"))
_COSTS_GROUPS = (("x", "ix", "cx"), ("y",), ("iy", "cy"))


def _rows_sizes(m: int, n: int, both: bool, blocks: int = 1) -> tuple:
    """The lengths of the pass's arrays (:data:`_ROWS_GROUPS`) for m x n points in ``blocks`` blocks."""
    return m, n, n if both else 0, blocks * n if both else 0, blocks * 3 * n


def by_pairs(m: int, n: int, both: bool) -> bool:
    """Whether :func:`pairs` finds the nearest points of clouds of m and n points (else the kNN
    search's trees)."""
    return m * n <= SCAN_PAIRS or (both and m * n <= GRID_PAIRS and m + n <= GRID_KEPT)


def _grid_arrays(cloud: torch.Tensor, capacity: int) -> list:
    """The work arrays of the grid of ``cloud`` (N, 3) (the kernels' ``build_grid``): order, points,
    begin, cursor, extents (:func:`_grid_lengths`), made for clouds of up to ``capacity`` points,
    their first parts passed (a launch kept for a range of sizes sets their lengths per call)."""
    room = _grid_lengths(capacity)
    return [t[:size] for t, size in zip([torch.empty(room[0], dtype=torch.int32), cloud.new_empty((room[1], 3)), torch.empty(room[2], dtype=torch.int32),
                                          torch.empty(room[3], dtype=torch.int32), cloud.new_empty(room[4])], _grid_lengths(cloud.shape[0]), strict=True)]


def _grid_lengths(n: int) -> tuple:
    """The lengths of the work arrays of the grid of n points (:func:`_grid_arrays`): N / GRID_POINTS columns (at least one)."""
    cells = max(1, n // GRID_POINTS)
    return n, n, cells + 1, cells, 8 * cells


# The arrays of the grid kernel whose lengths a call sets (the groups of _grid_lengths(n) and the clouds' lengths)
_GRID_GROUPS = (("y_order",), ("y_pts",), ("y_begin",), ("y_cursor",), ("y_ext",), ("x_order",), ("x_pts",), ("x_begin",), ("x_cursor",), ("x_ext",),
                ("x", "ix", "cx"), ("y",), ("iy", "cy"))


def _grid_sizes(m: int, n: int, both: bool) -> tuple:
    """The lengths of the grid kernel's arrays (:data:`_GRID_GROUPS`) for m x n points."""
    return (*_grid_lengths(n), *_grid_lengths(m if both else 0), m, n, n if both else 0)


def _grid_nearest(x: torch.Tensor, y: torch.Tensor, both: bool, check: bool, kept=None):
    """:func:`pairs` from the grids (the kernel ``grid_nearest``): a thread a direction."""
    m, n = x.shape[0], y.shape[0]
    kernel = _kernels(x.dtype)[3]
    vec = _warp.vec3(x.dtype)
    ix, cx = torch.empty(m, dtype=torch.int64), x.new_empty(m)
    iy, cy = torch.empty(n if both else 0, dtype=torch.int64), x.new_empty(n if both else 0)

    rooms = _warp.capacity(m), _warp.capacity(n)  # (one launch serves every size up to these)

    def args():
        flag = _warp.values_flag()
        work = _grid_arrays(y, rooms[1]) + (_grid_arrays(x, rooms[0]) if both else _grid_arrays(x[:0], 0))
        grids = [_warp.array(t, dtype=vec) if t.dim() == 2 else t for t in work]
        return [_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), *grids, ix, cx, iy, cy, flag[0]], (*flag, work)

    threads = 2 if both else 1
    keep = _run(kernel, ("chamfer_grid", x.dtype, *rooms, both, GRID_POINTS), threads, args, dict(x=x, y=y, ix=ix, cx=cx, iy=iy, cy=cy), None,
                (_GRID_GROUPS, _grid_sizes(m, n, both)), _kept(kept, _GRID_GROUPS, _grid_sizes, threads, rooms, both))
    if check and keep[1][0]:
        return None
    return ix, iy if both else None, cx, cy if both else None


def costs(x: torch.Tensor, y: torch.Tensor, both: bool, check: bool = False):
    """(cx (M,), cy (N,) or None) of two plain CPU clouds (M, 3) and (N, 3) of one dtype
    (float32 or float64, M and N > 0): see the module docs. ``check``: their values too (the
    pass and the grids look at every point; past them the sums are read first): None where
    one is NaN or inf. The clouds may be one padded sample each, (1, M, 3) and (1, N, 3)."""
    _warp.init()
    m, n = x.shape[-2], y.shape[-2]
    x, y = x.contiguous(), y.contiguous()
    small = by_pairs(m, n, both)
    key = _plan_key(m, n, x.dtype, both) if small else None
    plan = _warp.KEPT.get(key) if key is not None and _warp.PREPARED[0] else None
    if plan is not None:  # (kept: nothing to decide; the points' memory is all it reads)
        return plan.costs(x, y, check)
    if x.dim() == 3:
        x, y = x[0], y[0]
    if small:
        found = pairs(x, y, both, check, key)
        return None if found is None else found[2:]
    found = _kdtree.find_both(x, y, 1) if both else None  # (small trees: their builds side by side, the values checked)
    if found is not None:
        if check and found[2]:
            return None
        ix, iy = found[0], found[1]
    else:
        if check and not _layout.plain_clouds(True, x, y):
            return None
        ix = _kdtree.find(x, y, 1)[1]
        iy = _kdtree.find(y, x, 1)[1] if both else ix[:0]
    threads = m + n if both else m
    vec = _warp.vec3(x.dtype)
    cx, cy = x.new_empty(m), x.new_empty(n if both else 0)
    arrays = dict(x=x, y=y, ix=ix, iy=iy, cx=cx, cy=cy)
    _run(_kernels(x.dtype)[2], ("chamfer_costs", x.dtype, both), threads,
         lambda: ([_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), ix, iy, cx, cy], ()), arrays, threads, (_COSTS_GROUPS, (m, n, iy.shape[0])))
    return cx, cy if both else None
