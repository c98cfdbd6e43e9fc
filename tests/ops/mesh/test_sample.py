"""pcops.sample_points_on_mesh: the shared op suite against a NumPy float64 reference (the
documented SplitMix64 draws, a cumulative-area search, the square-root trick), and the
statistics of the samples at fixed seeds (counts per face against areas, uniform weights,
zero-area faces never drawn)."""

import numpy as np
import pytest
import torch

import pcops
from tests import op_table
from tests.compile_check import assert_compiles
from tests.op_suite import F64, TOL, OpSuite, assert_matches, pack

N = 200  # draws per mesh of the suite's tests


# -- meshes ---------------------------------------------------------------------------------------


def icosphere(subdivisions: int, gen=None, jitter: float = 0.0):
    """The op table's unit icosphere, its vertices moved radially by up to +-jitter / 2."""
    v, f = op_table.icosphere(subdivisions)
    if jitter:
        v = v * (1 + jitter * (torch.rand(v.shape[0], 1, generator=gen, dtype=F64) - 0.5))
    return v, f


def unit_cube():
    """The cube [0, 1]^3 as 12 triangles (two per side, equal areas), normals outward."""
    import trimesh

    m = trimesh.creation.box(extents=(1.0, 1.0, 1.0))
    return torch.tensor(m.vertices, dtype=F64) + 0.5, torch.tensor(m.faces, dtype=torch.int64)


def with_degenerate_faces(v, f, gen):
    """Zero-area faces (a repeated corner, three collinear corners) inserted first, in the
    middle and last: returns the mesh and a mask of its degenerate faces."""
    mid = torch.tensor([[0.25, 0.5, 0.0]], dtype=F64)
    a, b = v[0:1], v[1:2]
    v = torch.cat([v, mid, (a + b) / 2, (a + 3 * b) / 4])  # a lone point; two more on the line through a and b
    n = v.shape[0]
    bad = torch.tensor([[0, 0, 1], [n - 2, 0, 1], [n - 3, n - 3, n - 3], [1, n - 1, n - 2], [2, 2, 5]])
    k = f.shape[0] // 2
    faces = torch.cat([bad[:2], f[:k], bad[2:4], f[k:], bad[4:]])
    degenerate = torch.zeros(faces.shape[0], dtype=torch.bool)
    degenerate[[0, 1, k + 2, k + 3, faces.shape[0] - 1]] = True
    return v, faces, degenerate


def skewed(gen, faces: int = 30):
    """Separate triangles whose areas span six orders of magnitude."""
    scale = 10 ** (-3 * torch.rand(faces, 1, 1, generator=gen, dtype=F64))
    corners = torch.rand(faces, 3, 3, generator=gen, dtype=F64) * scale + torch.rand(faces, 1, 3, generator=gen, dtype=F64)
    return corners.reshape(-1, 3), torch.arange(3 * faces).reshape(faces, 3)


def mesh(kind: str, gen):
    if kind == "cube":
        return unit_cube()
    if kind == "degenerate":
        return with_degenerate_faces(*icosphere(1), gen)[:2]
    if kind == "skewed":
        return skewed(gen)
    return icosphere(2, gen, jitter=0.3)  # "sphere" (and the suite's "uniform")


# -- the reference --------------------------------------------------------------------------------

MASK = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def splitmix_uniforms(seed: int, n: int) -> np.ndarray:
    """The documented draws of one mesh: numbers 0 .. 3n - 1 of the SplitMix64 stream keyed by
    the mixed seed, 53 bits each, as (n, 3) float64 in [0, 1)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed & MASK], dtype=np.uint64))
        h = _mix(key + (np.arange(3 * n, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    return ((h >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(n, 3)


def reference(vertices, faces, n, seed):
    """float64 NumPy: faces by the cumulative distribution of the areas, then the square-root trick."""
    c = vertices.detach().double().numpy()[faces.numpy()]
    cross = np.cross(c[:, 1] - c[:, 0], c[:, 2] - c[:, 0])
    area = np.linalg.norm(cross, axis=1)
    cdf = np.cumsum(area / area.sum())
    u = splitmix_uniforms(seed, n)
    face = np.minimum(np.searchsorted(cdf, u[:, 0], side="right"), len(area) - 1)
    root = np.sqrt(u[:, 1])
    bary = np.stack([1 - root, root * (1 - u[:, 2]), root * u[:, 2]], 1)
    points = np.einsum("nk,nkd->nd", bary, c[face])
    normals = cross[face] / area[face, None]
    return torch.from_numpy(points), torch.from_numpy(face), torch.from_numpy(bary), torch.from_numpy(normals)


def on_face(out, vertices, faces, tol=1e-12):
    """Every point is its weights times its face's corners; weights >= 0 summing to 1; normals
    unit, perpendicular to the face's edges and along (v1 - v0) x (v2 - v0)."""
    c = vertices.double()[faces[out.face]]
    bary, points, normals = out.bary.double(), out.points.double(), out.normals.double()
    assert bool((bary >= 0).all())
    torch.testing.assert_close(bary.sum(-1), torch.ones_like(bary[:, 0]), rtol=0, atol=tol)
    torch.testing.assert_close(points, (bary[:, :, None] * c).sum(1), rtol=0, atol=tol)
    torch.testing.assert_close(normals.norm(dim=-1), torch.ones_like(bary[:, 0]), rtol=0, atol=tol)
    for edge in (c[:, 1] - c[:, 0], c[:, 2] - c[:, 0], c[:, 2] - c[:, 1]):
        assert float((normals * edge).sum(-1).abs().max()) <= tol * 10
    assert bool(((normals * torch.linalg.cross(c[:, 1] - c[:, 0], c[:, 2] - c[:, 0])).sum(-1) > 0).all())


def areas(vertices, faces):
    c = vertices[faces]
    return torch.linalg.cross(c[:, 1] - c[:, 0], c[:, 2] - c[:, 0]).norm(dim=-1) / 2


def chi_square(counts: torch.Tensor, weights: torch.Tensor) -> float:
    expected = weights / weights.sum() * counts.sum()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "draws on faces of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def chi_square_bound(df: int) -> float:
    """The chi-square statistic exceeded with probability 1e-6 (a fixed seed: the test is
    deterministic; a wrong distribution lands orders of magnitude above)."""
    from scipy.stats import chi2

    return float(chi2.ppf(1 - 1e-6, df))


# -- the suite ------------------------------------------------------------------------------------


class TestSampleOnMesh(OpSuite):
    differentiable = ("vertices",)
    clouds = ("sphere", "cube", "degenerate", "skewed")

    def inputs(self, kind, gen):
        vertices, faces = mesh(kind, gen)
        return dict(vertices=vertices, faces=faces, seed=int(torch.randint(0, 2**62, (), generator=gen)))

    def run(self, vertices, faces, seed):
        out = pcops.sample_points_on_mesh(vertices, faces, N, seed=seed)
        assert out.batch is None
        return out.points, out.face, out.bary, out.normals

    def reference(self, vertices, faces, seed):
        return reference(vertices, faces, N, seed)

    def compare(self, out, expected, dtype, inputs=None):
        points, face, bary, normals = out
        assert face.dtype == torch.int64 and torch.equal(face, expected[1]), "faces differ from the reference's"
        for name, a, e in (("points", points, expected[0]), ("bary", bary, expected[2]), ("normals", normals, expected[3])):
            assert_matches(a, e, dtype, name)

    def grad_inputs(self, gen):
        vertices, faces = icosphere(1, gen, jitter=0.3)
        return dict(vertices=vertices, faces=faces, seed=5)

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            vertices, faces = icosphere(1, gen, jitter=0.3)
            corners = vertices.to(dtype)[faces]
            normals = torch.nn.functional.normalize(torch.linalg.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0]), dim=-1)
            area = areas(vertices, faces)
            one = torch.zeros(faces.shape[0], dtype=torch.int64)
            two = (torch.arange(faces.shape[0]) >= 30).long()  # two meshes in a row
            seeds = torch.tensor([3, -7])
            uniform = torch.rand(2, 9, 3, generator=gen, dtype=F64)
            grad = lambda t: t.clone().requires_grad_()  # noqa: E731
            cases.append((torch.ops.pcops.mesh_sample.default, (area, one, corners, normals, seeds[:1], None, 11, True)))
            cases.append((torch.ops.pcops.mesh_sample.default, (area, two, grad(corners), grad(normals), seeds, None, 7, False)))
            cases.append((torch.ops.pcops.mesh_sample.default, (area, two, grad(corners), normals, None, uniform, 9, True)))
        return cases

    def compile_calls(self, gen):
        def fn(vertices, faces, seed):
            out = pcops.sample_points_on_mesh(vertices, faces, 40, seed=seed)
            return out.points, out.face, out.bary, out.normals

        return fn, [(*(t.requires_grad_() if t.is_floating_point() else t for t in icosphere(s, gen, 0.2)), torch.tensor(s))
                    for s in (1, 2)]

    def batched(self, gen):
        meshes = [icosphere(1, gen, 0.3), skewed(gen, 9), unit_cube(), icosphere(0, gen, 0.3)]
        meshes[2] = (meshes[2][0] * 2, meshes[2][1])
        seed = 123
        expected = [tuple(reference(v, f, N, seed + b)) for b, (v, f) in enumerate(meshes)]
        # padded: zero rows past each mesh's vertices, faces of zeros past its faces
        vs, fs = [v for v, _ in meshes], [f for _, f in meshes]
        vl, fl = torch.tensor([len(v) for v in vs]), torch.tensor([len(f) for f in fs])
        vp = torch.zeros(len(meshes), int(vl.max()), 3, dtype=F64)
        fp = torch.zeros(len(meshes), int(fl.max()), 3, dtype=torch.int64)
        for b, (v, f) in enumerate(meshes):
            vp[b, : len(v)], fp[b, : len(f)] = v, f
        out = pcops.sample_points_on_mesh(vp, fp, N, seed=seed, vertices_lengths=vl, faces_lengths=fl)
        assert out.points.shape == (len(meshes), N, 3) and out.batch is None
        padded = [(out.points[b], out.face[b], out.bary[b], out.normals[b]) for b in range(len(meshes))]
        # packed: vertices shuffled, faces interleaved (each mesh's in its own order) and
        # pointing at the shuffled rows; seeds given per mesh as a (B,) tensor
        vq, vb, v_pos = pack(vs, gen)
        offsets = torch.tensor([0] + [len(v) for v in vs]).cumsum(0)
        faces = [v_pos[f + offsets[b]] for b, f in enumerate(fs)]
        fq, fb, f_pos = pack(faces, gen, keep_order=True)
        seeds = seed + torch.arange(len(meshes))
        out = pcops.sample_points_on_mesh(vq, fq, N, seed=seeds, vertices_batch=vb)
        assert out.points.shape == (len(meshes) * N, 3)
        assert torch.equal(out.batch, torch.arange(len(meshes)).repeat_interleave(N))
        assert torch.equal(fb[out.face], out.batch)  # each draw on a face of its own mesh
        to_local = torch.empty_like(f_pos)  # packed face row -> its row within its mesh
        starts = torch.tensor([0] + [len(f) for f in fs]).cumsum(0)
        to_local[f_pos] = torch.arange(len(f_pos)) - starts[:-1].repeat_interleave(torch.tensor([len(f) for f in fs]))
        packed = [(out.points[r], to_local[out.face[r]], out.bary[r], out.normals[r]) for r in torch.arange(len(meshes) * N).reshape(-1, N)]
        return expected, padded, packed

    def bad_inputs(self, gen):
        v, f = icosphere(0)
        sample = pcops.sample_points_on_mesh
        nan = v.clone()
        nan[3, 1] = float("nan")
        line = torch.zeros_like(v)
        line[:, 0] = torch.arange(len(v))  # every vertex on a line: every face of zero area
        ids = torch.zeros(len(v), dtype=torch.int64)
        return {
            "zero n_samples": (lambda: sample(v, f, 0, seed=0), ValueError, "n_samples must be >= 1"),
            "float n_samples": (lambda: sample(v, f, 2.5, seed=0), TypeError, "n_samples must be an int"),
            "no faces": (lambda: sample(v, f[:0], 5, seed=0), ValueError, "a mesh needs vertices and faces"),
            "no vertices": (lambda: sample(v[:0], f, 5, seed=0), ValueError, "a mesh needs vertices and faces"),
            "face past the vertices": (lambda: sample(v, torch.cat([f, torch.tensor([[0, 1, 12]])]), 5), ValueError, "faces values must be"),
            "negative face": (lambda: sample(v, torch.cat([f, torch.tensor([[0, -1, 2]])]), 5), ValueError, "faces values must be"),
            "NaN vertices": (lambda: sample(nan, f, 5), ValueError, "vertices contains NaN or inf"),
            "float faces": (lambda: sample(v, f.double(), 5), TypeError, "faces must have an integer dtype"),
            "int vertices": (lambda: sample(v.long(), f, 5), TypeError, "vertices must have a floating dtype"),
            "2-d vertices": (lambda: sample(v[:, :2], f, 5), ValueError, "vertices must be a tensor of shape"),
            "zero area": (lambda: sample(line, f, 5), ValueError, "faces must include a face of positive area in every mesh: the mesh"),
            "zero-area mesh of a batch": (lambda: sample(torch.stack([v, line]), torch.stack([f, f]), 5), ValueError, "mesh 1 of 2 has none"),
            "float seed": (lambda: sample(v, f, 5, seed=1.5), TypeError, "seed must be an int or an integer tensor"),
            "float seed tensor": (lambda: sample(v, f, 5, seed=torch.tensor(1.0)), TypeError, "seed must have an integer dtype"),
            "seeds per mesh": (lambda: sample(v, f, 5, seed=torch.tensor([1, 2])), ValueError, r"seed must be .* one seed per mesh \(B,\) = \(1,\)"),
            "huge seed": (lambda: sample(v, f, 5, seed=2**64), ValueError, r"seed must be in \[-9223372036854775808, 9223372036854775807\] \(an int64\), got 18446744073709551616"),
            "seed and generator": (lambda: sample(v, f, 5, seed=1, generator=torch.Generator()), ValueError, "seed or generator, not both"),
            "not a generator": (lambda: sample(v, f, 5, generator=3), TypeError, "generator must be a torch.Generator"),
            "generator elsewhere": (lambda: sample(v.to("meta"), f.to("meta"), 5, generator=torch.Generator()), ValueError, "generator must be on"),
            "ids past batch_size": (lambda: sample(v, f, 5, vertices_batch=ids + 1, batch_size=1), ValueError, r"vertices_batch values must be in \[0, batch_size\)"),
            "negative ids": (lambda: sample(v, f, 5, vertices_batch=ids - 1), ValueError, "vertices_batch values must be >= 0"),
            "face across meshes": (lambda: sample(v, f, 5, vertices_batch=(torch.arange(len(v)) >= 6).long()), ValueError, "faces must join vertices of one sample"),
            "zero batch_size": (lambda: sample(v, f, 5, vertices_batch=ids, batch_size=0), ValueError, "batch_size must be >= 1"),
            "batch_size of one mesh": (lambda: sample(v, f, 5, batch_size=2), ValueError, "batch_size is the number of packed meshes"),
            "empty mesh of a batch": (lambda: sample(v[None], f[None], 5, faces_lengths=torch.tensor([0])), ValueError, "faces_lengths values"),
            "mesh of packed ids without faces": (lambda: sample(v, f, 5, vertices_batch=ids, batch_size=2), ValueError, "mesh 1 of 2 has none"),
        }


# -- the distribution -----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["seed", "generator", "global"])
def test_faces_are_drawn_in_proportion_to_their_areas(form):
    """Counts per face of 200,000 draws against the areas: a chi-square statistic below its 1e-6
    tail (df = F - 1), whichever source of randomness."""
    vertices, faces = skewed(torch.Generator().manual_seed(3), faces=40)
    kw = {"seed": dict(seed=11), "generator": dict(generator=torch.Generator().manual_seed(11)), "global": {}}[form]
    if form == "global":
        torch.manual_seed(11)
    out = pcops.sample_points_on_mesh(vertices, faces, 200_000, **kw)
    counts = torch.bincount(out.face, minlength=len(faces)).double()
    weights = areas(vertices, faces)
    assert chi_square(counts, weights) < chi_square_bound(len(faces) - 1)
    assert chi_square(counts, weights.sqrt()) > 100 * chi_square_bound(len(faces) - 1)  # the test tells areas from their square roots
    on_face(out, vertices, faces)


def test_points_are_uniform_on_their_triangle():
    """On one triangle, w0 = 1 - sqrt(r1) has P(w0 <= x) = 1 - (1 - x)^2 and w2 / (w1 + w2) is
    uniform: Kolmogorov-Smirnov distances of 10^5 draws below their 1e-6 tail, mean weights 1/3."""
    from scipy.stats import kstwo

    vertices = torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.5, 2.0, 1.0]], dtype=F64)
    out = pcops.sample_points_on_mesh(vertices, torch.tensor([[0, 1, 2]]), 100_000, seed=4)
    n = out.bary.shape[0]
    bound = float(kstwo.ppf(1 - 1e-6, n))
    w0 = torch.sort(out.bary[:, 0]).values
    split = torch.sort(out.bary[:, 2] / (out.bary[:, 1] + out.bary[:, 2])).values
    steps = torch.arange(1, n + 1, dtype=F64) / n
    for x, cdf in ((w0, 1 - (1 - w0) ** 2), (split, split)):
        assert float(torch.maximum((steps - cdf).abs(), (steps - 1 / n - cdf).abs()).max()) < bound
    torch.testing.assert_close(out.bary.mean(0), torch.full((3,), 1 / 3, dtype=F64), rtol=0, atol=5 / np.sqrt(n) * 0.25)
    on_face(out, vertices, torch.tensor([[0, 1, 2]]))


def test_samples_of_the_unit_cube_are_centred_and_share_its_sides():
    vertices, faces = unit_cube()
    out = pcops.sample_points_on_mesh(vertices, faces, 120_000, seed=2)
    n = out.points.shape[0]
    # a coordinate is uniform on four sides and 0 or 1 on two: variance (4/12 + 2/4) / 6 = 5/36
    torch.testing.assert_close(out.points.mean(0), torch.full((3,), 0.5, dtype=F64), rtol=0, atol=5 * np.sqrt(5 / 36 / n))
    side = (out.normals.abs().argmax(-1) * 2 + (out.normals.sum(-1) > 0)).bincount(minlength=6).double()
    assert chi_square(side, torch.ones(6, dtype=F64)) < chi_square_bound(5)
    on_face(out, vertices, faces)


def test_zero_area_faces_are_never_drawn():
    vertices, faces, degenerate = with_degenerate_faces(*icosphere(2), None)
    assert bool((areas(vertices, faces)[degenerate] == 0).all())
    out = pcops.sample_points_on_mesh(vertices, faces, 100_000, seed=0)
    assert not bool(degenerate[out.face].any())
    counts = torch.bincount(out.face, minlength=len(faces)).double()
    assert chi_square(counts, areas(vertices, faces)) < chi_square_bound(int((~degenerate).sum()) - 1)


def test_huge_meshes_sample_as_their_unit_copies():
    """Cross products of coordinates near 1e160-1e200 overflow float64: the faces' normals and
    areas are taken on edges scaled by a power of two, so such a mesh draws the same faces and
    normals as its unit copy (bitwise for a power-of-two scale), not "no face of positive area"."""
    v = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=F64)
    f = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
    draw = lambda vertices: pcops.sample_points_on_mesh(vertices, f, 200, generator=torch.Generator().manual_seed(3))  # noqa: E731
    unit = draw(v)
    for scale in (2.0**600, 2.0**-40, 1e160, 1e200):
        out = draw(v * scale)
        assert torch.equal(out.face, unit.face), scale
        if scale in (2.0**600, 2.0**-40):
            assert torch.equal(out.normals, unit.normals) and torch.equal(out.points, unit.points * scale)
        else:
            torch.testing.assert_close(out.normals, unit.normals, rtol=0, atol=1e-15)


def test_large_float32_meshes_are_sampled_not_refused():
    """A float32 mesh beyond 1e8 (the limit of the float32 distance search, which sampling does
    not run) was refused with that search's error: it is sampled, drawing its unit copy's faces
    and normals (bit for bit at a power of two), up to coordinates of 1e37."""
    v = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]])
    f = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
    draw = lambda vertices: pcops.sample_points_on_mesh(vertices, f, 200, seed=3)  # noqa: E731
    unit = draw(v)
    for scale in (2.0**40, 1e9, 1e20, 1e37):
        out = draw(v * scale)
        assert torch.equal(out.face, unit.face), scale
        assert torch.isfinite(out.points).all()
        torch.testing.assert_close(out.points / scale, unit.points, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.normals, unit.normals, rtol=0, atol=4 * torch.finfo(torch.float32).eps)
    assert torch.equal(draw(v * 2.0**40).normals, unit.normals)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_tiny_meshes_sample_the_normals_of_their_unit_copies(dtype):
    """The cross products of tiny faces underflowed (float32 legs of 1e-12 gave a normal of
    length 1e-24, 1e-30 a zero normal; float64 meshes at 1e-300 had no face of positive area):
    the edges are scaled by the largest coordinate's power of two below 1 as above it, so a mesh
    at 2^-100 (float32) or 2^-1000 (float64) draws the faces and normals of its unit copy bit for
    bit, and at any scale down to 1e-30 (1e-300) the same faces and unit normals within rounding."""
    v = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [0.3, 0.9, 0.4]], dtype=dtype)
    f = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3], [4, 1, 2]])
    draw = lambda vertices: pcops.sample_points_on_mesh(vertices, f, 300, seed=5)  # noqa: E731
    unit = draw(v)
    tiny = 2.0**-100 if dtype == torch.float32 else 2.0**-1000
    out = draw(v * tiny)
    assert torch.equal(out.face, unit.face) and torch.equal(out.normals, unit.normals)
    for scale in (1e-12, 1e-20, 1e-30) if dtype == torch.float32 else (1e-200, 1e-300):
        out = draw(v * scale)
        assert torch.equal(out.face, unit.face), scale
        torch.testing.assert_close(out.normals, unit.normals, rtol=0, atol=4 * torch.finfo(dtype).eps)


def test_a_padded_batch_of_no_mesh_is_a_value_error():
    """Padded (0, V, 3) vertices read as one mesh of no faces: mesh_bvh crashed the process
    (a segmentation fault), sampling failed in torch. Every mesh op names the vertices."""
    v, f, p = torch.zeros(0, 8, 3), torch.zeros(0, 12, 3, dtype=torch.int64), torch.zeros(0, 5, 3)
    for call in (lambda: pcops.mesh_bvh(v, f), lambda: pcops.sample_points_on_mesh(v, f, 5, seed=0),
                 lambda: pcops.sample_points_on_mesh(v, f, 5, seed=0, validate=False), lambda: pcops.mesh_distance(p, v, f, signed=True),
                 lambda: pcops.point_mesh_face_distance(p, v, f)):
        with pytest.raises(ValueError, match=r"^vertices must hold at least one mesh \(B >= 1\)"):
            call()


def test_every_face_of_a_large_mesh_is_found_exactly(gen):
    """The guide table's search equals a binary search of the cumulated units (10^4 faces, runs
    of zero-area faces, areas over six orders of magnitude, 10^5 draws)."""
    vertices, faces = skewed(gen, faces=10_000)
    faces[torch.randperm(10_000, generator=gen)[:3000]] = torch.tensor([5, 5, 6])  # zero-area faces, some in runs
    faces[:50] = torch.tensor([1, 1, 1])
    seed, n = 77, 100_000
    out = pcops.sample_points_on_mesh(vertices, faces, n, seed=seed)
    area = areas(vertices, faces).double() * 2
    units = torch.floor(area * (2.0**32 / area.max()) + 0.5).long()
    cum = units.cumsum(0)
    u0 = torch.from_numpy(splitmix_uniforms(seed, n)[:, 0])
    want = torch.searchsorted(cum, torch.floor(u0 * float(cum[-1])).long(), right=True)
    assert torch.equal(out.face, want)


# -- randomness: seeds, generators ----------------------------------------------------------------


def test_equal_seeds_give_equal_samples_and_other_seeds_others():
    v, f = icosphere(2)
    a, b = pcops.sample_points_on_mesh(v, f, 500, seed=9), pcops.sample_points_on_mesh(v, f, 500, seed=torch.tensor(9))
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)
    assert torch.equal(a.face, pcops.sample_points_on_mesh(v, f, 500, seed=torch.tensor([9], dtype=torch.int32)).face)
    other = pcops.sample_points_on_mesh(v, f, 500, seed=10)
    assert (other.face != a.face).float().mean() > 0.9
    assert torch.equal(pcops.sample_points_on_mesh(v, f, 200, seed=9).face, a.face[:200])  # draw j does not depend on n


def test_one_seed_for_a_batch_gives_mesh_b_the_seed_plus_b():
    v, f = icosphere(1)
    out = pcops.sample_points_on_mesh(torch.stack([v, 2 * v, 3 * v]), torch.stack([f, f, f]), 50, seed=-4)
    for b in range(3):
        one = pcops.sample_points_on_mesh((b + 1) * v, f, 50, seed=-4 + b)
        assert torch.equal(out.face[b], one.face) and torch.equal(out.points[b], one.points)
    assert not torch.equal(out.face[0], out.face[1])


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e20), (torch.float32, 1e37), (F64, 1e200)], ids=str)
def test_a_huge_mesh_beside_a_unit_one_leaves_it_its_own_samples(dtype, scale):
    """Each mesh of a batch is scaled by its own power of two before its edges are taken: a unit
    mesh beside a huge one got normals of 1e-40 or 0 (float32) or no face of positive area
    (float64), the batch's one scale underflowing its cross products. Padded and packed, each
    mesh draws its faces, points and normals as alone."""
    v = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=dtype)
    f = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
    meshes = (v, v * scale)
    alone = [pcops.sample_points_on_mesh(m, f, 64, seed=9 + b) for b, m in enumerate(meshes)]
    padded = pcops.sample_points_on_mesh(torch.stack(meshes), torch.stack([f, f]), 64, seed=9)
    packed = pcops.sample_points_on_mesh(torch.cat(meshes), torch.cat([f, f + 4]), 64, seed=9, vertices_batch=torch.tensor([0] * 4 + [1] * 4))
    for b, one in enumerate(alone):
        rows = slice(64 * b, 64 * (b + 1))
        for got in (padded.face[b], packed.face[rows] - 4 * b):
            assert torch.equal(got, one.face)
        for got in (padded.normals[b], packed.normals[rows]):
            assert torch.equal(got, one.normals)
        assert torch.equal(padded.points[b], one.points) and torch.equal(packed.points[rows], one.points)
    torch.testing.assert_close(alone[0].normals.norm(dim=1), torch.ones(64, dtype=dtype))


def test_float32_edges_beyond_the_dtype_are_measured():
    """A float32 face whose edges are longer than float32's largest value (its corners within it)
    was never drawn (its edge overflowed to inf, its area read 0): the corners are scaled before
    the edges are taken, so the faces are drawn as those of the float64 mesh."""
    v = torch.tensor([[-2e38, 0, 0], [2e38, 0, 0], [0, 2e38, 0], [0, 0, 2e38]])
    f = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
    single, double = (pcops.sample_points_on_mesh(m, f, 4000, seed=1) for m in (v, v.double()))
    assert torch.equal(single.face, double.face)
    torch.testing.assert_close(single.normals, double.normals.float(), rtol=0, atol=1e-7)
    assert pcops.sample_points_on_mesh(v, f[:1], 8, seed=1).face.tolist() == [0] * 8


def test_a_generator_reproduces_its_draws():
    v, f = icosphere(2)
    a = pcops.sample_points_on_mesh(v, f, 300, generator=torch.Generator().manual_seed(5))
    b = pcops.sample_points_on_mesh(v, f, 300, generator=torch.Generator().manual_seed(5))
    c = pcops.sample_points_on_mesh(v, f, 300, generator=torch.Generator().manual_seed(6))
    assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4]))
    assert not torch.equal(a.face, c.face)
    # the generator's draws are torch.rand((B, n, 3), dtype=float64): r1 = their second column
    u = torch.rand((1, 300, 3), dtype=F64, generator=torch.Generator().manual_seed(5))[0]
    torch.testing.assert_close(a.bary[:, 0], 1 - u[:, 1].sqrt(), rtol=0, atol=1e-15)


def test_global_generator_draws_follow_torch_manual_seed():
    v, f = icosphere(1)
    torch.manual_seed(3)
    a = pcops.sample_points_on_mesh(v, f, 100)
    torch.manual_seed(3)
    assert torch.equal(pcops.sample_points_on_mesh(v, f, 100).points, a.points)


def test_draws_are_the_same_in_float32_and_float64():
    v, f = icosphere(3, torch.Generator().manual_seed(0), 0.3)
    v = v.float().double()  # values exact in both dtypes: the same areas
    a, b = pcops.sample_points_on_mesh(v, f, 10_000, seed=1), pcops.sample_points_on_mesh(v.float(), f, 10_000, seed=1)
    assert torch.equal(a.face, b.face)
    torch.testing.assert_close(b.points.double(), a.points, **TOL[torch.float32])


# -- layouts --------------------------------------------------------------------------------------


def test_padded_faces_are_local_and_padding_faces_never_drawn():
    v, f = icosphere(1)
    fp = torch.stack([f, f.flip(0)])
    fp[0, 40:] = -1  # padding of mesh 0 (faces_lengths 40), whatever it holds
    out = pcops.sample_points_on_mesh(torch.stack([v, v]), fp, 2000, seed=0, faces_lengths=torch.tensor([40, 80]))
    assert out.face.shape == (2, 2000) and int(out.face[0].max()) < 40 and int(out.face[1].max()) >= 40
    on_face(type(out)(out.points[1], out.face[1], out.bary[1], out.normals[1]), v, f.flip(0))


def test_packed_meshes_need_a_batch_size_under_compile():
    v, f = icosphere(0)
    ids = torch.zeros(len(v), dtype=torch.int64)
    with pytest.raises(Exception, match="batch_size"):
        torch.compile(lambda v: pcops.sample_points_on_mesh(v, f, 5, seed=0, vertices_batch=ids).points, fullgraph=True, backend="aot_eager")(v)


def test_gradients_flow_to_the_corners_of_the_drawn_faces():
    v, f = icosphere(1)
    v = v.requires_grad_()
    out = pcops.sample_points_on_mesh(v, f, 64, seed=8)
    (out.points.sum() + 0 * out.normals.sum()).backward()
    want = torch.zeros_like(v).index_add_(0, f[out.face].reshape(-1), out.bary.reshape(-1, 1).expand(-1, 3))
    torch.testing.assert_close(v.grad, want, rtol=0, atol=1e-12)
    assert not out.bary.requires_grad and not out.face.is_floating_point()


def test_normals_gradcheck_and_second_order():
    v, f = icosphere(0, torch.Generator().manual_seed(1), 0.2)
    v = v.requires_grad_()

    def fn(x):
        out = pcops.sample_points_on_mesh(x, f, 25, seed=3)
        return (out.points * out.normals).sum(-1)

    assert torch.autograd.gradcheck(fn, (v,))
    assert torch.autograd.gradgradcheck(fn, (v,))


# -- compiling ------------------------------------------------------------------------------------


def test_padded_meshes_with_per_mesh_seeds_compile_whole(gen):
    def fn(vertices, faces, lengths, seeds):
        out = pcops.sample_points_on_mesh(vertices, faces, 30, seed=seeds, faces_lengths=lengths)
        return out.points, out.face, out.normals

    calls = []
    for s in (1, 2):
        v, f = icosphere(s, gen, 0.2)
        calls.append((torch.stack([v, 2 * v]).requires_grad_(), torch.stack([f, f]), torch.tensor([len(f), len(f) // 2]), torch.tensor([4, 9])))
    assert_compiles(fn, calls)


def test_packed_meshes_with_a_batch_size_compile_whole(gen):
    def fn(vertices, faces, ids):
        out = pcops.sample_points_on_mesh(vertices, faces, 20, seed=0, vertices_batch=ids, batch_size=2)
        return out.points, out.face, out.batch

    calls = []
    for s in (0, 1):
        v, f = icosphere(s, gen, 0.2)
        calls.append((torch.cat([v, v]).requires_grad_(), torch.cat([f, f + len(v)]), torch.arange(2).repeat_interleave(len(v))))
    assert_compiles(fn, calls)


def test_the_global_generator_form_compiles_whole():
    v, f = icosphere(1)
    torch._dynamo.reset()
    out = torch.compile(lambda v: pcops.sample_points_on_mesh(v, f, 50).points, fullgraph=True, backend="aot_eager")(v)
    assert out.shape == (50, 3) and bool((out.norm(dim=-1) <= 1 + 1e-12).all())


def test_value_checks_run_inside_the_op_under_compile():
    v, f = icosphere(0)
    nan, line = v.clone(), torch.zeros_like(v)
    nan[3, 1] = float("nan")
    line[:, 0] = torch.arange(len(v))
    torch._dynamo.reset()
    sample = torch.compile(lambda v, validate: pcops.sample_points_on_mesh(v, f, 5, seed=0, validate=validate).points,
                           fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="vertices contains NaN or inf"):
        sample(nan, True)
    with pytest.raises(Exception, match="faces must include a face of positive area in every mesh: the mesh has none"):
        sample(line, True)
    assert sample(line, False).shape == (5, 3)  # unspecified values, no error


def test_a_seed_tensor_compiles_one_graph_for_every_seed():
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    v, f = icosphere(1)
    torch._dynamo.reset()
    counters.clear()
    count = CompileCounter()
    sample = torch.compile(lambda v, s: pcops.sample_points_on_mesh(v, f, 20, seed=s).points, backend=count)
    for s in (1, 2, 3):
        assert torch.equal(sample(v, torch.tensor(s)), pcops.sample_points_on_mesh(v, f, 20, seed=s).points)
    assert count.frame_count == 1 and not counters["graph_break"]
