"""Signed ``mesh_distance`` on open meshes from caps over their holes (``pcops.ops.mesh._caps``):
the loops and their triangles, the capped mesh closed, and the signs of a kept hierarchy's
queries (near the surface, near the caps, through the box) against the exact winding number."""

import collections
import math

import pytest
import torch
import warp as wp

import pcops
from pcops.ops.mesh import _caps, _search, _sides, _tree
from tests import reference
from tests.op_table import icosphere
from tests.ops.mesh.test_distance import _grid

F64 = torch.float64


def _bumpy(gen, subdivisions=2, jitter=0.2):
    v, f = icosphere(subdivisions)
    return v * (1 + jitter * (torch.rand(v.shape[0], 1, generator=gen, dtype=F64) - 0.5)), f


def _tube(n=24, m=6):
    """An open cylinder along z, a wavy rim at each end: two loops."""
    u = torch.arange(n, dtype=F64) * 2 * torch.pi / n
    z = torch.linspace(-1, 1, m + 1, dtype=F64)
    uu, zz = torch.meshgrid(u, z, indexing="ij")
    zz = zz + 0.15 * torch.sin(3 * uu) * (zz.abs() == 1)
    v = torch.stack([uu.cos(), uu.sin(), zz], -1).reshape(-1, 3)
    i, j = torch.meshgrid(torch.arange(n), torch.arange(m), indexing="ij")
    at = lambda a, b: (a % n) * (m + 1) + b  # noqa: E731
    p, q, r, s = at(i, j), at(i + 1, j), at(i + 1, j + 1), at(i, j + 1)
    return v, torch.cat([torch.stack([p, q, r], -1).reshape(-1, 3), torch.stack([p, r, s], -1).reshape(-1, 3)])


def _cup(n=32, depth=0.2):
    """A shallow open cup: a fan of a unit disc at z = 0 and a wall up to z = depth, open at the
    top. Queries above the opening have the bottom as their nearest face and the cap between."""
    t = torch.arange(n, dtype=F64) * 2 * torch.pi / n
    ring = torch.stack([t.cos(), t.sin(), torch.zeros(n, dtype=F64)], 1)
    v = torch.cat([ring, ring + torch.tensor([0.0, 0.0, depth], dtype=F64), torch.zeros(1, 3, dtype=F64)])
    k, k1 = torch.arange(n), (torch.arange(n) + 1) % n
    bottom = torch.stack([torch.full_like(k, 2 * n), k1, k], 1)  # normals down: outward
    wall = torch.cat([torch.stack([k, k1, k1 + n], 1), torch.stack([k, k1 + n, k + n], 1)])
    return v, torch.cat([bottom, wall])


def _open_meshes():
    gen = torch.Generator().manual_seed(11)
    v, f = _bumpy(gen)
    a, b, c = v[f].unbind(1)
    mid = (a + b + c) / 3
    holes = f[(mid[:, 2] < 0.6) & (torch.rand(f.shape[0], generator=gen) > 0.03)]  # a cap's hole and a few single faces
    theta = torch.atan2(mid[:, 1], mid[:, 0])
    wavy = f[mid[:, 2] < 0.2 + 0.35 * torch.sin(5 * theta)]  # a bowl whose rim goes up and down: a non-planar loop
    w3, f3 = _bumpy(gen, 3, 0.05)
    a3, b3, c3 = w3[f3].unbind(1)
    m3 = (a3 + b3 + c3) / 3
    saddle = f3[m3[:, 2] < 0.7 * torch.sin(2 * torch.atan2(m3[:, 1], m3[:, 0]))]  # a rim over a saddle: a cap far from planar
    w2, f2 = _bumpy(gen, 1)
    moved = w2 * 0.8 + torch.tensor([0.7, 0.0, 0.1], dtype=F64)
    two = torch.cat([v, moved]), torch.cat([holes, f2[3:] + v.shape[0]])  # crossing each other, both open
    return {
        "holes": (v, holes),
        "wavy_bowl": (v, wavy),
        "saddle": (w3, saddle),
        "tube": _tube(),
        "cup": _cup(),
        "flat_grid": _grid(4),  # caps fold onto the grid itself: every face crossed, every query walked
        "two_open_spheres": two,
        "edge_used_twice": (v, torch.cat([holes, holes[:1]])),  # one face twice: its edges used twice one way
    }


def _more_open_meshes():
    """Open meshes whose boundaries and faces the caps' chaining and the capped mesh's analysis
    must take as they are: holes meeting at one vertex (loops through it more than once), an
    open sheet through a closed sphere, a third face on an edge (a fin) and faces given twice,
    once the same way and once reversed."""
    gen = torch.Generator().manual_seed(21)
    v, f = _bumpy(gen)
    mid = v[f].mean(1)
    around = torch.nonzero((f == 7).any(1)).squeeze(1)
    rims = f[~torch.isin(torch.arange(f.shape[0]), around[::2])]  # every other face about vertex 7 taken out
    sheet_v, sheet_f = _grid(6)
    sheet_v = sheet_v * 1.4
    sheet_v[:, 2] = 0.1 * torch.sin(3 * sheet_v[:, 0]) + 0.05
    half = f[mid[:, 0] < 0.7]
    e = half[0]
    fin_v = torch.cat([v, 0.8 * (v[e[0]] + v[e[1]])[None]])
    holes = f[torch.rand(f.shape[0], generator=gen) > 0.1]
    return {
        "rims_meeting_at_a_vertex": (v, rims),
        "sheet_through_a_sphere": (torch.cat([v, sheet_v]), torch.cat([f, sheet_f + v.shape[0]])),
        "fin_on_an_open_mesh": (fin_v, torch.cat([half, torch.tensor([[int(e[0]), int(e[1]), v.shape[0]]])])),
        "faces_twice_and_reversed": (v, torch.cat([holes, holes[:3], holes[3:6].flip(1)])),
    }


MESHES = {**_open_meshes(), **_more_open_meshes()}


def _directed(faces):
    edges = torch.stack([faces, faces.roll(-1, 1)], -1).reshape(-1, 2).tolist()
    return collections.Counter((a, b) for a, b in edges if a != b)


@pytest.mark.parametrize("name", list(MESHES))
def test_loops_are_the_unmatched_edge_uses_reversed(name):
    v, f = MESHES[name]
    uses = _directed(f)
    expected = collections.Counter()
    for (a, b), k in uses.items():
        extra = k - uses.get((b, a), 0)
        if extra > 0:
            expected[(b, a)] += extra
    found = collections.Counter()
    for loop in _caps.loops(f.numpy()):
        assert len(loop) >= 3
        found.update(zip(loop, loop[1:] + loop[:1]))
    assert found == expected and expected


@pytest.mark.parametrize("name", list(MESHES))
def test_caps_close_the_mesh(name):
    v, f = MESHES[name]
    c = _caps.caps(v, f)
    assert c.shape[0] == sum(len(loop) - 2 for loop in _caps.loops(f.numpy()))
    whole = torch.cat([f, c])
    uses = _directed(whole)
    assert all(uses[(a, b)] == uses.get((b, a), 0) for a, b in uses)
    assert int(_search.closed(v, whole, torch.zeros(whole.shape[0], dtype=torch.int64), None)[0]) == 1


def test_a_convex_loop_is_clipped_into_triangles_that_tile_it():
    """A planar convex octagon: six triangles, each turning the loop's way, their areas the
    octagon's (no two overlap), the best-shaped ear first."""
    t = torch.arange(8, dtype=F64) * 2 * math.pi / 8
    v = torch.stack([t.cos() * 2, t.sin(), torch.zeros(8, dtype=F64)], 1).numpy()
    triangles = _caps.clip(v, list(range(8)))
    assert len(triangles) == 6
    corners = torch.tensor(v)[torch.tensor(triangles)]
    normal = torch.linalg.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0])
    assert (normal[:, 2] > 0).all()  # counter-clockwise, as the loop
    torch.testing.assert_close(normal[:, 2].sum() / 2, torch.tensor(8 * math.sin(2 * math.pi / 8), dtype=F64))  # 8 r1 r2 sin / 2
    first = triangles[0]
    assert _caps._factor(v, *first) == min(_caps._factor(v, (k - 1) % 8, k, (k + 1) % 8) for k in range(8))


def _queries(v, f, gen, n=1500):
    """Near the surface, near the caps and through the box (float64)."""
    near = pcops.sample_points_on_mesh(v, f, n, generator=gen).points + 0.03 * torch.randn(n, 3, generator=gen, dtype=F64)
    c = _caps.caps(v, f)
    cap = pcops.sample_points_on_mesh(v, c, n // 2, generator=gen).points + 0.03 * torch.randn(n // 2, 3, generator=gen, dtype=F64)
    lo, hi = v.min(0).values - 0.3, v.max(0).values + 0.3
    box = lo + (hi - lo) * torch.rand(n // 2, 3, generator=gen, dtype=F64)
    return torch.cat([near, cap, box])


def _analysed(bvh):
    """(closed, simple, caps) of a kept one-mesh hierarchy (``_sides.analysis``)."""
    return _sides.analysis(bvh.vertices, bvh.faces, bvh.face_group, None, bvh.tree, 1, True, one=True)


def _closest(q, bvh, closed, simple):
    """(face, rival) of queries q: the signed search's closest faces and their rivals."""
    face, _, rival = _search.closest(q, torch.zeros(q.shape[0], dtype=torch.int64), bvh.tree, float("inf"), False,
                                     shape=closed[1] * simple[0], one=True)
    return face, rival


def _sided(q, bvh, closed, simple, capped):
    """(face, rival, the capped mesh's side) of queries q: what ``pcops::mesh_capped`` takes."""
    face, rival = _closest(q, bvh, closed, simple)
    return face, rival, torch.ops.pcops.mesh_sides.default(q, face, rival, bvh.vertices, capped.faces, closed[2], *simple)


def _decided(q, bvh):
    """The winding numbers the kept hierarchy's caps decide (inf: walked)."""
    closed, simple, capped = _analysed(bvh)
    face, rival = _closest(q, bvh, closed, simple)
    return capped, _sides.known(q, face, rival, bvh.vertices, bvh.faces, closed, simple, capped, bvh.tree.scale)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("name", list(MESHES))
def test_a_kept_open_mesh_is_signed_by_its_caps_as_the_exact_winding_number(name, dtype):
    v, f = MESHES[name]
    gen = torch.Generator().manual_seed(12)
    q = _queries(v, f, gen, 3000).to(dtype)
    v = v.to(dtype)
    w = reference.winding_number(q, v, f)
    clear = (w - 0.5).abs() >= 0.1
    bvh = pcops.mesh_bvh(v, f)
    out = pcops.mesh_distance(q, bvh, signed=True)
    assert torch.equal((out.dists < 0)[clear], (w >= 0.5)[clear])
    walked = pcops.mesh_distance(q, v, f, signed=True)  # built in the call: every query walked
    assert torch.equal(out.dists.abs(), walked.dists.abs()) and torch.equal(out.face, walked.face)
    capped, known = _decided(q.contiguous(), bvh)
    assert capped is not None
    decided = torch.isfinite(known)
    assert torch.equal((known >= 0.5)[decided & clear], (w >= 0.5)[decided & clear])
    # an integer: the capped mesh's, the caps' winding number bounded below BOUND; else W less its walk
    w_caps = reference.winding_number(q, v, capped.faces[f.shape[0]:])
    whole = decided & (known == known.round())
    assert (w_caps[whole].abs() < 0.45).all()  # (the module's BOUND: under 1/2, with room for the bound's rounding)
    assert ((known - w)[decided & ~whole].abs() < 0.1).all()
    share = decided.double().mean()
    if name == "flat_grid":
        assert share == 0  # its caps fold onto it
    elif name != "two_open_spheres":
        assert share > 0.5, share


def test_queries_with_a_cap_nearer_than_the_mesh_count_the_capped_mesh_s_crossings():
    """Above a cup's opening the bottom is the nearest face and the cap lies between: the side of
    the bottom is not the capped mesh's winding number there; the faces crossed from the
    bottom's centroid give it, less the caps' walked winding number (no walk of the mesh)."""
    v, f = MESHES["cup"]
    xy = torch.stack(torch.meshgrid(torch.linspace(-0.2, 0.2, 9, dtype=F64), torch.linspace(-0.2, 0.2, 9, dtype=F64), indexing="ij"), -1)
    q = torch.cat([xy.reshape(-1, 2), torch.full((81, 1), 0.7, dtype=F64)], 1)
    for dtype in (torch.float32, F64):
        bvh = pcops.mesh_bvh(v.to(dtype), f)
        capped, known = _decided(q.to(dtype), bvh)
        w = reference.winding_number(q, v, f)
        assert ((w - 0.5).abs() > 0.1).all() and torch.isfinite(known).all()
        assert ((known.double() - w).abs() < 0.1).all()
        signed = pcops.mesh_distance(q.to(dtype), bvh, signed=True).dists
        assert torch.equal(signed < 0, w >= 0.5)


@pytest.mark.parametrize("name", ["holes", "wavy_bowl", "tube", "cup"])
def test_queries_far_from_a_kept_open_mesh_are_walked_without_the_caps_check(name):
    """From ``FAR`` times its radius away from a kept open mesh a query is walked (the caps' check
    costs more than the walk there): nearer queries are decided as without the cut, the far ones
    the caps decided are left to the walk, and every clear sign is the exact winding number's."""
    v, f = MESHES[name]
    q = _queries(v, f, torch.Generator().manual_seed(13), 1500)
    far_away = 1.5 * v.abs().max() * torch.nn.functional.normalize(torch.randn(300, 3, generator=torch.Generator().manual_seed(14), dtype=F64), dim=1)
    q = torch.cat([q, far_away])
    bvh = pcops.mesh_bvh(v, f)
    closed, simple, capped = _analysed(bvh)
    face, rival = _closest(q, bvh, closed, simple)
    dist = pcops.mesh_distance(q, bvh).dists
    whole = _sides.known(q, face, rival, bvh.vertices, bvh.faces, closed, simple, capped, bvh.tree.scale)
    cut = _sides.known(q, face, rival, bvh.vertices, bvh.faces, closed, simple, capped, bvh.tree.scale, dist, bvh.tree.radius)
    far = dist >= _sides.FAR * bvh.tree.radius[0]
    assert (~far).any() and torch.isfinite(whole[far]).any()
    assert torch.equal(cut[~far], whole[~far]) and not torch.isfinite(cut[far]).any()
    w = reference.winding_number(q, v, f)
    clear = (w - 0.5).abs() >= 0.1
    signed = pcops.mesh_distance(q, bvh, signed=True).dists
    assert torch.equal((signed < 0)[clear], (w >= 0.5)[clear])


def test_rows_out_of_range_make_no_caps():
    v, f = MESHES["holes"]
    for bad in (-1, v.shape[0]):
        broken = f.clone()
        broken[0, 1] = bad
        assert _caps.caps(v, broken) is None


def test_more_unmatched_edges_than_the_limit_leave_the_queries_walked(monkeypatch):
    v, f = MESHES["holes"]
    q = _queries(v, f, torch.Generator().manual_seed(13), 300)
    monkeypatch.setattr(_caps, "EDGES", 8)
    assert _caps.caps(v, f) is None
    bvh = pcops.mesh_bvh(v, f)
    capped, known = _decided(q, bvh)
    assert capped is None and not torch.isfinite(known).any()
    w = reference.winding_number(q, v, f)
    clear = (w - 0.5).abs() >= 0.1
    assert torch.equal((pcops.mesh_distance(q, bvh, signed=True).dists < 0)[clear], (w >= 0.5)[clear])


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_the_capped_op_has_an_exact_fake(dtype):
    v, f = MESHES["holes"]
    v = v.to(dtype)
    q = _queries(v.double(), f, torch.Generator().manual_seed(14), 40).to(dtype)
    bvh = pcops.mesh_bvh(v, f)
    closed, simple, capped = _analysed(bvh)
    face, rival, sides = _sided(q, bvh, closed, simple, capped)
    t = capped.tree
    args = (q, face, rival, v, f, sides, t.a, t.b, t.c, t.group, t.lo, t.hi, t.glo, t.ghi, t.center, t.normal, t.moment, t.radius,
            capped.area, capped.gap, capped.far, capped.rho2, bvh.tree.scale, capped.faces, *simple[1:])
    torch.library.opcheck(torch.ops.pcops.mesh_capped.default, args)
    assert torch.isfinite(torch.ops.pcops.mesh_capped.default(*args)).any()


@pytest.mark.parametrize("name", ["holes", "saddle", "tube"])
def test_each_face_s_neighbourhood_bounds_hold_at_points_in_it(name):
    """Each face's widened box: the caps' distance and winding number at points in it within
    its gap and bound, and those no looser than the caps' own boxes allow (a brute force over
    every cap face's box: the gap at most their nearest, the bound at least their sum)."""
    v, f = MESHES[name]
    bvh = pcops.mesh_bvh(v, f)
    capped = _analysed(bvh)[2]
    gen = torch.Generator().manual_seed(15)
    rows = torch.randint(0, f.shape[0], (400,), generator=gen)
    corners = v[f[rows]]
    rho = float(capped.rho2.sqrt()) / (1 - 1e-9)
    lo, hi = corners.amin(1) - rho, corners.amax(1) + rho
    p = lo + (hi - lo) * torch.rand(400, 3, generator=gen, dtype=F64)
    caps = capped.faces[f.shape[0]:]
    assert (pcops.mesh_distance(p, v, caps).dists.square() >= capped.gap[rows] * (1 - 1e-12)).all()
    assert (4 * math.pi * reference.winding_number(p, v, caps).abs() <= capped.far[rows] * (1 + 1e-12)).all()
    c = v[caps]
    area = torch.linalg.vector_norm(torch.linalg.cross(c[:, 1] - c[:, 0], c[:, 2] - c[:, 0]), dim=-1) / 2
    e = torch.maximum(torch.maximum(c.amin(1)[None] - hi[:, None], lo[:, None] - c.amax(1)[None]), torch.zeros(3, dtype=F64))
    d2 = e.square().sum(-1)
    assert (capped.gap[rows] <= d2.amin(1) * (1 + 1e-12)).all()
    bound = torch.where(d2 > 0, area / d2, float("inf")).sum(1)
    assert (capped.far[rows] >= bound * (1 - 1e-12)).all()
    assert torch.isfinite(capped.far).float().mean() > 0.2  # (a bound that is never finite proves nothing)


def test_a_face_s_neighbourhood_decides_only_its_own_queries_where_its_data_allow():
    """``pcops::mesh_capped`` given made-up neighbourhood data: a query nearer than the widening
    to its face takes the capped mesh's side where the gap clears its band and the bound is
    small; with either failing, or farther from its face, it takes the per-query check's value."""
    v, f = MESHES["holes"]
    gen = torch.Generator().manual_seed(16)
    q = _queries(v, f, gen, 600)
    bvh = pcops.mesh_bvh(v, f)
    closed, simple, capped = _analysed(bvh)
    face, rival, sides = _sided(q, bvh, closed, simple, capped)
    t = capped.tree

    def run(gap, far):
        full = lambda x: torch.full_like(capped.gap, x)  # noqa: E731
        return torch.ops.pcops.mesh_capped.default(q, face, rival, v, f, sides, t.a, t.b, t.c, t.group, t.lo, t.hi, t.glo, t.ghi, t.center,
                                                   t.normal, t.moment, t.radius, capped.area, full(gap), full(far), capped.rho2, bvh.tree.scale,
                                                   capped.faces, *simple[1:])

    alone = run(0.0, float("inf"))  # the per-query check everywhere
    corners = v[f[face]]
    own = reference.triangle_points(q, *corners.unbind(1)).sub(q).square().sum(-1)
    within = torch.isfinite(sides) & (own <= capped.rho2)
    assert within.float().mean() > 0.1 and (~within & torch.isfinite(sides)).any()
    taken = run(float("inf"), 0.0)
    assert torch.equal(taken[within], sides[within]) and torch.equal(taken[~within], alone[~within])
    assert torch.equal(run(0.0, 0.0), alone) and torch.equal(run(float("inf"), float("inf")), alone)


def test_the_caps_node_areas_are_their_faces_areas():
    v, f = MESHES["holes"]
    bvh = pcops.mesh_bvh(v, f)
    capped = _analysed(bvh)[2]
    t = capped.tree
    a, b, c = t.a, t.b, t.c
    area = torch.linalg.vector_norm(torch.linalg.cross(b - a, c - a), dim=-1) / 2
    n = a.shape[0]
    for depth in range(_tree.depth(n) + 1):
        for k in range(1 << depth):
            expected = area[(k * n) >> depth:((k + 1) * n) >> depth].sum()
            got = capped.area[(1 << depth) - 1 + k]
            assert expected <= got <= expected * (1 + 1e-9) + 1e-12, (depth, k)


@pytest.mark.parametrize("name", ["holes", "wavy_bowl", "tube", "two_open_spheres", "edge_used_twice"])
def test_the_per_query_bound_holds_the_caps_winding_number(name):
    """The per-query pass (``_check_func``) at queries of every kind and band: a bound under its
    limit is at least 4 pi |w_C| (the caps' exact winding number), and a cap face within the
    band is always found."""
    v, f = MESHES[name]
    bvh = pcops.mesh_bvh(v, f)
    capped = _analysed(bvh)[2]
    gen = torch.Generator().manual_seed(17)
    q = _queries(v, f, gen, 1500)
    band = (0.05 * torch.rand(q.shape[0], generator=gen, dtype=F64)).square()
    t = capped.tree
    check = _caps._check_func(torch.float64)

    @wp.kernel(enable_backward=False, module="unique")
    def probe(q: wp.array(dtype=wp.vec3d), band: wp.array(dtype=wp.float64), depth: int, ca: wp.array(dtype=wp.vec3d),
              cb: wp.array(dtype=wp.vec3d), cc: wp.array(dtype=wp.vec3d), lo: wp.array(dtype=wp.vec3d), hi: wp.array(dtype=wp.vec3d),
              area: wp.array(dtype=wp.float64), hit: wp.array(dtype=wp.int32), bound: wp.array(dtype=wp.float64)):
        i = wp.tid()
        h, b = check(q[i], band[i], depth, ca, cb, cc, lo, hi, area)
        hit[i] = wp.where(h, 1, 0)
        bound[i] = b

    hit, bound = torch.zeros(q.shape[0], dtype=torch.int32), torch.zeros(q.shape[0], dtype=F64)
    arrays = [wp.from_torch(x.contiguous(), dtype=wp.vec3d) for x in (q, t.a, t.b, t.c, t.lo, t.hi)]
    wp.launch(probe, q.shape[0], [arrays[0], wp.from_torch(band), _tree.depth(t.a.shape[0]), *arrays[1:],
                                  wp.from_torch(capped.area), wp.from_torch(hit), wp.from_torch(bound)], device="cpu")
    caps = capped.faces[f.shape[0]:]
    near = pcops.mesh_distance(q, v, caps).dists.square() <= band
    assert torch.equal(hit.bool() | ~near, torch.ones_like(near))  # every cap face in the band found
    assert _caps.BOUND <= 0.45  # (under 1/2, with room for the bound's rounding)
    limit = 4 * math.pi * _caps.BOUND
    decided = (hit == 0) & (bound < limit)
    w_caps = reference.winding_number(q, v, caps)
    assert (4 * math.pi * w_caps[decided].abs() <= bound[decided] * (1 + 1e-9)).all()
    # no looser than the tightest form of the same bound: each cap face's area over its exact squared distance
    a, b, c = v[caps].unbind(1)
    d2 = (reference.triangle_points(q[:, None], a[None], b[None], c[None]) - q[:, None]).square().sum(-1)
    tightest = (torch.linalg.vector_norm(torch.linalg.cross(b - a, c - a), dim=-1) / 2 / d2).sum(1)
    assert (bound[decided] >= tightest[decided] * (1 - 1e-9)).all()
    tight = (4 * math.pi * w_caps[decided].abs() / bound[decided]).amax()
    assert decided.sum() >= 20 and tight > 0.2  # (bounds that bind)


def test_a_kept_open_mesh_is_capped_once_and_let_go_with_its_tree(monkeypatch):
    v, f = MESHES["holes"]
    bvh = pcops.mesh_bvh(v, f)
    calls = []
    made = _caps.capped
    monkeypatch.setattr(_caps, "capped", lambda *args: calls.append(1) or made(*args))
    q = _queries(v, f, torch.Generator().manual_seed(18), 200)
    first = pcops.mesh_distance(q, bvh, signed=True).dists
    second = pcops.mesh_distance(q, bvh, signed=True).dists
    assert len(calls) == 1 and torch.equal(first, second)
    key = (id(bvh.tree.a), True)
    assert _sides._ANALYSED[key][3] is not None
    pcops.mesh_distance(q, v, f, signed=True)  # built in the call: not capped
    assert len(calls) == 1
    del bvh
    assert key not in _sides._ANALYSED


def test_a_kept_open_mesh_compiles_whole_and_gives_eager_s_distances_and_clear_signs():
    """Compiled, the call walks (no caps: they are made on the host in eager mode): the same
    distances, faces and closest points as eager's capped call, and the same signs wherever the
    exact winding number is clear of 1/2."""
    v, f = MESHES["holes"]
    q = _queries(v, f, torch.Generator().manual_seed(19), 300)
    bvh = pcops.mesh_bvh(v, f)

    def fn(points):
        out = pcops.mesh_distance(points, bvh, signed=True)
        return out.dists, out.closest, out.face

    eager = fn(q)
    assert _sides._ANALYSED[(id(bvh.tree.a), True)][3] is not None  # (eager's call was capped)
    for options in (dict(fullgraph=True), dict(dynamic=True)):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", **options)(q)
        for a, b in zip(compiled[1:], eager[1:], strict=True):
            assert torch.equal(a, b)
        w = reference.winding_number(q, v, f)
        clear = (w - 0.5).abs() >= 0.1
        assert torch.equal(compiled[0].abs(), eager[0].abs())
        assert torch.equal((compiled[0] < 0)[clear], (eager[0] < 0)[clear])


def test_non_finite_vertices_without_validation_terminate():
    v, f = MESHES["holes"]
    q = _queries(v, f, torch.Generator().manual_seed(20), 100)
    for bad in (float("nan"), float("inf")):
        broken = v.clone()
        broken[f[0, 0]] = bad
        bvh = pcops.mesh_bvh(broken, f, validate=False)
        out = pcops.mesh_distance(q, bvh, signed=True, validate=False)
        assert out.dists.shape == (q.shape[0],)
