"""pcops.earth_movers_distance against POT's exact ``ot.emd2`` and scipy's
``linear_sum_assignment``, and what both transport losses share (their documented compiled calls,
packed ids, integral p).

POT is a test-only extra (``pip install -e ".[test]"``): the tests that need it skip without it."""


import math

import pytest
import torch

import pcops
from tests import reference
from tests.op_suite import OpSuite, pack, pad

F64 = torch.float64
from tests.ops.transport.test_sinkhorn import _cost, exact_emd  # the float64 references


def _emd_reference(x, y, p=2):
    """scipy's linear_sum_assignment on direct-difference costs: (value, per-point costs at its matching)."""
    from scipy.optimize import linear_sum_assignment

    c = _cost(x.double(), y.double(), 2) * 2
    c = c if p == 2 else c.sqrt()
    rows, cols = linear_sum_assignment(c.numpy())
    per_point = torch.zeros(x.shape[0], dtype=F64)
    per_point[rows] = c[rows, cols]
    return per_point.mean() if x.shape[0] else per_point.sum(), per_point


class TestEarthMoversDistance(OpSuite):
    differentiable = ("x", "y")

    def inputs(self, kind, gen):
        x, y, _ = reference.cloud(kind, gen, m=48, n=48)
        n = min(x.shape[0], y.shape[0])  # (duplicates: fewer queries)
        return dict(x=x[:n], y=y[:n])

    def run(self, x, y):
        out = pcops.earth_movers_distance(x, y)
        return out.distance, out.match

    def reference(self, x, y):
        value = exact_emd(x, y) if x.shape[0] else 0.0
        return torch.tensor(value, dtype=F64), torch.arange(x.shape[0])

    def compare(self, out, expected, dtype, inputs=None):
        tol = {F64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-3 if dtype == torch.float16 else 1e-2)
        torch.testing.assert_close(out[0].double(), expected[0].double(), rtol=tol, atol=tol)
        match = out[1]
        assert match.dtype == torch.int64
        assert torch.equal(torch.sort(match).values, torch.arange(match.numel())), "not a permutation"
        if inputs is not None and dtype == F64:  # the matching's own cost is the optimum
            x, y = inputs["x"], inputs["y"]
            torch.testing.assert_close((x - y[match]).square().sum(-1).mean(), expected[0], rtol=1e-12, atol=1e-12)

    def grad_inputs(self, gen):
        return dict(x=torch.rand(20, 3, generator=gen, dtype=F64), y=torch.rand(20, 3, generator=gen, dtype=F64))

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            x, y = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(20, 3, generator=gen, dtype=dtype)
            g = torch.arange(20, dtype=torch.int32) % 3
            cases.append((torch.ops.pcops.emd_match.default, (x, y, None, None, 1, 2, 100, True)))
            cases.append((torch.ops.pcops.emd_match.default, (x, y, g, g.flip(0), 3, 1, 100, False)))
        return cases

    def compile_calls(self, gen):
        def fn(x, y, lengths):
            return pcops.earth_movers_distance(x, y, x_lengths=lengths, y_lengths=lengths, batch_reduction=None).distance

        calls = []
        for b, n in ((2, 20), (3, 27)):
            lengths = torch.randint(1, n + 1, (b,), generator=gen)
            calls.append((torch.rand(b, n, 3, generator=gen).requires_grad_(), torch.rand(b, n, 3, generator=gen), lengths))
        return fn, calls

    def batched(self, gen):
        sizes = (9, 0, 7, 5)
        xs = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
        ys = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
        expected = []
        for x, y in zip(xs, ys):
            out = pcops.earth_movers_distance(x, y, point_reduction=None, batch_reduction=None)
            expected.append((out.distance.mean() if len(x) else out.distance.sum(), out.distance))
        (x, xl), (y, yl) = pad(xs), pad(ys)
        dist = pcops.earth_movers_distance(x, y, x_lengths=xl, y_lengths=yl, batch_reduction=None).distance
        costs = pcops.earth_movers_distance(x, y, x_lengths=xl, y_lengths=yl, point_reduction=None, batch_reduction=None).distance
        padded = [(dist[b], costs[b, : sizes[b]]) for b in range(len(sizes))]
        xp, xb, x_pos = pack(xs, gen)
        yp, yb, _ = pack(ys, gen)
        dist = pcops.earth_movers_distance(xp, yp, x_batch=xb, y_batch=yb, batch_size=len(sizes), batch_reduction=None).distance
        costs = pcops.earth_movers_distance(xp, yp, x_batch=xb, y_batch=yb, point_reduction=None, batch_reduction=None).distance
        packed, at = [], 0
        for b, n in enumerate(sizes):
            packed.append((dist[b], costs[x_pos[at : at + n]]))
            at += n
        return expected, padded, packed

    def test_padded_and_packed_equal_per_sample_loop(self, gen):
        expected, padded, packed = self.batched(gen)
        for e, a, b in zip(expected, padded, packed):
            for u, v, w in zip(e, a, b):
                torch.testing.assert_close(v, u, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(w, u, rtol=1e-12, atol=1e-12)

    def bad_inputs(self, gen):
        x, y = torch.rand(20, 3, generator=gen), torch.rand(20, 3, generator=gen)
        emd = pcops.earth_movers_distance
        return {
            "unequal sizes": (lambda: emd(x, y[:15]), ValueError, "same number of points.*sinkhorn_divergence"),
            "unequal samples": (lambda: emd(x, y, x_batch=torch.arange(20) % 2, y_batch=(torch.arange(20) < 5).long()), ValueError,
                                "in sample 0: use pcops.sinkhorn_divergence"),
            "too large": (lambda: emd(x, y, max_points=10), ValueError, "max_points=10 .*sinkhorn_divergence"),
            "p": (lambda: emd(x, y, p=3), ValueError, r"p must be one of \(1, 2\), got 3"),
            "point_reduction": (lambda: emd(x, y, point_reduction="max"), ValueError, "point_reduction must be one of"),
            "batch without points": (lambda: emd(x, y, point_reduction=None), ValueError, "batch_reduction must be None"),
            "max_points": (lambda: emd(x, y, max_points=0), ValueError, "max_points must be >= 1"),
            "2-d y": (lambda: emd(x, y[:, :2]), ValueError, "y must be a tensor of shape"),
        }


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("kind", ["uniform", "far_apart", "duplicates", "all_equal", "grid"])
def test_emd_equals_pot_and_scipy_on_adversarial_clouds(gen, p, kind):
    n = 64
    if kind == "far_apart":
        x, y = torch.rand(n, 3, generator=gen, dtype=F64), torch.rand(n, 3, generator=gen, dtype=F64) + 1000
    elif kind == "duplicates":  # every point three times, in both clouds
        base = torch.rand(n // 4, 3, generator=gen, dtype=F64)
        x = torch.cat([base.repeat(3, 1), torch.rand(n - 3 * (n // 4), 3, generator=gen, dtype=F64)])
        y = torch.cat([base[torch.randperm(n // 4, generator=gen)].repeat(3, 1), torch.rand(n - 3 * (n // 4), 3, generator=gen, dtype=F64)])
    elif kind == "all_equal":  # every pairing optimal
        x, y = torch.zeros(n, 3, dtype=F64), torch.ones(n, 3, dtype=F64)
    elif kind == "grid":  # many equal costs
        g = torch.stack(torch.meshgrid(*[torch.arange(4, dtype=F64)] * 3, indexing="ij"), -1).reshape(-1, 3)
        x, y = g, g + torch.tensor([0.5, 0.0, 0.0], dtype=F64)
    else:
        x, y = torch.rand(n, 3, generator=gen, dtype=F64), torch.rand(n, 3, generator=gen, dtype=F64)
    out = pcops.earth_movers_distance(x, y, p=p)
    want, _ = _emd_reference(x, y, p)
    torch.testing.assert_close(out.distance, want, rtol=1e-12, atol=1e-12)
    assert out.distance.item() == pytest.approx(exact_emd(x, y, p), rel=1e-12, abs=1e-12)
    assert torch.equal(torch.sort(out.match).values, torch.arange(n))


@pytest.mark.parametrize("p", [1, 2])
def test_clouds_far_from_unit_size_get_their_unit_copies_matching_and_distance(gen, p):
    """The matching's float64 costs are of the clouds divided by their extent's power of two, and
    p = 1's distances are norms of rows divided by theirs: float64 clouds at 1e200 or 1e-170
    (squares beyond float64: an arbitrary matching) and float32 ones at 1e20 or 1e-25 (norms of
    inf or 0) get their unit copy's matching, and its distance scaled (p = 1 by s, p = 2 by s^2
    where the dtype holds it); at a power-of-two scale bit for bit. Subnormal float64 clouds
    (1e-310: the power of two of their extent, 2^1030, beyond float64) get it too (their
    distances, subnormal, are not compared), and so do small clouds far from the origin (in the
    plane z = 1: their scaled coordinates overflowed where the box's low corner was not taken
    off first)."""
    x, y = torch.rand(12, 3, generator=gen, dtype=F64), torch.rand(12, 3, generator=gen, dtype=F64)
    for dtype, scales in ((F64, (1e200, 1e-170, 2.0**-300, 1e-310)), (torch.float32, (1e20, 1e-25, 2.0**60))):
        unit = pcops.earth_movers_distance(x.to(dtype), y.to(dtype), p=p, point_reduction=None, batch_reduction=None)
        for s in scales:
            out = pcops.earth_movers_distance(x.to(dtype) * s, y.to(dtype) * s, p=p, point_reduction=None, batch_reduction=None)
            assert torch.equal(out.match, unit.match), (dtype, s)
            if s < torch.finfo(dtype).tiny:
                continue
            if p == 2 and not math.isfinite(float(torch.tensor(s, dtype=dtype) ** 2)) or (p == 2 and s**2 < torch.finfo(dtype).tiny):
                continue  # (the squared distances themselves leave the dtype)
            want = unit.distance.double() * s**p
            if math.log2(s).is_integer():
                assert torch.equal(out.distance.double(), want), (dtype, s)
            else:
                torch.testing.assert_close(out.distance.double(), want, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=0)


def test_small_clouds_far_from_the_origin_get_their_unit_copies_matching(gen):
    """Clouds in the plane z = z0 (every point there), scaled small: the same matching as their
    unit copies at z = 0, off the origin too (the scale of a subnormal extent, 2^1030, made every
    coordinate z0 2^1030 = inf, every cost NaN: an arbitrary matching)."""
    x, y = torch.rand(12, 3, generator=gen, dtype=F64), torch.rand(12, 3, generator=gen, dtype=F64)
    x[:, 2], y[:, 2] = 0.0, 0.0
    unit = pcops.earth_movers_distance(x, y, point_reduction=None, batch_reduction=None).match
    for s, z in ((1e-310, 0.1), (1e-310, 1.0), (1e-200, 1e120), (2.0**-40, 2.0**200)):
        xs, ys = x * s, y * s
        xs[:, 2], ys[:, 2] = z, z
        assert torch.equal(pcops.earth_movers_distance(xs, ys, point_reduction=None, batch_reduction=None).match, unit), (s, z)


def test_emd_gradient_is_the_gradient_of_the_cost_at_the_matching(gen):
    x = torch.rand(30, 3, generator=gen, dtype=F64, requires_grad=True)
    y = torch.rand(30, 3, generator=gen, dtype=F64, requires_grad=True)
    out = pcops.earth_movers_distance(x, y, p=1)
    gx, gy = torch.autograd.grad(out.distance, (x, y))
    match = out.match
    ref = torch.linalg.vector_norm(x - y[match], dim=-1).mean()
    rx, ry = torch.autograd.grad(ref, (x, y))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gy, ry)


def test_emd_of_coincident_points_has_finite_gradients(gen):
    x = torch.rand(10, 3, generator=gen, dtype=F64)
    for p in (1, 2):
        xr = x.clone().requires_grad_()
        out = pcops.earth_movers_distance(xr, x.clone(), p=p)
        out.distance.backward()
        assert out.distance == 0 and torch.isfinite(xr.grad).all()


def test_emd_reductions(gen):
    x, y = torch.rand(3, 8, 3, generator=gen, dtype=F64), torch.rand(3, 8, 3, generator=gen, dtype=F64)
    per = pcops.earth_movers_distance(x, y, batch_reduction=None).distance
    assert per.shape == (3,)
    torch.testing.assert_close(pcops.earth_movers_distance(x, y).distance, per.mean())
    torch.testing.assert_close(pcops.earth_movers_distance(x, y, point_reduction="sum", batch_reduction="sum").distance, 8 * per.sum())
    single = pcops.earth_movers_distance(x[0], y[0], batch_reduction=None)
    assert single.distance.shape == () and single.match.shape == (8,)


def test_emd_loss_module_equals_the_function(gen):
    x, y = torch.rand(2, 16, 3, generator=gen), torch.rand(2, 16, 3, generator=gen)
    torch.testing.assert_close(pcops.nn.EMDLoss(p=1)(x, y), pcops.earth_movers_distance(x, y, p=1).distance)


@pytest.mark.parametrize("loss", ["earth_movers_distance", "EMDLoss", "SinkhornLoss"])
def test_the_documented_padded_losses_compile_with_their_defaults(loss):
    """docs/ops/transport.md: both losses compile as part of a model's loss, padded clouds and the
    default mean reduction included (the EMD's per-sample mean failed Inductor's C++ code
    generation on torch 2.13: an index_add over an index built in the graph)."""
    gen = torch.Generator().manual_seed(0)
    fn = {"earth_movers_distance": lambda a, b: pcops.earth_movers_distance(a, b).distance,
          "EMDLoss": pcops.nn.EMDLoss(), "SinkhornLoss": pcops.nn.SinkhornLoss(blur=0.05)}[loss]
    x, y = torch.rand(2, 16, 3, generator=gen), torch.rand(2, 16, 3, generator=gen)
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = fn(eager_x, y)
    expected.backward()
    got = torch.compile(fn)(compiled_x, y)
    got.backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)


@pytest.mark.parametrize("op", ["sinkhorn_divergence", "earth_movers_distance", "chamfer_distance"])
def test_packed_ids_asking_for_more_samples_than_points_raise(op):
    """Packed ids number the samples of these losses (a row each): ids near 2**32 allocated 2**32
    rows and the process was killed. They raise naming the ids; numbered samples with a gap
    (an empty sample) still work, and batch_size= says the count outright."""
    fn = getattr(pcops, op)
    x, y = torch.rand(6, 3, generator=torch.Generator().manual_seed(0)), torch.rand(6, 3, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 0, 0, 2, 2, 2])
    with pytest.raises(ValueError, match=r"x_batch and y_batch number the samples.*4294967299 rows for 12 points"):
        fn(x, y, x_batch=ids + 2**32, y_batch=ids + 2**32)
    with pytest.raises(ValueError, match="asks for 13 rows for 12 points"):
        fn(x, y, x_batch=ids * 6, y_batch=ids * 6)
    def per_sample(**kw):
        result = fn(x, y, batch_reduction=None, **kw)
        return result[0] if isinstance(result, tuple) else result

    gap = per_sample(x_batch=ids, y_batch=ids)
    assert gap.shape == (3,) and float(gap[1]) == 0.0  # the empty sample
    assert per_sample(x_batch=ids * 6, y_batch=ids * 6, batch_size=13).shape == (13,)


@pytest.mark.parametrize("op", ["sinkhorn_divergence", "earth_movers_distance"])
def test_p_as_an_integral_float_means_the_int(op):
    """p=2.0 passed the check, then failed in the op's schema."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(12, 3, generator=gen), torch.rand(12, 3, generator=gen)
    fn = getattr(pcops, op)
    for p in (1, 2):
        want, got = fn(x, y, p=p), fn(x, y, p=float(p))
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, want[0] if isinstance(want, tuple) else want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"p must be one of \(1, 2\)"):
        fn(x, y, p=1.5)
