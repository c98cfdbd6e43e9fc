"""pcops.farthest_point_sample against a float64 brute-force loop (the shared op suite, plus FPS specifics)."""

import pytest
import torch

import pcops
from pcops.ops import sampling
from tests import reference
from tests.compile_check import assert_compiles
from tests.op_suite import F64, OpSuite, TOL, pack, pad

S = 40


def assert_is_fps(points: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> None:
    """Each pick is (within TOL[dtype]) the farthest unpicked point from the points picked before it."""
    p = points.double()
    d = torch.full((p.shape[0],), float("inf"), dtype=F64)
    assert len(set(idx.tolist())) == idx.numel(), "a point was picked twice"
    for t in range(1, idx.numel()):
        d = torch.minimum(d, (p - p[idx[t - 1]]).square().sum(1))
        free = d.clone()
        free[idx[:t]] = -1
        tol = TOL[dtype]
        assert free[idx[t]] >= free.max() * (1 - tol["rtol"]) - tol["atol"], f"pick {t} is not the farthest point"


class TestFarthestPointSample(OpSuite):
    differentiable = ("points",)

    def inputs(self, kind, gen):
        _, p, _ = reference.cloud(kind, gen)
        return dict(points=p)

    def run(self, points):
        return tuple(pcops.farthest_point_sample(points, S))

    def reference(self, points):
        idx = reference.farthest_point_sample(points, S)
        return points.double()[idx], idx

    def compare(self, out, expected, dtype, inputs=None):
        (pts, idx), (ref_pts, ref_idx) = out, expected
        assert idx.dtype == torch.int64 and idx.shape == ref_idx.shape
        if dtype == F64:
            assert torch.equal(idx, ref_idx)
            assert torch.equal(pts, ref_pts)
        else:  # rounding may reorder near-ties: check the FPS property within the dtype's tolerance
            assert_is_fps(inputs["points"], idx, dtype)
            assert torch.equal(pts, inputs["points"][idx])

    def grad_inputs(self, gen):
        return dict(points=torch.rand(30, 3, generator=gen, dtype=F64))

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            p = torch.rand(3, 40, 3, generator=gen, dtype=dtype)
            lengths, counts, start = torch.tensor([40, 0, 17]), torch.tensor([10, 0, 10]), torch.tensor([0, 0, 5])
            cases.append((torch.ops.pcops.farthest_point_sample.default, (p, lengths, counts, start, 10, True)))
            batch = torch.randint(0, 3, (40,), generator=gen)
            cases.append((torch.ops.pcops.farthest_point_sample_packed.default, (p[0], batch, 5, 0.0, False, 0, True)))
        return cases

    def compile_calls(self, gen):
        def fn(points, lengths):
            out = pcops.farthest_point_sample(points, 8, lengths=lengths)
            return out.points.square().sum(-1), out.idx

        calls = []
        for b, n in ((2, 30), (3, 47)):
            p = torch.rand(b, n, 3, generator=gen).requires_grad_()
            calls.append((p, torch.randint(5, n + 1, (b,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        sizes = [50, 0, 7, 30]
        samples = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
        expected = []
        for p in samples:
            idx = reference.farthest_point_sample(p, S)
            expected.append((p[idx], idx))
        points, lengths = pad(samples)
        out = pcops.farthest_point_sample(points, S, lengths=lengths)
        padded = []
        for b, n in enumerate(sizes):
            c = min(n, S)
            assert torch.all(out.idx[b, c:] == -1) and torch.all(out.points[b, c:] == 0)
            padded.append((out.points[b, :c], out.idx[b, :c]))
        packed_points, ids, position = pack(samples, gen, keep_order=True)
        out = pcops.farthest_point_sample(packed_points, S, batch=ids)
        offsets = torch.tensor([0, *sizes]).cumsum(0)
        packed, at = [], 0
        for b, n in enumerate(sizes):
            c = min(n, S)
            idx = out.idx[at : at + c]
            assert torch.all(ids[idx] == b)
            local = torch.stack([(position == i).nonzero()[0, 0] for i in idx]) - offsets[b] if c else idx
            packed.append((out.points[at : at + c], local))
            at += c
        assert at == out.idx.numel()
        return expected, padded, packed

    def bad_inputs(self, gen):
        p = torch.rand(2, 10, 3, generator=gen)
        flat = p[0]
        fps = pcops.farthest_point_sample
        nan = flat.clone()
        nan[3, 1] = float("nan")
        return {
            "int points": (lambda: fps(flat.long(), 3), TypeError, "points must have a floating dtype"),
            "2-d coordinates": (lambda: fps(flat[:, :2], 3), ValueError, "points must be a tensor of shape"),
            "zero samples": (lambda: fps(flat, 0), ValueError, "n_samples must be >= 1"),
            "float n_samples": (lambda: fps(flat, 2.5), TypeError, "n_samples must be an int"),
            "ratio and n_samples": (lambda: fps(flat, 3, ratio=0.5), ValueError, "exactly one of n_samples and ratio"),
            "ratio above 1": (lambda: fps(flat, ratio=1.5), ValueError, r"ratio must be in \(0, 1\]"),
            "ratio for padded": (lambda: fps(p, ratio=0.5), ValueError, "ratio needs packed"),
            "lengths shape": (lambda: fps(p, 3, lengths=torch.tensor([3])), ValueError, "lengths must be a tensor of shape"),
            "lengths range": (lambda: fps(p, 3, lengths=torch.tensor([3, 11])), ValueError, "lengths values"),
            "float batch": (lambda: fps(flat, 3, batch=torch.zeros(10)), TypeError, "batch must have an integer dtype"),
            "negative batch": (lambda: fps(flat, 3, batch=-torch.ones(10, dtype=torch.long)), ValueError, "batch values"),
            "lengths for packed": (lambda: fps(flat, 3, lengths=torch.tensor([3])), ValueError, "lengths describes padded"),
            "NaN": (lambda: fps(nan, 3), ValueError, "points contains NaN"),
        }


@pytest.mark.parametrize("kind", ["uniform", "duplicates", "clustered"])
@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("in_kernel", [True, False])
def test_one_launch_per_pick_equals_one_launch_per_sample(gen, kind, block, in_kernel, monkeypatch):
    _, p, _ = reference.cloud(kind, gen, n=300)
    batch = torch.stack([p, p.flip(0), p * 2])
    lengths = torch.tensor([300, 7, 150])
    whole = pcops.farthest_point_sample(batch, 40, lengths=lengths)
    monkeypatch.setattr(sampling, "SINGLE_LAUNCH", 0)  # force the per-pick block kernel
    if block is not None:  # many blocks per sample: each launch (or torch, as on GPUs) reduces them
        monkeypatch.setattr(sampling, "_block", lambda n, b, device: block)
    monkeypatch.setattr(sampling, "_reduce_in_kernel", lambda device: in_kernel)
    blocks = pcops.farthest_point_sample(batch, 40, lengths=lengths)
    assert torch.equal(whole.idx, blocks.idx) and torch.equal(whole.points, blocks.points)
    assert torch.equal(whole.idx[2, :40], reference.farthest_point_sample(batch[2, :150], 40))


def test_packed_ratio_picks_ceil_of_each_sample(gen):
    sizes = [13, 1, 40]
    samples = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
    points, ids, _ = pack(samples, gen)
    out = pcops.farthest_point_sample(points, ratio=0.25, batch=ids)
    counts = torch.bincount(ids[out.idx], minlength=3)
    assert counts.tolist() == [4, 1, 10]
    for b in range(3):  # each sample starts at its first point in packed order
        first = (ids == b).nonzero()[0, 0]
        assert out.idx[counts[:b].sum()] == first


def test_random_start_is_reproducible_and_still_farthest(gen):
    p = torch.rand(200, 3, generator=gen, dtype=F64)
    a = pcops.farthest_point_sample(p, 20, random_start=True, generator=torch.Generator().manual_seed(3)).idx
    b = pcops.farthest_point_sample(p, 20, random_start=True, generator=torch.Generator().manual_seed(3)).idx
    assert torch.equal(a, b)
    starts = {int(pcops.farthest_point_sample(p, 2, random_start=True, generator=gen).idx[0]) for _ in range(5)}
    assert len(starts) > 1
    assert torch.equal(a, reference.farthest_point_sample(p, 20, start=int(a[0])))


def test_ties_go_to_the_smaller_index():
    # a cube's corners, all at the same distance from the centre point 0: the smaller index wins each tie
    corners = torch.tensor([[x, y, z] for x in (-1.0, 1.0) for y in (-1.0, 1.0) for z in (-1.0, 1.0)], dtype=F64)
    p = torch.cat([torch.zeros(1, 3, dtype=F64), corners[torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])]])
    idx = pcops.farthest_point_sample(p, 9).idx
    assert torch.equal(idx, reference.farthest_point_sample(p, 9))
    assert idx[1] == 1  # first of the eight tied corners


def test_packed_fullgraph_traces_the_dynamic_size(gen):
    def fn(points, batch):
        out = pcops.farthest_point_sample(points, ratio=0.5, batch=batch)
        return out.points.sum(-1), out.idx

    calls = []
    for n in (30, 45):
        calls.append((torch.rand(n, 3, generator=gen).requires_grad_(), torch.randint(0, 3, (n,), generator=gen)))
    assert_compiles(fn, calls)


@pytest.mark.slow
def test_a_million_points_match_the_loop(gen):
    p = torch.rand(1_000_000, 3, generator=gen, dtype=F64)
    idx = pcops.farthest_point_sample(p, 64).idx
    assert torch.equal(idx, reference.farthest_point_sample(p, 64))
    out = pcops.farthest_point_sample(p.float()[None].expand(2, -1, -1), 64, lengths=torch.tensor([1_000_000, 999_000]))
    assert_is_fps(p.float(), out.idx[0], torch.float32)
    assert_is_fps(p.float()[:999_000], out.idx[1], torch.float32)


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    p = torch.rand(3, 5000, 3, generator=gen)
    lengths = torch.tensor([5000, 10, 2500])
    cpu = pcops.farthest_point_sample(p, 100, lengths=lengths)
    gpu = pcops.farthest_point_sample(p.cuda(), 100, lengths=lengths.cuda())
    assert torch.equal(gpu.idx.cpu(), cpu.idx)
    torch.testing.assert_close(gpu.points.cpu(), cpu.points)
