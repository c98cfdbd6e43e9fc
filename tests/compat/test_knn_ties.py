"""Ties by the smaller index, as documented, where every query has ties: points on an integer
lattice, against a float64 brute force ordered by a stable sort (distance, then index).

The L1 search on the CPU is scipy's kd-tree, which returns any of the tied points; pcops picks
the smallest index among them. A wrong pick changes no distance, but it changes which
neighbour's normal ``chamfer_distance`` compares with, so the normals loss checks it too."""

import pytest
import torch
import torch.nn.functional as F

from pcops.compat import pytorch3d as p3


def _lattice(gen, n, p, low, high):
    """(n, p, 3) float32 integer points in [low, high): many equal distances."""
    return torch.randint(low, high, (n, p, 3), generator=gen).to(torch.float32)


def _brute(p1, p2, K, norm, lengths2):
    """(N, P1, K) float64 distances and indices, by a stable sort of each row's distances."""
    diff = p1.double()[:, :, None] - p2.double()[:, None]
    d = diff.square().sum(-1) if norm == 2 else diff.abs().sum(-1)
    pad = torch.arange(p2.shape[1])[None, None] >= lengths2[:, None, None]
    d = d.masked_fill(pad, float("inf"))
    order = torch.sort(d, dim=2, stable=True).indices[..., :K]
    return d.gather(2, order), order


@pytest.mark.parametrize("norm,K", [(1, 1), (2, 1), (2, 5)])
def test_knn_points_ties_on_a_lattice_go_to_the_smaller_index(norm, K):
    gen = torch.Generator().manual_seed(7)
    p1, p2 = _lattice(gen, 2, 3000, -1, 7), _lattice(gen, 2, 400, 0, 6)
    lengths2 = torch.tensor([400, 250])
    out = p3.knn_points(p1, p2, lengths2=lengths2, norm=norm, K=K)
    dists, idx = _brute(p1, p2, K, norm, lengths2)
    nearest_two = _brute(p1, p2, 2, norm, lengths2)[0]
    assert (nearest_two[..., 0] == nearest_two[..., 1]).sum() > 2000  # most nearest neighbours are tied
    assert torch.equal(out.idx, idx)
    torch.testing.assert_close(out.dists.double(), dists, rtol=0, atol=0)


def _normals_loss(x, y, xn, yn, norm):
    """PyTorch3D's chamfer normals term (both directions, means) on brute-force nearest points."""
    terms = []
    for a, b, an, bn in ((x, y, xn, yn), (y, x, yn, xn)):
        _, idx = _brute(a, b, 1, norm, torch.full((a.shape[0],), b.shape[1]))
        near = bn.double().gather(1, idx.expand(-1, -1, 3))
        terms.append((1 - F.cosine_similarity(an.double(), near, dim=2, eps=1e-6).abs()).mean(1))
    return (terms[0] + terms[1]).mean()


@pytest.mark.parametrize("norm", [1, 2])
def test_chamfer_normals_use_the_smaller_index_of_tied_neighbours(norm):
    gen = torch.Generator().manual_seed(3)
    x, y = _lattice(gen, 2, 1500, -1, 6), _lattice(gen, 2, 1200, 0, 5)
    xn, yn = torch.randn(2, 1500, 3, generator=gen), torch.randn(2, 1200, 3, generator=gen)
    _, loss_normals = p3.chamfer_distance(x, y, x_normals=xn, y_normals=yn, norm=norm)
    torch.testing.assert_close(loss_normals.double(), _normals_loss(x, y, xn, yn, norm), rtol=1e-6, atol=1e-6)
