"""What the point and face hierarchies share: the Morton spread table and codes, and the depth
of a tree's leaves. One definition each, for the kd-tree (``ops/neighbours/nearest/_kdtree``),
the mesh hierarchy (``ops/mesh/_tree``) and the curve codes and FPS buckets, which call
:func:`pcops._warp_funcs.spread` inside their kernels.
"""

import functools

import torch
import warp as wp

from . import _warp, _warp_funcs


def leaf_depth(n: int, leaf: int) -> int:
    """The depth of the leaves of a tree that halves ``n`` items down to at most ``leaf`` per
    leaf: the smallest d with ``n <= leaf * 2^d``."""
    d = 0
    while (leaf << d) < n:
        d += 1
    return d


@_warp.kernels
def _table_kernel():
    @wp.kernel(enable_backward=False, module="unique")
    def table(start: int, out: wp.array(dtype=wp.int32)):
        """out[c] = spread(c) (len(out) <= 2^10, so int32)."""
        c = wp.tid() + start
        out[c] = wp.int32(_warp_funcs.spread(wp.int64(c)))

    return table


@functools.cache
def spread_table(bits: int, device: torch.device) -> torch.Tensor:
    """(2^bits,) int32: ``spread(c)`` of each c < 2^bits (bits <= 10), filled on the CPU once per
    size and device: the lookup of ``_warp_funcs.cells``' ``morton`` and of :func:`codes`."""
    out = torch.empty(1 << bits, dtype=torch.int32)
    _warp.launch(_table_kernel(), out.shape[0], [out], like=out)
    return out.to(device)


def codes(cells: torch.Tensor, bits: int = 10) -> torch.Tensor:
    """(M,) int64 Morton codes of integer cells (M, 3) in [0, 2^bits): ``x | y << 1 | z << 2``
    of their spread bits, as ``_warp_funcs.cells``' ``morton``."""
    table = _spread_table64(bits, cells.device)
    return table[cells[:, 0]] | (table[cells[:, 1]] << 1) | (table[cells[:, 2]] << 2)


@functools.cache
def _spread_table64(bits: int, device: torch.device) -> torch.Tensor:
    """:func:`spread_table` as int64 (the codes' dtype), made once per size and device."""
    return spread_table(bits, device).to(torch.int64)
