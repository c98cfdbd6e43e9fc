"""pcops.radius_aggregate and RadiusAggregation against a dense float64 reference."""

import math

import pytest
import torch

import pcops
from tests import reference
from tests.compile_check import assert_compiles_like_eager
from tests.op_suite import OpSuite, pack_pair, pad, sample_rows
from tests.reference import CLOUDS, cloud, safe_radius

F64 = torch.float64


def features(gen, n, f=5, dtype=F64):
    return torch.randn(n, f, generator=gen, dtype=dtype)


@pytest.mark.parametrize("kind", CLOUDS)
def test_forward_matches_dense_reference_float64(gen, kind):
    q, p, r = cloud(kind, gen)
    f = features(gen, p.shape[0])
    for sigma in (0.05 * r, r, 10.0 * r):
        out = pcops.radius_aggregate(q, p, f, r, sigma)
        torch.testing.assert_close(out, reference.radius_aggregate(q, p, f, r, sigma), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", CLOUDS)
def test_forward_matches_dense_reference_float32(gen, kind):
    q, p, r = cloud(kind, gen)
    q, p = q.float(), p.float()
    r = safe_radius(q, p, r)  # float32 distances must not flip pairs at the boundary
    f = features(gen, p.shape[0], dtype=torch.float32)
    out = pcops.radius_aggregate(q, p, f, r, 0.3 * r)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference.radius_aggregate(q, p, f, r, 0.3 * r), rtol=2e-5, atol=2e-5)


def test_queries_without_neighbours_get_zeros(gen):
    q, p, r = cloud("isolated", gen)
    out = pcops.radius_aggregate(q, p, features(gen, p.shape[0]), r, 0.1)
    has_neighbour = (reference.distances(q, p) <= r).any(1)
    assert (~has_neighbour).sum() >= q.shape[0] // 2
    assert torch.all(out[~has_neighbour] == 0)
    assert torch.all(out[has_neighbour].abs().sum(1) > 0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_tiny_sigma_is_finite_and_picks_the_nearest_neighbour(gen, dtype):
    q, p, r = cloud("uniform", gen)
    q, p = q.to(dtype), p.to(dtype)
    r = safe_radius(q, p, r)
    f = features(gen, p.shape[0], dtype=dtype)
    out = pcops.radius_aggregate(q, p, f, r, 1e-4)
    assert torch.isfinite(out).all()
    d = reference.distances(q, p)
    d[d > r] = math.inf
    two = d.topk(2, dim=1, largest=False).values
    clear = torch.isfinite(two[:, 0]) & (two[:, 1] - two[:, 0] > 0.01)  # one neighbour clearly nearest
    assert clear.sum() > q.shape[0] // 2
    torch.testing.assert_close(out[clear].double(), f[d.argmin(1)[clear]].double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), reference.radius_aggregate(q, p, f, r, 1e-4), rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("width", [1, 8, 9, 16])
def test_any_feature_width_matches_dense_reference_with_gradients(gen, width):
    """Features run in blocks of 8 columns: whole blocks (the sums kept in the output) and padded ones."""
    q, p, f, r = _grad_inputs(gen)
    f = features(gen, p.shape[0], width).requires_grad_()
    g = torch.randn(q.shape[0], width, generator=gen, dtype=F64)
    out = pcops.radius_aggregate(q, p, f, r, 0.2)
    torch.testing.assert_close(out, reference.radius_aggregate(q, p, f.detach(), r, 0.2), rtol=1e-10, atol=1e-12)
    ours = torch.autograd.grad((out * g).sum(), f)[0]
    ff = f.detach().clone().requires_grad_()
    theirs = torch.autograd.grad((reference.radius_aggregate(q, p, ff, r, 0.2) * g).sum(), ff)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_softmax_either_side_of_the_fixed_shift_limit_matches_dense_reference(gen, dtype):
    """radius / sigma at most a limit: weights exp(-d / sigma) (no per-query shift); above it the
    nearest distance is the shift (an online softmax). Both match the float64 reference."""
    from pcops.ops.neighbours import radius as radius_module

    q, p, f, r = _grad_inputs(gen)
    limit = radius_module._FIXED_SHIFT_LIMIT[dtype]
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    for sigma in (r / limit * 1.001, r / limit * 0.999):  # fixed shift, online shift
        leaves = [t.to(dtype).requires_grad_() for t in (q, p, f)]
        out = pcops.radius_aggregate(*leaves, r, sigma)
        torch.testing.assert_close(out.double(), reference.radius_aggregate(q, p, f, r, sigma), **tol)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        assert all(torch.isfinite(g).all() for g in grads)

def _grad_inputs(gen):
    """Small float64 clouds with every pair well away from the radius boundary and no d == 0."""
    q, p = torch.rand(12, 3, generator=gen, dtype=F64), torch.rand(16, 3, generator=gen, dtype=F64)
    r = safe_radius(q, p, 0.45, gap=1e-2)
    return q, p, features(gen, 16, 3), r


@pytest.mark.parametrize("wrt", ["query", "ref", "features", "sigma"])
def test_gradcheck(gen, wrt):
    q, p, f, r = _grad_inputs(gen)
    inputs = {"query": q, "ref": p, "features": f, "sigma": torch.tensor(0.2, dtype=F64)}
    inputs[wrt] = inputs[wrt].clone().requires_grad_()

    def fn(x):
        args = dict(inputs, **{wrt: x})
        return pcops.radius_aggregate(args["query"], args["ref"], args["features"], r, args["sigma"])

    assert torch.autograd.gradcheck(fn, (inputs[wrt],))


def test_gradients_match_autograd_through_dense_reference(gen):
    """Same gradients as autograd through a dense masked softmax (an independent derivation)."""
    q, p, f, r = _grad_inputs(gen)
    leaves = [t.clone().requires_grad_() for t in (q, p, f, torch.tensor(0.2, dtype=F64))]
    g = torch.randn(12, 3, generator=gen, dtype=F64)
    ours = torch.autograd.grad((pcops.radius_aggregate(*leaves[:3], r, leaves[3]) * g).sum(), leaves)
    qq, pp, ff, ss = leaves
    d = (qq[:, None] - pp[None]).pow(2).sum(-1).sqrt()
    mask = d <= r
    w = torch.where(mask, torch.exp(-d / ss), 0)
    dense = (w @ ff) / w.sum(1, keepdim=True).clamp_min(1e-300)
    theirs = torch.autograd.grad((dense * g).sum(), leaves)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_gradients_of_queries_without_neighbours_are_zero(gen):
    q, p, r = cloud("isolated", gen)
    q = q.clone().requires_grad_()
    pcops.radius_aggregate(q, p, features(gen, p.shape[0]), r, 0.1).sum().backward()
    lonely = ~(reference.distances(q.detach(), p) <= r).any(1)
    assert torch.all(q.grad[lonely] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_opcheck(gen, dtype):
    q, p, f, r = _grad_inputs(gen)
    q, p, f = (t.to(dtype).requires_grad_() for t in (q, p, f))
    sigma = torch.tensor(0.2, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.pcops.radius_aggregate.default, (q, p, f, sigma, r, True, None, None))
    out, wsum, dmin, points, feats, *cells = torch.ops.pcops.radius_aggregate(q, p, f, sigma, r, True, None, None)
    grad = torch.randn_like(out)
    for need_ref, need_features in ((True, True), (False, True), (True, False)):
        args = (grad, q.detach(), points, feats, sigma.detach(), r, None, out.detach(), wsum, dmin, need_ref, need_features, "softmax", *cells)
        torch.library.opcheck(torch.ops.pcops.radius_aggregate_backward.default, args)


def test_multithreaded_cpu_path_equals_single_thread(gen):
    """Large enough to split across threads: private scatter buffers must add up exactly."""
    q, p = torch.rand(6000, 3, generator=gen, dtype=F64), torch.rand(5000, 3, generator=gen, dtype=F64)
    f = features(gen, 5000, 4)
    leaves = [t.clone().requires_grad_() for t in (q, p, f)]
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            for t in leaves:
                t.grad = None
            out = pcops.radius_aggregate(*leaves, 0.08, 0.05)
            (out * out).sum().backward()
            results.append([out.detach()] + [t.grad.clone() for t in leaves])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_run_in_float32_and_return_input_dtype(gen, dtype):
    q, p, r = cloud("uniform", gen)
    q, p = q.to(dtype), p.to(dtype)
    r = safe_radius(q.float(), p.float(), r)
    f = features(gen, p.shape[0], dtype=dtype).requires_grad_()
    out = pcops.radius_aggregate(q, p, f, r, 0.2)
    assert out.dtype == dtype
    expected = reference.radius_aggregate(q.float(), p.float(), f.detach().float(), r, 0.2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    out.sum().backward()
    assert f.grad.dtype == dtype


def test_mixed_dtypes_promote(gen):
    q, p, r = cloud("uniform", gen)
    f = features(gen, p.shape[0], dtype=torch.float32)
    out = pcops.radius_aggregate(q, p, f, r, 0.2)  # float64 points, float32 features
    assert out.dtype == F64
    torch.testing.assert_close(out, reference.radius_aggregate(q, p, f, r, 0.2), rtol=1e-6, atol=1e-6)


def test_empty_query_or_ref_gives_zeros(gen):
    p, f = torch.rand(7, 3, dtype=F64), features(gen, 7, 4)
    assert pcops.radius_aggregate(torch.zeros(0, 3, dtype=F64), p, f, 0.5, 0.1).shape == (0, 4)
    q = torch.rand(5, 3, dtype=F64, requires_grad=True)
    out = pcops.radius_aggregate(q, torch.zeros(0, 3, dtype=F64), torch.zeros(0, 4, dtype=F64), 0.5, 0.1)
    assert out.shape == (5, 4) and torch.all(out == 0)
    out.sum().backward()
    assert torch.all(q.grad == 0)
    for reduce in ("mean", "max"):  # gradients to (0, F) features: zero-size, not an error (max's once indexed row 0)
        f0 = torch.zeros(0, 4, dtype=F64, requires_grad=True)
        out = pcops.radius_aggregate(q, torch.zeros(0, 3, dtype=F64), f0, 0.5, 0.1 if reduce == "mean" else None, reduce=reduce)
        assert torch.all(out == 0)
        out.sum().backward()
        assert f0.grad.shape == (0, 4)


def test_non_contiguous_inputs(gen):
    q, p, r = cloud("uniform", gen)
    f = features(gen, p.shape[0], 6)
    out = pcops.radius_aggregate(q.t().contiguous().t(), p[::1].T.contiguous().T, f[:, ::2], r, 0.2)
    assert not f[:, ::2].is_contiguous()
    torch.testing.assert_close(out, reference.radius_aggregate(q, p, f[:, ::2], r, 0.2))


def test_sigma_tensor_of_shape_one_gets_gradient_of_same_shape(gen):
    q, p, f, r = _grad_inputs(gen)
    sigma = torch.tensor([0.2], dtype=F64, requires_grad=True)
    pcops.radius_aggregate(q, p, f, r, sigma).pow(2).sum().backward()
    assert sigma.grad.shape == (1,) and sigma.grad.abs().item() > 0


def _bad_inputs():
    q, p, f = torch.rand(4, 3), torch.rand(6, 3), torch.rand(6, 2)
    nan = p.clone()
    nan[2, 1] = float("nan")
    inf = q.clone()
    inf[0, 0] = float("inf")
    return [
        ((q[:, :2], p, f, 0.5, 0.1), ValueError, "query"),
        ((q[None, None], p, f, 0.5, 0.1), ValueError, "query"),
        ((q[None], p, f, 0.5, 0.1), ValueError, r"ref must be a tensor of shape \(B, N, 3\)"),
        ((q, p[:, :2], f, 0.5, 0.1), ValueError, "ref"),
        ((q, p, f[:5], 0.5, 0.1), ValueError, "features"),
        ((q, p, f[:, 0], 0.5, 0.1), ValueError, "features"),
        ((q.long(), p, f, 0.5, 0.1), TypeError, "query"),
        ((q, p.to(torch.complex64), f, 0.5, 0.1), TypeError, "ref"),
        ((q, p, f.int(), 0.5, 0.1), TypeError, "features"),
        ((q.numpy(), p, f, 0.5, 0.1), TypeError, "query"),
        ((q, p, f, 0.0, 0.1), ValueError, "radius"),
        ((q, p, f, -1.0, 0.1), ValueError, "radius"),
        ((q, p, f, float("inf"), 0.1), ValueError, "radius"),
        ((q, p, f, "0.5", 0.1), TypeError, "radius"),
        ((q, p, f, 0.5, 0.0), ValueError, "sigma"),
        ((q, p, f, 0.5, float("nan")), ValueError, "sigma"),
        ((q, p, f, 0.5, torch.tensor(-0.1)), ValueError, "sigma"),
        ((q, p, f, 0.5, torch.tensor([0.1, 0.2])), ValueError, "sigma"),
        ((q, nan, f, 0.5, 0.1), ValueError, "ref contains NaN"),
        ((inf, p, f, 0.5, 0.1), ValueError, "query contains NaN or inf"),
        ((q, p.to("meta"), f, 0.5, 0.1), ValueError, "same device"),
    ]


@pytest.mark.parametrize("args,error,match", _bad_inputs())
def test_bad_input_raises_clear_error(args, error, match):
    with pytest.raises(error, match=match):
        pcops.radius_aggregate(*args)


def test_validate_false_skips_value_checks():
    p = torch.rand(6, 3)
    p[0, 0] = float("nan")
    out = pcops.radius_aggregate(torch.rand(4, 3), p, torch.rand(6, 2), 0.5, 0.1, validate=False)
    assert out.shape == (4, 2)


def test_module_matches_functional_and_learns_sigma(gen):
    q, p, f, r = _grad_inputs(gen)
    layer = pcops.RadiusAggregation(r, sigma=0.2, learnable_sigma=True).double()
    out = layer(q, p, f)
    torch.testing.assert_close(out, pcops.radius_aggregate(q, p, f, r, 0.2))
    out.pow(2).sum().backward()
    assert layer.log_sigma.grad is not None and layer.log_sigma.grad.abs() > 0
    fixed = pcops.RadiusAggregation(r, sigma=0.2)
    assert list(fixed.parameters()) == []
    torch.testing.assert_close(fixed(q, p, f), out.detach())


@pytest.mark.parametrize("kwargs,match", [({"radius": 0.0}, "radius"), ({"radius": 1.0, "sigma": -1.0}, "sigma"),
                                          ({"radius": 1.0, "sigma": None}, "sigma is required")])
def test_module_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pcops.RadiusAggregation(**kwargs)


def test_layers_check_their_options_when_built(gen):
    # options the functional op would refuse on the first call are refused when the layer is made;
    # sigma=None is a layer's sigma where its weighting takes none
    for make, match in ((lambda: pcops.KNNAggregation(3, backend="bogus"), "backend"),
                        (lambda: pcops.nn.SinkhornLoss(batch_reduction="bogus"), "batch_reduction"),
                        (lambda: pcops.KNNAggregation(3, None), "sigma is required"),
                        (lambda: pcops.KNNAggregation(3, 0.1, True, weights="uniform"), "learnable_sigma")):
        with pytest.raises(ValueError, match=match):
            make()
    q, p, f = torch.rand(6, 3, generator=gen), torch.rand(9, 3, generator=gen), torch.rand(9, 2, generator=gen)
    torch.testing.assert_close(pcops.KNNAggregation(3, None, weights="uniform")(q, p, f), pcops.knn_aggregate(q, p, f, 3, weights="uniform"))
    torch.testing.assert_close(pcops.RadiusAggregation(0.5, None, reduce="max")(q, p, f), pcops.radius_aggregate(q, p, f, 0.5, reduce="max"))


class _Model(torch.nn.Module):
    def __init__(self, radius):
        super().__init__()
        self.lift = torch.nn.Linear(3, 8)
        self.agg = pcops.RadiusAggregation(radius, sigma=0.1, learnable_sigma=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, query, ref):
        return self.head(self.agg(query, ref, torch.relu(self.lift(ref))))


def test_compile_fullgraph_matches_eager_without_recompiling_per_size(gen):
    assert_compiles_like_eager(_Model(0.3), [(40, 70), (55, 90)], gen)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_cuda_matches_cpu_on_a_side_stream(gen, dtype):
    q, p, f, r = _grad_inputs(gen)
    cpu = [t.to(dtype).requires_grad_() for t in (q, p, f)]
    out_cpu = pcops.radius_aggregate(*cpu, r, 0.2)
    out_cpu.pow(2).sum().backward()
    gpu = [t.detach().cuda().requires_grad_() for t in cpu]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out_gpu = pcops.radius_aggregate(*gpu, r, 0.2)
        out_gpu.pow(2).sum().backward()
    torch.cuda.synchronize()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu.detach(), **tol)
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.grad.cpu(), b.grad, **tol)


def test_backward_for_some_inputs_equals_the_full_backward(gen):
    q, p = torch.rand(300, 3, generator=gen, dtype=F64), torch.rand(400, 3, generator=gen, dtype=F64)
    f = features(gen, 400, 6)
    full = [x.clone().requires_grad_() for x in (q, p, f)]
    pcops.radius_aggregate(*full, 0.2, 0.1).pow(2).sum().backward()
    for wrt in range(3):
        part = [x.clone().requires_grad_(i == wrt) for i, x in enumerate((q, p, f))]
        pcops.radius_aggregate(*part, 0.2, 0.1).pow(2).sum().backward()
        torch.testing.assert_close(part[wrt].grad, full[wrt].grad, rtol=1e-12, atol=1e-12)
        assert all(x.grad is None for i, x in enumerate(part) if i != wrt)


def test_sparse_cloud_with_a_tiny_radius_uses_a_bounded_grid_and_stays_exact(gen):
    # 10^9 cells of width r / 2 would be needed: the cell list widens its cells instead
    q = torch.rand(300, 3, generator=gen, dtype=F64) * 1000
    p = torch.cat([q[:100] + 0.05 * torch.rand(100, 3, generator=gen, dtype=F64), torch.rand(400, 3, generator=gen, dtype=F64) * 1000])
    f = features(gen, p.shape[0])
    r = reference.safe_radius(q, p, 0.1)
    out = pcops.radius_aggregate(q, p, f, r, 0.05)
    torch.testing.assert_close(out, reference.radius_aggregate(q, p, f, r, 0.05), rtol=1e-10, atol=1e-12)


def test_queries_over_part_of_a_large_cloud_match_the_dense_reference_with_gradients(gen):
    """The cell list covers only the reference points that can be within the radius of a query
    (their box cut to the queries' box grown by the radius): points just inside that band, at
    exactly the radius from a query, and far outside it must all be treated as the dense
    reference treats them, in the forward and in every gradient."""
    r = 0.125
    q = torch.rand(200, 3, generator=gen, dtype=F64) * 0.5  # queries in [0, 0.5]^3
    p = torch.randn(3000, 3, generator=gen, dtype=F64) * 2  # most points far outside
    corner = q[q[:, 0].argmax()]  # the query farthest along x
    edge = torch.stack([corner + torch.tensor([r, 0.0, 0.0], dtype=F64),  # at exactly r (a neighbour)
                        corner + torch.tensor([r * (1 + 1e-9), 0.0, 0.0], dtype=F64),  # just beyond
                        corner - torch.tensor([0.0, 0.0, 0.9 * r], dtype=F64)])
    p = torch.cat([p, edge])
    f = features(gen, p.shape[0], 4)
    leaves = [t.clone().requires_grad_() for t in (q, p, f, torch.tensor(0.05, dtype=F64))]
    g = torch.randn(200, 4, generator=gen, dtype=F64)
    out = pcops.radius_aggregate(*leaves[:3], r, leaves[3])
    torch.testing.assert_close(out, reference.radius_aggregate(q, p, f, r, 0.05), rtol=1e-10, atol=1e-12)
    ours = torch.autograd.grad((out * g).sum(), leaves)
    qq, pp, ff, ss = leaves
    d = (qq[:, None] - pp[None]).pow(2).sum(-1).sqrt()
    w = torch.where(d <= r, torch.exp(-(d - d.detach().amin(1, keepdim=True)) / ss), 0)
    dense = (w @ ff) / w.sum(1, keepdim=True).clamp_min(1e-300)
    theirs = torch.autograd.grad((dense * g).sum(), leaves)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert (d[:, -3] <= r).any() and (ours[2][-3] != 0).any()  # the point at exactly r counts
    far = (d > r).all(0)
    assert far.sum() > 2000 and (ours[1][far] == 0).all() and (ours[2][far] == 0).all()


@pytest.mark.parametrize("limit", ["counting", "torch", "mixed"])
def test_cell_sort_is_a_sort_by_cell_with_the_start_of_each_cell(gen, monkeypatch, limit):
    """The CPU cell list's sort of the reference points and the queries (a counting sort below a
    size, the two in one launch; torch.sort above it): the keys in order (the counting sort: the
    order of a stable sort), and the first position of every cell of the reference points
    (empty cells and the dropped points, key == total, included). "mixed": the reference points
    counted and the more numerous queries sorted by torch.sort, or the other way round."""
    from pcops.ops.neighbours import _cells

    monkeypatch.setattr(_cells, "_COUNTING_SORT", {"counting": 1 << 62, "torch": 0, "mixed": 600}[limit])
    for n, m, total in ((0, 3, 5), (1, 1, 1), (1000, 10, 7), (5000, 200, 4000), (300, 700, 100_000)):
        keys = torch.randint(0, total + 1, (n,), generator=gen, dtype=torch.int64)
        query_keys = torch.randint(0, total, (m,), generator=gen, dtype=torch.int64)
        order, starts, rows = _cells._sort(keys, query_keys, total)
        for k, o, counted in ((keys, order, n < _cells._COUNTING_SORT), (query_keys, rows, m < _cells._COUNTING_SORT)):
            expected = torch.sort(k, stable=True)
            assert torch.equal(k[o], expected.values)
            if counted:
                assert torch.equal(o, expected.indices)
        expected = torch.sort(keys).values
        assert torch.equal(starts[: total + 1], torch.searchsorted(expected, torch.arange(total + 1)))
        assert starts.shape[0] == max(total + 1, _cells.capacity(n)) and bool((starts[total + 1:] == n).all())


def test_the_grids_extent_on_the_cpu_equals_the_boxes_of_the_finite_points(gen):
    """``_cells.extent_of``'s host numbers (the boxes of the finite reference and query points,
    zeros for a cloud without one, the largest sample id), which CPU clouds below 2^16 points
    read straight from the box kernel's corners: the float64 boxes of a reference computation,
    with NaN and inf points, a cloud of one finite point or none, sample ids, float32 and
    float64, and a cloud past the one-range size (the torch combination of 16 ranges)."""
    from pcops.ops.neighbours import _cells

    def expected(q, p, samples):
        out = []
        for x in (p, q):
            x = x.double()[torch.isfinite(x).all(1)]
            out += (x.amin(0).tolist() + x.amax(0).tolist()) if x.shape[0] else [0.0] * 6
        return out + [float(samples)]

    for dtype in (torch.float32, F64):
        for n, m in ((1, 1), (40, 7), (1 << 16, 30)):
            q, p = (10 * torch.randn(m, 3, generator=gen) - 3).to(dtype), (5 * torch.rand(n, 3, generator=gen) + 2).to(dtype)
            p[0, 1], q[-1, 2] = float("nan"), float("-inf")
            for group in (None, (torch.zeros(m, dtype=torch.int64), torch.randint(0, 9, (n,), generator=gen))):
                qg, pg = group or (None, None)
                samples = 0 if group is None else max(int(qg.max()), int(pg.max()))
                assert _cells.extent_of(q, p, qg, pg)[1] == expected(q, p, samples), (dtype, n, m)
        none = torch.full((3, 3), float("nan"), dtype=dtype)
        assert _cells.extent_of(none, none, None, None)[1] == [0.0] * 13


def test_non_finite_points_without_validation_terminate_and_are_never_neighbours(gen):
    q, p = torch.rand(50, 3, generator=gen, dtype=F64), torch.rand(80, 3, generator=gen, dtype=F64)
    f = features(gen, 80)
    p[[4, 9]] = float("nan")
    p[11, 2] = float("inf")
    q[3, 1] = float("nan")
    out = pcops.radius_aggregate(q, p, f, 0.3, 0.1, validate=False)
    finite = torch.isfinite(p).all(1)
    rows = torch.arange(50) != 3
    expected = reference.radius_aggregate(q[rows], p[finite], f[finite], 0.3, 0.1)
    torch.testing.assert_close(out[rows], expected, rtol=1e-10, atol=1e-12)
    assert (out[3] == 0).all()


class TestRadiusAggregateSuite(OpSuite):
    """radius_aggregate with its default softmax weights in the shared op suite (tests/op_suite.py)."""

    differentiable = ("query", "ref", "features", "sigma")

    def inputs(self, kind, gen):
        q, p, r = cloud(kind, gen)
        f = features(gen, p.shape[0], 3)
        return dict(query=q, ref=p, features=f, radius=safe_radius(q, p, r, gap=1e-3), sigma=torch.tensor(0.3 * r, dtype=F64))

    def run(self, query, ref, features, radius, sigma):
        return (pcops.radius_aggregate(query, ref, features, radius, sigma),)

    def reference(self, query, ref, features, radius, sigma):
        return (reference.radius_aggregate(query, ref, features, radius, sigma),)

    def grad_inputs(self, gen):
        q, p, f, r = _grad_inputs(gen)
        return dict(query=q, ref=p, features=f, radius=r, sigma=torch.tensor(0.2, dtype=F64))

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            q, p = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(30, 3, generator=gen, dtype=dtype)
            f, sigma = torch.randn(30, 4, generator=gen, dtype=dtype), torch.tensor(0.2, dtype=dtype)
            qg = torch.randint(0, 3, (20,), generator=gen, dtype=torch.int32)
            rg = torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
            op = torch.ops.pcops.radius_aggregate.default
            cases += [(op, (q, p, f, sigma, 0.3, True, None, None)), (op, (q, p, f, sigma, 0.3, True, qg, rg))]
        return cases

    def compile_calls(self, gen):
        def fn(query, ref, features, sigma, ql, rl):
            return pcops.radius_aggregate(query, ref, features, 0.35, sigma, query_lengths=ql, ref_lengths=rl)

        calls = []
        for b, m, n in ((2, 20, 30), (3, 27, 41)):
            q = torch.rand(b, m, 3, generator=gen).requires_grad_()
            p = torch.rand(b, n, 3, generator=gen).requires_grad_()
            f = torch.randn(b, n, 5, generator=gen).requires_grad_()
            sigma = torch.tensor(0.2, requires_grad=True)
            calls.append((q, p, f, sigma, torch.randint(0, m + 1, (b,), generator=gen), torch.randint(0, n + 1, (b,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        qs = [torch.rand(m, 3, generator=gen, dtype=F64) for m in (9, 0, 7, 5)]
        ps = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (12, 5, 0, 3)]
        fs = [features(gen, len(p), 2) for p in ps]
        r, sigma = 0.45, 0.2
        # an empty ref sample: zeros (the dense reference cannot reduce over no column)
        expected = [(reference.radius_aggregate(q, p, f, r, sigma) if len(p) else torch.zeros(len(q), 2, dtype=F64),) for q, p, f in zip(qs, ps, fs)]
        (q, ql), (p, pl), (f, _) = pad(qs), pad(ps), pad(fs)
        out = pcops.radius_aggregate(q, p, f, r, sigma, query_lengths=ql, ref_lengths=pl)
        padded = [(out[b, : len(qs[b])],) for b in range(len(qs))]
        qp, qb, q_pos, pp, pb, _, fp = pack_pair(qs, ps, fs, gen)
        out = pcops.radius_aggregate(qp, pp, fp, r, sigma, query_batch=qb, ref_batch=pb)
        return expected, padded, sample_rows(out, q_pos, qs)

    def bad_inputs(self, gen):
        cases = {f"{match} ({n})": (lambda args=args: pcops.radius_aggregate(*args), error, match) for n, (args, error, match) in enumerate(_bad_inputs())}
        q, p, f = torch.rand(4, 3, generator=gen), torch.rand(6, 3, generator=gen), torch.rand(6, 2, generator=gen)
        cases["no sigma"] = (lambda: pcops.radius_aggregate(q, p, f, 0.5), ValueError, "sigma is required")
        cases["lengths range"] = (lambda: pcops.radius_aggregate(q[None], p[None], f[None], 0.5, 0.1, ref_lengths=torch.tensor([7])), ValueError, "ref_lengths")
        return cases


@pytest.mark.parametrize("weights", ["softmax", "inverse_distance", "uniform"])
def test_gradients_of_gradients_with_respect_to_the_queries(gen, weights):
    """create_graph=True (eikonal losses): the first gradient is differentiable again, with
    respect to every input (float64 gradcheck of the first gradient), and equals the Warp one."""
    q, p, f, r = _grad_inputs(gen)
    sigma = torch.tensor(0.2, dtype=F64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, p, f, sigma)]
    if weights != "softmax":
        leaves = leaves[:3]

    def first(*x):
        s = x[3] if len(x) > 3 else None
        out = pcops.radius_aggregate(x[0], x[1], x[2], r, s, weights=weights)
        return torch.autograd.grad(out.sin().sum(), x[0], create_graph=True)[0]

    assert torch.autograd.gradcheck(first, leaves, fast_mode=True)
    s = leaves[3] if len(leaves) > 3 else None
    plain = torch.autograd.grad(pcops.radius_aggregate(*leaves[:3], r, s, weights=weights).sin().sum(), leaves[0])[0]
    torch.testing.assert_close(first(*leaves).detach(), plain, rtol=1e-10, atol=1e-12)


def test_the_layer_takes_an_eikonal_loss(gen):
    layer = pcops.RadiusAggregation(0.3, sigma=0.1, learnable_sigma=True).double()
    q = torch.rand(40, 3, generator=gen, dtype=F64).requires_grad_()
    p, f = torch.rand(60, 3, generator=gen, dtype=F64), torch.rand(60, 1, generator=gen, dtype=F64).requires_grad_()
    g = torch.autograd.grad(layer(q, p, f).sum(), q, create_graph=True)[0]
    ((g.norm(dim=1) - 1) ** 2).mean().backward()
    assert f.grad is not None and torch.isfinite(f.grad).all() and f.grad.abs().sum() > 0
    assert q.grad is not None and next(layer.parameters()).grad is not None


def test_sparse_sample_ids_beyond_the_saved_starts_table(gen):
    """More samples than the saved starts table holds (ids far apart): the backward makes the
    table again from the keys; values and gradients equal the per-sample results."""
    q, p = torch.rand(30, 3, generator=gen, dtype=F64), torch.rand(40, 3, generator=gen, dtype=F64)
    qb, pb = torch.randint(0, 2, (30,), generator=gen) * 1000, torch.randint(0, 2, (40,), generator=gen) * 1000
    f = features(gen, 40, 3)
    leaves = [t.clone().requires_grad_() for t in (q, p, f)]
    out = pcops.radius_aggregate(*leaves, 0.4, 0.1, query_batch=qb, ref_batch=pb)
    out.square().sum().backward()
    for b in (0, 1000):
        mq, mp = qb == b, pb == b
        parts = [t.detach()[m].clone().requires_grad_() for t, m in zip((q, p, f), (mq, mp, mp))]
        alone = pcops.radius_aggregate(*parts, 0.4, 0.1)
        alone.square().sum().backward()
        torch.testing.assert_close(out[mq].detach(), alone.detach())
        for leaf, part, m in zip(leaves, parts, (mq, mp, mp)):
            torch.testing.assert_close(leaf.grad[m], part.grad)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_cell_lists_of_extreme_radii_find_every_neighbour(dtype):
    """The cell list's geometry in Python floats: three widths of a radius below about 1e-109
    multiplied to 0 (a ZeroDivisionError), widths capped at 2^20 cells a side left a grid of a
    tiny radius short of the cloud (counts 0: a point missed itself), and a float32 radius above
    the dtype gave a cell's inverse of 0 (counts 0). Every radius > 0 now finds what a brute
    force of direct differences finds, on clouds above the every-pair scan (cell lists) and for
    radius_graph."""
    p = torch.rand(3000, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    p[1] = p[0]  # an exact duplicate: found at every radius
    pd = p.to(dtype)
    f = torch.ones(3000, 1, dtype=dtype)
    d2 = (pd[:200, None] - pd[None]).square().sum(-1)  # (direct differences in the dtype, as the ops measure)
    for r in (1e-300, 1e-120, 1e-108, 1e-105, 1e-100, 0.05, 1e39, 1e100, 1e300):
        r2 = torch.tensor(r, dtype=F64).square().to(dtype)
        want = (d2 <= r2).sum(1)  # (counts: all within the radius, not only the K kept)
        got = pcops.ball_query(pd[:200], pd, r, 8).counts
        assert torch.equal(got, want), r
        assert torch.equal(pcops.ball_queries(pd[:200], pd, [r], 8)[0].counts, want), r
        agg = pcops.radius_aggregate(pd[:200], pd, f, r, weights="uniform")
        assert torch.equal(agg, torch.ones_like(agg)), r
        edges = pcops.radius_graph(pd[:100], r, loop=True, max_neighbors=100)
        assert edges.shape[1] == int((d2[:100, :100] <= r2).sum()), r


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_cell_lists_at_the_ends_of_the_dtype_find_what_the_every_pair_scans_find(dtype, monkeypatch):
    """Clouds whose extent a radius dwarfs by hundreds of orders of magnitude (the grid's one
    cell was sized from the extent's share of the radius, which rounded to 0: the cell a
    subnormal wide, every point but the first outside it), and clouds wider than the dtype's
    largest number (float32 points at -3e38 and 3e38: their coordinate differences overflowed
    to inf, those points fell outside the grid, a point missed itself; in float64 the host's
    sizes were NaN, a ValueError): the cell lists find what the every-pair scans find and what a
    brute force of direct differences in the dtype finds, for ball_query, ball_queries,
    radius_aggregate and radius_graph."""
    from pcops.ops.neighbours import _ball_search, radius as radius_module

    big, g = torch.finfo(dtype).max, torch.Generator().manual_seed(2)
    tiny = torch.arange(300, dtype=F64)[:, None].repeat(1, 3) * (1e-40 if dtype == F64 else 1e-30)
    ends = torch.tensor([[-0.9 * big] * 3, [0.9 * big] * 3, [0.0] * 3, [-0.9 * big, 0.0, 0.0], [0.9 * big, 1.0, 0.0]], dtype=F64)
    spread = torch.randn(60, 3, generator=g, dtype=F64) * torch.logspace(-30, 30, 60, dtype=F64)[:, None]
    cases = [(tiny, [1e300 if dtype == F64 else 1e38, 1.0]), (ends, [1.0, 0.5 * big, big]), (spread, [1e-20, 1.0, 1e20, 1e35])]
    for points, radii in cases:
        p = points.to(dtype)
        d2 = (p[:, None] - p[None]).square().sum(-1)  # (direct differences in the dtype, as the ops measure)
        ones = torch.ones(p.shape[0], 1, dtype=dtype)
        for r in radii:
            reach = torch.tensor(r, dtype=F64).to(dtype)  # a pair whose square overflows is within an infinite radius only
            want = ((d2 <= reach.double().square().to(dtype)) & d2.isfinite() | reach.isinf()).sum(1)
            runs = []
            for pairs in (0, 1 << 40):  # cell lists, then the every-pair scans
                monkeypatch.setattr(_ball_search, "SCAN_PAIRS", pairs)
                monkeypatch.setattr(radius_module, "SCAN_PAIRS", pairs)
                found = pcops.ball_query(p, p, r, 8)
                assert torch.equal(found.counts, want), (p.shape, r, pairs)
                assert torch.equal(pcops.ball_queries(p, p, [r], 8)[0].idx, found.idx), (p.shape, r, pairs)
                assert torch.equal(pcops.radius_aggregate(p, p, ones, r, weights="uniform"), ones), (p.shape, r, pairs)
                edges = pcops.radius_graph(p, r, loop=True)
                assert edges.shape[1] == int(want.sum()), (p.shape, r, pairs)
                runs.append((found.idx, edges))
            assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), (p.shape, r)


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e-30), (torch.float32, 1e-21), (F64, 1e-170), (F64, 1e-158)])
def test_clouds_whose_squares_underflow_give_every_path_the_same_neighbours(dtype, scale, monkeypatch):
    """Clouds so small that squared distances round to subnormals or 0 in the dtype: a point
    within the radius is what the kernels' own test says, and the cell list (sized and windowed
    at least the square root of the smallest normal number) finds exactly what the every-pair
    scan finds: ball_query, each radius of ball_queries, radius_aggregate and radius_graph.
    Cells of the radius itself missed pairs the test passes (counts depended on the path and on
    the other radii of ball_queries)."""
    from pcops.ops.neighbours import _ball_search, radius as radius_module

    g = torch.Generator().manual_seed(1)
    p = (torch.rand(1500, 3, generator=g, dtype=F64) * scale).to(dtype)
    q = p[:120]
    radii = [scale * f for f in (0.001, 0.02, 0.1, 0.3)]
    f = torch.arange(1500, dtype=dtype)[:, None] % 7  # (small integers: every mean exact, in any order)

    def everything():
        return ([pcops.ball_query(q, p, r, 32) for r in radii], pcops.ball_queries(q, p, radii, [32] * 4),
                [pcops.radius_aggregate(q, p, f, r, weights="uniform") for r in radii],
                [pcops.radius_graph(p[:400], r, loop=True, max_neighbors=400).shape[1] for r in radii])

    runs = []
    for pairs in (0, 1 << 40):  # cell lists, then the every-pair scans
        monkeypatch.setattr(_ball_search, "SCAN_PAIRS", pairs)
        monkeypatch.setattr(radius_module, "SCAN_PAIRS", pairs)
        runs.append(everything())
    cells, scans = runs
    for g_, r in enumerate(radii):
        for got in (cells[0][g_], cells[1][g_], scans[1][g_]):
            assert torch.equal(got.counts, scans[0][g_].counts) and torch.equal(got.idx, scans[0][g_].idx), r
        torch.testing.assert_close(cells[2][g_], scans[2][g_], rtol=0, atol=0)
        dense = pcops.ball_query(p[:400], p[:400], r, 400).counts.sum()
        assert cells[3][g_] == int(dense), r
