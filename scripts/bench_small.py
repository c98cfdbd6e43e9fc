"""Small clouds: one cloud per call, 16 to 4,096 points, quiet and next to a busy process.

Run through ``scripts/benchmark.py --only small`` (``--quick``: 16 and 256 points). Each row is
one op at one size, its ``ms`` the medians of pcops and its peers taken in turns
(``bench_timer.median_ms``), all on the same threads (torch's default, pykdtree's OpenMP,
cKDTree's ``workers=-1``):

* ``knn`` (self-query, k = 4 at 16 points, 8 at 256, 16 above): ``pcops.knn`` against pykdtree,
  scipy ``cKDTree.query`` and the dense torch formulation (``torch.cdist`` + ``topk``);
* ``ball_query`` (K = 32, a radius holding about 32 points on average): ``pcops.ball_query``
  against ``cKDTree.query(k=K, distance_upper_bound=r)`` (the K closest within the radius, the
  same answer without the counts) and the dense torch formulation (``cdist``, ``topk``, a mask).

``neighbour``: ``quiet``, or ``busy`` with one other process spinning a core for the whole row
(a DataLoader worker, a second job): the row's ratio to its quiet twin is what a shared machine
costs each library. Peers are imported lazily; a missing one leaves its column out.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import torch

import pcops
from bench_timer import median_ms

SIZES = (16, 256, 1024, 4096)
QUICK_SIZES = (16, 256)
BALL_K = 32


def _k(n: int) -> int:
    return 4 if n <= 16 else 8 if n <= 256 else 16


def _radius(n: int) -> float:
    """About BALL_K points of n uniform ones in the unit cube within it."""
    return (3 * BALL_K / (4 * torch.pi * n)) ** (1 / 3)


@contextlib.contextmanager
def _neighbour(kind: str):
    """A process spinning one core while the block runs (``busy``), or nothing (``quiet``)."""
    if kind == "quiet":
        yield
        return
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)  # let it take its core
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def _peers(points: torch.Tensor, op: str, n: int) -> dict:
    """{name: function} of the peers of ``op`` on one cloud that import here."""
    out, x = {}, points.numpy()
    k = _k(n)
    with contextlib.suppress(ImportError):
        from scipy.spatial import cKDTree

        if op == "knn":
            out["cKDTree"] = lambda: cKDTree(x).query(x, k=k, workers=-1)
        else:
            out["cKDTree"] = lambda: cKDTree(x).query(x, k=min(BALL_K, n), distance_upper_bound=_radius(n), workers=-1)
    if op == "knn":
        with contextlib.suppress(ImportError):
            from pykdtree.kdtree import KDTree

            out["pykdtree"] = lambda: KDTree(x).query(x, k=k)
        out["torch_cdist_topk"] = lambda: torch.cdist(points, points).topk(k, dim=1, largest=False)
    else:
        def dense():
            d, idx = torch.cdist(points, points).topk(min(BALL_K, n), dim=1, largest=False)
            inside = d <= _radius(n)
            return torch.where(inside, d, float("inf")), torch.where(inside, idx, -1)

        out["torch_cdist_topk"] = dense
    return out


def _ours(points: torch.Tensor, op: str, n: int):
    if op == "knn":
        return lambda: pcops.knn(points, points, _k(n))
    return lambda: pcops.ball_query(points, points, _radius(n), BALL_K)


def run(quick: bool = False) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    sizes = QUICK_SIZES if quick else SIZES
    for neighbour in ("quiet", "busy"):
        with _neighbour(neighbour):
            for op in ("knn", "ball_query"):
                for n in sizes:
                    points = torch.rand(n, 3, generator=gen)
                    fns = {"pcops": _ours(points, op, n), **_peers(points, op, n)}
                    ms = median_ms(fns, repeats=3 if quick else 15, budget_s=2.0 if quick else 10.0, min_s=0.05 if quick else 0.5)
                    rows.append({"bench": op, "points": n, "neighbour": neighbour, "ms": ms})
                    print(f"small {op:10s} n={n:5d} {neighbour:5s} " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items()), flush=True)
    return rows
