"""Segment reductions: sum / mean / max / min of the rows of each segment, with gradients.

Segments are given either as a CSR pointer ``offsets`` (S + 1,) over the rows (torch_scatter's
``segment_csr``: segment s is rows offsets[s] .. offsets[s + 1] - 1) or as a segment id per row
``ids`` (N,) in [0, num_segments), sorted or not (torch_scatter's ``scatter``). For a segment
with rows R_s:

    sum:  out[s] = sum_{r in R_s} values[r]          mean: out[s] = sum / |R_s|
    max:  out[s] = max_{r in R_s} values[r]          min:  out[s] = min_{r in R_s} values[r]
    an empty segment gives 0 for every reduction (torch_scatter's convention)

Per column, independently. The max/min gradient goes to the FIRST arg-extremum (the smallest
row index among tied rows; a NaN counts as the extremum), the row recorded in the forward pass.

One Warp kernel (a thread per segment on the CPU, per (segment, column) on CUDA: it walks its
segment's rows, no atomics, so results are deterministic) runs the forward pass, on the CPU (all
cores through :func:`pcops._warp.launch`) and CUDA; on the CPU it reads a row at a time, and a
max / min records its arg-extremum (only when a gradient is asked for: the arg costs more than
the reduction) in a second pass over the rows. One kernel runs the backward pass on CUDA; on
the CPU torch's own ops do. Segment ids are turned into a CSR pointer by a stable sort and
``searchsorted`` (static shapes: traceable).
"""

import math
from typing import Optional

import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp

REDUCTIONS = ("sum", "mean", "max", "min")


@_warp.kernels
def _kernels(dtype: torch.dtype, reduce: str, with_arg: bool = True, per_column: bool = True):
    """(forward, backward) of one float dtype and reduction; the reduction, for max/min whether
    the forward pass records the arg-extremum, and whether a forward thread takes one column of
    its segment (CUDA) or all of them (CPU) are fixed when the kernel is generated. A backward
    thread takes part of its segment's columns."""
    s = _warp.scalar(dtype)
    mode = REDUCTIONS.index(reduce)
    record = mode >= 2 and with_arg  # the forward pass writes the arg-extremum
    # a column at a time, accumulating in a register: CUDA (one column per thread); else (the CPU)
    # a row at a time, accumulating in ``out``: contiguous reads (docs/benchmarks.md, design choices)
    by_column = per_column

    # (``while`` loops over columns 0 .. cols - 1 on the CPU: the same loops over a column range
    # computed in the kernel, or Warp's ``for ... in range(lo, hi)``, are slower (docs/benchmarks.md, design choices))
    @wp.kernel(enable_backward=False, module="unique")
    def forward(
        start: int,
        values: wp.array2d(dtype=s),
        offsets: wp.array(dtype=wp.int64),
        out: wp.array2d(dtype=s),
        arg: wp.array2d(dtype=wp.int64),
    ):
        t = wp.tid() + start
        cols = values.shape[1]
        if wp.static(per_column):  # segment t // cols, its column t % cols
            seg = t // cols
            c0 = t - seg * cols
            c1 = c0 + 1
        else:  # segment t, every column
            seg = t
            c0 = int(0)
            c1 = cols
        lo = int(offsets[seg])
        hi = int(offsets[seg + 1])
        first = lo  # the first row to accumulate (max/min: the one after the segment's first)
        if wp.static(mode >= 2):
            if hi > lo:
                first = lo + 1
        c = int(c0)
        while c < c1:
            best = s(0.0)  # the running sum / extremum
            if wp.static(mode >= 2):
                if hi > lo:
                    best = values[lo, c]
            if wp.static(record and not by_column):
                arg[seg, c] = wp.int64(-1)
            if wp.static(by_column):
                at = int(-1)
                if hi > lo:
                    at = lo
                j = int(first)
                while j < hi:
                    v = values[j, c]
                    if wp.static(mode <= 1):
                        best += v
                    # larger (smaller for min) or a NaN, unless the best is NaN already: the first wins ties
                    elif wp.static(mode == 2):
                        if not (v <= best) and best == best:
                            best = v
                            at = j
                    else:
                        if not (v >= best) and best == best:
                            best = v
                            at = j
                    j += 1
                if wp.static(mode == 1):
                    if hi > lo:
                        best = best / s(float(hi - lo))
                if wp.static(record):
                    arg[seg, c] = wp.int64(at)
            out[seg, c] = best
            c += 1
        if wp.static(not by_column):
            j = int(first)
            while j < hi:
                c = int(c0)
                while c < c1:
                    v = values[j, c]
                    best = out[seg, c]
                    if wp.static(mode <= 1):
                        out[seg, c] = best + v
                    elif wp.static(mode == 2):  # (a select, not a branch: faster, docs/benchmarks.md)
                        out[seg, c] = wp.where(not (v <= best) and best == best, v, best)
                    else:
                        out[seg, c] = wp.where(not (v >= best) and best == best, v, best)
                    c += 1
                j += 1
            if wp.static(mode == 1):
                if hi > lo:
                    c = int(c0)
                    while c < c1:
                        out[seg, c] = out[seg, c] / s(float(hi - lo))
                        c += 1
            if wp.static(record):  # the arg: the first row equal to the extremum (or NaN as it), rows walked backwards
                j = hi - 1
                while j >= lo:
                    row = wp.int64(j)
                    c = int(c0)
                    while c < c1:
                        v = values[j, c]
                        best = out[seg, c]
                        arg[seg, c] = wp.where(v == best or (v != v and best != best), row, arg[seg, c])
                        c += 1
                    j -= 1

    @wp.kernel(enable_backward=False, module="unique")
    def backward(
        start: int,
        grad: wp.array2d(dtype=s),
        offsets: wp.array(dtype=wp.int64),
        parts: int,
        arg: wp.array2d(dtype=wp.int64),
        grad_values: wp.array2d(dtype=s),
    ):
        t = wp.tid() + start
        cols = grad.shape[1]
        seg = t // parts
        part = t - seg * parts
        c0 = part * cols // parts
        c1 = (part + 1) * cols // parts
        if wp.static(mode <= 1):
            lo = int(offsets[seg])
            hi = int(offsets[seg + 1])
            scale = s(1.0)
            if wp.static(mode == 1):
                if hi > lo:
                    scale = s(1.0) / s(float(hi - lo))
            for j in range(lo, hi):
                for c in range(c0, c1):
                    grad_values[j, c] = grad[seg, c] * scale
        else:  # every row of the segment written (0 but at the extremum): one sequential pass, no zero fill
            lo = int(offsets[seg])
            hi = int(offsets[seg + 1])
            for j in range(lo, hi):
                for c in range(c0, c1):
                    g = s(0.0)
                    if arg[seg, c] == wp.int64(j):
                        g = grad[seg, c]
                    grad_values[j, c] = g

    return forward, backward


def _parts(values: torch.Tensor) -> int:
    """Backward threads per segment: one walking all columns on the CPU (a segment's rows stay in
    the cache), one per column on CUDA (neighbouring threads read neighbouring columns)."""
    return 1 if values.device.type == "cpu" else max(1, values.shape[1])


def _arg_shape(values: torch.Tensor, segments: int, reduce: str, with_arg: bool = True) -> tuple[int, int]:
    return (segments, values.shape[1]) if reduce in ("max", "min") and with_arg else (0, values.shape[1])


def _torch_spread(grad: torch.Tensor, offsets: torch.Tensor, reduce: str, rows: int) -> torch.Tensor:
    """The CPU sum/mean backward: each segment's gradient repeated over its rows."""
    counts = offsets.diff()
    grad = grad.contiguous()  # autograd's gradient of a sum is expanded: repeat_interleave on it is far slower
    if reduce == "mean":
        grad = grad / counts.clamp_min(1).to(grad.dtype)[:, None]
    first, last = int(offsets[0]), int(offsets[-1])
    inner = grad.repeat_interleave(counts, dim=0, output_size=last - first)
    if first == 0 and last == rows:  # every row in a segment: no second copy
        return inner
    return torch.cat([grad.new_zeros((first, grad.shape[1])), inner, grad.new_zeros((rows - last, grad.shape[1]))])


@_threads.custom_op("pcops::segment_reduce", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _segment_reduce(values: torch.Tensor, offsets: torch.Tensor, reduce: str, validate: bool = False, with_arg: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """values (N, F) float32/64, offsets (S + 1,) int64 -> (out (S, F), arg (S, F) int64 for
    max/min with ``with_arg``: the row of each extremum, -1 for an empty segment; (0, F) for
    sum/mean and without ``with_arg``, when max/min have no gradient).
    ``validate``: check the pointer here (the caller could not: under ``torch.compile``)."""
    if validate:
        _layout.values(True, pointers={"offsets": (offsets, 0, values.shape[0])})
    return _warp_forward(values, offsets, reduce, with_arg)


def _warp_forward(values: torch.Tensor, offsets: torch.Tensor, reduce: str, with_arg: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass in the Warp kernel."""
    segments = offsets.shape[0] - 1
    out = values.new_empty((segments, values.shape[1]))
    arg = values.new_empty(_arg_shape(values, segments, reduce, with_arg), dtype=torch.int64)
    if segments == 0 or values.shape[1] == 0:
        return out, arg
    per_column = values.device.type != "cpu"  # neighbouring CUDA threads read neighbouring columns
    forward, _ = _kernels(values.dtype, reduce, with_arg or reduce in ("sum", "mean"), per_column)  # (sum/mean: one variant)
    arg_ = arg if arg.numel() else offsets.new_zeros((1, 1))
    _warp.launch(forward, segments * (values.shape[1] if per_column else 1), [values.contiguous(), offsets.contiguous(), out, arg_], like=values)
    return out, arg


@_segment_reduce.register_fake
def _(values, offsets, reduce, validate=False, with_arg=True):
    segments = offsets.shape[0] - 1
    return values.new_empty((segments, values.shape[1])), values.new_empty(_arg_shape(values, segments, reduce, with_arg), dtype=torch.int64)


@_threads.custom_op("pcops::segment_reduce_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _segment_reduce_backward(grad: torch.Tensor, offsets: torch.Tensor, arg: torch.Tensor, reduce: str, rows: int) -> torch.Tensor:
    """grad (S, F) of the output -> grad (rows, F) of the values (0 for rows in no segment)."""
    if grad.device.type == "cpu" and reduce in ("sum", "mean") and grad.shape[0] > 0:
        return _torch_spread(grad, offsets, reduce, rows)
    if grad.device.type == "cpu" and rows > 0:  # max/min: one scatter-add of each gradient to its row (empty segments add 0 to row 0)
        return grad.new_zeros((rows, grad.shape[1])).scatter_add_(0, arg.clamp_min(0), torch.where(arg >= 0, grad, 0))
    return _warp_backward(grad, offsets, arg, reduce, rows)


def _warp_backward(grad: torch.Tensor, offsets: torch.Tensor, arg: torch.Tensor, reduce: str, rows: int) -> torch.Tensor:
    """The backward pass in the Warp kernel (CUDA; on the CPU torch's own ops measured faster)."""
    if grad.shape[0] > 0:
        # the kernel writes every row of a segment: zero only the rows before and after them
        out = grad.new_empty((rows, grad.shape[1]))
        first, last = int(offsets[0]), int(offsets[-1])
        out[:first].zero_()
        out[last:].zero_()
    else:
        out = grad.new_zeros((rows, grad.shape[1]))
    if grad.shape[0] == 0 or grad.shape[1] == 0 or rows == 0:
        return out
    _, backward = _kernels(grad.dtype, reduce)
    parts = _parts(grad)
    arg_ = arg if arg.numel() else offsets.new_zeros((1, 1))
    _warp.launch(backward, grad.shape[0] * parts, [grad.contiguous(), offsets.contiguous(), parts, arg_, out], like=grad)
    return out


@_segment_reduce_backward.register_fake
def _(grad, offsets, arg, reduce, rows):
    return grad.new_empty((rows, grad.shape[1]))


def _setup_context(ctx, inputs, output):
    values, offsets, reduce, _validate_offsets, with_arg = inputs
    ctx.save_for_backward(offsets, output[1])
    ctx.reduce = reduce
    ctx.rows = values.shape[0]
    ctx.with_arg = with_arg


def _backward(ctx, grad_out, grad_arg):
    offsets, arg = ctx.saved_tensors
    if ctx.reduce in ("max", "min") and not ctx.with_arg:
        raise RuntimeError("pcops::segment_reduce: max/min called with with_arg=False record no arg-extremum and have no gradient")
    return _segment_reduce_backward(grad_out, offsets, arg, ctx.reduce, ctx.rows), None, None, None, None


torch.library.register_autograd("pcops::segment_reduce", _backward, setup_context=_setup_context)


def _backward_setup_context(ctx, inputs, output):
    _grad, offsets, arg, reduce, _rows = inputs
    ctx.save_for_backward(offsets, arg)
    ctx.reduce = reduce


def _backward_backward(ctx, grad_grad):
    """The backward is linear in the output gradient (the arg-max rows are constants): its own
    gradient is the forward reduction (sum, mean) or the gather at the arg-max rows (max, min)."""
    offsets, arg = ctx.saved_tensors
    if ctx.reduce in ("sum", "mean"):
        grad = _segment_reduce(grad_grad, offsets, ctx.reduce)[0]
    else:
        grad = torch.where(arg >= 0, grad_grad.gather(0, arg.clamp_min(0)), 0)
    return grad, None, None, None, None


torch.library.register_autograd("pcops::segment_reduce_backward", _backward_backward, setup_context=_backward_setup_context)


class _Permute(torch.autograd.Function):
    """``x[perm]`` for a permutation, with the inverse permutation's gather as its backward
    (index_select's own backward, an index_add, is several times slower on the CPU)."""

    @staticmethod
    def forward(x, perm, inverse):
        return x.index_select(0, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _lay_out(values, offsets, ids, reduce, num_segments) -> Optional[int]:
    """Checks of segment_reduce's arguments (shapes, dtypes, names); the number of segments of ``ids``
    (None for ``offsets``, or when it must be read from the ids)."""
    _validate.tensor("values", values, ndim=_validate.ROWS, shape_doc="(N, ...)")
    _validate.one_of("reduce", reduce, REDUCTIONS)
    _validate.exactly_one(": offsets a CSR pointer (S + 1,), ids a segment id per row (N,)", offsets=offsets, ids=ids)
    for name, t in (("offsets", offsets), ("ids", ids)):
        if t is not None:
            _validate.integer(name, t)
    _validate.same_device(values=values, offsets=offsets, ids=ids)
    if offsets is not None:
        if offsets.dim() != 1 or offsets.shape[0] < 1:
            raise ValueError(f"offsets must be a tensor of shape (S + 1,) with S >= 0, got shape {tuple(offsets.shape)}")
        _validate.at_most_one(": num_segments goes with ids; with offsets the number of segments is offsets.shape[0] - 1",
                              offsets=offsets, num_segments=num_segments)
        return None
    _validate.ids("ids", ids, values.shape[0], "(N,)")
    num_segments = _validate.plain(num_segments)
    _validate.compile_needs("num_segments", num_segments, "with ids, the output size would otherwise be read from the data")
    return None if num_segments is None else _validate.int_option("num_segments", num_segments, 0)


@_threads.limits
def segment_reduce(
    values: torch.Tensor,
    offsets: Optional[torch.Tensor] = None,
    ids: Optional[torch.Tensor] = None,
    reduce: str = "sum",
    num_segments: Optional[int] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Reduce the rows of ``values`` per segment (torch_scatter's ``segment_csr`` / ``scatter``).

    Args:
        values: floating Tensor of shape (N, ...); rows are reduced, the other dimensions kept.
        offsets: integer Tensor of shape (S + 1,), a CSR pointer: segment s is the rows
            offsets[s] .. offsets[s + 1] - 1 (non-decreasing, within [0, N]; empty segments
            allowed; rows outside [offsets[0], offsets[-1]) belong to no segment).
        ids: integer Tensor of shape (N,), the segment of each row, sorted or not (instead of
            ``offsets``). Rows with an id outside [0, num_segments) raise a ValueError eagerly;
            under ``torch.compile`` (where values are not checked) they belong to no segment.
        reduce: "sum", "mean", "max" or "min".
        num_segments: S with ``ids`` (default: ``ids.max() + 1``, read from the data, so
            REQUIRED under ``torch.compile``). Not used with ``offsets``.
        validate: check the values of ``offsets`` / ``ids`` (one host read; skipped under
            ``torch.compile`` for ``ids``). With False, offsets outside [0, N] or decreasing
            and ids outside [0, S) give unspecified sums, never a read out of bounds.

    Returns:
        Tensor of shape (S, ...) in the dtype of ``values`` (float16/bfloat16 reduced in
        float32). An empty segment gives 0 for every reduction. Differentiable with respect to
        ``values``: sum/mean spread the gradient over the segment; max/min send it to the first
        arg-extremum (the smallest row index among ties; NaN is the extremum when present).

    Example:
        >>> import torch, pcops
        >>> values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> pcops.segment_reduce(values, offsets=torch.tensor([0, 2, 2, 5]), reduce="sum")  # segments [0, 2), [2, 2), [2, 5)
        tensor([ 3.,  0., 12.])
        >>> pcops.segment_reduce(values, ids=torch.tensor([1, 0, 1, 0, 1]), reduce="max")
        tensor([4., 5.])
    """
    segments = _lay_out(values, offsets, ids, reduce, num_segments)
    n = values.shape[0]
    perm = inverse = None
    if offsets is None:
        if segments is None:
            _layout.values(validate, ranges={"ids": (ids, 0, None)})
            segments = int(ids.max()) + 1 if ids.numel() else 0
        else:
            _layout.values(validate, ranges={"ids": (ids, 0, segments - 1)})
        sorted_ids, perm = torch.sort(ids.to(torch.int64), stable=True)
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(n, device=perm.device))
        offsets = torch.searchsorted(sorted_ids, torch.arange(segments + 1, device=perm.device, dtype=torch.int64))
        return reduce_sorted(values, offsets, reduce, perm, inverse)  # offsets of sorted ids: a CSR pointer
    if not validate:  # unchecked: clamped into a pointer that reads no row out of bounds
        offsets = torch.cummax(offsets.clamp(0, n), 0).values
    return reduce_sorted(values, offsets, reduce, check=validate)


def reduce_sorted(values, offsets, reduce, perm=None, inverse=None, check: bool = False, name: str = "segment_reduce") -> torch.Tensor:
    """segment_reduce of ``values[perm]`` (``values`` if perm is None) over the CSR pointer
    ``offsets`` (``inverse``: the inverse permutation of ``perm``); ``check``: check the pointer
    (eagerly in one host read, else in the op); ``name``: the public function, in errors."""
    _threads.reverse_only(name, values)
    n = values.shape[0]
    shape = values.shape[1:]
    dtype, out_dtype = _validate.compute_dtype(values)
    flat = values.reshape(n, math.prod(shape)).to(dtype)
    if perm is not None:
        flat = _Permute.apply(flat, perm, inverse)  # rows in segment order: a CSR layout
    check = check and not _layout.values(True, pointers={"offsets": (offsets, 0, n)})
    with_arg = flat.requires_grad and torch.is_grad_enabled()  # the max/min backward's rows
    out, _ = _segment_reduce(flat, offsets.to(torch.int64), reduce, check, with_arg)
    return out.reshape(out.shape[0], *shape).to(out_dtype)


__all__ = ["segment_reduce"]
