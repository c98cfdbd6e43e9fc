"""The exact earth mover's distance between equal-size point clouds, by an optimal matching.

For clouds x and y of n points each with uniform weights, an optimal transport plan is a
permutation (Birkhoff), so

    EMD_p(x, y) = min over permutations s of (1/n) sum_i |x_i - y_s(i)|^p,     p = 1 or 2,

which scipy's ``linear_sum_assignment`` (a shortest augmenting path solver) finds exactly on
the (n, n) cost matrix: O(n^2) memory and up to O(n^3) time, on the CPU (CUDA inputs are
copied there and back). The solver is exact, not an approximation (unlike the auction codes
of MSN and PU-Net); its size is limited (``max_points``, 4,096 by default, seconds per
sample), above which the call raises a ValueError that points to
:func:`pcops.sinkhorn_divergence`, never switching silently.

The matching is an index (the custom op ``pcops::emd_match``, no gradient); the costs are
recomputed in torch from the matched pairs, so gradients reach both clouds: the cost at the
fixed optimal matching is differentiable in the points, and its gradient is a gradient of the
EMD wherever the optimal matching is unique (a subgradient otherwise).
"""

from typing import NamedTuple, Optional

import numpy as np
import torch

from ... import _layout, _threads, _validate

MAX_POINTS = 4096  # the default largest sample the exact solver takes (about 3 s on one core at p=2)
POINT_REDUCTIONS = ("mean", "sum", None)
BATCH_REDUCTIONS = ("mean", "sum", None)


class EarthMoversDistance(NamedTuple):
    """Result of :func:`earth_movers_distance`: ``distance`` (reduced as asked) and ``match``,
    the index of the point of y matched to each point of x, in x's layout (-1 at padding)."""

    distance: torch.Tensor
    match: torch.Tensor


def _solve(cost: np.ndarray) -> np.ndarray:
    """The optimal matching of a square cost matrix. NaN / inf costs (points unchecked with
    validate=False) count as more than any matching of finite costs: a matching still comes back
    (the distance of such a sample is then NaN or inf, from the points themselves)."""
    from scipy.optimize import linear_sum_assignment

    bad = ~np.isfinite(cost)
    if bad.any():
        finite = cost[~bad]
        cost = np.where(bad, (np.abs(finite).max() + 1.0 if finite.size else 1.0) * (cost.shape[0] + 1), cost)
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(cost.shape[0], dtype=np.int64)
    out[rows] = cols
    return out


def _cost_matrix(x: np.ndarray, y: np.ndarray, p: int) -> np.ndarray:
    """(n, n) costs |x_i - y_j|^p in float64, from direct differences (no matmul formula), of
    the two clouds moved to the low corner of their finite points' box and divided by the power
    of two of its extent: the same matching (every cost scaled by one power of two) where the
    squares stay in float64's range, and one for clouds whose squared distances would overflow
    or underflow it, wherever they lie."""
    both = np.concatenate([x, y])
    finite = both[np.isfinite(both).all(1)]
    low = finite.min(0) if finite.size else 0.0
    extent = float((finite.max(0) - low).max()) if finite.size else 0.0
    if 0.0 < extent < np.inf:  # (ldexp: 2^e itself overflows for subnormal extents, e > 1023)
        e = -int(np.floor(np.log2(extent)))
        x, y = np.ldexp(x - low, e), np.ldexp(y - low, e)
    d2 = np.zeros((x.shape[0], y.shape[0]))
    for c in range(x.shape[1]):
        diff = x[:, None, c] - y[None, :, c]
        d2 += diff * diff
    return d2 if p == 2 else np.sqrt(d2)


@_threads.custom_op("pcops::emd_match", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _emd_match(
    x: torch.Tensor,
    y: torch.Tensor,
    x_group: Optional[torch.Tensor],
    y_group: Optional[torch.Tensor],
    samples: int,
    p: int,
    max_points: int,
    validate: bool,
) -> torch.Tensor:
    """x (N, 3), y (M, 3), groups (sample ids 0 .. samples - 1; other ids are padding) -> (N,)
    int64: the row of y matched to each row of x by an optimal matching of its sample, -1 for padding."""
    _validate.groups_paired(x_group, y_group)
    _validate.op_values(validate, x=x, y=y)
    xs, ys = x.detach().cpu().double().numpy(), y.detach().cpu().double().numpy()
    if x_group is None:
        gx, gy = np.zeros(xs.shape[0], np.int64), np.zeros(ys.shape[0], np.int64)
    else:
        gx, gy = x_group.cpu().numpy().astype(np.int64), y_group.cpu().numpy().astype(np.int64)
    gx = np.where((gx >= 0) & (gx < samples), gx, samples)
    gy = np.where((gy >= 0) & (gy < samples), gy, samples)
    ox, oy = np.argsort(gx, kind="stable"), np.argsort(gy, kind="stable")
    cx, cy = np.bincount(gx, minlength=samples + 1), np.bincount(gy, minlength=samples + 1)
    unequal = np.nonzero(cx[:samples] != cy[:samples])[0]
    if unequal.size:
        s = int(unequal[0])
        where = f" in sample {s}" if samples > 1 else ""
        raise ValueError(
            f"earth_movers_distance needs x and y of the same number of points in each sample (uniform weights, a "
            f"matching), got {cx[s]} and {cy[s]}{where}: use pcops.sinkhorn_divergence for clouds of different sizes or weights"
        )
    largest = int(cx[:samples].max(initial=0))
    if largest > max_points:
        raise ValueError(
            f"earth_movers_distance solves exactly up to max_points={max_points} points per sample, got {largest}: the "
            "exact solver (scipy's linear_sum_assignment, on the CPU) takes O(n^2) memory and up to O(n^3) time. Use "
            "pcops.sinkhorn_divergence(x, y, p=p, blur=...), memory linear, within blur^p log(n) of EMD / p "
            "(docs/ops/transport.md), or pass a larger max_points"
        )
    match = np.full(xs.shape[0], -1, dtype=np.int64)
    starts_x, starts_y = np.concatenate([[0], np.cumsum(cx)]), np.concatenate([[0], np.cumsum(cy)])
    for s in range(samples):
        rx, ry = ox[starts_x[s] : starts_x[s + 1]], oy[starts_y[s] : starts_y[s + 1]]
        if rx.size:
            match[rx] = ry[_solve(_cost_matrix(xs[rx], ys[ry], p))]
    return torch.from_numpy(match).to(x.device)


@_emd_match.register_fake
def _(x, y, x_group, y_group, samples, p, max_points, validate):
    return x.new_empty((x.shape[0],), dtype=torch.int64)


_NAMES = _layout.names("x", "y")


def _check_options(p, point_reduction, batch_reduction, max_points) -> None:
    _validate.one_of("p", p, (1, 2))
    _validate.reductions(point_reduction, batch_reduction, POINT_REDUCTIONS, BATCH_REDUCTIONS)
    _validate.count("max_points", max_points)


def _per_sample(cost, flat: _layout.Flat, x, samples: int, reduction: str) -> torch.Tensor:
    """(samples,) sum or mean of each sample's matched costs (padding rows cost 0)."""
    if flat.query_group is None:
        total = cost.sum().reshape(1)
        return total if reduction == "sum" else total / max(cost.shape[0], 1)
    g = flat.query_group.to(torch.int64)
    g = torch.where((g >= 0) & (g < samples), g, samples)
    if flat.batch_shape:  # padded: each sample's rows are a row of (B, M), padding costs 0
        b, m = flat.batch_shape
        total = cost.reshape(b, m).sum(1)  # (an index_add over arange // M fails Inductor's C++ code generation)
        return total if reduction == "sum" else total / (g < samples).reshape(b, m).sum(1).clamp_min(1).to(cost.dtype)
    total = cost.new_zeros(samples + 1).index_add(0, g, cost)[:samples]
    if reduction == "sum":
        return total
    count = cost.new_zeros(samples + 1).index_add(0, g, torch.ones_like(cost))[:samples]
    return total / count.clamp_min(1)


@_threads.limits
def earth_movers_distance(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    x_lengths: Optional[torch.Tensor] = None,
    y_lengths: Optional[torch.Tensor] = None,
    x_batch: Optional[torch.Tensor] = None,
    y_batch: Optional[torch.Tensor] = None,
    p: int = 2,
    point_reduction: Optional[str] = "mean",
    batch_reduction: Optional[str] = "mean",
    batch_size: Optional[int] = None,
    max_points: int = MAX_POINTS,
    validate: bool = True,
) -> EarthMoversDistance:
    """The exact earth mover's distance between clouds of equal size: ``(1/n) sum_i |x_i -
    y_s(i)|^p`` over an optimal matching s (``p=2``: the squared 2-Wasserstein distance of the
    uniform measures; ``p=1``: the 1-Wasserstein distance), with the matching.

    Solved exactly by scipy's ``linear_sum_assignment`` on the CPU (CUDA inputs are copied
    there), one sample at a time, up to ``max_points`` points per sample; a larger sample
    raises a ValueError that points to :func:`pcops.sinkhorn_divergence` (memory linear, within
    ``blur^p log(n)`` of ``EMD / p``). Each sample of x must have as many points as its sample
    of y (a ValueError otherwise).

    Args:
        x: Tensor of shape (N, 3); (B, N, 3) padded; or (N_total, 3) packed.
        y: Tensor of shape (N, 3); (B, N', 3) padded; or (N'_total, 3) packed; each sample as
            many points as x's.
        x_lengths, y_lengths: optional int tensors (B,) for padded inputs (equal).
        x_batch, y_batch: int sample ids (N_total,) / (N'_total,) of packed inputs.
        p: 1 (``|x - y|``) or 2 (``|x - y|^2``).
        point_reduction: "mean" (the EMD), "sum" or None (the matched costs per point).
        batch_reduction: "mean", "sum" or None (per-sample values (B,)); None when
            point_reduction is.
        batch_size: number of samples of packed inputs; by default one more than the largest
            id (a host read; required under ``torch.compile``).
        max_points: the largest sample solved (the default takes seconds per sample).
        validate: check the points for NaN/inf and lengths/ids for range.

    Returns:
        EarthMoversDistance(distance, match): ``distance`` a scalar (batch_reduction), a (B,)
        tensor, or (one cloud, batch_reduction None) a 0-d tensor; with point_reduction None,
        the matched costs in x's layout. ``match`` int64 in x's layout: the index of the matched
        point of y (per sample for padded inputs, into the packed y for packed ones), -1 at
        padding. ``distance`` is in the promoted dtype of the points (float16/bfloat16
        computed in float32), differentiable with respect to both clouds at the fixed matching.

    Example:
        >>> import torch, pcops
        >>> x = torch.rand(200, 3)
        >>> y = x[torch.randperm(200)] + 0.1
        >>> emd = pcops.earth_movers_distance(x, y)
        >>> round(float(emd.distance), 4)  # the shift, squared, for each of the 3 coordinates
        0.03
    """
    p, batch_size, max_points = _validate.plain(p), _validate.plain(batch_size), _validate.plain(max_points)
    _check_options(p, point_reduction, batch_reduction, max_points)
    p = int(p)  # 2.0 means 2 (the op's schema takes an int)
    layout = dict(query_lengths=x_lengths, ref_lengths=y_lengths, query_batch=x_batch, ref_batch=y_batch)
    _validate.layout(x, y, None, **layout, names=_NAMES)
    samples, ranges = _layout.sample_count(x, x_batch, y_batch, batch_size)
    flat = _layout.pair(x, y, **layout, validate=validate, names=_NAMES, ranges=ranges)
    dtype, out_dtype = _validate.compute_dtype(x, y)
    q, r = flat.query.to(dtype), flat.ref.to(dtype)
    match = _emd_match(q.detach(), r.detach(), flat.query_group, flat.ref_group, samples, p, max_points, flat.validate)
    valid = match >= 0
    rows = r if r.shape[0] else r.new_zeros((1, 3))
    diff = q - _layout.select_rows(rows, match.clamp_min(0))
    cost = diff.square().sum(-1) if p == 2 else _norms(diff)
    cost = torch.where(valid, cost, 0)
    local = _layout.local_index(flat, match)
    match_out = _layout.unflatten(flat, local)
    if point_reduction is None:
        return EarthMoversDistance(_layout.unflatten(flat, cost).to(out_dtype), match_out)
    loss = _per_sample(cost, flat, x, samples, point_reduction)
    if batch_reduction is not None:
        loss = loss.sum() if batch_reduction == "sum" else loss.sum() / max(samples, 1)
    elif x.dim() == 2 and x_batch is None:
        loss = loss.reshape(())
    return EarthMoversDistance(loss.to(out_dtype), match_out)


def _norms(diff: torch.Tensor) -> torch.Tensor:
    """|diff| of each row (differentiable), measured on the row divided by its largest
    component's power of two: the same value bit for bit where the squares stay in the dtype's
    range, and no overflow or underflow of the squares for any difference the dtype holds
    (float32 points 1e20 apart gave inf, 1e-25 apart 0)."""
    top = diff.detach().abs().amax(-1, keepdim=True)
    scale = torch.where(torch.isfinite(top) & (top > 0), torch.exp2(torch.floor(torch.log2(top))), 1.0)
    return torch.linalg.vector_norm(diff / scale, dim=-1) * scale.squeeze(-1)


__all__ = ["EarthMoversDistance", "earth_movers_distance", "MAX_POINTS"]
