"""pcops.compat.torch_cluster against torch_cluster itself (CPU), where it is installed.

Marked slow (``pytest -m slow tests/compat``); torch_cluster has no wheels for every torch
version: ``pip install --no-build-isolation torch-cluster`` builds it from source (minutes).
Random float clouds have no distance ties, so the kNN and FPS results must be equal edge for
edge. torch_cluster's CPU ``radius`` lists neighbours in its kd-tree's traversal order, so
radius results are compared as sets per query, and where a cap truncates, by counts only.
"""

import pytest
import torch

torch_cluster = pytest.importorskip("torch_cluster")

from pcops.compat import torch_cluster as tc  # noqa: E402

pytestmark = pytest.mark.slow


def _data(gen, n=500, m=120, b=3):
    x, y = torch.rand(n, 3, generator=gen), torch.rand(m, 3, generator=gen)
    bx = torch.randint(0, b, (n,), generator=gen).sort().values
    by = torch.randint(0, b, (m,), generator=gen).sort().values
    return x, y, bx, by


def _as_sets(edges):
    return edges[:, torch.argsort(edges[0] * (edges.max() + 1) + edges[1])]


def test_knn_and_knn_graph_equal_torch_cluster(gen):
    x, y, bx, by = _data(gen)
    assert torch.equal(tc.knn(x, y, 8, bx, by), torch_cluster.knn(x, y, 8, bx, by))
    assert torch.equal(tc.knn(x, y, 8), torch_cluster.knn(x, y, 8))
    for loop in (False, True):
        for flow in ("source_to_target", "target_to_source"):
            assert torch.equal(tc.knn_graph(x, 6, bx, loop=loop, flow=flow), torch_cluster.knn_graph(x, 6, bx, loop=loop, flow=flow))


def test_radius_equals_torch_cluster_as_sets_without_truncation(gen):
    x, y, bx, by = _data(gen)
    ours, theirs = tc.radius(x, y, 0.15, bx, by, max_num_neighbors=500), torch_cluster.radius(x, y, 0.15, bx, by, max_num_neighbors=500)
    assert torch.equal(_as_sets(ours), _as_sets(theirs))
    ours, theirs = tc.radius_graph(x, 0.15, bx, max_num_neighbors=500), torch_cluster.radius_graph(x, 0.15, bx, max_num_neighbors=500)
    assert torch.equal(_as_sets(ours), _as_sets(theirs))


def test_radius_cap_keeps_as_many_as_torch_cluster(gen):
    x, y, bx, by = _data(gen)
    ours, theirs = tc.radius(x, y, 0.3, bx, by, max_num_neighbors=16), torch_cluster.radius(x, y, 0.3, bx, by, max_num_neighbors=16)
    assert torch.equal(torch.bincount(ours[0], minlength=y.shape[0]), torch.bincount(theirs[0], minlength=y.shape[0]))


def test_fps_nearest_and_grid_cluster_equal_torch_cluster(gen):
    x, y, bx, by = _data(gen)
    for ratio in (0.1, 0.3, 0.5):
        assert torch.equal(tc.fps(x, bx, ratio, random_start=False), torch_cluster.fps(x, bx, ratio, random_start=False))
    yb = torch.arange(3).repeat_interleave(40)
    assert torch.equal(tc.nearest(x, y, bx, yb), torch_cluster.nearest(x, y, bx, yb))
    size = torch.tensor([0.1, 0.2, 0.3])
    assert torch.equal(tc.grid_cluster(x, size), torch_cluster.grid_cluster(x, size))


def test_fps_counts_equal_torch_clusters_for_many_sizes(gen):
    sizes = torch.arange(1, 61)
    batch = torch.repeat_interleave(torch.arange(60), sizes)
    x = torch.rand(batch.numel(), 3, generator=gen)
    for ratio in (0.3, 0.6, 0.7, 0.9):
        assert torch.equal(tc.fps(x, batch, ratio, random_start=False), torch_cluster.fps(x, batch, ratio, random_start=False))


def test_knn_other_dimensions_and_edge_cases_equal_torch_cluster(gen):
    for d in (1, 2, 5):
        x, y = torch.rand(200, d, generator=gen), torch.rand(30, d, generator=gen)
        assert torch.equal(tc.knn(x, y, 4), torch_cluster.knn(x, y, 4)), d
    x, y = torch.rand(6, 3, generator=gen), torch.rand(4, 3, generator=gen)
    bx, by = torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([0, 1, 1, 2])
    assert torch.equal(tc.knn(x, y, 5, bx, by), torch_cluster.knn(x, y, 5, bx, by))  # k larger than examples
    assert torch.equal(tc.knn(x[:0], y, 2), torch_cluster.knn(x[:0], y, 2))
    size, start, end = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([-0.5, 0.0, 0.1]), torch.tensor([1.5, 1.0, 2.0])
    assert torch.equal(tc.grid_cluster(x, size, start, end), torch_cluster.grid_cluster(x, size, start, end))
    assert torch.equal(tc.nearest(x, y), torch_cluster.nearest(x, y))
