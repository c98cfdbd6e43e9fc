"""Ball query: the up to K CLOSEST reference points within a radius, and how many there are.

For each query q_i, with d_ij = ||q_i - p_j|| and N(i) = {j : d_ij <= radius}:

    idx[i]    = the min(K, |N(i)|) points of N(i) with the smallest d_ij, ascending, ties by
                the smaller j; padded with -1 (dists inf)
    counts[i] = |N(i)|, not capped at K, so a truncated neighbourhood is visible

Unlike caps that keep the first K points found (torch_cluster's radius, PyTorch3D's
ball_query), the result does not depend on the traversal order. The search and its Warp kernel
(a scan of the radius ops' cell list) are in ``_ball_search``, shared with
:func:`pcops.ball_queries` and pcops.compat's by-index op. Where a gradient to the points is
asked for, the distances are recomputed in torch from the indices, as :func:`pcops.knn` does,
so they are differentiable with respect to both point sets; otherwise they are the kernel's own.
Output shapes are static: the op compiles with ``fullgraph=True``.
"""

from typing import Optional

import torch

from ... import _layout, _threads, _validate
from ._ball_search import BallQuery, result, search, search_one
from .nearest import _points_grad


@_threads.custom_op("pcops::ball_query", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _ball_query(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    max_neighbors: int,
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query (M, 3), ref (N, 3) of one float dtype -> (idx (M, K) int64, counts (M,) int64,
    dists (M, K) of the points' dtype: the distances of idx's points, inf past the counts)."""
    return search_one(query, ref, radius, max_neighbors, validate, query_group, ref_group)


@_ball_query.register_fake
def _(query, ref, radius, max_neighbors, validate, query_group, ref_group):
    m = query.shape[0]
    return (query.new_empty((m, max_neighbors), dtype=torch.int64), query.new_empty((m,), dtype=torch.int64),
            query.new_empty((m, max_neighbors)))


def _check_max_neighbors(max_neighbors) -> None:
    _validate.count("max_neighbors", max_neighbors)


# Whether plain eager calls run the search directly (:func:`_plain_ball_query`; tests switch it
# off to compare both paths)
PLAIN = [True]


def _plain_ball_query(query, ref, radius, max_neighbors, validate: bool) -> Optional[BallQuery]:
    """The result of a plain eager CPU :func:`ball_query` call, from the search called directly (no
    layout layer, no custom op); None for any other call. Plain: plain clouds
    (:func:`pcops._layout.plain_clouds`), ``radius`` a finite Python number > 0 and
    ``max_neighbors`` a Python int >= 1. Every check of the general path but the values' passes
    on such a call (the search checks those, with the same error), and it would run the same search on the same tensors and return its distances (no gradient
    asked for), indices and counts as they are; anything else takes that path."""
    if type(radius) not in (int, float) or not 0 < radius <= _validate.FLOAT_MAX or type(max_neighbors) is not int or not 1 <= max_neighbors <= _validate.INT64_MAX:
        return None
    if not _layout.plain_clouds(False, query, ref):
        return None
    # the values: checked by the search (a small cloud's kept launch as it runs, else first),
    # whose error is the general path's (the layout of plain clouds has nothing else to raise)
    idx, counts, dists = search(query, ref, [float(radius)], [max_neighbors], validate, None, None)
    return BallQuery(dists, idx, counts.view(-1))


@_threads.limits
def ball_query(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    max_neighbors: int,
    *,
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> BallQuery:
    """The up to ``max_neighbors`` closest reference points within ``radius`` of each query.

    Args:
        query: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed.
        ref: Tensor of shape (N, 3); (B, N, 3) padded; or (N_total, 3) packed.
        radius: Python number > 0; a point is a neighbour when d_ij <= radius.
        max_neighbors: K >= 1, columns of the result (may exceed N).
        query_lengths, ref_lengths: optional int tensors (B,) for padded inputs; rows past a
            sample's length are padding (never neighbours; their own rows are -1 / inf / 0).
        query_batch, ref_batch: int sample ids (M_total,) / (N_total,) of packed inputs.
        validate: check the points for NaN/inf and lengths/ids for range.

    Returns:
        BallQuery(dists, idx, counts): ``dists``/``idx`` of shape (M, K), (B, M, K) or
        (M_total, K), sorted by distance ascending, ties by the smaller index, padded with
        inf / -1; ``idx`` int64 into ``ref`` (per sample for padded inputs, into the packed
        ref for packed ones); ``counts`` (M,), (B, M) or (M_total,) int64, the number of
        reference points within the radius (not capped at K). ``dists`` are Euclidean, in the
        promoted dtype of the points, differentiable with respect to ``query`` and ``ref``.
        float16/bfloat16 points are searched in float32.

    Example:
        >>> import torch, pcops
        >>> ref = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.2, 0.0]])
        >>> out = pcops.ball_query(torch.tensor([[0.0, 0.0, 0.0]]), ref, radius=1.0, max_neighbors=4)
        >>> out.idx  # the neighbours within the radius, nearest first, -1 padding
        tensor([[ 0,  3,  1, -1]])
        >>> out.counts
        tensor([3])
    """
    if PLAIN[0] and query_lengths is None and ref_lengths is None and query_batch is None and ref_batch is None:
        out = _plain_ball_query(query, ref, radius, max_neighbors, validate)
        if out is not None:
            return out
    radius, max_neighbors = _validate.plain(radius), _validate.plain(max_neighbors)  # NumPy scalars as Python numbers
    flat = _layout.pair(
        query, ref, query_lengths=query_lengths, ref_lengths=ref_lengths,
        query_batch=query_batch, ref_batch=ref_batch, validate=validate,
    )
    _validate.positive_number("radius", radius)
    _check_max_neighbors(max_neighbors)
    dtype, out_dtype = _validate.compute_dtype(query, ref)
    q, p = flat.query.to(dtype), flat.ref.to(dtype)
    idx, counts, found = _ball_query(
        q.detach(), p.detach(), float(radius), max_neighbors, flat.validate, flat.query_group, flat.ref_group
    )
    return result(flat, q, p, idx, counts, found, out_dtype, _points_grad(query, ref))


__all__ = ["BallQuery", "ball_query"]
