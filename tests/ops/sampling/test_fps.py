"""pcops.farthest_point_sample against a float64 brute-force loop (the shared op suite, plus FPS specifics)."""

import concurrent.futures
import importlib.util
import math

import pytest
import torch

import pcops
from pcops.ops.sampling import fps as sampling
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
            lengths, counts = torch.tensor([40, 0, 17]), torch.tensor([10, 0, 10])
            for start in (torch.tensor([[0], [0], [5]]), torch.tensor([[3, 9], [0, 1], [5, 16]])):
                cases.append((torch.ops.pcops.farthest_point_sample.default, (p, lengths, counts, start, 10, True)))
            batch = torch.randint(0, 3, (40,), generator=gen)
            for start in (torch.zeros(0, dtype=torch.int64), torch.tensor([1, 0])):
                cases.append((torch.ops.pcops.farthest_point_sample_packed.default, (p[0], batch, start, 5, None, None, True)))
            ratio, uniform = torch.tensor(0.3, dtype=F64), torch.rand(40, generator=gen, dtype=F64)  # a random start
            cases.append((torch.ops.pcops.farthest_point_sample_packed.default, (p[0], batch, torch.zeros(0, dtype=torch.int64), 0, ratio, uniform, True)))
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
            "huge n_samples": (lambda: fps(flat, 2**70), ValueError, r"n_samples must be <= 9223372036854775807 \(an int64\), got 1180591620717411303424"),
            "float start_idx": (lambda: fps(flat, 3, start_idx=torch.tensor([1.0])), TypeError, "start_idx must have an integer dtype"),
            "str start_idx": (lambda: fps(flat, 3, start_idx="0"), TypeError, "start_idx must be an int"),
            "float in start_idx": (lambda: fps(flat, 3, start_idx=[0, 1.5]), TypeError, "start_idx must be an int"),
            "negative start_idx": (lambda: fps(flat, 3, start_idx=[-1]), ValueError, "start_idx values must be >= 0"),
            "empty start_idx": (lambda: fps(flat, 3, start_idx=[]), ValueError, "start_idx must hold at least one index"),
            "start_idx past n_samples": (lambda: fps(flat, 2, start_idx=[0, 1, 2]), ValueError, "start_idx holds 3 indices"),
            "start_idx out of range": (lambda: fps(flat, 3, start_idx=[10]), ValueError, "start_idx values must be in"),
            "start_idx tensor out of range": (lambda: fps(p, 3, start_idx=torch.tensor([[1], [10]])), ValueError, "start_idx values must be in"),
            "repeated start_idx": (lambda: fps(flat, 3, start_idx=[4, 4]), ValueError, "start_idx must not repeat"),
            "per-sample start_idx of one cloud": (lambda: fps(flat, 3, start_idx=torch.zeros(1, 1, dtype=torch.long)), ValueError, r"start_idx must be a tensor of shape \(M,\)"),
            "start_idx rows": (lambda: fps(p, 3, start_idx=torch.zeros(3, 1, dtype=torch.long)), ValueError, r"start_idx must be a tensor of shape \(M,\) or \(B, M\)"),
            "start_idx and random_start": (lambda: fps(flat, 3, start_idx=0, random_start=True), ValueError, "start_idx or random_start"),
        }


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

    # one cloud takes the same counts, by a number or a tensor (an empty cloud: none)
    for n in (0, 1, 13):
        one = samples[2][:n]
        for ratio in (0.25, torch.tensor(0.25)):
            assert pcops.farthest_point_sample(one, ratio=ratio).idx.shape == (math.ceil(n / 4),)


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


def brute_force(points: torch.Tensor, n_samples: int, start=(0,)) -> torch.Tensor:
    """Plain FPS in the points' own dtype from a start set: the farthest unpicked point, ties by
    the smaller index, distances computed as the kernels compute them (sum of squared differences)."""
    n = points.shape[0]
    picked = list(start)[: min(n_samples, n)]
    dist = torch.full((n,), float("inf"), dtype=points.dtype)
    for u in picked[:-1]:
        dist = torch.minimum(dist, (points - points[u]).square().sum(1))
    while len(picked) < min(n_samples, n):
        dist = torch.minimum(dist, (points - points[picked[-1]]).square().sum(1))
        free = dist.clone()
        free[torch.tensor(picked)] = -1
        picked.append(int(free.argmax()))  # argmax returns the first maximum
    return torch.tensor(picked, dtype=torch.int64)


def adversarial(kind: str, gen: torch.Generator) -> torch.Tensor:
    """float64 clouds of many points (several tree levels) built to tie, repeat or degenerate."""
    rand = lambda *s: torch.rand(*s, generator=gen, dtype=F64)  # noqa: E731
    if kind == "grid":  # every distance repeats many times
        r = torch.arange(14, dtype=F64)
        return torch.cartesian_prod(r, r, r)[torch.randperm(14**3, generator=gen)]
    if kind == "duplicates":  # each point three times
        return rand(700, 3).repeat(3, 1)
    if kind == "all_equal":
        return torch.full((1500, 3), 0.25, dtype=F64)
    if kind == "collinear":
        return rand(2000, 1) * torch.tensor([[1.0, -2.0, 0.5]], dtype=F64)
    if kind == "clustered":
        centres = rand(5, 3) * 100
        return centres[torch.randint(0, 5, (3000,), generator=gen)] + 1e-3 * rand(3000, 3)
    if kind == "sphere":  # all at one distance from the centre point 0
        d = torch.randn(2500, 3, generator=gen, dtype=F64)
        return torch.cat([torch.zeros(1, 3, dtype=F64), d / d.norm(dim=1, keepdim=True)])
    if kind == "far_tiny":  # coordinates near 1e6 with 1e-6 spacing: rounding decides
        return 1e6 + 1e-6 * torch.randint(0, 20, (2000, 3), generator=gen).to(F64)
    raise ValueError(kind)


ADVERSARIAL = ["grid", "duplicates", "all_equal", "collinear", "clustered", "sphere", "far_tiny"]


@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_bucket_fps_is_plain_fps_on_adversarial_clouds(gen, kind):
    p = adversarial(kind, gen)
    s = min(p.shape[0], 600)
    assert torch.equal(pcops.farthest_point_sample(p, s).idx, reference.farthest_point_sample(p, s))


@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_float32_bucket_fps_equals_plain_fps_in_float32(gen, kind):
    # the same float32 distances as a plain loop: the bound test never skips a point that changes
    p = adversarial(kind, gen).float()
    s = min(p.shape[0], 400)
    assert torch.equal(pcops.farthest_point_sample(p, s).idx, brute_force(p, s))


@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_few_picks_use_morton_leaves_and_are_plain_fps_too(gen, kind):
    # below n / KD_PICKS picks a sample's leaves are Morton-ordered, not a kd-tree (the tests above)
    p = adversarial(kind, gen)
    s = p.shape[0] // (2 * sampling.KD_PICKS)
    assert 0 < s * sampling.KD_PICKS < p.shape[0]
    assert torch.equal(pcops.farthest_point_sample(p, s).idx, reference.farthest_point_sample(p, s))
    assert torch.equal(pcops.farthest_point_sample(p.float(), s).idx, brute_force(p.float(), s))


def test_kept_scratch_serves_calls_of_any_shape_and_thread(gen):
    # a thread's bucket FPS work arrays are kept for its next call of the same shape: calls that
    # reuse them (a kd-tree call after a Morton-leaves one and back, stale contents from another
    # cloud), change shape or dtype, or run on other threads at once are all plain FPS
    clouds = [torch.rand(300, 3, generator=gen, dtype=F64) for _ in range(3)] + [adversarial("grid", gen)[:300]]
    calls = [(clouds[0][:37], 30), (clouds[1][:37].float(), 30)] + [(p, s) for p in clouds for s in (5, 200, 5)]
    calls += [(clouds[1].float(), 150), (clouds[2][None], 40), (clouds[3][None].expand(2, -1, -1), 60)]
    plain = lambda q, s: reference.farthest_point_sample(q, s) if q.dtype == F64 else brute_force(q, s)  # noqa: E731
    expected = [torch.cat([plain(q, s) for q in p.reshape(-1, *p.shape[-2:])]) for p, s in calls]
    assert sampling.KEEP_SCRATCH >= 300
    for (p, s), want in zip(calls, expected):
        assert torch.equal(pcops.farthest_point_sample(p, s).idx.reshape(-1), want)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(lambda p=p, s=s: pcops.farthest_point_sample(p, s).idx.reshape(-1)) for p, s in calls * 4]
        assert all(torch.equal(r.result(), want) for r, want in zip(runs, expected * 4))


@pytest.mark.parametrize("bucket", [False, True], ids=["default", "bucket"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 127, 128, 129, 257, 1000])
def test_small_clouds_and_leaf_boundaries(gen, n, bucket, monkeypatch):
    if bucket:  # the bucket path's leaves and tree, which small samples skip for plain FPS
        monkeypatch.setattr(sampling, "PLAIN_PAIRS", 0)
    p = torch.rand(n, 3, generator=gen, dtype=F64)
    out = pcops.farthest_point_sample(p, n + 2)
    assert torch.equal(out.idx[:n], reference.farthest_point_sample(p, n))
    assert sorted(out.idx[:n].tolist()) == list(range(n))  # every point once


@pytest.mark.parametrize("bucket", [False, True], ids=["plain", "bucket"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fps_lanes_keep_the_first_farthest_point(gen, dtype, bucket, monkeypatch):
    """FPS updates a run of distances (plain FPS's whole sample, or a bucket's leaf) a vector of
    lanes at a time (8 float32 or 4 float64 points), each lane keeping its own first farthest
    point, the lanes' best taken, then the points past the last whole vector: on clouds of a few
    coordinates (many points at the farthest distance, in every lane and in the tail), of every
    length around the lanes' width, with duplicates, a start set and a cloud of all-equal points,
    the picks are plain FPS's (ties by the smaller index) in the points' dtype, on the plain
    path and forced through the bucket path (its leaves of up to 64 points)."""
    if bucket:
        monkeypatch.setattr(sampling, "PLAIN_PAIRS", 0)
    for n in [*range(1, 42), 63, 64, 65, 100]:
        for cloud in (torch.randint(0, 2, (n, 3), generator=gen), torch.randint(0, 3, (n, 3), generator=gen), torch.zeros(n, 3)):
            p = cloud.to(dtype)
            assert torch.equal(pcops.farthest_point_sample(p, n).idx, brute_force(p, n)), (n, p)
            if n > 5:
                start = [n - 1, 2]
                assert torch.equal(pcops.farthest_point_sample(p, n, start_idx=start).idx, brute_force(p, n, start)), (n, p)
    # a far point in each lane position, once and repeated, the rest at one place
    for n in (16, 17, 24, 31):
        for far in range(n):
            p = torch.zeros(n, 3, dtype=dtype)
            p[far] = 5.0
            p[(far + 9) % n] = 5.0
            assert torch.equal(pcops.farthest_point_sample(p, 4, start_idx=(far + 3) % n).idx, brute_force(p, 4, ((far + 3) % n,)))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_plain_fps_below_its_crossover_picks_what_bucket_fps_picks(gen, dtype, monkeypatch):
    """A sample of at most PLAIN_PAIRS points times picks (a quarter of it in float64) runs plain
    FPS, no tree; forced through the bucket path (PLAIN_PAIRS 0) the same samples give the same
    picks, on both sides of the crossover: at the real limit (a cloud of 4,096 points, picks at
    and past it), and with the limit lowered to 2^14 pairs, every adversarial cloud kind cut to
    a few hundred points, picks around the limit, start sets, a padded batch of samples on
    either side, NaN and infinite points without validation; and both equal the plain loop."""
    real = sampling.PLAIN_PAIRS if dtype == torch.float32 else sampling.PLAIN_PAIRS // 4
    big = torch.rand(4096, 3, generator=gen, dtype=F64).to(dtype)
    at = real // 4096
    assert at < 4096 and at * 4096 == real
    with monkeypatch.context() as m:
        m.setattr(sampling, "PLAIN_PAIRS", 0)
        bucket = {s: pcops.farthest_point_sample(big, s).idx for s in (at, at + 1)}
    for s in (at, at + 1):
        assert torch.equal(pcops.farthest_point_sample(big, s).idx, bucket[s])
    assert torch.equal(bucket[at + 1], brute_force(big, at + 1))
    pairs = 1 << 14  # the lowered limit, in either dtype
    limit = pairs if dtype == torch.float32 else 4 * pairs
    calls = []
    for kind in ADVERSARIAL:
        p = adversarial(kind, gen)[:300].to(dtype)
        for s in (5, pairs // 300, pairs // 300 + 1, 300):  # 300 s pairs: below, at, above the limit
            calls.append((p, s, {}))
        calls.append((p, 100, {"start_idx": [7, 3, 250]}))
    odd = torch.rand(260, 3, generator=gen, dtype=F64).to(dtype)
    odd[[5, 100]] = float("nan")
    odd[[7, 200], 1] = float("inf")
    calls += [(odd, pairs // 260, {"validate": False}), (odd, 260, {"validate": False})]
    points, lengths = pad([torch.rand(n, 3, generator=gen, dtype=F64).to(dtype) for n in (64, 120, 300)])
    calls.append((points, 120, {"lengths": lengths}))  # 64 x 64 and 120 x 120 pairs plain, 300 x 120 not
    runs = []
    for plain_pairs in (limit, 0):
        monkeypatch.setattr(sampling, "PLAIN_PAIRS", plain_pairs)
        runs.append([pcops.farthest_point_sample(p, s, **kw).idx for p, s, kw in calls])
    for (p, s, kw), default, bucket in zip(calls, *runs):
        assert torch.equal(default, bucket), (p.shape, s, kw)
        if p.dim() == 2 and "validate" not in kw:
            want = brute_force(p, s, kw.get("start_idx", (0,)))
            assert torch.equal(default[: want.numel()], want)
    # non-finite picks without validation: a NaN distance stays NaN on every path, so a short
    # run's picks (plain) are a long run's first ones (bucket) and the per-pick path's (CUDA's,
    # run on the CPU here); a NaN start makes every distance NaN: -1 after the start set
    monkeypatch.setattr(sampling, "PLAIN_PAIRS", limit)
    nan_start = torch.rand(200, 3, generator=gen, dtype=F64).to(dtype)
    nan_start[4] = float("nan")
    half_inf = torch.rand(1000, 3, generator=gen, dtype=F64).to(dtype)
    half_inf[:500, 0] = float("inf")
    for cloud, kw in ((nan_start, {"start_idx": [4, 7]}), (half_inf, {}), (half_inf, {"start_idx": [0, 600]})):
        short = pcops.farthest_point_sample(cloud, 6, validate=False, **kw).idx
        long = pcops.farthest_point_sample(cloud, 100, validate=False, **kw).idx
        assert torch.equal(short, long[:6]), (short, long[:6])
        with monkeypatch.context() as m:
            m.setattr(sampling, "_per_pick", lambda device: True)
            assert torch.equal(pcops.farthest_point_sample(cloud, 100, validate=False, **kw).idx, long)
    assert pcops.farthest_point_sample(nan_start, 6, start_idx=[4, 7], validate=False).idx.tolist() == [4, 7, -1, -1, -1, -1]


def test_a_single_cloud_smaller_than_n_samples_is_padded_with_minus_one(gen):
    p = torch.rand(3, 3, generator=gen)
    out = pcops.farthest_point_sample(p, 5)
    assert out.idx.tolist()[3:] == [-1, -1]
    assert torch.equal(out.points[3:], torch.zeros(2, 3))
    assert torch.equal(out.points[:3], p[out.idx[:3]])


def test_the_per_pick_path_equals_the_bucket_path(gen, monkeypatch):
    # CUDA runs one launch per pick (blocks of points, torch's argmax between launches): run it on the CPU
    _, p, _ = reference.cloud("duplicates", gen, n=300)
    batch = torch.stack([p, p.flip(0), p * 2])
    lengths = torch.tensor([300, 7, 150])
    start = torch.tensor([[5, 2], [0, 6], [149, 0]])
    bucket = [pcops.farthest_point_sample(batch, 40, lengths=lengths, **kw) for kw in ({}, {"start_idx": start})]
    monkeypatch.setattr(sampling, "_per_pick", lambda device: True)
    monkeypatch.setattr(sampling, "_block", lambda n, b, device: 16)  # many blocks per sample
    per_pick = [pcops.farthest_point_sample(batch, 40, lengths=lengths, **kw) for kw in ({}, {"start_idx": start})]
    for a, b in zip(bucket, per_pick):
        assert torch.equal(a.idx, b.idx) and torch.equal(a.points, b.points)
    assert torch.equal(bucket[0].idx[2, :40], reference.farthest_point_sample(batch[2, :150], 40))


def test_a_start_set_begins_every_sequence(gen):
    p = torch.rand(500, 3, generator=gen, dtype=F64)
    for start in (7, [7], [7, 400, 3], torch.tensor([7, 400, 3])):
        idx = pcops.farthest_point_sample(p, 30, start_idx=start).idx
        first = [start] if isinstance(start, int) else list(map(int, start))
        assert idx[: len(first)].tolist() == first
        assert torch.equal(idx, brute_force(p, 30, first))


def test_a_start_set_in_batches(gen):
    samples = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (60, 0, 9, 40)]
    points, lengths = pad(samples)
    shared = pcops.farthest_point_sample(points, 20, lengths=lengths, start_idx=[8, 2])
    rows = torch.tensor([[1, 2], [0, 0], [8, 0], [39, 38]])
    per_sample = pcops.farthest_point_sample(points, 20, lengths=lengths, start_idx=rows)
    packed_points, ids, _ = pack(samples, gen, keep_order=True)
    packed = pcops.farthest_point_sample(packed_points, 20, batch=ids, start_idx=[8, 2])
    at = 0
    for b, p in enumerate(samples):
        c = min(p.shape[0], 20)
        if not c:
            assert torch.all(shared.idx[b] == -1) and torch.all(per_sample.idx[b] == -1)
            continue
        assert torch.equal(shared.idx[b, :c], brute_force(p, 20, [8, 2]))
        assert torch.equal(per_sample.idx[b, :c], brute_force(p, 20, rows[b].tolist()))
        local = torch.searchsorted((ids == b).nonzero()[:, 0], packed.idx[at : at + c])  # position among the sample's points
        assert torch.equal(local, brute_force(p, 20, [8, 2]))
        at += c


def test_with_ratio_a_start_set_is_cut_to_each_samples_count(gen):
    samples = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (40, 5)]
    points, ids, _ = pack(samples, gen, keep_order=True)
    out = pcops.farthest_point_sample(points, ratio=0.25, batch=ids, start_idx=[3, 1, 4])
    counts = torch.bincount(ids[out.idx], minlength=2).tolist()
    assert counts == [10, 2]
    second = (ids == 1).nonzero()[:, 0]
    assert out.idx[10:].tolist() == second[[3, 1]].tolist()


def test_nan_points_are_never_picked_without_validation(gen):
    p = torch.rand(300, 3, generator=gen, dtype=F64)
    p[[4, 50, 299], 1] = float("nan")
    idx = pcops.farthest_point_sample(p, 300, validate=False).idx
    finite = torch.isfinite(p).all(1)
    assert sorted(idx[:297].tolist()) == finite.nonzero()[:, 0].tolist()
    assert idx[297:].tolist() == [-1, -1, -1]
    keep = finite.nonzero()[:, 0]  # the finite points alone give the same sequence
    assert torch.equal(idx[:50], keep[reference.farthest_point_sample(p[finite], 50)])


@pytest.mark.parametrize("value", [float("inf"), -float("inf")], ids=["inf", "-inf"])
def test_infinite_points_are_picked_once_without_validation(gen, monkeypatch, value):
    """Without validation an infinite point is the farthest and is picked, once: its mark was
    overwritten by a NaN distance (inf - inf) in the bucket walk, and the next pick made it inf
    again (111 of 200 such clouds repeated a pick). Every layout equals the per-pick path
    (CUDA's, run on the CPU here) and picks each point at most once."""
    fps_module = importlib.import_module("pcops.ops.sampling.fps")
    small = torch.tensor([[0.0, 0, 0], [1, 0, 0], [2, 0, 0], [value, 0, 0], [3, 0, 0]], dtype=F64)
    assert pcops.farthest_point_sample(small, 5, validate=False).idx.tolist() == [0, 3, 4, 1, 2]
    clouds = []
    for n in (40, 300, 2000):
        p = torch.rand(n, 3, generator=gen, dtype=F64)
        rows = torch.randperm(n, generator=gen)[:3]
        p[rows, torch.randint(0, 3, (3,), generator=gen)] = value
        clouds.append(p)
    points, lengths = pad(clouds)
    results = []
    for per_pick in (False, True):
        monkeypatch.setattr(fps_module, "_per_pick", lambda device, per_pick=per_pick: per_pick)
        single = [pcops.farthest_point_sample(p, p.shape[0] // 2, validate=False).idx for p in clouds]
        padded = pcops.farthest_point_sample(points, 20, lengths=lengths, validate=False).idx
        for b, idx in enumerate(single):
            assert idx.unique().numel() == idx.numel()
            assert torch.equal(padded[b], idx[:20])
        results.append(single)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_nan_start_ends_the_picks_and_a_bad_generator_is_named(gen, monkeypatch):
    """A NaN start point (given, without validation) makes every distance NaN: the picks after
    the start set are -1, as documented, on both paths; a generator that is not one is a
    TypeError naming it (it was torch's rand() error, or accepted without random_start)."""
    fps_module = importlib.import_module("pcops.ops.sampling.fps")
    p = torch.tensor([[float("nan"), 0, 0], [1.0, 0, 0], [2, 0, 0], [3, 0, 0]], dtype=F64)
    for per_pick in (False, True):
        monkeypatch.setattr(fps_module, "_per_pick", lambda device, per_pick=per_pick: per_pick)
        assert pcops.farthest_point_sample(p, 4, validate=False).idx.tolist() == [0, -1, -1, -1]
        assert pcops.farthest_point_sample(p, 4, start_idx=[3, 0], validate=False).idx.tolist() == [3, 0, -1, -1]
    for bad in (5, "not a generator"):
        for kwargs in (dict(random_start=True), {}):
            with pytest.raises(TypeError, match="^generator must be a torch.Generator"):
                pcops.farthest_point_sample(p.nan_to_num(), 2, generator=bad, **kwargs)


def test_nan_points_are_never_picked_with_few_picks(gen):
    # the Morton-ordered leaves (few picks) put NaN points last; the kd-tree (above) anywhere
    p = torch.rand(3000, 3, generator=gen, dtype=F64)
    p[[4, 50, 2999, 1500], [1, 0, 2, 1]] = float("nan")
    finite = torch.isfinite(p).all(1)
    keep = finite.nonzero()[:, 0]
    idx = pcops.farthest_point_sample(p, 100, validate=False).idx
    assert torch.equal(idx, keep[reference.farthest_point_sample(p[finite], 100)])


def test_a_batch_of_sixteen_equals_sixteen_calls(gen):
    clouds = [torch.rand(int(n), 3, generator=gen) for n in torch.randint(200, 3000, (16,), generator=gen)]
    points, lengths = pad(clouds)
    out = pcops.farthest_point_sample(points, 256, lengths=lengths)
    for b, p in enumerate(clouds):
        assert torch.equal(out.idx[b], pcops.farthest_point_sample(p, 256).idx)


@pytest.mark.skipif(importlib.util.find_spec("fpsample") is None, reason="fpsample is not installed (pip install fpsample)")
def test_matches_fpsample_bucket_fps(gen):
    import fpsample

    p = torch.rand(5000, 3, generator=gen)
    x = p.numpy()
    for idx in (fpsample.fps_sampling(x, 300, start_idx=0), fpsample.bucket_fps_kdline_sampling(x, 300, h=5, start_idx=0)):
        idx = torch.from_numpy(idx.astype("int64"))  # the bucket variants start at their tree's first point
        assert torch.equal(pcops.farthest_point_sample(p, 300, start_idx=int(idx[0])).idx, idx)


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    p = torch.rand(3, 5000, 3, generator=gen)
    lengths = torch.tensor([5000, 10, 2500])
    cpu = pcops.farthest_point_sample(p, 100, lengths=lengths)
    gpu = pcops.farthest_point_sample(p.cuda(), 100, lengths=lengths.cuda())
    assert torch.equal(gpu.idx.cpu(), cpu.idx)
    torch.testing.assert_close(gpu.points.cpu(), cpu.points)


def test_empty_clouds_give_only_padding():
    # as a cloud smaller than n_samples: the missing picks are -1 and their points zero
    for points, shape in ((torch.zeros(0, 3), (4,)), (torch.zeros(2, 0, 3), (2, 4))):
        out = pcops.farthest_point_sample(points, 4)
        assert out.idx.shape == shape and bool((out.idx == -1).all())
        assert out.points.shape == (*shape, 3) and bool((out.points == 0).all())


@pytest.mark.parametrize("start", [0, 15, [3, 9], [4, 4], [2, 16], [0, 1, 2, 3, 4, 5]])
def test_a_python_start_set_is_checked_as_the_op_checks_a_tensor_one(start):
    """Python ints on one cloud (or padded points without lengths) are checked before the op,
    without a tensor; the same picks and the same errors as a tensor start set, which the op checks."""
    gen = torch.Generator().manual_seed(4)
    for points in (torch.rand(16, 3, generator=gen), torch.rand(2, 16, 3, generator=gen), torch.rand(0, 16, 3, generator=gen)):
        outcomes = []
        for given in (start, torch.tensor(start if isinstance(start, list) else [start])):
            try:
                outcomes.append(pcops.farthest_point_sample(points, 6, start_idx=given).idx)
            except ValueError as err:
                outcomes.append(str(err))
        assert type(outcomes[0]) is type(outcomes[1])
        assert outcomes[0] == outcomes[1] if isinstance(outcomes[0], str) else torch.equal(*outcomes)
