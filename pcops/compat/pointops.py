"""Pointcept's ``pointops`` (Point Transformer v1/v2, Sonata, ...) on pcops' ops, with no
compiled extension: change one import.

    import pointops                               # before
    import pcops.compat.pointops as pointops      # or pcops.compat.install("pointops")

Batching is pointops' offset layout: the samples' points are concatenated, and ``offset`` (B,)
holds the cumulative point counts (``offset[b]`` = end of sample b; the last entry is the total).
A query of ``new_xyz`` in sample b (by ``new_offset``) searches only sample b of ``xyz``. Indices
are global (into the concatenated points), int32 as pointops returns them; distances are
Euclidean (pointops returns ``sqrt(dist2)``). Padding is pointops': index -1, distance 1e5
(``sqrt(1e10)``).

Argument names, order and defaults are pointops'. Where pointops leaves a result unspecified, or
its CUDA kernel reads out of bounds, pcops returns one fixed result (each function says which):

* ``knn_query``: neighbours by distance, ties by the smaller index.
* ``ball_query``: the candidates sorted by (squared distance, index); with more than ``nsample``
  of them, the ``nsample`` picked at positions ``int(float(c) / nsample * i)`` as pointops'
  kernel does. (pointops' kernel heap-sorts an array that was never made a heap, so its order is
  neither sorted nor index order, and for the rows with more candidates than ``nsample`` it
  writes the index into ``dist2``: pcops returns the true distance.)
* ``farthest_point_sampling``: ties by the smaller index, never a point twice within a sample
  (pointops' ties depend on its thread layout); a sample asked for more picks than it has
  points gets its first point for the extra ones, as pointops' kernel returns for distinct points.
* -1 indices given to ``grouping2``, ``subtraction`` and ``aggregation`` read zero rows
  (pointops' kernels read out of bounds); ``interpolation`` leaves -1 neighbours out of the
  weights (pointops blends in the last feature row with weight ~1e-5 / sum).

Gradients go through torch autograd of pcops' ops: ``grouping``, ``grouping2``,
``interpolation``, ``interpolation2``, ``subtraction``, ``aggregation`` and the attention
steps in every tensor input pointops differentiates. Beyond pointops: the distances of the
queries are differentiable in the points (pointops raises on a backward through them),
``interpolation`` in ``xyz`` and ``new_xyz``, and ``attention_relation_step`` in ``weight``
(pointops' backward computes that gradient and drops it). float64 points stay float64
(pointops takes float32 only); float16/bfloat16 are searched in float32. Details:
docs/interop.md.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

import pcops

from .. import _validate, _vml
from . import _WIDEN, check_count, check_tensor, compute_dtype, is_compiling, squared

__all__ = [
    "aggregation",
    "attention_fusion_step",
    "attention_relation_step",
    "ball_query",
    "ball_query_and_group",
    "batch2offset",
    "farthest_point_sampling",
    "grouping",
    "grouping2",
    "interpolation",
    "interpolation2",
    "knn_query",
    "knn_query_and_group",
    "offset2batch",
    "query_and_group",
    "random_ball_query",
    "subtraction",
]

_PAD_DIST = 1e5  # pointops pads with dist2 = 1e10 and returns its square root
_NEAR2 = 1e-5  # pointops' ball queries always keep points with dist2 <= 1e-5 (the query itself)
_EPS = 1e-8  # interpolation's 1 / (dist + 1e-8)

Offsets = Union[torch.Tensor, Sequence[int]]


# ----------------------------------------------------------------------------------------------
# arguments


def _number(name: str, value) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _offset(name: str, offset, device) -> torch.Tensor:
    """An offset vector (B,) as int64 on ``device`` (a tensor of any integer dtype, or ints)."""
    if not isinstance(offset, torch.Tensor):
        if not isinstance(offset, (list, tuple)):
            raise TypeError(f"{name} must be an integer tensor of shape (B,) (cumulative point counts), got {type(offset).__name__}")
        offset = torch.as_tensor(offset, dtype=torch.int64, device=device)
    _validate.integer(name, offset, ndim=1, shape_doc="(B,)", what="cumulative point counts")
    if offset.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one sample, got shape (0,)")
    if offset.device != device:
        raise ValueError(f"all tensors must be on the same device, got {name} on {offset.device}, points on {device}")
    return offset.to(torch.int64)


def _check_offsets(points: dict, **named) -> None:
    """name -> (offset, total): every offset non-decreasing from >= 0 and ending at its total;
    ``points`` (name -> tensor) free of NaN/inf. One host read for all (the pcops ops then run
    with ``validate=False``, so messages name the caller's arguments); skipped under torch.compile."""
    if is_compiling():
        return
    finite = [torch.isfinite(t).all().to(torch.int64).reshape(1) for t in points.values()]
    values = torch.cat([o for o, _ in named.values()] + finite).tolist()
    at = 0
    for name, (o, total) in named.items():
        v, at = values[at : at + o.shape[0]], at + o.shape[0]
        if v[0] < 0 or any(b < a for a, b in zip(v, v[1:])):
            raise ValueError(f"{name} must be non-decreasing cumulative point counts >= 0, got {v}")
        if v[-1] != total:
            raise ValueError(f"{name}[-1] must equal the number of points ({total}), got {v[-1]}")
    for name, ok in zip(points, values[at:]):
        if not ok:
            raise ValueError(f"{name} contains NaN or inf")


def _ids(offset: torch.Tensor, n) -> torch.Tensor:
    """Sample id of each of the n rows of an offset layout: the number of offsets <= row."""
    return torch.searchsorted(offset, torch.arange(n, device=offset.device, dtype=torch.int64), right=True)


def _points(name: str, t) -> torch.Tensor:
    _validate.points(name, t)
    return t


def _queries(xyz, offset, new_xyz, new_offset):
    """pointops' rule: without new_xyz the points query themselves. Returns the checked
    (xyz, new_xyz, offset, new_offset, ref ids, query ids)."""
    xyz = _points("xyz", xyz)
    if new_xyz is None:
        if new_offset is not None:
            raise ValueError("new_xyz is required with new_offset")
        new_xyz, new_offset = xyz, offset
    elif new_offset is None:
        raise ValueError("new_offset is required with new_xyz (pointops would silently query xyz instead)")
    new_xyz = _points("new_xyz", new_xyz)
    _validate.same_device(xyz=xyz, new_xyz=new_xyz)
    if offset is None:
        raise ValueError("offset is required (cumulative point counts of xyz)")
    offset = _offset("offset", offset, xyz.device)
    new_offset = _offset("new_offset", new_offset, xyz.device)
    if offset.shape[0] != new_offset.shape[0]:
        raise ValueError(f"offset and new_offset must have one entry per sample alike, got {offset.shape[0]} and {new_offset.shape[0]}")
    pts = {"xyz": xyz} if new_xyz is xyz else {"xyz": xyz, "new_xyz": new_xyz}
    _check_offsets(pts, offset=(offset, xyz.shape[0]), new_offset=(new_offset, new_xyz.shape[0]))
    return xyz, new_xyz, offset, new_offset, _ids(offset, xyz.shape[0]), _ids(new_offset, new_xyz.shape[0])


def _as_search(*points: torch.Tensor):
    """The points in the dtype pcops searches them in (float16/bfloat16 -> float32)."""
    dtype = compute_dtype(*points)
    return tuple(p.to(dtype) for p in points)


def _index(name: str, idx, dim: int = 2) -> torch.Tensor:
    _validate.integer(name, idx, ndim=dim, shape_doc="(m, nsample)" if dim == 2 else "(m,)")
    return idx


def _distance(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """|a - b| where valid (a gradient of 0 at distance 0), the padding distance elsewhere."""
    d2 = squared(a - b)
    pos = valid & (d2 > 0)
    d = _vml.root(torch.where(pos, d2, torch.ones((), dtype=d2.dtype, device=d2.device)))  # (IEEE's roots: eager = compiled)
    d = torch.where(pos, d, torch.zeros((), dtype=d.dtype, device=d.device))
    return torch.where(valid, d, torch.full((), _PAD_DIST, dtype=d.dtype, device=d.device))


# ----------------------------------------------------------------------------------------------
# queries


def knn_query(nsample: int, xyz: torch.Tensor, offset: Offsets, new_xyz: Optional[torch.Tensor] = None, new_offset: Optional[Offsets] = None):
    """The ``nsample`` nearest points of ``xyz`` to each point of ``new_xyz``, within its sample.

    Args:
        nsample: neighbours per query (pointops' kernel caps it at 128; pcops does not).
        xyz: Tensor (n, 3) of points, samples concatenated.
        offset: int tensor (b,), cumulative point counts of xyz's samples.
        new_xyz, new_offset: queries (m, 3) and their offsets (b,); both None: xyz queries
            itself (pointops' default). One without the other raises a ValueError.

    Returns:
        (idx, dist): int32 (m, nsample) global indices into xyz, by distance ascending, ties by
        the smaller index; Euclidean distances (m, nsample) in the points' dtype (float32 for
        float32 / float16 / bfloat16), differentiable in xyz and new_xyz. A sample with fewer
        than nsample points pads its rows with idx -1 and dist 1e5.
    """
    k = check_count("nsample", nsample)
    xyz, new_xyz, offset, new_offset, ref_ids, query_ids = _queries(xyz, offset, new_xyz, new_offset)
    ref, query = _as_search(xyz, new_xyz)
    m, n = query.shape[0], ref.shape[0]
    kk = min(k, n)
    if guard_or_false(kk == 0) or guard_or_false(m == 0):
        idx = torch.full((m, k), -1, dtype=torch.int64, device=query.device)
        dist = torch.full((m, k), _PAD_DIST, dtype=query.dtype, device=query.device)
    else:
        found = pcops.knn(query, ref, kk, query_batch=query_ids, ref_batch=ref_ids, validate=False)
        idx = found.idx
        dist = torch.where(idx >= 0, found.dists, torch.full((), _PAD_DIST, dtype=found.dists.dtype, device=idx.device))
        if kk < k:
            idx = torch.cat([idx, idx.new_full((m, k - kk), -1)], 1)
            dist = torch.cat([dist, dist.new_full((m, k - kk), _PAD_DIST)], 1)
    return idx.to(torch.int32), dist


def _pick(query, ref, table, rows, hi: float, lo: float, nsample: int, key: Optional[torch.Tensor]) -> torch.Tensor:
    """Of a ball-query table (R, W) of the queries ``rows``: the pointops candidates (dist2 <=
    1e-5 or lo <= dist2 < hi, dist2 in the points' dtype) ordered by (dist2, index), or by
    ``key`` (random keys of ref), and the nsample of them pointops keeps, -1 padded, (R, nsample)."""
    valid = table >= 0
    j = table.clamp(min=0)
    d2 = squared(query[rows][:, None, :] - ref[j])
    cand = valid & ((d2.double() <= _NEAR2) | ((d2 >= lo) & (d2 < hi)))
    big = torch.iinfo(torch.int64).max
    order = torch.where(cand, table, big).sort(1).indices  # by index, candidates first
    if key is None:
        primary = torch.where(cand, d2, torch.full((), float("inf"), dtype=d2.dtype, device=d2.device))
    else:
        primary = torch.where(cand, key[j], torch.full((), float("inf"), dtype=key.dtype, device=key.device))
    order = order.gather(1, primary.gather(1, order).sort(dim=1, stable=True).indices)
    listed = torch.where(cand, table, -1).gather(1, order)  # candidates first, in order, then -1
    c = cand.sum(1)
    col = torch.arange(nsample, device=table.device)
    if key is None:  # pointops' spread: int(float(c) / nsample * i) when c > nsample
        sep = c.to(torch.float32) / nsample
        spread = (sep[:, None] * col.to(torch.float32)[None, :]).to(torch.int64)
        pos = torch.where((c > nsample)[:, None], spread, col[None, :])
    else:
        pos = col[None, :].expand(table.shape[0], nsample)
    width = listed.shape[1]
    out = listed.gather(1, pos.clamp(max=width - 1)) if width else listed.new_full(pos.shape, -1)
    return torch.where(pos < c[:, None], out, -1)


@torch.library.custom_op("pcops_compat::pointops_ball", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _ball(
    query: torch.Tensor,
    ref: torch.Tensor,
    query_ids: torch.Tensor,
    ref_ids: torch.Tensor,
    max_radius: float,
    min_radius: float,
    nsample: int,
    key: Optional[torch.Tensor],
) -> torch.Tensor:
    """query (m, 3), ref (n, 3) of one float dtype, sample ids (m,) / (n,) -> (m, nsample) int64:
    pointops' ball-query pick (see :func:`_pick`; ``key`` None: by distance, spread; else the
    first nsample by key). pcops' ball query finds the candidates (widened, then the exact
    test), a second, wider one for the queries with more than nsample points in the ball."""
    m = query.shape[0]
    out = torch.full((m, nsample), -1, dtype=torch.int64, device=query.device)
    if m == 0 or ref.shape[0] == 0:
        return out
    f = np.float64 if query.dtype == torch.float64 else np.float32
    hi, lo = float(f(max_radius) * f(max_radius)), float(f(min_radius) * f(min_radius))  # as the kernel squares them
    search = max(max_radius, _NEAR2**0.5) * (1 + _WIDEN)
    _, table, counts = pcops.ball_query(query, ref, search, nsample, query_batch=query_ids, ref_batch=ref_ids, validate=False)
    rows = torch.arange(m, device=query.device)
    out = _pick(query, ref, table, rows, hi, lo, nsample, key)  # complete where counts <= nsample
    over = rows[counts > nsample]
    if over.numel():
        most = int(counts[over].max())
        _, wide, _ = pcops.ball_query(query[over], ref, search, most, query_batch=query_ids[over], ref_batch=ref_ids, validate=False)
        out[over] = _pick(query, ref, wide, over, hi, lo, nsample, key)
    return out


@_ball.register_fake
def _(query, ref, query_ids, ref_ids, max_radius, min_radius, nsample, key):
    return query.new_empty((query.shape[0], nsample), dtype=torch.int64)


def _ball_query(nsample, max_radius, min_radius, xyz, offset, new_xyz, new_offset, randomised: bool):
    k = check_count("nsample", nsample)
    hi, lo = _number("max_radius", max_radius), _number("min_radius", min_radius)
    if not lo < hi:
        raise ValueError(f"min_radius must be < max_radius, got min_radius={lo}, max_radius={hi}")
    if lo < 0:
        raise ValueError(f"min_radius must be >= 0, got {lo}")
    xyz, new_xyz, offset, new_offset, ref_ids, query_ids = _queries(xyz, offset, new_xyz, new_offset)
    ref, query = _as_search(xyz, new_xyz)
    key = torch.rand(ref.shape[0], device=ref.device) if randomised else None
    idx = _ball(query.detach().contiguous(), ref.detach().contiguous(), query_ids, ref_ids, hi, lo, k, key)
    dist = _distance(query[:, None, :], pcops.gather(ref, idx, validate=False), idx >= 0)
    return idx.to(torch.int32), dist


def ball_query(nsample: int, max_radius: float, min_radius: float, xyz: torch.Tensor, offset: Offsets,
               new_xyz: Optional[torch.Tensor] = None, new_offset: Optional[Offsets] = None):
    """Up to ``nsample`` points of ``xyz`` in the shell ``min_radius <= d < max_radius`` around
    each point of ``new_xyz``, within its sample (pointops' ``ball_query``).

    A point is a candidate when ``d2 <= 1e-5`` (the query itself, always kept) or
    ``min_radius^2 <= d2 < max_radius^2``, d2 the squared distance in the points' precision.
    The candidates are sorted by (d2, index). With c <= nsample candidates all are returned,
    then -1 / 1e5 padding; with more, the nsample at positions ``int(float(c) / nsample * i)``
    (float32, as pointops' kernel) of that order: an even spread over the distances.

    Returns:
        (idx, dist): int32 (m, nsample) global indices, Euclidean distances (m, nsample),
        differentiable in xyz and new_xyz. pointops' own kernel leaves its candidates in a
        scrambled order (a heap sort of an array never made a heap), writes the index as the
        dist2 of rows with more than nsample candidates and overflows past 2048 candidates;
        pcops' result is the sorted one, with true distances and no cap.
    """
    return _ball_query(nsample, max_radius, min_radius, xyz, offset, new_xyz, new_offset, False)


def random_ball_query(nsample: int, max_radius: float, min_radius: float, xyz: torch.Tensor, offset: Offsets,
                      new_xyz: Optional[torch.Tensor] = None, new_offset: Optional[Offsets] = None):
    """pointops' ``random_ball_query``: the candidates of :func:`ball_query`, in a random order
    of the points (one uniform key per point of xyz from torch's RNG, ``torch.rand``; pointops
    draws a ``randperm`` per sample: the same distribution, not the same draw), the first
    ``nsample`` of them, -1 / 1e5 padded. ``torch.manual_seed`` makes it reproducible; under
    ``torch.compile`` the draw is part of the graph.

    Returns:
        (idx, dist) as :func:`ball_query`.
    """
    return _ball_query(nsample, max_radius, min_radius, xyz, offset, new_xyz, new_offset, True)


def farthest_point_sampling(xyz: torch.Tensor, offset: Offsets, new_offset: Offsets) -> torch.Tensor:
    """Farthest point sampling per sample (pointops' ``farthest_point_sampling``).

    Sample b picks ``new_offset[b] - new_offset[b - 1]`` of its points, starting at its first
    point, each next pick the point farthest from those picked (squared distances in the points'
    precision; ties to the smaller index; a point is never picked twice). A sample asked for
    more picks than it has points gets its first point for the extra ones (what pointops' kernel
    returns for distinct points); an empty sample asked for picks raises a ValueError.

    Returns:
        int32 (new_offset[-1],) global indices into xyz, grouped by sample, in pick order. Its
        size is read from ``new_offset`` (a host read, as pointops does): under
        ``torch.compile`` the graph breaks here.
    """
    xyz = _points("xyz", xyz)
    offset = _offset("offset", offset, xyz.device)
    new_offset = _offset("new_offset", new_offset, xyz.device)
    if offset.shape[0] != new_offset.shape[0]:
        raise ValueError(f"offset and new_offset must have one entry per sample alike, got {offset.shape[0]} and {new_offset.shape[0]}")
    _check_offsets({"xyz": xyz}, offset=(offset, xyz.shape[0]))
    zero = offset.new_zeros(1)
    have = torch.diff(offset, prepend=zero)
    want = torch.diff(new_offset, prepend=zero)
    stats = torch.stack([want.min(), want.max(), ((want > 0) & (have == 0)).sum(), new_offset[-1]]).tolist()
    if stats[0] < 0:
        raise ValueError(f"new_offset must be non-decreasing cumulative pick counts >= 0, got {new_offset.tolist()}")
    if stats[2]:
        raise ValueError("new_offset asks for points from a sample of xyz that has none (see offset)")
    total, most = stats[3], stats[1]
    starts = offset - have  # first global index of each sample
    out = starts.repeat_interleave(want, output_size=total)  # extra picks: the sample's first point
    if most == 0:
        return out.to(torch.int32)
    (points,) = _as_search(xyz)
    ids = _ids(offset, xyz.shape[0])
    picked = pcops.farthest_point_sample(points.detach(), most, batch=ids, validate=False).idx  # min(most, n_b) per sample, grouped
    sample = ids[picked]
    rank = torch.arange(picked.shape[0], device=picked.device) - torch.searchsorted(sample, sample)
    keep = rank < want[sample]
    at = (new_offset - want)[sample] + rank
    out[at[keep]] = picked[keep]
    return out.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# grouping and the ops built on it


def grouping(idx: torch.Tensor, feat: torch.Tensor, xyz: torch.Tensor, new_xyz: Optional[torch.Tensor] = None,
             with_xyz: bool = False) -> torch.Tensor:
    """``feat[idx]`` (m, nsample, c), zero rows where idx is -1 (pointops' ``grouping``).

    With ``with_xyz`` the relative coordinates ``xyz[idx] - new_xyz`` (zero where idx is -1)
    come first: (m, nsample, 3 + c). ``new_xyz`` defaults to ``xyz`` (so idx (n, nsample)).
    Differentiable in feat, xyz and new_xyz. Indices outside [-1, n) raise a ValueError.
    """
    _index("idx", idx)
    check_tensor("feat", feat)
    if feat.dim() != 2:
        raise ValueError(f"feat must be a tensor of shape (n, c), got shape {tuple(feat.shape)}")
    grouped = pcops.gather(feat, idx)
    if not with_xyz:
        return grouped
    xyz = _points("xyz", xyz)
    new_xyz = xyz if new_xyz is None else _points("new_xyz", new_xyz)
    if new_xyz.shape[0] != idx.shape[0]:
        raise ValueError(f"new_xyz must have one row per row of idx ({idx.shape[0]}), got {new_xyz.shape[0]}")
    rel = pcops.gather(xyz, idx, validate=False) - new_xyz[:, None, :]
    rel = torch.where((idx >= 0)[..., None], rel, torch.zeros((), dtype=rel.dtype, device=rel.device))
    return torch.cat([rel.to(torch.promote_types(rel.dtype, grouped.dtype)), grouped.to(torch.promote_types(rel.dtype, grouped.dtype))], -1)


def grouping2(input: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``input[idx]`` (m, nsample, c) (pointops' ``Grouping`` function); -1 gives zero rows
    (pointops' kernel reads out of bounds). Differentiable in input."""
    check_tensor("input", input)
    if input.dim() != 2:
        raise ValueError(f"input must be a tensor of shape (n, c), got shape {tuple(input.shape)}")
    return pcops.gather(input, _index("idx", idx))


def knn_query_and_group(feat, xyz, offset=None, new_xyz=None, new_offset=None, idx=None, nsample=None, with_xyz=False):
    """:func:`knn_query` (unless ``idx`` is given) then :func:`grouping`.

    Returns:
        (grouped (m, nsample, [3 +] c), idx int32 (m, nsample)).
    """
    if idx is None:
        if nsample is None:
            raise ValueError("nsample is required when idx is None")
        idx, _ = knn_query(nsample, xyz, offset, new_xyz, new_offset)
    return grouping(idx, feat, xyz, new_xyz, with_xyz), idx


def ball_query_and_group(feat, xyz, offset=None, new_xyz=None, new_offset=None, idx=None, max_radio=None, min_radio=0,
                         nsample=None, with_xyz=False):
    """:func:`ball_query` (unless ``idx`` is given; pointops' names ``max_radio`` / ``min_radio``)
    then :func:`grouping`. Returns (grouped, idx)."""
    if idx is None:
        for name, value in (("nsample", nsample), ("offset", offset), ("max_radio", max_radio), ("min_radio", min_radio)):
            if value is None:
                raise ValueError(f"{name} is required when idx is None")
        idx, _ = ball_query(nsample, max_radio, min_radio, xyz, offset, new_xyz, new_offset)
    return grouping(idx, feat, xyz, new_xyz, with_xyz), idx


def query_and_group(nsample, xyz, new_xyz, feat, idx, offset, new_offset, dilation=0, with_feat=True, with_xyz=True):
    """pointops' ``query_and_group``: dilated kNN grouping.

    Without ``idx``: the ``1 + (nsample - 1) * (dilation + 1)`` nearest points, of which columns
    ``(dilation + 1) * i`` are kept; a sample with fewer points than that keeps columns
    ``int(((n_b - 1) / (nsample - 1) - 1 + 1) * i)`` (pointops' "soft dilation", same float64
    arithmetic). ``with_feat=False`` returns idx (int32) only; else ``(grouped, idx)`` with
    grouped ``[xyz[idx] - new_xyz, feat[idx]]`` (m, nsample, 3 + c) (``with_xyz``) or
    ``feat[idx]``. -1 entries group as zeros (pointops indexes row -1, the last point).
    """
    k = check_count("nsample", nsample)
    if idx is None:
        if isinstance(dilation, bool) or not isinstance(dilation, (int, np.integer)) or dilation < 0:
            raise ValueError(f"dilation must be an int >= 0, got {dilation!r}")
        d = int(dilation)
        total = 1 + (k - 1) * (d + 1)
        full, _ = knn_query(total, xyz, offset, new_xyz, new_offset)
        if new_xyz is None:
            new_xyz, new_offset = xyz, offset
        offset_t = _offset("offset", offset, xyz.device)
        query_ids = _ids(_offset("new_offset", new_offset, xyz.device), new_xyz.shape[0])
        have = torch.diff(offset_t, prepend=offset_t.new_zeros(1))[query_ids].to(torch.float64)  # points of each query's sample
        col = torch.arange(k, device=xyz.device)
        if k > 1:
            soft = (have - 1) / (k - 1) - 1
            soft_cols = ((soft + 1)[:, None] * col.to(torch.float64)[None, :]).to(torch.int64).clamp(min=0)  # < 0: an empty sample (all -1)
        else:
            soft_cols = col[None, :].expand(have.shape[0], k)
        cols = torch.where((have < total)[:, None], soft_cols, (d + 1) * col[None, :])
        idx = full.gather(1, cols)
    else:
        _index("idx", idx)
        if new_xyz is None:
            new_xyz = xyz
    if not with_feat:
        return idx
    return grouping(idx, feat, xyz, new_xyz, with_xyz), idx


# ----------------------------------------------------------------------------------------------
# interpolation, subtraction, aggregation, attention


def _interpolate(xyz, new_xyz, feat, offset, new_offset, k, name: str, positions: bool) -> torch.Tensor:
    check_tensor("xyz", xyz)
    check_tensor("new_xyz", new_xyz)
    check_tensor(name, feat)
    if feat.dim() != 2 or feat.shape[0] != xyz.shape[0]:
        raise ValueError(f"{name} must be a tensor of shape (m, c) with m = {xyz.shape[0]} (the rows of xyz), got shape {tuple(feat.shape)}")
    if not positions:
        xyz, new_xyz = xyz.detach(), new_xyz.detach()
    idx, dist = knn_query(check_count("k", k), xyz, offset, new_xyz, new_offset)
    valid = idx >= 0
    recip = torch.where(valid, 1.0 / (dist + _EPS), torch.zeros((), dtype=dist.dtype, device=dist.device))
    norm = recip.sum(1, keepdim=True)
    weight = recip / torch.where(norm > 0, norm, torch.ones((), dtype=norm.dtype, device=norm.device))
    grouped = pcops.gather(feat, idx, validate=False)
    dtype = torch.promote_types(grouped.dtype, weight.dtype)
    return (grouped.to(dtype) * weight.to(dtype)[..., None]).sum(1)


def interpolation(xyz: torch.Tensor, new_xyz: torch.Tensor, feat: torch.Tensor, offset: Offsets, new_offset: Offsets, k: int = 3) -> torch.Tensor:
    """Inverse-distance interpolation of ``feat`` (on ``xyz``, (m, c)) at ``new_xyz`` (n, 3).

    ``out_i = sum_j w_ij feat_j`` over the k nearest points j of i's sample, ``w_ij = r_ij /
    sum_j r_ij``, ``r_ij = 1 / (d_ij + 1e-8)`` (Euclidean d, pointops' formula). A sample of xyz
    with fewer than k points uses the ones it has (pointops blends in the last row of feat with
    a weight of about 1e-5 / sum); a sample with none gives zeros. Returns (n, c), differentiable
    in feat, xyz and new_xyz.
    """
    return _interpolate(xyz, new_xyz, feat, offset, new_offset, k, "feat", True)


def interpolation2(xyz: torch.Tensor, new_xyz: torch.Tensor, input: torch.Tensor, offset: Offsets, new_offset: Offsets, k: int = 3) -> torch.Tensor:
    """:func:`interpolation` as pointops' ``Interpolation`` function: the same values,
    differentiable in ``input`` only (the positions are constants, as its backward has them)."""
    return _interpolate(xyz, new_xyz, input, offset, new_offset, k, "input", False)


def subtraction(input1: torch.Tensor, input2: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[i, s] = input1[i] - input2[idx[i, s]]`` (n, nsample, c); -1 reads a zero row of
    input2. Differentiable in input1 and input2."""
    for name, t in (("input1", input1), ("input2", input2)):
        check_tensor(name, t)
        if t.dim() != 2:
            raise ValueError(f"{name} must be a tensor of shape (n, c), got shape {tuple(t.shape)}")
    _index("idx", idx)
    if idx.shape[0] != input1.shape[0]:
        raise ValueError(f"idx must have one row per row of input1 ({input1.shape[0]}), got {idx.shape[0]}")
    return input1[:, None, :] - pcops.gather(input2, idx)


def aggregation(input: torch.Tensor, position: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[i, c] = sum_s (input[idx[i, s], c] + position[i, s, c]) * weight[i, s, c % w_c]``.

    Args: input (n, c); position (n, nsample, c); weight (n, nsample, w_c) shared across the
    channel groups (channel c uses weight channel c % w_c); idx (n, nsample), -1 reading a zero
    row of input. Returns (n, c), differentiable in input, position and weight.
    """
    for name, t, rank in (("input", input, 2), ("position", position, 3), ("weight", weight, 3)):
        check_tensor(name, t)
        if t.dim() != rank:
            raise ValueError(f"{name} must be a tensor of rank {rank}, got shape {tuple(t.shape)}")
    _index("idx", idx)
    n, s, c = position.shape
    if idx.shape != (n, s) or weight.shape[:2] != (n, s) or input.shape[1] != c:
        raise ValueError(
            f"position (n, nsample, c) = {tuple(position.shape)} must match idx (n, nsample) = {tuple(idx.shape)}, "
            f"weight (n, nsample, w_c) = {tuple(weight.shape)} and input (., c) = {tuple(input.shape)}"
        )
    w = weight.index_select(2, torch.arange(c, device=weight.device) % weight.shape[2])
    return ((pcops.gather(input, idx) + position) * w).sum(1)


def attention_relation_step(query: torch.Tensor, key: torch.Tensor, weight: torch.Tensor, index_target: torch.Tensor,
                            index_refer: torch.Tensor) -> torch.Tensor:
    """``out[r, g] = sum_c query[index_target[r], g, c] * key[index_refer[r], g, c] * weight[c]``.

    query, key (n, g, c); weight (c,); index_target, index_refer (m,). Returns (m, g),
    differentiable in query, key and weight (pointops drops weight's gradient).
    """
    for name, t in (("query", query), ("key", key)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be a tensor of shape (n, g, c), got shape {tuple(t.shape)}")
    check_tensor("weight", weight)
    _index("index_target", index_target, 1)
    _index("index_refer", index_refer, 1)
    if index_target.shape != index_refer.shape:
        raise ValueError(f"index_target and index_refer must have the same shape, got {tuple(index_target.shape)} and {tuple(index_refer.shape)}")
    q = query.index_select(0, index_target.to(torch.int64))
    k = key.index_select(0, index_refer.to(torch.int64))
    return (q * k * weight).sum(-1)


def attention_fusion_step(weight: torch.Tensor, value: torch.Tensor, index_target: torch.Tensor, index_refer: torch.Tensor) -> torch.Tensor:
    """``out[index_target[r], g, :] += weight[r, g] * value[index_refer[r], g, :]``.

    weight (m, g); value (n, g, c); index_target, index_refer (m,). Returns (n, g, c),
    differentiable in weight and value.
    """
    check_tensor("weight", weight)
    check_tensor("value", value)
    if value.dim() != 3 or weight.dim() != 2:
        raise ValueError(f"weight must be (m, g) and value (n, g, c), got {tuple(weight.shape)} and {tuple(value.shape)}")
    _index("index_target", index_target, 1)
    _index("index_refer", index_refer, 1)
    if not (index_target.shape[0] == index_refer.shape[0] == weight.shape[0]):
        raise ValueError(f"index_target, index_refer and weight must have m rows alike, got {index_target.shape[0]}, {index_refer.shape[0]}, {weight.shape[0]}")
    part = weight[:, :, None] * value.index_select(0, index_refer.to(torch.int64))
    return value.new_zeros(value.shape, dtype=part.dtype).index_add(0, index_target.to(torch.int64), part)


# ----------------------------------------------------------------------------------------------
# layout helpers


def offset2batch(offset: torch.Tensor) -> torch.Tensor:
    """int64 (offset[-1],): the sample id of every point."""
    check_tensor("offset", offset)
    o = offset.to(torch.int64)
    return torch.repeat_interleave(torch.arange(o.shape[0], device=o.device), torch.diff(o, prepend=o.new_zeros(1)))


def batch2offset(batch: torch.Tensor) -> torch.Tensor:
    """int32 (B,): cumulative counts of sorted sample ids ``cumsum(bincount(batch))``."""
    check_tensor("batch", batch)
    return torch.cumsum(batch.bincount(), dim=0).int()


# ``pointops/__init__.py`` is ``from .functions import *``: ``pointops.functions`` holds the same
# names, so it is this module too (the attribute serves ``import pointops.functions``).
functions = sys.modules[__name__]
__aliases__ = {"pointops.functions": functions}
