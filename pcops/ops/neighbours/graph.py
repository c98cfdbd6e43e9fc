"""kNN and radius graphs in PyTorch Geometric's ``edge_index`` convention.

``edge_index`` is a (2, E) int64 tensor: row 0 the neighbour (source), row 1 the centre
(target), as ``torch_cluster.knn_graph`` / ``radius_graph`` with ``flow="source_to_target"``.
Edges are grouped by centre (ascending) and, per centre, ordered by distance, ties by the
smaller neighbour index, so results do not depend on the backend. A point is never its own
neighbour unless ``loop=True``; points only meet points of their own sample (``batch``).

The number of edges depends on the data (samples smaller than k + 1, points with few
neighbours within the radius): the ops that produce them declare it in their fakes with
``torch.library.get_ctx().new_dynamic_size()``, so ``torch.compile(fullgraph=True)`` traces
them, and ``torch.compile`` with default options breaks the graph there (at ``pcops.edges``
or ``pcops.radius_graph``). ``max_edges=`` gives the static-size form instead: the edges
padded with -1 to that many columns and their true number (:class:`PaddedEdges`), which
default ``torch.compile`` captures without a break.
"""

from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp, _warp_funcs
from .. import _bound
from . import _ball_search, _cells
from .ball_query import _ball_query
from .nearest import _found, _kdtree, plain_knn, plain_warp


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


class PaddedEdges(NamedTuple):
    """The static-size form of a graph (``max_edges=``): ``edge_index`` (2, max_edges) int64, the
    edges in the usual order in the first min(count, max_edges) columns and -1 after them;
    ``count`` () int64, the number of edges of the whole graph (more than ``max_edges`` when
    the bound cut it: then the first ``max_edges`` edges are kept, those of the smallest centres)."""

    edge_index: torch.Tensor
    count: torch.Tensor


def _padded(edges: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(edge_index (2, size) padded with -1 or cut, count ()) of the edges (2, E)."""
    return _bound.fit(edges, size, -1, dim=1), _bound.count(edges.shape[1], edges)


@_threads.custom_op("pcops::edges", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _edges_op(idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A neighbour table (M, K) int64 and a keep mask (M, K) -> edge_index (2, E)."""
    return _edges(idx, keep)


@_edges_op.register_fake
def _(idx, keep):
    e = torch.library.get_ctx().new_dynamic_size()
    return idx.new_empty((2, e))


@_threads.custom_op("pcops::edges_padded", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _edges_padded(idx: torch.Tensor, keep: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pcops::edges in the static-size form: (edge_index (2, size), count ()), without
    ``nonzero`` (a host read on a GPU): each kept entry's column is its rank among the kept
    (a cumulative sum, row-major as ``nonzero``), those past ``size`` written to a dropped column."""
    flat = keep.reshape(-1)
    rank = torch.cumsum(flat, 0) - 1
    column = torch.where(flat & (rank < size), rank, size)
    centre = torch.arange(idx.shape[0], device=idx.device).repeat_interleave(idx.shape[1])
    out = idx.new_full((2, size + 1), -1)
    out[0].scatter_(0, column, idx.reshape(-1))
    out[1].scatter_(0, column, centre)
    return out[:, :size].contiguous(), flat.sum()


@_edges_padded.register_fake
def _(idx, keep, size):
    return idx.new_empty((2, size)), idx.new_empty(())


@_warp.kernels
def _rows_kernel():
    """One thread per point of a sorted neighbour table (M, K) (its valid entries first, -1
    after them): its first ``k`` valid neighbours other than itself (itself too with ``loop``),
    in row order, as edges (neighbour, centre): what ``_edges(idx, _without_self(idx, k))`` (or
    ``idx >= 0`` with ``loop``) gives. Without ``ends`` (empty): k edges a row, into the columns
    from ``i k`` on. With ``ends`` (each row's end among the edges, a cumulative sum of counts
    made before the table was read): into the row's columns only. Either way ``bad[0] = 1``
    (given a flag) where a row holds another number of edges than its columns (a row cut short,
    or counts that were wrong: the caller drops the edges)."""

    @wp.kernel(enable_backward=False, module="unique")
    def edge_rows(start: int, idx: wp.array2d(dtype=wp.int64), ends: wp.array(dtype=wp.int64), k: int, loop: int,
             edges: wp.array2d(dtype=wp.int64), bad: wp.array(dtype=wp.int32)):
        i = wp.tid() + start
        base = wp.int64(i) * wp.int64(k)
        room = wp.int64(k)
        if ends.shape[0] > 0:
            base = wp.int64(0)
            if i > 0:
                base = ends[i - 1]
            room = ends[i] - base
        n = _warp_funcs.edge_row(idx, i, idx.shape[1], k, loop, edges, base, room)
        if n != room and bad.shape[0] > 0:
            bad[0] = 1

    return edge_rows


@_warp.kernels
def _within_kernel(dtype: torch.dtype):
    """One thread per point (in cell order): the points of its sample within the radius of it
    (itself only with ``loop``). ``fill == 0``: their number, into ``counts``; else the edges
    (neighbour, centre) into ``edges[:, offsets[i]:offsets[i] + counts[i]]``, by distance, ties
    by the smaller index (each found neighbour inserted into the point's own sorted run)."""
    s = _warp.scalar(dtype)
    Cells, window, run = _warp_funcs.cell_scan(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def within(
        start: int,
        cells: Cells,
        radius: s,
        loop: int,
        fill: int,
        offsets: wp.array(dtype=wp.int64),
        counts: wp.array(dtype=wp.int64),
        dists: wp.array(dtype=s),
        edges: wp.array2d(dtype=wp.int64),
    ):
        i = int(cells.rows[wp.tid() + start])
        q = cells.query[i]
        n = int(0)
        first = int(0)
        room = int(0)
        if fill != 0:
            first = int(offsets[i])
            room = int(counts[i])
        lo, hi = window(cells, i, q, radius)
        for z in range(lo[2], hi[2] + 1):
            for y in range(lo[1], hi[1] + 1):
                begin, end = run(cells, lo, hi, y, z)
                for j in range(begin, end):
                    d = wp.length(q - cells.points[j])
                    if d <= radius:
                        o = cells.order[j]
                        if loop != 0 or o != wp.int64(i):
                            if fill != 0 and n < room:
                                pos = first + n  # shift the run's entries after (d, o) up by one
                                while pos > first:
                                    if dists[pos - 1] < d or (dists[pos - 1] == d and edges[0, pos - 1] < o):
                                        break
                                    dists[pos] = dists[pos - 1]
                                    edges[0, pos] = edges[0, pos - 1]
                                    pos = pos - 1
                                dists[pos] = d
                                edges[0, pos] = o
                                edges[1, first + n] = wp.int64(i)
                            n = n + 1
        if fill == 0:
            counts[i] = wp.int64(n)

    return within


def _all_within(points: torch.Tensor, radius: float, loop: bool, group: Optional[torch.Tensor]) -> torch.Tensor:
    """edge_index (2, E) of every pair within ``radius``: one cell list, a pass that counts each
    point's neighbours and one that writes them in place (one host read: E)."""
    n = points.shape[0]
    _warp.init()
    cells = _cells.CellList(points, points, radius, group, group)
    long = dict(dtype=torch.int64, device=points.device)
    counts = torch.empty(n, **long)
    args = [cells.scan(points, group, _cells.permute(points, cells.order)), radius, int(loop)]
    kernel = _within_kernel(points.dtype)
    _warp.launch(kernel, n, [*args, 0, counts, counts, points.new_empty(0), torch.empty((2, 0), **long)], like=points, min_chunk=_warp.QUERY_CHUNK)
    ends = torch.cumsum(counts, 0)
    edges = torch.empty(2, int(ends[-1]), **long)
    _warp.launch(kernel, n, [*args, 1, ends - counts, counts, points.new_empty(edges.shape[1]), edges], like=points, min_chunk=_warp.QUERY_CHUNK)
    return edges


@_threads.custom_op("pcops::radius_graph", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _radius_graph(
    points: torch.Tensor, radius: float, max_neighbors: int, loop: bool, validate: bool, group: Optional[torch.Tensor]
) -> torch.Tensor:
    """points (N, 3), group (N,) int32 or None; max_neighbors 0 means all -> edge_index (2, E)."""
    return _radius_edges(points, radius, max_neighbors, loop, validate, group)


def _radius_edges(points, radius: float, max_neighbors: int, loop: bool, validate: bool, group) -> torch.Tensor:
    """The edges of pcops::radius_graph (its real implementation)."""
    if not max_neighbors:
        _validate.positive_number("radius", radius)
        if validate:
            _validate.finite(points=points)
        if not points.shape[0]:
            return torch.empty((2, 0), dtype=torch.int64, device=points.device)
        return _all_within(points, radius, loop, group)
    extra = 0 if loop else 1  # the centre itself is in its own ball
    width = max(1, min(max_neighbors + extra, points.shape[0]))  # (no row holds more than the cloud: a huge cap allocates nothing)
    idx, _, _ = _ball_query(points, points, radius, width, validate, group, group)
    return _edges(idx, (idx >= 0) if loop else _without_self(idx, max_neighbors))


@_radius_graph.register_fake
def _(points, radius, max_neighbors, loop, validate, group):
    e = torch.library.get_ctx().new_dynamic_size()
    return points.new_empty((2, e), dtype=torch.int64)


@_threads.custom_op("pcops::radius_graph_padded", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _radius_graph_padded(
    points: torch.Tensor, radius: float, max_neighbors: int, loop: bool, validate: bool, group: Optional[torch.Tensor], size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """pcops::radius_graph in the static-size form: (edge_index (2, size), count ())."""
    return _padded(_radius_edges(points, radius, max_neighbors, loop, validate, group), size)


@_radius_graph_padded.register_fake
def _(points, radius, max_neighbors, loop, validate, group, size):
    return points.new_empty((2, size), dtype=torch.int64), points.new_empty((), dtype=torch.int64)


def _lay_out(points, batch, loop, validate) -> _layout.Flat:
    """The one-cloud layout of a graph op: packed points (N, 3) with optional ids ``batch``."""
    _validate.points("points", points)
    _validate.flag(loop=loop)
    return _layout.single(points, batch=batch, validate=validate)


# Whether plain eager calls take the direct paths (:func:`_plain_knn_graph`, :func:`_plain_radius_graph`; tests switch it off
# to compare both paths)
PLAIN = [True]


def _plain_knn_graph(points, k, loop, validate: bool, max_edges) -> Optional[torch.Tensor]:
    """edge_index of a plain eager CPU :func:`knn_graph` call, or None for any other call.

    Plain: a plain kNN search (:func:`pcops.ops.neighbours.nearest.plain_knn`: one (N, 3) CPU
    tensor, float32 or float64, nothing to differentiate, ``k`` a Python int >= 1), ``loop`` a
    bool, N > k (N >= k with ``loop``), no ``max_edges``, and every point's row of k (+ 1)
    neighbours give k edges (a NaN or infinite point with ``validate=False``, or finite points
    whose squared distances overflow, cut rows short: the kernel flags a row of fewer, read back
    from its flag, and the general path's masks take the call): then a point's edges are its
    first k neighbours other than itself, written by the search itself where it is the calling
    thread's kept small tree (:func:`pcops.ops.neighbours.nearest._kdtree.graph_edges`: up to
    ``GRAPH_EDGES`` edges), else by one kernel after it (:func:`_rows_kernel`), instead of the
    general path's masks; the same edges in the same order, E = N k."""
    if max_edges is not None or type(k) is not int or k < 1 or type(loop) is not bool:
        return None
    search = k + (0 if loop else 1)
    if not plain_warp(points, points, search, "auto", False):  # (plain, and N >= k (+ 1))
        return None
    kept = _kdtree.graph_edges(points, k, loop)  # where the search is a kept small tree, it writes the edges itself
    if kept is not None:
        return None if kept[1] else kept[0]  # (a value not finite or a row cut short: the general path decides)
    found = plain_knn(points, points, search, "auto", validate, plain=True)
    if found is None:
        return None
    edges = torch.empty(2, points.shape[0] * k, dtype=torch.int64)
    return edges if _edge_rows(found[1], None, k, loop, edges) else None  # (a row of fewer than k edges: the general path's masks)


def _edge_rows(idx: torch.Tensor, ends: Optional[torch.Tensor], k: int, loop: bool, edges: torch.Tensor) -> bool:
    """Whether every row of the CPU neighbour table ``idx`` (N, K) gave its edges, written into
    ``edges`` (2, E) by :func:`_rows_kernel` (``ends``: each row's end among them, None: k a row):
    the calling thread's packed launch of tables cut into as many chunks where it has one, its
    flag read back from a NumPy view (no torch read)."""
    n, e = idx.shape[0], edges.shape[1]
    named = {"idx": idx, "edges": edges} if ends is None else {"idx": idx, "ends": ends, "edges": edges}
    given = _NO_ENDS if ends is None else ends  # (the kernel's ends argument)

    def make():
        flag = _warp.values_flag()
        return _warp.prepare(_rows_kernel(), n, [idx, given, k, int(loop), edges, flag[0]], work=idx.numel(),
                             min_chunk=_warp.MIN_CHUNK, keep=flag)

    key = ("edges", idx.shape[1], k, loop) if ends is None else ("edges", idx.shape[1], k, loop, "ends")
    launch = _warp.ranged(key, make, _EDGE_GROUPS if ends is None else _ENDS_GROUPS, (n, e, 8 * e), n, idx.numel(), _warp.MIN_CHUNK)
    if launch is not None:
        view = launch.keep[1]
        view[0] = 0
        launch.run(**named)
    else:
        flag, view = _warp.values_flag()
        _warp.launch(_rows_kernel(), n, [idx, given, k, int(loop), edges, flag], like=idx, work=idx.numel())
    return not view[0]


# The lengths a call of the edge rows sets (:func:`pcops._warp.ranged`): its points', its edges' and their rows' byte stride
_EDGE_GROUPS = (("idx",), (("edges", 1),), (("edges", 0, "strides"),))
_ENDS_GROUPS = (("idx", "ends"), (("edges", 1),), (("edges", 0, "strides"),))  # (the same, with each row's end)
_NO_ENDS = torch.empty(0, dtype=torch.int64)  # _rows_kernel's rows from i k (complete rows)


# An uncapped plain radius_graph of at most this many pairs searches with K = N - 1 (rows whole)
UNCAPPED_PAIRS = 1 << 18


def _plain_radius_graph(points, radius, max_neighbors, loop, validate, max_edges) -> Optional[torch.Tensor]:
    """edge_index of a plain eager CPU :func:`radius_graph` call, or None for any other call.

    Plain: one plain cloud (:func:`pcops._layout.plain_clouds`: an (N, 3) CPU tensor, float32 or
    float64, nothing to differentiate) of N >= 1 points checked finite (``validate=True``),
    ``radius`` a finite Python number > 0, ``max_neighbors`` None or a Python int >= 1, ``loop``
    a bool, no ``max_edges``. Every check of the general path passes on such a call. With a cap
    K: the ball search of K (+ 1) neighbours, then every point's edges written by one kernel
    (:func:`_rows_kernel`) instead of the general path's masks: a finite point is within the
    radius of itself, so a row holds min(count - 1, K) neighbours other than itself (min(count,
    K) with ``loop``), the same edges in the same order. The kernel checks each row against that
    count: a row without its own point (the cell list's rows once, at radii hundreds of orders
    of magnitude above the cloud's extent) gives None: the general path. Without a cap: the
    same with K = N - 1 (N) up to ``UNCAPPED_PAIRS`` pairs, where the ball search scans every
    pair (the same edges as the general path's cell-list pass), the general path's cell-list
    pass above (no custom op)."""
    if max_edges is not None or validate is not True or type(loop) is not bool:
        return None
    if type(radius) not in (int, float) or not 0 < radius <= _validate.FLOAT_MAX:
        return None
    if max_neighbors is not None and (type(max_neighbors) is not int or not 1 <= max_neighbors < _validate.INT64_MAX):
        return None
    if not _layout.plain_clouds(validate, points) or not points.shape[0]:
        return None
    n, own = points.shape[0], 0 if loop else 1
    cap = max_neighbors
    if cap is None:
        if n * n > UNCAPPED_PAIRS:
            return _all_within(points, float(radius), loop, None)
        cap = n - own  # every point's row holds the whole cloud: a ball search of every pair
    cap = max(1, min(cap, n - own))  # (no row holds more than the cloud)
    idx, counts, _ = _ball_search.search_one(points, points, float(radius), cap + own, False, None, None)
    ends = torch.cumsum((counts - own).clamp_(0, cap), 0)
    edges = torch.empty(2, int(ends[-1]), dtype=torch.int64)
    return edges if _edge_rows(idx, ends, cap, loop, edges) else None  # (a row without its own point: the general path's masks)


@_threads.limits
def knn_graph(points: torch.Tensor, k: int, *, batch: Optional[torch.Tensor] = None, loop: bool = False,
              validate: bool = True, max_edges: Optional[int] = None):
    """Edges from each point's k nearest points of its sample (PyG's ``knn_graph``).

    Args:
        points: Tensor of shape (N, 3).
        k: neighbours per point, k >= 1. A sample with n <= k points links each point to all
            n - 1 others (n with ``loop``).
        batch: optional int tensor (N,) of sample ids (sorted or not).
        loop: also link each point to itself (it is its own nearest neighbour, distance 0).
        validate: check the points for NaN/inf and the ids for range.
        max_edges: optional int >= 1: the static-size form (see Returns), for
            ``torch.compile`` without ``fullgraph`` and without a graph break (``N * k``
            always holds every edge).

    Returns:
        edge_index (2, E) int64: row 0 the neighbour j, row 1 the centre i; edges grouped by
        centre, each centre's neighbours by distance (ties by the smaller index). E = N * k
        when every sample has more than k points and no squared distance overflows the dtype
        (finite float32 points more than about 1.8e19 apart: no edge, as :func:`pcops.knn`);
        otherwise it depends on the data (a
        dynamic size under ``torch.compile``: default options break the graph at
        ``pcops.edges``). With ``max_edges``: :class:`PaddedEdges` (edge_index (2, max_edges)
        padded with -1, count).

    Example:
        >>> import torch, pcops
        >>> points = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
        >>> pcops.knn_graph(points, k=1)  # (2, E): row 0 the neighbour, row 1 the centre
        tensor([[1, 0, 1],
                [0, 1, 2]])
    """
    if PLAIN[0] and batch is None:
        edges = _plain_knn_graph(points, k, loop, validate, max_edges)
        if edges is not None:
            return edges
    k, size = _validate.plain(k), _bound.bound("max_edges", max_edges)  # NumPy scalars as Python numbers
    flat = _lay_out(points, batch, loop, validate)
    _validate.count("k", k)
    n = points.shape[0]
    if n == 0:
        empty = torch.empty((2, 0), dtype=torch.int64, device=points.device)
        return empty if size is None else PaddedEdges(*_padded(empty, size))
    _, idx = _found(flat, min(k + (0 if loop else 1), n), "auto", _validate.compute_dtype(points)[0])
    keep = (idx >= 0) if loop else _without_self(idx, k)
    if size is not None:
        return PaddedEdges(*_edges_padded(idx, keep, size))
    return _edges_op(idx, keep)


@_threads.limits
def radius_graph(points: torch.Tensor, radius: float, *, batch: Optional[torch.Tensor] = None, loop: bool = False,
                 max_neighbors: Optional[int] = None, validate: bool = True, max_edges: Optional[int] = None):
    """Edges from each point to the points of its sample within ``radius`` (PyG's ``radius_graph``).

    Args:
        points: Tensor of shape (N, 3).
        radius: Python number > 0; j is a neighbour of i when ||p_i - p_j|| <= radius.
        batch: optional int tensor (N,) of sample ids (sorted or not).
        loop: also link each point to itself.
        max_neighbors: keep only the closest ``max_neighbors`` of each point (ties by index);
            None keeps all (no silent cap, unlike torch_cluster's default of 32).
        validate: check the points for NaN/inf and the ids for range.
        max_edges: optional int >= 1: the static-size form (see Returns), for
            ``torch.compile`` without ``fullgraph`` and without a graph break.

    Returns:
        edge_index (2, E) int64: row 0 the neighbour j, row 1 the centre i, grouped by centre,
        by distance within a centre (ties by the smaller index). E depends on the data (a
        dynamic size under ``torch.compile``: default options break the graph at
        ``pcops.radius_graph``). With ``max_edges``: :class:`PaddedEdges` (edge_index
        (2, max_edges) padded with -1, count; on overflow the edges of the smallest centres).

    Example:
        >>> import torch, pcops
        >>> points = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
        >>> pcops.radius_graph(points, radius=1.5)  # (2, E): row 0 the neighbour, row 1 the centre
        tensor([[1, 0],
                [0, 1]])
    """
    if PLAIN[0] and batch is None:
        edges = _plain_radius_graph(points, radius, max_neighbors, loop, validate, max_edges)
        if edges is not None:
            return edges
    radius, max_neighbors = _validate.plain(radius), _validate.plain(max_neighbors)  # NumPy scalars as Python numbers
    size = _bound.bound("max_edges", max_edges)
    flat = _lay_out(points, batch, loop, validate)
    _validate.positive_number("radius", radius)
    if max_neighbors is not None:
        _validate.count("max_neighbors", max_neighbors)
    dtype, _ = _validate.compute_dtype(points)
    args = (points.detach().to(dtype), float(radius), max_neighbors or 0, loop, flat.validate, flat.query_group)
    if size is not None:
        return PaddedEdges(*_radius_graph_padded(*args, size))
    return _radius_graph(*args)


__all__ = ["PaddedEdges", "knn_graph", "radius_graph"]
