"""DGCNN (Wang et al. 2019): EdgeConv over dynamic kNN graphs, the graph rebuilt in feature space.

Each EdgeConv finds every point's ``k`` nearest neighbours with ``pcops.knn`` on the current
features (3-D coordinates for the first layer, D-dimensional features after it: the torch
backend's feature-space search) and forms edge features ``h(x_i, x_j - x_i)``, max-pooled over
the neighbours. ``h`` is one linear layer, as in the paper's classifier, computed per point,
not per edge: ``W [x_i, x_j - x_i] = (W_1 - W_2) x_i + W_2 x_j``. BatchNorm and LeakyReLU
follow the max over the neighbours (the paper applies them per edge, before it): LeakyReLU is
increasing, so ``max_j LeakyReLU(z_ij) = LeakyReLU(max_j z_ij)``, and only a gather and a max
run per edge, which makes the layer several times cheaper on CPU. The layers' outputs are
concatenated, embedded, max- and mean-pooled, and classified.

forward(points (B, N, 3)) -> logits (B, C).
"""

from __future__ import annotations

import torch
from torch import nn

from pcops import gather, knn

from .pointnet2 import _RowNorm, head


class EdgeConv(nn.Module):
    """LeakyReLU(BN(max_j W_1 x_i + W_2 (x_j - x_i))) over the k nearest neighbours j of i in feature space."""

    def __init__(self, in_features: int, out_features: int, k: int):
        super().__init__()
        self.k = k
        self.centre = nn.Linear(in_features, out_features, bias=False)
        self.edge = nn.Linear(in_features, out_features, bias=False)
        self.norm = _RowNorm(out_features)
        self.act = nn.LeakyReLU(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = knn(x.detach(), x.detach(), self.k, validate=False).idx  # (B, N, k), the point itself first
        neighbour = self.edge(x)  # W_2 x_j
        centre = self.centre(x) - neighbour  # (W_1 - W_2) x_i
        return self.act(self.norm(gather(neighbour, idx, validate=False).max(2).values + centre))


class DGCNN(nn.Module):
    """EdgeConv layers on dynamic graphs, a shared embedding, max + mean pooling, classifier head."""

    def __init__(self, num_classes: int, k: int = 20, widths: list[int] = (32, 32, 64, 128), embed: int = 256, hidden: int = 128, dropout: float = 0.5):
        super().__init__()
        sizes = [3, *widths]
        self.convs = nn.ModuleList(EdgeConv(a, b, k) for a, b in zip(sizes[:-1], sizes[1:]))
        self.embed = nn.Sequential(nn.Linear(sum(widths), embed, bias=False), _RowNorm(embed), nn.LeakyReLU(0.2))
        self.head = head([2 * embed, hidden, num_classes], dropout)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x, outs = points, []
        for conv in self.convs:
            x = conv(x)
            outs.append(x)
        h = self.embed(torch.cat(outs, -1))
        return self.head(torch.cat([h.max(1).values, h.mean(1)], -1))
