"""pcops.sinkhorn_divergence against a dense float64 Sinkhorn written from GeomLoss's definition
and against GeomLoss's tensorized backend itself; the stated bound between it and the exact EMD.
The dense references here serve tests/ops/transport/test_emd.py too.

GeomLoss is a test-only extra (``pip install -e ".[test]"``): the tests that need it skip
without it."""

import math

import numpy as np
import pytest
import torch

import pcops
from tests import reference
from tests.op_suite import OpSuite, pack, pad

F64 = torch.float64



# ----------------------------------------------------------------------------------------------
# Dense references


def _cost(u, v, p):
    d2 = ((u[:, None, :] - v[None, :, :]) ** 2).sum(-1)
    return d2 / 2 if p == 2 else d2.clamp_min(1e-8).sqrt()


def _schedule(p, diameter, blur, scaling):
    """GeomLoss's temperatures, from its documented definition."""
    inner = np.arange(p * math.log(diameter), p * math.log(blur), p * math.log(scaling))
    return [diameter**p] + [math.exp(e) for e in inner] + [blur**p]


def dense_sinkhorn(x, y, a, b, p=2, blur=0.05, scaling=0.5, diameter=None, debias=True):
    """(value, F, G) of the debiased (or not) Sinkhorn divergence on dense (N, M) costs in float64."""
    x, y, a, b = x.double(), y.double(), a.double(), b.double()
    if diameter is None:
        both = torch.cat([x, y])
        diameter = float((both.max(0).values - both.min(0).values).norm())
    la, lb = torch.log(a), torch.log(b)  # -inf for zero weights: no mass

    def smin(eps, c, h):
        return -eps * torch.logsumexp(h[None, :] - c / eps, dim=1)

    cxy, cyx, cxx, cyy = _cost(x, y, p), _cost(y, x, p), _cost(x, x, p), _cost(y, y, p)
    eps_list = _schedule(p, diameter, blur, scaling)
    e0 = eps_list[0]
    f, g, faa, gbb = smin(e0, cxy, lb), smin(e0, cyx, la), smin(e0, cxx, la), smin(e0, cyy, lb)
    for eps in eps_list:
        f, g, faa, gbb = (0.5 * (f + smin(eps, cxy, lb + g / eps)), 0.5 * (g + smin(eps, cyx, la + f / eps)),
                          0.5 * (faa + smin(eps, cxx, la + faa / eps)), 0.5 * (gbb + smin(eps, cyy, lb + gbb / eps)))
    eps = blur**p
    f, g, faa, gbb = smin(eps, cxy, lb + g / eps), smin(eps, cyx, la + f / eps), smin(eps, cxx, la + faa / eps), smin(eps, cyy, lb + gbb / eps)
    if not debias:
        faa, gbb = torch.zeros_like(f), torch.zeros_like(g)
    F, G = f - faa, g - gbb
    return (a * F).sum() + (b * G).sum(), F, G


def exact_emd(x, y, p=2):
    """POT's exact network simplex on uniform weights and direct-difference costs |x - y|^p."""
    ot = pytest.importorskip("ot")
    c = _cost(x.double(), y.double(), 2) * 2
    c = c if p == 2 else c.sqrt()
    n = x.shape[0]
    return float(ot.emd2(np.full(n, 1 / n), np.full(y.shape[0], 1 / y.shape[0]), c.numpy()))


def _weights(gen, n, zeros=3):
    w = torch.rand(n, generator=gen, dtype=F64) + 0.1
    w[:zeros] = 0
    return w / w.sum()


# ----------------------------------------------------------------------------------------------
# The Sinkhorn divergence


class TestSinkhornDivergence(OpSuite):
    differentiable = ("x", "y", "x_weights", "y_weights")

    def inputs(self, kind, gen):
        x, y, _ = reference.cloud(kind, gen, m=40, n=55)
        a, b = _weights(gen, x.shape[0]), _weights(gen, y.shape[0], zeros=1)
        return dict(x=x, y=y, x_weights=a, y_weights=b, blur=0.05, scaling=0.5, diameter=None)

    def run(self, x, y, x_weights, y_weights, blur, scaling, diameter):
        return (pcops.sinkhorn_divergence(x, y, x_weights=x_weights, y_weights=y_weights, blur=blur, scaling=scaling, diameter=diameter),)

    def reference(self, x, y, x_weights, y_weights, blur, scaling, diameter):
        return (dense_sinkhorn(x, y, x_weights, y_weights, 2, blur, scaling, diameter)[0],)

    def compare(self, out, expected, dtype, inputs=None):
        tol = {F64: 1e-11, torch.float32: 2e-5}.get(dtype, 2e-3 if dtype == torch.float16 else 1e-2)
        for a, e in zip(out, expected):
            torch.testing.assert_close(a.double(), e.double(), rtol=tol, atol=tol)

    def grad_inputs(self, gen):
        # a converged problem (many steps at a large temperature), where the envelope-theorem
        # gradient is the derivative of the computed value itself
        x, y = torch.rand(9, 3, generator=gen, dtype=F64), torch.rand(7, 3, generator=gen, dtype=F64)
        return dict(x=x, y=y, x_weights=_weights(gen, 9, 0), y_weights=_weights(gen, 7, 0), blur=0.6, scaling=0.999, diameter=0.63)

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            x, y = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(30, 3, generator=gen, dtype=dtype)
            a, b = torch.full((20,), 1 / 20, dtype=dtype), torch.full((30,), 1 / 30, dtype=dtype)
            xg = torch.randint(0, 3, (20,), generator=gen, dtype=torch.int32)
            yg = torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
            xr = x.clone().requires_grad_()
            cases.append((torch.ops.pcops.sinkhorn.default, (xr, y, a, b, None, None, 1, 2, 0.1, 0.5, None, True, True)))
            cases.append((torch.ops.pcops.sinkhorn.default, (x, y, a, b, xg, yg, 3, 1, 0.1, 0.7, 2.0, False, False)))
            _, state = torch.ops.pcops.sinkhorn(x, y, a, b, xg, yg, 3, 2, 0.1, 0.5, None, True, True)
            grad = torch.rand(3, generator=gen, dtype=dtype)
            cases.append((torch.ops.pcops.sinkhorn_backward.default, (x, y, a, b, xg, yg, state, grad, 3, 2, 0.1, True, True, True)))
        return cases

    def compile_calls(self, gen):
        def fn(x, y, xl, yl):
            return pcops.sinkhorn_divergence(x, y, x_lengths=xl, y_lengths=yl, blur=0.1, batch_reduction=None)

        calls = []
        for b, m, n in ((2, 20, 30), (3, 27, 41)):
            x = torch.rand(b, m, 3, generator=gen).requires_grad_()
            y = torch.rand(b, n, 3, generator=gen)
            calls.append((x, y, torch.randint(1, m + 1, (b,), generator=gen), torch.randint(1, n + 1, (b,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        xs = [torch.rand(m, 3, generator=gen, dtype=F64) for m in (9, 0, 7, 5)]
        ys = [torch.rand(n, 3, generator=gen, dtype=F64) + 0.2 for n in (12, 5, 0, 3)]
        ws = [_weights(gen, len(x), 1) if len(x) else x.new_zeros(0) for x in xs]
        kw = dict(blur=0.05, potentials=True)

        def one(out, b):
            return out.loss[b], out.x_potential[b, : len(xs[b])], out.y_potential[b, : len(ys[b])]

        expected = []
        for x, y, w in zip(xs, ys, ws):
            out = pcops.sinkhorn_divergence(x, y, x_weights=w, **kw)
            expected.append((out.loss, out.x_potential, out.y_potential))
        (x, xl), (y, yl) = pad(xs), pad(ys)
        w = torch.zeros(x.shape[:2], dtype=F64)
        for b, wb in enumerate(ws):
            w[b, : len(wb)] = wb
        out = pcops.sinkhorn_divergence(x, y, x_weights=w, x_lengths=xl, y_lengths=yl, batch_reduction=None, **kw)
        padded = [one(out, b) for b in range(len(xs))]
        xp, xb, x_pos = pack(xs, gen)
        yp, yb, y_pos = pack(ys, gen)
        wp = torch.empty(len(xp), dtype=F64)
        wp[x_pos] = torch.cat(ws)
        out = pcops.sinkhorn_divergence(xp, yp, x_weights=wp, x_batch=xb, y_batch=yb, batch_size=len(xs), batch_reduction=None, **kw)
        packed, ax, ay = [], 0, 0
        for b in range(len(xs)):
            rx, ry = x_pos[ax : ax + len(xs[b])], y_pos[ay : ay + len(ys[b])]
            packed.append((out.loss[b], out.x_potential[rx], out.y_potential[ry]))
            ax, ay = ax + len(xs[b]), ay + len(ys[b])
        return expected, padded, packed

    def bad_inputs(self, gen):
        x, y = torch.rand(4, 3, generator=gen), torch.rand(6, 3, generator=gen)
        sd = pcops.sinkhorn_divergence
        negative = torch.tensor([0.5, 0.5, 0.5, -0.5])
        nan = torch.tensor([0.5, float("nan"), 0.25, 0.25])
        return {
            "p": (lambda: sd(x, y, p=3), ValueError, r"p must be one of \(1, 2\), got 3"),
            "zero blur": (lambda: sd(x, y, blur=0.0), ValueError, "blur must be finite and > 0"),
            "scaling": (lambda: sd(x, y, scaling=1.0), ValueError, r"scaling must be in \(0, 1\)"),
            "diameter": (lambda: sd(x, y, diameter=-1.0), ValueError, "diameter must be finite and > 0"),
            "negative weight": (lambda: sd(x, y, x_weights=negative), ValueError, "x_weights must be >= 0"),
            "nan weight": (lambda: sd(x, y, x_weights=nan), ValueError, "x_weights contains NaN or inf"),
            "weight shape": (lambda: sd(x, y, y_weights=torch.ones(5) / 5), ValueError, r"y_weights must be a tensor of shape \(N,\) = \(6,\), got shape \(5,\)"),
            "int weights": (lambda: sd(x, y, y_weights=torch.ones(6, dtype=torch.int64)), TypeError, "y_weights must have a floating dtype"),
            "reduction": (lambda: sd(x, y, batch_reduction="max"), ValueError, "batch_reduction must be one of"),
            "debias": (lambda: sd(x, y, debias=1), TypeError, "debias must be a bool"),
            "2-d x": (lambda: sd(x[:, :2], y), ValueError, "x must be a tensor of shape"),
            "devices": (lambda: sd(x, y.to("meta")), ValueError, "same device"),
        }


def _geomloss(p, blur, scaling, debias=True, potentials=False):
    geomloss = pytest.importorskip("geomloss")
    return geomloss.SamplesLoss("sinkhorn", p=p, blur=blur, scaling=scaling, debias=debias, potentials=potentials, backend="tensorized")


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("debias", [True, False])
@pytest.mark.parametrize("blur", [0.5, 0.05, 0.01])
def test_value_potentials_and_gradients_equal_geomloss_tensorized(gen, p, debias, blur):
    """Unequal sizes, random weights with zeros: GeomLoss's value, potentials and gradients (to
    the points and the weights) in float64, to the rounding of its matmul-formula costs."""
    x, y = torch.rand(70, 3, generator=gen, dtype=F64), torch.rand(45, 3, generator=gen, dtype=F64) + 0.3
    a, b = _weights(gen, 70, 5), _weights(gen, 45, 2)
    leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
    want = _geomloss(p, blur, 0.5, debias)(leaves[2], leaves[0], leaves[3], leaves[1])
    want_grads = torch.autograd.grad(want, leaves)
    fw, gw = _geomloss(p, blur, 0.5, debias, potentials=True)(a, x, b, y)
    mine = [t.clone().requires_grad_() for t in (x, y, a, b)]
    out = pcops.sinkhorn_divergence(mine[0], mine[1], x_weights=mine[2], y_weights=mine[3], p=p, blur=blur, debias=debias, potentials=True)
    grads = torch.autograd.grad(out.loss, mine)
    tol = dict(rtol=1e-8, atol=1e-8)  # GeomLoss's |x|^2 + |y|^2 - 2 x.y costs round to ~1e-16 of |x|^2, divided by eps
    torch.testing.assert_close(out.loss, want.detach(), **tol)
    torch.testing.assert_close(out.x_potential, fw.reshape(-1), **tol)
    torch.testing.assert_close(out.y_potential, gw.reshape(-1), **tol)
    for name, g, w in zip(("x", "y", "x_weights", "y_weights"), grads, want_grads):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_float32_equals_geomloss_float32(gen):
    x, y = torch.rand(200, 3, generator=gen), torch.rand(150, 3, generator=gen) + 0.2
    want = _geomloss(2, 0.02, 0.5)(x, y)
    got = pcops.sinkhorn_divergence(x, y, blur=0.02)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_batch_with_a_shared_diameter_equals_geomloss_batched(gen):
    """GeomLoss's batched call takes one schedule for the batch (the diameter of all its points):
    pcops takes each sample's own, and GeomLoss's with ``diameter=``."""
    geomloss = pytest.importorskip("geomloss")
    x, y = torch.rand(3, 30, 3, generator=gen, dtype=F64), torch.rand(3, 25, 3, generator=gen, dtype=F64) * 2
    loss = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.05, diameter=4.0, backend="tensorized")
    got = pcops.sinkhorn_divergence(x, y, diameter=4.0, batch_reduction=None)
    torch.testing.assert_close(got, loss(x, y), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("p", [1, 2])
def test_the_divergence_is_within_the_stated_bound_of_the_exact_emd(gen, p):
    """|p S_eps - EMD_p| <= p blur^p log(n) for the converged divergence (scaling near 1)."""
    n = 80
    x, y = torch.rand(n, 3, generator=gen, dtype=F64), torch.rand(n, 3, generator=gen, dtype=F64) + 0.25
    emd = float(pcops.earth_movers_distance(x, y, p=p).distance)
    assert emd == pytest.approx(exact_emd(x, y, p), rel=1e-12, abs=1e-12)
    for blur in (0.1, 0.03) if p == 2 else (0.05, 0.02):
        s = float(pcops.sinkhorn_divergence(x, y, p=p, blur=blur, scaling=0.99))
        assert abs(p * s - emd) <= p * blur**p * math.log(n), (blur, p * s, emd)


def test_float32_is_stable_at_small_blur(gen):
    """Log-domain iterations: no overflow at eps = 1e-6 in float32, and float64's value."""
    x, y = torch.rand(150, 3, generator=gen), torch.rand(150, 3, generator=gen) + 0.5
    for blur in (1e-3, 1e-4):
        single = pcops.sinkhorn_divergence(x, y, blur=blur, potentials=True)
        double = pcops.sinkhorn_divergence(x.double(), y.double(), blur=blur)
        assert torch.isfinite(single.loss) and torch.isfinite(single.x_potential).all()
        torch.testing.assert_close(single.loss.double(), double, rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("p", [1, 2])
def test_any_blur_however_small_equals_geomloss(gen, p):
    """Zero weights are skipped by a flag, not by a floor on h: at blur 1e-15 and 1e-20 (eps down
    to 1e-40, h - C / eps far below any fixed floor) every term still counts: GeomLoss's value,
    and with zero weights the value of the clouds without those points (GeomLoss's own zero-weight
    sentinel, log w = -10^5, stops being negligible once C / eps passes 10^5)."""
    x, y = torch.rand(40, 3, generator=gen, dtype=F64), torch.rand(30, 3, generator=gen, dtype=F64) + 0.3
    a, b = _weights(gen, 40, 4), _weights(gen, 30, 3)
    for blur in (1e-15, 1e-20):
        want = _geomloss(p, blur, 0.5)(x, y)
        got = pcops.sinkhorn_divergence(x, y, p=p, blur=blur)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m, blur=blur: f"blur={blur}: {m}")
        kept = pcops.sinkhorn_divergence(x[a > 0], y[b > 0], x_weights=a[a > 0], y_weights=b[b > 0], p=p, blur=blur, diameter=2.0)
        got = pcops.sinkhorn_divergence(x, y, x_weights=a, y_weights=b, p=p, blur=blur, diameter=2.0)
        torch.testing.assert_close(got, kept, rtol=1e-12, atol=1e-14, msg=lambda m, blur=blur: f"zero weights, blur={blur}: {m}")


def test_emd_without_validation_returns_a_matching_for_non_finite_points(gen):
    """validate=False and a NaN or inf point: a permutation and a NaN / inf distance, not scipy's
    "invalid numeric entries" error (the other points' matching stays optimal among themselves)."""
    x, y = torch.rand(12, 3, generator=gen, dtype=F64), torch.rand(12, 3, generator=gen, dtype=F64)
    for value in (float("nan"), float("inf")):
        bad = x.clone()
        bad[4, 1] = value
        out = pcops.earth_movers_distance(bad, y, validate=False)
        assert sorted(out.match.tolist()) == list(range(12))
        assert not torch.isfinite(out.distance)
        with pytest.raises(ValueError, match="x contains NaN or inf"):
            pcops.earth_movers_distance(bad, y)


def test_a_sample_with_an_empty_cloud_is_zero(gen):
    x, y = torch.rand(2, 6, 3, generator=gen), torch.rand(2, 5, 3, generator=gen)
    out = pcops.sinkhorn_divergence(x, y, x_lengths=torch.tensor([6, 0]), batch_reduction=None)
    assert out[1] == 0 and out[0] > 0
    assert pcops.sinkhorn_divergence(x[0, :0], y[0]) == 0


def test_identical_clouds_give_zero(gen):
    x = torch.rand(50, 3, generator=gen, dtype=F64)
    assert abs(float(pcops.sinkhorn_divergence(x, x.clone()))) < 1e-12


def test_sinkhorn_loss_module_equals_the_function(gen):
    x, y = torch.rand(2, 40, 3, generator=gen), torch.rand(2, 30, 3, generator=gen)
    loss = pcops.nn.SinkhornLoss(p=1, blur=0.02, scaling=0.7)
    torch.testing.assert_close(loss(x, y), pcops.sinkhorn_divergence(x, y, p=1, blur=0.02, scaling=0.7))
    assert "blur=0.02" in repr(loss)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_temperatures_and_costs_beyond_the_dtype_are_value_errors(gen, dtype):
    """blur^p below the dtype's smallest normal number had an infinite inverse in the kernels
    (NaN; rounded to 0, a silent loss of 0), and finite clouds whose costs overflow gave NaN with
    validation on: ValueErrors naming blur, diameter, or x and y. At the smallest accepted
    temperatures the loss is the unit-scale loss scaled (p = 2: by s^2), as GeomLoss's."""
    x, y = torch.rand(30, 3, generator=gen, dtype=F64), torch.rand(20, 3, generator=gen, dtype=F64) + 0.3
    info = torch.finfo(dtype)
    tiny_blur = math.sqrt(info.tiny) / 2  # blur^2 below the smallest normal number
    for p, blur in ((2, tiny_blur), (1, info.tiny / 2), (2, 1e-300)):
        with pytest.raises(ValueError, match=r"^blur must be large enough that blur\*\*p is a normal"):
            pcops.sinkhorn_divergence(x.to(dtype), y.to(dtype), p=p, blur=blur)
    with pytest.raises(ValueError, match=r"^diameter\*\*p must be finite"):
        pcops.sinkhorn_divergence(x.to(dtype), y.to(dtype), diameter=float(info.max) ** 0.5 * 4)
    for p, blur in ((2, float(info.max) ** 0.5 * 4), (1, 10**309 if dtype == F64 else 1e39)):  # blur^p beyond the dtype (NaN; OverflowError)
        with pytest.raises(ValueError, match=r"^blur(\*\*p)? must be finite"):  # (an int beyond float64: the blur itself)
            pcops.sinkhorn_divergence(x.to(dtype), y.to(dtype), p=p, blur=blur)
    far = 10 * math.sqrt(info.max)  # finite coordinates whose squared distances overflow
    with pytest.raises(ValueError, match=r"^x and y span .* overflow"):
        pcops.sinkhorn_divergence(x.to(dtype) * far, y.to(dtype) * far)
    pcops.sinkhorn_divergence(x.to(dtype) * far, y.to(dtype) * far, validate=False)  # (unchecked: no error, no hang)
    s = 1e-17 if dtype == torch.float32 else 1e-150  # blur^2 = (0.05 s)^2: normal
    unit = pcops.sinkhorn_divergence(x.to(dtype), y.to(dtype), blur=0.05)
    small = pcops.sinkhorn_divergence(x.to(dtype) * s, y.to(dtype) * s, blur=0.05 * s)
    torch.testing.assert_close(small.double() / s**2, unit.double(), rtol=1e-4 if dtype == torch.float32 else 1e-9, atol=0)


# ----------------------------------------------------------------------------------------------
# The exact earth mover's distance


def test_a_scaling_too_close_to_one_raises_before_allocating_its_schedule():
    """scaling=1-1e-9 asked for a schedule of ~10^10 temperatures (26 GiB)."""
    x, y = torch.rand(8, 3), torch.rand(8, 3)
    with pytest.raises(ValueError, match=r"scaling=0.999999999 is so close to 1 .* \(at most 100,000"):
        pcops.sinkhorn_divergence(x, y, scaling=1 - 1e-9)
    assert len(pcops.ops.transport.sinkhorn.epsilon_schedule(2, 1.0, 0.05, 0.999)) < 100_000  # a long, legitimate schedule
