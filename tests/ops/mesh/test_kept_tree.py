"""The calling thread's kept hierarchy builds (pcops.ops.mesh._kept_tree): the same tensors as a
build from scratch, bit for bit, on every call, never shared between calls or threads."""

import threading

import pytest
import torch

import pcops
from pcops import _warp
from pcops.ops.mesh import _kept_tree, _search, _tree
from pcops.ops.neighbours.nearest import _kdtree
from tests.op_table import icosphere


def _soup(gen, n_vertices=300, n_faces=700, dtype=torch.float32):
    """Random faces over random vertices: long, thin, crossing and degenerate faces (a corner
    repeated), vertices shared by many faces and vertices no face uses."""
    v = (torch.rand(n_vertices, 3, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)
    f = torch.randint(0, n_vertices, (n_faces, 3), generator=gen)
    f[::17, 1] = f[::17, 0]  # degenerate
    return v, f


def _build(v, f, winding, kept: bool):
    """The hierarchy of one mesh through the op, with (kept) or without prepared launches."""
    saved = _warp.PREPARED[0]
    _warp.PREPARED[0] = kept
    try:
        return _search.tree(v, f, torch.zeros(f.shape[0], dtype=torch.int64), one=True, winding=winding)
    finally:
        _warp.PREPARED[0] = saved


def _assert_same(a: _tree.Tree, b: _tree.Tree):
    for x, y, name in zip(a, b, _tree.Tree._fields, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) and torch.equal(x.isnan(), y.isnan()), name


def _kept_count() -> int:
    return sum(key[0] == "mesh_build" for key in _warp.KEPT.keys())


@pytest.fixture(autouse=True)
def _fresh():
    _warp.KEPT.clear()
    yield
    _warp.KEPT.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("winding", [True, False])
@pytest.mark.parametrize("kind", ["soup", "icosphere", "one_face"])
def test_kept_builds_equal_builds_from_scratch_call_after_call(gen, kind, dtype, winding):
    if kind == "soup":
        v, f = _soup(gen, dtype=dtype)
    elif kind == "icosphere":
        v, f = icosphere(2, dtype=dtype)
    else:
        v, f = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0]], dtype=dtype), torch.tensor([[0, 1, 2]])
    _build(v, f, winding, kept=True)  # (the kernels' first run)
    for step in range(4):  # a mesh deformed step by step: the kept build of its shapes each time
        moved = (v.double() * (1 + 0.1 * step) + 0.05 * step * torch.randn(v.shape, generator=gen, dtype=torch.float64)).to(dtype)
        got = _build(moved, f, winding, kept=True)
        _assert_same(got, _build(moved, f, winding, kept=False))
    assert _kept_count() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_builds_return_new_tensors_every_call(gen, dtype):
    v, f = _soup(gen, dtype=dtype)
    first, second = (_build(v, f, True, kept=True) for _ in range(2))
    third = _build(v * 2, f, True, kept=True)
    for a, b, c in zip(first, second, third, strict=True):
        if a.numel():
            assert a.data_ptr() != b.data_ptr() != c.data_ptr() != a.data_ptr()
    _assert_same(first, second)  # (the third's build did not write into them)


def test_non_finite_vertices_build_the_same_kept_or_not(gen):
    v, f = _soup(gen)
    v[3, 1], v[40] = float("nan"), float("inf")
    _build(v, f, True, kept=True)
    _assert_same(_build(v, f, True, kept=True), _build(v, f, True, kept=False))


def test_kept_builds_follow_the_thread_count(gen):
    v, f = icosphere(3, dtype=torch.float32)  # (1,280 faces)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            _build(v, f, True, kept=True)
            _assert_same(_build(v, f, True, kept=True), _build(v, f, True, kept=False))
    finally:
        torch.set_num_threads(threads)


def test_each_thread_keeps_its_own_builds(gen):
    meshes = [_soup(torch.Generator().manual_seed(s)) for s in range(3)]  # one shape: one key per thread
    expected = [_build(v, f, True, kept=False) for v, f in meshes]
    errors = []

    def work(i):
        try:
            for _ in range(20):
                _assert_same(_build(*meshes[i], True, kept=True), expected[i])
        except AssertionError as error:  # pragma: no cover (reported below)
            errors.append(error)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors


def test_builds_are_kept_for_small_one_mesh_cpu_calls_only(gen, monkeypatch):
    v, f = _soup(gen)
    pcops.mesh_bvh(v, f)
    pcops.mesh_bvh(v, f)
    assert _kept_count() == 1
    pcops.mesh_bvh(v[None], f[None])  # a padded batch: its own build
    pcops.mesh_bvh(torch.cat([v, v]), torch.cat([f, f + v.shape[0]]), vertices_batch=torch.arange(2).repeat_interleave(v.shape[0]))
    assert _kept_count() == 1
    monkeypatch.setattr(_kept_tree, "KEEP_FACES", f.shape[0] - 1)
    pcops.mesh_bvh(v, f[:-1])  # under the bound: kept from its second build
    assert _kept_count() == 1
    pcops.mesh_bvh(v, f[:-1])
    assert _kept_count() == 2
    v2, f2 = _soup(gen, n_faces=f.shape[0] + 5)
    pcops.mesh_bvh(v2, f2)  # over it: built from scratch
    assert _kept_count() == 2


def test_the_gpus_build_switch_builds_from_scratch(gen, monkeypatch):
    """Under the switch that runs the GPUs' build on the CPU (the faces in Morton order), no kept
    build (kept in the kd split order) answers: the op's tree is that build's."""
    v, f = _soup(gen)
    _build(v, f, True, kept=True)
    _build(v, f, True, kept=True)
    monkeypatch.setattr(_kdtree, "_GPU_BUILD", True)
    monkeypatch.setattr(_tree.nearest, "split_order", lambda c, g, *rest: _tree.morton_order(c, g))
    _assert_same(_build(v, f, True, kept=True), _tree.build(v, f, torch.zeros(f.shape[0], dtype=torch.int64), v.dtype, True))


def test_mesh_distance_with_kept_builds_equals_the_reference(gen):
    v, f = icosphere(2, dtype=torch.float64)
    q = torch.randn(200, 3, generator=gen, dtype=torch.float64)
    for _ in range(3):
        got = pcops.mesh_distance(q, v, f, signed=True)
        _warp.PREPARED[0] = False
        try:
            want = pcops.mesh_distance(q, v, f, signed=True)
        finally:
            _warp.PREPARED[0] = True
        assert torch.equal(got.dists, want.dists) and torch.equal(got.face, want.face)
