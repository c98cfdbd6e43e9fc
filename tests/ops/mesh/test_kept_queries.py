"""Mesh queries through kept launches (``pcops._warp.launch(..., kept=True)``):
every call equals the same call with its launches converted and packed anew, whatever the
number of queries in turn, and a launch is kept only for arguments it can point."""

import gc
import weakref

import pytest
import torch
import warp as wp

import pcops
from pcops import _warp
from tests.op_table import icosphere

# the kernels of a kept hierarchy's queries (signed: on closed, crossing and open meshes)
_QUERY_KERNELS = {"_closest_kernel__locals__closest", "_closest_kernel__locals__measure", "_sides_kernel__locals__sides",
                  "_capped_kernel__locals__capped", "_winding_kernel__locals__winding", "_build_kernels__locals__order"}


def _meshes(dtype):
    v, f = icosphere(2)
    v, f = v.to(dtype), f
    crossing = (torch.cat([v, v * 0.8 + torch.tensor([0.7, 0.0, 0.1], dtype=dtype)]), torch.cat([f, f + v.shape[0]]))
    keep = torch.ones(f.shape[0], dtype=torch.bool)
    keep[::9] = False  # holes: an open mesh, signed through its caps
    return {"closed": (v, f), "crossing": crossing, "open": (v, f[keep])}


def _calls(q, bvh, v, f):
    """A kept hierarchy's queries, and a hierarchy built in the call (its query launches kept too)."""
    return [pcops.mesh_distance(q, bvh), pcops.mesh_distance(q, bvh, signed=True), pcops.mesh_distance(q, bvh, signed=True, max_dist=0.3),
            pcops.mesh_distance(q, v, f, signed=True), pcops.point_mesh_face_distance(q, v, f)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["closed", "crossing", "open"])
def test_kept_queries_equal_launches_packed_anew(gen, monkeypatch, name, dtype):
    """Query counts 1-3,000 in turn, three passes (the first makes the kept launches: one serves
    every count; the third makes none and runs every query kernel kept): every call equals the
    same call with every launch packed anew, bit for bit."""
    monkeypatch.setattr(_warp, "KEPT", _warp.Kept(_warp.KEEP_PREPARED, _warp.KEEP_BYTES))
    made, kept = [], []
    real_prepare, real_kept = _warp.prepare, _warp.kept_launch
    monkeypatch.setattr(_warp, "prepare", lambda *a, **kw: (made.append(a[0].key), real_prepare(*a, **kw))[1])
    monkeypatch.setattr(_warp, "kept_launch", lambda *a, **kw: (lambda r: (_warp.PREPARED[0] and kept.append((a[0].key, r)), r)[1])(
        real_kept(*a, **kw)))
    v, f = _meshes(dtype)[name]
    bvh = pcops.mesh_bvh(v, f)
    queries = [(torch.randn(m, 3, generator=gen, dtype=torch.float64) * 0.7).to(dtype) for m in (1, 2, 7, 64, 65, 130, 700, 3000)]
    for turn in range(3):
        made.clear()
        kept.clear()
        for q in queries:
            got = _calls(q, bvh, v, f)
            monkeypatch.setattr(_warp, "PREPARED", [False])
            want = _calls(q, bvh, v, f)
            monkeypatch.setattr(_warp, "PREPARED", [True])
            for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
                assert a.shape == b.shape and ((a == b) | (a.isnan() & b.isnan())).all(), (name, q.shape[0], turn)  # (NaN: no face within max_dist)
        if turn == 0:
            assert _QUERY_KERNELS <= set(made) | ({"_capped_kernel__locals__capped"} if name != "open" else set())
    assert not _QUERY_KERNELS & set(made), made  # (the third pass: nothing made)
    ran = {key for key, r in kept if r}
    assert {"_closest_kernel__locals__closest", "_closest_kernel__locals__measure", "_build_kernels__locals__order"} <= ran
    assert not {key for key, r in kept if not r and key in _QUERY_KERNELS}  # (every query kernel's launch kept)
    if name == "open":
        assert "_capped_kernel__locals__capped" in ran


@wp.kernel(enable_backward=False, module="unique")
def _axpy(start: int, a: float, x: wp.array(dtype=wp.vec3), y: wp.array2d(dtype=wp.float32), scale: wp.array(dtype=wp.float32),
          out: wp.array(dtype=wp.vec3)):
    i = wp.tid() + start
    out[i] = a * x[i] + wp.vec3(y[i, 0], y[i, 1], y[i, 2]) * scale[0] + wp.vec3(float(out.shape[0]), 0.0, 0.0)


def _run(n, a, x, y, scale):
    out = torch.empty(n, 3)
    _warp.launch(_axpy, n, [a, _warp.Typed(x, wp.vec3), y, scale, _warp.Typed(out, wp.vec3)], like=x, min_chunk=4, kept=True)
    return out


def test_a_kept_launch_points_its_arrays_and_takes_only_what_it_can_point(gen, monkeypatch):
    """A launch kept for a kernel: run for every size (each array's length and the threads set,
    read by the kernel: ``out.shape[0]``), a 0-d tensor, each scalar value its own key; a
    non-contiguous tensor, another kind of argument or trailing sizes of their own are not taken
    by it (launched as usual, the same result); the kept launch holds no tensor of its calls."""
    monkeypatch.setattr(_warp, "KEPT", _warp.Kept(_warp.KEEP_PREPARED, _warp.KEEP_BYTES))

    def want(n, a, x, y, scale):
        return a * x[:n] + y[:n] * scale + torch.tensor([float(n), 0.0, 0.0])

    results = []
    real = _warp.kept_launch
    monkeypatch.setattr(_warp, "kept_launch", lambda *a, **kw: (lambda r: (results.append(r), r)[1])(real(*a, **kw)))
    for turn in range(3):
        for n in (1, 5, 8, 33, 100):
            for a in (2.0, -1.5):
                x, y = torch.randn(n, 3, generator=gen), torch.randn(n, 3, generator=gen)
                scale = torch.tensor(0.5 + turn)
                torch.testing.assert_close(_run(n, a, x, y, scale), want(n, a, x, y, scale), rtol=0, atol=0)
    assert results[:2] == [False, False] and results[-10:] == [True] * 10  # (a key's first sighting: not kept; the third turn: all)
    results.clear()
    x = torch.randn(50, 3, generator=gen)
    strided = torch.randn(50, 6, generator=gen)[:, ::2]
    torch.testing.assert_close(_run(50, 2.0, x, strided, torch.tensor(1.0)), want(50, 2.0, x, strided, torch.tensor(1.0)), rtol=0, atol=0)
    assert results == [False]
    x = torch.randn(40, 3, generator=gen)
    y = torch.randn(40, 3, generator=gen)
    out = _run(40, 1.0, x, y, torch.tensor(2.0))
    ref = weakref.ref(x)
    del x, y, out
    gc.collect()
    assert ref() is None  # (no tensor of a call held by the kept launch)
    assert not _warp.kept_launch(_axpy, 4, [1.0, _warp.array(torch.zeros(4, 3), dtype=wp.vec3), torch.zeros(4, 3), torch.ones(()),
                                            torch.zeros(4, 3)], 4)  # (a converted array: not pointed, launched as usual)


@wp.kernel(enable_backward=False, module="unique")
def _copy(start: int, x: wp.array(dtype=wp.float32), out: wp.array(dtype=wp.float32)):
    i = wp.tid() + start
    out[i] = x[i]


def test_a_0d_tensor_and_a_1d_one_are_kept_apart(monkeypatch):
    """A launch kept for a 0-d tensor (an array without strides) does not serve a 1-d tensor of
    the same dtype, whose elements it would read all at the first."""
    monkeypatch.setattr(_warp, "KEPT", _warp.Kept(_warp.KEEP_PREPARED, _warp.KEEP_BYTES))
    for x in [torch.tensor(3.0)] * 3 + [torch.arange(5.0)] * 3:
        out = torch.empty(x.numel())
        _warp.launch(_copy, x.numel(), [x, out], like=x, work=0, kept=True)  # (one chunk whatever the size: one key)
        assert torch.equal(out, x.reshape(-1))
