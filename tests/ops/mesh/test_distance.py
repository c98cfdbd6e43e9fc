"""pcops.mesh_distance / mesh_bvh against a dense float64 reference: the closest point on every
(point, face) pair and the exact winding number (tests/reference.py). (trimesh's closest point
is not a reference: on a sliver it returned a point 15% nearer than the triangle.)"""

import importlib

import pytest
import torch

import pcops
from pcops import _warp
from tests import reference
from tests.op_suite import TOL, OpSuite, pack
from tests.op_table import icosphere

F64 = torch.float64
SHIFT = torch.tensor([1000.0, -1000.0, 500.0], dtype=F64)


def _sphere(gen, subdivisions=1, jitter=0.3):
    v, f = icosphere(subdivisions)
    return v * (1 + jitter * (torch.rand(v.shape[0], 1, generator=gen, dtype=F64) - 0.5)), f


def _grid(n=4):
    """A flat (n x n)-square grid in z = 0, two triangles a square: ties everywhere on its edges."""
    xs = torch.linspace(-1, 1, n + 1, dtype=F64)
    v = torch.stack(torch.meshgrid(xs, xs, indexing="ij"), -1).reshape(-1, 2)
    v = torch.cat([v, torch.zeros(v.shape[0], 1, dtype=F64)], 1)
    i = torch.arange(n)[:, None] * (n + 1) + torch.arange(n)[None, :]
    a, b, c, d = i.reshape(-1), (i + 1).reshape(-1), (i + n + 1).reshape(-1), (i + n + 2).reshape(-1)
    return v, torch.cat([torch.stack([a, c, d], 1), torch.stack([a, d, b], 1)])


def mesh(kind, gen):
    """(vertices, faces, points) of an adversarial mesh."""
    q = 3 * torch.rand(60, 3, generator=gen, dtype=F64) - 1.5
    if kind in ("sphere", "uniform"):  # "uniform": the suite's default kind
        v, f = _sphere(gen)
    elif kind == "open":  # holes: the winding number is fractional near them
        v, f = _sphere(gen)
        f = f[torch.rand(f.shape[0], generator=gen) > 0.2]
    elif kind == "degenerate":  # zero-area faces, repeated corners, a sliver and a duplicated face
        v, f = _sphere(gen)
        mid = ((v[f[0, 0]] + v[f[0, 1]]) / 2)[None]
        v = torch.cat([v, mid, v[:1] + 1e-13])
        n = v.shape[0]
        extra = torch.tensor([[0, 0, 1], [2, 2, 2], [f[0, 0], f[0, 1], n - 2], [0, n - 1, 5], *f[:3].tolist()])
        f = torch.cat([f, extra])
    elif kind == "far":  # far from the origin: distances from differences of large coordinates
        v, f = _sphere(gen)
        v, q = v + SHIFT, q + SHIFT
    elif kind == "flat":  # queries on the plane and above its vertices and edges
        v, f = _grid()
        q = torch.cat([q[:30], v[torch.randint(0, v.shape[0], (15,), generator=gen)] + torch.tensor([0.0, 0.0, 0.3], dtype=F64),
                       torch.cat([2 * torch.rand(15, 2, generator=gen, dtype=F64) - 1, torch.zeros(15, 1, dtype=F64)], 1)])
    elif kind == "self_intersecting":  # two overlapping spheres in one mesh: w = 2 where they overlap
        (v1, f1), (v2, f2) = _sphere(gen, 1, 0.0), _sphere(gen, 1, 0.0)
        v, f = torch.cat([v1 - 0.3, v2 + 0.3]), torch.cat([f1, f2 + v1.shape[0]])
    else:
        raise ValueError(kind)
    return v, f, q


def assert_mesh_distance(out, points, vertices, faces, dtype, signed=True):
    """out (dists, closest, face, bary) of points against one mesh, checked against the float64
    reference of the same (rounded) inputs: distances and closest points within the dtype's
    tolerance of the coordinates' size, the face the reference's (float64) or one as near
    (others), the weights those of the closest point, the sign that of the exact winding number
    wherever |w - 1/2| >= 0.1."""
    d, c, f, b = (t.detach() for t in out)
    p, v = points.double(), vertices.double()
    rd, rc, rf = reference.mesh_distance(p, v, faces)
    size = max(p.abs().max().item(), v.abs().max().item(), 1.0)
    tol = dict(rtol=0, atol=1e-11 * size) if dtype == F64 else dict(rtol=0, atol=4e-6 * size)
    if dtype in (torch.float16, torch.bfloat16):
        tol = dict(rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * size)
    assert f.dtype == torch.int64 and d.dtype == dtype
    torch.testing.assert_close(d.abs().double(), rd, **tol)
    if dtype == F64:
        assert torch.equal(f, rf), (f[f != rf], rf[f != rf])
    else:  # the face found is as near as the reference's, to the dtype's rounding
        own = torch.stack([reference.mesh_distance(p[i : i + 1], v, faces[f[i] : f[i] + 1])[0][0] for i in range(len(f))])
        torch.testing.assert_close(own, rd, **tol)
    torch.testing.assert_close(c.double(), rc if dtype == F64 else c.double(), **tol)
    corners = v[faces[f]]
    assert (b.double() >= -1e-6).all() and torch.allclose(b.double().sum(-1), torch.ones_like(rd), atol=4 * TOL[dtype]["atol"])
    torch.testing.assert_close((b.double()[:, :, None] * corners).sum(1), c.double(), **{**tol, "atol": 4 * tol["atol"]})
    if signed:
        w = reference.winding_number(p, v, faces)
        clear = (w - 0.5).abs() >= 0.1
        inside = d < 0
        assert torch.equal(inside[clear], (w >= 0.5)[clear]), "sign differs from the exact winding number"


class TestMeshDistance(OpSuite):
    differentiable = ("points", "vertices")
    clouds = ["sphere", "open", "degenerate", "far", "flat", "self_intersecting"]

    def inputs(self, kind, gen):
        v, f, q = mesh(kind, gen)
        return dict(points=q, vertices=v, faces=f)

    def run(self, points, vertices, faces):
        return tuple(pcops.mesh_distance(points, vertices, faces, signed=True))

    def reference(self, points, vertices, faces):
        return reference.mesh_distance(points, vertices, faces)

    def compare(self, out, expected, dtype, inputs=None):
        if inputs is None:  # batch test: the per-sample loop of pcops itself, float64
            for i, (a, e) in enumerate(zip(out, expected)):
                assert torch.equal(a, e) if not e.dtype.is_floating_point else torch.allclose(a, e, rtol=1e-12, atol=1e-12, equal_nan=True), i
            return
        assert_mesh_distance(out, inputs["points"], inputs["vertices"], inputs["faces"], dtype)

    def grad_inputs(self, gen):
        v, f = icosphere(0)  # 12 vertices: a short gradcheck
        directions = torch.nn.functional.normalize(torch.randn(10, 3, generator=gen, dtype=F64), dim=-1)
        q = directions * torch.tensor([0.5, 1.3], dtype=F64).repeat(5)[:, None]  # inside and outside
        return dict(points=q, vertices=v, faces=f)

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            v, f = _sphere(gen)
            v = v.to(dtype)
            group = torch.zeros(f.shape[0], dtype=torch.int64)
            tree = pcops.mesh_bvh(v, f).tree
            q = (3 * torch.rand(20, 3, generator=gen) - 1.5).to(dtype)
            qg = torch.zeros(20, dtype=torch.int64)
            cases += [(torch.ops.pcops.mesh_tree.default, (v, f, group, one, winding)) for one in (False, True) for winding in (False, True)]
            rows = torch.randperm(20, generator=gen)
            for rivals in (False, True):
                cases.append((torch.ops.pcops.mesh_closest.default, (q, q, q, qg, *tree[1:5], tree.order, *tree[5:9], tree.scale, 0.7, False, True, rivals, torch.tensor([3.0], dtype=F64))))
            reach = torch.rand(20, generator=gen, dtype=dtype)
            known = torch.tensor([0.0, 1.0, float("inf"), -1.0, float("inf")] * 4, dtype=dtype)  # inf: walked
            for closed in (0, 1):
                cases.append((torch.ops.pcops.mesh_winding.default, (q, qg, rows, reach, torch.tensor([closed], dtype=torch.int32), torch.tensor([2.0], dtype=F64),
                                                                     *tree[1:5], tree.glo, tree.ghi, tree.center, tree.normal, tree.moment, tree.radius, tree.scale,
                                                                     known)))
            face = pcops.mesh_distance(q, v, f).face
            flags, _, twin = torch.ops.pcops.mesh_closed.default(v, f, group, False, -1)
            for queries in (0, 1000):  # too few queries: nothing analysed
                analysis = (v, f, group, False, -1, queries, flags, twin, tree.order, *tree[1:5], *tree[5:9], tree.center, tree.normal, tree.moment,
                            tree.radius, tree.scale)
                cases.append((torch.ops.pcops.mesh_simple.default, analysis))
            simple = torch.ops.pcops.mesh_simple.default(*analysis)
            rival = torch.ops.pcops.mesh_closest.default(q, q, q, qg, *tree[1:5], tree.order, *tree[5:9], tree.scale, float("inf"), False, False, True, torch.tensor([3.0], dtype=F64))[2]
            sides = (q, face, rival, v, f, twin, *simple, group, tree.order, tree.group, tree.lo, tree.hi, tree.glo, tree.ghi, tree.scale)
            cases.append((torch.ops.pcops.mesh_sides.default, sides))
            cases.append((torch.ops.pcops.mesh_sides.default, (*sides, reach < 0.5)))  # (far queries: no crossings counted)
            cases.append((torch.ops.pcops.mesh_closed.default, (v, f, group, False, -1)))
            cases.append((torch.ops.pcops.mesh_closed.default, (v, f, group, True, 0)))
            corners = v[f[torch.randint(0, f.shape[0], (20,), generator=gen)]]
            cases.append((torch.ops.pcops.triangle_closest.default, (q, *corners.unbind(1))))
            cases.append((torch.ops.pcops.plane_normals.default, tuple(t.double().contiguous() for t in corners.unbind(1))))
            face = torch.randint(-1, f.shape[0], (20,), generator=gen)
            cases.append((torch.ops.pcops.mesh_measure.default, (q, v, f, face)))
        return cases

    def compile_calls(self, gen):
        def fn(points, vertices, faces, pl, fl):
            out = pcops.mesh_distance(points, vertices, faces, signed=True, points_lengths=pl, faces_lengths=fl)
            return out.dists, out.closest, out.face, out.bary

        calls = []
        for b, m, sub in ((2, 21, 0), (3, 27, 1)):  # m != F: duck sizing would tie them
            v, f = icosphere(sub)
            vs = torch.stack([v * (1 + 0.1 * k) for k in range(b)]).float()
            fs = f[None].expand(b, -1, -1).clone()
            q = (3 * torch.rand(b, m, 3, generator=gen) - 1.5).requires_grad_()
            calls.append((q, vs, fs, torch.randint(0, m + 1, (b,), generator=gen), torch.randint(1, f.shape[0] + 1, (b,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        meshes = [_sphere(gen, 0), _sphere(gen, 1), mesh("open", gen)[:2], _grid(2)]
        qs = [3 * torch.rand(m, 3, generator=gen, dtype=F64) - 1.5 for m in (9, 0, 7, 5)]
        expected = [tuple(pcops.mesh_distance(q, v, f, signed=True)) for q, (v, f) in zip(qs, meshes)]
        # padded: vertices zero-padded, faces -1-padded
        vmax, fmax, mmax = (max(t.shape[0] for t in ts) for ts in ([v for v, _ in meshes], [f for _, f in meshes], qs))
        vp = torch.zeros(len(meshes), vmax, 3, dtype=F64)
        fp = torch.full((len(meshes), fmax, 3), -1)
        qp = torch.zeros(len(meshes), max(mmax, 1), 3, dtype=F64)
        for b, ((v, f), q) in enumerate(zip(meshes, qs)):
            vp[b, : len(v)], fp[b, : len(f)], qp[b, : len(q)] = v, f, q
        vl, fl, ql = (torch.tensor([len(t) for t in ts]) for ts in ([v for v, _ in meshes], [f for _, f in meshes], qs))
        out = pcops.mesh_distance(qp, vp, fp, signed=True, points_lengths=ql, vertices_lengths=vl, faces_lengths=fl)
        assert torch.all(out.face[1] == -1) and torch.all(out.dists[1].isinf())  # padding rows
        padded = [tuple(t[b, : len(qs[b])] for t in out) for b in range(len(qs))]
        # packed: vertices shuffled, faces interleaved keeping each mesh's order (ties go to the smaller index)
        vcat, vb, v_pos = pack([v for v, _ in meshes], gen)
        offsets = torch.tensor([0] + [len(v) for v, _ in meshes]).cumsum(0)
        fglobal = [v_pos[f + offsets[b]] for b, (_, f) in enumerate(meshes)]
        fcat, _, f_pos = pack(fglobal, gen, keep_order=True)
        qcat, qb, q_pos = pack(qs, gen)
        d, c, face, bary = pcops.mesh_distance(qcat, vcat, fcat, signed=True, points_batch=qb, vertices_batch=vb)
        f_local = torch.empty_like(f_pos)  # packed face row -> row within its mesh
        f_local[f_pos] = torch.cat([torch.arange(len(f)) for _, f in meshes])
        packed, at = [], 0
        for q in qs:
            rows = q_pos[at : at + len(q)]
            packed.append((d[rows], c[rows], torch.where(face[rows] >= 0, f_local[face[rows].clamp(min=0)], -1), bary[rows]))
            at += len(q)
        return expected, padded, packed

    def bad_inputs(self, gen):
        v, f = _sphere(gen, 0)
        q = torch.rand(4, 3, generator=gen, dtype=F64)
        md = pcops.mesh_distance
        nan = v.clone()
        nan[3, 1] = float("nan")
        joined = torch.cat([torch.zeros(6), torch.ones(v.shape[0] - 6)]).long()
        return {
            "empty faces": (lambda: md(q, v, f[:0]), ValueError, "a mesh needs vertices and faces"),
            "face out of range": (lambda: md(q, v, torch.cat([f, torch.tensor([[0, 1, v.shape[0]]])])), ValueError, "faces values"),
            "negative face": (lambda: md(q, v, torch.cat([f, torch.tensor([[0, -1, 2]])])), ValueError, "faces values"),
            "float faces": (lambda: md(q, v, f.double()), TypeError, "faces must have an integer dtype"),
            "faces shape": (lambda: md(q, v, f[:, :2]), ValueError, "faces must be a tensor of shape"),
            "vertices shape": (lambda: md(q, v[:, :2], f), ValueError, "vertices must be a tensor of shape"),
            "NaN vertices": (lambda: md(q, nan, f), ValueError, "vertices contains NaN"),
            "NaN points": (lambda: md(torch.full((2, 3), float("nan"), dtype=F64), v, f), ValueError, "points contains NaN"),
            "padded points for one mesh": (lambda: md(q[None], v, f), ValueError, "points must be a tensor of shape"),
            "zero faces_lengths": (lambda: md(q[None], v[None], f[None], faces_lengths=torch.tensor([0])), ValueError, "faces_lengths values"),
            "packed points, one mesh": (lambda: md(q, v, f, points_batch=torch.zeros(4, dtype=torch.long)), ValueError, "points_batch"),
            "packed point without a mesh": (lambda: md(q, v, f, points_batch=torch.tensor([0, 0, 1, 0]), vertices_batch=torch.zeros(len(v), dtype=torch.long)),
                                            ValueError, "points_batch: sample 1 has points but no mesh faces"),
            "face across samples": (lambda: md(q, v, f, vertices_batch=joined, points_batch=torch.zeros(4, dtype=torch.long)), ValueError, "one sample"),
            "max_dist": (lambda: md(q, v, f, max_dist=0.0), ValueError, "max_dist must be finite and > 0"),
            "bvh and faces": (lambda: md(q, pcops.mesh_bvh(v, f), f), ValueError, "a MeshBVH holds its faces"),
            "no faces": (lambda: md(q, v), TypeError, "needs faces"),
            "signed not a bool": (lambda: md(q, v, f, signed="no"), TypeError, "signed must be a bool"),
            "validate not a bool": (lambda: md(q, v, f, validate=None), TypeError, "validate must be a bool"),
            "devices": (lambda: md(q, v.to("meta"), f), ValueError, "same device"),
        }


def _cube():
    v = torch.tensor([[x, y, z] for x in (0.0, 1.0) for y in (0.0, 1.0) for z in (0.0, 1.0)], dtype=F64)
    f = torch.tensor([[0, 1, 3], [0, 3, 2], [4, 6, 7], [4, 7, 5], [0, 4, 5], [0, 5, 1],
                      [2, 3, 7], [2, 7, 6], [0, 2, 6], [0, 6, 4], [1, 5, 7], [1, 7, 3]])
    return v, f


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_ties_on_shared_edges_and_corners_go_to_the_smaller_face(dtype):
    v, f = _cube()
    corners = v + 0.5 * (2 * v - 1)  # beyond each corner, along its diagonal: every face at the corner ties
    edges = torch.tensor([[0.5, -0.5, -0.5], [1.5, 0.5, 1.5], [0.5, 0.5, 0.5]], dtype=F64)  # two edge midpoints' wedges, the centre
    q = torch.cat([corners, edges]).to(dtype)
    out = pcops.mesh_distance(q, v.to(dtype), f)
    d_all = reference.mesh_distance(q.double(), v, f, tie=0)[0]
    expected = []
    for p in q.double():
        dist = torch.stack([reference.mesh_distance(p[None], v, f[k : k + 1])[0][0] for k in range(12)])
        expected.append(int(torch.nonzero(dist <= dist.min() + 1e-9)[0]))
    assert out.face.tolist() == expected
    torch.testing.assert_close(out.dists.double(), d_all)


def test_max_dist_is_a_band():
    gen = torch.Generator().manual_seed(3)
    v, f, q = mesh("sphere", gen)
    full = pcops.mesh_distance(q, v, f, signed=True)
    band = pcops.mesh_distance(q, v, f, signed=True, max_dist=0.3)
    within = full.dists.abs() <= 0.3
    assert within.any() and (~within).any()
    assert torch.equal(band.face[within], full.face[within]) and torch.equal(band.dists[within], full.dists[within])
    assert (band.face[~within] == -1).all() and band.closest[~within].isnan().all() and band.bary[~within].isnan().all()
    assert torch.equal(band.dists[~within], torch.where(full.dists[~within] < 0, -torch.inf, torch.inf))


def test_a_bvh_built_once_serves_many_queries_and_keeps_the_vertices_graph():
    gen = torch.Generator().manual_seed(4)
    v, f, q = mesh("open", gen)
    v = v.requires_grad_()
    bvh = pcops.mesh_bvh(v, f)
    for _ in range(2):
        q = 3 * torch.rand(50, 3, generator=gen, dtype=F64) - 1.5
        a, b = pcops.mesh_distance(q, bvh, signed=True), pcops.mesh_distance(q, v, f, signed=True)
        for x, y in zip(a, b):
            assert torch.equal(x.detach(), y.detach()) if not x.dtype.is_floating_point else torch.allclose(x, y, equal_nan=True)
    (g,) = torch.autograd.grad(pcops.mesh_distance(q, bvh).dists.sum(), v)
    assert g.abs().sum() > 0


def test_gradients_of_gradients_with_respect_to_points():
    v, f = icosphere(1)
    gen = torch.Generator().manual_seed(5)
    q = torch.nn.functional.normalize(torch.randn(8, 3, generator=gen, dtype=F64), dim=-1) * 1.3
    q.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x: pcops.mesh_distance(x, v, f, signed=True).dists, (q,))
    (g,) = torch.autograd.grad(pcops.mesh_distance(q, v, f, signed=True).dists.sum(), q, create_graph=True)
    torch.testing.assert_close(g.norm(dim=-1), torch.ones(8, dtype=F64))  # eikonal: a unit gradient
    (g.norm(dim=-1) - 1).pow(2).sum().backward()  # an eikonal loss backpropagates


def test_sign_agrees_with_the_exact_winding_number_on_open_and_self_intersecting_meshes():
    gen = torch.Generator().manual_seed(6)
    for kind in ("open", "self_intersecting", "degenerate"):
        v, f, _ = mesh(kind, gen)
        q = 3 * torch.rand(2000, 3, generator=gen, dtype=F64) - 1.5
        d = pcops.mesh_distance(q, v, f, signed=True).dists
        w = reference.winding_number(q, v, f)
        clear = (w - 0.5).abs() >= 0.1
        assert torch.equal((d < 0)[clear], (w >= 0.5)[clear]), kind
        d32 = pcops.mesh_distance(q.float(), v.float(), f, signed=True).dists
        assert torch.equal((d32 < 0)[clear], (w >= 0.5)[clear]), kind


def test_degenerate_faces_do_not_change_the_answer():
    gen = torch.Generator().manual_seed(7)
    v, f = _sphere(gen)
    q = 3 * torch.rand(300, 3, generator=gen, dtype=F64) - 1.5
    clean = pcops.mesh_distance(q, v, f)
    junk = torch.stack([f[0, [0, 0, 0]], f[1, [0, 0, 1]], f[2, [1, 2, 1]]])  # a corner, an edge, an edge of faces 0-2: zero area, on the surface
    dirty = pcops.mesh_distance(q, v, torch.cat([f, junk]))
    torch.testing.assert_close(dirty.dists, clean.dists, rtol=0, atol=1e-14)


@pytest.mark.cuda
def test_cuda_results_survive_a_side_stream_and_freed_inputs():
    """Every buffer of the search is a torch tensor on the caller's stream: queued on a side
    stream, with the mesh's tensors dropped and their memory reused before the stream runs,
    the results equal the CPU's."""
    gen = torch.Generator().manual_seed(8)
    v, f, q = mesh("open", gen)
    expected = pcops.mesh_distance(q, v, f, signed=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so the work below is queued, not run
        vc, fc, qc = v.cuda(), f.cuda(), q.cuda()
        out = pcops.mesh_distance(qc, pcops.mesh_bvh(vc, fc), signed=True)
        del vc, fc
        torch.empty(1 << 24, device="cuda").fill_(float("nan"))  # reuses freed blocks on this stream
    side.synchronize()
    for a, e in zip(out, expected):
        assert torch.allclose(a.cpu(), e, equal_nan=True) if a.dtype.is_floating_point else torch.equal(a.cpu(), e)


@pytest.mark.parametrize("validate", [True, False])
def test_sample_ids_above_int32_keep_packed_meshes_apart(validate):
    gen = torch.Generator().manual_seed(9)
    (v1, f1), (v2, f2) = _sphere(gen, 0), _sphere(gen, 1)
    v, f = torch.cat([v1, v2 + 0.5]), torch.cat([f1, f2 + v1.shape[0]])
    q = 3 * torch.rand(40, 3, generator=gen, dtype=F64) - 1.5
    vb = torch.cat([torch.zeros(v1.shape[0]), torch.ones(v2.shape[0])]).long()
    qb = torch.randint(0, 2, (40,), generator=gen)
    small = pcops.mesh_distance(q, v, f, signed=True, points_batch=qb, vertices_batch=vb, validate=validate)
    huge = pcops.mesh_distance(q, v, f, signed=True, points_batch=qb * 2**32 + 1, vertices_batch=vb * 2**32 + 1, validate=validate)
    for a, b in zip(huge, small):
        assert torch.equal(a, b) if not b.dtype.is_floating_point else torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    first = pcops.mesh_distance(q[qb == 0], v1, f1, signed=True)
    torch.testing.assert_close(small.dists[qb == 0], first.dists, rtol=0, atol=0)


def test_without_validation_a_point_of_a_sample_without_a_mesh_finds_nothing():
    # the walks' one-mesh path (no sample ranges to test) must not serve a point of another sample
    gen = torch.Generator().manual_seed(4)
    v, f = _sphere(gen, 0)
    q = torch.rand(30, 3, generator=gen, dtype=F64)
    qb = torch.arange(30) % 2  # sample 1 has points and no mesh
    for signed in (False, True):
        out = pcops.mesh_distance(q, v, f, signed=signed, points_batch=qb, vertices_batch=torch.zeros(len(v), dtype=torch.long), validate=False)
        assert bool((out.face[qb == 1] == -1).all()) and bool(out.dists[qb == 1].isinf().all())
        torch.testing.assert_close(out.dists[qb == 0], pcops.mesh_distance(q[qb == 0], v, f, signed=signed).dists, rtol=0, atol=0)


def test_the_cpu_chain_of_bounds_changes_nothing(monkeypatch):
    """On the CPU a query starts from the face its thread's previous query found (a bound); the
    result equals the walk from scratch, ties included."""
    from pcops.ops.mesh import _search

    gen = torch.Generator().manual_seed(10)
    v, f = _grid(6)
    q = torch.cat([3 * torch.rand(3000, 3, generator=gen, dtype=F64) - 1.5, v + torch.tensor([0.0, 0.0, 0.2], dtype=F64)])
    chained = pcops.mesh_distance(q, v, f, max_dist=1.0)
    monkeypatch.setattr(_search, "CHAIN", False)
    plain = pcops.mesh_distance(q, v, f, max_dist=1.0)
    assert torch.equal(chained.face, plain.face) and torch.equal(chained.dists, plain.dists)


@pytest.mark.parametrize("queries", ["random", "grid"])
def test_one_mesh_cpu_queries_go_in_the_knn_search_order_and_find_the_same(monkeypatch, queries):
    """The CPU queries of one mesh (up to COUNTED) are walked in the kNN search's order (a
    counting sort of Morton cells; grids stay as they are), others in the sorted (sample, Morton
    code) order. In
    float64 the order changes nothing: the faces and distances, signed (an open and a closed
    mesh: the closed one's walks copy the winding number of the query before them) and
    unsigned, equal those of the sorted order bit for bit."""
    from pcops.ops.mesh import _search, _tree
    from pcops.ops.neighbours import nearest

    gen = torch.Generator().manual_seed(11)
    sphere = _sphere(gen, 2)
    grid = _grid(6)
    if queries == "grid":
        axis = torch.linspace(-1.4, 1.4, 20, dtype=F64)  # (steps under 1/16 of the box: a spatial order)
        q = torch.cartesian_prod(axis, axis, axis) + torch.tensor([0.011, 0.023, 0.037], dtype=F64)
    else:
        q = torch.cat([3 * torch.rand(2000, 3, generator=gen, dtype=F64) - 1.5, sphere[0] * 1.01])
    seen = []
    counted = nearest.cpu_query_rows
    monkeypatch.setattr(nearest, "cpu_query_rows", lambda p: seen.append(p.shape[0]) or counted(p))
    _, rows, _ = _search.closest(q, torch.zeros(len(q), dtype=torch.long), pcops.mesh_bvh(*sphere).tree, float("inf"), False, one=True)
    assert torch.equal(rows, counted(q)) and torch.equal(torch.sort(rows).values, torch.arange(len(q)))
    assert torch.equal(rows, torch.arange(len(q))) == (queries == "grid")
    assert not torch.equal(rows, torch.argsort(_tree._codes(q), stable=True))  # (another order than the sort's)
    results = [pcops.mesh_distance(q, v, f, signed=signed) for v, f in (sphere, grid) for signed in (False, True)]
    assert seen and set(seen) == {len(q)}
    loss = pcops.point_mesh_face_distance(q, *sphere)  # (both ways: the faces' corners as queries too)
    assert len(seen) > 4
    monkeypatch.setattr(nearest, "cpu_query_rows", lambda p: torch.argsort(_tree._codes(p), stable=True))
    for got, (v, f, signed) in zip(results, [(*m, s) for m in (sphere, grid) for s in (False, True)]):
        want = pcops.mesh_distance(q, v, f, signed=signed)
        assert torch.equal(got.face, want.face) and torch.equal(got.dists, want.dists)
    assert torch.equal(pcops.point_mesh_face_distance(q, *sphere), loss)
    # more queries than COUNTED, or two meshes (packed): the sorted order (samples apart)
    monkeypatch.setattr(_tree, "COUNTED", len(q) - 1)
    _, rows, _ = _search.closest(q, torch.zeros(len(q), dtype=torch.long), pcops.mesh_bvh(*sphere).tree, float("inf"), False, one=True)
    assert torch.equal(rows, _tree.query_order(q, torch.zeros(len(q), dtype=torch.long)))
    monkeypatch.undo()
    both = pcops.mesh_bvh(torch.cat([sphere[0], grid[0]]), torch.cat([sphere[1], grid[1] + len(sphere[0])]),
                          vertices_batch=torch.cat([torch.zeros(len(sphere[0])), torch.ones(len(grid[0]))]).long())
    group = torch.arange(len(q)) % 2
    _, rows, _ = _search.closest(q, group, both.tree, float("inf"), False, one=both.batch == 0)
    assert torch.equal(rows, _tree.query_order(q, group))


def test_float32_faces_chained_through_the_tie_band_do_not_depend_on_the_other_queries(monkeypatch):
    """Seen from afar, a fan of nearly coplanar float32 faces about a corner has many faces
    within a few times float32's rounding of the nearest distance, chaining through the tie
    band (each within the band of the next, the ends farther apart). The face found is the
    smallest index within the band of the smallest distance, whatever order the walk takes: the
    queries flipped, one at a time, or without the CPU's chain of bounds find the same faces
    (a walk that let a nearer face win outright over the face taken lost the faces passed over
    for it: here 49 faces differed between those calls at 34b756f), each within float32's rounding of the exact
    nearest distance."""
    import math

    from pcops.ops.mesh import _search

    found = {}
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        angle = torch.arange(48, dtype=F64) * 2 * math.pi / 48
        ring = torch.stack([angle.cos(), angle.sin(), 3e-4 * torch.randn(48, generator=gen, dtype=F64)], 1)
        v = torch.cat([torch.zeros(1, 3, dtype=F64), ring]).float()
        f = torch.stack([torch.zeros(48, dtype=torch.long), torch.arange(1, 49), torch.arange(1, 49) % 48 + 1], 1)
        q = torch.randn(4000, 3, generator=gen)
        q = 2 * torch.cat([0.05 * q[:, :2], q[:, 2:].abs() + 0.5], 1)  # above the corner, 1 to 8 away
        face = pcops.mesh_distance(q, v, f).face
        found[seed] = (q, v, f, face)
        assert torch.equal(pcops.mesh_distance(q.flip(0), v, f).face.flip(0), face)
        assert torch.equal(torch.cat([pcops.mesh_distance(q[i:i + 1], v, f).face for i in range(0, 4000, 7)]), face[::7])
        exact = reference.mesh_distance(q.double(), v.double(), f)[0]
        own = (q.double() - reference.triangle_points(q.double(), *v.double()[f[face]].unbind(1))).norm(dim=1)
        assert bool(((own - exact) <= 64 * torch.finfo(torch.float32).eps * q.abs().amax()).all())
    monkeypatch.setattr(_search, "CHAIN", False)
    for q, v, f, face in found.values():
        assert torch.equal(pcops.mesh_distance(q, v, f).face, face)


def test_float32_meshes_too_large_to_search_raise_and_float64_ones_are_exact():
    """A float32 triangle with edges past ~1e9 overflowed its squared normal: every distance 0,
    the closest point the query. Such meshes raise naming the vertices; float64 ones are exact."""
    v, f = icosphere(1)
    q = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    near = pcops.mesh_distance(q, v.double(), f).dists
    for scale in (1e7, 1e10):
        big = pcops.mesh_distance(q * scale, v.double() * scale, f)
        torch.testing.assert_close(big.dists, near * scale, rtol=1e-12, atol=0)
    torch.testing.assert_close(pcops.mesh_distance((q * 1e7).float(), (v * 1e7).float(), f).dists, (near * 1e7).float(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="vertices has coordinates up to 1e\\+10.*pass float64 vertices"):
        pcops.mesh_distance((q * 1e10).float(), (v * 1e10).float(), f)
    with pytest.raises(ValueError, match="vertices has coordinates up to"):
        pcops.mesh_bvh((v * 1e9).float(), f)


def test_float64_points_on_a_float32_mesh_are_searched_in_float64():
    """The hierarchy was built in the vertices' float32 and float64 points were searched in it:
    a float64 result with float32 accuracy (faces picked within float32's tie band). The result
    equals the search of the same vertices given as float64."""
    v, f = icosphere(3)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8000, 3, dtype=torch.float64, generator=gen)
    q = q / q.norm(dim=1, keepdim=True) * 1.0001  # just off the surface: many near-ties between faces
    for signed in (False, True):
        mixed = pcops.mesh_distance(q, v.float(), f, signed=signed)
        exact = pcops.mesh_distance(q, v.float().double(), f, signed=signed)
        assert torch.equal(mixed.face, exact.face) and torch.equal(mixed.dists, exact.dists)


@pytest.mark.parametrize("signed", [False, True])
def test_points_on_and_next_to_the_surface_have_unit_gradients_and_finite_second_derivatives(signed):
    """Points sampled on a mesh (an eikonal term's input): exactly on the surface the gradient is
    the face's unit normal and the second derivative finite (it was 0 and NaN for 692 of 1,000);
    at rounding distance, and further out, still unit (p - closest point is noise there)."""
    v, f = icosphere(2)
    sample = pcops.sample_points_on_mesh(v, f, 1000, seed=0)
    for scale in (1.0, 1 + 1e-12, 1.1):
        p = (sample.points.detach() * scale).requires_grad_()
        d = pcops.mesh_distance(p, v, f, signed=signed).dists
        (grad,) = torch.autograd.grad(d.sum(), p, create_graph=True)
        (second,) = torch.autograd.grad(grad.sum(), p)
        torch.testing.assert_close(grad.norm(dim=1), torch.ones(1000, dtype=torch.float64), rtol=0, atol=1e-9)
        assert torch.isfinite(second).all()
        on = d.detach() == 0
        if scale == 1.0:
            assert on.sum() > 500 and torch.allclose(grad[on], sample.normals[on], atol=1e-9)
            assert torch.equal(second[on], torch.zeros_like(second[on]))


@pytest.mark.parametrize("kind", ["sphere", "open", "degenerate", "far", "flat", "self_intersecting"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_calls_without_gradients_give_the_differentiable_calls_values(kind, dtype):
    """Without a gradient to keep, the distances, closest points and weights come from one kernel
    (pcops::mesh_measure), else from the differentiable torch formula: the same values (signed
    or not, and inf / NaN beyond max_dist)."""
    v, f, q = mesh(kind, torch.Generator().manual_seed(4))
    v, q = v.to(dtype), q.to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for signed in (False, True):
        for max_dist in (None, 0.3):
            with torch.no_grad():
                fast = pcops.mesh_distance(q, v, f, signed=signed, max_dist=max_dist)
            slow = pcops.mesh_distance(q.clone().requires_grad_(), v, f, signed=signed, max_dist=max_dist)
            assert torch.equal(fast.face, slow.face)
            if max_dist is not None:
                assert (fast.face < 0).any() and (fast.face >= 0).any()
            for name in ("dists", "closest", "bary"):
                torch.testing.assert_close(getattr(fast, name), getattr(slow, name).detach(), equal_nan=True, **tol, msg=name)


@pytest.mark.parametrize("height", [1e-5, 1e-3, 0.05, 0.2])
def test_slivers_just_above_flat_are_measured_exactly(height):
    """A sliver (height 1e-5-0.2 of its longest edge, float32) beside a small face: the search's
    squared distances (Voronoi regions only for well-shaped triangles) pick the nearest face."""
    g = torch.Generator().manual_seed(2)
    v = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, height, 0.0],
                      [0.5, -0.0035, 0.0005], [0.51, -0.0035, 0.0005], [0.5, -0.0035, 0.0105]], dtype=F64)
    f = torch.tensor([[0, 1, 2], [3, 4, 5]])
    q = torch.cat([torch.tensor([[0.5, -0.0025, 0.0]], dtype=F64),
                   torch.rand(300, 3, generator=g, dtype=F64) * torch.tensor([1.2, 0.02, 0.02], dtype=F64) - torch.tensor([0.1, 0.01, 0.01], dtype=F64)])
    for dtype in (torch.float32, F64):
        out = pcops.mesh_distance(q.to(dtype), v.to(dtype), f)
        expected = reference.mesh_distance(q.to(dtype).double(), v.to(dtype).double(), f)[0]
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(out.dists.double(), expected, rtol=0, atol=tol)


def test_the_hierarchy_is_the_same_built_a_launch_per_level(monkeypatch):
    """The parent levels a launch per level (CUDA's way) and the radii a launch per depth (meshes
    past int32 thread ids) give the one-launch CPU build's hierarchy, bit for bit."""
    tree = importlib.import_module("pcops.ops.mesh._tree")
    v, f = icosphere(3)
    v = v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=v.dtype)
    v[5, 1] = float("nan")  # a NaN corner: the boxes above it are NaN either way
    group = (torch.arange(f.shape[0]) >= f.shape[0] // 3).to(torch.int64)
    expected = tree.build(v, f, group, torch.float64)
    monkeypatch.setattr(tree, "PER_LEVEL", [True])
    monkeypatch.setattr(tree, "THREADS", 1)
    for a, b in zip(expected, tree.build(v, f, group, torch.float64), strict=True):
        assert torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))



@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_split_on_the_threads_gives_the_one_threads_hierarchy(monkeypatch, threads):
    """The faces' split with the subtrees below the root on the threads (from
    ``_tree.SPLIT_WORK``) gives the hierarchy of the split on one thread, bit for bit: one mesh
    and two samples, kept builds and builds from scratch."""
    tree = importlib.import_module("pcops.ops.mesh._tree")
    kept = importlib.import_module("pcops.ops.mesh._kept_tree")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    v, f = icosphere(3)
    v = v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2), dtype=v.dtype)
    for group in (torch.zeros(f.shape[0], dtype=torch.int64), (torch.arange(f.shape[0]) >= f.shape[0] // 3).to(torch.int64)):
        one = bool((group == 0).all())
        built = {}
        for work in (1 << 30, 0):
            monkeypatch.setattr(tree, "SPLIT_WORK", work)
            built[work] = [tree.build(v, f, group, torch.float64, one=one)]
            if one:
                _warp.KEPT.clear()
                assert kept.build(v, f, group, True) is None  # (the shapes' first build: none kept)
                for _ in range(3):  # (the first call makes the kept build, the next ones run it)
                    built[work].append(kept.build(v, f, group, True))
        for a, b in zip(built[1 << 30], built[0], strict=True):
            assert b is not None and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

def test_the_cpu_hierarchy_splits_each_node_along_its_widest_axis():
    """On the CPU the faces are ordered by sample, then as the kd-tree splits points: every node
    of one sample holds, in its first half, the faces whose centroids lie at or below those of its
    second half along the widest axis of its centroids' box (sample ids past int32 included)."""
    tree = importlib.import_module("pcops.ops.mesh._tree")
    gen = torch.Generator().manual_seed(12)
    (v1, f1), (v2, f2) = _sphere(gen, 2), _sphere(gen, 1)
    v, f = torch.cat([v1 * torch.tensor([3.0, 1.0, 0.2], dtype=F64), v2]), torch.cat([f1, f2 + v1.shape[0]])
    group = torch.cat([torch.full((f1.shape[0],), 2**33), torch.full((f2.shape[0],), 5)])
    t = tree.build(v, f, group, torch.float64)
    n = f.shape[0]
    assert torch.equal(torch.sort(t.order).values, torch.arange(n))
    assert torch.equal(t.group, group[t.order]) and bool((t.group[1:] >= t.group[:-1]).all())
    centroid = v[f[t.order]].mean(1)
    depth, split = tree.depth(n), 0
    for d in range(depth):
        for k in range(1 << d):
            first, mid, last = (k * n) >> d, ((2 * k + 1) * n) >> (d + 1), ((k + 1) * n) >> d
            if t.group[first] != t.group[last - 1]:
                continue
            c = centroid[first:last]
            axis = int((c.amax(0) - c.amin(0)).argmax())
            assert c[: mid - first, axis].max() <= c[mid - first :, axis].min()
            split += 1
    assert split > 100


def test_the_gpus_morton_ordered_hierarchy_finds_what_the_cpus_finds(monkeypatch):
    """The faces in Morton order (the GPUs' build), searched on the CPU: the same distances and
    signs, each against the float64 reference."""
    tree = importlib.import_module("pcops.ops.mesh._tree")
    gen = torch.Generator().manual_seed(13)
    for kind in ("open", "self_intersecting", "degenerate", "far"):
        v, f, q = mesh(kind, gen)
        group = torch.zeros(f.shape[0], dtype=torch.int64)
        kd, kd_order = pcops.mesh_distance(q, v, f, signed=True), tree.build(v, f, group, F64).order
        monkeypatch.setattr(tree.nearest, "split_order", lambda c, g, *rest: tree.morton_order(c, g))
        monkeypatch.setattr(_warp, "PREPARED", [False])  # (a kept build orders by the kd splits: the call builds from scratch)
        morton, morton_order = pcops.mesh_distance(q, v, f, signed=True), tree.build(v, f, group, F64).order
        monkeypatch.undo()
        assert not torch.equal(kd_order, morton_order)
        for out in (kd, morton):
            assert_mesh_distance(out, q, v, f, F64)
        torch.testing.assert_close(kd.dists, morton.dists, rtol=0, atol=1e-12 * (1 + float(q.abs().max())))


def hierarchy_mesh(kind, gen):
    """(vertices, faces) of a mesh for the hierarchy's build tests: :func:`mesh`'s kinds, or
    "duplicates" (faces with equal centroids: ties of the split order), "soup" (6,000 random
    faces, whose split order runs its top levels a launch per depth) and "nan" (a sphere with a
    NaN and an infinite vertex)."""
    if kind == "duplicates":
        v, f, _ = mesh("open", gen)
        return v, torch.cat([f, f.flip(1), f])
    if kind == "soup":
        return torch.rand(3000, 3, generator=gen, dtype=F64), torch.randint(0, 3000, (6000, 3), generator=gen)
    v, f, _ = mesh("sphere" if kind == "nan" else kind, gen)
    if kind == "nan":
        v = v.clone()
        v[3, 1], v[7, 0] = float("nan"), float("inf")
    return v, f


@pytest.mark.parametrize("kind", ["open", "self_intersecting", "degenerate", "far", "duplicates", "soup"])
def test_one_meshs_hierarchy_without_the_sort_by_sample_is_the_same(kind):
    """The hierarchy of one mesh (the layout's ``batch == 0``) skips the sort of its faces by
    sample id: every tensor of it equals the sorted build's, bit for bit, in both dtypes
    ("soup": 6,000 faces, whose split order runs its top levels a launch per depth)."""
    tree = importlib.import_module("pcops.ops.mesh._tree")
    gen = torch.Generator().manual_seed(17)
    v, f = hierarchy_mesh(kind, gen)
    group = torch.zeros(f.shape[0], dtype=torch.int64)
    for dtype in (torch.float32, F64):
        sorted_, one = tree.build(v, f, group, dtype), tree.build(v, f, group, dtype, one=True)
        for name, a, b in zip(tree.Tree._fields, sorted_, one):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["sphere", "open", "degenerate", "duplicates", "soup"])
def test_a_hierarchy_for_unsigned_searches_is_the_signed_one_without_the_winding_data(kind):
    """``winding=False`` (unsigned ``mesh_distance`` with a mesh, ``point_mesh_face_distance``)
    builds every tensor the searches read exactly as the full build does, in both dtypes, one
    mesh or sorted by sample, and leaves the winding number's four empty; the unsigned results
    of a call with the mesh equal those through a full ``mesh_bvh``, bit for bit."""
    tree = importlib.import_module("pcops.ops.mesh._tree")
    gen = torch.Generator().manual_seed(5)
    v, f = hierarchy_mesh(kind, gen)
    group = torch.zeros(f.shape[0], dtype=torch.int64)
    winding = ("center", "normal", "moment", "radius")
    for dtype in (torch.float32, F64):
        for one in (False, True):
            full, unsigned = tree.build(v, f, group, dtype, one), tree.build(v, f, group, dtype, one, winding=False)
            for name, a, b in zip(tree.Tree._fields, full, unsigned):
                if name in winding:
                    assert b.shape[0] == 0 and b.shape[1:] == a.shape[1:] and b.dtype == a.dtype, name
                else:
                    assert torch.equal(a, b), name
        vd = v.to(dtype)
        lo, hi = vd.amin(0), vd.amax(0)
        q = lo - 0.2 * (hi - lo) + 1.4 * (hi - lo) * torch.rand(500, 3, generator=gen, dtype=dtype)
        for a, b in zip(pcops.mesh_distance(q, vd, f), pcops.mesh_distance(q, pcops.mesh_bvh(vd, f)), strict=True):
            assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", ["sphere", "open", "degenerate", "far", "self_intersecting", "duplicates", "soup", "nan"])
def test_the_cpu_s_radius_walk_equals_the_all_leaves_launch(kind, monkeypatch):
    """The CPU's node radii (a walk per node skipping boxes within the farthest corner found)
    equal the launch over every (depth, leaf) pair, bit for bit: every tensor of the hierarchy,
    both dtypes, one mesh and sorted, adversarial meshes (a NaN vertex and an infinite one: their
    corners never count), the walks shared by the threads as the build shares them and by 1, 2,
    3 and 7 threads (each a part of every depth's nodes)."""
    tree = importlib.import_module("pcops.ops.mesh._tree")
    gen = torch.Generator().manual_seed(23)
    v, f = hierarchy_mesh(kind, gen)
    group = torch.zeros(f.shape[0], dtype=torch.int64)
    shared = tree.radius_walks
    for dtype in (torch.float32, F64):
        for one in (False, True):
            monkeypatch.setattr(tree, "RADIUS_WALK", [False])
            launch = tree.build(v, f, group, dtype, one)
            monkeypatch.setattr(tree, "RADIUS_WALK", [True])
            for walks in (None, 1, 2, 3, 7):
                monkeypatch.setattr(tree, "radius_walks", shared if walks is None else (lambda n, walks=walks: walks))
                walk = tree.build(v, f, group, dtype, one)
                for name, a, b in zip(tree.Tree._fields, walk, launch):
                    assert torch.equal(a, b) or (name != "radius" and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)), name
                assert torch.equal(walk.radius, launch.radius), walks


@pytest.mark.parametrize("grad", [False, True])
def test_far_points_beyond_a_thin_face_s_short_edge_keep_their_distance(grad):
    """A float32 needle triangle (1e-2 wide at its base, 1 long) and points up to 2.4e4 beyond
    its base: whether a point projects inside the face is decided from p - corner only (the cross
    products of two corner offsets rounded by the squared distance over the short edge: a
    distance 35 short in 3e4 before), in the search, the kernel and the torch formulas."""
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(1)))
    v = (torch.tensor([[0, 0, 0], [1, -5e-3, 0], [1, 5e-3, 0]], dtype=F64) @ rotation.T).float()
    f = torch.tensor([[0, 2, 1]])
    gen = torch.Generator().manual_seed(2)
    beyond = 3e4 * (0.01 + 0.8 * torch.rand(2000, 1, generator=gen, dtype=F64))
    across = (torch.rand(2000, 1, generator=gen, dtype=F64) - 0.5) * 0.008
    height = 3e4 * (2 * torch.rand(2000, 1, generator=gen, dtype=F64) - 1)
    axes = rotation.T  # rows: the triangle's frame
    q = ((v[1] + v[2]).double() / 2 + beyond * axes[0] + across * axes[1] + height * axes[2]).float().requires_grad_(grad)
    d = pcops.mesh_distance(q, v, f).dists
    expected = reference.mesh_distance(q.detach(), v, f)[0]
    assert torch.allclose(d.detach().double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_points_over_thin_float64_faces_keep_their_distance_and_gradient(device):
    """float64 faces whose height is 70 to 10^8 eps of their longest edge and points 3e-4 to 0.3
    over them, projecting inside them and outside (1e-9 aside, or along the plain float64 normal,
    which a thin face's rounding tilts): distances within 1e-12 of the
    exact ones (rational arithmetic) without and with a gradient, which is the direction away
    from the exact closest point (up to the face's width over the distance: its two long edges
    are nearly tied). The plane's normal comes from the exact differences and products of the
    corners: the plain float64 cross product is off by about eps over the shape factor (40% off
    with a gradient asked for and 1e-8 without, before). On CUDA too, whose FMA contraction must
    not merge the products of those transformations."""
    gen = torch.Generator().manual_seed(5)
    eps = torch.finfo(F64).eps
    f = torch.tensor([[0, 1, 2]])
    regions = set()
    for ratio in (70.0, 1e3, 1e5, 1e8):
        rotation, _ = torch.linalg.qr(torch.randn(3, 3, dtype=F64, generator=gen))
        v = torch.tensor([[0, 0, 0], [1, 0, 0], [0.37, ratio * eps, 0]], dtype=F64) @ rotation.T + torch.randn(3, dtype=F64, generator=gen)
        a, b, c = v
        normal = reference.exact_unit_normal(a, b, c)
        at = torch.tensor([[0.5, 0.2], [0.3, 0.6], [0.7, 0.05]], dtype=F64)
        base = a + at[:, :1] * (b - a) + at[:, 1:] * (c - a)
        plain = torch.linalg.cross(b - a, c - a)  # (points along it project outside the thin faces)
        heights = torch.tensor([3e-4, 1e-2, 0.3], dtype=F64).repeat_interleave(9)
        q = torch.cat([base + h * n + aside * rotation[:, 1] for h in (3e-4, 1e-2, 0.3)
                       for n, aside in ((normal, 0.0), (normal, 1e-9), (plain / plain.norm(), 0.0))])
        exact = [reference.exact_triangle_point(x, a, b, c) for x in q]
        regions |= {where for _, _, where in exact}
        dist = torch.tensor([float(d2) ** 0.5 for d2, _, _ in exact], dtype=F64)
        closest = torch.tensor([[float(x) for x in point] for _, point, _ in exact], dtype=F64)
        on = dict(device=device)
        assert torch.allclose(pcops.mesh_distance(q.to(**on), v.to(**on), f.to(**on)).dists.cpu(), dist, rtol=1e-12, atol=0), ratio
        leaf = q.to(**on).requires_grad_()
        d = pcops.mesh_distance(leaf, v.to(**on), f.to(**on)).dists
        (grad,) = torch.autograd.grad(d.sum(), leaf)
        assert torch.allclose(d.detach().cpu(), dist, rtol=1e-12, atol=0), (ratio, d, dist)
        width = 2 * ratio * eps  # (the corners' spread over a unit edge)
        assert ((grad.cpu() - (q - closest) / dist[:, None]).norm(dim=1) <= 1e-9 + width / heights).all(), ratio
    assert regions == {"plane", "edge"}


@pytest.mark.parametrize("grad", [False, True])
def test_points_over_thin_float32_faces_keep_their_distance(grad):
    """float32 faces whose height is 70 to 10^4 eps of their longest edge (above the flatness
    threshold, so measured by their planes) and points 3e-4 to 0.3 over their interiors: the
    plane is computed in float64 in the search, the kernel and the torch formulas (a float32
    normal is off by about eps over the shape factor: up to 138% off before). With a second,
    well-shaped face just farther on the other side, the search still finds the thin one."""
    gen = torch.Generator().manual_seed(4)
    eps = torch.finfo(torch.float32).eps
    for ratio in (70.0, 100.0, 1e3, 1e4):
        rotation, _ = torch.linalg.qr(torch.randn(3, 3, dtype=F64, generator=gen))
        corners = torch.tensor([[0, 0, 0], [1, 0, 0], [0.37, ratio * eps, 0]], dtype=F64)
        thin = (corners @ rotation.T + torch.randn(3, dtype=F64, generator=gen)).float()
        a, b, c = thin.double()
        normal = torch.linalg.cross(b - a, c - a)
        normal = normal / normal.norm()
        heights = torch.tensor([3e-4, 1e-2, 0.3], dtype=F64)
        at = torch.tensor([[0.5, 0.2], [0.3, 0.6], [0.7, 0.05]], dtype=F64)
        base = a + at[:, :1] * (b - a) + at[:, 1:] * (c - a)
        q = (base[:, None] + heights[None, :, None] * normal).reshape(-1, 3).float()
        # the second face: a large triangle parallel to the thin one, beyond the point, 1.001 times its height from it
        for h in heights.tolist():
            shift = a + 2.001 * h * normal
            other = torch.stack([shift - 5 * (b - a), shift + 5 * (b - a) - 5 * (c - a), shift + 5 * (c - a) + 5 * (b - a)]).float()
            v, f = torch.cat([thin, other]), torch.tensor([[0, 1, 2], [3, 4, 5]])
            near = q.reshape(3, 3, 3)[:, heights.tolist().index(h)].clone().requires_grad_(grad)
            out = pcops.mesh_distance(near, v, f)
            exact, _, face = reference.mesh_distance(near.detach(), v, f)
            assert torch.equal(out.face, face) and bool((face == 0).all()), (ratio, h)
            assert torch.allclose(out.dists.detach().double(), exact, rtol=4 * eps, atol=0), (ratio, h, out.dists, exact)


@pytest.mark.parametrize("dtype, scales", [(torch.float32, (1e-15, 1e-13, 1e-11, 1e-9, 1e-6, 1e7, 3e7, 9e7)), (F64, (1e-60, 1e-30, 1e30, 1e55, 1e60))])
def test_the_nearest_face_and_the_sign_keep_at_every_scale_the_coordinates_allow(dtype, scales):
    """A squared height of size^6 (h h / |n|^2) or a dipole term of size^5 over- or underflowed
    at sizes whose coordinates and distances fit the dtype (float32 1e7-1e8, within its limit):
    the farther of two parallel faces came back, and every inside point of a closed mesh read
    outside; below float32 1e-8, products of four edges (the search's Voronoi tests) and of three
    corners (the solid angles) underflowed: wrong faces from 1e-11, every sign outside from 1e-15.
    Scaled copies of a unit case give the unit answer times the scale: the nearer face, its
    distance, the signs, and point_mesh_face_distance times the scale squared. Float32 meshes
    whose coordinates all lie below 1e-15 (their squared distances near the subnormals) are
    ValueErrors, as those beyond 1e8."""
    two = torch.tensor([[-1, -1, 2], [3, -1, 2], [-1, 3, 2], [-1, -1, 1], [3, -1, 1], [-1, 3, 1]], dtype=F64) / 3  # z = 2/3 (face 0), 1/3
    faces = torch.tensor([[0, 1, 2], [3, 4, 5]])
    v, f = icosphere(2)
    gen = torch.Generator().manual_seed(31)
    q = torch.nn.functional.normalize(torch.randn(200, 3, generator=gen, dtype=F64), dim=-1) * (0.3 + 1.2 * torch.rand(200, 1, generator=gen, dtype=F64))
    inside = q.norm(dim=-1) < 0.9  # (the icosphere's faces lie between radius 0.98 and 1)
    clear = inside | (q.norm(dim=-1) > 1.1)
    unit = pcops.mesh_distance(q.to(dtype), v.to(dtype), f, signed=True).dists.double()
    sample = pcops.sample_points_on_mesh(v, f, 300, seed=1).points
    noisy = sample + 0.05 * torch.randn(300, 3, generator=torch.Generator().manual_seed(32), dtype=F64)
    loss = pcops.point_mesh_face_distance(noisy.to(dtype), v.to(dtype), f).double()
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    for s in scales:
        near = pcops.mesh_distance(torch.zeros(1, 3, dtype=dtype), (two * s).to(dtype), faces)
        assert near.face.tolist() == [1], s
        torch.testing.assert_close(near.dists.double(), torch.tensor([s / 3], dtype=F64), rtol=rtol, atol=0)
        d = pcops.mesh_distance((q * s).to(dtype), (v * s).to(dtype), f, signed=True).dists.double()
        assert torch.equal((d < 0)[clear], inside[clear]), s
        torch.testing.assert_close(d / s, unit, rtol=rtol, atol=rtol)
        scaled = pcops.point_mesh_face_distance((noisy * s).to(dtype), (v * s).to(dtype), f).double()
        torch.testing.assert_close(scaled / (s * s), loss, rtol=10 * rtol, atol=0)
    if dtype == torch.float32:
        with pytest.raises(ValueError, match="vertices has coordinates only up to 4e-16"):
            pcops.mesh_distance(q.float() * 4e-16, (v * 4e-16).float(), f)
        at_zero = pcops.mesh_distance(q.float(), torch.zeros(3, 3), torch.tensor([[0, 1, 2]])).dists  # (a mesh at 0: no error)
        torch.testing.assert_close(at_zero, q.float().norm(dim=-1), rtol=1e-6, atol=0)


def _checks_pass(vertices, faces, searched) -> bool:
    """Whether the layout's torch checks of one mesh pass (the reference of the plain check)."""
    from pcops import _validate
    from pcops._layout import meshes

    checks = _validate.Checks()
    meshes._vertex_values(checks, vertices, searched)
    checks.in_range("faces", faces, 0, vertices.shape[0] - 1)
    try:
        checks.run()
    except ValueError:
        return False
    return True


def test_one_cpu_meshs_plain_value_check_agrees_with_the_checks_and_keeps_their_messages():
    """A plain CPU mesh's values are read from the extremes of its vertices and faces instead of
    the layout's checks: the same verdict on every bound (NaN, +-inf, faces out of range at
    either end, float32 extents at and just past both limits, an all-zero mesh, float64 meshes
    past the float32 limits), the failures still raised by the checks with their messages, and
    the flat mesh the same faces as the clamped ones."""
    from pcops._layout import meshes

    v, f = icosphere(1)
    v = v.double()
    big32 = torch.tensor(meshes.FLOAT32_EXTENT, dtype=torch.float32)
    least32 = torch.tensor(meshes.FLOAT32_LEAST, dtype=torch.float32)
    nudge = lambda x, to: torch.nextafter(x, torch.tensor(to, dtype=x.dtype)).item()  # noqa: E731
    cases = {}
    for dtype in (torch.float32, torch.float64):
        base = v.to(dtype)
        cases[f"plain {dtype}"] = (base, f)
        for name, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", -float("inf"))):
            bad = base.clone()
            bad[5, 2] = value
            cases[f"{name} {dtype}"] = (bad, f)
        cases[f"face -1 {dtype}"] = (base, torch.cat([f, torch.tensor([[0, -1, 2]])]))
        cases[f"face V {dtype}"] = (base, torch.cat([f, torch.tensor([[0, 1, base.shape[0]]])]))
        cases[f"face V-1 {dtype}"] = (base, torch.cat([f, torch.tensor([[0, 1, base.shape[0] - 1]])]))
        cases[f"zeros {dtype}"] = (torch.zeros_like(base), f)
        for limit, name in ((big32, "extent"), (least32, "least")):
            for value in (limit.item(), nudge(limit, 0.0), nudge(limit, float("inf"))):
                for sign in (1.0, -1.0):
                    scaled = base / base.abs().amax() * (value / 2)
                    scaled[7, 0] = sign * value  # (the largest coordinate, at the bound or a float32 step off)
                    cases[f"{name} {sign * value:.9g} {dtype}"] = (scaled.to(dtype), f)
    verdicts = set()
    for name, (vertices, faces) in cases.items():
        for searched in (True, False):
            expected = _checks_pass(vertices, faces, searched)
            assert meshes._plain_values(vertices, faces, vertices.shape[0], searched) == expected, (name, searched)
            verdicts.add(expected)
            if searched and not expected:
                with pytest.raises(ValueError, match="vertices contains NaN|faces values|vertices has coordinates"):
                    pcops.mesh_bvh(vertices, faces)
            if expected:
                flat = pcops._layout.mesh(vertices.requires_grad_(), faces, checks=pcops._validate.Checks(), searched=searched)
                assert torch.equal(flat.faces, faces.clamp(0, vertices.shape[0] - 1)), name
    assert verdicts == {True, False}
    # a tensor on another device than the CPU (meta here: no values) takes the checks
    assert not meshes._plain_values(v.to("meta"), f.to("meta"), v.shape[0], True)
