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
