"""Small clouds take a one-launch path (every pair measured) below a crossover; the switch never
changes a result: the same neighbours, ties by the smaller index, padding, counts and gradients
on both sides of it, and both sides equal the float64 reference."""

import functools
import importlib
import itertools

import numpy as np
import pytest
import torch

import pcops
from pcops import _warp
from pcops.ops.neighbours.nearest import _kdtree
from tests import reference
from tests.op_suite import F64, pack_pair
from tests.reference import CLOUDS, cloud

ball_search = importlib.import_module("pcops.ops.neighbours._ball_search")
radius = importlib.import_module("pcops.ops.neighbours.radius")
PATHS = {"every pair": 1 << 40, "tree and cell list": 0}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    """Every search of the test on one side of the crossovers (the CPU's and CUDA's)."""
    monkeypatch.setattr(_kdtree, "SCAN_PAIRS", PATHS[request.param])
    monkeypatch.setattr(ball_search, "SCAN_PAIRS", PATHS[request.param])
    monkeypatch.setattr(radius, "SCAN_PAIRS", PATHS[request.param])
    monkeypatch.setattr(_warp, "CUDA_SCAN_POINTS", PATHS[request.param])
    monkeypatch.setattr(_warp, "CUDA_SCAN_PAIRS", PATHS[request.param])
    return request.param


def both_paths(monkeypatch, fn):
    """``fn()`` on each side of the crossovers: (every pair, tree and cell list)."""
    out = []
    for pairs in PATHS.values():
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        monkeypatch.setattr(ball_search, "SCAN_PAIRS", pairs)
        monkeypatch.setattr(radius, "SCAN_PAIRS", pairs)
        out.append(fn())
    return out


def assert_identical(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def assert_knn_is_the_reference(q, p, device="cpu"):
    """pcops.knn (Warp) of q in p on ``device`` equals the float64 brute force at k = 1, 7, all."""
    for k in (1, 7, p.shape[0]):
        dists, idx = pcops.knn(q.to(device), p.to(device), k, backend="warp")
        ref_d, ref_idx = reference.knn(q, p, k)
        assert torch.equal(idx.cpu(), ref_idx)
        torch.testing.assert_close(dists.cpu(), ref_d, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", CLOUDS)
def test_knn_equals_the_float64_reference_on_each_side(gen, path, kind):
    q, p, _ = cloud(kind, gen)
    assert_knn_is_the_reference(q, p)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", CLOUDS)
def test_cuda_knn_and_ball_query_equal_the_float64_reference_on_each_side(gen, path, kind):
    q, p, r = cloud(kind, gen)
    qc, pc = q.cuda(), p.cuda()
    assert_knn_is_the_reference(q, p, "cuda")
    d = reference.distances(q, p)
    dists, idx, counts = pcops.ball_query(qc, pc, r, 9)
    assert torch.equal(counts.cpu(), (d <= r).sum(1))
    cpu = pcops.ball_query(q, p, r, 9)
    assert torch.equal(idx.cpu(), cpu.idx)
    torch.testing.assert_close(dists.cpu(), cpu.dists, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", CLOUDS)
def test_ball_query_equals_the_float64_reference_on_each_side(gen, path, kind):
    q, p, r = cloud(kind, gen)
    d = reference.distances(q, p)
    dists, idx, counts = pcops.ball_query(q, p, r, 9)
    assert torch.equal(counts, (d <= r).sum(1))
    ref_d, ref_idx = reference.knn(q, p, 9)
    inside = ref_d <= r
    assert torch.equal(idx, torch.where(inside, ref_idx, -1))
    torch.testing.assert_close(dists, torch.where(inside, ref_d, float("inf")), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_knn_is_identical_across_the_switch(gen, monkeypatch, kind, dtype):
    q, p, _ = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    for k in (1, 4, 16):
        scan, tree = both_paths(monkeypatch, lambda: pcops.knn(q, p, k, backend="warp"))
        assert_identical(scan, tree)


def test_knn_ties_on_a_lattice_are_identical_across_the_switch(monkeypatch):
    axis = torch.arange(5, dtype=torch.float32)
    p = torch.cartesian_prod(axis, axis, axis)  # many equal distances
    q = p[::7] + 0.5
    for k in (1, 6, 27):
        scan, tree = both_paths(monkeypatch, lambda: pcops.knn(q, p, k, backend="warp"))
        assert_identical(scan, tree)
        assert torch.equal(scan.idx, reference.knn(q.double(), p.double(), k)[1])


def test_knn_batches_are_identical_across_the_switch(gen, monkeypatch):
    qs = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (5, 0, 30)]
    ps = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (3, 8, 40)]
    fs = [torch.rand(n, 2, generator=gen, dtype=F64) for n in (3, 8, 40)]
    qp, qb, _, pp, pb, _, _ = pack_pair(qs, ps, fs, gen)
    scan, tree = both_paths(monkeypatch, lambda: pcops.knn(qp, pp, 4, query_batch=qb, ref_batch=pb, backend="warp"))
    assert_identical(scan, tree)
    assert bool((scan.idx == -1).any())  # the sample with 3 points pads its rows


@pytest.mark.parametrize("slices", [2, 7, 1000])
@pytest.mark.parametrize("kind", CLOUDS)
def test_the_split_scan_equals_the_float64_reference(gen, monkeypatch, kind, slices):
    """CUDA splits each query's points among several threads (partial rows, then a merge): the
    same two kernels, run on the CPU, find the reference's neighbours in its order."""
    monkeypatch.setattr(_kdtree, "SCAN_PAIRS", 1 << 40)
    monkeypatch.setattr(_kdtree, "_CPU_SLICES", slices)
    launches = []
    real = _warp.launch
    monkeypatch.setattr(_warp, "launch", lambda kernel, *a, **kw: (launches.append(kernel), real(kernel, *a, **kw)))
    q, p, _ = cloud(kind, gen)
    assert_knn_is_the_reference(q, p)
    assert _kdtree._scan_kernel(torch.float64, False)[1] in launches  # the merge ran


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_the_split_scan_equals_one_scan_on_batches_and_non_finite_points(gen, monkeypatch, value):
    qs = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (5, 0, 30)]
    ps = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (3, 8, 40)]
    fs = [torch.rand(n, 2, generator=gen, dtype=F64) for n in (3, 8, 40)]
    qp, qb, _, pp, pb, _, _ = pack_pair(qs, ps, fs, gen)
    qp[2, 1], pp[5, 0], pp[20, 2] = value, value, value
    monkeypatch.setattr(_kdtree, "SCAN_PAIRS", 1 << 40)
    found = []
    for slices in (1, 3, 16):
        monkeypatch.setattr(_kdtree, "_CPU_SLICES", slices)
        found.append(pcops.knn(qp, pp, 4, query_batch=qb, ref_batch=pb, backend="warp", validate=False))
        found.append(pcops.knn(qp, pp, 6, backend="warp", validate=False))
    for a, b in zip(found[2:], found[:-2]):
        assert_identical(a, b)
    assert bool((found[0].idx == -1).any()) and bool(torch.isinf(found[0].dists).any())


SEARCH_KINDS = ("uniform", "lattice", "duplicates", "non-finite", "overflow", "tiny")


def _search_clouds(gen, n: int, m: int, kind: str, dtype):
    """n points and m queries in the unit cube of one of :data:`SEARCH_KINDS`."""
    p = torch.rand(n, 3, generator=gen, dtype=F64)
    q = torch.rand(m, 3, generator=gen, dtype=F64)
    if kind == "lattice":
        p, q = (p * 3).round() / 3, (q * 3).round() / 3
    elif kind == "duplicates":
        p[1::2] = p[::2][: n // 2]
    elif kind == "overflow":  # (squares of the far half overflow: never neighbours of the near half)
        p[::2] += 1e20 if dtype == torch.float32 else 1e155
    elif kind == "tiny":  # (squares in the subnormal range and zero: ties)
        p, q = p * 1e-22, q * 1e-22
    p, q = p.to(dtype), q.to(dtype)
    if kind == "non-finite":
        p[::5, 1], p[2::7, 0], q[0, 2] = float("nan"), float("inf"), float("nan")
    return p, q


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_the_scans_rows_on_vectors_equal_the_tree_and_the_reference(gen, monkeypatch, dtype):
    """The CPU scan's rows on vectors (:mod:`pcops.ops.neighbours.nearest._scan_rows`: a pass
    of distances and each lane's smallest, a bound from them, then the insertions): ranges
    that end inside a vector (every remainder of 8 and 4 lanes) and past one or several tiles
    of 256 points, k from 1 to past what the lanes' bound covers (64 float32 or 32 float64
    distances), k above the points (inf / -1 padding), lattice ties and duplicates, NaN and
    infinite points, squares that overflow and squares below the smallest normal number: the
    tree's neighbours and distances, and, finite in float64, the reference's."""
    from pcops.ops.neighbours.nearest import _scan_rows

    cases = [(n, 5) for n in range(1, 18)] + [(255, 9), (256, 7), (257, 3), (511, 5), (700, 4)]
    for (n, m), k in itertools.product(cases, (1, 3, 8, 9, 16, 33, 65)):
        for kind in SEARCH_KINDS:
            p, q = _search_clouds(gen, n, m, kind, dtype)
            scan, tree = both_paths(monkeypatch, lambda: _kdtree.find(q, p, k))  # (the search itself: k may pass n)
            assert_identical(scan, tree)
            if dtype == F64 and kind in ("uniform", "lattice", "duplicates") and k <= n:
                ref_d, ref_idx = reference.knn(q, p, k)
                assert torch.equal(scan[1], ref_idx) and torch.equal(scan[0], ref_d)
    assert _scan_rows.TILE == 256 and _scan_rows.LEVELS * 8 == 64  # (the sizes above straddle them)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_the_trees_leaves_on_vectors_equal_the_warp_loop_and_the_reference(gen, monkeypatch, dtype):
    """The tree search's leaves on vectors (:func:`pcops.ops.neighbours.nearest._scan_rows.native_leaf`)
    against its Warp loop (``_VECTOR_LEAVES`` off), every search through a tree: clouds of fewer
    points than a vector (the loop runs), leaves that end inside a vector and straddle two
    (every remainder of 8 and 4 lanes), k from 1 to past the points, self-queries (kept trees,
    and knn_graph's edges written by the search), queries elsewhere, a batch of clouds (one
    tree each), lattice ties, duplicates, NaN and infinite points, squares that overflow or lie
    below the smallest normal number: the same neighbours and distances bit for bit, and,
    finite in float64, the reference's."""
    monkeypatch.setattr(_kdtree, "SCAN_PAIRS", 0)  # (every search through a tree)
    cases = [(n, 7) for n in (1, 3, 7, 8, 9, 15, 16, 17, 23, 31, 33, 40)] + [(130, 61), (517, 300), (1500, 700)]
    for (n, m), k in itertools.product(cases, (1, 3, 8, 16, 33)):
        for kind in SEARCH_KINDS:
            p, q = _search_clouds(gen, n, m, kind, dtype)
            groups = torch.arange(n) * 3 // n, torch.arange(m) * 3 // m
            runs = []
            for vectors in (True, False):
                monkeypatch.setattr(_kdtree, "_VECTOR_LEAVES", vectors)
                runs.append((*_kdtree.find(q, p, k), *_kdtree.find(p, p, k), *pcops.knn(p, p, min(k, n), validate=False),
                             *_kdtree.find(q, p, k, groups[1], groups[0]),
                             *(pcops.knn_graph(p, min(k, n - 1), validate=False) if n > 1 and kind != "non-finite" else ())))
            assert_identical(*runs)
            if dtype == F64 and kind in ("uniform", "lattice", "duplicates") and k <= n:
                ref_d, ref_idx = reference.knn(q, p, k)
                assert torch.equal(runs[0][1], ref_idx) and torch.equal(runs[0][0], ref_d)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_the_ball_searchs_runs_on_vectors_equal_the_warp_loop_and_the_reference(gen, monkeypatch, dtype):
    """The ball search's runs on vectors (one radius' sorted row:
    :func:`pcops.ops.neighbours.nearest._scan_rows.native_ball`) against its Warp loop
    (``VECTOR_RUNS`` off), through every pair and through cell lists: clouds of fewer points
    than a vector (the loop runs), runs that end inside a vector, radii from none within to
    all, K from 1 to a row that turns into a heap (the loop's), a radius too small for the
    runs' margin, radii at which points lie (their squares may round past the radius'), the
    adversarial clouds: the same rows, counts and distances bit for bit, and the counts of
    the kernels' own distances."""
    cases = [(n, 7) for n in (1, 3, 7, 8, 9, 15, 17, 31, 40)] + [(130, 61), (517, 300)]
    for (n, m), kind in itertools.product(cases, SEARCH_KINDS):
        p, q = _search_clouds(gen, n, m, kind, dtype)
        scale = 1e-22 if kind == "tiny" else 1.0
        with np.errstate(all="ignore"):  # (the kernels' distances, each operation rounded: NumPy's; torch's float32 roots may be 1 ulp off)
            e = q.numpy()[:, None] - p.numpy()[None]
            d = torch.from_numpy(np.sqrt((e[..., 0] * e[..., 0] + e[..., 1] * e[..., 1]) + e[..., 2] * e[..., 2]))
        on = [float(x) for x in d[0, :6] if 0 < x < float("inf")]  # (radii at which a point lies: its square may exceed r r)
        for r, K in itertools.product((0.05 * scale, 0.3 * scale, 2.0 * scale, 1e-30, *on), (1, 5, 32, 64)):
            runs = []
            for vectors, pairs in itertools.product((True, False), (0, 1 << 40)):
                monkeypatch.setattr(ball_search, "VECTOR_RUNS", vectors)
                monkeypatch.setattr(ball_search, "SCAN_PAIRS", pairs)
                found = pcops.ball_query(q, p, r, K, validate=False)
                runs.append((found.idx, found.counts, found.dists))
            for run in runs[1:]:
                assert_identical(run, runs[0])
            assert torch.equal(runs[0][1], (d <= r).sum(1))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_radius_aggregates_blocks_on_vectors_equal_the_warp_loop(gen, monkeypatch, dtype):
    """``radius_aggregate``'s kernels with each block of up to 64 points first narrowed to those
    that may lie within the radius on vectors (:func:`pcops.ops.neighbours.nearest._scan_rows.native_near`)
    against the same kernels measuring every point (``NEAR_BITS`` off), through every pair and
    through cell lists: clouds of fewer points than a vector (every bit kept), runs that end
    inside a vector and past one or several blocks of 64, radii with none within, a few and
    all, a radius too small for the vectors' margin, radii at which points lie (their squares
    may round past the radius'), the adversarial clouds; each weighting's output and gradients
    (query, reference points, features) and ``reduce="max"``'s values and rows bit for bit,
    and the neighbour counts of the kernels' own distances."""
    cases = [(n, 7) for n in (1, 3, 7, 8, 9, 17, 63, 64, 65, 130)] + [(517, 300)]
    for (n, m), kind in itertools.product(cases, SEARCH_KINDS):
        p, q = _search_clouds(gen, n, m, kind, dtype)
        f = torch.randn(n, 5, generator=gen, dtype=F64).to(dtype)
        scale = 1e-22 if kind == "tiny" else 1.0
        with np.errstate(all="ignore"):  # (the kernels' distances, each operation rounded)
            e = q.numpy()[:, None] - p.numpy()[None]
            d = torch.from_numpy(np.sqrt((e[..., 0] * e[..., 0] + e[..., 1] * e[..., 1]) + e[..., 2] * e[..., 2]))
        on = [float(x) for x in d[0, :4] if 0 < x < float("inf")]
        for r in (0.05 * scale, 0.3 * scale, 2.0 * scale, 1e-30, *on):
            runs = []
            for vectors, pairs in itertools.product((True, False), (1 << 40, 0)):
                monkeypatch.setattr(radius, "NEAR_BITS", vectors)
                monkeypatch.setattr(radius, "SCAN_PAIRS", pairs)
                run = []
                for weights, sigma in (("uniform", None), ("softmax", 0.1 * scale), ("inverse_distance", None)):
                    qg, pg, fg = (t.clone().requires_grad_() for t in (q, p, f))
                    out = pcops.radius_aggregate(qg, pg, fg, r, sigma, weights=weights, validate=False)
                    out.backward(torch.ones_like(out))
                    run += [out.detach(), qg.grad, pg.grad, fg.grad]
                top = pcops.radius_aggregate(q, p, f, r, reduce="max", validate=False)
                run += [top, *radius._radius_max(q, p, f, r, False, None, None)]
                runs.append(run)
            same = functools.partial(torch.testing.assert_close, rtol=0, atol=0, equal_nan=True)  # (NaN gradients in place)
            same(runs[0], runs[2])  # every pair: on vectors, and the loop
            same(runs[1], runs[3])  # cell lists (their sums in the cells' order)
            for run in runs[1:]:  # the max and its rows: whatever the order
                same(run[-3:], runs[0][-3:])
            assert torch.equal(runs[0][-1] >= 0, (d <= r).any(1)[:, None].expand(m, 5))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_points_are_identical_across_the_switch(gen, monkeypatch, value):
    q, p = torch.rand(20, 3, generator=gen), torch.rand(30, 3, generator=gen)
    q[3, 1], p[5, 0] = value, value
    knn = both_paths(monkeypatch, lambda: pcops.knn(q, p, 5, backend="warp", validate=False))
    assert_identical(*knn)
    assert bool((knn[0].idx[3] == -1).all()) and not bool((knn[0].idx == 5).any())
    ball = both_paths(monkeypatch, lambda: pcops.ball_query(q, p, 0.4, 6, validate=False))
    assert_identical(*ball)
    assert int(ball[0].counts[3]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_ball_query_is_identical_across_the_switch(gen, monkeypatch, kind, dtype):
    q, p, r = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    for k in (1, 5, 200):
        scan, cells = both_paths(monkeypatch, lambda: pcops.ball_query(q, p, r, k))
        assert_identical(scan, cells)
        op = lambda: torch.ops.pcops.ball_query_by_index(q, p, r, k, False, None, None)  # noqa: E731
        assert_identical(*both_paths(monkeypatch, op))


@pytest.mark.parametrize("kind", ["uniform", "clustered", "duplicates"])
def test_ball_queries_are_identical_across_the_switch(gen, monkeypatch, kind):
    q, p, r = cloud(kind, gen)
    radii, ks = [r, r / 3, 1.5 * r, 5 * r], [4, 2, 7, 3]
    scan, cells = both_paths(monkeypatch, lambda: pcops.ball_queries(q, p, radii, ks))
    for a, b in zip(scan, cells, strict=True):
        assert_identical(a, b)


def test_gradients_are_identical_across_the_switch(gen, monkeypatch):
    q, p, r = cloud("uniform", gen)
    f = torch.rand(p.shape[0], 4, generator=gen, dtype=F64)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, p, f)]
        out = pcops.knn_aggregate(*leaves, 5, 0.3, backend="warp").square().sum()
        out = out + pcops.ball_query(leaves[0], leaves[1], r, 6).dists.clamp_max(9).sum()
        return torch.autograd.grad(out, leaves)

    assert_identical(*both_paths(monkeypatch, grads))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_radius_aggregate_is_identical_across_the_switch(gen, monkeypatch, kind, dtype):
    """Every pair (a list of one cell, the points in their order) or the cell list: the same
    neighbours, so the same sums where they are exact (integer features, uniform weights) and
    the same max and arg-max (its gradient); softmax and inverse-distance weights sum the same
    terms in another order (equal to rounding), both the float64 reference's."""
    q, p, r = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    r = reference.safe_radius(q.double(), p.double(), r)  # (no pair where float32 rounding decides)
    f = torch.randint(-50, 50, (p.shape[0], 11), generator=gen).to(dtype)  # exact sums in any order
    f[5] = f[7]  # ties of the max: the smaller index

    def uniform_and_max():
        feats = f.clone().requires_grad_()
        mean = pcops.radius_aggregate(q, p, feats, r, weights="uniform")
        top = pcops.radius_aggregate(q, p, feats, r, reduce="max")
        (grad,) = torch.autograd.grad(top.sum(), feats)
        return mean.detach(), top.detach(), grad

    assert_identical(*both_paths(monkeypatch, uniform_and_max))
    single = dtype == torch.float32
    tight, near = (dict(rtol=1e-5, atol=1e-4), dict(rtol=2e-3, atol=2e-2)) if single else (dict(rtol=1e-12, atol=1e-11),) * 2
    for weights, sigma in (("softmax", 0.2), ("inverse_distance", None)):
        every, cells = both_paths(monkeypatch, lambda: pcops.radius_aggregate(q, p, f, r, sigma, weights=weights))
        torch.testing.assert_close(every, cells, **tight)
        want = reference.radius_weighted(q.double(), p.double(), f.double(), r, weights, sigma=sigma)
        torch.testing.assert_close(every.double(), want, **near)


def test_radius_aggregate_gradients_agree_across_the_switch(gen, monkeypatch):
    """The backward of a one-cell list visits every point as its forward did: gradients to every
    input equal the cell list's to rounding, and gradcheck passes on the small side."""
    q, p, r = cloud("uniform", gen, 12, 15)
    f = torch.rand(p.shape[0], 3, generator=gen, dtype=F64)
    r = reference.safe_radius(q, p, r)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, p, f, torch.tensor(0.3, dtype=F64))]
        out = pcops.radius_aggregate(*leaves[:3], r, leaves[3])
        return torch.autograd.grad(out.square().sum(), leaves)

    for a, b in zip(*both_paths(monkeypatch, grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(radius, "SCAN_PAIRS", 1 << 40)
    leaves = [t.clone().requires_grad_() for t in (q, p, f, torch.tensor(0.3, dtype=F64))]
    assert torch.autograd.gradcheck(lambda a, b, c, s: pcops.radius_aggregate(a, b, c, r, s), leaves)


def test_the_crossovers_pick_the_one_launch_path_for_small_clouds_only(monkeypatch):
    """Below the crossover a kNN search is one launch, above it the tree's several."""
    launches = []
    real, prepared = _warp.launch, _warp.Prepared.run_at
    monkeypatch.setattr(_warp, "launch", lambda kernel, *a, **kw: (launches.append(kernel), real(kernel, *a, **kw)))
    monkeypatch.setattr(_warp.Prepared, "run_at", lambda self, *a: (launches.append(self.kernel), prepared(self, *a)))
    small = torch.rand(64, 3)
    torch.ops.pcops.knn_warp(small, small, 4, False, None, None)
    assert launches == [_kdtree._scan_kernel(torch.float32, False)[0]]
    launches.clear()
    side = int(_kdtree.SCAN_PAIRS**0.5) + 1
    large = torch.rand(side, 3)
    torch.ops.pcops.knn_warp(large, large, 4, False, None, None)
    assert _kdtree._scan_kernel(torch.float32, False)[0] not in launches and len(launches) >= 2


def test_small_launches_run_on_the_calling_thread(monkeypatch):
    """Work under ``SERIAL_WORK`` never forks: no helper thread can hold up its join."""
    forks = []
    real = _warp.run_chunks
    monkeypatch.setattr(_warp, "run_chunks", lambda *a: (forks.append(a), real(*a)))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        for n in (16, 100):
            p = torch.rand(n, 3)
            pcops.knn(p, p, 4)
            pcops.ball_query(p, p, 0.3, 8)
    finally:
        torch.set_num_threads(threads)
    assert forks == []


@pytest.mark.parametrize("op", ["knn", "ball_query", "radius_aggregate", "radius_graph"])
def test_searches_of_a_few_hundred_queries_use_every_thread(monkeypatch, op):
    """A search costs a microsecond or more a query: from QUERY_CHUNK queries a chunk, 512
    queries run on two threads (1,024 per chunk left them on one)."""
    chunks = []
    real = _warp.chunk_bounds
    monkeypatch.setattr(_warp, "chunk_bounds", lambda n, s, m: (chunks.append((n, m, len(real(n, s, m)) - 1)), real(n, s, m))[1])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(pcops._threads, "available", lambda: 2)
    monkeypatch.setattr(radius, "SCAN_PAIRS", 0)  # (the cell list's search; every pair splits by pairs)
    monkeypatch.setattr(ball_search, "SCAN_PAIRS", 0)
    p, r = torch.rand(512, 3, generator=torch.Generator().manual_seed(0)), 0.12
    {"knn": lambda: pcops.knn(p, p, 8), "ball_query": lambda: pcops.ball_query(p, p, r, 8, query_batch=torch.zeros(512, dtype=torch.int64),
                                                                                 ref_batch=torch.zeros(512, dtype=torch.int64)),
     "radius_aggregate": lambda: pcops.radius_aggregate(p, p, torch.ones(512, 2), r, weights="uniform"),
     "radius_graph": lambda: pcops.radius_graph(p, r)}[op]()
    assert (512, _warp.QUERY_CHUNK, 2) in chunks


def test_warp_array_descriptors_equal_warps_own_conversion():
    """``_warp.array`` packs the descriptor ``wp.from_torch(..., return_ctype=True)`` builds."""
    import warp as wp

    cases = [
        (torch.rand(5, 3), wp.vec3f),
        (torch.rand(5, 3, dtype=F64), wp.vec3d),
        (torch.rand(4, 5, 3)[:, 1:], wp.vec3f),
        (torch.arange(6), None),
        (torch.rand(2, 3, 3, 3), wp.mat33f),
        (torch.rand(7, 4)[:, ::2], None),
        (torch.rand(0, 3), wp.vec3f),
        (torch.zeros(3, dtype=torch.int32), None),
        (torch.rand(3, 4).t(), None),
        (torch.rand(2, 3, 4, 5), None),
        (torch.rand(3, 1).expand(3, 6), None),
    ]
    for t, dtype in cases:
        assert bytes(_warp.array(t, dtype)) == bytes(wp.from_torch(t, dtype=dtype, requires_grad=False, return_ctype=True))
    temporary = _warp.array(torch.arange(6.0).view(2, 3).t().contiguous(), wp.float32)
    assert temporary._ref.data_ptr() == temporary.data  # the descriptor keeps its tensor's memory alive
    with pytest.raises(RuntimeError):
        _warp.array(torch.rand(5, 3, dtype=F64), wp.vec3f)  # Warp's own error for an incompatible dtype
    with pytest.raises(RuntimeError):
        _warp.array(torch.rand(5, 4), wp.vec3f)
    flat = torch.rand(40, dtype=F64)
    for at, count, width, dtype in [(0, 40, 1, wp.float64), (4, 9, 3, wp.vec3d), (39, 1, 1, wp.float64)]:  # _warp.span: parts of one tensor
        view = flat[at:at + count * width].view(count, width) if width > 1 else flat[at:at + count]
        assert bytes(_warp.span(flat, at, count, width)) == bytes(wp.from_torch(view, dtype=dtype, requires_grad=False, return_ctype=True))


@pytest.mark.parametrize("k", [1, 11, 12, 16, 17, 32])
def test_the_knn_crossover_by_k_is_exact_at_its_limit(k, monkeypatch):
    """At the largest every-pair size for k and one query more, each search takes its path, and
    (on a lattice: ties everywhere) both give the other path's neighbours and distances."""
    pairs = _kdtree.SCAN_PAIRS
    n = 64
    lattice = torch.stack(torch.meshgrid(*[torch.arange(4.0)] * 3, indexing="ij"), -1).reshape(n, 3)
    limit = _kdtree.scan_pairs(pairs // n, n, k, False)  # (a prepared small tree's, for these sizes)
    assert limit == ((pairs >> 1) + (pairs >> 3) if k <= 16 else (pairs >> 3) // max(1, k >> 1))  # (the scan's rows on vectors up to k = 16)
    for m in (limit // n, limit // n + 1):
        query = lattice[torch.arange(m) % n] + 0.5
        launches = []
        real, prepared = _warp.launch, _warp.Prepared.run_at
        monkeypatch.setattr(_warp, "launch", lambda kernel, *a, **kw: (launches.append(kernel), real(kernel, *a, **kw)))
        monkeypatch.setattr(_warp.Prepared, "run_at", lambda self, *a: (launches.append(self.kernel), prepared(self, *a)))
        got = pcops.knn(query, lattice, k)
        monkeypatch.setattr(_warp, "launch", real)
        monkeypatch.setattr(_warp.Prepared, "run_at", prepared)
        scan = _kdtree._scan_kernel(torch.float32, False)[0] in launches
        assert scan == (m * n <= limit)
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", 0 if scan else 1 << 40)  # the other path
        assert_identical(got, pcops.knn(query, lattice, k))
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)


def plain_and_general(monkeypatch, fn, module="pcops.ops.neighbours.nearest"):
    """``fn()`` with the plain calls of ``module``'s op run directly, then through the general path."""
    out = []
    for plain in (True, False):
        monkeypatch.setattr(importlib.import_module(module), "PLAIN", [plain])
        out.append(fn())
    return out


def recorded(monkeypatch, module: str, name: str) -> list:
    """The calls of ``module``'s function ``name`` (the op a general call runs), recorded from now on."""
    owner = importlib.import_module(module)
    ops, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: (ops.append(a), real(*a))[1])
    return ops


def assert_op_runs_for_general_calls_only(ops: list, general: list) -> None:
    """Each call of ``general`` (none of them plain) runs the op once more (``ops`` records its calls)."""
    for n, call in enumerate(general, 1):
        call()
        assert len(ops) == n


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_knn_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager call (one cloud each, nothing to differentiate) skips the layout layer and the
    custom op: the same neighbours and distances, on both sides of the scan's crossover."""
    q, p, _ = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    calls = [lambda: pcops.knn(q, p, 5), lambda: pcops.knn(p, p, 1), lambda: pcops.knn(q, p, p.shape[0]),
             lambda: pcops.knn(q[::2], p.t().contiguous().t(), 3), lambda: pcops.knn(q, p, 4, validate=False)]
    for pairs in PATHS.values():
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for call in calls:
            assert_identical(*plain_and_general(monkeypatch, call))


def test_plain_knn_calls_skip_the_op_and_others_do_not(gen, monkeypatch):
    """Which calls are plain: the op runs only for the others, and non-finite points without
    validation give the general path's rows."""
    from pcops.ops.neighbours.nearest import _registry

    ops = []
    real = _registry.BACKENDS["warp"].op
    monkeypatch.setitem(_registry.BACKENDS, "warp", _registry.BACKENDS["warp"].__class__(
        name="warp", op=lambda *a: (ops.append(a), real(*a))[1], devices=("cpu", "cuda"), requires=("warp",)))
    q, p = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen)
    for call in (lambda: pcops.knn(q, p, 4), lambda: pcops.knn(q, q, 4, "warp"), lambda: pcops.knn(q.double(), p.double(), 2)):
        call()
    with torch.no_grad():
        pcops.knn(q.clone().requires_grad_(), p, 4)  # nothing to differentiate
    assert ops == []
    general = [
        lambda: pcops.knn(q.requires_grad_(), p, 4),  # a gradient to record
        lambda: pcops.knn(q.detach().half(), p.half(), 4),  # searched in float32
        lambda: pcops.knn(q.detach(), p.double(), 4),  # mixed dtypes
        lambda: pcops.knn(q.detach()[None], p[None], 4),  # padded
        lambda: pcops.knn(q.detach(), p, 4, query_batch=torch.zeros(30, dtype=torch.int64), ref_batch=torch.zeros(40, dtype=torch.int64)),
        lambda: pcops.knn(q.detach(), p, np.int64(4)),  # k not a Python int
    ]
    assert_op_runs_for_general_calls_only(ops, general)
    bad = p.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="ref contains NaN or inf"):
        pcops.knn(q.detach(), bad, 4)
    assert len(ops) == len(general)  # the layout layer's check raised: the op never ran
    assert_identical(*plain_and_general(monkeypatch, lambda: pcops.knn(q.detach(), bad, 4, validate=False)))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_fps_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager FPS call (one cloud, the default start, nothing to differentiate) runs
    bucket FPS directly: the same picks and points, Morton and kd-tree leaves, padded results."""
    q, p, _ = cloud(kind, gen, m=40, n=2000)
    q, p = q.to(dtype), p.to(dtype)
    calls = [lambda: pcops.farthest_point_sample(p, 50), lambda: pcops.farthest_point_sample(p, 1000),
             lambda: pcops.farthest_point_sample(q, 40), lambda: pcops.farthest_point_sample(q, 64),
             lambda: pcops.farthest_point_sample(q[:1], 3), lambda: pcops.farthest_point_sample(p[::3], 70, validate=False),
             lambda: pcops.farthest_point_sample(p, 30, start_idx=0), lambda: pcops.farthest_point_sample(p, 30, start_idx=p.shape[0] - 1),
             lambda: pcops.farthest_point_sample(q, 50, start_idx=[5, 0, 39]), lambda: pcops.farthest_point_sample(p, 9, start_idx=(7, 8)),
             lambda: pcops.farthest_point_sample(p, 20, start_idx=3000, validate=False),
             lambda: pcops.farthest_point_sample(p, 40, random_start=True, generator=torch.Generator().manual_seed(5)),
             lambda: pcops.farthest_point_sample(q, ratio=0.3), lambda: pcops.farthest_point_sample(q, ratio=1.0),
             lambda: pcops.farthest_point_sample(p, ratio=0.01, random_start=True, generator=torch.Generator().manual_seed(2))]
    bad = q.clone()
    bad[[3, 17]] = float("nan")  # validate=False: NaN points are never picked, the picks past the others -1
    calls += [lambda: pcops.farthest_point_sample(bad, s, start_idx=i, validate=False) for s, i in ((30, 0), (38, 5), (39, 0), (40, 0), (45, 1))]
    big = p.clone()
    big[[5, 100, 999]] = float("nan")  # the same past one leaf: few picks (Morton leaves) and many (kd-tree leaves)
    n = big.shape[0]
    calls += [lambda s=s: pcops.farthest_point_sample(big, s, validate=False) for s in (20, n - 3, n - 2, n)]
    for call in calls:
        assert_identical(*plain_and_general(monkeypatch, call, "pcops.ops.sampling.fps"))
    assert (pcops.farthest_point_sample(bad, 40, validate=False).idx[-2:] == -1).all()  # (the case the calls above reach)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_the_common_fps_call_runs_its_kept_plan(gen, monkeypatch, dtype):
    """n picks from the default start or one index, on a size whose plan is kept, run the plan
    without the full lookup: the general path's picks and points, at several sizes of one plan and
    both ends of the start range; a NaN point still raises with validation (and the next call is
    right), and is picked past without it as the general path does."""
    from pcops.ops.sampling import fps

    p = torch.rand(100, 3, generator=gen, dtype=F64).to(dtype)
    for _ in range(2):  # (a plan is made on its key's second miss)
        pcops.farthest_point_sample(p, 10)
    assert _warp.kept(fps._plan_key(dtype, 128, 1)) is not None
    bad = p.clone()
    bad[[4, 60]] = float("nan")
    calls = [lambda: pcops.farthest_point_sample(p, 10), lambda: pcops.farthest_point_sample(p, 100, start_idx=99),
             lambda: pcops.farthest_point_sample(p[:70], 5, start_idx=0), lambda: pcops.farthest_point_sample(p[:65], 200),
             lambda: pcops.farthest_point_sample(bad, 99, start_idx=3, validate=False)]
    full = _warp.prepared
    monkeypatch.setattr(_warp, "prepared", lambda *a: pytest.fail("the common call looked its plan up in full"))
    plain = [call() for call in calls]
    with pytest.raises(ValueError, match="points contains NaN or inf"):
        pcops.farthest_point_sample(bad, 10)
    again = pcops.farthest_point_sample(p, 10)
    monkeypatch.setattr(_warp, "prepared", full)
    monkeypatch.setattr(fps, "PLAIN", [False])
    for got, call in zip(plain + [again], calls + calls[:1]):
        assert_identical(got, call())
    assert (plain[-1].idx[98:] == -1).all() and (plain[-1].idx[:98] >= 0).all()  # (98 finite points)
    assert (plain[3].idx[65:] == -1).all() and torch.equal(plain[3].idx[:65].sort().values, torch.arange(65))


def test_plain_fps_calls_skip_the_op_and_others_do_not(gen, monkeypatch):
    from pcops.ops.sampling import fps

    ops = []
    real = fps._fps
    monkeypatch.setattr(fps, "_fps", lambda *a: (ops.append(a), real(*a))[1])
    p = torch.rand(300, 3, generator=gen)
    pcops.farthest_point_sample(p, 20)
    pcops.farthest_point_sample(p.double(), 400)
    pcops.farthest_point_sample(p, 20, start_idx=5)
    pcops.farthest_point_sample(p, 20, start_idx=[5, 6])
    pcops.farthest_point_sample(p, 20, random_start=True)
    pcops.farthest_point_sample(p, ratio=0.25)
    with torch.no_grad():
        pcops.farthest_point_sample(p.clone().requires_grad_(), 20)
    assert ops == []
    general = [
        lambda: pcops.farthest_point_sample(p.clone().requires_grad_(), 20),  # a gradient to the points
        lambda: pcops.farthest_point_sample(p.half(), 20),
        lambda: pcops.farthest_point_sample(p, 20, start_idx=torch.tensor(5)),
        lambda: pcops.farthest_point_sample(p, ratio=torch.tensor(0.25)),
        lambda: pcops.farthest_point_sample(p, ratio=0.25, start_idx=3),
        lambda: pcops.farthest_point_sample(p[None], 20),
        lambda: pcops.farthest_point_sample(p, np.int64(20)),
    ]
    assert_op_runs_for_general_calls_only(ops, general)
    for call, error in ((lambda: pcops.farthest_point_sample(p, 20, start_idx=300), "start_idx values must be in"),
                        (lambda: pcops.farthest_point_sample(p, 20, start_idx=[4, 4]), "must not repeat"),
                        (lambda: pcops.farthest_point_sample(p, 20, start_idx=-1), "start_idx values must be >= 0"),
                        (lambda: pcops.farthest_point_sample(p, 1, start_idx=[1, 2]), "more than n_samples"),
                        (lambda: pcops.farthest_point_sample(p, 20, start_idx=1, random_start=True), "random_start"),
                        (lambda: pcops.farthest_point_sample(p, ratio=1.5), "ratio")):
        with pytest.raises(ValueError, match=error):
            call()
    assert len(ops) == len(general)  # each raised before the op
    bad = p.clone()
    bad[7, 2] = float("nan")
    with pytest.raises(ValueError, match="points contains NaN or inf"):
        pcops.farthest_point_sample(bad, 20)
    out = plain_and_general(monkeypatch, lambda: pcops.farthest_point_sample(bad, 300, validate=False), "pcops.ops.sampling.fps")
    assert_identical(*out)  # every finite point, then -1
    assert out[0].idx[-1] == -1


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_ball_query_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager ball query (one cloud each, nothing to differentiate) runs the search
    directly: the same neighbours, distances and counts, with and without cell lists."""
    q, p, r = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    calls = [lambda: pcops.ball_query(q, p, r, 5), lambda: pcops.ball_query(p, p, r, 1), lambda: pcops.ball_query(q, p, 3 * r, 200),
             lambda: pcops.ball_query(q[::2], p.t().contiguous().t(), r, 4), lambda: pcops.ball_query(q, p, r, 6, validate=False)]
    for pairs in PATHS.values():
        monkeypatch.setattr(ball_search, "SCAN_PAIRS", pairs)
        for call in calls:
            assert_identical(*plain_and_general(monkeypatch, call, "pcops.ops.neighbours.ball_query"))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_ball_queries_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager ``ball_queries`` call runs the search directly: the same neighbours,
    distances and counts per radius (one radius, several, repeated, unsorted, two groups),
    with and without cell lists, each radius searched on its own or all in one search (both
    sides of SPLIT_PAIRS), and without validation on non-finite points."""
    q, p, r = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    bad = p.clone()
    bad[3] = float("nan")
    bad[4, 1] = float("inf")
    calls = [lambda: pcops.ball_queries(q, p, [r], 5), lambda: pcops.ball_queries(p, p, [r, r / 2], [8, 3]),
             lambda: pcops.ball_queries(q, p, (3 * r, r, r), 7), lambda: pcops.ball_queries(q[::2], p.t().contiguous().t(), [r / 3, 2 * r], [4, 40]),
             lambda: pcops.ball_queries(q, bad, [r, 2 * r], [6, 2], validate=False)]
    module = importlib.import_module("pcops.ops.neighbours.ball_queries")
    for pairs, split in itertools.product(PATHS.values(), (0, 1 << 40)):
        monkeypatch.setattr(ball_search, "SCAN_PAIRS", pairs)
        monkeypatch.setattr(module, "SPLIT_PAIRS", split)
        for call in calls:
            plain, general = plain_and_general(monkeypatch, call, "pcops.ops.neighbours.ball_queries")
            assert len(plain) == len(general)
            for a, b in zip(plain, general, strict=True):
                assert_identical(a, b)
                assert all(t.is_contiguous() for t in a)


def test_plain_ball_queries_calls_skip_the_op_and_others_do_not(gen, monkeypatch):
    ops = recorded(monkeypatch, "pcops.ops.neighbours.ball_queries", "_ball_queries")
    q, p = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen)
    pcops.ball_queries(q, p, [0.3, 0.1], 8)
    pcops.ball_queries(q.double(), q.double(), (1, 2), [3, 4])
    pcops.ball_queries(q, p, [np.float32(0.3)], [np.int64(8)])  # NumPy scalars, as the general path takes them
    assert ops == []
    general = [
        lambda: pcops.ball_queries(q.clone().requires_grad_(), p, [0.3], 8),  # a gradient to record
        lambda: pcops.ball_queries(q.half(), p.half(), [0.3], 8),
        lambda: pcops.ball_queries(q, p.double(), [0.3], 8),
        lambda: pcops.ball_queries(q[None], p[None], [0.3], 8),
        lambda: pcops.ball_queries(q, p, [0.3], 8, query_batch=torch.zeros(30, dtype=torch.int64), ref_batch=torch.zeros(40, dtype=torch.int64)),
    ]
    assert_op_runs_for_general_calls_only(ops, general)
    for radii, match in (([0.0], "radii"), ([float("nan")], "radii"), ([], "radii"), (0.3, "radii")):
        with pytest.raises((ValueError, TypeError), match=match):
            pcops.ball_queries(q, p, radii, 8)
    with pytest.raises((ValueError, TypeError), match="max_neighbors"):
        pcops.ball_queries(q, p, [0.3, 0.2], [8])
    bad = p.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="ref contains NaN or inf"):
        pcops.ball_queries(q, bad, [0.3], 8)
    assert len(ops) == len(general)


def test_plain_ball_query_calls_skip_the_op_and_others_do_not(gen, monkeypatch):
    ops = recorded(monkeypatch, "pcops.ops.neighbours.ball_query", "_ball_query")
    q, p = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen)
    pcops.ball_query(q, p, 0.3, 8)
    pcops.ball_query(q.double(), q.double(), 1, 3)
    assert ops == []
    general = [
        lambda: pcops.ball_query(q.clone().requires_grad_(), p, 0.3, 8),  # a gradient to record
        lambda: pcops.ball_query(q.half(), p.half(), 0.3, 8),
        lambda: pcops.ball_query(q, p.double(), 0.3, 8),
        lambda: pcops.ball_query(q[None], p[None], 0.3, 8),
        lambda: pcops.ball_query(q, p, np.float32(0.3), 8),
        lambda: pcops.ball_query(q, p, 0.3, np.int64(8)),
    ]
    assert_op_runs_for_general_calls_only(ops, general)
    for radius, match in ((0.0, "radius"), (float("nan"), "radius"), (True, "radius")):
        with pytest.raises((ValueError, TypeError), match=match):
            pcops.ball_query(q, p, radius, 8)
    with pytest.raises((ValueError, TypeError), match="max_neighbors"):
        pcops.ball_query(q, p, 0.3, 0)
    bad = p.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="ref contains NaN or inf"):
        pcops.ball_query(q, bad, 0.3, 8)
    assert len(ops) == len(general)
    assert_identical(*plain_and_general(monkeypatch, lambda: pcops.ball_query(q, bad, 0.3, 8, validate=False), "pcops.ops.neighbours.ball_query"))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_knn_graph_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager knn_graph (one cloud, every point with k neighbours) writes each point's
    first k neighbours other than itself with one kernel: the same edges as the general path's
    masks, duplicates (a point's copies ahead of it) and loops included."""
    _, p, _ = cloud(kind, gen)
    p = p.to(dtype)
    n = p.shape[0]
    calls = [lambda: pcops.knn_graph(p, 6), lambda: pcops.knn_graph(p, 1), lambda: pcops.knn_graph(p, n - 1),
             lambda: pcops.knn_graph(p, n), lambda: pcops.knn_graph(p, n, loop=True), lambda: pcops.knn_graph(p, 5, loop=True),
             lambda: pcops.knn_graph(p[::2].contiguous(), 4), lambda: pcops.knn_graph(p, 4, validate=False)]
    bad = p.clone()
    bad[[2, 5]] = float("nan")  # validate=False: rows of NaN points cut short (and NaN points never neighbours)
    calls += [lambda loop=loop: pcops.knn_graph(bad, 3, loop=loop, validate=False) for loop in (False, True)]
    for pairs in PATHS.values():
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for call in calls:
            plain, general = plain_and_general(monkeypatch, call, "pcops.ops.neighbours.graph")
            assert torch.equal(plain, general)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_knn_graph_edges_written_by_the_kept_search(gen, monkeypatch, kind, dtype):
    """Once a plain knn_graph's search is the calling thread's kept small tree, the search writes
    the edges itself (pcops.ops.neighbours.nearest._kdtree.graph_edges, a third call of one
    shape): the same edges as the general path, and float64 clouds the float64 brute force's,
    duplicates and loops included; the tree's own knn calls after it write no edges and find the
    same neighbours; a cloud with a NaN point (validate=False) or with squares that overflow
    (rows cut short) is flagged and left to the general path."""
    _, p, _ = cloud(kind, gen, n=200)
    p = p.to(dtype)
    n = p.shape[0]
    kept = []
    real = _kdtree.graph_edges
    monkeypatch.setattr(_kdtree, "graph_edges", lambda *a: (kept.append(real(*a)), kept[-1])[1])
    bad = p.clone()
    bad[[2, 5]] = float("nan")
    huge = p.clone()
    huge[:20] *= 1e30 if dtype == torch.float32 else 1e300  # (their squares overflow: rows cut short)
    for pairs in PATHS.values():  # (the default crossovers, and trees at every size: k = 1 too)
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for points, k, loop, validate in ((p, 6, False, True), (p, 5, True, True), (p, 1, False, True), (p, 60, False, True),
                                          (p[::2].contiguous(), 4, False, True), (bad, 3, False, False), (huge, 4, True, True)):
            def call(points=points, k=k, loop=loop, validate=validate):
                return pcops.knn_graph(points, k, loop=loop, validate=validate)
            plain, general = plain_and_general(monkeypatch, call, "pcops.ops.neighbours.graph")
            del kept[:]
            monkeypatch.setattr(importlib.import_module("pcops.ops.neighbours.graph"), "PLAIN", [True])
            third = call()
            assert torch.equal(third, general) and torch.equal(plain, general), (pairs, k, loop)
            flagged = points is bad or points is huge
            if not _kdtree._scans(points.shape[0], points.shape[0], k + (not loop)):
                assert len(kept) == 1 and kept[0] is not None and kept[0][1] == flagged, (pairs, k, loop)  # (the kept search ran)
            if dtype == F64 and not flagged:
                assert torch.equal(third, reference.graph(points, loop=loop, k=k))
            plan = _kdtree._kept_plan(points, points, k + (not loop))
            if isinstance(plan, _kdtree._SmallTree):  # (its search's edge count put back: its knn calls write none)
                assert all(args.edge_k == 0 for args in plan.launches[3]._args)
            d, i = pcops.knn(points, points, k + 1, validate=validate)  # (the same kept tree, writing no edges)
            if dtype == F64 and not flagged:
                assert torch.equal(i, reference.knn(points, points, k + 1)[1])
            assert not flagged or torch.equal(i, pcops.knn(points, points, k + 1, validate=validate, backend="torch").idx)
    assert n * 60 <= _kdtree.GRAPH_EDGES


def test_plain_knn_graph_calls_skip_the_masks_and_others_do_not(gen, monkeypatch):
    graph = importlib.import_module("pcops.ops.neighbours.graph")
    ops = []
    real = graph._edges_op
    monkeypatch.setattr(graph, "_edges_op", lambda *a: (ops.append(a), real(*a))[1])
    p = torch.rand(40, 3, generator=gen)
    p[7] = p[3]  # a duplicate: point 7's nearest is point 3 (the smaller index), then itself
    assert torch.equal(pcops.knn_graph(p, 1)[:, 7], torch.tensor([3, 7]))
    pcops.knn_graph(p, 39)
    pcops.knn_graph(p.double(), 5, loop=True)
    pcops.knn_graph(p, 5, validate=False)
    assert ops == []
    bad = p.clone()
    bad[11, 2] = float("nan")
    general = [
        lambda: pcops.knn_graph(p, 40),  # fewer than k + 1 points: rows that are not complete
        lambda: pcops.knn_graph(bad, 5, validate=False),  # a NaN point's row: none found
        lambda: pcops.knn_graph(p, 5, batch=torch.zeros(40, dtype=torch.int64)),
        lambda: pcops.knn_graph(p.half(), 5),
        lambda: pcops.knn_graph(p.clone().requires_grad_(), 5),
        lambda: pcops.knn_graph(p, np.int64(5)),
    ]
    assert_op_runs_for_general_calls_only(ops, general)
    with pytest.raises((ValueError, TypeError), match="k"):
        pcops.knn_graph(p, 0)
    with pytest.raises(TypeError, match="loop"):
        pcops.knn_graph(p, 3, loop=1)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_radius_graph_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager radius_graph (one cloud checked finite) takes the ball search and writes each
    point's edges with one kernel: the same edges as the general path's masks (capped) and its
    cell-list pass (uncapped), on both sides of the ball search's crossover, duplicates (a point's
    copies ahead of it) and loops included; float64 clouds equal the float64 brute force."""
    _, p, r = cloud(kind, gen)
    p = p.to(dtype)
    n = p.shape[0]
    cases = [(r, 32, False), (r, 1, False), (r, 3, True), (r, n - 1, False), (r, n, True), (r, n + 5, False),
             (r, None, False), (r, None, True), (r / 1000, None, False), (r / 1000, 2, False), (1e9, None, False), (1e9, 4, True)]
    for pairs in PATHS.values():
        monkeypatch.setattr(ball_search, "SCAN_PAIRS", pairs)
        for radius_, cap, loop in cases:
            def call(q=p, radius_=radius_, cap=cap, loop=loop):
                return pcops.radius_graph(q, radius_, max_neighbors=cap, loop=loop)
            plain, general = plain_and_general(monkeypatch, call, "pcops.ops.neighbours.graph")
            assert torch.equal(plain, general), (pairs, radius_, cap, loop)
            if dtype == F64:
                assert torch.equal(plain, reference.graph(p, loop=loop, radius=radius_, max_neighbors=cap))
        one = p[:1].contiguous()  # a cloud of one point: no edge without loop, itself with it
        for loop in (False, True):
            assert torch.equal(*plain_and_general(monkeypatch, lambda loop=loop: pcops.radius_graph(one, r, loop=loop), "pcops.ops.neighbours.graph"))
            assert torch.equal(*plain_and_general(monkeypatch, lambda loop=loop: pcops.radius_graph(one, r, max_neighbors=2, loop=loop), "pcops.ops.neighbours.graph"))


def test_plain_radius_graph_checks_each_row_against_its_count(gen, monkeypatch):
    """The plain path writes each row's edges into the columns its count gives (the ball search's
    count less the point itself) and checks the row: a row that holds another number of edges
    (here a stand-in search whose row 5 lacks its own point, as the cell list's rows once did at
    radii hundreds of orders of magnitude above the cloud's extent: the kernel wrote past the
    edges) sends the call to the general path, whose edges it returns."""
    real = ball_search.search_one

    def without_own_point(query, ref, radius, cap, *rest):  # (row 5 and its count without point 5)
        idx, counts, dists = real(query, ref, radius, cap, *rest)
        row = idx[5][idx[5] != 5]
        idx, counts = idx.clone(), counts.clone()
        idx[5] = torch.cat([row, row.new_full((idx.shape[1] - row.shape[0],), -1)])
        counts[5] -= 1
        return idx, counts, dists

    p = torch.rand(40, 3, generator=gen)
    general = recorded(monkeypatch, "pcops.ops.neighbours.graph", "_radius_graph")
    for cap in (1, 39, 60):  # (row 5 full at cap 1: its first neighbour, as counted; short of it at 39 and 60: one edge more than counted)
        want = plain_and_general(monkeypatch, lambda cap=cap: pcops.radius_graph(p, 0.5, max_neighbors=cap), "pcops.ops.neighbours.graph")[1]
        monkeypatch.setattr(importlib.import_module("pcops.ops.neighbours.graph"), "PLAIN", [True])
        monkeypatch.setattr(ball_search, "search_one", without_own_point)
        calls = len(general)
        assert torch.equal(pcops.radius_graph(p, 0.5, max_neighbors=cap), want), cap
        assert len(general) == calls + (cap > 1), cap  # (flagged: the general path's op)
        monkeypatch.setattr(ball_search, "search_one", real)
    tiny = torch.arange(600, dtype=F64)[:, None].repeat(1, 3) * 1e-40  # (the cell list's once: now every row holds its point)
    for cap, loop in ((1, False), (1, True), (2, False)):
        plain, general_ = plain_and_general(monkeypatch, lambda cap=cap, loop=loop: pcops.radius_graph(tiny, 1e300, max_neighbors=cap, loop=loop),
                                            "pcops.ops.neighbours.graph")
        assert torch.equal(plain, general_) and plain.shape[1] == 600 * cap, (cap, loop)


def test_plain_radius_graph_calls_skip_the_op_and_others_do_not(gen, monkeypatch):
    ops = recorded(monkeypatch, "pcops.ops.neighbours.graph", "_radius_graph")
    padded = recorded(monkeypatch, "pcops.ops.neighbours.graph", "_radius_graph_padded")
    p = torch.rand(40, 3, generator=gen)
    p[7] = p[3]  # a duplicate: point 7's nearest is point 3 (the smaller index), then itself
    assert torch.equal(pcops.radius_graph(p, 1e-6, max_neighbors=1)[:, :2], torch.tensor([[7, 3], [3, 7]]))
    looped = pcops.radius_graph(p, 1e-6, max_neighbors=2, loop=True)  # each point itself; 3 and 7 each other too
    assert torch.equal(looped[:, looped[1] == 3], torch.tensor([[3, 7], [3, 3]]))
    assert torch.equal(looped[:, looped[1] == 7], torch.tensor([[3, 7], [7, 7]]))
    assert looped.shape[1] == 42
    pcops.radius_graph(p, 0.3)
    pcops.radius_graph(p.double(), 2, max_neighbors=5, loop=True)
    assert ops == []
    bad = p.clone()
    bad[11, 2] = float("nan")
    general = [
        lambda: pcops.radius_graph(p, 0.3, max_neighbors=4, validate=False),  # unchecked values: a NaN point is not within its own radius
        lambda: pcops.radius_graph(bad, 0.3, validate=False),
        lambda: pcops.radius_graph(p, 0.3, batch=torch.zeros(40, dtype=torch.int64)),
        lambda: pcops.radius_graph(p.half(), 0.3),
        lambda: pcops.radius_graph(p.clone().requires_grad_(), 0.3),
        lambda: pcops.radius_graph(p, np.float64(0.3)),
        lambda: pcops.radius_graph(p, 0.3, max_neighbors=np.int64(4)),
        lambda: pcops.radius_graph(p[:0], 0.3),
    ]
    assert_op_runs_for_general_calls_only(ops, general)
    pcops.radius_graph(p, 0.3, max_edges=100)
    assert len(padded) == 1
    with pytest.raises(ValueError, match="points"):
        pcops.radius_graph(bad, 0.3, max_neighbors=4)
    with pytest.raises((ValueError, TypeError), match="radius"):
        pcops.radius_graph(p, 0.0)
    with pytest.raises((ValueError, TypeError), match="max_neighbors"):
        pcops.radius_graph(p, 0.3, max_neighbors=0)
    with pytest.raises(TypeError, match="loop"):
        pcops.radius_graph(p, 0.3, loop=1)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_knn_interpolate_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """Inverse-distance interpolation of a plain call (the points plain, the features possibly
    requiring grad) takes the plain search and unmasked weights: the same values and the same
    gradient to the features, coincident points (d = 0) and huge coordinates included."""
    q, p, _ = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    q[0] = p[2]  # a query on a reference point: d = 0, the clamped weight
    f = torch.rand(p.shape[0], 5, generator=gen, dtype=dtype)

    def run(query, ref, k, **kw):
        feats = f.clone().requires_grad_()
        out = pcops.knn_interpolate(query, ref, feats, k, **kw)
        (grad,) = torch.autograd.grad(out.square().sum(), feats)
        return out.detach(), grad

    calls = [lambda: run(q, p, 3), lambda: run(p, p, 1), lambda: run(q, p, p.shape[0]), lambda: run(q * 1e18, p * 1e18, 4),
             lambda: (pcops.knn_aggregate(q, p, f, 2, weights="inverse_distance"),), lambda: run(q, p, 3, validate=False)]
    for pairs in PATHS.values():
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for call in calls:
            assert_identical(*plain_and_general(monkeypatch, call))


def test_plain_uniform_weight_kept_from_inference_mode_serves_a_gradient(gen):
    """The plain path's kept 1 / k (made once per dtype and k) is an ordinary tensor even when an
    inference-mode call made it: a later call whose features require grad saves it for backward."""
    from pcops.ops.neighbours import nearest

    nearest._uniform_weight.cache_clear()
    p = torch.rand(300, 3, generator=gen)
    f = torch.rand(300, 5, generator=gen)
    with torch.inference_mode():
        first = pcops.knn_aggregate(p, p, f, 6, weights="uniform")
    feats = f.clone().requires_grad_()
    out = pcops.knn_aggregate(p, p, feats, 6, weights="uniform")
    (grad,) = torch.autograd.grad(out.sum(), feats)
    idx = pcops.knn(p, p, 6).idx
    assert torch.equal(out.detach(), first)
    assert torch.allclose(out.detach(), f[idx].mean(1), rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad, (torch.bincount(idx.view(-1), minlength=300).to(f.dtype) / 6)[:, None].expand(300, 5), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_knn_aggregate_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """Uniform and softmax weights of a plain call (the features possibly requiring grad) take
    the plain search and unmasked weights: the same values and gradients to the features bit
    for bit, for any sigma (a number; the rows' nearest distance as the shift) and k (more
    than four with nothing to differentiate: the products made in place)."""
    q, p, _ = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    q[0] = p[2]
    f = torch.rand(p.shape[0], 5, generator=gen, dtype=dtype)

    def run(query, ref, k, **kw):
        feats = f.clone().requires_grad_()
        out = pcops.knn_aggregate(query, ref, feats, k, **kw)
        (grad,) = torch.autograd.grad(out.square().sum(), feats)
        return out.detach(), grad

    calls = [lambda: run(q, p, 3, weights="uniform"), lambda: run(q, p, p.shape[0], weights="uniform"), lambda: run(p, p, 7, sigma=0.1),
             lambda: run(q, p, 1, sigma=2), lambda: run(q * 1e18, p * 1e18, 4, sigma=1e17), lambda: run(q, p, 5, sigma=1e-30),
             lambda: (pcops.knn_aggregate(q, p, f, 6, 0.3),), lambda: (pcops.knn_aggregate(q, p, f, 6, weights="uniform"),),
             lambda: run(q, p, 3, sigma=0.1, validate=False)]
    for pairs in PATHS.values():
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for call in calls:
            assert_identical(*plain_and_general(monkeypatch, call))
    from pcops.ops.neighbours import nearest  # which of them were plain

    plain = [nearest._plain_weighted(q, p, f, 3, "auto", v, w, s) is not None
             for v, w, s in ((True, "uniform", None), (True, "softmax", 0.1), (True, "softmax", torch.tensor(0.1)), (False, "softmax", 0.1))]
    assert plain == [True, True, False, True]
    # validate=False: NaN features (plain, the same NaNs), NaN reference points (never found:
    # plain while every row is complete) and a NaN query (its row cut short: the general path)
    bad_f, bad_p, bad_q = f.clone(), p.clone(), q.clone()
    bad_f[4, 1] = bad_p[[1, 6], 0] = bad_q[3, 2] = float("nan")
    cases = [(q, p, bad_f, True), (q, bad_p, f, True), (bad_q, p, f, False)]
    for query, ref, feats, taken in cases:
        assert (nearest._plain_weighted(query, ref, feats, 3, "auto", False, "softmax", 0.2) is not None) is taken
        for w, s in (("softmax", 0.2), ("uniform", None), ("inverse_distance", None)):
            a, b = plain_and_general(monkeypatch, lambda: (pcops.knn_aggregate(query, ref, feats, 3, s, weights=w, validate=False),))
            torch.testing.assert_close(a[0], b[0], rtol=0, atol=0, equal_nan=True)


def test_plain_knn_interpolate_calls_and_others(gen, monkeypatch):
    from pcops.ops.neighbours import nearest

    taken = []
    real = nearest._plain_weighted
    monkeypatch.setattr(nearest, "_plain_weighted", lambda *a: (lambda out: (taken.append(out is not None), out)[1])(real(*a)))
    q, p, f = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen), torch.rand(40, 6, generator=gen)
    pcops.knn_interpolate(q, p, f)
    pcops.knn_interpolate(q, p, f.clone().requires_grad_())
    assert taken == [True, True]
    bad = f.clone()
    bad[1, 1] = float("nan")
    for call in (lambda: pcops.knn_interpolate(q.clone().requires_grad_(), p, f), lambda: pcops.knn_interpolate(q, p, f.double()),
                 lambda: pcops.knn_interpolate(q, p, f, validate=False), lambda: pcops.knn_interpolate(q, p, bad, validate=False)):
        call()
    assert taken == [True, True, False, False, True, True]  # (validate=False: plain while every row is complete)
    with pytest.raises(ValueError, match="features contains NaN or inf"):
        pcops.knn_interpolate(q, p, bad)


CHAMFER_PATHS = ("pass", "grids", "trees")


def chamfer_path(monkeypatch, path: str) -> None:
    """Chamfer's nearest points from its pass over every pair, its grids, or the kNN search's trees."""
    from pcops.ops.neighbours.nearest import _costs

    monkeypatch.setattr(_costs, "SCAN_PAIRS", 0 if path == "trees" else 1 << 40)
    monkeypatch.setattr(_costs, "GRID_PAIRS", 0 if path == "trees" else 1 << 40)
    monkeypatch.setattr(_costs, "GRID_FROM", 0 if path == "grids" else 1 << 40)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_chamfer_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """``chamfer_distance`` of two plain clouds (which may require grad) skips the layout layer:
    the same loss and per-point costs and the same gradients to both clouds, for every reduction,
    one direction or both, clouds of one shape (two kept trees of the same shapes side by side),
    and NaN points without validation (cost 0), on both sides of the kNN scan's crossover and
    with chamfer's pass over every pair, its grids or the trees."""
    q, p, _ = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    nan = q.clone()
    nan[1, 2] = float("nan")

    def run(x, y, **kw):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        out = pcops.chamfer_distance(x, y, **kw)
        loss = sum(t.nansum() for t in out) if isinstance(out, tuple) else out.sum()
        return (*(out if isinstance(out, tuple) else (out,)), *torch.autograd.grad(loss, (x, y), allow_unused=True))

    calls = [lambda: run(q, p), lambda: run(p, p), lambda: run(q, p[: q.shape[0]]), lambda: run(q[:1], p), lambda: run(q * 1e18, p * 1e18),
             lambda: run(q, p, point_reduction="sum", batch_reduction="sum"), lambda: run(q, p, point_reduction="max"),
             lambda: run(q, p, batch_reduction=None), lambda: run(q, p, point_reduction=None, batch_reduction=None),
             lambda: run(q, p, single_directional=True),
             lambda: run(q, p, single_directional=True, point_reduction=None, batch_reduction=None),
             lambda: run(nan, p, validate=False), lambda: (pcops.chamfer_distance(q, p),),
             lambda: run(q[None], p[None]), lambda: run(q[None], p[None], batch_reduction=None),
             lambda: run(q[None], p[None], point_reduction="max", batch_reduction="sum"),
             lambda: run(q[None], p[None], point_reduction=None, batch_reduction=None),
             lambda: run(q[None], p[None], single_directional=True, point_reduction=None, batch_reduction=None)]
    from pcops.ops.geometry import chamfer

    passes, sides = [], []
    real, real_both = chamfer.plain_nearest, _kdtree.find_both
    monkeypatch.setattr(chamfer, "plain_nearest", lambda *a: (lambda out: (passes.append(out is not None), out)[1])(real(*a)))
    monkeypatch.setattr(_kdtree, "find_both", lambda *a: (lambda out: (sides.append(out is not None), out)[1])(real_both(*a)))
    # the plain path's nearest points from chamfer's pass over every pair, or the two small trees
    # side by side (kNN trees), or its kNN searches one way and the other (scans)
    for path in CHAMFER_PATHS:
        chamfer_path(monkeypatch, path)
        each_pair = path != "trees"
        for pairs in PATHS.values():
            monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
            for call in calls:
                for a, b in zip(*plain_and_general(monkeypatch, call, "pcops.ops.geometry.chamfer"), strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # (the NaN point's gradient: NaN on both)
            assert any(passes) == bool(each_pair or not pairs) and any(sides) == (not each_pair and not pairs)
            passes.clear()
            sides.clear()


@pytest.mark.parametrize("shapes", [(4096, 4096, 2), (1024, 4096, 1), (1024, 4096, 2), (3000, 12000, 2)], ids=str)
def test_kept_trees_past_one_thread_equal_the_reference(gen, monkeypatch, shapes):
    """A plain search of up to 2^14 points and queries past one thread's small trees is kept with
    the general path's build launches (the root's splits, then a subtree a thread): the float64
    brute force's neighbours and the general path's distances, call after call, NaN queries and
    points included (validate=False), on one thread and two."""
    m, n, threads = shapes
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = torch.rand(n, 3, generator=gen) * 2 - 1
        query = ref if m == n else torch.rand(m, 3, generator=gen) * 2 - 1
        assert not _kdtree._small_tree(m, n)
        nearest = reference.knn(query.double(), ref.double(), 16)[1]  # (sorted, ties by the smaller index)
        for k in (1, 16):
            want = nearest[:, :k]
            general = None
            for kept in (False, True, True):
                monkeypatch.setattr(_warp, "PREPARED", [kept])
                got = pcops.knn(query, ref, k)
                assert torch.equal(got[1], want)
                general = got if general is None else general
                assert torch.equal(got[0], general[0])
            plan = _kdtree._kept_plan(query, ref, k)
            assert plan is not None and len(plan.launches[2]) == (1 if threads == 1 else 2)
        bad_ref, bad_query = ref.clone(), query.clone()
        bad_ref[5], bad_query[7, 1] = float("nan"), float("inf")
        for q in (bad_query, bad_ref):
            out = []
            for kept in (False, True, True):
                monkeypatch.setattr(_warp, "PREPARED", [kept])
                out.append(pcops.knn(q, bad_ref, 8, validate=False))
            assert all(torch.equal(a, b) for o in out[1:] for a, b in zip(o, out[0], strict=True))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("shapes", [(3500, 4000), (8000, 8384), (8000, 8385), (200, 12000)], ids=str)
def test_chamfer_trees_side_by_side_up_to_their_bound_equal_the_reference(gen, monkeypatch, shapes):
    """Past one thread's small trees, chamfer's two searches still run as kept trees side by side
    (a thread each) while both clouds together hold at most 2^14 points: the same nearest points
    as a float64 brute force and the same loss and gradients as the general path; past that bound
    each search runs as before."""

    m, n = shapes
    x = torch.rand(m, 3, generator=gen) * 2 - 1
    y = torch.rand(n, 3, generator=gen) * 2 - 1
    pcops.chamfer_distance(x, y)  # (the kernels' first run)
    _kdtree.find_both(x, y, 1)  # (made on the shapes' second sighting: pcops._warp.Kept.admit)
    found = _kdtree.find_both(x, y, 1)
    assert (found is not None) == (m + n <= 1 << 14) and not _kdtree._small_tree(m, n)
    if found is not None:
        assert not found[2]
        for a, b, idx in ((x, y, found[0]), (y, x, found[1])):
            assert torch.equal(idx, reference.knn(a.double(), b.double(), 1)[1])

    def run():
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        loss = pcops.chamfer_distance(a, b)
        return (loss, *torch.autograd.grad(loss, (a, b)))

    chamfer_path(monkeypatch, "trees")
    for a, b in zip(*plain_and_general(monkeypatch, run, "pcops.ops.geometry.chamfer"), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_chamfer_costs_from_one_launch_equal_the_torch_formula(gen, monkeypatch, kind, dtype):
    """A plain call with nothing to differentiate takes its costs from one Warp launch (the
    nearest points found in it, or by the kNN search above its crossover): the same loss and
    per-point costs bit for bit as the torch formula on the search's indices and as the general
    path, for every reduction, one direction or both, ties, points whose squares overflow, and NaN
    or infinite points without validation (cost 0), on each side of both crossovers."""
    from pcops.ops.geometry import chamfer
    from pcops.ops.neighbours.nearest import _costs

    q, p, _ = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    nan, inf = q.clone(), p.clone()
    nan[1, 2] = float("nan")
    inf[[0, 3], 1] = float("inf")
    tied = torch.cat([p[:3], p[:3]])  # every point twice: ties by the smaller index
    kw = [{}, dict(point_reduction="sum", batch_reduction="sum"), dict(point_reduction="max"), dict(batch_reduction=None),
          dict(point_reduction=None, batch_reduction=None), dict(single_directional=True),
          dict(single_directional=True, point_reduction=None, batch_reduction=None)]
    calls = [lambda k=k, x=x, y=y: pcops.chamfer_distance(x, y, **k) for k in kw for x, y in ((q, p), (q[None], p[None]), (p, tied))]
    calls += [lambda: pcops.chamfer_distance(q[:1], p[:1]), lambda: pcops.chamfer_distance(q * 1e25, -p * 1e25, point_reduction=None, batch_reduction=None),
              lambda: pcops.chamfer_distance(nan, inf, validate=False, point_reduction=None, batch_reduction=None),
              lambda: pcops.chamfer_distance(q[::2], p.t().contiguous().t())]
    taken = []
    monkeypatch.setattr(chamfer, "nearest_costs", lambda *a: (taken.append(1), _costs.costs(*a))[1])
    for path in CHAMFER_PATHS:
        chamfer_path(monkeypatch, path)
        for pairs in PATHS.values():
            monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
            for call in calls:
                outs = []
                for kernel, plain in ((True, True), (False, True), (False, False)):
                    monkeypatch.setattr(chamfer, "KERNEL", [kernel])
                    monkeypatch.setattr(chamfer, "PLAIN", [plain])
                    out = call()
                    outs.append(out if isinstance(out, tuple) else (out,))
                for other in outs[1:]:
                    for a, b in zip(outs[0], other, strict=True):
                        assert a.dtype == b.dtype and a.shape == b.shape
                        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert len(taken) == 2 * len(CHAMFER_PATHS) * len(calls)  # (each call took the launch once a turn)


@pytest.mark.parametrize("blocks", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_chamfer_pass_over_every_pair_finds_the_knn_search_points(gen, monkeypatch, blocks, dtype):
    """Chamfer's pass over every pair, its points of x cut into blocks (each keeping its nearest
    point of every point of y, merged in block order), finds each point's nearest point of the
    other cloud as the kNN search does: ties (duplicates in different blocks, a grid's equal
    distances) by the smaller index, none (-1) for NaN or infinite points and where every
    squared distance overflows; both directions and one, four points of x at a time (sizes
    that are not multiples of four), as many threads as blocks (at least two: the pass makes no
    more blocks than threads), y's points a vector of lanes at a time (lengths about the lanes'
    widths: the lanes' merge and the points past the last whole vector)."""
    from pcops.ops.neighbours.nearest import _costs

    monkeypatch.setattr(_costs, "GRID_FROM", 1 << 40)  # (the pass at every size here, grids none)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, blocks))
    try:
        monkeypatch.setattr(_costs, "BLOCKS", 1 if blocks > 1 else 8)  # (launches of these shapes with other blocks, kept: not taken)
        for _ in range(2):
            _costs.pairs(torch.rand(181, 3, generator=gen, dtype=dtype), torch.rand(183, 3, generator=gen, dtype=dtype), True)
        monkeypatch.setattr(_costs, "BLOCKS", blocks)
        for m, n in ((181, 183), (255, 130), (3, 6000), (1, 1), (7, 5), (9, 3), (17, 4), (5, 8), (6, 9), (11, 17), (13, 33)):
            base = torch.rand(m, 3, generator=gen, dtype=dtype)
            for kind in ("uniform", "grid", "duplicates", "not finite", "overflow"):
                x, y = base.clone(), torch.rand(n, 3, generator=gen, dtype=dtype)
                if kind == "grid":
                    x, y = (x * 4).floor(), (y * 4).floor()
                elif kind == "duplicates":  # every point of y twice, x holding both copies far apart
                    y = torch.cat([y, y])[:n]
                    x = torch.cat([y, x])[:m].flip(0).contiguous()
                elif kind == "not finite":
                    x[::3, 1] = float("nan")
                    y[::4, 0] = float("inf")
                elif kind == "overflow":
                    big = 1e19 if dtype == torch.float32 else 1e154
                    x, y = x * big, -y * big
                for both in (True, False):
                    ix, iy, cx, cy = _costs.pairs(x, y, both, False)
                    want = pcops.knn(x, y, 1, validate=False).idx[:, 0]
                    assert torch.equal(ix, want)
                    unmatched = torch.where(torch.isfinite(x).all(-1), float("inf"), 0.0).to(dtype)
                    assert torch.equal(cx, torch.where(want >= 0, ((x - y[want.clamp(min=0)]) ** 2).sum(-1), unmatched))
                    if both:
                        want = pcops.knn(y, x, 1, validate=False).idx[:, 0]
                        assert torch.equal(iy, want)
                    else:
                        assert iy is None and cy is None
                if kind == "not finite":
                    assert _costs.pairs(x, y, True, True) is None and _costs.pairs(base, y, False, True) is None
    finally:
        torch.set_num_threads(threads)


GRID_KINDS = ("uniform", "grid", "duplicates", "not finite", "none finite", "overflow", "flat", "line", "one point", "clustered",
              "far apart", "huge", "tiny")


def grid_case(kind: str, m: int, n: int, gen, dtype):
    """Clouds (m, 3) and (n, 3) of a kind that a grid of cells may get wrong: ties on a lattice,
    duplicates, NaN and inf (in some points, or in every point of y), squares that overflow (no
    neighbour to take: every column visited), a plane and a line (extents of zero), one
    repeated point, tight clusters, two groups far apart (empty columns between), coordinates
    whose box overflows, and subnormal coordinates."""
    x, y = torch.rand(m, 3, generator=gen, dtype=dtype), torch.rand(n, 3, generator=gen, dtype=dtype)
    big = 1e19 if dtype == torch.float32 else 1e154
    if kind == "grid":
        x, y = (x * 4).floor(), (y * 4).floor()
    elif kind == "duplicates":  # every point of y twice, x holding copies of y's
        y = torch.cat([y, y])[:n]
        x = torch.cat([y, x])[:m].flip(0).contiguous()
    elif kind == "not finite":
        x[::3, 1] = float("nan")
        y[::4, 0] = float("inf")
        y[1::5, 2] = float("nan")
    elif kind == "none finite":
        y[:, 1] = float("nan")
    elif kind == "overflow":
        x, y = x * big, -y * big
    elif kind == "flat":
        x[:, 2], y[:, 2] = 0.5, 0.5
    elif kind == "line":
        x[:, 1:], y[:, 1:] = 0.25, 0.25
    elif kind == "one point":
        x, y = torch.full_like(x, 0.5), torch.full_like(y, 0.5)
    elif kind == "clustered":
        x, y = (x * 4).floor() + x * 1e-3, (y * 4).floor() + y * 1e-3
    elif kind == "far apart":
        x[: m // 2] += 1000
        y[n // 2:] -= 1000
    elif kind == "huge":
        top = torch.finfo(dtype).max / 2
        x, y = (x - 0.5) * top, (y - 0.5) * top
    elif kind == "tiny":
        x, y = x * torch.finfo(dtype).tiny, y * torch.finfo(dtype).tiny
    return x, y


@pytest.mark.parametrize("points", [1, 6, 64])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_chamfer_grids_find_the_pass_points(gen, monkeypatch, points, dtype):
    """From GRID_FROM pairs chamfer's nearest points come from a grid of each cloud (a thread a
    direction) instead of the pass over every pair: the same nearest points (the kNN search's:
    ties by the smaller index, none for NaN or inf points or where every square overflows) and
    the same costs bit for bit as the pass, for clouds a grid may get wrong, unequal and tiny
    shapes, columns of one point up to many, one direction or both; NaN and inf flagged when
    checked."""
    from pcops.ops.neighbours.nearest import _costs

    monkeypatch.setattr(_costs, "GRID_POINTS", points)
    for m, n in ((181, 183), (255, 130), (3, 6000), (1, 1), (7, 5), (1, 40), (700, 900)):
        for kind in GRID_KINDS:
            x, y = grid_case(kind, m, n, gen, dtype)
            for both in (True, False):
                found = []
                for grid_from in (0, 1 << 40):
                    monkeypatch.setattr(_costs, "GRID_FROM", grid_from)
                    found.append(_costs.pairs(x, y, both, False))
                for a, b in zip(*found, strict=True):
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
                assert torch.equal(found[0][0], pcops.knn(x, y, 1, validate=False).idx[:, 0])
                if both:
                    assert torch.equal(found[0][1], pcops.knn(y, x, 1, validate=False).idx[:, 0])
            monkeypatch.setattr(_costs, "GRID_FROM", 0)
            finite = bool(torch.isfinite(x).all() and torch.isfinite(y).all())
            for both in (True, False):
                assert (_costs.pairs(x, y, both, True) is None) == (not finite)
    # (the kept launches are grids of this many points a column, not of an earlier parametrisation's)
    assert any(key[0][0] == "chamfer_grid" and key[0][-1] == points for key in _warp.KEPT.keys())


def test_chamfer_grids_take_the_pairs_between_their_crossovers(gen, monkeypatch):
    """Both directions of two clouds take the grids from GRID_FROM pairs up to GRID_PAIRS with at
    most GRID_KEPT points together, one direction up to SCAN_PAIRS; beyond, the trees: the loss
    and gradients on each side of every bound equal the float64 brute force's nearest points."""
    from pcops.ops.neighbours.nearest import _costs

    taken = []
    real = _costs._grid_nearest
    monkeypatch.setattr(_costs, "_grid_nearest", lambda *a: (taken.append(a[0].shape[0] * a[1].shape[0]), real(*a))[1])
    side = int(_costs.GRID_FROM**0.5)
    most, kept = int(_costs.GRID_PAIRS**0.5), _costs.GRID_KEPT
    for m, n, single, grid in ((side, side - 1, False, False), (side, side, False, True), (256, 256, True, True), (257, 256, True, False),
                               (most, most, False, True), (most, most + 1, False, False), (100, kept - 100, False, True),
                               (100, kept - 99, False, False)):
        x = torch.rand(m, 3, generator=gen, dtype=F64)
        y = torch.rand(n, 3, generator=gen, dtype=F64)
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        loss = pcops.chamfer_distance(a, b, single_directional=single, point_reduction="sum")
        grads = torch.autograd.grad(loss, (a, b), allow_unused=True)
        assert bool(taken) == grid, (m, n)
        taken.clear()
        ix = reference.knn(x, y, 1)[1][:, 0]
        want = ((x - y[ix]) ** 2).sum()
        if not single:
            iy = reference.knn(y, x, 1)[1][:, 0]
            want = want + ((y - x[iy]) ** 2).sum()
        torch.testing.assert_close(loss, want)
        assert grads[0] is not None


@pytest.mark.parametrize("shape", [(181, 181), (16, 2048), (2048, 16), (20000, 17000)], ids=str)
def test_chamfer_costs_launch_cut_into_chunks_equals_the_torch_formula(gen, monkeypatch, shape):
    """The costs' launch on two threads (two chunks: the pass over every pair in blocks from 2^14
    pairs, the costs from the search's indices from 2^15 points in all) gives the torch formula's
    per-point costs bit for bit, both dtypes."""
    from pcops.ops.geometry import chamfer

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype in (torch.float32, F64):
            x = torch.rand(shape[0], 3, generator=gen, dtype=dtype)
            y = torch.rand(shape[1], 3, generator=gen, dtype=dtype)
            outs = []
            for kernel in (True, False):
                monkeypatch.setattr(chamfer, "KERNEL", [kernel])
                outs.append(pcops.chamfer_distance(x, y, point_reduction=None, batch_reduction=None))
            for a, b in zip(*outs, strict=True):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_chamfer_costs_kept_plans_equal_the_pass_for_sizes_in_turn(gen, monkeypatch, dtype):
    """A chamfer call's kept plan (the grids' or the pass's launch, its index work arrays, kept
    for a range of sizes) runs the same launch as a call that decides anew: sizes of one range in
    turn (each call sets its own sizes), one direction or both, one padded sample (1, P, 3) or
    (P, 3), views at an offset, give the pass's costs bit for bit; NaN and inf still flagged
    where checked; and once kept, no call decides anew."""
    from pcops.ops.geometry import chamfer
    from pcops.ops.neighbours.nearest import _costs

    sizes = [(256, 250), (200, 256), (7, 9), (40, 33)]  # (the grids' range twice, the pass's twice)
    clouds = {mn: [torch.rand(k + 1, 3, generator=gen, dtype=dtype)[1:] for k in mn] for mn in sizes}  # (views at an offset)
    for turn in range(4):
        for (m, n), (x, y) in clouds.items():
            for both in (True, False):
                for one in (False, True):
                    got = _costs.costs(x[None] if one else x, y[None] if one else y, both, True)
                    monkeypatch.setattr(_costs, "GRID_FROM", 1 << 40)
                    want = _costs.pairs(x, y, both)[2:]
                    monkeypatch.undo()
                    assert torch.equal(got[0], want[0]) and (got[1] is None) == (not both)
                    if both:
                        assert torch.equal(got[1], want[1])
                    if turn == 3:
                        bad = y.clone()
                        bad[n // 2, 1] = float("nan")
                        assert _costs.costs(x, bad, both, True) is None
                        assert torch.equal(_costs.costs(x, bad, both, False)[0], _costs.pairs(x, bad, both)[2])
        if turn == 1:  # every plan kept by now: nothing decided anew from here
            kept = [key for key in _warp.KEPT.keys() if key[0] == "chamfer_costs"]
            ranges = {_costs._plan_key(m, n, dtype, both) for m, n in sizes for both in (True, False)}
            assert set(kept) == ranges and len(ranges) == 6  # (a plan a range of sizes and direction count: (256, 250) and (200, 256) share one; the one-padded calls too)
            monkeypatch.setattr(_costs, "pairs", lambda *a, **k: pytest.fail("decided anew"))
            for (x, y) in clouds.values():
                chamfer.chamfer_distance(x[None], y[None])
            monkeypatch.undo()


def test_plain_chamfer_calls_and_others(gen, monkeypatch):
    """Which chamfer calls are plain (the layout layer never runs for them), and bad values still
    raise the general path's errors."""
    from pcops.ops.geometry import chamfer

    taken = []
    real = chamfer._plain
    monkeypatch.setattr(chamfer, "_plain", lambda *a: (lambda out: (taken.append(out is not None), out)[1])(real(*a)))
    x, y = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen)
    pcops.chamfer_distance(x, y)
    pcops.chamfer_distance(x.clone().requires_grad_(), y)
    pcops.chamfer_distance(x, x, single_directional=True)
    pcops.chamfer_distance(x[None], y[None])  # one padded sample each
    assert taken == [True, True, True, True]
    for call in (lambda: pcops.chamfer_distance(x.double(), y), lambda: pcops.chamfer_distance(x.half(), y.half()),
                 lambda: pcops.chamfer_distance(x.expand(2, 30, 3), y.expand(2, 40, 3)), lambda: pcops.chamfer_distance(x[:0], y),
                 lambda: pcops.chamfer_distance(x, y, backend="torch"), lambda: pcops.chamfer_distance(x, y[:0]),
                 lambda: pcops.chamfer_distance(x[None], y[None], x_lengths=torch.tensor([30]))):
        call()
    assert taken == [True] * 4 + [False] * 6  # (the call with lengths never reached the plain function)
    bad = y.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="y contains NaN or inf"):
        pcops.chamfer_distance(x, bad)
    with pytest.raises(ValueError, match="point_reduction"):
        pcops.chamfer_distance(x, y, point_reduction="median")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (16, 16), (9, 40), (40, 9), (181, 181), (300, 300), (300, 260)], ids=str)
def test_values_checked_in_the_small_searches_raise_for_every_point(gen, dtype, shape):
    """The plain kNN calls and chamfer's small clouds check the values in their scans or small
    trees (a flag the launches set; chamfer's two trees side by side from 300 x 260 points): a
    NaN, inf or -inf at any point of either cloud raises the error naming it, on
    the first call of the shapes (the checks in torch) and once the launch is prepared (the
    flag), itself or the other cloud, and a finite call after one that raised gets the float64
    reference: the flag does not stay set."""
    m, n = shape
    x, y = torch.rand(m, 3, generator=gen, dtype=dtype), torch.rand(n, 3, generator=gen, dtype=dtype)
    k = min(3, n)
    d2 = torch.cdist(x.double(), y.double()).square()
    for value in (float("nan"), float("inf"), -float("inf")):
        for which, rows in (("x", m), ("y", n)):
            for row in sorted({0, rows // 2, rows - 1}):
                bad = (x if which == "x" else y).clone()
                bad[row, row % 3] = value
                a, b = (bad, y) if which == "x" else (x, bad)
                with pytest.raises(ValueError, match=f"{'query' if which == 'x' else 'ref'} contains NaN or inf"):
                    pcops.knn(a, b, k)
                if which == "y" and m == n:
                    with pytest.raises(ValueError, match="query contains NaN or inf"):
                        pcops.knn(bad, bad, k)
                with pytest.raises(ValueError, match=f"{which} contains NaN or inf"):
                    pcops.chamfer_distance(a, b)
                with pytest.raises(ValueError, match=f"{which} contains NaN or inf"):
                    pcops.chamfer_distance(a, b, single_directional=True)
                found = pcops.knn(x, y, k)
                torch.testing.assert_close(found.dists.double().square(), d2.gather(1, found.idx), rtol=1e-5, atol=1e-6)
                assert torch.equal(found.idx[:, 0], d2.argmin(1))
                expected = d2.amin(1).mean() + d2.amin(0).mean()
                torch.testing.assert_close(pcops.chamfer_distance(x, y).double(), expected, rtol=1e-5, atol=1e-7)


def test_small_plain_searches_read_no_sums(gen, monkeypatch):
    """The values of a plain kNN call whose search is a kept scan or tree (16, 400 and 5,000
    points), and of chamfer calls by its pass (16 points) or its grids (400 points with itself),
    are checked by their launches alone (no torch sum read back); those of a chamfer call of a
    cloud with itself past the grids and of a kNN search past the kept trees (m + n over 2^14)
    by the layout's sums."""
    from pcops import _validate

    x, y = torch.rand(16, 3, generator=gen), torch.rand(16, 3, generator=gen)
    large, kept, larger = (torch.rand(n, 3, generator=gen) for n in (400, 5000, 8193))
    calls = (lambda: pcops.knn(x, y, 4), lambda: pcops.knn(x, x, 4), lambda: pcops.chamfer_distance(x, y), lambda: pcops.knn_graph(x, 3),
             lambda: pcops.knn(large, large, 4), lambda: pcops.knn(large, x, 4), lambda: pcops.knn(kept, kept, 4),
             lambda: pcops.chamfer_distance(large, large))
    for _ in range(2):  # (each kernel's first run, through the general path; the plans made on the shapes' second sighting)
        for call in calls:
            call()
    read = []
    real = _validate.sum_is_finite
    monkeypatch.setattr(_validate, "sum_is_finite", lambda t: (read.append(t.shape[0]), real(t))[1])
    for _ in range(2):
        for call in calls:
            call()
    assert read == []
    pcops.chamfer_distance(larger, larger)
    pcops.knn(larger, larger, 4)
    assert read == [8193, 8193]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_plain_fps_checks_its_values_in_its_launch(gen, monkeypatch, dtype):
    """A plain FPS call with the default start or one index in range of up to CHECK_IN_LAUNCH
    points has its points' values checked by its prepared launch (no torch sum read back; its
    first call by the sums), and a
    NaN, inf or -inf anywhere (Morton and kd-tree leaves, one leaf) still raises the general
    path's error, on the first call and later ones, and the next finite call picks as before;
    the other starts (a list, a random start) sum first."""
    from pcops import _validate
    from pcops.ops.sampling import fps

    read = []
    real = _validate.sum_is_finite
    monkeypatch.setattr(_validate, "sum_is_finite", lambda t: (read.append(t.shape[0]), real(t))[1])
    for n, s in ((16, 4), (300, 20), (300, 200), (2000, 50)):
        p = torch.rand(n, 3, generator=gen, dtype=dtype)
        want = pcops.farthest_point_sample(p, s, validate=False).idx
        for value in (float("nan"), float("inf"), -float("inf")):
            for row in sorted({0, 1, n // 2, n - 1}):
                bad = p.clone()
                bad[row, row % 3] = value
                for start in (None, 0, n - 1):
                    with pytest.raises(ValueError, match="points contains NaN or inf"):
                        pcops.farthest_point_sample(bad, s, start_idx=start)
                assert torch.equal(pcops.farthest_point_sample(p, s).idx, want)
        read.clear()
        pcops.farthest_point_sample(p, s), pcops.farthest_point_sample(p, s, start_idx=n // 3)
        assert read == ([] if n <= fps.CHECK_IN_LAUNCH else [n, n])  # (larger clouds: the sums cost less)
        read.clear()
        pcops.farthest_point_sample(p, s, start_idx=[1, 2]), pcops.farthest_point_sample(p, s, random_start=True)
        assert read == [n, n]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_radius_aggregate_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager call below the crossover runs the forward kernel directly (no layout layer,
    no custom op, no cell list tensors): the same values bit for bit, for every weighting,
    features padded to whole blocks or not, without validation on non-finite points."""
    q, p, r = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    f5, f8 = (torch.rand(p.shape[0], c, generator=gen, dtype=dtype) for c in (5, 8))
    bad = p.clone()
    bad[3] = float("nan")
    bad[4, 1] = float("inf")
    calls = [lambda: pcops.radius_aggregate(q, p, f5, r, 0.2), lambda: pcops.radius_aggregate(q, p, f8, r, 1),
             lambda: pcops.radius_aggregate(p, p, f5, r, weights="inverse_distance"),
             lambda: pcops.radius_aggregate(q, p, f8, r, weights="uniform"), lambda: pcops.radius_aggregate(q, bad, f5, r, 0.1, validate=False)]
    for call in calls:
        assert_identical(*plain_and_general(monkeypatch, lambda: (call(),), "pcops.ops.neighbours.radius"))


def test_plain_radius_aggregate_calls_skip_the_op_and_others_do_not(gen, monkeypatch):
    ops = []
    real = radius._radius_aggregate
    monkeypatch.setattr(radius, "_radius_aggregate", lambda *a: (ops.append(a), real(*a))[1])
    q, p, f = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen), torch.rand(40, 6, generator=gen)
    for call in (lambda: pcops.radius_aggregate(q, p, f, 0.3, 0.1), lambda: pcops.radius_aggregate(q.double(), p.double(), f.double(), 0.3, 2),
                 lambda: pcops.radius_aggregate(q, p, f, 0.3, weights="uniform")):
        call()
    with torch.no_grad():
        pcops.radius_aggregate(q, p, f.clone().requires_grad_(), 0.3, 0.1)  # nothing to differentiate
    assert ops == []
    side = int(radius.SCAN_PAIRS**0.5) + 1
    large = torch.rand(side, 3, generator=gen)
    general = [
        lambda: pcops.radius_aggregate(q, p, f.clone().requires_grad_(), 0.3, 0.1),  # a gradient to record
        lambda: pcops.radius_aggregate(q, p, f, 0.3, torch.tensor(0.1)),  # sigma a tensor
        lambda: pcops.radius_aggregate(q, p, f.double(), 0.3, 0.1),  # mixed dtypes
        lambda: pcops.radius_aggregate(q.half(), p.half(), f.half(), 0.3, 0.1),  # in float32
        lambda: pcops.radius_aggregate(q[None], p[None], f[None], 0.3, 0.1),  # padded
        lambda: pcops.radius_aggregate(q, p, f, 0.3, 0.1, query_batch=torch.zeros(30, dtype=torch.int64), ref_batch=torch.zeros(40, dtype=torch.int64)),
        lambda: pcops.radius_aggregate(q, p, f, np.float32(0.3), 0.1),  # radius not a Python number
        lambda: pcops.radius_aggregate(large, large, torch.rand(side, 2, generator=gen), 0.05, 0.1),  # above the crossover
        lambda: pcops.radius_aggregate(q, p, f, 0.3, 1e-50),  # sigma 0 in float32: the general path's error
    ]
    for n, call in enumerate(general, 1):
        if n == len(general):
            with pytest.raises(ValueError, match="sigma must be finite and > 0 in torch.float32"):
                call()
        else:
            call()
            assert len(ops) == n
    bad = f.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="features contains NaN or inf"):
        pcops.radius_aggregate(q, p, bad, 0.3, 0.1)
    assert len(ops) == len(general) - 1  # the layout layer's check raised: the op never ran


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("kind", CLOUDS)
def test_plain_estimate_normals_calls_equal_the_general_path(gen, monkeypatch, kind, dtype):
    """A plain eager call (one cloud, nothing to differentiate, no viewpoint) takes the plain kNN
    search and the normals kernel directly: the same normals bit for bit, on both sides of the
    scan's crossover, NaN points without validation included."""
    _, p, _ = cloud(kind, gen)
    p = p.to(dtype)
    bad = p.clone()
    bad[2, 1] = float("nan")
    calls = [lambda: pcops.estimate_normals(p, 3), lambda: pcops.estimate_normals(p, 16), lambda: pcops.estimate_normals(p, p.shape[0]),
             lambda: pcops.estimate_normals(p[::2], 5), lambda: pcops.estimate_normals(bad, 6, validate=False)]
    for pairs in PATHS.values():
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for call in calls:
            assert_identical(*plain_and_general(monkeypatch, lambda: (call(),), "pcops.ops.geometry.normals"))


def test_plain_estimate_normals_calls_skip_the_layout_and_others_do_not(gen, monkeypatch):
    normals = importlib.import_module("pcops.ops.geometry.normals")
    searches = []
    real = normals.search
    monkeypatch.setattr(normals, "search", lambda *a: (searches.append(1), real(*a))[1])
    p = torch.rand(40, 3, generator=gen)
    pcops.estimate_normals(p, 8)
    pcops.estimate_normals(p.double(), 3, validate=False)
    assert searches == []
    general = [
        lambda: pcops.estimate_normals(p.clone().requires_grad_(), 8),  # a gradient to record
        lambda: pcops.estimate_normals(p, 8, orient_to=torch.zeros(3)),  # a viewpoint
        lambda: pcops.estimate_normals(p[None], 8),  # padded
        lambda: pcops.estimate_normals(p, 8, batch=torch.zeros(40, dtype=torch.int64)),  # packed
        lambda: pcops.estimate_normals(p.half(), 8),  # in float32
        lambda: pcops.estimate_normals(p, np.int64(8)),  # k not a Python int
    ]
    for n, call in enumerate(general, 1):
        call()
        assert len(searches) == n
    bad = p.clone()
    bad[1, 1] = float("inf")
    with pytest.raises(ValueError, match="points contains NaN or inf"):
        pcops.estimate_normals(bad, 8)


def test_plain_calls_where_distances_overflow_equal_the_general_path(monkeypatch):
    """Finite float32 points whose squared distances overflow to inf (a search row cut short,
    -1) pass validation: the plain paths of chamfer, knn_aggregate (every weighting),
    estimate_normals and knn_graph give the general path's results there too, not an error
    (nor, for knn_graph, edges to -1)."""
    x = torch.tensor([[3e38, 0.0, 0.0], [1.0, 2.0, 3.0]])
    y = torch.tensor([[-3e38, 0.0, 0.0], [0.0, 1.0, 0.0]])
    p = torch.cat([x, y])
    f = torch.rand(2, 3, generator=torch.Generator().manual_seed(0))
    calls = {"pcops.ops.geometry.chamfer": [lambda: (pcops.chamfer_distance(x[:1], y[:1]),), lambda: pcops.chamfer_distance(x, y, point_reduction=None, batch_reduction=None)],
             "pcops.ops.neighbours.nearest": [lambda: (pcops.knn_aggregate(x, y, f, 2, weights=w, sigma=s),)
                                              for w, s in (("uniform", None), ("softmax", 0.5), ("inverse_distance", None))],
             "pcops.ops.geometry.normals": [lambda: (pcops.estimate_normals(p, 4),)],
             "pcops.ops.neighbours.graph": [lambda loop=loop: (pcops.knn_graph(p, 2, loop=loop),) for loop in (False, True)]}
    for module, fns in calls.items():
        for call in fns:
            for a, b in zip(*plain_and_general(monkeypatch, call, module), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_prepared_normals_follow_the_callers_strides(gen, monkeypatch):
    """The normals take the strides of the caller's points (a transposed cloud's too): a launch
    kept for a contiguous cloud is not reused for them."""
    t = torch.randn(3, 40, generator=gen).t()
    for points in (t.contiguous(), t, t.contiguous(), t):
        got = pcops.estimate_normals(points, 8)
        monkeypatch.setattr(_warp, "PREPARED", [False])
        want = pcops.estimate_normals(points, 8)
        monkeypatch.setattr(_warp, "PREPARED", [True])
        assert got.stride() == want.stride() and torch.equal(got, want)


def test_prepared_launches_follow_each_calls_tensors(gen, monkeypatch):
    """Small kNN scans and trees, dense ball queries, plain knn_graph edges and plain FPS calls
    reuse the calling thread's packed launch of their shapes (:class:`pcops._warp.Prepared`): each call's
    clouds and outputs, never the last call's, with shapes, dtypes and start sets alternating,
    serial and chunked launches, the kept launches evicted and FPS's shared work arrays taken
    over by other shapes in between."""
    runs = []
    real = _warp.Prepared.run_at
    monkeypatch.setattr(_warp.Prepared, "run_at", lambda self, *a: (runs.append((self.kernel.key, self._chunks)), real(self, *a)))
    # (300 points: 90,000 pairs, a launch cut into a chunk per thread, run by the native fork-join)
    clouds = [torch.rand(n, 3, generator=gen, dtype=dtype) for n in (40, 40, 90, 300) for dtype in (torch.float32, F64)]
    monkeypatch.setattr(_warp._threads, "available", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _prepared_calls(gen, monkeypatch, clouds)
    finally:
        torch.set_num_threads(threads)
    assert all(any(name in key for key, _ in runs) for name in ("scan", "sample", "search", "edge_rows", "build", "order", "forward", "normals"))
    assert {chunks for _, chunks in runs} == {1, 2}


def _prepared_calls(gen, monkeypatch, clouds):
    """The calls of :func:`test_prepared_launches_follow_each_calls_tensors`, each compared with
    the float64 reference or with the same call packed anew (or through the general path)."""
    from pcops.ops.sampling import fps

    # every launch kept (made on the second pass, reused on the third), then evicted; then the
    # small trees (every kNN search a tree) kept and reused
    _warp.KEPT.clear()
    for keep, pairs in ((256, _kdtree.SCAN_PAIRS),) * 3 + ((3, _kdtree.SCAN_PAIRS),) + ((256, 0),) * 3:
        monkeypatch.setattr(_warp.KEPT, "most", keep)
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for c in clouds:
            q = torch.rand(17, 3, generator=gen, dtype=c.dtype)
            for query, k in ((q, 3), (c, 5)):
                got = pcops.knn(query, c, k)
                want_d, want_idx = reference.knn(query.double(), c.double(), k)
                assert torch.equal(got.idx, want_idx)
                torch.testing.assert_close(got.dists.double(), want_d, rtol=1e-6, atol=1e-6)
            f = torch.rand(c.shape[0], 9, generator=gen, dtype=c.dtype)
            for call in (lambda: pcops.ball_query(q, c, 0.3, 8), lambda: pcops.ball_query(c, c, 0.5, 5), lambda: pcops.knn_graph(c, 6),
                         lambda: pcops.ball_queries(q, c, [0.5, 0.3], [5, 8]), lambda: pcops.radius_aggregate(q, c, f, 0.3, 0.1),
                         lambda: pcops.radius_aggregate(c, c, f[:, :8], 0.2, weights="uniform"), lambda: pcops.estimate_normals(c, 7)):
                got = call()
                monkeypatch.setattr(_warp, "PREPARED", [False])
                want = call()
                monkeypatch.setattr(_warp, "PREPARED", [True])
                for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
                    assert torch.equal(a, b)
            for start in (0, 7, [3, 11]):
                got = pcops.farthest_point_sample(c, 12, start_idx=start)
                monkeypatch.setattr(fps, "PLAIN", [False])
                want = pcops.farthest_point_sample(c, 12, start_idx=start)
                monkeypatch.setattr(fps, "PLAIN", [True])
                assert torch.equal(got.idx, want.idx) and torch.equal(got.points, want.points)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_kept_dense_ball_searches_write_every_row_whole(gen, monkeypatch, dtype):
    """A kept dense ball search (every pair of a small cloud, each call after the first)
    allocates its outputs without a fill, its kernel writing -1 / inf past each row's
    neighbours: ball_query, ball_queries (one radius group's columns side by side, and two
    groups) and the by-index search equal the launches packed per call (filled first), with
    ``validate=False`` on NaN and inf points too, before and after calls whose rows were full;
    and the finite calls equal the float64 reference's neighbours and counts."""
    from pcops.ops.neighbours import _ball_search

    p, q = torch.rand(60, 3, generator=gen, dtype=dtype), torch.rand(25, 3, generator=gen, dtype=dtype)
    bad_p, bad_q = p.clone(), q.clone()
    bad_p[::4] = float("nan")
    bad_p[1::4, 1] = float("inf")
    bad_q[3], bad_q[9, 0] = float("nan"), -float("inf")
    calls = [lambda a, b: pcops.ball_query(a, b, 0.3, 7, validate=False), lambda a, b: pcops.ball_query(a, b, 2.0, 40, validate=False),
             lambda a, b: pcops.ball_queries(a, b, [0.2, 0.35], [4, 9], validate=False),
             lambda a, b: pcops.ball_queries(a, b, [0.1, 0.5], [3, 12], validate=False),
             lambda a, b: torch.ops.pcops.ball_query_by_index(a, b, 0.3, 6, False, None, None)]
    for call in calls:
        for query, ref in ((p, p), (q, p), (bad_p, bad_p), (bad_q, bad_p), (q, p), (bad_q, p), (p, p)):
            assert query.shape[0] * ref.shape[0] <= _ball_search.SCAN_PAIRS
            for _ in range(2):
                got = call(query, ref)
                monkeypatch.setattr(_warp, "PREPARED", [False])
                want = call(query, ref)
                monkeypatch.setattr(_warp, "PREPARED", [True])
                assert_identical(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))
    for query in (p, q):
        d = torch.cdist(query.double(), p.double())
        got = pcops.ball_query(query, p, 0.3, 7)
        within = d <= 0.3
        assert torch.equal(got.counts, within.sum(1))
        order = torch.where(within, d, float("inf")).sort(dim=1, stable=True)
        want = torch.where(order.values[:, :7].isfinite(), order.indices[:, :7], -1)
        assert torch.equal(got.idx, want)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_kept_small_trees_write_every_row_whole(gen, monkeypatch, dtype):
    """A kept small tree (every call of its shapes after the first) allocates its outputs
    without a fill: with ``validate=False`` the rows that a NaN or inf query, or too few finite
    points, cut short hold inf / -1 past what was found, as the general path's (launches packed
    per call), in a cloud searched in itself and in another, before and after calls whose rows
    were full; and finite calls equal the float64 reference."""
    p, q = torch.rand(300, 3, generator=gen, dtype=dtype), torch.rand(200, 3, generator=gen, dtype=dtype)
    bad_p, bad_q = p.clone(), q.clone()
    bad_p[::3] = float("nan")  # (100 finite points of 300: rows of k = 150 cut short)
    bad_p[1::3, 0] = float("inf")
    bad_q[5], bad_q[7, 2] = float("nan"), -float("inf")
    k = 150
    assert not _kdtree._scans(300, 300, k) and _kdtree._small_tree(300, 300)
    for query, ref in ((p, p), (q, p), (bad_p, bad_p), (bad_q, bad_p), (p, p), (bad_q, p), (q, p), (bad_p, bad_p)):
        for _ in range(2):
            got = pcops.knn(query, ref, k, validate=False)
            monkeypatch.setattr(_warp, "PREPARED", [False])
            want = pcops.knn(query, ref, k, validate=False)
            monkeypatch.setattr(_warp, "PREPARED", [True])
            assert torch.equal(got.idx, want.idx) and torch.equal(got.dists, want.dists)
            if query is p or query is q:
                want_d, want_idx = reference.knn(query.double(), ref.double(), k)
                assert torch.equal(got.idx, want_idx)
                torch.testing.assert_close(got.dists.double(), want_d, rtol=1e-6, atol=1e-6)
    assert (pcops.knn(bad_q, bad_p, k, validate=False).idx[:, 100:] == -1).all()


def test_prepared_launches_made_under_inference_mode_serve_other_calls(gen):
    """A launch first kept inside ``torch.inference_mode`` (a model's evaluation) serves the calls
    after it, and the other way round: the same results as the float64 reference."""
    for n in (40, 1000):  # (a scan, a small tree)
        p = torch.rand(n, 3, generator=gen, dtype=F64)
        want = reference.knn(p, p, 8)[1]
        for mode in (True, False, True):
            with torch.inference_mode(mode):
                for _ in range(2):
                    assert torch.equal(pcops.knn(p, p, 8).idx, want)
                    assert torch.equal(pcops.ball_query(p, p, 0.3, 8).idx, reference.ball_query(p, p, 0.3, 8)[1])
                    assert pcops.farthest_point_sample(p, 10).idx.unique().numel() == 10


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_one_kept_tree_serves_a_range_of_sizes(gen, monkeypatch, dtype, threads):
    """A kept small tree serves every size of its range (trees of one depth, queries up to a power
    of two, cut alike): clouds of sizes never seen before, growing and shrinking in turn, searched
    in themselves and with other queries, NaN and inf values among them, find the plan the first
    sizes made, and each call equals the general path's (launches packed per call) and, finite,
    the float64 reference; a NaN point still raises where values are checked."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k = 17  # (a tree: the scan takes these sizes up to k = 16)
        sizes = [256, 129, 200, 255, 130, 256, 180, 231, 140]  # (trees of depth 4: 129-256 points)
        plans = {True: set(), False: set()}
        for turn, n in enumerate(sizes):
            ref = torch.rand(n, 3, generator=gen, dtype=dtype) * 2 - 1
            query = torch.rand(sizes[-1 - turn], 3, generator=gen, dtype=dtype) * 2 - 1
            if turn % 3 == 2:
                ref[turn], query[turn, 1] = float("nan"), float("inf")
            for q in (ref, query):
                assert not _kdtree._scans(q.shape[0], n, k) and _kdtree._small_tree(q.shape[0], n)
                got = pcops.knn(q, ref, k, validate=False)
                plan = _kdtree._kept_plan(q, ref, k)
                if turn >= 2:  # (made on its range's second sighting, kept since)
                    plans[q is ref].add(id(plan))
                    assert isinstance(plan, _kdtree._SmallTree) and plan.sizes == (n, q.shape[0])
                monkeypatch.setattr(_warp, "PREPARED", [False])
                want = pcops.knn(q, ref, k, validate=False)
                monkeypatch.setattr(_warp, "PREPARED", [True])
                assert torch.equal(got.idx, want.idx) and torch.equal(got.dists, want.dists)
                if turn % 3 != 2 and dtype is F64:
                    assert torch.equal(got.idx, reference.knn(q, ref, k)[1])
                elif turn % 3 == 2:
                    with pytest.raises(ValueError, match="NaN or inf"):
                        pcops.knn(q, ref, k)
        assert len(plans[True]) == 1 and len(plans[False]) == 2  # (other queries: the query order's 2 bits below 181, 3 from there)
    finally:
        torch.set_num_threads(saved)


def test_kept_trees_side_by_side_serve_a_range_of_sizes(gen):
    """Chamfer's two kept trees (clouds past the grids' bound) serve clouds of sizes never seen
    before in their ranges: the same nearest points as the float64 reference, and one pair of
    plans for every size."""
    from pcops.ops.neighbours.nearest import _costs

    plans = set()
    for turn, (m, n) in enumerate([(4200, 4300), (4500, 4150), (4100, 4600), (4400, 4444)]):
        x, y = torch.rand(m, 3, generator=gen, dtype=F64) * 2 - 1, torch.rand(n, 3, generator=gen, dtype=F64) * 2 - 1
        assert not _costs.by_pairs(m, n, True)
        for _ in range(1 if turn else 2):  # (made on the range's second sighting)
            found = _kdtree.find_both(x, y, 1)
        assert found is not None and not found[2]
        plans.add((id(_kdtree._kept_plan(x, y, 1, 1)), id(_kdtree._kept_plan(y, x, 1, 2))))
        for a, b, idx in ((x, y, found[0]), (y, x, found[1])):
            assert torch.equal(idx, reference.knn(a, b, 1)[1])
    assert len(plans) == 1


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_one_kept_fps_plan_serves_a_range_of_sizes(gen, monkeypatch, dtype):
    """A kept bucket-FPS plan serves every cloud up to its capacity (a power of two) and any
    number of picks: clouds of sizes never seen before, growing and shrinking in turn, with
    more picks than points, start sets and NaN points among them, find the plan the first sizes
    made, and each call equals the general path's and, finite, the float64 reference."""
    from pcops.ops.sampling import fps

    plans = set()
    for turn, (n, picks) in enumerate([(256, 64), (129, 40), (200, 200), (255, 300), (130, 2), (256, 64), (180, 90), (231, 17)]):
        p = torch.rand(n, 3, generator=gen, dtype=dtype) * 2 - 1
        starts = [0] if turn % 2 else [3, 1]
        if turn % 4 == 3:
            p[[2, 9]] = float("nan")
        got = pcops.farthest_point_sample(p, picks, start_idx=starts, validate=False)
        key = (fps._plan_key(dtype, 256, len(starts)), torch.get_num_threads())
        if turn >= 2:
            plan = _warp.KEPT.get(key)
            assert isinstance(plan, fps._Bucket) and plan.last == (n, picks)
            plans.add(id(plan))
        monkeypatch.setattr(_warp, "PREPARED", [False])
        want = pcops.farthest_point_sample(p, picks, start_idx=starts, validate=False)
        monkeypatch.setattr(_warp, "PREPARED", [True])
        assert torch.equal(got.idx, want.idx) and torch.equal(got.points, want.points)
        if turn % 4 != 3 and starts == [0] and dtype is F64:
            assert torch.equal(got.idx[: min(picks, n)], reference.farthest_point_sample(p, picks)) and (got.idx[n:] == -1).all()
        elif turn % 4 == 3:
            with pytest.raises(ValueError, match="NaN or inf"):
                pcops.farthest_point_sample(p, picks, start_idx=starts)
    assert len(plans) == 2 and None not in plans  # (one plan a start count)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_one_kept_chamfer_grid_serves_a_range_of_sizes(gen, monkeypatch, dtype):
    """A kept launch of chamfer's grids serves every pair of clouds up to its capacities (powers
    of two): clouds of sizes never seen before, growing and shrinking in turn, one direction or
    both, NaN and inf points among them, find the launch the first sizes made, and give the
    pass's nearest points and costs bit for bit (the kNN search's points), the values flagged
    where checked."""
    from pcops.ops.neighbours.nearest import _costs

    sizes = [(256, 512), (129, 300), (200, 511), (255, 257), (130, 512), (256, 400), (140, 260)]
    launches = set()
    for turn, (m, n) in enumerate(sizes):
        x, y = torch.rand(m, 3, generator=gen, dtype=dtype) * 2 - 1, torch.rand(n, 3, generator=gen, dtype=dtype) * 2 - 1
        if turn % 3 == 2:
            x[turn], y[5, 1] = float("nan"), float("inf")
        for both in (True, False):
            monkeypatch.setattr(_costs, "GRID_FROM", 0)
            got = _costs.pairs(x, y, both, False)
            if turn >= 2:
                keys = [key for key in _warp.KEPT.keys() if key[0] == ("chamfer_grid", dtype, 256, 512, both, _costs.GRID_POINTS)]
                assert len(keys) == 1
                launch = _warp.KEPT.get(keys[0])
                launches.add(id(launch))
            assert (_costs.pairs(x, y, both, True) is None) == (turn % 3 == 2)
            monkeypatch.setattr(_costs, "GRID_FROM", 1 << 40)
            want = _costs.pairs(x, y, both, False)
            for a, b in zip(got, want, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(got[0], pcops.knn(x, y, 1, validate=False).idx[:, 0])
    assert len(launches) == 2  # (one a direction count)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_kept_scan_serves_every_size_of_its_cut(gen, monkeypatch, threads):
    """A kept scan (every pair measured) serves every size cut into as many chunks: clouds of sizes
    never seen before, small ones on the calling thread and a few queries in many points cut by
    query, NaN and inf values among them, find the scan the first sizes made, and each call
    equals the general path's and, finite, the float64 reference; a NaN point still raises where
    values are checked."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k = 4
        for sizes in ([(40, 50), (17, 90), (64, 64), (1, 30), (50, 7), (33, 33)], [(20, 4100), (31, 4200), (25, 4150), (30, 4300)]):
            scans = set()
            for turn, (m, n) in enumerate(sizes):
                ref = torch.rand(n, 3, generator=gen, dtype=F64) * 2 - 1
                query = ref if m == n else torch.rand(m, 3, generator=gen, dtype=F64) * 2 - 1
                if turn == 3:
                    query[0, 2] = float("nan")
                assert _kdtree._scans(m, n, k)
                got = pcops.knn(query, ref, k, validate=False)
                if turn >= 2 and query is not ref:  # (made on the second sighting of its cut)
                    plan = _kdtree._kept_plan(query, ref, k)
                    assert isinstance(plan, _kdtree._Scan) and plan.sizes == (n, m)
                    scans.add(id(plan))
                monkeypatch.setattr(_warp, "PREPARED", [False])
                want = pcops.knn(query, ref, k, validate=False)
                monkeypatch.setattr(_warp, "PREPARED", [True])
                assert torch.equal(got.idx, want.idx) and torch.equal(got.dists, want.dists)
                if turn == 3:
                    with pytest.raises(ValueError, match="NaN or inf"):
                        pcops.knn(query, ref, k)
                else:
                    assert torch.equal(got.idx, reference.knn(query, ref, k)[1])
            assert len(scans) == 1
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_kept_dense_searches_serve_ranges_of_sizes_and_radii(gen, monkeypatch, dtype):
    """The kept dense ball search and radius_aggregate's dense forward serve clouds of every size
    up to their capacity and any radius (the radii's order fixed): sizes and radii never seen
    before, growing and shrinking in turn, run what was kept (no launch packed anew) and equal
    the general path's results, ball_query the float64 reference; a NaN point still raises
    where values are checked."""
    sizes = [(256, 200), (183, 250), (200, 256), (255, 183), (190, 182), (256, 256), (182, 190)]  # (all cut into as many chunks)
    launched = []
    real_launch = _warp.launch
    monkeypatch.setattr(_warp, "launch", lambda *a, **kw: (launched.append(a[0].key), real_launch(*a, **kw))[1])
    for turn, (m, n) in enumerate(sizes):
        p = torch.rand(n, 3, generator=gen, dtype=dtype) * 2 - 1
        q = torch.rand(m, 3, generator=gen, dtype=dtype) * 2 - 1
        f = torch.randn(n, 5, generator=gen, dtype=dtype)
        r = 0.2 + 0.05 * turn
        calls = [lambda: pcops.ball_query(q, p, r, 16), lambda: pcops.ball_queries(q, p, (r, 0.8 * r), (8, 12)),
                 lambda: pcops.radius_aggregate(q, p, f, r, weights="uniform"), lambda: pcops.radius_aggregate(q, p, f, r, weights="softmax", sigma=0.1),
                 lambda: pcops.radius_graph(p, r, max_neighbors=10)]
        launched.clear()
        got = [call() for call in calls]
        if turn >= 2:  # (made on their ranges' second sightings)
            assert not launched, launched
        monkeypatch.setattr(_warp, "PREPARED", [False])
        want = [call() for call in calls]
        monkeypatch.setattr(_warp, "PREPARED", [True])
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
            assert torch.equal(a, b)
        if dtype is F64:
            _, ref_idx, ref_counts = reference.ball_query(q, p, r, 16)
            assert torch.equal(got[0].idx, ref_idx) and torch.equal(got[0].counts, ref_counts)
    p[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        pcops.ball_query(q, p, 0.3, 16)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_kept_chamfer_pass_and_costs_serve_ranges_of_sizes(gen, monkeypatch, dtype):
    """chamfer's kept pass over every pair (rows and columns) and its kept costs launch (after two
    kept trees) serve clouds of every size of their ranges: sizes never seen before, growing and
    shrinking in turn, run what was kept (no launch packed anew) and give the general path's
    loss; the pass's nearest points are the kNN search's."""
    from pcops.ops.neighbours.nearest import _costs

    monkeypatch.setattr(_costs, "GRID_FROM", 1 << 40)  # (the pass at every size below its bound)
    launched = []
    real_launch = _warp.launch
    monkeypatch.setattr(_warp, "launch", lambda *a, **kw: (launched.append(a[0].key), real_launch(*a, **kw))[1])
    for sizes in ([(100, 256), (120, 200), (90, 250), (128, 129), (70, 256), (110, 180)], [(4200, 4300), (4500, 4150), (4100, 4600), (4400, 4444)]):
        for turn, (m, n) in enumerate(sizes):
            x, y = torch.rand(m, 3, generator=gen, dtype=dtype) * 2 - 1, torch.rand(n, 3, generator=gen, dtype=dtype) * 2 - 1
            launched.clear()
            got = [pcops.chamfer_distance(x, y), pcops.chamfer_distance(x, y, single_directional=True)]
            if turn >= 2:  # (made on their ranges' second sightings)
                assert not launched, (m, n, launched)
            monkeypatch.setattr(_warp, "PREPARED", [False])
            want = [pcops.chamfer_distance(x, y), pcops.chamfer_distance(x, y, single_directional=True)]
            monkeypatch.setattr(_warp, "PREPARED", [True])
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
            if m * n <= _costs.SCAN_PAIRS:
                found = _costs.pairs(x, y, True)
                assert torch.equal(found[0], pcops.knn(x, y, 1).idx[:, 0]) and torch.equal(found[1], pcops.knn(y, x, 1).idx[:, 0])
