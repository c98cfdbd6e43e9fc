"""kNN in feature space: DGCNN's dynamic graphs, B clouds of n points with D features each.

Run through ``scripts/benchmark.py --only small`` (``--quick``: B = 2, 256 points, D = 32). Each
row is ``pcops.knn(x, x, k)`` on a (B, n, D) batch (the torch backend: candidates from the Gram
form, ranked by direct differences, ties by the smaller index) against what a user writes without
pcops: ``torch.cdist`` + ``topk``, and DGCNN's own formula (``-|x_i|^2 + 2 x_i . x_j - |x_j|^2``,
``topk`` of the largest), forward, no gradient, quiet, in turns (``bench_timer.median_ms``). The
peers' matrix products round, so on near ties their neighbours may differ from the exact ones;
pcops' are checked against float64 brute force on the first cloud before timing.
"""

from __future__ import annotations

import torch

import pcops
from bench_timer import median_ms
from tests import reference

K = 20  # DGCNN's default


def _cdist_topk(x: torch.Tensor, k: int):
    return torch.cdist(x, x).topk(k, dim=-1, largest=False)


def _dgcnn_formula(x: torch.Tensor, k: int):
    inner = 2 * x @ x.transpose(1, 2)
    square = x.square().sum(-1, keepdim=True)
    return (inner - square - square.transpose(1, 2)).topk(k, dim=-1)


def _check(x: torch.Tensor, idx: torch.Tensor) -> None:
    """pcops' neighbours of the first cloud equal float64 brute force's (ties by the smaller index)."""
    if not torch.equal(idx[0], reference.knn(x[0], x[0], idx.shape[-1])[1]):
        raise AssertionError("pcops.knn in feature space disagrees with float64 brute force")


def run(quick: bool = False) -> list[dict]:
    shapes = [(2, 256, 32)] if quick else [(16, 1024, 32), (16, 1024, 64), (32, 256, 32), (32, 256, 64)]
    timer = dict(repeats=3 if quick else 7, budget_s=2.0 if quick else 20.0)
    rows = []
    for b, n, dim in shapes:
        x = torch.randn(b, n, dim, generator=torch.Generator().manual_seed(dim))
        _check(x, pcops.knn(x, x, K).idx)
        fns = {"pcops": lambda: pcops.knn(x, x, K), "torch_cdist_topk": lambda: _cdist_topk(x, K),
               "dgcnn_formula": lambda: _dgcnn_formula(x, K)}
        ms = median_ms(fns, **timer)
        rows.append({"bench": "knn_features", "clouds": b, "points": n, "dim": dim, "k": K, "neighbour": "quiet", "ms": ms})
        print(f"features knn B={b} n={n} D={dim} k={K} " + "  ".join(f"{k} {v:.2f}" for k, v in ms.items()), flush=True)
    return rows
