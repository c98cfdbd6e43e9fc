"""The neighbour weightings and reductions shared by both aggregation families.

``weights`` (with ``reduce="mean"``), over the neighbours ``j`` of query ``i``:

* ``"softmax"``: ``w_ij = exp(-d_ij / sigma) / sum_l exp(-d_il / sigma)`` (the default)
* ``"inverse_distance"``: ``w_ij = (1 / max(d_ij^2, 1e-16)) / sum_l (1 / max(d_il^2, 1e-16))``
  (PyTorch Geometric's ``knn_interpolate``, PointNet++ feature propagation)
* ``"uniform"``: ``w_ij = 1 / |N(i)|``, the plain mean

``reduce="max"`` is the feature-wise max over the neighbours, unweighted (PointNet++
grouping): its gradient goes to the arg-max neighbour of each feature, and a query without
neighbours gets zeros.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import _validate

WEIGHTS = ("softmax", "inverse_distance", "uniform")
REDUCE = ("mean", "max")
MIN_SQUARED_DISTANCE = 1e-16  # the clamp of inverse-distance weights (PyTorch Geometric's)


def name(weights: Optional[str], reduce: str) -> str:
    """The weighting that ``weights`` means for ``reduce``, after checking both names.

    ``weights=None`` means ``"softmax"`` for ``reduce="mean"`` and ``"uniform"`` for
    ``reduce="max"`` (whose max is unweighted).
    """
    _validate.one_of("reduce", reduce, REDUCE)
    if weights is None:
        weights = "softmax" if reduce == "mean" else "uniform"
    _validate.one_of("weights", weights, WEIGHTS)
    if reduce == "max" and weights != "uniform":
        raise ValueError(f"reduce='max' takes the max of the unweighted features: weights must be None or 'uniform', got {weights!r}")
    return weights


def resolve(weights: Optional[str], reduce: str, sigma) -> str:
    """:func:`name`, and sigma given exactly when the weighting uses it (``"softmax"`` only)."""
    weights = name(weights, reduce)
    if weights == "softmax" and sigma is None:
        raise ValueError("sigma is required for weights='softmax'")
    if weights != "softmax" and sigma is not None:
        raise ValueError(f"sigma is used by weights='softmax' only; pass sigma=None with weights={weights!r}, reduce={reduce!r}")
    return weights


def inverse_distance(squared: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Normalised 1 / max(d^2, 1e-16) over the valid neighbours (M, k) of squared distances
    ``squared``; rows without any are 0. ``valid`` None: every neighbour is (complete rows, the
    same values without the masks).

    Each row is scaled by its smallest clamped d^2 first (weights in (0, 1], no overflow for
    any scale of coordinates); normalisation cancels the scale, so it carries no gradient.
    """
    sq = squared.clamp_min(MIN_SQUARED_DISTANCE)
    smallest = (sq if valid is None else torch.where(valid, sq, float("inf"))).amin(1, keepdim=True).detach()
    smallest = torch.where(torch.isinf(smallest), 1, smallest)
    w = smallest / sq if valid is None else torch.where(valid, smallest / sq, 0)
    total = w.sum(1, keepdim=True)
    return w / torch.where(total > 0, total, 1)
