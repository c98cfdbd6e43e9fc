"""Every public op under torch.compile as users write it (default options, no ``fullgraph``),
driven by the op table: ops whose result sizes follow from their inputs' shapes compile with no
graph break, forward and backward, and equal eager; ops whose result size depends on the data
break only at their own data-dependent call, and their static-size forms do not break. The
explicit backward ops keep no hidden state: ``retain_graph`` twice gives the same gradients, and
gradients of gradients either work (checked by gradcheck of the first gradient) or raise an
error that names the op.

Dynamo decides where a graph breaks, whatever the backend: the sweeps use ``aot_eager`` (fake
tensors, AOTAutograd's joint forward and backward, no code generation: seconds, not minutes);
tests/test_models.py and the compile checks of each op run Inductor.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.op_table import OPS, Op

GRAD_OPS = [op for op in OPS if op.grad]


def _tensors(out) -> list[torch.Tensor]:
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in out if isinstance(t, torch.Tensor)]


def _loss(out) -> torch.Tensor | None:
    floats = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
    return sum((torch.where(torch.isfinite(t), t, 0) * (1 + t.detach().abs())).sum() for t in floats) if floats else None


def _inputs(op: Op) -> tuple[dict, list[torch.Tensor]]:
    i = op.inputs()
    leaves = []
    for name in op.grad:
        i[name] = i[name].clone().requires_grad_()
        leaves.append(i[name])
    return i, leaves


def _run(call, i, leaves):
    out = call(i)
    loss = _loss(out)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss is not None and leaves else ()
    return _tensors(out), grads


def _compiled_like_eager(call, op: Op, **options) -> dict:
    """Runs ``call`` eagerly and compiled with ``options``; asserts equal outputs and gradients;
    returns dynamo's graph breaks {reason: count}."""
    torch._dynamo.reset()
    counters.clear()
    i, leaves = _inputs(op)
    eager = _run(call, i, leaves)
    compiled = _run(torch.compile(lambda x: call(x), backend="aot_eager", **options), i, leaves)
    for a, b in zip(compiled[0] + list(compiled[1]), eager[0] + list(eager[1])):
        if a is None or b is None:
            assert a is None and b is None
        elif a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(a, b)
    assert len(compiled[0]) == len(eager[0])
    return dict(counters["graph_break"])


@pytest.mark.parametrize("options", [{}, {"dynamic": True}], ids=["default", "dynamic"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_default_compile_breaks_only_at_the_ops_own_data_dependent_call(op, options):
    breaks = _compiled_like_eager(op.call, op, **options)
    if not op.breaks_at:
        assert not breaks, f"{op.name}: graph breaks under torch.compile({options}): {breaks}"
    else:
        assert breaks, f"{op.name} declares a data-dependent size at {op.breaks_at} but compiled without a break"
        assert all(op.breaks_at + ".default" in reason for reason in breaks), breaks


@pytest.mark.parametrize("op", [op for op in OPS if op.breaks_at], ids=lambda op: op.name)
def test_data_dependent_ops_compile_whole_when_dynamo_captures_dynamic_sizes(op):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert not _compiled_like_eager(op.call, op)


@pytest.mark.parametrize("op", [op for op in OPS if op.static], ids=lambda op: op.name)
def test_static_size_forms_compile_without_a_break(op):
    assert not _compiled_like_eager(op.static, op)
    assert not _compiled_like_eager(op.static, op, dynamic=True)


@pytest.mark.parametrize("op", GRAD_OPS, ids=lambda op: op.name)
def test_compiled_backward_twice_with_retain_graph_gives_the_same_gradients(op):
    torch._dynamo.reset()
    i, leaves = _inputs(op)
    loss = _loss(torch.compile(lambda x: op.call(x), backend="aot_eager")(i))
    first = torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(loss, leaves, allow_unused=True)
    for a, b in zip(first, second):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("op", GRAD_OPS, ids=lambda op: op.name)
def test_gradients_of_gradients_work_or_name_the_op(op):
    """The first gradient with respect to the first differentiable input, taken with
    create_graph=True, is differentiable again (float64 gradcheck), or asking for it raises an
    error naming a pcops op."""
    i, _ = _inputs(op)
    names = op.grad
    wrt = names[0]

    def first_gradient(*values):
        x = dict(i, **dict(zip(names, values)))
        floats = [t for t in _tensors(op.call(x)) if t.is_floating_point() and t.requires_grad]
        out = sum(t.sin().sum() for t in floats)  # not linear: its second derivatives are not zero
        return torch.autograd.grad(out, x[wrt], create_graph=True)[0]

    values = [i[n].detach().clone().requires_grad_() for n in names]
    try:
        first_gradient(*values).sum().backward()
    except RuntimeError as err:  # not supported: the error names the op (and says so)
        assert ("pcops::" in str(err) or "pcops." in str(err)) and "gradient" in str(err).lower(), err
        return
    assert torch.autograd.gradcheck(first_gradient, values, atol=1e-6, rtol=1e-4, fast_mode=True)


def _model_breaks(model, args, backend="aot_eager", **options) -> dict:
    """Compiles ``model`` as users write it; asserts compiled == eager in output and parameter
    gradients; returns dynamo's graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for m in (model, torch.compile(model, backend=backend, **options)):
        out = m(*args)
        results.append((out.detach(), torch.autograd.grad(out.square().sum(), params)))
    (eager, g_eager), (comp, g_comp) = results
    torch.testing.assert_close(comp, eager, rtol=1e-4, atol=1e-5)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return dict(counters["graph_break"])


def _models():
    from models import nets
    from models.dgcnn import DGCNN
    from models.pointnet2 import PointNet2

    gen = torch.Generator().manual_seed(0)
    cloud = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    points, queries = cloud(2, 300, 3), cloud(2, 100, 3)
    normals = torch.nn.functional.normalize(cloud(2, 300, 3) - 0.5, dim=-1)
    small = [(32, 0.3, 16, [16, 16]), (8, 0.5, 8, [16, 32])]
    return {
        "radius_projector": (nets.radius_projector(radius=0.2), (points, queries)),
        "knn_projector": (nets.knn_projector(), (points, queries)),
        "sdf": (nets.SDFNet(hidden=8, scales=((4, 0.05), (8, 0.1))), (points, normals, queries)),
        "pointnet2": (PointNet2(3, levels=small, global_widths=(16, 16), hidden=16).eval(), (points,)),
        "dgcnn": (DGCNN(3, k=8, widths=[16, 16], embed=16, hidden=16).eval(), (points,)),
    }


@pytest.mark.parametrize("name", ["radius_projector", "knn_projector", "sdf", "pointnet2", "dgcnn"])
def test_models_compile_without_a_break_as_users_write_it(name):
    model, args = _models()[name]
    assert not _model_breaks(model, args), name
    assert not _model_breaks(model, args, dynamic=True), name


def test_the_tutorial_radius_projector_compiles_whole_with_inductor():
    model, args = _models()["radius_projector"]
    assert not _model_breaks(model, args, backend="inductor")
