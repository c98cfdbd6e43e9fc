"""The closest point of a triangle to a point (:func:`closest`): in torch, differentiable to any
order, where a gradient is to be kept; else the same formula in one Warp kernel (the custom op
``pcops::triangle_closest``), one launch instead of some 60 torch operations. :func:`measure`
is that kernel with the triangles gathered from a mesh by face row and the distance of
``mesh_distance`` (the custom op ``pcops::mesh_measure``).

The same cases as the kernels' squared distance (:func:`._search._funcs`): the interior when
the point projects inside a triangle that is not flat (height above ``FLAT`` eps of its longest
edge), else the nearest of the three edges (the first of equal ones: ab, bc, ca). Flat and
degenerate triangles (zero area, repeated corners) are measured by their edges, exactly.
Every division has a safe denominator, so the branches not taken carry no NaN into gradients.
"""

from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _threads, _warp, _warp_funcs
from ._search import FLAT


# the dtype of a face's plane (normal, inside test, height) in the torch formulas, as in the
# kernels: float64, where the differences of float32 coordinates are exact
PLANE = torch.float64


class Closest(NamedTuple):
    point: torch.Tensor  # (..., 3)
    bary: torch.Tensor  # (..., 3) weights of a, b, c
    normal: Optional[torch.Tensor] = None  # (..., 3) (b - a) x (c - a) in PLANE dtype (the torch formula's; None from the kernel)


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
    differentiable where a derivative may be asked for (:func:`pcops._threads.differentiable`), else from one kernel."""
    if not _threads.differentiable(p, a, b, c) and p.dim() == 2:
        return Closest(*_triangle_closest(*(t.detach().contiguous() for t in (p, a, b, c))))
    return _closest_torch(p, a, b, c)


def plane_normal(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, exact: bool) -> torch.Tensor:
    """(b - a) x (c - a) of float64 corners (..., 3), differentiable; ``exact`` (float64 corners):
    its value from the exact differences and products (the kernels' formula,
    :func:`pcops._warp_funcs.plane_normal`, in one launch: ``pcops::plane_normals``), its
    derivatives the plain formula's. A thin float64 face's plain normal is off by about eps over
    its height over its longest edge."""
    n = torch.linalg.cross(b - a, c - a)
    if not exact:
        return n
    a, b, c = (t.detach().expand(n.shape).reshape(-1, 3).contiguous() for t in (a, b, c))
    fixed = _plane_normals(a, b, c).view(n.shape)
    return torch.where(torch.isfinite(fixed), fixed + (n - n.detach()), n)  # the value fixed, the plain derivatives


@_warp.kernels
def _normal_kernel(dtype: torch.dtype):
    """:func:`pcops._warp_funcs.plane_normal` of float64 triangles, one thread each."""
    normal = _warp_funcs.plane_normal(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def normals(start: int, a: wp.array(dtype=wp.vec3d), b: wp.array(dtype=wp.vec3d), c: wp.array(dtype=wp.vec3d),
                out: wp.array(dtype=wp.vec3d)):
        i = wp.tid() + start
        out[i] = normal(a[i], b[i], c[i])

    return normals


@_threads.custom_op("pcops::plane_normals", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _plane_normals(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float64 triangles' corners a, b, c (M, 3) -> their normals (b - a) x (c - a) (M, 3), from the
    exact differences and products (:func:`pcops._warp_funcs.plane_normal`)."""
    out = torch.empty_like(a)
    if a.shape[0]:
        _warp.init()
        _warp.launch(_normal_kernel(torch.float64), a.shape[0], [a, b, c, out], like=a)
    return out


@_plane_normals.register_fake
def _(a, b, c):
    return torch.empty_like(a)


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
    # the plane in float64 (float32 coordinates' differences exact there; float64 corners' normal
    # from exact differences and products): a thin face's normal computed in its own precision
    # is off by about eps over its shape factor (see _search._funcs)
    exact = a.dtype == torch.float64 and b.dtype == torch.float64 and c.dtype == torch.float64
    p_, a, b, c = (t.to(PLANE) for t in (p, a, b, c))
    n = plane_normal(a, b, c, exact)
    nn = _dot(n, n)
    longest = torch.maximum(torch.maximum(_dot(b - a, b - a), _dot(c - b, c - b)), _dot(a - c, a - c))
    solid = nn > (FLAT * eps) ** 2 * longest * longest
    safe = torch.where(solid, nn, 1.0)
    # twice the signed areas of p's projection with each edge, n . ((corner - p) x (next - p)),
    # as (p - corner) . (n x edge): only p - corner rounds with p's distance (for a far point
    # the cross product of two offsets would round by its square over the edge)
    u = _dot(p_ - b, torch.linalg.cross(n, c - b))
    v = _dot(p_ - c, torch.linalg.cross(n, a - c))
    w = _dot(p_ - a, torch.linalg.cross(n, b - a))
    inside = solid & (u >= 0) & (v >= 0) & (w >= 0)
    weights = (torch.stack([u, v, w], -1) / safe[..., None]).to(p.dtype)
    plane = (p_ + (_dot(n, a - p_) / safe)[..., None] * n).to(p.dtype)  # p's projection onto the plane
    return Closest(torch.where(inside[..., None], plane, point), torch.where(inside[..., None], weights, bary), n)


@_warp.kernels
def _closest_kernel(dtype: torch.dtype, result: bool):
    """:func:`_closest_torch`'s formula, one thread per point: the nearest edge point (the first of
    equal ones), replaced by the plane's point where p projects inside a triangle that is not flat.
    ``result``: the kernel of :func:`measure` instead (the triangle of each point gathered from a
    mesh by its face row, and the distance too)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    flat2 = wp.float64((FLAT * torch.finfo(dtype).eps) ** 2)
    tiny = wp.float64(torch.finfo(torch.float64).tiny)
    plane_normal = _warp_funcs.plane_normal(dtype)

    @wp.func(module="unique")
    def segment(p: v, x: v, y: v):
        xy = y - x
        length2 = wp.dot(xy, xy)
        t = s(0.0)
        if length2 > s(0.0):
            t = wp.clamp(wp.dot(p - x, xy) / length2, s(0.0), s(1.0))
        return t

    @wp.func(module="unique")
    def nearest(p: v, pa_: v, pb_: v, pc_: v):
        """(the closest point of triangle abc to p, its barycentric weights, the normal b - a x c - a)."""
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
        # the plane in float64 (as the search's, see _search._funcs): exact differences of float32
        # coordinates, float64 ones' normal from exact differences and products (plane_normal)
        pw, aw, bw, cw = wp.vec3d(p), wp.vec3d(pa_), wp.vec3d(pb_), wp.vec3d(pc_)
        ab, bc, ca = bw - aw, cw - bw, aw - cw
        n = plane_normal(aw, bw, cw)
        nn = wp.dot(n, n)
        longest = wp.max(wp.max(wp.dot(ab, ab), wp.dot(bc, bc)), wp.dot(ca, ca))
        if nn > flat2 * longest * longest:  # (the signed areas as in _closest_torch)
            u, vv, ww = wp.dot(pw - bw, wp.cross(n, bc)), wp.dot(pw - cw, wp.cross(n, ca)), wp.dot(pw - aw, wp.cross(n, ab))
            zero = wp.float64(0.0)
            if u >= zero and vv >= zero and ww >= zero:
                near = v(pw + (wp.dot(n, aw - pw) / nn) * n)
                w = v(wp.vec3d(u, vv, ww) / nn)
        return near, w, n

    if not result:

        @wp.kernel(enable_backward=False, module="unique")
        def closest(start: int, points: wp.array(dtype=v), a: wp.array(dtype=v), b: wp.array(dtype=v), c: wp.array(dtype=v),
                    point: wp.array(dtype=v), bary: wp.array(dtype=v)):
            i = wp.tid() + start
            near, w, _ = nearest(points[i], a[i], b[i], c[i])
            point[i] = near
            bary[i] = w

        return closest

    @wp.kernel(enable_backward=False, module="unique")
    def measure(start: int, points: wp.array(dtype=v), vertices: wp.array(dtype=v), faces: wp.array2d(dtype=wp.int64),
                face: wp.array(dtype=wp.int64), dists: wp.array(dtype=s), point: wp.array(dtype=v), bary: wp.array(dtype=v)):
        i = wp.tid() + start
        f = face[i]
        if f < wp.int64(0):
            nan = s(wp.nan)
            dists[i] = s(wp.inf)
            point[i] = v(nan, nan, nan)
            bary[i] = v(nan, nan, nan)
            return
        p = points[i]
        a, b, c = vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])]
        near, w, n = nearest(p, a, b, c)
        n = n / wp.max(wp.length(n), tiny)
        diff = p - near
        d = wp.length(diff)
        if diff[0] == s(0.0) and diff[1] == s(0.0) and diff[2] == s(0.0):  # on the surface: along the normal
            d = s(wp.dot(wp.vec3d(diff), n))
        elif w[0] > s(0.0) and w[1] > s(0.0) and w[2] > s(0.0):  # inside the face: the height over its plane
            d = s(wp.abs(wp.dot(wp.vec3d(p) - wp.vec3d(a), n)))
        dists[i] = d
        point[i] = near
        bary[i] = w

    return measure


@_threads.custom_op("pcops::triangle_closest", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _triangle_closest(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """points p and triangles abc (M, 3) -> (closest points (M, 3), barycentric weights (M, 3))."""
    point, bary = torch.empty_like(p), torch.empty_like(p)
    if p.shape[0]:
        _warp.init()
        _warp.launch(_closest_kernel(p.dtype, False), p.shape[0], [p, a, b, c, point, bary], like=p)
    return point, bary


@_triangle_closest.register_fake
def _(p, a, b, c):
    return torch.empty_like(p), torch.empty_like(p)


@_threads.custom_op("pcops::mesh_measure", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_measure(p: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor, face: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """points p (M, 3), a mesh's vertices (V, 3) and faces (F, 3) int64, each point's face row
    (M,) int64 (-1: none) -> (distances (M,) (inf for none), closest points (M, 3), barycentric
    weights (M, 3) (NaN for none))."""
    dists, point, bary = p.new_empty(p.shape[0]), torch.empty_like(p), torch.empty_like(p)
    if p.shape[0]:
        _warp.init()
        _warp.launch(_closest_kernel(p.dtype, True), p.shape[0], [p, vertices, faces, face, dists, point, bary], like=p, kept=True)
    return dists, point, bary


@_mesh_measure.register_fake
def _(p, vertices, faces, face):
    return p.new_empty(p.shape[0]), torch.empty_like(p), torch.empty_like(p)


def measure(p: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor, face: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Without gradients: (the distance, closest point and weights of each point p (M, 3) to
    the face ``face`` (M,) of the mesh (``vertices``, ``faces``); inf, NaN and NaN where face is
    -1), as ``mesh_distance`` computes them in torch (:func:`closest`, the height over the plane
    inside a face, the normal's component on the surface), in one kernel."""
    return _mesh_measure(p.detach().contiguous(), vertices.detach().contiguous(), faces.contiguous(), face.contiguous())
