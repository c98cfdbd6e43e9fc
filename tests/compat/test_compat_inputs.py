"""Every public drop-in function (torch_cluster, pytorch3d, torch_scatter) reports bad values in
its own argument names and suggests no argument it does not take.

Functions that search or sample points raise a ValueError naming the argument holding a NaN or
an inf; functions that only move or reduce values (torch_scatter, knn_gather, masked_gather)
pass NaN through as data, as the originals do."""

import inspect
import math
import re

import pytest
import torch

import pcops
from pcops.compat import pytorch3d as p3
from pcops.compat import torch_cluster as tc
from pcops.compat import torch_scatter as ts

MODULES = (tc, p3, ts)
NOT_PROVIDED = {"graclus_cluster", "random_walk", "neighbor_sampler"}  # stubs: test_torch_cluster_script.py


def _public(module):
    return [getattr(module, n) for n in module.__all__ if inspect.isfunction(getattr(module, n))]


def _params(fn) -> set:
    return set(inspect.signature(fn).parameters)


def _vocabulary() -> set:
    """Every argument name of the drop-ins and of pcops' own functions (``query``, ``ref``,
    ``points``, ``validate``, ...): a message may name one only if its function takes it."""
    words = set()
    for module in MODULES:
        for fn in _public(module):
            words |= _params(fn)
    for name in pcops.__all__:
        obj = getattr(pcops, name)
        if inspect.isfunction(obj):
            words |= _params(obj)
    return words


VOCABULARY = _vocabulary()


def _foreign(message: str, fn) -> set:
    """Argument names in ``message`` that ``fn`` does not take."""
    said = set(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", message))
    return (said & VOCABULARY) - _params(fn)


def _pts(gen, *shape):
    return torch.rand(*shape, generator=gen, dtype=torch.float32)


def _cases(gen):
    """fn -> keyword arguments of a valid call (small clouds)."""
    x, y = _pts(gen, 20, 3), _pts(gen, 6, 3)
    p1, p2 = _pts(gen, 2, 12, 3), _pts(gen, 2, 9, 3)
    return {
        tc.knn: dict(x=x, y=y, k=3),
        tc.knn_graph: dict(x=x, k=3),
        tc.radius: dict(x=x, y=y, r=0.4),
        tc.radius_graph: dict(x=x, r=0.4),
        tc.nearest: dict(x=x, y=y),
        tc.fps: dict(src=x, ratio=0.5),
        tc.grid_cluster: dict(pos=x, size=torch.tensor([0.2, 0.2, 0.2]), start=torch.zeros(3), end=torch.ones(3)),
        p3.knn_points: dict(p1=p1, p2=p2, K=2),
        p3.ball_query: dict(p1=p1, p2=p2, K=4, radius=0.4),
        p3.sample_farthest_points: dict(points=p1, K=4),
        p3.chamfer_distance: dict(x=p1, y=p2, x_normals=_pts(gen, 2, 12, 3), y_normals=_pts(gen, 2, 9, 3), weights=torch.ones(2)),
        p3.estimate_pointcloud_normals: dict(pointclouds=p1, neighborhood_size=4),
    }


CHECKED = [
    tc.knn, tc.knn_graph, tc.radius, tc.radius_graph, tc.nearest, tc.fps, tc.grid_cluster,
    p3.knn_points, p3.ball_query, p3.sample_farthest_points, p3.chamfer_distance, p3.estimate_pointcloud_normals,
]
PASS_THROUGH = [p3.knn_gather, p3.masked_gather] + _public(ts)


def test_every_public_function_is_swept():
    swept = {fn.__name__ for fn in CHECKED + PASS_THROUGH} | NOT_PROVIDED
    public = {fn.__name__ for module in MODULES for fn in _public(module)}
    assert public == swept


def _float_args(fn, gen):
    kwargs = _cases(gen)[fn]
    return [k for k, v in kwargs.items() if isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point())]


def _spoiled(value, bad: float):
    if isinstance(value, float):
        return bad
    value = value.clone()
    value.view(-1)[value.numel() // 2] = bad
    return value


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("fn", CHECKED, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_a_nan_or_inf_is_reported_in_the_callers_name(fn, bad):
    gen = torch.Generator().manual_seed(0)
    names = _float_args(fn, gen)
    assert names
    for name in names:
        kwargs = _cases(torch.Generator().manual_seed(0))[fn]
        kwargs[name] = _spoiled(kwargs[name], bad)
        with pytest.raises(ValueError) as info:
            fn(**kwargs)
        message = str(info.value)
        assert re.match(rf"{name}\b", message), (name, message)
        assert not _foreign(message, fn), (name, message)


def test_the_valid_calls_of_the_sweep_run(gen):
    for fn, kwargs in _cases(gen).items():
        fn(**kwargs)


@pytest.mark.parametrize("fn", [p3.knn_gather, p3.masked_gather])
def test_gathers_pass_nan_features_through(fn, gen):
    x = _pts(gen, 2, 9, 4)
    x[0, 3, 1] = math.nan
    idx = torch.full((2, 5, 2), 3) if fn is p3.knn_gather else torch.full((2, 5), 3)
    out = fn(x, idx)
    assert out[0].isnan().any() and not out[1].isnan().any()


def _scatter_call(fn, src: torch.Tensor, rows_per_slot: int = 2):
    """Call a torch_scatter function with 3 slots of ``rows_per_slot`` rows of ``src`` (for the
    gathers: ``src`` is one row per slot)."""
    params = _params(fn)
    index = torch.arange(3).repeat_interleave(rows_per_slot)
    indptr = torch.arange(0, 3 * rows_per_slot + 1, rows_per_slot)
    if "indptr" in params:
        return fn(src, indptr)
    if "dim" in params:
        return fn(src, index, dim=0)
    return fn(src, index)


@pytest.mark.parametrize("fn", _public(ts), ids=lambda f: f.__name__)
def test_torch_scatter_treats_nan_as_data(fn, gen):
    """torch_scatter reduces or gathers values: a NaN is data (it reaches its own slot's rows,
    and no other, and never raises)."""
    gathers = fn.__name__.startswith("gather")
    src = _pts(gen, 3 if gathers else 6, 2)
    src[0 if gathers else 1, 0] = math.nan
    out = _scatter_call(fn, src)
    out = out[0] if isinstance(out, tuple) else out
    if gathers or out.shape[0] == src.shape[0]:  # one row per element: rows 0 and 1 are slot 0's
        rows = 2
    else:  # one row per slot
        rows = 1
    assert not out[rows:].isnan().any()
    if fn is not ts.scatter_logsumexp:  # torch_scatter's logsumexp maps a NaN result to 0 (nan_to_num)
        assert out[:rows].isnan().any()


@pytest.mark.parametrize("fn", _public(ts), ids=lambda f: f.__name__)
def test_torch_scatter_errors_name_only_its_arguments(fn, gen):
    params = _params(fn)
    name = "indptr" if "indptr" in params else "index"
    src = _pts(gen, 6, 2)
    bad = torch.tensor([0.0, 2.0, 4.0, 6.0]) if name == "indptr" else torch.zeros(6)
    with pytest.raises(TypeError) as info:
        fn(src, bad, dim=0) if "dim" in params else fn(src, bad)
    message = str(info.value)
    assert message.startswith(name) and not _foreign(message, fn), message


@pytest.mark.parametrize("fn", CHECKED, ids=lambda f: f.__name__)
def test_errors_of_a_wrong_argument_type_name_only_its_arguments(fn, gen):
    kwargs = _cases(gen)[fn]
    first = next(iter(kwargs))
    kwargs[first] = kwargs[first].tolist()
    with pytest.raises(TypeError) as info:
        fn(**kwargs)
    message = str(info.value)
    assert message.startswith(first) and not _foreign(message, fn), message


def _pass_args(fn, gen) -> list:
    """The positional arguments of a valid call of a pass-through function: (values, index or
    pointer) of three slots of two rows (the gathers: one row a slot), or a gather's (x, idx)."""
    if fn in (p3.knn_gather, p3.masked_gather):
        return [_pts(gen, 2, 9, 4), torch.full((2, 5, 2), 3) if fn is p3.knn_gather else torch.full((2, 5), 3)]
    if "indptr" in _params(fn):
        return [_pts(gen, 6, 2), torch.arange(0, 7, 2)]
    return [_pts(gen, 3 if fn.__name__.startswith("gather") else 6, 2), torch.arange(3).repeat_interleave(2)]


@pytest.mark.parametrize("fn", PASS_THROUGH, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_pass_through_functions_name_an_argument_that_is_not_a_tensor(fn, gen):
    """A nested list, a number or None where a drop-in takes a tensor: a TypeError naming it
    (not an AttributeError from inside)."""
    along = dict(dim=0) if "dim" in _params(fn) else {}
    fn(*_pass_args(fn, gen), **along)
    names = list(inspect.signature(fn).parameters)[:2]
    for position, name in enumerate(names):
        for given in ("list", 1.5, None):
            args = _pass_args(fn, gen)
            args[position] = args[position].tolist() if given == "list" else given
            with pytest.raises(TypeError, match=rf"^{name} must be"):
                fn(*args, **along)


@pytest.mark.parametrize("name", ["_knn", "_radius", "_nearest"])
def test_pyg_lib_pointers_of_different_example_counts_are_an_error(name, gen):
    """pyg-lib reads ptr_y at ptr_x's examples: with another count of examples it reads past
    ptr_y's end, or leaves examples unread; the compat operators (their implementations, called
    without registering torch.ops.pyg) raise a ValueError naming both pointers instead."""
    from pcops.compat import pyg_lib

    x, y = _pts(gen, 6, 3), _pts(gen, 4, 3)
    fn = getattr(pyg_lib, name)
    for ptr_x, ptr_y in (([0, 6], [0, 2, 4]), ([0, 3, 6], [0, 4]), ([0, 2, 4, 6], [0, 1, 4])):
        with pytest.raises(ValueError, match="ptr_x and ptr_y"):
            fn(x, y, torch.tensor(ptr_x), torch.tensor(ptr_y))
    same = fn(x, y, torch.tensor([0, 3, 6]), torch.tensor([0, 2, 4]))  # the same count: examples paired
    bx, by = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 0, 1, 1])
    expected = {"_knn": lambda: tc.knn(x, y, 1, bx, by), "_radius": lambda: tc.radius(x, y, 1.0, bx, by, 32),
                "_nearest": lambda: tc.nearest(x, y, bx, by)}[name]()
    assert torch.equal(same, expected)
