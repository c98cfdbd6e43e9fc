"""Chamfer's per-point costs (each point's squared distance to its nearest point of the other cloud)
of two plain CPU clouds in Warp, for calls with nothing to differentiate.

``costs(x, y, both)`` returns ``cx`` (M,), the squared distance of each point of ``x`` to its
nearest point of ``y``, and (``both``) ``cy`` (N,) the other way: what :mod:`pcops.ops.geometry.chamfer`'s torch
formula computes from the kNN search's indices (``((x - y[idx]) ** 2).sum(-1)``; where a point
found no neighbour, inf if it is finite, else 0), the same values bit for bit: the nearest point is the kNN search's (small
clouds: the kernel measures every pair with the scan's code; larger ones: the search itself,
:func:`._kdtree.find`), and a cost is the differences squared and
summed in torch's order, ``(dx^2 + dy^2) + dz^2``, one operation a statement (the CPU compiler
fuses no multiply-add across statements). One launch instead of about fourteen small torch
operations (docs/benchmarks.md, small clouds).
"""

import torch
import warp as wp

from .... import _layout, _warp
from . import _kdtree

# Both clouds' nearest points are measured pair by pair in the costs' launch up to this many
# (point, point) pairs both ways (m n each way); above, each way's kNN search (a tree) first
# (the crossover in docs/benchmarks.md, small clouds)
SCAN_PAIRS = 1 << 15


@_warp.kernels
def _kernels(dtype: torch.dtype):
    """``scan``: thread t < m finds x[t]'s nearest point of y with the kNN scan's row
    (:func:`._kdtree.scan_row`: the same comparisons, so the same point; row t of the scratch rows;
    ``none``: the unread group) and writes its cost to
    cx[t]; thread m + i does the same for y[i] in x into cy[i]; between them the threads look at
    every point of both clouds and set ``bad[0]`` to 1 where one is NaN or inf (the values check
    of a plain call). ``from_indices``: the same costs
    from the indices found by a search (-1: none, cost :func:`unmatched`'s)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    row = _kdtree.scan_row(dtype, False)
    flag = _kdtree.flag_not_finite(dtype)

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
        if wp.isfinite(q[0]) and wp.isfinite(q[1]) and wp.isfinite(q[2]):
            c = s(wp.inf)
        return c

    @wp.kernel(enable_backward=False, module="unique")
    def scan(start: int, x: wp.array(dtype=v), y: wp.array(dtype=v), none: wp.array(dtype=wp.int32), dists: wp.array2d(dtype=s),
             idx: wp.array2d(dtype=wp.int64), cx: wp.array(dtype=s), cy: wp.array(dtype=s), bad: wp.array(dtype=wp.int32)):
        t = wp.tid() + start
        m = x.shape[0]
        flag(x, t, dists.shape[0], bad)  # the values' check: bad[0] = 1 where a point is not finite
        flag(y, t, dists.shape[0], bad)
        if t < m:
            q = x[t]
            row(q, wp.int32(0), y, none, 0, y.shape[0], dists, idx, t)  # (the kNN scan's k = 1 row t: idx -1 where none is finite)
            j = idx[t, 0]
            c = unmatched(q)
            if j >= wp.int64(0):
                c = cost(q, y[j])
            cx[t] = c
        else:
            q = y[t - m]
            row(q, wp.int32(0), x, none, 0, x.shape[0], dists, idx, t)
            j = idx[t, 0]
            c = unmatched(q)
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
            c = unmatched(x[t])
            if j >= wp.int64(0):
                c = cost(x[t], y[j])
            cx[t] = c
        else:
            j = iy[t - m, 0]
            c = unmatched(y[t - m])
            if j >= wp.int64(0):
                c = cost(y[t - m], x[j])
            cy[t - m] = c

    return scan, from_indices


def _run(kernel, key, threads: int, make_args, arrays: dict, work: int) -> tuple:
    """``kernel`` over ``threads`` threads: the calling thread's prepared launch of ``key``
    (:func:`pcops._warp.prepared`) with ``arrays`` (its named tensors) pointed at this call's,
    or, before the kernel has run once, a launch of the arguments ``make_args()`` returns
    (args, keep: the arrays the prepared launch keeps); returns the kept arrays (of the
    prepared launch, or of this launch)."""

    def prepare():
        args, keep = make_args()
        return _warp.prepare(kernel, threads, args, work=work, keep=keep)

    launch = _warp.prepared(key, prepare)
    if launch is None:  # (the kernel's first run: its arguments made again, once)
        args, keep = make_args()
        _warp.launch(kernel, threads, args, like=arrays["x"], min_chunk=1, work=work)
        return keep
    if launch.keep:
        launch.keep[1][0] = 0  # (the scan's flag, reset)
    launch.run(**arrays)
    return launch.keep


def costs(x: torch.Tensor, y: torch.Tensor, both: bool, check: bool = False):
    """(cx (M,), cy (N,) or None) of two plain CPU clouds (M, 3) and (N, 3) of one dtype
    (float32 or float64, M and N > 0): see the module docs. ``check``: their values too (the
    small clouds' scan looks at every point; larger clouds' sums are read first): None where
    one is NaN or inf."""
    _warp.init()
    m, n = x.shape[0], y.shape[0]
    x, y = x.contiguous(), y.contiguous()
    threads = m + n if both else m
    scan, from_indices = _kernels(x.dtype)
    vec = _warp.vec3(x.dtype)
    if m * n > SCAN_PAIRS and check and not _layout.plain_clouds(True, x, y):
        return None
    cx, cy = x.new_empty(m), x.new_empty(n if both else 0)
    if m * n <= SCAN_PAIRS:
        dists, idx = x.new_empty((threads, 1)), torch.empty((threads, 1), dtype=torch.int64)
        arrays = dict(x=x, y=y, dists=dists, idx=idx, cx=cx, cy=cy)

        def scan_args():
            flag = _kdtree.values_flag()
            return [_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), _kdtree._no_group(x.device)[1], dists, idx, cx, cy, flag[0]], flag

        flag = _run(scan, ("chamfer_scan", x.dtype, m, n, both), threads, scan_args, arrays, m * n * (2 if both else 1))[1]
        if check and flag[0]:
            return None
    else:
        ix = _kdtree.find(x, y, 1)[1]
        iy = _kdtree.find(y, x, 1)[1] if both else ix[:0]
        arrays = dict(x=x, y=y, ix=ix, iy=iy, cx=cx, cy=cy)
        _run(from_indices, ("chamfer_costs", x.dtype, m, n, both), threads,
             lambda: ([_warp.array(x, dtype=vec), _warp.array(y, dtype=vec), ix, iy, cx, cy], ()), arrays, threads)
    return cx, cy if both else None
