"""torch's CPU math functions that run on MKL's vector math (VML), each called once at import.

MKL picks the kernel of each VML function lazily, on the function's first call. When that
first call runs on several of torch's threads at once, one thread can run a low-accuracy
kernel on its whole chunk, and every later call is right (pytorch/pytorch#188792; not seen
with oneMKL 2025 or later). Here, after Warp's init, 2 to 6 fresh processes in 30 got a
float64 ``sqrt`` with errors of up to 7e-11 on half of a (60, 90) tensor, the half of torch's
second thread; 0 in 40 after one call on one element first. pcops computes distances
(``sqrt``) and weights (``exp``) with these functions, so :func:`warm_up` calls each of them
on one element per floating dtype, on the importing thread, before any of them can run on
several threads.

Even warmed up, VML's ``sqrt`` is within an ulp of the square root, not always the nearest
float (IEEE 754's root, which Warp's kernels, CUDA and numpy compute): on an AMD EPYC, 20% of
the float32 roots and 1.4% of the float64 roots of a large tensor (a few elements take torch's
own loop, which is IEEE's). Where a root decides a result (two points at equal distances tie
by their indices), :func:`sqrt` gives IEEE's on every device.
"""

import numpy as np
import torch

from . import _threads

_IEEE = (torch.float32, torch.float64)  # the dtypes whose roots NumPy computes (:func:`sqrt`, :func:`root`)

# The functions that ATen/cpu/vml.h sends to MKL (torch 2.13's list), by their torch names.
FUNCTIONS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt", "tan", "tanh", "trunc")


def warm_up() -> None:
    """One call of each VML function on one CPU element of float32 and float64 (no-op without MKL)."""
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in FUNCTIONS:
            getattr(torch, name)(x)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The square roots of ``x``'s values, each the nearest float (IEEE 754's): torch's own on
    CUDA, numpy's on the CPU (see the module docs). Not differentiable: values only."""
    if x.device.type != "cpu" or x.dtype not in _IEEE:
        return x.sqrt()
    with np.errstate(invalid="ignore"):  # (a negative value's root: NaN, as torch's)
        return torch.from_numpy(np.sqrt(x.detach().contiguous().numpy()))


def root(x: torch.Tensor) -> torch.Tensor:
    """``x.sqrt()``, differentiable as it is, with IEEE's values (:func:`sqrt`) where a call can
    read them: CPU tensors in eager mode, under no dispatch or function mode, torch.func transform
    or torch.jit trace (under torch.compile, inductor's code computes IEEE's roots; elsewhere
    torch's, within an ulp of them)."""
    if not (x.is_cpu and type(x) is torch.Tensor and x.dtype in _IEEE and _threads.values_readable()):
        return x.sqrt()
    if not (torch.is_grad_enabled() and x.requires_grad) and not _threads.forward_mode():
        return sqrt(x)  # (nothing to differentiate: the values alone)
    out = x.sqrt()
    # IEEE's roots written over torch's in the result's own memory: the result autograd keeps for
    # sqrt's derivative (0.5 / root) is then IEEE's too, and no node is added
    with np.errstate(invalid="ignore"):  # (a negative value's root: NaN, as torch's)
        np.sqrt(x.detach().numpy(), out=out.detach().numpy())
    return out
