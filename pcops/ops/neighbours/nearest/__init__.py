"""k-nearest-neighbour search and aggregation.

``knn`` finds the k nearest reference points of each query point through one of several
search backends (each a ``pcops::knn_<name>`` custom op), then recomputes the distances in
torch from the found indices so that they are differentiable (without a gradient asked for,
the Warp and torch backends' own distances are returned as they are; in D != 3 the torch
backend's own values always, float64 direct differences rounded once, with the recomputed
formula's derivatives). ``knn_aggregate`` weights the
features of those k neighbours by softmax(-d / sigma).

Backends (see docs/ops/knn.md):

========  ===========  ===============================================================
name      devices      implementation
========  ===========  ===============================================================
cuml      cuda         RAPIDS cuML ``NearestNeighbors`` (brute force), DLPack zero-copy
warp      cpu, cuda    Warp search of a balanced kd-tree (nearest child first, short stack)
scipy     cpu          ``scipy.spatial.cKDTree`` on all cores
torch     cpu, cuda    chunked brute force in torch (the reference); any dimension D
========  ===========  ===============================================================

Only ``torch`` searches points of dimension D != 3 (feature vectors, e.g. DGCNN's dynamic
graphs); the others are 3-D only and raise a ValueError for D != 3.

``backend="auto"`` takes the first available of ``AUTO[device]``.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional

import torch

from .... import _layout, _threads, _validate, _vml
from .. import _weighting
from . import _costs, _cuml, _kdtree, _mean, _scipy, _torch  # noqa: F401  (registers the backends; _kdtree.find: plain calls)
from ._registry import BACKENDS

split_order = _kdtree.split_order  # (the mesh hierarchy's CPU build orders its faces with the kd-tree's splits)
cpu_query_rows = _kdtree.cpu_query_rows  # (the mesh searches take one mesh's CPU queries in the kNN search's order)
prepared_split, kept_state = _kdtree.prepared_split, _kdtree.kept_state  # (the mesh ops' kept builds: pcops.ops.mesh._kept_tree)
nearest_costs = _costs.costs  # (chamfer's costs of plain clouds with nothing to differentiate)

# Preference per device. CPU: the Warp tree search does less work than the scipy backend
# (cKDTree + exact ties) on uniform, clustered and surface clouds and as much on the
# tutorial's Gaussian cloud, with no bad case (docs/ops/knn.md); CUDA: cuML, else Warp.
AUTO = {"cpu": ("warp", "scipy", "torch"), "cuda": ("cuml", "warp", "torch")}
# Backends that search points of any dimension D (knn on feature vectors); the others are 3-D only.
ANY_DIM = ("torch",)
# Backends whose own distances are direct differences of the given coordinates (cKDTree and cuML
# see shifted or centred copies; in D != 3, the torch backend's are float64 differences rounded
# once): knn returns them as they are when no gradient is asked for.
OWN_DISTANCES = ("warp", "torch")


class KNN(NamedTuple):
    """Result of :func:`knn`: ``dists`` (M, k) Euclidean distances, ``idx`` (M, k) int64."""

    dists: torch.Tensor
    idx: torch.Tensor


@functools.cache
def _warn_fallback(device: str, chosen: str, preferred: str) -> None:
    install = BACKENDS[preferred].install
    warnings.warn(f"pcops.knn: the '{preferred}' backend is not installed ({install}); using '{chosen}' on {device}")


@torch.compiler.assume_constant_result  # runs once at trace time: the choice is a constant of the graph
def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that ``backend`` means for tensors on ``device``; errors say how to install."""
    kind = device.type if device.type in AUTO else "cuda" if device.type != "cpu" else "cpu"
    if backend == "auto":
        names = AUTO[kind]
        for name in names:
            if BACKENDS[name].available():
                if name != names[0]:
                    _warn_fallback(kind, name, names[0])
                return name
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    chosen = BACKENDS[backend]
    if kind not in chosen.devices:
        raise ValueError(f"backend={backend!r} runs on {'/'.join(chosen.devices)} tensors, got tensors on {device}")
    if not chosen.available():
        raise ImportError(f"backend={backend!r} needs {', '.join(chosen.requires)}: {chosen.install}")
    return backend


def _flatten(query, ref, features, k, batch: dict, validate: bool, dim: Optional[int] = 3, **checks) -> tuple[_layout.Flat, int]:
    """The layout of a two-cloud kNN op through the layout layer (pcops._layout.pair), and k as an int."""
    flat = _layout.pair(query, ref, features, validate=validate, dim=dim, **batch, **checks)
    return flat, _validate.count("k", k, ref.shape[-2], "ref points")


def _found(flat: _layout.Flat, k: int, backend: str, dtype: torch.dtype):
    """(the backend's distances (P, k), inf where none; indices (P, k) into the flat ref, -1
    where none): the search itself, no gradient. The op checks values only where the layout
    layer could not (``flat.validate``)."""
    chosen = BACKENDS[resolve_backend(backend, flat.query.device)]
    query = _validate.detached(flat.query, dtype)
    ref = query if flat.ref is flat.query else _validate.detached(flat.ref, dtype)
    groups = flat.query_group, flat.ref_group
    if PLAIN[0] and not flat.validate and chosen.fn is not None and _threads.plain_device((query, ref, *groups), None) == "cpu":
        return chosen.fn(query, ref, k, *groups)  # what the op's call would run (the public function is limited already)
    return chosen.op(query, ref, k, flat.validate, *groups)


def _search(flat: _layout.Flat, k: int, backend: str, dtype: torch.dtype):
    """(the backend's distances (P, k), indices into the flat ref with -1 replaced by 0,
    validity mask (P, k))."""
    dists, idx = _found(flat, k, backend, dtype)
    return dists, idx.clamp_min(0), idx >= 0


def search(flat: _layout.Flat, k: int, backend: str, dtype: torch.dtype):
    """(indices (P, k) into the flat ref with -1 replaced by 0, validity mask (P, k)).

    The search itself (no gradient); the ops built on it gather what they need from the indices.
    """
    _, idx, valid = _search(flat, k, backend, dtype)
    return idx, valid


def _own_distances(flat: _layout.Flat, backend: str, points_grad: bool) -> bool:
    """Whether the search's own distances are the ones to return: direct differences of the given
    coordinates, and no gradient to the points asked for (no (P, k, D) gather). In D != 3 the
    torch backend's, in float64 rounded once (:func:`_feature_distances` with a gradient)."""
    return not points_grad and resolve_backend(backend, flat.query.device) in OWN_DISTANCES


def _feature_distances(found: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """Distances in D != 3 with a derivative asked for: the search's own values ``found`` (those
    a call without one returns) with the derivatives of the ``recomputed`` formula (0 where not
    valid; where it overflows or is NaN, no derivative)."""
    return found + torch.where(torch.isfinite(recomputed), recomputed - recomputed.detach(), 0)


def _neighbour_distances(flat: _layout.Flat, found: torch.Tensor, idx: torch.Tensor, backend: str, dtype, points_grad: bool,
                         valid: torch.Tensor):
    """Distances to the found neighbours: the search's own ``found`` (see ``_own_distances``),
    else recomputed in torch from the gathered points (differentiable; 0 where not ``valid``)."""
    if _own_distances(flat, backend, points_grad):
        return found
    return _recomputed_distances(flat, idx, dtype, valid)


def _recomputed_distances(flat: _layout.Flat, idx: torch.Tensor, dtype, valid: torch.Tensor) -> torch.Tensor:
    """Distances (P, k) to the flat ref's rows ``idx`` (>= 0), recomputed in torch: differentiable
    (0 where not ``valid``: see :func:`_distances`)."""
    return _distances(flat.query.to(dtype), _layout.select_rows(flat.ref.to(dtype), idx), valid)


def _distances(query: torch.Tensor, neighbours: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """||q_i - p_ij|| for new gathered neighbours (M, k, D), differentiable, with a zero (not NaN)
    gradient at d = 0; 0, and no gradient, where not ``valid`` (M, k): a missing neighbour's
    stand-in row (row 0) or a NaN query (``validate=False``, padding rows) gives its points no NaN
    gradient. With nothing to differentiate, the differences and squares are made in place in
    ``neighbours`` (the same values: one (M, k, D) tensor where three would be)."""
    if _threads.differentiable(query, neighbours):
        sq = torch.where(valid[..., None], query[:, None, :] - neighbours, 0).square().sum(-1)
    else:
        sq = neighbours.sub_(query[:, None, :]).square_().sum(-1).masked_fill_(~valid, 0)  # (an invalid row's sum, whatever it is, then 0)
    positive = sq > 0
    return torch.where(positive, _vml.root(torch.where(positive, sq, 1)), 0)


def _points_grad(query: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a derivative with respect to the points may be asked for (a gradient, or
    forward-mode AD: :func:`pcops._threads.differentiable`; static under torch.compile)."""
    return _threads.differentiable(query, ref)


def _any_dim_backend(backend: str) -> str:
    """The backend for points of dimension D != 3: "auto" means torch; 3-D-only backends are errors."""
    if backend == "auto":
        return ANY_DIM[0]
    if backend in BACKENDS and backend not in ANY_DIM:
        raise ValueError(f"backend={backend!r} searches 3-D points only; points of dimension D != 3 need backend='torch' (or 'auto')")
    return backend


# Whether plain eager calls run the search directly: ``knn``'s whole call (:func:`plain_knn`), and
# the search of every op on it without the custom op (:func:`_found`; tests switch it off to
# compare both paths)
PLAIN = [True]


def plain_knn(query, ref, k, backend: str, validate: bool, detach: bool = False, plain: bool = False):
    """(dists, idx) of a plain eager CPU :func:`knn` call, from the Warp search's function called
    directly (no layout layer, no custom op: most of a small call's time); None for any other call.

    Plain: plain clouds (:func:`pcops._layout.plain_clouds`: one (M, 3) and one (N, 3) CPU tensor
    of one dtype, float32 or float64, nothing to differentiate, finite values where ``validate``
    asks: checked by the calling thread's kept search where it is one (a small scan or tree,
    :func:`._kdtree.search_checked`), else by a sum each), ``k`` an int in 1..N, ``backend`` "auto"
    or "warp" meaning Warp. Every check of the
    general path passes on such a call, and it would call the same function on the same tensors
    and return its distances (no gradient asked for) and indices as they are; anything else (a
    sum that is not finite included) takes that path, which decides and names what fails.
    ``detach``: the points may require grad (the caller differentiates what it computes from the
    indices, as the general path's search does: ``chamfer_distance``). ``plain``: the caller found
    :func:`plain_warp` true of these arguments already (``knn_graph``).
    """
    if detach:
        if type(query) is not torch.Tensor or type(ref) is not torch.Tensor:
            return None
        same, query = ref is query, query.detach()
        ref = query if same else ref.detach()
    if not plain and not plain_warp(query, ref, k, backend, False):
        return None
    if validate:  # the values: in the search where it is a kept small one, else the layout's sums first
        found = _kdtree.search_checked(query, ref, k)
        if found is not None:
            return found or None  # (False: a value not finite; the general path names it)
        if not _layout.plain_clouds(True, query, ref):
            return None
    return plain_find(query, ref, k)


def plain_nearest(x, y, both: bool, backend: str, validate: bool):
    """(ix (M,), iy (N,) or None) of a plain chamfer call whose points may require grad: each
    point's nearest point of the other cloud (int64, -1 where none) as :func:`plain_knn` with
    ``k = 1`` and ``detach=True`` finds it, from chamfer's pass over every pair or grids
    (:func:`._costs.pairs`, the points detached) where :func:`._costs.by_pairs` says so, else
    (``both``) from the two searches as the calling
    thread's small trees side by side (:func:`._kdtree.find_both`); None for any other call, or
    where ``validate`` asks and a value is NaN or inf (the general path names it)."""
    if type(x) is not torch.Tensor or type(y) is not torch.Tensor:
        return None
    same, x = y is x, x.detach()
    y = x if same else y.detach()
    if not plain_warp(x, y, 1, backend, False) or not x.shape[0] * y.shape[0]:
        return None
    x, y = x.contiguous(), y.contiguous()
    if not _costs.by_pairs(x.shape[0], y.shape[0], both):
        found = _kdtree.find_both(x, y, 1) if both else None
        return None if found is None or (validate and found[2]) else (found[0][:, 0], found[1][:, 0])
    found = _costs.pairs(x, y, both, validate)
    return None if found is None else found[:2]


def plain_find(query, ref, k):
    """(dists, idx) of a search that :func:`plain_warp` accepted (the caller checked the values):
    the Warp search's function itself, as :func:`plain_knn` calls it."""
    return _kdtree.find(query, ref, k)


def plain_warp(query, ref, k, backend: str, validate: bool, dims: int = 2) -> bool:
    """Whether a search of ``k`` neighbours of ``query`` in ``ref`` is plain and Warp's: plain
    clouds (:func:`pcops._layout.plain_clouds`, their sums finite where ``validate`` asks; of
    ``dims`` dimensions), ``k`` an int in 1..N and ``backend`` "auto" or "warp" meaning Warp
    (:func:`plain_knn`, and chamfer's costs of plain clouds)."""
    if backend not in ("auto", "warp") or type(k) is not int or not _layout.plain_clouds(validate, query, ref, dims=dims):
        return False
    return 1 <= k <= ref.shape[-2] and _cpu_warp(backend)


def _cpu_warp(backend: str) -> bool:
    """Whether ``backend`` ("auto" or "warp") means Warp for CPU tensors, as :func:`resolve_backend`
    decides it, without its device object, warning or errors: Warp available and, for "auto",
    first of ``AUTO["cpu"]``. False sends a plain call to the general path, which resolves the
    backend there (and warns or raises)."""
    return BACKENDS["warp"].available() and (backend == "warp" or AUTO["cpu"][0] == "warp")


def complete_rows(idx: torch.Tensor) -> bool:
    """Whether every row of a plain search's indices (M, k) found its k neighbours: its last
    column (the farthest found; -1 where a row was cut short) holds no -1. One read of a CPU value
    (plain calls only)."""
    return not idx.numel() or int(idx[:, -1].min()) >= 0


def _plain_weighted(query, ref, features, k, backend: str, validate: bool, weights: str, sigma):
    """:func:`knn_aggregate` (``reduce="mean"``) of a plain call, or None for any other call: a
    plain kNN search (:func:`plain_knn`: the points plain, nothing to differentiate in them)
    (N, F) CPU features of the points' dtype (which may require grad), finite where ``validate``
    asks, and a softmax ``sigma`` a finite Python number > 0 (in the dtype too), every row of
    its search complete (read back: k <= N, and neither a NaN or infinite query, nor fewer
    than k finite reference points (``validate=False``), nor squared distances that overflow
    cut a row short), so the
    weights are the general path's without its masks (inverse distance:
    :func:`_weighting.inverse_distance` with no mask; softmax: the rows' first distance is their
    smallest): the same operations on the same values, the same result and gradient to the
    features."""
    if torch.compiler.is_compiling() or type(features) is not torch.Tensor or type(ref) is not torch.Tensor:
        return None
    if features.dim() != 2 or features.shape[0] != ref.shape[0] or not features.is_cpu or features.dtype is not ref.dtype or features.is_neg() or features.is_conj():
        return None
    if weights == "softmax" and (type(sigma) not in (int, float) or not _validate.is_positive_in(sigma, ref.dtype)):
        return None
    found = plain_knn(query, ref, k, backend, validate)
    if found is None or (validate and not _validate.sum_is_finite(features)):
        return None
    dists, idx = found
    if weights != "softmax" and k <= _mean.MAX_K and not _threads.differentiable(features):
        return _mean.mean(dists, idx, features, weights == "inverse_distance")  # (None: a row cut short)
    if not complete_rows(idx):  # (a row cut short: the general path's masks)
        return None
    if weights == "inverse_distance":
        w = _weighting.inverse_distance(dists.square(), None)
    elif weights == "softmax":
        w = torch.softmax(-(dists - dists[:, :1]) / torch.full((), float(sigma), dtype=dists.dtype), dim=1)
    else:
        w = _uniform_weight(dists.dtype, k)
    return _weighted_sum(w[..., None] if w.dim() else w, _layout.select_rows(features, idx), features)


@_threads.limits
def knn(
    query: torch.Tensor,
    ref: torch.Tensor,
    k: int,
    backend: str = "auto",
    *,
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> KNN:
    """The k nearest reference points of each query point.

    Args:
        query: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed. Points of
            any dimension D (M, D) are searched by the torch backend (feature-space kNN).
        ref: Tensor of shape (N, 3) with N >= k; (B, N, 3) padded; or (N_total, 3) packed;
            (..., D) with the query's D.
        k: number of neighbours, 1 <= k <= N.
        backend: "auto", "cuml", "warp", "scipy" or "torch" (see the module docs). For
            D != 3 only "torch" (which "auto" then means); the others search 3-D points only.
        query_lengths, ref_lengths: optional int tensors (B,) for padded inputs; rows past
            a sample's length are padding (never neighbours; their own rows are -1 / inf).
        query_batch, ref_batch: int sample ids (M_total,) / (N_total,) of packed inputs.
        validate: check the points for NaN/inf and lengths/ids for range (one device sync
            on CUDA).

    Returns:
        KNN(dists, idx) of shapes (M, k), (B, M, k) or (M_total, k): ``idx`` int64 indices
        into ``ref`` (per sample for padded inputs, into the packed ref for packed inputs),
        sorted by distance ascending, ties by the smaller index; ``dists`` Euclidean
        distances (not squared) in the promoted dtype of the points, differentiable with
        respect to ``query`` and ``ref`` (recomputed in torch from the found points when a
        gradient is asked for; the search's own distances otherwise; in D != 3 the search's own
        values, float64 direct differences rounded once, with and without a gradient, which
        then is the recomputed formula's). A query whose sample has fewer than k reference
        points gets idx -1 and dist inf in the missing columns; so does one whose squared
        distance to a reference point overflows the dtype (finite float32 points more than
        about 1.8e19 apart, the square root of its largest number; float64 1.3e154): that
        point is never its neighbour (the "scipy" backend, and in D != 3 the "torch" one, measure
        in float64, so they find such float32 points).
        float16/bfloat16 points are searched in float32.

    Example:
        >>> import torch, pcops
        >>> points = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
        >>> out = pcops.knn(points, points, k=2)  # each point's 2 nearest, itself first
        >>> out.idx
        tensor([[0, 1],
                [1, 0],
                [2, 0],
                [3, 0]])
        >>> out.dists  # distances
        tensor([[0., 1.],
                [0., 1.],
                [0., 2.],
                [0., 3.]])
    """
    if PLAIN[0] and query_lengths is None and ref_lengths is None and query_batch is None and ref_batch is None:
        found = plain_knn(query, ref, k, backend, validate)
        if found is not None:
            return KNN(*found)
    batch = dict(query_lengths=query_lengths, ref_lengths=ref_lengths, query_batch=query_batch, ref_batch=ref_batch)
    features_space = isinstance(query, torch.Tensor) and query.dim() > 0 and query.shape[-1] != 3
    if features_space:  # D != 3: a shape check, free under torch.compile
        backend = _any_dim_backend(backend)
    flat, k = _flatten(query, ref, None, k, batch, validate, dim=None if features_space else 3)
    dtype, out_dtype = _validate.compute_dtype(query, ref)
    found, idx = _found(flat, k, backend, dtype)
    if _own_distances(flat, backend, _points_grad(query, ref)):
        dists = found  # inf where none already
    else:
        valid = idx >= 0
        dists = _recomputed_distances(flat, idx.clamp_min(0), dtype, valid)
        if features_space:  # (the same values as without a derivative)
            dists = _feature_distances(found, dists)
        dists = torch.where(valid, dists, float("inf"))
    idx = _layout.local_index(flat, idx)
    return KNN(_layout.unflatten(flat, dists.to(out_dtype)), _layout.unflatten(flat, idx))


@_threads.limits
def knn_aggregate(
    query: torch.Tensor,
    ref: torch.Tensor,
    features: torch.Tensor,
    k: int,
    sigma=None,
    backend: str = "auto",
    *,
    weights: Optional[str] = None,
    reduce: str = "mean",
    query_lengths: Optional[torch.Tensor] = None,
    ref_lengths: Optional[torch.Tensor] = None,
    query_batch: Optional[torch.Tensor] = None,
    ref_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Weighted mean, or feature-wise max, of the features of the k nearest reference points.

    ``out_i = sum_{j in kNN(i)} w_ij f_j`` (``reduce="mean"``) with, by ``weights``:

    * ``"softmax"`` (the default): ``w_ij = exp(-d_ij / sigma) / sum_l exp(-d_il / sigma)``,
      computed stably for any sigma > 0
    * ``"inverse_distance"``: ``w_ij = (1 / max(d_ij^2, 1e-16)) / sum_l (1 / max(d_il^2, 1e-16))``
      (PyTorch Geometric's ``knn_interpolate``; see :func:`knn_interpolate`)
    * ``"uniform"``: ``w_ij = 1 / k``, the plain mean

    ``reduce="max"``: ``out_i[c] = max_{j in kNN(i)} f_j[c]`` (PointNet++ grouping; unweighted,
    ``weights`` None or "uniform"); its gradient goes to the arg-max neighbour of each feature.
    No radius cut in any case.

    Args:
        query: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed.
        ref: Tensor of shape (N, 3) with N >= k; (B, N, 3) padded; or (N_total, 3) packed.
        features: Tensor of shape (N, F); (B, N, F); or (N_total, F).
        k: number of neighbours, 1 <= k <= N.
        sigma: number > 0 or one-element tensor (e.g. a learnable parameter) for
            ``weights="softmax"``; None for the other weightings and for ``reduce="max"``.
        backend: search backend, as for :func:`knn`.
        weights: "softmax", "inverse_distance", "uniform", or None (softmax for
            ``reduce="mean"``, uniform for ``reduce="max"``).
        reduce: "mean" (weighted sum) or "max".
        query_lengths, ref_lengths, query_batch, ref_batch: batch layouts, as for :func:`knn`.
            Missing neighbours (a sample with fewer than k points) are left out of the
            weights and the max; a query with none gets zeros.
        validate: check points for NaN/inf, lengths/ids for range, a tensor sigma for > 0.

    Returns:
        Tensor of shape (M, F), (B, M, F) or (M_total, F) in the promoted dtype of the
        inputs. Differentiable with respect to ``features``, and for ``reduce="mean"`` with
        respect to ``query``, ``ref`` and (softmax) ``sigma``: the search returns indices
        only, the distances are recomputed in torch from the gathered points.

    Example:
        >>> import torch, pcops
        >>> ref = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
        >>> features = torch.tensor([[1.0], [3.0], [100.0]])
        >>> pcops.knn_aggregate(torch.tensor([[0.4, 0.0, 0.0]]), ref, features, k=2, weights="uniform")  # the mean of the 2 nearest
        tensor([[2.]])
    """
    weights = _validate.weighting(weights, reduce, sigma)
    if PLAIN[0] and reduce == "mean" and query_lengths is None and ref_lengths is None and query_batch is None and ref_batch is None:
        out = _plain_weighted(query, ref, features, k, backend, validate, weights, sigma)
        if out is not None:
            return out
    batch = dict(query_lengths=query_lengths, ref_lengths=ref_lengths, query_batch=query_batch, ref_batch=ref_batch)
    if weights == "softmax":
        _validate.scale("sigma", sigma)
        _validate.same_device(query=query, sigma=sigma)
    positive = dict(sigma=sigma) if weights == "softmax" and isinstance(sigma, torch.Tensor) else None
    flat, k = _flatten(query, ref, features, k, batch, validate, positive=positive)
    dtype, out_dtype = _validate.compute_dtype(query, ref, features)
    if weights == "softmax":
        sigma = _validate.scale_tensor(sigma, dtype, query.device)
    found, idx, valid = _search(flat, k, backend, dtype)
    gathered = _layout.select_rows(flat.features.to(dtype), idx)  # (P, k, F)
    if reduce == "max":
        out = torch.where(valid[..., None], gathered, float("-inf")).max(1).values  # gradient to the arg-max
        out = torch.where(valid.any(1, keepdim=True), out, 0)  # a query with no neighbour: zeros
        return _layout.unflatten(flat, out.to(out_dtype))
    if weights != "uniform":
        dists = torch.where(valid, _neighbour_distances(flat, found, idx, backend, dtype, _points_grad(query, ref), valid), 0)
    if weights == "softmax":
        nearest = torch.where(valid, dists, float("inf")).amin(1, keepdim=True).detach()  # shift: any sigma > 0 stays finite
        logits = torch.where(valid, -(dists - torch.where(valid, nearest, 0)) / sigma, float("-inf"))
        logits = torch.where(valid.any(1, keepdim=True), logits, 0)  # a query with no neighbour: no NaN
        w = torch.where(valid, torch.softmax(logits, dim=1), 0)  # softmax subtracts the row max: stable
    elif weights == "inverse_distance":
        w = _weighting.inverse_distance(dists.square(), valid)
    else:
        w = valid.to(dtype) / valid.sum(1, keepdim=True).clamp_min(1)
    out = _weighted_sum(w[..., None], gathered, flat.features, w)
    return _layout.unflatten(flat, out.to(out_dtype))


@functools.lru_cache(maxsize=64)
def _uniform_weight(dtype: torch.dtype, k: int) -> torch.Tensor:
    """1 / k as a 0-d tensor of ``dtype`` (the general path's uniform weight, ``valid / k``, to the
    bit: a division in the dtype), kept per dtype and k (two torch calls fewer in a plain call);
    never written."""
    with torch.inference_mode(False), torch.no_grad():  # (an ordinary tensor, whatever mode a first call runs in)
        return torch.ones((), dtype=dtype) / k


def _weighted_sum(w: torch.Tensor, rows: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``(w * rows).sum(1)`` of new gathered ``rows`` (P, k, F) and weights ``w`` (P, k, 1) or
    (): the products made in place where nothing of ``inputs`` (what ``w`` and ``rows`` were
    computed from) is to be differentiated (the same products, and one (P, k, F) tensor where
    two would be: a second large temporary made each call can cost more than the products)."""
    if _threads.differentiable(*inputs):
        return (w * rows).sum(1)
    return rows.mul_(w).sum(1)


__all__ = ["KNN", "knn", "knn_aggregate", "resolve_backend", "AUTO", "BACKENDS"]
