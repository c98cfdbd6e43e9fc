"""Farthest point sampling: exact, deterministic, on CPU (a thread per sample) and CUDA.

Iterative farthest point sampling picks a start point (or a start set), then repeatedly the
point whose distance to the points picked so far is largest:

    s_0 = start,   s_t = argmax_{j not picked} min_{u < t} ||p_j - p_{s_u}||

Ties go to the smaller index; points already picked are never picked again (a duplicate of a
picked point, at distance 0, still can be, once nothing farther is left). Each point keeps its
squared distance to the picked set, ``dist_j``, computed exactly as plain FPS computes it
(``length_sq(p_j - c)`` in the points' dtype, then the minimum): the result is the plain FPS
sequence bit for bit, only the work differs.

CPU: bucket FPS (QuickFPS, Han et al. 2023), all of a sample's work in ONE kernel thread,
samples spread over the cores. The sample's points are cut into 2^h leaves ("buckets") of at
most ``LEAF`` consecutive points of a permutation, the leaves of a complete binary tree in
heap layout (node i has children 2i+1, 2i+2; node k of level d holds positions
floor(k n / 2^d) .. floor((k + 1) n / 2^d) - 1). The permutation is a kd-tree when the sample
takes at least 1 / ``KD_PICKS`` of its points (each node's points sorted by cells of the widest
axis of its box, a counting sort per node and level, so its two halves lie on either side of
a plane: tight leaves, O(N h) to build), else the Morton order of the points' cells (2^10 per
axis in the sample's box, three counting-sort passes: O(N) to build, looser leaves). Within a
leaf the points are in index order. Every node keeps the bounding box of its points and the
largest ``dist`` among them with the smallest index among equals (``node_max``,
``node_arg``); the root's is the next pick. A new pick c can lower a point's ``dist`` only if
that point is closer to c than its current ``dist``: a node is skipped when the squared
distance from c to its box is at least its ``node_max`` (shrunk by a rounding margin, so that
no point of a skipped node would have changed in floating point). The walk needs no stack (a
finished right child hands its parent the better of its two children). Work per pick: the
nodes and leaves near the pick, O(LEAF + log N) for spread-out clouds, O(N) at worst (as
plain FPS). The loops over points are while loops: on the CPU, Warp's ``for j in range(a, b)``
costs more per step (docs/benchmarks.md, design choices). Every update of a run of points by
a pick (a leaf's, or plain FPS's of the whole sample) runs in native code on vectors of lanes
(:func:`_native_lower`; Warp's CPU loops are not vectorised), on the points copied by
coordinate. A sample of few points times picks (:data:`PLAIN_PAIRS`) skips the tree: plain
FPS, which below that size costs less than the tree's build and walks.

CUDA: one launch per pick for every sample at once (blocks of 128 points per thread, torch
takes each sample's farthest block between launches; the launch is recorded once, nothing is
read back to the host). A thread-per-sample bucket loop on a GPU would leave it idle, so the
bucket kernels run on the CPU only (they compile for CUDA too).
"""

import ctypes
import math
import threading
from collections.abc import Sequence
from typing import NamedTuple, Optional, Union

import numpy as np
import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp, _warp_funcs


class FPS(NamedTuple):
    """Result of :func:`farthest_point_sample`: the sampled ``points`` and their ``idx`` (int64)."""

    points: torch.Tensor
    idx: torch.Tensor


# Points per leaf at most (a leaf holds more than LEAF / 2 points unless its sample is smaller).
LEAF = 64

# A sample builds a kd-tree (slower to build, tighter leaves: faster picks) when it takes at
# least 1 / KD_PICKS of its points, else Morton-ordered leaves (docs/benchmarks.md, design choices).
KD_PICKS = 10

# A float32 sample whose points times picks are at most this many runs plain FPS (every point
# updated by every pick, 8 at a time), no tree: below it the tree's build and walks cost more than
# they save; a float64 sample (4 at a time) up to a quarter of it (the crossovers measured in
# docs/benchmarks.md, design choices).
PLAIN_PAIRS = 1 << 22


@_warp.kernels
def _kernels(dtype: torch.dtype, plain_pairs: int):
    """(sample, step): the bucket FPS of a sample per thread (its tree, then its picks; plain FPS
    where the sample's points times its picks are at most ``plain_pairs``, a quarter of it in
    float64: :data:`PLAIN_PAIRS`);
    one pick for every block of every sample (the CUDA path)."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    finite_box = _warp_funcs.finite_bounds(dtype)
    widest = _warp_funcs.widest_axis(dtype)
    flag = _warp_funcs.flag_not_finite(dtype)
    _, finite_point = _warp_funcs.finite(dtype)
    eps = float(torch.finfo(dtype).eps)
    # A skipped node must not hold a point whose computed distance to the pick is below its
    # node_max: the box distance is computed by the same kind of operations on coordinate gaps
    # no larger than the points' (rounding is monotonic), so it exceeds a point's computed
    # distance by a few roundings at most; 16 eps covers them (and fused multiply-adds). Below
    # ``tiny`` (subnormal squares) relative bounds fail: nothing is skipped there.
    shrink = s(1.0 - 16.0 * eps)
    leaf_size = LEAF
    kd_picks = KD_PICKS
    plain_limit = wp.int64(plain_pairs if dtype == torch.float32 else plain_pairs // 4)
    tiny = s(1e-30 if dtype == torch.float32 else 1e-290)
    lower_lanes = _native_lower(dtype)
    by_coordinate = _warp_funcs.by_coordinate(dtype)  # (a sample's points from 3 base)

    @wp.func(module="unique")
    def part(k: int, n: int, d: int):
        """Start of node k of level d among n points (children split their parent): the one rule."""
        return _warp_funcs.part(k, wp.int64(n), d)

    @wp.func(module="unique")
    def spread(x: int):
        """The 10 low bits of x spread to every third bit (bit i -> bit 3 i): the one spread."""
        return int(_warp_funcs.spread(wp.int64(x)))

    @wp.func(module="unique")
    def radix_pass(
        src_key: wp.array(dtype=wp.int32),
        src_ord: wp.array(dtype=wp.int32),
        dst_key: wp.array(dtype=wp.int32),
        dst_ord: wp.array(dtype=wp.int32),
        hist: wp.array(dtype=wp.int32),
        hb: int,
        lo: int,
        hi: int,
        shift: int,
    ):
        """One stable counting-sort pass of keys lo..hi-1 on their bits shift..shift+9."""
        for k in range(1024):
            hist[hb + k] = 0
        j = lo
        while j < hi:
            digit = (src_key[j] >> shift) & 1023
            hist[hb + digit] = hist[hb + digit] + 1
            j += 1
        total = int(lo)
        for k in range(1024):
            c = hist[hb + k]
            hist[hb + k] = total
            total += c
        j = lo
        while j < hi:
            key = src_key[j]
            digit = (key >> shift) & 1023
            at = hist[hb + digit]
            hist[hb + digit] = at + 1
            dst_key[at] = key
            dst_ord[at] = src_ord[j]
            j += 1

    @wp.func(module="unique")
    def better(d: s, i: int, top: s, top_i: int):
        """Whether (distance d, index i) beats the best so far: farther, or as far with a smaller index."""
        return d > top or (d == top and i < top_i)

    @wp.func(module="unique")
    def kd_level(
        src: wp.array(dtype=v),
        src_flat: wp.array(dtype=s),
        src_order: wp.array(dtype=wp.int32),
        dst: wp.array(dtype=v),
        dst_order: wp.array(dtype=wp.int32),
        hist: wp.array(dtype=wp.int32),
        hb: int,
        base: int,
        nb: int,
        d: int,
    ):
        """Level d of the kd-tree: each node's points (src, in its range) moved to dst sorted by
        cells of the widest axis of the box of its finite points (as many cells as points, at
        most 1024; a stable counting sort), so that its children (the two halves of its range)
        lie on either side of a plane, up to a cell (NaN coordinates: the first cell).
        (A branch-free box pass, or boxes gathered while scattering, measured slower.)"""
        for k in range(1 << d):
            lo = base + part(k, nb, d)
            hi = base + part(k + 1, nb, d)
            bl, bh = finite_box(src, lo, hi)
            ext = bh - bl
            axis = widest(ext)
            cells = wp.min(hi - lo, 1024)
            width = s(0.0)
            if ext[axis] > s(0.0):  # else (one point, all equal, or none finite) one cell
                width = s(cells) / ext[axis]
            low = bl[axis]
            last = s(cells - 1)
            for w in range(cells):
                hist[hb + w] = 0
            j = lo
            while j < hi:
                u = (src_flat[3 * j + axis] - low) * width
                u = wp.where(u > s(0.0), u, s(0.0))  # NaN: cell 0
                cell = int(wp.where(u < last, u, last))
                hist[hb + cell] = hist[hb + cell] + 1
                j += 1
            total = int(lo)
            for w in range(cells):
                cnt = hist[hb + w]
                hist[hb + w] = total
                total += cnt
            j = lo
            while j < hi:
                p = src[j]
                u = (src_flat[3 * j + axis] - low) * width
                u = wp.where(u > s(0.0), u, s(0.0))
                cell = int(wp.where(u < last, u, last))
                at = hist[hb + cell]
                hist[hb + cell] = at + 1
                dst[at] = p
                dst_order[at] = src_order[j]
                j += 1

    @wp.func(module="unique")
    def morton_leaves(
        points: wp.array(dtype=v),
        keys: wp.array(dtype=wp.int32),
        order: wp.array(dtype=wp.int32),
        tmp_keys: wp.array(dtype=wp.int32),
        tmp_order: wp.array(dtype=wp.int32),
        hist: wp.array(dtype=wp.int32),
        hb: int,
        base: int,
        end: int,
    ):
        """The leaves of a sample taking few picks: its points in the Morton order of their cells
        (2^10 per axis in the sample's box; a radix sort into ``order``)."""
        bl, bh = finite_box(points, base, end)
        ext = bh - bl
        scale = v(s(0.0))
        for a in range(3):
            if ext[a] > s(0.0):
                scale[a] = s(1023.0) / ext[a]
        j = base
        while j < end:
            p = points[j]
            code = int(0x3FFFFFFF)  # NaN/inf (validate=False): last
            if finite_point(p):
                q = wp.cw_mul(p - bl, scale)
                qx = int(wp.clamp(q[0], s(0.0), s(1023.0)))
                qy = int(wp.clamp(q[1], s(0.0), s(1023.0)))
                qz = int(wp.clamp(q[2], s(0.0), s(1023.0)))
                code = (spread(qx) << 2) | (spread(qy) << 1) | spread(qz)
            tmp_keys[j] = code
            tmp_order[j] = j - base
            j += 1
        radix_pass(tmp_keys, tmp_order, keys, order, hist, hb, base, end, 0)
        radix_pass(keys, order, tmp_keys, tmp_order, hist, hb, base, end, 10)
        radix_pass(tmp_keys, tmp_order, keys, order, hist, hb, base, end, 20)

    @wp.func(module="unique")
    def kd_leaves(
        points: wp.array(dtype=v),
        pts: wp.array(dtype=v),
        pts_flat: wp.array(dtype=s),
        tmp_pts: wp.array(dtype=v),
        tmp_flat: wp.array(dtype=s),
        order: wp.array(dtype=wp.int32),
        tmp_order: wp.array(dtype=wp.int32),
        hist: wp.array(dtype=wp.int32),
        hb: int,
        base: int,
        nb: int,
        h: int,
    ):
        """The leaves of a sample taking many picks: a kd-tree of h levels, each level's nodes
        split at their middle across the widest axis (pts and tmp_pts in turn), into ``order``."""
        end = base + nb
        for j in range(base, end):
            pts[j] = points[j]
            order[j] = j - base
        for d in range(h):
            if d % 2 == 0:
                kd_level(pts, pts_flat, order, tmp_pts, tmp_order, hist, hb, base, nb, d)
            else:
                kd_level(tmp_pts, tmp_flat, tmp_order, pts, order, hist, hb, base, nb, d)
        if h % 2 == 1:
            for j in range(base, end):
                order[j] = tmp_order[j]

    @wp.func(module="unique")
    def leaves_in_index_order(
        order: wp.array(dtype=wp.int32),
        inv: wp.array(dtype=wp.int32),
        tmp_keys: wp.array(dtype=wp.int32),
        base: int,
        nb: int,
        h: int,
    ):
        """Within each of the 2^h leaves, its points in index order (a stable counting sort by
        leaf): the first farthest point of a leaf scan is then the one with the smallest index.
        ``order[base + at]``: the point at leaf position at; ``inv``: the position of each point."""
        end = base + nb
        if h > 0:
            for leaf in range(1 << h):  # inv: the leaf of each point (no division per point)
                j = base + part(leaf, nb, h)
                last = base + part(leaf + 1, nb, h)
                tmp_keys[base + leaf] = j - base
                while j < last:
                    inv[base + order[j]] = leaf
                    j += 1
            for o in range(nb):
                leaf = inv[base + o]
                at = tmp_keys[base + leaf]
                tmp_keys[base + leaf] = at + 1
                order[base + at] = o
                inv[base + o] = at
        else:
            for j in range(base, end):
                order[j] = j - base
                inv[j] = j - base

    @wp.func(module="unique")
    def build_nodes(
        points: wp.array(dtype=v),
        pts: wp.array(dtype=v),
        flat: wp.array(dtype=s),
        order: wp.array(dtype=wp.int32),
        dist: wp.array(dtype=s),
        lo_box: wp.array(dtype=v),
        hi_box: wp.array(dtype=v),
        node_max: wp.array(dtype=s),
        node_arg: wp.array(dtype=wp.int32),
        base: int,
        nb: int,
        h: int,
        root: int,
    ):
        """The sample's points in leaf order (``pts``, and by coordinate in ``flat`` for the
        leaves' update, :func:`_native_lower`; distances inf), each leaf's box and first index,
        then the inner nodes bottom up (boxes, and the best (distance, index) below)."""
        end = base + nb
        leaf0 = (1 << h) - 1
        nan_box = v(s(wp.nan))
        j = base
        while j < end:
            p = points[base + order[j]]
            pts[j] = p
            by_coordinate(flat, 3 * base, nb, j - base, p)
            dist[j] = s(wp.inf)
            j += 1
        for leaf in range(1 << h):
            lo = base + part(leaf, nb, h)
            hi = base + part(leaf + 1, nb, h)
            bl = v(s(wp.inf))
            bh = v(-s(wp.inf))
            finite = bool(True)
            j = lo
            while j < hi:
                p = pts[j]
                bl = wp.min(bl, p)
                bh = wp.max(bh, p)
                finite = finite and finite_point(p)
                j += 1
            arg = wp.where(lo < hi, order[wp.min(lo, end - 1)], -1)
            node = root + leaf0 + leaf
            lo_box[node] = wp.where(finite, bl, nan_box)  # a NaN/inf point (validate=False): never skipped
            hi_box[node] = bh
            node_max[node] = wp.where(lo < hi, s(wp.inf), s(-2.0))  # an empty leaf: never picked from
            node_arg[node] = arg
        for k in range(leaf0):  # the inner nodes, bottom up
            i = leaf0 - 1 - k
            node = root + i
            left = node + i + 1
            ll = lo_box[left]
            rl = lo_box[left + 1]
            lo_box[node] = wp.where(wp.isnan(ll[0]) or wp.isnan(rl[0]), nan_box, wp.min(ll, rl))
            hi_box[node] = wp.max(hi_box[left], hi_box[left + 1])
            lm = node_max[left]
            la = node_arg[left]
            right = better(node_max[left + 1], node_arg[left + 1], lm, la)
            node_max[node] = wp.where(right, node_max[left + 1], lm)
            node_arg[node] = wp.where(right, node_arg[left + 1], la)

    @wp.func(module="unique")
    def lower(flat: wp.array(dtype=s), dist: wp.array(dtype=s), c: v, base: int, nb: int, lo: int, hi: int):
        """Plain FPS's update of positions lo .. hi - 1 of a sample (from base, of nb points;
        its points by coordinate in ``flat``) by the pick c: each distance lowered to the
        point's, picked ones (-1) and NaN ones (a NaN point's, or once NaN) kept (never the
        farthest); (the largest distance, -2 if none, and its first position, -1 if none):
        :func:`_native_lower`."""
        j = lower_lanes(flat, dist, base, nb, c[0], c[1], c[2], lo - base, hi - base)
        top = s(-2.0)
        if j >= 0:
            top = dist[base + j]
            j += base
        return top, j

    @wp.func(module="unique")
    def next_pick(first: wp.array2d(dtype=wp.int64), b: int, t: int, nb: int, top: s, arg: int):
        """Pick t of sample b: its start set's t-th index, else ``arg`` (the first farthest point,
        at distance ``top``), or -1 where only points of NaN distance are left (validate=False):
        no pick."""
        last = int(-1)
        if t < first.shape[1]:
            last = wp.clamp(int(first[b, t]), 0, nb - 1)
        elif top >= s(0.0):
            last = arg
        return last

    @wp.func(module="unique")
    def picks(
        first: wp.array2d(dtype=wp.int64),
        pts: wp.array(dtype=v),
        flat: wp.array(dtype=s),
        order: wp.array(dtype=wp.int32),
        inv: wp.array(dtype=wp.int32),
        dist: wp.array(dtype=s),
        lo_box: wp.array(dtype=v),
        hi_box: wp.array(dtype=v),
        node_max: wp.array(dtype=s),
        node_arg: wp.array(dtype=wp.int32),
        idx: wp.array2d(dtype=wp.int64),
        b: int,
        base: int,
        nb: int,
        h: int,
        root: int,
        count: int,
    ):
        """The ``count`` picks of sample b: its start set, then the root's farthest point, each
        pick followed by the walk that lowers the distances it can lower (a node is skipped when
        its box is farther from the pick than its best distance). Returns the picks made."""
        leaf0 = (1 << h) - 1
        t = int(0)
        while t < count:
            last = next_pick(first, b, t, nb, node_max[root], node_arg[root])
            if last < 0:
                break
            idx[b, t] = wp.int64(last)
            t += 1
            if t == count:
                break
            pos = base + inv[base + last]
            c = pts[pos]
            dist[pos] = s(-1.0)  # picked: never again (-1 stays below every distance)
            i = int(0)
            while True:
                node = root + i
                top = node_max[node]
                visit = node_arg[node] == last  # the pick's own path: its node_max is stale
                if not visit and top > s(0.0):
                    lb = lo_box[node]
                    gap = wp.max(wp.max(lb - c, c - hi_box[node]), v(s(0.0)))
                    bound = wp.length_sq(gap)
                    visit = wp.isnan(lb[0]) or not (bound >= tiny and top <= bound * shrink)
                if visit and i < leaf0:
                    i = 2 * i + 1
                    continue
                if visit:  # a leaf: plain FPS's update of its points
                    leaf = i - leaf0
                    lo = base + part(leaf, nb, h)
                    hi = base + part(leaf + 1, nb, h)
                    top, top_j = lower(flat, dist, c, base, nb, lo, hi)  # (the leaf is in index order)
                    node_max[node] = top
                    node_arg[node] = wp.where(top_j >= 0, order[wp.max(top_j, 0)], -1)
                while i > 0 and (i & 1) == 0:  # a right child done: so is its parent
                    i = (i - 1) >> 1
                    node = root + i
                    left = node + i + 1
                    lm = node_max[left]
                    la = node_arg[left]
                    right = better(node_max[left + 1], node_arg[left + 1], lm, la)
                    node_max[node] = wp.where(right, node_max[left + 1], lm)
                    node_arg[node] = wp.where(right, node_arg[left + 1], la)
                if i == 0:
                    break
                i += 1
        return t

    @wp.func(module="unique")
    def plain_picks(first: wp.array2d(dtype=wp.int64), points: wp.array(dtype=v), flat: wp.array(dtype=s), dist: wp.array(dtype=s),
                    idx: wp.array2d(dtype=wp.int64), b: int, base: int, nb: int, count: int):
        """The ``count`` picks of sample b by plain FPS: every point's distance lowered by every
        pick, in index order (the same distances, minima and first farthest point as
        :func:`picks`, whose skipped nodes change nothing: the same picks). Returns the picks
        made."""
        end = base + nb
        j = base
        while j < end:
            by_coordinate(flat, 3 * base, nb, j - base, points[j])
            dist[j] = s(wp.inf)
            j += 1
        top = s(-2.0)
        top_j = base
        t = int(0)
        while t < count:
            last = next_pick(first, b, t, nb, top, top_j - base)
            if last < 0:
                break
            idx[b, t] = wp.int64(last)
            t += 1
            if t == count:
                break
            c = points[base + last]
            dist[base + last] = s(-1.0)  # picked: never again (-1 stays below every distance)
            top, top_j = lower(flat, dist, c, base, nb, base, end)
        return t

    @wp.func(module="unique")
    def gather_picks(points: wp.array(dtype=v), idx: wp.array2d(dtype=wp.int64), gathered: wp.array(dtype=v), b: int, base: int, made: int):
        """Sample b's picked points into its rows of ``gathered`` (B * S), zeros past the
        ``made`` picks, whose indices it sets to -1: the whole result of a call, with no
        filled index array before the launch."""
        n_samples = idx.shape[1]
        for t in range(n_samples):
            if t < made:
                gathered[b * n_samples + t] = points[base + int(idx[b, t])]
            else:
                idx[b, t] = wp.int64(-1)
                gathered[b * n_samples + t] = v(s(0.0), s(0.0), s(0.0))

    @wp.kernel(enable_backward=False, module="unique")
    def sample(
        start: int,
        n: int,
        nodes: int,
        lengths: wp.array(dtype=wp.int32),
        counts: wp.array(dtype=wp.int64),
        first: wp.array2d(dtype=wp.int64),
        points: wp.array(dtype=v),
        pts: wp.array(dtype=v),
        pts_flat: wp.array(dtype=s),
        tmp_pts: wp.array(dtype=v),
        tmp_flat: wp.array(dtype=s),
        order: wp.array(dtype=wp.int32),
        keys: wp.array(dtype=wp.int32),
        tmp_order: wp.array(dtype=wp.int32),
        tmp_keys: wp.array(dtype=wp.int32),
        hist: wp.array(dtype=wp.int32),
        inv: wp.array(dtype=wp.int32),
        dist: wp.array(dtype=s),
        lo_box: wp.array(dtype=v),
        hi_box: wp.array(dtype=v),
        node_max: wp.array(dtype=s),
        node_arg: wp.array(dtype=wp.int32),
        idx: wp.array2d(dtype=wp.int64),
        gathered: wp.array(dtype=v),
        bad: wp.array(dtype=wp.int32),
    ):
        """All picks of sample b: its leaves (a kd-tree when the sample takes many picks, else
        its points in Morton order), the tree over them, then its picks. Each phase is a
        function called once per sample. Given a flag ``bad`` (one element; empty: no check),
        first sets it to 1 where a point of the sample is NaN or inf (a plain call's values
        check: the picks go on, the caller discards them). Given ``gathered`` (B * S points;
        empty: none), then writes the picked points there and -1 to every index past the picks
        made (:func:`gather_picks`); without it ``idx`` comes -1 filled."""
        b = wp.tid() + start
        nb = lengths[b]
        count = int(counts[b])
        base = b * n
        made = int(0)
        if nb > 0 and count > 0:
            if bad.shape[0] > 0:
                flag(points, base, base + nb, 1, bad)
            if wp.int64(nb) * wp.int64(count) <= plain_limit:  # few pairs: no tree pays for itself
                made = plain_picks(first, points, tmp_flat, dist, idx, b, base, nb, count)
            else:
                h = int(0)
                while (nb + (1 << h) - 1) >> h > leaf_size:  # the largest leaf, ceil(nb / 2^h), holds at most LEAF points
                    h += 1
                kd = h > 0 and wp.int64(count) * wp.int64(kd_picks) >= wp.int64(nb)
                if h > 0 and not kd:
                    morton_leaves(points, keys, order, tmp_keys, tmp_order, hist, b * 1024, base, base + nb)
                if kd:
                    kd_leaves(points, pts, pts_flat, tmp_pts, tmp_flat, order, tmp_order, hist, b * 1024, base, nb, h)
                leaves_in_index_order(order, inv, tmp_keys, base, nb, h)
                build_nodes(points, pts, tmp_flat, order, dist, lo_box, hi_box, node_max, node_arg, base, nb, h, b * nodes)
                made = picks(first, pts, tmp_flat, order, inv, dist, lo_box, hi_box, node_max, node_arg, idx, b, base, nb, h, b * nodes, count)
        if gathered.shape[0] > 0:
            gather_picks(points, idx, gathered, b, base, made)

    @wp.kernel(enable_backward=False, module="unique")
    def step(
        start: int,
        points: wp.array(dtype=v),
        n: int,
        block: int,
        blocks: int,
        lengths: wp.array(dtype=wp.int32),
        picked: wp.array(dtype=wp.int64),
        dist: wp.array(dtype=s),
        best: wp.array(dtype=s),
        best_idx: wp.array(dtype=wp.int64),
    ):
        """Block t of sample b: distances to the newest pick ``picked[b]``, and the block's farthest point."""
        t = wp.tid() + start
        b = t // blocks
        last = int(picked[b])
        row = b * n
        c = points[row + last]
        lo = (t - b * blocks) * block
        hi = wp.min(lo + block, lengths[b])
        top = s(-2.0)
        top_j = int(-1)
        for j in range(lo, hi):  # branch-free: selects, no jumps
            d = dist[row + j]
            x = wp.length_sq(points[row + j] - c)
            d = wp.where(d < x or not d >= s(0.0), d, x)  # picked points (-1) and NaN distances stay (x NaN makes one)
            d = wp.where(j == last, s(-1.0), d)  # picked: never again
            dist[row + j] = d
            better = d > top
            top = wp.where(better, d, top)
            top_j = wp.where(better, j, top_j)
        best[t] = top
        best_idx[t] = wp.int64(top_j)

    return sample, step


# Plain FPS's update of a run of points by a pick in native code (:func:`_native_lower`): a
# vector of lanes at a time, each lane keeping its own first farthest point
_LOWER_SNIPPET = r"""
const real* X = wp::address(flat, 3 * base);
const real* Y = X + nb;
const real* Z = Y + nb;
real* D = wp::address(dist, base);
real top = -2;
int top_j = -1;
int j = lo;
#if !defined(__CUDA_ARCH__)
if (hi - lo >= L) {
    lanes lane_top;
    mask lane_j, lane;
    for (int l = 0; l < L; ++l) {
        lane_top[l] = -2;
        lane_j[l] = -1;
        lane[l] = l;
    }
    for (; j + L <= hi; j += L) {
        lanes d, x, y, z;
        __builtin_memcpy(&d, D + j, sizeof d);
        __builtin_memcpy(&x, X + j, sizeof x);
        __builtin_memcpy(&y, Y + j, sizeof y);
        __builtin_memcpy(&z, Z + j, sizeof z);
        const lanes ax = x - cx, ay = y - cy, az = z - cz;
        const lanes s = ax * ax + ay * ay + az * az;
        const mask keep = (d < s) | ~(d >= 0);  // picked (-1) and NaN distances stay
        d = (lanes)((keep & (mask)d) | (~keep & (mask)s));
        OPAQUE(d);  // (a whole store, not a masked one)
        __builtin_memcpy(D + j, &d, sizeof d);
        const mask far = d > lane_top;  // a lane's first farthest
        lane_top = (lanes)((far & (mask)d) | (~far & (mask)lane_top));
        lane_j = (far & (lane + j)) | (~far & lane_j);
    }
    for (int l = 0; l < L; ++l) {  // the largest, the smallest index among equals
        if (lane_top[l] > top || (lane_top[l] == top && lane_j[l] >= 0 && (int)lane_j[l] < top_j)) {
            top = lane_top[l];
            top_j = (int)lane_j[l];
        }
    }
}
#endif
for (; j < hi; ++j) {  // (past the lanes' positions: a strict comparison keeps the first)
    real d = D[j];
    const real ax = X[j] - cx, ay = Y[j] - cy, az = Z[j] - cz;
    const real s = ax * ax + ay * ay + az * az;
    d = (d < s || !(d >= 0)) ? d : s;
    D[j] = d;
    if (d > top) {
        top = d;
        top_j = j;
    }
}
return top_j;
"""


@_warp.kernels
def _native_lower(dtype: torch.dtype):
    """``lower(flat, dist, base, nb, cx, cy, cz, lo, hi) -> j``: plain FPS's update by the
    pick (cx, cy, cz) of the positions lo .. hi - 1 of a sample of nb points from ``base`` (its
    points by coordinate in ``flat`` from 3 base: x, y, z each contiguous,
    :func:`pcops._warp_funcs.by_coordinate`; its distances in ``dist`` from base): each distance lowered to the point's, picked (-1) and NaN ones kept; returns the
    first position of the largest distance above -2 (-1: none, every distance NaN). The same
    squared distances as Warp's ``length_sq`` of the difference (each product and sum rounded),
    the same minima and first farthest point as a loop over the positions in order: on the CPU
    the update runs on vectors of 32 bytes (8 float32 or 4 float64 lanes, :class:`pcops._warp_funcs.lanes`),
    each lane keeping its first farthest point, the lanes' best, then the positions past the
    last whole vector; in CUDA code (compiled, not run) one position at a time."""
    s = _warp.scalar(dtype)

    @_warp_funcs.lanes.func_native(_LOWER_SNIPPET, dtype, "fps_lower")
    def lower(flat: wp.array(dtype=s), dist: wp.array(dtype=s), base: int, nb: int, cx: s, cy: s, cz: s, lo: int, hi: int) -> int: ...

    return lower


def _per_pick(device: torch.device) -> bool:
    """Whether FPS runs one launch per pick (CUDA: every block of every sample in parallel)
    instead of the bucket loop (CPU: a thread per sample)."""
    return device.type != "cpu"


def _block(n: int, b: int, device: torch.device) -> int:
    """Points per thread of the per-pick kernel."""
    return 128


def _height(n: int) -> int:
    """The smallest tree height whose leaves (node k of 2^h holds points floor(k n / 2^h) ..
    floor((k + 1) n / 2^h) - 1) hold at most LEAF of n points; the kernel finds the same."""
    h = 0
    while (n + (1 << h) - 1) >> h > LEAF:  # the largest leaf: ceil(n / 2^h)
        h += 1
    return h


def _bucket(points: torch.Tensor, lengths32: torch.Tensor, counts: torch.Tensor, start: torch.Tensor, idx: torch.Tensor,
            gathered: Optional[torch.Tensor] = None) -> None:
    """Bucket FPS into ``idx`` (B, S), -1 filled: points (B, N, 3), one kernel thread per
    sample (its tree, then its picks); given ``gathered`` (B, S, 3), the picked points there
    and ``idx`` needs no filling (the kernel's ``gather_picks``). The work arrays are views of
    two allocations (one of the points' dtype, one int32), passed as descriptors
    (:func:`_scratch`)."""
    b, n, _ = points.shape
    _run_samples(_kernels(points.dtype, PLAIN_PAIRS)[0], b,
                 _bucket_values(points, _warp.array(lengths32), _warp.array(counts), _warp.array(start), idx, gathered))


def _bucket_values(points: torch.Tensor, lengths, counts, start, idx: torch.Tensor, gathered=None, bad=None) -> list:
    """The arguments of the ``sample`` kernel (after ``start``) for points (B, N, 3): ``lengths``,
    ``counts`` and ``start`` converted, the work arrays :func:`_scratch`'s; ``gathered``: the
    picked points' tensor (None: none); ``bad``: the values check's flag (None: no check)."""
    b, n, _ = points.shape
    nodes = (2 << _height(n)) - 1  # enough for every sample (none is longer than n)
    flag = _warp.no_flag(points.device)[1] if bad is None else bad
    out = _NO_POINTS[points.dtype] if gathered is None else _warp.span(gathered, 0, gathered.numel() // 3, 3)
    return [n, nodes, lengths, counts, start, _warp.span(points, 0, b * n, 3), *_scratch(points.dtype, b, n, nodes), _warp.array(idx), out, flag]


_NO_POINTS = {dtype: _warp.span(torch.zeros(0, dtype=dtype), 0, 0, 3) for dtype in (torch.float32, torch.float64)}  # no picked points to write


# Scratch of bucket FPS kept for the next call of the same shape on the same thread, up to this
# many points in all (B * N): a small call's work arrays and their descriptors cost about as
# much as its picks; a large call's are a small part of it and are not kept
KEEP_SCRATCH = 1 << 14
_kept = threading.local()


def _scratch(dtype: torch.dtype, b: int, n: int, nodes: int) -> list:
    """The descriptors of bucket FPS's work arrays for B samples of N points (the ``sample``
    kernel's parameters from ``pts`` to ``node_arg``): the calling thread's from its last call
    of this shape, else new (kept when B * N <= :data:`KEEP_SCRATCH`). The kernel writes every
    entry it reads, so reused arrays need no clearing; a call finishes its launch before it
    returns, so a thread's arrays serve one call at a time."""
    key = (dtype, b, n)
    kept = getattr(_kept, "scratch", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    m, k = b * n, b * nodes
    # floats: pts (3m), dist (m), lo_box (3k), hi_box (3k), node_max (k), tmp_pts (3m, the kd-tree's)
    f = torch.empty((7 * m + 7 * k,), dtype=dtype)
    # int32: order, keys, tmp_order, tmp_keys, inv (m each), hist (1024 b), node_arg (k)
    i = torch.empty(5 * m + 1024 * b + k, dtype=torch.int32)
    ints = [_warp.span(i, c * m, m) for c in range(5)]
    spans = [_warp.span(f, 0, m, 3), _warp.span(f, 0, 3 * m), _warp.span(f, 4 * m + 7 * k, m, 3), _warp.span(f, 4 * m + 7 * k, 3 * m),
             *ints[:4], _warp.span(i, 5 * m, 1024 * b), ints[4], _warp.span(f, 3 * m, m), _warp.span(f, 4 * m, k, 3),
             _warp.span(f, 4 * m + 3 * k, k, 3), _warp.span(f, 4 * m + 6 * k, k), _warp.span(i, 5 * m + 1024 * b, k)]
    if m <= KEEP_SCRATCH:
        _kept.scratch = (key, spans)
    return spans


def _run_samples(kernel, b: int, values: list) -> None:
    """Threads 0 .. b-1 of ``kernel`` (a sample each) on the CPU: on one thread, the calling
    one runs them all; on several, the samples are cut into up to 8 chunks per thread (a
    sample each, for batches up to that size), taken in turn by the first free thread
    (samples differ in work, and a thread can be descheduled: fixed halves left one thread
    idle while the other finished its half)."""
    threads = _threads.requested()
    chunks = 1 if threads <= 1 else min(b, 8 * threads)
    _warp.launch_chunks(kernel, [b * c // chunks for c in range(chunks + 1)], values)


def _per_pick_fps(points: torch.Tensor, lengths32: torch.Tensor, start: torch.Tensor, n_samples: int, idx: torch.Tensor) -> None:
    """One launch per pick (CUDA): every block of every sample in parallel, torch finds each
    sample's farthest block between launches; into ``idx`` (B, S), -1 filled."""
    b, n, _ = points.shape
    _, step = _kernels(points.dtype, PLAIN_PAIRS)
    block = _block(n, b, points.device)
    blocks = math.ceil(n / block)
    best = points.new_empty((b * blocks,))
    best_idx = torch.empty((b * blocks,), dtype=torch.int64, device=points.device)
    dist = points.new_full((b * n,), float("inf"))
    picked = start[:, 0].clone()
    vec = _warp.array(points.reshape(b * n, 3), _warp.vec3(points.dtype))
    pick = _warp.recorded(step, b * blocks, [vec, n, block, blocks, lengths32, picked, dist, best, best_idx], like=points, min_chunk=1)
    rows = torch.arange(b, device=points.device)
    given = start.shape[1]
    idx[:, 0] = picked
    for t in range(1, min(n_samples, n)):
        pick()
        if t < given:
            picked.copy_(start[:, t])
            idx[:, t] = picked
            continue
        top = best.view(b, blocks).argmax(1)  # first maximum: the smaller index wins ties
        found = best_idx.view(b, blocks)[rows, top]
        ok = best.view(b, blocks)[rows, top] >= 0  # else only NaN points are left (validate=False)
        picked.copy_(found.clamp(min=0))
        idx[:, t] = torch.where(ok, found, -1)
    # once a sample has no pick left (-1), its later picks are none either
    idx.copy_(torch.where(torch.cummin(idx, 1).values < 0, -1, idx))


def _start_checks(checks: _validate.Checks, start: torch.Tensor, lengths: torch.Tensor) -> None:
    """The checks of start indices (B, M): in range of their (non-empty) samples, distinct within a sample."""
    live = (lengths > 0)[:, None]
    bad = live & ((start < 0) | (start >= lengths[:, None]))

    def first_bad() -> str:
        b, m = bad.nonzero()[0].tolist()
        return _out_of_range(int(start[b, m]), int(lengths[b]))

    checks.add(~bad.any(), first_bad)
    if start.shape[1] > 1:
        checks.add(~(live & (start.sort(1).values.diff(dim=1) == 0)).any(), lambda: _REPEATED)


def _out_of_range(value: int, n: int) -> str:
    return f"start_idx values must be in [0, n_b - 1] for every non-empty sample b of n_b points, got {value} for a sample of {n} points"


_REPEATED = "start_idx must not repeat an index (a sample's start set holds distinct points)"


@_threads.custom_op("pcops::farthest_point_sample", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fps(points: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor, start: torch.Tensor, n_samples: int, validate: bool) -> torch.Tensor:
    """points (B, N, 3) float32/64, lengths (B,), counts (B,) picks per sample (<= lengths),
    start (B, M) the first M picks of each sample; returns idx (B, n_samples) int64, -1 past each
    sample's count."""
    b, n, _ = points.shape
    if validate:  # one host read
        checks = _validate.Checks()
        checks.finite("points", points)
        _start_checks(checks, start, lengths)
        checks.run()
    idx = torch.full((b, n_samples), -1, dtype=torch.int64, device=points.device)
    if b == 0 or n == 0 or n_samples == 0:
        return idx
    _warp.init()
    points = points.contiguous()
    lengths32 = lengths.to(torch.int32).contiguous()
    if not _per_pick(points.device):  # the kernel clamps the start indices (validate=False) and writes counts[b] picks
        _bucket(points, lengths32, counts.to(torch.int64), start.to(torch.int64), idx)
        return idx
    start = torch.minimum(start.to(torch.int64).clamp(min=0), (lengths.to(torch.int64) - 1).clamp(min=0)[:, None]).contiguous()
    _per_pick_fps(points, lengths32, start, n_samples, idx)
    return torch.where(torch.arange(n_samples, device=idx.device) < counts[:, None], idx, -1)


@_fps.register_fake
def _(points, lengths, counts, start, n_samples, validate):
    return points.new_empty((points.shape[0], n_samples), dtype=torch.int64)


def _counts(lengths: torch.Tensor, n_samples: Optional[int], ratio) -> torch.Tensor:
    if ratio is None:
        return lengths.clamp(max=n_samples)
    return torch.ceil(lengths.to(torch.float64) * ratio).to(torch.int64).clamp(max=lengths)


def _uniform(n, generator, device) -> torch.Tensor:
    """(n,) float64 uniforms in [0, 1) on ``device``, drawn on the CPU from ``generator`` (torch's
    global RNG if None). A tensor drawn by torch: under torch.compile the draw is part of the
    graph (with ``generator=None``) and reaches the op as a tensor, never as a Python number.
    ``generator=None`` is not passed on: that overload of ``torch.rand`` fails to trace a
    data-dependent ``n`` (torch 2.13)."""
    kw = {} if generator is None else {"generator": generator}
    return torch.rand(n, dtype=torch.float64, device="cpu", **kw).to(device)


def _start_from(u: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A random start per sample, floor(u_b n_b) (0 for an empty sample), from uniforms ``u`` (B,)."""
    return (u * lengths).to(torch.int64).clamp(max=(lengths - 1).clamp(min=0))


def _start(lengths: torch.Tensor, random_start: bool, generator) -> torch.Tensor:
    if not random_start:
        return torch.zeros_like(lengths)
    return _start_from(_uniform(lengths.shape, generator, lengths.device), lengths)


def _check_numbers(points, n_samples, ratio) -> None:
    """``n_samples`` or ``ratio``, one of them, in range (the layout is checked by pcops._layout.single)."""
    _validate.exactly_one(n_samples=n_samples, ratio=ratio)
    if n_samples is not None:
        _validate.count("n_samples", n_samples)
        _validate.int_option("n_samples", n_samples, high=_validate.INT64_MAX, note=" (an int64)")
    else:  # a tensor's value is checked by the op (a data-dependent count)
        _validate.interval("ratio", ratio, 0, 1, closed_high=True, tensor=True)
    if points.dim() == 3 and ratio is not None:
        raise ValueError("ratio needs packed (N, 3) points with batch; padded points take n_samples")


def _start_set(start_idx, points: torch.Tensor, n_samples, random_start: bool, here: bool) -> tuple[Optional[torch.Tensor], bool]:
    """``start_idx`` as an int64 tensor on the points' device: (M,) for every sample, or (B, M)
    per sample of padded points; None if not given. Checks types, shapes and Python values
    (tensor values are checked by the op, with ``validate``); and whether the indices were checked
    here, as the op checks them but without a tensor or a host read: Python ints, with ``here``
    (validation on, and every sample holds the points' row count: one cloud, or padded points
    without lengths) and that count static."""
    if start_idx is None:
        return None, False
    _validate.at_most_one(start_idx=start_idx, random_start=random_start)
    padded = points.dim() == 3
    if isinstance(start_idx, torch.Tensor):
        _validate.integer("start_idx", start_idx)
        t = start_idx.reshape(1) if start_idx.dim() == 0 else start_idx
        if t.dim() > 2 or (t.dim() == 2 and not (padded and t.shape[0] == points.shape[0])):
            shapes = f"(M,) or (B, M) = ({points.shape[0]}, M)" if padded else "(M,)"
            raise ValueError(f"start_idx must be a tensor of shape {shapes}, got shape {tuple(start_idx.shape)}")
        _validate.same_device(points=points, start_idx=t)
        values = None
    else:
        value = _validate.plain(start_idx)
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            values = [_validate.plain(x) for x in value]
        else:
            values = [value]
        for x in values:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"start_idx must be an int, a sequence of ints or an integer tensor, got {type(start_idx).__name__} holding {type(x).__name__}")
            if x < 0:
                raise ValueError(f"start_idx values must be >= 0, got {x}")
        t = torch.tensor(values, dtype=torch.int64, device=points.device)
    if t.shape[-1] == 0:
        raise ValueError("start_idx must hold at least one index")
    if n_samples is not None and not isinstance(n_samples, torch.SymInt) and t.shape[-1] > n_samples:
        raise ValueError(f"start_idx holds {t.shape[-1]} indices, more than n_samples={n_samples}")
    n = points.shape[-2]
    if values is None or not here or not isinstance(n, int):
        return t.to(torch.int64), False
    if n and points.numel():  # (no sample with a point: nothing to check, as the op)
        checks = _validate.Checks()
        checks.add(max(values) < n, lambda: _out_of_range(next(x for x in values if x >= n), n))
        checks.add(len(set(values)) == len(values), lambda: _REPEATED)
        checks.run()
    return t.to(torch.int64), True


class _Bucket:
    """Bucket FPS of one sample (``m`` start indices) as a prepared launch (:class:`pcops._warp.Prepared`)
    that serves every sample of up to ``capacity`` points and any number of picks: its work
    arrays and lengths are kept for ``capacity`` points, and a call points ``points``, ``idx``
    and ``gathered`` (the picked points) at its tensors and, for other sizes than the last
    call's, writes the sample's length and pick count and the outputs' lengths (the kernel
    reads the rest of a sample's sizes from them). It keeps the start indices (a ctypes array of
    m int64, written by a call with other start indices than the last one's) and the values
    flag (a NumPy view of one int32)."""

    __slots__ = ("launch", "first", "starts", "sizes", "last", "flag", "idx", "picked", "rows", "fields", "lengths")

    @classmethod
    def make(cls, dtype: torch.dtype, capacity: int, n_samples: int, m: int) -> Optional["_Bucket"]:
        """The plan, made with outputs of ``n_samples`` picks; None before the kernel's first launch."""
        self = cls()
        sizes = np.array([capacity], dtype=np.int32), np.array([min(capacity, n_samples)], dtype=np.int64)  # (NumPy's memory: written per call)
        (lengths, counts), self.first = (torch.from_numpy(a) for a in sizes), (ctypes.c_int64 * m)()
        flag = _warp.values_flag()
        self.idx, self.picked, self.rows = torch.empty(n_samples, dtype=torch.int64), torch.empty((n_samples, 3), dtype=dtype), n_samples
        values = _bucket_values(torch.empty((1, capacity, 3), dtype=dtype), _warp.array(lengths), _warp.array(counts), _warp.memory(self.first, (1, m)),
                                self.idx[None], self.picked, flag[0])
        self.launch = _warp.prepare(_kernels(dtype, PLAIN_PAIRS)[0], 1, values, work=0, keep=(lengths, counts, values[6:-3]))  # (values[6:-3]: the work arrays)
        if self.launch is None:
            return None
        self.flag, self.sizes, self.starts, self.last = flag[1], sizes, None, (capacity, n_samples)
        self.fields = self.launch.fields("points", "idx", "gathered")
        self.lengths = self.launch.lengths(("points",), (("idx", 1), "gathered"))
        return self

    def held(self) -> int:
        """The bytes this plan holds (:meth:`pcops._warp.Kept.put`)."""
        return self.launch.held() + _warp.held_bytes(self.idx, self.picked)

    def picks(self, points: torch.Tensor, n_samples: int, starts: tuple, checked: bool) -> Optional[FPS]:
        """The picks of the contiguous ``points`` (N, 3) from ``starts``; None where ``checked``
        (the launch checked the values) and a value is NaN or inf (the general path names it)."""
        n = points.shape[0]
        if self.last != (n, n_samples):
            self.last = (n, n_samples)
            self.sizes[0][0], self.sizes[1][0] = n, min(n, n_samples)
            self.launch.resize(self.lengths, n, n_samples)
        if self.starts != starts:
            self.first[:] = self.starts = starts
        if n_samples == self.rows:
            idx, picked = torch.empty_like(self.idx), torch.empty_like(self.picked)
        else:
            idx, picked = torch.empty(n_samples, dtype=torch.int64), points.new_empty(n_samples, 3)
        self.launch.run_at(self.fields, points, idx, picked)
        if self.flag[0]:  # (the flag left 0 for the next call)
            self.flag[0] = 0
            if checked:
                return None
        return FPS(picked, idx)


# A plain call of up to this many points has its values checked by its launch (a pass over its
# points there), a larger one by a torch sum, which then costs less (docs/benchmarks.md, design choices)
CHECK_IN_LAUNCH = 512

# Whether plain eager calls run bucket FPS directly (:func:`_plain_fps`; tests switch it off to
# compare both paths)
PLAIN = [True]


def _plain_fps(points, n_samples, ratio, start_idx, random_start, generator, validate: bool) -> Optional[FPS]:
    """The result of a plain eager CPU :func:`farthest_point_sample` call, from bucket FPS called
    directly (no layout layer, no custom op: most of a small call's time); None for any other call.

    Plain: a plain cloud (:func:`pcops._layout.plain_clouds`: one (N, 3) CPU tensor, float32 or
    float64, nothing to differentiate, finite values where ``validate`` asks: checked by the
    prepared launch itself where the start is the default or one index in range, else by a sum), N >= 1,
    ``n_samples`` a Python int >= 1 or else ``ratio`` a Python float in (0, 1]; the default
    start, a random start (``random_start=True``, drawn as the general path draws it) or, with
    ``n_samples``, a start set of Python ints (checked by the general path's function). Every
    check of the general path passes on such a call, and it would run the same kernel on the same
    arrays (one sample of N points, the same start indices) and gather the same rows; anything
    else takes that path. The common call (``n_samples`` picks from the default start or one
    index, a plan kept for its size: :func:`pcops._warp.kept`) runs its checks and the plan,
    nothing more.
    """
    plain = False
    if ratio is None and random_start is False and type(n_samples) is int and (start_idx is None or type(start_idx) is int):
        # the common call (n picks from the default start or one index, its plan kept): only its checks
        plain = _layout.plain_clouds(False, points)
        if not plain:
            return None
        n, start = points.shape[0], start_idx or 0
        if (0 <= start < n <= (CHECK_IN_LAUNCH if validate else KEEP_SCRATCH) and 1 <= n_samples <= _validate.INT64_MAX
                and points.is_contiguous()):
            plan = _warp.kept(_plan_key(points.dtype, _warp.capacity(n), 1))
            if plan is not None:
                return plan.picks(points, n_samples, (start,), validate)
    if ratio is not None:
        if n_samples is not None or start_idx is not None or type(ratio) is not float or not 0 < ratio <= 1:
            return None
    elif type(n_samples) is not int or not 1 <= n_samples <= _validate.INT64_MAX:
        return None
    if type(random_start) is not bool or (random_start and start_idx is not None) or not (plain or _layout.plain_clouds(False, points)):
        return None
    n = points.shape[0]
    if n == 0:
        return None
    # the values: checked by the prepared launch itself for the default start or one in range (nothing
    # is drawn or raised before it), else by the layout's sum first
    in_kernel = validate and not random_start and n <= CHECK_IN_LAUNCH and (start_idx is None or (type(start_idx) is int and 0 <= start_idx < n))
    if validate and not in_kernel and not _layout.plain_clouds(True, points):
        return None
    if ratio is not None:
        n_samples = max(1, math.ceil(n * ratio))
    _warp.init()
    if start_idx is None:  # the default start, or the general path's draw: a float64 uniform u, start floor(u n)
        starts = (min(int(_uniform((1,), generator, points.device).item() * n), n - 1),) if random_start else (0,)
    elif type(start_idx) is int and 0 <= start_idx < n:
        starts = (start_idx,)
    elif type(start_idx) is int or (type(start_idx) in (list, tuple) and all(type(i) is int for i in start_idx)):
        starts = tuple(_start_set(start_idx, points, n_samples, False, here=validate)[0].tolist())  # (its errors)
    else:
        return None
    points = points.contiguous()
    capacity = _warp.capacity(n)  # (one plan serves every size up to its capacity)
    plan = _warp.prepared(_plan_key(points.dtype, capacity, len(starts)),
                          lambda: _Bucket.make(points.dtype, capacity, n_samples, len(starts))) if capacity <= KEEP_SCRATCH else None
    # the kernel writes every index (-1 past the picks made) and the picked points (zeros there)
    if plan is not None:
        return plan.picks(points, n_samples, starts, in_kernel)
    if in_kernel and not _layout.plain_clouds(True, points):  # (the kernel's first run: the sums)
        return None
    idx, picked = torch.empty(n_samples, dtype=torch.int64), points.new_empty(n_samples, 3)
    _bucket(points[None], torch.tensor([n], dtype=torch.int32), torch.tensor([min(n, n_samples)]), torch.tensor([starts]), idx[None], picked)
    return FPS(picked, idx)


def _plan_key(dtype: torch.dtype, capacity: int, starts: int) -> tuple:
    """The key of the kept :class:`_Bucket` of plain calls of up to ``capacity`` points of
    ``dtype`` from ``starts`` start indices (:func:`pcops._warp.prepared`, :func:`pcops._warp.kept`)."""
    return ("fps", dtype, capacity, starts, PLAIN_PAIRS)


@_threads.limits
def farthest_point_sample(
    points: torch.Tensor,
    n_samples: Optional[int] = None,
    *,
    lengths: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
    ratio: Union[float, torch.Tensor, None] = None,
    start_idx: Union[int, Sequence[int], torch.Tensor, None] = None,
    random_start: bool = False,
    generator: Optional[torch.Generator] = None,
    validate: bool = True,
) -> FPS:
    """Iterative farthest point sampling, exact and deterministic.

    Args:
        points: Tensor of shape (N, 3) (one cloud), (B, N, 3) padded with ``lengths``, or
            (N_total, 3) packed with ``batch``.
        n_samples: points to pick per sample (S). A sample with fewer points gives all of them,
            then -1 (see Returns).
        lengths: optional int tensor (B,) of valid rows per sample of padded points.
        batch: optional int tensor (N_total,) of sample ids of packed points (sorted or not).
        ratio: instead of ``n_samples``, for packed (or single) points: pick ceil(ratio * n_b)
            points of a sample of n_b points, 0 < ratio <= 1 (torch_cluster's ``fps``). A
            number, or a 0-d floating tensor (then the result has a data-dependent size even
            for a single cloud, and the op checks its value).
        start_idx: a start set: an int, a sequence of M distinct ints, or an int tensor (M,)
            (or (B, M) per sample for padded points). Every sample's sequence begins with these
            indices, in this order, and continues with plain FPS from the whole set. Indices
            are local to a sample: a row of the padded layout, or the position among the
            sample's points in packed order. They must be below the length of every non-empty
            sample; M <= n_samples. With ``ratio``, a sample with fewer than M picks gets the
            first of them. Default: each sample's first point (index 0).
        random_start: start each sample at a random point instead of its first point: the
            sample's start is floor(u n_b) for a uniform u drawn with torch's RNG on the CPU
            (``torch.manual_seed`` makes it reproducible). The draw is a tensor passed to the
            op, so under ``torch.compile`` it is part of the graph (no graph break; Inductor
            draws with its own generator unless ``torch._inductor.config.fallback_random``).
            Not with ``start_idx``.
        generator: optional CPU ``torch.Generator`` for the random start, in eager mode. A
            generator argument breaks the graph under ``torch.compile`` (torch 2.13): when
            compiling, leave it None and seed torch's global RNG (``torch.manual_seed``).
        validate: check the points for NaN/inf and lengths, batch ids and ``start_idx`` for
            range. With ``validate=False`` a point whose distance is NaN (a NaN point, or an
            infinite one after an infinite pick) is never picked, and once only such points
            are left, the remaining picks are -1.

    Returns:
        FPS(points, idx). Single: (S, 3) and (S,). Padded: (B, S, 3) and (B, S) with idx per
        sample. A sample (or a single cloud) with fewer than S points is padded: its idx is
        -1 past its point count and its points are zeros there (PyTorch3D's
        ``sample_farthest_points`` convention; the shape does not depend on the data). Do not
        index with a padded idx directly: -1 would silently give the last point; use
        ``out.points``, or ``idx[idx >= 0]``. Packed: (K, 3) and (K,) with idx into the packed
        points, grouped by sample in ascending id order, each in pick order (K = sum of the
        per-sample counts: its size depends on the data; never -1 unless ``validate=False``
        met NaN points). ``points`` is ``points[idx]``, differentiable with respect to the
        input points.

    Ties go to the smaller index. Points are compared in their own precision (float32/float64;
    float16/bfloat16 in float32). On the CPU each sample runs bucket FPS (a kd-tree of
    buckets; the exact plain FPS sequence), a thread per sample.

    Example:
        >>> import torch, pcops
        >>> points = torch.tensor([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0], [5.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
        >>> out = pcops.farthest_point_sample(points, 3)  # from point 0, each next pick the farthest
        >>> out.idx
        tensor([0, 2, 3])
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if PLAIN[0] and lengths is None and batch is None:
        out = _plain_fps(points, n_samples, ratio, start_idx, random_start, generator, validate)
        if out is not None:
            return out
    _validate.flag(random_start=random_start)
    n_samples, ratio = _validate.plain(n_samples), _validate.plain(ratio)  # NumPy scalars as Python numbers
    flat = _layout.single(points, lengths=lengths, batch=batch, validate=validate, flatten=False)
    _check_numbers(points, n_samples, ratio)
    first, start_checked = _start_set(start_idx, points, n_samples, random_start,
                                      here=validate and ratio is None and batch is None and lengths is None)
    # the op checks what the layout layer could not: values under torch.compile, a start set's
    # indices against each sample's length and a ratio tensor's value (one more host read, only
    # when a start set or a ratio tensor is given)
    check = flat.validate or (validate and ((first is not None and not start_checked) or isinstance(ratio, torch.Tensor)))
    return _sample(points, n_samples, ratio, lengths, batch, first, random_start, generator, check)


def _sample(points, n_samples, ratio, lengths, batch, first, random_start, generator, validate) -> FPS:
    """:func:`farthest_point_sample` on checked inputs; ``validate``: the op's own checks."""
    dtype, _ = _validate.compute_dtype(points)
    if points.dim() == 3:
        b, n = points.shape[:2]
        if lengths is None:
            lengths = torch.full((b,), n, dtype=torch.int64, device=points.device)
        lengths = lengths.to(torch.int64)
        counts = _counts(lengths, n_samples, None)
        if first is None:
            start = _start(lengths, random_start, generator)[:, None]
        else:
            start = first.expand(b, first.shape[-1])
        idx = _fps(points.detach().to(dtype), lengths, counts, start, n_samples, validate)
        if n == 0:  # empty clouds: every pick is -1 (nothing to gather from)
            return FPS(points.new_zeros((b, n_samples, 3)), idx)
        gathered = points.gather(1, idx.clamp(min=0)[..., None].expand(b, n_samples, 3))
        return FPS(torch.where(idx[..., None] >= 0, gathered, 0), idx)
    ratio_tensor = isinstance(ratio, torch.Tensor)
    if batch is None and not ratio_tensor:
        if ratio is not None:
            n_samples = math.ceil(points.shape[0] * ratio)  # (an empty cloud: none)
            first = None if first is None else first[: n_samples]
        out = _sample(points[None], n_samples, None, None, None, first, random_start, generator, validate)
        return FPS(out.points[0], out.idx[0])
    if batch is None:  # one cloud, a count that depends on a tensor's value: the packed op
        batch = torch.zeros(points.shape[0], dtype=torch.int64, device=points.device)
    if ratio_tensor:
        ratio = ratio.to(points.device, torch.float64)
    elif ratio is not None:
        ratio = torch.full((), ratio, dtype=torch.float64, device=points.device)
    idx = _fps_packed(
        points.detach().to(dtype), batch, first if first is not None else batch.new_empty((0,), dtype=torch.int64),
        n_samples or 0, ratio, _uniform(points.shape[0], generator, points.device) if random_start else None, validate,
    )
    return FPS(points[idx], idx)


@_threads.custom_op("pcops::farthest_point_sample_packed", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fps_packed(
    points: torch.Tensor, batch: torch.Tensor, start: torch.Tensor, n_samples: int, ratio: Optional[torch.Tensor],
    uniform: Optional[torch.Tensor], validate: bool,
) -> torch.Tensor:
    """Packed points (P, 3) with sample ids (P,) and a start set (M,) of local indices (M = 0:
    each sample's first point, or with ``uniform`` (P,) a random one: floor(u n_b) for the u of
    the sample's first point in packed order); ``n_samples`` picks per sample, or with ``ratio``
    (a 0-d float64 tensor) ceil(ratio n_b): idx (K,) into the points, by sample, in pick order."""
    if validate and ratio is not None:
        _validate.interval("ratio", float(ratio), 0, 1, closed_high=True)
    if points.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=points.device)
    order = torch.sort(batch.to(torch.int64), stable=True)
    ids, perm = order.values, order.indices
    samples, sizes = torch.unique_consecutive(ids, return_counts=True)
    b, n = samples.numel(), int(sizes.max())
    offsets = torch.cumsum(sizes, 0) - sizes
    local = torch.arange(ids.numel(), device=ids.device) - offsets.repeat_interleave(sizes)
    slot = torch.searchsorted(samples, ids)
    padded = points.new_zeros((b, n, 3))
    padded[slot, local] = points[perm]
    counts = _counts(sizes, n_samples or None, ratio)
    if start.numel():
        first = start.to(torch.int64)[None].expand(b, start.shape[0])
    elif uniform is not None:
        first = _start_from(uniform.to(torch.float64)[perm[offsets]], sizes)[:, None]
    else:
        first = torch.zeros((b, 1), dtype=torch.int64, device=points.device)
    idx = _fps(padded, sizes, counts, first, int(counts.max()), validate)
    keep = idx >= 0
    return perm[(offsets[:, None] + idx.clamp(min=0))[keep]]


@_fps_packed.register_fake
def _(points, batch, start, n_samples, ratio, uniform, validate):
    k = torch.library.get_ctx().new_dynamic_size()
    return points.new_empty((k,), dtype=torch.int64)


__all__ = ["FPS", "farthest_point_sample"]
