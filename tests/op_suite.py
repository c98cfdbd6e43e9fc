"""One test skeleton for every pcops op (after Kornia's per-op test base).

An op's test module subclasses :class:`OpSuite` (``class TestBallQuery(OpSuite): ...``) and
fills in the hooks; pytest then runs, for that op:

* ``test_matches_float64_reference``: on every adversarial cloud of tests/reference.py, the
  op in float64 equals the float64 reference (indices exactly, values within ``TOL``);
* ``test_dtypes``: float32/float64 native, float16/bfloat16 computed in float32: floating
  outputs have the input dtype and match the reference of the rounded inputs within ``TOL``;
* ``test_gradcheck``: float64 gradcheck for each name in ``differentiable``;
* ``test_opcheck``: ``torch.library.opcheck`` on every custom op the op calls (exact fakes);
* ``test_compile_fullgraph``: one graph, no break, no recompile for a new size, equal to eager;
* ``test_padded_and_packed_equal_per_sample_loop``: both batch layouts equal a loop;
* ``test_bad_inputs_raise``: every bad input raises ValueError/TypeError naming the argument.

Tolerances come from ONE table, per dtype (:data:`TOL`), not per test.

The device axis: the tests whose inputs the suite makes from the hooks (reference, dtypes,
gradcheck, opcheck, compile) run on every device of :func:`devices`, the op on the inputs moved
there and compared on the CPU against the CPU reference: ``cpu`` always, ``cuda`` as a
``cuda``-marked parameter that tests/conftest.py skips, with its reason, where torch sees no
GPU (so ``pytest -m cuda`` on a GPU machine runs it). The batch and bad-input hooks build and
call the op themselves: those two run on the CPU. The table-driven tests of
tests/test_op_table.py take the same axis.
"""

from __future__ import annotations

import pytest
import torch

from tests.compile_check import assert_compiles
from tests.reference import CLOUDS

F64 = torch.float64


def devices() -> list:
    """The device axis of the table-driven tests: ``cpu``, and ``cuda`` marked ``cuda`` (generated
    everywhere, skipped with a reason by tests/conftest.py where ``torch.cuda.is_available()`` is
    false)."""
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def to_device(value, device):
    """``value`` (a tensor, or a dict / tuple / list of them and other things) with every tensor on
    ``device``; a tensor that requires grad stays a leaf that requires grad; on its own device
    a tensor is returned as it is."""
    if isinstance(value, torch.Tensor):
        if value.device == torch.device(device):
            return value
        moved = value.detach().to(device)
        return moved.requires_grad_() if value.requires_grad else moved
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, tuple):  # a namedtuple
        return type(value)(*(to_device(v, device) for v in value))
    return value


def on_cpu(value):
    """An op's result (tensors, tuples, namedtuples) with its tensors copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(on_cpu(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(on_cpu(v) for v in value)
    return value
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Tolerance of a floating output against the float64 reference of the same (rounded) inputs:
# float64 is exact up to summation order; float32 results are rounded once or a few times;
# half types are computed in float32 and rounded once to the output dtype.
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
}


def assert_matches(actual, expected, dtype: torch.dtype, what: str = "output") -> None:
    """Integer outputs equal exactly; floating ones (inf where the reference has inf) within TOL[dtype]."""
    if not expected.dtype.is_floating_point:
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
        assert torch.equal(actual, expected), f"{what}: differs from the reference\n{actual}\n{expected}"
        return
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    torch.testing.assert_close(actual.detach().double(), expected.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def as_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    """The inputs with every floating tensor cast to ``dtype``."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v for k, v in inputs.items()}


def pad(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N_max, ...) zero padded and lengths (B,) of per-sample tensors (N_b, ...)."""
    lengths = torch.tensor([t.shape[0] for t in tensors])
    n = max(1, int(lengths.max()))
    out = tensors[0].new_zeros((len(tensors), n, *tensors[0].shape[1:]))
    for b, t in enumerate(tensors):
        out[b, : t.shape[0]] = t
    return out, lengths


def pack(tensors: list[torch.Tensor], gen: torch.Generator, keep_order: bool = False):
    """Per-sample tensors packed in a shuffled order: (packed, sample ids, position of each row).

    ``packed[position[k]]`` is row k of ``torch.cat(tensors)``. With ``keep_order`` the samples
    are interleaved at random but each sample's rows keep their relative order (for ops whose
    result depends on the order of the points, as FPS's start and ties do).
    """
    cat = torch.cat(tensors)
    ids = torch.cat([torch.full((t.shape[0],), b) for b, t in enumerate(tensors)])
    perm = torch.randperm(cat.shape[0], generator=gen)
    if keep_order:
        position = torch.argsort(ids[perm], stable=True)  # k-th row of sample b -> k-th slot holding b
    else:
        position = torch.empty_like(perm)
        position[perm] = torch.arange(perm.numel())
    packed = torch.empty_like(cat)
    packed[position] = cat
    packed_ids = torch.empty_like(ids)
    packed_ids[position] = ids
    return packed, packed_ids, position



def pack_pair(qs, ps, fs, gen: torch.Generator):
    """Packed query and reference clouds (shuffled) with the features in ref's packed order:
    (packed query, query ids, query positions, packed ref, ref ids, ref positions, packed features)."""
    qp, qb, q_pos = pack(qs, gen)
    pp, pb, p_pos = pack(ps, gen)
    fp = torch.empty(len(pp), fs[0].shape[1], dtype=fs[0].dtype)
    fp[p_pos] = torch.cat(fs)
    return qp, qb, q_pos, pp, pb, p_pos, fp


def sample_rows(out: torch.Tensor, position: torch.Tensor, tensors: list) -> list[tuple]:
    """Each sample's rows of a packed per-query result, in the sample's own order: [(rows,), ...]."""
    rows, at = [], 0
    for t in tensors:
        rows.append((out[position[at : at + len(t)]],))
        at += len(t)
    return rows

class OpSuite:
    """Base class of one op's tests. Subclasses define the hooks below."""

    differentiable: tuple[str, ...] = ()  # names of the inputs ``grad_inputs`` makes differentiable
    clouds = CLOUDS
    dtypes = DTYPES

    # -- hooks -----------------------------------------------------------------------------
    def inputs(self, kind: str, gen: torch.Generator) -> dict:
        """float64 keyword inputs of the op on one adversarial cloud ``kind``."""
        raise NotImplementedError

    def run(self, **inputs) -> tuple:
        """The op on one cloud: a tuple of output tensors."""
        raise NotImplementedError

    def reference(self, **inputs) -> tuple:
        """Independent float64 reference of ``run`` (same outputs, same order)."""
        raise NotImplementedError

    def compare(self, out: tuple, expected: tuple, dtype: torch.dtype, inputs: dict | None = None) -> None:
        """Outputs against the reference (``inputs``: what the op was given, None in the batch test);
        override for outputs compared differently."""
        assert len(out) == len(expected)
        for i, (a, e) in enumerate(zip(out, expected)):
            assert_matches(a, e, dtype, f"output {i}")

    def grad_inputs(self, gen: torch.Generator) -> dict:
        """Small float64 inputs for gradcheck (away from discontinuities)."""
        return self.inputs("uniform", gen)

    def opcheck_cases(self, gen: torch.Generator) -> list:
        """(custom op, args) pairs for ``torch.library.opcheck``."""
        raise NotImplementedError

    def compile_calls(self, gen: torch.Generator) -> tuple:
        """(function, [args of call 1, args of call 2 at another size, ...]) for the compile check."""
        raise NotImplementedError

    def batched(self, gen: torch.Generator) -> tuple[list, list, list]:
        """(expected per-sample outputs from a loop, per-sample outputs of the padded call,
        per-sample outputs of the packed call); samples of mixed sizes, empty ones included."""
        raise NotImplementedError

    def bad_inputs(self, gen: torch.Generator) -> dict:
        """{case name: (callable, exception type, regex naming the argument)}."""
        raise NotImplementedError

    # -- the tests -------------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc):
        if "wrt" in metafunc.fixturenames:
            metafunc.parametrize("wrt", metafunc.cls.differentiable)
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", metafunc.cls.dtypes, ids=str)
        if "kind" in metafunc.fixturenames:
            metafunc.parametrize("kind", metafunc.cls.clouds)
        if "device" in metafunc.fixturenames:
            metafunc.parametrize("device", devices())

    def test_matches_float64_reference(self, gen, kind, device):
        inputs = self.inputs(kind, gen)
        out = on_cpu(self.run(**to_device(inputs, device)))
        self.compare(out, self.reference(**inputs), F64, inputs)

    def test_dtypes(self, gen, dtype, device):
        inputs = as_dtype(self.inputs("uniform", gen), dtype)
        out = on_cpu(self.run(**to_device(inputs, device)))
        for o in out:
            assert not o.dtype.is_floating_point or o.dtype == dtype, f"output dtype {o.dtype} for {dtype} inputs"
        self.compare(out, self.reference(**as_dtype(inputs, F64)), dtype, inputs)

    def test_gradcheck(self, gen, wrt, device):
        inputs = to_device(self.grad_inputs(gen), device)
        x = inputs[wrt].detach().clone().requires_grad_()

        def fn(x):
            out = self.run(**{**inputs, wrt: x})
            return tuple(torch.where(torch.isfinite(o), o, 0) for o in out if o.dtype.is_floating_point)

        # on CUDA, torch's index_select / gather backward adds with atomics: float64 sums in any order
        assert torch.autograd.gradcheck(fn, (x,), nondet_tol=1e-12 if device.startswith("cuda") else 0.0)

    def test_opcheck(self, gen, device):
        cases = self.opcheck_cases(gen)
        assert cases
        for op, args, *devices in cases:  # an optional third item: the device types the op runs on
            if not devices or device.split(":")[0] in devices[0]:
                torch.library.opcheck(op, to_device(args, device))

    def test_compile_fullgraph(self, gen, device):
        fn, calls = self.compile_calls(gen)
        assert len(calls) >= 2
        assert_compiles(fn, [to_device(args, device) for args in calls])

    def test_padded_and_packed_equal_per_sample_loop(self, gen):
        expected, padded, packed = self.batched(gen)
        assert len(expected) == len(padded) == len(packed) >= 3
        for b, e in enumerate(expected):
            self.compare(padded[b], e, F64)
            self.compare(packed[b], e, F64)

    def test_bad_inputs_raise(self, gen):
        cases = self.bad_inputs(gen)
        assert cases
        for name, (call, error, match) in cases.items():
            with pytest.raises(error, match=match):
                call()
