"""knn_aggregate's weightings and max reduction, knn_interpolate, and their layer options."""

import pytest
import torch

import pcops
from tests import reference
from tests.compile_check import assert_compiles_like_eager
from tests.ops.test_batching import loop_aggregate, packed
from tests.reference import CLOUDS, cloud

F64 = torch.float64
CPU_BACKENDS = ["warp", "scipy", "torch"]
MODES = [("inverse_distance", "mean"), ("uniform", "mean"), ("uniform", "max")]


def _inputs(gen, m=10, n=25, f=4):
    return (
        torch.rand(m, 3, generator=gen, dtype=F64),
        torch.rand(n, 3, generator=gen, dtype=F64),
        torch.randn(n, f, generator=gen, dtype=F64),
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", CLOUDS)
@pytest.mark.parametrize("weights,reduce", MODES)
def test_matches_float64_reference(gen, backend, kind, weights, reduce):
    q, p, _ = cloud(kind, gen)
    f = torch.randn(p.shape[0], 3, generator=gen, dtype=F64)
    for k in (1, 3, 8):
        out = pcops.knn_aggregate(q, p, f, k, backend=backend, weights=weights, reduce=reduce)
        expected = reference.knn_weighted(q, p, f, k, weights, reduce)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_softmax_stays_the_default(gen):
    q, p, f = _inputs(gen)
    out = pcops.knn_aggregate(q, p, f, 5, 0.1)
    torch.testing.assert_close(out, pcops.knn_aggregate(q, p, f, 5, 0.1, weights="softmax", reduce="mean"), rtol=0, atol=0)
    torch.testing.assert_close(out, reference.knn_weighted(q, p, f, 5, "softmax", sigma=0.1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", CLOUDS)
def test_knn_interpolate_is_inverse_distance_with_k3(gen, kind):
    q, p, _ = cloud(kind, gen)
    f = torch.randn(p.shape[0], 5, generator=gen, dtype=F64)
    torch.testing.assert_close(pcops.knn_interpolate(q, p, f), reference.knn_weighted(q, p, f, 3, "inverse_distance"), rtol=1e-10, atol=1e-12)


def test_query_on_a_reference_point_takes_its_feature(gen):
    q, p, f = _inputs(gen)
    out = pcops.knn_interpolate(p[:6], p, f, k=4)
    torch.testing.assert_close(out, f[:6], rtol=1e-10, atol=1e-10)


def test_inverse_distance_is_finite_at_any_scale(gen):
    q, p, f = _inputs(gen)
    for scale in (1e-12, 1e12):
        for dtype in (torch.float32, F64):
            out = pcops.knn_interpolate((q * scale).to(dtype), (p * scale).to(dtype), f.to(dtype), k=4)
            assert torch.isfinite(out).all()
            expected = reference.knn_weighted(q * scale, p * scale, f, 4, "inverse_distance")
            torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_knn_interpolate_caps_k_at_the_reference_count(gen):
    q, p, f = _inputs(gen, n=2)
    torch.testing.assert_close(pcops.knn_interpolate(q, p, f, k=3), pcops.knn_interpolate(q, p, f, k=2), rtol=0, atol=0)


@pytest.mark.parametrize("weights,reduce", MODES)
@pytest.mark.parametrize("wrt", ["query", "ref", "features"])
def test_gradcheck(gen, weights, reduce, wrt):
    q, p, f = _inputs(gen)
    inputs = {"query": q, "ref": p, "features": f}
    inputs[wrt] = inputs[wrt].clone().requires_grad_()

    def fn(x):
        a = dict(inputs, **{wrt: x})
        return pcops.knn_aggregate(a["query"], a["ref"], a["features"], 5, weights=weights, reduce=reduce)

    assert torch.autograd.gradcheck(fn, (inputs[wrt],))  # random features: no ties in the max


def test_max_gradient_goes_to_the_arg_max_only(gen):
    q, p, f = _inputs(gen)
    f = f.clone().requires_grad_()
    out = pcops.knn_aggregate(q, p, f, 5, reduce="max")
    out.sum().backward()
    _, idx = reference.knn(q, p, 5)
    arg = f.detach()[idx].argmax(1)  # (M, F): which of the k neighbours holds each max
    expected = torch.zeros_like(f)
    for i in range(q.shape[0]):
        for c in range(f.shape[1]):
            expected[idx[i, arg[i, c]], c] += 1
    assert torch.equal(f.grad, expected)


def test_max_of_tied_features_sends_the_gradient_to_one_neighbour(gen):
    q, p, _ = _inputs(gen)
    f = torch.ones(p.shape[0], 2, dtype=F64, requires_grad=True)
    pcops.knn_aggregate(q, p, f, 4, reduce="max").sum().backward()
    assert f.grad.sum() == q.shape[0] * 2 and f.grad.max() <= q.shape[0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("weights,reduce", MODES)
def test_padded_and_packed_equal_a_loop(gen, backend, weights, reduce):
    from tests.ops.test_batching import QL, RL, M, N

    k = 3
    q = torch.rand(len(QL), M, 3, generator=gen, dtype=F64)
    p = torch.rand(len(RL), N, 3, generator=gen, dtype=F64)
    f = torch.randn(len(RL), N, 3, generator=gen, dtype=F64)
    ql, rl = torch.tensor(QL), torch.tensor(RL)

    def one(a, b_, c):
        return pcops.knn_aggregate(a, b_, c, min(k, b_.shape[0]), backend="torch", weights=weights, reduce=reduce)

    expected = loop_aggregate(one, q, p, f, QL, RL)
    kw = dict(backend=backend, weights=weights, reduce=reduce)
    out = pcops.knn_aggregate(q, p, f, k, query_lengths=ql, ref_lengths=rl, **kw)
    torch.testing.assert_close(out, expected)
    assert torch.all(out[2] == 0)  # a sample without reference points: zeros (also for max)
    qp, pp, fp, qb, rb, q_rows, _ = packed(q, p, f, QL, RL, gen)
    out = pcops.knn_aggregate(qp, pp, fp, k, query_batch=qb, ref_batch=rb, **kw)
    torch.testing.assert_close(out, torch.stack([expected[b, i] for b, i in q_rows]))


def test_knn_interpolate_takes_batch_layouts(gen):
    q = torch.rand(2, 6, 3, generator=gen, dtype=F64)
    p = torch.rand(2, 4, 3, generator=gen, dtype=F64)
    f = torch.randn(2, 4, 2, generator=gen, dtype=F64)
    out = pcops.knn_interpolate(q, p, f, query_lengths=torch.tensor([6, 2]), ref_lengths=torch.tensor([4, 2]))
    torch.testing.assert_close(out[0], pcops.knn_interpolate(q[0], p[0], f[0]))
    torch.testing.assert_close(out[1, :2], pcops.knn_interpolate(q[1, :2], p[1, :2], f[1, :2]))
    assert torch.all(out[1, 2:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weights,reduce", MODES)
def test_dtypes(gen, dtype, weights, reduce):
    q, p, f = _inputs(gen)
    out = pcops.knn_aggregate(q.to(dtype), p.to(dtype), f.to(dtype), 4, weights=weights, reduce=reduce)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    expected = reference.knn_weighted(q.to(dtype), p.to(dtype), f.to(dtype), 4, weights, reduce)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_layer_options_match_the_functional(gen):
    q, p, f = _inputs(gen)
    for weights, reduce in MODES:
        layer = pcops.KNNAggregation(4, weights=weights, reduce=reduce)
        expected = pcops.knn_aggregate(q, p, f, 4, weights=weights, reduce=reduce)
        torch.testing.assert_close(layer(q, p, f), expected, rtol=0, atol=0)
        assert repr(reduce) in repr(layer)


def test_empty_query_set(gen):
    _, p, f = _inputs(gen)
    for weights, reduce in MODES:
        out = pcops.knn_aggregate(torch.zeros(0, 3, dtype=F64), p, f, 3, weights=weights, reduce=reduce)
        assert out.shape == (0, 4)


def _bad():
    q, p, f = torch.rand(4, 3), torch.rand(6, 3), torch.rand(6, 2)
    return [
        (lambda: pcops.knn_aggregate(q, p, f, 2, reduce="min"), ValueError, "reduce must be one of"),
        (lambda: pcops.knn_aggregate(q, p, f, 2, 0.1, weights="gaussian"), ValueError, "weights must be one of"),
        (lambda: pcops.knn_aggregate(q, p, f, 2), ValueError, "sigma is required"),
        (lambda: pcops.knn_aggregate(q, p, f, 2, 0.1, weights="uniform"), ValueError, "sigma is used by"),
        (lambda: pcops.knn_aggregate(q, p, f, 2, weights="inverse_distance", reduce="max"), ValueError, "reduce='max'"),
        (lambda: pcops.knn_interpolate(q, p[:0], f[:0]), ValueError, "ref must hold at least one point"),
        (lambda: pcops.knn_interpolate(q, p, f, k=0), ValueError, "k must be >= 1"),
        (lambda: pcops.knn_interpolate(q, p, f, k=2.0), TypeError, "k must be an int"),
        (lambda: pcops.knn_interpolate(q, p, f[:5]), ValueError, "features"),
        (lambda: pcops.knn_interpolate(q, p.long(), f), TypeError, "ref"),
        (lambda: pcops.KNNAggregation(3, reduce="sum"), ValueError, "reduce must be one of"),
        (lambda: pcops.KNNAggregation(3, learnable_sigma=True, weights="uniform"), ValueError, "learnable_sigma"),
    ]


@pytest.mark.parametrize("call,error,match", _bad())
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


class _FeaturePropagation(torch.nn.Module):
    """A PointNet++-like block: max-pool onto a coarse set, interpolate back, both compiled."""

    def __init__(self):
        super().__init__()
        self.lift = torch.nn.Linear(3, 8)
        self.pool = pcops.KNNAggregation(4, reduce="max")
        self.head = torch.nn.Linear(8, 1)

    def forward(self, query, ref):
        coarse = ref[::2]
        pooled = self.pool(coarse, ref, torch.relu(self.lift(ref)))
        return self.head(pcops.knn_interpolate(query, coarse, pooled) + pcops.knn_aggregate(query, ref, self.lift(ref), 3, weights="uniform"))


def test_compile_fullgraph_matches_eager_without_recompiling_per_size(gen):
    assert_compiles_like_eager(_FeaturePropagation(), [(30, 50), (45, 80)], gen)


@pytest.mark.cuda
@pytest.mark.parametrize("weights,reduce", MODES)
def test_cuda_matches_reference(gen, weights, reduce):
    q, p, _ = cloud("uniform", gen, m=500, n=800)
    f = torch.randn(p.shape[0], 6, generator=gen, dtype=F64)
    out = pcops.knn_aggregate(q.cuda(), p.cuda(), f.cuda(), 8, weights=weights, reduce=reduce)
    torch.testing.assert_close(out.cpu(), reference.knn_weighted(q, p, f, 8, weights, reduce), rtol=1e-10, atol=1e-10)
