"""pcops.ball_query against a dense float64 reference (the shared op suite, plus ball-query specifics)."""

import pytest
import torch

import pcops
from tests import reference
from tests.op_suite import F64, TOL, OpSuite, pack, pad

K = 6


def assert_ball_query(out, expected, dtype, q, p, radius):
    """Counts exactly; dists within TOL[dtype]; indices exactly in float64, else up to near-ties."""
    (dists, idx, counts), (ref_d, ref_idx, ref_counts) = out, expected
    assert idx.dtype == counts.dtype == torch.int64
    assert torch.equal(counts, ref_counts)
    torch.testing.assert_close(dists.double(), ref_d, **TOL[dtype])
    if dtype == F64:
        assert torch.equal(idx, ref_idx)
        return
    assert torch.equal(idx >= 0, ref_idx >= 0)
    d = reference.distances(q, p).gather(1, idx.clamp(min=0))
    gap = (d - ref_d).abs()[idx != ref_idx]
    assert torch.all(gap <= TOL[dtype]["atol"] * (1 + radius)), "a neighbour away from a tie is misplaced"


def padded_calls(gen) -> list:
    """Arguments (query, ref, query_lengths, ref_lengths) of two padded calls of other sizes, for the compile checks."""
    calls = []
    for b, m, n in ((2, 20, 30), (3, 27, 41)):
        q = torch.rand(b, m, 3, generator=gen).requires_grad_()
        p = torch.rand(b, n, 3, generator=gen)
        calls.append((q, p, torch.randint(0, m + 1, (b,), generator=gen), torch.randint(0, n + 1, (b,), generator=gen)))
    return calls


class TestBallQuery(OpSuite):
    differentiable = ("query", "ref")

    def inputs(self, kind, gen):
        q, p, r = reference.cloud(kind, gen)
        return dict(query=q, ref=p, radius=reference.safe_radius(q, p, r, gap=1e-3))

    def run(self, query, ref, radius):
        return tuple(pcops.ball_query(query, ref, radius, K))

    def reference(self, query, ref, radius):
        return reference.ball_query(query, ref, radius, K)

    def compare(self, out, expected, dtype, inputs=None):
        if inputs is None:  # batch test: float64, exact
            for i, (a, e) in enumerate(zip(out, expected)):
                assert torch.equal(a, e) if not e.dtype.is_floating_point else torch.allclose(a, e, **TOL[F64]), i
            return
        q, p = inputs["query"].double(), inputs["ref"].double()
        assert_ball_query(out, expected, dtype, q, p, inputs["radius"])

    def grad_inputs(self, gen):
        q, p = torch.rand(12, 3, generator=gen, dtype=F64), torch.rand(30, 3, generator=gen, dtype=F64)
        return dict(query=q, ref=p, radius=reference.safe_radius(q, p, 0.4, gap=1e-2))

    def opcheck_cases(self, gen):
        cases = []
        for dtype in (torch.float32, F64):
            q, p = torch.rand(20, 3, generator=gen, dtype=dtype), torch.rand(30, 3, generator=gen, dtype=dtype)
            qg, rg = torch.randint(0, 3, (20,), generator=gen, dtype=torch.int32), torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
            cases.append((torch.ops.pcops.ball_query.default, (q, p, 0.3, 4, True, None, None)))
            cases.append((torch.ops.pcops.ball_query.default, (q, p, 0.3, 40, True, qg, rg)))
        return cases

    def compile_calls(self, gen):
        def fn(query, ref, ql, rl):
            out = pcops.ball_query(query, ref, 0.3, 5, query_lengths=ql, ref_lengths=rl)
            return out.dists, out.idx, out.counts

        return fn, padded_calls(gen)

    def batched(self, gen):
        qs = [torch.rand(m, 3, generator=gen, dtype=F64) for m in (9, 0, 7, 5)]
        ps = [torch.rand(n, 3, generator=gen, dtype=F64) for n in (12, 5, 0, 3)]
        r = 0.45
        expected = [reference.ball_query(q, p, r, K) for q, p in zip(qs, ps)]
        (q, ql), (p, pl) = pad(qs), pad(ps)
        out = pcops.ball_query(q, p, r, K, query_lengths=ql, ref_lengths=pl)
        assert torch.all(out.idx[1] == -1) and torch.all(out.counts[1] == 0)  # padding rows
        padded = [tuple(t[b, : len(qs[b])] for t in out) for b in range(len(qs))]
        qp, qb, q_pos = pack(qs, gen)
        pp, pb, p_pos = pack(ps, gen)
        d, idx, counts = pcops.ball_query(qp, pp, r, K, query_batch=qb, ref_batch=pb)
        offsets = [0] + torch.tensor([len(x) for x in ps]).cumsum(0).tolist()
        to_local = torch.empty_like(p_pos)  # packed ref row -> row within its sample
        to_local[p_pos] = torch.arange(p_pos.numel()) - torch.tensor(offsets[:-1]).repeat_interleave(torch.tensor([len(x) for x in ps]))
        packed, at = [], 0
        for b, x in enumerate(qs):
            rows = q_pos[at : at + len(x)]
            local = torch.where(idx[rows] >= 0, to_local[idx[rows].clamp(min=0)], -1)
            packed.append((d[rows], local, counts[rows]))
            at += len(x)
        return expected, padded, packed

    def bad_inputs(self, gen):
        q, p = torch.rand(4, 3, generator=gen), torch.rand(6, 3, generator=gen)
        nan = p.clone()
        nan[2, 0] = float("nan")
        bq = pcops.ball_query
        return {
            "zero radius": (lambda: bq(q, p, 0.0, 3), ValueError, "radius must be finite and > 0"),
            "tensor radius": (lambda: bq(q, p, torch.tensor(0.2), 3), TypeError, "radius must be a number"),
            "zero max_neighbors": (lambda: bq(q, p, 0.2, 0), ValueError, "max_neighbors must be >= 1"),
            "float max_neighbors": (lambda: bq(q, p, 0.2, 2.0), TypeError, "max_neighbors must be an int"),
            "2-d query": (lambda: bq(q[:, :2], p, 0.2, 3), ValueError, "query must be a tensor of shape"),
            "int ref": (lambda: bq(q, p.long(), 0.2, 3), TypeError, "ref must have a floating dtype"),
            "devices": (lambda: bq(q, p.to("meta"), 0.2, 3), ValueError, "same device"),
            "NaN ref": (lambda: bq(q, nan, 0.2, 3), ValueError, "ref contains NaN"),
            "lengths range": (lambda: bq(q[None], p[None], 0.2, 3, ref_lengths=torch.tensor([7])), ValueError, "ref_lengths values"),
            "batch alone": (lambda: bq(q, p, 0.2, 3, query_batch=torch.zeros(4, dtype=torch.long)), ValueError, "query_batch and ref_batch"),
        }


def test_keeps_the_closest_not_the_first_found(gen):
    # 200 points within the radius, in random order: the kept ones are the K closest
    p = torch.rand(200, 3, generator=gen, dtype=F64) * 0.1
    q = torch.zeros(1, 3, dtype=F64)
    dists, idx, counts = pcops.ball_query(q, p, 1.0, 8)
    assert counts.item() == 200
    assert torch.equal(idx[0], reference.distances(q, p)[0].argsort(stable=True)[:8])
    assert torch.all(dists[0, 1:] >= dists[0, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_op_by_index_keeps_the_smallest_indices_within_the_radius(gen, dtype):
    # the by-index op (pcops.compat's "first K" caps): per query the K smallest indices
    # within the radius, ascending, -1 padded, and the same counts; in two samples
    p = torch.rand(400, 3, generator=gen, dtype=dtype)
    q = torch.rand(60, 3, generator=gen, dtype=dtype)
    gp, gq = torch.arange(400) // 200, torch.arange(60) // 30
    radius = reference.safe_radius(q.double(), p.double(), 0.2, gap=1e-3)
    for k in (1, 7, 300):
        idx, counts = torch.ops.pcops.ball_query_by_index(q, p, radius, k, True, gq, gp)
        within = (reference.distances(q.double(), p.double()) <= radius) & (gq[:, None] == gp[None, :])
        assert torch.equal(counts, within.sum(1))
        first = torch.where(within, torch.arange(400), 400).sort(1).values[:, :k]
        assert torch.equal(idx, torch.where(first == 400, -1, first))
        assert torch.equal(counts, torch.ops.pcops.ball_query(q, p, radius, k, True, gq, gp)[1])



def test_the_op_by_index_passes_opcheck_and_terminates_on_nan(gen):
    p = torch.rand(300, 3, generator=gen, dtype=F64)
    q = torch.rand(40, 3, generator=gen, dtype=F64)
    gp, gq = torch.arange(300) // 150, torch.arange(40) // 20
    torch.library.opcheck(torch.ops.pcops.ball_query_by_index.default, (q, p, 0.2, 9, False, gq, gp))
    torch.library.opcheck(torch.ops.pcops.ball_query_by_index.default, (q, p, 0.2, 9, False, None, None))
    p[5], q[3] = float("nan"), float("inf")  # validate=False: terminates, and no NaN point is ever within the radius
    idx, counts = torch.ops.pcops.ball_query_by_index(q, p, 0.2, 9, False, None, None)
    assert not (idx == 5).any() and counts[3] == 0


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_searchs_own_distances_without_a_gradient_the_recomputed_ones_with_one(gen, dtype):
    # without a gradient to the points, dists are the kernel's (no (M, K, 3) gather); with one,
    # torch's from the gathered points: the same neighbours, both the float64 reference's
    # distances to rounding, inf past the counts; one cloud, two radii and a padded batch
    q, p = torch.rand(2, 70, 3, generator=gen, dtype=dtype), torch.rand(2, 90, 3, generator=gen, dtype=dtype)
    lengths = torch.tensor([70, 41]), torch.tensor([90, 77])
    calls = [lambda a, b: (pcops.ball_query(a[0], b[0], 0.3, 12),),
             lambda a, b: pcops.ball_queries(a[0], b[0], [0.15, 0.3], [4, 12]),
             lambda a, b: (pcops.ball_query(a, b, 0.3, 12, query_lengths=lengths[0], ref_lengths=lengths[1]),)]
    for call in calls:
        own = call(q, p)
        recomputed = call(q.clone().requires_grad_(), p)
        for a, b in zip(own, recomputed):
            assert torch.equal(a.idx, b.idx) and torch.equal(a.counts, b.counts)
            assert torch.equal(a.dists.isinf(), a.idx < 0) and torch.equal(b.dists.isinf(), b.idx < 0)
            torch.testing.assert_close(a.dists, b.dists.detach(), **TOL[dtype])
            assert not a.dists.requires_grad and b.dists.requires_grad
    found = call(q.double(), p.double())[0]  # (the padded batch) against float64 brute force
    ref = reference.distances(q[0].double(), p[0].double()).gather(1, found.idx[0].clamp(min=0))
    torch.testing.assert_close(own[0].dists[0].double(), torch.where(found.idx[0] >= 0, ref, float("inf")), **TOL[dtype])

def test_ties_go_to_the_smaller_index():
    axes = torch.cat([torch.eye(3), -torch.eye(3)]).double()
    p = torch.cat([axes, axes])[torch.tensor([7, 3, 11, 0, 9, 1, 5, 10, 2, 6, 4, 8])]
    dists, idx, counts = pcops.ball_query(torch.zeros(1, 3, dtype=F64), p, 1.0, 5)
    assert idx[0].tolist() == [0, 1, 2, 3, 4] and torch.all(dists == 1) and counts.item() == 12


def test_radius_is_inclusive():
    p = torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.25, 0.0], [0.0, 0.0, 0.75]], dtype=F64)
    dists, idx, counts = pcops.ball_query(torch.zeros(1, 3, dtype=F64), p, 0.5, 4)
    assert idx[0].tolist() == [1, 0, -1, -1] and counts.item() == 2
    assert dists[0, 2:].isinf().all()


def test_more_columns_than_points_and_empty_sets(gen):
    q, p = torch.rand(5, 3, generator=gen, dtype=F64), torch.rand(3, 3, generator=gen, dtype=F64)
    dists, idx, counts = pcops.ball_query(q, p, 10.0, 7)
    assert torch.all(counts == 3) and torch.all(idx[:, 3:] == -1)
    dists, idx, counts = pcops.ball_query(q, p[:0], 1.0, 2)
    assert torch.all(idx == -1) and torch.all(counts == 0) and dists.isinf().all()
    assert pcops.ball_query(q[:0], p, 1.0, 2).idx.shape == (0, 2)



@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_query_with_a_non_finite_coordinate_finds_nothing_without_validation(gen, value):
    # whichever axis: the query's window of cells is empty on it (pcops._warp_funcs.cell_scan)
    p = torch.rand(40, 3, generator=gen, dtype=F64)
    q = torch.full((4, 3), 0.5, dtype=F64)
    q[[0, 1, 2], [0, 1, 2]] = value  # one axis each; the last query is finite
    dists, idx, counts = pcops.ball_query(q, p, 2.0, 4, validate=False)
    assert counts.tolist() == [0, 0, 0, 40] and bool((idx[:3] == -1).all()) and bool(dists[:3].isinf().all())

def test_gradient_at_zero_distance_is_finite():
    p = torch.rand(8, 3, dtype=F64)
    q = p[:3].clone().requires_grad_()
    d = pcops.ball_query(q, p, 0.5, 4).dists
    torch.where(torch.isfinite(d), d, 0).sum().backward()
    assert torch.isfinite(q.grad).all()


def test_multithreaded_cpu_path_equals_single_thread(gen):
    q, p = torch.rand(5000, 3, generator=gen), torch.rand(4000, 3, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 4):
            torch.set_num_threads(n)
            results.append(pcops.ball_query(q, p, 0.1, 16))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_matches_cpu_on_a_side_stream(gen):
    q, p = torch.rand(3000, 3, generator=gen), torch.rand(5000, 3, generator=gen)
    cpu = pcops.ball_query(q, p, 0.08, 32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gpu = pcops.ball_query(q.cuda(), p.cuda(), 0.08, 32)
    torch.cuda.synchronize()
    assert torch.equal(gpu.idx.cpu(), cpu.idx) and torch.equal(gpu.counts.cpu(), cpu.counts)
    torch.testing.assert_close(gpu.dists.cpu(), cpu.dists)
