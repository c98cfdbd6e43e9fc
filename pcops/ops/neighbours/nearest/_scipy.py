"""kNN with ``scipy.spatial.cKDTree`` on all cores (CPU only).

cKDTree leaves the order of equal distances open; pcops breaks ties by the smaller index:
rows are sorted by (distance, index), and where the k-th neighbour is tied with the next one a
ball query at that distance collects every tied candidate. cKDTree measures in float64; float32
points are ranked by their float32 distances (:func:`_in_float32`), as the other backends rank them. Groups (batches) share one tree: each sample is shifted along x
by a multiple of more than the cloud's extent, so a sample's own points are always nearer than
any other sample's; neighbours from another sample (a sample with fewer than k points) are
then replaced by -1 / inf.
"""

import numpy as np
import torch

from ._registry import backend


def _retake(tree, q, rows, radii, measure, k, dist, idx):
    """Rows ``rows`` of the sorted (dist, idx) (M, >= k) from every point within ``radii`` of
    their queries (``q``, as the tree holds them): their k best by ``measure(row, cand)``'s
    distances, then index (a point beyond a row's candidates could tie or beat its k-th)."""
    balls = tree.query_ball_point(q[rows], radii, workers=-1)
    for row, cand in zip(rows, balls):
        cand = np.asarray(cand, dtype=np.int64)
        d = measure(row, cand)
        pick = np.lexsort((cand, d))[:k]
        dist[row, : pick.size], idx[row, : pick.size] = d[pick], cand[pick]


def _fix_boundary_ties(tree, q, ref, k, dist, idx, rows):
    """Rows whose k-th distance is shared with an unreturned point: take all at that distance."""
    _retake(tree, q, rows, dist[rows, k - 1] * (1 + 1e-9), lambda row, cand: np.sqrt(((ref[cand] - q[row]) ** 2).sum(1)),  # margin: rounding
            k, dist, idx)


def _separate(q, p, query_group, ref_group):
    """Shift each group along x so that groups are farther apart than any two points of one group."""
    qg, pg = query_group.numpy(), ref_group.numpy()
    _, rank = np.unique(np.concatenate([qg, pg]), return_inverse=True)
    both = np.concatenate([q, p])
    offset = 4.0 * float((both.max(0) - both.min(0)).max()) + 1.0
    q[:, 0] += rank[: len(qg)] * offset
    p[:, 0] += rank[len(qg) :] * offset


@backend("scipy", devices=("cpu",), requires=("scipy",), install="pip install scipy")
def search(query, ref, k, query_group, ref_group):
    usable, present = torch.isfinite(query).all(1), torch.isfinite(ref).all(1)
    if bool(usable.all()) and bool(present.all()):
        return _search(query, ref, k, query_group, ref_group)
    # NaN/inf points (validate=False; cKDTree rejects them) are never neighbours, and find none
    dists, idx = query.new_full((query.shape[0], k), float("inf")), torch.full((query.shape[0], k), -1)
    keep = present.nonzero()[:, 0]
    kk = min(k, keep.numel())
    if kk and bool(usable.any()):
        groups = (None, None) if query_group is None else (query_group[usable], ref_group[keep])
        d, i = _search(query[usable], ref[keep], kk, *groups)
        dists[usable, :kk], idx[usable, :kk] = d, torch.where(i >= 0, keep[i.clamp_min(0)], -1)
    return dists, idx


def _search(query, ref, k, query_group, ref_group):
    from scipy.spatial import cKDTree

    m, n = query.shape[0], ref.shape[0]
    if m == 0:
        return query.new_empty((0, k)), torch.empty((0, k), dtype=torch.int64)
    q = query.detach().numpy().astype(np.float64)
    p = ref.detach().numpy().astype(np.float64)
    if query_group is not None:
        _separate(q, p, query_group, ref_group)
    tree = cKDTree(p)
    kq = min(k + 1, n)  # one more, to see whether the k-th is tied with the next
    dist, idx = tree.query(q, k=list(range(1, kq + 1)), workers=-1)
    dist, idx = dist.reshape(m, kq), idx.reshape(m, kq).astype(np.int64)
    idx[np.isinf(dist)] = -1  # cKDTree's "none" (index n): squared distances beyond float64, never neighbours (as Warp's)
    order = np.lexsort((idx, dist), axis=-1)
    dist, idx = np.take_along_axis(dist, order, 1), np.take_along_axis(idx, order, 1)
    if query.dtype == torch.float32:
        groups = None if query_group is None else (query_group.numpy(), ref_group.numpy())
        dist, idx = _in_float32(tree, q, query.detach().numpy(), ref.detach().numpy(), k, dist, idx, groups)
        return torch.from_numpy(dist), torch.from_numpy(idx)
    if kq > k:
        rows = np.flatnonzero((dist[:, k] == dist[:, k - 1]) & np.isfinite(dist[:, k - 1]))
        if rows.size:
            _fix_boundary_ties(tree, q, p, k, dist, idx, rows)
    dist, idx = np.ascontiguousarray(dist[:, :k]), np.ascontiguousarray(idx[:, :k])
    if query_group is not None:
        other = ref_group.numpy()[idx] != query_group.numpy()[:, None]
        dist[other], idx[other] = np.inf, -1
    return torch.from_numpy(dist).to(query.dtype), torch.from_numpy(idx)


# A float32 distance's relative error at most, with room: the differences, three squares and two
# sums each round by half an ulp (the square's error at most 4 ulps, the root's half of it, and
# its own rounding half an ulp)
_DOUBT32 = 8 * float(np.finfo(np.float32).eps)


def _measured32(q32, p32, rows, cand, groups):
    """Distances (float32, inf where no candidate or another sample's) of the queries ``rows`` to
    their candidates ``cand`` (R, C) of the float32 points, as the Warp search measures them:
    float32 differences, squares summed x, y, z, the IEEE root."""
    diff = p32[np.maximum(cand, 0)] - q32[rows][:, None, :]
    sq = diff[..., 0] * diff[..., 0] + diff[..., 1] * diff[..., 1] + diff[..., 2] * diff[..., 2]
    out = (cand < 0) | ~np.isfinite(sq)
    if groups is not None:
        out |= groups[1][np.maximum(cand, 0)] != groups[0][rows][:, None]
    return np.where(out, np.float32(np.inf), np.sqrt(sq))


def _in_float32(tree, q, q32, p32, k, dist, idx, groups):
    """(dists, idx) (M, k) of float32 points ranked as the other backends rank them: by their
    float32 distances (:func:`_measured32`), ties by the smaller index, from cKDTree's k + 1
    nearest in float64 (``dist``, ``idx``, sorted; ``q`` its float64 queries) re-measured; a
    query whose (k + 1)-th float64 distance is not clear of its k-th float32 one by their
    rounding (a point beyond could tie or beat it: a lattice) takes every point its ball of that
    float32 distance, widened by the rounding, holds."""
    m, kq = idx.shape
    rows = np.arange(m)
    d32 = _measured32(q32, p32, rows, idx, groups)
    order = np.lexsort((idx, d32), axis=-1)
    d32, idx = np.take_along_axis(d32, order, 1), np.take_along_axis(idx, order, 1)
    if kq > k:
        kth = d32[:, k - 1].astype(np.float64)
        doubt = np.flatnonzero(np.isfinite(kth) & (dist[:, k] * (1 - _DOUBT32) <= kth))
        if doubt.size:
            _retake(tree, q, doubt, kth[doubt] / (1 - _DOUBT32) * (1 + 1e-12),
                    lambda row, cand: _measured32(q32, p32, np.array([row]), cand[None, :], groups)[0], k, d32, idx)
    d32, idx = np.ascontiguousarray(d32[:, :k]), np.ascontiguousarray(idx[:, :k])
    idx[np.isinf(d32)] = -1
    return d32, idx
