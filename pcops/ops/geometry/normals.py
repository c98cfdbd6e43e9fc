"""Surface normals of point clouds from the covariance of each point's k nearest neighbours.

The normal of point ``p_i`` is the eigenvector of the smallest eigenvalue of
``C_i = 1/k sum_{j in kNN(i)} (p_j - m_i)(p_j - m_i)^T`` with ``m_i`` the neighbourhood's mean
(the neighbourhood includes ``p_i`` itself), as Open3D's ``estimate_normals`` and PyTorch3D's
``estimate_pointcloud_normals`` compute it. The search is pcops' kNN search. When a gradient
to the points is asked for, the covariances and the batched 3x3 eigen-solve (closed form,
:func:`_eigh3`) are torch, so the normals are differentiable with respect to the points
wherever the smallest eigenvalue is simple. Otherwise one Warp kernel (``pcops::knn_normals``)
does all of it per point: it reads the point's neighbours' rows through the indices (no
(P, k, 3) gather), sums their covariance in registers, solves for the smallest eigenvector by
the same closed form, and orients it (docs/benchmarks.md, design choices).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp
from ..neighbours.nearest import plain_find, plain_warp, search


def _cross(a, b):
    return torch.linalg.cross(a, b, dim=-1)


def _unit_of_largest_cross(rows):
    """The normalised largest of the three pairwise cross products of rows (P, 3, 3): the null
    direction of a rank-2 matrix."""
    r0, r1, r2 = rows[:, 0], rows[:, 1], rows[:, 2]
    c = torch.stack([_cross(r0, r1), _cross(r0, r2), _cross(r1, r2)], 1)  # (P, 3, 3)
    n2 = c.square().sum(-1)  # (P, 3)
    best = n2.argmax(1)
    v = c.gather(1, best[:, None, None].expand(-1, 1, 3))[:, 0]
    d = n2.gather(1, best[:, None])
    axis = torch.zeros_like(v)
    axis[:, 0] = 1
    return torch.where(d > 0, v / torch.where(d > 0, d, 1).sqrt(), axis)  # rank <= 1 (rounding): any axis


def _eigh3(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending, (P, 3)) and unit eigenvectors (columns, (P, 3, 3)) of symmetric
    3x3 matrices in closed form, as ``torch.linalg.eigh`` returns them (faster on the CPU
    (docs/benchmarks.md, design choices)).

    D. Eberly, "A Robust Eigensolver for 3 x 3 Symmetric Matrices" (2014): the eigenvalues from
    the trigonometric solution of the characteristic cubic (after scaling and shifting), of
    which only the most separated one is kept (the largest when half the determinant of the
    shifted matrix is >= 0, else the smallest): its eigenvector is the largest cross product of
    two rows of A - l I; the other two eigenpairs are those of A restricted to the plane
    orthogonal to it, a 2x2 symmetric problem solved in closed form (so two small eigenvalues
    next to a large one, a strip-shaped neighbourhood, stay accurate)."""
    scale = a.abs().amax((-2, -1), keepdim=True)
    a = a / torch.where(scale > 0, scale, 1)
    a00, a01, a02 = a[:, 0, 0], a[:, 0, 1], a[:, 0, 2]
    a11, a12, a22 = a[:, 1, 1], a[:, 1, 2], a[:, 2, 2]
    q = (a00 + a11 + a22) / 3
    b00, b11, b22 = a00 - q, a11 - q, a22 - q
    p = ((b00.square() + b11.square() + b22.square() + 2 * (a01.square() + a02.square() + a12.square())) / 6).sqrt()
    # a numerically isotropic matrix (the scaled spread p within rounding of 0): eigenvalues q,
    # eigenvectors the axes (the cubic's coefficients would be rounding noise, even NaN)
    spread = p > 16 * torch.finfo(a.dtype).eps
    ps = torch.where(spread, p, 1)
    c00 = b11 * b22 - a12 * a12
    c01 = a01 * b22 - a12 * a02
    c02 = a01 * a12 - b11 * a02
    half_det = torch.where(spread, (b00 * c00 - a01 * c01 + a02 * c02) / (ps * ps * ps) / 2, 0).clamp(-1, 1)
    angle = torch.acos(half_det) / 3
    beta2 = 2 * torch.cos(angle)
    beta0 = 2 * torch.cos(angle + 2.0943951023931957)  # + 2 pi / 3 (a literal: no global inside autograd.Function under torch.compile)
    beta1 = -(beta0 + beta2)
    values = q[:, None] + torch.where(spread, p, 0)[:, None] * torch.stack([beta0, beta1, beta2], 1)  # ascending
    eye = torch.eye(3, dtype=a.dtype, device=a.device)
    # the most separated eigenvalue first: the largest if half_det >= 0, else the smallest
    first_is_max = half_det >= 0
    l_first = torch.where(first_is_max, values[:, 2], values[:, 0])
    w = _unit_of_largest_cross(a - l_first[:, None, None] * eye)  # its eigenvector
    # an orthonormal basis (u, v) of the plane orthogonal to w
    use0 = w[:, 0].abs() > w[:, 1].abs()
    inv0 = 1 / (w[:, 0].square() + w[:, 2].square()).clamp_min(torch.finfo(a.dtype).tiny).sqrt()
    inv1 = 1 / (w[:, 1].square() + w[:, 2].square()).clamp_min(torch.finfo(a.dtype).tiny).sqrt()
    zero = torch.zeros_like(w[:, 0])
    u = torch.where(use0[:, None], torch.stack([-w[:, 2] * inv0, zero, w[:, 0] * inv0], 1),
                    torch.stack([zero, w[:, 2] * inv1, -w[:, 1] * inv1], 1))
    v = _cross(w, u)
    au, av = (a @ u[..., None])[..., 0], (a @ v[..., None])[..., 0]
    # the other two eigenpairs: those of A restricted to that plane, [[m00, m01], [m01, m11]] in
    # the basis (u, v), in closed form (no use of the cubic's less accurate other roots)
    m00, m01, m11 = (u * au).sum(-1), (u * av).sum(-1), (v * av).sum(-1)
    mean, radius = (m00 + m11) / 2, torch.hypot((m00 - m11) / 2, m01)
    theta = torch.atan2(2 * m01, m00 - m11) / 2  # the larger one's direction from u
    cos, sin = torch.cos(theta)[:, None], torch.sin(theta)[:, None]
    big, small = cos * u + sin * v, cos * v - sin * u
    l_first = l_first[:, None]
    pair = torch.stack([mean - radius, mean + radius], 1)
    values = torch.where(first_is_max[:, None], torch.cat([pair, l_first], 1), torch.cat([l_first, pair], 1))
    values = torch.where(spread[:, None], values, q[:, None].expand(-1, 3))
    vectors = torch.where(first_is_max[:, None, None], torch.stack([small, big, w], -1), torch.stack([w, small, big], -1))
    vectors = torch.where(spread[:, None, None], vectors, eye)
    return values * scale[:, 0], vectors


@_warp.kernels
def _kernel(dtype: torch.dtype, oriented: bool):
    """The normal of each point from its neighbour indices, in one thread per point: the
    covariance (two passes over the rows: the mean, then the centred products), the eigenvector
    of its smallest eigenvalue by :func:`_eigh3`'s closed form (only the branch that yields it),
    and the sign (towards the point's viewpoint when ``oriented``, else the largest-magnitude
    component positive). Indices < 0 are absent neighbours (a sample smaller than k); a point
    with none (padding) gets a zero normal. The covariance is of the neighbours' coordinates
    times ``scale[0]`` (a power of two: :func:`_unit_scale`); the sign of the points as given."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    isotropic = s(16.0 * torch.finfo(dtype).eps)  # as _eigh3: a scaled spread p below this
    sqrt3 = s(math.sqrt(3.0))

    @wp.func(module="unique")
    def unit_of_largest_cross(r0: v, r1: v, r2: v):
        """_unit_of_largest_cross: the null direction of a rank-2 symmetric matrix from its rows."""
        best = wp.cross(r0, r1)
        d = wp.dot(best, best)
        c = wp.cross(r0, r2)
        n = wp.dot(c, c)
        if n > d:
            best = c
            d = n
        c = wp.cross(r1, r2)
        n = wp.dot(c, c)
        if n > d:
            best = c
            d = n
        if d > s(0.0):
            return best / wp.sqrt(d)
        return v(s(1.0), s(0.0), s(0.0))  # rank <= 1 (rounding): any axis

    @wp.func(module="unique")
    def smallest_eigenvector(a00: s, a01: s, a02: s, a11: s, a12: s, a22: s):
        """The unit eigenvector of the smallest eigenvalue of a symmetric 3x3 matrix, as
        ``_eigh3(a)[1][:, :, 0]`` computes it."""
        scale = wp.max(wp.max(wp.max(wp.abs(a00), wp.abs(a01)), wp.max(wp.abs(a02), wp.abs(a11))), wp.max(wp.abs(a12), wp.abs(a22)))
        if scale > s(0.0):
            a00 = a00 / scale
            a01 = a01 / scale
            a02 = a02 / scale
            a11 = a11 / scale
            a12 = a12 / scale
            a22 = a22 / scale
        q = (a00 + a11 + a22) / s(3.0)
        b00 = a00 - q
        b11 = a11 - q
        b22 = a22 - q
        p = wp.sqrt((b00 * b00 + b11 * b11 + b22 * b22 + s(2.0) * (a01 * a01 + a02 * a02 + a12 * a12)) / s(6.0))
        if not (p > isotropic):  # numerically isotropic: the first axis, as eigh's identity
            return v(s(1.0), s(0.0), s(0.0))
        c00 = b11 * b22 - a12 * a12
        c01 = a01 * b22 - a12 * a02
        c02 = a01 * a12 - b11 * a02
        half_det = wp.clamp((b00 * c00 - a01 * c01 + a02 * c02) / (p * p * p) / s(2.0), s(-1.0), s(1.0))
        angle = wp.acos(half_det) / s(3.0)
        r0 = v(a00, a01, a02)
        r1 = v(a01, a11, a12)
        r2 = v(a02, a12, a22)
        if half_det < s(0.0):  # the smallest eigenvalue is the most separated: its null vector
            low = q + p * (-wp.cos(angle) - sqrt3 * wp.sin(angle))  # q + 2 p cos(angle + 2 pi / 3)
            return unit_of_largest_cross(r0 - v(low, s(0.0), s(0.0)), r1 - v(s(0.0), low, s(0.0)), r2 - v(s(0.0), s(0.0), low))
        # the largest is: its eigenvector w, then the 2x2 problem in the plane orthogonal to it
        high = q + s(2.0) * p * wp.cos(angle)
        w = unit_of_largest_cross(r0 - v(high, s(0.0), s(0.0)), r1 - v(s(0.0), high, s(0.0)), r2 - v(s(0.0), s(0.0), high))
        u = v(s(0.0), s(0.0), s(0.0))
        if wp.abs(w[0]) > wp.abs(w[1]):
            inv = s(1.0) / wp.sqrt(w[0] * w[0] + w[2] * w[2])
            u = v(-w[2] * inv, s(0.0), w[0] * inv)
        else:
            inv = s(1.0) / wp.sqrt(w[1] * w[1] + w[2] * w[2])
            u = v(s(0.0), w[2] * inv, -w[1] * inv)
        t = wp.cross(w, u)
        au = v(wp.dot(r0, u), wp.dot(r1, u), wp.dot(r2, u))
        at = v(wp.dot(r0, t), wp.dot(r1, t), wp.dot(r2, t))
        theta = wp.atan2(s(2.0) * wp.dot(u, at), wp.dot(u, au) - wp.dot(t, at)) / s(2.0)  # the larger one's direction from u
        return wp.cos(theta) * t - wp.sin(theta) * u

    @wp.kernel(enable_backward=False, module="unique")
    def normals(
        start: int,
        points: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
        scale: wp.array(dtype=s),
        view: wp.array2d(dtype=s),
        view_stride: int,
        out: wp.array2d(dtype=s),
    ):
        i = wp.tid() + start
        k = idx.shape[1]
        unit = scale[0]
        total = v(s(0.0), s(0.0), s(0.0))
        count = int(0)
        for j in range(k):
            r = idx[i, j]
            if r >= wp.int64(0):
                total = total + v(points[r, 0] * unit, points[r, 1] * unit, points[r, 2] * unit)
                count = count + 1
        if count == 0:  # padding
            out[i, 0] = s(0.0)
            out[i, 1] = s(0.0)
            out[i, 2] = s(0.0)
            return
        mean = total / s(float(count))
        c00 = s(0.0)
        c01 = s(0.0)
        c02 = s(0.0)
        c11 = s(0.0)
        c12 = s(0.0)
        c22 = s(0.0)
        for j in range(k):
            r = idx[i, j]
            if r >= wp.int64(0):
                d = v(points[r, 0] * unit, points[r, 1] * unit, points[r, 2] * unit) - mean
                c00 = c00 + d[0] * d[0]
                c01 = c01 + d[0] * d[1]
                c02 = c02 + d[0] * d[2]
                c11 = c11 + d[1] * d[1]
                c12 = c12 + d[1] * d[2]
                c22 = c22 + d[2] * d[2]
        n = smallest_eigenvector(c00, c01, c02, c11, c12, c22)  # of the sum: 1/count does not change it
        towards = s(0.0)
        if wp.static(oriented):
            o = i * view_stride
            towards = wp.dot(n, v(view[o, 0] - points[i, 0], view[o, 1] - points[i, 1], view[o, 2] - points[i, 2]))
        else:  # the largest-magnitude component (the first of equal ones) positive
            towards = n[0]
            if wp.abs(n[1]) > wp.abs(towards):
                towards = n[1]
            if wp.abs(n[2]) > wp.abs(towards):
                towards = n[2]
        if towards < s(0.0):
            n = -n
        out[i, 0] = n[0]
        out[i, 1] = n[1]
        out[i, 2] = n[2]

    return normals


_GROUPS = (("points", "idx", "out"),)  # (the lengths a call sets: its points': pcops._warp.ranged)


def _normals_of(points: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor, view: Optional[torch.Tensor]) -> torch.Tensor:
    """The implementation of pcops::knn_normals (:func:`_knn_normals`, the op; plain calls run it
    directly): points (P, 3) float32/float64, idx (P, k) int64 rows of ``points`` (-1: absent), scale (1,)
    of their dtype (the covariances' factor, :func:`_unit_scale`), view None (the sign rule), (1, 3)
    or (P, 3) viewpoints -> unit normals (P, 3) (zeros where a row has no neighbour), no gradient."""
    out = torch.empty_like(points)
    if points.shape[0] == 0:
        return out
    _warp.init()
    points, idx, scale = points.contiguous(), idx.contiguous(), scale.contiguous()
    oriented = view is not None
    if not oriented and points.is_cpu:  # the calling thread's packed launch of clouds cut into as many chunks
        kernel, args = _kernel(points.dtype, False), [points, idx, scale, points[:1], 0, out]
        key = ("normals", points.dtype, idx.shape[1], *out.stride())  # (out has the strides of the caller's points)
        launch = _warp.ranged(key, lambda: _warp.prepare(kernel, points.shape[0], args, None, 256), _GROUPS, (points.shape[0],), points.shape[0], None, 256)
        if launch is not None:
            launch.run(points=points, idx=idx, scale=scale, view=points, out=out)
            return out
    view = view.contiguous() if oriented else points[:1]
    stride = int(view.shape[0] > 1)
    _warp.launch(_kernel(points.dtype, oriented), points.shape[0], [points, idx, scale, view, stride, out], like=points, min_chunk=256)
    return out


_knn_normals = _threads.custom_op("pcops::knn_normals", _normals_of, mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))


@_knn_normals.register_fake
def _(points, idx, scale, view):
    return torch.empty_like(points)


def _unit_scale(points: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(1,): 2^-e, 2^e the power of two of the largest finite absolute coordinate of ``points``
    (of a float dtype; ``rows``: a mask of the rows that count, None: all; NaN and inf do not
    count), where e lies beyond 1/8 of the dtype's largest exponent either way (:func:`_limits`),
    else 1 (and 1 where none counts). Normals are invariant to the cloud's scale; the search's squared distances and the
    covariances are not, and leave the dtype's range only at scales where this is not 1: the
    points times it give the same normals, bit for bit, wherever those squares stay in range (a
    power of two changes no bit of them). (:func:`_plain_scale`: the same rule on the host.)"""
    if points.numel() == 0:
        return points.new_ones(1)
    points = points.detach()
    keep = torch.isfinite(points) if rows is None else torch.isfinite(points) & rows[:, None]
    big = torch.linalg.vector_norm(torch.where(keep, points, 0), float("inf")).reshape(1)
    e = torch.frexp(big)[1] - 1  # big = m 2^e, 1 <= m < 2 (0: e = -1)
    near, top = _limits(points.dtype)
    return torch.where(e.abs() > near, torch.pow(2.0, -e.clamp(1 - top, top).to(points.dtype)), 1.0).to(points.dtype)


def _plain_scale(big: float, dtype: torch.dtype) -> Optional[float]:
    """:func:`_unit_scale` of a plain call's points as a Python float, from their largest finite
    absolute coordinate ``big`` (read on the host); None where it is 1."""
    e = math.frexp(big)[1] - 1
    near, top = _limits(dtype)
    return 2.0 ** -min(max(e, 1 - top), top) if abs(e) > near else None


def _limits(dtype: torch.dtype) -> tuple[int, int]:
    """(the exponents within which :func:`_unit_scale` is 1, the dtype's largest exponent):
    float32 (15, 127), float64 (127, 1023)."""
    top = math.frexp(torch.finfo(dtype).max)[1] - 1
    return top // 8, top


class _SmallestEigenvector(torch.autograd.Function):
    """Unit eigenvector of the smallest eigenvalue of symmetric 3x3 matrices (P, 3, 3) -> (P, 3).

    The backward uses only the gaps to the smallest eigenvalue, ``dv0 = sum_{i>0} v_i v_i^T dC
    v0 / (l0 - l_i)``, so equal larger eigenvalues (a disc-shaped neighbourhood on a regular
    grid) give finite gradients, where differentiating the full ``eigh`` gives NaN; a row that
    receives no gradient passes none on, whatever its eigenvalues.
    """

    @staticmethod
    def forward(cov):
        values, vectors = _eigh3(cov)
        return vectors[..., 0].contiguous(), values, vectors  # (a copy: forward mode's tangent of a view output must be laid out as it)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, values, vectors = output
        ctx.save_for_backward(values, vectors)
        ctx.save_for_forward(values, vectors)  # (for _ForwardModeEigenvector's jvp)
        ctx.mark_non_differentiable(values, vectors)

    @staticmethod
    def backward(ctx, grad, _values, _vectors):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
            raise RuntimeError(
                "pcops.estimate_normals does not support gradients of gradients (its eigenvector backward treats the "
                "eigen-decomposition as constant): take first gradients only (create_graph=False)"
            )
        values, vectors = ctx.saved_tensors
        v0, rest = vectors[..., 0], vectors[..., 1:]  # (P, 3), (P, 3, 2)
        gap = values[..., :1] - values[..., 1:]  # (P, 2), < 0
        along = torch.einsum("pc,pci->pi", grad, rest)
        # (g . v_i) / (l0 - l_i); no gradient in, none out (padding rows have all-zero
        # covariances); an exactly repeated eigenvalue (a point repeated k times: a zero
        # covariance, any direction its eigenvector) gives none either, not inf * 0 = NaN
        none = (along == 0) | (gap == 0)
        coeff = torch.where(none, 0, along / torch.where(none, 1, gap))
        g = torch.einsum("pi,pci,pd->pcd", coeff, rest, v0)
        return 0.5 * (g + g.transpose(-1, -2))


class _ForwardModeEigenvector(_SmallestEigenvector):
    """:class:`_SmallestEigenvector` with forward mode (torch.func.jvp, jacfwd, forward_ad), for
    eager calls only: torch.compile does not trace an autograd.Function that defines ``jvp``."""

    generate_vmap_rule = True  # (jacfwd vmaps the jvp over the tangents)

    @staticmethod
    def jvp(ctx, dcov):
        """The backward's first-order rule forwards: ``dv0 = sum_{i>0} v_i (v_i^T dC v0) / (l0 - l_i)``."""
        values, vectors = ctx.saved_tensors
        v0, rest = vectors[..., 0], vectors[..., 1:]
        gap = values[..., :1] - values[..., 1:]
        along = torch.einsum("pci,pcd,pd->pi", rest, 0.5 * (dcov + dcov.transpose(-1, -2)), v0)
        none = (along == 0) | (gap == 0)
        coeff = torch.where(none, 0, along / torch.where(none, 1, gap))
        return torch.einsum("pi,pci->pc", coeff, rest), None, None


_ONE = {dtype: torch.ones(1, dtype=dtype) for dtype in (torch.float32, torch.float64)}  # (never written)
# Whether plain eager calls take the direct path (:func:`_plain_normals`; tests switch it off to compare both paths)
PLAIN = [True]


def _plain_normals(points, k, backend: str, validate: bool) -> Optional[torch.Tensor]:
    """The normals of a plain eager CPU :func:`estimate_normals` call without ``orient_to``, or
    None for any other call: a plain kNN search of the cloud (times :func:`_unit_scale`) in itself
    (:func:`pcops.ops.neighbours.nearest.plain_warp`: one (P, 3) CPU cloud, float32 or float64,
    nothing to differentiate, k an int in 1..P; its largest absolute value, read once, is finite
    where ``validate`` asks and sets the scale), then
    the normals kernel called directly (not through the op): the general path's search and
    kernel on the same values, so the same normals."""
    if not plain_warp(points, points, k, backend, False):  # (the values are checked here)
        return None
    big = float(torch.linalg.vector_norm(points, float("inf")))  # one host read: NaN or inf if any value is
    if not math.isfinite(big):
        if validate:
            return None  # (the general path names what fails)
        big = float(torch.linalg.vector_norm(torch.where(torch.isfinite(points), points, 0), float("inf")))  # the largest finite one
    scale = _plain_scale(big, points.dtype)
    scaled = points if scale is None else points * scale
    rows = plain_find(scaled, scaled, k)[1]
    if not validate:  # (as the general search: -1, none found (NaN points), as row 0; finite points' unit-scaled rows are complete)
        rows = rows.clamp_min(0)
    return _normals_of(points, rows, _ONE[points.dtype] if scale is None else points.new_full((1,), scale), None)


@_threads.limits
def estimate_normals(
    points: torch.Tensor,
    k: int,
    *,
    lengths: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
    orient_to: Optional[torch.Tensor] = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Unit normals from the smallest eigenvector of each point's kNN covariance.

    Args:
        points: Tensor of shape (P, 3); (B, P, 3) padded; or (P_total, 3) packed.
        k: neighbourhood size including the point itself, 1 <= k <= P (3 or more for a
            meaningful normal; a point whose sample holds fewer uses the points it has).
        lengths: optional int tensor (B,) for padded points (rows past a length are padding).
        batch: int sample ids (P_total,) of packed points.
        orient_to: optional viewpoint, Tensor of shape (3,) or, for batches, (B, 3) (one per
            sample): each normal is flipped to point towards it, ``n . (o - p) >= 0``.
            Without it, the sign is arbitrary but fixed: the largest-magnitude component of
            each normal is positive.
        backend: kNN search backend, as for :func:`pcops.knn`.
        validate: check points and ``orient_to`` for NaN/inf and lengths/ids for range
            (one host read).

    Returns:
        Tensor of the shape of ``points``: unit normals in the dtype of the points
        (float16/bfloat16 computed in float32); zeros for padding rows. Differentiable with
        respect to ``points`` where the smallest covariance eigenvalue is simple; where it is
        not (a point repeated k times, a zero covariance), the normal passes no gradient on.
        Without a gradient asked for, one Warp kernel computes the same normals (to rounding).

    Example:
        >>> import torch, pcops
        >>> grid = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(-1, 2)
        >>> plane = torch.cat([grid, torch.zeros(16, 1)], 1)  # 16 points of the plane z = 0
        >>> normals = pcops.estimate_normals(plane, k=6, orient_to=torch.tensor([0.0, 0.0, 1.0]))
        >>> normals[:2].round(decimals=4) + 0.0  # unit normals, towards orient_to
        tensor([[0., 0., 1.],
                [0., 0., 1.]])
    """
    if PLAIN[0] and orient_to is None and lengths is None and batch is None:
        normals = _plain_normals(points, k, backend, validate)
        if normals is not None:
            return normals
    _validate.tensor("points", points)
    if orient_to is not None:
        _check_viewpoints(orient_to, points, batch)
    per_sample = orient_to is not None and orient_to.dim() == 2 and points.dim() == 2  # packed ids index orient_to
    flat = _layout.single(points, lengths=lengths, batch=batch, validate=validate,
                         finite=None if orient_to is None else dict(orient_to=orient_to),
                         ranges=dict(batch=(batch, 0, orient_to.shape[0] - 1)) if per_sample else None)
    k = _validate.count("k", k, points.shape[-2], "points")
    dtype, out_dtype = _validate.compute_dtype(points)
    # the search and the covariances of the points times a power of two (the same normals where
    # their squares stay in range: _unit_scale); the signs of the points as given
    padding = flat.batch_shape and flat.ref_group is not None  # (padded rows past a length: group B + 1)
    points_in = flat.ref.to(dtype)  # (converted once: half points)
    scale = _unit_scale(points_in, flat.ref_group < flat.batch_shape[0] if padding else None)
    ref = points_in * scale
    idx, valid = search(flat._replace(query=ref, ref=ref), k, backend, dtype)
    if not _threads.differentiable(points):  # one kernel, nothing to differentiate
        if flat.query_group is not None:
            idx = torch.where(valid, idx, -1)
        view = None
        if orient_to is not None:  # the sign passes no gradient on
            view = orient_to.detach().to(dtype)[None] if orient_to.dim() == 1 else _viewpoints(orient_to.detach(), batch, flat, dtype)
        normals = _knn_normals(points_in.detach(), idx, scale, view)
        return _layout.unflatten(flat, normals.to(out_dtype))

    neighbours = _layout.select_rows(ref, idx)  # (P, k, 3)
    if flat.query_group is None:  # one cloud: all k neighbours exist
        centred = neighbours - neighbours.mean(1, keepdim=True)
        cov = centred.transpose(1, 2) @ centred / k
    else:  # a sample with fewer than k points: only its valid neighbours count
        w = valid.to(dtype)[..., None]  # (P, k, 1)
        count = w.sum(1, keepdim=True).clamp_min(1)  # (P, 1, 1)
        centred = (neighbours - (w * neighbours).sum(1, keepdim=True) / count) * w
        cov = centred.transpose(1, 2) @ centred / count
    eigen = _ForwardModeEigenvector if _threads.differentiable() else _SmallestEigenvector  # forward mode: eager only
    normals, _, _ = eigen.apply(cov)

    direction = normals.detach()
    if orient_to is not None:
        towards = (direction * (_viewpoints(orient_to, batch, flat, dtype) - flat.query.to(dtype))).sum(-1, keepdim=True)
    else:  # the largest-magnitude component positive
        towards = direction.gather(-1, direction.abs().argmax(-1, keepdim=True))
    normals = torch.where(towards < 0, -normals, normals)
    if flat.query_group is not None:
        normals = torch.where(valid[:, :1], normals, 0)  # padding rows: zeros
    return _layout.unflatten(flat, normals.to(out_dtype))


def _check_viewpoints(orient_to, points, batch) -> None:
    """``orient_to`` is one viewpoint (3,), or one per sample (B, 3) of batched points."""
    _validate.tensor("orient_to", orient_to, ndim=(1, 2), last=3, shape_doc="(3,) or (B, 3)")
    _validate.same_device(points=points, orient_to=orient_to)
    if orient_to.dim() == 1:
        return
    if points.dim() == 3:
        _validate.same_size("orient_to", orient_to.shape[0], "points", points.shape[0], "batch size B")
    elif batch is None:
        raise ValueError(f"orient_to of shape {tuple(orient_to.shape)} needs batched points; a single cloud takes shape (3,)")


def _viewpoints(orient_to, batch, flat: _layout.Flat, dtype) -> torch.Tensor:
    """The viewpoint of every flat point: (P, 3) (``orient_to`` checked by :func:`_check_viewpoints`)."""
    o = orient_to.to(dtype)
    if o.shape == (3,):
        return o.expand(flat.query.shape[0], 3)
    if flat.batch_shape:  # padded (B, P, 3)
        return o[:, None, :].expand(*flat.batch_shape, 3).reshape(-1, 3)
    return o[batch.long()]


__all__ = ["estimate_normals"]
