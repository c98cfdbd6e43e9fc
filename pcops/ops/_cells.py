"""The cell list of the radius ops: reference points sorted by (sample, z, y, x) cell of a
dense grid, and the Warp functions that find the cells around a query.

``CellList(query, ref, radius, query_group, ref_group)`` sorts the reference points (``order``)
and the queries (``rows``) by cell; ``starts[c] .. starts[c + 1]`` are the sorted points of
cell c. Cells are ``CELL * radius`` wide, wider when that would make more than
``CELLS_PER_POINT`` cells per point of a sample. ``box_func(dtype)`` gives the Warp function
``box(q, radius, frame, dims) -> (first cell, last cell)`` of the cells a query must scan;
``permute`` reorders rows with a Warp kernel.
"""

import functools
import math
from typing import Optional

import torch
import warp as wp

from .. import _warp

# Cell width of the cell list, as a fraction of the radius: a query scans the cells that meet
# the cube [q - r, q + r] (5^3 cells at r / 2, a volume of (2.5 r)^3 against (3 r)^3 at r).
CELL = 0.5
# At most this many cells per reference point (per sample): sparse clouds get wider cells.
CELLS_PER_POINT = 2.0


@functools.cache
def cell_func(dtype: torch.dtype):
    s = _warp.scalar(dtype)

    @wp.func
    def cell(x: s, low: s, inv_h: s, n: int):
        """Cell coordinate of x along one axis, clamped to [-1, n] (inf included)."""
        return int(wp.floor(wp.clamp((x - low) * inv_h, s(-1.0), s(n))))

    return cell


@functools.cache
def box_func(dtype: torch.dtype):
    s = _warp.scalar(dtype)
    cell = cell_func(dtype)

    @wp.func
    def box(q: _warp.vec3(dtype), radius: s, frame: wp.array(dtype=s), dims: wp.vec3i):
        """First and last cell (x, y, z) that may hold a point within ``radius`` of q, clamped to the grid."""
        inv_h = frame[3]
        reach = radius + s(1e-3) / inv_h  # a margin for rounding at cell borders
        lo = wp.vec3i(0, 0, 0)
        hi = wp.vec3i(0, 0, 0)
        for a in range(3):
            lo[a] = wp.max(cell(q[a] - reach, frame[a], inv_h, dims[a]), 0)
            hi[a] = wp.min(cell(q[a] + reach, frame[a], inv_h, dims[a]), dims[a] - 1)
        return lo, hi

    return box


@_warp.kernels
def _starts_kernel():
    """``starts[c]``: the first index of sorted ``keys`` >= c, for c = 0 .. total."""

    @wp.kernel(enable_backward=False, module="unique")
    def starts_of(start: int, keys: wp.array(dtype=wp.int64), total: int, starts: wp.array(dtype=wp.int64)):
        i = wp.tid() + start  # 0 .. n: the cells after key i - 1 up to key i start at i
        n = keys.shape[0]
        first = int(0)
        if i > 0:
            first = int(keys[i - 1]) + 1
        last = total
        if i < n:
            last = int(keys[i])
        for c in range(first, last + 1):
            starts[c] = wp.int64(i)

    return starts_of


@_warp.kernels
def _permute_kernel(dtype: torch.dtype):
    """Rows in another order: ``dst[a] = src[order[a]]``, or ``dst[order[a]] = src[a]`` (inverse)."""
    s = _warp.scalar(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def permute(start: int, src: wp.array2d(dtype=s), order: wp.array(dtype=wp.int64), inverse: int, dst: wp.array2d(dtype=s)):
        a = wp.tid() + start
        j = int(order[a])
        for c in range(src.shape[1]):
            if inverse != 0:
                dst[j, c] = src[a, c]
            else:
                dst[a, c] = src[j, c]

    return permute


def permute(x: torch.Tensor, order: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x[order] (or the inverse) with a Warp kernel: torch's multi-threaded gather would start an
    OpenMP team, and a forked DataLoader worker hangs in its next torch operation when it has."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _warp.launch(_permute_kernel(x.dtype), x.shape[0], [x.contiguous(), order, int(inverse), out], like=x)
    return out


@_warp.kernels
def _key_kernel(dtype: torch.dtype):
    """Linear (sample, z, y, x) cell index of each point; non-finite coordinates count as 0."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def cell_keys(
        start: int,
        points: wp.array(dtype=v),
        groups: wp.array(dtype=wp.int32),
        frame: wp.array(dtype=s),
        dims: wp.vec3i,
        key: wp.array(dtype=wp.int64),
    ):
        i = wp.tid() + start
        p = points[i]
        c = wp.vec3i(0, 0, 0)
        for a in range(3):
            x = (p[a] - frame[a]) * frame[3]
            if wp.isfinite(x):
                c[a] = wp.clamp(int(wp.floor(wp.clamp(x, s(0.0), s(dims[a])))), 0, dims[a] - 1)
        cells = wp.int64(dims[0]) * wp.int64(dims[1]) * wp.int64(dims[2])
        key[i] = wp.int64(groups[i]) * cells + (wp.int64(c[2]) * wp.int64(dims[1]) + wp.int64(c[1])) * wp.int64(dims[0]) + wp.int64(c[0])

    return cell_keys


class CellList:
    """Reference points sorted into a dense grid of cells (one grid per sample), built in torch.

    ``order`` sorts the points by (sample, z, y, x) cell; ``starts[c] .. starts[c + 1]`` are the
    sorted points of cell c; ``rows`` orders the queries the same way (for memory locality).
    Cells are ``CELL * radius`` wide, wider when that would make more than ``CELLS_PER_POINT``
    cells per point of a sample. One host read (the bounding box and the number of samples).
    """

    def __init__(self, query, ref, radius: float, query_group, ref_group):
        dev = ref.device
        corners = torch.stack([ref.amin(0), ref.amax(0)]).double()
        samples = torch.zeros(1, dtype=torch.int64, device=dev)
        if ref_group is not None and ref_group.numel():
            samples = torch.maximum(ref_group.amax().long(), query_group.amax().long())[None] + 1
        host = torch.cat([corners.flatten(), samples.double()]).cpu().tolist()
        low, high, groups = host[0:3], host[3:6], max(int(host[6]), 1)
        if not all(map(math.isfinite, low + high)):  # non-finite points (validate=False): box of the others
            finite = ref[torch.isfinite(ref).all(1)].double()
            box = torch.stack([finite.amin(0), finite.amax(0)]) if finite.shape[0] else finite.new_zeros(2, 3)
            low, high = box.cpu().tolist()
        side = [max(h - lo, 0.0) for lo, h in zip(low, high)]
        width = CELL * radius
        volume = max(side[0] * side[1] * side[2], 1e-300)
        width = max(width, (volume * groups / (CELLS_PER_POINT * max(ref.shape[0], 1))) ** (1.0 / 3.0))
        dims = [max(1, min(int(x / width) + 1, 1 << 20)) for x in side]
        while dims[0] * dims[1] * dims[2] * groups > CELLS_PER_POINT * ref.shape[0] + 64 and max(dims) > 1:
            width *= 1.25  # a flat or thin cloud: the volume bound above was too generous
            dims = [max(1, min(int(x / width) + 1, 1 << 20)) for x in side]
        self.dims = wp.vec3i(dims[0], dims[1], dims[2])
        self.frame = torch.tensor([*low, 1.0 / width], dtype=ref.dtype, device=dev)
        key = self._key(ref, ref_group, dims)
        key, self.order = torch.sort(key)
        total = dims[0] * dims[1] * dims[2] * groups
        self.starts = torch.empty(total + 1, dtype=torch.int64, device=dev)
        # a Warp kernel, not torch.searchsorted (see _permute)
        _warp.launch(_starts_kernel(), key.shape[0] + 1, [key, total, self.starts], like=ref)
        self.rows = torch.sort(self._key(query, query_group, dims)).indices

    def _key(self, points, group, dims):
        """Linear (sample, z, y, x) cell index of each point (out-of-grid coordinates clamped)."""
        key = torch.empty(points.shape[0], dtype=torch.int64, device=points.device)
        if points.shape[0]:
            groups = groups_of(group, points)
            vec = _warp.array(points.contiguous(), dtype=_warp.vec3(points.dtype))
            _warp.launch(_key_kernel(points.dtype), points.shape[0], [vec, groups, self.frame, self.dims, key], like=points)
        return key


def groups_of(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Contiguous int32 sample ids for a kernel (zeros for one cloud)."""
    if t is None:
        return torch.zeros(like.shape[0], dtype=torch.int32, device=like.device)
    return t.to(torch.int32).clamp_min(0).contiguous()
