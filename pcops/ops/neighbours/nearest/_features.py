"""The candidates of the feature-space kNN on the CPU (:func:`._torch._search_features`) in one
Warp launch per chunk of queries (a native function on vectors), instead of torch's ``topk``,
gathers and sorts.

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
"""

import torch
import warp as wp

from .... import _threads, _warp, _warp_funcs

_LAST_ROW = 2**62  # the row an empty candidate sorts by (after every row of ref)
MAX_WIDTH = 64  # candidates a query at most (k + 8; more: the torch form)
TILE = 256  # values of a row a tile (a multiple of 8): the first one's buffered on the stack
_VEC4 = {torch.float32: wp.vec4f, torch.float64: wp.vec4d}


# One query row of :func:`_kernel` in native code (CPU; see its docs): the row's values made
# and compared a vector of lanes at a time (``real``: the Gram form's dtype, the formula's
# operations in its order, none fused), the candidates' differences four float64 lanes at a time
# from ``point`` coordinates, each candidate's place in (distance, row) order counted four
# distances at a time.
_ROW_SNIPPET = r"""
#if defined(__CUDA_ARCH__)
return -1;
#else
typedef POINT point;
typedef double d4 __attribute__((vector_size(32)));
typedef point p4 __attribute__((vector_size(4 * sizeof(point))));
struct Pair { double value, slot; };  // a buffer entry (16 bytes: moved whole)
const long long g = t / rows, i = t - g * rows;  // (64-bit: the byte offsets below may pass 2^31)
const int n = products.shape[2];
const real* X = (const real*)((const char*)products.data + g * products.strides[0] + i * products.strides[1]);
const real* RS = (const real*)((const char*)r_sq.data + g * r_sq.strides[0]);
const real qs = *(const real*)((const char*)q_sq.data + g * q_sq.strides[0] + i * q_sq.strides[1]);
Pair* B = (Pair*)((char*)buf.data + (long long)lane * buf.strides[0]);
const real inf = __builtin_inf();
const int capacity = 2 * MAX_WIDTH;
// entry ``target`` of the first ``count`` made the value of that rank, the smaller before it, the
// others after (a quickselect, the middle of three as the pivot, every pair swapped: no branch on
// the values; the pivot put between the halves and left out of the next pass)
auto nth = [&](int count, int target) -> real {
    int lo = 0, hi = count;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        const double ka = B[lo].value, kb = B[mid].value, kc = B[hi - 1].value;
        int at = mid;
        if (ka < kb) {
            if (kc < kb)
                at = ka < kc ? hi - 1 : lo;
        } else if (ka < kc)
            at = lo;
        else if (kb < kc)
            at = hi - 1;
        const Pair chosen = B[at];
        B[at] = B[hi - 1];
        int fence = lo;
        for (int j = lo; j < hi - 1; ++j) {
            const Pair x = B[j];
            B[j] = B[fence];
            B[fence] = x;
            fence += x.value < chosen.value;
        }
        B[hi - 1] = B[fence];
        B[fence] = chosen;
        if (target < fence)
            hi = fence;
        else if (target > fence)
            lo = fence + 1;
        else
            lo = hi;
    }
    return (real)B[target].value;
};
// every value of the row into the buffer that can be among its width smallest, in the row's order:
// in the first tile, each lane's ``levels`` smallest values (distinct values of the row: NaN and
// inf never enter) bound it, the largest of them no smaller than width of the row's values; each
// value at most the bound joins the buffer, which is cut back to its width smallest when full
// (a quickselect), lowering the bound
real top = inf;  // values below it join, and equal ones while ``inclusive`` (the lanes' bound, before a cut)
bool inclusive = false;
int count = 0, nans = 0;
const lanes qv = (lanes){} + qs, two = (lanes){} + (real)2, far = (lanes){} + inf;
auto cut = [&]() {  // (the buffer full: back to its width smallest)
    top = nth(count, width - 1);
    inclusive = false;
    count = width;
};
auto keep = [&](real x, int j) {  // one value
    if (x < top || (inclusive && x == top)) {
        B[count] = Pair{(double)x, (double)j};
        if (++count >= capacity)
            cut();
    }
};
auto keep_lanes = [&](lanes x, int j) {  // a vector's values from j: every lane written, those that join counted (no branch on each)
    const unsigned bits = BITS(x < (lanes){} + top) | (inclusive ? BITS(x == (lanes){} + top) : 0u);
    if (!bits)
        return;
    for (int l = 0; l < L; ++l) {
        B[count] = Pair{(double)x[l], (double)(j + l)};
        count += (bits >> l) & 1u;
    }
    if (count >= capacity)  // (the buffer holds L - 1 entries past its capacity)
        cut();
};
int levels = (width + L - 1) / L;
levels = levels <= 1 ? 1 : levels <= 2 ? 2 : levels <= 4 ? 4 : levels <= 8 ? 8 : 0;  // (0: no bound, every value a candidate)
auto tiles = [&](auto* size) {
    constexpr int LV = (int)sizeof(*size);
    for (int j0 = 0; j0 < n; j0 += TILE) {
        const int end = n - j0 < TILE ? n : j0 + TILE;
        const bool tops = j0 == 0 && levels > 0;
        real xb[TILE];
        lanes low[LV];
        for (int c = 0; c < LV; ++c)
            low[c] = far;
        int j = j0;
        for (; j + L <= end; j += L) {
            lanes p, rs;
            __builtin_memcpy(&p, X + j, sizeof p);
            __builtin_memcpy(&rs, RS + j, sizeof rs);
            const lanes x = (qv + rs) - two * p;
            const mask number = x == x;
            nans += L - __builtin_popcount(BITS(number));
            if (tops) {
                __builtin_memcpy(xb + (j - j0), &x, sizeof x);
                lanes y = (lanes)((number & (mask)x) | (~number & (mask)far));  // each lane's smallest, in order (NaN as inf)
                for (int c = 0; c < LV; ++c) {
                    const lanes less = __builtin_elementwise_min(y, low[c]);
                    y = __builtin_elementwise_max(y, low[c]);
                    low[c] = less;
                }
            } else
                keep_lanes(x, j);
        }
        for (; j < end; ++j) {  // (the tile's last values, fewer than a vector)
            const real x = (qs + RS[j]) - (real)2 * X[j];
            nans += x != x;
            if (tops)
                xb[j - j0] = x;
            else
                keep(x, j);
        }
        if (tops) {
            real bound = low[LV - 1][0];
            for (int l = 1; l < L; ++l)
                bound = low[LV - 1][l] > bound ? low[LV - 1][l] : bound;
            top = bound;  // (inf: every finite value joins)
            inclusive = bound < inf;
            const int vectors = (end - j0) / L;
            for (int v = 0; v < vectors; ++v) {
                lanes x;
                __builtin_memcpy(&x, xb + v * L, sizeof x);
                keep_lanes(x, j0 + v * L);
            }
            for (int e = vectors * L; e < end - j0; ++e)
                keep(xb[e], j0 + e);
            if (end < n && count > width)  // (more tiles: the width smallest so far bound them)
                cut();
        }
    }
};
if (levels <= 1)
    tiles((char(*)[1])nullptr);
else if (levels == 2)
    tiles((char(*)[2])nullptr);
else if (levels == 4)
    tiles((char(*)[4])nullptr);
else
    tiles((char(*)[8])nullptr);
if (count > width) {
    top = nth(count, width - 1);
    count = width;
} else if (count == width) {
    top = (real)B[0].value;
    for (int e = 1; e < width; ++e)
        top = top > (real)B[e].value ? top : (real)B[e].value;
}
if (nans > 0)
    top = __builtin_nan("");
*(real*)((char*)last.data + g * last.strides[0] + i * last.strides[1]) = top;
// each candidate's direct distance: four float64 sums (dimension c in sum c mod 4, added in one
// order), four candidates at a time (their sums independent), NaN as inf (never a neighbour; an
// empty slot's Gram value is inf, never kept); the slots past ``count``: inf, row ``none``
const int dims = q.shape[2];
const point* Q = (const point*)((const char*)q.data + g * q.strides[0] + i * q.strides[1]);
double dist[MAX_WIDTH];
long long ids[MAX_WIDTH];
for (int e0 = 0; e0 < count; e0 += 4) {
    const point* R[4];
    for (int u = 0; u < 4; ++u) {
        const long long jj = (long long)B[e0 + u < count ? e0 + u : e0].slot;
        R[u] = (const point*)((const char*)r.data + g * r.strides[0] + jj * r.strides[1]);
    }
    d4 sums[4] = {};
    for (int c = 0; c < dims; ++c) {
        p4 a;
        __builtin_memcpy(&a, Q + 4 * c, sizeof a);
        const d4 x = __builtin_convertvector(a, d4);
        for (int u = 0; u < 4; ++u) {
            p4 b;
            __builtin_memcpy(&b, R[u] + 4 * c, sizeof b);
            const d4 diff = x - __builtin_convertvector(b, d4);
            const d4 square = diff * diff;
            sums[u] = sums[u] + square;
        }
    }
    for (int u = 0; u < 4 && e0 + u < count; ++u) {
        const double acc = (sums[u][0] + sums[u][1]) + (sums[u][2] + sums[u][3]);
        const long long jj = (long long)B[e0 + u].slot;
        const long long row = *(const long long*)((const char*)r_rows.data + g * r_rows.strides[0] + jj * r_rows.strides[1]);
        dist[e0 + u] = acc == acc ? acc : __builtin_inf();
        ids[e0 + u] = row < 0 ? none : row;
    }
}
for (int e = count; e < width; ++e) {
    dist[e] = __builtin_inf();
    ids[e] = none;
}
// each candidate's place in (distance, row) order: how many are before it (equal pairs by their
// slot), counted four distances at a time; ties of distance resolved one by one
typedef long long l4 __attribute__((vector_size(32)));
auto count4 = [](l4 m) -> int {  // (a comparison's true lanes)
#if defined(__AVX__)
    return __builtin_popcount((unsigned)__builtin_ia32_movmskpd256((d4)m));
#else
    return (int)__builtin_reduce_add(m & (l4){1, 1, 1, 1});
#endif
};
const int take = values.shape[2];
const int padded = (width + 3) & ~3;
for (int e = width; e < padded; ++e)
    dist[e] = __builtin_nan("");  // (never smaller, never equal)
double* V = (double*)((char*)values.data + g * values.strides[0] + i * values.strides[1]);
long long* C = (long long*)((char*)cand.data + g * cand.strides[0] + i * cand.strides[1]);
const long long vs = values.strides[2] / (long long)sizeof(double), cs = cand.strides[2] / (long long)sizeof(long long);
for (int e = 0; e < width; ++e) {
    const double d = dist[e];
    const d4 dv = (d4){} + d;
    int less = 0, equal = 0;
    for (int f = 0; f < padded; f += 4) {
        d4 o;
        __builtin_memcpy(&o, dist + f, sizeof o);
        less += count4((l4)(o < dv));
        equal += count4((l4)(o == dv));
    }
    int at = less;
    if (equal > 1)
        for (int f = 0; f < width; ++f)
            at += dist[f] == d && (ids[f] < ids[e] || (ids[f] == ids[e] && f < e));
    if (at < take) {
        V[at * vs] = d;
        C[at * cs] = d < __builtin_inf() ? ids[e] : -1;
    }
}
return 0;
#endif
"""


@_warp.kernels
def _kernel(dtype: torch.dtype, point_dtype: torch.dtype):
    """Thread ``lane``: the lane-th of ``lanes`` ranges of the chunk's queries, through row ``lane``
    of the buffer (pairs of a value and its slot, one 16-byte entry to move in a swap); query t: row
    t % rows of group t // rows (see the module docs). The row's values go by tiles of
    :data:`TILE`. In the first, each of the L lanes (8 float32 or 4 float64 values a vector) keeps
    its ``levels`` smallest (ceil(width / L), rounded up to 1, 2, 4 or 8; none past 8): the largest
    of those L levels values, of distinct points, bounds the width smallest of the row. Every value
    at most the bound joins a buffer of 2 MAX_WIDTH, in the row's order (each lane of a vector
    written, those that join counted: no branch a value); a full buffer, and the first tile's of a
    longer row, is cut back to its width smallest (a quickselect), lowering the bound to the
    width-th value (then only smaller values join). At the end the buffer's width smallest are the
    candidates. (A heap sifts for every value that joins it, about width ln(n / width) times a row,
    each a mispredicted branch or more: several times slower.) The candidates' points come as rows
    of 4-vectors (``q`` (G, S, D / 4), ``r`` (G, R, D / 4)), their differences and squares taken a
    4-vector at a time, four candidates at once. All of it in a native function
    (:data:`_ROW_SNIPPET`; Warp's CPU loops are not vectorised): CPU only (the CUDA path ranks in
    torch), in CUDA code the function does nothing. The arrays' last dimensions are contiguous
    (:func:`rank`)."""
    s, pt = _warp.scalar(dtype), _warp.scalar(point_dtype)
    p4 = wp.types.vector(length=4, dtype=pt)
    body = (_ROW_SNIPPET.replace("POINT", "float" if point_dtype == torch.float32 else "double")
            .replace("MAX_WIDTH", str(MAX_WIDTH)).replace("TILE", str(TILE)))

    @_warp_funcs.lanes.func_native(body, dtype, f"features_rank_row_{'f' if point_dtype == torch.float32 else 'd'}")
    def row(t: int, lane: int, rows: int, width: int, products: wp.array3d(dtype=s), q_sq: wp.array2d(dtype=s), r_sq: wp.array2d(dtype=s),
            q: wp.array3d(dtype=p4), r: wp.array3d(dtype=p4), r_rows: wp.array2d(dtype=wp.int64), none: wp.int64,
            buf: wp.array2d(dtype=wp.vec2d), values: wp.array3d(dtype=wp.float64),
            cand: wp.array3d(dtype=wp.int64), last: wp.array2d(dtype=s)) -> int: ...

    @wp.kernel(enable_backward=False, module="unique")
    def rank(start: int, lanes: int, total: int, rows: int, width: int, products: wp.array3d(dtype=s), q_sq: wp.array2d(dtype=s),
             r_sq: wp.array2d(dtype=s), q: wp.array3d(dtype=p4), r: wp.array3d(dtype=p4), r_rows: wp.array2d(dtype=wp.int64),
             none: wp.int64, buf: wp.array2d(dtype=wp.vec2d), values: wp.array3d(dtype=wp.float64),
             cand: wp.array3d(dtype=wp.int64), last: wp.array2d(dtype=s)):
        lane = wp.tid() + start
        t = total * lane // lanes
        end = total * (lane + 1) // lanes
        while t < end:
            row(t, lane, rows, width, products, q_sq, r_sq, q, r, r_rows, none, buf, values, cand, last)
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
    products, r_sq = products.contiguous(), r_sq.contiguous()  # (the kernel's rows: contiguous)
    values = torch.empty((g, rows, take), dtype=torch.float64)
    cand = torch.empty((g, rows, take), dtype=torch.int64)
    last = products.new_empty((g, rows))
    lanes = min(g * rows, _threads.requested())
    buf = _warp.Typed(torch.empty((lanes, 2 * MAX_WIDTH + 8, 2), dtype=torch.float64), wp.vec2d)  # (a vector's lanes past the capacity)
    dims = q.shape[2]
    # the points as rows of 4-vectors (zeros added up to a multiple of 4: exact in the sums; a
    # point's coordinates contiguous, as the vectors need: a transposed feature map is copied)
    q, r = (_warp.Typed((torch.nn.functional.pad(x, (0, -dims % 4)) if dims % 4 else x if x.stride(-1) == 1 else x.contiguous())
                        .view(*x.shape[:2], -1, 4), _VEC4[x.dtype]) for x in (q, r))
    args = [lanes, g * rows, rows, width, products, q_sq, r_sq, q, r, r_rows, _LAST_ROW, buf, values, cand, last]
    _warp.launch(_kernel(products.dtype, q.tensor.dtype), lanes, args, like=products, min_chunk=1, work=g * rows * (n + width * dims))
    return values, cand, last
