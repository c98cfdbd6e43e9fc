"""kNN with a Warp ``HashGrid``, on CPU and CUDA: search a radius, grow it for queries short of k.

Each query keeps its k best (distance, index) pairs in its output row by insertion, so the
order is exact, ties by the smaller index. A query that found k points within radius R has
its exact k nearest (every point with d <= R is a candidate of the grid query); the others
are searched again with 2R, until R exceeds the diameter of all points. Groups (batches) use
Warp's grouped ``HashGrid``: a query only visits its own sample's points, and needs
min(k, size of its sample) of them; missing neighbours are -1 / inf.
"""

import math

import torch
import warp as wp

from ... import _warp
from ._registry import backend


@_warp.kernels
def _kernel(dtype: torch.dtype, grouped: bool):
    s = _warp.scalar(dtype)
    point, neighbours = _warp.kernel_funcs(dtype, grouped)

    @wp.kernel(enable_backward=False, module="unique")
    def search(
        start: int,
        grid: wp.uint64,
        rows: wp.array(dtype=wp.int64),
        query_group: wp.array(dtype=wp.int32),
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
        it = neighbours(grid, q, radius, query_group, i)
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


def _box(points: torch.Tensor) -> list[torch.Tensor]:
    """Lower and upper corner of the finite rows of ``points`` (+inf / -inf where there are none)."""
    finite = torch.isfinite(points).all(1, keepdim=True)
    return [torch.where(finite, points, float("inf")).amin(0), torch.where(finite, points, float("-inf")).amax(0)]


def _radii(query: torch.Tensor, ref: torch.Tensor, k: int, ref_group) -> tuple[float, float, bool]:
    """(first radius, reach, all finite): about 3k points if each sample filled ref's bounding box
    uniformly, and the diagonal of all finite points' bounding box (no finite pair is farther
    apart, so the search always ends, even on NaN/inf points). One host read."""
    finite = torch.isfinite(query).all() & torch.isfinite(ref).all()
    corners = torch.stack([*_box(ref), *_box(query), finite.expand(3)]).double().cpu()
    box = corners[:4].nan_to_num(posinf=0.0, neginf=0.0)  # no finite point: an empty box
    side = float((box[1] - box[0]).clamp_min(0).max())
    reach = float((box.amax(0) - box.amin(0)).norm())
    samples = 1 if ref_group is None else torch.unique(ref_group).numel()
    return max(side * 0.9 * (k * samples / ref.shape[0]) ** (1.0 / 3.0), 1e-12), reach, bool(corners[4, 0])


def _targets(k: int, query_group, ref_group, m: int, device) -> torch.Tensor:
    """How many neighbours each query can have: k, or the size of its group if smaller."""
    if query_group is None:
        return torch.full((m,), k, dtype=torch.int32, device=device)
    sizes = torch.sort(ref_group).values
    count = torch.searchsorted(sizes, query_group, right=True) - torch.searchsorted(sizes, query_group)
    return count.clamp(max=k).to(torch.int32)


@backend("warp", devices=("cpu", "cuda"), requires=("warp",), install="pip install warp-lang")
def search(query, ref, k, query_group, ref_group):
    m = query.shape[0]
    dists = query.new_full((m, k), float("inf"))
    idx = torch.full((m, k), -1, dtype=torch.int64, device=query.device)
    if m == 0:
        return dists, idx
    _warp.init()
    query, ref = query.contiguous(), ref.contiguous()
    grouped = query_group is not None
    kernel = _kernel(query.dtype, grouped)
    target = _targets(k, query_group, ref_group, m, query.device)
    groups = query_group.contiguous() if grouped else torch.zeros(1, dtype=torch.int32, device=query.device)
    ref_groups = ref_group.contiguous() if grouped else None
    radius, reach, finite = _radii(query, ref, k, ref_group)
    rows = torch.arange(m, device=query.device)[target > 0]
    with _warp.stream(query):
        while rows.numel():
            grid = _warp.hash_grid(ref, radius, ref_groups)
            found = torch.empty(rows.numel(), dtype=torch.int32, device=query.device)
            args = [wp.uint64(grid.id), rows, groups, query, ref, radius, dists, idx, found]
            _warp.launch(kernel, rows.numel(), args, like=query)
            _warp.keep_alive(grid, query)
            rows = rows[found < target[rows]]
            if not radius <= reach or math.isinf(radius):  # past every finite pair (or overflowed): done
                break
            radius *= 2.0
    if rows.numel() and finite:  # NaN/inf points are never neighbours (validate=False): -1 / inf
        raise RuntimeError(f"knn (warp): {rows.numel()} queries found fewer than k={k} points within the cloud's reach")
    return dists, idx
