"""A first pcops run: radius aggregation of a random cloud onto a grid, eager and compiled.

    python scripts/example.py
"""

import time

import torch

import pcops


def main() -> None:
    torch.manual_seed(0)
    ref = torch.rand(20_000, 3) * 2 - 1
    features = torch.sin(3 * ref).sum(1, keepdim=True)  # a smooth field sampled on the cloud
    axis = torch.linspace(-1, 1, 20)
    query = torch.cartesian_prod(axis, axis, axis)  # 8,000 grid points
    layer = pcops.RadiusAggregation(radius=0.1, sigma=0.05)

    layer(query, ref, features)  # warm-up: loads (or compiles once) the Warp kernels
    start = time.perf_counter()
    out = layer(query, ref, features)
    eager_ms = 1e3 * (time.perf_counter() - start)
    truth = torch.sin(3 * query).sum(1, keepdim=True)
    print(f"radius_aggregate: {ref.shape[0]} points -> {query.shape[0]} queries in {eager_ms:.1f} ms (eager)")
    print(f"mean |smoothed field - true field| on the grid: {(out - truth).abs().mean():.4f}")

    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(query, ref, features), out)
    print("torch.compile(fullgraph=True) result matches eager")


if __name__ == "__main__":
    main()
