"""Forward-mode derivatives (torch.func.jvp) of the ops that skip their differentiable torch
formula when nothing is to be differentiated (pcops._threads.differentiable): equal to the
reverse-mode directional derivatives, not the zeros of the no-gradient path."""

import pytest
import torch

import pcops
from tests.op_table import icosphere

F64 = torch.float64


def _reverse(fn, x, t):
    """Per output element, its gradient to ``x`` dotted with the tangent ``t`` (each output row
    depends on its own input row only in the ops below, so the row's gradient is enough)."""
    x = x.clone().requires_grad_()
    out = fn(x)
    rows = []
    for i in range(out.shape[0]):
        flat = out[i].reshape(-1)
        rows.append(torch.stack([torch.autograd.grad(flat[j], x, retain_graph=True)[0][i].flatten() @ t[i].flatten()
                                 for j in range(flat.numel())]).reshape(out[i].shape))
    return torch.stack(rows)


def _cases():
    gen = torch.Generator().manual_seed(0)
    ref = torch.rand(40, 3, generator=gen, dtype=F64)
    v, f = icosphere(1)
    v = v.to(F64)
    yield "knn", lambda x: pcops.knn(x, ref, 3).dists
    yield "ball_query", lambda x: pcops.ball_query(x, ref, 0.4, 4).dists
    yield "mesh_distance", lambda x: pcops.mesh_distance(x, v, f).dists
    yield "mesh_distance signed", lambda x: pcops.mesh_distance(x, v, f, signed=True).dists
    features = torch.rand(40, 2, generator=gen, dtype=F64)
    yield "knn_aggregate", lambda x: pcops.knn_aggregate(x, ref, features, 3, 0.3)
    yield "knn_interpolate", lambda x: pcops.knn_interpolate(x, ref, features, 3)
    yield "ball_queries", lambda x: pcops.ball_queries(x, ref, [0.3, 0.5], [4, 8])[1].dists
    yield "chamfer_distance", lambda x: pcops.chamfer_distance(x, ref, point_reduction=None, batch_reduction=None)[0]


@pytest.mark.parametrize("name", [name for name, _ in _cases()])
def test_forward_mode_derivatives_equal_the_reverse_mode_ones(name):
    fn = dict(_cases())[name]
    gen = torch.Generator().manual_seed(1)
    q = 3 * torch.rand(7, 3, generator=gen, dtype=F64) - 1.5 if name.startswith("mesh") else torch.rand(7, 3, generator=gen, dtype=F64)
    t = torch.randn(7, 3, generator=gen, dtype=F64)
    _, forward = torch.func.jvp(fn, (q,), (t,))
    reverse = _reverse(fn, q, t)
    finite = torch.isfinite(forward) & torch.isfinite(reverse)
    torch.testing.assert_close(forward[finite], reverse[finite], rtol=1e-12, atol=1e-12)
    assert forward[finite].abs().max() > 0


def test_forward_mode_derivatives_of_normals_are_those_of_the_differentiable_formula():
    gen = torch.Generator().manual_seed(2)
    p = torch.rand(30, 3, generator=gen, dtype=F64)
    t = torch.randn(30, 3, generator=gen, dtype=F64)
    _, forward = torch.func.jvp(lambda x: pcops.estimate_normals(x, k=8), (p,), (t,))
    # the normals depend on the neighbours' points too: compare with the full Jacobian
    jac = torch.autograd.functional.jacobian(lambda x: pcops.estimate_normals(x, k=8), p)
    torch.testing.assert_close(forward, torch.einsum("ijkl,kl->ij", jac, t), rtol=1e-10, atol=1e-10)
    assert forward.abs().max() > 0


def test_forward_mode_derivative_of_point_mesh_face_distance_is_its_gradient_along_the_tangent():
    gen = torch.Generator().manual_seed(5)
    v, f = icosphere(1)
    x, t = 1.4 * torch.rand(9, 3, generator=gen, dtype=F64) - 0.7, torch.randn(9, 3, generator=gen, dtype=F64)
    _, forward = torch.func.jvp(lambda p: pcops.point_mesh_face_distance(p, v.to(F64), f), (x,), (t,))
    y = x.clone().requires_grad_()
    pcops.point_mesh_face_distance(y, v.to(F64), f).backward()
    torch.testing.assert_close(forward, (y.grad * t).sum(), rtol=1e-12, atol=1e-12)
    assert forward.abs() > 0


def test_forward_ad_and_jacfwd_of_normals_equal_the_reverse_mode_jacobian():
    """torch.autograd.forward_ad failed in torch (an internal assert: the normal was a view of the
    eigenvectors, its tangent laid out otherwise) and jacfwd had no vmap rule for the
    eigenvector's forward rule; both now give the reverse-mode Jacobian."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(3)
    p = torch.rand(25, 3, generator=gen, dtype=F64)
    t = torch.randn(25, 3, generator=gen, dtype=F64)
    normals = lambda x: pcops.estimate_normals(x, k=8)  # noqa: E731
    jac = torch.autograd.functional.jacobian(normals, p)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(normals(fwAD.make_dual(p, t))).tangent
    torch.testing.assert_close(tangent, torch.einsum("ijkl,kl->ij", jac, t), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.func.jacfwd(normals)(p), jac, rtol=1e-10, atol=1e-10)


def _reverse_only_cases():
    gen = torch.Generator().manual_seed(4)
    ref, feats = torch.rand(30, 3, generator=gen, dtype=F64), torch.rand(30, 2, generator=gen, dtype=F64)
    sites = torch.tensor([[0, 0, 0], [0, 0, 1], [1, 0, 0], [3, 3, 3]])
    weight = torch.rand(27, 2, 2, generator=gen, dtype=F64)
    v, f = icosphere(1)
    yield "radius_aggregate", lambda x: pcops.radius_aggregate(x[:, :3], ref, feats, 0.5, 0.2), torch.rand(6, 3, generator=gen, dtype=F64)
    yield "radius_aggregate", lambda x: pcops.radius_aggregate(ref, ref, x, 0.5, reduce="max"), feats.clone()
    yield "segment_reduce", lambda x: pcops.segment_reduce(x, offsets=torch.tensor([0, 1, 1, 2]), reduce="sum"), feats[:4].clone()
    yield "sparse_conv3d", lambda x: pcops.sparse_conv3d(x, sites, weight), feats[:4].clone()
    yield "sinkhorn_divergence", lambda x: pcops.sinkhorn_divergence(x, ref), torch.rand(8, 3, generator=gen, dtype=F64)
    yield "sample_points_on_mesh", lambda x: pcops.sample_points_on_mesh(x, f, 5, seed=0).points, v.to(F64)
    yield "serialized_pool", lambda x: pcops.serialized_pool(pcops.serialize(sites).code, 1, x).features, feats[:4].clone()
    from pcops.compat import torch_scatter

    yield r"pcops.compat.torch_scatter \(its max, min and CSR reductions\)", lambda x: torch_scatter.segment_csr(x, torch.tensor([0, 1, 4]), reduce="sum"), feats[:4].clone()


@pytest.mark.parametrize("case", range(8))
def test_ops_without_a_forward_rule_raise_instead_of_a_zero_tangent(case):
    """The ops whose custom op has a reverse-mode autograd only gave forward mode no tangent (a
    silent zero from jvp and jacfwd, None from forward_ad): a NotImplementedError naming the op
    now, and none where no tangent reaches the op; reverse mode still works."""
    import torch.autograd.forward_ad as fwAD

    name, fn, x = list(_reverse_only_cases())[case]
    t = torch.randn_like(x)
    for forward in (lambda: torch.func.jvp(fn, (x,), (t,)), lambda: torch.func.jacfwd(fn)(x)):
        with pytest.raises(NotImplementedError, match=f"^{name} has no forward-mode derivative"):
            forward()
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match=f"^{name} has no forward-mode derivative"):
        fn(fwAD.make_dual(x, t))
    with fwAD.dual_level():  # a dual level with no tangent reaching the op: no error
        fn(x)
    _, tangent = torch.func.jvp(lambda y: (2 * y).sum() + fn(x).sum(), (x,), (t,))  # the op on a constant of the transform: no error
    torch.testing.assert_close(tangent, 2 * t.sum())
    y = x.clone().requires_grad_()
    fn(y).sum().backward()
    assert y.grad is not None and torch.isfinite(y.grad).all()
