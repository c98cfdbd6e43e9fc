"""The closest point of a triangle to a point, in torch: differentiable to any order.

The same cases as the kernels' squared distance (:func:`._search._funcs`): the interior when
the point projects inside a triangle that is not flat (height above ``FLAT`` eps of its longest
edge), else the nearest of the three edges (the first of equal ones: ab, bc, ca). Flat and
degenerate triangles (zero area, repeated corners) are measured by their edges, exactly.
Every division has a safe denominator, so the branches not taken carry no NaN into gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

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
    """The closest point of triangles abc (..., 3) to points p (..., 3), with barycentric weights."""
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
