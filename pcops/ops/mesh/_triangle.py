"""The closest point of a triangle to a point (:func:`closest`): in torch, differentiable to any
order, where a gradient is to be kept; else the same formula in one Warp kernel (the custom op
``pcops::triangle_closest``), one launch instead of some 60 torch operations.

The same cases as the kernels' squared distance (:func:`._search._funcs`): the interior when
the point projects inside a triangle that is not flat (height above ``FLAT`` eps of its longest
edge), else the nearest of the three edges (the first of equal ones: ab, bc, ca). Flat and
degenerate triangles (zero area, repeated corners) are measured by their edges, exactly.
Every division has a safe denominator, so the branches not taken carry no NaN into gradients.
"""

from typing import NamedTuple

import torch
import warp as wp

from ... import _threads, _warp
from ._search import FLAT


class Closest(NamedTuple):
    point: torch.Tensor  # (..., 3)
    bary: torch.Tensor  # (..., 3) weights of a, b, c


def _dot(x, y):
    return (x * y).sum(-1)


def _segment(p, a, b):
    """Closest point of segment ab to p, and its parameter t (0 at a)."""
    ab = b - a
    length2 = _dot(ab, ab)
    t = (_dot(p - a, ab) / torch.where(length2 > 0, length2, 1.0)).clamp(0, 1)
    t = torch.where(length2 > 0, t, torch.zeros_like(t))
    return a + t[..., None] * ab, t


def closest(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Closest:
    """The closest point of triangles abc (..., 3) to points p (..., 3), with barycentric weights:
    differentiable where an input requires grad (and grad mode is on), else from one kernel."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (p, a, b, c))) and p.dim() == 2:
        return Closest(*_triangle_closest(*(t.detach().contiguous() for t in (p, a, b, c))))
    return _closest_torch(p, a, b, c)


def _closest_torch(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Closest:
    """:func:`closest` in torch operations."""
    eps = torch.finfo(p.dtype).eps
    zero = torch.zeros_like(p[..., 0])
    candidates = []
    for (x, y), slot in (((a, b), 0), ((b, c), 1), ((c, a), 2)):
        point, t = _segment(p, x, y)
        w = [zero, zero, zero]
        w[slot], w[(slot + 1) % 3] = 1 - t, t
        candidates.append((point, torch.stack(w, -1)))
    d2 = torch.stack([_dot(p - q, p - q) for q, _ in candidates], -1)
    pick = d2.argmin(-1, keepdim=True)  # the first of equal ones
    point = torch.stack([q for q, _ in candidates], -2).gather(-2, pick[..., None].expand(*pick.shape, 3)).squeeze(-2)
    bary = torch.stack([w for _, w in candidates], -2).gather(-2, pick[..., None].expand(*pick.shape, 3)).squeeze(-2)
    n = torch.linalg.cross(b - a, c - a)
    nn = _dot(n, n)
    longest = torch.maximum(torch.maximum(_dot(b - a, b - a), _dot(c - b, c - b)), _dot(a - c, a - c))
    solid = nn > (FLAT * eps) ** 2 * longest * longest
    safe = torch.where(solid, nn, 1.0)
    pa, pb, pc = a - p, b - p, c - p
    u, v, w = _dot(n, torch.linalg.cross(pb, pc)), _dot(n, torch.linalg.cross(pc, pa)), _dot(n, torch.linalg.cross(pa, pb))
    inside = solid & (u >= 0) & (v >= 0) & (w >= 0)
    weights = torch.stack([u, v, w], -1) / safe[..., None]
    plane = p + (_dot(n, pa) / safe)[..., None] * n  # p's projection onto the plane
    return Closest(torch.where(inside[..., None], plane, point), torch.where(inside[..., None], weights, bary))


@_warp.kernels
def _closest_kernel(dtype: torch.dtype):
    """:func:`_closest_torch`'s formula, one thread per point: the nearest edge point (the first of
    equal ones), replaced by the plane's point where p projects inside a triangle that is not flat."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    flat2 = s((FLAT * torch.finfo(dtype).eps) ** 2)

    @wp.func(module="unique")
    def segment(p: v, x: v, y: v):
        xy = y - x
        length2 = wp.dot(xy, xy)
        t = s(0.0)
        if length2 > s(0.0):
            t = wp.clamp(wp.dot(p - x, xy) / length2, s(0.0), s(1.0))
        return t

    @wp.kernel(enable_backward=False, module="unique")
    def closest(start: int, points: wp.array(dtype=v), a: wp.array(dtype=v), b: wp.array(dtype=v), c: wp.array(dtype=v),
                point: wp.array(dtype=v), bary: wp.array(dtype=v)):
        i = wp.tid() + start
        p, pa_, pb_, pc_ = points[i], a[i], b[i], c[i]
        t0, t1, t2 = segment(p, pa_, pb_), segment(p, pb_, pc_), segment(p, pc_, pa_)
        q0 = pa_ + t0 * (pb_ - pa_)
        q1 = pb_ + t1 * (pc_ - pb_)
        q2 = pc_ + t2 * (pa_ - pc_)
        d0, d1, d2 = wp.dot(p - q0, p - q0), wp.dot(p - q1, p - q1), wp.dot(p - q2, p - q2)
        near = q0
        w = v(s(1.0) - t0, t0, s(0.0))
        if d1 < d0 and d1 <= d2:
            near = q1
            w = v(s(0.0), s(1.0) - t1, t1)
        elif d2 < d0 and d2 < d1:
            near = q2
            w = v(t2, s(0.0), s(1.0) - t2)
        ab, bc, ca = pb_ - pa_, pc_ - pb_, pa_ - pc_
        n = wp.cross(ab, -ca)
        nn = wp.dot(n, n)
        longest = wp.max(wp.max(wp.dot(ab, ab), wp.dot(bc, bc)), wp.dot(ca, ca))
        if nn > flat2 * longest * longest:
            pa, pb, pc = pa_ - p, pb_ - p, pc_ - p
            u, vv, ww = wp.dot(n, wp.cross(pb, pc)), wp.dot(n, wp.cross(pc, pa)), wp.dot(n, wp.cross(pa, pb))
            if u >= s(0.0) and vv >= s(0.0) and ww >= s(0.0):
                near = p + (wp.dot(n, pa) / nn) * n
                w = v(u / nn, vv / nn, ww / nn)
        point[i] = near
        bary[i] = w

    return closest


@_threads.custom_op("pcops::triangle_closest", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _triangle_closest(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """points p and triangles abc (M, 3) -> (closest points (M, 3), barycentric weights (M, 3))."""
    point, bary = torch.empty_like(p), torch.empty_like(p)
    if p.shape[0]:
        _warp.init()
        _warp.launch(_closest_kernel(p.dtype), p.shape[0], [p, a, b, c, point, bary], like=p)
    return point, bary


@_triangle_closest.register_fake
def _(p, a, b, c):
    return torch.empty_like(p), torch.empty_like(p)

