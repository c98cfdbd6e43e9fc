"""Ball query: the up to K CLOSEST reference points within a radius, and how many there are.

For each query q_i, with d_ij = ||q_i - p_j|| and N(i) = {j : d_ij <= radius}:

    idx[i]    = the min(K, |N(i)|) points of N(i) with the smallest d_ij, ascending, ties by
                the smaller j; padded with -1 (dists inf)
    counts[i] = |N(i)|, not capped at K, so a truncated neighbourhood is visible

Unlike caps that keep the first K points found (torch_cluster's radius, PyTorch3D's
ball_query), the result does not depend on the traversal order. The cell list of the radius
ops (``pcops.ops.neighbours._cells``: the reference points sorted by cells of the grid) yields the
candidates; each query keeps its K best (distance, index) pairs sorted in its output row by
insertion. The kernel returns indices only: distances are
recomputed in torch from them, as :func:`pcops.knn` does, so they are differentiable with
respect to both point sets. Output shapes are static: the op compiles with ``fullgraph=True``.
"""

from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _batch, _validate, _warp, _warp_funcs
from . import _cells
from .nearest import _distances


class BallQuery(NamedTuple):
    """Result of :func:`ball_query`: ``dists`` and ``idx`` (..., K), ``counts`` (...) int64."""

    dists: torch.Tensor
    idx: torch.Tensor
    counts: torch.Tensor


@_warp.kernels
def _kernel(dtype: torch.dtype):
    """One thread per query (in cell order): scan the cells that meet [q - r, q + r], keep the K
    best (distance, original index) pairs and count every point within the radius."""
    s = _warp.scalar(dtype)
    Cells, window, run = _warp_funcs.cell_scan(dtype)
    insert = _warp_funcs.sorted_insert(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def search(
        start: int,
        cells: Cells,
        radius: s,
        dists: wp.array2d(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
        counts: wp.array(dtype=wp.int64),
    ):
        i = int(cells.rows[wp.tid() + start])
        q = cells.query[i]
        n = int(0)
        total = int(0)
        lo, hi = window(cells, i, q, radius)
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                first, last = run(cells, lo, hi, y, z)
                for j in range(first, last):
                    d = wp.length(q - cells.points[j])
                    if d <= radius:
                        total = total + 1
                        n = insert(dists, idx, i, n, d, cells.order[j])
        counts[i] = wp.int64(total)

    return search


@torch.library.custom_op("pcops::ball_query", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _ball_query(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    max_neighbors: int,
    validate: bool,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """query (M, 3), ref (N, 3) of one float dtype -> (idx (M, K) int64, counts (M,) int64)."""
    _validate.positive_number("radius", radius)
    _validate.groups_paired(query_group, ref_group)
    if validate:
        _validate.finite(query=query, ref=ref)
    m = query.shape[0]
    idx = torch.full((m, max_neighbors), -1, dtype=torch.int64, device=query.device)
    counts = torch.zeros((m,), dtype=torch.int64, device=query.device)
    if m == 0 or ref.shape[0] == 0:
        return idx, counts
    _warp.init()
    dists = query.new_full((m, max_neighbors), float("inf"))
    cells = _cells.CellList(query, ref, radius, query_group, ref_group)  # one host read (the grid's size)
    args = [cells.scan(query, query_group, _cells.permute(ref, cells.order)), radius, dists, idx, counts]
    _warp.launch(_kernel(query.dtype), m, args, like=query)
    return idx, counts


@_ball_query.register_fake
def _(query, ref, radius, max_neighbors, validate, query_group, ref_group):
    m = query.shape[0]
    return query.new_empty((m, max_neighbors), dtype=torch.int64), query.new_empty((m,), dtype=torch.int64)


def _check_max_neighbors(max_neighbors) -> None:
    _validate.count("max_neighbors", max_neighbors)


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
    """
    radius, max_neighbors = _validate.plain(radius), _validate.plain(max_neighbors)  # NumPy scalars as Python numbers
    flat = _batch.pair(
        query, ref, query_lengths=query_lengths, ref_lengths=ref_lengths,
        query_batch=query_batch, ref_batch=ref_batch, validate=validate,
    )
    _validate.positive_number("radius", radius)
    _check_max_neighbors(max_neighbors)
    dtype, out_dtype = _validate.compute_dtype(query, ref)
    q, p = flat.query.to(dtype), flat.ref.to(dtype)
    idx, counts = torch.ops.pcops.ball_query(
        q.detach(), p.detach(), float(radius), max_neighbors, flat.validate, flat.query_group, flat.ref_group
    )
    valid = idx >= 0
    rows = p if p.shape[0] else p.new_zeros((1, 3))  # an empty ref: every idx is -1, gather from a dummy row
    dists = torch.where(valid, _distances(q, _batch.rows(rows, idx.clamp(min=0))), float("inf")).to(out_dtype)
    idx = _batch.local_index(flat, idx)
    return BallQuery(_batch.unflatten(flat, dists), _batch.unflatten(flat, idx), _batch.unflatten(flat, counts))


__all__ = ["BallQuery", "ball_query"]
