"""One RMM memory pool shared by PyTorch, CuPy and cuML on CUDA.

Call :func:`use_rmm_pool` once, first thing in a process, before PyTorch initialises CUDA:

    import pcops.memory
    pcops.memory.use_rmm_pool(initial_pool_size="8GiB")

It makes RMM's pool the current device resource (``rmm.reinitialize(pool_allocator=True)``),
PyTorch's CUDA allocator (``torch.cuda.memory.change_current_allocator(rmm_torch_allocator)``)
and CuPy's allocator (``cupy.cuda.set_allocator(rmm_cupy_allocator)``); cuML allocates through
RMM's current device resource already. pcops' ops allocate their outputs and scratch with
torch, so they draw from the same pool. The pool is wrapped in RMM's statistics adaptor, so
:func:`max_memory_allocated` / :func:`reset_peak_memory_stats` report the pool's peak (PyTorch's
own memory statistics raise under a pluggable allocator). Warp allocates no memory of its own in
pcops' calls (every array a kernel reads or writes is a torch tensor). See docs/gpu.md.
"""

from __future__ import annotations

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
) -> None:
    """Route PyTorch, CuPy and cuML allocations on CUDA through one RMM pool.

    Args:
        initial_pool_size: bytes (or a string such as "4GiB") the pool starts with; RMM's
            default (half the free memory) when None.
        maximum_pool_size: upper bound of the pool; unbounded when None.
        devices: CUDA device id(s) to set the pool up on. Default: the ``LOCAL_RANK``
            environment variable (set by torchrun / Lightning for each process), else the
            current CUDA device (0 unless set, e.g. by ``CUDA_VISIBLE_DEVICES`` remapping or a
            ``cudaSetDevice`` through CuPy). The first of them becomes the current CUDA device,
            which PyTorch takes as its current device when it initialises CUDA, so that
            ``device="cuda"`` tensors and :func:`max_memory_allocated` without a device use the
            pool. Tensors on other devices are allocated outside the pool (plain
            ``cudaMalloc``), and :func:`max_memory_allocated` refuses them.

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
    from rmm._cuda.gpu import getDevice, setDevice  # the CUDA runtime calls rmm.reinitialize makes

    if devices is None:
        devices = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else getDevice()
    ids = [devices] if isinstance(devices, int) else list(devices)
    if not ids:
        raise ValueError("pcops.memory.use_rmm_pool: devices is empty")
    # rmm.reinitialize (rmm/pylibrmm/memory_resource/_memory_resource.pyx, _initialize) saves the
    # current device (cudaGetDevice), drops every per-device resource set before, makes each of
    # ``ids`` current in turn (cudaSetDevice, which creates its primary context) to create its
    # pool, and sets the saved device back at its end: device 0 unless something chose another,
    # which would create a context on device 0 in every rank and leave device 0 current (torch's
    # "cuda" tensors and cuML's buffers then outside the pool). The rank's own device is made
    # current first, so it is the one restored.
    setDevice(ids[0])
    rmm.reinitialize(
        pool_allocator=True, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size, devices=ids
    )
    stats = {}
    for index in ids:  # the pool's peak for max_memory_allocated (torch's statistics raise under RMM)
        stats[index] = rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_per_device_resource(index))
        rmm.mr.set_per_device_resource(index, stats[index])
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
    _state.update(devices=ids, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size, stats=stats)


def check_compile_mode(mode: str | None) -> None:
    """Warn when a ``torch.compile`` mode is known not to work with a pluggable allocator."""
    if _state and mode in ("reduce-overhead", "max-autotune"):
        warnings.warn(
            f"torch.compile(mode={mode!r}) records CUDA graphs, which PyTorch does not support with a "
            "pluggable allocator such as RMM's: use mode='default' (or 'max-autotune-no-cudagraphs') "
            "with pcops.memory.use_rmm_pool()"
        )


def _index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def _stats(device):
    index = _index(device)
    adaptor = _state["stats"].get(index)
    if adaptor is None:
        raise ValueError(
            f"pcops.memory.use_rmm_pool() did not set up device {index}: it covers {_state['devices']} (tensors on "
            "other devices are allocated outside the pool, with plain cudaMalloc, and PyTorch's own statistics "
            "raise under RMM's allocator); pass every device the process uses as use_rmm_pool(devices=[...])"
        )
    return adaptor


def max_memory_allocated(device=None) -> int:
    """Peak bytes allocated on ``device`` since the pool was set up or the last reset.

    Under :func:`use_rmm_pool`: RMM's statistics of the pool (everything torch, CuPy and cuML
    allocated from it), the bytes allocated at the last :func:`reset_peak_memory_stats` plus the
    peak growth since. Otherwise ``torch.cuda.max_memory_allocated``. (PyTorch's own memory
    statistics raise under RMM's pluggable allocator.)
    """
    if not _state:
        return torch.cuda.max_memory_allocated(device)
    index = _index(device)
    counts = _stats(index).allocation_counts
    return _state.setdefault("base", {}).get(index, 0) + counts.peak_bytes


def reset_peak_memory_stats(device=None) -> None:
    """Start a new peak for :func:`max_memory_allocated` (``torch.cuda.reset_peak_memory_stats`` without the pool)."""
    if not _state:
        torch.cuda.reset_peak_memory_stats(device)
        return
    index = _index(device)
    adaptor, base, pushed = _stats(index), _state.setdefault("base", {}), _state.setdefault("pushed", set())
    if index in pushed:
        adaptor.pop_counters()  # folds the finished period into the level below
    before = adaptor.push_counters()  # a fresh zero level; returns the statistics before the push
    pushed.add(index)
    base[index] = before.current_bytes  # the level below holds everything since the pool was set up


_async_done: set = set()


def default_cuml_resource(index: int) -> None:
    """Without the pool, give device ``index`` RMM's async (stream-ordered pool) resource for cuML.

    Importing cuML makes RMM CuPy's allocator, and RMM's default device resource is the plain
    ``CudaMemoryResource`` (a cudaMalloc and cudaFree per buffer). When nothing has chosen a
    resource for the device (it is still that default) and :func:`use_rmm_pool` is not in use,
    this sets ``rmm.mr.CudaAsyncMemoryResource`` (CUDA's stream-ordered allocator, which keeps
    freed memory for reuse) with a release threshold (:func:`async_release_threshold`): above
    it, freed memory goes back to the device at the next synchronisation. Called by the cuML
    backend in the device's context; a resource the user set is left alone. PyTorch's
    allocator is not affected.
    """
    if _state or index in _async_done:
        return
    import rmm

    if type(rmm.mr.get_per_device_resource(index)) is rmm.mr.CudaMemoryResource:
        # CudaAsyncMemoryResource(initial_pool_size=None, release_threshold=None) creates its own
        # pool (cudaMemPoolCreate) and sets cudaMemPoolAttrReleaseThreshold with
        # cudaMemPoolSetAttribute to release_threshold, UINT64_MAX when None (rmm
        # cpp/src/mr/detail/cuda_async_memory_resource_impl.cpp): the pool would keep all it
        # ever held. With a threshold, memory beyond it goes back to the device at the next
        # synchronisation (cuML synchronises after each call), so PyTorch's allocator can use it.
        threshold = async_release_threshold(torch.cuda.get_device_properties(index).total_memory)
        rmm.mr.set_per_device_resource(index, rmm.mr.CudaAsyncMemoryResource(release_threshold=threshold))
    _async_done.add(index)


def async_release_threshold(total_memory: int) -> int:
    """Bytes cuML's async pool keeps between calls: 1/16 of the device's memory, at most 1 GiB
    (enough for the buffers of a search of a few million points, little beside PyTorch's cache)."""
    return min(total_memory // 16, 1 << 30)
