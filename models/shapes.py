"""Random shapes with exact signed distance functions (negative inside), for the default task.

Each primitive is an exact Euclidean SDF (sphere, box, rounded box, torus, capsule, cylinder).
A shape is a primitive with random parameters under a random uniform scale, rotation and
translation; the distance stays exact because the transform is a similarity. Surface points
are made by projecting random points of a thin band (inside down to -0.5, outside up to
0.02) onto the zero level set along the SDF gradient (one Newton step is exact for an exact
SDF; more remove rounding), and the normals are the SDF gradients there. Starting from the
inside keeps samples off edges and corners, onto which whole regions of outside points would
project.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PRIMITIVES = ("sphere", "box", "rounded_box", "torus", "capsule", "cylinder")
ALL_PRIMITIVES = PRIMITIVES + ("cone", "prism")  # the SDF task draws from PRIMITIVES; the point tasks from all


def _box(p: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    q = p.abs() - half
    return q.clamp_min(0).norm(dim=-1) + q.max(-1).values.clamp_max(0)


def primitive_sdf(kind: str, p: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Exact SDF of a primitive with parameters ``a`` (3 numbers in (0.3, 0.8)) at points p (..., 3)."""
    if kind == "sphere":
        return p.norm(dim=-1) - a[0]
    if kind == "box":
        return _box(p, a)
    if kind == "rounded_box":
        r = 0.25 * a.min()
        return _box(p, a - r) - r
    if kind == "torus":
        major, minor = a[0], 0.4 * a[1]
        ring = torch.stack([p[..., :2].norm(dim=-1) - major, p[..., 2]], -1)
        return ring.norm(dim=-1) - minor
    if kind == "capsule":
        half, r = a[0], 0.5 * a[1]
        z = p[..., 2].clamp(-half, half)
        return (p - torch.stack([torch.zeros_like(z), torch.zeros_like(z), z], -1)).norm(dim=-1) - r
    if kind == "cylinder":
        r, half = a[0], a[1]
        d = torch.stack([p[..., :2].norm(dim=-1) - r, p[..., 2].abs() - half], -1)
        return d.max(-1).values.clamp_max(0) + d.clamp_min(0).norm(dim=-1)
    if kind == "cone":
        return _cone(p, a[0], a[1])
    if kind == "prism":
        return _prism(p, a[0], a[1], a[2])
    raise ValueError(f"unknown primitive {kind!r}; choose from {ALL_PRIMITIVES}")


def _cone(p: torch.Tensor, r: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Exact SDF of a cone along z: base radius r at z = -h, apex at z = +h (Quilez's capped cone)."""
    qx, qy = p[..., :2].norm(dim=-1), p[..., 2]
    cax = qx - torch.minimum(qx, torch.where(qy < 0, r, torch.zeros_like(r)))
    cay = qy.abs() - h
    t = ((r * qx + 2 * h * (h - qy)) / (r * r + 4 * h * h)).clamp(0, 1)
    cbx, cby = qx - r * t, qy - h + 2 * h * t
    sign = torch.where((cbx < 0) & (cay < 0), -1.0, 1.0).to(p.dtype)
    return sign * torch.minimum(torch.stack([cax, cay], -1).norm(dim=-1), torch.stack([cbx, cby], -1).norm(dim=-1))


def _prism(p: torch.Tensor, half_base: torch.Tensor, height: torch.Tensor, half_length: torch.Tensor) -> torch.Tensor:
    """Exact SDF of a wedge: the isosceles triangle (+-half_base, -height/2), (0, height/2) in xy, extruded along z."""
    zero = torch.zeros_like(half_base)
    corners = [torch.stack([-half_base, -height / 2]), torch.stack([half_base, -height / 2]), torch.stack([zero, height / 2])]
    xy = p[..., :2]
    dist, side = None, None
    for i in range(3):  # Quilez's exact triangle SDF: distance to the nearest edge, sign from the edge sides
        a, e = corners[i], corners[(i + 1) % 3] - corners[i]
        v = xy - a
        w = v - e * ((v @ e) / (e @ e)).clamp(0, 1)[..., None]
        cross = e[0] * v[..., 1] - e[1] * v[..., 0]  # > 0 inside for these counter-clockwise corners
        dist = w.norm(dim=-1) if dist is None else torch.minimum(dist, w.norm(dim=-1))  # norm: a finite gradient at 0
        side = cross if side is None else torch.minimum(side, cross)
    flat = torch.where(side > 0, -dist, dist)
    w2 = torch.stack([flat, p[..., 2].abs() - half_length], -1)
    return w2.max(-1).values.clamp_max(0) + w2.clamp_min(0).norm(dim=-1)


def _rotation(gen: torch.Generator) -> torch.Tensor:
    """A uniformly random rotation matrix (from a random unit quaternion)."""
    w, x, y, z = torch.nn.functional.normalize(torch.randn(4, generator=gen, dtype=torch.float64), dim=0)
    return torch.tensor(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ],
        dtype=torch.float64,
    )


@dataclass
class Shape:
    """A primitive under x -> scale * R x + shift (scale in [0.6, 0.9], shift within 0.15 of 0)."""

    kind: str
    params: torch.Tensor  # (3,)
    rotation: torch.Tensor  # (3, 3)
    scale: float
    shift: torch.Tensor  # (3,)

    @staticmethod
    def random(gen: torch.Generator, kinds=PRIMITIVES) -> "Shape":
        kind = kinds[int(torch.randint(len(kinds), (1,), generator=gen))]
        params = 0.3 + 0.5 * torch.rand(3, generator=gen, dtype=torch.float64)
        scale = 0.6 + 0.3 * float(torch.rand(1, generator=gen, dtype=torch.float64))
        shift = 0.15 * (torch.rand(3, generator=gen, dtype=torch.float64) * 2 - 1)
        return Shape(kind, params, _rotation(gen), scale, shift)

    def sdf(self, x: torch.Tensor) -> torch.Tensor:
        """Signed distance at world points x (..., 3), float64; negative inside."""
        local = (x.double() - self.shift) @ self.rotation / self.scale
        return self.scale * primitive_sdf(self.kind, local, self.params)

    def gradient(self, x: torch.Tensor) -> torch.Tensor:
        x = x.double().detach().requires_grad_()
        (g,) = torch.autograd.grad(self.sdf(x).sum(), x)
        return g

    def sample_surface(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(points (n, 3), unit outward normals (n, 3)) on the surface, float64."""
        x = (torch.rand(8 * n, 3, generator=gen, dtype=torch.float64) * 2 - 1) * 1.2
        d = self.sdf(x)
        x = x[(d > -0.5) & (d < 0.02)]  # mostly inside: see the module docs
        x = x[:n] if x.shape[0] >= n else x[torch.randint(x.shape[0], (n,), generator=gen)]
        for _ in range(3):
            g = self.gradient(x)
            g = g / g.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            x = x - self.sdf(x)[:, None] * g
        normals = torch.nn.functional.normalize(self.gradient(x), dim=-1)
        return x, normals


def grid(resolution: int, extent: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """Regular grid points (resolution^3, 3) covering [-extent, extent]^3."""
    axis = torch.linspace(-extent, extent, resolution, dtype=dtype)
    return torch.cartesian_prod(axis, axis, axis)


def slice_grid(resolution: int, extent: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """Regular grid points (resolution^2, 3) on the z = 0 slice of [-extent, extent]^3 (x-major)."""
    axis = torch.linspace(-extent, extent, resolution, dtype=dtype)
    xy = torch.cartesian_prod(axis, axis)
    return torch.cat([xy, torch.zeros(xy.shape[0], 1, dtype=dtype)], 1)
