"""Input checks shared by every pcops op.

Shape, dtype and device checks are free (they read metadata only) and run in the public
functions, also under ``torch.compile``. Checks that read values (NaN/inf, sigma > 0) would be
data-dependent branches under ``torch.compile(fullgraph=True)``: they run inside the custom
ops' real implementations, which always execute eagerly, through :func:`finite` and
:func:`positive_values`.
"""

from __future__ import annotations

import math

import torch


def tensor(name: str, t, *, ndim: int | None = None, last: int | None = None, shape_doc: str = "") -> None:
    """``t`` is a real floating tensor of rank ``ndim`` whose last dimension is ``last``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64), got {t.dtype}")
    if (ndim is not None and t.dim() != ndim) or (last is not None and t.shape[-1] != last):
        raise ValueError(f"{name} must be a tensor of shape {shape_doc}, got shape {tuple(t.shape)}")


def points(name: str, t) -> None:
    """``t`` is a point set of shape (P, 3)."""
    tensor(name, t, ndim=2, last=3, shape_doc="(P, 3)")


def same_device(**named: torch.Tensor) -> None:
    """All tensors live on one device."""
    devices = {name: t.device for name, t in named.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on the same device, got {listing}")


def positive_number(name: str, value) -> None:
    """``value`` is a finite Python number > 0.

    Under ``torch.compile`` a number may be symbolic: its value is then checked again inside
    the op (see the ops' real implementations), where it is concrete.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if torch.compiler.is_compiling():
        return
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")


def scale(name: str, value) -> None:
    """``value`` is a positive number or a one-element floating tensor (values checked in the op)."""
    if isinstance(value, torch.Tensor):
        tensor(name, value)
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
    else:
        positive_number(name, value)


def scale_tensor(value, dtype: torch.dtype, device) -> torch.Tensor:
    """A checked scale (number or one-element tensor) as a 0-d tensor of ``dtype`` (differentiable)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).reshape(())
    return torch.tensor(float(value), dtype=dtype, device=device)


def compute_dtype(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the kernels run in, dtype returned): float64 or float32; half types run in float32."""
    out = tensors[0].dtype
    for t in tensors[1:]:
        out = torch.promote_types(out, t.dtype)
    return (torch.float64 if out == torch.float64 else torch.float32), out


def finite(**named: torch.Tensor) -> None:
    """No NaN or inf in the tensors. Reads values: call it from a custom op's real implementation."""
    for name, t in named.items():
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or inf (pass validate=False to skip this check)")


def positive_values(name: str, t: torch.Tensor) -> None:
    """All values finite and > 0. Reads values: call it from a custom op's real implementation."""
    if t.numel() and not bool((torch.isfinite(t) & (t > 0)).all()):
        raise ValueError(f"{name} must be finite and > 0, got {t.detach().cpu().reshape(-1)[:4].tolist()}")


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
