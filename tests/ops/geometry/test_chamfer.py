"""pcops.chamfer_distance against a dense float64 reference with PyTorch3D's documented semantics."""

import pytest
import torch

import pcops
from pcops.ops.geometry import chamfer as chamfer_module
from tests import reference
from tests.compile_check import assert_compiles
from tests.reference import CLOUDS, cloud

F64 = torch.float64
LENGTHS_X, LENGTHS_Y = [5, 0, 7, 3, 6], [6, 4, 0, 1, 6]  # an empty x sample, an empty y sample


def expected(xs, ys, norm=2, single=False, point_reduction="mean", batch_reduction="mean"):
    """PyTorch3D's chamfer_distance over per-sample clouds, from dense per-point costs."""
    reduce = {
        "sum": lambda c: c.sum(),
        "mean": lambda c: c.sum() / max(c.shape[0], 1),
        "max": lambda c: c.max() if c.numel() else c.sum(),
    }[point_reduction]
    losses = []
    for x, y in zip(xs, ys):
        cx, cy = reference.chamfer_terms(x, y, norm)
        lx, ly = reduce(cx), reduce(cy)
        losses.append(lx if single else torch.maximum(lx, ly) if point_reduction == "max" else lx + ly)
    losses = torch.stack(losses)
    if batch_reduction is None:
        return losses
    return losses.sum() if batch_reduction == "sum" else losses.mean()


def _batch(gen, p1=7, p2=6):
    x = torch.rand(len(LENGTHS_X), p1, 3, generator=gen, dtype=F64)
    y = torch.rand(len(LENGTHS_Y), p2, 3, generator=gen, dtype=F64)
    return x, y, torch.tensor(LENGTHS_X), torch.tensor(LENGTHS_Y)


def _samples(x, y, xl, yl):
    return [x[b, : xl[b]] for b in range(len(xl))], [y[b, : yl[b]] for b in range(len(yl))]


def _packed(x, y, xl, yl, gen):
    xs, ys = _samples(x, y, xl, yl)
    xp, xb = torch.cat(xs), torch.cat([torch.full((len(s),), b) for b, s in enumerate(xs)])
    yp, yb = torch.cat(ys), torch.cat([torch.full((len(s),), b) for b, s in enumerate(ys)])
    px, py = torch.randperm(len(xp), generator=gen), torch.randperm(len(yp), generator=gen)
    return xp[px], yp[py], xb[px], yb[py], px, py


@pytest.mark.parametrize("kind", CLOUDS)
@pytest.mark.parametrize("norm", [1, 2])
def test_single_clouds_match_the_dense_reference(gen, kind, norm):
    x, y, _ = cloud(kind, gen)
    for pr in ("mean", "sum", "max"):
        for single in (False, True):
            out = pcops.chamfer_distance(x, y, norm=norm, point_reduction=pr, single_directional=single)
            assert out.shape == ()
            torch.testing.assert_close(out, expected([x], [y], norm, single, pr), rtol=1e-12, atol=1e-12)
    cx, cy = pcops.chamfer_distance(x, y, norm=norm, point_reduction=None, batch_reduction=None)
    ref_x, ref_y = reference.chamfer_terms(x, y, norm)
    torch.testing.assert_close(cx, ref_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cy, ref_y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["warp", "scipy", "torch"])
def test_every_search_backend_gives_the_same_loss(gen, backend):
    x, y, _ = cloud("clustered", gen)
    out = pcops.chamfer_distance(x, y, backend=backend)
    torch.testing.assert_close(out, expected([x], [y]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [1, 2])
@pytest.mark.parametrize("point_reduction", ["mean", "sum", "max"])
@pytest.mark.parametrize("batch_reduction", ["mean", "sum", None])
def test_padded_and_packed_equal_a_loop(gen, norm, point_reduction, batch_reduction):
    x, y, xl, yl = _batch(gen)
    xs, ys = _samples(x, y, xl, yl)
    kw = dict(norm=norm, point_reduction=point_reduction, batch_reduction=batch_reduction)
    want = expected(xs, ys, norm, False, point_reduction, batch_reduction)
    torch.testing.assert_close(pcops.chamfer_distance(x, y, x_lengths=xl, y_lengths=yl, **kw), want, rtol=1e-12, atol=1e-12)
    xp, yp, xb, yb, _, _ = _packed(x, y, xl, yl, gen)
    torch.testing.assert_close(pcops.chamfer_distance(xp, yp, x_batch=xb, y_batch=yb, **kw), want, rtol=1e-12, atol=1e-12)


def test_padded_without_lengths_uses_every_row(gen):
    x, y, _, _ = _batch(gen)
    out = pcops.chamfer_distance(x, y, batch_reduction=None)
    torch.testing.assert_close(out, expected(list(x), list(y), batch_reduction=None), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [1, 2])
def test_per_point_costs_keep_the_layout(gen, norm):
    x, y, xl, yl = _batch(gen)
    cx, cy = pcops.chamfer_distance(x, y, x_lengths=xl, y_lengths=yl, norm=norm, point_reduction=None, batch_reduction=None)
    assert cx.shape == x.shape[:2] and cy.shape == y.shape[:2]
    for b in range(len(xl)):
        ref_x, ref_y = reference.chamfer_terms(x[b, : xl[b]], y[b, : yl[b]], norm)
        torch.testing.assert_close(cx[b, : xl[b]], ref_x, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cy[b, : yl[b]], ref_y, rtol=1e-12, atol=1e-12)
        assert torch.all(cx[b, xl[b] :] == 0) and torch.all(cy[b, yl[b] :] == 0)
    xp, yp, xb, yb, px, py = _packed(x, y, xl, yl, gen)
    single = pcops.chamfer_distance(xp, yp, x_batch=xb, y_batch=yb, norm=norm, single_directional=True, point_reduction=None, batch_reduction=None)
    flat_x = torch.cat([cx[b, : xl[b]] for b in range(len(xl))])
    torch.testing.assert_close(single, flat_x[px], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [1, 2])
@pytest.mark.parametrize("wrt", ["x", "y"])
def test_gradcheck(gen, norm, wrt):
    x, y, xl, yl = _batch(gen)
    inputs = {"x": x, "y": y}
    inputs[wrt] = inputs[wrt].clone().requires_grad_()

    def fn(t):
        a = dict(inputs, **{wrt: t})
        return pcops.chamfer_distance(a["x"], a["y"], x_lengths=xl, y_lengths=yl, norm=norm, batch_reduction=None)

    assert torch.autograd.gradcheck(fn, (inputs[wrt],))


def test_gradients_match_the_dense_reference(gen):
    x = torch.rand(40, 3, generator=gen, dtype=F64, requires_grad=True)
    y = torch.rand(30, 3, generator=gen, dtype=F64, requires_grad=True)
    grads = torch.autograd.grad(pcops.chamfer_distance(x, y), (x, y))
    cx, cy = reference.chamfer_terms(x, y)
    for a, b in zip(grads, torch.autograd.grad(cx.mean() + cy.mean(), (x, y))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_l1_search_paths_agree_with_brute_force(gen):
    x, y, xl, yl = _batch(gen, 30, 40)
    from pcops import _layout as layouts

    flat = layouts.pair(x, y, query_lengths=xl, ref_lengths=yl)
    for groups in ((flat.query_group, flat.ref_group), (None, None)):
        brute = chamfer_module._l1_brute(flat.query, flat.ref, *groups)
        tree = chamfer_module._l1_scipy(flat.query, flat.ref, *groups)
        assert torch.equal(brute >= 0, tree >= 0)
        ok = brute >= 0
        cost = lambda i: (flat.query[ok] - flat.ref[i[ok]]).abs().sum(-1)  # noqa: E731
        torch.testing.assert_close(cost(tree), cost(brute), rtol=0, atol=0)


def test_opcheck_nearest_l1(gen):
    x, y, xl, yl = _batch(gen)
    from pcops import _layout as layouts

    flat = layouts.pair(x, y, query_lengths=xl, ref_lengths=yl)
    for dtype in (torch.float32, F64):
        q, r = flat.query.to(dtype), flat.ref.to(dtype)
        torch.library.opcheck(chamfer_module.nearest_l1, (q, r, True, flat.query_group, flat.ref_group))
        torch.library.opcheck(chamfer_module.nearest_l1, (q, r, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(gen, dtype):
    x, y, _ = cloud("uniform", gen)
    out = pcops.chamfer_distance(x.to(dtype), y.to(dtype))
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected([x.to(dtype)], [y.to(dtype)]), rtol=tol, atol=tol)


def test_identical_clouds_have_zero_distance(gen):
    x, _, _ = cloud("duplicates", gen)
    assert pcops.chamfer_distance(x, x.flip(0)) == 0
    assert pcops.chamfer_distance(x, x, norm=1) == 0


def test_matches_pytorch3d_where_installed(gen):
    p3d = pytest.importorskip("pytorch3d.loss", reason="pytorch3d is not installed in this environment")
    x, y, xl, yl = _batch(gen)
    x, y = x.float(), y.float()
    for norm in (1, 2):
        ours = pcops.chamfer_distance(x, y, x_lengths=xl, y_lengths=yl, norm=norm)
        theirs, _ = p3d.chamfer_distance(x, y, x_lengths=xl, y_lengths=yl, norm=norm)
        torch.testing.assert_close(ours, theirs)


def _bad():
    x, y = torch.rand(2, 5, 3), torch.rand(2, 6, 3)
    xp, yp = torch.rand(5, 3), torch.rand(6, 3)
    xb, yb = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1, 1, 1, 1, 0])
    nan = yp.clone()
    nan[2, 0] = float("nan")
    return [
        (lambda: pcops.chamfer_distance(x, y, norm=3), ValueError, r"norm must be one of \(1, 2\), got"),
        (lambda: pcops.chamfer_distance(x, y, norm=True), ValueError, r"norm must be one of \(1, 2\), got"),
        (lambda: pcops.chamfer_distance(x, y, point_reduction="median"), ValueError, "point_reduction must be one of"),
        (lambda: pcops.chamfer_distance(x, y, batch_reduction="max"), ValueError, "batch_reduction must be one of"),
        (lambda: pcops.chamfer_distance(x, y, point_reduction=None), ValueError, "batch_reduction must be None"),
        (lambda: pcops.chamfer_distance(x, y, single_directional=1), TypeError, "single_directional"),
        (lambda: pcops.chamfer_distance(x, y[:1]), ValueError, "same batch size"),
        (lambda: pcops.chamfer_distance(x[..., :2], y), ValueError, r"^x must be a tensor of shape"),
        (lambda: pcops.chamfer_distance(x, y.long()), TypeError, r"^y must have a floating dtype"),
        (lambda: pcops.chamfer_distance(x, y, x_lengths=torch.tensor([6, 1])), ValueError, r"^x_lengths values"),
        (lambda: pcops.chamfer_distance(xp, yp, x_batch=xb), ValueError, "both x_batch and y_batch"),
        (lambda: pcops.chamfer_distance(xp, yp, x_batch=xb, y_batch=yb, batch_size=1), ValueError, r"^x_batch values"),
        (lambda: pcops.chamfer_distance(xp, nan), ValueError, r"^y contains NaN"),
        (lambda: pcops.chamfer_distance(xp, nan, norm=1), ValueError, r"^y contains NaN"),
        (lambda: pcops.chamfer_distance(nan, xp, single_directional=True), ValueError, r"^x contains NaN"),
        (lambda: pcops.chamfer_distance(x, y, y_lengths=torch.tensor([1, 9])), ValueError, r"^y_lengths values"),
        (lambda: pcops.chamfer_distance(xp, yp, x_batch=xb, y_batch=yb[:3]), ValueError, r"^y_batch must be a tensor of shape"),
        (lambda: pcops.chamfer_distance(x, y, x_batch=xb), ValueError, r"^x_batch describes packed"),
    ]


@pytest.mark.parametrize("call,error,match", _bad())
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


class _Fit(torch.nn.Module):
    """A tiny reconstruction: move the query cloud, Chamfer loss to the reference, per layout."""

    def __init__(self, layout):
        super().__init__()
        self.move = torch.nn.Linear(3, 3)
        self.layout = layout

    def forward(self, query, ref):
        moved = self.move(query)
        if self.layout == "single":
            return torch.stack([pcops.chamfer_distance(moved, ref), pcops.chamfer_distance(moved, ref, norm=1)])
        if self.layout == "padded":
            x, y = torch.stack([moved, moved.flip(0)]), torch.stack([ref, ref.flip(0)])
            xl, yl = torch.tensor([x.shape[1], x.shape[1] - 3]), torch.tensor([y.shape[1] - 1, y.shape[1]])
            return pcops.chamfer_distance(x, y, x_lengths=xl, y_lengths=yl, batch_reduction=None)
        xb = (torch.arange(moved.shape[0]) % 2)
        yb = (torch.arange(ref.shape[0]) % 2)
        return pcops.chamfer_distance(moved, ref, x_batch=xb, y_batch=yb, batch_size=2, point_reduction="sum", batch_reduction=None)


@pytest.mark.parametrize("layout", ["single", "padded", "packed"])
def test_compile_fullgraph_matches_eager_without_recompiling_per_size(gen, layout):
    # the gradients to both clouds: inductor once gave a cloud that is one direction's query and
    # the other's gathered ref a wrong gradient (single and packed layouts)
    calls = [(torch.rand(m, 3, generator=gen).requires_grad_(), torch.rand(n, 3, generator=gen).requires_grad_()) for m, n in [(30, 50), (45, 80)]]
    assert_compiles(_Fit(layout), calls)


def test_packed_under_compile_needs_batch_size(gen):
    def fn(x, y, xb, yb):
        return pcops.chamfer_distance(x, y, x_batch=xb, y_batch=yb)

    x, y = torch.rand(6, 3, generator=gen), torch.rand(5, 3, generator=gen)
    with pytest.raises(Exception, match="batch_size"):
        torch.compile(fn, fullgraph=True, backend="eager")(x, y, torch.zeros(6, dtype=torch.int64), torch.zeros(5, dtype=torch.int64))


@pytest.mark.cuda
@pytest.mark.parametrize("norm", [1, 2])
def test_cuda_matches_reference(gen, norm):
    x, y, xl, yl = _batch(gen, 300, 400)
    out = pcops.chamfer_distance(x.cuda(), y.cuda(), x_lengths=xl.cuda(), y_lengths=yl.cuda(), norm=norm, batch_reduction=None)
    torch.testing.assert_close(out.cpu(), expected(*_samples(x, y, xl, yl), norm, batch_reduction=None), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype, far", [(torch.float32, 3e19), (F64, 1e155)])
def test_points_farther_than_the_dtype_holds_cost_inf_and_missing_partners_still_cost_0(dtype, far, monkeypatch):
    """A finite point whose squared distance to every point of the other cloud overflows (the
    kNN search finds none: -1) costs inf, not 0 (a far point silently dropped out of the loss);
    padding, an empty sample of the other cloud and a NaN point without validation still cost 0,
    and, without validation, a finite point whose other cloud holds no finite point costs inf. The
    same on every path: the costs launch, the torch formula (with gradients), the layout layer,
    padded and packed, L2 and L1."""
    x = torch.tensor([[0.0, 0.0, 0.0], [far, 0.0, 0.0]], dtype=dtype)
    y = torch.tensor([[1.0, 0.0, 0.0], [-far, 0.0, 0.0]], dtype=dtype)
    inf = float("inf")
    want = (torch.tensor([1.0, inf], dtype=dtype), torch.tensor([1.0, inf], dtype=dtype))
    for kernel in (True, False):
        for plain in (True, False):
            monkeypatch.setattr(chamfer_module, "KERNEL", [kernel])
            monkeypatch.setattr(chamfer_module, "PLAIN", [plain])
            for grad in (False, True):
                xs = x.clone().requires_grad_(grad)
                got = pcops.chamfer_distance(xs, y, point_reduction=None, batch_reduction=None)
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a.detach(), b), (kernel, plain, grad)
                loss = pcops.chamfer_distance(xs, y)
                assert loss.item() == inf, (kernel, plain, grad)
                if grad:
                    got[0][0].backward()  # the finite cost's gradient is still finite
                    assert torch.isfinite(xs.grad).all()
            # padded, sample 1 of y empty: its x points cost 0, padding rows 0
            xp, yp = torch.stack([x, x]), torch.stack([y, y])
            cx, cy = pcops.chamfer_distance(xp, yp, x_lengths=torch.tensor([2, 1]), y_lengths=torch.tensor([2, 0]),
                                            point_reduction=None, batch_reduction=None)
            assert torch.equal(cx, torch.tensor([[1.0, inf], [0.0, 0.0]], dtype=dtype)), (kernel, plain)
            assert torch.equal(cy, torch.tensor([[1.0, inf], [0.0, 0.0]], dtype=dtype)), (kernel, plain)
            # packed, the same samples
            cx, cy = pcops.chamfer_distance(torch.cat([x, x[:1]]), y, x_batch=torch.tensor([0, 0, 1]), y_batch=torch.tensor([0, 0]),
                                            batch_size=2, point_reduction=None, batch_reduction=None)
            assert torch.equal(cx, torch.tensor([1.0, inf, 0.0], dtype=dtype)) and torch.equal(cy, want[1]), (kernel, plain)
            # L1: the far point's L1 distance overflows too, or its cost does
            if dtype == torch.float32:
                xl, yl = torch.tensor([[0.0, 0.0, 0.0], [3e38, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0], [-3e38, 0.0, 0.0]])
                l1 = pcops.chamfer_distance(xl[1:], yl[1:], norm=1, point_reduction=None, batch_reduction=None)
                assert torch.equal(l1[0], torch.tensor([inf])) and torch.equal(l1[1], torch.tensor([inf])), (kernel, plain)
                l1 = pcops.chamfer_distance(xl, yl, norm=1, point_reduction=None, batch_reduction=None)
                assert torch.equal(l1[0], torch.tensor([1.0, 3e38])), (kernel, plain)
            # without validation: a NaN point costs 0; a finite one facing only NaN points, inf
            nan = float("nan")
            xn = torch.tensor([[nan, 0.0, 0.0], [0.5, 0.0, 0.0]], dtype=dtype)
            cx, _ = pcops.chamfer_distance(xn, y, validate=False, point_reduction=None, batch_reduction=None)
            assert torch.equal(cx, torch.tensor([0.0, 0.25], dtype=dtype)), (kernel, plain)
            cx, cy = pcops.chamfer_distance(xn[1:], torch.full((2, 3), nan, dtype=dtype), validate=False, point_reduction=None,
                                            batch_reduction=None)
            assert torch.equal(cx, torch.tensor([inf], dtype=dtype)) and torch.equal(cy, torch.zeros(2, dtype=dtype)), (kernel, plain)
            # L1 the same (scipy's tree takes no NaN or inf point: they neither find nor are neighbours)
            cx, _ = pcops.chamfer_distance(xn, y, norm=1, validate=False, point_reduction=None, batch_reduction=None)
            assert torch.equal(cx, torch.tensor([0.0, 0.5], dtype=dtype)), (kernel, plain)
            cx, cy = pcops.chamfer_distance(xn[1:], torch.full((2, 3), nan, dtype=dtype), norm=1, validate=False,
                                            point_reduction=None, batch_reduction=None)
            assert torch.equal(cx, torch.tensor([inf], dtype=dtype)) and torch.equal(cy, torch.zeros(2, dtype=dtype)), (kernel, plain)
    # both L1 searches (the CPU's tree, the brute force elsewhere), grouped or not, with NaN and inf points
    q = torch.tensor([[nan, 0, 0], [0.5, 0, 0], [inf, 0, 0], [2, 0, 0], [0, 0, 0]], dtype=dtype)
    r = torch.tensor([[0, nan, 0], [1, 0, 0], [0, -inf, 0], [2.5, 0, 0], [0, 0, nan]], dtype=dtype)
    qg, rg = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 0, 0, 1, 1])
    for search in (chamfer_module._l1_scipy, chamfer_module._l1_brute):
        assert search(q, r, None, None).tolist() == [-1, 1, -1, 3, 1]
        assert search(q, r, qg, rg).tolist() == [-1, 1, -1, 3, 3]
