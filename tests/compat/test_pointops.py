"""pcops.compat.pointops against float64 brute-force references written from Pointcept's
pointops (libs/pointops: functions/*.py and the CUDA kernels under src/): offset batching,
int32 indices, -1 / 1e5 padding, sqrt distances, the ball query's candidate rule and spread
pick, FPS from each sample's first point, grouping's relative coordinates first, interpolation's
1 / (d + 1e-8) weights, subtraction, aggregation and the attention steps."""

import math
import sys

import numpy as np
import pytest
import torch

from pcops.compat import pointops as po

# ----------------------------------------------------------------------------------------------
# references (float64 loops, no pcops)


def _bounds(offset):
    ends = [int(v) for v in offset]
    return list(zip([0] + ends[:-1], ends))


def _sample_of(i, offset):
    return next(b for b, e in enumerate(int(v) for v in offset) if i < e)


def _ref_rows(nsample, xyz, offset, new_xyz, new_offset, pick):
    """(idx (m, nsample) -1 padded, dist (m, nsample) 1e5 padded): for each query, ``pick(d2)`` of the
    squared distances {j: d2} to the points of its sample, in float64, their distances sqrt(d2)."""
    a, q = xyz.double(), new_xyz.double()
    m = q.shape[0]
    idx = torch.full((m, nsample), -1, dtype=torch.long)
    dist = torch.full((m, nsample), 1e5, dtype=torch.float64)
    spans = _bounds(offset)
    for i in range(m):
        s, e = spans[_sample_of(i, new_offset)]
        d2 = {j: float((q[i] - a[j]).square().sum()) for j in range(s, e)}
        for t, j in enumerate(pick(d2)):
            idx[i, t], dist[i, t] = j, math.sqrt(d2[j])
    return idx, dist


def ref_knn(nsample, xyz, offset, new_xyz, new_offset):
    """idx (m, nsample) by (d2, index) within the query's sample, -1 padded; dist sqrt(d2), 1e5 padded."""
    return _ref_rows(nsample, xyz, offset, new_xyz, new_offset, lambda d2: sorted(d2, key=lambda j: (d2[j], j))[:nsample])


def ref_ball(nsample, max_r, min_r, xyz, offset, new_xyz, new_offset):
    """Candidates d2 <= 1e-5 or min_r^2 <= d2 < max_r^2 sorted by (d2, index); c <= nsample: all,
    -1 / 1e5 padded; else positions int(float32(c) / nsample * i) in float32 (the kernel's)."""

    def pick(d2):
        cand = sorted((j for j in d2 if d2[j] <= 1e-5 or min_r * min_r <= d2[j] < max_r * max_r), key=lambda j: (d2[j], j))
        c = len(cand)
        return cand if c <= nsample else [cand[int(np.float32(c) / np.float32(nsample) * np.float32(t))] for t in range(nsample)]

    return _ref_rows(nsample, xyz, offset, new_xyz, new_offset, pick)


def ref_fps(xyz, offset, new_offset):
    """Per sample: start at its first point, then argmax of the min squared distance (first max);
    picks beyond the sample's size repeat its first point."""
    a = xyz.double()
    out = []
    for (s, e), (ms, me) in zip(_bounds(offset), _bounds(new_offset)):
        pts = a[s:e]
        dist = torch.full((e - s,), float("inf"), dtype=torch.float64)
        picked, pick = [], 0
        for _ in range(min(me - ms, e - s)):
            picked.append(s + pick)
            dist = torch.minimum(dist, (pts - pts[pick]).square().sum(1))
            pick = int(torch.argmax(dist))
        out += picked + [s] * (me - ms - len(picked))
    return torch.tensor(out, dtype=torch.long)


def ref_group(idx, feat, xyz, new_xyz, with_xyz):
    m, k = idx.shape
    out = torch.zeros(m, k, (3 if with_xyz else 0) + feat.shape[1], dtype=torch.float64)
    for i in range(m):
        for t in range(k):
            j = int(idx[i, t])
            if j >= 0:
                row = feat[j].double()
                out[i, t] = torch.cat([xyz[j].double() - new_xyz[i].double(), row]) if with_xyz else row
    return out


def ref_interpolation(xyz, new_xyz, feat, offset, new_offset, k=3):
    idx, dist = ref_knn(k, xyz, offset, new_xyz, new_offset)
    out = torch.zeros(new_xyz.shape[0], feat.shape[1], dtype=torch.float64)
    for i in range(new_xyz.shape[0]):
        js = [(int(j), float(d)) for j, d in zip(idx[i], dist[i]) if j >= 0]
        norm = sum(1 / (d + 1e-8) for _, d in js)
        for j, d in js:
            out[i] += feat[j].double() * (1 / (d + 1e-8)) / norm
    return out


# ----------------------------------------------------------------------------------------------
# inputs


SIZES = [7, 19, 1, 12]  # ragged, one sample smaller than every nsample used
QUERIES = [5, 11, 3, 8]


def _cloud(gen, sizes, dtype=torch.float32):
    xyz = torch.rand(sum(sizes), 3, generator=gen, dtype=torch.float64).to(dtype)
    return xyz, torch.tensor(np.cumsum(sizes), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# knn_query


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_knn_query_matches_reference_on_ragged_samples(gen, dtype):
    xyz, offset = _cloud(gen, SIZES, dtype)
    new_xyz, new_offset = _cloud(gen, QUERIES, dtype)
    idx, dist = po.knn_query(8, xyz, offset, new_xyz, new_offset)
    ridx, rdist = ref_knn(8, xyz, offset, new_xyz, new_offset)
    assert idx.dtype == torch.int32 and dist.dtype == dtype
    assert torch.equal(idx.long(), ridx)
    torch.testing.assert_close(dist.double(), rdist, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-6 if dtype == torch.float32 else 1e-12)


def test_knn_query_without_new_xyz_queries_the_points_themselves(gen):
    xyz, offset = _cloud(gen, [30])
    idx, dist = po.knn_query(4, xyz, offset)
    ridx, rdist = ref_knn(4, xyz, offset, xyz, offset)
    assert torch.equal(idx.long(), ridx)
    assert torch.equal(idx[:, 0].long(), torch.arange(30)) and bool((dist[:, 0] == 0).all())


def test_knn_query_pads_with_minus_one_and_1e5_when_nsample_exceeds_all_points(gen):
    xyz, offset = _cloud(gen, [2, 3])
    idx, dist = po.knn_query(7, xyz, offset)
    assert idx.shape == (5, 7)
    assert bool((idx[:2, 2:] == -1).all()) and bool((idx[2:, 3:] == -1).all())
    assert bool((dist[idx < 0] == 1e5).all()) and bool((idx[idx >= 0] < 5).all())
    assert torch.equal(idx.long(), ref_knn(7, xyz, offset, xyz, offset)[0])


def test_knn_query_takes_int64_offsets_and_lists(gen):
    xyz, offset = _cloud(gen, SIZES)
    a = po.knn_query(3, xyz, offset)[0]
    assert torch.equal(a, po.knn_query(3, xyz, offset.long())[0])
    assert torch.equal(a, po.knn_query(3, xyz, offset.tolist())[0])


def test_knn_query_distances_are_differentiable(gen):
    xyz, offset = _cloud(gen, [6, 5], torch.float64)
    new_xyz = torch.rand(4, 3, generator=gen, dtype=torch.float64) + 0.01
    new_offset = torch.tensor([2, 4])
    torch.autograd.gradcheck(lambda a, b: po.knn_query(3, a, offset, b, new_offset)[1], (xyz.requires_grad_(), new_xyz.requires_grad_()))


# ----------------------------------------------------------------------------------------------
# ball_query / random_ball_query


@pytest.mark.parametrize("min_r", [0.0, 0.2])
def test_ball_query_matches_reference_including_the_spread_pick(gen, min_r):
    xyz, offset = _cloud(gen, [60, 45, 1], torch.float64)
    new_xyz, new_offset = _cloud(gen, [9, 7, 2], torch.float64)
    idx, dist = po.ball_query(6, 0.45, min_r, xyz, offset, new_xyz, new_offset)
    ridx, rdist = ref_ball(6, 0.45, min_r, xyz, offset, new_xyz, new_offset)
    assert idx.dtype == torch.int32
    assert torch.equal(idx.long(), ridx)
    torch.testing.assert_close(dist, rdist)
    assert bool((idx >= 0).all(1).any()) and bool((idx < 0).any())  # both spread rows and padded rows


def test_ball_query_keeps_the_query_itself_inside_min_radius(gen):
    xyz, offset = _cloud(gen, [20], torch.float64)
    idx, dist = po.ball_query(4, 0.9, 0.5, xyz, offset)
    assert torch.equal(idx.long(), ref_ball(4, 0.9, 0.5, xyz, offset, xyz, offset)[0])
    assert bool((idx.long() == torch.arange(20)[:, None]).any(1).all())


def test_ball_query_float32_matches_reference_away_from_the_radius(gen):
    xyz, offset = _cloud(gen, SIZES)
    pairs = (xyz.double()[:, None] - xyz.double()[None]).norm(dim=-1)
    assert bool(((pairs - 0.3).abs() > 1e-5).all())  # no pair where float32 and float64 could disagree
    idx, dist = po.ball_query(5, 0.3, 0.0, xyz, offset)
    ridx, rdist = ref_ball(5, 0.3, 0.0, xyz, offset, xyz, offset)
    assert torch.equal(idx.long(), ridx)
    torch.testing.assert_close(dist.double(), rdist, rtol=1e-6, atol=1e-6)


def test_ball_query_distances_compiled_equal_eager_and_the_float32_roots():
    """The distances are each pair's float32 squared distance's IEEE root, eagerly and compiled
    (torch's CPU sqrt is not always the nearest float: on a lattice cloud thousands of them
    were an ulp off inductor's, with or without a gradient)."""
    g = torch.Generator().manual_seed(0)
    xyz = (torch.randint(-9, 9, (1500, 3), generator=g).double() / 7).float()
    offset = torch.tensor([1500], dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(po.ball_query)
    for points in (xyz, xyz.clone().requires_grad_(True)):
        idx, dist = po.ball_query(16, 0.5, 0.0, points, offset)
        again, dist_c = compiled(16, 0.5, 0.0, points, offset)
        assert torch.equal(again, idx) and torch.equal(dist_c.detach(), dist.detach())
    valid = idx >= 0
    diff = xyz[:, None, :] - xyz[idx.long().clamp_min(0)]
    d2 = diff[..., 0] * diff[..., 0] + diff[..., 1] * diff[..., 1] + diff[..., 2] * diff[..., 2]
    want = torch.from_numpy(np.sqrt(d2.numpy()))  # (numpy's roots: IEEE's)
    assert torch.equal(dist.detach()[valid], want[valid])


def test_random_ball_query_returns_a_random_subset_of_the_candidates(gen):
    xyz, offset = _cloud(gen, [80, 50], torch.float64)
    nsample, max_r, min_r = 5, 0.4, 0.1
    full = ref_ball(200, max_r, min_r, xyz, offset, xyz, offset)[0]
    torch.manual_seed(0)
    idx, dist = po.random_ball_query(nsample, max_r, min_r, xyz, offset)
    torch.manual_seed(0)
    again, _ = po.random_ball_query(nsample, max_r, min_r, xyz, offset)
    assert torch.equal(idx, again)
    for i in range(xyz.shape[0]):
        cand = {int(j) for j in full[i] if j >= 0}
        got = [int(j) for j in idx[i] if j >= 0]
        assert len(got) == min(nsample, len(cand)) and len(set(got)) == len(got) and set(got) <= cand
        assert bool((idx[i, len(got):] == -1).all()) and bool((dist[i, len(got):] == 1e5).all())
        for t, j in enumerate(got):
            assert math.isclose(float(dist[i, t]), float((xyz[i] - xyz[j]).norm()), rel_tol=1e-12, abs_tol=1e-12)
    torch.manual_seed(1)
    other, _ = po.random_ball_query(nsample, max_r, min_r, xyz, offset)
    assert not torch.equal(idx, other)


# ----------------------------------------------------------------------------------------------
# farthest_point_sampling


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_farthest_point_sampling_matches_reference(gen, dtype):
    xyz, offset = _cloud(gen, SIZES, dtype)
    new_offset = torch.tensor(np.cumsum([3, 9, 1, 12]), dtype=torch.int32)
    idx = po.farthest_point_sampling(xyz, offset, new_offset)
    assert idx.dtype == torch.int32
    assert torch.equal(idx.long(), ref_fps(xyz, offset, new_offset))


def test_farthest_point_sampling_repeats_the_first_point_past_a_samples_size(gen):
    xyz, offset = _cloud(gen, [3, 4])
    idx = po.farthest_point_sampling(xyz, offset, torch.tensor([5, 6]))
    assert torch.equal(idx[3:5].long(), torch.tensor([0, 0])) and sorted(idx[:3].tolist()) == [0, 1, 2]
    assert torch.equal(idx.long(), ref_fps(xyz, offset, torch.tensor([5, 6])))


# ----------------------------------------------------------------------------------------------
# grouping


@pytest.mark.parametrize("with_xyz", [False, True])
def test_grouping_matches_reference_with_padding(gen, with_xyz):
    xyz, offset = _cloud(gen, [3, 9])
    new_xyz, new_offset = _cloud(gen, [2, 4])
    feat = torch.randn(12, 5, generator=gen)
    idx, _ = po.knn_query(5, xyz, offset, new_xyz, new_offset)  # sample 0 pads two columns
    out = po.grouping(idx, feat, xyz, new_xyz, with_xyz=with_xyz)
    torch.testing.assert_close(out.double(), ref_group(idx, feat, xyz, new_xyz, with_xyz))


def test_grouping_gradcheck(gen):
    xyz = torch.rand(9, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    new_xyz = torch.rand(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    feat = torch.randn(9, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 3, 3], [8, -1, 1], [2, 2, -1], [5, 6, 7]], dtype=torch.int32)
    torch.autograd.gradcheck(lambda f, a, b: po.grouping(idx, f, a, b, with_xyz=True), (feat, xyz, new_xyz))
    torch.autograd.gradcheck(lambda f: po.grouping2(f, idx), (feat,))


def test_knn_query_and_group_reuses_a_given_idx(gen):
    xyz, offset = _cloud(gen, SIZES)
    feat = torch.randn(xyz.shape[0], 4, generator=gen)
    grouped, idx = po.knn_query_and_group(feat, xyz, offset, nsample=6, with_xyz=True)
    assert grouped.shape == (xyz.shape[0], 6, 7) and torch.equal(idx.long(), ref_knn(6, xyz, offset, xyz, offset)[0])
    again, same = po.knn_query_and_group(feat * 2, xyz, offset, idx=idx, with_xyz=False)
    assert same is idx
    torch.testing.assert_close(again, 2 * grouped[..., 3:])


def test_ball_query_and_group_matches_ball_query_then_grouping(gen):
    xyz, offset = _cloud(gen, [40, 30], torch.float64)
    feat = torch.randn(70, 3, generator=gen, dtype=torch.float64)
    grouped, idx = po.ball_query_and_group(feat, xyz, offset, max_radio=0.3, nsample=4, with_xyz=True)
    ridx, _ = ref_ball(4, 0.3, 0.0, xyz, offset, xyz, offset)
    assert torch.equal(idx.long(), ridx)
    torch.testing.assert_close(grouped, ref_group(ridx, feat, xyz, xyz, True))


def _ref_dilated(nsample, xyz, offset, new_xyz, new_offset, dilation):
    """pointops' query_and_group column choice, on the reference kNN."""
    total = 1 + (nsample - 1) * (dilation + 1)
    full, _ = ref_knn(total, xyz, offset, new_xyz, new_offset)
    rows = []
    for (s, e), (ms, me) in zip(_bounds(offset), _bounds(new_offset)):
        soft = (e - s - 1) / (nsample - 1) - 1 if e - s < total else dilation
        rows.append(full[ms:me, [int((soft + 1) * i) for i in range(nsample)]])
    return torch.cat(rows)


@pytest.mark.parametrize("dilation", [0, 1, 2])
def test_query_and_group_dilation_matches_reference(gen, dilation):
    xyz, offset = _cloud(gen, [40, 9, 5])
    new_xyz, new_offset = _cloud(gen, [6, 4, 3])
    feat = torch.randn(54, 2, generator=gen)
    grouped, idx = po.query_and_group(4, xyz, new_xyz, feat, None, offset, new_offset, dilation=dilation)
    ridx = _ref_dilated(4, xyz, offset, new_xyz, new_offset, dilation)
    assert torch.equal(idx.long(), ridx)
    torch.testing.assert_close(grouped.double(), ref_group(ridx, feat, xyz, new_xyz, True))
    assert torch.equal(po.query_and_group(4, xyz, new_xyz, feat, None, offset, new_offset, dilation, with_feat=False), idx)


def test_query_and_group_gives_minus_one_and_zero_rows_for_a_sample_without_points(gen):
    xyz, _ = _cloud(gen, [9])
    offset, new_offset = torch.tensor([5, 5, 9]), torch.tensor([2, 3, 5])  # sample 1 of xyz is empty
    new_xyz = torch.rand(5, 3, generator=gen)
    feat = torch.randn(9, 2, generator=gen)
    grouped, idx = po.query_and_group(2, xyz, new_xyz, feat, None, offset, new_offset, dilation=1)
    assert bool((idx[2] == -1).all()) and bool((grouped[2] == 0).all())
    assert torch.equal(idx.long(), _ref_dilated(2, xyz, [5, 5, 9], new_xyz, [2, 3, 5], 1))


# ----------------------------------------------------------------------------------------------
# interpolation


@pytest.mark.parametrize("fn", [po.interpolation, po.interpolation2])
def test_interpolation_matches_reference(gen, fn):
    xyz, offset = _cloud(gen, [5, 2, 9])  # the second sample has fewer than k = 3 points
    new_xyz, new_offset = _cloud(gen, [7, 4, 6])
    feat = torch.randn(16, 4, generator=gen)
    out = fn(xyz, new_xyz, feat, offset, new_offset)
    torch.testing.assert_close(out.double(), ref_interpolation(xyz, new_xyz, feat, offset, new_offset), rtol=1e-5, atol=1e-5)
    # pointops' common case: the points themselves among the queries (distance 0, weight ~1)
    same = fn(xyz, xyz, feat, offset, offset)
    torch.testing.assert_close(same, feat, rtol=1e-5, atol=1e-5)


def test_interpolation_gradcheck_in_features_and_positions(gen):
    xyz = torch.rand(8, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    new_xyz = torch.rand(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    feat = torch.randn(8, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    offset, new_offset = torch.tensor([3, 8]), torch.tensor([2, 5])
    torch.autograd.gradcheck(lambda a, b, f: po.interpolation(a, b, f, offset, new_offset), (xyz, new_xyz, feat))
    out = po.interpolation2(xyz, new_xyz, feat, offset, new_offset)
    assert torch.autograd.grad(out.sum(), [xyz, new_xyz], allow_unused=True) == (None, None)
    torch.autograd.gradcheck(lambda f: po.interpolation2(xyz, new_xyz, f, offset, new_offset), (feat,))


# ----------------------------------------------------------------------------------------------
# subtraction, aggregation, attention steps


def test_subtraction_matches_formula_and_gradcheck(gen):
    a = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 4], [2, 2], [1, 3], [4, 0], [3, 3]], dtype=torch.int32)
    out = po.subtraction(a, b, idx)
    for i in range(5):
        for s in range(2):
            assert torch.equal(out[i, s], a[i] - b[int(idx[i, s])])
    torch.autograd.gradcheck(lambda x, y: po.subtraction(x, y, idx), (a, b))


@pytest.mark.parametrize("w_c", [1, 2, 6])
def test_aggregation_matches_formula_and_gradcheck(gen, w_c):
    n, s, c = 4, 3, 6
    inp = torch.randn(n, c, generator=gen, dtype=torch.float64, requires_grad=True)
    pos = torch.randn(n, s, c, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, s, w_c, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, n, (n, s), generator=gen, dtype=torch.int32)
    out = po.aggregation(inp, pos, w, idx)
    ref = torch.zeros(n, c, dtype=torch.float64)
    for i in range(n):
        for ch in range(c):
            ref[i, ch] = sum((inp[int(idx[i, t]), ch] + pos[i, t, ch]) * w[i, t, ch % w_c] for t in range(s))
    torch.testing.assert_close(out, ref)
    torch.autograd.gradcheck(lambda a, b, d: po.aggregation(a, b, d, idx), (inp, pos, w))


def test_attention_steps_match_formulas_and_gradcheck(gen):
    n, g, c, m = 5, 2, 3, 7
    q = torch.randn(n, g, c, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n, g, c, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(c, generator=gen, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, n, (m,), generator=gen, dtype=torch.int32)
    ref = torch.randint(0, n, (m,), generator=gen, dtype=torch.int32)
    rel = po.attention_relation_step(q, k, w, tgt, ref)
    expect = torch.stack([torch.stack([(q[tgt[r], h] * k[ref[r], h] * w).sum() for h in range(g)]) for r in range(m)])
    torch.testing.assert_close(rel, expect)
    torch.autograd.gradcheck(lambda a, b, d: po.attention_relation_step(a, b, d, tgt, ref), (q, k, w))
    weight = torch.randn(m, g, generator=gen, dtype=torch.float64, requires_grad=True)
    fused = po.attention_fusion_step(weight, k, tgt, ref)
    expect = torch.zeros(n, g, c, dtype=torch.float64)
    for r in range(m):
        expect[tgt[r]] += weight[r][:, None] * k[ref[r]]
    torch.testing.assert_close(fused, expect)
    torch.autograd.gradcheck(lambda a, b: po.attention_fusion_step(a, b, tgt, ref), (weight, k))


# ----------------------------------------------------------------------------------------------
# layout helpers, API, op registration


def test_offset2batch_and_batch2offset_round_trip():
    offset = torch.tensor([3, 3, 7, 8], dtype=torch.int32)
    batch = po.offset2batch(offset)
    assert batch.dtype == torch.int64 and batch.tolist() == [0, 0, 0, 2, 2, 2, 2, 3]
    back = po.batch2offset(torch.tensor([0, 0, 0, 1, 1, 2]))
    assert back.dtype == torch.int32 and back.tolist() == [3, 5, 6]


def test_module_exports_pointops_public_names_and_aliases():
    names = ["knn_query", "ball_query", "random_ball_query", "farthest_point_sampling", "grouping", "grouping2",
             "interpolation", "interpolation2", "subtraction", "aggregation", "attention_relation_step",
             "attention_fusion_step", "query_and_group", "knn_query_and_group", "ball_query_and_group",
             "batch2offset", "offset2batch"]
    assert sorted(po.__all__) == sorted(names) and all(callable(getattr(po, n)) for n in names)
    assert po.__aliases__ == {"pointops.functions": sys.modules["pcops.compat.pointops"]}


def test_import_pointops_and_pointops_functions_resolve_to_the_drop_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "pointops", po)
    for name, module in po.__aliases__.items():
        monkeypatch.setitem(sys.modules, name, module)
    import pointops
    import pointops.functions
    from pointops.functions import knn_query

    assert pointops is po and pointops.functions is po and knn_query is po.knn_query


def test_ball_op_passes_opcheck(gen):
    xyz, offset = _cloud(gen, [30, 20])
    ids = po.offset2batch(offset)
    for key in (None, torch.rand(50, generator=gen)):
        torch.library.opcheck(torch.ops.pcops_compat.pointops_ball.default, (xyz, xyz, ids, ids, 0.4, 0.1, 4, key))


# ----------------------------------------------------------------------------------------------
# torch.compile


def test_queries_grouping_interpolation_subtraction_aggregation_compile_fullgraph_without_breaks(gen):
    from torch._dynamo.utils import counters

    def f(feat, xyz, offset, new_xyz, new_offset):
        grouped, idx = po.knn_query_and_group(feat, xyz, offset, new_xyz, new_offset, nsample=5, with_xyz=True)
        up = po.interpolation(new_xyz, xyz, grouped.amax(1), new_offset, offset)
        ball, bidx = po.ball_query_and_group(feat, xyz, offset, new_xyz, new_offset, max_radio=0.4, nsample=4)
        rand, _ = po.random_ball_query(4, 0.4, 0.1, xyz, offset, new_xyz, new_offset)
        sub = po.subtraction(new_xyz, xyz, idx)
        agg = po.aggregation(feat, sub, sub[..., :1], idx)
        return grouped, idx, up, ball, bidx, rand, sub, agg

    xyz, offset = _cloud(gen, [13, 4, 21])
    new_xyz, new_offset = _cloud(gen, [6, 2, 9])
    feat = torch.randn(38, 3, generator=gen)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True)
    with torch._inductor.config.patch(fallback_random=True):  # Inductor draws as eager does
        torch.manual_seed(0)
        got = compiled(feat, xyz, offset, new_xyz, new_offset)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.manual_seed(0)
    want = f(feat, xyz, offset, new_xyz, new_offset)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x, o: po.knn_query(0, x, o), "nsample"),
        (lambda x, o: po.knn_query(2.5, x, o), "nsample"),
        (lambda x, o: po.knn_query(2, x[:, :2], o), "xyz"),
        (lambda x, o: po.knn_query(2, x, o.float()), "offset"),
        (lambda x, o: po.knn_query(2, x, torch.tensor([3, 9])), "offset"),
        (lambda x, o: po.knn_query(2, x, torch.tensor([6, 3, 10])), "offset"),
        (lambda x, o: po.knn_query(2, x, o, x), "new_offset"),
        (lambda x, o: po.knn_query(2, x, o, x, torch.tensor([10])), "new_offset"),
        (lambda x, o: po.knn_query(2, x, o, x[:, :2], o), "new_xyz"),
        (lambda x, o: po.knn_query(2, x, None), "offset"),
        (lambda x, o: po.knn_query(2, x / torch.tensor(0.0), o), "xyz contains NaN"),
        (lambda x, o: po.ball_query(2, 0.3, 0.0, x, o, x * float("inf"), o), "new_xyz contains NaN or inf"),
        (lambda x, o: po.farthest_point_sampling(x * float("nan"), o, o), "xyz contains NaN"),
        (lambda x, o: po.ball_query(2, 0.1, 0.2, x, o), "min_radius"),
        (lambda x, o: po.ball_query(2, "r", 0.0, x, o), "max_radius"),
        (lambda x, o: po.farthest_point_sampling(x, o, torch.tensor([2, 1])), "new_offset"),
        (lambda x, o: po.grouping(torch.zeros(3, 2), x, x), "idx"),
        (lambda x, o: po.grouping(torch.tensor([[0, 10]]), x, x), "idx"),
        (lambda x, o: po.grouping(torch.zeros(3, 2, dtype=torch.int32), x[0], x), "feat"),
        (lambda x, o: po.knn_query_and_group(x, x, o), "nsample"),
        (lambda x, o: po.query_and_group(2, x, x, x, None, o, o, dilation=-1), "dilation"),
        (lambda x, o: po.interpolation(x, x, x[:4], o, o), "feat"),
        (lambda x, o: po.interpolation2(x, x, x[:4], o, o), "input"),
        (lambda x, o: po.interpolation(x.tolist(), x, x, o, o), "xyz"),
        (lambda x, o: po.interpolation2(x, x.tolist(), x, o, o), "new_xyz"),
        (lambda x, o: po.subtraction(x, x, torch.zeros(4, 2, dtype=torch.int32)), "idx"),
        (lambda x, o: po.aggregation(x, x[:, None], x[:, None], torch.zeros(10, 2, dtype=torch.int32)), "position"),
    ],
)
def test_bad_input_raises_naming_the_argument(gen, call, name):
    xyz, offset = _cloud(gen, [4, 6])
    with pytest.raises((ValueError, TypeError), match=name):
        call(xyz, offset)


def test_knn_query_and_group_and_interpolation_compile_dynamic_over_two_batch_sizes(gen):
    from torch._dynamo.utils import counters

    def f(feat, xyz, offset, new_xyz, new_offset):
        grouped, idx = po.knn_query_and_group(feat, xyz, offset, new_xyz, new_offset, nsample=4, with_xyz=True)
        return grouped, po.interpolation(new_xyz, xyz, grouped.sum(1), new_offset, offset)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, dynamic=True, fullgraph=True, backend="aot_eager")
    for sizes, queries in (([13, 4, 21], [6, 2, 9]), ([30, 7], [11, 5])):
        xyz, offset = _cloud(gen, sizes)
        new_xyz, new_offset = _cloud(gen, queries)
        feat = torch.randn(xyz.shape[0], 2, generator=gen)
        for a, b in zip(compiled(feat, xyz, offset, new_xyz, new_offset), f(feat, xyz, offset, new_xyz, new_offset)):
            torch.testing.assert_close(a, b)
    assert not counters["graph_break"], dict(counters["graph_break"])
