"""pcops.voxel_pool against a float64 dictionary-of-voxels reference (the shared op suite, plus specifics)."""

import pytest
import torch

import pcops
from tests import reference
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
            "reduce": (lambda: vp(p, 0.1, f, reduce="sum"), ValueError, "reduce must be 'mean' or 'max'"),
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


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    p, f = torch.rand(5000, 3, generator=gen), torch.randn(5000, 8, generator=gen)
    batch = torch.randint(0, 4, (5000,), generator=gen)
    cpu = pcops.voxel_pool(p, 0.05, f, batch=batch)
    gpu = pcops.voxel_pool(p.cuda(), 0.05, f.cuda(), batch=batch.cuda())
    assert torch.equal(gpu.cluster.cpu(), cpu.cluster)
    torch.testing.assert_close(gpu.points.cpu(), cpu.points)
    torch.testing.assert_close(gpu.features.cpu(), cpu.features)
