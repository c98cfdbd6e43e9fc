"""Voxel and sparse-convolution benchmarks: pcops against the same work written in torch.

Run through ``scripts/benchmark.py --only sparse`` (``--quick`` shrinks them). Rows are medians
of forward times (and train steps for the convolution), each pair interleaved; the ratio
torch / pcops is what to read (> 1: pcops is faster).

* grid_sample (mode "first"): ``pcops.grid_sample`` against ``torch.unique(keys,
  return_inverse=True)`` on the packed int64 voxel keys (floor, per-cloud shift, packing in
  torch) plus the first index per voxel (``scatter_reduce`` amin), on ``uniform`` and
  ``surface`` clouds (``bench_search.cloud``) and the real meshes of ``bench_meshes.py``
  sampled as clouds, about 8 points per voxel were the cloud uniform in its box.
* sparse_kernel_map (K = 3): pcops' sort-and-walk map against a torch sort + ``searchsorted`` of the
  same packed keys, on the voxelised clouds.
* sparse_conv3d (K = 3, Cin = Cout = 32): forward, and train step (forward + backward to features
  and weight), against a per-offset gather + matmul + ``index_add`` in torch on the same kernel map.
"""

from __future__ import annotations

import torch

import bench_meshes
import bench_search
import pcops
from bench_timer import median_ms

CLOUDS = ("uniform", "surface")


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median ms of each function (rounded to microseconds), the functions taking turns: bench_timer.median_ms."""
    return {name: round(ms, 3) for name, ms in median_ms(fns, repeats=repeats, budget_s=float("inf")).items()}


def torch_grid_sample(points: torch.Tensor, size: float):
    """Voxel keys in torch, torch.unique(return_inverse=True), the first point of each voxel."""
    cells = torch.floor(points.double() / size).long()
    cells -= cells.amin(0)
    span = cells.amax(0) + 1
    key = (cells[:, 0] * span[1] + cells[:, 1]) * span[2] + cells[:, 2]
    unique, inverse = torch.unique(key, return_inverse=True)
    first = torch.full_like(unique, points.shape[0]).scatter_reduce(0, inverse, torch.arange(points.shape[0]), "amin")
    return points[first], inverse, first


def torch_kernel_map(coords: torch.Tensor) -> torch.Tensor:
    """(27, N) neighbour table of unique coords by sort + searchsorted of packed keys."""
    c = coords - coords.amin(0) + 1
    span = c.amax(0) + 2
    key = (c[:, 0] * span[1] + c[:, 1]) * span[2] + c[:, 2]
    sorted_key, order = torch.sort(key)
    r = torch.arange(-1, 2)
    off = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3)
    query = ((off[:, 0] * span[1] + off[:, 1]) * span[2] + off[:, 2])[:, None] + key[None]
    pos = torch.searchsorted(sorted_key, query).clamp_max(key.shape[0] - 1)
    return torch.where(sorted_key[pos] == query, order[pos], -1)


def torch_sparse_conv(features, weight, km):
    """Per-offset gather + matmul + index_add in torch on a pcops kernel map."""
    out = features.new_zeros((features.shape[0], weight.shape[2]))
    start = 0
    for k, count in enumerate(km.counts.tolist()):
        rows, cols = km.out_index[start : start + count], km.in_index[start : start + count]
        out = out.index_add(0, rows, features.index_select(0, cols) @ weight[k])
        start += count
    return out


def run(quick: bool = False) -> list[dict]:
    n = 5_000 if quick else 200_000
    repeats = 2 if quick else 5
    channels = 8 if quick else 32
    rows = []
    for shape in ("uniform",) if quick else CLOUDS + bench_meshes.clouds():
        points = bench_search.cloud(shape, n, 11)
        size = (8 * float((points.amax(0) - points.amin(0)).prod()) / n) ** (1 / 3)
        ms = _interleaved({"pcops": lambda: pcops.grid_sample(points, size, validate=False),
                           "torch_unique": lambda: torch_grid_sample(points, size)}, repeats)
        sampled = pcops.grid_sample(points, size, validate=False)
        assert torch.equal(sampled.inverse, torch_grid_sample(points, size)[1])
        rows.append({"bench": "grid_sample", "cloud": shape, "n": n, "sites": int(sampled.grid_coord.shape[0]), "ms": ms})

        coords = sampled.grid_coord
        ms = _interleaved({"pcops": lambda: pcops.sparse_kernel_map(coords), "torch_searchsorted": lambda: torch_kernel_map(coords)}, repeats)
        km = pcops.sparse_kernel_map(coords)
        assert torch.equal(km.neighbours, torch_kernel_map(coords))
        sites = coords.shape[0]
        rows.append({"bench": "sparse_kernel_map", "cloud": shape, "n": sites, "pairs_per_site": round(int(km.counts.sum()) / sites, 2), "ms": ms})

        gen = torch.Generator().manual_seed(3)
        feats = torch.randn(sites, channels, generator=gen).requires_grad_()
        weight = (torch.randn(27, channels, channels, generator=gen) / (27 * channels) ** 0.5).requires_grad_()
        ours = lambda: pcops.sparse_conv3d(feats, None, weight, kernel_map=km, validate=False)  # noqa: E731
        peer = lambda: torch_sparse_conv(feats, weight, km)  # noqa: E731
        with torch.no_grad():
            torch.testing.assert_close(ours(), peer(), rtol=1e-4, atol=1e-4)
            ms = _interleaved({"pcops": ours, "torch_index_add": peer}, repeats)
        rows.append({"bench": "sparse_conv3d_forward", "cloud": shape, "n": sites, "channels": channels, "ms": ms})
        ms = _interleaved({"pcops": lambda: ours().square().mean().backward(), "torch_index_add": lambda: peer().square().mean().backward()}, repeats)
        rows.append({"bench": "sparse_conv3d_train_step", "cloud": shape, "n": sites, "channels": channels, "ms": ms})
    for r in rows:
        peer = next(name for name in r["ms"] if name != "pcops")
        ratio = r["ms"][peer] / r["ms"]["pcops"]
        print(f"{r['bench']:<25} {r['cloud']:<8} n={r['n']:>8,}  pcops {r['ms']['pcops']:>9,.1f} ms  {peer} {r['ms'][peer]:>9,.1f} ms  "
              f"{peer} / pcops {ratio:.2f}", flush=True)
    return rows


if __name__ == "__main__":
    import sys

    run("--quick" in sys.argv)
