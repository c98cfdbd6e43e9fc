"""Ball queries: :func:`pcops.ball_query` at several radii in one call, one result per radius,
each equal to ball_query's at that radius.

One layout, one check, and per group of close radii (``_ball_search.GROUP_RATIO``) one cell
list and one scan that tests each point against every radius of the group: the search and its
one kernel are ball_query's (``_ball_search``).
"""

from typing import Optional

import torch

from ... import _layout, _threads, _validate
from ._ball_search import BallQuery, result, search
from .nearest import _points_grad


@_threads.custom_op("pcops::ball_queries", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _ball_queries(
    query: torch.Tensor,
    ref: torch.Tensor,
    radii: list[float],
    max_neighbors: list[int],
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query (M, 3), ref (N, 3) of one float dtype -> (idx (M, sum K) int64, radius g's K_g
    columns after those of the radii before it; counts (M, G) int64; dists (M, sum K) of idx's
    points, inf past the counts)."""
    _check_radii(radii, max_neighbors)
    return search(query, ref, list(radii), list(max_neighbors), validate, query_group, ref_group)


@_ball_queries.register_fake
def _(query, ref, radii, max_neighbors, validate, query_group, ref_group):
    m, width = query.shape[0], sum(max_neighbors)
    return (query.new_empty((m, width), dtype=torch.int64), query.new_empty((m, len(radii)), dtype=torch.int64),
            query.new_empty((m, width)))


def _check_radii(radii, max_neighbors) -> tuple[list, list]:
    """``radii`` (a sequence of numbers > 0, at least one) and ``max_neighbors`` (an int >= 1, or
    a sequence of as many as there are radii) as lists of Python numbers, one K per radius."""
    if type(radii) in (list, tuple) and radii and all(type(r) in (int, float) and 0 < r <= _validate.FLOAT_MAX for r in radii):
        if type(max_neighbors) is int and 1 <= max_neighbors <= _validate.INT64_MAX:  # (Python numbers in range: what the checks below pass)
            return list(radii), [max_neighbors] * len(radii)
        if type(max_neighbors) in (list, tuple) and len(max_neighbors) == len(radii) and all(type(k) is int and 1 <= k <= _validate.INT64_MAX for k in max_neighbors):
            return list(radii), list(max_neighbors)
    if isinstance(radii, (torch.Tensor, str, bytes)) or not hasattr(radii, "__len__") or not hasattr(radii, "__iter__"):
        raise TypeError(f"radii must be a sequence of numbers (a list or tuple), got {type(radii).__name__}")
    radii = [_validate.plain(r) for r in radii]
    if not radii:
        raise ValueError("radii must not be empty: give at least one radius")
    for g, r in enumerate(radii):
        _validate.positive_number(f"radii[{g}]", r)
    if isinstance(max_neighbors, (torch.Tensor, str, bytes)) or not hasattr(max_neighbors, "__len__"):
        ks = [_validate.plain(max_neighbors)] * len(radii)
        _validate.count("max_neighbors", ks[0])
    else:
        ks = [_validate.plain(k) for k in max_neighbors]
        if len(ks) != len(radii):
            raise ValueError(f"max_neighbors must be an int or have one entry per radius ({len(radii)} radii), got {len(ks)} entries")
        for g, k in enumerate(ks):
            _validate.count(f"max_neighbors[{g}]", k)
    return radii, ks


# Whether plain eager calls run the search directly (:func:`_plain_ball_queries`; tests switch it
# off to compare both paths)
PLAIN = [True]


def _plain_ball_queries(query, ref, radii, max_neighbors, validate: bool) -> Optional[tuple]:
    """The result of a plain eager CPU :func:`ball_queries` call, from the search called directly
    (no layout layer, no custom op); None for any other call. Plain: plain clouds
    (:func:`pcops._layout.plain_clouds`, their sums finite where ``validate`` asks) and radii
    and counts that :func:`_check_radii` accepts (its errors are the general path's: the layout
    of plain clouds has none to raise first). The general path would run the same search on
    the same tensors and return its distances (no gradient asked for), the same columns and
    counts; anything else takes that path."""
    if not PLAIN[0] or not _layout.plain_clouds(validate, query, ref):
        return None
    radii, ks = _check_radii(radii, max_neighbors)
    if len(radii) > 1 and query.shape[0] * ref.shape[0] <= SPLIT_PAIRS:  # a search per radius, each into its own outputs
        return tuple(BallQuery(d, i, c.view(-1)) for i, c, d in (search(query, ref, [float(r)], [k], False, None, None) for r, k in zip(radii, ks)))
    idx, counts, dists = search(query, ref, [float(r) for r in radii], ks, False, None, None)
    return tuple(BallQuery(d, i, c) for i, c, d in _per_radius(idx, counts, dists, ks))


# A plain call of several radii with at most this many (query, point) pairs searches each radius
# on its own (a dense launch each, its outputs whole): below, copying each radius' columns out of
# one shared search costs more than measuring the pairs again (docs/ops/ball_query.md)
SPLIT_PAIRS = 1 << 13


def _per_radius(idx: torch.Tensor, counts: torch.Tensor, found: torch.Tensor, ks: list) -> list:
    """(idx, counts, distances) of each radius from the search's columns (radius g's K_g after
    those of the radii before it; counts (M, G)), each contiguous."""
    if len(ks) == 1:
        return [(idx, counts[:, 0], found)]
    first = [sum(ks[:g]) for g in range(len(ks))]
    counts = counts.t().contiguous()  # (G, M): each radius' counts a contiguous row
    return [(idx[:, a:a + k].contiguous(), counts[g], found[:, a:a + k].contiguous()) for g, (a, k) in enumerate(zip(first, ks))]


@_threads.limits
def ball_queries(
    query: torch.Tensor,
    ref: torch.Tensor,
    radii,
    max_neighbors,
    *,
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> tuple[BallQuery, ...]:
    """:func:`ball_query` at several radii in one call: one result per radius, each equal to
    ``ball_query(query, ref, radii[g], max_neighbors[g], ...)``.

    The radii share the layout, the checks and the search: radii within ``GROUP_RATIO`` of
    each other share one cell list (sized by the largest) and one scan, which tests each point
    against every radius of the group (docs/ops/ball_query.md says what was measured).

    Args:
        query: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed.
        ref: Tensor of shape (N, 3); (B, N, 3) padded; or (N_total, 3) packed.
        radii: a sequence of G >= 1 Python numbers > 0 (any order, repeats allowed).
        max_neighbors: K >= 1 for every radius, or a sequence of G such ints, one per radius.
        query_lengths, ref_lengths: optional int tensors (B,) for padded inputs.
        query_batch, ref_batch: int sample ids (M_total,) / (N_total,) of packed inputs.
        validate: check the points for NaN/inf and lengths/ids for range.

    Returns:
        A tuple of G :class:`BallQuery` (dists, idx, counts), in the order of ``radii``: result g
        is the one of :func:`ball_query` at ``radii[g]`` with ``max_neighbors[g]`` columns
        (same shapes, padding, sorting, ties and gradients).

    Example:
        >>> import torch, pcops
        >>> points = torch.rand(1000, 3)
        >>> near, far = pcops.ball_queries(points, points, [0.05, 0.2], [8, 32])
        >>> near.idx.shape, far.idx.shape, far.counts.shape
        (torch.Size([1000, 8]), torch.Size([1000, 32]), torch.Size([1000]))
        >>> bool((far.counts >= near.counts).all())
        True
    """
    if query_lengths is None and ref_lengths is None and query_batch is None and ref_batch is None:
        plain = _plain_ball_queries(query, ref, radii, max_neighbors, validate)
        if plain is not None:
            return plain
    flat = _layout.pair(
        query, ref, query_lengths=query_lengths, ref_lengths=ref_lengths,
        query_batch=query_batch, ref_batch=ref_batch, validate=validate,
    )
    radii, ks = _check_radii(radii, max_neighbors)
    dtype, out_dtype = _validate.compute_dtype(query, ref)
    q, p = flat.query.to(dtype), flat.ref.to(dtype)
    idx, counts, found = _ball_queries(
        q.detach(), p.detach(), [float(r) for r in radii], ks, flat.validate, flat.query_group, flat.ref_group
    )
    grad = _points_grad(query, ref)
    return tuple(result(flat, q, p, i, c, d, out_dtype, grad) for i, c, d in _per_radius(idx, counts, found, ks))


__all__ = ["ball_queries"]
