"""Drop-in modules for PyTorch Geometric (torch_cluster, torch_scatter), Pointcept (torch_scatter)
and PyTorch3D users.

``pcops.compat.torch_cluster``, ``pcops.compat.torch_scatter`` and ``pcops.compat.pytorch3d``
take the arguments, defaults and return conventions of ``torch_cluster``, ``torch_scatter`` and
``pytorch3d.ops`` / ``pytorch3d.loss`` and map them onto pcops' native ops (and torch's own
scatter / gather ops); no module here has a search of its own. Change one import::

    from torch_cluster import fps, radius, knn_graph          # before
    from pcops.compat.torch_cluster import fps, radius, knn_graph

    from pytorch3d.ops import knn_points, ball_query            # before
    from pcops.compat.pytorch3d import knn_points, ball_query

    from torch_scatter import scatter, segment_csr               # before
    from pcops.compat.torch_scatter import scatter, segment_csr

Conventions and every difference: docs/interop.md.

This package also holds the few helpers both modules share: argument checks that name the
caller's arguments, and ``pcops_compat::first_within``, the custom op behind the "first K
points within the radius, in index order" caps of ``torch_cluster.radius`` (its CUDA kernel)
and ``pytorch3d.ops.ball_query``. It runs pcops' ball query keyed by index (the K smallest
indices within a radius and how many there are), tests those exactly, and searches again with
room for all only the rare queries that lost one of them to the exact test and have more
beyond; as a custom op with a static (M, K) result it keeps ``torch.compile(fullgraph=True)``
graphs whole.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

import pcops  # noqa: F401 (registers torch.ops.pcops, which the ops below call)
from pcops import _validate

# pcops' ball is inclusive (d <= radius, d computed by the kernel); the originals test the squared
# distance strictly (d^2 < r^2 in the points' precision). The search is widened by this relative
# margin so that it finds every point the originals count, and the exact test runs afterwards.
_WIDEN = 1e-5
# first_within keeps this many columns past k (and the query itself): a query that loses this
# many of its kept points to the exact test (points in the margin) needs no second search,
# which builds a cell list of all the reference points again.
_SPARE = 2


def check_tensor(name: str, value, what: str = "a torch.Tensor") -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_count(name: str, value, least: int = 1) -> int:
    """An int (or numpy int, or a SymInt under compile) >= ``least``, named ``name`` in the errors."""
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return value


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32/float64 stay, float16/bfloat16 compute in float32, integers in float64."""
    dtype = torch.float32
    for t in tensors:
        d = t.dtype
        if d == torch.float64 or not d.is_floating_point:
            return torch.float64
    return dtype


def pad3(points: torch.Tensor, name: str, most: int = 3) -> torch.Tensor:
    """(..., D) points with D <= ``most`` as (..., 3) (zero columns change no distance)."""
    d = points.shape[-1]
    if d > most:
        raise ValueError(f"{name} must have at most {most} coordinates per point here (pcops searches in 3-D), got {d}")
    if d == 3:
        return points
    return torch.cat([points, points.new_zeros(points.shape[:-1] + (3 - d,))], -1)


def is_compiling() -> bool:
    return torch.compiler.is_compiling()


def check_finite(**named) -> None:
    """No NaN or inf in the named floating tensors (None and integer tensors are skipped), in
    the caller's names: one host read for all of them. Skipped while compiling (a value read
    would break the graph). The drop-ins check their own inputs here and call pcops' ops with
    ``validate=False``, so no message names pcops' internal arguments or suggests an argument
    the drop-in does not take."""
    if is_compiling():
        return
    items = [(n, t) for n, t in named.items() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not items:
        return
    oks = torch.stack([_validate.sum_finite(t).to(items[0][1].device) for _, t in items]).tolist()  # the one host read
    for ok, (name, t) in zip(oks, items):
        if not ok and not _validate.all_finite(t):
            raise ValueError(f"{name} contains NaN or inf")


def same_device(**named) -> None:
    """All the named tensors (None skipped) on one device, in the caller's names."""
    _validate.same_device(**{n: t for n, t in named.items() if t is not None})


def squared(diff: torch.Tensor) -> torch.Tensor:
    """Squared lengths of (..., 3) differences, summed left to right as the originals' loops do."""
    return diff[..., 0] * diff[..., 0] + diff[..., 1] * diff[..., 1] + diff[..., 2] * diff[..., 2]


def _first(query, ref, table, rows, found, bound, k: int, exclude_same: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a ball-query table (R, W >= k) of the queries ``rows`` (None: all of them, in order),
    each row ``found`` (R,) indices in ascending order (the by-index search), then -1: (the
    first k of them with squared distance < bound, and j != row if ``exclude_same``, -1
    padded, as (R, k); whether fewer than k pass, (R,)). The exact test runs on the found
    entries only; the rows that lose an entry to it (few but for ``exclude_same``, which drops
    each query itself) are compacted."""
    dev, r = table.device, table.shape[0]
    j = table.masked_select(table >= 0)  # the found entries, row by row
    local = torch.arange(r, device=dev).repeat_interleave(found, output_size=j.shape[0])  # the row of each
    at = local if rows is None else rows.index_select(0, local)
    diff = ref.index_select(0, j).sub_(query.index_select(0, at))  # p - q: the same squares as q - p
    diff.mul_(diff)
    ok = (diff[:, 0] + diff[:, 1]).add_(diff[:, 2]) < bound  # summed left to right, as squared()
    if exclude_same:
        ok &= j != at
    out = table[:, :k].clone()
    short = found < k
    lost = (~ok).nonzero().squeeze(1)
    if lost.numel():  # compact the rows that lost an entry
        row = local.index_select(0, lost)
        col = lost - (found.cumsum(0) - found).index_select(0, row)
        sick = torch.zeros(r, dtype=torch.bool, device=dev).index_fill_(0, row, True).nonzero().squeeze(1)
        keep = table.index_select(0, sick) >= 0
        keep[torch.searchsorted(sick, row), col] = False
        place = keep.cumsum(1) - 1  # an entry's column in the result
        kept_r, kept_c = (keep & (place < k)).nonzero(as_tuple=True)
        part = table.new_full((sick.shape[0], k), -1)
        part[kept_r, place[kept_r, kept_c]] = table[sick[kept_r], kept_c]
        out[sick] = part
        short[sick] = place[:, -1] + 1 < k
    return out, short


@torch.library.custom_op("pcops_compat::first_within", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def first_within(
    query: torch.Tensor,
    ref: torch.Tensor,
    query_group: Optional[torch.Tensor],
    ref_group: Optional[torch.Tensor],
    radius: float,
    bound: float,
    k: int,
    exclude_same: bool,
) -> torch.Tensor:
    """query (M, 3), ref (N, 3) of one float dtype, optional int sample ids (M,) / (N,) ->
    (M, k) int64: for each query the first k reference indices j in ascending order with
    ``squared(q_i - p_j) < bound`` (in the points' dtype), same sample, ``j != i`` if
    ``exclude_same``; -1 padded."""
    m = query.shape[0]
    out = torch.full((m, k), -1, dtype=torch.int64, device=query.device)
    if m == 0 or ref.shape[0] == 0:
        return out
    bound_t = torch.tensor(bound, dtype=query.dtype, device=query.device)
    search = radius * (1 + _WIDEN)
    cols = k + int(exclude_same) + _SPARE
    # pcops' ball-query op keyed by index: the cols smallest indices within the widened radius
    # (a superset of the points the exact test keeps) and how many there are
    idx, counts = torch.ops.pcops.ball_query_by_index(query=query, ref=ref, radius=search, max_neighbors=cols, validate=False,
                                                      query_group=query_group, ref_group=ref_group)
    out, short = _first(query, ref, idx, None, counts.clamp(max=cols), bound_t, k, exclude_same)
    # exact unless a query kept fewer than k and found more than cols: search those again with room for all
    over = (short & (counts > cols)).nonzero().squeeze(1)
    if over.numel():
        wide_group = None if query_group is None else query_group[over]
        wide, _ = torch.ops.pcops.ball_query_by_index(query=query[over], ref=ref, radius=search, max_neighbors=int(counts[over].max()),
                                                      validate=False, query_group=wide_group, ref_group=ref_group)
        out[over] = _first(query, ref, wide, over, (wide >= 0).sum(1), bound_t, k, exclude_same)[0]
    return out


@first_within.register_fake
def _(query, ref, query_group, ref_group, radius, bound, k, exclude_same):
    return query.new_empty((query.shape[0], k), dtype=torch.int64)


def compact(table: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(2, E) int64 of a (M, K) table's kept entries, row-major: row 0 the entry, row 1 its row.
    pcops' ``pcops::edges`` op, whose fake declares E as a dynamic size (compile-safe)."""
    return torch.ops.pcops.edges(idx=table, keep=keep)


from . import pytorch3d, torch_cluster, torch_scatter  # noqa: E402  (they use the helpers above)
from ._install import install  # noqa: E402  (pcops.compat.install(): point other libraries' imports at the drop-ins)

__all__ = ["install", "pytorch3d", "torch_cluster", "torch_scatter"]
