"""Thin ``nn.Module`` layers over pcops' functional ops."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import _deprecated, _validate
from .ops.neighbours.nearest._registry import BACKENDS
from .ops import knn_aggregate, radius_aggregate
from .ops.transport import earth_movers_distance, sinkhorn_divergence


class _Sigma(nn.Module):
    """Holds sigma as a constant, or as a learnable parameter kept > 0 by a log parametrisation;
    None (no sigma: weightings other than softmax, ``weights`` the layer's resolved weighting)."""

    def __init__(self, sigma: float | None, learnable: bool, weights: str):
        super().__init__()
        if sigma is None and weights == "softmax":
            raise ValueError("sigma is required for weights='softmax'")
        if sigma is not None:
            _validate.positive_number("sigma", sigma)
        _validate.flag(learnable_sigma=learnable)
        self.learnable_sigma = learnable
        if self.learnable_sigma and weights != "softmax":
            raise ValueError(f"learnable_sigma needs weights='softmax', got weights={weights!r}")
        if self.learnable_sigma:
            self.log_sigma = nn.Parameter(torch.tensor(math.log(sigma)))
        else:
            self._sigma = None if sigma is None else float(sigma)

    @property
    def sigma(self):
        """The current sigma: a tensor when learnable, else a float."""
        return self.log_sigma.exp() if self.learnable_sigma else self._sigma

    def _sigma_value(self) -> float:
        """The current sigma as a number (read without recording a gradient: the layer's repr)."""
        return float(self.log_sigma.detach().exp()) if self.learnable_sigma else self._sigma


class RadiusAggregation(_Sigma):
    """Aggregates reference features onto query points over all neighbours within ``radius``.

    ``out_i = sum_j exp(-d_ij/sigma) f_j / sum_j exp(-d_ij/sigma)`` over ``d_ij <= radius`` by
    default; ``weights="inverse_distance"`` / ``"uniform"`` and ``reduce="max"`` as in
    :func:`pcops.radius_aggregate`.

    Args:
        radius: neighbourhood radius (> 0).
        sigma: length scale of the softmax weights (> 0); unused by the other weightings (None allowed there).
        learnable_sigma: make sigma a parameter (stored as ``log_sigma``); softmax only.
        validate: check point values for NaN/inf on every call.
        weights: "softmax", "inverse_distance", "uniform", or None (softmax for
            ``reduce="mean"``, uniform for ``reduce="max"``).
        reduce: "mean" or "max" (the feature-wise max over the neighbours).

    Shapes: ``forward(query (M, 3), ref (N, 3), features (N, F)) -> (M, F)``, or batched as in
    docs/batching.md (padded with ``*_lengths``, packed with ``*_batch`` keyword arguments).

    Example:
        >>> import torch, pcops
        >>> layer = pcops.RadiusAggregation(radius=0.2, sigma=0.1, learnable_sigma=True)
        >>> query, ref, features = torch.rand(100, 3), torch.rand(500, 3), torch.randn(500, 16)
        >>> layer(query, ref, features).shape
        torch.Size([100, 16])
    """

    def __init__(
        self,
        radius: float,
        sigma: float = 0.1,
        learnable_sigma: bool = False,
        validate: bool = True,
        *,
        weights: str | None = None,
        reduce: str = "mean",
    ):
        resolved = _validate.weighting_name(weights, reduce)
        super().__init__(sigma, learnable_sigma, resolved)
        _validate.positive_number("radius", radius)
        self.weights = resolved
        self.reduce = reduce
        self.radius = float(radius)
        _validate.flag(validate=validate)
        self.validate = validate

    def forward(self, query: torch.Tensor, ref: torch.Tensor, features: torch.Tensor, **batch) -> torch.Tensor:
        """``batch``: ``query_lengths``/``ref_lengths`` (padded) or ``query_batch``/``ref_batch`` (packed)."""
        sigma = self.sigma if self.weights == "softmax" else None
        return radius_aggregate(
            query, ref, features, self.radius, sigma, weights=self.weights, reduce=self.reduce, validate=self.validate, **batch
        )

    def extra_repr(self) -> str:
        if self.weights != "softmax":
            return f"radius={self.radius}, weights={self.weights!r}, reduce={self.reduce!r}"
        return f"radius={self.radius}, sigma={self._sigma_value():.4g}, learnable_sigma={self.learnable_sigma}"


class KNNAggregation(_Sigma):
    """Aggregates reference features onto query points over their k nearest neighbours.

    ``out_i = sum_j softmax_j(-d_ij/sigma) f_j`` over the k nearest reference points by
    default; ``weights="inverse_distance"`` / ``"uniform"`` and ``reduce="max"`` as in
    :func:`pcops.knn_aggregate`.

    Args:
        k: number of neighbours (>= 1, <= number of reference points at call time).
        sigma: length scale of the softmax weights (> 0); unused by the other weightings (None allowed there).
        learnable_sigma: make sigma a parameter (stored as ``log_sigma``); softmax only.
        backend: kNN search backend: "auto", "cuml", "warp", "scipy" or "torch".
        validate: check point values for NaN/inf on every call.
        weights: "softmax", "inverse_distance", "uniform", or None (softmax for
            ``reduce="mean"``, uniform for ``reduce="max"``).
        reduce: "mean" or "max" (the feature-wise max over the neighbours).

    Shapes: ``forward(query (M, 3), ref (N, 3), features (N, F)) -> (M, F)``, or batched as in
    docs/batching.md (padded with ``*_lengths``, packed with ``*_batch`` keyword arguments).

    Example:
        >>> import torch, pcops
        >>> layer = pcops.KNNAggregation(k=8, sigma=0.1)
        >>> query, ref, features = torch.rand(100, 3), torch.rand(500, 3), torch.randn(500, 16)
        >>> layer(query, ref, features).shape
        torch.Size([100, 16])
        >>> lengths = torch.tensor([80, 100])  # a padded batch of two clouds
        >>> layer(torch.rand(2, 100, 3), torch.rand(2, 500, 3), torch.randn(2, 500, 16), query_lengths=lengths).shape
        torch.Size([2, 100, 16])
    """

    def __init__(
        self,
        k: int,
        sigma: float = 0.1,
        learnable_sigma: bool = False,
        backend: str = "auto",
        validate: bool = True,
        *,
        weights: str | None = None,
        reduce: str = "mean",
    ):
        resolved = _validate.weighting_name(weights, reduce)
        super().__init__(sigma, learnable_sigma, resolved)
        self.k = _validate.count("k", k)
        self.weights = resolved
        self.reduce = reduce
        _validate.one_of("backend", backend, ("auto", *BACKENDS))
        self.backend = backend
        _validate.flag(validate=validate)
        self.validate = validate

    def forward(self, query: torch.Tensor, ref: torch.Tensor, features: torch.Tensor, **batch) -> torch.Tensor:
        """``batch``: ``query_lengths``/``ref_lengths`` (padded) or ``query_batch``/``ref_batch`` (packed)."""
        sigma = self.sigma if self.weights == "softmax" else None
        return knn_aggregate(
            query, ref, features, self.k, sigma, self.backend, weights=self.weights, reduce=self.reduce,
            validate=self.validate, **batch,
        )

    def extra_repr(self) -> str:
        if self.weights != "softmax":
            return f"k={self.k}, weights={self.weights!r}, reduce={self.reduce!r}, backend={self.backend!r}"
        return f"k={self.k}, sigma={self._sigma_value():.4g}, learnable_sigma={self.learnable_sigma}, backend={self.backend!r}"


class SparseConv3d(nn.Module):
    """Submanifold sparse 3-d convolution (stride 1, odd ``kernel_size``) over integer voxel sites.

    ``forward(features (N, Cin), grid_coord (N, 3) int, batch=None, kernel_map=None) -> (N, Cout)``:
    :func:`pcops.sparse_conv3d` with ``weight`` of shape (K^3, Cin, Cout) (offset
    ``k = (a * K + b) * K + c`` is ``((a, b, c) - K // 2) * dilation``; ``weight.view(K, K, K,
    Cin, Cout)`` is ``conv3d``'s weight permuted (2, 3, 4, 1, 0)). Pass a
    :func:`pcops.sparse_kernel_map` of the sites as ``kernel_map`` to share one search between
    layers. Initialised as ``torch.nn.Conv3d`` (uniform in +-1/sqrt(Cin * K^3)).

    Example:
        >>> import torch, pcops
        >>> grid_coord = torch.tensor([[0, 0, 0], [0, 0, 1], [5, 5, 5]])  # three occupied voxels
        >>> conv = pcops.SparseConv3d(4, 8, kernel_size=3)
        >>> conv(torch.randn(3, 4), grid_coord).shape
        torch.Size([3, 8])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, dilation: int = 1, bias: bool = True):
        super().__init__()
        from .ops.sparse.sparse_conv import _sites  # the checks of kernel_size and dilation

        self.in_channels = _validate.count("in_channels", in_channels)
        self.out_channels = _validate.count("out_channels", out_channels)
        _sites(torch.zeros(0, 3, dtype=torch.int64), None, kernel_size, dilation)
        self.kernel_size, self.dilation = int(kernel_size), int(dilation)
        _validate.flag(bias=bias)
        bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size**3)
        self.weight = nn.Parameter(torch.empty(self.kernel_size**3, self.in_channels, self.out_channels).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(self.out_channels).uniform_(-bound, bound)) if bias else None

    @_deprecated.renamed(coords="grid_coord")
    def forward(self, features: torch.Tensor, grid_coord: torch.Tensor | None, batch: torch.Tensor | None = None, kernel_map=None) -> torch.Tensor:
        from .ops.sparse.sparse_conv import sparse_conv3d

        return sparse_conv3d(features, grid_coord, self.weight, self.bias, batch=batch, dilation=self.dilation, kernel_map=kernel_map)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, dilation={self.dilation}, "
                f"bias={self.bias is not None}")


class SinkhornLoss(nn.Module):
    """The debiased Sinkhorn divergence as a loss: :func:`pcops.sinkhorn_divergence` with its
    options fixed (GeomLoss's ``SamplesLoss("sinkhorn", p=p, blur=blur, scaling=scaling)``).

    ``forward(x, y, x_weights=None, y_weights=None, **batch)``: clouds as in docs/batching.md
    (padded with ``x_lengths``/``y_lengths``, packed with ``x_batch``/``y_batch``); returns the
    loss reduced over the batch by ``batch_reduction``.

    Example:
        >>> import torch, pcops
        >>> loss = pcops.nn.SinkhornLoss(blur=0.02)
        >>> x = torch.rand(2, 300, 3, requires_grad=True)
        >>> value = loss(x, torch.rand(2, 250, 3))
        >>> value.backward()
        >>> value.shape, x.grad.shape
        (torch.Size([]), torch.Size([2, 300, 3]))
    """

    def __init__(self, p: int = 2, blur: float = 0.05, scaling: float = 0.5, *, debias: bool = True,
                 diameter: float | None = None, batch_reduction: str | None = "mean", validate: bool = True):
        super().__init__()
        from .ops.transport.sinkhorn import BATCH_REDUCTIONS, _check_options

        _check_options(p, blur, scaling, diameter)
        _validate.one_of("batch_reduction", batch_reduction, BATCH_REDUCTIONS)
        _validate.flag(debias=debias, validate=validate)
        self.p, self.blur, self.scaling, self.debias, self.diameter = int(p), float(blur), float(scaling), debias, diameter
        self.batch_reduction, self.validate = batch_reduction, validate

    def forward(self, x: torch.Tensor, y: torch.Tensor, x_weights: torch.Tensor | None = None,
                y_weights: torch.Tensor | None = None, **batch) -> torch.Tensor:
        """``batch``: ``x_lengths``/``y_lengths`` (padded), ``x_batch``/``y_batch`` and ``batch_size`` (packed)."""
        return sinkhorn_divergence(
            x, y, x_weights=x_weights, y_weights=y_weights, p=self.p, blur=self.blur, scaling=self.scaling,
            diameter=self.diameter, debias=self.debias, batch_reduction=self.batch_reduction, validate=self.validate, **batch,
        )

    def extra_repr(self) -> str:
        return f"p={self.p}, blur={self.blur}, scaling={self.scaling}, debias={self.debias}"


class EMDLoss(nn.Module):
    """The exact earth mover's distance as a loss: :func:`pcops.earth_movers_distance`'s
    ``distance`` (equal-size clouds, an optimal matching solved on the CPU, at most
    ``max_points`` points per sample; gradients at the fixed matching).

    ``forward(x, y, **batch)``: clouds as in docs/batching.md; returns the distance reduced by
    ``point_reduction`` and ``batch_reduction``.

    Example:
        >>> import torch, pcops
        >>> loss = pcops.nn.EMDLoss()
        >>> x = torch.rand(2, 256, 3, requires_grad=True)
        >>> value = loss(x, torch.rand(2, 256, 3))
        >>> value.backward()
        >>> value.shape, x.grad.shape
        (torch.Size([]), torch.Size([2, 256, 3]))
    """

    def __init__(self, p: int = 2, *, point_reduction: str | None = "mean", batch_reduction: str | None = "mean",
                 max_points: int | None = None, validate: bool = True):
        super().__init__()
        from .ops.transport.emd import MAX_POINTS, _check_options

        self.max_points = MAX_POINTS if max_points is None else max_points
        _check_options(p, point_reduction, batch_reduction, self.max_points)
        _validate.flag(validate=validate)
        self.p, self.point_reduction, self.batch_reduction, self.validate = int(p), point_reduction, batch_reduction, validate

    def forward(self, x: torch.Tensor, y: torch.Tensor, **batch) -> torch.Tensor:
        """``batch``: ``x_lengths``/``y_lengths`` (padded), ``x_batch``/``y_batch`` and ``batch_size`` (packed)."""
        return earth_movers_distance(
            x, y, p=self.p, point_reduction=self.point_reduction, batch_reduction=self.batch_reduction,
            max_points=self.max_points, validate=self.validate, **batch,
        ).distance

    def extra_repr(self) -> str:
        return f"p={self.p}, point_reduction={self.point_reduction!r}, batch_reduction={self.batch_reduction!r}"
