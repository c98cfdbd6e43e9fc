"""``torch_cluster``'s point-cloud functions on pcops' ops: change one import.

    from pcops.compat.torch_cluster import fps, knn, knn_graph, nearest, radius, radius_graph, grid_cluster

Argument names, defaults, return types (int64 index tensors) and row conventions are those of
torch_cluster 1.6.3 (``radius``'s ``ignore_same_index`` and ``radius_graph``'s cap are those of
its current source, after 1.6.3). ``knn`` and ``radius`` return ``(2, E)`` with row 0 indexing
``y`` (the queries) and row 1 indexing ``x``; ``knn_graph`` and ``radius_graph`` return row 0
the neighbour (source) and row 1 the centre (target) for ``flow="source_to_target"``. Where
torch_cluster's result is unspecified or differs between its CPU and CUDA kernels, pcops
returns one fixed result:

* ``knn``: neighbours by distance, ties by the smaller index (torch_cluster's CUDA kernel; its
  CPU kd-tree leaves ties in traversal order).
* ``radius``: with more than ``max_num_neighbors`` points within ``r``, the first
  ``max_num_neighbors`` by index, listed in index order (torch_cluster's CUDA kernel; its docs
  say "picked randomly" and its CPU kd-tree keeps the first its traversal finds).
* ``fps``: ties by the smaller index; a point is never picked twice.

``num_workers`` is accepted and ignored (pcops uses torch's threads); ``batch_size`` is
accepted (pcops needs no sample count), and where given must count every example of the batch
vectors (a ValueError naming it otherwise: torch_cluster would search fewer examples). Batches need not be sorted. A NaN or inf in the points
raises a ValueError naming the argument (``x``, ``y``, ``src``, ``pos``), outside
``torch.compile``.

Every function scripts with ``torch.jit.script``, as torch_cluster's do: each public function
is a typed signature whose body calls its implementation, which TorchScript leaves to Python
(``@torch.jit.ignore``); eager calls and ``torch.compile`` run the same implementation. No
module-level ``from __future__ import annotations`` here: TorchScript reads the annotations
of the ignored implementations as objects. torch_cluster's graph functions
(``graclus_cluster``, ``random_walk``, ``neighbor_sampler``) exist with their signatures, so
that code importing them (PyTorch Geometric 2.5 / 2.6) imports, and raise NotImplementedError.
Details: docs/interop.md.
"""

import math
from typing import List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false, has_free_unbacked_symbols

import pcops

from .. import _validate
from . import check_count, check_finite, check_tensor, compact, compute_dtype, first_within, is_compiling, pad3, same_device

__all__ = [
    "fps", "graclus_cluster", "grid_cluster", "knn", "knn_graph", "nearest", "neighbor_sampler", "radius",
    "radius_graph", "random_walk",
]

_FLOWS = ("source_to_target", "target_to_source")


def _features(name: str, t) -> torch.Tensor:
    check_tensor(name, t)
    t = t.view(-1, 1) if t.dim() == 1 else t
    if t.dim() != 2:
        raise ValueError(f"{name} must be a tensor of shape (N, F) or (N,), got shape {tuple(t.shape)}")
    return t


def _batch(name: str, batch, n: int) -> Optional[torch.Tensor]:
    if batch is None:
        return None
    check_tensor(name, batch)
    if batch.dtype.is_floating_point or batch.dtype == torch.bool or batch.dim() != 1 or batch.shape[0] != n:
        raise ValueError(f"{name} must be an integer tensor of shape ({n},), got {batch.dtype} of shape {tuple(batch.shape)}")
    return batch


def _batch_size(batch_size, **batches) -> None:
    """``batch_size``, where given, an int >= 1 that counts every example of the named batch
    vectors (their ids below it). torch_cluster takes it as the number of examples: with 1 it
    searches the points as one example whatever the batch vectors say, and with fewer than the
    ids it leaves the later examples' points out (or fails, in ``fps``). pcops reads the examples
    from the batch vectors, so a count that contradicts them raises here rather than give other
    results than torch_cluster's (one host read; skipped while compiling)."""
    if batch_size is None:
        return
    check_count("batch_size", batch_size)
    if is_compiling():
        return
    for name, batch in batches.items():
        if isinstance(batch, torch.Tensor) and batch.numel():
            top = int(batch.max())
            if top >= batch_size:
                raise ValueError(f"batch_size={batch_size} counts fewer examples than {name} holds (ids up to {top}); "
                                 "leave it None (pcops needs no count) or give the number of examples")


def _pair_batches(batch_x, batch_y, x, y):
    """torch_cluster's rule: a missing batch vector means one example, which the other may not contradict."""
    bx, by = _batch("batch_x", batch_x, x.shape[0]), _batch("batch_y", batch_y, y.shape[0])
    if bx is None and by is None:
        return None, None
    if (bx is None) != (by is None) and not is_compiling():
        given, name, missing = (bx, "batch_x", "batch_y") if by is None else (by, "batch_y", "batch_x")
        if given.numel() and int(given.max()) > 0:
            raise ValueError(f"{missing} is required when {name} holds more than one example (as in torch_cluster)")
    if bx is None:
        bx = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    if by is None:
        by = torch.zeros(y.shape[0], dtype=torch.int64, device=y.device)
    return bx, by


def _positive_r(value) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"r must be a number, got {type(value).__name__}")
    if not (_validate.is_finite_number(value) and value > 0):
        raise ValueError(f"r must be finite and > 0, got {_validate.shown_number(value)}")
    return float(value)


def _empty(device) -> torch.Tensor:
    return torch.empty((2, 0), dtype=torch.long, device=device)


def _known_empty(t: torch.Tensor) -> bool:
    """Whether ``t`` is known to be empty. A size that depends on the data (an unbacked symbol
    under torch.compile: e.g. the points that ``fps`` picked) is not known: the call goes on
    into the ops, which handle empty inputs when they run, so no branch reads the data."""
    return guard_or_false(t.numel() == 0)


def _data_dependent(t: torch.Tensor) -> bool:
    """Whether ``t``'s size is data-dependent while compiling (e.g. points picked by ``fps``)."""
    return has_free_unbacked_symbols(t)


def _knn_table(x, y, k: int, batch_x, batch_y, cosine: bool) -> torch.Tensor:
    """(M, min(k, N)) int64 neighbour table of y in x, by distance, ties by index, -1 padded;
    (M, k) when N is data-dependent."""
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same number of features, got {x.shape[1]} and {y.shape[1]}")
    dtype = compute_dtype(x, y)
    x, y = x.detach().to(dtype), y.detach().to(dtype)
    if cosine:  # 1 - cos(a, b) orders as |a/|a| - b/|b||^2 = 2 - 2 cos(a, b)
        x, y = F.normalize(x, dim=1), F.normalize(y, dim=1)
    if x.shape[1] < 3:
        x, y = pad3(x, "x"), pad3(y, "y")
    bx, by = _pair_batches(batch_x, batch_y, x, y)
    if _data_dependent(x):
        # min(k, N) is unknown while tracing: k zero points in an example of their own (never a
        # neighbour) make N >= k, and an example with fewer than k points gets -1 columns
        n, m = x.shape[0], y.shape[0]
        bx = torch.zeros(n, dtype=torch.int64, device=x.device) if bx is None else bx.to(torch.int64)
        by = torch.zeros(m, dtype=torch.int64, device=y.device) if by is None else by.to(torch.int64)
        alone = torch.cat([bx, by, bx.new_full((1,), -1)]).max() + 1
        x = torch.cat([x, x.new_zeros((k, x.shape[1]))])
        bx = torch.cat([bx, alone.expand(k)])
        return pcops.knn(y, x, k, query_batch=by, ref_batch=bx, validate=False).idx
    kw = {} if bx is None else {"query_batch": by, "ref_batch": bx}
    return pcops.knn(y, x, min(k, x.shape[0]), validate=False, **kw).idx


@torch.jit.ignore
def _knn(
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    batch_x: Optional[torch.Tensor] = None,
    batch_y: Optional[torch.Tensor] = None,
    cosine: bool = False,
    num_workers: int = 1,
    batch_size: Optional[int] = None,
) -> torch.Tensor:
    x, y = _features("x", x), _features("y", y)
    k = check_count("k", k)
    same_device(x=x, y=y, batch_x=batch_x, batch_y=batch_y)
    check_finite(x=x, y=y)
    if _known_empty(x) or _known_empty(y):
        return _empty(x.device)
    _batch_size(batch_size, batch_x=batch_x, batch_y=batch_y)
    idx = _knn_table(x, y, k, batch_x, batch_y, cosine)
    if batch_x is None and batch_y is None and not _data_dependent(x):  # min(k, N) neighbours each: a static size
        rows = torch.arange(y.shape[0], device=idx.device).repeat_interleave(idx.shape[1])
        return torch.stack([rows, idx.reshape(-1)])
    return compact(idx, idx >= 0).flip(0)


@torch.jit.ignore
def _knn_graph(
    x: torch.Tensor,
    k: int,
    batch: Optional[torch.Tensor] = None,
    loop: bool = False,
    flow: str = "source_to_target",
    cosine: bool = False,
    num_workers: int = 1,
    batch_size: Optional[int] = None,
) -> torch.Tensor:
    if flow not in _FLOWS:
        raise ValueError(f"flow must be one of {_FLOWS}, got {flow!r}")
    x = _features("x", x)
    k = check_count("k", k)
    same_device(x=x, batch=batch)
    check_finite(x=x)
    if _known_empty(x):
        return _empty(x.device)
    _batch_size(batch_size, batch=batch)
    idx = _knn_table(x, x, k if loop else k + 1, batch, batch, cosine)
    keep = idx >= 0
    if not loop:
        keep &= idx != torch.arange(x.shape[0], device=idx.device)[:, None]
    edges = compact(idx, keep)  # (neighbour, centre)
    return edges if flow == "source_to_target" else edges.flip(0)


@torch.jit.ignore
def _radius(
    x: torch.Tensor,
    y: torch.Tensor,
    r: float,
    batch_x: Optional[torch.Tensor] = None,
    batch_y: Optional[torch.Tensor] = None,
    max_num_neighbors: int = 32,
    num_workers: int = 1,
    batch_size: Optional[int] = None,
    ignore_same_index: bool = False,
) -> torch.Tensor:
    x, y = _features("x", x), _features("y", y)
    r = _positive_r(r)
    k = check_count("max_num_neighbors", max_num_neighbors)
    if not isinstance(ignore_same_index, bool):
        raise TypeError(f"ignore_same_index must be a bool, got {type(ignore_same_index).__name__}")
    same_device(x=x, y=y, batch_x=batch_x, batch_y=batch_y)
    check_finite(x=x, y=y)
    if _known_empty(x) or _known_empty(y):
        return _empty(x.device)
    _batch_size(batch_size, batch_x=batch_x, batch_y=batch_y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same number of features, got {x.shape[1]} and {y.shape[1]}")
    dtype = compute_dtype(x, y)
    xs, ys = pad3(x.detach().to(dtype), "x"), pad3(y.detach().to(dtype), "y")
    bx, by = _pair_batches(batch_x, batch_y, xs, ys)
    table = first_within(ys, xs, by, bx, r, r * r, k, ignore_same_index)
    return compact(table, table >= 0).flip(0)


@torch.jit.ignore
def _radius_graph(
    x: torch.Tensor,
    r: float,
    batch: Optional[torch.Tensor] = None,
    loop: bool = False,
    max_num_neighbors: int = 32,
    flow: str = "source_to_target",
    num_workers: int = 1,
    batch_size: Optional[int] = None,
) -> torch.Tensor:
    if flow not in _FLOWS:
        raise ValueError(f"flow must be one of {_FLOWS}, got {flow!r}")
    edges = _radius(x, x, r, batch, batch, max_num_neighbors, num_workers, batch_size, not loop)
    return edges.flip(0) if flow == "source_to_target" else edges


@torch.jit.ignore
def _nearest(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_x: Optional[torch.Tensor] = None,
    batch_y: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    x, y = _features("x", x), _features("y", y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same number of features, got {x.shape[1]} and {y.shape[1]}")
    bx, by = _batch("batch_x", batch_x, x.shape[0]), _batch("batch_y", batch_y, y.shape[0])
    same_device(x=x, y=y, batch_x=batch_x, batch_y=batch_y)
    check_finite(x=x, y=y)
    if not is_compiling():
        for name, b in (("batch_x", bx), ("batch_y", by)):
            if b is not None and bool((b[1:] < b[:-1]).any()):
                raise ValueError(f"'{name}' is not sorted")
    if bx is None and by is not None:
        bx = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    if by is None and bx is not None:
        by = torch.zeros(y.shape[0], dtype=torch.int64, device=y.device)
    if bx is not None and not is_compiling() and not torch.equal(bx.unique_consecutive(), by.unique_consecutive()):
        raise ValueError("Some batch indices occur in 'batch_x' that do not occur in 'batch_y'")
    if guard_or_false(x.shape[0] == 0):
        return torch.empty(0, dtype=torch.long, device=x.device)
    if guard_or_false(y.shape[0] == 0):
        raise ValueError("y must hold at least one point")
    torch._check(y.shape[0] > 0, lambda: "y must hold at least one point")  # a data-dependent size: when it runs
    idx = _knn_table(y, x, 1, by, bx, False)  # queries x in the points y
    return idx[:, 0]


def _fps_counts(n: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Picks per example as torch_cluster's CPU kernel computes them: ceil(float32(n) * ratio) in float32."""
    return torch.ceil(n.to(torch.float32) * ratio.to(torch.float32)).to(torch.int64)


@torch.jit.ignore
def _fps(
    src: torch.Tensor,
    batch: Optional[torch.Tensor] = None,
    ratio: Optional[Union[torch.Tensor, float]] = None,
    random_start: bool = True,
    batch_size: Optional[int] = None,
    ptr: Optional[Union[torch.Tensor, List[int]]] = None,
) -> torch.Tensor:
    check_tensor("src", src)
    src = src.view(src.shape[0], -1) if src.dim() != 2 else src
    n = src.shape[0]
    if ptr is not None:
        ptr_t = torch.as_tensor(ptr, dtype=torch.int64, device=src.device)
        batch = torch.repeat_interleave(torch.arange(ptr_t.numel() - 1, device=src.device), ptr_t.diff())
    batch = _batch("batch", batch, n)
    same_device(src=src, batch=batch)
    check_finite(src=src)
    if ratio is None:
        ratio = 0.5
    if isinstance(ratio, torch.Tensor):  # its values set the counts: no host read while compiling
        if ratio.dim() == 0 and not is_compiling():
            value = float(ratio)
            if not 0 < value <= 1:
                raise ValueError(f"ratio must be in (0, 1], got {value}")
        elif ratio.dim() > 0 and not is_compiling() and not bool(((ratio > 0) & (ratio <= 1)).all()):
            raise ValueError("ratio must be in (0, 1]")
    else:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating)):
            raise TypeError(f"ratio must be a float or a tensor, got {type(ratio).__name__}")
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if guard_or_false(n == 0):  # a data-dependent n (points picked before) goes on: the op handles 0
        return torch.empty(0, dtype=torch.long, device=src.device)
    if ptr is None:  # (torch_cluster reads the examples from ``ptr`` alone when it is given)
        _batch_size(batch_size, batch=batch)
    points = pad3(src.detach().to(compute_dtype(src)), "src")
    if batch is None and not isinstance(ratio, torch.Tensor) and not _data_dependent(src):
        picks = math.ceil(float(np.float32(n) * np.float32(ratio)))  # as torch_cluster: float32
        return pcops.farthest_point_sample(points, min(picks, n), random_start=random_start, validate=False).idx
    if batch is None:
        batch = torch.zeros(n, dtype=torch.int64, device=src.device)
    # pcops' packed FPS with a slightly larger ratio picks at least as many per example; each
    # example is then cut to its own count (FPS picks are prefixes of longer runs). A tensor
    # ratio stays a tensor (pcops takes a 0-d one): the counts are computed in the graph.
    if isinstance(ratio, torch.Tensor):
        wide = (ratio.max().to(torch.float64) * (1 + 2.0**-20)).clamp(max=1.0)
        r = ratio
    else:
        wide = min(1.0, float(ratio) * (1 + 2.0**-20))
        r = torch.tensor(float(ratio), dtype=torch.float32, device=src.device)
    idx = pcops.farthest_point_sample(points, batch=batch, ratio=wide, random_start=random_start, validate=False).idx
    example = batch[idx]  # ascending: the picks are grouped by example
    rank = torch.arange(idx.shape[0], device=idx.device) - torch.searchsorted(example, example)
    ordered = batch.sort().values
    sizes = torch.searchsorted(ordered, example, right=True) - torch.searchsorted(ordered, example)
    if r.dim() > 0:
        r = r.to(idx.device)[example]
    keep = rank < _fps_counts(sizes, r)
    return compact(idx[:, None], keep[:, None])[0]


@torch.jit.ignore
def _grid_cluster(
    pos: torch.Tensor,
    size: torch.Tensor,
    start: Optional[torch.Tensor] = None,
    end: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    check_tensor("pos", pos)
    size = check_tensor("size", size)
    pos = pos.view(pos.shape[0], -1)
    d = pos.shape[1]
    if size.numel() != d:
        raise ValueError(f"size must have one entry per dimension of pos ({d}), got {size.numel()}")
    for name, t in (("start", start), ("end", end)):
        if t is not None and check_tensor(name, t).numel() != d:
            raise ValueError(f"{name} must have one entry per dimension of pos ({d}), got {t.numel()}")
    check_finite(pos=pos, size=size, start=start, end=end)
    if not is_compiling() and size.numel() and not bool((size > 0).all()):  # (one host read; 0 gave INT64_MIN ids)
        raise ValueError(f"size must be > 0 in every dimension, got {size.reshape(-1).tolist()}")
    if pos.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=pos.device)
    start = pos.min(0).values if start is None else start.reshape(d).to(pos.device)
    end = pos.max(0).values if end is None else end.reshape(d).to(pos.device)
    size = size.reshape(d).to(pos.device)
    cell = torch.true_divide(pos - start, size).to(torch.long)
    extent = torch.true_divide(end - start, size).to(torch.long) + 1
    stride = torch.cat([extent.new_ones(1), extent.cumprod(0)[:-1]])
    return (cell * stride).sum(1)


# ----------------------------------------------------------------------------------------------
# The public functions: typed signatures that torch.jit.script compiles; each calls its
# implementation above, which TorchScript leaves to Python (@torch.jit.ignore) and torch.compile
# traces as any Python function.


def knn(
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    batch_x: Optional[torch.Tensor] = None,
    batch_y: Optional[torch.Tensor] = None,
    cosine: bool = False,
    num_workers: int = 1,
    batch_size: Optional[int] = None,
) -> torch.Tensor:
    """For each element of ``y``, its ``k`` nearest points of ``x`` (torch_cluster's ``knn``).

    Args:
        x: Tensor (N, F) (or (N,)) of points searched.
        y: Tensor (M, F) of query points.
        k: number of neighbours; an example with fewer points in ``x`` gives all of them.
        batch_x, batch_y: optional int tensors (N,) / (M,) of example ids (sorted or not).
        cosine: rank by the cosine distance 1 - cos(x_j, y_i) (on every device; torch_cluster
            supports it on CUDA only).
        num_workers: accepted, not needed. batch_size: the number of examples, not needed; where
            given it must count every example of the batch vectors (a ValueError otherwise).

    Returns:
        LongTensor (2, E): row 0 the index into ``y``, row 1 into ``x``; grouped by ``y``
        (ascending), each group by distance, ties by the smaller index of ``x``.
    """
    return _knn(x, y, k, batch_x, batch_y, cosine, num_workers, batch_size)


def knn_graph(
    x: torch.Tensor,
    k: int,
    batch: Optional[torch.Tensor] = None,
    loop: bool = False,
    flow: str = "source_to_target",
    cosine: bool = False,
    num_workers: int = 1,
    batch_size: Optional[int] = None,
) -> torch.Tensor:
    """Edges to the ``k`` nearest points (torch_cluster's ``knn_graph``).

    As torch_cluster, the ``k`` (``k + 1`` without ``loop``) nearest points of each point are
    found, itself included, and without ``loop`` the point itself is then dropped: a point
    with duplicates at distance 0 ranked before it keeps ``k + 1`` neighbours.

    Returns:
        LongTensor (2, E): ``flow="source_to_target"``: row 0 the neighbour, row 1 the centre;
        ``"target_to_source"``: swapped. Grouped by centre, by distance within a centre.
    """
    return _knn_graph(x, k, batch, loop, flow, cosine, num_workers, batch_size)


def radius(
    x: torch.Tensor,
    y: torch.Tensor,
    r: float,
    batch_x: Optional[torch.Tensor] = None,
    batch_y: Optional[torch.Tensor] = None,
    max_num_neighbors: int = 32,
    num_workers: int = 1,
    batch_size: Optional[int] = None,
    ignore_same_index: bool = False,
) -> torch.Tensor:
    """For each element of ``y``, the points of ``x`` within distance ``r`` (torch_cluster's ``radius``).

    Args:
        x: Tensor (N, D) (or (N,)), D <= 3.
        y: Tensor (M, D).
        r: radius; ``x_j`` is a neighbour of ``y_i`` when ``||x_j - y_i||^2 < r * r`` (strictly,
            squared in the points' precision, as torch_cluster).
        batch_x, batch_y: optional int tensors of example ids (sorted or not).
        max_num_neighbors: at most this many per element of ``y``: the first ones by index.
        ignore_same_index: skip ``x_i`` for ``y_i`` (the same row number), before the cap.
        num_workers: accepted, not needed. batch_size: the number of examples, not needed; where
            given it must count every example of the batch vectors (a ValueError otherwise).

    Returns:
        LongTensor (2, E): row 0 the index into ``y``, row 1 into ``x``; grouped by ``y``
        (ascending), each group in ascending index of ``x``.
    """
    return _radius(x, y, r, batch_x, batch_y, max_num_neighbors, num_workers, batch_size, ignore_same_index)


def radius_graph(
    x: torch.Tensor,
    r: float,
    batch: Optional[torch.Tensor] = None,
    loop: bool = False,
    max_num_neighbors: int = 32,
    flow: str = "source_to_target",
    num_workers: int = 1,
    batch_size: Optional[int] = None,
) -> torch.Tensor:
    """Edges to all points within ``r`` (torch_cluster's ``radius_graph``): ``radius(x, x, ...)``
    with ``ignore_same_index=not loop``, so each point keeps at most ``max_num_neighbors``
    neighbours other than itself (the first by index).

    Returns:
        LongTensor (2, E): ``flow="source_to_target"``: row 0 the neighbour, row 1 the centre;
        ``"target_to_source"``: swapped. Grouped by centre, in ascending neighbour index.
    """
    return _radius_graph(x, r, batch, loop, max_num_neighbors, flow, num_workers, batch_size)


def nearest(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_x: Optional[torch.Tensor] = None,
    batch_y: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """For each element of ``x``, the index of its nearest point of ``y`` in the same example
    (torch_cluster's ``nearest``); ties by the smaller index.

    Raises ValueError, as torch_cluster, when a batch vector is not sorted or when the examples
    of ``x`` and ``y`` differ.
    """
    return _nearest(x, y, batch_x, batch_y)


def fps(
    src: torch.Tensor,
    batch: Optional[torch.Tensor] = None,
    ratio: Optional[Union[torch.Tensor, float]] = None,
    random_start: bool = True,
    batch_size: Optional[int] = None,
    ptr: Optional[Union[torch.Tensor, List[int]]] = None,
) -> torch.Tensor:
    """Farthest point sampling (torch_cluster's ``fps``) on ``pcops.farthest_point_sample``.

    Args:
        src: Tensor (N, D) (or (N,)), D <= 3.
        batch: optional int tensor (N,) of example ids (sorted or not).
        ratio: fraction of each example to pick, 0 < ratio <= 1 (default 0.5): an example of n
            points gives ceil(n * ratio) picks, computed in float32 as torch_cluster's CPU kernel
            does (ratio 0.3 and n = 50 give 16). A float, a 0-d tensor or a (B,) tensor; a
            tensor's values are not read on the host (the counts are computed by tensor ops).
        random_start: start each example at a random point drawn from torch's global RNG
            (``torch.manual_seed`` makes it reproducible; not the same draw as torch_cluster);
            otherwise at its first point. The draw is a tensor op, so under ``torch.compile``
            it stays in the graph (Inductor draws with its own generator; set
            ``torch._inductor.config.fallback_random = True`` to get eager's draws).
        batch_size: the number of examples, not needed; where given it must count every
            example of ``batch`` (a ValueError otherwise).
        ptr: instead of ``batch``, CSR boundaries of contiguous examples (tensor or list).

    Returns:
        LongTensor (K,) of indices into ``src``, grouped by example (ascending id), each in pick
        order. Ties go to the smaller index; a point is never picked twice.
    """
    return _fps(src, batch, ratio, random_start, batch_size, ptr)


def grid_cluster(
    pos: torch.Tensor,
    size: torch.Tensor,
    start: Optional[torch.Tensor] = None,
    end: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Voxel grid clustering (torch_cluster's ``grid_cluster``): the index of each point's voxel.

    The voxel of ``pos_i`` in dimension d is ``c_d = trunc((pos_id - start_d) / size_d)``, and
    its index ``sum_d c_d * prod_{e<d} n_e`` with ``n_e = trunc((end_e - start_e) / size_e) + 1``;
    ``start`` and ``end`` default to the minimum and maximum of ``pos``. Arithmetic only (no
    search). For consecutive ids use ``torch.unique(cluster, return_inverse=True)`` or
    ``pcops.voxel_pool``, whose voxels are origin-aligned.

    Returns:
        LongTensor (N,).
    """
    return _grid_cluster(pos, size, start, end)


# ----------------------------------------------------------------------------------------------
# torch_cluster's graph functions: not point-cloud ops, so not provided. They exist (with
# torch_cluster's signatures) so that code importing them, as PyTorch Geometric 2.5 / 2.6 do at
# import time with ``torch_cluster`` aliased to this module, imports; a call raises.


def graclus_cluster(
    row: Tensor,
    col: Tensor,
    weight: Optional[Tensor] = None,
    num_nodes: Optional[int] = None,
) -> Tensor:
    """Not provided (torch_cluster's greedy graph clustering): raises NotImplementedError."""
    raise NotImplementedError("pcops.compat.torch_cluster does not provide graclus_cluster (a graph op, not a point-cloud op): install torch_cluster for it")


def random_walk(
    row: Tensor,
    col: Tensor,
    start: Tensor,
    walk_length: int,
    p: float = 1,
    q: float = 1,
    coalesced: bool = True,
    num_nodes: Optional[int] = None,
    return_edge_indices: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Not provided (torch_cluster's biased random walks): raises NotImplementedError."""
    raise NotImplementedError("pcops.compat.torch_cluster does not provide random_walk (a graph op, not a point-cloud op): install torch_cluster for it")


def neighbor_sampler(start: Tensor, rowptr: Tensor, size: float) -> Tensor:
    """Not provided (torch_cluster's neighbour sampling of a CSR graph): raises NotImplementedError."""
    raise NotImplementedError("pcops.compat.torch_cluster does not provide neighbor_sampler (a graph op, not a point-cloud op): install torch_cluster for it")
