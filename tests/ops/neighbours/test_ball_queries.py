"""pcops.ball_queries against a dense float64 reference (the shared op suite, plus equality with
ball_query at each radius and the grouping of radii)."""

import math

import pytest
import torch

import pcops
from tests import reference
from tests.op_suite import F64, OpSuite, pack, pad
from tests.ops.neighbours import test_ball_query as single  # (a module: its TestBallQuery is not collected twice)
from tests.ops.neighbours.test_ball_query import padded_calls

RADII = (0.5, 1.0, 1.7, 3.0)  # times a cloud's radius: two radii within GROUP_RATIO of each other, two alone
KS = (3, 6, 5, 9)


def _flat(results) -> tuple:
    """The tensors of a tuple of BallQuery results, radius by radius."""
    return tuple(t for result in results for t in result)


class TestBallQueries(OpSuite):
    """pcops.ball_queries: each radius' result equals ball_query's and the float64 reference."""

    differentiable = ("query", "ref")

    def inputs(self, kind, gen):
        q, p, r = reference.cloud(kind, gen)
        return dict(query=q, ref=p, radii=[reference.safe_radius(q, p, f * r, gap=1e-4) for f in RADII])

    def run(self, query, ref, radii):
        return _flat(pcops.ball_queries(query, ref, radii, KS))

    def reference(self, query, ref, radii):
        return _flat(reference.ball_query(query, ref, r, k) for r, k in zip(radii, KS))

    def compare(self, out, expected, dtype, inputs=None):
        assert len(out) == len(expected) and len(out) % 3 == 0
        for g in range(len(out) // 3):
            part, want = out[3 * g:3 * g + 3], expected[3 * g:3 * g + 3]
            single.TestBallQuery.compare(self, part, want, dtype, None if inputs is None else dict(inputs, radius=inputs["radii"][g]))

    def grad_inputs(self, gen):
        q, p = torch.rand(12, 3, generator=gen, dtype=F64), torch.rand(30, 3, generator=gen, dtype=F64)
        return dict(query=q, ref=p, radii=[reference.safe_radius(q, p, r, gap=1e-3) for r in (0.2, 0.35, 0.5, 0.9)])

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            q, p = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(30, 3, generator=gen, dtype=dtype)
            qg, rg = torch.randint(0, 3, (20,), generator=gen, dtype=torch.int32), torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
            cases.append((torch.ops.pcops.ball_queries.default, (q, p, [0.3, 0.1, 0.5, 0.2], [4, 2, 6, 40], True, None, None)))
            cases.append((torch.ops.pcops.ball_queries.default, (q, p, [0.3], [5], True, qg, rg)))
            cases.append((torch.ops.pcops.ball_queries.default, (q, p, [0.4, 0.25], [40, 3], False, qg, rg)))
        return cases

    def compile_calls(self, gen):
        def fn(query, ref, ql, rl):
            return _flat(pcops.ball_queries(query, ref, [0.3, 0.1, 0.2], [5, 3, 4], query_lengths=ql, ref_lengths=rl))

        return fn, padded_calls(gen)

    def batched(self, gen):
        qs = [torch.rand(m, 3, generator=gen, dtype=F64) for m in (9, 0, 7, 5)]
        ps = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (12, 5, 0, 3)]
        radii = [0.45, 0.2, 0.3]
        expected = [_flat(reference.ball_query(q, p, r, k) for r, k in zip(radii, KS)) for q, p in zip(qs, ps)]
        (q, ql), (p, pl) = pad(qs), pad(ps)
        out = _flat(pcops.ball_queries(q, p, radii, KS[:3], query_lengths=ql, ref_lengths=pl))
        padded = [tuple(t[b, : len(qs[b])] for t in out) for b in range(len(qs))]
        qp, qb, q_pos = pack(qs, gen)
        pp, pb, p_pos = pack(ps, gen)
        out = _flat(pcops.ball_queries(qp, pp, radii, KS[:3], query_batch=qb, ref_batch=pb))
        offsets = [0] + torch.tensor([len(x) for x in ps]).cumsum(0).tolist()
        to_local = torch.empty_like(p_pos)  # packed ref row -> row within its sample
        to_local[p_pos] = torch.arange(p_pos.numel()) - torch.tensor(offsets[:-1]).repeat_interleave(torch.tensor([len(x) for x in ps]))
        packed, at = [], 0
        for x in qs:
            rows = q_pos[at : at + len(x)]
            sample = []
            for d, idx, counts in zip(out[0::3], out[1::3], out[2::3]):
                sample += [d[rows], torch.where(idx[rows] >= 0, to_local[idx[rows].clamp(min=0)], -1), counts[rows]]
            packed.append(tuple(sample))
            at += len(x)
        return expected, padded, packed

    def bad_inputs(self, gen):
        q, p = torch.rand(4, 3, generator=gen), torch.rand(6, 3, generator=gen)
        bqs = pcops.ball_queries
        return {
            "empty radii": (lambda: bqs(q, p, [], 3), ValueError, "radii must not be empty"),
            "zero radius": (lambda: bqs(q, p, [0.2, 0.0], 3), ValueError, r"radii\[1\] must be finite and > 0"),
            "negative radius": (lambda: bqs(q, p, (-0.1,), 3), ValueError, r"radii\[0\] must be finite and > 0"),
            "NaN radius": (lambda: bqs(q, p, [0.1, float("nan")], 3), ValueError, r"radii\[1\] must be finite and > 0"),
            "tensor radii": (lambda: bqs(q, p, torch.tensor([0.1, 0.2]), 3), TypeError, "radii must be a sequence of numbers"),
            "number radii": (lambda: bqs(q, p, 0.2, 3), TypeError, "radii must be a sequence of numbers"),
            "tensor in radii": (lambda: bqs(q, p, [0.1, torch.tensor(0.2)], 3), TypeError, r"radii\[1\] must be a number"),
            "max_neighbors length": (lambda: bqs(q, p, [0.1, 0.2], [3]), ValueError, r"max_neighbors must be an int or have one entry per radius \(2 radii\), got 1"),
            "zero max_neighbors": (lambda: bqs(q, p, [0.1, 0.2], 0), ValueError, "max_neighbors must be >= 1"),
            "zero in max_neighbors": (lambda: bqs(q, p, [0.1, 0.2], [3, 0]), ValueError, r"max_neighbors\[1\] must be >= 1"),
            "float in max_neighbors": (lambda: bqs(q, p, [0.1, 0.2], [3, 2.0]), TypeError, r"max_neighbors\[1\] must be an int"),
            "2-d query": (lambda: bqs(q[:, :2], p, [0.2], 3), ValueError, "query must be a tensor of shape"),
            "devices": (lambda: bqs(q, p.to("meta"), [0.2], 3), ValueError, "same device"),
            "batch alone": (lambda: bqs(q, p, [0.2], 3, ref_batch=torch.zeros(6, dtype=torch.long)), ValueError, "query_batch and ref_batch"),
        }


def _assert_equal(a, b, what=""):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), what


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_ball_queries_equal_ball_query_at_each_radius_in_every_layout(gen, dtype):
    # unsorted radii, a repeat, radii grouped and alone; 2,400 queries: CPU launches split across threads
    radii, ks = [0.08, 0.02, 0.3, 0.08, 0.05, 0.11], [16, 3, 40, 2, 8, 1]
    q, p = torch.rand(2400, 3, generator=gen, dtype=dtype), torch.rand(3000, 3, generator=gen, dtype=dtype)
    qb, pb = torch.randint(0, 3, (2400,), generator=gen), torch.randint(0, 3, (3000,), generator=gen)
    ql, pl = torch.tensor([800, 0, 513]), torch.tensor([1000, 700, 0])
    layouts = {
        "single": ((q, p), {}),
        "packed": ((q, p), dict(query_batch=qb, ref_batch=pb)),
        "padded": ((q.view(3, 800, 3), p.view(3, 1000, 3)), dict(query_lengths=ql, ref_lengths=pl)),
    }
    for name, (args, kw) in layouts.items():
        results = pcops.ball_queries(*args, radii, ks, **kw)
        assert len(results) == len(radii) and all(isinstance(r, pcops.BallQuery) for r in results)
        for g, (r, k) in enumerate(zip(radii, ks)):
            _assert_equal(results[g], pcops.ball_query(*args, r, k, **kw), f"{name}, radius {r}")
            assert all(t.is_contiguous() for t in results[g])


def test_max_neighbors_as_one_int_applies_to_every_radius(gen):
    q, p = torch.rand(50, 3, generator=gen, dtype=F64), torch.rand(80, 3, generator=gen, dtype=F64)
    one = pcops.ball_queries(q, p, (0.2, 0.4), 7)
    _assert_equal(_flat(one), _flat(pcops.ball_queries(q, p, [0.2, 0.4], [7, 7])))
    assert one[0].idx.shape == one[1].idx.shape == (50, 7)


def test_numpy_radii_and_counts_work(gen):
    np = pytest.importorskip("numpy")
    q, p = torch.rand(30, 3, generator=gen, dtype=F64), torch.rand(40, 3, generator=gen, dtype=F64)
    got = pcops.ball_queries(q, p, np.array([0.2, 0.5]), np.array([4, 6]))
    _assert_equal(_flat(got), _flat(pcops.ball_queries(q, p, [0.2, 0.5], [4, 6])))


@pytest.mark.parametrize("ratio", [1.0, float("inf")], ids=["a cell list per radius", "one cell list for all"])
def test_the_grouping_of_radii_never_changes_the_results(gen, monkeypatch, ratio):
    import importlib

    module = importlib.import_module("pcops.ops.neighbours._ball_search")
    monkeypatch.setattr(module, "SCAN_PAIRS", 0)  # cell lists, not the every-pair scan of small clouds
    radii, ks = [0.01, 0.05, 0.25, 1.0, 2.5, 0.26], [4, 8, 16, 64, 128, 5]
    q, p = torch.rand(300, 3, generator=gen, dtype=F64), torch.rand(500, 3, generator=gen, dtype=F64)
    want = pcops.ball_queries(q, p, radii, ks)
    monkeypatch.setattr(module, "GROUP_RATIO", ratio)
    _assert_equal(_flat(pcops.ball_queries(q, p, radii, ks)), _flat(want))


def test_radii_within_the_group_ratio_share_a_cell_list_and_others_do_not():
    import importlib

    groups = importlib.import_module("pcops.ops.neighbours._ball_search").groups
    ratio = importlib.import_module("pcops.ops.neighbours._ball_search").GROUP_RATIO
    assert groups([0.01, 0.05, 0.25, 1.0, 2.5, 5.0]) == [[0], [1], [2], [3], [4, 5]] and ratio == 2.0
    assert groups([0.3, 0.1, 0.2, 0.1]) == [[1, 3, 2], [0]]  # by ascending radius, then index


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_ball_queries_of_a_non_finite_query_find_nothing_without_validation(gen, value):
    p = torch.rand(40, 3, generator=gen, dtype=F64)
    q = torch.full((2, 3), 0.5, dtype=F64)
    q[0, 1] = value
    for dists, idx, counts in pcops.ball_queries(q, p, [0.3, 2.0, 0.4], 4, validate=False):
        assert counts[0] == 0 and bool((idx[0] == -1).all()) and bool(dists[0].isinf().all())
    assert pcops.ball_queries(q, p, [2.0], 4, validate=False)[0].counts[1] == 40


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("scan", [True, False], ids=["every pair", "cell list"])
def test_wide_rows_are_the_rows_of_the_reference(monkeypatch, dtype, scan):
    """Rows of up to 300 columns, on integer points (exact distances, many equal, duplicates
    among them): the float64 reference's rows, ties by the smaller index, for rows that stay
    short, fill exactly and overflow, one radius a row and several radii side by side in one
    group's row, by the every-pair scan and by the cell list."""
    import importlib

    module = importlib.import_module("pcops.ops.neighbours._ball_search")
    if not scan:
        monkeypatch.setattr(module, "SCAN_PAIRS", 0)
    g = torch.arange(6, dtype=dtype)
    grid = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    p = torch.cat([grid, grid[::7]])  # 247 points, 31 of them twice
    q = torch.cat([grid[::9], grid[::11] + 0.5])
    for radius in (1.5, 2.5, 10.0):  # about 20, 60 and every point within it
        for k in (31, 32, 33, 64, 300):
            got = pcops.ball_query(q, p, radius, k)
            dists, idx, counts = reference.ball_query(q.double(), p.double(), radius, k)
            assert torch.equal(got.idx, idx) and torch.equal(got.counts, counts), (radius, k)
            torch.testing.assert_close(got.dists.double(), dists)
    overflow = reference.ball_query(q.double(), p.double(), 2.5, 64)[2] > 64
    assert overflow.any() and (~overflow).any()  # (rows that overflow and rows that do not)
    monkeypatch.setattr(module, "GROUP_RATIO", float("inf"))  # one group: its radii's rows side by side
    radii, caps = [2.0, 2.5, 3.0, 10.0], [8, 32, 64, 300]
    for (dists, idx, counts), radius, k in zip(pcops.ball_queries(q, p, radii, caps), radii, caps, strict=True):
        want = reference.ball_query(q.double(), p.double(), radius, k)
        assert torch.equal(idx, want[1]) and torch.equal(counts, want[2]), (radius, k)
        torch.testing.assert_close(dists.double(), want[0])


@pytest.mark.parametrize("path", ["every_pair", "cell_list", "kd_tree"])
def test_rows_of_many_columns_keep_the_closest_of_crowded_balls(gen, path, monkeypatch):
    """K about and above the heap rows' threshold (a row appended, then kept as a max-heap and
    sorted at the end: ``_ball_search.HEAP_FROM``), balls that hold the whole cloud, many more
    points than K, and fewer than K, repeated points (ties by the smaller index), every pair
    measured, through the cell list and on the kd-tree (``_ball_tree``, every radius): the
    float64 reference's rows, counts and distances, ball_query equal to each of ball_queries'
    columns; float32 equal to the reference but where two of its distances tie in float32."""
    from pcops.ops.neighbours import _ball_search, _ball_tree

    dense = path == "every_pair"
    monkeypatch.setattr(_ball_tree, "crowded", lambda *args: path == "kd_tree")
    m, n = (60, 300) if dense else (300, 2000)
    assert (m * n <= _ball_search.SCAN_PAIRS) == dense
    k0 = _ball_search.HEAP_FROM
    caps = [4, k0 - 1, k0, k0 + 1, 2 * k0, 4 * k0]
    for dtype in (torch.float64, torch.float32):
        p = torch.rand(n, 3, generator=gen, dtype=F64)
        p[n // 2: n // 2 + n // 6] = p[: n // 6]  # (repeated points: ties)
        q = torch.cat([p[:10], torch.rand(m - 10, 3, generator=gen, dtype=F64)])
        radii = [reference.safe_radius(q, p, r, gap=1e-6) for r in (0.1, 0.2, 0.35, 0.6, 1.0, 2.0)]  # (2.0: the whole unit cube)
        qd, pd = q.to(dtype), p.to(dtype)
        out = pcops.ball_queries(qd, pd, radii, caps)
        for g, (r, k) in enumerate(zip(radii, caps)):
            want_d, want_i, want_c = reference.ball_query(qd.double(), pd.double(), r, k)
            got = out[g]
            one = pcops.ball_query(qd, pd, r, k)
            assert torch.equal(one.idx, got.idx) and torch.equal(one.dists, got.dists) and torch.equal(one.counts, got.counts)
            assert torch.equal(got.counts, want_c)
            assert torch.allclose(got.dists.double(), want_d, rtol=1e-6, atol=0) or dtype == F64 and torch.equal(got.dists, want_d)
            if dtype == F64:
                assert torch.equal(got.idx, want_i), (r, k)
            else:  # where the float64 order differs, the two points' float32 distances tie
                differ = got.idx != want_i
                d32 = torch.linalg.norm(qd[:, None] - pd[None], dim=-1)
                rows = differ.nonzero()[:, 0]
                assert torch.equal(d32[rows].gather(1, got.idx[differ].view(-1, 1)).view(-1), d32[rows].gather(1, want_i[differ].view(-1, 1)).view(-1))
            assert bool((got.counts >= k).any()) or k <= 4 or r < 0.6  # (crowded balls are met)


def _tree_calls(monkeypatch) -> list:
    """The radii that :func:`_ball_tree.search` is called for, recorded as it runs."""
    from pcops.ops.neighbours import _ball_tree

    calls, search = [], _ball_tree.search

    def recorded(query, ref, rows, heap_from):
        calls.extend(float(row[0]) for row in rows)
        return search(query, ref, rows, heap_from)

    monkeypatch.setattr(_ball_tree, "search", recorded)
    return calls


@pytest.mark.parametrize("cloud", ["uniform", "lattice", "flat", "far", "clusters", "duplicates", "specks", "tiny", "huge"])
def test_crowded_balls_on_the_kd_tree_equal_the_cell_list(gen, cloud, monkeypatch):
    """Every radius on the kd-tree (``_ball_tree``) against every radius through the cell list,
    ball_queries, ball_query and radius_graph in both dtypes: the same rows, counts and
    distances, bit for bit, on clouds with float32 ties (a lattice, a duplicated cloud), a flat
    one, one far from the origin (coordinates about 10^4 times the radii), clusters, half the
    points within 1e-20 of the origin (float32 squares among the subnormal numbers: rows of ties
    there), and points placed at exactly a radius from a query; float32 clouds whose radii's
    squares are subnormal or overflow keep the cell list (``_ball_tree.in_range``), float64 ones
    take the tree; and the float64 reference's counts and rows (but the lattice's, whose tied
    distances the reference rounds otherwise)."""
    from pcops.ops.neighbours import _ball_tree

    n, m = 1500, 400
    p = torch.rand(n, 3, generator=gen, dtype=F64)
    if cloud == "lattice":
        p = (p * 6).round() / 6
    elif cloud == "flat":
        p[:, 2] = 0.25
    elif cloud == "far":
        p = p + 1e4
    elif cloud == "clusters":
        p = (torch.rand(8, 3, generator=gen, dtype=F64)[torch.randint(0, 8, (n,), generator=gen)] + 0.05 * p)
    elif cloud == "duplicates":
        p[n // 2:] = p[: n - n // 2]
    elif cloud == "specks":  # half the points within 1e-20 of the origin: float32 squares among the subnormal numbers
        p[: n // 2] *= 1e-20
    q = torch.cat([p[:m // 2], torch.rand(m - m // 2, 3, generator=gen, dtype=F64) + (1e4 if cloud == "far" else 0)])
    radii, caps = [0.08, 0.3, 0.6, 2.0], [8, 32, 64, 256]
    # points at exactly 0.3 (float32-exact offsets) from the first queries: the boundary counted alike
    p[-8:] = q[:8] + torch.tensor([0.3, 0.0, 0.0], dtype=F64)
    scale = {"tiny": 1e-21, "huge": 1e17}.get(cloud, 1.0)  # (float32 squares of the radii subnormal / past the largest float)
    p, q, radii = p * scale, q * scale, [r * scale for r in radii]
    for dtype in (torch.float32, F64):
        qd, pd = q.to(dtype), p.to(dtype)
        got = {}
        for path in ("cell_list", "kd_tree", "unchained"):  # ("unchained": each query's walk from the radius, not the query before's bound)
            monkeypatch.setattr(_ball_tree, "crowded", lambda *args, path=path: path != "cell_list")
            monkeypatch.setattr(_ball_tree, "CHAIN", [int(path != "unchained")])
            calls = _tree_calls(monkeypatch)
            got[path] = (pcops.ball_queries(qd, pd, radii, caps), [pcops.ball_query(qd, pd, r, k) for r, k in zip(radii, caps)],
                         pcops.radius_graph(pd, 0.3 * scale, max_neighbors=32))
            taken = [r for r in radii if _ball_tree.in_range(r, dtype)] if path != "cell_list" else []  # (the others: the cell list)
            assert sorted(set(calls)) == sorted(taken), calls
            assert len(taken) == (0 if path == "cell_list" else 4 if dtype == F64 or scale == 1.0 else 0)
        for path in ("kd_tree", "unchained"):
            for a, b in zip(_flat(got["cell_list"][0]) + _flat(got["cell_list"][1]) + tuple(got["cell_list"][2]),
                            _flat(got[path][0]) + _flat(got[path][1]) + tuple(got[path][2]), strict=True):
                assert torch.equal(a, b), path
        for (dists, idx, counts), r, k in zip(got["kd_tree"][0], radii, caps, strict=True):
            want = reference.ball_query(qd.double(), pd.double(), r, k)
            assert torch.equal(counts, want[2]) or dtype != F64, (cloud, r)
            assert torch.equal(idx, want[1]) or dtype != F64 or cloud == "lattice", (cloud, r)  # (the lattice's ties: the reference's rounding)
            if dtype == F64:
                torch.testing.assert_close(dists, want[0], rtol=1e-14, atol=0)


def test_crowded_radii_take_the_kd_tree(monkeypatch):
    """The default choice (``_ball_tree.crowded``): of GeoTransolver's six radii over a unit
    cube of 4,096 points, those whose balls hold 128 points or more and their K take the tree
    (0.25 and up), the others the cell list; the same cube as a batch of two halves 1.0 and up,
    a tree a sample (0.25's 1,024 balls a sample hold too few points together for a batch's
    threshold, ``SAMPLE_WORK``), padded or packed with sparse ids; a by-index search and a small cloud (every pair measured) never do."""
    gen = torch.Generator().manual_seed(3)
    p, q = torch.rand(4096, 3, generator=gen), torch.rand(2048, 3, generator=gen)
    radii, caps = [0.01, 0.05, 0.25, 1.0, 2.5, 5.0], [4, 8, 16, 64, 128, 256]
    calls = _tree_calls(monkeypatch)
    pcops.ball_queries(q, p, radii, caps)
    assert sorted(calls) == [0.25, 1.0, 2.5, 5.0]
    calls.clear()
    pcops.ball_queries(q.view(2, 1024, 3), p.view(2, 2048, 3), radii, caps)  # (padded: a batch)
    assert sorted(set(calls)) == [1.0, 2.5, 5.0] and len(calls) == 6  # (a tree a sample)
    for ids in ((0, 1000), (2**40, 2**40 + 1)):  # (packed, sparse ids and ids past int32: the samples counted, not the largest id)
        calls.clear()
        qb, rb = torch.tensor(ids).repeat_interleave(1024), torch.tensor(ids).repeat_interleave(2048)
        pcops.ball_queries(q, p, radii, caps, query_batch=qb, ref_batch=rb)
        assert sorted(set(calls)) == [1.0, 2.5, 5.0] and len(calls) == 6, ids
    calls.clear()
    pcops.ball_queries(q[:100], p[:500], radii, caps)  # (every pair)
    from pcops.compat import torch_cluster

    torch_cluster.radius(p, q, 0.25, max_num_neighbors=16)  # (the first K by index)
    assert calls == []


def test_clustered_balls_take_the_kd_tree_by_a_sample(monkeypatch):
    """Balls crowded in clusters whose box says they spread (``_ball_tree.sampled``, searches of
    ``SAMPLE_PAIRS`` pairs or more): 32,768 points in 16 tight clusters, 4,096 queries among
    them, a radius whose ball would hold 30 points of the box spread evenly but holds hundreds:
    it takes the tree, one cloud or a batch of two, and the same cloud spread evenly keeps the
    cell list; every result equal to the cell list's."""
    from pcops.ops.neighbours import _ball_tree

    gen = torch.Generator().manual_seed(9)
    n, m, r, k = 32768, 4096, 0.06, 32
    assert m * n >= _ball_tree.SAMPLE_PAIRS
    centres = torch.rand(16, 3, generator=gen)
    clustered = centres[torch.randint(0, 16, (n,), generator=gen)] + 0.02 * torch.randn(n, 3, generator=gen)
    spread = torch.rand(n, 3, generator=gen)
    crowded = _ball_tree.crowded
    for cloud, taken in ((clustered, True), (spread, False)):
        q = cloud[torch.randperm(n, generator=gen)[:m]] + 0.001
        box = (cloud.amax(0) - cloud.amin(0)).prod()
        assert n * 4.19 * r**3 / box < _ball_tree.CROWDED  # (the box alone: not crowded)
        held = _ball_tree.sampled(q, cloud, None, None, [r])[0]
        true = float(pcops.ball_query(q, cloud, r, 1).counts.double().mean())
        assert 0.5 * true <= held <= 2.0 * true, (held, true)
        for layout in ("one", "batch"):
            args = (q, cloud) if layout == "one" else (q.view(2, m // 2, 3), cloud.view(2, n // 2, 3))
            calls = _tree_calls(monkeypatch)
            got = pcops.ball_query(*args, r, k)
            assert bool(calls) == taken, (layout, held)
            monkeypatch.setattr(_ball_tree, "crowded", lambda *a: False)
            want = pcops.ball_query(*args, r, k)
            monkeypatch.setattr(_ball_tree, "crowded", crowded)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), layout


def test_the_sample_of_a_cloud_queried_in_itself_counts_each_point_once(monkeypatch):
    """``ball_query(p, p)`` of ``SAMPLE_PAIRS`` pairs or more: a sampled query that is also a sampled
    point finds itself, which counts once (not as a share of the ball): the estimate of a tiny
    radius is 1 point, of a radius holding about 16 within 2x of the true mean, and such balls
    keep the cell list (no tree), their rows equal to the reference's."""
    from pcops.ops.neighbours import _ball_search, _ball_tree

    monkeypatch.setattr(_ball_search, "KEPT_LISTS", [False])  # (the general path's choice)
    gen = torch.Generator().manual_seed(3)
    for n in (11600, 16384, 20000):
        p = torch.rand(n, 3, generator=gen, dtype=torch.float64)
        assert n * n >= _ball_tree.SAMPLE_PAIRS
        r = (16 * 3 / (4 * math.pi * n)) ** (1 / 3)  # (a ball of about 16 points of the unit cube)
        tiny, held = _ball_tree.sampled(p, p, None, None, [1e-9, r])
        assert tiny == 1.0
        got = pcops.ball_query(p, p, r, 32)
        true = float(got.counts.double().mean())
        assert 0.5 * true <= held <= 2.0 * true, (n, held, true)
        calls = _tree_calls(monkeypatch)
        again = pcops.ball_query(p, p, r, 32)
        assert not calls
        idx = torch.cdist(p[::97], p).le(r)
        assert torch.equal(again.counts[::97], idx.sum(1)) and torch.equal(again.idx, got.idx)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_crowded_balls_of_a_batch_on_kd_trees_equal_the_cell_list(gen, layout, monkeypatch):
    """A batch's crowded balls, a kd-tree a sample (``_ball_tree.search_groups``), against the
    cell list and against a loop over the samples: padded clouds with lengths (padding rows
    amid the points, never neighbours), packed clouds in shuffled order with a sample without points and one
    without queries; ball_queries and ball_query, both dtypes, the same rows, counts and
    distances bit for bit."""
    from pcops.ops.neighbours import _ball_tree

    sizes = [(500, 700), (300, 900), (650, 500)]  # (queries, points) a sample
    clouds = [(torch.rand(m, 3, generator=gen, dtype=F64), torch.rand(n, 3, generator=gen, dtype=F64)) for m, n in sizes]
    clouds[1][1][: 300] = clouds[1][1][300: 600]  # (duplicated points: ties)
    radii, caps = [0.1, 0.4, 0.9, 3.0], [8, 32, 64, 200]
    for dtype in (torch.float32, F64):
        if layout == "padded":
            q = torch.full((3, 650, 3), 0.5, dtype=dtype)  # (padding amid the points: never neighbours)
            p = torch.full((3, 900, 3), 0.5, dtype=dtype)
            for b, (cq, cp) in enumerate(clouds):
                q[b, : len(cq)], p[b, : len(cp)] = cq, cp
            kwargs = dict(query_lengths=torch.tensor([m for m, _ in sizes]), ref_lengths=torch.tensor([n for _, n in sizes]))
        else:
            q = torch.cat([c[0] for c in clouds] + [torch.rand(40, 3, generator=gen, dtype=F64)]).to(dtype)  # (sample 3: no points)
            p = torch.cat([c[1] for c in clouds] + [torch.rand(60, 3, generator=gen, dtype=F64)]).to(dtype)  # (sample 4: no queries)
            qb = torch.cat([torch.full((m,), b) for b, (m, _) in enumerate(sizes)] + [torch.full((40,), 3)])
            rb = torch.cat([torch.full((n,), b) for b, (_, n) in enumerate(sizes)] + [torch.full((60,), 4)])
            qs, rs = torch.randperm(len(qb), generator=gen), torch.randperm(len(rb), generator=gen)
            q, p, qb, rb = q[qs], p[rs], qb[qs], rb[rs]
            kwargs = dict(query_batch=qb, ref_batch=rb)
        got = {}
        for path in ("cell_list", "kd_tree"):
            monkeypatch.setattr(_ball_tree, "crowded", lambda *args, path=path: path == "kd_tree")
            calls = _tree_calls(monkeypatch)
            got[path] = _flat(pcops.ball_queries(q, p, radii, caps, **kwargs)) + _flat([pcops.ball_query(q, p, 0.9, 64, **kwargs)])
            assert bool(calls) == (path == "kd_tree")
        for a, b in zip(got["cell_list"], got["kd_tree"], strict=True):
            assert torch.equal(a, b)
        if layout == "padded":  # (and each sample alone)
            for b, (m, n) in enumerate(sizes):
                alone = _flat(pcops.ball_queries(q[b, :m], p[b, :n], radii, caps))
                for whole, one in zip(got["kd_tree"][: len(alone)], alone, strict=True):
                    assert torch.equal(whole[b, :m], one)


def test_crowded_balls_of_strided_clouds(gen, monkeypatch):
    """Column-major and column-strided clouds (views that are not rows of three) take the
    kd-tree as contiguous ones do: the same results as the cell list's and as their contiguous
    copies', ball_query, ball_queries and radius_graph."""
    from pcops.ops.neighbours import _ball_search, _ball_tree

    q = torch.rand(3, 800, generator=gen).t()  # (column-major)
    p = torch.rand(1000, 6, generator=gen)[:, ::2]  # (every other column)
    assert not q.is_contiguous() and not p.is_contiguous() and 800 * 1000 > _ball_search.SCAN_PAIRS  # (past the every-pair scan)
    calls = _tree_calls(monkeypatch)
    got = (_flat(pcops.ball_queries(q, p, [0.1, 0.5], [8, 64])) + tuple(pcops.ball_query(q, p, 0.5, 32))
           + tuple(pcops.radius_graph(q, 0.5, max_neighbors=40)))
    assert sorted(set(calls)) == [0.5]
    want = (_flat(pcops.ball_queries(q.contiguous(), p.contiguous(), [0.1, 0.5], [8, 64])) + tuple(pcops.ball_query(q.contiguous(), p.contiguous(), 0.5, 32))
            + tuple(pcops.radius_graph(q.contiguous(), 0.5, max_neighbors=40)))
    monkeypatch.setattr(_ball_tree, "crowded", lambda *args: False)
    cells = (_flat(pcops.ball_queries(q, p, [0.1, 0.5], [8, 64])) + tuple(pcops.ball_query(q, p, 0.5, 32))
             + tuple(pcops.radius_graph(q, 0.5, max_neighbors=40)))
    for a, b, c in zip(got, want, cells, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_batches_of_negative_sample_ids_unchecked(gen, monkeypatch):
    """Packed sample ids that ``validate=False`` leaves unchecked, all negative (the largest
    -1 or below): no error from the crowded balls' estimate of the samples, the cell list's
    rows either way (the tree's where it is taken), and one id the whole cloud's."""
    from pcops.ops.neighbours import _ball_tree

    q, p = torch.rand(300, 3, generator=gen), torch.rand(700, 3, generator=gen)
    for ids in ([-1], [-1, -5], [-2]):
        qb = torch.tensor(ids)[torch.randint(0, len(ids), (300,), generator=gen)]
        rb = torch.tensor(ids)[torch.randint(0, len(ids), (700,), generator=gen)]
        got = pcops.ball_query(q, p, 0.6, 64, query_batch=qb, ref_batch=rb, validate=False)
        with monkeypatch.context() as patch:
            patch.setattr(_ball_tree, "crowded", lambda *args: False)
            cells = pcops.ball_query(q, p, 0.6, 64, query_batch=qb, ref_batch=rb, validate=False)
        assert all(torch.equal(a, b) for a, b in zip(got, cells))
        if len(ids) == 1:
            assert all(torch.equal(a, b) for a, b in zip(got, pcops.ball_query(q, p, 0.6, 64)))
