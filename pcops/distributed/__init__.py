"""One cloud across processes: neighbour ops on shares of a cloud held by the ranks of a
torch.distributed process group (gloo on CPU, NCCL on CUDA), exchanging only halos.

Each rank calls the op with its own share of the queries and of the reference points (and
features); the global reference cloud is the ranks' shares concatenated in rank order. A rank
gets its own rows of what the single-process op gives on the whole cloud: the same values,
neighbours as global rows (ties by the smaller global row), and gradients that flow back to the
rank that holds each point and feature. Any assignment of points to ranks is correct; a spatial
one (:func:`partition`) is cheap: a rank receives only the reference points that its queries
can reach (:mod:`._halo`), and :data:`traffic` counts the bytes each process moved. The ops
also take DTensors sharded on the points' dimension (``Shard(0)`` on a 1-D device mesh, uneven
shares allowed) and return DTensors (:mod:`._dtensor`)::

    import torch.distributed as dist
    import pcops.distributed as pd

    dist.init_process_group("gloo")                      # torchrun --nproc-per-node 2 ...
    part = pd.partition(points)                          # a balanced spatial share for this rank
    mine = part.points                                   # (n_r, 3)
    out = pd.knn(mine, mine, 16)                         # this rank's rows, global indices
    back = part.restore(out.dists)                       # rows in the order the points came in
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import FPS, KNN, BallQuery, _layout, _morton, _validate, nn
from .. import ball_query as _ball_query, knn as _knn, knn_aggregate as _knn_aggregate, radius_aggregate as _radius_aggregate
from . import _comm, _fps, _halo
from ._dtensor import accepts_dtensors
from ._comm import Traffic, traffic

_comm.spell(*_validate.WEIGHTS, *_validate.REDUCE)  # (their names in a message about another rank's options)

__all__ = ["KNNAggregation", "Partition", "RadiusAggregation", "Traffic", "ball_query", "chamfer_distance", "farthest_point_sample", "knn", "knn_aggregate", "knn_interpolate", "partition",
           "radius_aggregate", "traffic"]


def _knn_reach(query: torch.Tensor, ref: torch.Tensor, k: int, group, known=None):
    """The reach of :func:`pcops.distributed._halo.gather` for kNN, a function of every rank's
    reference count: each query's k-th distance among this rank's own reference points, a bound
    of its k-th distance in the whole cloud. Where a rank holds fewer than k points, the other
    ranks first send it their points nearest to its queries (:func:`_near_cells`: two small
    collectives, only then), and its bound is the k-th distance among its own and those; inf
    where the whole cloud holds fewer than k (an error: :func:`_enough`). ``known``: the own
    k-th distances, where the caller has them. Every rank must take this path."""

    def own() -> torch.Tensor:
        if known is not None:
            return known
        if ref.shape[0] < k or query.shape[0] == 0:
            return query.new_full((query.shape[0],), float("inf"))
        return _knn(query.detach(), ref.detach(), k, validate=False).dists[:, -1]

    def reach(counts: list) -> torch.Tensor:
        if min(counts) >= k or sum(counts) < k:
            return own()
        near = _near_cells(query, ref, k, [n < k for n in counts], group)  # every rank takes part
        if ref.shape[0] >= k or query.shape[0] == 0:
            return own()
        points = torch.cat([ref.detach().to(torch.float64), near.to(ref.device)])
        if points.shape[0] < k:  # fewer than k finite points near (NaN points, validate=False): no bound
            return query.new_full((query.shape[0],), float("inf"))
        return _knn(query.detach().to(torch.float64), points, k, validate=False).dists[:, -1]

    return reach


def _near_cells(query: torch.Tensor, ref: torch.Tensor, k: int, needy: list, group) -> torch.Tensor:
    """The reference points the other ranks hold nearest to this rank's queries, float64: every
    rank gathers the centres of each rank's query cells (:func:`pcops.distributed._halo.reach_boxes`
    at reach 0) and sends each rank in ``needy`` (with fewer than k points of its own) its k
    points nearest to each of that rank's centres. Together with the rank's own points, at
    least k (the whole cloud holds k or more), they bound each query's k-th distance."""
    me, world = _comm.rank_and_size(group)
    boxes = _halo.reach_boxes(query, query.new_zeros(()))
    centres = _comm.all_gather(boxes.mean(1).cpu(), group)  # (CELLS^3, 3) float64, NaN for an empty cell
    point = ref.detach().to(torch.float64)
    rows = []
    for r in range(world):
        centre = centres[r][~centres[r].isnan().any(1)].to(ref.device)
        if r == me or not needy[r] or centre.shape[0] == 0 or point.shape[0] == 0:
            rows.append(point.new_zeros((0, 3)))
            continue
        idx = _knn(centre, point, min(k, point.shape[0]), validate=False).idx
        rows.append(point.index_select(0, torch.unique(idx[idx >= 0])))  # -1: none (NaN points, validate=False)
    return _comm.exchange(rows, group)


def _kept(*received: torch.Tensor) -> torch.Tensor:
    """A zero that depends on the received tensors: added to a rank's result, it keeps the exchange
    in every rank's autograd graph (each backward then runs its collective), and stays 0 with NaN
    or inf points in a halo (validate=False)."""
    return sum((t.nan_to_num(0.0, 0.0, 0.0) * 0).sum() for t in received)  # (zeros summed: no sum to overflow to inf, float16 included)


def _k_halo(query, ref, features, k: int, group) -> _halo.Halo:
    return _enough(_halo.gather(query, ref, features, _knn_reach(query, ref, k, group), group), k)


def _enough(halo: _halo.Halo, k: int) -> _halo.Halo:
    if k > halo.total:  # the same on every rank
        raise ValueError(f"k must be <= the number of reference points of all ranks, got k={k} for {halo.total}")
    return halo


def _nearest(query: torch.Tensor, ref: torch.Tensor, k: int, group) -> tuple[KNN, _halo.Halo]:
    """:func:`knn`'s result (global rows) and the halo it searched: each query's k nearest among
    this rank's own points, searched again with the halo only where a point of another rank
    lies within their k-th distance."""
    if ref.shape[0] < k or query.shape[0] == 0:  # no bound from this rank's own points
        halo = _k_halo(query, ref, None, k, group)
        if query.shape[0] == 0:  # no search (this rank's halo may hold fewer than k points), the graph kept
            return KNN(query.new_zeros((0, k)) + _kept(halo.ref), torch.zeros((0, k), dtype=torch.int64, device=query.device)), halo
        out = _knn(query, halo.ref, k, validate=False)
        return KNN(out.dists, _halo.to_global(out.idx, halo)), halo
    own = _knn(query, ref, k, validate=False)
    reach = own.dists[:, -1].detach()
    halo = _enough(_halo.gather(query, ref, None, _knn_reach(query, ref, k, group, known=reach), group), k)
    border = _halo.reached(query, halo, reach, lambda q, p: _knn(q, p, 1, validate=False).dists[:, 0])
    dists, idx = own.dists + _kept(halo.ref), torch.where(own.idx >= 0, own.idx + halo.offset, -1)  # the exchange kept in every rank's graph
    if bool(border.any()):
        again = _knn(query[border], halo.ref, k, validate=False)
        dists = dists.index_put((border,), again.dists)
        idx = idx.index_put((border,), _halo.to_global(again.idx, halo))
    return KNN(dists, idx), halo


def _weighting_of(sigma, options: dict, allowed: tuple) -> str:
    """The weighting of an aggregation's ``sigma`` and ``options`` (``allowed``: its ``weights``
    and ``reduce``, and kNN's search ``backend``; the single-process op's checks)."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"got an unexpected keyword argument {unknown[0]!r} (the options are {', '.join(allowed)})")
    weights = _validate.weighting(options.get("weights"), options.get("reduce", "mean"), sigma)
    if weights == "softmax":
        _validate.scale("sigma", sigma)
    return weights


def _pair(group, query, ref, features, validate: bool, names=None, aggregate=None, **numbers):
    """The agreed checks of a two-cloud call (the layout's, in the caller's names, and its
    numbers: ``k=`` an int >= 1, ``radius=`` a number > 0; ``aggregate``: an aggregation's
    (sigma, options), checked as the single-process op checks them), the numbers as Python
    numbers; the numbers, the options, the clouds' dtypes and the features' channels the same on
    every rank."""

    def check():
        positive = None
        if aggregate is not None and _weighting_of(*aggregate) == "softmax":
            _validate.same_device(query=query, sigma=aggregate[0])
            positive = dict(sigma=aggregate[0]) if isinstance(aggregate[0], torch.Tensor) else None
        _layout.pair(query, ref, features, validate=validate, positive=positive, **({"names": names} if names else {}))
        out = {}
        for name, value in numbers.items():
            value = _validate.plain(value)
            if name == "radius":
                _validate.positive_number(name, value)
                out[name] = float(value)
            else:
                out[name] = _validate.count(name, value)
        return out

    said = names or _layout.names()
    same = {**{name: _validate.plain(value) for name, value in numbers.items()}, f"{said.query}'s dtype": _dtype(query),
            f"{said.ref}'s dtype": _dtype(ref)}
    same.update({f"{said.features}'s dtype": _dtype(features), f"{said.features}' channels": _channels(features)})  # (None: none; every rank's row of one length)
    if aggregate is not None:
        sigma, options, _ = aggregate
        try:  # (a name that fails: the checks say so first)
            weights = _validate.weighting_name(options.get("weights"), options.get("reduce", "mean"))
        except (ValueError, TypeError):
            weights = None
        same.update(weights=weights, reduce=options.get("reduce", "mean"), sigma=sigma)
    return _comm.agree(check, group, same)


def _dtype(t):
    return t.dtype if isinstance(t, torch.Tensor) else None


def _channels(t):
    return t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() else None


@accepts_dtensors(per_query=True)
def knn(query: torch.Tensor, ref: torch.Tensor, k: int, *, group=None, validate: bool = True) -> KNN:
    """:func:`pcops.knn` of this rank's queries against the whole reference cloud (every rank's
    share), ``idx`` global rows of the cloud. Every rank calls it; k <= the whole cloud's size.

    Example (two processes, each with its share)::

        out = pcops.distributed.knn(my_queries, my_points, 8)   # out.idx: rows of the whole cloud
    """
    k = _pair(group, query, ref, None, validate, k=k)["k"]
    return _nearest(query, ref, k, group)[0]


@accepts_dtensors(per_query=True)
def knn_aggregate(query: torch.Tensor, ref: torch.Tensor, features: torch.Tensor, k: int, sigma=None, *, group=None,
                  validate: bool = True, **options) -> torch.Tensor:
    """:func:`pcops.knn_aggregate` of this rank's queries over the whole cloud (``options``:
    its ``weights``, ``reduce`` and ``backend``); gradients reach every rank's points and features."""
    k = _pair(group, query, ref, features, validate, aggregate=(sigma, options, ("weights", "reduce", "backend")), k=k)["k"]
    halo = _k_halo(query, ref, features, k, group)
    if query.shape[0] == 0:  # no search (this rank's halo may hold fewer than k points), the graph kept
        return features.new_zeros((0, features.shape[1])) + _kept(halo.ref, halo.features)
    return _knn_aggregate(query, halo.ref, halo.features, k, sigma, validate=False, **options)


@accepts_dtensors(per_query=True)
def knn_interpolate(query: torch.Tensor, ref: torch.Tensor, features: torch.Tensor, k: int = 3, *, group=None,
                    validate: bool = True) -> torch.Tensor:
    """:func:`pcops.knn_interpolate` over the whole cloud (k capped at its size)."""
    k = _pair(group, query, ref, features, validate, k=k)["k"]
    total = int(_comm.all_reduce(torch.tensor(ref.shape[0]), dist.ReduceOp.SUM, group))
    return knn_aggregate(query, ref, features, min(k, total), group=group, validate=False, weights="inverse_distance")


@accepts_dtensors(per_query=True)
def ball_query(query: torch.Tensor, ref: torch.Tensor, radius: float, max_neighbors: int, *, group=None,
               validate: bool = True) -> BallQuery:
    """:func:`pcops.ball_query` of this rank's queries over the whole cloud, ``idx`` global rows."""
    numbers = _pair(group, query, ref, None, validate, radius=radius, max_neighbors=max_neighbors)
    halo = _halo.gather(query, ref, None, torch.tensor(numbers["radius"], dtype=torch.float64), group)
    out = _ball_query(query, halo.ref, numbers["radius"], numbers["max_neighbors"], validate=False)
    return BallQuery(out.dists + _kept(halo.ref), _halo.to_global(out.idx, halo), out.counts)  # (the exchange kept: see _kept)


@accepts_dtensors(per_query=True)
def radius_aggregate(query: torch.Tensor, ref: torch.Tensor, features: torch.Tensor, radius: float, sigma=None, *, group=None,
                     validate: bool = True, **options) -> torch.Tensor:
    """:func:`pcops.radius_aggregate` of this rank's queries over the whole cloud (``options``:
    its ``weights`` and ``reduce``); gradients reach every rank's points and features."""
    radius = _pair(group, query, ref, features, validate, aggregate=(sigma, options, ("weights", "reduce")), radius=radius)["radius"]
    halo = _halo.gather(query, ref, features, torch.tensor(radius, dtype=torch.float64), group)
    out = _radius_aggregate(query, halo.ref, halo.features, radius, sigma, validate=False, **options)
    return out + _kept(halo.ref, halo.features)  # (the exchange kept in the graph of a rank with nothing to search)


@accepts_dtensors(per_query=False)
def chamfer_distance(x: torch.Tensor, y: torch.Tensor, *, group=None, validate: bool = True) -> torch.Tensor:
    """:func:`pcops.chamfer_distance` (squared distances, means) of the whole clouds x and y,
    each rank holding shares of both: the same scalar on every rank. Every rank calls backward
    on it (or on a loss of it that every rank computes alike): each rank's points get their
    gradients of that one loss."""
    _pair(group, x, y, None, validate, names=_layout.names("x", "y"))
    sizes = _comm.all_reduce(torch.tensor([x.shape[0], y.shape[0]]), dist.ReduceOp.SUM, group).tolist()
    if 0 in sizes:  # a whole cloud empty: 0, as the single-process op (PyTorch3D's zero), on every rank
        return _kept(x, y).to(torch.promote_types(x.dtype, y.dtype))
    sums = []
    for a, b in ((x, y), (y, x)):
        near, halo = _nearest(a, b, 1, group)
        nearest = halo.ref.index_select(0, torch.searchsorted(halo.index, near.idx[:, 0]))  # the nearest point, from its global row
        d2 = ((a - nearest) ** 2).sum(1)
        sums.append(torch.stack([d2.sum() + _kept(halo.ref), torch.tensor(float(a.shape[0]), dtype=a.dtype, device=a.device)]))
    total = _comm.all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group, shared=True)
    return total[0, 0] / total[0, 1] + total[1, 0] / total[1, 1]


@accepts_dtensors(per_query=False)
def farthest_point_sample(points: torch.Tensor, n_samples: int, *, group=None, validate: bool = True) -> FPS:
    """:func:`pcops.farthest_point_sample` of the whole cloud (every rank's share, in rank order),
    started at its first point: the same picks, ``idx`` global rows and ``points`` their
    coordinates, on every rank. One all-gather of five numbers per pick (each rank's farthest
    point). ``points`` is differentiable: every rank calls backward on a loss it computes alike,
    and each rank's points get the gradients of their picks. Distances are computed as the
    single-process op computes them (:mod:`._fps`)."""

    def check():
        _layout.single(points, validate=validate)
        return _validate.count("n_samples", _validate.plain(n_samples))

    n_samples = _comm.agree(check, group, {"n_samples": _validate.plain(n_samples), "points' dtype": _dtype(points)})
    me, world = _comm.rank_and_size(group)
    counts = torch.stack(_comm.all_gather(torch.tensor([points.shape[0]], dtype=torch.int64), group))[:, 0]
    total, offset = int(counts.sum()), int(counts[:me].sum())
    if n_samples > total:  # the same on every rank
        raise ValueError(f"n_samples must be <= the number of points of all ranks, got {n_samples} for {total}")
    p = points.detach().to(_validate.compute_dtype(points)[0]).contiguous()  # half: picked in float32, as the single-process op does
    far = p.new_full((p.shape[0],), float("inf"))
    mine = torch.zeros(n_samples, dtype=torch.bool)
    picks, last = [], None
    for t in range(n_samples):
        if t == 0:  # the first point of the whole cloud: row 0 of the first rank holding points
            here = offset == 0 and p.shape[0] > 0
            candidate = torch.tensor([1.0 if here else -1.0, 0.0, *(p[0].tolist() if here else [0.0, 0.0, 0.0])], dtype=torch.float64)
        else:
            _fps.lower(far, p, last.to(p.dtype))
            if p.shape[0]:
                value = far.max()
                j = int((far == value).nonzero()[0])  # the first of equal ones
                candidate = torch.tensor([float(value), float(offset + j), *p[j].tolist()], dtype=torch.float64)
            else:
                candidate = torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        every = torch.stack(_comm.all_gather(candidate, group))
        best = max(range(world), key=lambda r: (float(every[r, 0]), -float(every[r, 1])))  # farthest, then the smaller row
        index = int(every[best, 1])
        picks.append(index)
        last = every[best, 2:]
        if best == me:
            far[index - offset] = -1.0  # picked: never again
            mine[t] = True
    idx = torch.tensor(picks, dtype=torch.int64, device=points.device)
    local = points.new_zeros((n_samples, 3))
    rows = idx[mine.to(idx.device)] - offset
    local = local.index_put((mine.to(points.device),), points.index_select(0, rows))
    return FPS(_comm.all_reduce(local, dist.ReduceOp.SUM, group, shared=True), idx)


class Partition(NamedTuple):
    """This rank's share of a spatial partition (:func:`partition`): ``points`` (n_r, 3), and
    how to move other per-point tensors the same way (:meth:`apply`) and results back to the
    ranks and order the points came from (:meth:`restore`). Both are differentiable."""

    points: torch.Tensor
    order: torch.Tensor  # (n_in,) the incoming rows, sorted by the rank they go to
    sent: list  # rows sent to each rank
    received: list  # rows received from each rank (points holds them in rank order)
    group: object

    @torch.compiler.disable
    def apply(self, values: torch.Tensor) -> torch.Tensor:
        """Per-point ``values`` (n_in, ...) of the points as they came in, moved to their shares."""
        return _comm.exchange(list(values.index_select(0, self.order).split(self.sent)), self.group)

    @torch.compiler.disable
    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """Per-point ``values`` (n_r, ...) of this share, sent back: (n_in, ...) in the incoming order."""
        back = _comm.exchange(list(values.split(self.received)), self.group)  # row i: incoming row order[i]
        return back.index_select(0, torch.argsort(self.order))


@torch.compiler.disable
def partition(points: torch.Tensor, *, group=None, bits: int = 10) -> Partition:
    """A balanced spatial partition of the points every rank holds: each point goes to the rank
    whose range of Morton codes (``bits`` per axis over the whole cloud's box) holds its code, the
    ranges cut at the codes' quantiles (a sample sort), so every rank gets about the same number
    of points and a compact region of space. Collective: every rank calls it."""
    _comm.agree(lambda: _layout.single(points), group, {"points' dtype": _dtype(points)})
    me, world = _comm.rank_and_size(group)
    p = points.detach()
    low = _comm.all_reduce(p.amin(0) if p.shape[0] else p.new_full((3,), float("inf")), dist.ReduceOp.MIN, group)
    high = _comm.all_reduce(p.amax(0) if p.shape[0] else p.new_full((3,), float("-inf")), dist.ReduceOp.MAX, group)
    top = (1 << bits) - 1
    cells = ((p - low) / (high - low).clamp_min(torch.finfo(p.dtype).tiny) * top).clamp(0, top).to(torch.int64)
    code = _morton.codes(cells, bits) if p.shape[0] else torch.zeros(0, dtype=torch.int64, device=p.device)
    samples = 64
    picks = torch.sort(code).values[torch.arange(samples, device=p.device) * (p.shape[0] - 1) // (samples - 1)] if p.shape[0] else \
        torch.full((samples,), -1, dtype=torch.int64, device=p.device)
    weight = torch.full((samples,), float(p.shape[0]) / samples, dtype=torch.float64)
    allp = torch.cat(_comm.all_gather(picks, group))
    allw = torch.cat(_comm.all_gather(weight, group))
    keep = allp >= 0
    allp, allw = allp[keep], allw[keep]
    order = torch.argsort(allp)
    allp, cum = allp[order], torch.cumsum(allw[order], 0)
    total = float(cum[-1]) if cum.numel() else 0.0
    cuts = [allp[min(int(torch.searchsorted(cum, total * r / world)), allp.numel() - 1)] for r in range(1, world)] if total else []
    splitters = torch.stack(cuts) if cuts else torch.zeros(0, dtype=torch.int64)
    destination = torch.searchsorted(splitters.to(p.device), code, right=True)
    order = torch.argsort(destination, stable=True)
    sent = [int(n) for n in torch.bincount(destination, minlength=world)]
    moved = _comm.exchange(list(points.index_select(0, order).split(sent)), group)
    received = [int(n) for n in torch.stack(_comm.all_gather(torch.tensor(sent, dtype=torch.int64), group))[:, me]]
    return Partition(moved, order, sent, received, group)


class KNNAggregation(nn.KNNAggregation):
    """:class:`pcops.KNNAggregation` over the whole cloud of a process group (:func:`knn_aggregate`):
    the same arguments, and ``group`` (None: the default group). ``forward(query, ref, features)``
    takes this rank's shares. A learnable sigma's gradient is this rank's part (DDP sums the ranks')."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def forward(self, query: torch.Tensor, ref: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        sigma = self.sigma if self.weights == "softmax" else None
        return knn_aggregate(query, ref, features, self.k, sigma, weights=self.weights, reduce=self.reduce, validate=self.validate,
                             group=self.group)


class RadiusAggregation(nn.RadiusAggregation):
    """:class:`pcops.RadiusAggregation` over the whole cloud of a process group
    (:func:`radius_aggregate`): the same arguments, and ``group``."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def forward(self, query: torch.Tensor, ref: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        sigma = self.sigma if self.weights == "softmax" else None
        return radius_aggregate(query, ref, features, self.radius, sigma, weights=self.weights, reduce=self.reduce,
                                validate=self.validate, group=self.group)
