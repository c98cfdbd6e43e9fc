"""The integer layout: integer-data ops (serialize, segment_reduce, gather, sparse convolution)
take integer sites (N, 3) with packed sample ids (:func:`sites`), segment ids, CSR offsets or
indices, whose values :func:`values` checks in one host read (the counterpart of the point
layouts' value checks).
"""

from __future__ import annotations

from typing import Optional

from .. import _validate


def sites(grid_coord, batch=None, *, size: Optional[int] = None, name: str = "grid_coord", what: str = "integer grid coordinates",
          batch_name: str = "batch") -> None:
    """The eager checks of an integer-data op's sites (the second layout, beside the points'
    :func:`pcops._layout.points.single`): ``grid_coord`` (N, 3) integers (N = ``size`` if given) with optional ``batch`` (N,) sample
    ids (packed, as PyTorch Geometric), on one device. Values are checked by :func:`values`."""
    _validate.grid_coords(name, grid_coord, what, size)
    _validate.ids(batch_name, batch, grid_coord.shape[0], "(N,)")
    _validate.same_device(**{name: grid_coord, batch_name: batch})


def values(validate: bool, *, ranges: Optional[dict] = None, finite: Optional[dict] = None, pointers: Optional[dict] = None) -> bool:
    """The value checks of an integer-data op, in one host read, with ``validate`` and not under
    ``torch.compile`` (as the point layouts check points): ``ranges`` (name -> (tensor, low, high[,
    the range as the message says it]): sites, ids, indices within bounds; high None for none), ``finite`` (name -> tensor: no
    NaN/inf), ``pointers`` (name -> (tensor, low, high): CSR pointers, non-decreasing within
    bounds). Returns whether they ran; the op checks what they could not (``validate and not
    values(...)``), and its kernels clamp or mask indices, so that unchecked bad values give
    unspecified results, never a read out of bounds."""
    checks = _validate.checks(validate)
    if checks is None:
        return False
    for name, (t, low, high) in (pointers or {}).items():
        checks.non_decreasing(name, t, low, high)
    for name, (t, low, high, *bound) in (ranges or {}).items():
        checks.in_range(name, t, low, high, *bound)
    for name, t in (finite or {}).items():
        checks.finite(name, t)
    checks.run()
    return True
