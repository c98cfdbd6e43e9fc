"""radius_aggregate's gradients as torch operations, for ``create_graph=True``.

The Warp backward (``pcops::radius_aggregate_backward``) is fast but not differentiable itself.
When a caller asks for gradients that are differentiable again (``torch.autograd.grad(...,
create_graph=True)``: eikonal terms of SDF models, physics-informed losses), the radius op's
autograd calls :func:`gradients` instead: it lists the neighbour pairs once (two ball queries
on the same cell list rule, so the pairs are exactly the forward's), writes the aggregation
over them in torch operations and differentiates that with ``create_graph=True``, so autograd
records every gradient and can take it again (to any order). Memory is O(pairs * F): this path
is for the second-order terms, not for training steps that need only first gradients.
"""

from typing import Optional

import torch

from ... import _vml
from . import _weighting


def _pairs(query, ref, radius: float, query_group, ref_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j): every query i and reference point j of the same sample with ||q_i - p_j|| <= radius."""
    q, p = query.detach(), ref.detach()
    counts = torch.ops.pcops.ball_query(q, p, radius, 1, False, query_group, ref_group)[1]
    most = int(counts.max()) if counts.numel() else 0
    if most == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=query.device)
        return empty, empty
    idx = torch.ops.pcops.ball_query(q, p, radius, most, False, query_group, ref_group)[0]
    i, slot = (idx >= 0).nonzero(as_tuple=True)
    return i, idx[i, slot]


def aggregate(query, ref, features, sigma, pairs, shift: torch.Tensor, weights: str) -> torch.Tensor:
    """radius_aggregate's output over the neighbour ``pairs`` (i, j), in differentiable torch
    operations; ``shift`` (M,) each query's weighting shift (the forward's ``dmin``: a constant,
    as its gradient is exactly zero)."""
    i, j = pairs
    diff = query.index_select(0, i) - ref.index_select(0, j)
    sq = (diff * diff).sum(1)
    m = shift.detach().index_select(0, i)
    if weights == "softmax":  # d's gradient at d = 0 taken as 0, as in the Warp kernels
        d = torch.where(sq > 0, _vml.root(sq.clamp_min(torch.finfo(sq.dtype).tiny)), 0)  # (IEEE's roots, as the kernels')
        w = torch.exp((m - d) / sigma)
    elif weights == "inverse_distance":
        w = m / sq.clamp_min(_weighting.MIN_SQUARED_DISTANCE)
    else:
        w = torch.ones_like(sq)
    total = query.new_zeros(query.shape[0]).index_add(0, i, w)
    sums = query.new_zeros((query.shape[0], features.shape[1])).index_add(0, i, w[:, None] * features.index_select(0, j))
    found = total > 0
    return torch.where(found[:, None], sums / torch.where(found, total, 1)[:, None], 0)


def gradients(grad_out, query, ref, features, sigma, radius: float, query_group: Optional[torch.Tensor],
              ref_group: Optional[torch.Tensor], shift, weights: str, need) -> tuple:
    """The gradients of (query, ref, features, sigma) for the output gradient ``grad_out``,
    recorded by autograd (``need``: which are wanted; the others are None)."""
    inputs = [t for t, n in zip((query, ref, features, sigma), need) if n]
    with torch.enable_grad():
        out = aggregate(query, ref, features, sigma, _pairs(query, ref, radius, query_group, ref_group), shift, weights)
        found = iter(torch.autograd.grad(out, inputs, grad_out, create_graph=True, allow_unused=True) if inputs else ())
    grads = []
    for t, n in zip((query, ref, features, sigma), need):
        g = next(found) if n else None
        grads.append(torch.zeros_like(t) if n and g is None else g)
    return tuple(grads)
