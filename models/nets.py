"""Plain ``nn.Module`` networks built from pcops' public layers (no Lightning here)."""

from __future__ import annotations

import torch
from torch import nn

from pcops import KNNAggregation, RadiusAggregation


def mlp(sizes: list[int], act=nn.GELU) -> nn.Sequential:
    """Linear layers with an activation between them (none after the last)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


class Projector(nn.Module):
    """The tutorial's projector: MLP on the cloud's coordinates, aggregation onto the queries, MLP out.

    ``aggregation`` is a pcops layer (``KNNAggregation`` or ``RadiusAggregation``).
    forward(points (B, N, 3), queries (B, M, 3)) -> (B, M, out_dim).
    """

    def __init__(self, aggregation: nn.Module, hidden: int = 25, out_dim: int = 1):
        super().__init__()
        self.encode = mlp([3, hidden, hidden])
        self.aggregate = aggregation
        self.decode = mlp([hidden, hidden, out_dim])

    def forward(self, points: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        return self.decode(self.aggregate(queries, points, self.encode(points)))


def knn_projector(k: int = 7, sigma: float = 0.1, hidden: int = 25, out_dim: int = 1, backend: str = "auto") -> Projector:
    return Projector(KNNAggregation(k, sigma=sigma, backend=backend, validate=False), hidden, out_dim)


def radius_projector(radius: float = 0.1, sigma: float = 0.1, hidden: int = 25, out_dim: int = 1) -> Projector:
    return Projector(RadiusAggregation(radius, sigma=sigma, validate=False), hidden, out_dim)


class SDFNet(nn.Module):
    """Signed distance at query points from an oriented surface cloud, at several kNN scales.

    Each reference point carries [p, n, p.n, h(p, n)] (h a learned embedding). For every scale,
    ``KNNAggregation`` gives each query the softmax(-d/sigma)-weighted means of those over its k
    nearest surface points; since the means are linear, the query derives from them its offset
    to the local centroid ``q - mean(p)``, the local normal ``mean(n)`` and the plane distance
    ``q . mean(n) - mean(p . n)`` (a first-order signed distance), plus the learned features.
    An MLP maps all scales' features to the signed distance.

    forward(points (B, N, 3), normals (B, N, 3), queries (B, M, 3)) -> (B, M).
    """

    def __init__(self, hidden: int = 32, scales: list[tuple[int, float]] = ((8, 0.02), (24, 0.1)), backend: str = "auto"):
        super().__init__()
        self.embed = mlp([6, hidden, hidden])
        self.scales = nn.ModuleList(
            KNNAggregation(int(k), sigma=float(s), learnable_sigma=True, backend=backend, validate=False) for k, s in scales
        )
        self.head = mlp([3 + len(self.scales) * (8 + hidden), 2 * hidden, hidden, 1])

    def forward(self, points: torch.Tensor, normals: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        pn = (points * normals).sum(-1, keepdim=True)
        ref = torch.cat([points, normals, pn, self.embed(torch.cat([points, normals], -1))], -1)
        features = [queries]
        for agg in self.scales:
            a = agg(queries, points, ref)
            p_mean, n_mean, pn_mean, h = a[..., :3], a[..., 3:6], a[..., 6:7], a[..., 7:]
            offset = queries - p_mean
            plane = (queries * n_mean).sum(-1, keepdim=True) - pn_mean
            features += [offset, n_mean, plane, offset.norm(dim=-1, keepdim=True), h]
        return self.head(torch.cat(features, -1)).squeeze(-1)
