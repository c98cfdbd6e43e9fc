"""kNN with RAPIDS cuML ``NearestNeighbors`` (brute force) on CUDA tensors, made exact in torch.

cuML 26.x converts its inputs to float32 and computes Euclidean distances with the expanded
formula sqrt(|x|^2 + |y|^2 - 2 x.y), whose rounding error grows with the squared distance of
the points from the origin: far from it, neighbours come back in the wrong order and ties do
not follow the other backends. So this backend:

1. centres each searched block (the whole cloud, or one sample) on the centre of its
   reference points' bounding box, in torch, before converting to float32;
2. asks cuML for ``k + margin`` candidates (``margin = max(k, 8)``, at most all points);
3. recomputes the candidates' distances exactly in the input dtype (direct differences of the
   original coordinates, the squares' IEEE roots) and keeps the k smallest, ties by the
   smaller index, as every pcops backend does.

Residual inexactness: a true neighbour is missed only if cuML's float32 error on the centred
points pushes it below ``k + margin`` candidates, i.e. the error exceeds the gap between the
k-th and the (k + margin)-th distance. After centring that error is about 1e-7 times the
squared extent of the block, so it matters only for near-ties at the k-th neighbour in
clouds whose extent is huge compared to their point spacing.

Synchronisation: cuML's Python API is synchronous and runs on its own (per-thread) stream.
All inputs are converted and centred first, then PyTorch's current stream is synchronised
once (so cuML reads finished inputs), then every block is searched, then the re-ranking runs
on torch's stream. A grouped search costs two more host reads (one sort of the group keys,
``unique_consecutive``, which reads its output size, and one read of the group sizes). CuPy's current stream is PyTorch's
(``cupy.cuda.Stream.from_external``) for the DLPack exchanges.

Devices: cuML keeps one handle per thread, bound to the device that was current when the
thread first used cuML. Each CUDA device's searches therefore run in a worker thread of their
own (one per device), so a process that searches on several GPUs gets each device's handle.
Without ``pcops.memory.use_rmm_pool()``, the first search on a device replaces RMM's plain
``CudaMemoryResource`` (RMM's default, which cuML's CuPy allocator uses) with RMM's
``CudaAsyncMemoryResource``, so cuML's buffers come from CUDA's stream-ordered pool instead of
a cudaMalloc/cudaFree per call.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from .... import _vml, memory
from ._registry import backend

_workers: dict = {}  # CUDA device index -> single-thread executor running that device's cuML calls
_workers_lock = threading.Lock()


def _forget_workers() -> None:
    _workers.clear()  # in a forked child the parent's worker threads do not exist


os.register_at_fork(after_in_child=_forget_workers)


def _worker(index: int) -> ThreadPoolExecutor:
    with _workers_lock:
        if index not in _workers:
            _workers[index] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pcops-cuml-{index}")
        return _workers[index]


def margin(k: int) -> int:
    """Extra candidates asked of cuML beyond k, re-ranked away by exact distances."""
    return max(k, 8)


@backend("cuml", devices=("cuda",), requires=("cuml", "cupy"), install='pip install "pcops[cuda12]" (or "pcops[cuda13]")')
def search(query, ref, k, query_group, ref_group):
    return knn(query, ref, k, query_group, ref_group, _cuml_candidates)


def knn(query, ref, k: int, query_group, ref_group, candidates: Callable):
    """The exact kNN from approximate candidates.

    ``candidates(blocks, device)`` takes a list of (query (m, 3) float32, ref (n, 3) float32,
    kk) blocks, centred and contiguous, and returns a list of int64 (m, kk) candidate indices
    into each block's ref: cuML's search here, a stand-in in tests.
    """
    m, n = query.shape[0], ref.shape[0]
    dists = query.new_full((m, k), float("inf"))
    idx = torch.full((m, k), -1, dtype=torch.int64, device=query.device)
    if m == 0 or n == 0:
        return dists, idx
    if query_group is None:
        rows, cols = [None], [None]
    else:
        rows, cols = _group_slices(query_group, ref_group)
    blocks, places = [], []
    for r, c in zip(rows, cols):
        q = query if r is None else query[r]
        p = ref if c is None else ref[c]
        centre = (p.amin(0) + p.amax(0)) / 2  # on the device: no host read
        kk = min(k + margin(k), p.shape[0])
        blocks.append(((q - centre).float().contiguous(), (p - centre).float().contiguous(), kk))
        places.append((r, c, q, p, min(k, p.shape[0])))
    found = candidates(blocks, query.device)
    for (r, c, q, p, kr), cand in zip(places, found):
        d, i = rerank(q, p, cand, kr)
        if c is not None:
            i = c[i]
        if r is None:
            dists[:, :kr], idx[:, :kr] = d, i
        else:
            dists[r, :kr], idx[r, :kr] = d, i
    return dists, idx


def rerank(query: torch.Tensor, ref: torch.Tensor, cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k candidates with the smallest exact distance, ascending, ties by the smaller index."""
    cand = cand.sort(dim=1).values  # ascending index, so a stable sort by distance breaks ties by index
    diff = query[:, None, :] - ref[cand]
    d = _vml.sqrt(diff[..., 0].square() + diff[..., 1].square() + diff[..., 2].square())
    order = d.argsort(dim=1, stable=True)[:, :k]  # by the distances (IEEE roots: squares an ulp apart may tie), as the Warp search
    return d.gather(1, order), cand.gather(1, order)


def _group_slices(query_group: torch.Tensor, ref_group: torch.Tensor):
    """Row and column index tensors of each group present on both sides.

    One sort of the keys 2 * group + side (queries before references of the same group), one
    ``unique_consecutive`` (which reads its output size) and one host read of the counts.
    """
    m = query_group.shape[0]
    keys = torch.cat([query_group.long() * 2, ref_group.long() * 2 + 1])
    keys, order = keys.sort(stable=True)
    runs, counts = keys.unique_consecutive(return_counts=True)
    host = torch.stack([runs, counts]).tolist()  # the one host read
    slices, start = {}, 0
    for key, count in zip(*host):
        slices[key] = order[start : start + count]
        start += count
    rows, cols = [], []
    for key, members in slices.items():
        if key % 2 == 0 and key + 1 in slices:
            rows.append(members)
            cols.append(slices[key + 1] - m)
    return rows, cols


def _cuml_candidates(blocks: list, device: torch.device) -> list:
    """cuML brute-force candidates for each block, run in ``device``'s cuML worker thread."""
    stream = torch.cuda.current_stream(device)
    stream.synchronize()  # the inputs written on torch's stream must be complete before cuML's stream reads them
    return _worker(device.index).submit(_search_blocks, blocks, device.index, stream).result()


def _search_blocks(blocks: list, index: int, stream) -> list:
    import cupy as cp
    from cuml.neighbors import NearestNeighbors

    out = []
    # this thread's current streams (torch's and CuPy's are per thread) are the caller's torch stream
    with torch.cuda.stream(stream), cp.cuda.Device(index), cp.cuda.Stream.from_external(stream):
        memory.default_cuml_resource(index)
        for q, p, kk in blocks:
            nn = NearestNeighbors(n_neighbors=kk, algorithm="brute", metric="euclidean", output_type="cupy")
            nn.fit(cp.from_dlpack(p))
            _, idx = nn.kneighbors(cp.from_dlpack(q), return_distance=True)
            out.append(torch.from_dlpack(cp.ascontiguousarray(idx)).to(torch.int64))
    return out
