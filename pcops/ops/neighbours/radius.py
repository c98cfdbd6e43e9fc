"""Radius aggregation: exp(-d/sigma)-weighted mean of the features of all neighbours within a radius.

For query points q_i and reference points p_j with features f_j, d_ij = ||q_i - p_j||:

    N(i)  = { j : d_ij <= r }
    w_ij  = exp(-(d_ij - m_i) / sigma),   m_i = min_{j in N(i)} d_ij
    out_i = sum_{j in N(i)} w_ij f_j / sum_{j in N(i)} w_ij       (0 when N(i) is empty)

Neighbours are found in a cell list (``pcops.ops.neighbours._cells``): the reference points sorted by
(sample, z, y, x) cell of a dense grid with cells r / 3 wide in x and r in y and z (wider for
sparse clouds, at most two cells per point), so each query scans 9 contiguous runs of sorted
points; no neighbour list and no (M, N) matrix is ever built. Queries run in the same cell
order, so neighbours are near in memory at any size. The forward kernel keeps a running minimum m_i and rescales its
accumulators when it drops (an online softmax), so one pass over the neighbours suffices and
any sigma > 0 stays finite. The backward pass is a hand-written Warp kernel (Warp's automatic
adjoint of a kernel that normalises after a dynamic neighbour loop is wrong: see
docs/ops/radius_aggregate.md). With a_ij = (w_ij / W_i) * g_i . (f_j - out_i):

    dL/df_j     = sum_i (w_ij / W_i) g_i
    dL/dd_ij    = -a_ij / sigma            -> dL/dq_i, dL/dp_j through (q_i - p_j) / d_ij
    dL/dsigma   = sum_ij a_ij (d_ij - m_i) / sigma^2

The shift m_i has exactly zero gradient (softmax is shift-invariant) and is held constant.
"""


import functools
from typing import Optional

import torch
import torch._prims_common
import warp as wp

from ... import _layout, _threads, _validate, _warp, _warp_funcs
from . import _cells, _weighting
from .nearest import _scan_rows


# Features are handled in blocks of this many columns (Warp vectors; rows padded with zeros):
# a block is one vector operation on the CPU instead of BLOCK scalar ones.
BLOCK = 8

# Softmax weights take a fixed shift (m_i = 0: w_ij = exp(-d_ij / sigma)) when radius / sigma is
# at most this, so no weight falls below exp(-limit) (a normal float32 / float64); above it the
# forward keeps each query's nearest distance as the shift (an online softmax).
_FIXED_SHIFT_LIMIT = {torch.float32: 60.0, torch.float64: 600.0}


def _vector(dtype: torch.dtype):
    """The Warp vector type of a block of ``BLOCK`` features."""
    return wp.types.vector(length=BLOCK, dtype=_warp.scalar(dtype))


def _padded(columns):
    """Columns rounded up to whole blocks (a Python or symbolic int)."""
    return (columns + BLOCK - 1) // BLOCK * BLOCK


def _blocks(x: torch.Tensor):
    """A zero-copy Warp view of a contiguous (rows, k * BLOCK) tensor as (rows, k) vectors."""
    return _warp.array(x.view(x.shape[0], x.shape[1] // BLOCK, BLOCK), dtype=_vector(x.dtype))


@functools.cache
def _weight_funcs(dtype: torch.dtype, weights: str):
    """One weighting's Warp functions (see pcops.ops.neighbours._weighting); the nearest neighbour weighs most.

    ``key(d, sq)``: what the weight decreases in (d; max(d^2, 1e-16); 0 for uniform);
    ``relative(k, m, sigma)``: w(k) / w(m), in (0, 1] for k >= m and never an overflow (a
    division by sigma after the shift, not a product with 1/sigma); ``fixed(radius, sigma)``:
    the shift m every key of a query within the radius may take (all weights relative to it
    normal numbers in (0, 1]), or +inf when there is none (the forward then keeps each query's
    smallest key); ``log_weight_dq(diff, d, sq, inv_s)``: the gradient of log w_ij with
    respect to q_i; ``sigma_term(d, m)``: d - m for softmax (times a_ij / sigma^2 it is the
    sigma gradient), else 0.
    """
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    softmax, inverse = weights == "softmax", weights == "inverse_distance"
    eps = s(_weighting.MIN_SQUARED_DISTANCE)
    limit = s(_FIXED_SHIFT_LIMIT[dtype])
    # inverse distance: eps / k >= eps / radius^2 stays normal up to radius^2 = eps * this
    span = s(1e20 if dtype == torch.float32 else 1e250)

    @wp.func
    def key(d: s, sq: s):
        if wp.static(softmax):
            return d
        if wp.static(inverse):
            return wp.max(sq, eps)
        return s(0.0)

    @wp.func
    def relative(k: s, m: s, sigma: s):
        if wp.static(softmax):
            return wp.exp((m - k) / sigma)
        if wp.static(inverse):
            return m / k
        return s(1.0)

    @wp.func
    def fixed(radius: s, sigma: s):
        if wp.static(softmax):
            if radius <= limit * sigma:
                return s(0.0)
            return s(wp.inf)
        if wp.static(inverse):
            if radius * radius <= eps * span:
                return eps
            return s(wp.inf)
        return s(0.0)

    @wp.func
    def log_weight_dq(diff: v, d: s, sq: s, inv_s: s):
        if wp.static(softmax):
            if d > s(0.0):
                return (-inv_s / d) * diff
        if wp.static(inverse):
            if sq > eps:
                return (s(-2.0) / sq) * diff
        return v(s(0.0), s(0.0), s(0.0))

    @wp.func
    def sigma_term(d: s, m: s):
        if wp.static(softmax):
            return d - m
        return s(0.0)

    return key, relative, fixed, log_weight_dq, sigma_term


@_warp.kernels
def _kernels(dtype: torch.dtype, weights: str = "softmax", dense: bool = False, near_bits: bool = True):
    """Forward and backward kernels for one float dtype and weighting (batches: one cell list per sample).

    Features, the output gradient and the forward's sums are (rows, blocks) arrays of
    ``BLOCK``-vectors (rows padded with zeros); ``out`` is a plain (M, F) array, the feature
    gradient a plain (N, blocks * BLOCK) one. ``dense``: a thread visits every reference point
    (``cells.points`` in their order, no window): the kernels of a list of one cell
    (:func:`_one_cell`), which visit its points in the same order as the window would.
    ``near_bits``: each run of points goes in blocks of 64, the points of a block that may lie
    within the radius found on vectors (:func:`.nearest._scan_rows.point_blocks`: on the CPU) and
    measured one by one in order as before; else every point of a block is measured (:data:`NEAR_BITS`).
    """
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    block_bits, take = _scan_rows.point_blocks(dtype, near_bits)
    vb = _vector(dtype)
    Cells, scope, span = _warp_funcs.cell_scan(dtype, dense)
    key, relative, fixed, log_weight_dq, sigma_term = _weight_funcs(dtype, weights)

    @wp.kernel(enable_backward=False, module="unique")
    def forward(
        start: int,
        cells: Cells,
        feats: wp.array2d(dtype=vb),
        sigma: wp.array(dtype=s),
        radius: s,
        acc: wp.array2d(dtype=vb),
        out: wp.array2d(dtype=s),
        wsum: wp.array(dtype=s),
        dmin: wp.array(dtype=s),
    ):
        i = int(cells.rows[wp.tid() + start])
        q = cells.query[i]
        nb = feats.shape[1]
        nf = out.shape[1]
        for b in range(nb):
            acc[i, b] = vb()
        sig = sigma[0]
        m = fixed(radius, sig)  # the shift of the keys; +inf: the smallest key so far (online)
        online = m == s(wp.inf)
        w_total = s(0.0)
        reach = radius * radius * s(1.0001)  # squared distances beyond it are out (d > radius)
        lo, hi = scope(cells, i, q, radius)
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                first, last = span(cells, lo, hi, y, z)
                block = first
                while block < last:  # blocks of 64 points: those that may lie within reach as bits, then each in order
                    bits = block_bits(q, cells.points, block, last, reach)
                    while bits != wp.uint64(0):
                        j, bits = take(block, bits)
                        diff = q - cells.points[j]
                        sq = wp.dot(diff, diff)
                        if sq <= reach:
                            d = wp.sqrt(sq)
                            if d <= radius:
                                k = key(d, sq)
                                if online:
                                    if k < m:  # a new nearest neighbour: shift what was accumulated so far
                                        scale = relative(m, k, sig)  # 0 for the first one (m = inf)
                                        w_total = w_total * scale
                                        for b in range(nb):
                                            acc[i, b] = acc[i, b] * scale
                                        m = k
                                w = relative(k, m, sig)
                                w_total = w_total + w
                                for b in range(nb):
                                    acc[i, b] = acc[i, b] + w * feats[j, b]
                    block += 64
        den = s(1.0)  # no neighbour: acc is 0, so 0 / 1
        if w_total > s(0.0):
            den = w_total
        else:
            m = s(0.0)
        for b in range(nb):  # a division, not a product with 1 / w_total: one neighbour gives its features exactly
            mean = acc[i, b] / den
            for e in range(BLOCK):
                if b * BLOCK + e < nf:
                    out[i, b * BLOCK + e] = mean[e]
        wsum[i] = w_total
        dmin[i] = m

    @wp.kernel(enable_backward=False, module="unique")
    def backward(
        start: int,
        cells: Cells,
        feats: wp.array2d(dtype=vb),
        sigma: wp.array(dtype=s),
        radius: s,
        grad_out: wp.array2d(dtype=vb),
        need_ref: int,
        need_feats: int,
        g_outs: wp.array(dtype=s),
        wsum: wp.array(dtype=s),
        dmin: wp.array(dtype=s),
        grad_query: wp.array2d(dtype=s),
        grad_sigma: wp.array(dtype=s),
        grad_ref: wp.array2d(dtype=s),
        grad_feats: wp.array2d(dtype=vb),
    ):
        i = int(cells.rows[wp.tid() + start])
        if wsum[i] == s(0.0):
            return
        q = cells.query[i]
        sig = sigma[0]
        inv_s = s(1.0) / sig
        inv_w = s(1.0) / wsum[i]
        m = dmin[i]
        nb = feats.shape[1]
        g_out = g_outs[i]  # g_i . out_i
        ones = vb(s(1.0))
        g_q = v(s(0.0), s(0.0), s(0.0))
        g_s = s(0.0)
        reach = radius * radius * s(1.0001)
        lo, hi = scope(cells, i, q, radius)
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                first, last = span(cells, lo, hi, y, z)
                block = first
                while block < last:  # blocks of 64 points: those that may lie within reach as bits, then each in order
                    bits = block_bits(q, cells.points, block, last, reach)
                    while bits != wp.uint64(0):
                        j, bits = take(block, bits)
                        diff = q - cells.points[j]
                        sq = wp.dot(diff, diff)
                        if sq <= reach:
                            d = wp.sqrt(sq)
                            if d <= radius:
                                w = relative(key(d, sq), m, sig) * inv_w
                                g_fv = vb()  # g_i * f_j by component: one horizontal sum per neighbour, not one per block
                                for b in range(nb):
                                    g = grad_out[i, b]
                                    g_fv = g_fv + wp.cw_mul(g, feats[j, b])
                                    if need_feats != 0:  # a plain add on the CPU (pcops._warp.launch's private copies)
                                        wp.atomic_add(grad_feats, j, b, w * g)
                                g_f = wp.dot(g_fv, ones)  # g_i . f_j
                                a = w * (g_f - g_out)  # dL / d log w_ij
                                g_s = g_s + a * sigma_term(d, m)
                                g_d = a * log_weight_dq(diff, d, sq, inv_s)  # dL/dq_i through this neighbour
                                g_q = g_q + g_d
                                if need_ref != 0:
                                    wp.atomic_add(grad_ref, j, 0, -g_d[0])
                                    wp.atomic_add(grad_ref, j, 1, -g_d[1])
                                    wp.atomic_add(grad_ref, j, 2, -g_d[2])
                    block += 64
        grad_query[i, 0] = g_q[0]
        grad_query[i, 1] = g_q[1]
        grad_query[i, 2] = g_q[2]
        grad_sigma[i] = g_s * inv_s * inv_s

    return forward, backward


def _launch(kernel, scan, feats, sigma, radius, tail: list, scatter=(), dense: bool = False):
    """Run a radius kernel over the queries (in cell order). Arguments: (start, ``scan`` (the
    struct of :meth:`pcops.ops.neighbours._cells.CellList.scan` or
    :func:`pcops.ops.neighbours._cells.every_point`), sorted features, sigma, radius, *tail);
    ``scatter`` indexes ``tail`` (the arrays the kernel accumulates into). ``feats`` may be a
    Warp array already (feature blocks). ``dense``: a kernel that visits every point (a query's
    work is the number of points: split as the every-pair searches are)."""
    _warp.init()
    like, m, n = scan.tensors[0], scan.query.shape[0], scan.points.shape[0]
    args = [scan, feats, sigma.reshape(1).contiguous(), radius, *tail]
    offset = len(args) - len(tail)
    _warp.launch(kernel, m, args, like=like, scatter=tuple(offset + i for i in scatter), min_chunk=1 if dense else _warp.QUERY_CHUNK,
                 work=m * n if dense else None)


# One CPU cloud with at most this many (query, reference point) pairs: every pair is measured,
# no cell list is built (a list of one cell, in the points' order: see _kernels' dense) (docs/ops/radius_aggregate.md).
SCAN_PAIRS = 1 << 19

# The kernels' runs of points in blocks whose points within the radius are found on vectors first
# (:func:`_kernels`' ``near_bits``; tests compare with False)
NEAR_BITS = True


def _dense(query: torch.Tensor, group: Optional[torch.Tensor], n: int) -> bool:
    """Whether a search of ``n`` reference points visits every one (no cell list)."""
    return query.is_cpu and group is None and query.shape[0] * n <= SCAN_PAIRS


# The lengths a call of the dense forward sets (:func:`pcops._warp.ranged`): its queries', its points'
_DENSE_GROUPS = (("cells__query", "cells__rows", "acc", "out", "wsum", "dmin"), ("cells__points", "cells__order", "feats"))


def _dense_forward(query, points, feats, sigma, radius: float, weights: str, acc, out, wsum, dmin) -> None:
    """The forward kernel over every pair of one CPU cloud; a prepared launch
    (:class:`pcops._warp.Prepared`, the calling thread's for clouds of up to a power of two
    points: :func:`pcops._warp.ranged`) once it is loaded."""
    kernel = _kernels(query.dtype, weights, True, NEAR_BITS)[0]
    m, n = query.shape[0], points.shape[0]
    query, sigma = query.contiguous(), sigma.reshape(1).contiguous()
    capacity = _warp.capacity(max(m, n))

    def make():
        scan = _cells.every_point(query, points, capacity)
        return _warp.prepare(kernel, m, [scan, _blocks(feats), sigma, radius, _blocks(acc), out, wsum, dmin], work=m * n,
                             keep=(scan.tensors[2],))  # (the indices; not this call's tensors)

    launch = _warp.ranged(("radius", query.dtype, weights, capacity, feats.shape[1], out.shape[1], NEAR_BITS), make, _DENSE_GROUPS, (m, n), m, m * n,
                          values=(("radius", float(radius)),))
    if launch is None:
        _launch(kernel, _cells.every_point(query, points), _blocks(feats), sigma, radius, [_blocks(acc), out, wsum, dmin], dense=True)
    else:
        launch.run(cells__query=query, cells__points=points, feats=feats, sigma=sigma, acc=acc, out=out, wsum=wsum, dmin=dmin)


@_threads.custom_op("pcops::radius_aggregate", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _radius_aggregate(
    query: torch.Tensor,
    ref: torch.Tensor,
    features: torch.Tensor,
    sigma: torch.Tensor,
    radius: float,
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
    weights: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out (M, F), wsum (M,), dmin (M,), points (N, 3), feats (N, F rounded up to
    blocks), *cells): ``wsum`` and ``dmin`` each query's sum of weights and smallest weighting
    key (softmax: the nearest distance); ``points`` and ``feats`` the reference points and
    their zero-padded features in the cell list's order, and ``cells`` the cell list
    (:meth:`pcops.ops.neighbours._cells.CellList.tensors`): the backward's inputs, saved so that it
    neither sorts nor reorders again. Every size follows from the inputs' shapes: the op
    compiles without a graph break under default ``torch.compile``. One host read (the grid's
    size; on a GPU a synchronisation)."""
    _validate.positive_number("radius", radius)
    _validate.groups_paired(query_group, ref_group)
    _validate.op_values(validate, query=query, ref=ref, features=features, sigma=sigma)
    m, n, f = query.shape[0], ref.shape[0], features.shape[1]
    width = _padded(f)
    if m == 0 or n == 0 or f == 0:
        return (query.new_zeros((m, f)), query.new_zeros((m,)), query.new_zeros((m,)), ref.new_zeros((n, 3)),
                ref.new_zeros((n, width)), *_cells.CellList.empty(m, ref).tensors())
    out, wsum, dmin = query.new_empty(m, f), query.new_empty(m), query.new_empty(m)
    # the sums of the padded feature blocks: ``out`` itself when F is a whole number of blocks
    acc = out if width == f else query.new_empty(m, width)
    if _dense(query, query_group, n):  # every pair, in the points' order: a list of one cell
        cells = _cells.CellList.empty(m, ref)
        points = ref.contiguous().clone()
        feats = torch.nn.functional.pad(features, (0, width - f)) if width != f else features.contiguous().clone()
        _dense_forward(query, points, feats, sigma, radius, weights, acc, out, wsum, dmin)
    else:
        cells = _cells.CellList(query, ref, radius, query_group, ref_group)
        forward, _ = _kernels(query.dtype, weights, cells.total == 1, NEAR_BITS)
        points, feats = _cells.permute(ref, cells.order), _cells.permute(features, cells.order, width=width)
        scan = cells.scan(query, query_group, points)
        _launch(forward, scan, _blocks(feats), sigma, radius, [_blocks(acc), out, wsum, dmin], dense=cells.total == 1)
    return out, wsum, dmin, points, feats, *cells.tensors()


@_radius_aggregate.register_fake
def _(query, ref, features, sigma, radius, validate, query_group, ref_group, weights="softmax"):
    m, n = query.shape[0], ref.shape[0]
    long = dict(dtype=torch.int64)
    return (query.new_empty((m, features.shape[1])), query.new_empty((m,)), query.new_empty((m,)), ref.new_empty((n, 3)),
            ref.new_empty((n, _padded(features.shape[1]))), ref.new_empty((n,), **long), ref.new_empty((n,), **long),
            query.new_empty((m,), **long), ref.new_empty((6,)), torch.empty((4,), device="cpu", **long),
            ref.new_empty((_cells.capacity(n),), **long))


@_threads.custom_op("pcops::radius_aggregate_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _radius_aggregate_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    points: torch.Tensor,
    feats: torch.Tensor,
    sigma: torch.Tensor,
    radius: float,
    query_group: Optional[torch.Tensor],
    out: torch.Tensor,
    wsum: torch.Tensor,
    dmin: torch.Tensor,
    need_ref: bool,
    need_features: bool,
    weights: str,
    order: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    frame: torch.Tensor,
    shape: torch.Tensor,
    starts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the gradients of (query, ref, features, sigma), in the inputs' order; those of
    ref / features stay zero unless ``need_ref`` / ``need_features`` (no scattering for inputs
    without gradient). ``points``, ``feats``, ``out``, ``wsum``, ``dmin`` and the cell list
    (order, keys, rows, frame, shape, starts): what pcops::radius_aggregate returned."""
    if query.is_cuda:  # CUDA atomics add in any order; the CPU path sums per-thread copies in a fixed order
        torch._prims_common.alert_not_deterministic("pcops::radius_aggregate_backward on CUDA")
    m, n, f = query.shape[0], points.shape[0], out.shape[1]
    grad_query, grad_sigma = torch.zeros_like(query), query.new_zeros((m,))
    if not (m and n and f):
        grad_ref, grad_feats = torch.zeros_like(points), points.new_zeros((n, f))
    else:
        cells = _cells.CellList.of(order, keys, rows, frame, shape, starts)
        _, backward = _kernels(query.dtype, weights, cells.total == 1, NEAR_BITS)
        width = feats.shape[1]
        grad_out = grad_out.contiguous()
        if width != f:  # rows padded to whole blocks
            grad_out = torch.nn.functional.pad(grad_out, (0, width - f))
        # gradients of the sorted points, scattered into (tail 8 and 9)
        sorted_ref = torch.zeros_like(points) if need_ref else points.new_zeros((0, 3))
        sorted_feats = torch.zeros_like(feats) if need_features else feats.new_zeros((0, width))
        g_out = torch.linalg.vecdot(grad_out[:, :f], out)  # g_i . out_i (padding columns are 0 in grad_out)
        tail = [_blocks(grad_out), int(need_ref), int(need_features), g_out.contiguous(), wsum, dmin,
                grad_query, grad_sigma, sorted_ref, _warp.Typed(sorted_feats.view(sorted_feats.shape[0], width // BLOCK, BLOCK), _vector(feats.dtype))]
        scatter = (8,) * need_ref + (9,) * need_features
        _launch(backward, cells.scan(query, query_group, points), _blocks(feats), sigma, radius, tail, scatter, cells.total == 1)
        grad_ref = _cells.permute(sorted_ref, cells.order, True) if need_ref else torch.zeros_like(points)
        grad_feats = _cells.permute(sorted_feats, cells.order, True, width=f) if need_features else points.new_zeros((n, f))
    return grad_query, grad_ref, grad_feats, grad_sigma.sum().reshape(sigma.shape)


@_radius_aggregate_backward.register_fake
def _(grad_out, query, points, feats, sigma, radius, query_group, out, wsum, dmin, need_ref, need_features, weights, order, keys,
      rows, frame, shape, starts):
    return torch.empty_like(query), torch.empty_like(points), points.new_empty((points.shape[0], out.shape[1])), torch.empty_like(sigma)


def _setup_context(ctx, inputs, output):
    query, ref, features, sigma, radius, _validate_flag, query_group, ref_group, weights = inputs
    out, wsum, dmin, points, feats, *cells = output
    ctx.radius, ctx.weights = radius, weights
    ctx.mark_non_differentiable(wsum, dmin, points, feats, *cells)
    ctx.save_for_backward(query, ref, features, sigma, query_group, ref_group, out, wsum, dmin, points, feats, *cells)


def _backward(ctx, grad_out, *_grads_of_saved):
    query, ref, features, sigma, query_group, ref_group, out, wsum, dmin, points, feats, *cells = ctx.saved_tensors
    need = ctx.needs_input_grad
    if torch.is_grad_enabled():  # create_graph=True: gradients that are differentiable again (pcops.ops.neighbours._radius_torch)
        from ._radius_torch import gradients

        grads = gradients(grad_out, query, ref, features, sigma, ctx.radius, query_group, ref_group, dmin, ctx.weights, need[:4])
    else:
        grads = _radius_aggregate_backward(
            grad_out, query, points, feats, sigma, ctx.radius, query_group, out, wsum, dmin, need[1], need[2], ctx.weights, *cells
        )
    return *(g if n else None for g, n in zip(grads, need)), *(None,) * 5


_radius_aggregate.register_autograd(_backward, setup_context=_setup_context)


@_warp.kernels
def _max_kernel(dtype: torch.dtype, dense: bool = False, near_bits: bool = True):
    """Feature-wise max over the neighbours within the radius, and the reference row holding it
    (``dense``: over every point, ``near_bits``: blocks of points, as :func:`_kernels`)."""
    _, finite_point = _warp_funcs.finite(dtype)
    s = _warp.scalar(dtype)
    Cells, window, run = _warp_funcs.cell_scan(dtype, dense)
    block_bits, take = _scan_rows.point_blocks(dtype, near_bits)

    @wp.kernel(enable_backward=False, module="unique")
    def forward_max(
        start: int,
        cells: Cells,
        feats: wp.array2d(dtype=s),
        sigma: wp.array(dtype=s),
        radius: s,
        out: wp.array2d(dtype=s),
        arg: wp.array2d(dtype=wp.int64),
    ):
        i = int(cells.rows[wp.tid() + start])
        q = cells.query[i]
        if not finite_point(q):
            return  # as the scan would (an empty window), sooner
        nf = feats.shape[1]
        count = int(0)
        reach = radius * radius * s(1.0001)  # (a square past it: no distance within the radius)
        lo, hi = window(cells, i, q, radius)
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                first, last = run(cells, lo, hi, y, z)
                block = first
                while block < last:
                    bits = block_bits(q, cells.points, block, last, reach)
                    while bits != wp.uint64(0):
                        j, bits = take(block, bits)
                        if wp.length(q - cells.points[j]) <= radius:
                            original = cells.order[j]
                            for c in range(nf):
                                f = feats[j, c]
                                best = out[i, c]
                                # ties go to the smaller original index, whatever order the cells are visited in
                                if count == 0 or f > best or (f == best and original < arg[i, c]):
                                    out[i, c] = f
                                    arg[i, c] = original
                            count = count + 1
                    block += 64

    return forward_max


@_threads.custom_op("pcops::radius_max", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _radius_max(
    query: torch.Tensor,
    ref: torch.Tensor,
    features: torch.Tensor,
    radius: float,
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out (M, F), arg (M, F) int64): each feature's max over the neighbours and the
    reference row holding it (the smallest index among ties); 0 and -1 for a query without any."""
    _validate.positive_number("radius", radius)
    _validate.groups_paired(query_group, ref_group)
    _validate.op_values(validate, query=query, ref=ref, features=features)
    m, f = query.shape[0], features.shape[1]
    out = query.new_zeros((m, f))
    arg = torch.full((m, f), -1, dtype=torch.int64, device=query.device)
    if m == 0 or ref.shape[0] == 0 or f == 0:
        return out, arg
    unit = torch.ones(1, dtype=query.dtype, device=query.device)  # the sigma slot of the launch helper
    if _dense(query, query_group, ref.shape[0]):  # every pair, in the points' order
        scan, feats, dense = _cells.every_point(query, ref), features.contiguous(), True
    else:
        cells = _cells.CellList(query, ref, radius, query_group, ref_group)
        points, feats, dense = ref[cells.order].contiguous(), features[cells.order].contiguous(), cells.total == 1
        scan = cells.scan(query, query_group, points)
    _launch(_max_kernel(query.dtype, dense, NEAR_BITS), scan, feats, unit, radius, [out, arg], dense=dense)
    return out, arg


@_radius_max.register_fake
def _(query, ref, features, radius, validate, query_group, ref_group):
    shape = (query.shape[0], features.shape[1])
    return query.new_empty(shape), query.new_empty(shape, dtype=torch.int64)


def _max_setup_context(ctx, inputs, output):
    ctx.rows = inputs[2].shape[0]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])


def _max_backward(ctx, grad_out, _grad_arg):
    (arg,) = ctx.saved_tensors
    grad = grad_out.new_zeros((ctx.rows, grad_out.shape[1]))
    if ctx.rows == 0:  # no reference point: every arg is -1, and no row 0 to add into
        return None, None, grad, None, None, None, None
    grad = grad.scatter_add(0, arg.clamp_min(0), torch.where(arg >= 0, grad_out, 0))  # all to the arg-max
    return None, None, grad, None, None, None, None


_radius_max.register_autograd(_max_backward, setup_context=_max_setup_context)


# Whether plain eager calls run the forward kernel directly (:func:`_plain_radius_aggregate`;
# tests switch it off to compare both paths)
PLAIN = [True]


def _plain_radius_aggregate(query, ref, features, radius, sigma, weights: str, validate: bool) -> Optional[torch.Tensor]:
    """The result of a plain eager CPU :func:`radius_aggregate` call (``reduce="mean"``) small
    enough to visit every pair (:func:`_dense`), from its forward kernel called directly (no
    layout layer, no custom op, no cell list tensors); None for any other call. Plain: plain
    clouds (:func:`pcops._layout.plain_clouds`), (N, F) CPU features of their dtype with F >= 1,
    nothing to differentiate, finite where ``validate`` asks, ``radius`` and a softmax ``sigma``
    finite Python numbers > 0 (sigma > 0 in the dtype too). Every check of the general path
    passes on such a call, and it would run the same kernel on the same values."""
    if torch.compiler.is_compiling():  # (traced: the general path; no guard on the sizes here)
        return None
    if type(radius) not in (int, float) or not 0 < radius <= _validate.FLOAT_MAX or (sigma is not None and type(sigma) not in (int, float)):
        return None
    if not all(type(t) is torch.Tensor and t.dim() == 2 for t in (query, ref, features)) or features.shape[0] != ref.shape[0]:
        return None
    if not (features.shape[1] and query.shape[0] and ref.shape[0]) or not _dense(query, None, ref.shape[0]):
        return None
    if not _layout.plain_clouds(validate, query, ref, features=features):  # (last: the sums where validate asks)
        return None
    dtype, f = query.dtype, features.shape[1]
    if sigma is None:
        sigma = _unit(dtype)
    elif _validate.is_positive_in(sigma, dtype):  # (else the general path names it)
        sigma = torch.full((1,), float(sigma), dtype=dtype)
    else:
        return None
    m, width = query.shape[0], _padded(f)
    out, wsum, dmin = query.new_empty(m, f), query.new_empty(m), query.new_empty(m)
    acc = out if width == f else query.new_empty(m, width)
    feats = features.contiguous() if width == f else torch.nn.functional.pad(features, (0, width - f))
    _dense_forward(query, ref.contiguous(), feats, sigma, float(radius), weights, acc, out, wsum, dmin)
    return out


@functools.cache
def _unit(dtype: torch.dtype) -> torch.Tensor:
    """A (1,) one of ``dtype``: the sigma slot of the weightings without one (never written)."""
    return torch.ones(1, dtype=dtype)


@_threads.limits
def radius_aggregate(
    query: torch.Tensor,
    ref: torch.Tensor,
    features: torch.Tensor,
    radius: float,
    sigma=None,
    *,
    weights: Optional[str] = None,
    reduce: str = "mean",
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Distance-weighted mean of the features of all reference points within ``radius``.

    For each query point q_i, with d_ij = ||q_i - p_j|| and N(i) = {j : d_ij <= radius}::

        out_i = sum_{j in N(i)} exp(-d_ij / sigma) f_j / sum_{j in N(i)} exp(-d_ij / sigma)

    and out_i = 0 when N(i) is empty. Computed stably for any sigma > 0 (the exponent is
    shifted by each query's nearest distance). Memory is O((M + N) * F): no neighbour list
    and no (M, N) matrix is built. ``weights="inverse_distance"`` uses
    ``w_ij = 1 / max(d_ij^2, 1e-16)`` and ``weights="uniform"`` the plain mean instead;
    ``reduce="max"`` takes the feature-wise max over N(i) (unweighted; its gradient goes to the
    arg-max neighbour, the smallest index among ties). See docs/ops/knn_interpolate.md.

    Args:
        query: Tensor of shape (M, 3), the points to aggregate onto; or (B, M, 3) padded,
            or (M_total, 3) packed with ``query_batch``.
        ref: Tensor of shape (N, 3) (or (B, N, 3), or (N_total, 3) with ``ref_batch``),
            the points carrying features.
        features: Tensor of shape (N, F) (or (B, N, F), or (N_total, F)), one row per
            reference point.
        radius: Python number > 0, the neighbourhood radius (inclusive: d_ij <= radius).
        sigma: number > 0 or one-element tensor (e.g. a learnable parameter), the length
            scale of the softmax weights; None for the other weightings and for max.
        weights: "softmax", "inverse_distance", "uniform", or None (softmax for
            ``reduce="mean"``, uniform for ``reduce="max"``).
        reduce: "mean" (weighted mean) or "max".
        query_lengths, ref_lengths: optional int tensors of shape (B,) for padded inputs:
            rows past a sample's length are padding (never neighbours, zero outputs).
        query_batch, ref_batch: int tensors of shapes (M_total,) and (N_total,), the sample
            id of each point of packed inputs (sorted or not). Points never find neighbours
            in another sample.
        validate: check values (NaN/inf in points, sigma > 0, lengths and ids in range);
            on CUDA this costs a device synchronisation. Shape, dtype and device checks
            always run.

    Returns:
        Tensor of shape (M, F) (or (B, M, F), or (M_total, F)) in the promoted dtype of the
        inputs. float32 and float64 are computed natively, float16 and bfloat16 in float32.

    Gradients flow to ``features``, and for ``reduce="mean"`` to ``query`` and ``ref``
    (softmax and inverse-distance weights) and ``sigma`` (softmax, when it is a tensor).

    Example:
        >>> import torch, pcops
        >>> ref = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [3.0, 0.0, 0.0]])
        >>> features = torch.tensor([[2.0], [4.0], [100.0]])
        >>> pcops.radius_aggregate(torch.tensor([[0.0, 0.0, 0.0]]), ref, features, radius=1.0, weights="uniform")  # the mean within the radius
        tensor([[3.]])
    """
    weights = _validate.weighting(weights, reduce, sigma)
    if PLAIN[0] and reduce == "mean" and query_lengths is None and ref_lengths is None and query_batch is None and ref_batch is None:
        out = _plain_radius_aggregate(query, ref, features, radius, sigma, weights, validate)
        if out is not None:
            return out
    softmax = reduce != "max" and weights == "softmax"
    if softmax:
        _validate.scale("sigma", sigma)
        _validate.same_device(query=query, sigma=sigma)
    flat = _layout.pair(
        query, ref, features, query_lengths=query_lengths, ref_lengths=ref_lengths,
        query_batch=query_batch, ref_batch=ref_batch, validate=validate,
        positive=dict(sigma=sigma) if softmax and isinstance(sigma, torch.Tensor) else None,
    )
    _validate.positive_number("radius", radius)
    dtype, out_dtype = _validate.compute_dtype(query, ref, features)
    q, p, f = flat.query.to(dtype), flat.ref.to(dtype), flat.features.to(dtype)
    _threads.reverse_only("radius_aggregate", q, p, f, sigma)
    if reduce == "max":
        out, _ = _radius_max(q, p, f, float(radius), flat.validate, flat.query_group, flat.ref_group)
        return _layout.unflatten(flat, out.to(out_dtype))
    if softmax:
        sigma = _validate.scale_tensor(sigma, dtype, query.device)
    else:  # not read by the kernels of the other weightings
        sigma = torch.ones((), dtype=dtype, device=query.device)
    out = _radius_aggregate(q, p, f, sigma, float(radius), flat.validate, flat.query_group, flat.ref_group, weights)[0]
    return _layout.unflatten(flat, out.to(out_dtype))
