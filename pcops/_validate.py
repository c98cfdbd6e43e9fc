"""Every input check of pcops, in one place. Two kinds, run at two moments:

Eager checks (metadata and Python values only: free, and also run under ``torch.compile``):
    :func:`layout` (the tensors of any batch layout: types, dtypes, ranks, shapes, devices),
    :func:`tensor`, :func:`points`, :func:`same_device`, :func:`ids` (shapes and dtypes),
    :func:`count` (``k``), :func:`positive_number` (``radius``, a number ``sigma``),
    :func:`scale` (a number or one-element tensor ``sigma``), :func:`scale_tensor` (a number
    ``sigma`` that rounds to 0 in the compute dtype) and :func:`groups_paired`. They run in the
    public functions and layers, before any work.

Value checks (read tensor data, so each is a host read, one device sync on CUDA; a
data-dependent branch would break ``torch.compile(fullgraph=True)``), only with
``validate=True``:
    :func:`op_values` (NaN/inf in points and features, sigma finite and > 0 in the compute
    dtype) runs inside the custom ops' real implementations, which always execute eagerly, so
    it holds under ``torch.compile`` too; :func:`layout_values` (lengths and batch ids in
    range) and the checks of tensors that enter no custom op (the features and a tensor sigma
    of ``knn_aggregate``) run in the public functions only when not compiling.

Numbers may be Python or NumPy scalars (``np.float32`` sigma, ``np.int64`` k).
"""

from __future__ import annotations

import math
import numbers

import torch


def tensor(name: str, t, *, ndim: int | None = None, last: int | None = None, shape_doc: str = "") -> None:
    """``t`` is a real floating tensor of rank ``ndim`` whose last dimension is ``last``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64), got {t.dtype}")
    if (ndim is not None and t.dim() != ndim) or (last is not None and t.shape[-1] != last):
        raise ValueError(f"{name} must be a tensor of shape {shape_doc}, got shape {tuple(t.shape)}")


def points(name: str, t, dim: int = 3) -> None:
    """``t`` is a point set of shape (P, dim) (dim 3 unless a feature-space op says otherwise)."""
    tensor(name, t, ndim=2, last=dim, shape_doc="(P, 3)" if dim == 3 else f"(P, D) with D = {dim}")


def same_device(**named: torch.Tensor) -> None:
    """All tensors live on one device."""
    devices = {name: t.device for name, t in named.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on the same device, got {listing}")


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (numbers.Real, torch.SymInt, torch.SymFloat))


def plain(value):
    """A NumPy scalar as the Python number it holds (``np.int64(8)`` -> 8); anything else unchanged,
    for the caller's own checks. Public functions pass their number arguments through it."""
    if value is None or isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat, torch.Tensor)):
        return value  # the common case, and what torch.compile traces (symbolic numbers)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def positive_number(name: str, value) -> None:
    """``value`` is a finite Python or NumPy number > 0.

    Under ``torch.compile`` a number may be symbolic: its value is then checked again inside
    the op (see the ops' real implementations), where it is concrete.
    """
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if torch.compiler.is_compiling():
        return
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")


def count(name: str, value, most: int | None = None, what: str = "") -> int:
    """``value`` is an integer (Python, NumPy or symbolic) with 1 <= value <= most; returned as an int."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not isinstance(value, torch.SymInt):
        value = int(value)
    if value <= 0:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be <= the number of {what}, got {name}={value} for {most} {what}")
    return value


def scale(name: str, value) -> None:
    """``value`` is a positive number or a one-element floating tensor (values checked in the op)."""
    if isinstance(value, torch.Tensor):
        tensor(name, value)
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
    else:
        positive_number(name, value)


def scale_tensor(value, dtype: torch.dtype, device, name: str = "sigma") -> torch.Tensor:
    """A checked scale (number or one-element tensor) as a 0-d tensor of ``dtype`` (differentiable).

    A number that rounds to 0 in ``dtype`` (the compute dtype) raises here, the same error
    :func:`positive_values` gives for a tensor that does.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype).reshape(())
    t = torch.tensor(float(value), dtype=dtype)
    if not torch.compiler.is_compiling():
        positive_values(name, t)
    return t.to(device)


def compute_dtype(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the kernels run in, dtype returned): float64 or float32; half types run in float32."""
    out = tensors[0].dtype
    for t in tensors[1:]:
        out = torch.promote_types(out, t.dtype)
    return (torch.float64 if out == torch.float64 else torch.float32), out


def finite(**named: torch.Tensor) -> None:
    """No NaN or inf in the tensors (None is skipped). Reads values."""
    for name, t in named.items():
        if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or inf (pass validate=False to skip this check)")


def positive_values(name: str, t: torch.Tensor) -> None:
    """All values finite and > 0 in ``t``'s dtype (the compute dtype). Reads values."""
    if t.numel() and not bool((torch.isfinite(t) & (t > 0)).all()):
        got = t.detach().cpu().reshape(-1)[:4].tolist()
        raise ValueError(f"{name} must be finite and > 0 in {t.dtype} (the dtype it is computed in), got {got}")


def op_values(validate: bool, sigma: torch.Tensor | None = None, **named: torch.Tensor) -> None:
    """The value checks of a custom op's real implementation: ``named`` tensors finite, sigma > 0."""
    if not validate:
        return
    finite(**named)
    if sigma is not None:
        positive_values("sigma", sigma)


def groups_paired(query_group, ref_group) -> None:
    """Both groups given or neither (an op's own arguments)."""
    if (query_group is None) != (ref_group is None):
        raise ValueError("query_group and ref_group must be given together")


def ids(name: str, t, size: int, shape_doc: str) -> None:
    """``t`` is None or an integer tensor of shape (size,): batch ids or lengths."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must be a tensor of shape {shape_doc} = ({size},), got shape {tuple(t.shape)}")


def ids_in_range(name: str, t, low: int, high) -> None:
    """All values of ``t`` (if given) in [low, high] (no upper bound if high is None). Reads values."""
    if t is None or not t.numel():
        return
    if bool((t < low).any()) or (high is not None and bool((t > high).any())):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} values must be {bound}, got min {int(t.min())}, max {int(t.max())}")


def layout(query, ref, features, *, query_lengths, ref_lengths, query_batch, ref_batch, dim: int | None = 3) -> bool:
    """Eager checks of any batch layout (see pcops._batch); True for the padded (B, P, 3) layout.

    ``dim`` is the points' last dimension (None: any D shared by query and ref).
    """
    tensor("query", query)
    padded = query.dim() == 3
    d = query.shape[-1] if dim is None else dim
    sym = "3" if dim == 3 else "D"
    if dim is None and isinstance(ref, torch.Tensor) and ref.dim() == query.dim() and ref.shape[-1] != d:
        raise ValueError(f"query and ref must have the same last dimension D, got query {tuple(query.shape)} and ref {tuple(ref.shape)}")
    if padded:
        tensor("query", query, ndim=3, last=d, shape_doc=f"(B, M, {sym})")
        tensor("ref", ref, ndim=3, last=d, shape_doc=f"(B, N, {sym})")
        if ref.shape[0] != query.shape[0]:
            raise ValueError(f"query and ref must have the same batch size B, got {query.shape[0]} and {ref.shape[0]}")
        if query_batch is not None or ref_batch is not None:
            raise ValueError("query_batch/ref_batch describe packed (P, 3) inputs; padded (B, P, 3) inputs take *_lengths")
    else:
        points("query", query, d)
        points("ref", ref, d)
        if query_lengths is not None or ref_lengths is not None:
            raise ValueError("query_lengths/ref_lengths describe padded (B, P, 3) inputs; packed inputs take *_batch")
        if (query_batch is None) != (ref_batch is None):
            raise ValueError("packed inputs need both query_batch and ref_batch")
    if features is not None:
        shape = "(B, N, F)" if padded else "(N, F)"
        tensor("features", features, ndim=ref.dim(), shape_doc=shape)
        if features.shape[:-1] != ref.shape[:-1]:
            raise ValueError(f"features must have one row per point of ref: got shape {tuple(features.shape)} for ref {tuple(ref.shape)}")
    b = query.shape[0] if padded else 0
    for name, t in (("query_lengths", query_lengths), ("ref_lengths", ref_lengths)):
        ids(name, t, b, "(B,)")
    ids("query_batch", query_batch, query.shape[0], "(M_total,)")
    ids("ref_batch", ref_batch, ref.shape[0], "(N_total,)")
    same_device(
        query=query, ref=ref, features=features, query_lengths=query_lengths, ref_lengths=ref_lengths,
        query_batch=query_batch, ref_batch=ref_batch,
    )
    return padded


def layout_values(query, ref, *, query_lengths, ref_lengths, query_batch, ref_batch) -> None:
    """Value checks of a batch layout: lengths within the padded rows, ids >= 0. Reads values:
    call only when validating and not compiling."""
    padded = query.dim() == 3
    ids_in_range("query_lengths", query_lengths, 0, query.shape[1] if padded else 0)
    ids_in_range("ref_lengths", ref_lengths, 0, ref.shape[1] if padded else 0)
    ids_in_range("query_batch", query_batch, 0, None)
    ids_in_range("ref_batch", ref_batch, 0, None)
