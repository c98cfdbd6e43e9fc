"""Padded and packed batches for every op equal a Python loop over the samples."""

import pytest
import torch

import pcops
from tests.compile_check import assert_compiles_like_eager

F64 = torch.float64
QL, RL = [5, 0, 7, 3, 4], [6, 4, 0, 2, 6]  # mixed sizes, an empty query set, an empty ref set, 2 < k
M, N, F, K = 7, 6, 3, 3
BACKENDS = ["warp", "scipy", "torch"]


@pytest.fixture
def batch(gen):
    """A padded batch whose samples overlap in space (so isolation between samples is tested)."""
    q = torch.rand(len(QL), M, 3, generator=gen, dtype=F64)
    p = torch.rand(len(RL), N, 3, generator=gen, dtype=F64)
    f = torch.randn(len(RL), N, F, generator=gen, dtype=F64)
    return q, p, f, torch.tensor(QL), torch.tensor(RL)


def packed(q, p, f, ql, rl, gen):
    """The same samples packed, in a shuffled order, with sample ids; and where each row came from."""
    q_rows = [(b, i) for b in range(len(ql)) for i in range(ql[b])]
    r_rows = [(b, j) for b in range(len(rl)) for j in range(rl[b])]
    q_perm = torch.randperm(len(q_rows), generator=gen).tolist()
    r_perm = torch.randperm(len(r_rows), generator=gen).tolist()
    q_rows, r_rows = [q_rows[i] for i in q_perm], [r_rows[i] for i in r_perm]
    qp = torch.stack([q[b, i] for b, i in q_rows])
    pp = torch.stack([p[b, j] for b, j in r_rows])
    fp = torch.stack([f[b, j] for b, j in r_rows])
    qb = torch.tensor([b for b, _ in q_rows])
    rb = torch.tensor([b for b, _ in r_rows])
    return qp, pp, fp, qb, rb, q_rows, r_rows


def loop_knn(q, p, ql, rl, k):
    """Per-sample knn, padded with -1 / inf: the reference for batched knn."""
    dists = torch.full((len(ql), q.shape[1], k), float("inf"), dtype=q.dtype)
    idx = torch.full((len(ql), q.shape[1], k), -1)
    for b in range(len(ql)):
        kk = min(k, int(rl[b]))
        if ql[b] and kk:
            d, i = pcops.knn(q[b, : ql[b]], p[b, : rl[b]], kk, backend="torch")
            dists[b, : ql[b], :kk], idx[b, : ql[b], :kk] = d, i
    return dists, idx


def loop_aggregate(fn, q, p, f, ql, rl):
    """Per-sample aggregation (zeros for padding and for samples without reference points)."""
    out = torch.zeros(len(ql), q.shape[1], f.shape[-1], dtype=f.dtype)
    for b in range(len(ql)):
        if ql[b] and rl[b]:
            out[b, : ql[b]] = fn(q[b, : ql[b]], p[b, : rl[b]], f[b, : rl[b]])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_knn_padded_equals_loop(batch, backend):
    q, p, _, ql, rl = batch
    dists, idx = pcops.knn(q, p, K, backend=backend, query_lengths=ql, ref_lengths=rl)
    ref_d, ref_idx = loop_knn(q, p, ql, rl, K)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(dists, ref_d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_knn_packed_unsorted_equals_loop(batch, gen, backend):
    q, p, _, ql, rl = batch
    qp, pp, _, qb, rb, q_rows, r_rows = packed(*batch[:3], QL, RL, gen)
    dists, idx = pcops.knn(qp, pp, K, backend=backend, query_batch=qb, ref_batch=rb)
    ref_d, ref_idx = loop_knn(q, p, ql, rl, K)
    where = {row: n for n, row in enumerate(r_rows)}
    for n, (b, i) in enumerate(q_rows):
        expected = [where[(b, j)] if j >= 0 else -1 for j in ref_idx[b, i].tolist()]
        assert idx[n].tolist() == expected
        torch.testing.assert_close(dists[n], ref_d[b, i])


def test_knn_without_lengths_uses_every_row(batch):
    q, p, _, _, _ = batch
    dists, idx = pcops.knn(q, p, K)
    for b in range(q.shape[0]):
        d, i = pcops.knn(q[b], p[b], K, backend="torch")
        assert torch.equal(idx[b], i)
        torch.testing.assert_close(dists[b], d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_knn_aggregate_padded_and_packed_equal_loop(batch, gen, backend):
    q, p, f, ql, rl = batch
    fn = lambda a, b_, c: pcops.knn_aggregate(a, b_, c, min(K, b_.shape[0]), 0.2, backend="torch")  # noqa: E731
    expected = loop_aggregate(fn, q, p, f, QL, RL)
    out = pcops.knn_aggregate(q, p, f, K, 0.2, backend=backend, query_lengths=ql, ref_lengths=rl)
    torch.testing.assert_close(out, expected)
    qp, pp, fp, qb, rb, q_rows, _ = packed(q, p, f, QL, RL, gen)
    out = pcops.knn_aggregate(qp, pp, fp, K, 0.2, backend=backend, query_batch=qb, ref_batch=rb)
    torch.testing.assert_close(out, torch.stack([expected[b, i] for b, i in q_rows]))


def test_radius_aggregate_padded_and_packed_equal_loop(batch, gen):
    q, p, f, ql, rl = batch
    fn = lambda a, b_, c: pcops.radius_aggregate(a, b_, c, 0.45, 0.2)  # noqa: E731
    expected = loop_aggregate(fn, q, p, f, QL, RL)
    out = pcops.radius_aggregate(q, p, f, 0.45, 0.2, query_lengths=ql, ref_lengths=rl)
    torch.testing.assert_close(out, expected)
    assert torch.all(out[1] == 0) and torch.all(out[2] == 0)  # empty query set / empty ref set
    qp, pp, fp, qb, rb, q_rows, _ = packed(q, p, f, QL, RL, gen)
    out = pcops.radius_aggregate(qp, pp, fp, 0.45, 0.2, query_batch=qb, ref_batch=rb)
    torch.testing.assert_close(out, torch.stack([expected[b, i] for b, i in q_rows]))


def test_radius_aggregate_padded_without_lengths(batch):
    q, p, f, _, _ = batch
    out = pcops.radius_aggregate(q, p, f, 0.45, 0.2)
    for b in range(q.shape[0]):
        torch.testing.assert_close(out[b], pcops.radius_aggregate(q[b], p[b], f[b], 0.45, 0.2))


def test_layers_take_batch_arguments(batch):
    q, p, f, ql, rl = batch
    radius = pcops.RadiusAggregation(0.45, sigma=0.2)
    knn = pcops.KNNAggregation(K, sigma=0.2)
    assert radius(q, p, f, query_lengths=ql, ref_lengths=rl).shape == (len(QL), M, F)
    torch.testing.assert_close(
        knn(q, p, f, query_lengths=ql, ref_lengths=rl),
        pcops.knn_aggregate(q, p, f, K, 0.2, query_lengths=ql, ref_lengths=rl),
    )


def _small_batch(gen):
    q = torch.rand(2, 5, 3, generator=gen, dtype=F64)
    p = torch.rand(2, 6, 3, generator=gen, dtype=F64)
    f = torch.randn(2, 6, 2, generator=gen, dtype=F64)
    return q, p, f, torch.tensor([5, 3]), torch.tensor([4, 6])


@pytest.mark.parametrize("op", ["radius", "knn"])
def test_gradcheck_on_a_padded_batch(gen, op):
    q, p, f, ql, rl = _small_batch(gen)
    sigma = torch.tensor(0.2, dtype=F64)
    lengths = dict(query_lengths=ql, ref_lengths=rl)
    if op == "radius":
        fn = lambda q, p, f, s: pcops.radius_aggregate(q, p, f, 0.55, s, **lengths)  # noqa: E731
    else:
        fn = lambda q, p, f, s: pcops.knn_aggregate(q, p, f, 3, s, **lengths)  # noqa: E731
    inputs = tuple(t.clone().requires_grad_() for t in (q, p, f, sigma))
    assert torch.autograd.gradcheck(fn, inputs)


def test_gradients_match_the_loop(gen):
    q, p, f, ql, rl = _small_batch(gen)
    leaves = [t.clone().requires_grad_() for t in (q, p, f)]
    out = pcops.knn_aggregate(*leaves, 3, 0.2, query_lengths=ql, ref_lengths=rl)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    loop = [t.clone().requires_grad_() for t in (q, p, f)]
    total = sum(
        pcops.knn_aggregate(loop[0][b, : ql[b]], loop[1][b, : rl[b]], loop[2][b, : rl[b]], 3, 0.2).square().sum()
        for b in range(2)
    )
    for a, b in zip(grads, torch.autograd.grad(total, loop)):
        torch.testing.assert_close(a, b)


class _BatchedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lift = torch.nn.Linear(3, 8)
        self.knn = pcops.KNNAggregation(3, sigma=0.1)
        self.radius = pcops.RadiusAggregation(0.4, sigma=0.1)

    def forward(self, query, ref):
        # two samples per call, the second one shorter: lengths built from sizes, no host sync
        q = torch.stack([query, query.flip(0)])
        p = torch.stack([ref, ref.flip(0)])
        ql = torch.tensor([q.shape[1], q.shape[1] - 1])
        rl = torch.tensor([p.shape[1], p.shape[1] - 2])
        feats = torch.relu(self.lift(p))
        lengths = dict(query_lengths=ql, ref_lengths=rl)
        return (self.knn(q, p, feats, **lengths) + self.radius(q, p, feats, **lengths)).sum(-1)


def test_compile_batched_fullgraph_matches_eager(gen):
    assert_compiles_like_eager(_BatchedModel(), [(20, 30), (26, 41)], gen)


def _bad_cases():
    """(id, call(q, p, f, ql, rl, qp, pp, fp, qb, rb), error, message): one per bad batch input."""
    return [
        ("query_lengths_too_long", lambda q, p, f, ql, rl, *_: pcops.knn(q, p, 2, query_lengths=torch.tensor([8, 0, 0, 0, 0])), ValueError, r"query_lengths values must be \[0, 7\]"),
        ("negative_ref_lengths", lambda q, p, f, ql, rl, *_: pcops.knn(q, p, 2, ref_lengths=-rl), ValueError, "ref_lengths values"),
        ("query_lengths_shape", lambda q, p, f, ql, rl, *_: pcops.knn(q, p, 2, query_lengths=ql[:3]), ValueError, r"query_lengths must be a tensor of shape \(B,\)"),
        ("float_query_lengths", lambda q, p, f, ql, rl, *_: pcops.knn(q, p, 2, query_lengths=ql.float()), TypeError, "query_lengths must have an integer dtype"),
        ("query_batch_shape", lambda *a: pcops.knn(a[5], a[6], 2, query_batch=a[8][:-1], ref_batch=a[9]), ValueError, "query_batch must be a tensor of shape"),
        ("negative_query_batch", lambda *a: pcops.knn(a[5], a[6], 2, query_batch=a[8] - 1, ref_batch=a[9]), ValueError, "query_batch values must be >= 0"),
        ("query_batch_alone", lambda *a: pcops.knn(a[5], a[6], 2, query_batch=a[8]), ValueError, "both query_batch and ref_batch"),
        ("batch_ids_for_padded", lambda *a: pcops.knn(a[0], a[1], 2, query_batch=a[8], ref_batch=a[9]), ValueError, "padded"),
        ("lengths_for_packed", lambda *a: pcops.knn(a[5], a[6], 2, query_lengths=a[3]), ValueError, "padded"),
        ("batch_sizes_differ", lambda q, p, *_: pcops.knn(q, p[:2], 2), ValueError, "same batch size"),
        ("k_above_n", lambda q, p, *_: pcops.knn(q, p, N + 1), ValueError, "k must be <="),
        ("features_rows", lambda q, p, f, *_: pcops.radius_aggregate(q, p, f[:, :5], 0.3, 0.1), ValueError, "features must have one row per point"),
        ("float_ref_batch", lambda *a: pcops.radius_aggregate(a[5], a[6], a[7], 0.3, 0.1, query_batch=a[8], ref_batch=a[9].float()), TypeError, "ref_batch"),
        ("ref_lengths_too_long", lambda q, p, f, *_: pcops.knn_aggregate(q, p, f, 2, 0.1, ref_lengths=torch.tensor([9, 1, 1, 1, 1])), ValueError, "ref_lengths values"),
    ]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in _bad_cases()], ids=[c[0] for c in _bad_cases()])
def test_bad_batch_input_raises_clear_error(batch, call, error, match):
    q, p, f, ql, rl = batch
    qb, rb = torch.zeros(M, dtype=torch.int64), torch.zeros(N, dtype=torch.int64)
    with pytest.raises(error, match=match):
        call(q, p, f, ql, rl, q[0], p[0], f[0], qb, rb)


def test_validation_reads_a_cloud_searched_against_itself_once(monkeypatch):
    """knn(points, points) checks points once for NaN/inf (one check on the CPU, read at once), a
    pair of clouds twice (the general path: a dispatch mode keeps the call off the plain one);
    a NaN is caught either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pcops import _validate

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    checked = []
    real = _validate.sum_is_finite
    monkeypatch.setattr(_validate, "sum_is_finite", lambda t: (checked.append(t), real(t))[1])
    p, q = torch.rand(40, 3), torch.rand(40, 3)
    counts = []
    for query in (p, q):
        checked.clear()
        with Passing():
            pcops.knn(query, p, 4)
        counts.append(len(checked))
    assert counts == [1, 2]
    bad = p.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="query contains NaN or inf"):
        pcops.knn(bad, bad, 4)
    with pytest.raises(ValueError, match="ref contains NaN or inf"):
        pcops.knn(p, bad, 4)
