"""A batch of small clouds: PointNet++'s grouping block on B = 32 clouds of 1,024 points.

Run through ``scripts/benchmark.py --only small`` (``--quick``: B = 4, 256 points). The block, as
PointNet++ SSG runs it on each level: farthest point sampling to half the points, a ball query
(radius 0.2 in the unit cube, K = 32, short lists padded with the closest neighbour), a shared
MLP on [offset / radius, the neighbour's 32 features] max-pooled per centroid, and inverse
distance interpolation (k = 3) of the pooled features back onto every point. The same module
runs on two sets of ops:

* ``pcops``: ``farthest_point_sample``, ``ball_query``, ``gather``, ``knn_interpolate``;
* ``torch_dense``: the formulation a user writes without pcops (PointNet++'s reference code in
  torch): an FPS loop over the picks, batched over the clouds; ``torch.cdist`` + ``topk`` + a
  mask for the ball; advanced indexing for the gather; ``cdist`` + ``topk`` for the interpolation.
  ``cdist`` as users call it (a matrix product at these sizes, whose rounding can move a point at
  the radius in or out of a ball); the check runs it with exact differences.

Each is timed forward (no gradients) and as a train step (forward, backward, an SGD step), quiet,
in turns (``bench_timer.median_ms``); pcops' answer equals the exact dense one (checked before timing).
"""

from __future__ import annotations

import torch
from torch import nn

import pcops
from bench_timer import median_ms

RADIUS, K, FEATURES, WIDTHS = 0.2, 32, 32, (64, 64)


class PcopsOps:
    @staticmethod
    def fps(xyz: torch.Tensor, s: int) -> torch.Tensor:
        return pcops.farthest_point_sample(xyz, s, start_idx=0).points

    @staticmethod
    def ball(centres: torch.Tensor, xyz: torch.Tensor) -> torch.Tensor:
        return pcops.ball_query(centres, xyz, RADIUS, K).idx

    @staticmethod
    def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return pcops.gather(x, idx, validate=False)

    @staticmethod
    def interpolate(xyz: torch.Tensor, centres: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return pcops.knn_interpolate(xyz, centres, f, 3)


class DenseOps:
    cdist = staticmethod(torch.cdist)  # the default: a matrix product where the sizes are large

    @staticmethod
    def fps(xyz: torch.Tensor, s: int) -> torch.Tensor:
        b, n, _ = xyz.shape
        rows = torch.arange(b)
        picks = torch.empty(b, s, dtype=torch.int64)
        nearest = torch.full((b, n), float("inf"), dtype=xyz.dtype)
        far = torch.zeros(b, dtype=torch.int64)
        for i in range(s):
            picks[:, i] = far
            nearest = torch.minimum(nearest, (xyz - xyz[rows, far][:, None]).square().sum(-1))
            far = nearest.argmax(-1)
        return xyz[rows[:, None], picks]

    @classmethod
    def ball(cls, centres: torch.Tensor, xyz: torch.Tensor) -> torch.Tensor:
        d, idx = cls.cdist(centres, xyz).topk(K, dim=-1, largest=False)
        return torch.where(d <= RADIUS, idx, -1)

    @staticmethod
    def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x[torch.arange(x.shape[0])[:, None, None], idx]

    @classmethod
    def interpolate(cls, xyz: torch.Tensor, centres: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        d, idx = cls.cdist(xyz, centres).topk(3, dim=-1, largest=False)
        w = 1.0 / d.square().clamp_min(1e-16)
        w = w / w.sum(-1, keepdim=True)
        return (f[torch.arange(f.shape[0])[:, None, None], idx] * w[..., None]).sum(-2)


class ExactDenseOps(DenseOps):
    """The dense formulation with cdist's exact differences: the check's reference (the matrix
    product's rounding moves points at the radius in or out of a ball)."""

    @staticmethod
    def cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


class Grouping(nn.Module):
    def __init__(self, ops, centroids: int):
        super().__init__()
        self.ops, self.centroids = ops, centroids
        layers, width = [], 3 + FEATURES
        for w in WIDTHS:
            layers += [nn.Linear(width, w), nn.ReLU()]
            width = w
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        centres = ops.fps(xyz, self.centroids)
        idx = ops.ball(centres, xyz)
        safe = torch.where(idx >= 0, idx, idx[..., :1])  # the centre is a point of the cloud: never -1
        grouped = torch.cat([(ops.gather(xyz, safe) - centres[:, :, None]) / RADIUS, ops.gather(features, safe)], -1)
        pooled = self.mlp(grouped).max(2).values
        return ops.interpolate(xyz, centres, pooled)


def run(quick: bool = False) -> list[dict]:
    b, n = (4, 256) if quick else (32, 1024)
    gen = torch.Generator().manual_seed(0)
    xyz = torch.rand(b, n, 3, generator=gen)
    feats = torch.randn(b, n, FEATURES, generator=gen)
    torch.manual_seed(0)
    ours = Grouping(PcopsOps, n // 2)
    dense = Grouping(DenseOps, n // 2)
    dense.load_state_dict(ours.state_dict())
    exact = Grouping(ExactDenseOps, n // 2)
    exact.load_state_dict(ours.state_dict())
    with torch.no_grad():
        a, d = ours(xyz, feats), exact(xyz, feats)
    if not torch.allclose(a, d, rtol=1e-4, atol=1e-4):
        raise AssertionError(f"the two groupings disagree: {float((a - d).abs().max())}")

    def step(model, opt):
        def run_step():
            opt.zero_grad()
            model(xyz, feats).square().mean().backward()
            opt.step()

        return run_step

    def forward(model):
        def run_forward():
            with torch.no_grad():
                return model(xyz, feats)

        return run_forward

    rows = []
    timer = dict(repeats=3 if quick else 9, budget_s=2.0 if quick else 15.0)
    for mode in ("forward", "train_step"):
        if mode == "forward":
            fns = {"pcops": forward(ours), "torch_dense": forward(dense)}
        else:
            fns = {"pcops": step(ours, torch.optim.SGD(ours.parameters(), lr=1e-3)),
                   "torch_dense": step(dense, torch.optim.SGD(dense.parameters(), lr=1e-3))}
        ms = median_ms(fns, **timer)
        rows.append({"bench": "pointnet2_grouping", "mode": mode, "clouds": b, "points": n, "neighbour": "quiet", "ms": ms})
        print(f"grouping {mode:10s} B={b} n={n} " + "  ".join(f"{k} {v:.2f}" for k, v in ms.items()), flush=True)
    return rows
