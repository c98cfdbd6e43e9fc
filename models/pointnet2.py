"""PointNet (the baseline without grouping) and PointNet++ (single-scale grouping) from pcops ops.

All networks take padded clouds ``points`` (B, N, 3) and return logits: (B, C) for
classification, (B, N, C) for segmentation.

* :class:`PointNet` - a shared MLP on every point's coordinates and a max pool over the cloud
  (Qi et al. 2017, without the input/feature transforms): no neighbourhoods at all.
* :class:`PointNetSeg` - its segmentation form: the same shared MLP, the cloud's max-pooled
  feature concatenated to every point's feature, and a per-point head: no neighbourhoods.
* :class:`PointNet2` - PointNet++ SSG (Qi et al. 2017b): set-abstraction levels, each
  ``pcops.farthest_point_sample`` centroids, ``pcops.ball_query`` neighbourhoods (the closest
  ``k`` points within the radius), a shared MLP on [offset / radius, features] and a max pool
  per neighbourhood; then a global level (MLP + max pool over the remaining centroids).
* :class:`PointNet2Seg` - the same encoder with feature propagation: each level's features are
  interpolated back onto the level above with ``pcops.knn_interpolate`` (inverse distance, 3
  neighbours), concatenated with that level's skip features and mixed by a shared MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from pcops import ball_query, farthest_point_sample, gather, knn_interpolate


class SharedMLP(nn.Sequential):
    """Linear + BatchNorm + ReLU layers applied to the last dimension of (..., C) tensors."""

    def __init__(self, sizes: list[int]):
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b, bias=False), _RowNorm(b), nn.ReLU()]
        super().__init__(*layers)


class _RowNorm(nn.BatchNorm1d):
    """BatchNorm1d over every leading position of a (..., C) tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def head(sizes: list[int], dropout: float) -> nn.Sequential:
    """Classifier head: hidden layers with BatchNorm, ReLU and dropout, then a plain Linear."""
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-2], sizes[1:-1]):
        layers += [nn.Linear(a, b, bias=False), nn.BatchNorm1d(b), nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1]))


class PointNet(nn.Module):
    """Shared MLP on coordinates + global max pool + classifier head (no grouping)."""

    def __init__(self, num_classes: int, widths: list[int] = (64, 128, 256), hidden: int = 128, dropout: float = 0.3):
        super().__init__()
        self.mlp = SharedMLP([3, *widths])
        self.head = head([widths[-1], hidden, num_classes], dropout)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(points).max(1).values)


class PointNetSeg(nn.Module):
    """Per-point shared MLP, the global max feature concatenated to each point, a per-point head (no grouping)."""

    def __init__(self, num_classes: int, widths: list[int] = (64, 128, 256), head_widths: list[int] = (128, 64), dropout: float = 0.3):
        super().__init__()
        self.mlp = SharedMLP([3, *widths])
        self.head = SharedMLP([2 * widths[-1], *head_widths])
        self.classify = nn.Sequential(nn.Dropout(dropout), nn.Linear(head_widths[-1], num_classes))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        f = self.mlp(points)  # (B, N, W)
        g = f.max(1, keepdim=True).values.expand_as(f)  # the cloud's feature, beside every point's own
        return self.classify(self.head(torch.cat([f, g], -1)))


class SetAbstraction(nn.Module):
    """FPS centroids, ball-query neighbourhoods, shared MLP on [offset / radius, features], max pool."""

    def __init__(self, centroids: int, radius: float, k: int, in_features: int, widths: list[int]):
        super().__init__()
        self.centroids, self.radius, self.k = centroids, radius, k
        self.mlp = SharedMLP([3 + in_features, *widths])

    def forward(self, xyz: torch.Tensor, features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        centres = farthest_point_sample(xyz, self.centroids).points  # (B, S, 3)
        _, idx, _ = ball_query(centres, xyz, self.radius, self.k)  # (B, S, k), -1 past the neighbours found
        # Fewer than k neighbours: the empty slots repeat the closest one (as PointNet++ does), which
        # leaves the max unchanged and keeps far-away rows out of the BatchNorm statistics.
        first = idx[..., :1]  # the closest neighbour: the centre itself, unless it is FPS padding
        safe = torch.where(idx >= 0, idx, first).clamp_min(0)
        grouped = (gather(xyz, safe, validate=False) - centres[:, :, None, :]) / self.radius
        if features is not None:
            grouped = torch.cat([grouped, gather(features, safe, validate=False)], -1)
        h = self.mlp(grouped).max(2).values
        return centres, torch.where(first >= 0, h, 0)  # a padding centre (cloud smaller than S): zeros


class GlobalAbstraction(nn.Module):
    """Shared MLP on [xyz, features] of all points and a max pool: one vector per cloud."""

    def __init__(self, in_features: int, widths: list[int]):
        super().__init__()
        self.mlp = SharedMLP([3 + in_features, *widths])

    def forward(self, xyz: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([xyz, features], -1)).max(1).values


def _levels(levels: list[tuple[int, float, int, list[int]]]) -> nn.ModuleList:
    modules, width = [], 0
    for centroids, radius, k, widths in levels:
        modules.append(SetAbstraction(int(centroids), float(radius), int(k), width, list(widths)))
        width = widths[-1]
    return nn.ModuleList(modules)


# (centroids, radius, neighbours, MLP widths) per level, for clouds in the unit ball
CLS_LEVELS = [(128, 0.2, 16, [32, 32, 64]), (32, 0.4, 16, [64, 64, 128])]
SEG_LEVELS = [(256, 0.15, 16, [32, 32, 64]), (64, 0.35, 16, [64, 64, 128])]


class PointNet2(nn.Module):
    """PointNet++ SSG classifier: set-abstraction levels, a global level, a classifier head."""

    def __init__(self, num_classes: int, levels=CLS_LEVELS, global_widths: list[int] = (128, 256), hidden: int = 128, dropout: float = 0.3):
        super().__init__()
        self.levels = _levels(levels)
        self.global_level = GlobalAbstraction(levels[-1][3][-1], list(global_widths))
        self.head = head([global_widths[-1], hidden, num_classes], dropout)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        xyz, features = points, None
        for level in self.levels:
            xyz, features = level(xyz, features)
        return self.head(self.global_level(xyz, features))


class PointNet2Seg(nn.Module):
    """PointNet++ SSG segmentation: the encoder above, feature propagation back to every point.

    ``fp_widths`` has one width per propagation step, from the coarsest level to the input
    points (len(levels) + 1 steps); each step's MLP sees [propagated features, skip features]
    (the skip features of the input points are their coordinates).
    """

    def __init__(self, num_classes: int, levels=SEG_LEVELS, global_widths: list[int] = (128, 256), fp_widths: list[int] = (128, 128, 64), dropout: float = 0.3):
        super().__init__()
        if len(fp_widths) != len(levels) + 1:
            raise ValueError(f"fp_widths needs len(levels) + 1 = {len(levels) + 1} widths, got {list(fp_widths)}")
        self.levels = _levels(levels)
        self.global_level = GlobalAbstraction(levels[-1][3][-1], list(global_widths))
        skips = [3] + [widths[-1] for *_, widths in levels]
        self.propagate = nn.ModuleList()
        width_in = global_widths[-1]
        for skip, width in zip(reversed(skips), fp_widths):
            self.propagate.append(SharedMLP([width_in + skip, width, width]))
            width_in = width
        self.classify = nn.Sequential(nn.Dropout(dropout), nn.Linear(width_in, num_classes))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        xyzs, feats = [points], [points]  # the input level's skip features are its coordinates
        for level in self.levels:
            xyz, f = level(xyzs[-1], None if len(xyzs) == 1 else feats[-1])
            xyzs.append(xyz)
            feats.append(f)
        coarsest = len(xyzs) - 1
        h = self.global_level(xyzs[-1], feats[-1])[:, None, :].expand(-1, xyzs[-1].shape[1], -1)
        for mlp, i in zip(self.propagate, range(coarsest, -1, -1)):
            if i < coarsest:  # inverse-distance interpolation of the coarser level onto this one
                h = knn_interpolate(xyzs[i], xyzs[i + 1], h, k=3)
            h = mlp(torch.cat([h, feats[i]], -1))
        return self.classify(h)
