"""k-nearest-neighbour search and aggregation.

``knn`` finds the k nearest reference points of each query point through one of several
search backends (each a ``pcops::knn_<name>`` custom op), then recomputes the distances in
torch from the found indices so that they are differentiable. ``knn_aggregate`` weights the
features of those k neighbours by softmax(-d / sigma).

Backends (see docs/ops/knn.md):

========  ===========  ===============================================================
name      devices      implementation
========  ===========  ===============================================================
cuml      cuda         RAPIDS cuML ``NearestNeighbors`` (brute force), DLPack zero-copy
warp      cpu, cuda    Warp ``HashGrid`` search with a growing radius
scipy     cpu          ``scipy.spatial.cKDTree`` on all cores
torch     cpu, cuda    chunked brute force in torch (the reference)
========  ===========  ===============================================================

``backend="auto"`` takes the first available of ``AUTO[device]``.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch

from ... import _validate
from . import _cuml, _scipy, _torch, _warp  # noqa: F401  (registers the backends)
from ._registry import BACKENDS

# Preference per device. CPU: the Warp search was faster than scipy's cKDTree on the
# tutorial-size benchmark (docs/ops/knn.md); CUDA: cuML, else Warp.
AUTO = {"cpu": ("warp", "scipy", "torch"), "cuda": ("cuml", "warp", "torch")}


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


def _check(query, ref, k) -> None:
    _validate.points("query", query)
    _validate.points("ref", ref)
    _validate.same_device(query=query, ref=ref)
    if isinstance(k, bool) or not isinstance(k, (int, torch.SymInt)):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > ref.shape[0]:
        raise ValueError(f"k must be <= the number of ref points, got k={k} for {ref.shape[0]} ref points")


def _search(query, ref, k, backend, validate, dtype):
    """Indices of the k nearest (no gradient), from the chosen backend's custom op."""
    name = resolve_backend(backend, query.device)
    return BACKENDS[name].op(query.detach().to(dtype), ref.detach().to(dtype), k, validate)


def _distances(query: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """||q_i - p_ij|| for neighbours (M, k, 3), differentiable, with a zero (not NaN) gradient at d = 0."""
    sq = (query[:, None, :] - neighbours).square().sum(-1)
    positive = sq > 0
    return torch.where(positive, torch.where(positive, sq, 1).sqrt(), 0)


def knn(query: torch.Tensor, ref: torch.Tensor, k: int, backend: str = "auto", *, validate: bool = True) -> KNN:
    """The k nearest reference points of each query point.

    Args:
        query: Tensor of shape (M, 3).
        ref: Tensor of shape (N, 3), N >= k.
        k: number of neighbours, 1 <= k <= N.
        backend: "auto", "cuml", "warp", "scipy" or "torch" (see the module docs).
        validate: check the points for NaN/inf (one device sync on CUDA).

    Returns:
        KNN(dists, idx): ``idx`` (M, k) int64 indices into ``ref``, sorted by distance
        ascending, ties by the smaller index; ``dists`` (M, k) Euclidean distances (not
        squared) in the promoted dtype of the points, differentiable with respect to
        ``query`` and ``ref``. float16/bfloat16 points are searched in float32.
    """
    _check(query, ref, k)
    dtype, out_dtype = _validate.compute_dtype(query, ref)
    _, idx = _search(query, ref, k, backend, validate, dtype)
    dists = _distances(query.to(dtype), ref.to(dtype)[idx])
    return KNN(dists.to(out_dtype), idx)


def knn_aggregate(
    query: torch.Tensor,
    ref: torch.Tensor,
    features: torch.Tensor,
    k: int,
    sigma,
    backend: str = "auto",
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Softmax(-d / sigma)-weighted sum of the features of the k nearest reference points.

    ``out_i = sum_{j in kNN(i)} w_ij f_j`` with ``w_ij = exp(-d_ij / sigma) / sum_l exp(-d_il / sigma)``
    over the k neighbours (computed stably for any sigma > 0; no radius cut).

    Args:
        query: Tensor of shape (M, 3).
        ref: Tensor of shape (N, 3), N >= k.
        features: Tensor of shape (N, F).
        k: number of neighbours, 1 <= k <= N.
        sigma: number > 0 or one-element tensor (e.g. a learnable parameter).
        backend: search backend, as for :func:`knn`.
        validate: check points for NaN/inf and a tensor sigma for > 0.

    Returns:
        Tensor of shape (M, F) in the promoted dtype of the inputs. Differentiable with
        respect to ``features``, ``query``, ``ref`` and ``sigma``: the search returns indices
        only, the distances are recomputed in torch from the gathered points.
    """
    _check(query, ref, k)
    _validate.tensor("features", features, ndim=2, shape_doc="(N, F)")
    _validate.rows_match("features", features, "ref", ref)
    _validate.scale("sigma", sigma)
    _validate.same_device(query=query, ref=ref, features=features, sigma=sigma)
    dtype, out_dtype = _validate.compute_dtype(query, ref, features)
    if isinstance(sigma, torch.Tensor):
        sigma = sigma.to(dtype).reshape(())
        if validate and not torch.compiler.is_compiling():  # a value check; skipped inside compiled graphs
            _validate.positive_values("sigma", sigma)
    _, idx = _search(query, ref, k, backend, validate, dtype)
    dists = _distances(query.to(dtype), ref.to(dtype)[idx])
    weights = torch.softmax(-dists / sigma, dim=1)  # softmax subtracts the row max: stable for small sigma
    out = (weights[..., None] * features.to(dtype)[idx]).sum(1)
    return out.to(out_dtype)


__all__ = ["KNN", "knn", "knn_aggregate", "resolve_backend", "AUTO", "BACKENDS"]
