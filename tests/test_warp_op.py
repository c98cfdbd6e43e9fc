"""pcops.warp_op: a user's Warp kernel as a compile-safe custom op, checked against float64 torch references."""

import contextlib
import re

import pytest
import torch
import warp as wp

import pcops
from pcops import warp_op

# ---------------------------------------------------------------------------------------------
# Kernels as a user writes them, and the ops made of them (registered once, at import)
# ---------------------------------------------------------------------------------------------


@wp.kernel
def _field(points: wp.array(dtype=wp.vec3d), amp: wp.array(dtype=wp.float64), value: wp.array(dtype=wp.float64)):
    i = wp.tid()
    value[i] = amp[0] * wp.sin(wp.length(points[i]))


@wp.kernel
def _field_backward(
    points: wp.array(dtype=wp.vec3d),
    amp: wp.array(dtype=wp.float64),
    value: wp.array(dtype=wp.float64),
    grad_value: wp.array(dtype=wp.float64),
    grad_points: wp.array(dtype=wp.vec3d),
    grad_amp: wp.array(dtype=wp.float64),
):
    i = wp.tid()
    r = wp.length(points[i])
    g = grad_value[i]
    wp.atomic_add(grad_amp, 0, g * wp.sin(r))
    if r > wp.float64(0.0):
        grad_points[i] = (g * amp[0] * wp.cos(r) / r) * points[i]


@wp.kernel
def _radial(
    start: int,
    points: wp.array(dtype=wp.vec3d),
    center: wp.array(dtype=wp.vec3d),
    scale: wp.float64,
    dist: wp.array(dtype=wp.float64),
    unit: wp.array(dtype=wp.vec3d),
    inside: wp.array(dtype=wp.int32),
):
    i = wp.tid() + start
    d = points[i] - center[0]
    r = wp.length(d)
    dist[i] = scale * r
    unit[i] = d / r
    if r < wp.float64(1.0):
        inside[i] = 1


@wp.kernel
def _moment(start: int, points: wp.array(dtype=wp.vec3d), weights: wp.array(dtype=wp.float64), total: wp.array(dtype=wp.vec3d)):
    i = wp.tid() + start
    wp.atomic_add(total, 0, weights[i] * points[i])


@wp.kernel(enable_backward=False)
def _no_adjoint(points: wp.array(dtype=wp.vec3d), value: wp.array(dtype=wp.float64)):
    value[wp.tid()] = wp.length(points[wp.tid()])


@wp.kernel
def _pair_sum(start: int, x: wp.array(dtype=wp.float64), y: wp.array(dtype=wp.float64), out: wp.array(dtype=wp.float64)):
    i = wp.tid() + start
    out[i] = x[i] + y[i]


@wp.kernel
def _scale_half(start: int, x: wp.array(dtype=wp.float16), a: wp.float16, out: wp.array(dtype=wp.float16)):
    i = wp.tid() + start
    out[i] = a * x[i]


@wp.kernel
def _scale_half_ties(start: int, x: wp.array(dtype=wp.float16), a: wp.float16, out: wp.array(dtype=wp.float16)):
    i = wp.tid() + start
    out[i] = a * x[i]


def _rows(points, *_):
    return points.shape[0]


field = warp_op("pcops_test::field", _field, outputs={"value": lambda points, amp: (points.shape[0],)}, dim=_rows)
field_by_hand = warp_op(
    "pcops_test::field_by_hand", _field, outputs={"value": lambda points, amp: (points.shape[0],)}, dim=_rows,
    backward=_field_backward,
)
# min_chunk=16: launches of a few hundred points already split over the CPU threads
radial = warp_op(
    "pcops_test::radial", _radial,
    outputs={"dist": lambda p, c, s: (p.shape[0],), "unit": lambda p, c, s: (p.shape[0], 3), "inside": lambda p, c, s: (p.shape[0],)},
    dim=_rows, min_chunk=16,
)
pair_sum = warp_op("pcops_test::pair_sum", _pair_sum, outputs={"out": lambda x, y: (x.shape[0],)}, dim=_rows, per_thread=["x", "y", "out"])
pair_sum_short_out = warp_op("pcops_test::pair_sum_short_out", _pair_sum, outputs={"out": (2,)}, dim=_rows, per_thread=("out",))
scale_half = warp_op("pcops_test::scale_half", _scale_half, outputs={"out": lambda x, a: (x.shape[0],)}, dim=_rows, min_chunk=2)
scale_half_ties = warp_op("pcops_test::scale_half_ties", _scale_half_ties, outputs={"out": lambda x, a: (x.shape[0],)}, dim=_rows)  # (only its test calls it)
moment = warp_op("pcops_test::moment", _moment, outputs={"total": (1, 3)}, dim=_rows, accumulate=["total"], min_chunk=16)


def field_reference(points, amp):
    return amp[0] * torch.sin(torch.linalg.vector_norm(points, dim=-1))


def radial_reference(points, center, scale):
    d = points - center[0]
    r = torch.linalg.vector_norm(d, dim=-1)
    return scale * r, d / r[:, None], (r < 1).to(torch.int32)


def moment_reference(points, weights):
    return (weights[:, None] * points).sum(0, keepdim=True)


def _points(gen, n=300):
    return torch.randn(n, 3, generator=gen, dtype=torch.float64)


def _center():
    return torch.tensor([[0.1, -0.2, 0.3]], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Forward values
# ---------------------------------------------------------------------------------------------


def test_field_matches_the_float64_reference(gen):
    points, amp = _points(gen), torch.tensor([1.7], dtype=torch.float64)
    torch.testing.assert_close(field(points, amp), field_reference(points, amp), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(field(points=points, amp=amp), field_reference(points, amp), rtol=1e-12, atol=1e-12)


def test_split_kernel_with_three_outputs_matches_the_reference_on_every_chunk(gen):
    points = _points(gen, 2000)
    dist, unit, inside = radial(points, _center(), 2.5)
    ref = radial_reference(points, _center(), 2.5)
    torch.testing.assert_close(dist, ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(unit, ref[1], rtol=1e-12, atol=1e-12)
    assert inside.dtype == torch.int32 and torch.equal(inside, ref[2])


def test_accumulated_output_sums_every_chunks_private_copy(gen):
    points, weights = _points(gen, 2000), torch.rand(2000, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(moment(points, weights), moment_reference(points, weights), rtol=1e-10, atol=1e-10)


def test_empty_inputs_give_empty_outputs_and_gradients():
    points = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
    amp = torch.ones(1, dtype=torch.float64, requires_grad=True)
    value = field(points, amp)
    assert value.shape == (0,)
    value.sum().backward()
    assert points.grad.shape == (0, 3) and amp.grad.item() == 0


def test_non_contiguous_inputs_are_accepted(gen):
    points = _points(gen, 600)[::2]
    amp = torch.tensor([0.5], dtype=torch.float64)
    torch.testing.assert_close(field(points, amp), field_reference(points, amp), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


def _gradcheck(fn, inputs, names):
    for name in names:  # one differentiable input at a time, the others held constant
        args = [t.detach().clone().requires_grad_(k == name) if isinstance(t, torch.Tensor) else t for k, t in inputs.items()]
        assert torch.autograd.gradcheck(lambda *a: fn(*a), args), name


@pytest.mark.parametrize("op", [field, field_by_hand], ids=["warp_adjoint", "user_backward"])
def test_field_gradcheck(op, gen):
    _gradcheck(op, {"points": _points(gen, 20), "amp": torch.tensor([1.3], dtype=torch.float64)}, ["points", "amp"])


def test_split_kernel_gradcheck_through_both_float_outputs(gen):
    def fn(points, center, scale):
        dist, unit, _ = radial(points, center, scale)
        return dist, unit

    _gradcheck(fn, {"points": _points(gen, 40), "center": _center(), "scale": 1.5}, ["points", "center"])


def test_accumulated_output_gradcheck(gen):
    _gradcheck(moment, {"points": _points(gen, 40), "weights": torch.rand(40, generator=gen, dtype=torch.float64)}, ["points", "weights"])


def test_split_adjoint_sums_the_gradient_of_an_input_every_thread_reads(gen):
    points = _points(gen, 3000).requires_grad_(True)  # 3000 threads, min_chunk 16: one chunk per CPU thread
    center = _center().requires_grad_(True)
    dist, unit, _ = radial(points, center, 2.0)
    g_dist, g_unit = torch.randn(dist.shape, generator=gen, dtype=torch.float64), torch.randn(unit.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((dist * g_dist).sum() + (unit * g_unit).sum(), (points, center))
    p, c = points.detach().requires_grad_(True), center.detach().requires_grad_(True)
    ref_dist, ref_unit, _ = radial_reference(p, c, 2.0)
    ref = torch.autograd.grad((ref_dist * g_dist).sum() + (ref_unit * g_unit).sum(), (p, c))
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_integer_outputs_are_not_differentiable(gen):
    _, _, inside = radial(_points(gen, 10).requires_grad_(True), _center(), 1.0)
    assert not inside.requires_grad


def test_backward_twice_with_retain_graph_gives_identical_gradients(gen):
    points = _points(gen, 200).requires_grad_(True)
    amp = torch.tensor([0.8], dtype=torch.float64, requires_grad=True)
    loss = (field(points, amp) ** 2).sum()
    first = torch.autograd.grad(loss, (points, amp), retain_graph=True)
    second = torch.autograd.grad(loss, (points, amp))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_grad_names_the_inputs_that_get_gradients(gen):
    only_points = warp_op("pcops_test::field_points_only", _field, outputs={"value": lambda p, a: (p.shape[0],)}, dim=_rows, grad=["points"])
    points = _points(gen, 10).requires_grad_(True)
    amp = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    value = only_points(points, amp)
    grads = torch.autograd.grad(value.sum(), (points, amp), allow_unused=True)
    assert grads[0] is not None and grads[1] is None


def test_a_kernel_without_adjoint_makes_an_op_without_gradients(gen):
    lengths = warp_op("pcops_test::lengths", _no_adjoint, outputs={"value": lambda p: (p.shape[0],)}, dim=_rows, grad=())
    out = lengths(_points(gen, 10).requires_grad_(True))
    assert not out.requires_grad
    assert not hasattr(torch.ops.pcops_test, "lengths_backward")


# ---------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ---------------------------------------------------------------------------------------------


def _opcheck_cases(gen):
    points = _points(gen, 50)
    amp = torch.tensor([1.1], dtype=torch.float64)
    value = field(points, amp)
    dist, unit, inside = radial(points, _center(), 2.0)
    weights = torch.rand(50, generator=gen, dtype=torch.float64)
    total = moment(points, weights)
    ones = torch.ones_like
    return [
        (torch.ops.pcops_test.field.default, (points, amp)),
        (torch.ops.pcops_test.field_backward.default, (points, amp, value, ones(value))),
        (torch.ops.pcops_test.field_by_hand_backward.default, (points, amp, value, ones(value))),
        (torch.ops.pcops_test.radial.default, (points, _center(), 2.0)),
        (torch.ops.pcops_test.radial_backward.default, (points, _center(), 2.0, dist, unit, inside, ones(dist), ones(unit))),
        (torch.ops.pcops_test.moment.default, (points, weights)),
        (torch.ops.pcops_test.moment_backward.default, (points, weights, total, ones(total))),
        (torch.ops.pcops_test.pair_sum.default, (weights, weights.flip(0))),
        (torch.ops.pcops_test.scale_half.default, (weights.half(), 0.5)),
    ]


def test_opcheck_every_generated_op(gen):
    for op, args in _opcheck_cases(gen):
        if not op.name().endswith("_backward"):  # float inputs that require grad: the autograd registration is checked too
            args = [a.clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(op, args)


def _model(points, amp, center):
    dist, unit, _ = radial(points, center, 2.0)
    return field(points, amp) * dist + unit[:, 0]


@pytest.mark.parametrize("options", [{}, {"dynamic": True}, {"fullgraph": True}], ids=["default", "dynamic", "fullgraph"])
def test_compiles_without_graph_breaks_and_matches_eager(options, gen):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    points, amp, center = _points(gen, 100), torch.tensor([0.7], dtype=torch.float64), _center()
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_model, backend=backend, **options)
    results = []
    for fn in (_model, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (points, amp, center)]
        out = fn(*leaves)
        out.square().sum().backward()
        results.append((out.detach(), *(t.grad for t in leaves)))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert backend.frame_count == 1
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert "pcops_test.field" in backend.graphs[0].code and "pcops_test.radial" in backend.graphs[0].code


# ---------------------------------------------------------------------------------------------
# Declarations and calls that do not fit the kernel
# ---------------------------------------------------------------------------------------------

_OUT = {"value": lambda p, a: (p.shape[0],)}

BAD_DECLARATIONS = [
    (dict(name="field", kernel=_field, outputs=_OUT, dim=_rows), ValueError, "name"),
    (dict(name="pcops_test::bad-name", kernel=_field, outputs=_OUT, dim=_rows), ValueError, "name"),
    (dict(name="pcops_test::bad", kernel=lambda x: x, outputs=_OUT, dim=_rows), TypeError, "kernel"),
    (dict(name="pcops_test::bad", kernel=_field, outputs={"out": _OUT["value"]}, dim=_rows), ValueError, "outputs"),
    (dict(name="pcops_test::bad", kernel=_field, outputs={}, dim=_rows), TypeError, "outputs"),
    (dict(name="pcops_test::bad", kernel=_field, outputs={"value": "N"}, dim=_rows), TypeError, r"outputs\['value'\]"),
    (dict(name="pcops_test::bad", kernel=_field, outputs=_OUT, dim=100), TypeError, "dim"),
    (dict(name="pcops_test::bad", kernel=_field, outputs=_OUT, dim=_rows, grad=["weights"]), ValueError, "grad"),
    (dict(name="pcops_test::bad", kernel=_field, outputs=_OUT, dim=_rows, grad="amp"), TypeError, "grad"),
    (dict(name="pcops_test::bad", kernel=_moment, outputs={"total": (1, 3)}, dim=_rows, accumulate=["sum"]), ValueError, "accumulate"),
    (dict(name="pcops_test::bad", kernel=_field, outputs=_OUT, dim=_rows, backward=_moment), ValueError, "backward"),
    (dict(name="pcops_test::bad", kernel=_no_adjoint, outputs={"value": _OUT["value"]}, dim=_rows), ValueError, "enable_backward"),
    (dict(name="pcops_test::bad", kernel=_field, outputs=_OUT, dim=_rows, min_chunk=0), ValueError, "min_chunk"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_DECLARATIONS, ids=[f"{e.__name__}-{m}" for _, e, m in BAD_DECLARATIONS])
def test_a_bad_declaration_raises_naming_the_argument(kwargs, error, match):
    kwargs = dict(kwargs)
    with pytest.raises(error, match=match):
        warp_op(kwargs.pop("name"), kwargs.pop("kernel"), **kwargs)


def test_a_tensor_of_the_wrong_dtype_raises_naming_the_input(gen):
    with pytest.raises(TypeError, match="amp must be a torch.float64 tensor"):
        field(_points(gen, 5), torch.ones(1, dtype=torch.float32))


def test_a_tensor_of_the_wrong_shape_raises_naming_the_input(gen):
    with pytest.raises(ValueError, match=r"points must be a torch.float64 tensor of rank 2 \(\.\.\., 3\)"):
        field(_points(gen, 5)[:, :2], torch.ones(1, dtype=torch.float64))


def test_a_declared_shape_that_does_not_fit_the_kernel_raises_naming_the_output(gen):
    wrong = warp_op("pcops_test::field_wrong_shape", _field, outputs={"value": lambda p, a: (p.shape[0], 1)}, dim=_rows)
    with pytest.raises(ValueError, match=r"outputs\['value'\] declared shape \(5, 1\)"):
        wrong(_points(gen, 5), torch.ones(1, dtype=torch.float64))


def test_launch_dimensions_a_split_kernel_cannot_take_raise_naming_dim(gen):
    two_d = warp_op("pcops_test::moment_2d", _moment, outputs={"total": (1, 3)}, dim=lambda p, w: (p.shape[0], 1), accumulate=["total"])
    with pytest.raises(ValueError, match=r"dim returned \(5, 1\); a kernel with a 'start' parameter takes one dimension"):
        two_d(_points(gen, 5), torch.ones(5, dtype=torch.float64))


def test_warp_op_is_exported():
    assert pcops.warp_op is warp_op and "warp_op" in pcops.__all__


# ---------------------------------------------------------------------------------------------
# CUDA: one launch on torch's current stream, the same values and gradients as on the CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_on_a_side_stream_matches_cpu_values_and_gradients(gen):
    points, amp, center = _points(gen, 5000), torch.tensor([0.9], dtype=torch.float64), _center()
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_(True) for t in (points, amp, center)]
        side = None
        if device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            out = _model(*leaves)
            total = moment(leaves[0], leaves[1].expand(5000).contiguous())
            (out.square().sum() + total.sum()).backward()
            results.append([t.detach().cpu() for t in (out, total, *(leaf.grad for leaf in leaves))])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_name_registered_twice_raises_and_the_first_op_is_kept():
    with pytest.raises(ValueError, match="pcops_test::field.*already registered"):
        warp_op("pcops_test::field", _no_adjoint, outputs={"value": lambda p: (p.shape[0],)}, dim=_rows, grad=())
    points = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    amp = torch.tensor([2.0], dtype=torch.float64)
    value = field(points, amp)  # still the first kernel, with its gradients
    value.sum().backward()
    r = points.detach().norm(dim=1, keepdim=True)
    assert torch.allclose(value, 2.0 * r[:, 0].sin())
    assert torch.allclose(points.grad, 2.0 * r.cos() * points.detach() / r)


@wp.kernel
def _shift(points: wp.array(dtype=wp.float64), n: int, small: wp.int8, out: wp.array(dtype=wp.float64)):
    out[wp.tid()] = points[wp.tid()] + wp.float64(n) + wp.float64(small)


shift = warp_op("pcops_test::shift", _shift, outputs={"out": lambda p, n, s: p.shape}, dim=lambda p, n, s: p.shape[0], grad=())


@pytest.mark.parametrize("n, small, bad", [(2**31, 0, "n"), (-(2**31) - 1, 0, "n"), (0, 128, "small"), (0, -129, "small")])
def test_int_scalars_outside_their_declared_type_raise_naming_them(n, small, bad):
    with pytest.raises(ValueError, match=rf"{bad} = .* does not fit"):
        shift(torch.zeros(2, dtype=torch.float64), n, small)


def test_int_scalars_at_the_ends_of_their_type_pass_exactly():
    out = shift(torch.zeros(2, dtype=torch.float64), 2**31 - 1, -128)
    assert out.tolist() == [2**31 - 1 - 128] * 2


def test_calls_are_checked_against_the_schema(gen):
    """A generated op's call goes through its schema, as any op's through torch.ops: an extra
    argument raises, as the dispatcher's does."""
    points, amp = _points(gen), torch.tensor([2.0], dtype=torch.float64)
    with pytest.raises(Exception, match="argument"):
        field(points, amp, 99)
    assert torch.equal(field(points, amp), torch.ops.pcops_test.field(points, amp))


def test_per_thread_arrays_shorter_than_dim_raise_naming_them(gen):
    """An array each thread indexes by its id (``per_thread``) with fewer rows than the launch
    has threads would be read or written past its end: a ValueError naming it, eager and
    compiled, before anything runs; arrays with enough rows pass, and the op sums them."""
    x, y = torch.rand(8, generator=gen, dtype=torch.float64), torch.rand(8, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(pair_sum(x, y), x + y, rtol=0, atol=0)
    torch.testing.assert_close(pair_sum(x[:5], y), x[:5] + y[:5], rtol=0, atol=0)  # (y longer: fine)
    with pytest.raises(ValueError, match=r"pcops_test::pair_sum: y has 2 rows, fewer than the 8 threads"):
        pair_sum(x, y[:2])
    # compiled: the fake's check, at trace time (torch wraps it, with the message)
    with pytest.raises((ValueError, torch._dynamo.exc.TorchRuntimeError), match=r"pcops_test::pair_sum: y has 2 rows, fewer than the 8 threads"):
        torch.compile(pair_sum, fullgraph=True, backend="eager")(x, y[:2])
    with pytest.raises(ValueError, match=r"outputs\['out'\] has 2 rows, fewer than the 8 threads"):
        pair_sum_short_out(x, y)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(per_thread="x"), TypeError, "per_thread must be a sequence"),
    (dict(per_thread=["z"]), ValueError, r"per_thread names \['z'\]"),
])
def test_a_bad_per_thread_declaration_raises_naming_it(kwargs, error, match):
    with pytest.raises(error, match=match):
        warp_op("pcops_test::bad_rows", _pair_sum, outputs={"out": lambda x, y: (x.shape[0],)}, dim=_rows, **kwargs)


def test_float16_scalars_reach_split_kernels(gen):
    """A float16 scalar parameter of a split kernel: Warp's packed launch takes its half bits
    (a Python float there was a TypeError), the same values as the kernel without chunks."""
    x = torch.rand(40, generator=gen).half()
    for a in (2.0, 0.1, -3.5):
        for _ in range(2):  # (the first launch loads the kernel; the next ones run its entry point)
            torch.testing.assert_close(scale_half(x, a), (torch.tensor(a).half() * x), rtol=0, atol=0)
    # 2049 lies halfway between the float16s 2048 and 2050: the packed launches round it as the
    # first call's wp.launch does (Warp's conversion, ties away from zero; NumPy's gave 2048)
    calls = [scale_half_ties(torch.ones(4).half(), 2049.0) for _ in range(3)]
    assert [float(c[0]) for c in calls] == [2050.0] * 3


def test_float_scalars_beyond_their_declared_type_raise_naming_them(gen):
    """A float32 or float16 scalar parameter given a finite number its type cannot hold became
    inf in the kernel: a ValueError naming it (inf and NaN given as such pass as given)."""
    x = torch.rand(8, generator=gen).half()
    for a in (7e4, -1e5, 1e39):
        with pytest.raises(ValueError, match=rf"pcops_test::scale_half: a = {re.escape(str(a))} does not fit the kernel's float16"):
            scale_half(x, a)
    assert torch.equal(scale_half(x, 6e4), torch.tensor(6e4).half() * x)
    assert torch.isinf(scale_half(torch.ones(2).half(), float("inf"))).all()
    assert torch.isnan(scale_half(torch.ones(2).half(), float("nan"))).all()


def test_shapes_and_dims_that_are_not_counts_raise_naming_them(gen):
    negative = warp_op("pcops_test::negative_shape", _pair_sum, outputs={"out": lambda x, y: (x.shape[0] - 9,)}, dim=_rows)
    truth = warp_op("pcops_test::bool_dim", _pair_sum, outputs={"out": lambda x, y: (x.shape[0],)}, dim=lambda x, y: True)
    x = torch.rand(8, generator=gen, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"outputs\['out'\] declared shape \(-1,\); a shape holds ints >= 0"):
        negative(x, x)
    with pytest.raises(ValueError, match="dim returned True"):
        truth(x, x)


@pytest.mark.parametrize("op", ["pair_sum", "field"])
def test_dynamic_sizes_stay_dynamic(op, gen):
    """Compiled with dynamic=True, an op (with per_thread checks or without) is one frame for every
    size: the fake's checks read dim's sizes as they are (an operator.index there fixed each size,
    one recompile per size)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("eager")
    fn = (lambda x: pair_sum(x, x)) if op == "pair_sum" else (lambda x: field(x, torch.ones(1, dtype=torch.float64)))
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for n in (10, 20, 30, 40):
        x = torch.rand(n, 3, generator=gen, dtype=torch.float64)
        x = x[:, 0].contiguous() if op == "pair_sum" else x
        torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0)
    assert backend.frame_count == 1
