"""``torch_scatter``'s public functions on torch's own scatter / gather ops: change one import.

    from pcops.compat.torch_scatter import scatter, scatter_max, segment_csr, scatter_softmax

Argument names, defaults, shapes, in-place ``out=`` behaviour and return types are those of
torch_scatter 2.1.2 (as PyTorch Geometric and Pointcept call it): ``scatter`` and
``scatter_{sum,add,mean,mul,min,max}`` (``min`` / ``max`` return ``(out, arg)``, ``arg`` the
position along ``dim`` of the extremum, ``src.size(dim)`` for an empty slot, whose value is 0),
``segment_{sum,add,mean,min,max}_{csr,coo}``, ``segment_csr`` / ``segment_coo``, ``gather_csr``
/ ``gather_coo`` and the composites ``scatter_softmax``, ``scatter_log_softmax``,
``scatter_logsumexp`` and ``scatter_std``. ``index`` broadcasts as in torch_scatter (a 1-D
index runs along ``dim``; missing trailing dimensions are expanded).

No compiled extension: torch's ``scatter_reduce``, ``gather`` and ``searchsorted``, and pcops'
segment reduction op for ``segment_csr`` with a 1-D pointer and for ``scatter_max`` /
``scatter_min`` with a 1-D index (rows sorted by slot) of float32 / float64 values. Gradients
by autograd (``max`` / ``min`` send the gradient to the arg element only, as torch_scatter),
and every function is scriptable (``torch.jit.script``) and
traces under ``torch.compile(fullgraph=True)`` without a host read when the output size is
known (``dim_size=`` or ``out=``; ``segment_csr`` / ``gather_coo`` always; ``gather_csr`` with
``out=``). Where torch_scatter leaves the result open, pcops returns one fixed result: the arg
of a tie is the smallest position, and a NaN counts as the extremum. Details: docs/interop.md.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import check_tensor

__all__ = [
    "gather_coo",
    "gather_csr",
    "scatter",
    "scatter_add",
    "scatter_log_softmax",
    "scatter_logsumexp",
    "scatter_max",
    "scatter_mean",
    "scatter_min",
    "scatter_mul",
    "scatter_softmax",
    "scatter_std",
    "scatter_sum",
    "segment_add_coo",
    "segment_add_csr",
    "segment_coo",
    "segment_csr",
    "segment_max_coo",
    "segment_max_csr",
    "segment_mean_coo",
    "segment_mean_csr",
    "segment_min_coo",
    "segment_min_csr",
    "segment_sum_coo",
    "segment_sum_csr",
]


# ----------------------------------------------------------------------------------------------
# shapes (all static: no host read)


def _dim(dim: int, ndim: int) -> int:
    if dim < -ndim or dim >= max(ndim, 1):
        raise ValueError("dim must be in [-" + str(ndim) + ", " + str(max(ndim, 1)) + "), got " + str(dim))
    return dim + ndim if dim < 0 else dim


def _broadcast(index: torch.Tensor, other: torch.Tensor, dim: int) -> torch.Tensor:
    """``index`` expanded to ``other``'s shape: a 1-D index runs along ``dim``, leading size-1
    and missing trailing dimensions expand (torch_scatter's broadcasting)."""
    if index.dim() == 1:
        shape: List[int] = [1] * other.dim()
        if other.dim() > 0:
            shape[dim] = index.shape[0]
        index = index.view(shape)
    while index.dim() < other.dim():
        index = index.unsqueeze(-1)
    return index.expand(other.shape)


def _out_shape(src: torch.Tensor, dim: int, size: int) -> List[int]:
    shape: List[int] = list(src.shape)
    shape[dim] = size
    return shape


def _size(index: torch.Tensor, dim_size: Optional[int]) -> int:
    """The output size along ``dim``: ``dim_size``, else ``index.max() + 1`` (one host read)."""
    if dim_size is not None:
        return dim_size
    if index.numel() == 0:
        return 0
    return int(index.max()) + 1


def _src_size(src: torch.Tensor, index: torch.Tensor, dim_size: Optional[int]) -> int:
    """:func:`_size` of an index broadcast to ``src`` (torch_scatter's): 0 slots without
    ``dim_size`` where ``src`` holds no element, whatever a 1-D ``index`` holds."""
    if dim_size is None and src.numel() == 0:
        return 0
    return _size(index, dim_size)


def _check_index(src: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    """``index`` (any integer dtype) as int64: torch's scatters take int32 and int64 only, and
    torch.gather misreads an expanded int32 index on the CPU. In eager calls, ``src`` and the
    index (``name``) are tensors first (a TypeError naming the one that is not; a scripted
    call's arguments are typed)."""
    if not torch.jit.is_scripting():  # (a scripted function skips this branch)
        check_tensor("src", src)
        check_tensor(name, index)
    if index.is_floating_point() or index.dtype == torch.bool or index.is_complex():
        raise TypeError(name + " must be an integer tensor, got " + str(index.dtype))
    return index.long()


def _positions(src: torch.Tensor, dim: int) -> torch.Tensor:
    """(src.shape) int64: each element's position along ``dim``."""
    shape: List[int] = [1] * src.dim()
    shape[dim] = -1
    return torch.arange(src.shape[dim], device=src.device).view(shape).expand(src.shape)


def _reduce_arg(src: torch.Tensor, index: torch.Tensor, dim: int, out: Optional[torch.Tensor], size: int, mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """max / min (``mode`` "amax" / "amin") of ``src`` along ``dim`` by a broadcast ``index`` and
    the arg: the smallest position of the extremum (a NaN is one), ``src.size(dim)`` where no
    element of ``src`` holds the result (an empty slot, or ``out``'s own value kept)."""
    n = src.shape[dim]
    if out is None:
        value = src.new_zeros(_out_shape(src, dim, size)).scatter_reduce(dim, index, src.detach(), mode, include_self=False)
    else:
        value = out.detach().scatter_reduce(dim, index, src.detach(), mode, include_self=True)
    picked = value.gather(dim, index)
    hit = src.detach() == picked
    if src.is_floating_point():
        hit = hit | (torch.isnan(picked) & torch.isnan(src.detach()))
    pos = torch.where(hit, _positions(src, dim), n)
    arg = torch.full(value.shape, n, dtype=torch.long, device=src.device).scatter_reduce(dim, index, pos, "amin", include_self=True)
    if out is not None:
        return out.scatter_reduce_(dim, index, src, mode, include_self=True), arg
    if n == 0:  # nothing to pick: the empty reduction itself keeps src in the graph
        return src.new_zeros(value.shape).scatter_reduce(dim, index, src, mode, include_self=False), arg
    # the values as a gather of the args: the gradient goes to the arg element, as torch_scatter's
    res = src.gather(dim, arg.clamp(max=n - 1)).masked_fill(arg == n, 0)
    return res, arg


def _flat(rows: torch.Tensor) -> torch.Tensor:
    """(N, ...) as (N, F) (no -1 in the shape: N may be 0)."""
    cols = 1
    for k in rows.shape[1:]:
        cols = cols * k
    return rows.reshape(rows.shape[0], cols)


@torch.jit.unused
def _reverse_only(src: torch.Tensor) -> None:
    """pcops' segment_reduce op has no forward-mode derivative: an error where a tangent reaches it
    (:func:`pcops._threads.reverse_only`)."""
    from .. import _threads

    _threads.reverse_only("pcops.compat.torch_scatter (its max, min and CSR reductions)", src)


def _sorted_kernel(src: torch.Tensor, index: torch.Tensor, dim: int, size: int, reduce: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """max / min of a float32/float64 ``src`` by a 1-D ``index`` along ``dim``: the rows sorted
    by slot (a stable sort: tied rows keep their order, so the first arg stays the smallest
    position), then pcops' segment_reduce op over the sorted rows' pointer (one pass, its arg
    mapped back through the sort). An index outside [0, size) joins no slot."""
    n = src.shape[dim]
    rows = src.movedim(dim, 0)
    keys, perm = torch.sort(index.to(torch.long), stable=True)
    ptr = torch.searchsorted(keys, torch.arange(size + 1, device=src.device))
    if not torch.jit.is_scripting():  # (a scripted function skips this branch)
        _reverse_only(src)
    res, arg = torch.ops.pcops.segment_reduce(values=_flat(rows).index_select(0, perm), offsets=ptr, reduce=reduce, validate=False)
    arg = torch.where(arg < 0, n, perm.index_select(0, arg.clamp(min=0).reshape(-1)).view(arg.shape))
    shape: List[int] = [size] + list(rows.shape[1:])
    return res.reshape(shape).movedim(0, dim), arg.reshape(shape).movedim(0, dim)


def _no_grad(src: torch.Tensor) -> bool:
    """No gradient will be asked of ``src``: a max / min then needs no arg (only the backward reads it)."""
    return not (src.requires_grad and torch.is_grad_enabled())


def _extreme_values(src: torch.Tensor, index: torch.Tensor, dim: int, out: Optional[torch.Tensor], dim_size: Optional[int], mode: str) -> torch.Tensor:
    """The values of scatter_min / scatter_max (``mode`` "amin" / "amax") without their arg, by
    torch's own reduction: the same values (an index outside [0, size) of a 1-D index joins no
    slot, as in the sorted kernel)."""
    index = _check_index(src, index, "index")
    d = _dim(dim, src.dim())
    if out is not None:
        return out.scatter_reduce_(d, _broadcast(index, src, d), src, mode, include_self=True)
    size = _src_size(src, index, dim_size)
    if index.dim() == 1:
        index = torch.where((index >= 0) & (index < size), index, size)
        res = src.new_zeros(_out_shape(src, d, size + 1)).scatter_reduce(d, _broadcast(index, src, d), src, mode, include_self=False)
        return res.narrow(d, 0, size)
    return src.new_zeros(_out_shape(src, d, size)).scatter_reduce(d, _broadcast(index, src, d), src, mode, include_self=False)


def _use_kernel(src: torch.Tensor, index: torch.Tensor, dim: int, out: Optional[torch.Tensor]) -> bool:
    return out is None and index.dim() == 1 and src.dim() > 0 and index.shape[0] == src.shape[dim] > 0 and (src.dtype == torch.float32 or src.dtype == torch.float64)


# ----------------------------------------------------------------------------------------------
# scatter


def scatter_sum(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> torch.Tensor:
    """Sums ``src`` into slot ``index`` along ``dim`` (torch_scatter's ``scatter_sum``); adds
    into ``out`` in place when given. Empty slots are 0."""
    index = _check_index(src, index, "index")
    d = _dim(dim, src.dim())
    index = _broadcast(index, src, d)
    if out is None:
        size = _size(index, dim_size)
        return src.new_zeros(_out_shape(src, d, size)).scatter_add_(d, index, src)
    return out.scatter_add_(d, index, src)


def scatter_add(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> torch.Tensor:
    """``scatter_sum``."""
    return scatter_sum(src, index, dim, out, dim_size)


def scatter_mul(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> torch.Tensor:
    """Multiplies ``src`` into slot ``index`` along ``dim`` (``out`` in place when given);
    empty slots are 1."""
    index = _check_index(src, index, "index")
    d = _dim(dim, src.dim())
    index = _broadcast(index, src, d)
    if out is None:
        size = _size(index, dim_size)
        return src.new_ones(_out_shape(src, d, size)).scatter_reduce(d, index, src, "prod", include_self=True)
    return out.scatter_reduce_(d, index, src, "prod", include_self=True)


def scatter_mean(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> torch.Tensor:
    """Means of ``src`` per slot (empty slots 0; integer dtypes floor-divide, as torch_scatter's
    ``scatter_mean``). With ``out``: (out + sum) / count in place, as torch_scatter."""
    return _mean(src, index, dim, out, dim_size, "floor")


def _mean(src: torch.Tensor, index: torch.Tensor, dim: int, out: Optional[torch.Tensor], dim_size: Optional[int], rounding: str) -> torch.Tensor:
    """:func:`scatter_mean` with integer means rounded by ``rounding``: "floor" (torch_scatter's
    ``scatter_mean``, in Python) or "trunc" (its segment means, C++ integer division)."""
    index = _check_index(src, index, "index")
    res = scatter_sum(src, index, dim, out, dim_size)
    d = _dim(dim, src.dim())
    # counts over index's own shape (a 1-D index: one count per slot), then broadcast
    count_dim = d if index.dim() > d else index.dim() - 1
    ones = torch.ones(index.shape, dtype=res.dtype, device=res.device)
    count = ones.new_zeros(_out_shape(index, count_dim, res.shape[d])).scatter_add_(count_dim, index, ones).clamp_(min=1)
    count = _broadcast(count, res, d) if count.dim() == 1 else count
    while count.dim() < res.dim():
        count = count.unsqueeze(-1)
    if res.is_floating_point():
        return res.true_divide_(count)
    return res.div_(count, rounding_mode=rounding)


def scatter_min(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, argmin)``: minima per slot (0 for an empty slot) and their positions along
    ``dim`` (``src.size(dim)`` for an empty slot)."""
    index = _check_index(src, index, "index")
    d = _dim(dim, src.dim())
    if _use_kernel(src, index, d, out):
        return _sorted_kernel(src, index, d, _src_size(src, index, dim_size), "min")
    index = _broadcast(index, src, d)
    size = out.shape[d] if out is not None else _size(index, dim_size)
    return _reduce_arg(src, index, d, out, size, "amin")


def scatter_max(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, argmax)``: maxima per slot (0 for an empty slot) and their positions along
    ``dim`` (``src.size(dim)`` for an empty slot).

    Example::

        >>> from pcops.compat.torch_scatter import scatter_max
        >>> scatter_max(torch.tensor([1., 3., 2.]), torch.tensor([0, 0, 2]))
        (tensor([3., 0., 2.]), tensor([1, 3, 2]))
    """
    index = _check_index(src, index, "index")
    d = _dim(dim, src.dim())
    if _use_kernel(src, index, d, out):
        return _sorted_kernel(src, index, d, _src_size(src, index, dim_size), "max")
    index = _broadcast(index, src, d)
    size = out.shape[d] if out is not None else _size(index, dim_size)
    return _reduce_arg(src, index, d, out, size, "amax")


def scatter(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None, reduce: str = "sum") -> torch.Tensor:
    """Reduces ``src`` into slots ``index`` along ``dim`` (torch_scatter's ``scatter``);
    ``reduce`` is ``"sum"``, ``"add"``, ``"mul"``, ``"mean"``, ``"min"`` or ``"max"``.

    Example::

        >>> from pcops.compat.torch_scatter import scatter
        >>> src = torch.randn(10, 6, 64)
        >>> index = torch.tensor([0, 1, 0, 1, 2, 1])
        >>> scatter(src, index, dim=1, reduce="mean").shape
        torch.Size([10, 3, 64])
    """
    if reduce == "sum" or reduce == "add":
        return scatter_sum(src, index, dim, out, dim_size)
    if reduce == "mul":
        return scatter_mul(src, index, dim, out, dim_size)
    if reduce == "mean":
        return scatter_mean(src, index, dim, out, dim_size)
    if reduce == "min" or reduce == "max":
        if _no_grad(src):
            return _extreme_values(src, index, dim, out, dim_size, "a" + reduce)
        return scatter_min(src, index, dim, out, dim_size)[0] if reduce == "min" else scatter_max(src, index, dim, out, dim_size)[0]
    raise ValueError("reduce must be one of 'sum', 'add', 'mul', 'mean', 'min', 'max', got '" + reduce + "'")


# ----------------------------------------------------------------------------------------------
# segment_coo / segment_csr: along dimension index.dim() - 1 (indptr.dim() - 1)


def _coo_index(src: torch.Tensor, index: torch.Tensor, name: str) -> Tuple[torch.Tensor, int]:
    """``index`` (..., N) expanded to ``src``'s shape (leading size-1 and trailing dimensions)."""
    index = _check_index(src, index, name)
    d = index.dim() - 1
    if d < 0 or index.dim() > src.dim():
        raise ValueError(name + " must have 1 to src.dim() = " + str(src.dim()) + " dimensions, got " + str(index.dim()))
    if index.shape[-1] != src.shape[d]:
        raise ValueError(name + " must have src's size " + str(src.shape[d]) + " in its last dimension, got " + str(index.shape[-1]))
    lead: List[int] = list(src.shape[:d]) + [index.shape[-1]]
    idx = index.expand(lead)
    while idx.dim() < src.dim():
        idx = idx.unsqueeze(-1)
    return idx.expand(src.shape), d


def _coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor], dim_size: Optional[int], reduce: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    idx, d = _coo_index(src, index, "index")
    if index.dim() == 1:
        idx = index  # scatter broadcasts it along dim 0 (and picks the sorted kernel for max / min)
    if reduce == "sum":
        return scatter_sum(src, idx, d, out, dim_size), None
    if reduce == "mean":
        return _mean(src, idx, d, out, dim_size, "trunc"), None
    if reduce == "min":
        res, arg = scatter_min(src, idx, d, out, dim_size)
        return res, arg
    res, arg = scatter_max(src, idx, d, out, dim_size)
    return res, arg


def segment_sum_coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> torch.Tensor:
    """Sums of the rows of each slot of a sorted ``index`` along ``index.dim() - 1``."""
    return _coo(src, index, out, dim_size, "sum")[0]


def segment_add_coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> torch.Tensor:
    """``segment_sum_coo``."""
    return _coo(src, index, out, dim_size, "sum")[0]


def segment_mean_coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> torch.Tensor:
    """Means of each slot of a sorted ``index`` (empty slots 0)."""
    return _coo(src, index, out, dim_size, "mean")[0]


def segment_min_coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, argmin)`` of each slot of a sorted ``index``."""
    res, arg = _coo(src, index, out, dim_size, "min")
    assert arg is not None
    return res, arg


def segment_max_coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, argmax)`` of each slot of a sorted ``index``."""
    res, arg = _coo(src, index, out, dim_size, "max")
    assert arg is not None
    return res, arg


def segment_coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None, reduce: str = "sum") -> torch.Tensor:
    """Reduces ``src`` by a sorted ``index`` along ``index.dim() - 1`` (torch_scatter's
    ``segment_coo``); ``reduce`` is ``"sum"``, ``"add"``, ``"mean"``, ``"min"`` or ``"max"``.
    ``index`` need not be sorted here (the result is ``scatter``'s)."""
    if reduce == "sum" or reduce == "add":
        return _coo(src, index, out, dim_size, "sum")[0]
    if reduce == "mean" or reduce == "min" or reduce == "max":
        return _coo(src, index, out, dim_size, reduce)[0]
    raise ValueError("reduce must be one of 'sum', 'add', 'mean', 'min', 'max', got '" + reduce + "'")


def _csr_index(src: torch.Tensor, indptr: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """The slot of each row of ``src`` along ``indptr.dim() - 1`` (static shapes): segment s is
    rows indptr[s] .. indptr[s + 1] - 1; rows outside [indptr[0], indptr[-1]) go to slot S, one
    past the S = indptr.size(-1) - 1 segments, which the caller drops."""
    indptr = _check_index(src, indptr, "indptr")
    d = indptr.dim() - 1
    if d < 0 or indptr.dim() > src.dim():
        raise ValueError("indptr must have 1 to src.dim() = " + str(src.dim()) + " dimensions, got " + str(indptr.dim()))
    segments = max(indptr.shape[-1] - 1, 0)
    lead: List[int] = list(src.shape[:d])
    ptr = indptr.expand(lead + [indptr.shape[-1]]).to(torch.long).contiguous()
    rows = torch.arange(src.shape[d], device=src.device).expand(lead + [src.shape[d]]).contiguous()
    if indptr.shape[-1] == 0:
        slot = torch.zeros_like(rows)
    else:
        slot = torch.searchsorted(ptr, rows, right=True) - 1
        slot = torch.where((slot < 0) | (slot >= segments), segments, slot)
    return _broadcast(slot, src, d), d, segments


def _csr_kernel(src: torch.Tensor, indptr: torch.Tensor, reduce: str, need_arg: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A 1-D pointer over the rows of a float32/float64 ``src``: pcops' segment_reduce op (one
    pass, no atomics; its gradient goes to the first arg-extremum). The pointer is clamped into
    [0, N] and made non-decreasing, so that a bad one reads no row out of bounds."""
    n = src.shape[0]
    ptr = torch.cummax(indptr.to(torch.long).clamp(0, n), 0).values
    if (reduce == "sum" and src.dim() == 1) or ((reduce == "max" or reduce == "min") and not need_arg):
        # torch's segment reduction: the same values (empty segments 0), faster than the kernel for
        # one value per row and where no arg is asked; its sum's gradient is the same as the kernel's
        res = torch.segment_reduce(src, reduce, offsets=ptr, axis=0)
        if reduce != "sum":
            res = torch.where((ptr[1:] > ptr[:-1]).view([-1] + [1] * (src.dim() - 1)), res, 0)
        return res, None
    flat = _flat(src)
    if not torch.jit.is_scripting():  # (a scripted function skips this branch)
        _reverse_only(src)
    res, arg = torch.ops.pcops.segment_reduce(values=flat, offsets=ptr, reduce=reduce, validate=False)
    shape: List[int] = [res.shape[0]] + list(src.shape[1:])
    if reduce == "sum" or reduce == "mean":
        return res.reshape(shape), None
    return res.reshape(shape), torch.where(arg < 0, n, arg).reshape(shape)


def _csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor], reduce: str, need_arg: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    indptr = _check_index(src, indptr, "indptr")
    if indptr.dim() == 1 and indptr.shape[0] > 0 and src.dim() > 0 and (src.dtype == torch.float32 or src.dtype == torch.float64):
        res, arg = _csr_kernel(src, indptr, reduce, need_arg)
        if out is not None:
            return out.copy_(res), arg
        return res, arg
    slot, d, segments = _csr_index(src, indptr)
    arg: Optional[torch.Tensor] = None
    if reduce == "sum":
        res = scatter_sum(src, slot, d, None, segments + 1)
    elif reduce == "mean":
        res = _mean(src, slot, d, None, segments + 1, "trunc")
    elif reduce == "min":
        res, arg = scatter_min(src, slot, d, None, segments + 1)
    else:
        res, arg = scatter_max(src, slot, d, None, segments + 1)
    res = res.narrow(d, 0, segments)
    if arg is not None:
        arg = arg.narrow(d, 0, segments)
    if out is not None:
        return out.copy_(res), arg
    return res, arg


def segment_sum_csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sums of the segments of the CSR pointer ``indptr`` along ``indptr.dim() - 1``."""
    return _csr(src, indptr, out, "sum")[0]


def segment_add_csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``segment_sum_csr``."""
    return _csr(src, indptr, out, "sum")[0]


def segment_mean_csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Means of the segments of ``indptr`` (empty segments 0)."""
    return _csr(src, indptr, out, "mean")[0]


def segment_min_csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, argmin)`` of the segments of ``indptr``."""
    res, arg = _csr(src, indptr, out, "min")
    assert arg is not None
    return res, arg


def segment_max_csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, argmax)`` of the segments of ``indptr``."""
    res, arg = _csr(src, indptr, out, "max")
    assert arg is not None
    return res, arg


def segment_csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor] = None, reduce: str = "sum") -> torch.Tensor:
    """Reduces the segments of the CSR pointer ``indptr`` along ``indptr.dim() - 1``
    (torch_scatter's ``segment_csr``, as Pointcept's pooling calls it); ``reduce`` is
    ``"sum"``, ``"add"``, ``"mean"``, ``"min"`` or ``"max"``. ``out`` is overwritten.

    Example::

        >>> from pcops.compat.torch_scatter import segment_csr
        >>> segment_csr(torch.arange(6.), torch.tensor([0, 2, 5, 5, 6]), reduce="max")
        tensor([1., 4., 0., 5.])
    """
    if reduce == "sum" or reduce == "add":
        return _csr(src, indptr, out, "sum")[0]
    if reduce == "mean" or reduce == "min" or reduce == "max":
        return _csr(src, indptr, out, reduce, not _no_grad(src))[0]
    raise ValueError("reduce must be one of 'sum', 'add', 'mean', 'min', 'max', got '" + reduce + "'")


# ----------------------------------------------------------------------------------------------
# gather


def gather_coo(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[..., i, ...] = src[..., index[..., i], ...]`` along ``index.dim() - 1`` (the
    inverse of ``segment_coo``); ``out`` is overwritten when given."""
    index = _check_index(src, index, "index")
    d = index.dim() - 1
    if d < 0 or index.dim() > src.dim():
        raise ValueError("index must have 1 to src.dim() = " + str(src.dim()) + " dimensions, got " + str(index.dim()))
    shape = _out_shape(src, d, index.shape[-1])
    idx = index.expand(shape[: d + 1])
    while idx.dim() < src.dim():
        idx = idx.unsqueeze(-1)
    res = src.gather(d, idx.expand(shape))
    if out is not None:
        return out.copy_(res)
    return res


def gather_csr(src: torch.Tensor, indptr: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each segment's row of ``src`` repeated over the segment of ``indptr`` (the inverse of
    ``segment_csr``), along ``indptr.dim() - 1``; the output has ``indptr[..., -1]`` rows (one
    host read unless ``out`` is given, whose rows are overwritten)."""
    indptr = _check_index(src, indptr, "indptr")
    d = indptr.dim() - 1
    if d < 0 or indptr.dim() > src.dim():
        raise ValueError("indptr must have 1 to src.dim() = " + str(src.dim()) + " dimensions, got " + str(indptr.dim()))
    if out is not None:
        rows = out.shape[d]
    elif indptr.numel() == 0:
        rows = 0
    else:
        rows = int(indptr.reshape(-1)[-1])
    lead: List[int] = list(src.shape[:d])
    ptr = indptr.expand(lead + [indptr.shape[-1]]).to(torch.long).contiguous()
    pos = torch.arange(rows, device=src.device).expand(lead + [rows]).contiguous()
    if indptr.shape[-1] == 0 or src.shape[d] == 0:
        slot = torch.zeros_like(pos)
    else:
        slot = (torch.searchsorted(ptr, pos, right=True) - 1).clamp(0, src.shape[d] - 1)
    while slot.dim() < src.dim():
        slot = slot.unsqueeze(-1)
    res = src.gather(d, slot.expand(_out_shape(src, d, rows)))
    if out is not None:
        return out.copy_(res)
    return res


# ----------------------------------------------------------------------------------------------
# composites


def _floating(src: torch.Tensor, name: str) -> None:
    if not src.is_floating_point():
        raise ValueError(name + " computes over floating-point src only, got " + str(src.dtype))


def scatter_softmax(src: torch.Tensor, index: torch.Tensor, dim: int = -1, dim_size: Optional[int] = None) -> torch.Tensor:
    """The softmax of ``src`` within each slot of ``index`` along ``dim``.

    Example::

        >>> from pcops.compat.torch_scatter import scatter_softmax
        >>> scatter_softmax(torch.tensor([0., 0., 1.]), torch.tensor([0, 0, 1]))
        tensor([0.5000, 0.5000, 1.0000])
    """
    index = _check_index(src, index, "index")
    _floating(src, "scatter_softmax")
    d = _dim(dim, src.dim())
    index = _broadcast(index, src, d)
    top = scatter_max(src, index, d, None, dim_size)[0]
    shifted = (src - top.gather(d, index)).exp()
    total = scatter_sum(shifted, index, d, None, top.shape[d])
    return shifted / total.gather(d, index)


def scatter_log_softmax(src: torch.Tensor, index: torch.Tensor, dim: int = -1, eps: float = 1e-12, dim_size: Optional[int] = None) -> torch.Tensor:
    """The log-softmax of ``src`` within each slot: ``src - max - log(sum exp(src - max) + eps)``."""
    index = _check_index(src, index, "index")
    _floating(src, "scatter_log_softmax")
    d = _dim(dim, src.dim())
    index = _broadcast(index, src, d)
    top = scatter_max(src, index, d, None, dim_size)[0]
    shifted = src - top.gather(d, index)
    total = scatter_sum(shifted.exp(), index, d, None, top.shape[d])
    return shifted - (total + eps).log().gather(d, index)


def scatter_logsumexp(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None, eps: float = 1e-12) -> torch.Tensor:
    """``log(sum exp(src) + eps)`` per slot, computed as ``max + log(sum exp(src - max) + eps)``;
    empty slots 0. With ``out``: its values join each slot's sum, in place; slots whose result
    is not finite keep ``out``'s value (torch_scatter's rule)."""
    index = _check_index(src, index, "index")
    _floating(src, "scatter_logsumexp")
    d = _dim(dim, src.dim())
    index = _broadcast(index, src, d)
    if out is not None:
        dim_size = out.shape[d]
    size = _size(index, dim_size)
    top = src.new_full(_out_shape(src, d, size), float("-inf"))
    if out is not None:
        top = torch.maximum(top, out.detach())
    top = top.scatter_reduce(d, index, src.detach(), "amax", include_self=True)
    shifted = src - top.gather(d, index)
    shifted = shifted.masked_fill(torch.isnan(shifted), float("-inf"))
    base = torch.zeros_like(top) if out is None else (out - top).exp()
    total = base.scatter_add(d, index, shifted.exp())
    res = (total + eps).log() + top
    if out is None:
        return res.nan_to_num(neginf=0.0)
    keep = ~torch.isfinite(res)
    return out.copy_(torch.where(keep, out, res))


def scatter_std(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: Optional[torch.Tensor] = None, dim_size: Optional[int] = None, unbiased: bool = True) -> torch.Tensor:
    """Standard deviation per slot, ``sqrt(sum (src - mean)^2 / (count - unbiased + 1e-6))``
    with counts clamped to at least 1 (torch_scatter's formula: empty slots 0). With ``out``,
    the squared deviations are added to ``out`` first."""
    index = _check_index(src, index, "index")
    d = _dim(dim, src.dim())
    if out is not None:
        dim_size = out.shape[d]
    index = _broadcast(index, src, d)
    size = _size(index, dim_size)
    count = scatter_sum(torch.ones_like(src), index, d, None, size).clamp(min=1)
    mean = scatter_sum(src, index, d, None, size) / count
    dev = src - mean.gather(d, index)
    var = scatter_sum(dev * dev, index, d, out, size)
    if unbiased:
        count = (count - 1).clamp(min=1)
    return (var / (count + 1e-6)).sqrt()
