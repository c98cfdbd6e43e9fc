"""The voxel assignment of the voxel ops (:func:`pcops.voxel_pool`, :func:`pcops.grid_sample`),
defined once: both custom ops (``pcops::voxel_cluster``, ``pcops::grid_cluster``) call
:func:`assign`, so a point is in the same voxel whichever op is asked.

Cell of point p (per sample): ``floor((p - origin) / size)``, computed in float64 whatever the
points' dtype (every float16 / bfloat16 / float32 value is exact in float64; float32 arithmetic
would round the quotient first: a float32 point at -0.3 with size 0.3 would land in cell -1,
not -2). Occupied voxels are numbered in lexicographic order of (sample, x, y, z), each voxel's
points listed by ascending index; rows with a sample id < 0 are in no voxel.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ... import _validate

# Cells must stay exact integers in float64 and int64 (beyond this, floor() has no meaning).
CELL_LIMIT = 2.0**52


def assign(
    points: torch.Tensor,
    size: float,
    origin: Optional[torch.Tensor],
    batch: Optional[torch.Tensor],
    validate: bool,
    *,
    name: str,
    shift: bool,
    coords: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """points (P, 3) float, ``size`` the voxel side (named ``name`` in errors), ``origin`` (3,)
    float64 or None (the world origin), ``batch`` (P,) int sample ids or None (< 0: a row in no
    voxel) -> (inverse (P,), order (P,), coords (V, 3), voxel batch (V,), counts (V,)), int64.

    ``inverse[i]``: the voxel of row i (-1 for a row in no voxel); ``order``: the rows of voxel
    0, then of voxel 1, ..., each voxel's by ascending index (rows in no voxel last), so voxel c's
    rows are ``order[start_c : start_c + counts[c]]``; ``coords``: each voxel's cell, shifted so
    that each sample's smallest cell is 0 on every axis with ``shift`` (Pointcept's
    ``grid_coord``; only with ``origin`` None), as computed otherwise (None with ``coords=False``,
    which skips their gather: a random read of V rows). ``validate``: reject
    NaN/inf points or origin (unchecked, their cells are cell 0, results unspecified); a finite
    point whose cell overflows (``size`` too small for its coordinates) raises, checked or not.
    """
    _validate.positive_number(name, size)
    if validate:
        _validate.finite(points=points, origin=origin)
    shift = shift and origin is None
    n, dev = points.shape[0], points.device
    ids = torch.zeros(n, dtype=torch.int64, device=dev) if batch is None else batch.to(torch.int64)
    empty = lambda *shape: ids.new_empty((0, *shape))  # noqa: E731 (outputs must not alias)
    if n == 0:
        return empty(), empty(), empty(3), empty(), empty()
    # the cells axis by axis, (3, P): every pass below runs over contiguous rows (on (P, 3) rows,
    # the broadcast subtractions and column reads took most of the time)
    cells_f = torch.empty((3, n), dtype=torch.float64, device=dev).copy_(points.t())
    if origin is not None:
        cells_f.sub_(origin.to(cells_f)[:, None])
    cells_f = cells_f.div_(size).floor_()
    valid = ids >= 0
    live = n if batch is None else int(valid.sum())
    every = live == n  # no row in no voxel: the masks below are skipped (most of the time otherwise)
    if live == 0:
        return torch.full_like(ids, -1), torch.arange(n, device=dev), empty(3), empty(), empty()
    lows, highs = _extent(cells_f if every else cells_f[:, valid])
    big = max(abs(x) for x in lows + highs)
    if not all(map(math.isfinite, lows + highs)):
        # a finite point whose cell overflowed (the size too small for its coordinates): the
        # error below; else NaN / inf points (validate=False): in cell 0, results unspecified
        given = torch.isfinite(points.t()) if origin is None else torch.isfinite(points.t()) & torch.isfinite(origin)[:, None]
        if bool((given & ~torch.isfinite(cells_f) & valid).any()):
            big = math.inf
        else:
            cells_f = torch.nan_to_num(cells_f, nan=0.0, posinf=0.0, neginf=0.0)
            lows, highs = _extent(cells_f if every else cells_f[:, valid])
            big = max(abs(x) for x in lows + highs)
    if big >= CELL_LIMIT:
        raise ValueError(
            f"{name}={size} is too small for the extent of the points: a grid coordinate reaches "
            f"{big:.3g}, beyond 2^52 (the voxel keys would overflow)"
        )
    cells = (cells_f if every else torch.where(valid, cells_f, 0)).to(torch.int64)  # (3, P)
    # sample ranks 0 .. S-1 (the ids themselves unless they are sparse or huge)
    top = 0 if batch is None else int(ids.max())
    if top < 4 * n + 16:
        rank, samples = (ids if every else torch.where(valid, ids, 0)), top + 1
    else:
        uniq, rank = torch.unique(torch.where(valid, ids, ids[valid][0]), return_inverse=True)
        samples = uniq.shape[0]
    # the cells relative to ``base`` give the keys; ``coords`` are ``cells - shifted``
    base, shifted = [int(x) for x in lows], [0, 0, 0]
    if shift and samples == 1:  # Pointcept: each sample's smallest cell is 0
        shifted = base
    elif shift:
        big_i = torch.iinfo(torch.int64).max
        low = torch.full((samples, 3), big_i, dtype=torch.int64, device=dev)
        low = low.scatter_reduce(0, rank[:, None].expand(n, 3), (cells if every else torch.where(valid, cells, big_i)).t(), "amin")
        cells = cells - low.index_select(0, rank).t()
        if not every:
            cells = torch.where(valid, cells, 0)
        base = [0, 0, 0]
    # one int64 key per row, monotone in (sample, x, y, z); rows in no voxel sort last
    if shift and samples > 1:  # shifted per sample: the largest sample's extent
        span = [int(h) + 1 for h in _extent(cells if every else cells[:, valid])[1]]
    else:
        span = [int(h - lo) + 1 for lo, h in zip(lows, highs)]
    rel = [cells[a] - base[a] if base[a] else cells[a] for a in range(3)]
    if not every:
        rel = [torch.where(valid, r, 0) for r in rel]
    volume = float(samples) * span[0] * span[1] * span[2]
    if volume < 2.0**62:
        key = rel[0] if samples == 1 else rank * span[0] + rel[0]  # (one sample: its rank is 0)
        key = (key * span[1]).add_(rel[1]).mul_(span[2]).add_(rel[2])
        if volume < 2.0**31 - 1:  # 4-byte keys (below the padding's): torch sorts them faster
            key = key.to(torch.int32)
        if not every:
            key = torch.where(valid, key, torch.iinfo(key.dtype).max)
        key, order = torch.sort(key, stable=True)
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]
        voxel = torch.cumsum(first, 0) - 1
        if not every:
            first &= valid.index_select(0, order)
    else:  # too wide for one key: sort rows lexicographically
        rows = torch.stack([(~valid).to(torch.int64), rank, *rel, torch.arange(n, device=dev)], 1)
        for col in range(4, -1, -1):  # least significant column first, stable sorts
            perm = torch.sort(rows[:, col], stable=True).indices
            rows = rows.index_select(0, perm)
        order = rows[:, 5].contiguous()
        sorted_rows = rows[:, :5]
        first = torch.ones(n, dtype=torch.bool, device=dev)
        first[1:] = (sorted_rows[1:] != sorted_rows[:-1]).any(1)
        voxel = torch.cumsum(first, 0) - 1
        first &= valid.index_select(0, order)
    starts = first.nonzero().reshape(-1)
    v = starts.shape[0]
    # (scatter_: several times faster than an index assignment on the CPU)
    inverse = torch.empty_like(order).scatter_(0, order, voxel if every else torch.where(valid.index_select(0, order), voxel, -1))
    counts = torch.diff(starts, append=starts.new_tensor([live]))
    kept = order.index_select(0, starts)
    voxel_batch = ids.index_select(0, kept)
    if not coords:
        return inverse, order, None, voxel_batch, counts
    kept_cells = cells.index_select(1, kept).t()
    if any(shifted):
        kept_cells = kept_cells - torch.tensor(shifted, dtype=torch.int64, device=dev)
    return inverse, order, kept_cells.contiguous().reshape(v, 3), voxel_batch, counts


def _extent(cells: torch.Tensor) -> tuple[list[float], list[float]]:
    """The smallest and largest cell on each axis of ``cells`` (3, P) (one host read)."""
    both = torch.cat([cells.amin(1), cells.amax(1)]).tolist()
    return both[:3], both[3:]
