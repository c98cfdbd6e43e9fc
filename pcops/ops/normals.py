"""Surface normals of point clouds from the covariance of each point's k nearest neighbours.

The normal of point ``p_i`` is the eigenvector of the smallest eigenvalue of
``C_i = 1/k sum_{j in kNN(i)} (p_j - m_i)(p_j - m_i)^T`` with ``m_i`` the neighbourhood's mean
(the neighbourhood includes ``p_i`` itself), as Open3D's ``estimate_normals`` and PyTorch3D's
``estimate_pointcloud_normals`` compute it. The search is pcops' kNN search; the covariances
and the batched 3x3 eigen-solve (closed form, :func:`_eigh3`) are torch, so the normals are
differentiable with respect to the points wherever the smallest eigenvalue is simple.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _batch, _validate
from .nearest import search


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
    3x3 matrices in closed form, as ``torch.linalg.eigh`` returns them (2.4x faster on the CPU, 20,000 matrices).

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
        return vectors[..., 0], values, vectors

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, values, vectors = output
        ctx.save_for_backward(values, vectors)
        ctx.mark_non_differentiable(values, vectors)

    @staticmethod
    def backward(ctx, grad, _values, _vectors):
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
    """
    _validate.tensor("points", points)
    if orient_to is not None:
        _check_viewpoints(orient_to, points, batch)
    per_sample = orient_to is not None and orient_to.dim() == 2 and points.dim() == 2  # packed ids index orient_to
    flat = _batch.single(points, lengths=lengths, batch=batch, validate=validate,
                         finite=None if orient_to is None else dict(orient_to=orient_to),
                         ranges=dict(batch=(batch, 0, orient_to.shape[0] - 1)) if per_sample else None)
    k = _validate.count("k", k, points.shape[-2], "points")
    dtype, out_dtype = _validate.compute_dtype(points)
    idx, valid = search(flat, k, backend, dtype)

    neighbours = _batch.rows(flat.ref.to(dtype), idx)  # (P, k, 3)
    if flat.query_group is None:  # one cloud: all k neighbours exist
        centred = neighbours - neighbours.mean(1, keepdim=True)
        cov = centred.transpose(1, 2) @ centred / k
    else:  # a sample with fewer than k points: only its valid neighbours count
        w = valid.to(dtype)[..., None]  # (P, k, 1)
        count = w.sum(1, keepdim=True).clamp_min(1)  # (P, 1, 1)
        centred = (neighbours - (w * neighbours).sum(1, keepdim=True) / count) * w
        cov = centred.transpose(1, 2) @ centred / count
    normals, _, _ = _SmallestEigenvector.apply(cov)

    direction = normals.detach()
    if orient_to is not None:
        towards = (direction * (_viewpoints(orient_to, batch, flat, dtype) - flat.query.to(dtype))).sum(-1, keepdim=True)
    else:  # the largest-magnitude component positive
        towards = direction.gather(-1, direction.abs().argmax(-1, keepdim=True))
    normals = torch.where(towards < 0, -normals, normals)
    if flat.query_group is not None:
        normals = torch.where(valid[:, :1], normals, 0)  # padding rows: zeros
    return _batch.unflatten(flat, normals.to(out_dtype))


def _check_viewpoints(orient_to, points, batch) -> None:
    """``orient_to`` is one viewpoint (3,), or one per sample (B, 3) of batched points."""
    _validate.tensor("orient_to", orient_to)
    _validate.same_device(points=points, orient_to=orient_to)
    if orient_to.shape == (3,):
        return
    if orient_to.dim() != 2 or orient_to.shape[1] != 3:
        raise ValueError(f"orient_to must be a tensor of shape (3,) or (B, 3), got shape {tuple(orient_to.shape)}")
    if points.dim() == 3:
        if orient_to.shape[0] != points.shape[0]:
            raise ValueError(f"orient_to must have one row per sample: got {orient_to.shape[0]} rows for B={points.shape[0]}")
    elif batch is None:
        raise ValueError(f"orient_to of shape {tuple(orient_to.shape)} needs batched points; a single cloud takes shape (3,)")


def _viewpoints(orient_to, batch, flat: _batch.Flat, dtype) -> torch.Tensor:
    """The viewpoint of every flat point: (P, 3) (``orient_to`` checked by :func:`_check_viewpoints`)."""
    o = orient_to.to(dtype)
    if o.shape == (3,):
        return o.expand(flat.query.shape[0], 3)
    if flat.batch_shape:  # padded (B, P, 3)
        return o[:, None, :].expand(*flat.batch_shape, 3).reshape(-1, 3)
    return o[batch.long()]


__all__ = ["estimate_normals"]
