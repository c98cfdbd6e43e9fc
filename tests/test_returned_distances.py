"""The distances an op returns are one set of values: the same whether a gradient is asked for
or not, eagerly or compiled, and sorted as documented. Where a derivative is asked for, the ops
recompute distances from the points in torch; torch's CPU sqrt is within an ulp of the root, not
always IEEE's (pcops._vml), so those values went through pcops._vml.root."""

import math

import pytest
import torch

import pcops
from pcops import _vml
from tests import reference

DTYPES = [torch.float32, torch.float64]


def lattice(n: int, dtype, seed: int, step: int = 7) -> torch.Tensor:
    """Points on a lattice of 1/step (voxelised scans): many equal distances, whose squares
    differ by an ulp and whose roots are often an ulp apart in torch's CPU sqrt."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-9, 9, (n, 3), generator=gen).double() / step).to(dtype)


def _distances(q: torch.Tensor, p: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor) -> dict:
    """Every op's returned distances of queries q to the cloud p and the mesh (vertices, faces)."""
    return {
        "knn warp": pcops.knn(q, p, 12).dists,
        "knn torch": pcops.knn(q, p, 12, backend="torch").dists,
        "knn scipy": pcops.knn(q, p, 12, backend="scipy").dists,
        "ball_query": pcops.ball_query(q, p, 0.45, 24).dists,
        "ball_queries": pcops.ball_queries(q, p, [0.3, 0.45], [8, 24])[1].dists,
        "mesh_distance": pcops.mesh_distance(q, vertices, faces).dists,
    }


def _mesh(dtype):
    """A closed mesh on the lattice's scale (an icosphere of radius 0.93, moved off the lattice's
    planes: no query lies on it, where the kernel's and torch's closest points may round apart)."""
    import trimesh

    sphere = trimesh.creation.icosphere(subdivisions=2)
    vertices = torch.tensor(sphere.vertices, dtype=torch.float64) * 0.93 + torch.tensor([0.011, 0.017, 0.003], dtype=torch.float64)
    return vertices.to(dtype), torch.tensor(sphere.faces, dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_returned_distances_are_the_same_with_a_gradient_and_sorted(dtype):
    """With a gradient to the queries, each op returns the distances it returns without one (bit
    for bit: the differentiable recomputation's values are IEEE's roots, as the searches'), rows
    still ascending, every distance the float64 reference's IEEE root in float64; and the
    gradient is the distance's (the unit vector from the neighbour)."""
    pytest.importorskip("scipy")
    pytest.importorskip("trimesh")
    vertices, faces = _mesh(dtype)
    for seed in range(3):
        p = torch.cat([lattice(600, dtype, seed), vertices])
        q0 = lattice(400, dtype, seed + 100)
        q = q0.clone().requires_grad_(True)
        plain, recorded = _distances(q0, p, vertices, faces), _distances(q, p, vertices, faces)
        for name, want in plain.items():
            got = recorded[name]
            assert got.requires_grad, name
            assert torch.equal(got.detach(), want), f"{name}: {int((got != want).sum())} distances differ"
            if name != "mesh_distance":
                ranked = torch.where(torch.isfinite(want), want, math.inf)
                assert torch.all(ranked[:, 1:] >= ranked[:, :-1]), name
        knn = pcops.knn(q, p, 12)
        if dtype == torch.float64:
            ref_d, _ = reference.knn(q0, p, 12)
            assert torch.equal(knn.dists.detach(), ref_d)
        (grad,) = torch.autograd.grad(knn.dists[:, 0].sum(), q)
        unit = q0 - p[knn.idx[:, 0]]
        unit = unit / unit.norm(dim=1, keepdim=True)
        torch.testing.assert_close(grad, torch.where(knn.dists[:, :1].detach() > 0, unit, 0))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float64, marks=pytest.mark.slow)], ids=str)
def test_returned_distances_compiled_equal_eager(dtype):
    """Compiled (inductor), the ops return eager's distances bit for bit, with and without a
    gradient (a tolerance would hide which of two equal distances comes first)."""
    pytest.importorskip("scipy")
    pytest.importorskip("trimesh")
    vertices, faces = _mesh(dtype)
    p = torch.cat([lattice(500, dtype, 7), vertices])
    q0 = lattice(300, dtype, 8)
    torch._dynamo.reset()
    compiled = torch.compile(_distances)
    for q in (q0, q0.clone().requires_grad_(True)):
        eager, comp = _distances(q, p, vertices, faces), compiled(q, p, vertices, faces)
        for name, want in eager.items():
            assert torch.equal(comp[name].detach(), want.detach()), f"{name}: {int((comp[name] != want).sum())} distances differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_root_is_ieee_and_differentiable_as_sqrt(dtype):
    """pcops._vml.root: IEEE's roots (math.sqrt's, rounded once in float32) with sqrt's first and
    second derivatives, in reverse and forward mode; torch's own where it cannot read values."""
    gen = torch.Generator().manual_seed(0)
    sq = (torch.rand(50_000, generator=gen, dtype=torch.float64) * 4).to(dtype)
    want = torch.tensor([math.sqrt(x) for x in sq.double().tolist()], dtype=torch.float64).to(dtype)
    assert not torch.equal(sq.sqrt(), want)  # (what the function is for; if torch's became IEEE's, so much the better)
    x = sq.clone().requires_grad_(True)
    out = _vml.root(x)
    assert torch.equal(out.detach(), want) and torch.equal(_vml.root(sq), want)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    torch.testing.assert_close(g, 0.5 / sq.sqrt())
    (g2,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(g2, -0.25 / sq.sqrt() ** 3)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(sq, torch.ones_like(sq))
        primal, tangent = torch.autograd.forward_ad.unpack_dual(_vml.root(dual))
    assert torch.equal(primal, want)
    torch.testing.assert_close(tangent, 0.5 / sq.sqrt())
    small = sq[:20].double().requires_grad_(True)
    assert torch.autograd.gradcheck(_vml.root, (small,))
    jac = torch.func.jacrev(_vml.root)(small.detach()[:4])  # (a transform: torch's values, its derivative)
    torch.testing.assert_close(jac, torch.diag(0.5 / small.detach()[:4].sqrt()))
