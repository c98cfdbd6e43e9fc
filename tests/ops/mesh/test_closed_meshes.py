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


def _closed_by_count(faces, group, limit, n_vertices):
    """Every directed edge (u != w) of the faces below ``limit`` as often as its reverse, and no
    lower vertex on more than ``_search.DEGREE`` edges."""
    count, degree = collections.Counter(), collections.Counter()
    for face, g in zip(faces.tolist(), group.tolist(), strict=True):
        if g < limit:
            for e in range(3):
                u, w = face[e], face[(e + 1) % 3]
                if u != w:
                    count[u, w] += 1
                    degree[min(u, w)] += 1
    return all(count[u, w] == count[w, u] for u, w in count) and all(d <= _search.DEGREE for d in degree.values())


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
    cv, cf = _cone(_search.DEGREE // 2)
    yield "a cone within the degree", cv, cf
    cv, cf = _cone(_search.DEGREE + 1)
    yield "a cone past the degree (counted open)", cv, cf


def test_closedness_is_an_exact_count_of_directed_edges():
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for name, v, f in _meshes(gen):
        for limit, group in ((2**62, torch.zeros(f.shape[0], dtype=torch.int64)),  # one mesh
                             (1, torch.cat([torch.zeros(f.shape[0] - 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)]))):  # last face padding
            expected = _closed_by_count(f, group, limit, v.shape[0])
            seen.add(expected)
            assert _search.closed(f, group, v.shape[0], limit).item() == expected, (name, limit)
            assert _search._closed_torch(f, group, limit, v.shape[0]).item() == expected, (name, limit)
    assert seen == {True, False}


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
    assert _search.closed(f, torch.zeros(f.shape[0], dtype=torch.int64), v.shape[0], 2**62).item() == 1
    shared = pcops.mesh_distance(q, bvh, signed=True, validate=False).dists
    # every query walked: the same signs, and the exact winding number's (an integer: no query near 1/2)
    monkeypatch.setattr(_search, "closed", lambda faces, *args: torch.zeros(1, dtype=torch.int32))
    walked = pcops.mesh_distance(q, bvh, signed=True, validate=False).dists
    assert torch.equal(shared.isnan(), walked.isnan()) and torch.equal(shared[~shared.isnan()], walked[~walked.isnan()])
    finite = ~q.isnan().any(1)
    w = reference.winding_number(q[finite], v, f)
    assert ((w - w.round()).abs() < 1e-6).all()
    assert torch.equal(shared[finite] < 0, w >= 0.5)
    # the queries did share walks: the winding numbers of walked queries differ from their own by rounding
    search = bvh.tree
    group = torch.zeros(q.shape[0], dtype=torch.int64)
    face, rows = _search.closest(q, group, search, float("inf"), False)
    reach = torch.where(face >= 0, walked.abs(), 0)
    ones, zeros = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    w_shared = _search.winding(q, group, search, rows, reach, ones)
    w_own = _search.winding(q, group, search, rows, reach, zeros)
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
        assert _search.closed(bvh.faces, bvh.face_group, bvh.vertices.shape[0], 2).item() == int(not open_second)
        d = pcops.mesh_distance(q, bvh, signed=True).dists
        for b, (vb, fb) in enumerate(((v1, f1), (v2, f2b))):
            w = reference.winding_number(q[b], vb, fb)
            clear = (w - 0.5).abs() >= 0.1
            assert torch.equal((d[b] < 0)[clear], (w >= 0.5)[clear]), (open_second, b)
