"""The kept cell lists of small CPU clouds (``_kept_cells``: one build launch into buffers kept for
a range of sizes, and kept scan launches): the same lists as ``_cells.CellList``, so the same
rows, counts and errors as the general path and the float64 reference, for clouds of sizes and
radii in turn, adversarial clouds, non-finite points, and every thread count."""

import importlib

import pytest
import torch

import pcops
from pcops import _warp
from pcops.ops.neighbours import _cells, _kept_cells
from tests import reference
from tests.op_suite import F64
from tests.reference import CLOUDS, cloud

ball_search = importlib.import_module("pcops.ops.neighbours._ball_search")


def calls(q, p, r, validate=True):
    """ball_query, ball_queries (one group of radii, then two) and the by-index search of q in p."""
    return [lambda: pcops.ball_query(q, p, r, 16, validate=validate),
            lambda: pcops.ball_queries(q, p, (r, 0.7 * r), (6, 12), validate=validate),
            lambda: pcops.ball_queries(q, p, (0.3 * r, r), (4, 9), validate=validate),
            lambda: torch.ops.pcops.ball_query_by_index(q, p, r, 10, validate, None, None)]


def leaves(x):
    return torch.utils._pytree.tree_leaves(x)


def assert_kept_equals_general(monkeypatch, call, launched=None):
    """``call()`` on kept lists equals the general path's; ``launched``: cleared, then the kernels
    that the kept call launched through ``_warp.launch`` (not prepared launches)."""
    if launched is not None:
        real_launch = _warp.launch
        launched.clear()
        monkeypatch.setattr(_warp, "launch", lambda *a, **kw: (launched.append(a[0].key), real_launch(*a, **kw))[1])
        got = call()
        monkeypatch.setattr(_warp, "launch", real_launch)
    else:
        got = call()
    monkeypatch.setattr(ball_search, "KEPT_LISTS", [False])
    want = call()
    monkeypatch.setattr(ball_search, "KEPT_LISTS", [True])
    for a, b in zip(leaves(got), leaves(want), strict=True):
        assert torch.equal(a, b)
    return got


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_kept_lists_equal_the_general_path_for_sizes_and_radii_in_turn(gen, monkeypatch, dtype, threads):
    """Clouds of sizes growing and shrinking in turn (past the every-pair scan, within one
    capacity and across two) and radii never seen before: every call after a size's first
    builds and scans what was kept (no launch packed anew: no ``_warp.launch``), and equals the
    general path (a ``CellList`` a call) and, in float64, the reference."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sizes = [(900, 800), (1000, 1024), (1024, 700), (760, 990), (2000, 1500), (1100, 1900), (990, 1000)]
        for turn, (m, n) in enumerate(sizes * 2):
            q = torch.rand(m, 3, generator=gen, dtype=dtype) * 2 - 1
            p = torch.rand(n, 3, generator=gen, dtype=dtype) * 2 - 1
            r = 0.08 + 0.01 * turn
            assert m * n > ball_search.SCAN_PAIRS
            launched, got = [], []
            for call in calls(q, p, r):
                got.append(assert_kept_equals_general(monkeypatch, call, launched))
                if turn >= len(sizes):  # (each capacity's plan and scans made on their second sightings)
                    assert not launched, launched
            if dtype is F64:
                _, ref_idx, ref_counts = reference.ball_query(q, p, r, 16)
                assert torch.equal(got[0].idx, ref_idx) and torch.equal(got[0].counts, ref_counts)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kind", CLOUDS)
def test_kept_lists_of_adversarial_clouds_equal_the_reference(gen, monkeypatch, kind):
    """Far, clustered, duplicate, isolated points and a radius past the cloud (the crowded balls
    of the last take the kd-tree): the general path's rows and the float64 reference's, on every
    call of the shapes."""
    q, p, r = cloud(kind, gen, 800, 900)
    _, ref_idx, ref_counts = reference.ball_query(q, p, r, 16)
    for _ in range(3):
        got = [assert_kept_equals_general(monkeypatch, call) for call in calls(q, p, r)]
        assert torch.equal(got[0].idx, ref_idx) and torch.equal(got[0].counts, ref_counts)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_a_kept_list_is_the_cell_list_of_the_same_clouds(gen, dtype):
    """A plan's build: the same frame, cells a side, order, starts and rows as a ``CellList`` of the
    same clouds and radius (its cells in x, y and z of flat, thin and round clouds, with points
    outside the queries' reach), and the reference points in that order."""
    plan = _kept_cells.Plan.make(dtype, 4096)
    for shape, r in (((1, 1, 1), 0.1), ((1, 1, 0), 0.05), ((1e-3, 1, 1e-3), 0.2), ((5, 1, 1), 0.3), ((1, 1, 1), 3.0)):
        p = (torch.rand(3000, 3, generator=gen, dtype=dtype) * 2 - 1) * torch.tensor(shape, dtype=dtype)
        q = p[:1200] * 0.5
        host = plan.extent(q, p)
        assert host == _cells.extent_of(q, p, None, None)[1]
        assert not plan.build(q, p, r, host)
        cells = _cells.CellList(q, p, r, None, None)
        rows, starts, frame, groups, points, order = plan.fields()
        assert list(plan.dims) == cells.shape and torch.equal(frame, cells.frame)
        assert torch.equal(order[:3000], cells.order) and torch.equal(rows[:1200], cells.rows)
        assert torch.equal(starts[:cells.total + 1], cells.starts[:cells.total + 1])
        assert torch.equal(points[:3000], p[cells.order]) and not groups.any()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_points_raise_or_equal_the_general_path(gen, monkeypatch, value):
    """A NaN or infinite coordinate at any point of either cloud raises the error naming it on the
    shapes' first and kept calls (the build's flag), and a finite call after it gets the
    reference (the flag does not stay set); with ``validate=False`` the kept list's rows equal
    the general path's."""
    q, p = torch.rand(800, 3, generator=gen) * 2 - 1, torch.rand(900, 3, generator=gen) * 2 - 1
    for which, row in (("query", 0), ("query", 799), ("ref", 450), ("ref", 899)):
        bad_q, bad_p = q.clone(), p.clone()
        (bad_q if which == "query" else bad_p)[row, row % 3] = value
        for _ in range(3):
            with pytest.raises(ValueError, match=f"{which} contains NaN or inf"):
                pcops.ball_query(bad_q, bad_p, 0.1, 16)
            with pytest.raises(ValueError, match=f"{which} contains NaN or inf"):
                pcops.ball_queries(bad_q, bad_p, (0.1, 0.05), (8, 4))
            for call in calls(bad_q, bad_p, 0.1, validate=False):
                assert_kept_equals_general(monkeypatch, call)
        _, ref_idx, ref_counts = reference.ball_query(q.double(), p.double(), 0.1, 16)
        got = pcops.ball_query(q, p, 0.1, 16)
        assert torch.equal(got.counts, ref_counts)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_kept_lists_at_extreme_scales_and_radii_equal_the_general_path(gen, monkeypatch, dtype):
    """Clouds at scales of 1e-30 to 1e30 with radii from the dtype's smallest normal numbers to its
    largest (the by-index search takes every radius on a kept list: it never walks the tree),
    points on a line and all at one place: the general path's rows and counts."""
    info = torch.finfo(dtype)
    for scale in (1e-30, 1.0, 1e30):
        p = (torch.rand(900, 3, generator=gen, dtype=dtype) * 2 - 1) * scale
        q = (torch.rand(800, 3, generator=gen, dtype=dtype) * 2 - 1) * scale
        for r in (info.tiny, 1e-3 * scale, 0.1 * scale, 3.0 * scale, info.max):
            for _ in range(2):
                assert_kept_equals_general(monkeypatch, lambda: torch.ops.pcops.ball_query_by_index(q, p, float(r), 8, False, None, None))
                assert_kept_equals_general(monkeypatch, lambda: pcops.ball_query(q, p, float(r), 8, validate=False))
    line = torch.zeros(900, 3, dtype=dtype)
    line[:, 0] = torch.linspace(0, 1, 900, dtype=dtype)
    one = torch.ones(900, 3, dtype=dtype)
    for _ in range(2):
        got = assert_kept_equals_general(monkeypatch, lambda: pcops.ball_query(line, line, 0.01, 8))
        assert torch.equal(got.counts, reference.ball_query(line.double(), line.double(), 0.01, 8)[2])
        got = assert_kept_equals_general(monkeypatch, lambda: torch.ops.pcops.ball_query_by_index(one, one, 0.5, 8, False, None, None))
        assert torch.equal(got[1], torch.full((900,), 900))


def test_kept_scans_of_radii_groups_with_other_caps_of_one_width(gen, monkeypatch):
    """Two groups of radii whose caps differ but sum to the same width (4 + 12, 8 + 8, 12 + 4), each
    called in turn on kept lists: each radius' columns and counts are the general path's and
    the reference's (a kept scan serves only the caps it was made for)."""
    q, p = torch.rand(800, 3, generator=gen) * 2 - 1, torch.rand(900, 3, generator=gen) * 2 - 1
    for _ in range(3):
        for caps in ((4, 12), (8, 8), (12, 4)):
            got = assert_kept_equals_general(monkeypatch, lambda: pcops.ball_queries(q, p, (0.03, 0.12), caps))
            for g, (r, k) in enumerate(zip((0.03, 0.12), caps)):
                _, ref_idx, ref_counts = reference.ball_query(q.double(), p.double(), r, k)
                assert torch.equal(got[g].counts, ref_counts) and torch.equal(got[g].idx, ref_idx)


def test_threads_keep_lists_of_their_own(gen):
    """Four threads calling on clouds of sizes in turn at once (each thread's plans and scans kept
    for it): every result equals the same call's on the main thread."""
    import threading

    clouds = [torch.rand(n, 3, generator=gen) * 2 - 1 for n in (800, 1000, 1500, 2000)]
    want = [pcops.ball_query(p, p, 0.1, 16) for p in clouds]
    errors = []

    def worker(t):
        try:
            for turn in range(12):
                c = (t + turn) % len(clouds)
                got = pcops.ball_query(clouds[c], clouds[c], 0.1, 16)
                if not all(torch.equal(a, b) for a, b in zip(got, want[c])):
                    errors.append((t, turn))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(repr(err))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
