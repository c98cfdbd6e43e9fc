"""The calling thread's kept launches and plans (pcops._warp.Kept): the least recently used
dropped past a count or a byte budget, a key made on its second sighting among the last misses,
each thread its own; and clouds of many sizes taken in turn: kept whole from their second pass
(nothing made on a third), a stream of sizes seen once makes only what serves a range of sizes,
and every call's answer is the answer of launches packed anew."""

import threading

import pytest
import torch

import pcops
from pcops import _warp


def test_the_least_recently_used_is_dropped_past_the_count():
    kept = _warp.Kept(2, 1 << 20)
    kept.put("a", 1)
    kept.put("b", 2)
    assert kept.get("a") == 1  # (now the most recently used)
    kept.put("c", 3)
    assert kept.keys() == ["a", "c"] and kept.get("b") is None and kept.get("c") == 3
    kept.put("a", 4)  # (replaced, now the most recent)
    kept.put("d", 5)
    assert kept.keys() == ["a", "d"] and kept.get("a") == 4


def test_the_byte_budget_drops_the_oldest_and_keeps_the_newest():
    kept = _warp.Kept(10, 100)
    kept.put("a", 1, 60)
    kept.put("b", 2, 30)
    kept.put("c", 3, 30)  # (120 bytes: a dropped)
    assert kept.keys() == ["b", "c"]
    kept.put("d", 4, 500)  # (over the budget alone: kept alone)
    assert kept.keys() == ["d"]
    kept.put("d", 5, 10)  # (replaced: its bytes counted once)
    kept.put("e", 6, 80)
    kept.put("f", 7, 10)
    assert kept.keys() == ["d", "e", "f"]
    kept.put("g", 8, 1)  # (101 bytes: d dropped)
    assert kept.keys() == ["e", "f", "g"]


def test_a_key_is_made_on_its_second_sighting_among_the_last_misses():
    kept = _warp.Kept(3, 1 << 20)
    assert not kept.admit("a") and kept.admit("a")
    assert kept.admit("a")  # (not made yet, say a kernel not loaded: asked again, still admitted)
    kept.put("a", 1)
    assert kept.admit("a")  # (kept, made under other switches: made again at once)
    for key in "bcde":
        assert not kept.admit(key)
    assert not kept.admit("b")  # (its sighting dropped: three misses since)
    assert kept.admit("d") and kept.admit("e")
    kept.clear()
    assert kept.keys() == [] and not kept.admit("a")


def test_each_thread_keeps_its_own():
    kept = _warp.Kept(4, 1 << 20)
    kept.put("main", 1)
    seen = []

    def other():
        seen.append((kept.get("main"), kept.admit("other")))
        kept.put("other", 2)
        seen.append(kept.keys())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [(None, False), ["other"]] and kept.keys() == ["main"] and kept.get("other") is None


def test_held_bytes_counts_nested_tensors():
    a, b = torch.zeros(10, dtype=torch.float64), torch.zeros((3, 4), dtype=torch.int32)
    assert _warp.held_bytes(a, (b, None, [a[:2]]), 7) == 80 + 48 + 80


def _calls(x: torch.Tensor) -> list:
    k = min(8, x.shape[0])
    return [pcops.knn(x, x, k), pcops.knn(x[: x.shape[0] // 2 + 1], x, k), pcops.ball_query(x, x, 0.3, 16),
            pcops.farthest_point_sample(x, x.shape[0] // 4 + 1, start_idx=0), pcops.knn_graph(x, 6),
            pcops.radius_aggregate(x, x, x.square(), 0.3, weights="uniform"), pcops.chamfer_distance(x, x.flip(0) * 0.9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_clouds_of_many_sizes_in_turn_are_kept_whole(gen, monkeypatch, dtype):
    """40 sizes (100-2,000 points: scans and kept trees) in turn, three passes: the second makes
    their launches, the third makes none; a pass of 150 sizes never seen again makes only what
    serves a range of sizes, and a pass of 150 other new sizes in those ranges makes none; every
    call equals the same call with launches packed anew."""
    made = []
    real = _warp.prepare
    monkeypatch.setattr(_warp, "prepare", lambda *a, **kw: (made.append(a[0]), real(*a, **kw))[1])
    monkeypatch.setattr(_warp, "KEPT", _warp.Kept(_warp.KEEP_PREPARED, _warp.KEEP_BYTES))
    clouds = [torch.rand(n, 3, generator=gen, dtype=dtype) * 2 - 1 for n in [*range(100, 130), *range(1990, 2000)]]

    def check(x):
        got = _calls(x)
        monkeypatch.setattr(_warp, "PREPARED", [False])
        want = _calls(x)
        monkeypatch.setattr(_warp, "PREPARED", [True])
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
            assert torch.equal(a, b)

    for x in clouds[:2]:
        check(x)  # (every kernel loaded: their first runs go through the general path)
    counts = []
    for _ in range(3):
        made.clear()
        for x in clouds:
            check(x)
        counts.append(len(made))
    assert counts[1] > 0 and counts[2] == 0, counts
    assert len(_warp.KEPT.keys()) <= _warp.KEEP_PREPARED
    made.clear()
    for n in range(400, 700, 2):
        check(torch.rand(n, 3, generator=gen, dtype=dtype))
    assert {k.key for k in made} <= _RANGES, sorted({k.key for k in made})  # (only what serves a range of sizes)
    made.clear()
    for n in range(401, 700, 2):  # (sizes never seen, in the ranges of those made above)
        check(torch.rand(n, 3, generator=gen, dtype=dtype))
    assert not made, sorted({k.key for k in made})


# The kernels of the kept objects that serve a range of sizes: a kept tree's (pcops.ops.neighbours.nearest._kdtree._SmallTree),
# bucket FPS's (pcops.ops.sampling.fps._Bucket), chamfer's grids (pcops.ops.neighbours.nearest._costs._grid_nearest)
_RANGES = {"_load_kernel__locals__load", "_build_kernels__locals__order", "_build_kernels__locals__build", "_search_kernel__locals__search",
           "_kernels__locals__sample", "_kernels__locals__grid_nearest"}
