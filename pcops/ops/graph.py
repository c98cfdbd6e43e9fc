"""kNN and radius graphs in PyTorch Geometric's ``edge_index`` convention.

``edge_index`` is a (2, E) int64 tensor: row 0 the neighbour (source), row 1 the centre
(target), as ``torch_cluster.knn_graph`` / ``radius_graph`` with ``flow="source_to_target"``.
Edges are grouped by centre (ascending) and, per centre, ordered by distance, ties by the
smaller neighbour index, so results do not depend on the backend. A point is never its own
neighbour unless ``loop=True``; points only meet points of their own sample (``batch``).

The number of edges depends on the data (samples smaller than k + 1, points with few
neighbours within the radius): the ops that produce them declare it in their fakes with
``torch.library.get_ctx().new_dynamic_size()``, so ``torch.compile(fullgraph=True)`` traces
them.
"""

from typing import Optional

import torch

from .. import _batch, _validate
from .ball_query import _ball_query
from .nearest import _found


def _edges(idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(2, E) edges (neighbour, centre) of the kept entries of a (M, K) neighbour table, row-major."""
    centre, col = keep.nonzero(as_tuple=True)
    return torch.stack([idx[centre, col], centre])


def _without_self(idx: torch.Tensor, cap: int, centres: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keep mask of a sorted neighbour table: valid entries other than the row's centre
    (``centres``, default the row number), the first ``cap`` per row."""
    rows = torch.arange(idx.shape[0], device=idx.device) if centres is None else centres
    keep = (idx >= 0) & (idx != rows[:, None])
    return keep & (torch.cumsum(keep, 1) <= cap)


def _merged_edges(tables: list, n: int) -> torch.Tensor:
    """Edges of several (idx (R, K), keep (R, K), centres (R,)) tables, each centre's kept entries
    in one table only, grouped by centre in ascending order, each row's entries in table order."""
    kept = torch.zeros(n, dtype=torch.int64, device=tables[0][0].device)
    for _, keep, centres in tables:
        kept.index_add_(0, centres, keep.sum(1))
    offsets = torch.cumsum(kept, 0) - kept
    out = torch.empty((2, int(kept.sum())), dtype=torch.int64, device=kept.device)
    for idx, keep, centres in tables:
        rank = torch.cumsum(keep, 1) - 1
        row, col = keep.nonzero(as_tuple=True)
        at = offsets[centres[row]] + rank[row, col]
        out[0, at] = idx[row, col]
        out[1, at] = centres[row]
    return out


# radius_graph without a cap first keeps this many neighbours per point, then searches again
# (with room for the largest count) only for the points that have more.
FIRST_COLUMNS = 32


@torch.library.custom_op("pcops::edges", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _edges_op(idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A neighbour table (M, K) int64 and a keep mask (M, K) -> edge_index (2, E)."""
    return _edges(idx, keep)


@_edges_op.register_fake
def _(idx, keep):
    e = torch.library.get_ctx().new_dynamic_size()
    return idx.new_empty((2, e))


@torch.library.custom_op("pcops::radius_graph", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _radius_graph(
    points: torch.Tensor, radius: float, max_neighbors: int, loop: bool, validate: bool, group: Optional[torch.Tensor]
) -> torch.Tensor:
    """points (N, 3), group (N,) int32 or None; max_neighbors 0 means all -> edge_index (2, E)."""
    extra = 0 if loop else 1  # the centre itself is in its own ball
    n = points.shape[0]
    k = max_neighbors + extra if max_neighbors else FIRST_COLUMNS
    cap = k - extra if max_neighbors else n
    idx, counts = _ball_query(points, points, radius, k, validate, group, group)
    rows = torch.arange(n, device=points.device)
    tables = []
    if not max_neighbors and n:
        over = rows[counts > k]  # points with more neighbours than columns: search them again
        if over.numel():
            wide, _ = _ball_query(points[over], points, radius, int(counts[over].max()), False,
                                  None if group is None else group[over], group)
            tables.append((wide, (wide >= 0) if loop else _without_self(wide, cap, over), over))
            idx[over] = -1  # their first, truncated rows give no edges
    tables.append((idx, (idx >= 0) if loop else _without_self(idx, cap), rows))
    return _merged_edges(tables, n)


@_radius_graph.register_fake
def _(points, radius, max_neighbors, loop, validate, group):
    e = torch.library.get_ctx().new_dynamic_size()
    return points.new_empty((2, e), dtype=torch.int64)


def _layout(points, batch, loop, validate) -> _batch.Flat:
    """The one-cloud layout of a graph op: packed points (N, 3) with optional ids ``batch``."""
    _validate.points("points", points)
    if not isinstance(loop, bool):
        raise TypeError(f"loop must be a bool, got {type(loop).__name__}")
    return _batch.single(points, batch=batch, validate=validate)


def knn_graph(points: torch.Tensor, k: int, *, batch: Optional[torch.Tensor] = None, loop: bool = False,
              validate: bool = True) -> torch.Tensor:
    """Edges from each point's k nearest points of its sample (PyG's ``knn_graph``).

    Args:
        points: Tensor of shape (N, 3).
        k: neighbours per point, k >= 1. A sample with n <= k points links each point to all
            n - 1 others (n with ``loop``).
        batch: optional int tensor (N,) of sample ids (sorted or not).
        loop: also link each point to itself (it is its own nearest neighbour, distance 0).
        validate: check the points for NaN/inf and the ids for range.

    Returns:
        edge_index (2, E) int64: row 0 the neighbour j, row 1 the centre i; edges grouped by
        centre, each centre's neighbours by distance (ties by the smaller index). E = N * k
        when every sample has more than k points; otherwise it depends on the data.
    """
    k = _validate.plain(k)  # NumPy scalars as Python numbers
    flat = _layout(points, batch, loop, validate)
    _validate.count("k", k)
    n = points.shape[0]
    if n == 0:
        return torch.empty((2, 0), dtype=torch.int64, device=points.device)
    _, idx = _found(flat, min(k + (0 if loop else 1), n), "auto", _validate.compute_dtype(points)[0])
    keep = (idx >= 0) if loop else _without_self(idx, k)
    return torch.ops.pcops.edges(idx, keep)


def radius_graph(points: torch.Tensor, radius: float, *, batch: Optional[torch.Tensor] = None, loop: bool = False,
                 max_neighbors: Optional[int] = None, validate: bool = True) -> torch.Tensor:
    """Edges from each point to the points of its sample within ``radius`` (PyG's ``radius_graph``).

    Args:
        points: Tensor of shape (N, 3).
        radius: Python number > 0; j is a neighbour of i when ||p_i - p_j|| <= radius.
        batch: optional int tensor (N,) of sample ids (sorted or not).
        loop: also link each point to itself.
        max_neighbors: keep only the closest ``max_neighbors`` of each point (ties by index);
            None keeps all (no silent cap, unlike torch_cluster's default of 32).
        validate: check the points for NaN/inf and the ids for range.

    Returns:
        edge_index (2, E) int64: row 0 the neighbour j, row 1 the centre i, grouped by centre,
        by distance within a centre (ties by the smaller index). E depends on the data.
    """
    radius, max_neighbors = _validate.plain(radius), _validate.plain(max_neighbors)  # NumPy scalars as Python numbers
    flat = _layout(points, batch, loop, validate)
    _validate.positive_number("radius", radius)
    if max_neighbors is not None:
        if isinstance(max_neighbors, bool) or not isinstance(max_neighbors, (int, torch.SymInt)):
            raise TypeError(f"max_neighbors must be an int or None, got {type(max_neighbors).__name__}")
        if max_neighbors < 1:
            raise ValueError(f"max_neighbors must be >= 1, got {max_neighbors}")
    dtype, _ = _validate.compute_dtype(points)
    return torch.ops.pcops.radius_graph(points.detach().to(dtype), float(radius), max_neighbors or 0, loop, flat.validate, flat.query_group)


__all__ = ["knn_graph", "radius_graph"]
