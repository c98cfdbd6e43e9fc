"""pcops.compat.torch_scatter against float64 references written from torch_scatter 2.1.2's
documented semantics (a loop over slots; torch's own softmax / logsumexp / std per group), and
torch's scatter_reduce; gradients by gradcheck; scripting and a fullgraph compile."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.autograd import gradcheck

from pcops.compat import torch_scatter as ts

REDUCES = ("sum", "add", "mean", "min", "max", "mul")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------------------------------------
# references (float64 loops over slots, no pcops)


def ref_scatter(src, index, dim, size, reduce):
    """``index`` already broadcast to src's shape; returns (out, arg) (arg for min/max)."""
    src64 = src.double().movedim(dim, -1)
    idx = index.movedim(dim, -1)
    n = src64.shape[-1]
    out = torch.zeros(src64.shape[:-1] + (size,), dtype=torch.float64)
    arg = torch.full(out.shape, n, dtype=torch.long)
    for pos in torch.cartesian_prod(*[torch.arange(s) for s in src64.shape[:-1]]).view(-1, src64.dim() - 1) if src64.dim() > 1 else [()]:
        pos = tuple(int(p) for p in pos)
        row, irow = src64[pos], idx[pos]
        for s in range(size):
            sel = (irow == s).nonzero().flatten()
            vals = row[sel]
            if reduce in ("sum", "add"):
                out[pos + (s,)] = vals.sum()
            elif reduce == "mul":
                out[pos + (s,)] = vals.prod()
            elif reduce == "mean":
                out[pos + (s,)] = vals.mean() if len(sel) else 0.0
            elif len(sel):
                j = int(vals.argmax() if reduce == "max" else vals.argmin())  # the first extremum
                out[pos + (s,)] = vals[j]
                arg[pos + (s,)] = sel[j]
    return out.movedim(-1, dim), arg.movedim(-1, dim)


def _cases(gen):
    """(src, index, dim, broadcast index): 1-D, a 1-D index along a middle dim, a full index."""
    a = torch.randn(13, generator=gen)
    ia = torch.randint(0, 5, (13,), generator=gen)
    b = torch.randn(3, 9, 4, generator=gen)
    ib = torch.randint(0, 4, (9,), generator=gen)
    c = torch.randn(4, 7, generator=gen)
    ic = torch.randint(0, 6, (4, 7), generator=gen)
    return [
        (a, ia, -1, ia),
        (b, ib, 1, ib.view(1, 9, 1).expand(3, 9, 4)),
        (c, ic, 1, ic),
        (c, ic, -1, ic),
    ]


@pytest.mark.parametrize("reduce", REDUCES)
def test_scatter_equals_the_reference(gen, reduce):
    for src, index, dim, full in _cases(gen):
        size = int(index.max()) + 3  # empty slots at the end too
        want, want_arg = ref_scatter(src, full, dim % src.dim(), size, reduce)
        got = ts.scatter(src.double(), index, dim, dim_size=size, reduce=reduce)
        torch.testing.assert_close(got, want)
        if reduce in ("min", "max"):
            res, arg = getattr(ts, "scatter_" + reduce)(src, index, dim, dim_size=size)
            assert torch.equal(arg, want_arg)
            torch.testing.assert_close(res, want.float())
        # dim_size left out: index.max() + 1
        assert ts.scatter(src, index, dim, reduce=reduce).shape[dim] == int(index.max()) + 1


def test_scatter_equals_torch_scatter_reduce(gen):
    src = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 8, (6, 50), generator=gen)
    for reduce, mode in (("sum", "sum"), ("mean", "mean"), ("max", "amax"), ("min", "amin"), ("mul", "prod")):
        want = torch.zeros(6, 8, dtype=torch.float64).scatter_reduce(1, index, src, mode, include_self=False)
        torch.testing.assert_close(ts.scatter(src, index, 1, dim_size=8, reduce=reduce), want)


def test_ties_give_the_first_position_and_empty_slots_the_size(gen):
    src = torch.tensor([[2.0, 5.0, 5.0, 1.0, 1.0, 7.0]])
    index = torch.tensor([0, 0, 0, 2, 2, 3])
    out, arg = ts.scatter_max(src, index, dim=1, dim_size=5)
    assert out.tolist() == [[5.0, 0.0, 1.0, 7.0, 0.0]] and arg.tolist() == [[1, 6, 3, 5, 6]]
    out, arg = ts.scatter_min(src, index, dim=1, dim_size=5)
    assert out.tolist() == [[2.0, 0.0, 1.0, 7.0, 0.0]] and arg.tolist() == [[0, 6, 3, 5, 6]]
    nan = torch.tensor([1.0, float("nan"), 3.0])
    out, arg = ts.scatter_max(nan, torch.tensor([0, 0, 0]))
    assert out.isnan().all() and arg.tolist() == [1]


@pytest.mark.parametrize("reduce", ["min", "max"])
def test_both_min_max_paths_agree(gen, reduce):
    """A 1-D index of float rows runs pcops' segment kernel after a stable sort; a full index
    runs torch's scatter_reduce and an arg pass: the same values, args and gradients (ties
    everywhere: small integers)."""
    src = torch.randint(0, 4, (50, 3, 2), generator=gen).double().requires_grad_()
    index = torch.randint(0, 9, (50,), generator=gen)
    fn = getattr(ts, "scatter_" + reduce)
    a, arg_a = fn(src, index, 0, dim_size=10)
    b, arg_b = fn(src, index.view(50, 1, 1).expand(50, 3, 2), 0, dim_size=10)
    assert torch.equal(a, b) and torch.equal(arg_a, arg_b)
    (ga,) = torch.autograd.grad(a.sum(), src)
    (gb,) = torch.autograd.grad(b.sum(), src)
    assert torch.equal(ga, gb)
    c, arg_c = fn(src.transpose(0, 1), index, 1, dim_size=10)  # along a middle dimension
    assert torch.equal(c, a.transpose(0, 1)) and torch.equal(arg_c, arg_a.transpose(0, 1))


@pytest.mark.parametrize("shape", [(40,), (40, 3)])
def test_value_only_calls_equal_the_values_of_the_arg_paths(gen, shape):
    """Without a gradient to take, scatter / segment_csr / segment_coo max and min compute no arg
    (torch's reductions) and a 1-D segment_csr sum runs torch's segment reduction: the values of
    the paths with an arg, all-negative and empty slots, indices outside the slots and a pointer
    that starts past row 0 included; the 1-D sum's gradient passes gradcheck."""
    src = torch.randn(*shape, generator=gen, dtype=torch.float64) - 3  # most slots all-negative
    index = torch.randint(-1, 9, (40,), generator=gen)  # -1: no slot; 8 >= dim_size: no slot
    indptr = torch.tensor([2, 5, 5, 11, 30, 38])  # rows 0-1 and 38-39 in no segment; one empty
    ids = torch.searchsorted(indptr, torch.arange(40), right=True) - 1
    ids = torch.where((torch.arange(40) >= 2) & (torch.arange(40) < 38), ids, 5)
    for reduce in ("min", "max"):
        arg_path = getattr(ts, "scatter_" + reduce)(src.clone().requires_grad_(), index, 0, dim_size=8)[0]
        assert torch.equal(ts.scatter(src, index, 0, dim_size=8, reduce=reduce), arg_path.detach())
        csr_arg = getattr(ts, f"segment_{reduce}_csr")(src, indptr)[0]
        assert torch.equal(ts.segment_csr(src, indptr, reduce=reduce), csr_arg)
        want = ref_scatter(src, ids.view(-1, *([1] * (src.dim() - 1))).expand(src.shape), 0, 6, reduce)[0][:5]
        assert torch.equal(csr_arg, want)
    want = ref_scatter(src, ids.view(-1, *([1] * (src.dim() - 1))).expand(src.shape), 0, 6, "sum")[0][:5]
    torch.testing.assert_close(ts.segment_csr(src, indptr), want, rtol=1e-12, atol=1e-12)
    assert gradcheck(lambda x: ts.segment_csr(x, indptr), (src.clone().requires_grad_(),))


def test_out_is_updated_in_place():
    src = torch.tensor([1.0, 3.0, 2.0, 4.0])
    index = torch.tensor([0, 1, 0, 1])
    out = torch.full((3,), -2.0)
    assert ts.scatter_sum(src, index, out=out) is out and out.tolist() == [1.0, 5.0, -2.0]
    out = torch.full((3,), 2.5)
    res, arg = ts.scatter_max(src, index, out=out)
    assert res is out and out.tolist() == [2.5, 4.0, 2.5] and arg.tolist() == [4, 3, 4]
    out = torch.ones(3)
    ts.scatter_mul(src, index, out=out)
    assert out.tolist() == [2.0, 12.0, 1.0]
    csr = torch.full((2,), -9.0)
    assert ts.segment_csr(src, torch.tensor([0, 2, 4]), csr) is csr and csr.tolist() == [4.0, 6.0]  # overwritten


def test_integer_and_half_dtypes(gen):
    src = torch.randint(-9, 9, (20, 3), generator=gen)
    index = torch.randint(0, 4, (20,), generator=gen)
    for reduce in REDUCES:
        want, _ = ref_scatter(src, index.view(20, 1).expand(20, 3), 0, 4, reduce)
        if reduce == "mean":
            want = (ref_scatter(src, index.view(20, 1).expand(20, 3), 0, 4, "sum")[0] / torch.bincount(index, minlength=4).clamp(min=1)[:, None]).floor()
        assert torch.equal(ts.scatter(src, index, 0, dim_size=4, reduce=reduce), want.long())
        half = ts.scatter(src.half(), index, 0, dim_size=4, reduce=reduce)
        assert half.dtype == torch.float16


def test_integer_means_round_as_torch_scatter_does():
    """torch_scatter's ``scatter_mean`` floor-divides integer sums (Python), its segment means
    divide in C++ (toward zero): the mean of -3 and -4 is -4 by scatter and -3 by segments."""
    src, index = torch.tensor([-3, -4, 5]), torch.tensor([0, 0, 1])
    assert ts.scatter(src, index, reduce="mean").tolist() == [-4, 5]
    assert ts.scatter_mean(src, index).tolist() == [-4, 5]
    for got in (ts.segment_csr(src, torch.tensor([0, 2, 3]), reduce="mean"), ts.segment_coo(src, index, reduce="mean"),
                ts.segment_mean_csr(src, torch.tensor([0, 2, 3])), ts.segment_mean_coo(src, index)):
        assert got.tolist() == [-3, 5]


@pytest.mark.parametrize("reduce", ["sum", "mul", "min", "max"])
def test_no_elements_give_no_slots(reduce):
    """A src without elements (a zero-size dimension other than ``dim``) broadcasts the index to
    no elements: no slots without ``dim_size``, whatever a 1-D index holds (torch_scatter's
    rule; max and min gave index.max() + 1 slots where sum gave none)."""
    src, index = torch.empty(4, 0), torch.tensor([0, 1, 0, 2])
    for grad in (False, True):
        got = ts.scatter(src.clone().requires_grad_(grad), index, 0, reduce=reduce)
        assert got.shape == (0, 0)
        assert ts.scatter(src, index, 0, dim_size=5, reduce=reduce).shape == (5, 0)
    if reduce in ("min", "max"):
        values, arg = getattr(ts, f"scatter_{reduce}")(src, index, 0)
        assert values.shape == arg.shape == (0, 0)


# ----------------------------------------------------------------------------------------------
# segment_csr / segment_coo / gather


def _segments(gen, n=30, segments=7):
    ids = torch.sort(torch.randint(0, segments, (n,), generator=gen)).values
    ids[ids == 2] = 3  # an empty segment
    indptr = torch.searchsorted(ids, torch.arange(segments + 1))
    return ids, indptr


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.int64])
@pytest.mark.parametrize("reduce", ["sum", "mean", "min", "max"])
def test_segments_equal_scatter_and_the_reference(gen, dtype, reduce):
    ids, indptr = _segments(gen)
    src = (torch.randn(30, 2, 3, generator=gen) * 10).to(dtype)
    full = ids.view(30, 1, 1).expand(src.shape)
    want, want_arg = ref_scatter(src, full, 0, 7, reduce)
    tol = {torch.float16: {"rtol": 1e-2, "atol": 1e-2}, torch.float32: {"rtol": 1e-5, "atol": 1e-5}}.get(dtype, {})
    for got in (ts.segment_csr(src, indptr, reduce=reduce), ts.segment_coo(src, ids, reduce=reduce)):
        assert got.dtype == dtype and got.shape == (7, 2, 3)
        if dtype == torch.int64 and reduce == "mean":  # torch_scatter's segment means: C++ integer division, toward zero
            sums = ref_scatter(src, full, 0, 7, "sum")[0]
            counts = torch.bincount(ids, minlength=7).clamp(min=1).view(7, 1, 1)
            assert torch.equal(got, (sums / counts).trunc().long())
            continue
        torch.testing.assert_close(got.double(), want, **tol)
    if reduce in ("min", "max"):
        for _, arg in (getattr(ts, f"segment_{reduce}_csr")(src, indptr), getattr(ts, f"segment_{reduce}_coo")(src, ids)):
            if dtype != torch.float16:  # rounding may create ties
                assert torch.equal(arg, want_arg)


def test_batched_pointers_and_rows_outside_the_pointer(gen):
    src = torch.randn(2, 8, 3, generator=gen, dtype=torch.float64)
    indptr = torch.tensor([[0, 3, 3, 8], [1, 2, 5, 6]])  # second row: rows 0, 6, 7 in no segment
    ids = torch.tensor([[0, 0, 0, 2, 2, 2, 2, 2], [3, 0, 1, 1, 1, 2, 3, 3]])
    for reduce in ("sum", "mean", "max"):
        want = ts.scatter(src, ids, 1, dim_size=4, reduce=reduce)[:, :3]
        torch.testing.assert_close(ts.segment_csr(src, indptr, reduce=reduce), want)
    torch.testing.assert_close(ts.segment_csr(src[0], indptr[1]), torch.stack([src[0, 1], src[0, 2:5].sum(0), src[0, 5]]))


def test_gather_is_the_inverse_of_segments(gen):
    ids, indptr = _segments(gen)
    src = torch.randn(7, 4, generator=gen)
    want = src[ids]
    assert torch.equal(ts.gather_csr(src, indptr), want)
    assert torch.equal(ts.gather_coo(src, ids), want)
    out = torch.empty(30, 4)
    assert ts.gather_csr(src, indptr, out) is out and torch.equal(out, want)
    batched = torch.randn(2, 7, 4, generator=gen)
    assert torch.equal(ts.gather_coo(batched, ids.view(1, -1)), batched[:, ids])


# ----------------------------------------------------------------------------------------------
# composites


def test_composites_equal_torch_per_group(gen):
    src = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 6, (40,), generator=gen)
    index[index == 4] = 5  # slot 4 empty
    soft = ts.scatter_softmax(src, index, dim=0)
    logsoft = ts.scatter_log_softmax(src, index, dim=0)
    lse = ts.scatter_logsumexp(src, index, dim=0)
    std = ts.scatter_std(src, index, dim=0)
    for s in range(6):
        m = index == s
        if not m.any():
            assert (lse[s] == 0).all() and (std[s] == 0).all()
            continue
        torch.testing.assert_close(soft[m], torch.softmax(src[m], 0))
        torch.testing.assert_close(logsoft[m], torch.log_softmax(src[m], 0))
        torch.testing.assert_close(lse[s], torch.logsumexp(src[m], 0))
        want = src[m].std(0) if m.sum() > 1 else torch.zeros(3, dtype=torch.float64)
        torch.testing.assert_close(std[s], want, rtol=1e-5, atol=1e-6)  # torch_scatter's +1e-6
    assert torch.equal(ts.scatter_softmax(src, index, dim=0, dim_size=9), soft)
    with pytest.raises(ValueError, match="floating"):
        ts.scatter_softmax(index, index)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_integer_indices_give_the_int64_results(gen, dtype):
    # torch.gather reads an expanded (stride-0) int32 index wrongly on the CPU: the args of
    # scatter_max(out=), the composites and gather_coo of a broadcast index were wrong
    src = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    index = torch.tensor([2, 0, 1, 2, 0, 1])
    out = torch.full((3, 3), -5.0, dtype=torch.float64)
    calls = {
        "scatter_max": lambda i: ts.scatter_max(src, i, dim=0),
        "scatter_min out=": lambda i: ts.scatter_min(src, i, dim=0, out=out.clone()),
        "scatter_max grad": lambda i: ts.scatter_max(src.clone().requires_grad_(), i, dim=0),
        "segment_max_coo": lambda i: ts.segment_max_coo(src, i.sort().values),
        "scatter_softmax": lambda i: ts.scatter_softmax(src, i, dim=0),
        "scatter_log_softmax": lambda i: ts.scatter_log_softmax(src, i, dim=0),
        "scatter_logsumexp": lambda i: ts.scatter_logsumexp(src, i, dim=0),
        "scatter_std": lambda i: ts.scatter_std(src, i, dim=0),
        "scatter_mean": lambda i: ts.scatter_mean(src, i, dim=0),
        "gather_coo": lambda i: ts.gather_coo(src.t().contiguous(), i[None].expand(3, 6)),
    }
    for name, call in calls.items():
        want, got = call(index), call(index.to(dtype))
        for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert torch.equal(w.detach(), g.detach()), name


# ----------------------------------------------------------------------------------------------
# gradients, scripting, compile, errors


@pytest.mark.parametrize("reduce", REDUCES)
def test_gradcheck_scatter_and_segments(gen, reduce):
    src = torch.randn(12, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 1, 0, 1, 1, 3, 0, 3, 3, 1, 0, 0])
    assert gradcheck(lambda s: ts.scatter(s, index, 0, dim_size=5, reduce=reduce), (src,))
    if reduce != "mul":
        ptr = torch.tensor([0, 4, 4, 9, 12])
        red = "sum" if reduce == "add" else reduce
        assert gradcheck(lambda s: ts.segment_csr(s, ptr, reduce=red), (src,))
        assert gradcheck(lambda s: ts.segment_coo(s, torch.sort(index).values, reduce=red), (src,))


def test_gradcheck_composites_and_gathers(gen):
    src = torch.randn(10, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 2, 0, 2, 2, 3, 0, 3, 3, 2])
    for fn in (ts.scatter_softmax, ts.scatter_log_softmax, ts.scatter_logsumexp, ts.scatter_std):
        assert gradcheck(lambda s: fn(s, index, dim=0), (src,))
    rows = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda s: ts.gather_csr(s, torch.tensor([0, 2, 2, 5, 6])), (rows,))
    assert gradcheck(lambda s: ts.gather_coo(s, torch.tensor([0, 0, 2, 2, 3])), (rows,))


def test_max_gradient_goes_to_the_arg_element_only():
    src = torch.tensor([3.0, 3.0, 1.0], requires_grad=True)
    ts.scatter_max(src, torch.tensor([0, 0, 0]))[0].sum().backward()
    assert src.grad.tolist() == [1.0, 0.0, 0.0]
    src.grad = None
    ts.segment_csr(src, torch.tensor([0, 3]), reduce="max").sum().backward()
    assert src.grad.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_every_function_scripts():
    src, index = torch.tensor([1.0, 3.0, 2.0]), torch.tensor([0, 1, 0])
    for name in ts.__all__:
        torch.jit.script(getattr(ts, name))
    assert torch.equal(torch.jit.script(ts.scatter)(src, index, reduce="max"), ts.scatter(src, index, reduce="max"))


def test_fullgraph_compile_without_host_reads(gen):
    """PTv3's pooling (segment_csr over a pointer) and a PyG-style attention softmax, with
    dim_size given: one graph, equal to eager."""

    def fn(feat, indptr, index):
        pooled = ts.segment_csr(feat, indptr, reduce="max") + ts.segment_csr(feat, indptr, reduce="mean")
        alpha = ts.scatter_softmax(feat.sum(-1), index, dim=0, dim_size=5)
        agg = ts.scatter(feat * alpha[:, None], index, dim=0, dim_size=5, reduce="sum")
        top, arg = ts.scatter_max(feat, index, dim=0, dim_size=5)
        return pooled, agg, top, arg, ts.gather_csr(pooled, indptr, torch.empty_like(feat))

    feat = torch.randn(20, 4, generator=gen)
    index = torch.randint(0, 5, (20,), generator=gen)
    indptr = torch.tensor([0, 5, 5, 12, 20])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(feat, indptr, index), fn(feat, indptr, index)):
        torch.testing.assert_close(got, want)
    assert not counters["graph_break"]


def test_errors_name_the_argument():
    src = torch.ones(4)
    with pytest.raises(ValueError, match="reduce"):
        ts.scatter(src, torch.zeros(4, dtype=torch.long), reduce="median")
    with pytest.raises(TypeError, match="index"):
        ts.scatter(src, torch.zeros(4))
    with pytest.raises(TypeError, match="indptr"):
        ts.segment_csr(src, torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match="index"):
        ts.segment_coo(src, torch.zeros(3, dtype=torch.long))
