"""kNN by chunked brute force in torch: the reference backend, on any device.

Distances use direct coordinate differences (never the matmul form of ``torch.cdist``), in
query chunks that bound memory to about ``_ENTRIES`` distances at a time; no (M, N, 3) tensor.
Points are ranked by their distances (the squares' IEEE roots, :func:`pcops._vml.sqrt`), ties by
the smaller index, exactly as the Warp search ranks them. Groups mask other samples' points to +inf.
"""

import math

import torch

from .... import _vml
from . import _features
from ._registry import backend

_ENTRIES = 1 << 22  # distances held per chunk (16 MB in float32)


def _smallest(d2: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k smallest entries of each row, ascending, ties by the smaller column index."""
    kth = d2.topk(k, dim=1, largest=False).values[:, -1:]
    below = d2 < kth
    tied = d2 == kth
    room = k - below.sum(1, keepdim=True)
    take = below | (tied & (tied.cumsum(1, dtype=torch.int32) <= room))
    idx = take.nonzero()[:, 1].view(-1, k)  # ascending column order per row
    dist = d2.gather(1, idx)
    order = dist.argsort(dim=1, stable=True)
    dist, idx = dist.gather(1, order), idx.gather(1, order)
    return dist, torch.where(torch.isinf(dist), -1, idx)  # inf: a masked point, not a neighbour


@backend("torch", devices=("cpu", "cuda"))
def search(query, ref, k, query_group, ref_group):
    if query.shape[1] != 3:
        return _search_features(query, ref, k, query_group, ref_group)
    m = query.shape[0]
    dists = query.new_empty((m, k))
    idx = torch.empty((m, k), dtype=torch.int64, device=query.device)
    chunk = max(1, _ENTRIES // max(ref.shape[0], 1))
    for s in range(0, m, chunk):
        q = query[s : s + chunk]
        d2 = (q[:, None, 0] - ref[None, :, 0]).square()
        d2 += (q[:, None, 1] - ref[None, :, 1]).square()
        d2 += (q[:, None, 2] - ref[None, :, 2]).square()
        d2.masked_fill_(d2.isnan(), float("inf"))  # a NaN/inf point is never a neighbour (validate=False)
        if query_group is not None:
            d2.masked_fill_(query_group[s : s + chunk, None] != ref_group[None, :], float("inf"))
        # ranked by the distances themselves (IEEE roots, as the Warp search's: two squares an ulp
        # apart often have one root, and those points tie by their indices)
        dists[s : s + chunk], idx[s : s + chunk] = _smallest(_vml.sqrt(d2), k)
    return dists, idx


_CANDIDATES = 8  # extra candidates ordered by (distance, index) in the feature-space search
# a bound on the Gram form's error, per dimension, times (|q - c| + max |p - c|)^2: sums of D
# products and three terms (and float32's rounding of the centred coordinates) round by at most
# about (D + 3) eps of that square (16 eps a dimension)
_GRAM_ROUNDING = {dtype: 16 * torch.finfo(dtype).eps for dtype in (torch.float32, torch.float64)}
# Whether CPU feature-space searches keep and rank their candidates in Warp (:mod:`._features`),
# with a float32 Gram form for float32 points (tests switch it off to compare with the torch form)
RANK_IN_WARP = [True]


def _pad_groups(points: torch.Tensor, group: torch.Tensor | None, groups: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Points sorted into a (groups, S, D) block, S the largest group, each slot's row (-1:
    empty), and whether the block is the points themselves (groups of one size, in order: a
    padded batch's rows, a view, each slot's row its position)."""
    p = points.shape[0]
    if group is None or (p and p % groups == 0 and bool((group.reshape(groups, -1) == torch.arange(groups, device=group.device)[:, None]).all())):
        return points.reshape(groups, -1, points.shape[1]), torch.arange(p, device=points.device).view(groups, -1), True
    group = group.long()
    order = group.argsort(stable=True)
    counts = torch.bincount(group, minlength=groups)
    starts = counts.cumsum(0) - counts
    slot = torch.arange(points.shape[0], device=points.device) - starts[group[order]]
    size = max(int(counts.max()), 1) if points.shape[0] else 1
    rows = torch.full((groups, size), -1, dtype=torch.int64, device=points.device)
    rows[group[order], slot] = order
    block = points.new_zeros((groups, size, points.shape[1]))
    block[group[order], slot] = points[order]
    return block, rows, False


def _direct(q: torch.Tensor, r: torch.Tensor, slots: torch.Tensor, gram: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Squared distances of the candidates ``slots`` (G, S, W) of queries ``q`` (G, S, D) in the
    blocks ``r`` (G, R, D), by direct differences (float64): the Gram form's rounding depends on
    the BLAS kernel the CPU picks, so equal distances (exact duplicates) could differ in their
    last bits and break the tie rule. Candidates the Gram form found nowhere (inf) stay inf.
    The candidates' points are copied into ``scratch`` (at least G S W D entries of r's dtype,
    kept across a call's chunks) and their differences and squares made there."""
    g, s, w = slots.shape
    rows = (slots + (torch.arange(g, device=slots.device) * r.shape[1])[:, None, None]).view(-1)  # rows of the (G R, D) blocks
    pts = torch.index_select(r.reshape(g * r.shape[1], -1), 0, rows, out=_view(scratch, (g * s * w, r.shape[2]))).view(g, s, w, -1)
    # (p - q)^2 in place: the squares of (q - p)
    return torch.where(torch.isinf(gram), gram, pts.sub_(q[:, :, None, :]).square_().sum(-1))


def _view(scratch: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A contiguous tensor of ``shape`` on the first entries of the flat ``scratch``."""
    return scratch[: math.prod(shape)].view(shape)


def _exact_rows(q: torch.Tensor, r: torch.Tensor, r_rows: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, cand: torch.Tensor) -> None:
    """The k = values.shape[-1] nearest points of the queries ``rows`` (G, S) bool of ``q`` (G,
    S, D), by direct squared distances to every point of their group's block ``r`` (G, R, D)
    (slots in row order: ties by the smaller row), into ``values`` and ``cand`` (G, S, k) (rows
    of ref) in place; NaN distances as inf (never a neighbour)."""
    g, s = rows.nonzero(as_tuple=True)
    k = values.shape[-1]
    step = max(1, _ENTRIES // max(r.shape[1] * r.shape[2], 1))
    for a in range(0, g.shape[0], step):
        gi, si = g[a : a + step], s[a : a + step]
        d2 = (q[gi, si][:, None, :] - r[gi]).square().sum(-1)  # (n, R)
        d2.masked_fill_(d2.isnan() | (r_rows[gi] < 0), float("inf"))
        sq, slot = _smallest(d2, k)
        values[gi, si] = sq
        cand[gi, si] = torch.where(slot >= 0, r_rows[gi].gather(1, slot.clamp_min(0)), -1)


def _search_features(query, ref, k, query_group, ref_group):
    """kNN of D-dimensional points (D != 3): every group is a dense block, all blocks at once.

    Candidates come from the Gram form |q|^2 + |p|^2 - 2 q.p (batched matrix products, O(M N D)
    flops per group, after centring each group on its mean): the k + 8 smallest. In float64
    (float32 inputs are exact there, so only the sums round, ~1e-16 relative), or on the CPU for
    float32 points in float32 (:func:`_gram_dtype`). Those are ranked by their directly computed
    squared distances (:func:`_direct`), then by index, so exact ties go to the smaller index on
    any BLAS. A query whose last candidate's Gram value is not clear of its k-th distance by the
    Gram form's rounding (more points tie, or nearly tie, than the candidates hold: duplicates,
    lattices) is searched again by direct differences to every point of its group
    (:func:`_exact_rows`). On the CPU one Warp launch a chunk keeps and ranks the candidates
    (:mod:`._features`); elsewhere torch's ``topk`` and sorts. ``knn`` returns these distances
    (float64 direct differences rounded once), with the derivatives of its own formula.
    """
    groups = 1 if query_group is None else int(max(query_group.max(), ref_group.max())) + 1 if query.shape[0] else 1
    # the blocks in the points' dtype (the CPU's ranking measures from them: float32 values are
    # exact in float64, the same differences, half the memory read); in float64 only where the
    # torch form or a query searched again takes them
    same = ref is query and ref_group is query_group  # (knn(x, x): one block, its centred points the queries' too)
    q_points, q_rows, in_order = _pad_groups(query, query_group, groups)
    r_points, r_rows, r_in_order = (q_points, q_rows, in_order) if same else _pad_groups(ref, ref_group, groups)
    width = min(r_points.shape[1], k + _CANDIDATES)
    take = min(k, width)
    cpu = query.device.type == "cpu" and RANK_IN_WARP[0] and width <= _features.MAX_WIDTH
    r_valid = r_rows >= 0
    # centred in float64 (the points' dtype promotes: float32 values' differences exact there)
    centre = (r_points.sum(1, dtype=torch.float64) / r_valid.sum(1).clamp_min(1)[:, None])[:, None, :]
    rc = r_points - centre
    gram = _gram_dtype(query.dtype, cpu, None if same else q_points, centre, rc, r_valid, r_in_order)
    rc = rc.to(gram)
    norms = rc.square().sum(-1)
    r_sq = norms.masked_fill(~r_valid, float("inf"))[:, None, :]  # empty slots: never found
    r_reach = norms.masked_fill(~r_valid, 0).amax(-1).double().sqrt()[:, None]  # max |p - c| per group
    r_block = None if cpu else r_points.double()  # (the points in float64: the torch form, and the rows searched again)
    dists = torch.full((query.shape[0], k), float("inf"), dtype=query.dtype, device=query.device)
    idx = torch.full((query.shape[0], k), -1, dtype=torch.int64, device=query.device)
    # a chunk's (G, S, R) products (elsewhere also Gram values and candidates' points) hold about
    # _ENTRIES entries, on scratch kept across the chunks; on the CPU a row counts as 4 MAX_WIDTH
    # entries at least (its results: a search of many queries in few points)
    n, dims = r_points.shape[1:]
    per_row = max(n, 4 * _features.MAX_WIDTH) if cpu else max(n, width * dims)
    chunk = max(1, _ENTRIES // max(groups * per_row, 1))
    rows_at_most = groups * min(chunk, q_points.shape[1])
    scratch = [rc.new_empty(rows_at_most * n)]
    if not cpu:
        scratch += [r_block.new_empty(rows_at_most * n), r_block.new_empty(rows_at_most * width * dims)]
    for s in range(0, q_points.shape[1], chunk):
        qc = rc[:, s : s + chunk] if same else (q_points[:, s : s + chunk] - centre).to(gram)
        shape = (groups, qc.shape[1], n)
        products = torch.bmm(qc, rc.transpose(1, 2), out=_view(scratch[0], shape))
        q_sq = norms[:, s : s + chunk] if same else qc.square().sum(-1)
        if cpu:
            values, cand, last = _features.rank(products, q_sq, r_sq[:, 0], q_points[:, s : s + chunk], r_points, r_rows, width, take)
        else:
            values, cand, last = _candidates(products.mul_(2), q_sq, r_sq, q_points[:, s : s + chunk].double(), r_block, r_rows, width, take,
                                             ref.shape[0], scratch[1:])
        if width < n:  # points left out: could one tie or beat the k-th?
            reach = q_sq.double().sqrt() + r_reach  # |q - c| + max |p - c|
            clear = last.double() - _GRAM_ROUNDING[gram] * (query.shape[1] + 3) * reach.square() > values[..., -1]
            doubt = ~(clear | (last == float("inf")))  # (NaN: doubt; inf: no point left out is finite, a sample of fewer than k)
            if bool(doubt.any()):
                r_block = r_points.double() if r_block is None else r_block
                _exact_rows(q_points[:, s : s + chunk].double(), r_block, r_rows, doubt, values, cand)
        best = torch.where(torch.isinf(values), -1, cand)
        if in_order:  # (the block's slots are the queries' rows)
            dists.view(groups, -1, k)[:, s : s + chunk, :take] = values.clamp_min(0).sqrt()
            idx.view(groups, -1, k)[:, s : s + chunk, :take] = best
            continue
        rows = q_rows[:, s : s + chunk]
        keep = rows >= 0
        dists[rows[keep], :take] = values[keep].clamp_min(0).sqrt().to(query.dtype)
        idx[rows[keep], :take] = best[keep]
    return dists, idx


def _candidates(products, q_sq, r_sq, q, r, r_rows, width: int, take: int, n_ref: int, scratch: list) -> tuple:
    """:func:`._features.rank` in torch operations (any device): ``products`` doubled in place."""
    gram = torch.add(q_sq[..., None], r_sq, out=_view(scratch[0], products.shape)).sub_(products)  # (|q|^2 + |p|^2) - 2 q.p
    values, slots = gram.topk(width, dim=2, largest=False)  # (G, S, width)
    last = values[..., -1]  # no point outside the candidates has a smaller Gram value
    cand = r_rows.gather(1, slots.reshape(r_rows.shape[0], -1)).reshape(slots.shape)  # rows of ref, -1 for none
    values = _direct(q, r, slots, values, scratch[1])
    cand, order = torch.where(cand >= 0, cand, n_ref).sort(dim=2)  # by row first ...
    values, order2 = values.gather(2, order).sort(dim=2, stable=True)  # ... then by distance: ties by row
    return values[..., :take], cand.gather(2, order2)[..., :take], last


def _gram_dtype(dtype: torch.dtype, cpu: bool, q_points: torch.Tensor | None, centre: torch.Tensor, rc: torch.Tensor, r_valid: torch.Tensor,
                full: bool) -> torch.dtype:
    """The Gram form's dtype: float32 for float32 points on the CPU whose centred coordinates
    (the blocks of queries ``q_points`` (G, S, D) less ``centre`` (G, 1, D), None where the
    queries are the points; and ``rc`` (G, R, D), float64, of the points, ``r_valid`` (G, R)
    their slots, every one where ``full``) are finite, at most 2^50 in size (no square or sum
    overflows float32) and spread by at least 2^-30 in every sample with points (its largest
    centred coordinate: then every query's rounding bound, at least eps times that squared, is
    far above what underflow of the smaller values can add); float64 otherwise. The bound
    (:data:`_GRAM_ROUNDING`) scales with the dtype's eps: float32 has more queries searched
    again, but no other result. One host read."""
    if not cpu or dtype != torch.float32 or not (full and rc.shape[1] > 0 or bool(r_valid.any())):
        return torch.float64
    if full:  # (each sample's largest |centred coordinate|)
        spread = torch.maximum(rc.amax((1, 2)), rc.amin((1, 2)).neg())
    else:
        spread = rc.abs().masked_fill(~r_valid[..., None], 0).amax((1, 2))[r_valid.any(1)]
    if q_points is None or not q_points.numel():
        queries = spread[0]
    else:
        queries = torch.maximum(q_points.amax(1).double() - centre[:, 0], centre[:, 0] - q_points.amin(1).double()).amax()
    largest, smallest = torch.stack([torch.maximum(queries, spread.amax()), spread.amin()]).tolist()
    return torch.float32 if largest <= 2.0**50 and smallest >= 2.0**-30 else torch.float64  # (NaN, inf: float64)
