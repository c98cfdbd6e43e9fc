"""One RMM memory pool shared by PyTorch, CuPy and cuML on CUDA.

Call :func:`use_rmm_pool` once, first thing in a process, before PyTorch initialises CUDA:

    import pcops.memory
    pcops.memory.use_rmm_pool(initial_pool_size="8GiB")

It makes RMM's pool the current device resource (``rmm.reinitialize(pool_allocator=True)``),
PyTorch's CUDA allocator (``torch.cuda.memory.change_current_allocator(rmm_torch_allocator)``)
and CuPy's allocator (``cupy.cuda.set_allocator(rmm_cupy_allocator)``); cuML allocates through
RMM's current device resource already. pcops' ops allocate their outputs and scratch with
torch, so they draw from the same pool. Warp still allocates its own ``HashGrid`` storage (a
few ints per point) through its CUDA mempool; its release threshold is set so that Warp returns
what it holds beyond ``warp_release_threshold`` bytes at each synchronisation instead of
hoarding next to the pool. See docs/gpu.md.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

_INSTALL = 'pip install "pcops[cuda12]" (or "pcops[cuda13]")'
_state: dict = {}


def rmm_pool_enabled() -> bool:
    """Whether :func:`use_rmm_pool` has set up the shared pool in this process."""
    return bool(_state)


def use_rmm_pool(
    initial_pool_size: int | str | None = None,
    maximum_pool_size: int | str | None = None,
    devices: int | list[int] | None = None,
    warp_release_threshold: int = 256 * 1024**2,
) -> None:
    """Route PyTorch, CuPy and cuML allocations on CUDA through one RMM pool.

    Args:
        initial_pool_size: bytes (or a string such as "4GiB") the pool starts with; RMM's
            default (half the free memory) when None.
        maximum_pool_size: upper bound of the pool; unbounded when None.
        devices: CUDA device id(s) to set the pool up on. Default: the ``LOCAL_RANK``
            environment variable (set by torchrun / Lightning for each process), else 0.
        warp_release_threshold: bytes Warp's own mempool may keep (HashGrid storage).

    A second call is a no-op. Raises ``RuntimeError`` without CUDA or when PyTorch has
    already initialised CUDA (the allocator cannot be swapped then), and ``ImportError`` when
    rmm is not installed.
    """
    if _state:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("pcops.memory.use_rmm_pool needs a CUDA GPU, and torch.cuda.is_available() is False")
    try:
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator
    except ImportError as err:
        raise ImportError(f"pcops.memory.use_rmm_pool needs the rmm package: {_INSTALL}") from err
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "pcops.memory.use_rmm_pool() must run before PyTorch initialises CUDA, and CUDA is already "
            "initialised in this process (a tensor was put on the GPU, or a torch.cuda call started CUDA): "
            "call it first thing in your script, or set `rmm_pool: true` in the training config, which "
            "calls it before the model is built"
        )
    if devices is None:
        devices = int(os.environ.get("LOCAL_RANK", 0))
    ids = [devices] if isinstance(devices, int) else list(devices)
    rmm.reinitialize(
        pool_allocator=True, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size, devices=ids
    )
    try:
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    except RuntimeError as err:  # e.g. "Can't swap an already initialized allocator"
        raise RuntimeError(
            "PyTorch's CUDA allocator was initialised before pcops.memory.use_rmm_pool(): call it first "
            f"thing in your script, before any CUDA tensor exists ({err})"
        ) from err
    try:
        import cupy
        from rmm.allocators.cupy import rmm_cupy_allocator
    except ImportError:
        pass  # CuPy is optional: without it only torch and cuML share the pool
    else:
        cupy.cuda.set_allocator(rmm_cupy_allocator)
    _limit_warp_mempool(ids, warp_release_threshold)
    _state.update(devices=ids, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size)


def _limit_warp_mempool(devices: list[int], threshold: int) -> None:
    from . import _warp

    _warp.init()
    import warp as wp

    for device in devices:
        if wp.is_mempool_supported(f"cuda:{device}"):
            wp.set_mempool_release_threshold(f"cuda:{device}", threshold)


def check_compile_mode(mode: str | None) -> None:
    """Warn when a ``torch.compile`` mode is known not to work with a pluggable allocator."""
    if _state and mode in ("reduce-overhead", "max-autotune"):
        warnings.warn(
            f"torch.compile(mode={mode!r}) records CUDA graphs, which PyTorch does not support with a "
            "pluggable allocator such as RMM's: use mode='default' (or 'max-autotune-no-cudagraphs') "
            "with pcops.memory.use_rmm_pool()"
        )


def max_memory_allocated(device=None) -> int | None:
    """``torch.cuda.max_memory_allocated``, or None (with one warning) under the RMM pool.

    PyTorch's memory statistics come from its own caching allocator; with RMM's pluggable
    allocator they stay at zero, so pcops reports "unknown" instead of a false 0.
    """
    if _state:
        _warn_no_stats()
        return None
    return torch.cuda.max_memory_allocated(device)


@functools.cache
def _warn_no_stats() -> None:
    warnings.warn("torch.cuda.max_memory_allocated is not reported under RMM's allocator (pcops.memory.use_rmm_pool)")
