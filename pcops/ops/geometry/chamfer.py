"""Chamfer distance between point clouds, with PyTorch3D's semantics, on pcops' nearest-neighbour search.

Each point of ``x`` is matched to its nearest point of ``y`` (and each point of ``y`` to its
nearest in ``x``) by a search that returns indices only: pcops' kNN search with k = 1 for
``norm=2`` (Euclidean nearest), the ``pcops::nearest_l1`` custom op for ``norm=1`` (nearest in
the L1 metric: scipy's cKDTree on CPU, chunked brute force elsewhere). The costs are then
recomputed in torch from the matched pairs, ``||x_i - y_nn(i)||_2^2`` or ``||x_i - y_nn(i)||_1``,
so gradients reach both clouds and no (N, M) matrix is ever built.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from ... import _layout, _threads, _validate
from ..neighbours.nearest import nearest_costs, plain_knn, plain_nearest, plain_warp, search

POINT_REDUCTIONS = ("mean", "sum", "max", None)
BATCH_REDUCTIONS = ("mean", "sum", None)
_ENTRIES = 1 << 22  # L1 distances held per chunk of the brute-force search


# ----------------------------------------------------------------------------------------------
# The L1 nearest-neighbour search (norm=1)


def _l1_brute(query, ref, query_group, ref_group) -> torch.Tensor:
    """Index of the L1-nearest ref point per query (-1 if its group has none), in chunks; ties by smaller index."""
    out = torch.full((query.shape[0],), -1, dtype=torch.int64, device=query.device)
    if ref.shape[0] == 0:
        return out
    chunk = max(1, _ENTRIES // ref.shape[0])
    for s in range(0, query.shape[0], chunk):
        q = query[s : s + chunk]
        d = (q[:, None, 0] - ref[None, :, 0]).abs()
        for c in range(1, query.shape[1]):  # the coordinates summed in order (3 for chamfer, any D for compat)
            d += (q[:, None, c] - ref[None, :, c]).abs()
        d.masked_fill_(d.isnan(), float("inf"))  # a NaN/inf point is never a neighbour (validate=False)
        if query_group is not None:
            d.masked_fill_(query_group[s : s + chunk, None] != ref_group[None, :], float("inf"))
        best, idx = d.min(1)  # the first minimal index
        out[s : s + chunk] = torch.where(torch.isinf(best), -1, idx)
    return out


def _l1_scipy(query, ref, query_group, ref_group) -> torch.Tensor:
    """The same with scipy's cKDTree (p=1, all cores), one tree per group; ties by the smaller
    index, as the brute force (the tree returns any of the tied points: see :func:`_first_tied`).
    Points with a NaN or inf coordinate (``validate=False``; the tree takes none) neither find
    nor are neighbours, as in the brute force."""
    from scipy.spatial import cKDTree

    q, r = query.numpy(), ref.numpy()
    out = np.full(q.shape[0], -1, dtype=np.int64)
    q_finite, r_finite = np.isfinite(q).all(1), np.isfinite(r).all(1)
    if query_group is None:
        sets = [(np.flatnonzero(q_finite), np.flatnonzero(r_finite))]
    else:  # rows of each group from one stable sort per side (not one scan per group)
        qg, rg = query_group.numpy(), ref_group.numpy()
        size = int(max(qg.max(initial=0), rg.max(initial=0))) + 1
        q_order, r_order = np.argsort(qg, kind="stable"), np.argsort(rg, kind="stable")
        q_split = np.split(q_order, np.cumsum(np.bincount(qg, minlength=size))[:-1])
        r_split = np.split(r_order, np.cumsum(np.bincount(rg, minlength=size))[:-1])
        sets = ((rows[q_finite[rows]], cols[r_finite[cols]]) for rows, cols in zip(q_split, r_split))
    for rows, cols in sets:  # cols ascending: the smallest local index is the smallest index
        if rows.size and cols.size:
            out[rows] = cols[_first_tied(cKDTree(r[cols]), q[rows], r[cols])]
    return torch.from_numpy(out)


_TIE = 1e-12  # relative: distances this close to the smallest are re-measured (the tree's own sums may round otherwise)


def _first_tied(tree, q: np.ndarray, r: np.ndarray) -> np.ndarray:
    """(P,) index into ``r`` of each query's L1-nearest point, ties by the smaller index. The
    tree's two nearest tell which queries may have a tie; for those, every point within the
    nearest distance (widened by ``_TIE``) is measured again in float64 and the smallest
    (distance, index) wins."""
    k = min(2, r.shape[0])
    dist, near = tree.query(q, k=k, p=1, workers=-1)
    if k == 1:
        return near
    best = near[:, 0].copy()
    bound = dist[:, 0] * (1 + _TIE)
    tied = np.flatnonzero(dist[:, 1] <= bound)
    if tied.size:
        balls = tree.query_ball_point(q[tied], bound[tied], p=1, workers=-1)
        row = np.repeat(np.arange(tied.size), [len(b) for b in balls])
        cand = np.concatenate([np.asarray(b, dtype=np.int64) for b in balls])
        diff = np.abs(q[tied][row].astype(np.float64) - r[cand].astype(np.float64))
        d = diff[:, 0]
        for c in range(1, diff.shape[1]):
            d = d + diff[:, c]
        order = np.lexsort((cand, d, row))  # by row, then distance, then index
        first = np.flatnonzero(np.r_[True, row[order][1:] != row[order][:-1]])
        best[tied] = cand[order][first]
    return best


@_threads.custom_op("pcops::nearest_l1", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def nearest_l1(
    query: torch.Tensor,
    ref: torch.Tensor,
    validate: bool,
    query_group: Optional[torch.Tensor] = None,
    ref_group: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(P,) int64 index of each query's nearest ref point in the L1 metric within its group, -1 if
    none; query (P, D) and ref (R, D), any D."""
    _validate.groups_paired(query_group, ref_group)
    _validate.op_values(validate, query=query, ref=ref)
    if query.device.type == "cpu":
        return _l1_scipy(query, ref, query_group, ref_group)
    return _l1_brute(query, ref, query_group, ref_group)


@nearest_l1.register_fake
def _(query, ref, validate, query_group=None, ref_group=None):
    return query.new_empty((query.shape[0],), dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Chamfer distance


_NAMES = _layout.names("x", "y")  # the caller's names in every message of the layout layer


def _check_options(norm, single_directional, point_reduction, batch_reduction) -> None:
    _validate.one_of("norm", norm, (1, 2))
    _validate.flag(single_directional=single_directional)
    _validate.reductions(point_reduction, batch_reduction, POINT_REDUCTIONS, BATCH_REDUCTIONS)


def _unmatched(query: torch.Tensor, query_group, ref_group, validate: bool, ids: Optional[int] = None):
    """The cost of a query whose search found no neighbour (-1): inf where the query is finite
    and its sample of the other cloud has points (every distance to them overflowed the dtype,
    or, without validation, none of them is finite), else 0 (padding rows, points whose sample
    of the other cloud is empty, a NaN query without validation). ``validate``: the caller's
    (the points were checked finite); query_group / ref_group None: one cloud each, the other
    one not empty; ``ids``: the groups are below it (padded layouts), else any int32 (packed).
    A number, or a tensor (P,)."""
    fill = float("inf")
    if not validate:
        fill = torch.where(torch.isfinite(query).all(-1), fill, 0.0)
    if query_group is not None:
        if ids is None:
            present = torch.isin(query_group, ref_group)
        else:  # (a table of the ids, where their number is known: no sort)
            present = query_group.new_zeros(ids, dtype=torch.bool).index_fill_(0, ref_group.long(), True)[query_group.long()]
        fill = torch.where(present, fill, 0.0)
    return fill


def _costs(flats: list, norm: int, backend: str, dtype, validate: bool) -> list:
    """Per-point costs (P_a,) of each flat query to its nearest ref point (``validate``: the
    caller's): 0 for padding and points whose sample of the other cloud is empty, inf where a
    finite point found none (:func:`_unmatched`). The nearest rows of every direction are
    gathered from one concatenation of the refs: with each direction's own, torch.compile's
    inductor (torch 2.13, CPU) gave wrong gradients to a cloud that is one direction's query and
    the other's gathered ref (tests/test_compile.py)."""
    found = []
    for flat in flats:
        if flat.ref.shape[0] == 0 or flat.query.shape[0] == 0:  # nothing to match: PyTorch3D's zero
            found.append(None)
        elif norm == 2:
            idx, valid = search(flat, 1, backend, dtype)
            found.append((idx[:, 0], valid[:, 0]))
        else:
            q, r = flat.query.detach().to(dtype), flat.ref.detach().to(dtype)
            nearest = nearest_l1(q, r, flat.validate, flat.query_group, flat.ref_group)
            found.append((nearest.clamp_min(0), nearest >= 0))
    refs = [flat.ref.to(dtype) for flat in flats]
    ref = refs[0] if len(refs) == 1 else torch.cat(refs)
    costs, offset = [], 0
    for flat, rows, part in zip(flats, found, refs):
        if rows is None:
            costs.append(flat.query.to(dtype).sum(-1) * 0)
        else:
            idx, valid = rows
            diff = flat.query.to(dtype) - _layout.select_rows(ref, idx + offset if offset else idx)
            cost = diff.square().sum(-1) if norm == 2 else diff.abs().sum(-1)
            ids = flat.batch_shape[0] + 2 if flat.batch_shape else None  # (padded: samples, then the two padding ids)
            costs.append(torch.where(valid, cost, _unmatched(flat.query.detach(), flat.query_group, flat.ref_group, validate, ids)))
        offset += part.shape[0]
    return costs


def _per_sample(cost, flat: _layout.Flat, lengths, batch_ids, batch_size: int, reduction: str) -> torch.Tensor:
    """(B,) sum, mean or max of each sample's point costs (costs of padding rows are 0)."""
    if flat.batch_shape:  # padded (B, P)
        rows = cost.reshape(flat.batch_shape)
        if reduction == "max":
            return rows.amax(1) if rows.shape[1] else rows.sum(1)
        total = rows.sum(1)
        if reduction == "sum":
            return total
        count = lengths.to(cost.dtype) if lengths is not None else torch.full_like(total, rows.shape[1])
        return total / count.clamp_min(1)
    if batch_ids is None:  # one cloud
        if reduction == "max":
            return (cost.amax() if cost.numel() else cost.sum()).reshape(1)
        return (cost.sum() if reduction == "sum" else cost.sum() / max(cost.shape[0], 1)).reshape(1)
    zeros = cost.new_zeros(batch_size)
    if reduction == "max":
        return zeros.scatter_reduce(0, batch_ids, cost, "amax", include_self=True)  # costs are >= 0
    total = zeros.index_add(0, batch_ids, cost)
    if reduction == "sum":
        return total
    count = zeros.index_add(0, batch_ids, torch.ones_like(cost))
    return total / count.clamp_min(1)


# Whether plain eager calls skip the layout layer (:func:`_plain`; tests switch it off to compare both paths)
PLAIN = [True]
# Whether plain calls with nothing to differentiate take their costs from one Warp launch
# (:func:`_kernel_costs`; tests switch it off to compare both ways)
KERNEL = [True]


def _kernel_costs(x, y, single_directional: bool, backend: str, validate: bool, dims: int):
    """[cx, cy] (or [cx]) of :func:`_plain`'s call from :func:`pcops.ops.neighbours.nearest._costs.costs`, or None
    unless both clouds are non-empty and plain with nothing to differentiate
    (:func:`pcops.ops.neighbours.nearest.plain_warp`), their values finite where ``validate``
    asks (checked by the costs' launch: a NaN or inf gives None, and the general path names it)
    and the search is Warp's: the values of the torch formula on the plain kNN search's
    indices. ``dims``: the clouds' dimensions (3: one padded sample each, (1, P, 3))."""
    if not KERNEL[0] or not plain_warp(x, y, 1, backend, False, dims) or x.shape[-2] == 0:  # (y: 1 <= N)
        return None
    found = nearest_costs(x, y, not single_directional, validate)
    if found is None:
        return None
    return [found[0]] if single_directional else list(found)


def _plain(x, y, single_directional: bool, point_reduction, batch_reduction, backend: str, validate: bool, dims: int = 2):
    """:func:`chamfer_distance` (norm 2, no batch keywords) of two plain clouds, or None for any
    other call: each cloud non-empty, both plain but for gradients (the points detached, x's and
    y's values checked once), each point's nearest point of the other cloud from chamfer's pass
    over every pair (small clouds: :func:`plain_nearest`) or the plain kNN searches (the search's
    function called directly), the same points either way. The costs and reductions are the
    general path's operations on the same values (one cloud each), so the same loss and
    gradients. With nothing to differentiate, the costs come from one Warp launch
    (:func:`_kernel_costs`: the same values). ``dims=3``: x and y are one padded sample each, (1,
    P, 3), given as they are to that launch (their points alone elsewhere): per-point costs (P,)."""
    costs = _kernel_costs(x, y, single_directional, backend, validate, dims)
    if costs is None:
        if dims == 3:
            x, y = x[0], y[0]
        nearest = plain_nearest(x, y, not single_directional, backend, validate)
        if nearest is None:
            found = plain_knn(x, y, 1, backend, validate, detach=True)
            if found is None or x.shape[0] == 0:
                return None
            back = None if single_directional else plain_knn(y, x, 1, backend, False, detach=True)
            if back is None and not single_directional:
                return None
            nearest = found[1][:, 0], None if back is None else back[1][:, 0]
        costs = []
        for query, ref, idx in ((x, y, nearest[0]), (y, x, nearest[1]))[: 1 if single_directional else 2]:
            # (idx -1: a NaN query without validation, or every distance overflowing to inf)
            costs.append(torch.where(idx >= 0, (query - _layout.select_rows(ref, idx.clamp_min(0))).square().sum(-1),
                                     _unmatched(query.detach(), None, None, validate)))
    if point_reduction is None:
        return costs[0] if single_directional else tuple(costs)
    # one sample: its loss is the batch's (the general path's sum, or mean, of one value: the same value)
    if point_reduction == "max":
        per_sample = [cost.amax() for cost in costs]
    else:
        per_sample = [cost.sum() if point_reduction == "sum" else cost.mean() for cost in costs]  # (a CPU mean: the sum over the count)
    if single_directional:
        return per_sample[0]
    return torch.maximum(*per_sample) if point_reduction == "max" else per_sample[0] + per_sample[1]


def _one_padded(t) -> bool:
    """Whether ``t`` is a plain tensor of one padded sample, (1, P, 3)."""
    return type(t) is torch.Tensor and t.dim() == 3 and t.shape[0] == 1


@_threads.limits
def chamfer_distance(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    x_lengths: Optional[torch.Tensor] = None,
    y_lengths: Optional[torch.Tensor] = None,
    x_batch: Optional[torch.Tensor] = None,
    y_batch: Optional[torch.Tensor] = None,
    norm: int = 2,
    single_directional: bool = False,
    point_reduction: Optional[str] = "mean",
    batch_reduction: Optional[str] = "mean",
    batch_size: Optional[int] = None,
    backend: str = "auto",
    validate: bool = True,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Chamfer distance between the clouds ``x`` and ``y`` (PyTorch3D's ``chamfer_distance``).

    ``cham_x[i] = min_j ||x_i - y_j||_2^2`` (``norm=2``) or ``min_j ||x_i - y_j||_1`` (``norm=1``),
    and ``cham_y`` the same from ``y`` to ``x``. Per sample, ``point_reduction`` sums ("sum"),
    averages over the sample's points ("mean") or takes the largest ("max", the Hausdorff
    distance) of each; the loss is ``cham_x + cham_y`` (``max(cham_x, cham_y)`` for "max"), or
    ``cham_x`` alone with ``single_directional=True``. ``batch_reduction`` then sums or averages
    over the B samples. Padding rows and points whose sample of the other cloud is empty cost 0;
    a point farther from every point of its sample of the other cloud than the dtype holds (the
    squared distances overflow: float32 coordinates about 1e19 apart) costs inf.

    Args:
        x: Tensor of shape (P1, 3); (B, P1, 3) padded; or (P1_total, 3) packed.
        y: Tensor of shape (P2, 3); (B, P2, 3) padded; or (P2_total, 3) packed.
        x_lengths, y_lengths: optional int tensors (B,) for padded inputs (PyTorch3D's lengths).
        x_batch, y_batch: int sample ids (P1_total,) / (P2_total,) of packed inputs.
        norm: 2 (squared Euclidean, nearest in Euclidean distance) or 1 (L1, nearest in L1).
        single_directional: only the x -> y term.
        point_reduction: "mean", "sum", "max" or None (per-point costs).
        batch_reduction: "mean", "sum" or None (per-sample losses); None when point_reduction is.
        batch_size: number of samples of packed inputs; by default one more than the largest
            id (a host read; required under ``torch.compile``).
        backend: kNN search backend for ``norm=2``, as for :func:`pcops.knn`.
        validate: check points for NaN/inf and lengths/ids for range.

    Returns:
        With reductions: a scalar (batch_reduction) or a (B,) tensor (one cloud: B = 1; a
        0-d tensor with ``batch_reduction=None``). With ``point_reduction=None``: the tuple
        ``(cham_x, cham_y)`` of per-point costs in the input layout ((P1,), (B, P1) or
        (P1_total,) and likewise for y), or ``cham_x`` alone if single_directional. Unlike
        PyTorch3D, no ``(loss, loss_normals)`` pair: normals are not supported. In the
        promoted dtype of the points (float16/bfloat16 computed in float32); differentiable
        with respect to both clouds.

    Example:
        >>> import torch, pcops
        >>> x = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
        >>> y = torch.tensor([[0.0, 0.5, 0.0]])
        >>> pcops.chamfer_distance(x, y)  # mean nearest squared distance, x to y plus y to x
        tensor(1.)
    """
    batch_size = _validate.plain(batch_size)  # NumPy scalars as Python numbers
    _check_options(norm, single_directional, point_reduction, batch_reduction)
    if PLAIN[0] and norm == 2 and x_lengths is None and y_lengths is None and x_batch is None and y_batch is None and batch_size is None:
        if _one_padded(x) and _one_padded(y):  # (1, P, 3) without lengths (PyTorch3D's call): one cloud each
            loss = _plain(x, y, single_directional, point_reduction, batch_reduction, backend, validate, 3)
            if loss is not None and point_reduction is None:  # per-point costs in the padded layout, (1, P)
                return tuple(c[None] for c in loss) if isinstance(loss, tuple) else loss[None]
            if loss is not None:  # a per-sample loss (1,), or the batch's
                return loss.reshape(1) if batch_reduction is None else loss
        else:
            loss = _plain(x, y, single_directional, point_reduction, batch_reduction, backend, validate)
            if loss is not None:
                return loss
    layout = dict(query_lengths=x_lengths, ref_lengths=y_lengths, query_batch=x_batch, ref_batch=y_batch)
    _validate.layout(x, y, None, **layout, names=_NAMES)
    b, ranges = _layout.sample_count(x, x_batch, y_batch, batch_size, rows=point_reduction is not None)
    flat_x = _layout.pair(x, y, **layout, validate=validate, names=_NAMES, ranges=ranges)
    dtype, out_dtype = _validate.compute_dtype(x, y)
    terms = [(flat_x, x_lengths, x_batch)]
    if not single_directional:  # the same clouds the other way round: their values are checked
        reverse = dict(query_lengths=y_lengths, ref_lengths=x_lengths, query_batch=y_batch, ref_batch=x_batch)
        flat_y = _layout.pair(y, x, **reverse, validate=flat_x.validate, names=_layout.names("y", "x"))
        terms.append((flat_y, y_lengths, y_batch))
    costs = _costs([flat for flat, _, _ in terms], norm, backend, dtype, validate)
    terms = [(cost, *term) for cost, term in zip(costs, terms)]
    if point_reduction is None:
        per_point = tuple(_layout.unflatten(flat, cost).to(out_dtype) for cost, flat, _, _ in terms)
        return per_point[0] if single_directional else per_point
    per_sample = [_per_sample(cost, flat, lengths, ids, b, point_reduction) for cost, flat, lengths, ids in terms]
    if single_directional:
        loss = per_sample[0]
    elif point_reduction == "max":
        loss = torch.maximum(*per_sample)
    else:
        loss = per_sample[0] + per_sample[1]
    if batch_reduction is not None:
        loss = loss.sum() if batch_reduction == "sum" else loss.sum() / max(b, 1)
    elif x.dim() == 2 and x_batch is None:
        loss = loss.reshape(())  # one cloud: no batch dimension
    return loss.to(out_dtype)


__all__ = ["chamfer_distance", "nearest_l1"]
