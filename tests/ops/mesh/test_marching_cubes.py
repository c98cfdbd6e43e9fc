"""pcops.marching_cubes: vertices against a float64 brute force and scikit-image, the mesh closed,
manifold and oriented towards increasing values, gradients, compile, batches, bad inputs."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

import pcops
from tests.op_suite import OpSuite, assert_matches

F64 = torch.float64
N = 9  # the suite's grids: N^3 values


def field(kind: str, gen: torch.Generator, n: int = N) -> torch.Tensor:
    """A grid (n, n, n) of float64 values whose level set 0 is ``kind``'s surface, in voxel units."""
    axis = torch.arange(n, dtype=F64)
    x, y, z = torch.meshgrid(axis, axis, axis, indexing="ij")
    c = (n - 1) / 2 + 0.3 * (torch.rand(3, generator=gen, dtype=F64) - 0.5)
    if kind in ("sphere", "uniform"):
        f = ((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2).sqrt() - n / 3
        return f + (0.4 * torch.rand(f.shape, generator=gen, dtype=F64) if kind == "uniform" else 0)
    if kind == "torus":
        return (((x - c[0]) ** 2 + (y - c[1]) ** 2).sqrt() - n / 4) ** 2 + (z - c[2]) ** 2 - (n / 8) ** 2
    if kind == "noise":  # every ambiguous configuration, closed by a border above the level
        f = torch.rand(n, n, n, generator=gen, dtype=F64) * 2 - 1
        f[[0, -1]] = f[:, [0, -1]] = f[:, :, [0, -1]] = 1.0
        return f
    if kind == "open":  # a wavy sheet through the whole grid: open at the grid's sides
        return z - c[2] - torch.sin(x) - 0.5 * torch.cos(0.7 * y)
    if kind == "ties":  # values on the level exactly at whole planes of corners
        return (x - 3).abs() + 0.0 * y - 2.0
    raise ValueError(kind)


CLOSED = ("sphere", "uniform", "torus", "noise")


def reference(volume: torch.Tensor, level: float = 0.0, origin=(0.0, 0.0, 0.0), step=(1.0, 1.0, 1.0)) -> torch.Tensor:
    """float64 brute force: a vertex on every edge whose ends are on either side of the level
    (>= level: above), ordered by (i, j, k, axis), linearly interpolated."""
    v = volume.double().numpy()
    rows = []
    for axis in range(3):
        lo = [slice(None)] * 3
        hi = [slice(None)] * 3
        lo[axis], hi[axis] = slice(0, -1), slice(1, None)
        a, b = v[tuple(lo)], v[tuple(hi)]
        for i, j, k in zip(*np.nonzero((a >= level) != (b >= level))):
            t = (level - a[i, j, k]) / (b[i, j, k] - a[i, j, k])
            p = np.array([i, j, k], dtype=np.float64)
            p[axis] += t
            rows.append(((i, j, k, axis), np.asarray(origin) + np.asarray(step) * p))
    rows.sort(key=lambda r: r[0])
    return torch.tensor(np.array([p for _, p in rows]).reshape(-1, 3))


def check_mesh(vertices: torch.Tensor, faces: torch.Tensor, closed: bool) -> None:
    """Every vertex used; each face's corners distinct; every directed edge in one face at most
    and, for a closed surface, its reverse in exactly one other (closed, manifold, oriented)."""
    assert faces.dtype == torch.int64
    if faces.numel() == 0:
        return
    assert torch.equal(torch.unique(faces), torch.arange(len(vertices))), "a vertex is unused"
    assert (faces[:, 0] != faces[:, 1]).all() and (faces[:, 1] != faces[:, 2]).all() and (faces[:, 0] != faces[:, 2]).all()
    directed = Counter(map(tuple, torch.cat([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]]).tolist()))
    assert max(directed.values()) == 1, "an edge is used twice in one direction: not oriented or not manifold"
    if closed:
        missing = [e for e in directed if (e[1], e[0]) not in directed]
        assert not missing, f"{len(missing)} edges with one face: not closed"


def volume_of(vertices: torch.Tensor, faces: torch.Tensor) -> float:
    a, b, c = (vertices[faces[:, i]].double() for i in range(3))
    return float((a * torch.linalg.cross(b, c)).sum() / 6)


def euler(vertices: torch.Tensor, faces: torch.Tensor) -> int:
    edges = {tuple(sorted(e)) for e in torch.cat([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]]).tolist()}
    return len(vertices) - len(edges) + len(faces)


class TestMarchingCubes(OpSuite):
    differentiable = ("volume",)
    clouds = ("sphere", "uniform", "torus", "noise", "open", "ties")

    def inputs(self, kind, gen):
        return dict(volume=field(kind, gen), kind=kind)

    def run(self, volume, kind):
        out = pcops.marching_cubes(volume, 0.0, origin=-0.5, voxel_size=1 / N)
        assert out.vertices_batch is None and out.faces_batch is None
        return out.vertices, out.faces

    def reference(self, volume, kind):
        return reference(volume, 0.0, (-0.5,) * 3, (1 / N,) * 3), kind

    def compare(self, out, expected, dtype, inputs=None):
        vertices, faces = out
        assert_matches(vertices, expected[0], dtype, "vertices")
        if isinstance(expected[1], torch.Tensor):  # the batch test: faces of the loop
            assert torch.equal(faces, expected[1])
        else:
            check_mesh(vertices, faces, closed=expected[1] in CLOSED)

    def grad_inputs(self, gen):
        return dict(volume=field("uniform", gen, 6), kind="uniform")

    def opcheck_cases(self, gen):
        op = torch.ops.pcops.marching_cubes.default
        cases = []
        for dtype in (torch.float32, F64):
            grids = torch.stack([field("uniform", gen, 7), field("torus", gen, 7), torch.ones(7, 7, 7, dtype=F64)]).to(dtype)
            cases += [(op, (grids, 0.0, -1, -1)), (op, (grids, 0.25, 40, 30)), (op, (grids[:1, :, 1:, 2:], -0.5, -1, -1))]
        return cases

    def compile_calls(self, gen):
        def fn(volume):
            out = pcops.marching_cubes(volume, 0.0, max_vertices=400, max_faces=800)
            return out.vertices, out.faces, out.vertices_lengths, out.faces_lengths

        return fn, [(field("uniform", gen, n).requires_grad_(),) for n in (7, 9)]

    def batched(self, gen):
        grids = [field("sphere", gen), field("noise", gen), torch.ones(N, N, N, dtype=F64), field("open", gen)]
        expected = [self.run(g, "") for g in grids]
        expected = [(v, f) for v, f in expected]
        stack = torch.stack(grids)
        out = pcops.marching_cubes(stack, 0.0, origin=-0.5, voxel_size=1 / N)
        packed = []
        for b in range(len(grids)):
            rows = (out.vertices_batch == b).nonzero().squeeze(1)
            face_rows = out.faces_batch == b
            first = rows[0] if rows.numel() else 0
            assert torch.equal(out.vertices_batch[out.faces[face_rows]], torch.full_like(out.faces[face_rows], b))
            packed.append((out.vertices[rows], out.faces[face_rows] - first))
        bound_v = max(len(v) for v, _ in expected)
        bound_f = max(len(f) for _, f in expected)
        pad = pcops.marching_cubes(stack, 0.0, origin=-0.5, voxel_size=1 / N, max_vertices=bound_v + 3, max_faces=bound_f + 5)
        padded = []
        for b, (v, f) in enumerate(expected):
            nv, nf = int(pad.vertices_lengths[b]), int(pad.faces_lengths[b])
            assert (nv, nf) == (len(v), len(f))
            assert (pad.vertices[b, nv:] == 0).all() and (pad.faces[b, nf:] == -1).all()
            padded.append((pad.vertices[b, :nv], pad.faces[b, :nf]))
        return [(v, f) for v, f in expected], padded, packed

    def bad_inputs(self, gen):
        v = field("sphere", gen)
        mc = pcops.marching_cubes
        nan = v.clone()
        nan[2, 3, 4] = float("nan")
        return {
            "not a tensor": (lambda: mc(v.numpy()), TypeError, "volume must be a torch.Tensor"),
            "integer volume": (lambda: mc(v.long()), TypeError, "volume must have a floating dtype"),
            "2-d volume": (lambda: mc(v[0]), ValueError, r"volume must be a tensor of shape \(D, H, W\) or \(B, D, H, W\)"),
            "5-d volume": (lambda: mc(v[None, None]), ValueError, "volume must be a tensor of shape"),
            "NaN": (lambda: mc(nan), ValueError, "volume contains NaN or inf"),
            "level not a number": (lambda: mc(v, "0"), TypeError, "level must be a number"),
            "level tensor": (lambda: mc(v, torch.tensor(0.0)), TypeError, "level must be a number"),
            "infinite level": (lambda: mc(v, float("inf")), ValueError, "level must be finite"),
            "zero voxel_size": (lambda: mc(v, voxel_size=0.0), ValueError, "voxel_size must be finite and > 0"),
            "negative voxel_size": (lambda: mc(v, voxel_size=(1.0, -1.0, 1.0)), ValueError, "voxel_size must be finite and > 0"),
            "two voxel sizes": (lambda: mc(v, voxel_size=(1.0, 1.0)), TypeError, "voxel_size must be a number or a sequence of three"),
            "origin of strings": (lambda: mc(v, origin=("a", 0, 0)), TypeError, "origin must be a number or a sequence of three"),
            "NaN origin": (lambda: mc(v, origin=float("nan")), ValueError, "origin must be finite"),
            "NaN tensor origin": (lambda: mc(v, origin=torch.tensor([0.0, float("nan"), 0.0])), ValueError, "origin contains NaN or inf"),
            "origin tensor of two": (lambda: mc(v, origin=torch.zeros(2)), ValueError, r"origin must be .* a real tensor of shape \(3,\)"),
            "bool origin tensor": (lambda: mc(v, origin=torch.zeros(3, dtype=torch.bool)), ValueError, "origin must be .* a real tensor"),
            "max_vertices alone": (lambda: mc(v, max_vertices=10), ValueError, "max_vertices and max_faces go together"),
            "zero max_faces": (lambda: mc(v, max_vertices=10, max_faces=0), ValueError, "max_faces must be >= 1"),
            "float max_vertices": (lambda: mc(v, max_vertices=2.5, max_faces=3), TypeError, "max_vertices must be an int"),
            "validate not a bool": (lambda: mc(v, validate=1), TypeError, "validate must be a bool"),
        }


# -- against scikit-image, and the surface's shape ------------------------------------------------


@pytest.mark.parametrize("kind", ["sphere", "torus", "noise", "open"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_vertices_are_scikit_images(kind, dtype):
    """The same surface points as scikit-image's marching_cubes, with its spacing as voxel_size:
    Lorensen's exactly (one vertex per crossed edge), and Lewiner's on the grid's edges (it adds
    points inside some ambiguous cells)."""
    measure = pytest.importorskip("skimage.measure")
    volume = field(kind, torch.Generator().manual_seed(3), 14).to(dtype)
    step = torch.tensor([0.5, 0.25, 2.0], dtype=F64)
    out = pcops.marching_cubes(volume, 0.1, voxel_size=tuple(step.tolist()))
    order = lambda p: p[np.lexsort(p.numpy().T[::-1])]  # noqa: E731
    for method in ("lorensen", "lewiner"):
        verts, _, _, _ = measure.marching_cubes(volume.numpy(), 0.1, spacing=tuple(step.tolist()), method=method)
        theirs = torch.tensor(verts, dtype=F64)
        on_edges = ((theirs / step - (theirs / step).round()).abs() < 1e-5).sum(1) >= 2
        assert method == "lewiner" or on_edges.all()
        theirs = theirs[on_edges]
        assert out.vertices.shape == theirs.shape
        torch.testing.assert_close(order(out.vertices.double()), order(theirs), rtol=0, atol=1e-5)


def test_values_at_the_level_put_one_vertex_where_scikit_image_does():
    """Grid values equal to the level count as below it, as in scikit-image: on volumes of small
    integers (many corners exactly at the level) the vertices are Lorensen's, and a corner at the
    level between one corner above and several below gives one vertex there, not one per edge
    (corners at the level counted as above gave 58 vertices at 54 positions and 8 faces of no
    area where scikit-image has 54)."""
    measure = pytest.importorskip("skimage.measure")
    order = lambda p: sorted(map(tuple, p.numpy().round(4)))  # noqa: E731  (positions on a grid of 1/4-steps: exact in float32)
    g = torch.Generator().manual_seed(0)
    volumes = [torch.randint(-2, 3, (6, 7, 5), generator=g).double() for _ in range(30)]
    one = torch.full((5, 5, 5), 1.0, dtype=F64)
    one[1:4, 1:4, 1:4], one[2, 2, 2], one[1, 2, 2] = -1.0, -2.0, 0.0  # one corner at the level
    for volume in [one, *volumes]:
        out = pcops.marching_cubes(volume, 0.0)
        verts = torch.tensor(np.ascontiguousarray(measure.marching_cubes(volume.numpy(), 0.0, method="lorensen")[0]), dtype=F64)
        assert out.vertices.shape == verts.shape and order(out.vertices) == order(verts)
    assert pcops.marching_cubes(one, 0.0).vertices.shape[0] == 54


def test_a_float32_grid_meshes_as_its_values_in_float64():
    """The level is not rounded to the grid's dtype before the above-or-below test (a float32 1.0
    was not above the level 0.99999999999, and a float32 0.1 was at the level 0.1), and the
    vertices are measured in float64 (a float32 ``values[end] - values[start]`` overflowed from
    1.7e38, putting the vertices on their start corners): a float32 grid gives its values'
    float64 mesh, rounded to float32."""
    peak = torch.full((3, 3, 3), -1.0)
    peak[1, 1, 1] = 1.0
    tenth = torch.full((3, 3, 3), -1.0)
    tenth[1, 1, 1], tenth[1, 1, 2] = 1.0, 0.1
    wide = torch.full((2, 2, 2), -2e38)
    wide[1] = 2e38
    g = torch.Generator().manual_seed(5)
    noise = (torch.rand(6, 6, 6, generator=g) - 0.5) * 3e38
    for volume, level in ((peak, 0.99999999999), (peak, 1.0), (tenth, 0.1), (tenth, float(torch.tensor(0.1))), (wide, 0.0), (noise, 1e37)):
        got, want = pcops.marching_cubes(volume, level), pcops.marching_cubes(volume.double(), level)
        assert torch.equal(got.faces, want.faces)
        assert torch.equal(got.vertices, want.vertices.float())
    assert pcops.marching_cubes(peak, 0.99999999999).faces.shape[0] == 8
    assert pcops.marching_cubes(peak, 1.0).faces.shape[0] == 0
    torch.testing.assert_close(pcops.marching_cubes(wide, 0.0).vertices[:, 0], torch.full((4,), 0.5), rtol=0, atol=0)


def test_a_sphere_is_a_closed_outward_oriented_sphere():
    n = 48
    axis = torch.linspace(-1, 1, n, dtype=F64)
    points = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1)
    out = pcops.marching_cubes(points.norm(dim=-1) - 0.75, 0.0, origin=-1.0, voxel_size=2 / (n - 1))
    check_mesh(out.vertices, out.faces, closed=True)
    assert euler(out.vertices, out.faces) == 2
    torch.testing.assert_close(out.vertices.norm(dim=1), torch.full((len(out.vertices),), 0.75, dtype=F64), rtol=0, atol=2e-3)
    assert volume_of(out.vertices, out.faces) == pytest.approx(4 / 3 * math.pi * 0.75**3, rel=5e-3)
    corners = out.vertices[out.faces]
    normals = torch.linalg.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0])
    assert ((normals * corners.mean(1)).sum(1) > 0).all(), "a face's normal points inwards (towards lower values)"


def test_a_torus_has_genus_one_and_the_negated_field_the_other_orientation():
    volume = field("torus", torch.Generator().manual_seed(0), 24)
    out = pcops.marching_cubes(volume, 0.0)
    check_mesh(out.vertices, out.faces, closed=True)
    assert euler(out.vertices, out.faces) == 0
    # the field is not a distance (linear interpolation places its zeros a little inwards)
    assert volume_of(out.vertices, out.faces) == pytest.approx(2 * math.pi**2 * 6 * 3**2, rel=0.05)
    flipped = pcops.marching_cubes(-volume, 0.0)  # the same surface with the inside above: inward normals
    check_mesh(flipped.vertices, flipped.faces, closed=True)
    assert volume_of(flipped.vertices, flipped.faces) == pytest.approx(-volume_of(out.vertices, out.faces), rel=1e-3)


@pytest.mark.parametrize("seed", range(4))
def test_noise_gives_a_closed_manifold_whose_faces_stay_in_their_cells(seed):
    volume = field("noise", torch.Generator().manual_seed(seed), 12)
    out = pcops.marching_cubes(volume, 0.0)
    check_mesh(out.vertices, out.faces, closed=True)
    # each face's three vertices lie on edges of one cell: their coordinates span at most one voxel
    span = out.vertices[out.faces].amax(1) - out.vertices[out.faces].amin(1)
    assert (span <= 1).all()


def test_gradients_of_a_vertex_are_its_edge_interpolations():
    volume = field("sphere", torch.Generator().manual_seed(1), 7).requires_grad_()
    out = pcops.marching_cubes(volume, 0.0)
    out.vertices[0].sum().backward()
    grad = volume.grad
    used = grad.nonzero()
    assert len(used) == 2  # the vertex's two corners
    (a, b) = [volume[tuple(i)].item() for i in used]
    # d/da of t = (0 - a) / (b - a) is -b / (b - a)^2; d/db is a / (b - a)^2
    torch.testing.assert_close(grad[tuple(used[0])], torch.tensor(-b / (b - a) ** 2, dtype=F64))
    torch.testing.assert_close(grad[tuple(used[1])], torch.tensor(a / (b - a) ** 2, dtype=F64))


def test_padded_gradcheck_and_overflow_cuts_the_mesh():
    volume = field("uniform", torch.Generator().manual_seed(2), 6).requires_grad_()
    full = pcops.marching_cubes(volume, 0.0)
    v, f = len(full.vertices), len(full.faces)
    torch.autograd.gradcheck(lambda x: pcops.marching_cubes(x, 0.0, max_vertices=v + 2, max_faces=f).vertices, (volume,))
    cut = pcops.marching_cubes(volume, 0.0, max_vertices=v // 2, max_faces=f - 1)
    assert int(cut.vertices_lengths) == v and int(cut.faces_lengths) == f
    torch.testing.assert_close(cut.vertices, full.vertices[: v // 2])
    kept = (full.faces[: f - 1] < v // 2).all(1)
    assert torch.equal(cut.faces[kept], full.faces[: f - 1][kept]) and (cut.faces[~kept] == -1).all()


@pytest.mark.parametrize("shape", [(5, 5, 5), (1, 6, 6), (6, 1, 6), (0, 4, 4), (2, 0, 3, 3)])
def test_grids_without_a_crossing_or_a_cell_give_empty_meshes(shape):
    volume = torch.ones(shape)
    out = pcops.marching_cubes(volume, 0.5 if shape != (5, 5, 5) else 2.0)
    assert out.vertices.shape == (0, 3) and out.faces.shape == (0, 3)
    pad = pcops.marching_cubes(volume, 0.0, max_vertices=4, max_faces=2)
    assert (pad.vertices_lengths == 0).all() and (pad.faces == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_tensor_origin_gives_the_numbers_mesh_and_its_gradient(dtype):
    """A tensor origin, (3,) or 0-d, float32 or float64, gives bit for bit the mesh of the same
    origin given as numbers (one and padded grids, a batch); the vertices are differentiable with
    respect to it (each vertex moves with the origin: fp64 gradcheck), and the bounded form with a
    tensor origin compiles in one graph."""
    volume = field("torus", torch.Generator().manual_seed(4), 12).to(dtype)
    for origin in ((-0.5, 0.25, 3.0), (0.1, 0.1, 0.1)):
        for tensor in (torch.tensor(origin, dtype=F64), torch.tensor(origin, dtype=torch.float32)):
            numbers = tuple(tensor.double().tolist())
            if len(set(numbers)) == 1:
                tensor = tensor[0]  # a 0-d tensor
            for grid, kw in ((volume, {}), (volume, dict(max_vertices=900, max_faces=1800)), (torch.stack([volume, -volume]), {})):
                want = pcops.marching_cubes(grid, 0.05, origin=numbers, voxel_size=(0.5, 0.25, 2.0), **kw)
                got = pcops.marching_cubes(grid, 0.05, origin=tensor, voxel_size=(0.5, 0.25, 2.0), **kw)
                for a, b in zip(want, got, strict=True):
                    assert (a is None and b is None) or torch.equal(a, b)
    origin = torch.tensor([0.3, -0.2, 0.7], dtype=F64, requires_grad=True)
    small = field("sphere", torch.Generator().manual_seed(5), 6)
    torch.autograd.gradcheck(lambda o: pcops.marching_cubes(small, 0.0, origin=o, voxel_size=0.2).vertices, (origin,))
    explanation = torch._dynamo.explain(
        lambda x, o: pcops.marching_cubes(x, 0.0, origin=o, max_vertices=300, max_faces=600).vertices.sum())(small, origin.detach())
    assert explanation.graph_break_count == 0


def test_the_bounded_form_compiles_in_one_graph_by_default():
    volume = field("sphere", torch.Generator().manual_seed(0))
    explanation = torch._dynamo.explain(lambda x: pcops.marching_cubes(x, 0.0, max_vertices=300, max_faces=600).vertices.sum())(volume)
    assert explanation.graph_break_count == 0
