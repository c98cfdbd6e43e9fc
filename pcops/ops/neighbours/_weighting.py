"""The neighbour weightings and reductions shared by both aggregation families.

``weights`` (with ``reduce="mean"``), over the neighbours ``j`` of query ``i``:

* ``"softmax"``: ``w_ij = exp(-d_ij / sigma) / sum_l exp(-d_il / sigma)`` (the default)
* ``"inverse_distance"``: ``w_ij = (1 / max(d_ij^2, 1e-16)) / sum_l (1 / max(d_il^2, 1e-16))``
  (PyTorch Geometric's ``knn_interpolate``, PointNet++ feature propagation)
* ``"uniform"``: ``w_ij = 1 / |N(i)|``, the plain mean

``reduce="max"`` is the feature-wise max over the neighbours, unweighted (PointNet++
grouping): its gradient goes to the arg-max neighbour of each feature, and a query without
neighbours gets zeros. The names and their rule (``weights=None`` per ``reduce``, sigma given
exactly for softmax) are checked by :func:`pcops._validate.weighting`.
"""

from __future__ import annotations

from typing import Optional

import torch

MIN_SQUARED_DISTANCE = 1e-16  # the clamp of inverse-distance weights (PyTorch Geometric's)


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
