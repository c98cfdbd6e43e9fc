"""pcops.compat.torch_cluster under TorchScript (torch_cluster's own tests script every
function) and as the ``torch_cluster`` module of older PyTorch Geometric releases, which import
torch_cluster's graph functions by name."""

import inspect
from typing import Optional

import pytest
import torch
from torch import Tensor

from pcops.compat import torch_cluster as tc

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

# What PyTorch Geometric 2.5.x / 2.6.x import from torch_cluster (``from torch_cluster import
# ...`` in nn/conv/{x_conv,edge_conv,gravnet_conv}.py, nn/pool/{graclus,voxel_grid}.py,
# transforms/rooted_subgraph.py, and ``torch_cluster.<name>`` in nn/pool/__init__.py), plus
# ``neighbor_sampler`` from torch_cluster's own ``__all__``.
PYG_IMPORTS = ["fps", "graclus_cluster", "grid_cluster", "knn", "knn_graph", "nearest", "radius", "radius_graph", "random_walk"]
STUBS = {  # torch_cluster 1.6.3's signatures
    "graclus_cluster": ["row", "col", "weight", "num_nodes"],
    "random_walk": ["row", "col", "start", "walk_length", "p", "q", "coalesced", "num_nodes", "return_edge_indices"],
    "neighbor_sampler": ["start", "rowptr", "size"],
}


def _cloud(gen, n, d=3):
    return torch.rand(n, d, generator=gen, dtype=torch.float32)


def test_every_name_older_pyg_imports_exists():
    for name in PYG_IMPORTS + list(STUBS):
        assert callable(getattr(tc, name)), name
        assert name in tc.__all__
    assert "batch_size" in tc.knn.__doc__  # PyG reads it to pass batch_size


@pytest.mark.parametrize("name", sorted(STUBS))
def test_graph_functions_raise_an_error_naming_pcops(name):
    fn = getattr(tc, name)
    assert list(inspect.signature(fn).parameters) == STUBS[name]
    args = {
        "graclus_cluster": (torch.tensor([0, 1]), torch.tensor([1, 0])),
        "random_walk": (torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([0]), 3),
        "neighbor_sampler": (torch.tensor([0]), torch.tensor([0, 1, 2]), 1.0),
    }[name]
    for call in (fn, torch.jit.script(fn)):
        with pytest.raises((NotImplementedError, torch.jit.Error), match=f"pcops.compat.torch_cluster does not provide {name}"):
            call(*args)


def _equal(a, b):
    assert torch.equal(a, b), (a, b)


def test_knn_and_knn_graph_script_and_equal_eager(gen):
    x, y = _cloud(gen, 40), _cloud(gen, 10)
    bx, by = torch.arange(2).repeat_interleave(20), torch.arange(2).repeat_interleave(5)
    knn, knn_graph = torch.jit.script(tc.knn), torch.jit.script(tc.knn_graph)
    _equal(knn(x, y, 3), tc.knn(x, y, 3))
    _equal(knn(x, y, 3, bx, by, True), tc.knn(x, y, 3, bx, by, True))
    _equal(knn_graph(x, 4, bx, flow="target_to_source"), tc.knn_graph(x, 4, bx, flow="target_to_source"))


def test_radius_nearest_and_grid_cluster_script_and_equal_eager(gen):
    x, y = _cloud(gen, 40), _cloud(gen, 10)
    bx, by = torch.arange(2).repeat_interleave(20), torch.arange(2).repeat_interleave(5)
    radius, radius_graph = torch.jit.script(tc.radius), torch.jit.script(tc.radius_graph)
    _equal(radius(x, y, 0.3, bx, by, 4), tc.radius(x, y, 0.3, bx, by, 4))
    _equal(radius_graph(x, 0.3, bx, True, 5), tc.radius_graph(x, 0.3, bx, True, 5))
    _equal(torch.jit.script(tc.nearest)(x, y, bx, by), tc.nearest(x, y, bx, by))
    size = torch.tensor([0.25, 0.25, 0.25])
    _equal(torch.jit.script(tc.grid_cluster)(x, size), tc.grid_cluster(x, size))


def test_fps_scripts_with_each_form_of_ratio_and_ptr(gen):
    x = _cloud(gen, 30)
    batch = torch.arange(3).repeat_interleave(10)
    fps = torch.jit.script(tc.fps)
    _equal(fps(x, batch, 0.3, False), tc.fps(x, batch, 0.3, False))
    _equal(fps(x, batch, torch.tensor(0.3), False), tc.fps(x, batch, torch.tensor(0.3), False))
    _equal(fps(x, None, 0.5, False, None, [0, 10, 30]), tc.fps(x, None, 0.5, False, None, [0, 10, 30]))
    _equal(fps(x, None, 0.5, False, None, torch.tensor([0, 10, 30])), tc.fps(x, batch=batch[:30].clamp(max=1), ratio=0.5, random_start=False))


def _user_function(x: Tensor, ratio: Tensor, batch: Optional[Tensor]) -> Tensor:
    """A user's scripted function calling the drop-ins (as torch_cluster's fps test does)."""
    picked = tc.fps(x, batch, ratio, False)
    return tc.knn(x, x[picked], 2)


def test_a_scripted_user_function_calls_the_drop_ins(gen):
    x = _cloud(gen, 20)
    picked = tc.fps(x, None, 0.5, False)
    _equal(torch.jit.script(_user_function)(x, torch.tensor(0.5), None), tc.knn(x, x[picked], 2))
