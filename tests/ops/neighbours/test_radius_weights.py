"""radius_aggregate's inverse-distance and uniform weights and max reduction (the shared op suite)."""

import pytest
import torch

import pcops
from tests import reference
from tests.op_suite import F64, OpSuite, pack_pair, pad, sample_rows


class _RadiusMode(OpSuite):
    """One weighting/reduction of radius_aggregate against the dense float64 reference."""

    weights, reduce = None, "mean"

    def call(self, query, ref, features, radius, **batch):
        return pcops.radius_aggregate(query, ref, features, radius, weights=self.weights, reduce=self.reduce, **batch)

    def inputs(self, kind, gen):
        q, p, r = reference.cloud(kind, gen)
        f = torch.randn(p.shape[0], 3, generator=gen, dtype=F64)
        return dict(query=q, ref=p, features=f, radius=reference.safe_radius(q, p, r, gap=1e-3))

    def run(self, query, ref, features, radius):
        return (self.call(query, ref, features, radius),)

    def reference(self, query, ref, features, radius):
        return (reference.radius_weighted(query, ref, features, radius, self.weights or "uniform", self.reduce),)

    def grad_inputs(self, gen):
        q, p = torch.rand(12, 3, generator=gen, dtype=F64), torch.rand(30, 3, generator=gen, dtype=F64)
        f = torch.randn(30, 4, generator=gen, dtype=F64)
        return dict(query=q, ref=p, features=f, radius=reference.safe_radius(q, p, 0.4, gap=1e-2))

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            q, p = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(30, 3, generator=gen, dtype=dtype)
            f = torch.randn(30, 4, generator=gen, dtype=dtype)
            qg = torch.randint(0, 3, (20,), generator=gen, dtype=torch.int32)
            rg = torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
            cases += self.op_cases(q, p, f, qg, rg)
        return cases

    def compile_calls(self, gen):
        def fn(query, ref, features, ql, rl):
            return self.call(query, ref, features, 0.35, query_lengths=ql, ref_lengths=rl)

        calls = []
        for b, m, n in ((2, 20, 30), (3, 27, 41)):
            q = torch.rand(b, m, 3, generator=gen).requires_grad_()
            p = torch.rand(b, n, 3, generator=gen)
            f = torch.randn(b, n, 5, generator=gen).requires_grad_()
            calls.append((q, p, f, torch.randint(0, m + 1, (b,), generator=gen), torch.randint(0, n + 1, (b,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        qs = [torch.rand(m, 3, generator=gen, dtype=F64) for m in (9, 0, 7, 5)]
        ps = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (12, 5, 0, 3)]
        fs = [torch.randn(len(p), 2, generator=gen, dtype=F64) for p in ps]
        r = 0.45
        expected = [(reference.radius_weighted(q, p, f, r, self.weights or "uniform", self.reduce),) for q, p, f in zip(qs, ps, fs)]
        (q, ql), (p, pl), (f, _) = pad(qs), pad(ps), pad(fs)
        out = self.call(q, p, f, r, query_lengths=ql, ref_lengths=pl)
        padded = [(out[b, : len(qs[b])],) for b in range(len(qs))]
        qp, qb, q_pos, pp, pb, _, fp = pack_pair(qs, ps, fs, gen)
        out = self.call(qp, pp, fp, r, query_batch=qb, ref_batch=pb)
        return expected, padded, sample_rows(out, q_pos, qs)

    def bad_inputs(self, gen):
        q, p, f = torch.rand(4, 3, generator=gen), torch.rand(6, 3, generator=gen), torch.rand(6, 2, generator=gen)
        ra = pcops.radius_aggregate
        return {
            "sigma given": (lambda: ra(q, p, f, 0.3, 0.1, weights=self.weights, reduce=self.reduce), ValueError, "sigma is used by"),
            "unknown weights": (lambda: ra(q, p, f, 0.3, weights="gauss", reduce=self.reduce), ValueError, "weights must be one of"),
            "unknown reduce": (lambda: ra(q, p, f, 0.3, weights=self.weights, reduce="min"), ValueError, "reduce must be one of"),
            "zero radius": (lambda: ra(q, p, f, 0.0, weights=self.weights, reduce=self.reduce), ValueError, "radius"),
            "features rows": (lambda: ra(q, p, f[:5], 0.3, weights=self.weights, reduce=self.reduce), ValueError, "features"),
        }


class _Mean(_RadiusMode):
    def op_cases(self, q, p, f, qg, rg):
        op, unit = torch.ops.pcops.radius_aggregate.default, torch.ones((), dtype=q.dtype)
        return [(op, (q, p, f, unit, 0.3, True, None, None, self.weights)), (op, (q, p, f, unit, 0.3, True, qg, rg, self.weights))]


class TestInverseDistance(_Mean):
    weights = "inverse_distance"
    differentiable = ("query", "ref", "features")


class TestUniform(_Mean):
    weights = "uniform"
    differentiable = ("features",)


class TestMax(_RadiusMode):
    weights, reduce = None, "max"
    differentiable = ("features",)  # random features: no ties

    def op_cases(self, q, p, f, qg, rg):
        op = torch.ops.pcops.radius_max.default
        return [(op, (q, p, f, 0.3, True, None, None)), (op, (q, p, f, 0.3, True, qg, rg))]


def test_max_gradient_goes_to_the_arg_max_only(gen):
    q, p = torch.rand(10, 3, generator=gen, dtype=F64), torch.rand(40, 3, generator=gen, dtype=F64)
    f = torch.randn(40, 3, generator=gen, dtype=F64, requires_grad=True)
    r = reference.safe_radius(q, p, 0.4)
    pcops.radius_aggregate(q, p, f, r, reduce="max").sum().backward()
    mask = reference.distances(q, p) <= r
    arg = torch.where(mask[..., None], f.detach()[None], float("-inf")).argmax(1)  # (M, F)
    expected = torch.zeros_like(f)
    for i in range(q.shape[0]):
        for c in range(f.shape[1]):
            if mask[i].any():
                expected[arg[i, c], c] += 1
    assert torch.equal(f.grad, expected)


def test_query_on_a_reference_point_takes_its_feature(gen):
    p, f = torch.rand(30, 3, generator=gen, dtype=F64), torch.randn(30, 2, generator=gen, dtype=F64)
    out = pcops.radius_aggregate(p[:5], p, f, 0.3, weights="inverse_distance")
    torch.testing.assert_close(out, f[:5], rtol=1e-10, atol=1e-10)


def test_layer_options(gen):
    q, p, f = torch.rand(10, 3, generator=gen, dtype=F64), torch.rand(30, 3, generator=gen, dtype=F64), torch.randn(30, 2, generator=gen, dtype=F64)
    layer = pcops.RadiusAggregation(0.4, reduce="max")
    torch.testing.assert_close(layer(q, p, f), pcops.radius_aggregate(q, p, f, 0.4, reduce="max"), rtol=0, atol=0)
    assert "max" in repr(layer)
    with pytest.raises(ValueError, match="learnable_sigma"):
        pcops.RadiusAggregation(0.4, learnable_sigma=True, weights="uniform")
