"""Closed meshes in signed ``mesh_distance``: the test of closedness (``pcops::mesh_closed``,
its CPU kernel and its torch form against a count of directed edges) and the queries that take
the winding number of the query before them (the sign still the exact winding number's)."""

import collections

import pytest
import torch

import pcops
from pcops.ops.mesh import _search
from tests import reference
from tests.ops.mesh.test_distance import SHIFT, _sphere
from tests.op_table import icosphere

F64 = torch.float64


def _closed_by_count(faces, group, padding, n_vertices):
    """Every directed edge (u != w) of the faces but padding (sample id ``padding``) used as often
    as its reverse within its sample, no lower vertex on more than ``_search.DEGREE`` edge uses,
    no vertex index out of range."""
    count, degree = collections.Counter(), collections.Counter()
    for face, g in zip(faces.tolist(), group.tolist(), strict=True):
        if g != padding:
            if min(face) < 0 or max(face) >= n_vertices:
                return False
            for e in range(3):
                u, w = face[e], face[(e + 1) % 3]
                if u != w:
                    count[g, u, w] += 1
                    degree[min(u, w)] += 1
    return all(count[g, u, w] == count[g, w, u] for g, u, w in count) and all(d <= _search.DEGREE for d in degree.values())


def _shape_by_faces(v, faces, group, padding):
    """The largest squared longest edge over twice the area of the faces (but padding) above a
    quarter of the flatness threshold."""
    a, b, c = v.double()[faces].unbind(1)
    area2 = torch.linalg.cross(b - a, c - a).norm(dim=-1)
    longest = torch.stack([(b - a).square().sum(-1), (c - b).square().sum(-1), (a - c).square().sum(-1)]).amax(0)
    solid = (group != padding) & (area2 > _search.FLAT * torch.finfo(v.dtype).eps / 4 * longest)
    return float((longest / area2)[solid].max()) if solid.any() else 0.0


def _cone(sides):
    """A closed cone: a fan of ``sides`` faces about its apex (vertex 0) and a fan about the base's centre."""
    t = torch.arange(sides, dtype=F64) * 2 * torch.pi / sides
    ring = torch.stack([t.cos(), t.sin(), torch.zeros_like(t)], 1)
    v = torch.cat([torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64), ring])
    i = torch.arange(sides) + 2
    j = (torch.arange(sides) + 1) % sides + 2
    return v, torch.cat([torch.stack([torch.zeros_like(i), i, j], 1), torch.stack([torch.ones_like(i), j, i], 1)])


def _meshes(gen):
    v, f = _sphere(gen)
    far = v.shape[0] + 5
    yield "sphere", v, f
    yield "flipped face", v, torch.cat([f[:1].flip(1), f[1:]])
    yield "a face removed", v, f[1:]
    yield "repeated corners", v, torch.cat([f, torch.tensor([[0, 0, 1], [2, 2, 2]])])
    yield "a collinear face", v, torch.cat([f, torch.tensor([[0, 1, 2]])])
    yield "a face and its reverse", v, torch.cat([f, f[:1], f[:1].flip(1)])
    yield "a face twice", v, torch.cat([f, f[:1]])
    (v1, f1), (v2, f2) = _sphere(gen), _sphere(gen)
    yield "two spheres", torch.cat([v1 - 0.3, v2 + 0.3]), torch.cat([f1, f2 + v1.shape[0]])
    yield "an unused vertex past the faces", torch.cat([v, torch.zeros(far - v.shape[0], 3, dtype=F64)]), f
    cv, cf = _cone(_search.DEGREE // 2)  # the apex: the lower end of DEGREE edge uses
    yield "a cone within the degree", cv, cf
    cv, cf = _cone(_search.DEGREE // 2 + 1)
    yield "a cone past the degree (counted open)", cv, cf
    yield "a face past the vertices (counted open)", v, torch.cat([f, torch.tensor([[0, 1, v.shape[0]]])])
    yield "a face across two samples' vertices", v, f  # with the samples below


def test_closedness_is_an_exact_count_of_directed_edges():
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for name, v, f in _meshes(gen):
        n = f.shape[0]
        layouts = [(None, torch.zeros(n, dtype=torch.int64)),  # one mesh
                   (2, torch.cat([torch.zeros(n - 1, dtype=torch.int64), torch.full((1,), 2)])),  # the last face padding
                   (None, torch.full((n,), 2**62)),  # a sample id past 2^62 is a sample like any other
                   (None, (torch.arange(n) >= n // 2).to(torch.int64))]  # faces of two samples on shared vertices: open seams
        for padding, group in layouts:
            expected = _closed_by_count(f, group, padding, v.shape[0])
            seen.add(expected)
            for dtype in (torch.float32, F64):
                got = _search.closed(v.to(dtype), f, group, padding)
                by_torch = _search._closed_torch(v.to(dtype), f, group, padding is not None, -1 if padding is None else padding)
                assert got[0].item() == by_torch[0].item() == expected, (name, padding)
                if f.max() < v.shape[0]:
                    shape = _shape_by_faces(v.to(dtype), f, group, padding)
                    assert got[1].item() == pytest.approx(shape, rel=1e-12) and by_torch[1].item() == pytest.approx(shape, rel=1e-12), name
    assert seen == {True, False}


def _never_closed(*args):
    return [torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=F64), torch.full((args[1].shape[0] if args else 0, 3), -1)]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("kind", ["sphere", "self_intersecting", "hollow", "far"])
def test_queries_of_a_closed_mesh_share_walks_and_keep_the_exact_sign(kind, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    v, f = _sphere(gen, 2)
    if kind == "self_intersecting":  # w = 2 where the two spheres overlap
        v, f = torch.cat([v - 0.3, v + 0.3]), torch.cat([f, f + v.shape[0]])
    elif kind == "hollow":  # a reversed inner sphere: w = 0 inside it
        v, f = torch.cat([v, 0.5 * v]), torch.cat([f, f.flip(1) + v.shape[0]])
    q = 3 * torch.rand(6000, 3, generator=gen, dtype=F64) - 1.5
    q[::500] = float("nan")  # never take nor give a winding number
    if kind == "far":
        v, q = v + SHIFT, q + SHIFT
    v, q = v.to(dtype), q.to(dtype)
    bvh = pcops.mesh_bvh(v, f)
    closed = _search.closed(v, f, torch.zeros(f.shape[0], dtype=torch.int64), None)
    assert closed[0].item() == 1
    shared = pcops.mesh_distance(q, bvh, signed=True, validate=False).dists
    # every query walked: the same signs, and the exact winding number's (an integer: no query near 1/2)
    monkeypatch.setattr(_search, "closed", _never_closed)
    walked = pcops.mesh_distance(q, bvh, signed=True, validate=False).dists
    assert torch.equal(shared.isnan(), walked.isnan()) and torch.equal(shared[~shared.isnan()], walked[~walked.isnan()])
    finite = ~q.isnan().any(1)
    w = reference.winding_number(q[finite], v, f)
    assert ((w - w.round()).abs() < 1e-6).all()
    assert torch.equal(shared[finite] < 0, w >= 0.5)
    # the queries did share walks: the winding numbers of walked queries differ from their own by rounding
    search = bvh.tree
    group = torch.zeros(q.shape[0], dtype=torch.int64)
    face, rows, _ = _search.closest(q, group, search, float("inf"), False)
    reach = torch.where(face >= 0, walked.abs(), 0)
    w_shared = _search.winding(q, group, search, rows, reach, closed)
    w_own = _search.winding(q, group, search, rows, reach, _never_closed())
    assert (w_shared[finite] != w_own[finite]).sum() > 100
    assert torch.equal(w_shared[finite] >= 0.5, w_own[finite] >= 0.5)


def test_a_padded_batch_of_closed_meshes_ignores_its_padding_faces():
    gen = torch.Generator().manual_seed(2)
    v1, f1 = _sphere(gen, 2)
    v2, f2 = icosphere(1)
    v2 = v2.to(F64) * 0.7
    q = 3 * torch.rand(2, 3000, 3, generator=gen, dtype=F64) - 1.5
    for open_second in (False, True):
        f2b = f2[1:] if open_second else f2
        vertices = torch.zeros(2, v1.shape[0], 3, dtype=F64)
        vertices[0], vertices[1, : v2.shape[0]] = v1, v2
        faces = torch.zeros(2, f1.shape[0], 3, dtype=torch.int64)
        faces[0], faces[1, : f2b.shape[0]] = f1, f2b
        faces[1, f2b.shape[0]:] = f1[: f1.shape[0] - f2b.shape[0]]  # padding that would open the mesh
        lengths = torch.tensor([f1.shape[0], f2b.shape[0]])
        bvh = pcops.mesh_bvh(vertices, faces, vertices_lengths=torch.tensor([v1.shape[0], v2.shape[0]]), faces_lengths=lengths)
        assert _search.closed(bvh.vertices, bvh.faces, bvh.face_group, 3)[0].item() == int(not open_second)
        d = pcops.mesh_distance(q, bvh, signed=True).dists
        for b, (vb, fb) in enumerate(((v1, f1), (v2, f2b))):
            w = reference.winding_number(q[b], vb, fb)
            clear = (w - 0.5).abs() >= 0.1
            assert torch.equal((d[b] < 0)[clear], (w >= 0.5)[clear]), (open_second, b)


def test_a_thin_face_does_not_let_a_query_take_a_winding_number_across_the_surface(monkeypatch):
    """A closed float32 tetrahedron whose base is split in three, one of them a sliver (height
    3e-4 of its longest edge, above the flat threshold): its normal's rounding makes the first
    query's distance 23% too long, and the ball of that distance reaches the second query, inside."""
    v = torch.tensor([[0.15480799973011017, -0.45142436027526855, -0.14916610717773438], [-0.15480799973011017, 0.45142436027526855, 0.14916610717773438],
                      [-4.9445192416897044e-05, -4.11896726291161e-05, 7.333778194151819e-05], [-0.40541431307792664, -0.33772510290145874, 0.6013160347938538],
                      [0.33070841431617737, -0.07772523909807205, 0.5784381628036499]])
    f = torch.tensor([[0, 2, 1], [1, 2, 3], [3, 2, 0], [0, 1, 4], [1, 3, 4], [3, 0, 4]])
    q = torch.tensor([[-0.06201552227139473, 0.1805517077445984, 0.05962521955370903], [-0.06192322075366974, 0.18056106567382812, 0.05969270318746567]])
    assert _search.closed(v, f, torch.zeros(6, dtype=torch.int64), None)[0].item() == 1
    w = reference.winding_number(q, v, f)
    assert w[0] < 0.1 and w[1] > 0.9
    shared = pcops.mesh_distance(q, v, f, signed=True).dists
    monkeypatch.setattr(_search, "closed", _never_closed)
    walked = pcops.mesh_distance(q, v, f, signed=True).dists
    assert torch.equal(shared, walked) and shared[0] > 0 and shared[1] < 0


def test_packed_closed_and_open_meshes_with_large_sample_ids_and_a_band():
    gen = torch.Generator().manual_seed(3)
    v1, f1 = _sphere(gen, 2)
    v2, f2 = icosphere(1)
    v2, f2 = v2.to(F64) * 0.6 + 0.2, f2[4:]  # open: four faces removed
    for ids in ((0, 1), (2**62, 2**62 + 1), (2**62 + 1, 5)):
        vertices, faces = torch.cat([v1, v2]), torch.cat([f1, f2 + v1.shape[0]])
        vertices_batch = torch.cat([torch.full((v1.shape[0],), ids[0]), torch.full((v2.shape[0],), ids[1])])
        q = 3 * torch.rand(4000, 3, generator=gen, dtype=F64) - 1.5
        points_batch = torch.tensor(ids)[torch.randint(0, 2, (4000,), generator=gen)]
        for max_dist in (None, 0.2):
            d = pcops.mesh_distance(q, vertices, faces, signed=True, max_dist=max_dist, points_batch=points_batch, vertices_batch=vertices_batch).dists
            for sid, (vb, fb) in zip(ids, ((v1, f1), (v2, f2)), strict=True):
                rows = points_batch == sid
                w = reference.winding_number(q[rows], vb, fb)
                clear = (w - 0.5).abs() >= 0.1
                assert torch.equal((d[rows] < 0)[clear], (w >= 0.5)[clear]), (ids, max_dist, sid)


# A unit box whose bottom is split with a sliver face (A, E, C), E at about 64 eps of AC (the
# flatness threshold: the rounded cross product decides whether it is measured by its plane),
# randomly rotated; two queries just above and below the sliver.
V64 = [[0.0, 0.0, 0.0], [0.12925072306469276, 0.963132589112983, -0.23594462565563112], [-0.8596086312631996, 1.106039372785955, -0.19429335270425374], [-0.9888593543278924, 0.14290678367297205, 0.04165127295137737], [-0.4298043156316157, 0.5530196863929658, -0.09714667635212293], [0.07383378593488128, 0.22793259303743324, 0.970873475322997], [0.20308450899957403, 1.1910651821504163, 0.7349288496673658], [-0.7857748453283183, 1.3339719658233882, 0.7765801226187432], [-0.9150255683930111, 0.3708393767104053, 1.0125247482743742]]
Q64 = [[-0.42980431563164057, 0.5530196863928607, -0.09714667635261134], [-0.42980431563156707, 0.5530196863930885, -0.09714667635164043]]
V32 = [[0.0, 0.0, 0.0], [-0.6652421951293945, 0.6735954880714417, -0.32205885648727417], [-1.1287908554077148, 0.6391222476959229, 0.5633417367935181], [-0.4635486304759979, -0.03447321057319641, 0.8854005932807922], [-0.5643938779830933, 0.31955572962760925, 0.28168007731437683], [0.5852994322776794, 0.7382957935333252, 0.33517730236053467], [-0.07994275540113449, 1.4118913412094116, 0.013118435628712177], [-0.5434914231300354, 1.377418041229248, 0.8985190391540527], [0.12175081670284271, 0.7038226127624512, 1.2205779552459717]]
Q32 = [[-0.5645706057548523, 0.3193381428718567, 0.2815728783607483], [-0.5642194747924805, 0.31978142261505127, 0.2817734479904175]]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("grad", [False, True])
def test_a_face_at_the_flatness_threshold_counts_in_the_shape_factor(dtype, grad, monkeypatch):
    v, q = (torch.tensor(V32), torch.tensor(Q32)) if dtype == torch.float32 else (torch.tensor(V64, dtype=F64), torch.tensor(Q64, dtype=F64))
    f = torch.tensor([[0, 4, 2], [0, 2, 1], [0, 3, 4], [4, 3, 2], [5, 6, 7], [5, 7, 8], [0, 1, 6], [0, 6, 5], [1, 2, 7], [1, 7, 6], [2, 3, 8],
                      [2, 8, 7], [3, 0, 5], [3, 5, 8]])
    w = reference.winding_number(q, v, f)
    assert w[0] < 0.1 and w[1] > 0.9

    def run():
        with torch.set_grad_enabled(grad):
            return pcops.mesh_distance(q.clone().requires_grad_(grad), v, f, signed=True).dists.detach()

    shared = run()
    monkeypatch.setattr(_search, "closed", _never_closed)
    assert torch.equal(shared, run()) and shared[0] > 0 and shared[1] < 0
