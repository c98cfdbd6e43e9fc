"""pcops.knn on D-dimensional points (feature space) with the torch backend, against float64 brute force."""

import pytest
import torch

import pcops
from pcops.ops.neighbours import nearest as knn_module
from tests import reference

F64 = torch.float64


def brute_force(q, p, k):
    """Dense float64 kNN of (M, D) and (N, D) points by direct differences, ties by the smaller index."""
    d = (q.double()[:, None, :] - p.double()[None, :, :]).square().sum(-1).sqrt()
    order = d.argsort(dim=1, stable=True)[:, :k]
    return d.gather(1, order), order


@pytest.mark.parametrize("dim", [1, 2, 8, 64])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_knn_in_d_dimensions_matches_float64_brute_force(gen, dim, backend):
    q = torch.randn(70, dim, generator=gen, dtype=F64)
    p = torch.randn(90, dim, generator=gen, dtype=F64) * 3 + 10  # off-centre: the Gram form must not cancel
    q = q * 3 + 10
    for k in (1, 20, 90):
        dists, idx = pcops.knn(q, p, k, backend=backend)
        ref_d, ref_idx = brute_force(q, p, k)
        torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
        torch.testing.assert_close(dists, ref_d, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("dim", [6, 32, 64])
def test_transposed_feature_maps_are_searched_as_their_copies(gen, dim, dtype):
    """Features stored channels first ((B, D, N), DGCNN's layout) and searched as (B, N, D)
    through a transpose (a point's coordinates not contiguous): the neighbours and distances of
    float64 brute force (in float64) and of the contiguous copy, one cloud and a padded batch."""
    maps = torch.randn(3, dim, 300, generator=gen, dtype=F64)
    x = maps.transpose(1, 2).to(dtype)
    assert x.stride(-1) != 1
    dists, idx = pcops.knn(x[0], x[0], 12)
    want = pcops.knn(x[0].contiguous(), x[0].contiguous(), 12)
    torch.testing.assert_close(idx, want.idx, rtol=0, atol=0)
    torch.testing.assert_close(dists, want.dists, rtol=0, atol=0)
    if dtype == F64:
        ref_d, ref_idx = brute_force(x[0], x[0], 12)
        torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
        torch.testing.assert_close(dists, ref_d, rtol=1e-12, atol=1e-12)
    batch = pcops.knn(x, x, 12)
    again = pcops.knn(x.contiguous(), x.contiguous(), 12)
    torch.testing.assert_close(batch.idx, again.idx, rtol=0, atol=0)
    torch.testing.assert_close(batch.dists, again.dists, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [8, 64])
def test_float32_features_agree_with_float64(gen, dim):
    q, p = torch.randn(200, dim, generator=gen), torch.randn(300, dim, generator=gen)
    dists, idx = pcops.knn(q, p, 20)
    ref_d, ref_idx = brute_force(q, p, 20)
    assert dists.dtype == torch.float32
    torch.testing.assert_close(dists.double(), ref_d, rtol=1e-5, atol=1e-5)
    assert (idx == ref_idx).float().mean() > 0.999


def test_ties_and_duplicates_are_broken_by_the_smaller_index(gen):
    base = torch.randn(10, 8, generator=gen, dtype=F64)
    p = base.repeat(4, 1)[torch.randperm(40, generator=gen)]  # every point four times, shuffled
    dists, idx = pcops.knn(base, p, 8)
    ref_d, ref_idx = brute_force(base, p, 8)
    torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
    assert torch.all(dists[:, :4] == 0)



@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_ties_beyond_the_candidates_still_go_to_the_smaller_index(gen, dtype):
    # more points tie at the k-th distance than the Gram form's k + 8 candidates hold: a 4-d
    # integer lattice (exact distances, up to 32 at one distance), twenty duplicates in 5-d, and
    # the same in packed samples (each with its own block): every row in (distance, index) order
    import itertools

    lattice = torch.tensor(list(itertools.product(range(5), repeat=4)), dtype=dtype)
    dup = torch.rand(40, 5, generator=gen, dtype=F64).to(dtype)
    dup[:20] = dup[0]
    for points, k in ((lattice, 10), (lattice, 25), (dup, 5), (dup, 21)):
        dists, idx = pcops.knn(points, points, k)
        ref_d, ref_idx = brute_force(points, points, k)
        torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
        torch.testing.assert_close(dists.double(), ref_d, rtol=1e-6, atol=0)
    batch = torch.arange(len(lattice)) % 3
    dists, idx = pcops.knn(lattice, lattice, 12, query_batch=batch, ref_batch=batch)
    for b in range(3):
        rows = (batch == b).nonzero().flatten()
        torch.testing.assert_close(idx[rows], rows[brute_force(lattice[rows], lattice[rows], 12)[1]], rtol=0, atol=0)


# (dtype, the far cluster's distance from the centre, the step between the forty squared
# distances, the queries' spread, a scale of everything)
_NEAR_TIES = {
    # float64 Gram form: steps of 1e-10, 1e5 away, where it rounds by about 1e-9
    "float64": (F64, 1e5, 1e-10, 1e-7, 1.0),
    # the float32 Gram form of float32 points (the CPU's): steps of 1e-4, 100 away, rounding by about 1e-3
    "float32": (torch.float32, 100.0, 1e-4, 1e-5, 1.0),
    # the same scaled by 1e-22: squares subnormal in float32, which the guard on the samples' spread leaves to float64
    "float32 tiny": (torch.float32, 100.0, 1e-4, 1e-5, 1e-22),
}


@pytest.mark.parametrize("case", list(_NEAR_TIES))
@pytest.mark.parametrize("dim", [4, 8])
def test_near_ties_beyond_the_gram_forms_rounding_go_by_their_direct_distances(dim, case):
    # forty points whose squared distances to the queries differ by less than the Gram form
    # rounds there, far from the centre of the points (a second cluster at the origin): the
    # rounding scrambles their order, so its k + 8 candidates may miss the nearest; the rounding
    # bound sends those queries to the direct search (a bound of 0 fails this)
    dtype, far, step, spread, scale = _NEAR_TIES[case]
    wrong = []
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        dirs = torch.randn(40, dim, generator=g, dtype=F64)
        centre = torch.zeros(dim, dtype=F64)
        centre[0] = far
        radii = (1 + step * torch.randperm(40, generator=g).double()).sqrt()
        p = torch.cat([centre + dirs / dirs.norm(dim=1, keepdim=True) * radii[:, None], torch.randn(40, dim, generator=g, dtype=F64)])
        q = centre + spread * torch.randn(20, dim, generator=g, dtype=F64)
        p, q = (p * scale).to(dtype), (q * scale).to(dtype)
        for k in (1, 2):
            idx = pcops.knn(q, p, k).idx
            wrong.append(int((idx != brute_force(q, p, k)[1]).any(1).sum()))
    assert wrong == [0] * 10


def _feature_cases(gen):
    """(name, query, ref, k, batch keywords, validate) of feature-space searches: plain clouds of
    both dtypes and several sizes and k (up to the widest the CPU ranks in Warp, and one past
    it), duplicates and a lattice (ties past the candidates), padded and packed samples (empty
    slots), NaN / inf / huge points without validation, and far and tiny scales (the float32
    Gram form's guard and its least reach)."""
    import itertools

    cases = []
    for dtype in (torch.float32, F64):
        for n, dim, k in ((300, 8, 20), (200, 64, 1), (130, 16, 56), (90, 5, 57), (40, 33, 20), (7, 4, 5)):
            x = torch.randn(n, dim, generator=gen, dtype=dtype)
            cases.append((f"randn {n}x{dim} k={k}", x[: n // 2 + 1], x, k, {}, True))
        dup = torch.rand(150, 6, generator=gen, dtype=dtype)
        dup[:40] = dup[0]
        cases.append(("duplicates", dup, dup, 12, {}, True))
        lattice = torch.tensor(list(itertools.product(range(5), repeat=4)), dtype=dtype)
        cases.append(("lattice", lattice, lattice, 25, {}, True))
        lengths = torch.tensor([60, 3, 41, 1])
        padded = torch.randn(4, 60, 8, generator=gen, dtype=dtype)
        cases.append(("padded", padded, padded, 10, dict(query_lengths=lengths, ref_lengths=lengths), True))
        batch = torch.randint(0, 3, (120,), generator=gen)
        packed = torch.randn(120, 16, generator=gen, dtype=dtype)
        cases.append(("packed", packed, packed, 9, dict(query_batch=batch, ref_batch=batch), True))
        bad = torch.randn(80, 8, generator=gen, dtype=dtype)
        bad[3, 2], bad[10, 0], bad[11] = float("nan"), float("inf"), 1e20
        cases.append(("nan inf huge", bad, bad, 6, {}, False))
        mixed = torch.cat([torch.randn(50, 10, generator=gen, dtype=F64) * 1e-20, torch.randn(50, 10, generator=gen, dtype=F64)])
        groups = torch.arange(100) // 50  # a sample of tiny values beside one of ordinary values
        cases.append(("mixed scales", mixed.to(dtype), mixed.to(dtype), 7, dict(query_batch=groups, ref_batch=groups), True))
        for scale, dim in ((1e-30, 12), (1e-20, 12), (1e16, 12), (2e18, 64), (1e30, 12)):  # (2e18: |q|^2 + |p|^2 past float32's range)
            far = torch.randn(100, dim, generator=gen, dtype=F64) * scale
            cases.append((f"scale {scale:g}", far.to(dtype), far.to(dtype), 7, {}, True))
    return cases


def test_cpu_candidates_ranked_in_warp_equal_the_torch_form(gen, monkeypatch):
    """The CPU's Warp ranking of the candidates (with a float32 Gram form for float32 points)
    returns what the torch form (topk, gathers, sorts; float64 Gram form) returns: the same
    neighbours, and distances that differ only by the order of their float64 sums (the kernel
    sums four running sums; torch its own way): within a few float64 roundings, one rounding
    of float32's."""
    from pcops.ops.neighbours.nearest import _torch

    for name, q, p, k, batch, validate in _feature_cases(gen):
        results = []
        for in_warp in (True, False):
            monkeypatch.setattr(_torch, "RANK_IN_WARP", [in_warp])
            results.append(pcops.knn(q, p, k, validate=validate, **batch))
        (d_warp, i_warp), (d_torch, i_torch) = results
        assert torch.equal(i_warp, i_torch), name
        ulp = torch.finfo(q.dtype).eps
        torch.testing.assert_close(d_warp, d_torch, rtol=ulp if q.dtype == torch.float32 else 64 * ulp, atol=0, msg=name)
        if not batch and validate:
            ref_d, ref_idx = brute_force(q, p, min(k, p.shape[0]))
            assert torch.equal(i_warp[:, : ref_idx.shape[1]], ref_idx), name


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_feature_search_in_many_chunks_equals_one_chunk(gen, dtype, monkeypatch):
    """Queries searched a few rows at a time (the last chunk shorter) give what one chunk gives,
    bit for bit, and float64 brute force's neighbours: packed samples of uneven sizes, and a
    padded batch of equal clouds (its block the points themselves, the results written by
    chunk in place)."""
    from pcops.ops.neighbours.nearest import _torch

    batch = torch.randint(0, 3, (250,), generator=gen)
    x = torch.randn(250, 12, generator=gen, dtype=dtype)
    padded = torch.randn(3, 80, 12, generator=gen, dtype=dtype)
    whole = pcops.knn(x, x, 9, query_batch=batch, ref_batch=batch)
    whole_padded = pcops.knn(padded, padded, 9)
    monkeypatch.setattr(_torch, "_ENTRIES", 3 * 4 * 64 * 7)  # chunks of 7 rows a sample
    chunked = pcops.knn(x, x, 9, query_batch=batch, ref_batch=batch)
    chunked_padded = pcops.knn(padded, padded, 9)
    assert torch.equal(whole.idx, chunked.idx) and torch.equal(whole.dists, chunked.dists)
    assert torch.equal(whole_padded.idx, chunked_padded.idx) and torch.equal(whole_padded.dists, chunked_padded.dists)
    for b in range(3):
        rows = (batch == b).nonzero().flatten()
        assert torch.equal(chunked.idx[rows], rows[brute_force(x[rows], x[rows], 9)[1]])
        assert torch.equal(chunked_padded.idx[b], brute_force(padded[b], padded[b], 9)[1])


@pytest.mark.parametrize("gram, points_dtype", [(F64, F64), (torch.float32, torch.float32), (F64, torch.float32)])
def test_rank_keeps_the_width_smallest_gram_values(gen, monkeypatch, gram, points_dtype):
    """The kernel's candidates are the rows of the width smallest values of its row (each value
    here the Gram formula's with |q|^2 = |p|^2 = 0), whatever the row's length and the ties, and
    ``last`` is the width-th smallest (inf where the row has fewer finite values, NaN where one is
    NaN); the queries split into 1 to 7 ranges, one buffer each; rows of one tile and of several
    (the first tile's bound from each lane's smallest values, then the buffer's), widths within
    and past what the lanes bound (8 float32 or 4 float64 lanes, 8 values each)."""
    from pcops.ops.neighbours.nearest import _features

    # random rows, then rows about a tile's length and widths about what the lanes bound
    edges = [(_features.TILE + d, w) for d in (-1, 0, 1, 9) for w in (1, 31, 32, 33, 64)]
    for trial in range(120 + len(edges)):
        if trial < 120:
            n = int(torch.randint(1, 3 * _features.TILE, (1,), generator=gen))
            width = int(torch.randint(1, min(n, _features.MAX_WIDTH) + 1, (1,), generator=gen))
        else:
            n, width = edges[trial - 120]
        values = torch.randn(2, 3, n, generator=gen, dtype=F64).to(gram)
        if trial % 3 == 0:
            values = values.round()  # many equal values
        if trial % 5 == 0:
            values[:, :, n // 2 :] = float("inf")  # fewer finite values than width, at times
        if trial % 7 == 0:
            values[1, 2, n // 3] = float("nan")  # (that row's last: NaN, its candidates any)
        products = (-values / 2).contiguous()
        zeros = torch.zeros(2, 3, dtype=gram), torch.zeros(2, n, dtype=gram)
        rows = torch.arange(n).expand(2, n).contiguous()
        points = torch.zeros(2, 3, 1, dtype=points_dtype), torch.zeros(2, n, 1, dtype=points_dtype)  # every distance 0: ties by row
        with monkeypatch.context() as m:  # the queries in 1 to 7 ranges, each through one buffer
            m.setattr(_features._threads, "requested", lambda: 1 + trial % 7)
            dist, cand, last = _features.rank(products, *zeros, *points, rows, width, width)
        smallest = values.sort(-1).values
        nan = values.isnan().any(-1)
        assert torch.equal(last.isnan(), nan), trial
        assert torch.equal(last[~nan], smallest[..., width - 1][~nan]), trial
        finite = cand >= 0
        assert torch.equal(finite[~nan], torch.isfinite(smallest[..., :width])[~nan]), trial
        kept = torch.where(finite, values.gather(2, cand.clamp_min(0)), float("inf")).sort(-1).values
        assert torch.equal(kept[~nan], smallest[..., :width][~nan]), trial
        assert bool((cand[..., 1:][finite[..., 1:]] > cand[..., :-1][finite[..., 1:]]).all()), trial  # equal distances: by row


@pytest.mark.parametrize("dim", [8, 64])
def test_padded_layout_equals_a_per_sample_loop(gen, dim, monkeypatch):
    lengths = torch.tensor([50, 7, 31, 1])
    q = torch.randn(4, 50, dim, generator=gen, dtype=F64)
    from pcops.ops.neighbours.nearest import _torch

    again = []  # samples of fewer than k points are complete from their candidates: no second search
    monkeypatch.setattr(_torch, "_exact_rows", lambda *args: again.append(args))
    dists, idx = pcops.knn(q, q, 10, query_lengths=lengths, ref_lengths=lengths)
    assert not again
    for b, n in enumerate(lengths.tolist()):
        k = min(10, n)
        ref_d, ref_idx = brute_force(q[b, :n], q[b, :n], k)
        torch.testing.assert_close(idx[b, :n, :k], ref_idx, rtol=0, atol=0)
        torch.testing.assert_close(dists[b, :n, :k], ref_d, rtol=1e-12, atol=1e-12)
        assert torch.all(idx[b, :n, k:] == -1) and torch.all(torch.isinf(dists[b, :n, k:]))
        assert torch.all(idx[b, n:] == -1)  # padding rows find nothing


@pytest.mark.parametrize("dim", [8, 64])
def test_packed_layout_equals_a_per_sample_loop(gen, dim):
    sizes = [30, 12, 45]
    batch = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])[torch.randperm(sum(sizes), generator=gen)]
    x = torch.randn(sum(sizes), dim, generator=gen, dtype=F64)
    dists, idx = pcops.knn(x, x, 12, query_batch=batch, ref_batch=batch)
    for b in range(len(sizes)):
        rows = (batch == b).nonzero().flatten()
        ref_d, ref_idx = brute_force(x[rows], x[rows], 12)
        torch.testing.assert_close(idx[rows], rows[ref_idx], rtol=0, atol=0)  # packed indices are global
        torch.testing.assert_close(dists[rows], ref_d, rtol=1e-12, atol=1e-12)


def test_distances_are_differentiable_in_d_dimensions(gen):
    q = torch.randn(12, 8, generator=gen, dtype=F64).requires_grad_()
    p = torch.randn(20, 8, generator=gen, dtype=F64).requires_grad_()
    torch.autograd.gradcheck(lambda a, b: pcops.knn(a, b, 5).dists, (q, p))


@pytest.mark.parametrize("dim", [3, 64])
def test_recomputed_distances_without_a_gradient_equal_the_differentiable_ones(gen, dim):
    """The distances to gathered neighbours made in place (nothing to differentiate) are the
    differentiable formula's to the bit: NaN and missing neighbours 0 where not valid, a NaN
    query's row 0, equal points 0, and the neighbours' copies are what gets written."""
    q = torch.randn(40, dim, generator=gen)
    nb = torch.randn(40, 6, dim, generator=gen)
    nb[:, 0] = q  # distance 0
    nb[3, 2] = float("nan")
    nb[5, 1, 0] = float("inf")
    q[7] = float("nan")
    valid = torch.rand(40, 6, generator=gen) > 0.3
    valid[3, 2] = False
    valid[7] = False
    with torch.enable_grad():
        grad_side = knn_module._distances(q.clone().requires_grad_(), nb.clone(), valid).detach()
    with torch.no_grad():
        copy = nb.clone()
        in_place = knn_module._distances(q, copy, valid)
    assert torch.equal(in_place, grad_side)
    assert not torch.equal(copy, nb)  # (the gathered copy took the work, not a new tensor)
    assert in_place[3, 2] == 0 and bool((in_place[7] == 0).all()) and bool((in_place[~valid] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_feature_distances_with_a_gradient_equal_those_without(gen, dtype):
    """In D != 3 a call without a gradient returns the search's own distances (float64 direct
    differences rounded once: no (P, k, D) gather) and a call with one the same values, bit for
    bit, with the formula's derivatives (against float64 brute force: values, and the gradient
    of their sum against autograd through the dense formula); missing neighbours inf."""
    lengths = torch.tensor([30, 4])
    x = torch.randn(2, 30, 8, generator=gen, dtype=dtype)
    plain = pcops.knn(x, x, 6, query_lengths=lengths, ref_lengths=lengths)
    xg = x.clone().requires_grad_()
    graded = pcops.knn(xg, x, 6, query_lengths=lengths, ref_lengths=lengths)
    assert torch.equal(plain.idx, graded.idx) and torch.equal(plain.dists, graded.dists.detach())
    assert bool(torch.isinf(plain.dists[1, :4, 4:]).all())
    ref_d, _ = brute_force(x[0].double(), x[0].double(), 6)
    torch.testing.assert_close(plain.dists[0].double(), ref_d, rtol=torch.finfo(dtype).eps, atol=0)
    finite = torch.isfinite(graded.dists)
    graded.dists[finite].sum().backward()
    xd = x.detach().double().requires_grad_()
    dense = (xd[:, :, None, :] - x.double()[:, None, :, :]).square().sum(-1).clamp_min(1e-300).sqrt()
    picked = dense.gather(2, plain.idx.clamp_min(0))
    picked[finite & (picked > 1e-100)].sum().backward()
    torch.testing.assert_close(xg.grad.double(), xd.grad, rtol=1e-4 if dtype == torch.float32 else 1e-10, atol=1e-5 if dtype == torch.float32 else 1e-10)


def test_float32_points_beyond_float32_squares_are_found_in_d_dimensions():
    """The search measures in float64: float32 points 1e20 apart (a square past float32's
    range) are each other's neighbours at a finite distance, with and without a gradient."""
    x = torch.zeros(2, 8)
    x[1, 0] = 1e20
    for points in (x, x.clone().requires_grad_()):
        out = pcops.knn(points, x, 2)
        assert out.idx.tolist() == [[0, 1], [1, 0]]
        far = x[1, 0].item()  # (1e20 in float32)
        assert out.dists.detach().tolist() == [[0.0, far], [0.0, far]]


def test_float32_points_far_on_one_side_of_their_centre_are_searched_in_float64(gen):
    """The float32 Gram form needs every centred coordinate within 2^50 on both sides: one point
    of 32,768 far below the others (its centred coordinate past float32's squares, the others'
    within 2^50 above the centre), and a query far from points that are not; float64 brute
    force's neighbours and distances."""
    n, far = 32768, 0.9 * 2.0**50 * 32768
    ref = torch.randn(n, 4, generator=gen)
    ref[0, 0] = -far
    queries = torch.cat([ref[:1] + 1.0, torch.randn(5, 4, generator=gen)])
    lone = torch.cat([torch.tensor([[-far, 0.0, 0.0, 0.0]]), torch.randn(3, 4, generator=gen)])
    for q, p in ((queries, ref), (lone, torch.randn(40, 4, generator=gen))):
        out = pcops.knn(q, p, 3)
        ref_d, ref_idx = brute_force(q, p, 3)
        assert torch.equal(out.idx, ref_idx)
        torch.testing.assert_close(out.dists.double(), ref_d, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_features_are_searched_in_float32(gen, dtype):
    """float16 / bfloat16 points are searched in float32 (the CPU's Warp ranking): float64 brute
    force's neighbours of the same values, distances in the points' dtype within one rounding."""
    x = torch.randn(150, 16, generator=gen).to(dtype)
    out = pcops.knn(x, x, 7)
    ref_d, ref_idx = brute_force(x.float(), x.float(), 7)
    assert out.dists.dtype == dtype and torch.equal(out.idx, ref_idx)
    torch.testing.assert_close(out.dists.double(), ref_d, rtol=torch.finfo(dtype).eps, atol=0)


def test_search_op_passes_opcheck_in_d_dimensions(gen):
    op = knn_module.BACKENDS["torch"].op
    for dtype in (torch.float32, F64):
        q, p = torch.randn(20, 8, generator=gen, dtype=dtype), torch.randn(30, 8, generator=gen, dtype=dtype)
        groups = torch.randint(0, 3, (20,), generator=gen, dtype=torch.int32), torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
        torch.library.opcheck(op._opoverload, (q, p, 4, True))
        torch.library.opcheck(op._opoverload, (q, p, 4, True, *groups))


@pytest.mark.parametrize("backend", ["warp", "scipy", "cuml"])
def test_three_d_only_backends_refuse_other_dimensions(backend):
    x = torch.rand(10, 8)
    with pytest.raises(ValueError, match="3-D points only"):
        pcops.knn(x, x, 3, backend=backend)


def test_mismatched_dimensions_name_the_argument():
    with pytest.raises(ValueError, match="query and ref must have the same last dimension"):
        pcops.knn(torch.rand(10, 8), torch.rand(10, 5), 3)
    with pytest.raises(ValueError, match="query and ref must have the same last dimension"):
        pcops.knn(torch.rand(2, 10, 8), torch.rand(2, 10, 3), 3)
    with pytest.raises(ValueError, match="ref must be a tensor of shape"):
        pcops.knn(torch.rand(10, 8), torch.rand(2, 10, 8), 3)


def test_three_d_points_still_use_the_automatic_choice(gen):
    q, p, _ = reference.cloud("uniform", gen)
    d, idx = pcops.knn(q, p, 5)
    ref_d, ref_idx = reference.knn(q, p, 5)
    torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)


def test_feature_knn_compiles_with_fullgraph_and_dynamic_sizes(gen):
    from torch._dynamo.testing import CompileCounterWithBackend

    def edge_max(x):  # a DGCNN-style step: neighbours in feature space, max of the differences
        idx = pcops.knn(x, x, 4).idx
        return (x[idx] - x[:, None, :]).amax(1)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(edge_max, fullgraph=True, dynamic=True, backend=counter)
    for n in (30, 41):
        x = torch.randn(n, 8, generator=gen)
        torch.testing.assert_close(compiled(x), edge_max(x))
    assert counter.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"]
