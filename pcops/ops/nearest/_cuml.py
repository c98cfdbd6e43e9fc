"""kNN with RAPIDS cuML ``NearestNeighbors`` (brute force, exact) on CUDA tensors.

Tensors go to CuPy and back through DLPack without copies. cuML's Python API is synchronous
and runs on cuML's own stream, so PyTorch's current stream is synchronised first (the one
host synchronisation of this backend: cuML forces it); CuPy's current stream is set to
PyTorch's so the DLPack exchanges are ordered with torch's work. Groups (batches) are searched
one sample at a time (cuML has no grouped search; its call synchronises anyway).
"""

import torch

from ._registry import backend


@backend("cuml", devices=("cuda",), requires=("cuml", "cupy"), install='pip install "pcops[cuda12]" (or "pcops[cuda13]")')
def search(query, ref, k, query_group, ref_group):
    if query_group is None:
        return _search(query, ref, k)
    dists = query.new_full((query.shape[0], k), float("inf"))
    idx = torch.full((query.shape[0], k), -1, dtype=torch.int64, device=query.device)
    for g in torch.unique(query_group).tolist():
        rows = (query_group == g).nonzero().flatten()
        cols = (ref_group == g).nonzero().flatten()
        kk = min(k, cols.numel())
        if kk:
            d, i = _search(query[rows], ref[cols], kk)
            dists[rows, :kk], idx[rows, :kk] = d, cols[i]
    return dists, idx


def _search(query: torch.Tensor, ref: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    import cupy as cp
    from cuml.neighbors import NearestNeighbors

    m = query.shape[0]
    if m == 0:
        return query.new_empty((0, k)), torch.empty((0, k), dtype=torch.int64, device=query.device)
    stream = torch.cuda.current_stream(query.device)
    stream.synchronize()  # inputs written on torch's stream must be complete before cuML's stream reads them
    with cp.cuda.Device(query.device.index), cp.cuda.ExternalStream(stream.cuda_stream, query.device.index):
        nn = NearestNeighbors(n_neighbors=k, algorithm="brute", metric="euclidean", output_type="cupy")
        nn.fit(cp.from_dlpack(ref.contiguous()))
        dist, idx = nn.kneighbors(cp.from_dlpack(query.contiguous()))
        dists = torch.from_dlpack(cp.ascontiguousarray(dist)).to(query.dtype)
        idx = torch.from_dlpack(cp.ascontiguousarray(idx)).to(torch.int64)
    return dists, idx
