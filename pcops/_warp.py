"""Warp <-> torch glue: initialisation, device and stream binding, array conversion, launches.

Every Warp call in pcops goes through this module, so the rules that keep Warp cheap and
correct inside PyTorch live in one place:

* tensors are converted with ``requires_grad=False`` and ``return_ctype=True`` (no gradient
  buffer is allocated, no device-wide sync, the cheapest conversion);
* launches on CUDA go on PyTorch's current stream;
* Warp's CPU kernels run on one thread, so :func:`launch` splits the thread range across a
  pool (Warp launches release the GIL) and gives each extra chunk a private copy of the
  arrays it scatters into, because Warp's ``atomic_add`` is a plain add on the CPU.
"""

import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import warp as wp

# Below this many threads a launch is not worth splitting across CPU threads.
_MIN_CHUNK = 1024


@functools.cache
def init() -> None:
    """Initialise Warp once, without its banner unless the user asked for Warp's info logs."""
    if wp.config.log_level == wp.LOG_INFO:  # Warp's default: keep the greeting out of users' logs
        wp.config.log_level = wp.LOG_WARNING
    wp.init()


def scalar(dtype: torch.dtype):
    """The Warp scalar type of a float32/float64 torch dtype."""
    return {torch.float32: wp.float32, torch.float64: wp.float64}[dtype]


def vec3(dtype: torch.dtype):
    """The Warp 3-vector type of a float32/float64 torch dtype."""
    return {torch.float32: wp.vec3f, torch.float64: wp.vec3d}[dtype]


def device(t: torch.Tensor):
    """The Warp device of a torch tensor."""
    return "cpu" if t.device.type == "cpu" else wp.device_from_torch(t.device)


def stream(t: torch.Tensor):
    """Context manager that makes Warp launch on PyTorch's current stream of ``t``'s device."""
    if t.device.type == "cuda":
        return wp.ScopedStream(wp.stream_from_torch(torch.cuda.current_stream(t.device)))
    return contextlib.nullcontext()


def array(t: torch.Tensor, dtype=None):
    """A zero-copy Warp view of ``t`` for a kernel argument (no gradient buffer)."""
    return wp.from_torch(t, dtype=dtype, requires_grad=False, return_ctype=True)


def hash_grid(points: torch.Tensor, cell: float, groups: torch.Tensor | None = None) -> wp.HashGrid:
    """A Warp ``HashGrid`` over ``points`` (N, 3) with cubic cells of width ``cell``.

    The number of hash buckets grows with N (about 8 per point, at most 128^3), so small
    clouds do not pay for clearing a large table and large ones see few foreign candidates.
    ``groups`` (N,) int32 partitions the grid: a grouped query only visits its own group.
    """
    dim = max(8, min(128, int(round(2.0 * max(points.shape[0], 1) ** (1.0 / 3.0)))))
    grid = wp.HashGrid(dim, dim, dim, device=device(points), dtype=scalar(points.dtype))
    pts = wp.from_torch(points, dtype=vec3(points.dtype), requires_grad=False)
    grp = None if groups is None else wp.from_torch(groups, dtype=wp.int32, requires_grad=False)
    grid.build(pts, float(cell), groups=grp)
    return grid


_pending: list = []  # (CUDA event, Warp resource): resources kept alive until their stream work completes


def keep_alive(resource, like: torch.Tensor) -> None:
    """Hold a Warp-owned resource (a HashGrid) until the work queued so far on ``like``'s stream is done.

    Warp's documentation asks that Warp-owned resources used on a non-blocking stream (as
    ``torch.cuda.Stream()`` is) are not freed while that work is pending. pcops builds a grid
    per call, so instead of a host synchronisation it records an event and drops the grid on a
    later call, once the event has completed. No-op on the CPU.
    """
    if like.device.type != "cuda":
        return
    _pending[:] = [(event, res) for event, res in _pending if not event.query()]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(like.device))
    _pending.append((event, resource))


@functools.cache
def kernel_funcs(dtype: torch.dtype, grouped: bool):
    """Warp functions shared by the kernels of one float dtype: ``point`` and ``neighbours``.

    ``point(x, i)`` reads row i of an (N, 3) array as a 3-vector; ``neighbours(grid, q, r,
    groups, i)`` starts a hash-grid query around q, restricted to group ``groups[i]`` when the
    kernels are grouped. (No ``from __future__ import annotations`` in this module: Warp reads
    the annotations of these closures at definition time.)
    """
    s, v = scalar(dtype), vec3(dtype)

    @wp.func
    def point(x: wp.array2d(dtype=s), i: int):
        return v(x[i, 0], x[i, 1], x[i, 2])

    @wp.func
    def neighbours(grid: wp.uint64, q: v, radius: s, groups: wp.array(dtype=wp.int32), i: int):
        if wp.static(grouped):
            return wp.hash_grid_query(grid, q, radius, groups[i])
        return wp.hash_grid_query(grid, q, radius)

    return point, neighbours


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="pcops")


def _convert(arg):
    return array(arg) if isinstance(arg, torch.Tensor) else arg


def launch(kernel, n: int, args: list, like: torch.Tensor, scatter: tuple[int, ...] = ()) -> None:
    """Launch ``kernel`` over threads ``0 .. n-1`` on the device of ``like``.

    The kernel's first parameter is the index of its first thread (``start``), followed by
    ``args``: torch tensors (converted zero-copy), Python scalars or Warp values. On the CPU
    the range is split over ``torch.get_num_threads()`` pool threads; the tensors at the
    positions ``scatter`` (accumulated with ``atomic_add``) get a zeroed private copy per
    extra chunk, summed back into the original after the launches.
    """
    if n <= 0:
        return
    dev = device(like)
    chunks = 1 if like.device.type != "cpu" else max(1, min(torch.get_num_threads(), n // _MIN_CHUNK))
    if chunks == 1:
        with stream(like):
            wp.launch(kernel, dim=n, inputs=[0, *map(_convert, args)], device=dev)
        return
    bounds = [n * c // chunks for c in range(chunks + 1)]
    private = [list(args)] + [
        [torch.zeros_like(a) if i in scatter else a for i, a in enumerate(args)] for _ in range(chunks - 1)
    ]

    def run(c: int) -> None:
        start, stop = bounds[c], bounds[c + 1]
        wp.launch(kernel, dim=stop - start, inputs=[start, *map(_convert, private[c])], device=dev)

    list(_pool().map(run, range(chunks)))
    for i in scatter:
        for extra in private[1:]:
            args[i].add_(extra[i])
