"""The candidates of the feature-space kNN on the CPU (:func:`._torch._search_features`) in one
Warp launch per chunk of queries, instead of torch's ``topk``, gathers and sorts.

A thread per range of query rows (one range per torch thread) takes each row's Gram form matrix
products (``products``: q.p of the centred points, from a batched matrix product) and keeps the
``width`` smallest values of ``(|q|^2 + |p|^2) - 2 q.p`` (torch's formula, the same operations):
its candidates, and ``last``, the largest of them (no point left out has a smaller value; NaN
where a value was NaN: the caller searches that row again directly). Then it measures each
candidate's squared distance by direct float64 differences of the points (summed in four running
sums, dimension c in sum c mod 4, added in one order: equal points give equal distances), orders
the candidates by (distance, row of ref) and writes the first ``take``: distance, and the row or
-1 where the distance is inf (an empty slot of a padded block, or a NaN point: never a
neighbour). The same neighbours as the torch form of the same steps: which of several equal Gram
values it keeps at its edge never matters, since the caller checks ``last`` against the k-th
distance (see :func:`._torch._search_features`).

(A Warp trap met here: ``a, b = x[i], y[i]`` binds the array elements, not their values; a
store to ``x[i]`` before ``a`` is read changes ``a``. Elements read into names that outlive a
store to them are read one statement each.)
"""

import torch
import warp as wp

from .... import _threads, _warp

_LAST_ROW = 2**62  # the row an empty candidate sorts by (after every row of ref)
MAX_WIDTH = 64  # candidates a query at most (k + 8; more: the torch form)
_SAMPLES = 64  # values of a row at most in the sample that sets its first threshold
_VEC4 = {torch.float32: wp.vec4f, torch.float64: wp.vec4d}


@_warp.kernels
def _kernel(dtype: torch.dtype, point_dtype: torch.dtype):
    """Thread ``lane``: the lane-th of ``lanes`` ranges of the chunk's queries, through row ``lane``
    of the buffer (pairs of a value and its slot, one 16-byte entry to move in a swap); query t: row
    t % rows of group t // rows (see the module docs). The candidates go through a buffer of 2
    MAX_WIDTH values: first a threshold from a sample of the row (its values every ceil(n /
    _SAMPLES) columns; the one whose rank there puts about 2 width of the row below it), then every
    value below the threshold joins the buffer; a full buffer is cut back to its width smallest,
    lowering the threshold; at the end the buffer's width smallest are the candidates. A sample's
    threshold that lets fewer than width values through is dropped and the row scanned again without
    one. Where a fair share of the row passes (n < 16 width: about one value in 8 or more), every
    value is stored and kept or overwritten by the count, with no branch on it (a branch there
    mispredicts often). (A heap sifts for every value that joins it, about width ln(n / width) times
    a row, each a mispredicted branch or more: several times slower.) The points come as rows of
    4-vectors (``q`` (G, S, D / 4), ``r`` (G, R, D / 4)), their differences and squares taken a
    4-vector at a time."""
    s, pt = _warp.scalar(dtype), _warp.scalar(point_dtype)
    f64 = wp.float64
    capacity = 2 * MAX_WIDTH
    ranked = wp.types.vector(length=MAX_WIDTH, dtype=f64)
    ranked_ids = wp.types.vector(length=MAX_WIDTH, dtype=wp.int64)
    v4, p4 = wp.vec4d, wp.types.vector(length=4, dtype=pt)
    pair = wp.vec2d  # a buffer entry: (value, slot), the value exact in float64, the slot too (below 2^53)

    @wp.func(module="unique")
    def nth(buf: wp.array2d(dtype=pair), t: int, count: int, target: int):
        """Row t's first count (value, slot) pairs reordered so that entry ``target`` holds the
        value of that rank, the smaller ones before it, the others after: a quickselect, the
        middle of three as the pivot, each pass swapping every pair (no branch on the values)
        and the pivot put between the halves (each pass leaves it out: duplicates cannot stall
        it)."""
        lo = int(0)
        hi = count
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ka = buf[t, lo][0]
            kb = buf[t, mid][0]
            kc = buf[t, hi - 1][0]
            at = mid  # the middle of the three
            if ka < kb:
                if kc < kb:
                    at = wp.where(ka < kc, hi - 1, lo)
            elif ka < kc:
                at = lo
            elif kb < kc:
                at = hi - 1
            chosen = buf[t, at]
            pivot = chosen[0]
            buf[t, at] = buf[t, hi - 1]
            fence = lo
            j = lo
            while j < hi - 1:
                x = buf[t, j]
                buf[t, j] = buf[t, fence]
                buf[t, fence] = x
                fence = fence + int(x[0] < pivot)
                j += 1
            buf[t, hi - 1] = buf[t, fence]
            buf[t, fence] = chosen
            if target < fence:
                hi = fence
            elif target > fence:
                lo = fence + 1
            else:
                lo = hi
        return s(buf[t, target][0])

    @wp.func(module="unique")
    def one(t: int, lane: int, rows: int, width: int, products: wp.array3d(dtype=s), q_sq: wp.array2d(dtype=s), r_sq: wp.array2d(dtype=s),
            q: wp.array3d(dtype=p4), r: wp.array3d(dtype=p4), r_rows: wp.array2d(dtype=wp.int64), none: wp.int64,
            buf: wp.array2d(dtype=pair), values: wp.array3d(dtype=f64),
            cand: wp.array3d(dtype=wp.int64), last: wp.array2d(dtype=s)):
        """Query row t (of the chunk's G S), through the buffer's row ``lane``."""
        g = t // rows
        i = t - g * rows
        n = products.shape[2]
        qs = q_sq[g, i]
        # the sample's threshold
        top = s(wp.inf)
        step = wp.max((n + _SAMPLES - 1) // _SAMPLES, 1)
        samples = (n + step - 1) // step
        m = 2 * width * samples // n + 1
        if m < samples:
            count = int(0)
            j = int(0)
            while j < n:
                x = (qs + r_sq[g, j]) - s(2.0) * products[g, i, j]
                buf[lane, count] = pair(f64(x), f64(0.0))
                count += int(x == x)
                j += step
            if m < count:
                top = nth(buf, lane, count, m - 1)
        count = int(0)
        nans = int(0)
        dense = n < 16 * width
        scan = bool(True)
        while scan:
            j = int(0)
            if dense:  # many values pass: every value stored, kept by the count (no branch on it)
                while j < n:
                    x = (qs + r_sq[g, j]) - s(2.0) * products[g, i, j]
                    buf[lane, count] = pair(f64(x), f64(j))
                    count += int(x < top)
                    nans += int(x != x)
                    if count == capacity:  # full: keep the width smallest
                        top = nth(buf, lane, count, width - 1)
                        count = width
                    j += 1
            while j < n:
                x = (qs + r_sq[g, j]) - s(2.0) * products[g, i, j]
                if x < top:
                    buf[lane, count] = pair(f64(x), f64(j))
                    count += 1
                    if count == capacity:  # full: keep the width smallest
                        top = nth(buf, lane, count, width - 1)
                        count = width
                elif x != x:
                    nans += 1
                j += 1
            scan = count < width and top < s(wp.inf)
            if scan:  # the sample's threshold let too few through: again without it
                top = s(wp.inf)
                count = 0
                nans = 0
        if count > width:
            top = nth(buf, lane, count, width - 1)
            count = width
        elif count == width:
            top = s(buf[lane, 0][0])
            for e in range(1, width):
                top = wp.max(top, s(buf[lane, e][0]))
        if nans > 0:
            top = s(wp.nan)
        last[g, i] = top
        dist = ranked()
        ids = ranked_ids()
        dims = q.shape[2]
        for e in range(width):  # each candidate's direct distance, inserted in (distance, row) order
            d = f64(wp.inf)
            row = none
            if e < count:
                jj = int(buf[lane, e][1])
                # four sums (dimensions c mod 4: the vectors' lanes), added in one order: equal points, equal distances
                sums = v4()
                c = int(0)
                while c < dims:
                    diff = v4(q[g, i, c]) - v4(r[g, jj, c])
                    sums = sums + wp.cw_mul(diff, diff)
                    c += 1
                acc = (sums[0] + sums[1]) + (sums[2] + sums[3])
                if acc == acc:  # (NaN: never a neighbour; an empty slot's Gram value is inf, never kept)
                    d = acc
                row = r_rows[g, jj]
                if row < wp.int64(0):
                    row = none
            p = e
            while p > 0 and (dist[p - 1] > d or (dist[p - 1] == d and ids[p - 1] > row)):
                dist[p] = dist[p - 1]
                ids[p] = ids[p - 1]
                p = p - 1
            dist[p] = d
            ids[p] = row
        for e in range(values.shape[2]):
            values[g, i, e] = dist[e]
            cand[g, i, e] = wp.where(dist[e] < f64(wp.inf), ids[e], wp.int64(-1))

    @wp.kernel(enable_backward=False, module="unique")
    def rank(start: int, lanes: int, total: int, rows: int, width: int, products: wp.array3d(dtype=s), q_sq: wp.array2d(dtype=s),
             r_sq: wp.array2d(dtype=s), q: wp.array3d(dtype=p4), r: wp.array3d(dtype=p4), r_rows: wp.array2d(dtype=wp.int64),
             none: wp.int64, buf: wp.array2d(dtype=pair), values: wp.array3d(dtype=f64),
             cand: wp.array3d(dtype=wp.int64), last: wp.array2d(dtype=s)):
        lane = wp.tid() + start
        t = total * lane // lanes
        end = total * (lane + 1) // lanes
        while t < end:
            one(t, lane, rows, width, products, q_sq, r_sq, q, r, r_rows, none, buf, values, cand, last)
            t += 1

    return rank


def rank(products: torch.Tensor, q_sq: torch.Tensor, r_sq: torch.Tensor, q: torch.Tensor, r: torch.Tensor, r_rows: torch.Tensor,
         width: int, take: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values (G, S, take) float64, cand (G, S, take) int64, last (G, S)) of a chunk's queries
    (see the module docs): ``products`` (G, S, R) and the squared norms ``q_sq`` (G, S) and
    ``r_sq`` (G, R) (inf for empty slots) of the centred points, in the Gram form's dtype; ``q``
    (G, S, D) and ``r`` (G, R, D) the points (float32 or float64, one dtype; their differences
    taken in float64), ``r_rows`` (G, R) their rows in ref (-1: empty); width at most
    :data:`MAX_WIDTH`. The queries run in a range per torch thread, each range's candidates
    through one buffer (a few kilobytes a call, not a buffer a query)."""
    g, rows, n = products.shape
    values = torch.empty((g, rows, take), dtype=torch.float64)
    cand = torch.empty((g, rows, take), dtype=torch.int64)
    last = products.new_empty((g, rows))
    lanes = min(g * rows, _threads.requested())
    buf = _warp.Typed(torch.empty((lanes, 2 * MAX_WIDTH, 2), dtype=torch.float64), wp.vec2d)
    dims = q.shape[2]
    # the points as rows of 4-vectors (zeros added up to a multiple of 4: exact in the sums)
    q, r = (_warp.Typed((torch.nn.functional.pad(x, (0, -dims % 4)) if dims % 4 else x).view(*x.shape[:2], -1, 4), _VEC4[x.dtype]) for x in (q, r))
    args = [lanes, g * rows, rows, width, products, q_sq, r_sq, q, r, r_rows, _LAST_ROW, buf, values, cand, last]
    _warp.launch(_kernel(products.dtype, q.tensor.dtype), lanes, args, like=products, min_chunk=1, work=g * rows * (n + width * dims))
    return values, cand, last
