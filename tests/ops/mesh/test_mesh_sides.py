"""Signed ``mesh_distance`` on closed meshes without winding-number walks
(``pcops::mesh_sides``): the side of the closest face or edge, and each piece's outer winding
number, against the exact winding number; next to faces that cross, touch or fold onto others
or that share an edge with more than one other face, the winding number at the face's centroid
and the faces crossed from there; meshes that are not closed have every query walked."""

import pytest
import torch

import pcops
from pcops.ops.mesh import _search, _sides
from tests import reference
from tests.op_table import icosphere
from tests.ops.mesh.test_distance import _sphere

F64 = torch.float64


def _outward(v, f):
    """The faces turned so that the mesh's signed volume is positive."""
    a, b, c = v[f].unbind(1)
    return f if (a * torch.linalg.cross(b, c)).sum() > 0 else f.flip(1)


def _torus(n=24, m=10, big=1.0, small=0.35):
    u = torch.arange(n, dtype=F64) * 2 * torch.pi / n
    w = torch.arange(m, dtype=F64) * 2 * torch.pi / m
    uu, ww = torch.meshgrid(u, w, indexing="ij")
    v = torch.stack([(big + small * ww.cos()) * uu.cos(), (big + small * ww.cos()) * uu.sin(), small * ww.sin()], -1).reshape(-1, 3)
    i, j = torch.meshgrid(torch.arange(n), torch.arange(m), indexing="ij")
    at = lambda a, b: (a % n) * m + b % m  # noqa: E731
    p, q, r, s = at(i, j), at(i + 1, j), at(i + 1, j + 1), at(i, j + 1)
    f = torch.cat([torch.stack([p, q, r], -1).reshape(-1, 3), torch.stack([p, r, s], -1).reshape(-1, 3)])
    return v, _outward(v, f)


def _grid_cube(k=3):
    """The cube [-1, 1]^3, each side a k x k grid of squares in two triangles: flat fans of coplanar faces."""
    t = torch.linspace(-1, 1, k + 1, dtype=F64)
    index, faces = {}, []

    def vertex(p):
        key = tuple(round(x, 9) for x in p)
        return index.setdefault(key, len(index))

    for axis in range(3):
        for side in (-1.0, 1.0):
            for i in range(k):
                for j in range(k):
                    corners = []
                    for di, dj in ((0, 0), (1, 0), (1, 1), (0, 1)):
                        p = [0.0, 0.0, 0.0]
                        p[axis], p[(axis + 1) % 3], p[(axis + 2) % 3] = side, float(t[i + di]), float(t[j + dj])
                        corners.append(vertex(p))
                    a, b, c, d = corners if side > 0 else corners[::-1]
                    faces += [[a, b, c], [a, c, d]]
    v = torch.tensor(list(index), dtype=F64)
    return v, torch.tensor(faces)


def _corner_tetrahedra():
    """Two tetrahedra sharing one corner (the origin) and nothing else."""
    v = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [-1, 0, 0], [0, -1, 0], [0, 0, -1]], dtype=F64)
    f = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3], [0, 4, 5], [0, 6, 4], [0, 5, 6], [4, 6, 5]])
    return v, f


def _simple(name):
    gen = torch.Generator().manual_seed(3)
    if name == "sphere":
        return _sphere(gen, 2)
    if name == "torus":
        return _torus()
    if name == "grid_cube":
        return _grid_cube()
    if name == "nested":  # the inner sphere oriented as the outer: w = 2 inside it
        v, f = icosphere(2)
        return torch.cat([v, 0.5 * v]), torch.cat([f, f + v.shape[0]])
    if name == "hollow":  # the inner sphere reversed: w = 0 inside it
        v, f = icosphere(2)
        return torch.cat([v, 0.5 * v]), torch.cat([f, f.flip(1) + v.shape[0]])
    if name == "apart":  # two spheres that do not meet
        v, f = icosphere(1)
        return torch.cat([v - 1.5, v + 1.5]), torch.cat([f, f + v.shape[0]])
    if name == "corner":
        return _corner_tetrahedra()
    raise ValueError(name)


def _queries(v, f, gen, n=3000):
    """Points near the surface (two scales) and spread through its box."""
    a, b, c = v[f[torch.randint(0, f.shape[0], (2 * n,), generator=gen)]].unbind(1)
    u, w = torch.rand(2, 2 * n, 1, generator=gen, dtype=F64)
    flip = u + w > 1
    u, w = torch.where(flip, 1 - u, u), torch.where(flip, 1 - w, w)
    surface = a + u * (b - a) + w * (c - a)
    scale = torch.cat([torch.full((n, 1), 0.05, dtype=F64), torch.full((n, 1), 1e-4, dtype=F64)])
    near = surface + scale * torch.randn(2 * n, 3, generator=gen, dtype=F64)
    lo, hi = v.amin(0) - 0.3, v.amax(0) + 0.3
    return torch.cat([near, lo + (hi - lo) * torch.rand(n, 3, generator=gen, dtype=F64)])


def _analysed(q, v, f):
    """(closed, simple, each query's closest face, the winding numbers mesh_sides finds (inf:
    walked)) for one mesh."""
    bvh = pcops.mesh_bvh(v, f)
    group = torch.zeros(q.shape[0], dtype=torch.int64)
    closed, simple, _ = _sides.analysis(v, f, bvh.face_group, None, bvh.tree, q.shape[0], False)
    face, _, rival = _search.closest(q, group, bvh.tree, float("inf"), False, shape=closed[1])
    return closed, simple, face, _sides.known(q, face, rival, v, f, closed, simple)


def _known(q, v, f):
    """The winding numbers mesh_sides finds (inf: walked) for one mesh."""
    return _analysed(q, v, f)[3]


def _agree(q, v, f, k, w):
    """The winding numbers found (``k`` finite) are the exact ones (``w`` rounded: closed meshes),
    and so are the signs of ``mesh_distance`` (a float32 query that rounds onto the surface:
    either sign)."""
    found = k < float("inf")
    assert torch.equal(k[found].double(), w.round()[found])
    signed = pcops.mesh_distance(q, v, f, signed=True).dists
    off = signed != 0
    assert torch.equal((signed < 0)[off], (w.round() >= 1)[off])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", ["sphere", "torus", "grid_cube", "nested", "hollow", "apart", "corner"])
def test_the_side_of_the_closest_face_is_the_exact_winding_number(name, dtype):
    gen = torch.Generator().manual_seed(4)
    v, f = _simple(name)
    q = _queries(v, f, gen).to(dtype)
    v = v.to(dtype)
    k = _known(q, v, f)
    w = reference.winding_number(q, v, f)
    assert ((w - w.round()).abs() < 1e-6).all()  # closed meshes: integers (no query on the surface)
    found = k < float("inf")
    assert found.float().mean() > 0.5, "most queries take the side of their closest face"
    _agree(q, v, f, k, w)


def _pushed_through():
    """An icosphere with one vertex pulled through the sphere and out of its far side: its faces cross others."""
    v, f = icosphere(1)
    v = v.clone()
    v[0] = -1.5 * v[0]
    return v, f


def _shared_edge():
    """Two tetrahedra on one triangle (0, 1, 3), given in the same turn by both: not closed (its
    three edges are each used twice more one way than the other)."""
    v = torch.tensor([[0, 0, 0], [0, 0, 1], [1, 0, 0], [0, 1, 0], [-1, 0, 0]], dtype=F64)
    f = torch.tensor([[0, 1, 2], [0, 3, 1], [1, 3, 2], [0, 2, 3], [0, 4, 1], [0, 3, 4], [1, 4, 3], [0, 1, 3][::-1]])
    return v, f


def _crossing(name):
    """Closed meshes whose faces cross or touch others (not simple)."""
    v, f = icosphere(1)
    if name == "overlapping":  # two spheres through each other: w = 2 where they overlap
        return torch.cat([v - 0.3, v + 0.3]), torch.cat([f, f + v.shape[0]])
    if name == "chain":  # three spheres, each through the next, and a small one inside the middle one: w up to 2
        v2, f2 = icosphere(2)
        return torch.cat([v - 0.7, v2, v + 0.7, 0.2 * v]), torch.cat([f, f2 + 42, f + 204, f + 246])
    if name == "pushed_through":
        return _pushed_through()
    # touching: a second sphere whose face lies on a face of the first (no shared vertex)
    centre = v[f[0]].mean(0)
    v2 = v + 2 * centre  # its face opposite face 0 now lies in face 0's plane, about the same centre
    return torch.cat([v, v2]), torch.cat([f, f + v.shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", ["overlapping", "chain", "pushed_through", "touching"])
def test_faces_that_meet_no_other_face_take_their_side_where_others_cross(name, dtype):
    """Each piece of faces that meet no face but along their shared edges and corners, joined
    by their edges, has one winding number on its outer side: queries closest to such faces
    take their side's (the exact winding number); those closest to a face that crosses or
    touches another take the winding number just off its centroid plus the faces crossed on
    the way from there (walked where a crossing is unclear: faces in one plane)."""
    gen = torch.Generator().manual_seed(5)
    v, f = _crossing(name)
    q = _queries(v, f, gen, 1000).to(dtype)
    v = v.to(dtype)
    closed, simple, face, k = _analysed(q, v, f)
    w = reference.winding_number(q, v, f)
    assert ((w - w.round()).abs() < 1e-6).all()  # (closed: integers)
    found = k < float("inf")
    crossed = simple[1] < 0
    assert 0 < crossed.sum() < f.shape[0] // 2, "some faces, not most, meet another"
    assert found[crossed[face]].float().mean() > 0.7, "most queries closest to a face that meets another count the faces crossed"
    assert found.float().mean() > 0.9
    _agree(q, v, f, k, w)
    if name in ("overlapping", "chain"):  # outer sides inside another sphere: w = 1 (and 2) there
        assert (k[found] >= 1).any()


def _random_crossing(seed):
    """A random closed mesh whose faces cross: two bumpy icospheres through each other (the second
    turned inside out for odd seeds), one with a vertex pulled through its far side, moved
    and scaled by 1e-3 .. 1e3."""
    gen = torch.Generator().manual_seed(seed)
    v, f = icosphere(1 + seed % 2)
    bumpy = lambda: v * (1 + 0.3 * (torch.rand(v.shape[0], 1, generator=gen, dtype=F64) - 0.5))  # noqa: E731
    first, second = bumpy(), 0.8 * bumpy() + 0.9 * torch.randn(3, generator=gen, dtype=F64)
    k = int(torch.randint(0, v.shape[0], (1,), generator=gen))
    first[k] = -1.4 * first[k]
    scale = 10.0 ** float(torch.randint(-3, 4, (1,), generator=gen))
    return scale * torch.cat([first, second]), torch.cat([f, (f.flip(1) if seed % 2 else f) + v.shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("seed", range(6))
def test_the_faces_crossed_from_a_centroid_give_the_exact_winding_number_on_random_crossing_meshes(seed, dtype):
    v, f = _random_crossing(seed)
    q = _queries(v, f, torch.Generator().manual_seed(seed), 400).to(dtype)
    v = v.to(dtype)
    closed, simple, face, k = _analysed(q, v, f)
    assert int(closed[0]) == 1 and int(simple[0]) == 1 and (simple[1] < 0).any(), "closed, analysed, with faces that cross"
    w = reference.winding_number(q, v, f)
    found = k < float("inf")
    assert found.float().mean() > 0.9
    _agree(q, v, f, k, w)


def test_a_padded_batch_of_crossing_meshes_counts_each_sample_s_crossings_alone(monkeypatch):
    """Three crossing meshes padded into one batch, in one place: each query counts the faces of
    its own sample only (the batch's other meshes overlap it), as the per-sample calls do."""
    meshes = [_random_crossing(seed) for seed in (1, 2, 3)]
    for k, (v, f) in enumerate(meshes):  # (one place: the others' faces lie across each segment)
        meshes[k] = (v / v.abs().max(), f)
    vs = torch.nn.utils.rnn.pad_sequence([v for v, _ in meshes], batch_first=True)
    fs = torch.nn.utils.rnn.pad_sequence([f for _, f in meshes], batch_first=True)
    q = torch.stack([_queries(v, f, torch.Generator().manual_seed(k), 300) for k, (v, f) in enumerate(meshes)])
    shares = []
    monkeypatch.setattr(_sides, "FAR", float("inf"))  # (every query's crossings counted, far ones too)
    sides = _sides._mesh_sides
    monkeypatch.setattr(_sides, "_mesh_sides", lambda *a: (lambda out: shares.append(torch.isfinite(out).double().mean()) or out)(sides(*a)))
    out = pcops.mesh_distance(q, vs, fs, signed=True, vertices_lengths=torch.tensor([v.shape[0] for v, _ in meshes]),
                              faces_lengths=torch.tensor([f.shape[0] for _, f in meshes])).dists
    assert len(shares) == 1 and shares[0] > 0.9
    for k, (v, f) in enumerate(meshes):
        assert torch.equal(out[k], pcops.mesh_distance(q[k], v, f, signed=True).dists)
        w = reference.winding_number(q[k], v, f)
        assert torch.equal((out[k] < 0)[out[k] != 0], (w.round() >= 1)[out[k] != 0])


def test_queries_far_from_their_face_are_walked_not_counted():
    """A segment longer than ``REACH`` times its face's longest edge (a query far from the mesh)
    is not walked down the boxes: the query is walked (far queries share walks); the same signs."""
    v, f = _crossing("overlapping")
    gen = torch.Generator().manual_seed(8)
    near = _queries(v, f, gen, 300)[:600]
    far = 20 * torch.nn.functional.normalize(torch.randn(300, 3, generator=gen, dtype=F64), dim=1)
    q = torch.cat([near, far])
    closed, simple, face, k = _analysed(q, v, f)
    crossed = simple[1] < 0
    counted = torch.isfinite(k) & crossed[face]
    assert counted[:600].any() and not counted[600:].any()
    _agree(q, v, f, k, reference.winding_number(q, v, f))


@pytest.mark.parametrize("name", ["sphere", "torus", "nested"])
def test_far_queries_count_no_crossings_and_keep_their_signs(name):
    """From ``FAR`` times the mesh's radius away a query whose closest face's side does not decide
    its winding number is walked, not counted through the faces crossed: nearer queries and the
    sides found are as without the cut, and every sign is still the exact winding number's."""
    v, f = _simple(name)
    gen = torch.Generator().manual_seed(11)
    q = torch.cat([_queries(v, f, gen, 1000), 1.4 * v.abs().max() * torch.nn.functional.normalize(torch.randn(500, 3, generator=gen, dtype=F64), dim=1)])
    bvh = pcops.mesh_bvh(v, f)
    closed, simple, _ = _sides.analysis(v, f, bvh.face_group, None, bvh.tree, q.shape[0], False)
    face, _, rival = _search.closest(q, torch.zeros(q.shape[0], dtype=torch.int64), bvh.tree, float("inf"), False, shape=closed[1])
    whole = _sides.known(q, face, rival, v, f, closed, simple)
    dist = pcops.mesh_distance(q, bvh).dists
    cut = _sides.known(q, face, rival, v, f, closed, simple, reach=dist, radius=bvh.tree.radius)
    far = dist >= _sides.FAR * bvh.tree.radius[0]
    assert torch.equal(cut[~far], whole[~far])
    kept = torch.isfinite(cut) & far
    assert torch.equal(cut[kept], whole[kept]) and kept.any()  # (the sides of far queries' faces still count)
    assert (torch.isfinite(whole) & far & ~kept).any()  # far queries the crossings found: walked now
    w = reference.winding_number(q, v, f)
    signed = pcops.mesh_distance(q, bvh, signed=True).dists
    off = signed != 0
    assert torch.equal((signed < 0)[off], (w.round() >= 1)[off])


def test_past_the_share_of_crossed_faces_their_queries_are_walked(monkeypatch):
    """More faces in no piece than ``CROSSED`` allows (a soup of faces through each other): no
    reference walk per face, their queries walked, the same signs."""
    v, f = _crossing("overlapping")
    q = _queries(v, f, torch.Generator().manual_seed(5), 500)
    monkeypatch.setattr(_sides, "CROSSED", (0.0, 0))
    closed, simple, face, k = _analysed(q, v, f)
    crossed = simple[1] < 0
    assert crossed[face].any() and not (k < float("inf"))[crossed[face]].any()
    w = reference.winding_number(q, v, f)
    _agree(q, v, f, k, w)


@pytest.mark.parametrize("name", ["shared_edge", "open"])
def test_meshes_that_are_not_closed_have_every_query_walked(name):
    gen = torch.Generator().manual_seed(5)
    if name == "shared_edge":
        v, f = _shared_edge()
    else:
        v, f = icosphere(1)
        f = f[1:]
    q = _queries(v, f, gen, 500)
    assert (_known(q, v, f) == float("inf")).all()
    w = reference.winding_number(q, v, f)
    clear = (w - 0.5).abs() >= 0.1
    signed = pcops.mesh_distance(q, v, f, signed=True).dists
    assert torch.equal((signed < 0)[clear], (w >= 0.5)[clear])


def _merged(v, f):
    """The vertices at one place made one (rounded to 1e-9), the faces renumbered."""
    keys, inverse = torch.unique((v * 1e9).round().long(), dim=0, return_inverse=True)
    merged = torch.zeros(keys.shape[0], 3, dtype=v.dtype).index_copy_(0, inverse, v)
    return merged, inverse[f]


def _edge_sharing(name):
    """Closed meshes with edges used twice each way (each such edge has no twin)."""
    v, f = _grid_cube(3)
    # two cubes of 3 x 3 grids whose edges along x = y = 1 coincide; "cube_and_inverted_cube": the
    # second turned inside out (w = -1 in it: a piece joined across the shared edge would be wrong)
    second = f.flip(1) if name == "cube_and_inverted_cube" else f
    cubes = _merged(torch.cat([v, v + torch.tensor([2.0, 2.0, 0.0], dtype=F64)]), torch.cat([f, second + v.shape[0]]))
    if name != "cubes_and_sphere":
        return cubes
    s, t = icosphere(2)  # and a sphere through both: edges shared and faces crossing
    return torch.cat([cubes[0], 0.6 * s.to(F64) + 1.0]), torch.cat([cubes[1], t + cubes[0].shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", ["cubes", "cube_and_inverted_cube", "cubes_and_sphere"])
def test_faces_at_an_edge_shared_by_more_than_two_walk_and_the_others_take_their_side(name, dtype):
    """A closed mesh with edges used twice each way (solids sharing an edge): the faces along
    such an edge count as crossing others (their queries count the faces crossed from their
    centroids); the other faces' queries take their side's winding number, the exact one."""
    gen = torch.Generator().manual_seed(6)
    v, f = _edge_sharing(name)
    q = _queries(v, f, gen, 1000).to(dtype)
    v = v.to(dtype)
    closed, simple, face, k = _analysed(q, v, f)
    assert int(closed[0]) == 1 and int(simple[0]) == 1, "closed, and analysed"
    twinless = (closed[2] < 0).any(1)
    assert twinless.any() and (simple[1][twinless] < 0).all(), "the faces of a shared edge count as crossing"
    w = reference.winding_number(q, v, f)
    assert ((w - w.round()).abs() < 1e-6).all()  # (closed: integers)
    found = k < float("inf")
    assert found[twinless[face]].float().mean() > 0.9, "queries closest to a face of a shared edge count the faces crossed"
    assert found.float().mean() > 0.9
    _agree(q, v, f, k, w)


def test_a_kept_hierarchy_is_analysed_once_whatever_the_number_of_queries(monkeypatch):
    v, f = icosphere(3)  # 1,280 faces
    bvh = pcops.mesh_bvh(v, f)
    calls = []
    analyse = _sides._mesh_simple
    monkeypatch.setattr(_sides, "_mesh_simple", lambda *args: calls.append(args[5]) or analyse(*args))
    q = _queries(v, f, torch.Generator().manual_seed(6), 100)  # 300 queries: fewer than the faces
    first = pcops.mesh_distance(q, bvh, signed=True).dists
    second = pcops.mesh_distance(0.9 * q, bvh, signed=True).dists
    assert len(calls) == 1 and calls[0] >= f.shape[0]  # analysed once, whatever the queries
    w = reference.winding_number(torch.cat([q, 0.9 * q]), v, f)
    signed = torch.cat([first, second])
    assert torch.equal((signed < 0)[signed != 0], (w.round() >= 1)[signed != 0])
    key = (id(bvh.tree.a), True)
    assert key in _sides._ANALYSED
    pcops.mesh_distance(q, v, f, signed=True)  # a hierarchy built in the call: analysed in it, if the queries are enough
    assert calls[1:] == [q.shape[0]]
    del bvh
    assert key not in _sides._ANALYSED  # (nothing kept past its tree)


def _box(hi, dtype, top_last=True):
    """The box [0, hi]: outward faces, its side faces listed before its top and bottom (which
    then lose ties of the search by index)."""
    x, y, z = hi
    v = torch.tensor([[0, 0, 0], [x, 0, 0], [x, y, 0], [0, y, 0], [0, 0, z], [x, 0, z], [x, y, z], [0, y, z]], dtype=dtype)
    sides = [[0, 1, 5], [0, 5, 4], [1, 2, 6], [1, 6, 5], [2, 3, 7], [2, 7, 6], [3, 0, 4], [3, 4, 7]]
    return v, torch.tensor(sides + [[0, 2, 1], [0, 3, 2], [4, 5, 6], [4, 6, 7]])


def _wedge(degrees):
    """A float32 prism whose edge along y at x = 1 is a knife of ``degrees``; its slanted top face
    listed first."""
    t = torch.tan(torch.deg2rad(torch.tensor(degrees, dtype=F64))).item()
    v = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 1, 0], [0, 0, t], [0, 1, t]], dtype=torch.float32)
    f = torch.tensor([[0, 1, 5], [0, 5, 4], [0, 2, 3], [0, 3, 1], [2, 4, 5], [2, 5, 3], [0, 4, 2], [1, 3, 5]])
    return v, f


@pytest.mark.parametrize("case", ["wedge", "edge_of_a_large_cube", "thin_plate", "far_query"])
def test_faces_the_search_tied_are_compared_in_float64(case):
    """The search ties faces whose float32 distances agree to its rounding (and a tie goes to the
    smaller index): near a sharp edge, an edge of a large mesh, across a plate thinner than that
    rounding or from far away, the face found may not be the nearest, and its side would be the
    wrong one; the face it tied with is measured too, in float64."""
    if case == "wedge":  # queries just below the bottom, just inside the 3-degree tip
        v, f = _wedge(3.0)
        h = torch.tensor([1e-2, 5e-3, 3e-3, 1e-3]).repeat_interleave(3)
        s = 1.2 * h * torch.tan(torch.deg2rad(torch.tensor(1.5)))
        q = torch.stack([1 - s, torch.tensor([0.3, 0.5, 0.7]).repeat(4), -h], 1)
    elif case == "edge_of_a_large_cube":  # just above the top, just in from an edge
        v, f = _box((100.0, 100.0, 100.0), torch.float32)
        h = torch.tensor([1e-3, 3e-4, 2e-4, 1e-4, 3e-5]).repeat_interleave(3)
        q = torch.stack([100 - 1.5 * h, torch.tensor([20.0, 50.0, 80.0]).repeat(5), 100 + h], 1)
    elif case == "thin_plate":
        v, f = _box((1.0, 1.0, 1e-6), torch.float32)
        q = torch.tensor([[0.5, 0.5, 0.5], [0.3, 0.6, -0.5]]).repeat(8, 1)
    else:
        v, f = _box((1.0, 1.0, 1.0), torch.float32)
        q = torch.tensor([[0.5, 0.5, 1e6], [0.2, 0.7, -1e6]]).repeat(8, 1)
    bvh = pcops.mesh_bvh(v, f)
    shape = _search.closed(v, f, bvh.face_group, None)[1]
    _, _, rival = _search.closest(q, torch.zeros(q.shape[0], dtype=torch.int64), bvh.tree, float("inf"), False, shape=shape)
    assert (rival != -1).any()  # the search did tie faces here
    w = reference.winding_number(q, v, f)
    assert ((w - 0.5).abs() > 0.4).all()
    signed = pcops.mesh_distance(q, bvh, signed=True).dists
    assert torch.equal(signed < 0, w >= 0.5)
    k = _known(q, v, f)
    assert torch.equal(k[k < float("inf")].double(), w.round()[k < float("inf")])


def _turned(v, seed):
    """The vertices turned by a random rotation (off the axes), in float32."""
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(seed)))
    return (v.to(F64) @ rotation.T).to(torch.float32)


def _needle_plate(thickness=5e-6, width=1e-4):
    """A closed float32 plate 1 x 1 x ``thickness`` whose top holds a needle face (0.9 long,
    ``width`` wide at its end: height over longest edge about 1e-4), turned off the axes."""
    square = [(0, 0), (1, 0), (1, 1), (0, 1)]
    top = square + [(0.05, 0.5), (0.95, 0.5 - width / 2), (0.95, 0.5 + width / 2)]
    v = torch.tensor([(x, y, thickness) for x, y in top] + [(x, y, 0.0) for x, y in square], dtype=F64)
    f = [(4, 5, 6), (0, 1, 5), (0, 5, 4), (1, 2, 6), (1, 6, 5), (2, 3, 4), (2, 4, 6), (3, 0, 4), (7, 9, 8), (7, 10, 9)]
    for i in range(4):
        j = (i + 1) % 4
        f += [(7 + i, 7 + j, j), (7 + i, j, i)]
    return _turned(v, 0), torch.tensor(f)


def test_a_thin_face_s_rounded_plane_does_not_hide_the_nearest_face():
    """Over a needle face (its float32 plane tilted by about eps over its shape, so its distance is
    off by far more than the search's tie band) on a plate thinner than that error, the bottom
    face measured nearer in float32 must not decide the side: the band is widened by the mesh's
    worst shape factor."""
    v, f = _needle_plate()
    v64 = v.double()
    normal = torch.nn.functional.normalize(torch.linalg.cross(v64[5] - v64[4], v64[6] - v64[4]), dim=0)
    s = torch.linspace(0.80, 0.99, 200, dtype=F64)[:, None]
    q = (v64[4] + s * ((v64[5] + v64[6]) / 2 - v64[4]) + 1e-5 * normal).to(torch.float32)
    w = reference.winding_number(q, v, f)
    assert ((w - 0.5).abs() > 0.4).all()
    for mesh in ((v, f), (pcops.mesh_bvh(v, f),)):
        signed = pcops.mesh_distance(q, *mesh, signed=True).dists
        assert torch.equal(signed < 0, w >= 0.5)


def test_a_band_past_max_dist_walks_the_query():
    """A float32 plate thinner than the tie band, a query far above it and ``max_dist`` between the
    two faces' rounded distances: the face past ``max_dist`` is not measured, so the query is walked."""
    v, f = _box((10.0, 10.0, 1e-6), F64)
    v = _turned(v, 1)
    q = torch.tensor([[14.69129467010498, 17.33878517150879, 20.798463821411133]])
    d = float(pcops.mesh_distance(q.double(), v.double(), f).dists[0])
    w = reference.winding_number(q, v, f)
    bvh = pcops.mesh_bvh(v, f)
    for max_dist in [None] + [d * (1 + k * 1e-8) for k in range(-30, 31, 3)]:
        out = pcops.mesh_distance(q.repeat(16, 1), bvh, signed=True, max_dist=max_dist).dists
        assert torch.equal(out < 0, (w >= 0.5).repeat(16)), max_dist


def _needle_box(width=1e-2, seed=1):
    """A closed float32 box [0, 1] x [-1/2, 1/2] x [0, 1] turned off the axes, its bottom holding a
    needle face from the corner-less point (0, 0, 0) to a base ``width`` long on the wall x = 1."""
    v = torch.tensor([(0, -.5, 0), (1, -.5, 0), (1, .5, 0), (0, .5, 0), (0, 0, 0), (1, -width / 2, 0), (1, width / 2, 0),
                      (0, -.5, 1), (1, -.5, 1), (1, .5, 1), (0, .5, 1)], dtype=F64)
    f = torch.tensor([(4, 6, 5), (4, 1, 0), (4, 5, 1), (4, 3, 2), (4, 2, 6), (7, 8, 9), (7, 9, 10), (0, 1, 8), (0, 8, 7), (1, 5, 8),
                      (5, 6, 8), (6, 9, 8), (6, 2, 9), (2, 3, 10), (2, 10, 9), (3, 4, 10), (4, 0, 7), (4, 7, 10)])
    return _turned(v, seed), f


def test_signed_calls_find_the_faces_and_distances_of_unsigned_ones():
    """The signed search measures more faces (for the sides' rivals) but takes the same ones as the
    unsigned search: far queries beyond a needle's short edge, where the needle's float32 distance
    is far too small, keep the unsigned face (and the exact winding number's sign)."""
    v, f = _needle_box()
    v64 = v.double()
    a, b, c = v64[4], v64[6], v64[5]
    normal = torch.nn.functional.normalize(torch.linalg.cross(b - a, c - a), dim=0)
    along = torch.nn.functional.normalize((b + c) / 2 - a - (((b + c) / 2 - a) @ normal) * normal, dim=0)
    gen = torch.Generator().manual_seed(1)
    beyond = 3e4 * (0.01 + 0.8 * torch.rand(400, 1, generator=gen, dtype=F64))
    q = ((b + c) / 2 + beyond * along - 3e4 * normal).to(torch.float32)
    cases = [(q, v, f)]
    for name in ("sphere", "torus", "grid_cube"):
        vs, fs = _simple(name)
        cases.append((_queries(vs, fs, torch.Generator().manual_seed(7), 400).to(torch.float32), vs.to(torch.float32), fs))
    for points, vertices, faces in cases:
        bvh = pcops.mesh_bvh(vertices, faces)
        unsigned, signed = pcops.mesh_distance(points, bvh), pcops.mesh_distance(points, bvh, signed=True)
        assert torch.equal(signed.face, unsigned.face) and torch.equal(signed.dists.abs(), unsigned.dists)
        w = reference.winding_number(points, vertices, faces)
        off = signed.dists != 0
        assert torch.equal((signed.dists < 0)[off], (w >= 0.5)[off])


@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_a_piece_s_outer_winding_number_is_walked_in_float64(scale):
    """A box standing on another (its side faces touch the lower box's top: flagged), turned,
    float32: the upper box's bottom is a piece of its own, whose centroid rounded to float32 may
    lie below the lower box's top, which it touches; its outer winding number is 1 (inside the
    lower box), and the queries under it take it."""
    (va, fa), (vb, fb) = _box((1.0, 1.0, 1.0), F64), _box((0.4, 0.4, 0.5), F64)
    v0, f = torch.cat([va, vb + torch.tensor([0.2, 0.3, 1.0], dtype=F64)]), torch.cat([fa, fb + 8])
    grid = torch.linspace(0.25, 0.55, 4, dtype=F64)
    q0 = torch.stack(torch.meshgrid(grid, grid + 0.1, torch.tensor([0.9, 0.97], dtype=F64), indexing="ij"), -1).reshape(-1, 3)
    for angle in torch.linspace(0.01, 0.3, 30, dtype=F64):
        c, s = torch.cos(angle), torch.sin(angle)
        turn = torch.tensor([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=F64) @ torch.tensor([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=F64)
        v, q = (scale * v0 @ turn.T).float(), (scale * q0 @ turn.T).float()
        w = reference.winding_number(q.double(), v.double(), f)
        assert ((w - 1).abs() < 1e-6).all()
        signed = pcops.mesh_distance(q, v, f, signed=True).dists
        assert (signed < 0).all(), f"angle {float(angle):.3f}: {int((signed >= 0).sum())} of {q.shape[0]} queries inside signed outside"


@pytest.mark.parametrize("scale", [1e-3, 1.0])
def test_queries_a_few_roundings_inside_a_sliver_through_a_sphere_are_walked_in_float64(scale):
    """A sliver tetrahedron (3 long, 1e-4 thick) through a sphere, float32: its faces cross the
    sphere's, so the queries inside it are walked. Those a few float32 roundings of the mesh's
    size from its wide faces see each of them at nearly a half turn, whose sign float32's solid
    angles lose: the faces the walk opens are measured in float64 (the float32 values widened)."""
    v, f = icosphere(2)
    sliver = torch.tensor([[-1.5, 0, 0], [1.5, 0, 0], [0.0, 0.6, 0], [0.1, 0.25, 1e-4]], dtype=F64)
    fs = torch.tensor([[0, 1, 2], [0, 3, 1], [0, 2, 3], [1, 3, 2]])  # outwards (the fourth corner above the first face)
    gen = torch.Generator().manual_seed(5)
    e = -torch.rand(400, 3, generator=gen, dtype=F64).log()
    on_face = (e / e.sum(1, keepdim=True)) @ sliver[:3]  # on the wide face z = 0, then a few roundings up (z <= 1e-4 inside)
    height = 1e-4 * torch.logspace(-6, -1, 400, dtype=F64)
    q0 = on_face + height[:, None] * torch.tensor([0.0, 0.0, 1.0], dtype=F64)
    for seed in range(3):
        turn = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(seed), dtype=F64))[0]
        vt = (scale * torch.cat([v.double(), sliver @ turn.T])).float()
        q = (scale * q0 @ turn.T).float()
        ft = torch.cat([f, fs + v.shape[0]])
        w = reference.winding_number(q.double(), vt.double(), ft)
        signed = pcops.mesh_distance(q, vt, ft, signed=True).dists
        clear = ((w - 0.5).abs() >= 0.1) & (signed != 0)
        assert clear.sum() > 250
        wrong = (signed < 0) != (w >= 0.5)
        assert not (wrong & clear).any(), f"seed {seed}: {int((wrong & clear).sum())} of {int(clear.sum())} signs wrong"
