"""pcops.voxel_pool against a float64 dictionary-of-voxels reference (the shared op suite, plus specifics)."""

import pytest
import torch
from torch._dynamo.utils import counters

import pcops
from pcops.ops.sampling.voxel import VoxelPool, VoxelPoolPadded
from tests import reference
from tests.compile_check import assert_compiles, compiled_breaks
from tests.op_suite import F64, OpSuite, assert_matches, pack

F = 4


class TestVoxelPoolMean(OpSuite):
    reduce = "mean"
    differentiable = ("points", "features")

    def inputs(self, kind, gen):
        _, p, r = reference.cloud(kind, gen)
        f = torch.randn(p.shape[0], F, generator=gen, dtype=F64)
        return dict(points=p, features=f, voxel_size=r)

    def run(self, points, features, voxel_size):
        return tuple(pcops.voxel_pool(points, voxel_size, features, reduce=self.reduce))

    def reference(self, points, features, voxel_size):
        return reference.voxel_pool(points, voxel_size, features, reduce=self.reduce)

    def compare(self, out, expected, dtype, inputs=None):
        for i, (a, e) in enumerate(zip(out, expected)):
            assert_matches(a, e, dtype, ("points", "features", "cluster")[i])

    def grad_inputs(self, gen):
        # points near voxel centres, so a finite-difference step never changes the voxels
        centres = torch.randint(0, 4, (24, 3), generator=gen).double() + 0.5
        p = (centres + 0.2 * (torch.rand(24, 3, generator=gen, dtype=F64) - 0.5)) * 0.25
        return dict(points=p, features=torch.randn(24, F, generator=gen, dtype=F64), voxel_size=0.25)

    def opcheck_cases(self, gen):
        p = torch.rand(40, 3, generator=gen)
        batch = torch.randint(0, 3, (40,), generator=gen)
        op = torch.ops.pcops.voxel_cluster.default
        return [(op, (p, 0.3, None, True)), (op, (p.double(), 0.25, batch, True))]

    def compile_calls(self, gen):
        def fn(points, features, batch):
            out = pcops.voxel_pool(points, 0.3, features, batch=batch, reduce=self.reduce)
            return out.points, out.features, out.cluster

        calls = []
        for n in (40, 61):
            p = torch.rand(n, 3, generator=gen).requires_grad_()
            f = torch.randn(n, F, generator=gen).requires_grad_()
            calls.append((p, f, torch.randint(0, 3, (n,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        sizes = [30, 0, 9, 1]
        pts = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
        feats = [torch.randn(n, F, generator=gen, dtype=F64) for n in sizes]
        expected = [reference.voxel_pool(p, 0.3, f, reduce=self.reduce) for p, f in zip(pts, feats)]
        results = []
        for shuffle in (False, True):
            points, ids, position = pack(pts, gen) if shuffle else (torch.cat(pts), torch.cat([torch.full((n,), b) for b, n in enumerate(sizes)]), torch.arange(sum(sizes)))
            features = torch.empty(sum(sizes), F, dtype=F64)
            features[position] = torch.cat(feats)
            out = pcops.voxel_pool(points, 0.3, features, batch=ids, reduce=self.reduce)
            per_sample, at, first = [], 0, 0
            for b, n in enumerate(sizes):
                cluster = out.cluster[position[at : at + n]]  # sample b's points in their own order
                v = expected[b][0].shape[0]
                assert torch.all(ids[position[at : at + n]] == b)
                per_sample.append((out.points[first : first + v], out.features[first : first + v], cluster - first))
                at, first = at + n, first + v
            assert first == out.points.shape[0]
            results.append(per_sample)
        return expected, results[0], results[1]

    def bad_inputs(self, gen):
        p, f = torch.rand(10, 3, generator=gen), torch.randn(10, F, generator=gen)
        nan = p.clone()
        nan[1, 2] = float("inf")
        vp = pcops.voxel_pool
        return {
            "zero voxel_size": (lambda: vp(p, 0.0), ValueError, "voxel_size must be finite and > 0"),
            "tensor voxel_size": (lambda: vp(p, torch.tensor(0.1)), TypeError, "voxel_size must be a number"),
            "tiny voxel_size": (lambda: vp(p * 1e6, 1e-12), ValueError, "voxel_size=1e-12 is too small"),
            "padded points": (lambda: vp(p[None], 0.1), ValueError, "points must be a tensor of shape"),
            "feature rows": (lambda: vp(p, 0.1, f[:9]), ValueError, "features must have one row per point"),
            "1-d features": (lambda: vp(p, 0.1, f[:, 0]), ValueError, "features must be a tensor of shape"),
            "reduce": (lambda: vp(p, 0.1, f, reduce="sum"), ValueError, r"reduce must be one of \('mean', 'max'\), got 'sum'"),
            "batch dtype": (lambda: vp(p, 0.1, batch=torch.zeros(10)), TypeError, "batch must have an integer dtype"),
            "negative batch": (lambda: vp(p, 0.1, batch=-torch.ones(10, dtype=torch.long)), ValueError, "batch values"),
            "inf points": (lambda: vp(nan, 0.1), ValueError, "points contains NaN or inf"),
        }


class TestVoxelPoolMax(TestVoxelPoolMean):
    reduce = "max"


def test_every_point_in_one_voxel_pools_to_the_centroid(gen):
    p = torch.rand(50, 3, generator=gen, dtype=F64) * 0.1 + 0.05
    out = pcops.voxel_pool(p, 1.0)
    assert out.features is None and torch.all(out.cluster == 0)
    torch.testing.assert_close(out.points, p.mean(0, keepdim=True))


def test_voxels_are_aligned_to_the_origin_and_half_open():
    p = torch.tensor([[0.0, 0, 0], [0.999, 0, 0], [1.0, 0, 0], [-0.001, 0, 0]], dtype=F64)
    assert pcops.voxel_pool(p, 1.0).cluster.tolist() == [1, 1, 2, 0]


@pytest.mark.parametrize("validate", [True, False])
def test_finite_points_whose_cells_overflow_raise_naming_the_voxel_size(validate):
    """A finite point whose cell p / voxel_size overflows float64 (a subnormal size, or a point at
    1e300 on a fine grid) was put in cell 0 with the NaN / inf points of unchecked calls: distinct
    points pooled into one voxel. It is the size's error, checked or not; a NaN point of an
    unchecked call still goes to cell 0 without an error (pooled there with the point in it,
    results unspecified)."""
    small = torch.tensor([[0.1, 0.2, 0.3], [0.9, 0.8, 0.7], [0.5, 0.5, 0.5]])
    far = torch.tensor([[1e300, 0.0, 0.0], [0.0, 0.0, 0.0], [1e-3, 0.0, 0.0]], dtype=F64)
    for points, size in ((small, 1e-310), (far, 1e-9)):
        for op in (pcops.voxel_pool, pcops.grid_sample):
            with pytest.raises(ValueError, match=f"voxel_size={size} is too small for the extent of the points"):
                op(points, size, validate=validate)
    with pytest.raises(ValueError, match="voxel_size=1e-09 is too small"):  # (with an origin: its subtraction overflows)
        pcops.grid_sample(torch.tensor([[1.5e308, 0.0, 0.0]], dtype=F64), 1e-9, origin=torch.tensor([-1.5e308, 0.0, 0.0], dtype=F64))
    if not validate:
        nan = torch.tensor([[0.1, 0.2, 0.3], [float("nan"), 0.0, 0.0], [5.0, 5.0, 5.0]], dtype=F64)
        assert pcops.voxel_pool(nan, 1.0, validate=False).cluster.tolist() == [0, 0, 1]


def test_float32_points_are_assigned_in_float64():
    # float32(-0.3) is a little below -0.3: floor(p / 0.3) = -2 in float64; float32 arithmetic
    # rounds the quotient to -1.0 and puts it in the voxel of -0.29
    p = torch.tensor([[-0.3, 0.0, 0.0], [-0.31, 0.0, 0.0], [-0.29, 0.0, 0.0]])
    assert torch.floor(p.double() / 0.3)[:, 0].tolist() == [-2, -2, -1]
    assert pcops.voxel_pool(p, 0.3).cluster.tolist() == [0, 0, 1]


@pytest.mark.parametrize("size", [0.3, 0.1, 0.05, 0.07, 1 / 3, 0.25, 2.2])
def test_float32_lattice_clouds_get_the_voxels_of_grid_sample_and_of_a_float64_floor(gen, size):
    # points at integer multiples of the size (negative too), rounded to float32: exactly where
    # float32 and float64 arithmetic disagree on the cell
    batch = torch.randint(0, 2, (60,), generator=gen)
    for _ in range(30):
        k = torch.randint(-40, 41, (60, 3), generator=gen)
        p = (k.double() * size).float()
        cells = torch.floor(p.double() / size).long()  # the definition, in float64
        keys = torch.cat([batch[:, None], cells], 1)
        expected = torch.unique(keys, dim=0, return_inverse=True)[1]  # numbered by (sample, x, y, z)
        pooled = pcops.voxel_pool(p, size, batch=batch)
        sampled = pcops.grid_sample(p, size, batch=batch)
        assert torch.equal(pooled.cluster, expected)
        assert torch.equal(sampled.inverse, expected)


def test_samples_never_share_a_voxel(gen):
    p = torch.rand(20, 3, generator=gen, dtype=F64) * 0.1
    batch = torch.arange(20) % 2
    out = pcops.voxel_pool(p, 1.0, batch=batch)
    assert out.points.shape == (2, 3) and torch.equal(out.cluster, batch)


def test_grids_too_wide_for_one_int64_key_still_sort_lexicographically(gen):
    # 10^9 voxels per axis: (x, y, z) do not fit in one int64 key, the op sorts rows instead
    p = torch.rand(30, 3, generator=gen, dtype=F64)
    batch = torch.randint(0, 2, (30,), generator=gen)
    out = pcops.voxel_pool(p, 1e-9, batch=batch)
    expected = reference.voxel_pool(p, 1e-9, batch=batch)
    assert torch.equal(out.cluster, expected[2])
    torch.testing.assert_close(out.points, expected[0])


def test_empty_cloud(gen):
    out = pcops.voxel_pool(torch.zeros(0, 3), 0.1, torch.zeros(0, 2))
    assert out.points.shape == (0, 3) and out.features.shape == (0, 2) and out.cluster.shape == (0,)


# -- bounded form: max_voxels (static shapes, padded rows, the true count) ------------------------


def bounded_inputs(gen, n=120, samples=3):
    p = torch.rand(n, 3, generator=gen, dtype=F64)
    return p, torch.randn(n, F, generator=gen, dtype=F64), torch.randint(0, samples, (n,), generator=gen)


def _pool_fn(max_voxels, reduce="mean"):
    def fn(points, features, batch):
        out = pcops.voxel_pool(points, 0.3, features, batch=batch, reduce=reduce, max_voxels=max_voxels)
        return tuple(out)

    return fn


def _calls(gen):
    return [tuple(t.float().requires_grad_() if t.dtype == F64 else t for t in bounded_inputs(gen, n)) for n in (40, 61)]


@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("extra", [0, 7])
def test_bounded_equals_unbounded_on_the_first_count_rows_then_pads(gen, reduce, extra):
    p, f, batch = bounded_inputs(gen)
    full = pcops.voxel_pool(p, 0.3, f, batch=batch, reduce=reduce)
    v = full.points.shape[0]
    out = pcops.voxel_pool(p, 0.3, f, batch=batch, reduce=reduce, max_voxels=v + extra)
    assert type(out) is VoxelPoolPadded and type(full) is VoxelPool and out._fields == (*VoxelPool._fields, "count")
    assert out.count.dtype == torch.int64 and out.count.shape == () and int(out.count) == v
    assert out.points.shape == (v + extra, 3) and out.features.shape == (v + extra, F)
    assert torch.equal(out.points[:v], full.points) and torch.equal(out.features[:v], full.features)
    assert torch.equal(out.cluster, full.cluster)
    assert torch.all(out.points[v:] == 0) and torch.all(out.features[v:] == 0)
    expected = reference.voxel_pool(p, 0.3, f, batch=batch, reduce=reduce)  # the independent reference
    for a, e, name in zip((out.points[:v], out.features[:v], out.cluster), expected, ("points", "features", "cluster")):
        assert_matches(a, e, F64, name)


def test_bounded_without_features(gen):
    p, _, _ = bounded_inputs(gen)
    out = pcops.voxel_pool(p, 0.5, max_voxels=100)
    v = int(out.count)
    assert out.features is None and torch.equal(out.points[:v], pcops.voxel_pool(p, 0.5).points)


def test_bounded_batch_equals_a_per_sample_loop(gen):
    sizes = [30, 0, 9, 1]
    pts = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
    feats = [torch.randn(n, F, generator=gen, dtype=F64) for n in sizes]
    points, ids, position = pack(pts, gen)
    features = torch.empty(sum(sizes), F, dtype=F64)
    features[position] = torch.cat(feats)
    out = pcops.voxel_pool(points, 0.3, features, batch=ids, max_voxels=64)
    first, at = 0, 0
    for b, n in enumerate(sizes):
        alone = pcops.voxel_pool(pts[b], 0.3, feats[b])
        v = alone.points.shape[0]
        # sums over the shuffled packed rows: equal up to rounding
        torch.testing.assert_close(out.points[first : first + v], alone.points, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.features[first : first + v], alone.features, rtol=1e-12, atol=1e-12)
        assert torch.equal(out.cluster[position[at : at + n]] - first, alone.cluster)
        first, at = first + v, at + n
    assert int(out.count) == first and torch.all(out.points[first:] == 0)


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_overflow_keeps_the_first_voxels_in_order_and_marks_dropped_points(gen, reduce):
    p, f, batch = bounded_inputs(gen)
    full = pcops.voxel_pool(p, 0.3, f, batch=batch, reduce=reduce)
    v, m = full.points.shape[0], 10
    assert v > 2 * m  # whole samples are dropped too: samples are contiguous in the order
    out = pcops.voxel_pool(p, 0.3, f, batch=batch, reduce=reduce, max_voxels=m)
    assert int(out.count) == v and out.points.shape == (m, 3) and out.features.shape == (m, F)
    assert torch.equal(out.points, full.points[:m]) and torch.equal(out.features, full.features[:m])
    assert torch.equal(out.cluster, torch.where(full.cluster < m, full.cluster, -1))
    # the dropped points get no gradient, the kept ones the unbounded call's
    x = p.clone().requires_grad_()
    (g,) = torch.autograd.grad(pcops.voxel_pool(x, 0.3, batch=batch, max_voxels=m).points.sum(), x)
    (g_full,) = torch.autograd.grad(pcops.voxel_pool(x, 0.3, batch=batch).points[:m].sum(), x)
    assert torch.equal(g, g_full) and torch.all(g[out.cluster < 0] == 0)


def test_bounded_empty_cloud_is_all_padding():
    out = pcops.voxel_pool(torch.zeros(0, 3), 0.1, torch.zeros(0, 2), max_voxels=4)
    assert out.points.shape == (4, 3) and out.features.shape == (4, 2) and out.cluster.shape == (0,)
    assert int(out.count) == 0 and torch.all(out.points == 0) and torch.all(out.features == 0)


@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("wrt", ["points", "features"])
def test_bounded_gradcheck(gen, reduce, wrt):
    inputs = TestVoxelPoolMean().grad_inputs(gen)  # points near voxel centres
    v = pcops.voxel_pool(inputs["points"], 0.25).points.shape[0]
    for m in (v + 3, v - 2):  # padded, and overflowing (dropped points: zero gradient)
        def fn(x):
            args = {**inputs, wrt: x}
            out = pcops.voxel_pool(args["points"], 0.25, args["features"], reduce=reduce, max_voxels=m)
            return out.points, out.features

        assert torch.autograd.gradcheck(fn, (inputs[wrt].clone().requires_grad_(),))


def test_bounded_opcheck(gen):
    p = torch.rand(40, 3, generator=gen)
    batch = torch.randint(0, 3, (40,), generator=gen)
    op = torch.ops.pcops.voxel_cluster.default
    for size in (-1, 1, 5, 200):
        torch.library.opcheck(op, (p, 0.3, None, True, size))
        torch.library.opcheck(op, (p.double(), 0.25, batch, True, size))
    torch.library.opcheck(op, (p[:0], 0.3, None, True, 3))


@pytest.mark.parametrize("options", [{}, {"dynamic": True}], ids=["default", "dynamic"])
def test_bounded_compiles_without_graph_breaks(gen, options):
    for bound in (64, 8):  # padded, and overflowing
        assert compiled_breaks(_pool_fn(bound, "max"), _calls(gen), **options) == {}


def test_bounded_compiles_fullgraph(gen):
    assert_compiles(_pool_fn(64), _calls(gen), ops=("pcops.voxel_cluster",), backend="aot_eager")


def test_bounded_compiles_with_inductor_without_graph_breaks(gen):
    torch._dynamo.reset()
    counters.clear()
    fn = _pool_fn(64)
    compiled = torch.compile(fn)
    for args in _calls(gen):
        out, expected = compiled(*args), fn(*args)
        for a, e in zip(out, expected):
            torch.testing.assert_close(a, e)
        grads = torch.autograd.grad(out[0].sum() + out[1].sum(), args[:2])
        for g, e in zip(grads, torch.autograd.grad(expected[0].sum() + expected[1].sum(), args[:2])):
            torch.testing.assert_close(g, e)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_bound_given_as_an_argument_compiles_once_for_every_bound(gen):
    def fn(points, features, m):
        return tuple(pcops.voxel_pool(points, 0.3, features, max_voxels=m))

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="aot_eager", dynamic=True)
    for n, m in ((40, 50), (61, 70), (70, 3)):
        p, f, _ = bounded_inputs(gen, n)
        for a, e in zip(compiled(p, f, m), fn(p, f, m)):
            assert torch.equal(a, e)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_unbounded_breaks_the_graph_at_the_op_under_default_compile(gen):
    breaks = compiled_breaks(_pool_fn(None), _calls(gen))
    assert breaks and all("pcops.voxel_cluster" in reason for reason in breaks), breaks


def test_bad_max_voxels_raises(gen):
    p = torch.rand(10, 3, generator=gen)
    for bad, error in ((0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError), (torch.tensor(4), TypeError)):
        with pytest.raises(error, match="max_voxels"):
            pcops.voxel_pool(p, 0.1, max_voxels=bad)


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    p, f = torch.rand(5000, 3, generator=gen), torch.randn(5000, 8, generator=gen)
    batch = torch.randint(0, 4, (5000,), generator=gen)
    cpu = pcops.voxel_pool(p, 0.05, f, batch=batch)
    gpu = pcops.voxel_pool(p.cuda(), 0.05, f.cuda(), batch=batch.cuda())
    assert torch.equal(gpu.cluster.cpu(), cpu.cluster)
    torch.testing.assert_close(gpu.points.cpu(), cpu.points)
    torch.testing.assert_close(gpu.features.cpu(), cpu.features)


@pytest.mark.cuda
def test_bounded_cuda_matches_cpu(gen):
    p, f = torch.rand(5000, 3, generator=gen), torch.randn(5000, 8, generator=gen)
    batch = torch.randint(0, 4, (5000,), generator=gen)
    for m in (20_000, 300):  # padded, and overflowing
        cpu = pcops.voxel_pool(p, 0.05, f, batch=batch, max_voxels=m)
        gpu = pcops.voxel_pool(p.cuda(), 0.05, f.cuda(), batch=batch.cuda(), max_voxels=m)
        assert torch.equal(gpu.cluster.cpu(), cpu.cluster) and torch.equal(gpu.count.cpu(), cpu.count)
        torch.testing.assert_close(gpu.points.cpu(), cpu.points)
        torch.testing.assert_close(gpu.features.cpu(), cpu.features)
