"""The static-size forms of the ops whose result size depends on the data.

A caller-given bound (``max_edges``, ``max_voxels``, ``max_clusters``) makes every output size
follow from the inputs' shapes and the bound, so default ``torch.compile`` keeps the call in
its graph. The forms share these pieces: the bound's check, rows cut or padded to it, the true
count, the ids of dropped rows set to -1 (overflow), and rows gathered at padded indices.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _validate


def bound(name: str, value) -> Optional[int]:
    """``value`` (the caller's ``name``): None, or an int >= 1 (NumPy scalars included)."""
    return None if value is None else _validate.count(name, _validate.plain(value))


def count(n: int, like: torch.Tensor) -> torch.Tensor:
    """The true number of rows ``n``, a 0-dim int64 tensor on ``like``'s device."""
    return torch.full((), n, dtype=torch.int64, device=like.device)  # a fill on the device: no copy from the host


def fit(t: torch.Tensor, size: int, fill, dim: int = 0) -> torch.Tensor:
    """``t`` cut or padded with ``fill`` to ``size`` entries along ``dim`` (its first ones kept)."""
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_full(shape, fill)
    kept = min(size, t.shape[dim])
    out.narrow(dim, 0, kept).copy_(t.narrow(dim, 0, kept))
    return out


def drop(ids: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """Row ids with -1 for the rows past ``size`` of ``rows`` (those cut on overflow)."""
    return torch.where(ids < size, ids, -1) if rows > size else ids


def rows(x: torch.Tensor, index: torch.Tensor, real: Optional[torch.Tensor], fill=0) -> torch.Tensor:
    """``x[index]`` along dim 0, ``fill`` where ``real`` is False (padding; None: no padding).
    Differentiable in ``x``; ``x`` may have no rows (a shape test, not a data read)."""
    if real is None:
        return x.index_select(0, index)
    if x.shape[0] == 0:
        return x.new_full((index.shape[0], *x.shape[1:]), fill)
    gathered = x.index_select(0, torch.where(real, index, 0))
    return torch.where(real.reshape(-1, *[1] * (x.dim() - 1)), gathered, fill)
