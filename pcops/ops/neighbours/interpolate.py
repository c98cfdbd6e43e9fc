"""knn_interpolate: inverse-distance interpolation from the k nearest points (PointNet++ feature propagation)."""

from __future__ import annotations

from typing import Optional

import torch

from ... import _threads, _validate
from .nearest import knn_aggregate


@_threads.limits
def knn_interpolate(
    query: torch.Tensor,
    ref: torch.Tensor,
    features: torch.Tensor,
    k: int = 3,
    *,
    backend: str = "auto",
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Inverse-distance interpolation of reference features at the query points.

    PointNet++ feature propagation, and PyTorch Geometric's ``knn_interpolate``:
    ``out_i = sum_j w_ij f_j / sum_j w_ij`` with ``w_ij = 1 / max(d_ij^2, 1e-16)`` over the
    k nearest reference points. This is ``knn_aggregate(..., weights="inverse_distance")``,
    except that k is capped at the number of reference rows (a coarse level may hold fewer
    than 3 points).

    Args:
        query: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed.
        ref: Tensor of shape (N, 3), N >= 1; (B, N, 3) padded; or (N_total, 3) packed.
        features: Tensor of shape (N, F); (B, N, F); or (N_total, F).
        k: number of neighbours (>= 1; default 3 as in PointNet++).
        backend, query_lengths, ref_lengths, query_batch, ref_batch, validate: as for
            :func:`knn_aggregate`.

    Returns:
        Tensor of shape (M, F), (B, M, F) or (M_total, F) in the promoted dtype of the
        inputs, differentiable with respect to ``features``, ``query`` and ``ref``; zeros for a
        query with no neighbour (none in its sample, or every squared distance overflowing the
        points' dtype: :func:`pcops.knn`).

    Example:
        >>> import torch, pcops
        >>> ref = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
        >>> features = torch.tensor([[0.0], [3.0], [100.0]])
        >>> pcops.knn_interpolate(torch.tensor([[0.5, 0.0, 0.0]]), ref, features, k=2)  # inverse squared distance weights
        tensor([[1.5000]])
    """
    k = _validate.plain(k)  # NumPy scalars as Python numbers
    _validate.tensor("ref", ref)
    if ref.dim() >= 2 and ref.shape[-2] == 0:
        raise ValueError("ref must hold at least one point to interpolate from")
    k = _validate.count("k", k)
    if ref.dim() >= 2 and k > ref.shape[-2]:
        k = ref.shape[-2]
    return knn_aggregate(
        query, ref, features, k, None, backend, weights="inverse_distance", query_lengths=query_lengths,
        ref_lengths=ref_lengths, query_batch=query_batch, ref_batch=ref_batch, validate=validate,
    )


__all__ = ["knn_interpolate"]
