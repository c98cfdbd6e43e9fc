"""pcops.point_mesh_face_distance against a dense float64 reference with PyTorch3D's semantics
(every point to its nearest face, every face to its nearest point, squared; means per sample,
then over samples), the point-to-triangle distances of tests/reference.py."""

import pytest
import torch

import pcops
from tests import reference
from tests.op_suite import TOL, OpSuite, pack
from tests.op_table import icosphere
from tests.ops.mesh.test_distance import _sphere, mesh

F64 = torch.float64


def pair_d2(points, vertices, faces):
    """(P, F) squared distances from each point to each face (tests/reference.py)."""
    p, corners = points.double(), vertices.double()[faces]
    near = reference.triangle_points(p[:, None], corners[None, :, 0], corners[None, :, 1], corners[None, :, 2])
    return (p[:, None] - near).pow(2).sum(-1)


def expected(samples):
    """The loss over per-sample (points, vertices, faces)."""
    terms = []
    for p, v, f in samples:
        d2 = pair_d2(p, v, f)
        terms.append(d2.min(1).values.mean() + d2.min(0).values.mean())
    return torch.stack(terms).mean()


class TestPointMeshFaceDistance(OpSuite):
    differentiable = ("points", "vertices")
    clouds = ["sphere", "open", "degenerate", "far", "flat", "self_intersecting"]

    def inputs(self, kind, gen):
        v, f, q = mesh(kind, gen)
        return dict(points=q, vertices=v, faces=f)

    def run(self, points, vertices, faces):
        return (pcops.point_mesh_face_distance(points, vertices, faces),)

    def reference(self, points, vertices, faces):
        return (expected([(points, vertices, faces)]),)

    def compare(self, out, expected, dtype, inputs=None):
        size = 1.0 if inputs is None else max(inputs["points"].abs().max().item(), 1.0)
        tol = TOL[dtype] if dtype != torch.float32 else dict(rtol=2e-5, atol=1e-5)
        torch.testing.assert_close(out[0].double(), expected[0].double(), rtol=tol["rtol"], atol=tol["atol"] * size * size)

    def grad_inputs(self, gen):
        v, f = icosphere(0)
        q = torch.nn.functional.normalize(torch.randn(12, 3, generator=gen, dtype=F64), dim=-1) * 1.2
        return dict(points=q, vertices=v, faces=f)

    def opcheck_cases(self, gen):
        v, f = _sphere(gen)
        q = 3 * torch.rand(20, 3, generator=gen, dtype=F64) - 1.5
        rows = torch.arange(20)[:, None].expand(-1, 3).contiguous()
        tree = pcops.mesh_bvh(q, rows).tree  # the points as faces of three equal corners
        a, b, c = (v[f[:, k]].contiguous() for k in range(3))
        fg = torch.zeros(f.shape[0], dtype=torch.int64)
        return [(torch.ops.pcops.mesh_closest.default, (a, b, c, fg, *tree[1:5], tree.order, *tree[5:9], tree.scale, float("inf"), True, False))]

    def compile_calls(self, gen):
        def fn(points, vertices, faces, pl, fl):
            return pcops.point_mesh_face_distance(points, vertices, faces, points_lengths=pl, faces_lengths=fl)

        calls = []
        for b, m, sub in ((2, 21, 0), (3, 27, 1)):
            v, f = icosphere(sub)
            vs = torch.stack([v * (1 + 0.1 * k) for k in range(b)]).float().requires_grad_()
            q = (3 * torch.rand(b, m, 3, generator=gen) - 1.5).requires_grad_()
            calls.append((q, vs, f[None].expand(b, -1, -1).clone(), torch.randint(1, m + 1, (b,), generator=gen),
                          torch.randint(1, f.shape[0] + 1, (b,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        meshes = [_sphere(gen, 0), _sphere(gen, 1), mesh("open", gen)[:2]]
        qs = [3 * torch.rand(m, 3, generator=gen, dtype=F64) - 1.5 for m in (9, 1, 7)]
        loop = [(expected([(q, v, f) for q, (v, f) in zip(qs, meshes)]),)] * 3
        vmax, fmax, mmax = (max(t.shape[0] for t in ts) for ts in ([v for v, _ in meshes], [f for _, f in meshes], qs))
        vp, fp, qp = torch.zeros(3, vmax, 3, dtype=F64), torch.full((3, fmax, 3), -1), torch.zeros(3, mmax, 3, dtype=F64)
        for k, ((v, f), q) in enumerate(zip(meshes, qs)):
            vp[k, : len(v)], fp[k, : len(f)], qp[k, : len(q)] = v, f, q
        vl, fl, ql = (torch.tensor([len(t) for t in ts]) for ts in ([v for v, _ in meshes], [f for _, f in meshes], qs))
        padded = pcops.point_mesh_face_distance(qp, vp, fp, points_lengths=ql, vertices_lengths=vl, faces_lengths=fl)
        vcat, vb, v_pos = pack([v for v, _ in meshes], gen)
        offsets = torch.tensor([0] + [len(v) for v, _ in meshes]).cumsum(0)
        fcat = torch.cat([v_pos[f + offsets[k]] for k, (_, f) in enumerate(meshes)])
        qcat, qb, _ = pack(qs, gen)
        packed = pcops.point_mesh_face_distance(qcat, vcat, fcat, points_batch=qb * 7 + 3, vertices_batch=vb * 7 + 3)  # any ids
        return loop, [(padded,)] * 3, [(packed,)] * 3

    def bad_inputs(self, gen):
        v, f = _sphere(gen, 0)
        q = torch.rand(4, 3, generator=gen, dtype=F64)
        loss = pcops.point_mesh_face_distance
        return {
            "empty points": (lambda: loss(q[:0], v, f), ValueError, "points is empty"),
            "empty sample": (lambda: loss(q[None], v[None], f[None], points_lengths=torch.tensor([0])), ValueError, "points_lengths values"),
            "empty faces": (lambda: loss(q, v, f[:0]), ValueError, "a mesh needs vertices and faces"),
            "face out of range": (lambda: loss(q, v, f + 1), ValueError, "faces values"),
            "NaN points": (lambda: loss(torch.full((2, 3), float("nan"), dtype=F64), v, f), ValueError, "points contains NaN"),
            "int points": (lambda: loss(q.long(), v, f), TypeError, "points must have a floating dtype"),
        }


def test_equals_pytorch3d_formula_on_a_hand_made_case():
    v = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 2.0, 0.0]], dtype=F64)
    p = torch.tensor([[0.5, 0.5, 1.0], [3.0, 0.0, 0.0]], dtype=F64)
    # points: 1 (above the interior) and 1 (beyond corner 1); the face: nearest point at 1
    out = pcops.point_mesh_face_distance(p, v, torch.tensor([[0, 1, 2]]))
    torch.testing.assert_close(out, torch.tensor((1.0 + 1.0) / 2 + 1.0, dtype=F64))


@pytest.mark.parametrize("ids, sample, says", [([0, 0, 0, 0], 1, "has a mesh but no points"), ([0, 0, 2, 2], 2, "has points but no mesh"),
                                               ([5, 5, 5, 5], 5, "has points but no mesh")])
def test_packed_samples_of_points_and_meshes_must_match(ids, sample, says):
    triangle = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    vertices, faces = torch.cat([triangle, triangle + 2]), torch.tensor([[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match=rf"points_batch: sample {sample} {says}"):
        pcops.point_mesh_face_distance(torch.rand(4, 3), vertices, faces, points_batch=torch.tensor(ids),
                                       vertices_batch=torch.tensor([0, 0, 0, 1, 1, 1]))
