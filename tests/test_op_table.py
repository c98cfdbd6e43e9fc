"""The op table (tests/op_table.py) covers every public op, and every op speaks the caller's names.

The per-op checks run on every device of the test base's device axis (tests/op_suite.py:
``cpu``, and ``cuda``, skipped with its reason where torch sees no GPU)."""

import inspect
import pathlib

import numpy as np
import pytest
import torch

import pcops
from tests import op_table
from tests.op_suite import devices, to_device

ROOT = pathlib.Path(__file__).resolve().parents[1]


# public functions that make ops rather than being one (tested in their own files)
NOT_OPS = {"warp_op"}


def test_every_public_function_has_a_row():
    public = {name for name in pcops.__all__ if inspect.isfunction(getattr(pcops, name))} - NOT_OPS
    assert public == set(op_table.BY_NAME), "add the op to tests/op_table.py (and drop rows of ops that are gone)"


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_every_op_has_a_docs_page_that_names_it(op):
    page = ROOT / "docs" / "ops" / f"{op.page}.md"
    assert page.exists(), page
    assert f"{op.name}(" in page.read_text(), f"{page} does not show a call of {op.name}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_the_canonical_call_runs_and_its_differentiable_inputs_get_gradients(op, device):
    inputs = to_device(op.inputs(), device)
    for name in op.grad:
        inputs[name].requires_grad_(True)
    out = op.call(inputs)
    tensors = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if op.grad:
        sum(t.sum() for t in tensors).backward()
        for name in op.grad:
            assert inputs[name].grad is not None and torch.isfinite(inputs[name].grad).all(), name


# the table-driven checks an op may stay out of (with a note in its row saying why): whether the
# row's data make it take part, or None for checks every op takes part in unless its notes say why
CHECKS = {
    "grad": lambda op: bool(op.grad),  # gradients: the compile sweeps, deterministic gradients, this file
    "numbers": lambda op: bool(op.numbers),  # NumPy scalars for its number arguments
    "batch": lambda op: bool(op.batch),  # packed sample ids of any integer range
    "threads": None,  # concurrent calls equal serial calls
}


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_every_op_takes_part_in_each_table_driven_check_or_says_why(op):
    unknown = set(op.notes) - set(CHECKS)
    assert not unknown, f"{op.name}: notes for no check: {unknown} (checks: {sorted(CHECKS)})"
    for check, takes_part in CHECKS.items():
        if takes_part is not None and takes_part(op):
            assert check not in op.notes, f"{op.name} takes part in {check!r}: drop its notes[{check!r}]"
        elif takes_part is not None or check in op.notes:
            assert op.notes.get(check), f"{op.name} does not take part in {check!r}: say why in its row's notes[{check!r}]"


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_a_rows_validate_and_sample_id_keywords_are_the_ops_own(op):
    """``validates`` says whether the function takes ``validate=``; each sample-id keyword is a
    parameter of the function and labels one of the row's inputs."""
    params = inspect.signature(getattr(pcops, op.name)).parameters
    assert op.validates == ("validate" in params), f"{op.name}: validates={op.validates} in its row"
    assert set(op.batch) <= set(params)
    assert set(op.batch.values()) <= set(op.inputs())


CASES = [(op, name) for op in op_table.POINT_OPS for name in op.points]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("op,name", CASES, ids=[f"{op.name}-{name}" for op, name in CASES])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_input_raises_an_error_naming_the_argument_as_typed(op, name, value, device):
    inputs = to_device(op.inputs(), device)
    inputs[name][3, 1] = value
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or inf"):
        op.call(inputs)


HALF = [op for op in op_table.OPS if op.grad or op.points]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("op", HALF, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_in_float32_and_returned_in_their_dtype(op, dtype, device):
    inputs = to_device(op.inputs(), device)
    half = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    single = {k: v.to(dtype).float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    got, want = op.call(half), op.call(single)  # the same values in float32: the float32 computation
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        if isinstance(g, torch.Tensor) and g.is_floating_point():
            assert g.dtype == dtype
            torch.testing.assert_close(g, w.to(dtype), rtol=0, atol=0, equal_nan=True)
        elif isinstance(g, torch.Tensor):
            assert torch.equal(g, w)


@pytest.mark.parametrize("op", [op for op in op_table.OPS if op.validates], ids=lambda op: op.name)
def test_validate_must_be_a_bool(op):
    """``validate=None`` (or 1, "yes", NumPy's True) would pass a truth test, None silently
    turning the checks off: every op that takes ``validate`` raises a TypeError naming it, before
    anything else is read."""
    for bad in (None, 1, "yes", np.True_):
        with pytest.raises(TypeError, match="^validate must be a bool"):
            getattr(pcops, op.name)(validate=bad)


def _flags(op) -> list[str]:
    """The keyword parameters of an op with a bool default, ``validate`` aside (its own test)."""
    params = inspect.signature(getattr(pcops, op.name)).parameters.values()
    return [p.name for p in params if isinstance(p.default, bool) and p.name != "validate"]


FLAGS = [(op, name) for op in op_table.OPS for name in _flags(op)]


@pytest.mark.parametrize(("op", "name"), FLAGS, ids=[f"{op.name}-{name}" for op, name in FLAGS])
def test_every_flag_must_be_a_bool(op, name, monkeypatch):
    """Each bool option (``random_start``, ``signed``, ``potentials``, ...) given None, 1, "yes"
    or NumPy's True raises a TypeError naming it, on the op's canonical call (the flag forced in
    over whatever the call passes), never a truth test that silently picks a branch."""
    f = getattr(pcops, op.name)
    inputs = op.make(torch.Generator().manual_seed(0))
    for bad in (None, 1, "yes", np.True_):
        monkeypatch.setattr(pcops, op.name, lambda *a, **kw: f(*a, **{**kw, name: bad}))
        with pytest.raises(TypeError, match=f"^{name} must be a bool"):
            op.call(inputs)
