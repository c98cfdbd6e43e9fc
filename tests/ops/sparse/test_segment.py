"""pcops.segment_reduce against a float64 per-segment loop and torch.scatter_reduce; gradients
(gradcheck, first arg-extremum), both segment layouts, compile promises."""

import importlib

import pytest
import torch
import warp as wp

import pcops
from pcops import _warp
from tests.compile_check import assert_compiles
from tests.op_suite import TOL

segment_module = importlib.import_module("pcops.ops.sparse.segment")
REDUCTIONS = ("sum", "mean", "max", "min")
F64 = torch.float64


def loop_reference(values: torch.Tensor, offsets: torch.Tensor, reduce: str) -> torch.Tensor:
    """One segment at a time, float64; an empty segment gives 0."""
    rows = []
    for s in range(offsets.numel() - 1):
        part = values[int(offsets[s]) : int(offsets[s + 1])].double()
        if part.shape[0] == 0:
            rows.append(torch.zeros(values.shape[1:], dtype=F64))
        elif reduce == "sum":
            rows.append(part.sum(0))
        elif reduce == "mean":
            rows.append(part.mean(0))
        elif reduce == "max":
            rows.append(part.max(0).values)
        else:
            rows.append(part.min(0).values)
    return torch.stack(rows) if rows else torch.zeros((0, *values.shape[1:]), dtype=F64)


def random_offsets(gen, segments: int, rows: int) -> torch.Tensor:
    """A CSR pointer over ``rows`` rows with ``segments`` segments, some of them empty."""
    cuts = torch.sort(torch.randint(0, rows + 1, (segments - 1,), generator=gen)).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])


def scatter_reference(values, ids, segments, reduce):
    how = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}[reduce]
    index = ids[:, None].expand(-1, values.shape[1])
    return values.new_zeros((segments, values.shape[1])).scatter_reduce(0, index, values, how, include_self=False)


# -- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_offsets_match_the_float64_loop(gen, reduce):
    values = torch.randn(200, 5, generator=gen, dtype=F64)
    offsets = random_offsets(gen, 40, 200)
    assert (offsets[1:] == offsets[:-1]).any()  # some segments are empty
    out = pcops.segment_reduce(values, offsets, reduce=reduce)
    torch.testing.assert_close(out, loop_reference(values, offsets, reduce), **TOL[F64])


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_unsorted_ids_match_torch_scatter_reduce(gen, reduce):
    values = torch.randn(300, 7, generator=gen, dtype=F64)
    ids = torch.randint(0, 50, (300,), generator=gen)  # some of the 60 segments empty
    out = pcops.segment_reduce(values, ids=ids, reduce=reduce, num_segments=60)
    torch.testing.assert_close(out, scatter_reference(values, ids, 60, reduce), **TOL[F64])


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_ids_and_offsets_agree(gen, reduce):
    values = torch.randn(100, 3, generator=gen, dtype=F64)
    offsets = random_offsets(gen, 12, 100)
    ids = torch.repeat_interleave(torch.arange(12), offsets.diff())
    a = pcops.segment_reduce(values, offsets, reduce=reduce)
    b = pcops.segment_reduce(values, ids=ids, reduce=reduce, num_segments=12)
    c = pcops.segment_reduce(values, ids=ids, reduce=reduce)  # num_segments from the ids (the last is not empty here)
    assert torch.equal(a, b)
    assert torch.equal(a[: c.shape[0]], c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_dtypes(gen, dtype, reduce):
    values = torch.randn(120, 4, generator=gen).to(dtype)
    offsets = random_offsets(gen, 20, 120)
    out = pcops.segment_reduce(values, offsets, reduce=reduce)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), loop_reference(values.double(), offsets, reduce), **TOL[dtype])


def test_any_trailing_shape_and_1d_values(gen):
    values = torch.randn(30, 2, 3, generator=gen, dtype=F64)
    offsets = torch.tensor([0, 10, 10, 30])
    out = pcops.segment_reduce(values, offsets, reduce="max")
    assert out.shape == (3, 2, 3)
    torch.testing.assert_close(out.reshape(3, 6), loop_reference(values.reshape(30, 6), offsets, "max"))
    flat = pcops.segment_reduce(values[:, 0, 0], offsets, reduce="mean")
    assert flat.shape == (3,)
    torch.testing.assert_close(flat, loop_reference(values[:, :1, 0], offsets, "mean")[:, 0])


def test_rows_outside_the_pointer_belong_to_no_segment(gen):
    values = torch.randn(10, 2, generator=gen, dtype=F64, requires_grad=True)
    offsets = torch.tensor([2, 5, 7])  # rows 0, 1 and 7 .. 9 in no segment
    out = pcops.segment_reduce(values, offsets, reduce="sum")
    torch.testing.assert_close(out, torch.stack([values[2:5].sum(0), values[5:7].sum(0)]))
    out.sum().backward()
    assert torch.equal(values.grad[:, 0], torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 0, 0], dtype=F64))


def test_empty_segments_give_zero_for_every_reduction():
    values = torch.tensor([[-3.0], [-1.0]])
    for reduce in REDUCTIONS:
        out = pcops.segment_reduce(values, torch.tensor([0, 0, 2, 2]), reduce=reduce)
        assert out[0].item() == 0 and out[2].item() == 0, reduce


def test_no_segments_and_no_rows():
    assert pcops.segment_reduce(torch.randn(5, 3), torch.tensor([0]), reduce="max").shape == (0, 3)
    out = pcops.segment_reduce(torch.zeros(0, 3), torch.tensor([0, 0, 0]), reduce="mean")
    assert out.shape == (2, 3) and torch.all(out == 0)
    assert pcops.segment_reduce(torch.zeros(0, 3), ids=torch.zeros(0, dtype=torch.long)).shape == (0, 3)


def test_nan_is_the_extremum():
    values = torch.tensor([[1.0], [float("nan")], [5.0], [2.0]])
    assert torch.isnan(pcops.segment_reduce(values, torch.tensor([0, 4]), reduce="max")).all()
    assert torch.isnan(pcops.segment_reduce(values, torch.tensor([0, 4]), reduce="min")).all()
    assert pcops.segment_reduce(values, torch.tensor([0, 1, 2, 4]), reduce="max")[2].item() == 5.0


def test_a_batch_of_samples_equals_a_per_sample_loop(gen):
    sizes = [17, 0, 5, 1]
    samples = [(torch.randn(n, 3, generator=gen, dtype=F64), random_offsets(gen, 4, n)) for n in sizes]
    values = torch.cat([v for v, _ in samples])
    starts = torch.cumsum(torch.tensor([0] + sizes[:-1]), 0)
    offsets = torch.cat([torch.tensor([0])] + [o[1:] + s for (_, o), s in zip(samples, starts)])
    for reduce in REDUCTIONS:
        out = pcops.segment_reduce(values, offsets, reduce=reduce)
        expected = torch.cat([pcops.segment_reduce(v, o, reduce=reduce) for v, o in samples])
        assert torch.equal(out, expected)


# -- gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_gradcheck_offsets(gen, reduce):
    values = torch.randn(40, 3, generator=gen, dtype=F64, requires_grad=True)
    offsets = random_offsets(gen, 9, 40)
    assert torch.autograd.gradcheck(lambda v: pcops.segment_reduce(v, offsets, reduce=reduce), (values,))


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_gradcheck_unsorted_ids(gen, reduce):
    values = torch.randn(40, 3, generator=gen, dtype=F64, requires_grad=True)
    ids = torch.randint(0, 8, (40,), generator=gen)
    fn = lambda v: pcops.segment_reduce(v, ids=ids, reduce=reduce, num_segments=10)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (values,))


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_extremum_gradient_goes_to_the_first_of_tied_rows(reduce):
    v = 4.0 if reduce == "max" else -4.0
    values = torch.tensor([[0.0], [v], [1.0], [v], [v]], dtype=F64, requires_grad=True)
    pcops.segment_reduce(values, torch.tensor([0, 5]), reduce=reduce).sum().backward()
    assert values.grad[:, 0].tolist() == [0, 1, 0, 0, 0]
    # with unsorted ids too: the first row (smallest index) of the segment wins
    values.grad = None
    ids = torch.tensor([1, 0, 1, 0, 0])
    pcops.segment_reduce(values, ids=ids, reduce=reduce, num_segments=2).sum().backward()
    # segment 0 is rows 1, 3, 4 (tied: row 1); segment 1 is rows 0 (0.0) and 2 (1.0)
    assert values.grad[:, 0].tolist() == ([0, 1, 1, 0, 0] if reduce == "max" else [1, 1, 0, 0, 0])


def test_mean_gradient_is_one_over_the_count():
    values = torch.zeros(5, 1, dtype=F64, requires_grad=True)
    pcops.segment_reduce(values, torch.tensor([0, 1, 5]), reduce="mean").sum().backward()
    assert values.grad[:, 0].tolist() == [1, 0.25, 0.25, 0.25, 0.25]


# -- errors ------------------------------------------------------------------------------------


def test_bad_inputs_raise(gen):
    v = torch.randn(10, 2, generator=gen)
    o = torch.tensor([0, 4, 10])
    ids = torch.randint(0, 3, (10,), generator=gen)
    sr = pcops.segment_reduce
    cases = {
        "int values": (lambda: sr(v.long(), o), TypeError, "values must have a floating dtype"),
        "0-d values": (lambda: sr(v[0, 0], o), ValueError, "values must be a tensor of shape"),
        "reduce": (lambda: sr(v, o, reduce="prod"), ValueError, "reduce must be one of"),
        "neither": (lambda: sr(v), ValueError, "exactly one of offsets"),
        "both": (lambda: sr(v, o, ids), ValueError, "exactly one of offsets"),
        "float offsets": (lambda: sr(v, o.float()), TypeError, "offsets must have an integer dtype"),
        "2-d offsets": (lambda: sr(v, o[None]), ValueError, "offsets must be a tensor of shape"),
        "decreasing offsets": (lambda: sr(v, torch.tensor([0, 5, 3])), ValueError, "offsets must be non-decreasing"),
        "offsets past N": (lambda: sr(v, torch.tensor([0, 11])), ValueError, "offsets must be non-decreasing with values in"),
        "num_segments with offsets": (lambda: sr(v, o, num_segments=2), ValueError, "num_segments goes with ids"),
        "ids shape": (lambda: sr(v, ids=ids[:9]), ValueError, "ids must be a tensor of shape"),
        "float ids": (lambda: sr(v, ids=ids.float()), TypeError, "ids must have an integer dtype"),
        "negative ids": (lambda: sr(v, ids=ids - 1, num_segments=3), ValueError, "ids values must be"),
        "ids past num_segments": (lambda: sr(v, ids=ids, num_segments=2), ValueError, "ids values must be"),
        "float num_segments": (lambda: sr(v, ids=ids, num_segments=2.0), TypeError, "num_segments must be an int"),
        "list values": (lambda: sr([1.0], o), TypeError, "values must be a torch.Tensor"),
    }
    for name, (call, error, match) in cases.items():
        with pytest.raises(error, match=match):
            call()


# -- compile promises ------------------------------------------------------------------------


def test_opcheck(gen):
    v = torch.randn(30, 4, generator=gen)
    o = random_offsets(gen, 6, 30)
    for reduce in REDUCTIONS:
        torch.library.opcheck(torch.ops.pcops.segment_reduce.default, (v, o, reduce))
        torch.library.opcheck(torch.ops.pcops.segment_reduce.default, (v.double().requires_grad_(), o, reduce))
        torch.library.opcheck(torch.ops.pcops.segment_reduce.default, (v, o, reduce, True, False))
        s = torch.randn(6, 4, generator=gen)
        arg = torch.randint(0, 30, (6, 4), generator=gen) if reduce in ("max", "min") else torch.zeros(0, 4, dtype=torch.long)
        torch.library.opcheck(torch.ops.pcops.segment_reduce_backward.default, (s, o, arg, reduce, 30))


def test_compile_fullgraph_offsets_and_ids(gen):
    def fn(values, offsets, ids):
        return pcops.segment_reduce(values, offsets, reduce="max"), pcops.segment_reduce(values, ids=ids, reduce="mean", num_segments=5)

    calls = []
    for n in (30, 43):
        values = torch.randn(n, 3, generator=gen).requires_grad_()
        calls.append((values, random_offsets(gen, 7, n), torch.randint(0, 5, (n,), generator=gen)))
    assert_compiles(fn, calls, backend="aot_eager")


def test_ids_without_num_segments_cannot_be_compiled(gen):
    fn = torch.compile(lambda v, i: pcops.segment_reduce(v, ids=i), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="num_segments is required"):
        fn(torch.randn(5, 2), torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_kernels_compile_for_a_gpu(tmp_path, reduce):
    _warp.init()
    for dtype in (torch.float32, F64):
        for kernel in (*segment_module._kernels(dtype, reduce), segment_module._kernels(dtype, reduce, False)[0]):
            try:
                paths = wp.compile_aot_module(kernel.module, arch=90, module_dir=tmp_path, use_ptx=True)
            except Exception as err:  # noqa: BLE001 (no NVRTC in this Warp build)
                pytest.skip(f"Warp cannot compile for a GPU here: {err}")
            assert any(str(p).endswith(".ptx") and p.stat().st_size > 0 for p in paths)


@pytest.mark.cuda
@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_cuda_matches_cpu(gen, reduce):
    values = torch.randn(5000, 16, generator=gen, requires_grad=True)
    ids = torch.randint(0, 700, (5000,), generator=gen)
    cpu = pcops.segment_reduce(values, ids=ids, reduce=reduce, num_segments=800)
    (g_cpu,) = torch.autograd.grad(cpu.sum(), values)
    cuda_values = values.detach().cuda().requires_grad_()
    gpu = pcops.segment_reduce(cuda_values, ids=ids.cuda(), reduce=reduce, num_segments=800)
    (g_gpu,) = torch.autograd.grad(gpu.sum(), cuda_values)
    torch.testing.assert_close(gpu.cpu(), cpu)
    torch.testing.assert_close(g_gpu.cpu(), g_cpu)


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_warp_kernels_equal_the_cpu_torch_path(gen, reduce):
    # on the CPU sum/mean run in torch; the Warp kernels (CUDA's path for all four) run here directly
    values = torch.randn(300, 6, generator=gen, dtype=F64)
    offsets = torch.cat([torch.tensor([3]), random_offsets(gen, 30, 290)[1:-1] + 3, torch.tensor([293])])
    out, arg = segment_module._warp_forward(values, offsets, reduce)
    torch.testing.assert_close(out, loop_reference(values[: 293], torch.cat([torch.tensor([0]), offsets]), reduce)[1:], **TOL[F64])
    grad = torch.randn(out.shape, generator=gen, dtype=F64)
    back = segment_module._warp_backward(grad, offsets, arg, reduce, 300)
    (expected,) = torch.autograd.grad(
        pcops.segment_reduce(values.requires_grad_(), offsets, reduce=reduce), values, grad)
    torch.testing.assert_close(back, expected, **TOL[F64])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_cpu_forward_is_bitwise_torchs_segment_reduce(gen, dtype, reduce):
    # the row-at-a-time loop (sum, mean, max/min without arg) and the column-at-a-time one
    # (max/min recording the arg, under autograd) give torch's bits: NaN wins, ties keep the
    # first row (signed zeros), sums run in row order; empty segments give 0
    values = torch.randn(400, 7, generator=gen, dtype=dtype)
    if reduce in ("max", "min"):
        values = torch.randint(-3, 4, (400, 7), generator=gen).to(dtype)
        values[torch.rand(values.shape, generator=gen) < 0.2] = -0.0
        values[torch.rand(values.shape, generator=gen) < 0.01] = -float("inf")
    values[torch.rand(values.shape, generator=gen) < 0.03] = float("nan")
    offsets = torch.cat([torch.tensor([5]), random_offsets(gen, 60, 380)[1:-1] + 5, torch.tensor([385])])
    assert (offsets[1:] == offsets[:-1]).any()
    expected = torch.segment_reduce(values, reduce, offsets=offsets, axis=0)
    expected = expected.masked_fill((offsets[1:] == offsets[:-1])[:, None], 0)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    out, none = torch.ops.pcops.segment_reduce(values, offsets, reduce, False, False)
    assert none.shape == (0, 7)
    assert torch.equal(out.view(bits), expected.view(bits))
    leaf = values.clone().requires_grad_()
    assert torch.equal(pcops.segment_reduce(leaf, offsets, reduce=reduce).detach().view(bits), expected.view(bits))
    assert torch.equal(pcops.segment_reduce(values, offsets, reduce=reduce).view(bits), expected.view(bits))
    if reduce in ("max", "min"):
        kernel, arg = segment_module._warp_forward(values, offsets, reduce)
        assert torch.equal(kernel.view(bits), expected.view(bits)) and arg.shape == (60, 7)
    # CUDA's layout (a thread per (segment, column)), run here on the CPU
    forward, _ = segment_module._kernels(dtype, reduce, True, True)
    out, arg = torch.empty(60, 7, dtype=dtype), torch.empty(60, 7, dtype=torch.int64)
    _warp.launch(forward, 60 * 7, [values, offsets, out, arg], like=values)
    assert torch.equal(out.view(bits), expected.view(bits))
    if reduce in ("max", "min"):
        assert torch.equal(arg, segment_module._warp_forward(values, offsets, reduce)[1])


def test_extremum_without_arg_has_no_gradient(gen):
    values = torch.randn(10, 2, generator=gen, requires_grad=True)
    out, arg = torch.ops.pcops.segment_reduce(values, torch.tensor([0, 4, 10]), "max", False, False)
    assert arg.shape == (0, 2)
    with pytest.raises(RuntimeError, match="with_arg=False"):
        out.sum().backward()


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_gradient_with_no_rows(reduce):
    values = torch.zeros(0, 2, requires_grad=True)
    out = pcops.segment_reduce(values, torch.tensor([0, 0, 0]), reduce=reduce)
    out.sum().backward()
    assert out.shape == (2, 2) and values.grad.shape == (0, 2)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_gradients_of_gradients(reduce):
    gen = torch.Generator().manual_seed(3)
    values = torch.rand(20, 3, generator=gen, dtype=torch.float64).requires_grad_()
    offsets = torch.tensor([0, 4, 4, 11, 20])
    assert torch.autograd.gradgradcheck(lambda v: pcops.segment_reduce(v, offsets, reduce=reduce), (values,))


def test_validate_false_skips_the_value_checks_and_never_reads_out_of_bounds():
    values = torch.arange(10.0).reshape(5, 2)
    bad = torch.tensor([0, 3, 1, 99])  # decreasing, past N
    with pytest.raises(ValueError, match="offsets"):
        pcops.segment_reduce(values, bad)
    for reduce in REDUCTIONS:
        out = pcops.segment_reduce(values, bad, reduce=reduce, validate=False)
        assert out.shape == (3, 2) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="ids"):
        pcops.segment_reduce(values, ids=torch.tensor([0, 1, 5, 1, 0]), num_segments=2)
    out = pcops.segment_reduce(values, ids=torch.tensor([0, 1, 5, 1, 0]), num_segments=2, validate=False)
    assert torch.equal(out, pcops.segment_reduce(values[[0, 1, 3, 4]], ids=torch.tensor([0, 1, 1, 0]), num_segments=2))
