"""pcops.knn, pcops.knn_aggregate and KNNAggregation against dense float64 references."""

import contextlib
import dataclasses
import math
import warnings

import pytest
import torch

import pcops
from pcops import _morton
from pcops.ops.neighbours import nearest as knn_module
from pcops.ops.neighbours.nearest import _kdtree
from tests import reference
from tests.compile_check import assert_compiles_like_eager
from tests.op_suite import TOL, OpSuite, pack_pair, pad, sample_rows
from tests.reference import CLOUDS, cloud

F64 = torch.float64
CPU_BACKENDS = ["warp", "scipy", "torch"]


@pytest.fixture(autouse=True)
def _kd_tree_in_warp_tests(request, monkeypatch):
    """The warp backend's tests here are of its kd-tree: their small clouds would otherwise
    take the every-pair path (tests/ops/test_small_clouds.py tests that one and the switch)."""
    if "warp" in request.node.name:
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", CLOUDS)
def test_knn_matches_float64_brute_force(gen, backend, kind):
    q, p, _ = cloud(kind, gen)
    for k in (1, 5, p.shape[0]):
        dists, idx = pcops.knn(q, p, k, backend=backend)
        ref_d, ref_idx = reference.knn(q, p, k)
        assert idx.dtype == torch.int64 and idx.shape == (q.shape[0], k)
        torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
        torch.testing.assert_close(dists, ref_d, rtol=1e-12, atol=1e-12)


def assert_ranked_up_to_ties(idx, q, p, tol):
    """``idx`` is the float64 ranking of the points q, p except between neighbours whose float64
    distances tie within ``tol`` (float32 searches may order those differently)."""
    ref_d, ref_idx = reference.knn(q, p, idx.shape[1])
    chosen = reference.distances(q, p).gather(1, idx.cpu())
    gap = (chosen - ref_d).abs()[idx.cpu() != ref_idx]
    assert torch.all(gap <= tol * (1 + ref_d.abs().max())), f"a neighbour {float(gap.max()):.2e} away from a tie"


@pytest.mark.parametrize("kind", CLOUDS)
def test_cpu_backends_agree_in_float32(gen, kind):
    q, p, _ = cloud(kind, gen)
    q, p = q.float(), p.float()
    results = {b: pcops.knn(q, p, 6, backend=b) for b in CPU_BACKENDS}
    ref_d, _ = reference.knn(q, p, 6)
    for b, (d, idx) in results.items():
        assert d.dtype == torch.float32
        torch.testing.assert_close(d.double(), ref_d, rtol=1e-5, atol=1e-5)
        assert_ranked_up_to_ties(idx, q, p, 1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ties_are_broken_by_the_smaller_index(backend):
    # Twelve points at distance 1 from the origin, in shuffled index order, with duplicates.
    axes = torch.cat([torch.eye(3), -torch.eye(3)]).double()
    p = torch.cat([axes, axes, torch.full((2, 3), 5.0, dtype=F64)])[torch.tensor([13, 3, 7, 0, 12, 9, 1, 5, 10, 2, 11, 4, 8, 6])]
    q = torch.zeros(1, 3, dtype=F64)
    dists, idx = pcops.knn(q, p, 5, backend=backend)
    tied = (reference.distances(q, p)[0] == 1).nonzero().flatten()
    assert idx[0].tolist() == tied[:5].tolist()
    assert torch.all(dists == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["torch", "scipy"])
def test_lattice_clouds_rank_equal_distances_by_index_on_every_backend(backend, dtype):
    """Points on lattices of 1/3, 1/5 and 1/10 (voxelised scans): many pairs at the same real
    distance, whose rounded squares differ by an ulp and often share their rounded root. Every
    backend ranks by the returned distances (IEEE roots), ties by the smaller index: the Warp
    search's neighbours and distances (the kd-tree and the every-pair scan), which are those of
    the float64 reference in float64. (scipy's cKDTree measures in float64: its float32 points
    are ranked by their float32 distances; its distances are recomputed in torch, as IEEE's
    roots too: the same values.)"""
    gen = torch.Generator().manual_seed(3)
    for step, n, m, k in ((3, 150, 120, 15), (5, 240, 180, 39), (10, 355, 187, 33), (5, 60, 60, 59)):
        p = ((torch.rand(n, 3, generator=gen, dtype=F64) * step).round() / step).to(dtype)
        q = ((torch.rand(m, 3, generator=gen, dtype=F64) * step).round() / step).to(dtype)
        got = pcops.knn(q, p, k, backend=backend)
        for scan in (0, 1 << 30):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(_kdtree, "SCAN_PAIRS", scan)
                want = pcops.knn(q, p, k, backend="warp")
            assert torch.equal(got.idx, want.idx)
            assert torch.equal(got.dists, want.dists)
        if dtype == F64:
            ref_d, ref_idx = reference.knn(q, p, k)
            assert torch.equal(got.idx, ref_idx)
            assert torch.equal(got.dists, ref_d)


@pytest.mark.parametrize("backend", ["warp", "torch", "warp-scan", "scipy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_points_whose_squared_distances_overflow_are_never_neighbours(gen, monkeypatch, backend, dtype):
    """Two clusters of finite points so far apart that their squared distances overflow the
    dtype (validation accepts them): each point's neighbours are those of its own cluster, the
    missing columns -1 / inf, and knn_graph has only the edges within a cluster (as documented;
    the scipy backend ranks float32 points by their float32 distances, and float64 ones it
    cannot square are missing too, not cKDTree's index N)."""
    if backend == "warp-scan":  # the every-pair scan, instead of the tree the fixture forces
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", 1 << 30)
    far = 1e20 if dtype == torch.float32 else 1e155
    near = torch.rand(5, 3, generator=gen, dtype=F64)
    p = torch.cat([near, near[:3] * 0.5 + far]).to(dtype)[torch.tensor([5, 0, 1, 6, 2, 7, 3, 4])]
    k = 6
    dists, idx = pcops.knn(p, p, k, backend=backend.removesuffix("-scan"))
    d2 = ((p[:, None].double() - p[None].double()) ** 2).to(dtype).sum(-1)  # each square in the dtype, as the search
    assert torch.isinf(d2).any()
    for i in range(p.shape[0]):
        found = [j for j in torch.argsort(d2[i].double(), stable=True).tolist() if math.isfinite(d2[i, j])][:k]
        assert idx[i].tolist() == found + [-1] * (k - len(found))
        torch.testing.assert_close(dists[i, : len(found)].double(), d2[i, found].double().sqrt(), rtol=1e-6, atol=0)
        assert torch.isinf(dists[i, len(found):]).all()
    if backend == "scipy":
        return
    within = sum(min(n - 1, 4) for n in (5, 5, 5, 5, 5, 3, 3, 3))  # 26 edges of N k = 32
    assert pcops.knn_graph(p, 4).shape == (2, within)


@contextlib.contextmanager
def _threads_of(n: int):
    """torch's thread count set to ``n`` for the block (launches cut into that many chunks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("kind", CLOUDS)
def test_weighted_means_from_one_launch_equal_the_torch_formula(gen, monkeypatch, kind, dtype):
    """A plain knn_aggregate / knn_interpolate call with k <= 4, uniform or inverse-distance
    weights and nothing to differentiate takes its weighted means from one Warp launch: the same
    values bit for bit as the torch formula (the call with features that require grad) and as
    the general path, on both sides of the search's crossover, for features of magnitudes 1e-6
    to 1e6 (the products' summation order shows), zero distances, strided features and 1, 3 or
    32 channels. This also checks, on each torch release CI tries, that torch sums up to four
    terms left to right. A row cut short (a NaN query without validation) takes the general path."""
    from pcops.ops.neighbours.nearest import _mean

    q, p, _ = cloud(kind, gen)
    q, p = q.to(dtype), p.to(dtype)
    q[0] = p[2]  # a zero distance (the clamp)
    scale = 10.0 ** torch.randint(-6, 7, (p.shape[0], 1), generator=gen).to(dtype)
    feats = {c: torch.randn(p.shape[0], c, generator=gen, dtype=dtype) * scale for c in (1, 3, 32)}
    feats["strided"] = feats[3].t().contiguous().t()
    taken = []  # whether each launch gave the result (None: a row cut short)
    monkeypatch.setattr(_mean, "mean", lambda *a, real=_mean.mean: (lambda out: (taken.append(out is not None), out)[1])(real(*a)))
    calls = 0
    for pairs in (1 << 40, 0):
        monkeypatch.setattr(_kdtree, "SCAN_PAIRS", pairs)
        for k in range(1, _mean.MAX_K + 1):
            for weights in ("inverse_distance", "uniform"):
                for f in feats.values():
                    fused = pcops.knn_aggregate(q, p, f, k, weights=weights)
                    formula = pcops.knn_aggregate(q, p, f.clone().requires_grad_(), k, weights=weights).detach()
                    monkeypatch.setattr(knn_module, "PLAIN", [False])
                    general = pcops.knn_aggregate(q, p, f, k, weights=weights)
                    monkeypatch.setattr(knn_module, "PLAIN", [True])
                    assert torch.equal(fused, formula) and torch.equal(fused, general), (k, weights, f.shape)
                    calls += 1
            assert torch.equal(pcops.knn_interpolate(q, p, feats[32], k), pcops.knn_aggregate(q, p, feats[32], k, weights="inverse_distance"))
            calls += 2
    many, f = torch.rand(5000, 3, generator=gen, dtype=dtype), feats[32]  # (a launch cut into chunks on several threads)
    with _threads_of(2):
        assert torch.equal(pcops.knn_interpolate(many, p, f), pcops.knn_interpolate(many, p, f.clone().requires_grad_()).detach())
    assert taken == [True] * (calls + 1)
    # rows cut short (validate=False): a NaN query (no neighbour), and three reference points of
    # which two are finite (every row one short): the launch says so and the general path answers
    nan, few = q.clone(), p[:3].clone()
    nan[1, 0] = few[1, 2] = float("nan")
    for query, ref, k, weights in ((nan, p, 3, "inverse_distance"), (q, few, 3, "uniform"), (q, few, 3, "inverse_distance")):
        out = pcops.knn_aggregate(query, ref, feats[3][: ref.shape[0]], k, weights=weights, validate=False)
        assert taken[-1] is False
        monkeypatch.setattr(knn_module, "PLAIN", [False])
        torch.testing.assert_close(out, pcops.knn_aggregate(query, ref, feats[3][: ref.shape[0]], k, weights=weights, validate=False),
                                   rtol=0, atol=0, equal_nan=True)
        monkeypatch.setattr(knn_module, "PLAIN", [True])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_opcheck_search_ops(gen, backend):
    op = knn_module.BACKENDS[backend].op
    for dtype in (torch.float32, F64):
        q, p = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(30, 3, generator=gen, dtype=dtype)
        torch.library.opcheck(op._opoverload, (q, p, 4, True))


def _grad_inputs(gen):
    return (
        torch.rand(10, 3, generator=gen, dtype=F64),
        torch.rand(25, 3, generator=gen, dtype=F64),
        torch.randn(25, 4, generator=gen, dtype=F64),
    )


@pytest.mark.parametrize("wrt", ["query", "ref"])
def test_knn_distances_gradcheck(gen, wrt):
    q, p, _ = _grad_inputs(gen)
    x = (q if wrt == "query" else p).clone().requires_grad_()
    fn = (lambda x: pcops.knn(x, p, 4).dists) if wrt == "query" else (lambda x: pcops.knn(q, x, 4).dists)
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("wrt", ["query", "ref", "features", "sigma"])
def test_knn_aggregate_gradcheck(gen, wrt):
    q, p, f = _grad_inputs(gen)
    inputs = {"query": q, "ref": p, "features": f, "sigma": torch.tensor(0.1, dtype=F64)}
    inputs[wrt] = inputs[wrt].clone().requires_grad_()

    def fn(x):
        a = dict(inputs, **{wrt: x})
        return pcops.knn_aggregate(a["query"], a["ref"], a["features"], 5, a["sigma"])

    assert torch.autograd.gradcheck(fn, (inputs[wrt],))


def test_gradient_at_zero_distance_is_finite():
    p = torch.rand(8, 3, dtype=F64)
    q = p[:3].clone().requires_grad_()  # each query sits on a reference point
    pcops.knn(q, p, 3).dists.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["uniform", "clustered", "duplicates", "far_negative"])
def test_knn_aggregate_matches_reference(gen, backend, kind):
    q, p, _ = cloud(kind, gen)
    f = torch.randn(p.shape[0], 3, generator=gen, dtype=F64)
    scale = reference.knn(q, p, 1)[0].mean().item() + 1e-3
    for sigma in (0.1 * scale, scale, 10 * scale):
        out = pcops.knn_aggregate(q, p, f, 7, sigma, backend=backend)
        torch.testing.assert_close(out, reference.knn_aggregate(q, p, f, 7, sigma), rtol=1e-10, atol=1e-12)


def test_knn_aggregate_tiny_sigma_is_finite_and_picks_the_nearest(gen):
    q, p, f = _grad_inputs(gen)
    out = pcops.knn_aggregate(q.float(), p.float(), f.float(), 4, 1e-6)
    assert torch.isfinite(out).all()
    nearest = reference.knn(q, p, 1)[1][:, 0]
    torch.testing.assert_close(out, f.float()[nearest])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_points_are_searched_in_float32(gen, dtype):
    q, p, f = _grad_inputs(gen)
    q, p, f = q.to(dtype), p.to(dtype), f.to(dtype)
    dists, idx = pcops.knn(q, p, 3)
    assert dists.dtype == dtype
    ref_d, ref_idx = reference.knn(q.float(), p.float(), 3)
    torch.testing.assert_close(dists.double(), ref_d, rtol=1e-2, atol=1e-2)
    out = pcops.knn_aggregate(q, p, f, 3, 0.2)
    assert out.dtype == dtype


def test_empty_query_set(gen):
    _, p, f = _grad_inputs(gen)
    for backend in CPU_BACKENDS:
        dists, idx = pcops.knn(torch.zeros(0, 3, dtype=F64), p, 3, backend=backend)
        assert dists.shape == (0, 3) and idx.shape == (0, 3)
    assert pcops.knn_aggregate(torch.zeros(0, 3, dtype=F64), p, f, 3, 0.1).shape == (0, 4)


def _bad():
    q, p, f = torch.rand(4, 3), torch.rand(6, 3), torch.rand(6, 2)
    nan = p.clone()
    nan[1, 1] = float("nan")
    return [
        (lambda: pcops.knn(q, p, 7), ValueError, "k must be <= the number of ref points"),
        (lambda: pcops.knn(q, p, 0), ValueError, "k must be >= 1"),
        (lambda: pcops.knn(q, p, 2.0), TypeError, "k must be an int"),
        (lambda: pcops.knn(q[:, :2], p, 2), ValueError, "query"),
        (lambda: pcops.knn(q, p.long(), 2), TypeError, "ref"),
        (lambda: pcops.knn(q, p.to("meta"), 2), ValueError, "same device"),
        (lambda: pcops.knn(q, nan, 2), ValueError, "ref contains NaN"),
        (lambda: pcops.knn(q, p, 2, backend="faiss"), ValueError, "backend must be"),
        (lambda: pcops.knn(q, p, 2, backend="cuml"), ValueError, "runs on cuda tensors"),
        (lambda: pcops.knn_aggregate(q, p, f[:5], 2, 0.1), ValueError, "features"),
        (lambda: pcops.knn_aggregate(q, p, f, 2, -0.1), ValueError, "sigma"),
        (lambda: pcops.knn_aggregate(q, p, f, 2, torch.tensor(0.0)), ValueError, "sigma"),
        (lambda: pcops.KNNAggregation(0), ValueError, "k must be >= 1"),
        (lambda: pcops.KNNAggregation(3, sigma=0), ValueError, "sigma"),
    ]


@pytest.mark.parametrize("call,error,match", _bad())
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _missing(monkeypatch, name: str) -> None:
    """Make backend ``name`` look uninstalled (backends are frozen: swap in a changed copy)."""
    changed = dataclasses.replace(knn_module.BACKENDS[name], requires=("a_module_that_is_not_installed",))
    monkeypatch.setitem(knn_module.BACKENDS, name, changed)


def test_forcing_a_missing_backend_says_how_to_install(monkeypatch):
    _missing(monkeypatch, "scipy")
    with pytest.raises(ImportError, match="pip install scipy"):
        pcops.knn(torch.rand(3, 3), torch.rand(5, 3), 2, backend="scipy")


def test_auto_falls_back_with_one_warning(monkeypatch):
    _missing(monkeypatch, "warp")
    knn_module._warn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert knn_module.resolve_backend("auto", torch.device("cpu")) == "scipy"
        assert knn_module.resolve_backend("auto", torch.device("cpu")) == "scipy"
    assert len([w for w in caught if "pip install warp-lang" in str(w.message)]) == 1
    knn_module._warn_fallback.cache_clear()


def test_auto_picks_the_measured_cpu_default():
    chosen = knn_module.resolve_backend("auto", torch.device("cpu"))
    assert chosen == knn_module.AUTO["cpu"][0] and knn_module.BACKENDS[chosen].available()
    assert "cpu" in knn_module.BACKENDS[chosen].devices


def test_module_matches_functional_and_learns_sigma(gen):
    q, p, f = _grad_inputs(gen)
    layer = pcops.KNNAggregation(5, sigma=0.1, learnable_sigma=True).double()
    out = layer(q, p, f)
    torch.testing.assert_close(out, pcops.knn_aggregate(q, p, f, 5, 0.1))
    out.pow(2).sum().backward()
    assert layer.log_sigma.grad.abs() > 0


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lift = torch.nn.Linear(3, 8)
        self.agg = pcops.KNNAggregation(4, sigma=0.1, learnable_sigma=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, query, ref):
        return self.head(self.agg(query, ref, torch.relu(self.lift(ref))))


def test_compile_fullgraph_matches_eager_without_recompiling_per_size(gen):
    assert_compiles_like_eager(_Model(), [(30, 50), (45, 80)], gen)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuml", "warp", "torch"])
def test_cuda_backends_match_reference_on_a_side_stream(gen, backend):
    if not knn_module.BACKENDS[backend].available():
        pytest.skip(f"{backend} is not installed: {knn_module.BACKENDS[backend].install}")
    q, p, _ = cloud("uniform", gen, m=500, n=800)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        qc, pc = q.float().cuda(), p.float().cuda()
        dists, idx = pcops.knn(qc, pc, 8, backend=backend)
    torch.cuda.synchronize()
    ref_d, _ = reference.knn(q.float(), p.float(), 8)
    torch.testing.assert_close(dists.cpu().double(), ref_d, rtol=1e-4, atol=1e-4)
    assert_ranked_up_to_ties(idx, q.float(), p.float(), 1e-4)


@pytest.mark.parametrize("kind", ["randn", "shell", "clusters"])
def test_warp_tree_search_is_exact_on_large_clouds(gen, kind):
    # several tree levels, dense and empty regions: indices equal the float64 brute force
    n = 6000
    if kind == "randn":
        p = torch.randn(n, 3, generator=gen, dtype=F64)
    elif kind == "shell":  # points on a sphere, queries inside and outside it
        p = torch.nn.functional.normalize(torch.randn(n, 3, generator=gen, dtype=F64), dim=1)
    else:
        centres = torch.rand(5, 3, generator=gen, dtype=F64) * 4 - 2
        p = centres[torch.randint(0, 5, (n,), generator=gen)] + 0.01 * torch.randn(n, 3, generator=gen, dtype=F64)
    q = torch.rand(700, 3, generator=gen, dtype=F64) * 3 - 1.5
    for dtype in (F64, torch.float32):
        for k in (1, 7, 40):
            _, idx = pcops.knn(q.to(dtype), p.to(dtype), k, backend="warp")
            ref_d, ref_idx = reference.knn(q.to(dtype), p.to(dtype), k)
            if dtype == F64:
                torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
            else:  # float32 rounding may reorder near-ties: compare the distances found
                found = reference.distances(q.to(dtype), p.to(dtype)).gather(1, idx)
                torch.testing.assert_close(found, ref_d, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_warp_ties_are_ties_of_the_returned_distances(gen, dtype):
    # the Warp search ranks squared distances and takes roots at the end; squares a few ulps
    # apart can have the same root, and such a tie must go to the smaller index, as for equal
    # squares: points on the unit sphere around the query, at distance 1 within a few ulps
    p = torch.randn(3000, 3, generator=gen, dtype=dtype)
    p = p / p.norm(dim=1, keepdim=True)
    q = torch.zeros(1, 3, dtype=dtype)
    dists, idx = pcops.knn(q, p, p.shape[0], backend="warp")
    d, i = dists[0], idx[0]
    assert sorted(i.tolist()) == list(range(p.shape[0]))
    ordered = (d[1:] > d[:-1]) | ((d[1:] == d[:-1]) & (i[1:] > i[:-1]))
    assert bool(ordered.all())  # by returned distance, then index
    assert int((d[1:] == d[:-1]).sum()) > 100  # many ties: the test has teeth
    for k in (1, 7, 100, 1234):
        dk, ik = pcops.knn(q, p, k, backend="warp")
        torch.testing.assert_close(ik[0], i[:k], rtol=0, atol=0)
        torch.testing.assert_close(dk[0], d[:k], rtol=0, atol=0)


@pytest.mark.parametrize("rounds", [0, 1, 64])
@pytest.mark.parametrize("queries", ["scattered", "grid"])
def test_warp_kd_tree_is_exact_whatever_its_splits(gen, monkeypatch, rounds, queries):
    # the partitions may stop early (adversarial inputs): the boxes are those of the points in
    # each range, so unbalanced or unsorted splits slow the search down but keep it exact; and
    # queries put in Morton order (scattered) or left as given (a grid) find the same
    from pcops import _warp
    from pcops.ops.neighbours.nearest import _kdtree as tree

    monkeypatch.setattr(tree, "_ROUNDS", rounds)
    p = torch.randn(3000, 3, generator=gen, dtype=F64)
    p[:1000] = p[:1000].round(decimals=1)  # heavy duplicates in the split keys
    p[1000:1200] = p[1000]  # 200 copies of one point: ties by the smaller index
    if queries == "grid":
        # (shifted off the 0.1 lattice of the rounded points: no distances equal in exact arithmetic
        # whose roundings differ between the kernel's fused multiply-adds and the reference)
        axis = torch.linspace(-2, 2, 20, dtype=F64)
        grid = torch.cartesian_prod(axis, axis, axis) + torch.tensor([0.0123, 0.0371, 0.0519], dtype=F64)
        q = torch.cat([grid, p[995:1005]])
    else:
        q = torch.cat([torch.randn(400, 3, generator=gen, dtype=F64), p[995:1005]])
    launch, rows, _ = tree._cpu_query_order(q)
    _warp.launch(launch[0], 1, launch[1], like=q)
    assert torch.equal(rows, torch.arange(q.shape[0])) == (queries == "grid")
    _, ref_idx = reference.knn(q, p, 33)  # sorted, ties by the smaller index: its first k columns are the k nearest
    for k in (1, 7, 33):
        _, idx = pcops.knn(q, p, k, backend="warp")
        torch.testing.assert_close(idx, ref_idx[:, :k], rtol=0, atol=0)


def _cell_order(q: torch.Tensor) -> torch.Tensor:
    """The CPU query order by its definition, in torch: a stable sort of the Morton codes of the
    cells (about one per query) on the box of every max(m // 1024, 1)-th query, NaN left out."""
    from pcops.ops.neighbours.nearest import _kdtree as tree

    m = q.shape[0]
    bits = max(1, min(tree._CPU_BITS, round(math.log2(m + 1) / 3)))
    sample = q[:: max(m // 1024, 1)]
    low = torch.where(sample.isnan(), float("inf"), sample).amin(0)
    side = (torch.where(sample.isnan(), float("-inf"), sample).amax(0) - low).amax()
    top = 2.0**bits - 1
    x = (q - low) * (top / side)
    cells = torch.where(x > 0, torch.minimum(x, torch.tensor(top, dtype=q.dtype)), 0).long()
    spread = _morton.spread_table(bits, q.device).long()
    code = spread[cells[:, 0]] | spread[cells[:, 1]] << 1 | spread[cells[:, 2]] << 2
    return torch.sort(code, stable=True).indices


@pytest.mark.parametrize("m", [1, 7, 3000, 70_000])
def test_warp_cpu_query_order_is_a_stable_sort_of_morton_cells(gen, m):
    # the CPU order of ungrouped queries (a counting sort on one thread, beside the root split):
    # exactly the definition's, and the queries copied in that order; NaN, infinite and equal
    # coordinates only move queries to border cells
    from pcops import _warp
    from pcops.ops.neighbours.nearest import _kdtree as tree

    q = torch.randn(m, 3, generator=gen, dtype=F64) * torch.tensor([1.0, 5.0, 0.1], dtype=F64)
    if m > 100:
        q[10:20] = q[5]
        q[30, 1] = float("nan")
        q[40] = float("nan")
        q[50, 2] = float("inf")
    launch, rows, ordered = tree._cpu_query_order(q)
    _warp.launch(launch[0], 1, launch[1], like=q)
    torch.testing.assert_close(rows, _cell_order(q), rtol=0, atol=0)
    torch.testing.assert_close(ordered, q[rows], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype,scale", [(F64, 1.0), (F64, 3e-162), (torch.float32, 1.0), (torch.float32, 1e-22), (torch.float32, 3e-23), (torch.float32, 1e15)])
def test_warp_cpu_bounds_chained_from_the_previous_query_find_the_same(gen, monkeypatch, dtype, scale):
    # on the CPU each query starts from a bound taken from the query before it on the same
    # thread (its k-th distance plus the step between them): the rows equal those of searches
    # without it, bit for bit, also where squared distances are subnormal or underflow (tiny
    # scales: without the margins for rounding and underflow, 1e-22 and 3e-23 in float32 and
    # 3e-162 in float64 differ) and for duplicate, non-finite, grouped and grid queries
    from pcops.ops.neighbours.nearest import _kdtree as tree

    p = torch.randn(5000, 3, generator=gen, dtype=F64)
    p[:500] = p[:500].round(decimals=1)
    p[7] = float("nan")
    axis = torch.linspace(-2, 2, 14, dtype=F64)
    q = torch.cat([torch.cartesian_prod(axis, axis, axis), torch.randn(2000, 3, generator=gen, dtype=F64) * 1.5, p[:300]])
    q[100:110] = q[99]
    q[2000, 1] = float("nan")
    q, p = (q * scale).to(dtype), (p * scale).to(dtype)
    groups = (torch.randint(0, 3, (p.shape[0],), generator=gen), torch.randint(0, 3, (q.shape[0],), generator=gen))
    for k in (1, 7, 30):
        for batch in ({}, {"ref_batch": groups[0], "query_batch": groups[1]}):
            found = {}
            for chain in (True, False):
                monkeypatch.setattr(tree, "_CHAIN", chain)
                found[chain] = pcops.knn(q, p, k, backend="warp", validate=False, **batch)
            torch.testing.assert_close(found[True].idx, found[False].idx, rtol=0, atol=0)
            torch.testing.assert_close(found[True].dists, found[False].dists, rtol=0, atol=0)


def test_warp_queries_already_in_spatial_order_are_not_sorted_again(gen):
    # grouped queries of large CPU trees are sorted in torch into Morton order, unless
    # consecutive queries are near each other already (a grid, a sorted cloud): the sort would
    # cost time and save none (ungrouped ones: the order kernel's own test, in its own terms)
    from pcops.ops.neighbours.nearest import _kdtree as tree

    axis = torch.linspace(-1, 1, 30, dtype=F64)
    grid = torch.cartesian_prod(axis, axis, axis)
    assert tree._in_order(grid)
    assert tree._in_order(grid[tree._query_order(grid, None)])
    assert not tree._in_order(grid[torch.randperm(grid.shape[0], generator=gen)])
    assert not tree._in_order(torch.randn(5000, 3, generator=gen, dtype=F64))
    assert not tree._in_order(torch.full((10, 3), float("nan"), dtype=F64))


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_the_gpu_build_bounds_every_node_and_finds_the_cpu_builds_neighbours(gen, monkeypatch, dtype):
    # the GPUs' build (the points in Morton order, boxes from the leaves up): each node's box is
    # the box of its range's points (NaN coordinates left out), its group range theirs, the
    # points a permutation of the cloud in group order; and the same neighbours as the CPU build
    # (quickselect splits) with duplicate coordinates and NaN points, alone or in samples
    from pcops.ops.neighbours.nearest import _kdtree as tree

    p = torch.randn(2500, 3, generator=gen, dtype=F64).to(dtype)
    p[:300] = p[:300].round(decimals=1)
    p[[5, 77]] = float("nan")
    p[9, 1] = float("nan")
    groups = torch.randint(0, 3, (2500,), generator=gen, dtype=torch.int32)
    monkeypatch.setattr(tree, "_GPU_BUILD", True)
    for group in (None, groups):
        points, order, sorted_group, lo, hi, glo, ghi, axis, _, depth = tree._tree(p, group)
        assert torch.equal(torch.sort(order).values, torch.arange(2500))
        assert torch.equal(points, p[order]) or torch.equal(points.nan_to_num(7.0), p[order].nan_to_num(7.0))
        if group is not None:
            assert torch.equal(sorted_group, group[order]) and bool((sorted_group[1:] >= sorted_group[:-1]).all())
        for d in range(depth + 1):
            for node in range(1 << d):
                first, last = (node * 2500) >> d, ((node + 1) * 2500) >> d
                b = (1 << d) - 1 + node
                rows = points[first:last]
                inf = torch.tensor(float("inf"), dtype=dtype)
                assert torch.equal(lo[b], torch.where(rows.isnan(), inf, rows).amin(0))
                assert torch.equal(hi[b], torch.where(rows.isnan(), -inf, rows).amax(0))
                if group is not None:
                    assert (int(glo[b]), int(ghi[b])) == (int(sorted_group[first]), int(sorted_group[last - 1]))
                if d < depth:
                    multi = group is not None and int(sorted_group[first]) != int(sorted_group[last - 1])
                    assert int(axis[b]) == -1 if multi else 3 <= int(axis[b]) <= 5
    q = torch.randn(300, 3, generator=gen, dtype=F64).to(dtype)
    q_groups = torch.randint(0, 3, (300,), generator=gen, dtype=torch.int32)
    for batch in ({}, {"query_batch": q_groups, "ref_batch": groups}):
        found = []
        for gpu_build in (False, True):
            monkeypatch.setattr(tree, "_GPU_BUILD", gpu_build)
            monkeypatch.setattr(tree, "SCAN_PAIRS", 0)
            found.append(pcops.knn(q, p, 9, backend="warp", validate=False, **batch))
        assert torch.equal(found[0].idx, found[1].idx) and torch.equal(found[0].dists, found[1].dists)


@pytest.mark.parametrize("by_sorting", [False, True])
def test_warp_kd_tree_builds_are_exact_on_adversarial_clouds(gen, monkeypatch, by_sorting):
    # the CPU build (Warp kernels) and the GPUs' build (Morton order, run here on the CPU) find
    # the float64 brute force's neighbours on skewed and heavily duplicated clouds, in samples
    # or not
    from pcops.ops.neighbours.nearest import _kdtree as tree

    monkeypatch.setattr(tree, "_GPU_BUILD", by_sorting)
    skewed = torch.randn(4000, 3, generator=gen, dtype=F64)
    skewed[:3000, 0] = torch.rand(3000, generator=gen, dtype=F64) * 1e-3  # most keys of one axis in a sliver
    dupes = torch.randn(4000, 3, generator=gen, dtype=F64).round(decimals=0)  # a few dozen distinct points
    line = torch.zeros(3000, 3, dtype=F64)
    line[:, 2] = torch.arange(3000, dtype=F64) % 7  # 7 distinct points, ~430 copies each
    for p in (skewed, dupes, line):
        q = torch.randn(300, 3, generator=gen, dtype=F64) * 2
        for k in (1, 9):
            _, idx = pcops.knn(q, p, k, backend="warp")
            _, ref_idx = reference.knn(q, p, k)
            torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
        groups = torch.randint(0, 4, (p.shape[0],), generator=gen)
        q_groups = torch.randint(0, 4, (300,), generator=gen)
        _, idx = pcops.knn(q, p, 5, backend="warp", query_batch=q_groups, ref_batch=groups)
        for b in range(4):
            rows, cols = (q_groups == b).nonzero().flatten(), (groups == b).nonzero().flatten()
            _, ref_idx = reference.knn(q[rows], p[cols], 5)
            torch.testing.assert_close(idx[rows], cols[ref_idx], rtol=0, atol=0)


@pytest.mark.parametrize("sort_queries", [False, True])
@pytest.mark.parametrize("by_sorting", [False, True])
def test_warp_kd_tree_with_more_samples_than_leaves(gen, monkeypatch, sort_queries, by_sorting):
    # many tiny samples: tree nodes spanning several samples are split between samples; the
    # GPUs' build (Morton order, run here on the CPU) gives the same results
    from pcops.ops.neighbours.nearest import _kdtree as tree

    monkeypatch.setattr(tree, "_SORT_QUERIES_ABOVE", 0 if sort_queries else 1 << 62)
    monkeypatch.setattr(tree, "_GPU_BUILD", by_sorting)
    sizes = torch.randint(1, 6, (300,), generator=gen)
    p_batch = torch.repeat_interleave(torch.arange(300), sizes)
    p = torch.rand(int(sizes.sum()), 3, generator=gen, dtype=F64)
    q_batch = torch.arange(300).repeat(3)
    q = torch.rand(900, 3, generator=gen, dtype=F64)
    _, idx = pcops.knn(q, p, 4, backend="warp", query_batch=q_batch, ref_batch=p_batch)
    for b in range(0, 300, 7):
        rows, cols = (q_batch == b).nonzero().flatten(), (p_batch == b).nonzero().flatten()
        k = min(4, int(sizes[b]))
        _, ref_idx = reference.knn(q[rows], p[cols], k)
        torch.testing.assert_close(idx[rows, :k], cols[ref_idx], rtol=0, atol=0)
        assert (idx[rows, k:] == -1).all()


@pytest.mark.parametrize("ids", [(-7, -3, 5), (-(2**31), 0, 2**31 - 1)])
def test_warp_negative_and_extreme_sample_ids_without_validation(gen, ids):
    # with validate=False, ids the checks would refuse still search exactly, sample by sample
    ids = torch.tensor(ids)
    p_batch, q_batch = ids[torch.randint(0, 3, (600,), generator=gen)], ids[torch.randint(0, 3, (90,), generator=gen)]
    p, q = torch.rand(600, 3, generator=gen, dtype=F64), torch.rand(90, 3, generator=gen, dtype=F64)
    _, idx = pcops.knn(q, p, 4, backend="warp", query_batch=q_batch, ref_batch=p_batch, validate=False)
    for b in ids:
        rows, cols = (q_batch == b).nonzero().flatten(), (p_batch == b).nonzero().flatten()
        _, ref_idx = reference.knn(q[rows], p[cols], 4)
        torch.testing.assert_close(idx[rows], cols[ref_idx], rtol=0, atol=0)


def test_warp_search_terminates_on_non_finite_points_without_validation(gen):
    p = torch.rand(300, 3, generator=gen, dtype=F64)
    q = torch.rand(40, 3, generator=gen, dtype=F64)
    p[[3, 50, 120]] = float("nan")
    p[7, 1], p[9, 0] = float("inf"), float("-inf")
    q[2, 0], q[5, 2] = float("nan"), float("inf")
    _, idx = pcops.knn(q, p, 6, backend="warp", validate=False)
    assert (idx[[2, 5]] == -1).all()
    finite = torch.isfinite(p).all(1).nonzero().flatten()
    rows = torch.tensor([i for i in range(40) if i not in (2, 5)])
    _, ref_idx = reference.knn(q[rows], p[finite], 6)
    torch.testing.assert_close(idx[rows], finite[ref_idx], rtol=0, atol=0)


def test_a_nan_query_without_validation_gives_no_other_point_a_nan_gradient(gen):
    # a query that finds none (NaN, validate=False) stands in row 0 for its missing neighbours:
    # their distances once sent 0 * NaN into row 0's gradient; padding rows of NaN did the same
    # to another sample's point. The gradients equal those of the call without the NaN query
    p = torch.rand(6, 3, generator=gen, dtype=F64)
    q = torch.rand(4, 3, generator=gen, dtype=F64)
    bad = torch.cat([q, torch.tensor([[float("nan"), 0.5, 0.5]], dtype=F64)])
    f = torch.rand(6, 2, generator=gen, dtype=F64)
    calls = {
        "knn": lambda q, p: pcops.knn(q, p, 2, validate=False).dists,
        "knn_aggregate": lambda q, p: pcops.knn_aggregate(q, p, f, 2, sigma=0.3, validate=False),
        "knn_interpolate": lambda q, p: pcops.knn_interpolate(q, p, f, k=2, validate=False),
        "ball_query": lambda q, p: pcops.ball_query(q, p, 0.6, 3, validate=False).dists,
    }
    for name, call in calls.items():
        grads = []
        for queries in (q, bad):
            ref = p.clone().requires_grad_()
            out = call(queries, ref)[: len(q)]
            torch.where(torch.isfinite(out), out, 0).sum().backward()
            grads.append(ref.grad)
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-14, msg=name)
    padded = torch.stack([torch.cat([q, torch.full((2, 3), float("nan"), dtype=F64)]), torch.cat([q.flip(0), q[:2]])])
    for name, kw in (("knn", {}), ("ball_query", {})):
        ref = torch.stack([p, p.flip(0)]).requires_grad_()
        lengths = torch.tensor([4, 6])
        if name == "knn":
            out = pcops.knn(padded, ref, 2, query_lengths=lengths, validate=False).dists
        else:
            out = pcops.ball_query(padded, ref, 0.6, 3, query_lengths=lengths, validate=False).dists
        torch.where(torch.isfinite(out), out, 0).sum().backward()
        assert torch.isfinite(ref.grad).all(), name


def test_warp_leaves_of_nan_points_only_are_skipped_exactly(gen):
    # a third of the cloud NaN: whole subtrees hold NaN points only (their boxes are empty, from
    # +inf to -inf); the neighbours are those of the finite points
    p = torch.randn(3000, 3, generator=gen, dtype=F64)
    p[1000:2000, 1] = float("nan")
    q = torch.randn(200, 3, generator=gen, dtype=F64)
    _, idx = pcops.knn(q, p, 7, backend="warp", validate=False)
    finite = torch.isfinite(p).all(1).nonzero().flatten()
    _, ref_idx = reference.knn(q, p[finite], 7)
    torch.testing.assert_close(idx, finite[ref_idx], rtol=0, atol=0)


def test_warp_batched_search_equals_a_per_sample_loop(gen):
    sizes = [900, 40, 3, 1500]
    ps = [torch.randn(s, 3, generator=gen, dtype=F64) for s in sizes]
    qs = [torch.randn(200, 3, generator=gen, dtype=F64) for _ in sizes]
    perm_p, perm_q = torch.randperm(sum(sizes), generator=gen), torch.randperm(800, generator=gen)
    p_batch = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))[perm_p]
    q_batch = torch.repeat_interleave(torch.arange(4), 200)[perm_q]
    p, q = torch.cat(ps)[perm_p], torch.cat(qs)[perm_q]
    _, idx = pcops.knn(q, p, 5, backend="warp", query_batch=q_batch, ref_batch=p_batch)
    for b in range(4):
        rows, cols = (q_batch == b).nonzero().flatten(), (p_batch == b).nonzero().flatten()
        k = min(5, sizes[b])
        _, ref_idx = reference.knn(q[rows], p[cols], k)
        torch.testing.assert_close(idx[rows, :k], cols[ref_idx], rtol=0, atol=0)
        assert (idx[rows, k:] == -1).all()


def _grouped_cases(gen, dtype):
    """(query, ref, query ids, ref ids) of packed searches: sorted ids (self-queries, as a
    PyTorch Geometric batch gives them) and shuffled ones, integer coordinates (exact ties,
    duplicates), a sample of queries without reference points, one of points without queries,
    samples smaller than k, one sample large enough to be built on every thread, extreme ids."""
    sizes = [4200, 2, 0, 1300, 9, 600]
    p = torch.randint(0, 16, (sum(sizes), 3), generator=gen).to(dtype)
    p_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    yield p, p, p_ids, p_ids  # sorted, one tensor both ways (a self-query)
    q = torch.randint(0, 16, (500, 3), generator=gen).to(dtype)
    q_ids = torch.randint(0, 7, (500,), generator=gen)  # (sample 6: no reference point; 4 of 9 points)
    yield q, p, q_ids.sort().values, p_ids
    perm = torch.randperm(p.shape[0], generator=gen)
    extreme = torch.tensor([-(2**31), -5, 0, 7, 2**20, 2**31 - 1])
    yield q, p[perm], extreme[q_ids.clamp(max=5)], extreme[p_ids[perm]]
    yield p[perm], p[perm], p_ids[perm], p_ids[perm]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_warp_grouped_search_over_a_forest_equals_the_batch_tree(gen, monkeypatch, dtype):
    # a kd-tree per sample (FOREST) and the batch's one tree give the same neighbours as the
    # float64 reference, ties by the smaller index, -1 / inf past a sample's points
    k = 12
    for q, p, q_ids, p_ids in _grouped_cases(gen, dtype):
        found = []
        for forest in (False, True):
            monkeypatch.setattr(_kdtree, "FOREST", [forest])
            found.append(pcops.knn(q, p, k, backend="warp", query_batch=q_ids, ref_batch=p_ids, validate=False))
        torch.testing.assert_close(found[1].idx, found[0].idx, rtol=0, atol=0)
        torch.testing.assert_close(found[1].dists, found[0].dists, rtol=0, atol=0)
        for b in torch.unique(q_ids):
            rows, cols = (q_ids == b).nonzero().flatten(), (p_ids == b).nonzero().flatten()
            n = min(k, cols.shape[0])
            if n:
                d, ref_idx = reference.knn(q[rows].double(), p[cols].double(), n)
                torch.testing.assert_close(found[1].idx[rows, :n], cols[ref_idx], rtol=0, atol=0)
                torch.testing.assert_close(found[1].dists[rows, :n].double(), d, rtol=1e-6, atol=1e-6)
            assert (found[1].idx[rows, n:] == -1).all() and torch.isinf(found[1].dists[rows, n:]).all()


def test_warp_forest_search_terminates_on_non_finite_points_without_validation(gen, monkeypatch):
    # NaN and inf points in the samples of a forest are never neighbours, a non-finite query
    # finds none: the batch's one tree gives the same rows, the finite ones the reference's
    sizes = [900, 40, 3, 1500]
    p = torch.randn(sum(sizes), 3, generator=gen, dtype=F64)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    p[[3, 50, 120, 950, 1000]] = float("nan")
    p[7, 1], p[1200, 0] = float("inf"), float("-inf")
    found = []
    for forest in (False, True):
        monkeypatch.setattr(_kdtree, "FOREST", [forest])
        found.append(pcops.knn(p, p, 6, backend="warp", query_batch=ids, ref_batch=ids, validate=False))
    torch.testing.assert_close(found[1].idx, found[0].idx, rtol=0, atol=0)
    finite = torch.isfinite(p).all(1)
    assert (found[1].idx[~finite] == -1).all()
    for b in range(4):
        rows = (finite & (ids == b)).nonzero().flatten()
        cols = rows
        k = min(6, cols.shape[0])
        _, ref_idx = reference.knn(p[rows], p[cols], k)
        torch.testing.assert_close(found[1].idx[rows, :k], cols[ref_idx], rtol=0, atol=0)


def test_warp_grouped_search_builds_a_forest_unless_each_sample_is_a_node_of_the_batch_tree(gen, monkeypatch):
    # equal samples, a power of two of them, are each one node of the batch's tree: it is kept;
    # any other batch gets the forest (and a sample of most of the points is built on every
    # thread by the ungrouped build's launches, in place)
    forests, builds = [], []
    real_forest, real_launch = _kdtree._forest, _kdtree._warp.launch
    monkeypatch.setattr(_kdtree, "_forest", lambda *a: (lambda out: (forests.append(out is not None), out)[1])(real_forest(*a)))
    monkeypatch.setattr(_kdtree._warp, "launch", lambda kernel, n, *a, **kw: (builds.append(kernel), real_launch(kernel, n, *a, **kw))[1])
    kernels = _kdtree._build_kernels(torch.float32)[0], _kdtree._forest_kernel(torch.float32)
    for sizes, forest in (([600] * 4, False), ([600] * 3, True), ([600, 610], True), ([600, 601], False), ([5000, 300, 300], True), ([5000] * 2, False)):
        forests.clear()
        builds.clear()
        ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        p = torch.rand(sum(sizes), 3, generator=gen)
        pcops.knn(p, p, 4, backend="warp", query_batch=ids, ref_batch=ids)
        assert forests == [forest], sizes
        assert (kernels[1] in builds) == forest and (kernels[0] in builds) == (not forest or sizes[0] == 5000), sizes


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32, torch.uint8])
def test_a_packed_cloud_searched_in_itself_walks_its_forest_in_the_trees_order(gen, monkeypatch, ids_dtype):
    # one ids tensor both ways (knn with query_batch is ref_batch, knn_graph's batch) reaches the
    # search as one groups tensor, so the forest takes its queries in the trees' order (no query
    # order computed); the same neighbours as the batch's one tree and the float64 reference
    from pcops._layout import points as layout_points

    sizes = [700, 33, 1200, 5]
    p = torch.randint(0, 12, (sum(sizes), 3), generator=gen).float()
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(ids_dtype)
    qg, rg = layout_points._int32_ids(ids, ids)
    assert qg is rg and qg.dtype == torch.int32 and torch.equal(qg, ids.to(torch.int32))
    qg, rg = layout_points._int32_ids(ids, ids.clone())
    assert qg is not rg
    orders = []
    real = _kdtree._query_order
    monkeypatch.setattr(_kdtree, "_query_order", lambda *a: (orders.append(a[0].shape[0]), real(*a))[1])
    found = [(pcops.knn(p, p, 8, backend="warp", query_batch=ids, ref_batch=ids), pcops.knn_graph(p, 6, batch=ids))]
    strided = p.t().contiguous().t()  # (the same cloud, not contiguous: still one cloud once made contiguous)
    found.append((pcops.knn(strided, strided, 8, backend="warp", query_batch=ids, ref_batch=ids), pcops.knn_graph(strided, 6, batch=ids)))
    assert orders == []
    found.append((pcops.knn(p, p, 8, backend="warp", query_batch=ids, ref_batch=ids.clone()), pcops.knn_graph(p, 6, batch=ids)))
    assert orders == [p.shape[0]]  # (two ids tensors: the queries ordered as any other queries)
    monkeypatch.setattr(_kdtree, "FOREST", [False])
    found.append((pcops.knn(p, p, 8, backend="warp", query_batch=ids, ref_batch=ids), pcops.knn_graph(p, 6, batch=ids)))
    for other in found[1:]:
        for a, b in zip(torch.utils._pytree.tree_leaves(found[0]), torch.utils._pytree.tree_leaves(other), strict=True):
            assert torch.equal(a, b)
    for b in range(len(sizes)):
        rows = (ids == b).nonzero().flatten()
        k = min(8, rows.shape[0])
        _, ref_idx = reference.knn(p[rows].double(), p[rows].double(), k)
        assert torch.equal(found[0][0].idx[rows, :k], rows[ref_idx])


def test_a_sample_is_one_node_of_the_grouped_tree_exactly_where_a_node_holds_its_rows(gen):
    for n in (37, 1000, 1024, 4099):
        nodes = {(a, b) for d in range(13) for k in range(1 << d) for a, b in [((n * k) >> d, (n * (k + 1)) >> d)] if b - a >= 2}
        starts = torch.randint(0, n - 1, (400,), generator=gen).tolist()
        rows = [(a, a + int(torch.randint(2, n - a + 1, (1,), generator=gen))) for a in starts if n - a >= 2] + sorted(nodes)[:300]
        for a, b in rows:
            assert _kdtree._one_node(a, b, n) == ((a, b) in nodes), (n, a, b)


# -- the shared op suite (tests/op_suite.py) ----------------------------------------------------
K = 5


def _knn_padded(q, p, k):
    """reference.knn with the -1 / inf columns pcops.knn gives when a sample has fewer than k points."""
    d, idx = reference.knn(q, p, k)
    missing = k - idx.shape[1]
    return torch.cat([d, d.new_full((q.shape[0], missing), float("inf"))], 1), torch.cat([idx, idx.new_full((q.shape[0], missing), -1)], 1)


def _samples(gen, with_features=False):
    """Per-sample clouds of mixed sizes: an empty query sample, an empty ref sample, one with fewer than K points."""
    qs = [torch.rand(m, 3, generator=gen, dtype=F64) for m in (9, 0, 7, 5)]
    ps = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (12, 6, 0, 3)]
    fs = [torch.randn(len(p), 2, generator=gen, dtype=F64) for p in ps]
    return qs, ps, fs


def _search_op_cases(gen):
    """Every installed search op on the devices it runs on, both dtypes, single cloud and grouped (packed) inputs."""
    cases = []
    for backend in knn_module.BACKENDS.values():
        if not backend.available():
            continue
        op, devices = backend.op._opoverload, backend.devices
        for dtype in (torch.float32, F64):
            q, p = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(30, 3, generator=gen, dtype=dtype)
            qg = torch.randint(0, 3, (20,), generator=gen, dtype=torch.int32)
            rg = torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
            cases += [(op, (q, p, 4, True), devices), (op, (q, p, 4, True, qg, rg), devices)]
    return cases


def _padded_calls(gen, features=False):
    calls = []
    for b, m, n in ((2, 20, 30), (3, 27, 41)):
        q = torch.rand(b, m, 3, generator=gen).requires_grad_()
        p = torch.rand(b, n, 3, generator=gen).requires_grad_()
        ql, rl = torch.randint(0, m + 1, (b,), generator=gen), torch.randint(0, n + 1, (b,), generator=gen)
        extra = (torch.randn(b, n, 4, generator=gen).requires_grad_(), torch.tensor(0.2, requires_grad=True)) if features else ()
        calls.append((q, p, *extra, ql, rl))
    return calls


class TestKnnSuite(OpSuite):
    differentiable = ("query", "ref")

    def inputs(self, kind, gen):
        q, p, _ = cloud(kind, gen)
        return dict(query=q, ref=p)

    def run(self, query, ref):
        return tuple(pcops.knn(query, ref, K))

    def reference(self, query, ref):
        return reference.knn(query, ref, K)

    def compare(self, out, expected, dtype, inputs=None):
        (dists, idx), (ref_d, ref_idx) = out, expected
        assert idx.dtype == torch.int64 and idx.shape == ref_idx.shape
        torch.testing.assert_close(dists.double(), ref_d, **TOL[dtype])
        if dtype == F64:
            assert torch.equal(idx, ref_idx)
        else:  # rounding may reorder near-ties
            assert_ranked_up_to_ties(idx, inputs["query"].double(), inputs["ref"].double(), TOL[dtype]["atol"])

    def grad_inputs(self, gen):
        q, p, _ = _grad_inputs(gen)
        return dict(query=q, ref=p)

    def opcheck_cases(self, gen):
        return _search_op_cases(gen)

    def compile_calls(self, gen):
        def fn(query, ref, ql, rl):
            return tuple(pcops.knn(query, ref, K, query_lengths=ql, ref_lengths=rl))

        return fn, _padded_calls(gen)

    def batched(self, gen):
        qs, ps, _ = _samples(gen)
        expected = [_knn_padded(q, p, K) for q, p in zip(qs, ps)]
        (q, ql), (p, pl) = pad(qs), pad(ps)
        out = pcops.knn(q, p, K, query_lengths=ql, ref_lengths=pl)
        padded = [tuple(t[b, : len(qs[b])] for t in out) for b in range(len(qs))]
        qp, qb, q_pos, pp, pb, p_pos, _ = pack_pair(qs, ps, [torch.zeros(len(p), 1, dtype=F64) for p in ps], gen)
        d, idx = pcops.knn(qp, pp, K, query_batch=qb, ref_batch=pb)
        sizes = torch.tensor([len(x) for x in ps])
        to_local = torch.empty_like(p_pos)  # packed ref row -> row within its sample
        to_local[p_pos] = torch.arange(p_pos.numel()) - (sizes.cumsum(0) - sizes).repeat_interleave(sizes)
        packed, at = [], 0
        for x in qs:
            rows = q_pos[at : at + len(x)]
            packed.append((d[rows], torch.where(idx[rows] >= 0, to_local[idx[rows].clamp(min=0)], -1)))
            at += len(x)
        return expected, padded, packed

    def bad_inputs(self, gen):
        q, p = torch.rand(4, 3, generator=gen), torch.rand(6, 3, generator=gen)
        nan = p.clone()
        nan[1, 1] = float("nan")
        knn = pcops.knn
        return {
            "k above N": (lambda: knn(q, p, 7), ValueError, "k must be <= the number of ref points"),
            "zero k": (lambda: knn(q, p, 0), ValueError, "k must be >= 1"),
            "float k": (lambda: knn(q, p, 2.0), TypeError, "k must be an int"),
            "2-d query": (lambda: knn(q[:, :2], p, 2), ValueError, "query"),
            "int ref": (lambda: knn(q, p.long(), 2), TypeError, "ref"),
            "devices": (lambda: knn(q, p.to("meta"), 2), ValueError, "same device"),
            "NaN ref": (lambda: knn(q, nan, 2), ValueError, "ref contains NaN"),
            "unknown backend": (lambda: knn(q, p, 2, backend="faiss"), ValueError, "backend must be"),
            "lengths range": (lambda: knn(q[None], p[None], 2, ref_lengths=torch.tensor([7])), ValueError, "ref_lengths"),
            "batch alone": (lambda: knn(q, p, 2, query_batch=torch.zeros(4, dtype=torch.long)), ValueError, "query_batch and ref_batch"),
        }


class TestKnnAggregateSuite(OpSuite):
    """knn_aggregate with its default softmax weights (the other weightings: test_knn_features.py)."""

    differentiable = ("query", "ref", "features", "sigma")

    def inputs(self, kind, gen):
        q, p, _ = cloud(kind, gen)
        f = torch.randn(p.shape[0], 3, generator=gen, dtype=F64)
        sigma = reference.knn(q, p, 1)[0].mean() + 1e-3  # the scale of the cloud's spacing
        return dict(query=q, ref=p, features=f, sigma=sigma)

    def run(self, query, ref, features, sigma):
        return (pcops.knn_aggregate(query, ref, features, K, sigma),)

    def reference(self, query, ref, features, sigma):
        return (reference.knn_aggregate(query, ref, features, K, sigma),)

    def grad_inputs(self, gen):
        q, p, f = _grad_inputs(gen)
        return dict(query=q, ref=p, features=f, sigma=torch.tensor(0.1, dtype=F64))

    def opcheck_cases(self, gen):
        return _search_op_cases(gen)

    def compile_calls(self, gen):
        def fn(query, ref, features, sigma, ql, rl):
            return pcops.knn_aggregate(query, ref, features, K, sigma, query_lengths=ql, ref_lengths=rl)

        return fn, _padded_calls(gen, features=True)

    def batched(self, gen):
        qs, ps, fs = _samples(gen)
        sigma = 0.15
        expected = [(reference.knn_aggregate(q, p, f, K, sigma),) for q, p, f in zip(qs, ps, fs)]
        (q, ql), (p, pl), (f, _) = pad(qs), pad(ps), pad(fs)
        out = pcops.knn_aggregate(q, p, f, K, sigma, query_lengths=ql, ref_lengths=pl)
        padded = [(out[b, : len(qs[b])],) for b in range(len(qs))]
        qp, qb, q_pos, pp, pb, _, fp = pack_pair(qs, ps, fs, gen)
        out = pcops.knn_aggregate(qp, pp, fp, K, sigma, query_batch=qb, ref_batch=pb)
        return expected, padded, sample_rows(out, q_pos, qs)

    def bad_inputs(self, gen):
        q, p, f = torch.rand(4, 3, generator=gen), torch.rand(6, 3, generator=gen), torch.rand(6, 2, generator=gen)
        nan = f.clone()
        nan[2, 0] = float("nan")
        agg = pcops.knn_aggregate
        return {
            "features rows": (lambda: agg(q, p, f[:5], 2, 0.1), ValueError, "features"),
            "int features": (lambda: agg(q, p, f.int(), 2, 0.1), TypeError, "features"),
            "NaN features": (lambda: agg(q, p, nan, 2, 0.1), ValueError, "features contains NaN"),
            "no sigma": (lambda: agg(q, p, f, 2), ValueError, "sigma is required"),
            "negative sigma": (lambda: agg(q, p, f, 2, -0.1), ValueError, "sigma"),
            "zero tensor sigma": (lambda: agg(q, p, f, 2, torch.tensor(0.0)), ValueError, "sigma"),
            "two sigmas": (lambda: agg(q, p, f, 2, torch.tensor([0.1, 0.2])), ValueError, "sigma"),
            "k above N": (lambda: agg(q, p, f, 7, 0.1), ValueError, "k must be <= the number of ref points"),
            "unknown reduce": (lambda: agg(q, p, f, 2, 0.1, reduce="min"), ValueError, "reduce must be one of"),
        }


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_cpu_builds_splits_put_each_nodes_halves_either_side_of_its_middle_key(gen, dtype):
    """The CPU build's quickselect: every inner node's range is split at its middle index along
    the widest axis of its box, its first half's keys at most the split value and its second
    half's at least (NaN as +inf), on clouds made to stall a partition (one point repeated, a few
    distinct keys, sorted, reversed and organ-pipe keys, a sliver, NaN points) and on one cloud
    big enough for the threads' subtrees; every split finished (none marked), the points a
    permutation of the cloud's."""
    from pcops.ops.neighbours.nearest import _kdtree as tree

    n = 3001
    ramp = torch.arange(n, dtype=dtype)[:, None].expand(n, 3) * torch.tensor([1.0, 0.5, 0.25], dtype=dtype)
    clouds = {
        "uniform": torch.rand(n, 3, generator=gen, dtype=dtype),
        "one point": torch.ones(n, 3, dtype=dtype),
        "few keys": torch.randint(0, 3, (n, 3), generator=gen).to(dtype),
        "sorted": ramp.clone(),
        "reversed": ramp.flip(0).contiguous(),
        "organ pipe": torch.cat([ramp[: n // 2], ramp[n // 2 :].flip(0)]),
        "sliver": torch.rand(n, 3, generator=gen, dtype=dtype) * torch.tensor([1.0, 1e-6, 0.0], dtype=dtype),
        "NaN points": torch.rand(n, 3, generator=gen, dtype=dtype).index_fill_(0, torch.arange(0, n, 7), float("nan")),
        "large": torch.randn(1 << 16, 3, generator=gen, dtype=dtype),
    }
    for name, p in clouds.items():
        points, order, _, _, _, _, _, axis, split, depth = tree._tree(p, None)
        m = p.shape[0]
        assert torch.equal(torch.sort(order).values, torch.arange(m)) and torch.equal(points.nan_to_num(nan=7.0), p[order].nan_to_num(nan=7.0)), name
        keys = torch.nan_to_num(points, nan=float("inf"))
        for d in range(depth):
            nodes = torch.arange(1 << d)
            first, mid, last = (nodes * m) >> d, ((2 * nodes + 1) * m) >> (d + 1), ((nodes + 1) * m) >> d
            a = axis[(1 << d) - 1 + nodes].long()
            assert bool((a < 3).all()), (name, d)  # every split finished
            for k in range(1 << d):
                box = points[first[k] : last[k]]
                box = box[~box.isnan().any(1)]
                if len(box):
                    ext = box.amax(0) - box.amin(0)
                    assert int(a[k]) == int((ext == ext.max()).nonzero()[0]), (name, d, k)  # the widest axis (the first of equals)
                key = keys[first[k] : last[k], a[k]]
                s = split[(1 << d) - 1 + k]
                assert bool((key[: mid[k] - first[k]] <= s).all()) and bool((key[mid[k] - first[k] :] >= s).all()), (name, d, k)
