"""kNN by chunked brute force in torch: the reference backend, on any device.

Distances use direct coordinate differences (never the matmul form of ``torch.cdist``), in
query chunks that bound memory to about ``_ENTRIES`` distances at a time; no (M, N, 3) tensor.
Ties are broken by the smaller index, exactly. Groups mask other samples' points to +inf.
"""

import torch

from ._registry import backend

_ENTRIES = 1 << 22  # distances held per chunk (16 MB in float32)


def _smallest(d2: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k smallest entries of each row, ascending, ties by the smaller column index."""
    kth = d2.topk(k, dim=1, largest=False).values[:, -1:]
    below = d2 < kth
    tied = d2 == kth
    room = k - below.sum(1, keepdim=True)
    take = below | (tied & (tied.cumsum(1, dtype=torch.int32) <= room))
    idx = take.nonzero()[:, 1].view(-1, k)  # ascending column order per row
    dist = d2.gather(1, idx)
    order = dist.argsort(dim=1, stable=True)
    dist, idx = dist.gather(1, order), idx.gather(1, order)
    return dist, torch.where(torch.isinf(dist), -1, idx)  # inf: a masked point, not a neighbour


@backend("torch", devices=("cpu", "cuda"))
def search(query, ref, k, query_group, ref_group):
    if query.shape[1] != 3:
        return _search_features(query, ref, k, query_group, ref_group)
    m = query.shape[0]
    dists = query.new_empty((m, k))
    idx = torch.empty((m, k), dtype=torch.int64, device=query.device)
    chunk = max(1, _ENTRIES // max(ref.shape[0], 1))
    for s in range(0, m, chunk):
        q = query[s : s + chunk]
        d2 = (q[:, None, 0] - ref[None, :, 0]).square()
        d2 += (q[:, None, 1] - ref[None, :, 1]).square()
        d2 += (q[:, None, 2] - ref[None, :, 2]).square()
        d2.masked_fill_(d2.isnan(), float("inf"))  # a NaN/inf point is never a neighbour (validate=False)
        if query_group is not None:
            d2.masked_fill_(query_group[s : s + chunk, None] != ref_group[None, :], float("inf"))
        sq, idx[s : s + chunk] = _smallest(d2, k)
        dists[s : s + chunk] = sq.sqrt()
    return dists, idx


_CANDIDATES = 16  # extra candidates re-ranked by exact distances in the feature-space search


def _segments(group: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """(rows sorted by group, the groups present, their row counts)."""
    order = group.argsort(stable=True)
    ids, counts = torch.unique_consecutive(group[order], return_counts=True)
    return order, ids.tolist(), counts.tolist()


def _search_features(query, ref, k, query_group, ref_group):
    """kNN of D-dimensional points (D != 3), one dense block per group.

    Candidates come from the Gram form |q|^2 + |p|^2 - 2 q.p (a matrix product, O(M N D) flops,
    after centring on the block's mean); the k + 16 best are re-ranked by exact squared
    distances from direct differences, ties by the smaller index. The result is exact unless
    the Gram form's rounding moves a true neighbour past those 16 extra candidates.
    """
    m = query.shape[0]
    dists = torch.full((m, k), float("inf"), dtype=query.dtype, device=query.device)
    idx = torch.full((m, k), -1, dtype=torch.int64, device=query.device)
    if query_group is None:
        blocks = [(None, None)]
    else:
        q_order, q_ids, q_counts = _segments(query_group)
        r_order, r_ids, r_counts = _segments(ref_group)
        r_start = dict(zip(r_ids, [sum(r_counts[:i]) for i in range(len(r_counts))]))
        r_count = dict(zip(r_ids, r_counts))
        blocks, start = [], 0
        for gid, count in zip(q_ids, q_counts):
            if gid in r_start:
                rows = q_order[start : start + count]
                blocks.append((rows, r_order[r_start[gid] : r_start[gid] + r_count[gid]]))
            start += count
    for rows, cols in blocks:
        q = query if rows is None else query[rows]
        r = ref if cols is None else ref[cols]
        d, i = _block(q, r, k)
        if cols is not None:
            i = torch.where(i >= 0, cols[i.clamp_min(0)], -1)
        width = d.shape[1]
        if rows is None:
            dists[:, :width], idx[:, :width] = d, i
        else:
            dists[rows, :width], idx[rows, :width] = d, i
    return dists, idx


def _block(q: torch.Tensor, r: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dists, idx) of the min(k, len(r)) nearest rows of r for each row of q, in query chunks."""
    n = r.shape[0]
    k = min(k, n)
    wide = min(n, k + _CANDIDATES)
    centre = r.mean(0)
    rc = r - centre
    r_sq = rc.square().sum(1)
    dists = q.new_empty((q.shape[0], k))
    idx = torch.empty((q.shape[0], k), dtype=torch.int64, device=q.device)
    chunk = max(1, _ENTRIES // max(n, 1))
    for s in range(0, q.shape[0], chunk):
        qc = q[s : s + chunk] - centre
        gram = qc.square().sum(1, keepdim=True) + r_sq[None, :] - 2 * qc @ rc.T
        cand = gram.topk(wide, dim=1, largest=False).indices.sort(dim=1).values  # ascending index
        exact = (q[s : s + chunk, None, :] - r[cand]).square().sum(-1)
        order = exact.argsort(dim=1, stable=True)[:, :k]  # ties: the smaller index comes first
        dists[s : s + chunk] = exact.gather(1, order).sqrt()
        idx[s : s + chunk] = cand.gather(1, order)
    return dists, idx
