"""PyTorch3D's point-cloud ops on pcops' ops: change one import.

    from pcops.compat.pytorch3d import (knn_points, knn_gather, ball_query, sample_farthest_points,
                                        chamfer_distance, estimate_pointcloud_normals)

Argument names, defaults, return types and padding are those of PyTorch3D's current source
(``pytorch3d.ops``, ``pytorch3d.loss``): padded (N, P, D) tensors with optional ``lengths``,
``KNN(dists, idx, knn)`` namedtuples, squared distances, 0 / -1 padding as each op has it.
Tensors only: a ``Pointclouds`` object raises a TypeError (pass ``pcl.points_padded()`` and
``pcl.num_points_per_cloud()``). Where PyTorch3D's result is unspecified pcops returns one
fixed result (neighbours by distance, ties by the smaller index). ``knn_points``'s ``version``
and ``ball_query``'s ``skip_points_outside_cube`` are accepted and do not change the result.
Details: docs/interop.md.
"""

from __future__ import annotations

from collections import namedtuple
from typing import List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

import pcops

from .. import _validate
from . import check_count, check_finite, check_tensor, compute_dtype, first_within, is_compiling, pad3, same_device, squared

__all__ = [
    "KNN",
    "ball_query",
    "chamfer_distance",
    "estimate_pointcloud_normals",
    "knn_gather",
    "knn_points",
    "masked_gather",
    "sample_farthest_points",
]

KNN = namedtuple("KNN", "dists idx knn")  # PyTorch3D's ``_KNN``; ball_query returns it too


def _clouds(name: str, t) -> torch.Tensor:
    if hasattr(t, "points_padded") and hasattr(t, "num_points_per_cloud"):
        raise TypeError(
            f"{name}: pcops.compat.pytorch3d takes tensors, not Pointclouds objects; "
            "pass pcl.points_padded() and pcl.num_points_per_cloud() as the lengths"
        )
    check_tensor(name, t, "a torch.Tensor of shape (N, P, D)")
    if t.dim() != 3:
        raise ValueError(f"{name} must be a tensor of shape (N, P, D), got shape {tuple(t.shape)}")
    return t


def _lengths(name: str, lengths, n: int, p: int, device) -> torch.Tensor:
    if lengths is None:
        return torch.full((n,), p, dtype=torch.int64, device=device)
    check_tensor(name, lengths)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.shape != (n,):
        raise ValueError(f"{name} must be an integer tensor of shape ({n},), got {lengths.dtype} of shape {tuple(lengths.shape)}")
    if not is_compiling() and n and (int(lengths.min()) < 0 or int(lengths.max()) > p):
        raise ValueError(f"{name} must be in [0, {p}]")
    return lengths.to(torch.int64)


def _pair(p1, p2, lengths1, lengths2):
    """The checks of a two-cloud op (p1, p2, lengths1, lengths2 in the caller's names): shapes,
    devices, then NaN / inf in the points (one host read; pcops' ops then run with validate=False)."""
    p1, p2 = _clouds("p1", p1), _clouds("p2", p2)
    if p1.shape[0] != p2.shape[0]:
        raise ValueError("p1 and p2 must have the same batch dimension.")
    if p1.shape[2] != p2.shape[2]:
        raise ValueError("p1 and p2 must have the same point dimension.")
    same_device(p1=p1, p2=p2, lengths1=lengths1, lengths2=lengths2)
    check_finite(p1=p1, p2=p2)
    return p1, p2


def _packed(points: torch.Tensor, lengths: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, P, D) -> (N P, D) and sample ids (N P,): n for real rows, ``pad_id`` for padding."""
    n, p = points.shape[:2]
    sample = torch.arange(n, device=points.device)[:, None].expand(n, p)
    ids = torch.where(torch.arange(p, device=points.device)[None, :] < lengths[:, None], sample, pad_id)
    return points.reshape(n * p, points.shape[-1]), ids.reshape(-1)


def _gather(points: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """points (N, P, U), idx (N, L, K) -> (N, L, K, U) = points[n, idx[n, l, k]], 0 for an
    index outside [0, P): pcops.gather, the one gather of pcops."""
    return pcops.gather(points, idx, validate=False)


def knn_gather(x: torch.Tensor, idx: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x_out[n, l, k] = x[n, idx[n, l, k]]``, 0 where ``k >= lengths[n]`` (PyTorch3D's ``knn_gather``).

    Args:
        x: Tensor (N, M, U) of features; idx: LongTensor (N, L, K) of valid indices (as
            ``knn_points`` returns them); lengths: optional (N,) points per example of ``x``.

    Returns:
        Tensor (N, L, K, U).
    """
    check_tensor("x", x)
    check_tensor("idx", idx)
    n, m, _ = x.shape
    if idx.shape[0] != n:
        raise ValueError("x and idx must have same batch dimension.")
    lengths = _lengths("lengths", lengths, n, m, x.device)
    k = idx.shape[2]
    out = _gather(x, idx)
    mask = lengths[:, None] <= torch.arange(k, device=x.device)[None]  # (N, K): columns past the cloud
    return torch.where(mask[:, None, :, None], torch.zeros((), dtype=out.dtype, device=out.device), out)


def masked_gather(points: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``points[n, idx[...]]`` with -1 indices giving 0.0 (PyTorch3D's ``ops.utils.masked_gather``):
    idx (N, K) -> (N, K, D); idx (N, L, K) -> (N, L, K, D)."""
    check_tensor("points", points)
    check_tensor("idx", idx)
    if idx.shape[0] != points.shape[0]:
        raise ValueError("points and idx must have the same batch dimension")
    if idx.dim() not in (2, 3):
        raise ValueError(f"idx format is not supported {tuple(idx.shape)!r}")
    flat = idx if idx.dim() == 3 else idx[:, :, None]
    out = _gather(points, flat)  # -1 gives zeros
    return out if idx.dim() == 3 else out[:, :, 0]


def knn_points(
    p1: torch.Tensor,
    p2: torch.Tensor,
    lengths1: Union[torch.Tensor, None] = None,
    lengths2: Union[torch.Tensor, None] = None,
    norm: int = 2,
    K: int = 1,
    version: int = -1,
    return_nn: bool = False,
    return_sorted: bool = True,
) -> KNN:
    """The K nearest points of ``p2`` for each point of ``p1`` (PyTorch3D's ``knn_points``).

    Args:
        p1: Tensor (N, P1, D); p2: Tensor (N, P2, D).
        lengths1, lengths2: optional LongTensors (N,) of points per cloud.
        norm: 2 (squared Euclidean distances) or 1 (L1; K = 1 only in pcops).
        K: neighbours; K > P2 is allowed (the missing columns are padding).
        version: accepted and ignored. return_sorted: results are always sorted.
        return_nn: also return the neighbours, ``knn_gather(p2, idx, lengths2)``.

    Returns:
        KNN(dists (N, P1, K), idx (N, P1, K) int64, knn (N, P1, K, D) or None): squared
        distances (L1 distances for norm=1) ascending, ties by the smaller index; dists and idx
        are 0 where a cloud of p2 has fewer than K points and on padding rows of p1. dists are
        differentiable with respect to p1 and p2 and have p1's dtype (float16/bfloat16 are
        searched in float32).
    """
    p1, p2 = _pair(p1, p2, lengths1, lengths2)
    if norm not in (1, 2):
        raise ValueError("Support for 1 or 2 norm.")
    K = check_count("K", K)
    n, s1, d = p1.shape
    s2 = p2.shape[1]
    lengths1 = _lengths("lengths1", lengths1, n, s1, p1.device)
    lengths2 = _lengths("lengths2", lengths2, n, s2, p1.device)
    dtype = compute_dtype(p1, p2)
    a, b = p1.to(dtype), p2.to(dtype)
    k = min(K, s2)
    if k == 0 or n == 0 or s1 == 0:
        idx = torch.full((n, s1, k), -1, dtype=torch.int64, device=p1.device)
    elif norm == 2:
        qa, qb = (pad3(a.detach(), "p1"), pad3(b.detach(), "p2")) if d < 3 else (a.detach(), b.detach())
        idx = pcops.knn(qa, qb, k, query_lengths=lengths1, ref_lengths=lengths2, validate=False).idx
    else:
        if K != 1:
            raise ValueError("pcops.compat.pytorch3d.knn_points supports norm=1 with K=1 only (pcops' L1 search finds the nearest point)")
        qa, qb = (pad3(a.detach(), "p1"), pad3(b.detach(), "p2")) if d < 3 else (a.detach(), b.detach())  # the L1 search takes any D
        fa, ga = _packed(qa, lengths1, n)
        fb, gb = _packed(qb, lengths2, n + 1)
        near = torch.ops.pcops.nearest_l1(query=fa.contiguous(), ref=fb.contiguous(), validate=False, query_group=ga, ref_group=gb)
        local = near - torch.arange(n, device=p1.device).repeat_interleave(s1) * s2
        idx = torch.where(near >= 0, local, -1).view(n, s1, 1)
    valid = idx >= 0
    idx = torch.where(valid, idx, 0)
    if k:
        diff = a[:, :, None, :] - _gather(b, idx)
        dist = diff.square().sum(-1) if norm == 2 else diff.abs().sum(-1)
        dists = torch.where(valid, dist, torch.zeros((), dtype=dist.dtype, device=dist.device)).to(p1.dtype)
    else:
        dists = p1.new_zeros((n, s1, 0))
    if K > k:
        dists = torch.cat([dists, dists.new_zeros((n, s1, K - k))], 2)
        idx = torch.cat([idx, idx.new_zeros((n, s1, K - k))], 2)
    nn = knn_gather(p2, idx, lengths2) if return_nn else None
    return KNN(dists=dists, idx=idx, knn=nn)


def _square(value: float, dtype: torch.dtype) -> float:
    """``value * value`` rounded as a multiply in ``dtype`` (float32 or float64) rounds it, on the
    host: Python numbers only, so torch.compile folds it (a tensor and float() would break the graph)."""
    v = (np.float64 if dtype == torch.float64 else np.float32)(value)
    return float(v * v)


def ball_query(
    p1: torch.Tensor,
    p2: torch.Tensor,
    lengths1: Union[torch.Tensor, None] = None,
    lengths2: Union[torch.Tensor, None] = None,
    K: int = 500,
    radius: float = 0.2,
    return_nn: bool = True,
    skip_points_outside_cube: bool = False,
) -> KNN:
    """The first K points of ``p2`` (in index order) within ``radius`` of each point of ``p1``
    (PyTorch3D's ``ball_query``: not the closest K, the first K).

    Args:
        p1: Tensor (N, P1, D), D <= 3; p2: Tensor (N, P2, D).
        lengths1, lengths2: optional LongTensors (N,).
        K: at most this many neighbours per point. radius: ``p2_j`` is a neighbour when
            ``||p1_i - p2_j||^2 < radius^2`` (strictly, squared in the points' precision).
        return_nn: also return the neighbours (0.0 where idx is -1).
        skip_points_outside_cube: accepted (it changes no result).

    Returns:
        KNN(dists (N, P1, K) squared, 0 padded; idx (N, P1, K) int64 ascending, -1 padded;
        knn (N, P1, K, D) or None). dists are differentiable with respect to p1 and p2.
    """
    p1, p2 = _pair(p1, p2, lengths1, lengths2)
    K = check_count("K", K)
    if isinstance(radius, torch.Tensor) and radius.numel() == 1:
        radius = float(radius)
    if isinstance(radius, bool) or not isinstance(radius, (int, float, np.floating)) or not (_validate.is_finite_number(radius) and radius > 0):
        raise ValueError(f"radius must be a finite number > 0, got {_validate.shown_number(radius)}")
    n, s1, d = p1.shape
    s2 = p2.shape[1]
    lengths1 = _lengths("lengths1", lengths1, n, s1, p1.device)
    lengths2 = _lengths("lengths2", lengths2, n, s2, p1.device)
    dtype = compute_dtype(p1, p2)
    a, b = pad3(p1.to(dtype), "p1"), pad3(p2.to(dtype), "p2")
    if n == 0 or s1 == 0 or s2 == 0:
        idx = torch.full((n, s1, K), -1, dtype=torch.int64, device=p1.device)
    else:
        fa, ga = _packed(a.detach(), lengths1, n)
        fb, gb = _packed(b.detach(), lengths2, n + 1)
        bound = _square(float(radius), dtype)  # PyTorch3D: radius * radius in float
        table = first_within(fa.contiguous(), fb.contiguous(), ga, gb, float(radius), bound, K, False).view(n, s1, K)
        idx = torch.where(table >= 0, table - torch.arange(n, device=p1.device)[:, None, None] * s2, -1)
    valid = idx >= 0
    if s2:
        dist = squared(a[:, :, None, :] - _gather(b, idx.clamp(min=0)))
        dists = torch.where(valid, dist, torch.zeros((), dtype=dist.dtype, device=dist.device)).to(p1.dtype)
    else:
        dists = p1.new_zeros((n, s1, K))
    nn = masked_gather(p2, idx) if return_nn and s2 else (p2.new_zeros((n, s1, K, d)) if return_nn else None)
    return KNN(dists=dists, idx=idx, knn=nn)


def sample_farthest_points(
    points: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    K: Union[int, List, torch.Tensor] = 50,
    random_start_point: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Iterative farthest point sampling (PyTorch3D's ``sample_farthest_points``).

    Args:
        points: Tensor (N, P, D), D <= 3. lengths: optional LongTensor (N,).
        K: picks per cloud: an int, or a list / LongTensor (N,) of per-cloud counts.
        random_start_point: start at a random point of each cloud, drawn from torch's global
            RNG (reproducible with ``torch.manual_seed``; not the same draw as PyTorch3D).

    Returns:
        (selected points (N, K, D) float32, as PyTorch3D (it converts the points to float32),
        0.0 past a cloud's picks; indices (N, K) int64, -1 past them). With per-cloud K the
        width is max(K). A cloud with fewer points than its K gives all of them; ties go to the
        smaller index; a point is never picked twice.
    """
    points = _clouds("points", points)
    n, p, d = points.shape
    lengths = _lengths("lengths", lengths, n, p, points.device)
    same_device(points=points, lengths=lengths)
    check_finite(points=points)
    if isinstance(K, np.integer):
        K = int(K)
    if isinstance(K, int) and not isinstance(K, bool):
        per_cloud = None
        width = check_count("K", K)
    else:
        per_cloud = torch.as_tensor(K, dtype=torch.int64, device=points.device)
        if per_cloud.shape != (n,):
            raise ValueError("K and points must have the same batch dimension")
        if isinstance(K, torch.Tensor):  # the width is the largest count: a host read (its size follows the data)
            width = int(per_cloud.max()) if n else 0
        else:  # a list: its numbers, no tensor to read
            width = max(int(c) for c in K) if n else 0
        if width < 1:
            raise ValueError("K must hold at least one count >= 1")
    points = points.to(torch.float32)
    if n == 0 or p == 0:
        idx = torch.full((n, width), -1, dtype=torch.int64, device=points.device)
    else:
        idx = pcops.farthest_point_sample(pad3(points.detach(), "points"), width, lengths=lengths,
                                          random_start=random_start_point, validate=False).idx
    if per_cloud is not None:
        idx = torch.where(torch.arange(width, device=idx.device)[None] < per_cloud[:, None], idx, -1)
    return masked_gather(points, idx), idx


def _reductions(batch_reduction, point_reduction) -> None:
    if batch_reduction is not None and batch_reduction not in ["mean", "sum"]:
        raise ValueError('batch_reduction must be one of ["mean", "sum"] or None')
    if point_reduction is not None and point_reduction not in ["mean", "sum", "max"]:
        raise ValueError('point_reduction must be one of ["mean", "sum", "max"] or None')
    if point_reduction is None and batch_reduction is not None:
        raise ValueError("Batch reduction must be None if point_reduction is None")


def _one_direction(x, y, x_lengths, y_lengths, x_normals, y_normals, weights, point_reduction, norm, abs_cosine):
    """PyTorch3D's ``_chamfer_distance_single_direction`` over this module's ``knn_points``."""
    n, s1, _ = x.shape
    x_mask = torch.arange(s1, device=x.device)[None] >= x_lengths[:, None]  # (N, P1) padding
    x_nn = knn_points(x, y, lengths1=x_lengths, lengths2=y_lengths, norm=norm, K=1)
    cham_x = x_nn.dists[..., 0].masked_fill(x_mask, 0.0)
    if weights is not None:
        cham_x = cham_x * weights.view(n, 1)
    cham_norm_x = None
    if x_normals is not None and y_normals is not None:
        x_normals_near = knn_gather(y_normals, x_nn.idx, y_lengths)[..., 0, :]
        cosine = F.cosine_similarity(x_normals, x_normals_near, dim=2, eps=1e-6)
        cham_norm_x = (1 - (cosine.abs() if abs_cosine else cosine)).masked_fill(x_mask, 0.0)
        if weights is not None:
            cham_norm_x = cham_norm_x * weights.view(n, 1)
    if point_reduction == "max":
        cham_x = cham_x.max(1).values
    elif point_reduction is not None:
        cham_x = cham_x.sum(1)
        cham_norm_x = None if cham_norm_x is None else cham_norm_x.sum(1)
        if point_reduction == "mean":
            count = x_lengths.clamp(min=1)
            cham_x = cham_x / count
            cham_norm_x = None if cham_norm_x is None else cham_norm_x / count
    return cham_x, cham_norm_x


def chamfer_distance(
    x,
    y,
    x_lengths=None,
    y_lengths=None,
    x_normals=None,
    y_normals=None,
    weights=None,
    batch_reduction: Union[str, None] = "mean",
    point_reduction: Union[str, None] = "mean",
    norm: int = 2,
    single_directional: bool = False,
    abs_cosine: bool = True,
):
    """Chamfer distance (PyTorch3D's ``pytorch3d.loss.chamfer_distance``, current source).

    Args:
        x: Tensor (N, P1, D); y: Tensor (N, P2, D). x_lengths, y_lengths: optional (N,).
        x_normals, y_normals: optional (N, P1, 3) / (N, P2, 3): with both, a normals loss
            ``1 - |cos|`` (``1 - cos`` with ``abs_cosine=False``) between each point's normal
            and its nearest neighbour's.
        weights: optional (N,) non-negative weights of the clouds.
        batch_reduction: "mean", "sum" or None. point_reduction: "mean", "sum", "max" or None.
        norm: 2 (squared Euclidean) or 1 (L1). single_directional: x to y only.

    Returns:
        (loss, loss_normals) as PyTorch3D: loss_normals is None without both normals; with
        ``point_reduction=None`` each is a pair of per-point tensors (N, P1), (N, P2) (or the
        first alone if single-directional). Computed by ``pcops.chamfer_distance`` when there
        are no normals and no weights, otherwise by this module's ``knn_points``; gradients to
        x and y (and the normals).
    """
    _reductions(batch_reduction, point_reduction)
    if norm not in (1, 2):
        raise ValueError("Support for 1 or 2 norm.")
    if point_reduction == "max" and (x_normals is not None or y_normals is not None):
        raise ValueError('Normals must be None if point_reduction is "max"')
    x, y = _clouds("x", x), _clouds("y", y)
    n = x.shape[0]
    if y.shape[0] != n or y.shape[2] != x.shape[2]:
        raise ValueError("y does not have the correct shape.")
    x_lengths = _lengths("x_lengths", x_lengths, n, x.shape[1], x.device)
    y_lengths = _lengths("y_lengths", y_lengths, n, y.shape[1], x.device)
    for name, normals in (("x_normals", x_normals), ("y_normals", y_normals)):
        if normals is not None and check_tensor(name, normals).dim() != 3:
            raise ValueError(f"Expected {name} to be of shape (N, P, 3)")
    return_normals = x_normals is not None and y_normals is not None
    if weights is not None:
        check_tensor("weights", weights)
    same_device(x=x, y=y, x_lengths=x_lengths, y_lengths=y_lengths, x_normals=x_normals, y_normals=y_normals, weights=weights)
    check_finite(x=x, y=y, x_normals=x_normals, y_normals=y_normals, weights=weights)
    if weights is not None:
        if weights.shape[0] != n:
            raise ValueError("weights must be of shape (N,).")
        if not is_compiling():
            if not bool((weights >= 0).all()):
                raise ValueError("weights cannot be negative.")
            if float(weights.sum()) == 0.0:  # PyTorch3D: zero losses, connected to x for autograd
                zero = (x.sum((1, 2)) * weights) * 0.0
                if point_reduction is not None and batch_reduction is not None:
                    zero = zero.sum()
                return zero, zero
    if not return_normals and weights is None and x.shape[2] == 3:
        loss = pcops.chamfer_distance(
            x, y, x_lengths=x_lengths, y_lengths=y_lengths, norm=norm, single_directional=single_directional,
            point_reduction=point_reduction, batch_reduction=batch_reduction, validate=False,
        )
        loss = tuple(t.to(x.dtype) for t in loss) if isinstance(loss, tuple) else loss.to(x.dtype)
        return loss, None
    args = (weights, point_reduction, norm, abs_cosine)
    cham_x, cham_norm_x = _one_direction(x, y, x_lengths, y_lengths, x_normals, y_normals, *args)
    if single_directional:
        loss, loss_normals = cham_x, cham_norm_x
    else:
        cham_y, cham_norm_y = _one_direction(y, x, y_lengths, x_lengths, y_normals, x_normals, *args)
        if point_reduction == "max":
            loss, loss_normals = torch.maximum(cham_x, cham_y), None
        elif point_reduction is not None:
            loss = cham_x + cham_y
            loss_normals = None if cham_norm_x is None else cham_norm_x + cham_norm_y
        else:
            loss = (cham_x, cham_y)
            loss_normals = None if cham_norm_x is None else (cham_norm_x, cham_norm_y)
    if batch_reduction is None:
        return loss, loss_normals
    loss = loss.sum()
    loss_normals = None if loss_normals is None else loss_normals.sum()
    if batch_reduction == "mean":
        div = max(n, 1) if weights is None else torch.where(weights.sum() == 0, 1.0, weights.sum())
        loss = loss / div
        loss_normals = None if loss_normals is None else loss_normals / div
    return loss, loss_normals


def estimate_pointcloud_normals(
    pointclouds: torch.Tensor,
    neighborhood_size: int = 50,
    disambiguate_directions: bool = True,
    *,
    use_symeig_workaround: bool = True,
) -> torch.Tensor:
    """Normals from the covariance of each point's ``neighborhood_size`` nearest points, itself
    included (PyTorch3D's ``estimate_pointcloud_normals``), on ``pcops.estimate_normals``.

    Args:
        pointclouds: Tensor (N, P, 3); P must exceed ``neighborhood_size``.
        disambiguate_directions: orient each normal as PyTorch3D does (after SHOT, Tombari et
            al. 2010): flip it when fewer than half of the point's neighbours ``q_j`` have
            ``n . (q_j - p) > 0``. Without it the sign is pcops' fixed rule (the largest
            component positive) where PyTorch3D's is its eigen-solver's.
        use_symeig_workaround: accepted and ignored.

    Returns:
        Unit normals (N, P, 3) in the dtype of the points, differentiable where the smallest
        eigenvalue of a neighbourhood's covariance is simple.
    """
    points = _clouds("pointclouds", pointclouds)
    if points.shape[2] != 3:
        raise ValueError("The pointclouds argument has to be of shape (minibatch, N, 3)")
    k = check_count("neighborhood_size", neighborhood_size)
    if points.shape[1] <= k:
        raise ValueError("The neighborhood_size argument has to be >= size of each of the point clouds.")
    check_finite(pointclouds=points)
    centred = points - points.mean(1, keepdim=True)  # PyTorch3D undoes the mean first
    normals = pcops.estimate_normals(centred, k, validate=False)
    if not disambiguate_directions:
        return normals
    idx = pcops.knn(centred.detach(), centred.detach(), k, validate=False).idx  # (N, P, k), the same neighbourhoods
    offsets = _gather(centred.detach(), idx) - centred.detach()[:, :, None]
    positive = ((normals.detach()[:, :, None] * offsets).sum(3) > 0).sum(2)
    flip = positive < 0.5 * k
    return torch.where(flip[..., None], -normals, normals)
