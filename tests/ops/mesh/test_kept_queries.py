"""Mesh queries through kept launches (``pcops._warp.launch(..., kept=True)``): every call
equals the same call with its launches converted and packed anew, whatever the number of
queries in turn (the kept launch itself: tests/test_kept.py)."""

import pytest
import torch

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
