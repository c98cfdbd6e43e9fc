"""Sparse 3-d convolution over integer voxel coordinates: submanifold (spconv's ``SubMConv3d``,
the sparse convolutions of Point Transformer V3 and MinkowskiNet; stride 1, odd kernel size),
and the strided maps and their transposes behind :mod:`pcops.compat.spconv`'s ``SparseConv3d``
and ``SparseInverseConv3d``.

Sites are (sample, x, y, z) with ``grid_coord`` (N, 3) integers and optional ``batch`` sample ids;
they must be unique. Outputs live at the input sites (submanifold: the active set does not
grow). With ``r = K // 2`` and the offsets ``d(a, b, c) = ((a, b, c) - r) * dilation`` for
``a, b, c = 0 .. K-1``, numbered ``k = (a * K + b) * K + c`` (x slowest, z fastest):

    out[i] = bias + sum_k  features[j] @ weight[k]     over the k with a site j at grid_coord[i] + d_k
                                                           (same sample)

This is ``torch.nn.functional.conv3d`` (a cross-correlation) on the dense grid (D, H, W) =
(x, y, z) with ``padding = r * dilation``, read back at the active sites, when
``weight[k] = conv3d_weight[:, :, a, b, c].T`` (i.e. ``weight.view(K, K, K, Cin, Cout) ==
conv3d_weight.permute(2, 3, 4, 1, 0)``) and the inactive voxels hold zeros.

One kernel map serves every kind: output site o (of M) reads, through offset (a, b, c), the
input at ``o * stride - padding + (a, b, c) * dilation`` (per-axis kernel sizes, strides,
paddings and dilations). The submanifold map is the case outputs = inputs, stride 1, padding
``r * dilation``; a strided convolution's outputs are the cells of its output grid that some
input reaches (``pcops::sparse_conv_sites_map``, a data-dependent count declared with
``new_dynamic_size()``); its transpose (spconv's inverse convolution) runs the same pairs
swapped. Each offset pairs an output with at most one input and an input with at most one
output, in every kind, so each offset's adds touch every row at most once, both ways.

The kernel map is found by sorting: the input sites' keys (sample, x, y, z) packed into one
int64 are sorted once, and a Warp kernel walks them along the output cells in key order, one
thread per two leading taps (a, b) of the offsets and block of outputs: a binary search for the
block's first cell, then a merge (the cells of every output shift by the same key step per
offset, so they stay in order; a cell outside the inputs' box holds none). A submanifold map's
outputs are its inputs, in the order already sorted; a strided map's outputs are sorted once
more. It is returned as a
:class:`KernelMap` that layers with the same sites reuse. The
convolution gathers, per offset, the rows of the pairs, multiplies them by the offset's
weight and adds them to their outputs with one ``index_add_`` (an offset hits each output at
most once, so every row gets one add per offset, in offset order: deterministic on every device,
and faster on the CPU than a gather, add and ``index_put_``); in a submanifold map the centre
offset maps every site to itself and
is one matrix product (only there: in a strided map it links different sites).
The backward pass is the same with the pairs reversed. Both are custom ops with exact fakes
and registered autograd (gradients to features, weight and bias).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _layout, _deprecated, _threads, _validate, _warp

_KEY_LIMIT = 2.0**62  # samples * spans of the packed keys
_SENTINEL = 2**63 - 1  # after the last input key: above every query
_BLOCK, _CUDA_BLOCK = 128, 8  # outputs per thread of the map's query (one binary search, then a walk)
_CHUNK = 8192  # pairs per gather-multiply-add step of the convolution on the CPU


class KernelMap(NamedTuple):
    """The kernel map of a set of sites for one kernel size and dilation (see :func:`sparse_kernel_map`).

    ``neighbours`` (K^3, N) int64: ``neighbours[k, i]`` is the site at ``grid_coord[i] + d_k`` (or -1); ``in_index`` and
    ``out_index`` (K^3 N,) int64: the pairs (input site j, output site i) of every offset, offset
    by offset (k ascending, then i ascending), in their first P = ``counts.sum()`` entries and -1
    after them (every size follows from N and K: no graph break under ``torch.compile``);
    ``counts`` (K^3,) int64: the pairs of each offset.
    """

    neighbours: torch.Tensor
    in_index: torch.Tensor
    out_index: torch.Tensor
    counts: torch.Tensor
    kernel_size: int
    dilation: int


@_warp.kernels
def _merge_kernel():
    """The query of the kernel map: sorted input keys against sorted output cells, one merge per offset."""

    @wp.kernel(enable_backward=False, module="unique")
    def query(
        start: int,
        block: int,
        keys: wp.array(dtype=wp.int64),
        order: wp.array(dtype=wp.int64),
        qkey: wp.array(dtype=wp.int64),
        qpos: wp.array2d(dtype=wp.int64),
        qrow: wp.array(dtype=wp.int64),
        sx: wp.int64,
        sy: wp.int64,
        sz: wp.int64,
        kx: int,
        ky: int,
        kz: int,
        dx: int,
        dy: int,
        dz: int,
        neighbours: wp.array2d(dtype=wp.int64),
    ):
        # thread: one (a, b) of the offsets and one block of the outputs in key order; output i
        # reads, through offset (a, b, c), the input whose key is qkey[i] + (a dx sy + b dy) sz + c dz,
        # if that cell (qpos[i] + the offset) is in the inputs' box. The queries of a block ascend,
        # so after one binary search the input keys (ascending, ending in a sentinel above every
        # query) are walked once for c = 0; the other c continue from there.
        m = qkey.shape[0]
        t = wp.tid() + start
        blocks = (m + block - 1) // block
        row = t // blocks
        lo = (t - row * blocks) * block
        hi = wp.min(lo + block, m)
        a = row // ky
        b = row - a * ky
        ox = wp.int64(a) * wp.int64(dx)
        oy = wp.int64(b) * wp.int64(dy)
        step = (ox * sy + oy) * sz
        target = qkey[lo] + step
        p = int(0)
        h = keys.shape[0] - 1
        while p < h:
            mid = (p + h) // 2
            if keys[mid] < target:
                p = mid + 1
            else:
                h = mid
        first = row * kz
        for i in range(lo, hi):
            q = qkey[i] + step
            while keys[p] < q:
                p += 1
            x = qpos[i, 1] + ox
            y = qpos[i, 2] + oy
            inside = qpos[i, 0] >= wp.int64(0) and x >= wp.int64(0) and x < sx and y >= wp.int64(0) and y < sy
            out = qrow[i]
            r = p
            for c in range(kz):
                z = qpos[i, 3] + wp.int64(c) * wp.int64(dz)
                qc = q + wp.int64(c) * wp.int64(dz)
                while keys[r] < qc:
                    r += 1
                found = wp.int64(-1)
                if inside and z >= wp.int64(0) and z < sz and keys[r] == qc:
                    found = order[r]
                neighbours[first + c, out] = found

    return query


def _sample_ranks(ids: torch.Tensor, out_ids: torch.Tensor, n: int):
    """(input ids, output ids, number of samples) as 0-based: shifted by the smallest input id,
    or their ranks among the input ids where those are sparse or huge (an output id that no input
    has becomes -1)."""
    host = torch.stack([ids.amin(), ids.amax()]).tolist()
    low, high = host
    if high - low < n:
        return ids - low, out_ids - low, high - low + 1
    values, ranks = torch.unique(ids, return_inverse=True)
    where = torch.searchsorted(values, out_ids).clamp_(max=values.shape[0] - 1)
    return ranks, torch.where(values[where] == out_ids, where, -1), values.shape[0]


def _duplicate(grid_coord: torch.Tensor, i: int):
    return ValueError(
        f"grid_coord has duplicate sites: site {i} ({', '.join(map(str, grid_coord[i].tolist()))}) appears twice in one sample. "
        "Sparse convolution needs unique sites (as spconv does); merge them first (e.g. pcops.grid_sample)"
    )


def _searched_map(c, ids, out_coord, out_ids, low, span, kernel_size, stride, padding, dilation, validate):
    """(K, M) neighbours: the inputs' packed keys sorted, and the outputs' cells in key order walked
    along them, one merge per offset and block of outputs (:func:`_merge_kernel`)."""
    m, dev = out_coord.shape[0], c.device
    k3 = kernel_size[0] * kernel_size[1] * kernel_size[2]
    rel = c - c.new_tensor(low)
    keys, order = torch.sort(((ids * span[0] + rel[:, 0]) * span[1] + rel[:, 1]) * span[2] + rel[:, 2])
    if validate:
        same = (keys[1:] == keys[:-1]).nonzero()
        if same.shape[0]:
            first = int(same[0, 0])
            raise _duplicate(c, max(int(order[first]), int(order[first + 1])))
    origin = out_coord * c.new_tensor(stride) - c.new_tensor(padding) - c.new_tensor(low)
    if stride == [1, 1, 1] and out_coord.shape == c.shape and torch.equal(out_coord, c) and torch.equal(out_ids, ids):
        # outputs = inputs (a submanifold map): their cells' keys are the inputs' keys, shifted
        qrow, qkey = order, keys - ((padding[0] * span[1] + padding[1]) * span[2] + padding[2])
    else:
        qkey, qrow = torch.sort(((out_ids * span[0] + origin[:, 0]) * span[1] + origin[:, 1]) * span[2] + origin[:, 2])
    qpos = torch.cat([out_ids[:, None], origin], 1).index_select(0, qrow)
    keys = torch.cat([keys, keys.new_full((1,), _SENTINEL)])
    neighbours = torch.empty((k3, m), dtype=torch.int64, device=dev)  # the query writes every entry
    block = _BLOCK if dev.type == "cpu" else _CUDA_BLOCK
    threads = kernel_size[0] * kernel_size[1] * -(-m // block)  # one per (a, b) and block of outputs
    _warp.launch(_merge_kernel(), threads, [block, keys, order, qkey, qpos, qrow, *span, *kernel_size, *dilation, neighbours],
                 like=c, min_chunk=8)
    return neighbours


def _reach(c: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int]):
    """Per axis, the taps of each input that land on an output cell: a tap a lands iff a d = c + p
    (mod s), i.e. a = a0, a0 + t, ... (a0 < t, t = s / gcd(d, s)): at most J = ceil(K / t) of the K,
    on the cells o0, o0 - d / gcd(d, s), ... -> per axis (cells (J, N), lowest first; their taps
    (J, N); where a tap lands (J, N))."""
    axes = []
    for axis in range(3):
        k, s, d = kernel_size[axis], stride[axis], dilation[axis]
        t = s // math.gcd(d, s)
        q = c[:, axis] + padding[axis]
        a0 = torch.full_like(q, -1)
        for r in range(min(t, k) - 1, -1, -1):
            a0 = torch.where(torch.remainder(q - r * d, s) == 0, r, a0)
        tap = a0 + torch.arange(-(-k // t) - 1, -1, -1, device=c.device)[:, None] * t
        axes.append((torch.div(q - tap * d, s, rounding_mode="floor"), tap, (a0 >= 0) & (tap < k)))
    return axes


def _map_pairs(
    grid_coord: torch.Tensor, batch: Optional[torch.Tensor], out_coord: torch.Tensor, out_batch: Optional[torch.Tensor],
    kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int], validate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel map from the N input sites to the M output sites: output i, offset (a, b, c)
    (``k = (a K1 + b) K2 + c``) reads the input at ``out_coord[i] * stride - padding + (a, b, c) *
    dilation`` in the same sample. -> (neighbours (K, M), in_index (K M,), out_index (K M,), counts (K,)).

    Every offset is injective both ways (the input of an output is one cell; an input cell is
    reached through offset k from one output cell at most), which the convolution ops' plain
    indexed writes rely on, in the map and in its transpose. The pairs are read off the (K, M)
    table in one ``nonzero`` (offset-major, so sorted), the counts by a ``searchsorted`` of the
    offsets' bounds in it."""
    n, m, dev = grid_coord.shape[0], out_coord.shape[0], grid_coord.device
    k3 = kernel_size[0] * kernel_size[1] * kernel_size[2]
    if n == 0 or m == 0:
        empty = torch.full((k3, m), -1, dtype=torch.int64, device=dev)
        return empty, empty.view(-1).clone(), empty.view(-1).clone(), torch.zeros(k3, dtype=torch.int64, device=dev)
    c = grid_coord.to(torch.int64)
    ids = torch.zeros(n, dtype=torch.int64, device=dev) if batch is None else batch.to(torch.int64)
    out_ids = torch.zeros(m, dtype=torch.int64, device=dev) if out_batch is None else out_batch.to(torch.int64)
    ids, out_ids, samples = _sample_ranks(ids, out_ids, n)
    host = torch.cat([c.amin(0), c.amax(0)]).tolist()
    low, high = host[0:3], host[3:6]
    span = [h - lo + 1 for lo, h in zip(low, high)]
    # the keys of the outputs' cells and of the taps that may land in the sites' box: the sites' keys
    # shifted by up to the padding and the kernel's reach (or the box's span, beyond which no tap lands) per axis
    reach = [min((k - 1) * d, n) + abs(p) for k, d, p, n in zip(kernel_size, dilation, padding, span)]
    if ((samples * span[0] + reach[0]) * span[1] + reach[1]) * span[2] + reach[2] >= _KEY_LIMIT:
        raise ValueError(
            f"grid_coord spans {span} sites per axis over {samples} samples, with the padding and the kernel's reach ({reach}) too "
            "wide for the int64 keys of the kernel map (at most 2^62 in all)"
        )
    neighbours = _searched_map(c, ids, out_coord.to(torch.int64), out_ids, low, span, kernel_size, stride, padding, dilation,
                               validate)
    return (neighbours, *_pairs(neighbours))


def _pairs(neighbours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, M) neighbours -> the pairs (in_index (K M,), out_index (K M,), counts (K,)) of a kernel map."""
    (k3, m), dev = neighbours.shape, neighbours.device
    if m == 0:
        return neighbours.new_empty((0,)), neighbours.new_empty((0,)), torch.zeros(k3, dtype=torch.int64, device=dev)
    flat = neighbours.view(-1)
    pair = (flat >= 0).nonzero().view(-1)  # offset by offset, outputs ascending
    # pair is sorted: offset k's pairs are those in [k m, (k + 1) m)
    counts = torch.searchsorted(pair, torch.arange(k3 + 1, dtype=torch.int64, device=dev) * m).diff()
    p = pair.shape[0]
    in_index, out_index = torch.empty(k3 * m, dtype=torch.int64, device=dev), torch.empty(k3 * m, dtype=torch.int64, device=dev)
    torch.index_select(flat, 0, pair, out=in_index[:p])
    torch.remainder(pair, m, out=out_index[:p])
    in_index[p:] = -1
    out_index[p:] = -1
    return in_index, out_index, counts


@_threads.custom_op("pcops::sparse_kernel_map", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _kernel_map(
    grid_coord: torch.Tensor, batch: Optional[torch.Tensor], kernel_size: int, dilation: int, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grid_coord (N, 3) int, batch (N,) int or None -> (neighbours (K^3, N), in_index (P,), out_index (P,), counts (K^3,)).

    The submanifold map: the map to other sites with outputs = inputs, stride 1 and padding r d."""
    r = (kernel_size // 2) * dilation
    return _map_pairs(grid_coord, batch, grid_coord, batch, [kernel_size] * 3, [1, 1, 1], [r, r, r], [dilation] * 3, validate)


@_kernel_map.register_fake
def _(grid_coord, batch, kernel_size, dilation, validate=True):
    k3, n = kernel_size**3, grid_coord.shape[0]
    like = grid_coord.new_empty((0,), dtype=torch.int64)
    return like.new_empty((k3, n)), like.new_empty((k3 * n,)), like.new_empty((k3 * n,)), like.new_empty((k3,))


@_threads.custom_op("pcops::sparse_conv_map", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _conv_map(
    grid_coord: torch.Tensor, batch: Optional[torch.Tensor], out_coord: torch.Tensor, out_batch: Optional[torch.Tensor],
    kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int], validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel map from input sites (N, 3) to output sites (M, 3) of a strided convolution (see
    :func:`_map_pairs`) -> (neighbours (K, M), in_index (K M,), out_index (K M,), counts (K,))."""
    return _map_pairs(grid_coord, batch, out_coord, out_batch, kernel_size, stride, padding, dilation, validate)


@_conv_map.register_fake
def _(grid_coord, batch, out_coord, out_batch, kernel_size, stride, padding, dilation, validate=True):
    k3, m = kernel_size[0] * kernel_size[1] * kernel_size[2], out_coord.shape[0]
    like = grid_coord.new_empty((0,), dtype=torch.int64)
    return like.new_empty((k3, m)), like.new_empty((k3 * m,)), like.new_empty((k3 * m,)), like.new_empty((k3,))


def _candidates(grid_coord, batch, kernel_size, stride, padding, dilation, out_shape):
    """The output cells each input reaches (:func:`_reach`: per axis at most ceil(K / (s / gcd(d, s)))
    of the K taps land) -> (their keys (sample, x, y, z) packed in the output grid, the smallest
    sample id, the input and the offset k of each), candidates ordered (J_x, J_y, J_z, N), N
    innermost."""
    dev, n = grid_coord.device, grid_coord.shape[0]
    ids = torch.zeros(n, dtype=torch.int64, device=dev) if batch is None else batch.to(torch.int64)
    id_low, id_high = torch.stack([ids.amin(), ids.amax()]).tolist() if n else (0, 0)
    if float(id_high - id_low + 1) * out_shape[0] * out_shape[1] * out_shape[2] >= _KEY_LIMIT:
        raise ValueError(f"the output grid {out_shape} over {id_high - id_low + 1} samples is too wide for int64 keys (at most 2^62 cells)")
    key, valid, k = (ids - id_low)[None, :], None, None
    axes = _reach(grid_coord.to(torch.int64), kernel_size, stride, padding, dilation)
    for (o, tap, ok), size, ksize in zip(axes, out_shape, kernel_size):
        # the candidates (J_x, ..., N) of the axes so far, N innermost (contiguous broadcasts)
        key = key.unsqueeze(-2) * size + o
        ok = ok & (o >= 0) & (o < size)
        valid = ok if valid is None else valid.unsqueeze(-2) & ok
        k = tap if k is None else k.unsqueeze(-2) * ksize + tap
    where = valid.view(-1).nonzero().view(-1)
    return key.view(-1).index_select(0, where), id_low, torch.remainder(where, max(n, 1)), k.reshape(-1).index_select(0, where)


def _decode(key: torch.Tensor, out_shape: list[int], id_low: int, dtype: torch.dtype):
    """Packed output keys -> (out_coord (M, 3) of ``dtype``, out_batch (M,) int64)."""
    sx, sy, sz = out_shape
    z, rest = key % sz, torch.div(key, sz, rounding_mode="floor")
    y, rest = rest % sy, torch.div(rest, sy, rounding_mode="floor")
    x, sample = rest % sx, torch.div(rest, sx, rounding_mode="floor")
    return torch.stack([x, y, z], 1).to(dtype), sample + id_low


@_threads.custom_op("pcops::sparse_conv_sites_map", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _conv_sites_map(
    grid_coord: torch.Tensor, batch: Optional[torch.Tensor], kernel_size: list[int], stride: list[int], padding: list[int],
    dilation: list[int], out_shape: list[int], validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output sites of a strided convolution, every cell o of the output grid ``[0, out_shape)``
    with an input site at ``o * stride - padding + (a, b, c) * dilation`` for some offset (sorted by
    (sample, x, y, z)), and its kernel map to them: the cells the inputs reach sorted once, each
    cell's rank among them its output, each candidate one pair (input, offset, output) -> (out_coord (M, 3), out_batch (M,), in_index (P,), out_index
    (P,), counts (K,)): the P pairs offset by offset, outputs ascending, unpadded (M is a dynamic
    size already, so P costs no other graph break). Two inputs on one (offset, output) pair are
    one site twice (ValueError with ``validate``)."""
    k3, dev = kernel_size[0] * kernel_size[1] * kernel_size[2], grid_coord.device
    key, id_low, rows, k = _candidates(grid_coord, batch, kernel_size, stride, padding, dilation, out_shape)
    key, order = torch.sort(key)
    first = torch.ones_like(key, dtype=torch.bool)
    torch.ne(key[1:], key[:-1], out=first[1:])
    out = torch.cumsum(first, 0) - 1  # the output of each sorted candidate
    unique = key.masked_select(first)
    m = unique.shape[0]
    slot, by = torch.sort(k.index_select(0, order) * m + out)  # offset by offset, outputs ascending
    in_index, out_index = rows.index_select(0, order.index_select(0, by)), out.index_select(0, by)
    if validate:  # two inputs on one (offset, output) pair are one site twice
        same = (slot[1:] == slot[:-1]).nonzero()
        if same.shape[0]:
            first_same = int(same[0, 0])
            raise _duplicate(grid_coord, max(int(in_index[first_same]), int(in_index[first_same + 1])))
    counts = torch.searchsorted(slot, torch.arange(k3 + 1, dtype=torch.int64, device=dev) * m).diff()
    return (*_decode(unique, out_shape, id_low, grid_coord.dtype), in_index, out_index, counts)


@_conv_sites_map.register_fake
def _(grid_coord, batch, kernel_size, stride, padding, dilation, out_shape, validate=True):
    k3, ctx = kernel_size[0] * kernel_size[1] * kernel_size[2], torch.library.get_ctx()
    m, p = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    like = grid_coord.new_empty((0,), dtype=torch.int64)
    return grid_coord.new_empty((m, 3)), like.new_empty((m,)), like.new_empty((p,)), like.new_empty((p,)), like.new_empty((k3,))


def _segments(counts: torch.Tensor, n: int, submanifold: bool):
    """(k, start, stop) of the offsets with pairs, and whether the centre offset is the identity
    map (then left out of the segments). Only a submanifold map (outputs = inputs, the kernel
    centred on them) can have one: there the centre offset pairs each site with itself, and
    with all N pairs present it is ``out = features @ weight[centre]``. In a strided map or its
    transpose the centre offset links different sites, so it stays a segment like the others."""
    k3 = counts.shape[0]
    host = counts.tolist()
    centre = k3 // 2
    bounds = [0]
    for c in host:
        bounds.append(bounds[-1] + c)
    segments = [(k, bounds[k], bounds[k + 1]) for k in range(k3) if host[k]]
    identity = submanifold and host[centre] == n
    return [s for s in segments if not (identity and s[0] == centre)], identity, centre


@_threads.custom_op("pcops::sparse_conv", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _sparse_conv(
    features: torch.Tensor, weight: torch.Tensor, in_index: torch.Tensor, out_index: torch.Tensor, counts: torch.Tensor,
    num_out: Optional[int] = None,
) -> torch.Tensor:
    """features (N, Cin), weight (K^3, Cin, Cout), a kernel map's pairs -> (M, Cout).

    ``num_out`` None: the pairs are a submanifold map of the N sites (M = N); else M = ``num_out``
    output sites (a strided map, or a map's transpose with its pairs swapped)."""
    n = features.shape[0]
    m = n if num_out is None else num_out
    segments, identity, centre = _segments(counts, n, num_out is None)
    if identity:
        out = features @ weight[centre]
    else:
        out = features.new_zeros((m, weight.shape[2]))
    _accumulate(out, out_index, features, in_index, weight, segments)
    return out


def _accumulate(out: torch.Tensor, out_rows: torch.Tensor, source: torch.Tensor, source_rows: torch.Tensor, weight: torch.Tensor,
                segments: list, transpose: bool = False) -> None:
    """``out[out_rows[p]] += source[source_rows[p]] @ weight[k]`` (``weight[k].T`` with ``transpose``)
    for the pairs p of each segment (k, a, b). Each offset reaches a row at most once, so the add of
    one offset is a plain add per row (deterministic). On the CPU in steps of at most ``_CHUNK``
    pairs through two reused buffers, which stay in cache between the gather, the product and the add."""
    if not segments:
        return
    longest = max(b - a for _, a, b in segments)
    step = _CHUNK if out.device.type == "cpu" else longest
    gathered = source.new_empty((min(step, longest), source.shape[1]))
    product = out.new_empty((min(step, longest), out.shape[1]))
    for k, a, b in segments:
        w = weight[k].t() if transpose else weight[k]
        for start in range(a, b, step):
            stop = min(start + step, b)
            torch.mm(torch.index_select(source, 0, source_rows[start:stop], out=gathered[: stop - start]), w,
                     out=product[: stop - start])
            out.index_add_(0, out_rows[start:stop], product[: stop - start])


@_sparse_conv.register_fake
def _(features, weight, in_index, out_index, counts, num_out=None):
    return features.new_empty((features.shape[0] if num_out is None else num_out, weight.shape[2]))


@_threads.custom_op("pcops::sparse_conv_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _sparse_conv_backward(
    grad: torch.Tensor, features: torch.Tensor, weight: torch.Tensor, in_index: torch.Tensor, out_index: torch.Tensor,
    counts: torch.Tensor, need_features: bool, need_weight: bool, num_out: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of features (N, Cin), grad of weight (K^3, Cin, Cout)) from grad (M, Cout); zeros where not needed."""
    n = features.shape[0]
    segments, identity, centre = _segments(counts, n, num_out is None)
    grad_f = features.new_zeros(features.shape)
    grad_w = weight.new_zeros(weight.shape)
    grad = grad.contiguous()
    if identity:
        if need_features:
            grad_f = grad @ weight[centre].t()
        if need_weight:
            grad_w[centre] = features.t() @ grad
    if need_features:  # the pairs reversed: an input site feeds each offset at most once
        _accumulate(grad_f, in_index, grad, out_index, weight, segments, transpose=True)
    if need_weight:
        for k, a, b in segments:
            grad_w[k] = features.index_select(0, in_index[a:b]).t() @ grad.index_select(0, out_index[a:b])
    return grad_f, grad_w


@_sparse_conv_backward.register_fake
def _(grad, features, weight, in_index, out_index, counts, need_features, need_weight, num_out=None):
    return features.new_empty(features.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    features, weight, in_index, out_index, counts, num_out = inputs
    ctx.save_for_backward(features, weight, in_index, out_index, counts)
    ctx.num_out = num_out


def _backward(ctx, grad):
    features, weight, in_index, out_index, counts = ctx.saved_tensors
    need_f, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_f, grad_w = _sparse_conv_backward(grad, features, weight, in_index, out_index, counts, need_f, need_w,
                                                          ctx.num_out)
    return (grad_f if need_f else None), (grad_w if need_w else None), None, None, None, None


_sparse_conv.register_autograd(_backward, setup_context=_setup)


def _backward_setup(ctx, inputs, output):
    grad, features, weight, in_index, out_index, counts, _need_f, _need_w, num_out = inputs
    ctx.save_for_backward(grad, features, weight, in_index, out_index, counts)
    ctx.num_out = num_out


def _backward_backward(ctx, grad_grad_f, grad_grad_w):
    """The backward (grad_f = A_W^T g, grad_w = d(g . conv(f, W))/dW) is bilinear: with
    upstream gradients (u, U) of (grad_f, grad_w), d/dg = conv(u, W) + conv(f, U),
    d/df = A_U^T g and d/dW = d(g . conv(u, W))/dW: the same two ops again."""
    grad, features, weight, in_index, out_index, counts = ctx.saved_tensors
    need_g, need_f, need_w = ctx.needs_input_grad[:3]
    pairs, m = (in_index, out_index, counts), ctx.num_out
    u, big_u = grad_grad_f, grad_grad_w
    d_grad = d_features = d_weight = None
    if need_g:
        d_grad = _sparse_conv(u, weight, *pairs, m) + _sparse_conv(features, big_u, *pairs, m)
    if need_f:
        d_features = _sparse_conv_backward(grad, features, big_u, *pairs, True, False, m)[0]
    if need_w:
        d_weight = _sparse_conv_backward(grad, u, weight, *pairs, False, True, m)[1]
    return d_grad, d_features, d_weight, None, None, None, None, None, None


_sparse_conv_backward.register_autograd(_backward_backward, setup_context=_backward_setup)


def _convolve(features: torch.Tensor, weight: torch.Tensor, in_index: torch.Tensor, out_index: torch.Tensor,
              counts: torch.Tensor, num_out: Optional[int] = None) -> torch.Tensor:
    """The convolution op on a kernel map's pairs (features (N, Cin) and weight (K^3, Cin, Cout)
    contiguous, of one dtype): (N, Cout) for a submanifold map (``num_out`` None), else (num_out, Cout)."""
    _threads.reverse_only("sparse_conv3d", features, weight)
    return _sparse_conv(features, weight, in_index, out_index, counts, num_out)


# The largest kernel size and dilation: K^3 offsets and a dilation that a kernel's 32-bit int takes
MAX_KERNEL_SIZE, MAX_DILATION = 1289, 2**31 - 1


def _numbers(kernel_size, dilation, weighted: bool = True) -> None:
    """The checks of a kernel size (None: the weight's, where there is a weight: ``weighted``) and
    a dilation."""
    if kernel_size is not None or not weighted:
        _validate.int_option("kernel_size", kernel_size, 1, MAX_KERNEL_SIZE, odd=True)
    _validate.int_option("dilation", dilation, 1, MAX_DILATION)


def _sites(grid_coord, batch, kernel_size, dilation) -> None:
    """The checks of the sites of :func:`sparse_kernel_map` (shapes, dtypes, devices, numbers: its
    kernel size given, there being no weight to take it from)."""
    _layout.sites(grid_coord, batch)
    _numbers(kernel_size, dilation, weighted=False)


@_deprecated.renamed(coords="grid_coord")
@_threads.limits
def sparse_kernel_map(grid_coord: torch.Tensor, *, batch: Optional[torch.Tensor] = None, kernel_size: int = 3, dilation: int = 1,
                      validate: bool = True) -> KernelMap:
    """The kernel map of unique sites ``grid_coord`` (N, 3) (with optional ``batch`` (N,) sample ids).

    For each site i and offset k (``d_k = ((a, b, c) - K // 2) * dilation``, ``k = (a * K + b) * K + c``),
    the site j of the same sample at ``grid_coord[i] + d_k``. Reuse it across layers with the same
    sites, kernel size and dilation (``sparse_conv3d(..., kernel_map=km)``). Duplicate sites
    raise ValueError (``validate=False`` skips that check: a duplicate site then gets the
    neighbours of one of its copies). Every size of the result follows from N and K (the pairs are padded to
    K^3 N with -1), so ``torch.compile`` captures it without a graph break. (``coords`` is the
    keyword's former name, accepted with a FutureWarning until the next release.)

    Example:
        >>> import torch, pcops
        >>> kmap = pcops.sparse_kernel_map(torch.tensor([[0, 0, 0], [1, 0, 0], [5, 5, 5]]), kernel_size=3)
        >>> kmap.counts.sum()  # (input, output) pairs: each site itself, and the two neighbours each other
        tensor(5)
    """
    kernel_size, dilation = _validate.plain(kernel_size), _validate.plain(dilation)
    _sites(grid_coord, batch, kernel_size, dilation)
    neighbours, in_index, out_index, counts = _kernel_map(grid_coord, batch, kernel_size, dilation, bool(validate))
    return KernelMap(neighbours, in_index, out_index, counts, kernel_size, dilation)


_WEIGHT_SHAPE = "(K^3, Cin, Cout) or (K, K, K, Cin, Cout)"


def _kernel_size_of(weight: torch.Tensor, kernel_size) -> int:
    """K from a weight of shape (K^3, Cin, Cout) or (K, K, K, Cin, Cout), checked against ``kernel_size``."""
    k = round(weight.shape[0] ** (1.0 / 3.0)) if weight.dim() == 3 else weight.shape[0]
    if k**3 != weight.shape[0] * (1 if weight.dim() == 3 else k * k) or (weight.dim() == 5 and weight.shape[:3] != (k, k, k)):
        raise ValueError(f"weight must be a tensor of shape {_WEIGHT_SHAPE}, got shape {tuple(weight.shape)}")
    if kernel_size is not None:
        _validate.same_size("kernel_size", kernel_size, "weight", k, "kernel size K")
    return k


@_deprecated.renamed(coords="grid_coord")
@_threads.limits
def sparse_conv3d(
    features: torch.Tensor,
    grid_coord: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    batch: Optional[torch.Tensor] = None,
    kernel_size: Optional[int] = None,
    dilation: int = 1,
    kernel_map: Optional[KernelMap] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Submanifold sparse convolution (stride 1) of ``features`` at the sites ``grid_coord``.

    Args:
        features: Tensor of shape (N, Cin), one row per site.
        grid_coord: int tensor (N, 3) of unique integer grid coordinates (may be None with
            ``kernel_map``; ``coords``, its former name, is accepted with a FutureWarning
            until the next release).
        weight: Tensor of shape (K^3, Cin, Cout) or (K, K, K, Cin, Cout), K odd; offset
            ``k = (a * K + b) * K + c`` is ``((a, b, c) - K // 2) * dilation``, so
            ``weight.view(K, K, K, Cin, Cout) == conv3d_weight.permute(2, 3, 4, 1, 0)``.
        bias: optional Tensor of shape (Cout,).
        batch: optional int tensor (N,) of sample ids: sites of different samples never meet.
        kernel_size: optional check of K (taken from ``weight``).
        dilation: int >= 1, the spacing of the kernel's taps.
        kernel_map: a :class:`KernelMap` of these sites from :func:`sparse_kernel_map` (or an
            earlier call), reused instead of a new search (a ``grid_coord`` given with it is
            checked for its shape and dtype only: the map holds the sites).
        validate: check features and weight for NaN/inf (eagerly only) and the sites for
            duplicates (:func:`sparse_kernel_map`).

    Returns:
        Tensor of shape (N, Cout) in the promoted dtype of features, weight and bias (float16
        and bfloat16 are computed in float32): ``conv3d`` on the dense grid read at the sites.
        Differentiable with respect to features, weight and bias.

    Example:
        >>> import torch, pcops
        >>> grid_coord = torch.tensor([[0, 0, 0], [1, 0, 0], [5, 5, 5]])
        >>> features = torch.ones(3, 2)
        >>> weight = torch.ones(27, 2, 4)  # (kernel_size^3, C_in, C_out)
        >>> pcops.sparse_conv3d(features, grid_coord, weight)  # a submanifold convolution: sums over the 3^3 neighbours
        tensor([[4., 4., 4., 4.],
                [4., 4., 4., 4.],
                [2., 2., 2., 2.]])
    """
    _validate.tensor("features", features, ndim=2, shape_doc="(N, Cin)")
    _validate.tensor("weight", weight, ndim=(3, 5), shape_doc=_WEIGHT_SHAPE)
    kernel_size, dilation = _validate.plain(kernel_size), _validate.plain(dilation)
    _numbers(kernel_size, dilation)
    k = _kernel_size_of(weight, kernel_size)
    if k % 2 == 0:
        raise ValueError(f"weight has K = {k} taps per axis (shape {tuple(weight.shape)}): K must be odd (a submanifold kernel has a centre)")
    cin, cout = weight.shape[-2], weight.shape[-1]
    _validate.same_size("features", features.shape[1], "weight", cin, "number of input channels Cin")
    if bias is not None:
        _validate.tensor("bias", bias, ndim=1, size=cout, shape_doc="(Cout,)")
    _validate.same_device(features=features, weight=weight, bias=bias, grid_coord=grid_coord)
    if kernel_map is None:
        if grid_coord is None:
            raise ValueError("grid_coord is None: pass the sites' grid_coord or their kernel_map")
        if isinstance(grid_coord, torch.Tensor):  # (else sparse_kernel_map names its type)
            _validate.same_size("features", features.shape[0], "grid_coord", grid_coord.shape[0], "number of rows (one per site)")
        kernel_map = sparse_kernel_map(grid_coord, batch=batch, kernel_size=k, dilation=dilation, validate=validate)
    else:
        _validate.instance("kernel_map", kernel_map, KernelMap, "pcops.KernelMap")
        _validate.same_size("kernel_map.kernel_size", kernel_map.kernel_size, "weight", k, "kernel size K")
        _validate.same_size("kernel_map.dilation", kernel_map.dilation, "dilation", dilation, "dilation")
        _validate.same_size("features", features.shape[0], "kernel_map", kernel_map.neighbours.shape[1], "number of sites")
        if grid_coord is not None:
            _validate.integer("grid_coord", grid_coord, ndim=2, last=3, shape_doc="(N, 3)", what="integer grid coordinates")
            _validate.same_size("grid_coord", grid_coord.shape[0], "kernel_map", kernel_map.neighbours.shape[1], "number of sites")
    if validate and not torch.compiler.is_compiling():
        _validate.finite(features=features, weight=weight, bias=bias)
    dtype, out_dtype = _validate.compute_dtype(features, weight, *(() if bias is None else (bias,)))
    w = weight.to(dtype).reshape(k**3, cin, cout)
    out = _convolve(features.to(dtype).contiguous(), w.contiguous(), kernel_map.in_index, kernel_map.out_index, kernel_map.counts)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(out_dtype)


__all__ = ["KernelMap", "sparse_conv3d", "sparse_kernel_map"]
