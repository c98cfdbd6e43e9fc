"""The halo of a rank's queries: the reference points of other ranks that its neighbour ops can reach.

Every rank holds a share of the reference cloud (rows ``offset_r .. offset_r + n_r - 1`` of the
global cloud: the shares concatenated in rank order) and a share of the queries. A rank's
queries reach, through a neighbour op, only the reference points within some distance of them
(the radius of a radius op; for kNN, the k-th distance among the rank's own points, a bound of
the true k-th distance). Each rank gathers every rank's *reach boxes* (for each cell of a
4 x 4 x 4 grid over its queries' box, the box of the balls about the queries in it), and sends
to each other rank only its reference rows inside one of that rank's boxes, with their global
indices (and features): the halo. A rank's own rows and its halo, in
global order, hold every reference point its queries can reach, in the order of the global
cloud, so that the single-process op on them gives the rows, ties and sums of the op on the
whole cloud. Nothing else moves: on a spatial partition, a halo is the points near the shares'
borders.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _comm


class Halo(NamedTuple):
    ref: torch.Tensor  # (L, 3) this rank's reference rows and its halo, in global order
    features: Optional[torch.Tensor]  # (L, F) their features
    index: torch.Tensor  # (L,) int64 their global rows
    total: int  # rows of the global reference cloud
    offset: int  # the global row of this rank's first reference row
    own: int  # this rank's reference rows


def _slack(t: torch.Tensor) -> float:
    return 16 * torch.finfo(t.dtype).eps


# A rank's queries are described by the reach boxes of the cells of a CELLS^3 grid over their own
# box: a share that is not a box (a range of Morton codes) is covered much more tightly than by one box.
CELLS = 4


def reach_boxes(query: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """(CELLS^3, 2, 3) float64: for each cell of a grid over the queries' box, the box of the balls
    of radius ``reach`` (M,) (or 0-d) about its queries, widened by rounding; empty cells (and
    every cell when there is no query) give empty boxes (+inf, -inf)."""
    q = query.detach().to(torch.float64)
    boxes = torch.stack([q.new_full((CELLS**3, 3), float("inf")), q.new_full((CELLS**3, 3), float("-inf"))], 1)
    if q.shape[0] == 0:
        return boxes
    reach = reach.to(q).expand(q.shape[0])
    size = q.abs().amax() + reach.nan_to_num(posinf=0.0).amax()
    pad = (reach * (1 + _slack(query)) + _slack(query) * size)[:, None]
    low, high = q.amin(0), q.amax(0)
    cell = ((q - low) / (high - low).clamp_min(1e-300) * CELLS).clamp(0, CELLS - 1).to(torch.int64)
    cell = (cell[:, 0] * CELLS + cell[:, 1]) * CELLS + cell[:, 2]
    index = cell[:, None].expand(-1, 3)
    boxes[:, 0].scatter_reduce_(0, index, q - pad, "amin")
    boxes[:, 1].scatter_reduce_(0, index, q + pad, "amax")
    return boxes


def gather(query: torch.Tensor, ref: torch.Tensor, features: Optional[torch.Tensor], reach, group) -> Halo:
    """This rank's reference rows and the other ranks' rows within ``reach`` of its queries:
    a tensor (M,) or 0-d, or a function of every rank's number of reference rows (a list, the
    same on every rank) that returns it (it may run collectives of its own: every rank calls it)."""
    me, world = _comm.rank_and_size(group)
    counts = torch.stack(_comm.all_gather(torch.tensor([ref.shape[0]], dtype=torch.int64), group))[:, 0]
    offset = int(counts[:me].sum())
    if callable(reach):
        reach = reach(counts.tolist())
    boxes = _comm.all_gather(reach_boxes(query, reach).cpu(), group)  # float64: a point on a box's face stays inside
    index = torch.arange(offset, offset + ref.shape[0], device=ref.device)
    point = ref.detach().to(torch.float64)
    rows = []
    for r, box in enumerate(boxes):
        if r == me:
            rows.append(torch.arange(ref.shape[0], device=ref.device))
            continue
        box = box[box[:, 0, 0] <= box[:, 1, 0]].to(ref.device)  # the cells with queries
        if box.shape[0] == 0:
            rows.append(torch.zeros(0, dtype=torch.int64, device=ref.device))
            continue
        if bool(((box[:, 0] == float("-inf")) & (box[:, 1] == float("inf"))).all(1).any()):
            rows.append(torch.arange(ref.shape[0], device=ref.device))  # an unbounded reach: every row, NaN ones too
            continue
        # the points inside the boxes' hull first (on a spatial share, the few near the border),
        # then those inside one of the boxes
        near = ((point >= box[:, 0].amin(0)) & (point <= box[:, 1].amax(0))).all(1).nonzero().squeeze(1)
        candidate = point.index_select(0, near)
        inside = ((candidate[:, None] >= box[None, :, 0]) & (candidate[:, None] <= box[None, :, 1])).all(2).any(1)
        rows.append(near[inside])
    values = ref if features is None else torch.cat([ref, features.to(ref.dtype)], 1)
    got = _comm.exchange([values.index_select(0, r) for r in rows], group)
    got_index = _comm.exchange([index.index_select(0, r) for r in rows], group)
    order = torch.argsort(got_index)  # the global order (the ranks' blocks are each in order already)
    got, got_index = got.index_select(0, order), got_index.index_select(0, order)
    feats = None if features is None else got[:, 3:].to(features.dtype)
    return Halo(got[:, :3], feats, got_index, int(counts.sum()), offset, ref.shape[0])


def reached(query: torch.Tensor, halo: Halo, reach: torch.Tensor, nearest) -> torch.Tensor:
    """(M,) bool: the queries that a point of another rank lies within ``reach`` of (rounding
    included); ``nearest(query, points)`` the distance to each query's nearest point. The other
    queries' results are those of this rank's own points."""
    others = (halo.index < halo.offset) | (halo.index >= halo.offset + halo.own)
    points = halo.ref.detach()[others]
    if points.shape[0] == 0 or query.shape[0] == 0:
        return torch.zeros(query.shape[0], dtype=torch.bool, device=query.device)
    size = (query.detach().abs().amax() + points.abs().amax()).nan_to_num(0.0, 0.0, 0.0)  # (NaN points: validate=False)
    return nearest(query.detach(), points) <= reach * (1 + _slack(query)) + _slack(query) * size


def to_global(idx: torch.Tensor, halo: Halo) -> torch.Tensor:
    """Rows of ``halo.ref`` (-1 kept) as global rows."""
    return torch.where(idx >= 0, halo.index[idx.clamp(min=0)], -1) if halo.index.numel() else idx
