"""pcops.grid_sample against a float64 Python-dictionary reference (the shared op suite, plus specifics)."""

import math

import pytest
import torch
from torch._dynamo.utils import counters

import pcops
from pcops.ops.sampling.grid_sample import GridSample, GridSamplePadded
from tests import reference
from tests.compile_check import assert_compiles, compiled_breaks
from tests.op_suite import F64, OpSuite, assert_matches, pack, pad


def grid_reference(points, voxel_size, batch=None, mode="first", origin=None):
    """Voxels of a Python dict of (sample, cell) keys, cells from Python float arithmetic:
    (points (V, 3), coords (V, 3), index (V,) or None, inverse (N,), batch (V,))."""
    p = points.double().tolist()
    n = len(p)
    ids = [0] * n if batch is None else batch.tolist()
    o = [0.0] * 3 if origin is None else [float(x) for x in origin]
    cells = [tuple(math.floor((x - oa) / voxel_size) for x, oa in zip(row, o)) for row in p]
    if origin is None:  # Pointcept: each sample's smallest cell is 0
        low = {}
        for b, c in zip(ids, cells):
            low[b] = tuple(min(a, m) for a, m in zip(c, low.get(b, c)))
        cells = [tuple(a - m for a, m in zip(c, low[b])) for b, c in zip(ids, cells)]
    keys = [(b, *c) for b, c in zip(ids, cells)]
    number = {key: v for v, key in enumerate(sorted(set(keys)))}
    inverse = torch.tensor([number[k] for k in keys], dtype=torch.int64)
    members = {}
    for i, k in enumerate(keys):
        members.setdefault(number[k], []).append(i)
    v = len(number)
    coords = torch.tensor([list(k[1:]) for k in sorted(number)], dtype=torch.int64).reshape(v, 3)
    vb = torch.tensor([k[0] for k in sorted(number)], dtype=torch.int64)
    pts = points.double()
    if mode == "mean":
        out = torch.stack([pts[members[c]].mean(0) for c in range(v)]) if v else pts.new_zeros((0, 3))
        return out, coords, None, inverse, vb
    index = torch.tensor([members[c][0] for c in range(v)], dtype=torch.int64)
    return pts[index], coords, index, inverse, vb


class TestGridSampleFirst(OpSuite):
    mode = "first"
    differentiable = ("points",)
    names = ("points", "grid_coord", "index", "inverse", "batch")

    def inputs(self, kind, gen):
        _, p, r = reference.cloud(kind, gen)
        return dict(points=p, voxel_size=r)

    def run(self, points, voxel_size):
        out = pcops.grid_sample(points, voxel_size, mode=self.mode)
        return tuple(x for x in out if x is not None)

    def reference(self, points, voxel_size):
        return tuple(x for x in grid_reference(points, voxel_size, mode=self.mode) if x is not None)

    def compare(self, out, expected, dtype, inputs=None):
        assert len(out) == len(expected)
        names = [n for n in self.names if not (n == "index" and self.mode == "mean")]
        for a, e, name in zip(out, expected, names):
            assert_matches(a, e, dtype, name)

    def grad_inputs(self, gen):
        # points near voxel centres, so a finite-difference step never changes the voxels
        centres = torch.randint(0, 4, (24, 3), generator=gen).double() + 0.5
        p = (centres + 0.2 * (torch.rand(24, 3, generator=gen, dtype=F64) - 0.5)) * 0.25
        return dict(points=p, voxel_size=0.25)

    def opcheck_cases(self, gen):
        p = torch.rand(40, 3, generator=gen)
        batch = torch.randint(0, 3, (40,), generator=gen)
        padded = torch.where(torch.arange(40) < 30, batch, -1)
        op = torch.ops.pcops.grid_cluster.default
        origin = torch.tensor([-0.1, 0.2, 0.0], dtype=F64)
        return [(op, (p, 0.3, None, None, True)), (op, (p.double(), 0.25, origin, batch, True)), (op, (p, 0.2, None, padded, True))]

    def compile_calls(self, gen):
        def fn(points, batch):
            out = pcops.grid_sample(points, 0.3, batch=batch, mode=self.mode)
            return tuple(x for x in out if x is not None)

        calls = []
        for n in (40, 61):
            p = torch.rand(n, 3, generator=gen).requires_grad_()
            calls.append((p, torch.randint(0, 3, (n,), generator=gen)))
        return fn, calls

    def test_compile_fullgraph(self, gen):
        fn, calls = self.compile_calls(gen)
        assert_compiles(fn, calls, backend="aot_eager")

    def batched(self, gen):
        sizes = [30, 0, 9, 1]
        pts = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
        expected = [tuple(x for x in grid_reference(p, 0.3, mode=self.mode) if x is not None) for p in pts]
        padded_pts, lengths = pad(pts)
        out = pcops.grid_sample(padded_pts, 0.3, lengths=lengths, mode=self.mode)
        padded_rows = []
        for b, n in enumerate(sizes):
            mine = out.batch == b
            assert torch.all(out.inverse[b, n:] == -1)
            first = int(mine.nonzero()[0]) if bool(mine.any()) else 0
            rows = (out.points[mine], out.grid_coord[mine], out.index[mine] if out.index is not None else None,
                    out.inverse[b, :n] - first, torch.zeros(int(mine.sum()), dtype=torch.int64))
            padded_rows.append(tuple(x for x in rows if x is not None))
        points, ids, position = pack(pts, gen, keep_order=True)  # "first" is by row: keep each sample's order
        out = pcops.grid_sample(points, 0.3, batch=ids, mode=self.mode)
        packed_rows, at = [], 0
        for b, n in enumerate(sizes):
            mine = out.batch == b
            first = int(mine.nonzero()[0]) if bool(mine.any()) else 0
            local = torch.empty(points.shape[0], dtype=torch.int64)
            local[position[at : at + n]] = torch.arange(n)  # packed row -> row within sample b
            index = None if out.index is None else local[out.index[mine]]
            rows = (out.points[mine], out.grid_coord[mine], index, out.inverse[position[at : at + n]] - first,
                    torch.zeros(int(mine.sum()), dtype=torch.int64))
            packed_rows.append(tuple(x for x in rows if x is not None))
            at += n
        return expected, padded_rows, packed_rows

    def bad_inputs(self, gen):
        p = torch.rand(10, 3, generator=gen)
        nan = p.clone()
        nan[1, 2] = float("nan")
        gs = pcops.grid_sample
        return {
            "zero voxel_size": (lambda: gs(p, 0.0), ValueError, "voxel_size must be finite and > 0"),
            "tensor voxel_size": (lambda: gs(p, torch.tensor(0.1)), TypeError, "voxel_size must be a number"),
            "huge coordinates": (lambda: gs(p * 1e12, 1e-6), ValueError, "voxel_size=1e-06 is too small"),
            "2-d points": (lambda: gs(p[:, :2], 0.1), ValueError, "points must be a tensor of shape"),
            "int points": (lambda: gs(p.long(), 0.1), TypeError, "points must have a floating dtype"),
            "mode": (lambda: gs(p, 0.1, mode="last"), ValueError, "mode must be one of"),
            "generator": (lambda: gs(p, 0.1, mode="random", generator=0), TypeError, "generator must be a torch.Generator"),
            "batch dtype": (lambda: gs(p, 0.1, batch=torch.zeros(10)), TypeError, "batch must have an integer dtype"),
            "batch shape": (lambda: gs(p, 0.1, batch=torch.zeros(9, dtype=torch.long)), ValueError, "batch must be a tensor of shape"),
            "negative batch": (lambda: gs(p, 0.1, batch=-torch.ones(10, dtype=torch.long)), ValueError, "batch values"),
            "lengths with packed": (lambda: gs(p, 0.1, lengths=torch.tensor([10])), ValueError, "lengths describes padded"),
            "batch with padded": (lambda: gs(p[None], 0.1, batch=torch.zeros(10, dtype=torch.long)), ValueError, "batch describes packed"),
            "long lengths": (lambda: gs(p[None], 0.1, lengths=torch.tensor([11])), ValueError, "lengths values"),
            "origin": (lambda: gs(p, 0.1, origin=(0.0, 1.0)), TypeError, "origin must be"),
            "NaN points": (lambda: gs(nan, 0.1), ValueError, "points contains NaN or inf"),
        }


class TestGridSampleMean(TestGridSampleFirst):
    mode = "mean"


def test_inverse_equals_torch_unique_of_the_voxel_keys(gen):
    p = torch.randn(20_000, 3, generator=gen) * 3
    batch = torch.randint(0, 5, (20_000,), generator=gen)
    out = pcops.grid_sample(p, 0.2, batch=batch)
    cells = torch.floor(p.double() / 0.2).long()
    cells -= torch.stack([cells[batch == b].amin(0) for b in range(5)])[batch]
    key = ((batch * 1000 + cells[:, 0]) * 1000 + cells[:, 1]) * 1000 + cells[:, 2]
    unique, inverse = torch.unique(key, return_inverse=True)
    assert torch.equal(out.inverse, inverse) and out.points.shape[0] == unique.shape[0]
    assert torch.equal(out.index, torch.full_like(unique, p.shape[0]).scatter_reduce(0, inverse, torch.arange(p.shape[0]), "amin"))


def test_points_on_voxel_boundaries_belong_to_the_upper_voxel():
    p = torch.tensor([[0.5, 0.25, -0.25], [0.4999, 0.25, -0.25], [0.0, 0.0, 0.0], [-0.25, 0.0, 0.0]], dtype=F64)
    out = pcops.grid_sample(p, 0.25, origin=0.0)
    by_point = out.grid_coord[out.inverse]
    assert by_point.tolist() == [[2, 1, -1], [1, 1, -1], [0, 0, 0], [-1, 0, 0]]


def test_default_origin_shifts_each_sample_like_pointcept(gen):
    p = torch.rand(50, 3, generator=gen, dtype=F64) * 4 - 7  # negative coordinates
    batch = torch.arange(50) % 2
    p[batch == 1] += 100.0
    out = pcops.grid_sample(p, 0.5, batch=batch)
    for b in (0, 1):
        assert torch.equal(out.grid_coord[out.batch == b].amin(0), torch.zeros(3, dtype=torch.int64))
    # Pointcept: grid_coord = floor(coord / grid_size) - min(floor(coord / grid_size))
    cells = torch.floor(p[batch == 0] / 0.5).long()
    assert torch.equal(out.grid_coord[out.inverse[batch == 0]], cells - cells.amin(0))


def test_explicit_origin_matches_reference(gen):
    p = torch.rand(80, 3, generator=gen, dtype=F64) * 2 - 1
    origin = [0.1, -0.3, 0.05]
    out = pcops.grid_sample(p, 0.3, origin=torch.tensor(origin))
    expected = grid_reference(p, 0.3, origin=origin)
    for a, e in zip((out.points, out.grid_coord, out.index, out.inverse), expected):
        assert torch.equal(a, e)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("origin", [NAN, (0.0, INF, 0.0), [0.0, 0.0, -INF], torch.tensor([0.0, NAN, 0.0]), torch.tensor(INF)],
                         ids=["nan", "inf tuple", "-inf list", "nan tensor", "inf 0-d tensor"])
def test_a_nan_or_inf_origin_raises_naming_it(gen, origin):
    # before: every cell NaN, so every point in one voxel
    p = torch.rand(50, 3, generator=gen)
    with pytest.raises(ValueError, match="origin"):
        pcops.grid_sample(p, 0.1, origin=origin)


def test_a_nan_tensor_origin_is_not_read_without_validate(gen):
    p = torch.rand(50, 3, generator=gen)
    out = pcops.grid_sample(p, 0.1, origin=torch.tensor([0.0, NAN, 0.0]), validate=False)  # unspecified voxels, no error
    assert out.inverse.shape == (50,)


def test_a_nan_tensor_origin_raises_in_the_op_under_compile(gen):
    def fn(points, origin):
        return pcops.grid_sample(points, 0.1, origin=origin).inverse

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    p = torch.rand(50, 3, generator=gen)
    assert torch.equal(compiled(p, torch.zeros(3)), fn(p, torch.zeros(3)))
    with pytest.raises(ValueError, match="origin contains NaN or inf"):
        compiled(p, torch.tensor([0.0, NAN, 0.0]))


@pytest.mark.parametrize("size", [NAN, INF, -INF])
def test_a_nan_or_inf_voxel_size_raises(gen, size):
    with pytest.raises(ValueError, match="must be finite and > 0"):
        pcops.grid_sample(torch.rand(50, 3, generator=gen), size)


def test_the_former_keyword_grid_size_warns_and_gives_the_same_result(gen):
    p = torch.rand(200, 3, generator=gen) * 2 - 1
    batch = torch.randint(0, 3, (200,), generator=gen)
    with pytest.warns(FutureWarning, match="'grid_size' is renamed 'voxel_size'"):
        old = pcops.grid_sample(p, grid_size=0.3, batch=batch, mode="mean")
    new = pcops.grid_sample(p, voxel_size=0.3, batch=batch, mode="mean")
    assert old._fields == new._fields
    for a, b in zip(old, new):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(TypeError, match="'grid_size' and its new name 'voxel_size'"):
        pcops.grid_sample(p, voxel_size=0.3, grid_size=0.3)


def test_random_mode_draws_each_member_of_a_voxel(gen):
    p = torch.tensor([[0.1, 0.1, 0.1], [0.2, 0.2, 0.2], [0.3, 0.3, 0.3], [5.0, 5.0, 5.0]])
    seen = set()
    for s in range(60):
        out = pcops.grid_sample(p, 1.0, mode="random", generator=torch.Generator().manual_seed(s))
        assert out.index[1] == 3 and torch.equal(out.points, p[out.index])
        seen.add(int(out.index[0]))
    assert seen == {0, 1, 2}
    a = pcops.grid_sample(p, 1.0, mode="random", generator=torch.Generator().manual_seed(7)).index
    b = pcops.grid_sample(p, 1.0, mode="random", generator=torch.Generator().manual_seed(7)).index
    assert torch.equal(a, b)


def test_random_mode_compiles_without_a_generator(gen):
    def fn(points):
        out = pcops.grid_sample(points, 0.25, mode="random")
        return out.points, out.index, out.inverse

    p = torch.rand(200, 3, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    points, index, inverse = compiled(p)
    assert torch.equal(points, p[index]) and torch.equal(inverse[index], torch.arange(index.shape[0]))


def test_grids_too_wide_for_one_int64_key_still_sort_lexicographically(gen):
    p = torch.rand(30, 3, generator=gen, dtype=F64)
    batch = torch.randint(0, 2, (30,), generator=gen)
    out = pcops.grid_sample(p, 1e-9, batch=batch)
    expected = grid_reference(p, 1e-9, batch=batch)
    for a, e in zip((out.points, out.grid_coord, out.index, out.inverse, out.batch), expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("size", [0.3, 1e-3], ids=["4-byte-keys", "8-byte-keys"])
def test_keys_of_either_width_match_the_reference(gen, size):
    # a grid of < 2^31 cells sorts 4-byte keys, a wider one (here ~10^10 cells) 8-byte keys
    p = torch.rand(200, 3, generator=gen, dtype=F64) * 2
    batch = torch.randint(0, 3, (200,), generator=gen)
    out = pcops.grid_sample(p, size, batch=batch)
    for a, e in zip((out.points, out.grid_coord, out.index, out.inverse, out.batch), grid_reference(p, size, batch=batch)):
        assert torch.equal(a, e)
    # padded samples: the padding rows are in no voxel
    lengths = torch.tensor([70, 20, 50])
    padded = torch.full((3, 70, 3), 100.0, dtype=F64)  # far-away padding, in no voxel
    padded[0], padded[1, :20], padded[2, :50] = p[:70], p[70:90], p[90:140]
    real = torch.arange(70)[None] < lengths[:, None]
    out = pcops.grid_sample(padded, size, lengths=lengths)
    ids = torch.arange(3)[:, None].expand(3, 70)[real]
    e_points, e_coords, e_index, e_inverse, e_batch = grid_reference(padded[real], size, batch=ids)
    first = torch.cumsum(lengths, 0) - lengths
    assert torch.equal(out.inverse[real], e_inverse) and bool((out.inverse[~real] == -1).all())
    assert torch.equal(out.points, e_points) and torch.equal(out.grid_coord, e_coords) and torch.equal(out.batch, e_batch)
    assert torch.equal(out.index, e_index - first[e_batch])


def test_sparse_huge_sample_ids_keep_their_values(gen):
    p = torch.rand(20, 3, generator=gen, dtype=F64)
    batch = torch.tensor([2**40, 7] * 10)
    out = pcops.grid_sample(p, 0.5, batch=batch)
    expected = grid_reference(p, 0.5, batch=batch)
    for a, e in zip((out.points, out.grid_coord, out.index, out.inverse, out.batch), expected):
        assert torch.equal(a, e)


def test_empty_cloud():
    out = pcops.grid_sample(torch.zeros(0, 3), 0.1)
    assert out.points.shape == (0, 3) and out.grid_coord.shape == (0, 3) and out.index.shape == (0,) and out.inverse.shape == (0,)


# -- bounded form: max_voxels (static shapes, padded rows, the true count) ------------------------

PAD = {"points": 0, "grid_coord": -1, "index": -1, "batch": -1}  # the padding of the voxel rows


def assert_padded_form(out, full, bound):
    """``out`` (bounded) holds ``full``'s (unbounded) first min(V, bound) voxels, then padding;
    inverse -1 for the points of dropped voxels; count V."""
    v = full.points.shape[0]
    keep = min(v, bound)
    assert type(out) is GridSamplePadded and type(full) is GridSample and out._fields == (*GridSample._fields, "count")
    assert out.count.dtype == torch.int64 and out.count.shape == () and int(out.count) == v
    for name, fill in PAD.items():
        a, e = getattr(out, name), getattr(full, name)
        if e is None:
            assert a is None
            continue
        assert a.shape == (bound, *e.shape[1:]) and a.dtype == e.dtype, name
        assert torch.equal(a[:keep], e[:keep]), name
        assert torch.all(a[keep:] == fill), name
    assert torch.equal(out.inverse, torch.where(full.inverse < bound, full.inverse, -1))


@pytest.mark.parametrize("mode", ["first", "mean", "random"])
@pytest.mark.parametrize("extra", [0, 9, -20], ids=["exact", "padded", "overflow"])
def test_bounded_equals_unbounded_on_the_first_count_rows(gen, mode, extra):
    p = torch.rand(150, 3, generator=gen, dtype=F64) * 2 - 1
    batch = torch.randint(0, 3, (150,), generator=gen)
    torch.manual_seed(5)
    full = pcops.grid_sample(p, 0.4, batch=batch, mode=mode)
    v = full.points.shape[0]
    assert v > 40
    torch.manual_seed(5)  # "random": the same draws
    out = pcops.grid_sample(p, 0.4, batch=batch, mode=mode, max_voxels=v + extra)
    assert_padded_form(out, full, v + extra)
    if mode != "random":  # and the independent reference
        expected = grid_reference(p, 0.4, batch=batch, mode=mode)
        keep = min(v, v + extra)
        for a, e, name in zip((out.points, out.grid_coord, out.index, out.batch), expected[:3] + expected[4:], ("points", "grid_coord", "index", "batch")):
            if e is not None:
                assert_matches(a[:keep], e[:keep], F64, name)


def test_bounded_padded_input_equals_a_per_sample_loop(gen):
    sizes = [30, 0, 9, 1]
    pts = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
    padded_pts, lengths = pad(pts)
    out = pcops.grid_sample(padded_pts, 0.3, lengths=lengths, max_voxels=50)
    full = pcops.grid_sample(padded_pts, 0.3, lengths=lengths)
    assert_padded_form(out, full, 50)
    first = 0
    for b, n in enumerate(sizes):
        alone = pcops.grid_sample(pts[b], 0.3)
        v = alone.points.shape[0]
        assert torch.equal(out.points[first : first + v], alone.points) and torch.equal(out.index[first : first + v], alone.index)
        assert torch.equal(out.grid_coord[first : first + v], alone.grid_coord) and torch.all(out.batch[first : first + v] == b)
        assert torch.equal(out.inverse[b, :n] - first, alone.inverse) and torch.all(out.inverse[b, n:] == -1)
        first += v
    assert int(out.count) == first


def test_overflow_drops_whole_later_samples_and_marks_their_points(gen):
    p = torch.rand(40, 3, generator=gen, dtype=F64)
    batch = torch.arange(40) % 2  # sample 1's voxels all come after sample 0's
    full = pcops.grid_sample(p, 0.5, batch=batch)
    first_sample = int((full.batch == 0).sum())
    out = pcops.grid_sample(p, 0.5, batch=batch, max_voxels=first_sample)
    assert_padded_form(out, full, first_sample)
    assert torch.all(out.batch == 0) and torch.all(out.inverse[batch == 1] == -1) and torch.all(out.inverse[batch == 0] >= 0)
    assert int(out.count) == full.points.shape[0]


def test_bounded_empty_cloud_is_all_padding():
    out = pcops.grid_sample(torch.zeros(0, 3), 0.1, max_voxels=3)
    assert out.points.shape == (3, 3) and torch.all(out.points == 0) and torch.all(out.grid_coord == -1)
    assert out.index.tolist() == [-1] * 3 and out.batch.tolist() == [-1] * 3 and out.inverse.shape == (0,)
    assert int(out.count) == 0


@pytest.mark.parametrize("mode", ["first", "mean"])
def test_bounded_gradcheck(gen, mode):
    inputs = TestGridSampleFirst().grad_inputs(gen)  # points near voxel centres
    v = pcops.grid_sample(inputs["points"], 0.25).points.shape[0]
    for m in (v + 3, v - 2):  # padded, and overflowing (dropped points: zero gradient)
        fn = lambda x: pcops.grid_sample(x, 0.25, mode=mode, max_voxels=m).points  # noqa: E731
        assert torch.autograd.gradcheck(fn, (inputs["points"].clone().requires_grad_(),))


def test_bounded_opcheck(gen):
    p = torch.rand(40, 3, generator=gen)
    batch = torch.randint(0, 3, (40,), generator=gen)
    padded = torch.where(torch.arange(40) < 30, batch, -1)
    origin = torch.tensor([-0.1, 0.2, 0.0], dtype=F64)
    op = torch.ops.pcops.grid_cluster.default
    for size in (-1, 1, 6, 200):
        torch.library.opcheck(op, (p, 0.3, None, None, True, size))
        torch.library.opcheck(op, (p.double(), 0.25, origin, batch, True, size))
        torch.library.opcheck(op, (p, 0.2, None, padded, True, size))
    torch.library.opcheck(op, (p[:0], 0.3, None, None, True, 3))


def _sample_fn(max_voxels, mode="first"):
    def fn(points, batch):
        return tuple(x for x in pcops.grid_sample(points, 0.3, batch=batch, mode=mode, max_voxels=max_voxels) if x is not None)

    return fn


def _calls(gen):
    return [(torch.rand(n, 3, generator=gen).requires_grad_(), torch.randint(0, 3, (n,), generator=gen)) for n in (40, 61)]


@pytest.mark.parametrize("options", [{}, {"dynamic": True}], ids=["default", "dynamic"])
@pytest.mark.parametrize("mode", ["first", "mean"])
def test_bounded_compiles_without_graph_breaks(gen, options, mode):
    for bound in (64, 8):  # padded, and overflowing
        assert compiled_breaks(_sample_fn(bound, mode), _calls(gen), **options) == {}


def test_bounded_compiles_fullgraph(gen):
    assert_compiles(_sample_fn(64), _calls(gen), ops=("pcops.grid_cluster",), backend="aot_eager")


def test_bounded_random_mode_compiles_without_graph_breaks(gen):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_sample_fn(100, "random"), backend="aot_eager")
    p = torch.rand(200, 3, generator=gen)
    points, coords, index, inverse, batch, count = compiled(p, torch.zeros(200, dtype=torch.long))
    v = int(count)
    assert not counters["graph_break"] and 0 < v <= 100
    assert torch.equal(points[:v], p[index[:v]]) and torch.equal(inverse[index[:v]], torch.arange(v))
    assert torch.all(index[v:] == -1) and torch.all(points[v:] == 0)


def test_unbounded_breaks_the_graph_at_the_op_under_default_compile(gen):
    breaks = compiled_breaks(_sample_fn(None), _calls(gen))
    assert breaks and all("pcops.grid_cluster" in reason for reason in breaks), breaks


def test_bad_max_voxels_raises(gen):
    p = torch.rand(10, 3, generator=gen)
    for bad, error in ((0, ValueError), (-1, ValueError), (False, TypeError), (8.0, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="max_voxels"):
            pcops.grid_sample(p, 0.1, max_voxels=bad)


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    p = torch.rand(5000, 3, generator=gen)
    batch = torch.randint(0, 4, (5000,), generator=gen)
    cpu = pcops.grid_sample(p, 0.05, batch=batch)
    gpu = pcops.grid_sample(p.cuda(), 0.05, batch=batch.cuda())
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b)


@pytest.mark.cuda
def test_bounded_cuda_matches_cpu(gen):
    p = torch.rand(5000, 3, generator=gen)
    batch = torch.randint(0, 4, (5000,), generator=gen)
    for mode in ("first", "mean"):
        for m in (20_000, 300):  # padded, and overflowing
            cpu = pcops.grid_sample(p, 0.05, batch=batch, mode=mode, max_voxels=m)
            gpu = pcops.grid_sample(p.cuda(), 0.05, batch=batch.cuda(), mode=mode, max_voxels=m)
            for a, b in zip(gpu, cpu):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a.cpu(), b)


def test_the_former_field_coords_warns_and_is_grid_coord():
    p = torch.tensor([[0.1, 0.2, 0.3], [0.9, 0.9, 0.9]])
    for out in (pcops.grid_sample(p, 0.5), pcops.grid_sample(p, 0.5, max_voxels=4)):
        with pytest.warns(FutureWarning, match=r"\.coords is renamed .*\.grid_coord"):
            assert out.coords is out.grid_coord
