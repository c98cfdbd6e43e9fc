"""Submanifold sparse 3-d convolution over integer voxel coordinates (spconv's ``SubMConv3d``,
the sparse convolutions of Point Transformer V3 and MinkowskiNet), stride 1, odd kernel size.

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

The kernel map (which site j feeds site i through offset k) is found with a hash table of the
sites, keys (sample, x, y, z) packed into one int64: built and queried by Warp kernels (the
build on one CPU thread, as Warp's CPU atomics are plain operations; the queries on all
cores). It is returned as a :class:`KernelMap` that layers with the same sites reuse. The
convolution gathers, per offset, the rows of the pairs, multiplies them by the offset's
weight and adds them to their outputs (offsets hit each output at most once, so the adds are
plain indexed writes); the centre offset maps every site to itself and is one matrix product.
The backward pass is the same with the pairs reversed. Both are custom ops with exact fakes
and registered autograd (gradients to features, weight and bias).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _batch, _deprecated, _validate, _warp

_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing multiplier (2^64 / golden ratio)
_KEY_LIMIT = 2.0**62  # samples * spans of the packed keys


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
def _hash_kernels():
    """(build, query) kernels of the open-addressing hash table of packed site keys."""

    @wp.func
    def slot(key: wp.int64, bits: int):
        h = wp.uint64(key) * wp.uint64(_GOLDEN)
        return int(h >> wp.uint64(64 - bits))

    @wp.func
    def pack(sample: wp.int64, x: wp.int64, y: wp.int64, z: wp.int64, sy: wp.int64, sz: wp.int64, sx: wp.int64):
        return ((sample * sx + x) * sy + y) * sz + z

    @wp.kernel(enable_backward=False, module="unique")
    def build(
        start: int,
        rel: wp.array2d(dtype=wp.int64),
        ids: wp.array(dtype=wp.int64),
        sx: wp.int64,
        sy: wp.int64,
        sz: wp.int64,
        bits: int,
        keys: wp.array(dtype=wp.int64),
        values: wp.array(dtype=wp.int64),
        duplicate: wp.array(dtype=wp.int64),
    ):
        i = wp.tid() + start
        key = pack(ids[i], rel[i, 0], rel[i, 1], rel[i, 2], sy, sz, sx)
        mask = keys.shape[0] - 1
        h = slot(key, bits)
        for _probe in range(keys.shape[0]):
            prev = wp.atomic_cas(keys, h, wp.int64(-1), key)
            if prev == wp.int64(-1):
                values[h] = wp.int64(i)
                return
            if prev == key:
                duplicate[0] = wp.int64(i) + wp.int64(1)
                return
            h = (h + 1) & mask

    @wp.kernel(enable_backward=False, module="unique")
    def query(
        start: int,
        rel: wp.array2d(dtype=wp.int64),
        ids: wp.array(dtype=wp.int64),
        sx: wp.int64,
        sy: wp.int64,
        sz: wp.int64,
        bits: int,
        keys: wp.array(dtype=wp.int64),
        values: wp.array(dtype=wp.int64),
        ksize: int,
        dilation: int,
        neighbours: wp.array2d(dtype=wp.int64),
    ):
        i = wp.tid() + start  # neighbours is (K^3, N): the pairs come out offset by offset
        half = ksize // 2
        mask = keys.shape[0] - 1
        for a in range(ksize):
            x = rel[i, 0] + wp.int64((a - half) * dilation)
            for b in range(ksize):
                y = rel[i, 1] + wp.int64((b - half) * dilation)
                for c in range(ksize):
                    z = rel[i, 2] + wp.int64((c - half) * dilation)
                    key = pack(ids[i], x, y, z, sy, sz, sx)
                    h = slot(key, bits)
                    found = wp.int64(-1)
                    for _probe in range(keys.shape[0]):
                        t = keys[h]
                        if t == key:
                            found = values[h]
                            break
                        if t == wp.int64(-1):
                            break
                        h = (h + 1) & mask
                    neighbours[(a * ksize + b) * ksize + c, i] = found

    return build, query


@torch.library.custom_op("pcops::sparse_kernel_map", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _kernel_map(
    grid_coord: torch.Tensor, batch: Optional[torch.Tensor], kernel_size: int, dilation: int, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grid_coord (N, 3) int, batch (N,) int or None -> (neighbours (K^3, N), in_index (P,), out_index (P,), counts (K^3,))."""
    n, k3, dev = grid_coord.shape[0], kernel_size**3, grid_coord.device
    neighbours = torch.empty((k3, n), dtype=torch.int64, device=dev)
    if n == 0:
        empty = lambda: torch.zeros(0, dtype=torch.int64, device=dev)  # noqa: E731 (outputs must not alias)
        return empty().view(k3, 0), empty(), empty(), torch.zeros(k3, dtype=torch.int64, device=dev)
    reach = (kernel_size // 2) * dilation
    c = grid_coord.to(torch.int64)
    ids = torch.zeros(n, dtype=torch.int64, device=dev) if batch is None else batch.to(torch.int64)
    host = torch.cat([c.amin(0), c.amax(0), ids.amin()[None], ids.amax()[None]]).tolist()
    low, high, id_low, id_high = host[0:3], host[3:6], host[6], host[7]
    if id_high - id_low >= n:  # sparse or huge sample ids: their ranks
        ids = torch.unique(ids, return_inverse=True)[1]
        id_low, id_high = 0, int(ids.max())
    ids = ids - id_low
    span = [h - lo + 2 * reach + 1 for lo, h in zip(low, high)]
    if float(id_high - id_low + 1) * span[0] * span[1] * span[2] >= _KEY_LIMIT:
        raise ValueError(
            f"grid_coord spans {span} sites per axis (with the kernel's reach) over {id_high - id_low + 1} samples: "
            "too wide for the int64 keys of the kernel map (at most 2^62 cells in all)"
        )
    rel = (c - c.new_tensor(low) + reach).contiguous()
    bits = max(4, math.ceil(math.log2(2 * n)))
    keys = torch.full((1 << bits,), -1, dtype=torch.int64, device=dev)
    values = torch.empty(1 << bits, dtype=torch.int64, device=dev)
    duplicate = torch.zeros(1, dtype=torch.int64, device=dev)
    build, query = _hash_kernels()
    # the build on one CPU thread: Warp's CPU compare-and-swap is not atomic across threads
    _warp.launch(build, n, [rel, ids, span[0], span[1], span[2], bits, keys, values, duplicate], like=grid_coord, min_chunk=n + 1)
    found = int(duplicate[0]) if validate else 0
    if found:
        i = found - 1
        raise ValueError(
            f"grid_coord has duplicate sites: site {i} ({', '.join(map(str, grid_coord[i].tolist()))}) appears twice in one sample. "
            "Submanifold convolution needs unique sites (as spconv does); merge them first (e.g. pcops.grid_sample)"
        )
    _warp.launch(query, n, [rel, ids, span[0], span[1], span[2], bits, keys, values, kernel_size, dilation, neighbours],
                 like=grid_coord, min_chunk=256)
    flat = neighbours.view(-1)
    pair = (flat >= 0).nonzero().view(-1)  # offset by offset, sites ascending
    counts = torch.bincount(torch.div(pair, n, rounding_mode="floor"), minlength=k3)
    p = pair.shape[0]
    in_index, out_index = torch.empty_like(flat), torch.empty_like(flat)  # the pairs, then -1 up to K^3 N
    torch.index_select(flat, 0, pair, out=in_index[:p])
    torch.remainder(pair, n, out=out_index[:p])
    in_index[p:] = -1
    out_index[p:] = -1
    return neighbours, in_index, out_index, counts


@_kernel_map.register_fake
def _(grid_coord, batch, kernel_size, dilation, validate=True):
    k3, n = kernel_size**3, grid_coord.shape[0]
    like = grid_coord.new_empty((0,), dtype=torch.int64)
    return like.new_empty((k3, n)), like.new_empty((k3 * n,)), like.new_empty((k3 * n,)), like.new_empty((k3,))


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


@torch.library.custom_op("pcops::sparse_conv", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
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
    for k, a, b in segments:
        rows, cols = out_index[a:b], in_index[a:b]
        # each offset reaches an output site at most once: a plain indexed write, no accumulation
        out.index_put_((rows,), out.index_select(0, rows) + features.index_select(0, cols) @ weight[k])
    return out


@_sparse_conv.register_fake
def _(features, weight, in_index, out_index, counts, num_out=None):
    return features.new_empty((features.shape[0] if num_out is None else num_out, weight.shape[2]))


@torch.library.custom_op("pcops::sparse_conv_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
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
    for k, a, b in segments:
        rows, cols = out_index[a:b], in_index[a:b]
        g = grad.index_select(0, rows)
        if need_features:  # an input site feeds each offset at most once: a plain indexed write
            grad_f.index_put_((cols,), grad_f.index_select(0, cols) + g @ weight[k].t())
        if need_weight:
            grad_w[k] = features.index_select(0, cols).t() @ g
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
    grad_f, grad_w = torch.ops.pcops.sparse_conv_backward(grad, features, weight, in_index, out_index, counts, need_f, need_w,
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
        d_grad = torch.ops.pcops.sparse_conv(u, weight, *pairs, m) + torch.ops.pcops.sparse_conv(features, big_u, *pairs, m)
    if need_f:
        d_features = torch.ops.pcops.sparse_conv_backward(grad, features, big_u, *pairs, True, False, m)[0]
    if need_w:
        d_weight = torch.ops.pcops.sparse_conv_backward(grad, u, weight, *pairs, False, True, m)[1]
    return d_grad, d_features, d_weight, None, None, None, None, None, None


_sparse_conv_backward.register_autograd(_backward_backward, setup_context=_backward_setup)


def _convolve(features: torch.Tensor, weight: torch.Tensor, in_index: torch.Tensor, out_index: torch.Tensor,
              counts: torch.Tensor, num_out: Optional[int] = None) -> torch.Tensor:
    """The convolution op on a kernel map's pairs (features (N, Cin) and weight (K^3, Cin, Cout)
    contiguous, of one dtype): (N, Cout) for a submanifold map (``num_out`` None), else (num_out, Cout)."""
    return torch.ops.pcops.sparse_conv(features, weight, in_index, out_index, counts, num_out)


def _sites(grid_coord, batch, kernel_size, dilation) -> None:
    """The checks of the sites of :func:`sparse_kernel_map` (shapes, dtypes, devices, numbers)."""
    _batch.sites(grid_coord, batch)
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be an odd int >= 1, got {kernel_size!r}")
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be an int >= 1, got {dilation!r}")


@_deprecated.renamed(coords="grid_coord")
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
    """
    kernel_size, dilation = _validate.plain(kernel_size), _validate.plain(dilation)
    _sites(grid_coord, batch, kernel_size, dilation)
    neighbours, in_index, out_index, counts = torch.ops.pcops.sparse_kernel_map(grid_coord, batch, kernel_size, dilation, bool(validate))
    return KernelMap(neighbours, in_index, out_index, counts, kernel_size, dilation)


def _kernel_size_of(weight: torch.Tensor, kernel_size) -> int:
    """K from a weight of shape (K^3, Cin, Cout) or (K, K, K, Cin, Cout), checked against ``kernel_size``."""
    k = round(weight.shape[0] ** (1.0 / 3.0)) if weight.dim() == 3 else weight.shape[0]
    if k**3 != weight.shape[0] * (1 if weight.dim() == 3 else k * k) or (weight.dim() == 5 and weight.shape[:3] != (k, k, k)):
        raise ValueError(f"weight must have shape (K^3, Cin, Cout) or (K, K, K, Cin, Cout), got shape {tuple(weight.shape)}")
    if kernel_size is not None and kernel_size != k:
        raise ValueError(f"kernel_size={kernel_size} does not match weight of shape {tuple(weight.shape)} (K = {k})")
    return k


@_deprecated.renamed(coords="grid_coord")
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
            earlier call), reused instead of a new search.
        validate: check features and weight for NaN/inf (eagerly only) and the sites for
            duplicates (:func:`sparse_kernel_map`).

    Returns:
        Tensor of shape (N, Cout) in the promoted dtype of features and weight (float16 and
        bfloat16 are computed in float32): ``conv3d`` on the dense grid read at the sites.
        Differentiable with respect to features, weight and bias.
    """
    _validate.tensor("features", features, ndim=2, shape_doc="(N, Cin)")
    _validate.tensor("weight", weight)
    if weight.dim() not in (3, 5):
        raise ValueError(f"weight must have shape (K^3, Cin, Cout) or (K, K, K, Cin, Cout), got shape {tuple(weight.shape)}")
    k = _kernel_size_of(weight, _validate.plain(kernel_size))
    if k % 2 == 0:
        raise ValueError(f"weight has K = {k} taps per axis (shape {tuple(weight.shape)}): K must be odd (a submanifold kernel has a centre)")
    cin, cout = weight.shape[-2], weight.shape[-1]
    if features.shape[1] != cin:
        raise ValueError(f"features has {features.shape[1]} channels but weight expects Cin = {cin} (shape {tuple(weight.shape)})")
    if bias is not None:
        _validate.tensor("bias", bias, ndim=1, shape_doc=f"(Cout,) = ({cout},)")
        if bias.shape[0] != cout:
            raise ValueError(f"bias must be a tensor of shape (Cout,) = ({cout},), got shape {tuple(bias.shape)}")
    _validate.same_device(features=features, weight=weight, bias=bias, grid_coord=grid_coord)
    if kernel_map is None:
        if grid_coord is None:
            raise ValueError("grid_coord is None: pass the sites' grid_coord or their kernel_map")
        if grid_coord.shape[0] != features.shape[0] if isinstance(grid_coord, torch.Tensor) else False:
            raise ValueError(f"features must have one row per site: got {features.shape[0]} rows for grid_coord of shape {tuple(grid_coord.shape)}")
        kernel_map = sparse_kernel_map(grid_coord, batch=batch, kernel_size=k, dilation=_validate.plain(dilation), validate=validate)
    else:
        if not isinstance(kernel_map, KernelMap):
            raise TypeError(f"kernel_map must be a pcops.KernelMap, got {type(kernel_map).__name__}")
        if kernel_map.kernel_size != k or kernel_map.dilation != dilation:
            raise ValueError(f"kernel_map is for kernel_size={kernel_map.kernel_size}, dilation={kernel_map.dilation}; "
                             f"the call has kernel_size={k}, dilation={dilation}")
        if kernel_map.neighbours.shape[1] != features.shape[0]:
            raise ValueError(f"kernel_map has {kernel_map.neighbours.shape[1]} sites but features has {features.shape[0]} rows")
    if validate and not torch.compiler.is_compiling():
        _validate.finite(features=features, weight=weight, bias=bias)
    dtype, out_dtype = _validate.compute_dtype(features, weight, *(() if bias is None else (bias,)))
    w = weight.to(dtype).reshape(k**3, cin, cout)
    out = _convolve(features.to(dtype).contiguous(), w.contiguous(), kernel_map.in_index, kernel_map.out_index, kernel_map.counts)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(out_dtype)


__all__ = ["KernelMap", "sparse_conv3d", "sparse_kernel_map"]
