"""Reliability: garbage in never hangs, batch ids never merge samples, one rule for sigma,
deterministic gradients, thread safety, far coordinates, bounded memory.

The lists of ops these tests run come from the op table (tests/op_table.py): a new row takes
part in each of them, or says in its notes why not (tests/test_op_table.py checks)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pcops
from tests import op_table, reference

CPU_BACKENDS = ["warp", "scipy", "torch"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, timeout: float) -> str:
    """Run ``code`` in a fresh interpreter; a hang fails the test instead of stalling the suite."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"did not finish within {timeout} s (a hang?); output so far:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def tensors(out) -> list[torch.Tensor]:
    """The tensors of an op's result (a tensor, a tuple or a namedtuple), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in tensors(item)]
    return []


def assert_same(got, want, what) -> None:
    """Equal results: every tensor bitwise equal (inf where inf), the same structure."""
    got, want = tensors(got), tensors(want)
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: output {i} differs"


# -- NaN/inf points with validate=False terminate -------------------------------------------------

NON_FINITE = """
import itertools, torch, pcops
from tests import reference
ops = [("knn", b) for b in {backends!r}] + [("knn_aggregate", b) for b in {backends!r}] + [("radius_aggregate", "")]
ops += [(name, "") for name in {others!r}]
g = torch.Generator().manual_seed(0)
m, n, k = 2100, 2200, 4  # > 2 * 1024 queries: the CPU launch is split across threads
cases = itertools.product(ops, ("query", "ref"), (float("nan"), float("inf")), (False, True))  # -inf: the table loop below
for (op, backend), where, value, grouped in cases:
    q, p = torch.rand(m, 3, generator=g, dtype=torch.float64), torch.rand(n, 3, generator=g, dtype=torch.float64)
    f = torch.rand(n, 2, generator=g, dtype=torch.float64)
    bad = torch.tensor([5, 17])
    (q if where == "query" else p)[bad, 1] = value
    kw = dict(query_batch=torch.arange(m) % 2, ref_batch=torch.arange(n) % 2) if grouped else {{}}
    if op == "knn":
        out = pcops.knn(q, p, k, backend, validate=False, **kw)
        assert out.idx.shape == (m, k)
        if not grouped:  # finite queries: the exact kNN among the finite points; NaN/inf points find none
            ok_q = torch.isfinite(q).all(1)
            keep = torch.isfinite(p).all(1).nonzero()[:, 0]
            ref_d, ref_i = reference.knn(q[ok_q], p[keep], k)
            assert torch.equal(out.idx[ok_q], keep[ref_i]), (where, value)
            assert torch.equal(out.idx[~ok_q], torch.full(((~ok_q).sum(), k), -1)), (where, value)
    elif op == "knn_aggregate":
        out = pcops.knn_aggregate(q, p, f, k, 0.1, backend, validate=False, **kw)
        assert out.shape == (m, 2)
    elif op == "radius_aggregate":
        out = pcops.radius_aggregate(q, p, f, 0.1, 0.1, validate=False, **kw)
        assert out.shape == (m, 2)
    else:
        one = dict(batch=kw.get("ref_batch"), validate=False)
        try:
            {{
                "ball_query": lambda: pcops.ball_query(q, p, 0.1, 8, validate=False, **kw),
                "ball_queries": lambda: pcops.ball_queries(q, p, [0.1, 0.05, 0.3], 8, validate=False, **kw),
                "knn_interpolate": lambda: pcops.knn_interpolate(q, p, f, 3, validate=False, **kw),
                "chamfer_distance": lambda: pcops.chamfer_distance(q, p, x_batch=kw.get("query_batch"), y_batch=kw.get("ref_batch"), validate=False),
                "sinkhorn_divergence": lambda: pcops.sinkhorn_divergence(q, p, x_batch=kw.get("query_batch"), y_batch=kw.get("ref_batch"), validate=False),
                "earth_movers_distance": lambda: pcops.earth_movers_distance(q, p[:m], x_batch=kw.get("query_batch"), y_batch=kw["ref_batch"][:m] if kw else None, validate=False),
                "knn_graph": lambda: pcops.knn_graph(p, 6, **one),
                "radius_graph": lambda: pcops.radius_graph(p, 0.1, **one),
                "estimate_normals": lambda: pcops.estimate_normals(p, 8, **one),
                "farthest_point_sample": lambda: pcops.farthest_point_sample(p, 50, **one),
                "voxel_pool": lambda: pcops.voxel_pool(p, 0.1, f, **one),
                "grid_sample": lambda: pcops.grid_sample(p, 0.1, **one),
            }}[op]()  # a KeyError: an op of the table (tests/op_table.py) missing here
        except ValueError as err:  # a clear error is a way to terminate too
            print(op, "raised", err)
    print(op, backend, where, value, grouped, "returned", flush=True)

# every point input of every op of the table, at the table's sizes, NaN, inf and -inf
from tests import op_table
for op in op_table.POINT_OPS:
    for name in op.points:
        for value in (float("nan"), float("inf"), -float("inf")):
            inputs = op.inputs()
            inputs[name][3, 1] = value
            try:
                op.call(inputs, validate=False)
            except ValueError as err:  # a clear error is a way to terminate too
                print(op.name, name, value, "raised", err)
            print(op.name, name, value, "table returned", flush=True)
"""


# every point-cloud op of the table (tests/op_table.py) besides the three above, at sizes that split launches
OTHER_OPS = [op.name for op in op_table.POINT_OPS if op.clouds and op.name not in ("knn", "knn_aggregate", "radius_aggregate")]


def test_non_finite_points_without_validation_terminate():
    """One interpreter: every op (knn and knn_aggregate on every CPU backend) with NaN/inf in query
    or ref, grouped or not, at sizes that split launches; then every point input of every op of
    the table (tests/op_table.py) with NaN, inf and -inf."""
    out = run_python(NON_FINITE.format(backends=CPU_BACKENDS, others=OTHER_OPS), timeout=400)
    assert out.count(" returned") - out.count("table returned") == (7 + len(OTHER_OPS)) * 8
    assert out.count("table returned") == 3 * sum(len(op.points) for op in op_table.POINT_OPS)


# -- batch ids and lengths of any integer range ---------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("validate", [True, False])
def test_batch_ids_above_int32_never_merge_samples(backend, validate):
    # Sample 1 and sample 2**32 + 1 agree in their low 32 bits: a cast to int32 merges them.
    q = torch.tensor([[0.0, 0.0, 0.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    p = torch.tensor([[0.1, 0.0, 0.0], [3.0, 0.0, 0.0], [5.0, 5.0, 5.2]], dtype=torch.float64)
    f = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    qb, rb = torch.tensor([2**32 + 1, 7]), torch.tensor([1, 2**32 + 1, 7])
    kw = dict(query_batch=qb, ref_batch=rb, validate=validate)
    idx = pcops.knn(q, p, 1, backend, **kw).idx
    assert idx[:, 0].tolist() == [1, 2]
    out = pcops.knn_aggregate(q, p, f, 1, 0.1, backend, **kw)
    assert out[:, 0].tolist() == [2.0, 3.0]
    if backend == "warp":
        out = pcops.radius_aggregate(q, p, f, 10.0, 0.1, **kw)
        assert out[:, 0].tolist() == [2.0, 3.0]


def test_ids_that_wrap_in_int32_match_small_ids():
    gen = torch.Generator().manual_seed(0)
    q, p = torch.rand(40, 3, generator=gen, dtype=torch.float64), torch.rand(50, 3, generator=gen, dtype=torch.float64)
    qb, rb = torch.randint(0, 3, (40,), generator=gen), torch.randint(0, 3, (50,), generator=gen)
    small = pcops.knn(q, p, 3, query_batch=qb, ref_batch=rb)
    huge = pcops.knn(q, p, 3, query_batch=qb * 2**32 + 2**40, ref_batch=rb * 2**32 + 2**40)
    assert torch.equal(small.idx, huge.idx)


HUGE = 2**32 + 1  # equal to 1 in its low 32 bits


def _huge(ids: torch.Tensor) -> torch.Tensor:
    """Sample ids 0 and 1 as 1 and 2**32 + 1 (a cast to int32 would merge them); others (-1 padding) kept."""
    return torch.where(ids == 0, 1, torch.where(ids == 1, HUGE, ids))


# every op of the table (tests/op_table.py) that takes packed sample ids (its row's ``batch``);
# the others say why in their row's notes["batch"]
BATCHED = [(op, v) for op in op_table.OPS if op.batch for v in ((True, False) if op.validates else (None,))]


@pytest.mark.parametrize("op,validate", BATCHED, ids=[f"{op.name}-{v}" for op, v in BATCHED])
def test_sample_ids_above_int32_give_every_op_the_result_of_small_ids(op, validate):
    """Two samples, shuffled: ids 1 and 2**32 + 1 give what ids 0 and 1 give (the samples stay
    apart); outputs that return the ids (``batch`` fields) return the large ids."""
    inputs = op.inputs()
    gen = torch.Generator().manual_seed(1)
    small = {kw: torch.randint(0, 2, (inputs[name].shape[0],), generator=gen) for kw, name in op.batch.items()}
    extra = {} if validate is None else {"validate": validate}
    want = op.call(inputs, **small, **extra)
    got = op.call(inputs, **{kw: _huge(ids) for kw, ids in small.items()}, **extra)
    names = getattr(want, "_fields", None) or [str(i) for i in range(len(tensors(want)))]
    pairs = zip(names, got, want) if hasattr(want, "_fields") else zip(names, tensors(got), tensors(want))
    for name, a, b in pairs:
        if not isinstance(b, torch.Tensor):
            assert a == b, name
        elif name == "batch":
            assert torch.equal(a, _huge(b)), name
        elif b.is_floating_point():  # the samples' groups are numbered apart: sums may run in another order
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
        else:
            assert torch.equal(a, b), name


def test_chamfer_per_point_costs_keep_samples_with_ids_above_int32_apart():
    """chamfer_distance's ids index its per-sample losses (its row's notes["batch"]); its
    per-point costs take ids of any range."""
    inputs = op_table.BY_NAME["chamfer_distance"].inputs()
    x, y = inputs["x"], inputs["y"]
    gen = torch.Generator().manual_seed(1)
    xb, yb = torch.randint(0, 2, (len(x),), generator=gen), torch.randint(0, 2, (len(y),), generator=gen)
    for validate in (True, False):
        want = pcops.chamfer_distance(x, y, x_batch=xb, y_batch=yb, point_reduction=None, batch_reduction=None, validate=validate)
        got = pcops.chamfer_distance(x, y, x_batch=_huge(xb), y_batch=_huge(yb), point_reduction=None, batch_reduction=None,
                                     validate=validate)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_lengths_above_int32_mean_whole_rows_without_validation():
    gen = torch.Generator().manual_seed(0)
    q, p = torch.rand(2, 5, 3, generator=gen), torch.rand(2, 6, 3, generator=gen)
    big = torch.tensor([2**32 + 1, 2**32 + 1])
    with pytest.raises(ValueError, match="query_lengths"):
        pcops.knn(q, p, 2, query_lengths=big)
    whole = pcops.knn(q, p, 2)
    assert torch.equal(pcops.knn(q, p, 2, query_lengths=big, ref_lengths=big, validate=False).idx, whole.idx)


# -- one rule for sigma ---------------------------------------------------------------------------


def _separated(dtype):
    """Queries with one clearly nearest reference point each, and the features of that point."""
    gen = torch.Generator().manual_seed(1)
    p = torch.rand(40, 3, generator=gen, dtype=torch.float64)
    q = p[:10] + 1e-3 * torch.rand(10, 3, generator=gen, dtype=torch.float64)
    q[0] = p[0]  # d = 0 for one query
    f = torch.rand(40, 2, generator=gen, dtype=torch.float64)
    return q.to(dtype), p.to(dtype), f.to(dtype), f[:10].to(dtype)


AGGREGATES = {
    "knn_aggregate": lambda q, p, f, sigma: pcops.knn_aggregate(q, p, f, 4, sigma),
    "radius_aggregate": lambda q, p, f, sigma: pcops.radius_aggregate(q, p, f, 0.3, sigma),
}


@pytest.mark.parametrize("op", sorted(AGGREGATES))
@pytest.mark.parametrize(
    "dtype,sigma",
    [(torch.float32, 1e-39), (torch.float32, 1.5e-45), (torch.float32, 1e-30), (torch.float64, 5e-324), (torch.float64, 1e-300)],
)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_any_sigma_above_zero_in_the_compute_dtype_gives_the_nearest_features(op, dtype, sigma, as_tensor):
    q, p, f, nearest = _separated(dtype)
    s = torch.tensor(sigma, dtype=dtype) if as_tensor else sigma
    assert float(torch.tensor(sigma, dtype=dtype)) > 0
    out = AGGREGATES[op](q, p, f, s)
    assert torch.isfinite(out).all()
    assert torch.equal(out, nearest)


@pytest.mark.parametrize("op", sorted(AGGREGATES))
@pytest.mark.parametrize("sigma", [1e-46, torch.tensor(1e-46, dtype=torch.float64), torch.tensor([1e-46])])
def test_a_sigma_that_rounds_to_zero_raises_the_same_error(op, sigma):
    q, p, f, _ = _separated(torch.float32)
    with pytest.raises(ValueError, match=r"sigma must be finite and > 0 in torch.float32 \(the dtype it is computed in\)"):
        AGGREGATES[op](q, p, f, sigma)


# -- features checked, numpy scalars accepted -----------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_features_of_other_ops_are_rejected_when_validating(value):
    q, p, f, _ = _separated(torch.float32)
    f[3, 1] = value
    for call in (lambda v: pcops.knn_interpolate(q, p, f, 3, validate=v), lambda v: pcops.voxel_pool(p, 0.2, f, validate=v),
                 lambda v: pcops.knn_aggregate(q, p, f, 3, weights="inverse_distance", validate=v)):
        with pytest.raises(ValueError, match="features contains NaN or inf"):
            call(True)
        call(False)


@pytest.mark.parametrize("op", sorted(AGGREGATES))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_features_are_rejected_when_validating(op, value):
    q, p, f, _ = _separated(torch.float32)
    f[3, 1] = value
    with pytest.raises(ValueError, match="features contains NaN or inf"):
        AGGREGATES[op](q, p, f, 0.1)
    call = {"knn_aggregate": lambda: pcops.knn_aggregate(q, p, f, 4, 0.1, validate=False),
            "radius_aggregate": lambda: pcops.radius_aggregate(q, p, f, 0.3, 0.1, validate=False)}[op]
    assert call().shape == (10, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_values_whose_sum_overflows_pass_the_finite_check(dtype):
    """The NaN/inf check first sums each tensor (a NaN or inf makes the sum non-finite); a sum
    that overflows on finite values must fall back to the exact check, not raise."""
    q, p, _, _ = _separated(dtype)
    f = torch.full((40, 2), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not f.sum().isfinite()
    for call in (lambda: pcops.radius_aggregate(q, p, f, 0.3, 0.1), lambda: pcops.knn_interpolate(q, p, f, 3)):
        assert call().shape == (10, 2)  # no error (the values may overflow in the weighted sums)
    f[4, 1] = float("nan")
    for call in (lambda: pcops.radius_aggregate(q, p, f, 0.3, 0.1), lambda: pcops.knn_interpolate(q, p, f, 3)):
        with pytest.raises(ValueError, match="features contains NaN or inf"):
            call()


# every op of the table with a number argument (its row's call and static-size form); the
# others say why in their row's notes["numbers"]
NUMBERED = [op for op in op_table.OPS if op.numbers]


@pytest.mark.parametrize("op", NUMBERED, ids=lambda op: op.name)
def test_numpy_scalars_work_wherever_python_numbers_do(op):
    """Each number argument of the op as a NumPy scalar (np.int64 / np.int32, np.float32 /
    np.float64), one at a time and all at once, gives the result of the same Python number."""
    np = pytest.importorskip("numpy")
    kinds = {int: (np.int64, np.int32), float: (np.float32, np.float64)}
    inputs = op.inputs()
    for call in filter(None, (op.call, op.static)):
        values = op_table.numbers(call)
        cases = [{name: kind(value)} for name, value in values.items() for kind in kinds[type(value)]]
        cases.append({name: kinds[type(value)][0](value) for name, value in values.items()})
        for case in cases:
            python = {name: type(values[name])(v) for name, v in case.items()}  # the NumPy value as a Python number
            assert_same(call(inputs, **case), call(inputs, **python), f"{op.name} with {case!r}")


@pytest.mark.parametrize("op", NUMBERED, ids=lambda op: op.name)
def test_ints_beyond_float64_are_value_errors_naming_the_argument_or_results(op):
    """Each number argument of the op as an int beyond float64's range (10**400), one at a time:
    a result, or a ValueError / TypeError naming the argument, never Python's OverflowError (a
    radius, sigma or blur of one raised it from a float conversion)."""
    inputs = op.inputs()
    for call in filter(None, (op.call, op.static)):
        for name in op_table.numbers(call):
            if (op.name, name) == ("ball_queries", "radius"):  # (the row scales its radius: the radii are checked below)
                with pytest.raises(ValueError, match=r"^radii\[1\] must be finite and > 0, got an int beyond"):
                    pcops.ball_queries(inputs["query"], inputs["ref"], [0.1, 10**400], 4)
                continue
            try:
                call(inputs, **{name: 10**400})
            except (ValueError, TypeError) as err:
                assert name in str(err), f"{op.name} {name}: {err}"


LAYERS = {  # every nn.Module pcops exports: the arguments it needs
    "KNNAggregation": dict(k=3), "RadiusAggregation": dict(radius=0.3), "SparseConv3d": dict(in_channels=2, out_channels=3),
    "SinkhornLoss": {}, "EMDLoss": {},
}


@pytest.mark.parametrize("op", [op for op in op_table.OPS if op.points], ids=lambda op: op.name)
def test_points_that_are_not_tensors_are_type_errors_naming_them(op):
    """A nested list, a NumPy array or a number where an op takes points: a TypeError or
    ValueError naming the argument, on the plain path of small calls as on the general one."""
    inputs = op.make(torch.Generator().manual_seed(0))
    for name in op.points:
        for given in (inputs[name].tolist(), inputs[name].numpy(), 1.5):
            with pytest.raises((TypeError, ValueError), match=name):
                op.call({**inputs, name: given})


def test_layers_are_all_listed():
    exported = {n for n in dir(pcops) if isinstance(getattr(pcops, n), type) and issubclass(getattr(pcops, n), torch.nn.Module)}
    assert exported == set(LAYERS)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layer_flags_must_be_bools(layer):
    """Every bool argument of a layer (``validate``, ``learnable_sigma``, ``debias``, ``bias``)
    is checked as the functions check theirs: None, 1, "no" or NumPy's True would pass a truth
    test (None turning a layer's checks off, "False" making sigma learnable), so each is a
    TypeError naming it."""
    import inspect

    np = pytest.importorskip("numpy")
    cls = getattr(pcops, layer)
    flags = [p.name for p in inspect.signature(cls.__init__).parameters.values() if isinstance(p.default, bool)]
    assert flags
    for name in flags:
        for bad in (None, 1, "False", np.True_):
            with pytest.raises(TypeError, match=f"^{name} must be a bool"):
                cls(**LAYERS[layer], **{name: bad})
        for good in (True, False):
            made = cls(**LAYERS[layer], **{name: good})
            assert (made.bias is not None) is good if name == "bias" else getattr(made, name) is good


def test_the_repr_of_a_learnable_sigma_warns_nothing():
    import warnings

    for layer in (pcops.KNNAggregation(4, sigma=0.25, learnable_sigma=True), pcops.RadiusAggregation(0.3, sigma=0.25, learnable_sigma=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert "sigma=0.25" in repr(layer)


def test_numpy_scalars_as_keywords_layer_arguments_and_on_every_backend():
    np = pytest.importorskip("numpy")
    q, p, f, _ = _separated(torch.float32)
    assert torch.equal(pcops.knn(q, p, np.int32(3), "torch").idx, pcops.knn(q, p, 3, "torch").idx)
    assert torch.equal(pcops.knn_aggregate(q, p, f, np.int64(3), np.float32(0.1), "scipy"),
                       pcops.knn_aggregate(q, p, f, 3, float(np.float32(0.1)), "scipy"))
    layer = pcops.KNNAggregation(np.int64(3), sigma=np.float32(0.1))
    assert layer.k == 3 and type(layer.k) is int
    assert layer(q, p, f).shape == (10, 2)
    assert pcops.RadiusAggregation(np.float32(0.3), sigma=np.float64(0.1))(q, p, f).shape == (10, 2)
    assert torch.equal(pcops.radius_graph(p, np.float64(0.3), max_neighbors=np.int32(4)), pcops.radius_graph(p, 0.3, max_neighbors=4))
    batch = torch.zeros(40, dtype=torch.long)
    ratio = pcops.farthest_point_sample(p, ratio=np.float32(0.5), batch=batch).idx
    assert torch.equal(ratio, pcops.farthest_point_sample(p, ratio=0.5, batch=batch).idx)
    x, y = torch.rand(5, 3), torch.rand(6, 3)
    xb, yb = torch.zeros(5, dtype=torch.long), torch.zeros(6, dtype=torch.long)
    assert torch.equal(pcops.chamfer_distance(x, y, x_batch=xb, y_batch=yb, batch_size=np.int64(1)),
                       pcops.chamfer_distance(x, y, x_batch=xb, y_batch=yb, batch_size=1))
    with pytest.raises(TypeError, match="k must be an int"):
        pcops.knn(q, p, np.float64(3.0))
    with pytest.raises(TypeError, match="k must be an int"):
        pcops.knn(q, p, np.bool_(True))


# -- determinism ----------------------------------------------------------------------------------


@pytest.fixture
def deterministic_two_threads():
    threads, mode = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(mode)
    torch.set_num_threads(threads)


GRAD_SIZE = 4000  # points of each input (2,666 queries of two-cloud ops): > 2 * 1024, Warp's CPU launch is split
SIGMA = "sigma tensor"  # in a case's keywords: a fresh sigma tensor that requires grad (one more gradient)

# (row of the table, keywords of its call): every op of the table with differentiable inputs
# (the others say why in notes["grad"]), and the kNN ops on each CPU backend, a sigma tensor
# and inverse-distance weights
GRAD_CASES = {op.name: (op.name, {}) for op in op_table.OPS if op.grad}
GRAD_CASES.update({f"knn-{b}": ("knn", dict(backend=b)) for b in CPU_BACKENDS})
GRAD_CASES.update({f"knn_aggregate-{b}": ("knn_aggregate", dict(backend=b, sigma=SIGMA)) for b in CPU_BACKENDS})
GRAD_CASES["radius_aggregate-sigma"] = ("radius_aggregate", dict(sigma=SIGMA))
GRAD_CASES["knn_aggregate_inverse_distance"] = ("knn_aggregate", dict(sigma=None, weights="inverse_distance"))
GRADIENTS = {case: len(op_table.BY_NAME[name].grad) + sum(v is SIGMA for v in kw.values()) for case, (name, kw) in GRAD_CASES.items()}


def _gradients(case):
    name, keywords = GRAD_CASES[case]
    op = op_table.BY_NAME[name]
    inputs = op.inputs(0, n=GRAD_SIZE, dtype=torch.float32)
    leaves = [inputs[x].requires_grad_() for x in op.grad]
    kw = {k: torch.tensor(0.05, requires_grad=True) if v is SIGMA else v for k, v in keywords.items()}
    leaves += [v for v in kw.values() if isinstance(v, torch.Tensor)]
    gen = torch.Generator().manual_seed(1)
    outs = [t for t in tensors(op.call(inputs, **kw)) if t.requires_grad]
    sum((torch.where(torch.isfinite(t), t, 0) * torch.rand(t.shape, generator=gen)).sum() for t in outs).backward()
    return [t.grad for t in leaves if t.grad is not None]


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_deterministic_mode_gives_bitwise_equal_gradients(deterministic_two_threads, case):
    first = _gradients(case)
    assert len(first) == GRADIENTS[case]
    for _ in range(3):
        for a, b in zip(first, _gradients(case)):
            assert torch.equal(a, b)


# -- first calls of torch's math functions -------------------------------------------------------


@pytest.mark.slow
def test_first_parallel_sqrt_of_fresh_processes_is_exact():
    # MKL picks its vector math kernels on first use; first used by two torch threads at once,
    # one of them could run a low-accuracy sqrt on its half (pcops._vml): 2-3 fresh processes
    # in 30 got errors of up to 7e-11 here without pcops' warm-up at import, 0 in 40 with it
    # (without it, this test passes by chance about once in 20)
    code = """
        import numpy as np, torch
        import pcops
        from pcops import _warp
        from tests import reference
        _warp.init()
        q, p, _ = reference.cloud("uniform", torch.Generator().manual_seed(0))
        s = (q[:, None, :] - p[None, :, :]).pow(2).sum(-1)
        print(float(np.abs(s.sqrt().numpy() - np.sqrt(s.numpy())).max()))
    """
    errors = [float(run_python(code, timeout=120).split()[-1]) for _ in range(40)]
    assert max(errors) < 1e-14, f"{sum(e >= 1e-14 for e in errors)} of {len(errors)} processes: sqrt off by up to {max(errors):.1e}"


# -- far coordinates ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("offset", [1e6, 3e7, 1e9, 3e9])
def test_knn_of_a_far_cloud_is_exact_in_float64(backend, offset):
    """Against the float64 oracle on the shifted coordinates (what the caller passed): exact."""
    gen = torch.Generator().manual_seed(0)
    shift = torch.tensor([offset, -offset / 3, offset / 7], dtype=torch.float64)
    q = torch.rand(300, 3, generator=gen, dtype=torch.float64) + shift
    p = torch.rand(500, 3, generator=gen, dtype=torch.float64) + shift
    ref_d, ref_i = reference.knn(q, p, 8)
    d, i = pcops.knn(q, p, 8, backend)
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(d, ref_d, rtol=1e-12, atol=0)


# -- recompilation --------------------------------------------------------------------------------


def test_a_new_number_of_points_does_not_recompile_with_aot_eager(gen):
    """The claim of the docs: sizes on both sides of 4096 (where inductor's CPU reductions may guard)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    knn_layer, radius_layer = pcops.KNNAggregation(8, sigma=0.1), pcops.RadiusAggregation(0.1, sigma=0.1)

    def model(q, p, f):
        return (knn_layer(q, p, f) + radius_layer(q, p, f)).mean(0)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for m, n in [(100, 200), (5000, 300), (300, 9000)]:
        q, p, f = torch.rand(m, 3, generator=gen).requires_grad_(), torch.rand(n, 3, generator=gen), torch.rand(n, 4, generator=gen)
        out = compiled(q, p, f)
        out.sum().backward()
        torch.testing.assert_close(out, model(q, p, f))
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == [frames[0]] * 3


# -- threads and memory ---------------------------------------------------------------------------

# (row of the table, keywords of its call): every op of the table (an op left out says why in
# notes["threads"]), and knn on each CPU backend
STEADY_CALLS = {op.name: (op.name, {}) for op in op_table.OPS if "threads" not in op.notes}
STEADY_CALLS.update({f"knn-{b}": ("knn", dict(backend=b)) for b in CPU_BACKENDS})


def test_steady_state_calls_from_four_threads_match_serial_calls():
    from concurrent.futures import ThreadPoolExecutor

    # float32 and float64; 300 points (one chunk) and 3,200 (2,133 queries: a launch split across the pool)
    sizes = [(dtype, n) for dtype in (torch.float32, torch.float64) for n in (300, 3200)]
    inputs = {(name, i): op_table.BY_NAME[name].inputs(i, n=n, dtype=dtype)
              for name in dict.fromkeys(name for name, _ in STEADY_CALLS.values()) for i, (dtype, n) in enumerate(sizes)}

    def run(job):
        case, i = job
        name, kw = STEADY_CALLS[case]
        return op_table.BY_NAME[name].call(inputs[name, i], **kw)

    jobs = [(case, i) for case in STEADY_CALLS for i in range(len(sizes))]
    serial = {job: run(job) for job in jobs}  # also warms every kernel
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            for job, out in zip(jobs * 2, pool.map(run, jobs * 2)):
                assert_same(out, serial[job], job)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow  # 1-2 min per layer on 2 busy cores
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size from /proc")
@pytest.mark.parametrize("layer", ["RadiusAggregation", "KNNAggregation"])
def test_no_memory_growth_over_a_thousand_train_steps(layer):
    gen = torch.Generator().manual_seed(0)
    module = pcops.RadiusAggregation(0.15, sigma=0.05, learnable_sigma=True) if layer == "RadiusAggregation" else pcops.KNNAggregation(8, sigma=0.05, learnable_sigma=True)
    head = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD([*module.parameters(), *head.parameters()], lr=1e-3)
    q, p = torch.rand(600, 3, generator=gen), torch.rand(800, 3, generator=gen)
    f = torch.rand(800, 4, generator=gen).requires_grad_()
    target = torch.rand(600, 1, generator=gen)

    def step():
        opt.zero_grad()
        loss = (head(module(q, p, f)) - target).square().mean()
        loss.backward()
        opt.step()

    for _ in range(100):  # warm-up: allocator pools, Warp modules, thread pool
        step()
    before = _rss_mb()
    for _ in range(1000):
        step()
    growth = _rss_mb() - before
    assert growth < 20, f"resident memory grew by {growth:.1f} MB over 1,000 steps"


@pytest.mark.cuda
def test_cuda_radius_backward_alerts_under_deterministic_mode():
    q, p, f = (torch.rand(50, 3, device="cuda"), torch.rand(60, 3, device="cuda"), torch.rand(60, 2, device="cuda", requires_grad=True))
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = pcops.radius_aggregate(q, p, f, 0.3, 0.1)
        with pytest.raises(RuntimeError, match="pcops::radius_aggregate_backward on CUDA does not have a deterministic"):
            out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(mode)


def test_single_cloud_ops_keep_samples_with_ids_above_int32_apart():
    p = torch.tensor([[0.0, 0, 0], [0.1, 0, 0], [0.05, 0, 0], [5, 5, 5]])
    b = torch.tensor([1, 2**32 + 1, 1, 2**32 + 1])  # equal in their low 32 bits
    assert sorted(map(tuple, pcops.knn_graph(p, 1, batch=b).T.tolist())) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert sorted(map(tuple, pcops.radius_graph(p, 0.2, batch=b).T.tolist())) == [(0, 2), (2, 0)]
    assert pcops.farthest_point_sample(p, ratio=0.5, batch=b).idx.tolist() == [0, 1]
    assert pcops.voxel_pool(p, 1.0, batch=b).cluster.tolist() == [0, 1, 0, 2]


# -- a padded batch of no samples -------------------------------------------------------------------

PADDED = {
    "knn": lambda q, p, f: pcops.knn(q, p, 2),
    "knn_aggregate": lambda q, p, f: pcops.knn_aggregate(q, p, f, 2, 0.1),
    "knn_interpolate": lambda q, p, f: pcops.knn_interpolate(q, p, f, 2),
    "ball_query": lambda q, p, f: pcops.ball_query(q, p, 0.5, 4),
    "ball_queries": lambda q, p, f: pcops.ball_queries(q, p, [0.2, 0.5], [2, 4]),
    "radius_aggregate": lambda q, p, f: pcops.radius_aggregate(q, p, f, 0.5, 0.1),
    "chamfer_distance": lambda q, p, f: pcops.chamfer_distance(q, p, batch_reduction=None),
    "earth_movers_distance": lambda q, p, f: pcops.earth_movers_distance(p, p.flip(1), batch_reduction=None),
    "sinkhorn_divergence": lambda q, p, f: pcops.sinkhorn_divergence(q, p, batch_reduction=None),
    "farthest_point_sample": lambda q, p, f: pcops.farthest_point_sample(p, 3),
    "estimate_normals": lambda q, p, f: pcops.estimate_normals(p, 4),
}


@pytest.mark.parametrize("name", PADDED)
def test_a_padded_batch_of_no_samples_gives_empty_results(name):
    """Padded inputs with B = 0 (an empty batch, as a loader's last split may give): the results of
    two samples with none of their rows (knn, ball_query, ball_queries and earth_movers_distance
    failed in torch reshaping the indices of no sample)."""
    g = torch.Generator().manual_seed(0)
    q, p, f = torch.rand(2, 5, 3, generator=g), torch.rand(2, 7, 3, generator=g), torch.rand(2, 7, 2, generator=g)
    two, none = tensors(PADDED[name](q, p, f)), tensors(PADDED[name](q[:0], p[:0], f[:0]))
    assert [t.shape[1:] for t in none] == [t.shape[1:] for t in two] and all(t.shape[0] == 0 for t in none)
    assert [t.dtype for t in none] == [t.dtype for t in two]
