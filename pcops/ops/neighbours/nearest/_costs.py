"""Chamfer's per-point costs (each point's squared distance to its nearest point of the other cloud)
of two plain CPU clouds in Warp, for calls with nothing to differentiate.

``costs(x, y, both)`` returns ``cx`` (M,), the squared distance of each point of ``x`` to its
nearest point of ``y``, and (``both``) ``cy`` (N,) the other way: what :mod:`pcops.ops.geometry.chamfer`'s torch
formula computes from the kNN search's indices (``((x - y[idx]) ** 2).sum(-1)``, 0 where a point
found no neighbour), the same values bit for bit: the nearest point is the kNN search's (small
clouds: the kernel measures every pair with the scan's code; larger ones: the search itself,
:func:`._kdtree.find`), and a cost is the differences squared and
summed in torch's order, ``(dx^2 + dy^2) + dz^2``, one operation a statement (the CPU compiler
fuses no multiply-add across statements). One launch instead of about fourteen small torch
operations (docs/benchmarks.md, small clouds).
"""

import torch
import warp as wp

from .... import _warp, _warp_funcs
from . import _kdtree

# Both clouds' nearest points are measured pair by pair in the costs' launch up to this many
# (point, point) pairs both ways (m n each way); above, each way's kNN search (a tree) first
# (the crossover in docs/benchmarks.md, small clouds)
SCAN_PAIRS = 1 << 15


@_warp.kernels
def _kernels(dtype: torch.dtype):
    """``scan``: thread t < m finds x[t]'s nearest point of y by the kNN scan's insertion (the
    same comparisons, so the same point; row t of the scratch rows) and writes its cost to
    cx[t]; thread m + i does the same for y[i] in x into cy[i]. ``from_indices``: the same costs
    from the indices found by a search (-1: none, cost 0)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    insert = _warp_funcs.sorted_insert(dtype, True)
    slack = s((1.0 + 64.0 * torch.finfo(dtype).eps) ** 2)  # the kNN scan's: ties still compared

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
    def nearest(q: v, points: wp.array(dtype=v), dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), t: int):
        """The kNN scan's k = 1 row t for the query q (idx -1 where no point is finite or q is not)."""
        dists[t, 0] = s(wp.inf)
        idx[t, 0] = wp.int64(-1)
        if not (wp.isfinite(q[0]) and wp.isfinite(q[1]) and wp.isfinite(q[2])):
            return wp.int64(-1)
        n = int(0)
        bound = s(wp.inf)
        for j in range(points.shape[0]):
            diff = q - points[j]
            d2 = wp.dot(diff, diff)
            if d2 <= bound and d2 < s(wp.inf):  # NaN / inf points are never neighbours
                n = insert(dists, idx, t, n, d2, wp.int64(j))
                bound = wp.min(bound, dists[t, 0] * slack)
        return idx[t, 0]

    @wp.kernel(enable_backward=False, module="unique")
    def scan(start: int, x: wp.array(dtype=v), y: wp.array(dtype=v), dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64),
             cx: wp.array(dtype=s), cy: wp.array(dtype=s)):
        t = wp.tid() + start
        m = x.shape[0]
        if t < m:
            q = x[t]
            j = nearest(q, y, dists, idx, t)
            c = s(0.0)
            if j >= wp.int64(0):
                c = cost(q, y[j])
            cx[t] = c
        else:
            q = y[t - m]
            j = nearest(q, x, dists, idx, t)
            c = s(0.0)
            if j >= wp.int64(0):
                c = cost(q, x[j])
            cy[t - m] = c

    @wp.kernel(enable_backward=False, module="unique")
    def from_indices(start: int, x: wp.array(dtype=v), y: wp.array(dtype=v), ix: wp.array2d(dtype=wp.int64),
                     iy: wp.array2d(dtype=wp.int64), cx: wp.array(dtype=s), cy: wp.array(dtype=s)):
        t = wp.tid() + start
        m = x.shape[0]
        if t < m:
            j = ix[t, 0]
            c = s(0.0)
            if j >= wp.int64(0):
                c = cost(x[t], y[j])
            cx[t] = c
        else:
            j = iy[t - m, 0]
            c = s(0.0)
            if j >= wp.int64(0):
                c = cost(y[t - m], x[j])
            cy[t - m] = c

    return scan, from_indices


def _run(kernel, key, threads: int, args: list, arrays: dict, work: int) -> None:
    """``kernel`` over ``threads`` threads: the calling thread's prepared launch of ``key``
    (:func:`pcops._warp.prepared`) with ``arrays`` (its named tensors) pointed at this call's,
    or, before the kernel has run once, a launch of ``args``."""
    launch = _warp.prepared(key, lambda: _warp.prepare(kernel, threads, args, work=work))
    if launch is not None:
        launch.run(**arrays)
    else:
        _warp.launch(kernel, threads, args, like=arrays["x"], min_chunk=1, work=work)


def costs(x: torch.Tensor, y: torch.Tensor, both: bool) -> tuple:
    """(cx (M,), cy (N,) or None) of two plain CPU clouds (M, 3) and (N, 3) of one dtype
    (float32 or float64, contiguous, M and N > 0): see the module docs."""
    _warp.init()
    m, n = x.shape[0], y.shape[0]
    x, y = x.contiguous(), y.contiguous()
    threads = m + n if both else m
    scan, from_indices = _kernels(x.dtype)
    vec = _warp.vec3(x.dtype)
    cx, cy = x.new_empty(m), x.new_empty(n if both else 0)
    if m * n <= SCAN_PAIRS:
        dists, idx = x.new_empty((threads, 1)), torch.empty((threads, 1), dtype=torch.int64)
        args = [_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), dists, idx, cx, cy]
        arrays = dict(x=x, y=y, dists=dists, idx=idx, cx=cx, cy=cy)
        _run(scan, ("chamfer_scan", x.dtype, m, n, both), threads, args, arrays, work=m * n * (2 if both else 1))
    else:
        ix = _kdtree.find(x, y, 1)[1]
        iy = _kdtree.find(y, x, 1)[1] if both else ix[:0]
        args = [_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), ix, iy, cx, cy]
        arrays = dict(x=x, y=y, ix=ix, iy=iy, cx=cx, cy=cy)
        _run(from_indices, ("chamfer_costs", x.dtype, m, n, both), threads, args, arrays, work=threads)
    return cx, cy if both else None
