"""PyTorch Geometric models on pcops.compat.torch_cluster: PyG's PointNet++ classification example
(PointNetConv + global_max_pool, with fps and radius from pcops) and a small DGCNN (EdgeConv on
knn_graph edges recomputed in feature space) train on the offline shape task and their loss falls.
Skipped where torch_geometric is not installed (``pip install -e ".[pyg]"``)."""

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")

from models.shapes import Shape  # noqa: E402
from pcops.compat.torch_cluster import fps, knn_graph, radius  # noqa: E402

KINDS = ("sphere", "box", "torus", "cylinder")
POINTS = 128


def shape_batch(clouds_per_class: int = 2, seed: int = 0):
    """Packed surface clouds of random shapes (PyG's layout: pos (N, 3), batch (N,), y (B,))."""
    gen = torch.Generator().manual_seed(seed)
    pos, batch, y = [], [], []
    for b in range(clouds_per_class * len(KINDS)):
        label = b % len(KINDS)
        points, _ = Shape.random(gen, kinds=(KINDS[label],)).sample_surface(POINTS, gen)
        points = points - points.mean(0)
        pos.append((points / points.norm(dim=1).max()).float())
        batch.append(torch.full((POINTS,), b))
        y.append(label)
    return torch.cat(pos), torch.cat(batch), torch.tensor(y)


class SAModule(torch.nn.Module):
    """PyG's examples/pointnet2_classification.py set abstraction, verbatim but for the imports."""

    def __init__(self, ratio, r, nn):
        super().__init__()
        self.ratio, self.r = ratio, r
        self.conv = pyg_nn.PointNetConv(nn, add_self_loops=False)

    def forward(self, x, pos, batch):
        idx = fps(pos, batch, ratio=self.ratio)
        row, col = radius(pos, pos[idx], self.r, batch, batch[idx], max_num_neighbors=64)
        edge_index = torch.stack([col, row], dim=0)
        x_dst = None if x is None else x[idx]
        x = self.conv((x, x_dst), (pos, pos[idx]), edge_index)
        return x, pos[idx], batch[idx]


class GlobalSAModule(torch.nn.Module):
    def __init__(self, nn):
        super().__init__()
        self.nn = nn

    def forward(self, x, pos, batch):
        x = self.nn(torch.cat([x, pos], dim=1))
        return pyg_nn.global_max_pool(x, batch)


class PointNet2(torch.nn.Module):
    """The example's network with narrower layers (2 CPU cores)."""

    def __init__(self, classes: int):
        super().__init__()
        self.sa1 = SAModule(0.5, 0.2, pyg_nn.MLP([3, 16, 32]))
        self.sa2 = SAModule(0.25, 0.4, pyg_nn.MLP([32 + 3, 64, 64]))
        self.sa3 = GlobalSAModule(pyg_nn.MLP([64 + 3, 128]))
        self.mlp = pyg_nn.MLP([128, 64, classes], dropout=0.0, norm=None)

    def forward(self, pos, batch):
        x, pos, batch = self.sa1(None, pos, batch)
        x, pos, batch = self.sa2(x, pos, batch)
        return self.mlp(self.sa3(x, pos, batch)).log_softmax(-1)


class DGCNN(torch.nn.Module):
    """Two EdgeConv layers, the second on a kNN graph of the first layer's features (DynamicEdgeConv's edges)."""

    def __init__(self, classes: int, k: int = 12):
        super().__init__()
        self.k = k
        self.conv1 = pyg_nn.EdgeConv(pyg_nn.MLP([2 * 3, 32, 32]), aggr="max")
        self.conv2 = pyg_nn.EdgeConv(pyg_nn.MLP([2 * 32, 64]), aggr="max")
        self.lin = pyg_nn.MLP([32 + 64, 128])
        self.mlp = pyg_nn.MLP([128, 64, classes], dropout=0.0, norm=None)

    def forward(self, pos, batch):
        x1 = self.conv1(pos, knn_graph(pos, self.k, batch))
        x2 = self.conv2(x1, knn_graph(x1, self.k, batch))  # feature space, D = 32
        out = pyg_nn.global_max_pool(self.lin(torch.cat([x1, x2], 1)), batch)
        return self.mlp(out).log_softmax(-1)


def _train(model, steps: int = 8):
    torch.manual_seed(0)
    pos, batch, y = shape_batch()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.nll_loss(model(pos, batch), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_pyg_pointnet2_example_trains_on_pcops_fps_and_radius():
    torch.manual_seed(0)
    losses = _train(PointNet2(len(KINDS)))
    assert sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses


def test_pyg_dgcnn_trains_on_pcops_knn_graph():
    torch.manual_seed(0)
    losses = _train(DGCNN(len(KINDS)))
    assert sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses
