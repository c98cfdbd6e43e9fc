"""The grid layout: dense grids of values, one (D, H, W) or a batch (B, D, H, W), on cells of a
given origin and voxel size (:func:`grid`), as :func:`pcops.marching_cubes` takes them."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _validate


class Grid(NamedTuple):
    values: torch.Tensor  # (B, D, H, W), contiguous, the compute dtype
    batched: bool  # the caller passed (B, D, H, W)
    origin: torch.Tensor  # float64 (3,), on the values' device: the position of values[..., 0, 0, 0]
    voxel_size: tuple  # 3 floats > 0: the step along each axis


def grid(name: str, values, origin, voxel_size, *, checks: Optional[_validate.Checks] = None) -> Grid:
    """The eager checks of a grid ``values`` (D, H, W) or (B, D, H, W) with its ``origin`` (a
    number, three, or a real tensor (3,) or (): :func:`pcops._validate.origin`) and
    ``voxel_size`` (a number or three), its values (and a tensor origin's) checked for NaN/inf in
    ``checks`` (None: not), and the grid as (B, D, H, W) in the compute dtype."""
    _validate.tensor(name, values)
    if values.dim() not in (3, 4):
        raise ValueError(f"{name} must be a tensor of shape (D, H, W) or (B, D, H, W), got shape {tuple(values.shape)}")
    at = _validate.origin(origin, name, values)
    step = _validate.triple("voxel_size", voxel_size, positive=True)
    if checks is not None:
        checks.finite(name, values)
        if isinstance(origin, torch.Tensor):
            checks.finite("origin", origin)
    compute, _ = _validate.compute_dtype(values)
    batched = values.dim() == 4
    return Grid((values if batched else values[None]).to(compute).contiguous(), batched, at, step)
