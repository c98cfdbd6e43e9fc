"""kNN with a Warp ``HashGrid``, on CPU and CUDA: search a radius, grow it for queries short of k.

Each query keeps its k best (distance, index) pairs in its output row by insertion, so the
order is exact, ties by the smaller index. A query that found k points within radius R has
its exact k nearest (every point with d <= R is a candidate of the grid query); the others
are searched again with 2R, until R exceeds the diameter of all points.
"""

import functools

import torch
import warp as wp

from ... import _warp
from ._registry import backend


@functools.cache
def _kernel(dtype: torch.dtype):
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)

    @wp.func
    def point(x: wp.array2d(dtype=s), i: int):
        return v(x[i, 0], x[i, 1], x[i, 2])

    @wp.kernel(enable_backward=False)
    def search(
        start: int,
        grid: wp.uint64,
        rows: wp.array(dtype=wp.int64),
        query: wp.array2d(dtype=s),
        ref: wp.array2d(dtype=s),
        radius: s,
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
        found: wp.array(dtype=wp.int32),
    ):
        t = wp.tid() + start
        i = int(rows[t])
        k = dists.shape[1]
        q = point(query, i)
        n = int(0)
        it = wp.hash_grid_query(grid, q, radius)
        j = int(0)
        while wp.hash_grid_query_next(it, j):
            d = wp.length(q - point(ref, j))
            jj = wp.int64(j)
            if d <= radius:
                last = wp.min(n, k - 1)
                if n < k or d < dists[i, last] or (d == dists[i, last] and jj < idx[i, last]):
                    pos = last
                    while pos > 0:
                        pd = dists[i, pos - 1]
                        if pd < d or (pd == d and idx[i, pos - 1] < jj):
                            break
                        dists[i, pos] = pd
                        idx[i, pos] = idx[i, pos - 1]
                        pos = pos - 1
                    dists[i, pos] = d
                    idx[i, pos] = jj
                    n = wp.min(n + 1, k)
        found[t] = n

    return search


def _initial_radius(ref: torch.Tensor, k: int) -> float:
    """A radius expected to hold about k points if ``ref`` filled its bounding box uniformly."""
    side = float((ref.amax(0) - ref.amin(0)).max())
    return max(side * 0.9 * (k / ref.shape[0]) ** (1.0 / 3.0), 1e-12)


@backend("warp", devices=("cpu", "cuda"), requires=("warp",), install="pip install warp-lang")
def search(query: torch.Tensor, ref: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = query.shape[0]
    dists = query.new_empty((m, k))
    idx = torch.empty((m, k), dtype=torch.int64, device=query.device)
    if m == 0:
        return dists, idx
    _warp.init()
    query, ref = query.contiguous(), ref.contiguous()
    kernel = _kernel(query.dtype)
    radius = _initial_radius(ref, k)
    corners = torch.stack([query.amin(0), query.amax(0), ref.amin(0), ref.amax(0)])
    reach = float((corners.amax(0) - corners.amin(0)).double().norm())  # no pair is farther apart
    rows = torch.arange(m, device=query.device)
    with _warp.stream(query):
        while rows.numel():
            grid = _warp.hash_grid(ref, radius)
            found = torch.empty(rows.numel(), dtype=torch.int32, device=query.device)
            args = [wp.uint64(grid.id), rows, query, ref, radius, dists, idx, found]
            _warp.launch(kernel, rows.numel(), args, like=query)
            rows = rows[found < k]
            if radius > reach:
                break
            radius *= 2.0
    if rows.numel():
        raise RuntimeError(f"knn (warp): {rows.numel()} queries found fewer than k={k} points within the cloud's reach")
    return dists, idx
