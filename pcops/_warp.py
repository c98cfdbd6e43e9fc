"""Warp <-> torch glue: initialisation, device and stream binding, array conversion, launches.

Every Warp call in pcops goes through this module, so the rules that keep Warp cheap and
correct inside PyTorch live in one place (the Warp functions shared by pcops' kernels are in
:mod:`pcops._warp_funcs`):

* tensors are converted with ``requires_grad=False`` and ``return_ctype=True`` (no gradient
  buffer is allocated, no device-wide sync, the cheapest conversion);
* on CUDA, Warp works on PyTorch's current stream through one ``wp.Stream`` per (device, torch
  stream) kept for the life of the process (:func:`cuda_stream`): Warp unregisters a wrapped
  stream when its ``wp.Stream`` is garbage-collected, which resets the device's current
  stream to the legacy NULL stream and frees that stream's sort scratch unordered with
  pending work, so wrappers must never be per call. :func:`launch` passes ``stream=``
  explicitly: no op enters a stream scope (the device's current Warp stream is per device,
  not per thread). Every array a kernel reads is a torch tensor, allocated and released by
  torch on its stream: pcops keeps no Warp-owned object (a ``HashGrid``) past a call;
* kernels are built and loaded once per process under one lock (Warp's code generation is
  not thread-safe), each kernel variant is its own Warp module (``module="unique"``), so the
  on-disk kernel cache does not depend on the order in which variants are first used; a
  module whose cached files Warp cannot load (truncated, zero bytes) is deleted from the cache
  and built again once (:func:`_load_or_rebuild`);
* Warp's CPU kernels run on one thread, so :func:`launch` splits the thread range into chunks
  run by several threads (Warp launches release the GIL) and gives each extra chunk a private
  copy of the arrays it scatters into, because Warp's ``atomic_add`` is a plain add on the
  CPU. The threads are those of torch's own OpenMP team where torch runs on GNU OpenMP
  (:func:`_openmp`): after a parallel torch op its idle workers spin for a while, and a
  second pool of threads would share the cores with them (docs/benchmarks.md, design choices).
  Elsewhere, and in a forked child, a pool of
  Python threads runs them; the pool is dropped in a forked child (its threads do not exist
  there) and made again on demand;
* once a kernel is loaded, its CPU chunks call its native entry point directly, with argument
  structs of Warp's own ctypes types packed on the calling thread (:func:`_runner`): packing in
  each thread (wp.launch) made the threads contend for the GIL. Where a Warp version does not
  expose what this reads, launches go through wp.launch.
"""

import contextlib
import ctypes
import errno
import functools
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
import typing
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import warp as wp

from . import _threads

# Below this many threads a launch is not worth splitting across CPU threads.
MIN_CHUNK = 1024
# The same for kernels whose threads each search (a tree walk, a cell-list scan): a microsecond
# or more per thread, so a chunk of this many outweighs a fork-join.
QUERY_CHUNK = 64
# CUDA: a search in at most this many reference points and (query, point) pairs (times the
# caller's cost of a pair) measures every pair (the kNN and ball-query scans) instead of
# building a tree or a cell list: one or two launches and no host read, the same result
# (:func:`cuda_scans`; the crossover measured in docs/benchmarks.md, GPU).
CUDA_SCAN_POINTS = 1 << 16
CUDA_SCAN_PAIRS = 1 << 31
# Threads of a CUDA scan: a query's points are split among several threads when there are fewer
# queries than this (then one more launch merges each query's partial rows).
CUDA_SCAN_THREADS = 1 << 17


def cuda_scans(m: int, n: int, cost: int = 1) -> bool:
    """Whether a CUDA search of ``m`` queries in ``n`` reference points measures every pair
    (``cost``: the work of one pair, in units of a plain distance)."""
    return n <= CUDA_SCAN_POINTS and m * n * cost <= CUDA_SCAN_PAIRS

# One re-entrant lock for everything in Warp that is not thread-safe and happens once:
# initialisation, kernel creation (code generation, module hashing) and first module loads.
_BUILD_LOCK = threading.RLock()
# Guards the cache of wp.Stream wrappers of torch streams (:func:`cuda_stream`).
_STREAM_LOCK = threading.RLock()

_CUDA_DRIVER_WARNING = "Could not find or load the NVIDIA CUDA driver"


def init() -> None:
    """Initialise Warp once, quietly.

    Warp's banner is kept out of users' logs unless they asked for Warp's info logs, and on a
    machine where PyTorch sees no CUDA, Warp's "Could not find or load the NVIDIA CUDA driver"
    line (printed by its native library) is filtered out: a CPU user did not ask for CUDA.
    Everything else Warp prints during initialisation still reaches stderr.
    """
    if not _initialised:
        with _BUILD_LOCK:
            if not _initialised:
                _init()
                _initialised.append(True)


_initialised: list = []


def _init() -> None:
    if wp.config.log_level == wp.LOG_INFO:  # Warp's default: keep the greeting out of users' logs
        wp.config.log_level = wp.LOG_WARNING
    with _cache_dir_errors():
        if torch.cuda.is_available():
            wp.init()
            return
        with _filtered_stderr(_CUDA_DRIVER_WARNING):
            wp.init()


@contextlib.contextmanager
def _filtered_stderr(drop: str):
    """Capture file descriptor 2 (native code prints there) and re-emit it without lines containing ``drop``."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, AttributeError, ValueError):  # no usable stderr (closed, or None under pythonw)
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            kept = "".join(line for line in text.splitlines(keepends=True) if drop not in line)
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


@contextlib.contextmanager
def _cache_dir_errors():
    """Turn a failure to write Warp's kernel cache into an error that says what to do."""
    try:
        yield
    except OSError as err:
        where = str(getattr(wp.config, "kernel_cache_dir", None) or os.environ.get("WARP_CACHE_PATH", ""))
        name = str(err.filename or "")
        in_cache = bool(where and name) and (name.startswith(where) or where.startswith(name))
        if not in_cache and err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise RuntimeError(
            f"pcops could not write Warp's kernel cache directory {where!r} ({err.strerror}): Warp compiles "
            "each kernel there on first use. Set the WARP_CACHE_PATH environment variable to a writable "
            "directory (before the first pcops call), or pre-build the cache where it is writable"
        ) from err


def scalar(dtype: torch.dtype):
    """The Warp scalar type of a float32/float64 torch dtype."""
    return {torch.float32: wp.float32, torch.float64: wp.float64}[dtype]


def vec3(dtype: torch.dtype):
    """The Warp 3-vector type of a float32/float64 torch dtype."""
    return {torch.float32: wp.vec3f, torch.float64: wp.vec3d}[dtype]


def device(t: torch.Tensor):
    """The Warp device of a torch tensor (Warp initialised first: its CUDA devices exist only then)."""
    if t.device.type == "cpu":
        return "cpu"
    init()
    return wp.device_from_torch(t.device)


# (device index, torch stream handle) -> wp.Stream. Never emptied: a wp.Stream must not be
# garbage-collected (see the module docs). torch's own streams come from fixed per-device
# pools, so this holds a few entries per device.
_streams: dict = {}


def cuda_stream(t: torch.Tensor):
    """The process-wide ``wp.Stream`` of PyTorch's current stream on ``t``'s CUDA device (None on CPU)."""
    if t.device.type != "cuda":
        return None
    current = torch.cuda.current_stream(t.device)
    key = (current.device_index, current.cuda_stream)
    found = _streams.get(key)
    if found is None:
        with _STREAM_LOCK:
            found = _streams.get(key)
            if found is None:
                init()
                found = _streams[key] = wp.stream_from_torch(current)
    return found


def array(t: torch.Tensor, dtype=None):
    """A zero-copy Warp view of ``t`` for a kernel argument (no gradient buffer): the descriptor
    ``wp.from_torch(t, dtype, requires_grad=False, return_ctype=True)`` returns, packed here in
    one step (a fifth of its cost: conversions are most of a small call's). Anything this does
    not pack (an incompatible dtype, non-contiguous element dims, sizes past int32) goes to
    ``wp.from_torch``, which raises its own errors."""
    element = _element(t.dtype, dtype)
    if element is not None:
        size, inner = element
        shape, strides = t.shape, t.stride()
        if inner:
            d = len(inner)
            if tuple(shape[-d:]) != inner or strides[-1] != 1 or (d > 1 and strides[-2] != inner[-1]):
                return wp.from_torch(t, dtype=dtype, requires_grad=False, return_ctype=True)
            shape, strides = tuple(shape[:-d]) or (1,), tuple(strides[:-d]) or (1,)
        if len(shape) <= _MAX_DIMS:
            try:
                return _packed(t, t.data_ptr(), shape, [x * size for x in strides])
            except struct.error:  # a size past int32: Warp's own conversion decides
                pass
    return wp.from_torch(t, dtype=dtype, requires_grad=False, return_ctype=True)


def _packed(t: torch.Tensor, ptr: int, shape: tuple, byte_strides: tuple):
    """Warp's descriptor of the memory of ``t`` at ``ptr`` with ``shape`` and ``byte_strides``,
    keeping ``t`` alive, as Warp's own descriptor does (a temporary's memory)."""
    n = len(shape)
    out = _ARRAY_T.from_buffer_copy(_PACKERS[n].pack(ptr, 0, *shape, *byte_strides, n, 0))
    out._ref = t
    return out


def values_flag() -> tuple:
    """(a kernel's values-check flag, one int32 tensor a launch sets to 1 where a value is NaN or
    inf, and its NumPy view): kept with a prepared launch, reset (``view[0] = 0``) before each run
    and read after it without a torch read (the plain calls' values check in their kernels)."""
    view = np.zeros(1, dtype=np.int32)  # (NumPy's memory, torch's view of it: no tensor read to make it)
    return torch.from_numpy(view), view


@functools.cache
def no_flag(device: torch.device) -> tuple:
    """(tensor, its Warp view): a kernel's empty values-check flag (no check), one per device,
    kept alive here and converted once."""
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    return empty, array(empty)


def memory(buffer, shape: tuple):
    """A Warp array descriptor of a contiguous ctypes array ``buffer`` viewed with ``shape`` (its
    element type the kernel parameter's), kept alive by the descriptor."""
    size = ctypes.sizeof(buffer._type_)
    strides = [size * math.prod(shape[i + 1:]) for i in range(len(shape))]
    return _packed(buffer, ctypes.addressof(buffer), tuple(shape), tuple(strides))


def span(t: torch.Tensor, at: int, count: int, width: int = 1):
    """A 1-d Warp array of ``count`` elements of ``width`` values each, from value ``at`` of the
    contiguous tensor ``t``: parts of one allocation passed as separate kernel arguments, without
    a torch view each. The kernel's parameter declares the element type (a scalar, or a vector
    of ``width``)."""
    size = t.element_size()
    if _element(t.dtype, None) is not None:
        return _packed(t, t.data_ptr() + at * size, (count,), (width * size,))
    part = t.reshape(-1)[at:at + count * width]
    return array(part.view(count, width), wp.types.vector(width, wp.dtype_from_torch(t.dtype))) if width > 1 else array(part)


# Warp's array descriptor (data, grad, shape, strides, ndim, flags), packed by :func:`array` where
# its layout is the one this expects (checked once against Warp's own conversion)
_ARRAY_T = type(wp.from_torch(torch.zeros(1), requires_grad=False, return_ctype=True))
_MAX_DIMS = 4
_HEAD = f"<QQ{2 * _MAX_DIMS}iHH"  # data, grad, shape, strides, ndim, flags: the fields this packs
# the descriptor of an array of n dimensions (the unused sizes and strides zero bytes), padded to Warp's size
_PACKERS = [struct.Struct(f"<QQ{n}i{4 * (_MAX_DIMS - n)}x{n}i{4 * (_MAX_DIMS - n)}xHH"
                          + "x" * max(ctypes.sizeof(_ARRAY_T) - struct.calcsize(_HEAD), 0)) for n in range(_MAX_DIMS + 1)]


@functools.cache
def _element(dtype: torch.dtype, wp_dtype):
    """(bytes per scalar, element dims) of a Warp array of ``wp_dtype`` (None: Warp's match of
    ``dtype``) viewing a tensor of ``dtype``; None where :func:`array` leaves the conversion to Warp."""
    try:
        if wp_dtype is None:
            wp_dtype = wp.dtype_from_torch(dtype)
        size, inner = ctypes.sizeof(wp_dtype._type_), tuple(getattr(wp_dtype, "_shape_", ()))
        probe = torch.zeros((2, 3, *inner), dtype=dtype)[:, 1]
        expected = wp.from_torch(probe, dtype=wp_dtype, requires_grad=False, return_ctype=True)  # raises if incompatible
    except Exception:  # noqa: BLE001 (Warp raises its own error in array())
        return None
    if ctypes.sizeof(_ARRAY_T) != _PACKERS[1].size or type(expected) is not _ARRAY_T:
        return None
    packed = _PACKERS[1].pack(probe.data_ptr(), 0, 2, 3 * math.prod(inner) * size, 1, 0)  # the packer array() uses
    return (size, inner) if packed == bytes(expected) else None


def kernels(factory):
    """Decorator for a kernel factory: cached per arguments, and run under the build lock.

    Warp's code generation and module hashing (run when ``@wp.kernel`` is applied) are not
    thread-safe: two threads creating the same kernels at once fail inside Warp. The
    factory's kernels should be declared ``@wp.kernel(enable_backward=False, module="unique")``.
    """
    cached = functools.cache(factory)
    made: dict = {}  # the factory's results, read without the lock once made

    @functools.wraps(factory)
    def locked(*args):
        found = made.get(args)
        if found is None:
            with _BUILD_LOCK:
                found = made[args] = cached(*args)
        return found

    def cache_clear() -> None:
        with _BUILD_LOCK:
            made.clear()
            cached.cache_clear()

    locked.cache_clear = cache_clear
    FACTORIES.append(locked)  # every kernel factory of pcops (tests/test_cuda_compile.py compiles each)
    return locked


FACTORIES: list = []  # the factories decorated with :func:`kernels`, in import order


# (kernel, device) pairs launched once in this process: the first launch of each builds or loads
# its module, under the build lock and on one thread
_loaded: set = set()


_pool_state: list = []  # [ThreadPoolExecutor] once made in this process


def _pool() -> ThreadPoolExecutor:
    if not _pool_state:
        with _BUILD_LOCK:
            if not _pool_state:
                _pool_state.append(ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="pcops"))
    return _pool_state[0]


def _after_fork_in_child() -> None:
    """In a forked child only the forking thread exists: the parent's pool threads are gone (its
    executor would wait for them forever) and a lock another thread held stays held."""
    global _BUILD_LOCK, _STREAM_LOCK, _forked
    _pool_state.clear()
    _openmp_state[:] = [None]  # torch's OpenMP team is not fork-safe: the pool from now on
    _BUILD_LOCK, _STREAM_LOCK = threading.RLock(), threading.RLock()
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)
_forked = False


def forked() -> bool:
    """Whether this process is a forked child of one that imported pcops (a DataLoader worker):
    there torch's multi-threaded CPU ops may hang (its OpenMP team is not fork-safe), so pcops
    runs its CPU work in Warp kernels on its own pool instead."""
    return _forked


class Typed(typing.NamedTuple):
    """A launch argument: ``tensor`` as a Warp array of ``dtype`` (rows of vectors: a (N, k, 8)
    tensor as a (N, k) array of 8-vectors), also where it is scattered into."""

    tensor: torch.Tensor
    dtype: typing.Any


def convert(arg):
    if isinstance(arg, Typed):
        return array(arg.tensor, dtype=arg.dtype)
    return array(arg) if isinstance(arg, torch.Tensor) else arg


def zeros_like(arg):
    """A zeroed private copy of a scattered argument (a tensor or a :class:`Typed` one)."""
    if isinstance(arg, Typed):
        return Typed(torch.zeros_like(arg.tensor), arg.dtype)
    return torch.zeros_like(arg)


def capacity(n: int) -> int:
    """n rounded up to a power of two: the size a plan kept for a range of sizes is made for."""
    return 1 << (n - 1).bit_length()  # (n = 0: 2)


def chunk_bounds(n: int, s, min_chunk: int) -> list[int]:
    """Thread ranges of a launch: one on CUDA; on the CPU one per torch thread (as the caller
    set torch's count: :func:`pcops._threads.requested`, so that a busy machine runs the same
    chunks on fewer threads and the sums of scattered copies do not change), each of at least
    ``min_chunk`` threads. (More chunks per thread, to balance uneven work, measured slower on
    every op: a chunk's hand-off costs more than the imbalance, and contiguous ranges of
    spatially ordered queries keep each core's cache on its own part of the data.)"""
    chunks = 1 if s is not None else chunk_count(n, None, min_chunk)
    return [n * c // chunks for c in range(chunks + 1)]


def chunk_count(n: int, work: typing.Optional[int], min_chunk: int, requested: typing.Optional[int] = None) -> int:
    """The CPU chunks of a launch of n threads as :func:`launch` and :func:`prepare` cut it: one
    below :data:`SERIAL_WORK` steps of ``work`` (None: no estimate), else one per torch thread
    (``requested``: :func:`pcops._threads.requested`, where the caller has it), each of at
    least ``min_chunk`` threads (:func:`chunk_bounds`)."""
    if work is not None and work < SERIAL_WORK:
        return 1
    return max(1, min(_threads.requested() if requested is None else requested, n // max(min_chunk, 1)))


_openmp_state: list = []  # [GOMP_parallel or None] once looked up in this process
_TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _openmp():
    """``GOMP_parallel`` of the GNU OpenMP runtime torch's parallel ops run on, or None.

    Found among the libraries mapped into this process (Linux): the one in torch's own
    folder (wheels), else the only one. Another process layout, or any failure, gives None.
    """
    if not _openmp_state:
        with _BUILD_LOCK:
            if not _openmp_state:
                _openmp_state.append(_find_openmp())
    return _openmp_state[0]


def _find_openmp():
    try:
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return None
        with open("/proc/self/maps") as maps:
            found = sorted(set(re.findall(r"(/\S*/libgomp[^/\s]*\.so[^/\s]*)$", maps.read(), re.M)))
        mine = [p for p in found if os.path.dirname(p) == os.path.join(os.path.dirname(torch.__file__), "lib")]
        paths = mine or found
        if len(paths) != 1:
            return None
        parallel = ctypes.CDLL(paths[0]).GOMP_parallel  # an already mapped library: the same copy
    except (OSError, AttributeError):
        return None
    parallel.argtypes = [_TASK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    return parallel


def run_chunks(run, first: int, chunks: int) -> None:
    """``run(c)`` for c = first .. chunks - 1: at most :func:`pcops._threads.available` threads (the
    calling one and torch's OpenMP workers, or pool threads; Warp launches release the GIL)
    take the chunks in turn."""
    workers = min(_threads.available(), chunks - first)
    if workers <= 1:
        for c in range(first, chunks):
            run(c)
        return
    if getattr(run, "entries", None) is not None and _fork(run, first, chunks, workers):
        return
    todo, lock, errors = iter(range(first, chunks)), threading.Lock(), []

    def worker(_=None) -> None:
        while True:
            with lock:
                c = None if errors else next(todo, None)
            if c is None:
                return
            try:
                run(c)
            except BaseException as err:  # noqa: BLE001 (raised on the calling thread below)
                with lock:
                    errors.append(err)

    parallel = _openmp()
    if parallel is not None:
        parallel(_TASK(worker), None, workers, 0)  # ctypes releases the GIL; each thread takes it to run ``worker``
    else:
        futures = [_pool().submit(worker) for _ in range(workers - 1)]
        worker()
        for f in futures:
            f.result()
    if errors:
        raise errors[0]


def first_load(kernel, dev, load) -> bool:
    """Run ``load()`` (which builds or loads the kernel's module) under the build lock if the
    kernel was never launched on ``dev`` in this process; whether it ran."""
    key = (kernel, str(dev))
    if key in _loaded:
        return False
    with _BUILD_LOCK:
        if key in _loaded:
            return False
        init()
        with _cache_dir_errors():
            _load_or_rebuild(kernel, load)
        _loaded.add(key)
        return True


# What Warp raises when a module's cached files exist but cannot be loaded (a truncated or
# zero-byte object file, a corrupt metadata file): it does not rebuild them by itself, so every
# later call would fail the same way.
_LOAD_FAILURES = ("Failed to load CPU module", "Failed to load CUDA module", "Module metadata file")


def _unloadable(err: Exception) -> bool:
    return isinstance(err, json.JSONDecodeError) or any(text in str(err) for text in _LOAD_FAILURES)


def _cache_dirs(kernel) -> list[str]:
    """The kernel cache directories of ``kernel``'s module (those of each block size a launch may load)."""
    module, root = kernel.module, str(wp.config.kernel_cache_dir)
    names = set()
    for block_dim in (None, 1, module.options.get("block_dim")):
        try:
            names.add(module.get_module_identifier(block_dim))
        except Exception:  # noqa: BLE001 (a variant that cannot be hashed has no files either)
            pass
    return [os.path.join(root, name) for name in sorted(names)]


def _load_or_rebuild(kernel, load) -> None:
    """``load()``; if Warp cannot load the module's cached files, delete them and build once more."""
    try:
        load()
        return
    except Exception as err:  # noqa: BLE001 (re-raised unless the cached files are at fault)
        if not _unloadable(err):
            raise
    dirs = [d for d in _cache_dirs(kernel) if os.path.isdir(d)]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    try:
        load()
    except Exception as err:  # noqa: BLE001
        if not _unloadable(err):
            raise
        where = ", ".join(dirs) or str(wp.config.kernel_cache_dir)
        raise RuntimeError(
            f"pcops could not load the Warp kernel {kernel.key!r} from Warp's kernel cache ({where}), even after "
            f"deleting its cached files and building it again ({err}). Delete that directory, or set the "
            "WARP_CACHE_PATH environment variable to another writable directory (before the first pcops call)"
        ) from err


# kernel -> (entry point, argument struct type, launch-bounds type) of its CPU module, or None
# where this Warp does not expose them (its launches then go through wp.launch)
_natives: dict = {}


def _native(kernel, values: list):
    """The native CPU entry point of a loaded ``kernel``, with the ctypes types Warp packs its
    launch bounds and arguments into, taken from a launch command Warp records for ``values``
    (so the layouts are Warp's own); None if any of it is missing or differs."""
    found = _natives.get(kernel, False)
    if found is not False:
        return found
    try:
        cmd = wp.launch(kernel, dim=1, inputs=[0, *values], device="cpu", record_cmd=True)
        fields = [(a.label, type(p)) for a, p in zip(kernel.adj.args, cmd.params[1:], strict=True)]
        bounds = type(cmd.params[0])
        halves = tuple(i for i, a in enumerate(kernel.adj.args) if a.type is wp.float16)
        body = {"_fields_": fields}
        if halves:  # (a float16 scalar is packed as its bits, which wp.launch converts and a struct does not)
            body["__init__"] = lambda self, *v: ctypes.Structure.__init__(self, *(_half_bits(x) if i in halves else x for i, x in enumerate(v)))
        found = cmd.hooks.forward, type("Args", (ctypes.Structure,), body), bounds
        if found[0] is None or bytes(bounds((1,))) != bytes(cmd.params[0]):
            found = None
    except Exception:  # noqa: BLE001 (another Warp: wp.launch does it all)
        found = None
    _natives[kernel] = found
    return found


def _runner(kernel, bounds: list[int], private: list[list], dev, s):
    """``run(c)``: launch chunk c (threads bounds[c] .. bounds[c + 1] - 1 of ``kernel``, with the
    arguments ``private[c]``). On the CPU, once the kernel is loaded, the arguments of every chunk
    are packed here, on the calling thread, and a run only calls the kernel's entry point (which
    releases the GIL): wp.launch packs them in Python on each call, and the chunks' threads then
    contend for the GIL (docs/benchmarks.md, design choices); ``run.entries`` then holds the
    packed chunks for :func:`run_chunks`' native fork-join. Elsewhere a run is a wp.launch."""
    native = _native(kernel, private[0]) if s is None and (kernel, str(dev)) in _loaded else None
    if native is None:

        def run(c: int) -> None:
            start, stop = bounds[c], bounds[c + 1]
            wp.launch(kernel, dim=stop - start, inputs=[start, *private[c]], device=dev, stream=s)

        return run
    forward, args_type, bounds_type = native
    entry = ctypes.cast(forward, ctypes.c_void_p).value
    entries = [(entry, bounds_type((bounds[c + 1] - bounds[c],)), args_type(bounds[c], *private[c])) for c in range(len(private))]
    calls = [(ctypes.byref(dim), ctypes.byref(args)) for _, dim, args in entries]

    def run(c: int) -> None:
        forward(*calls[c])

    run.entries = entries  # ``entries`` lives as long as ``run``
    return run


@kernels
def _fork_kernel():
    """A one-thread CPU kernel (CPU only) that runs packed chunks (a table of (entry point, launch
    bounds, arguments) triples) on ``threads`` threads of torch's OpenMP team through
    ``GOMP_parallel`` (its address: ``parallel``), each thread taking the next chunk until none is
    left: a fork-join without Python, where a ctypes callback per thread takes the GIL and costs
    more than a small chunk's work (docs/benchmarks.md, design choices)."""

    @wp.func_native(_FORK_SNIPPET)
    def fork_join(parallel: wp.uint64, table: wp.uint64, chunks: int, threads: int): ...

    @wp.kernel(enable_backward=False, module="unique")
    def fork(start: int, parallel: wp.uint64, table: wp.uint64, chunks: int, threads: int):
        fork_join(parallel, table, chunks, threads)

    return fork


_FORK_SNIPPET = r"""
struct Chunks { void** table; int count; int next; };
auto take = [](void* data) {
    Chunks* chunks = (Chunks*)data;
    for (;;) {
        int c = __atomic_fetch_add(&chunks->next, 1, __ATOMIC_RELAXED);
        if (c >= chunks->count) break;
        void** call = chunks->table + 3 * c;
        ((void (*)(void*, void*))call[0])(call[1], call[2]);
    }
};
Chunks work = {(void**)table, chunks, 0};
((void (*)(void (*)(void*), void*, unsigned, unsigned))parallel)(take, &work, (unsigned)threads, 0u);
"""


def _fork(run, first: int, chunks: int, workers: int) -> bool:
    """Run the packed chunks ``first .. chunks - 1`` of ``run`` (its ``entries``: see
    :func:`_runner`) on ``workers`` threads of the OpenMP team in native code
    (:func:`_fork_kernel`); False, having run nothing, where torch's OpenMP runtime was not found
    (the caller then runs them itself). The chunks' table and the fork kernel's packed arguments
    are made once for each (first, chunks, workers) and kept on ``run``: a prepared launch's
    chunks stay where they are between calls."""
    parallel = _openmp()
    if parallel is None or not NATIVE_FORK[0]:
        return False
    forks = run.__dict__.setdefault("forks", {})
    call = forks.get((first, chunks, workers))
    if call is None:
        entries = run.entries[first:chunks]
        table = (ctypes.c_void_p * (3 * len(entries)))()
        for c, (entry, dim, args) in enumerate(entries):
            table[3 * c : 3 * c + 3] = entry, ctypes.addressof(dim), ctypes.addressof(args)
        values = [ctypes.cast(parallel, ctypes.c_void_p).value, ctypes.addressof(table), len(entries), workers]
        try:
            kernel = _fork_kernel()
            if first_load(kernel, "cpu", lambda: wp.launch(kernel, dim=1, inputs=[0, *values], device="cpu")):
                return True
        except Exception:  # noqa: BLE001 (a toolchain that cannot build it: the Python fork-join from now on)
            NATIVE_FORK[0] = False
            return False
        native = _native(kernel, values)
        if native is None:
            _serial(kernel, 1, values)
            return True
        forward, args_type, bounds_type = native
        packed = args_type(0, *values)
        call = forks[first, chunks, workers] = (forward, ctypes.byref(_bounds(bounds_type, 1)), ctypes.byref(packed), packed, table)
    call[0](call[1], call[2])
    return True


NATIVE_FORK = [True]  # False: the chunks' fork-join in Python (tests compare both)


def launch_chunks(kernel, bounds: list[int], values: list) -> None:
    """On the CPU: chunk c of ``kernel`` is threads ``bounds[c] .. bounds[c + 1] - 1``, every chunk
    with the arguments ``values``, the chunks taken in turn by the first free thread (the
    caller's cut: chunks of uneven work). The first launch of the kernel loads it on this thread."""
    chunks = len(bounds) - 1
    private = [values] * chunks
    first = first_load(kernel, "cpu", lambda: _runner(kernel, bounds, private, "cpu", None)(0))
    run_chunks(_runner(kernel, bounds, private, "cpu", None), 1 if first else 0, chunks)


def launch(kernel, n: int, args: list, like: torch.Tensor, scatter: tuple[int, ...] = (), min_chunk: int = MIN_CHUNK, beside=None,
           work: typing.Optional[int] = None, kept: bool = False) -> None:
    """Launch ``kernel`` over threads ``0 .. n-1`` on the device of ``like``.

    The kernel's first parameter is the index of its first thread (``start``), followed by
    ``args``: torch tensors (converted zero-copy), Python scalars or Warp values. On CUDA the
    launch goes on PyTorch's current stream (passed explicitly). On the CPU the range is split
    into a chunk per torch thread (:func:`pcops._threads.requested`, run by the
    :func:`pcops._threads.available` ones), each running at least ``min_chunk``
    threads (less for kernels whose threads do much work each); the tensors at the positions
    ``scatter`` (accumulated with ``atomic_add``) get a zeroed private copy per extra chunk,
    summed back into the original after the launches. The first launch of a kernel on a device
    (which compiles or loads its module) runs alone, under the build lock, through wp.launch;
    later CPU launches call the kernel's entry point directly (:func:`_runner`).

    ``beside``: (kernel, args) of a one-thread launch, or (kernel, args, threads), run with this
    one as one more chunk (on the CPU by a thread of the same team, e.g. one this launch's chunks
    leave idle): two small independent launches in one fork-join.

    ``kept``: on the CPU, the launch is kept (:func:`kept_launch`): a call that repeats its
    kernel with arguments of the same kinds points the kept launch at its tensors and runs it,
    without converting or packing them.

    ``work``: the caller's estimate of the launch's elementary steps (points touched, beside's
    included). Below :data:`SERIAL_WORK` the CPU runs everything on the calling thread, one
    launch after the other: a fork-join costs more than such work, and on a shared machine a
    helper thread that is not scheduled holds the join up for a time slice.
    """
    if n <= 0:
        return
    if kept and beside is None and not scatter and like.is_cpu and kept_launch(kernel, n, args, min_chunk, work):
        return
    side_threads = 0 if beside is None else beside[2] if len(beside) > 2 else 1
    if side_threads <= 0:
        beside = None
    if work is not None and work < SERIAL_WORK and like.is_cpu and (kernel, "cpu") in _loaded and (beside is None or (beside[0], "cpu") in _loaded):
        _serial(kernel, n, [convert(a) for a in args])  # the common small CPU launch, nothing to decide
        if beside is not None:  # (then beside's, as the serial path below runs them)
            _serial(beside[0], side_threads, [convert(a) for a in beside[1]])
        return
    s = cuda_stream(like)
    dev = "cpu" if s is None else device(like)
    serial = s is None and work is not None and work < SERIAL_WORK
    bounds = [0, n] if serial else chunk_bounds(n, s, min_chunk)
    chunks = len(bounds) - 1
    values = [convert(a) for a in args]  # once per launch: a conversion costs as much as a small chunk's work
    if chunks == 1 and beside is None and s is None and (kernel, dev) in _loaded:
        _serial(kernel, n, values)  # the common small launch: no fork-join
        return
    extras = [{i: zeros_like(args[i]) for i in scatter} for _ in range(chunks - 1)]
    private = [values] + [[convert(extra[i]) if i in extra else v for i, v in enumerate(values)] for extra in extras]
    jobs = [(kernel, bounds, private)]
    if beside is not None:
        jobs.append((beside[0], [0, side_threads], [[convert(a) for a in beside[1]]]))
    todo, entries = [], []  # the chunks left to run, and their packed forms (None unless every one has it)
    for job in jobs:
        first = first_load(job[0], dev, lambda: _runner(*job, dev, s)(0))
        run = _runner(*job, dev, s)
        skip = 1 if first else 0
        todo += [functools.partial(run, c) for c in range(skip, len(job[1]) - 1)]
        entries = entries + run.entries[skip:] if entries is not None and hasattr(run, "entries") else None
    if s is None and not serial:

        def chunk(c: int) -> None:
            todo[c]()

        if entries is not None:
            chunk.entries = entries
        run_chunks(chunk, 0, len(todo))
    else:  # one stream, or one thread: in order
        for run in todo:
            run()
    for extra in extras:
        for i, t in extra.items():
            (args[i].tensor if isinstance(t, Typed) else args[i]).add_(t.tensor if isinstance(t, Typed) else t)


def kept_launch(kernel, n: int, args: list, min_chunk: int = MIN_CHUNK, work: typing.Optional[int] = None) -> bool:
    """:func:`launch` of a loaded CPU ``kernel`` through a :class:`Prepared` launch the calling
    thread keeps (:func:`ranged`) for arguments of these kinds: each tensor's dtype, Warp dtype,
    dimensions and sizes past the first (every tensor contiguous, on the CPU), every other argument's
    value (ints, floats and bools only), and the launch's chunks. A run points every array
    argument at this call's tensor and sets its length and the launch's threads: the packed
    arguments a conversion would give, without converting or packing (most of a small call's
    cost); the kept launch holds no tensor. False, having run nothing, where it is not kept
    (yet): other arguments, the kernel not loaded, or the key's first miss."""
    if not PREPARED[0] or (kernel, "cpu") not in _loaded:
        return False
    arrays = _array_params(kernel, len(args))
    if arrays is None:
        return False
    key, tensors = [kernel, min_chunk], []
    for a, is_array in zip(args, arrays[2]):
        kind = type(a)
        if kind is torch.Tensor or kind is Typed:
            t = a if kind is torch.Tensor else a.tensor
            if not is_array or type(t) is not torch.Tensor or not t.is_cpu or not t.is_contiguous():
                return False
            key.append(t.dtype)
            key.append(t.dim())  # (a 0-d tensor's array has no strides: a 1-d one's would be read with them)
            key.append(t.shape[1:] if kind is torch.Tensor else (t.shape[1:], a.dtype))
            tensors.append(t)
        elif not is_array and kind in _SCALARS:
            key.append(kind)
            key.append(a)
        else:
            return False

    def make():  # (strides as a contiguous tensor's, which later calls' tensors have where they matter)
        return prepare(kernel, n, args, work, min_chunk) if all(t.stride() == contiguous_strides(t.shape) for t in tensors) else None

    launch = ranged(tuple(key), make, arrays[1], tuple(t.shape[0] if t.dim() else 0 for t in tensors), n, work, min_chunk)  # (a 0-d tensor's: 0, as packed)
    if launch is None:
        return False
    launch.run_at(launch.fields(*arrays[0]), *tensors)
    return True


def contiguous_strides(shape) -> tuple:
    """The strides (in elements) torch gives a contiguous tensor of ``shape`` (an empty
    dimension counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


_SCALARS = (int, float, bool)
_params: dict = {}  # (kernel, argument count) -> :func:`_array_params`


def _array_params(kernel, count: int):
    """(names, groups, which) of the parameters of ``kernel`` after ``start``: the names of its
    array parameters in order, each as a group of its own (:meth:`Prepared.lengths`), and
    whether each parameter is an array; None where it has not ``count`` of them."""
    found = _params.get((kernel, count), False)
    if found is False:
        params = kernel.adj.args[1:]
        which = tuple(wp.types.is_array(a.type) for a in params)
        labels = tuple(a.label for a, is_array in zip(params, which) if is_array)
        found = _params[(kernel, count)] = (labels, tuple((label,) for label in labels), which) if len(params) == count else None
    return found


def _serial(kernel, n: int, values: list) -> None:
    """Threads 0 .. n-1 of a loaded CPU ``kernel`` on the calling thread, with the converted ``values``."""
    native = _native(kernel, values)
    if native is None:
        wp.launch(kernel, dim=n, inputs=[0, *values], device="cpu")
        return
    forward, args_type, bounds_type = native
    forward(ctypes.byref(_bounds(bounds_type, n)), ctypes.byref(args_type(0, *values)))


def _half_bits(value) -> int:
    """The binary16 bits of a float16 scalar argument (a number), rounded as ``wp.launch`` packs
    it (Warp's own conversion: ties away from zero, where NumPy rounds them to even), so a
    kernel's first launch (through ``wp.launch``) and its packed ones see the same value."""
    if _WARP_HALF is not None:
        return int(_WARP_HALF(float(value)))
    with np.errstate(over="ignore"):  # (another Warp: NumPy's rounding; beyond float16 inf, as Warp's)
        return int(np.array(float(value), dtype=np.float16).view(np.uint16))


try:  # Warp's conversion of a float16 scalar (not public: found where this Warp keeps it)
    from warp._src.types import float_to_half_bits as _WARP_HALF
except ImportError:  # pragma: no cover
    _WARP_HALF = None


@functools.lru_cache(maxsize=256)
def _bounds(bounds_type, n: int):
    """Warp's launch bounds of ``n`` threads (read, never written, by a launch): made once per size."""
    return bounds_type((n,))


# Launches whose ``work`` (see :func:`launch`) is below this run on the calling thread alone:
# torch's own grain size for its parallel loops (at::internal::GRAIN_SIZE).
SERIAL_WORK = 1 << 15


class Prepared:
    """A CPU launch of a loaded kernel with its arguments packed once and kept (:func:`_runner`'s
    structs), for small calls repeated with arrays of the same shapes (or of any size its key
    names: :meth:`size`, :func:`ranged`): a call points the named array arguments at its
    tensors' memory (:meth:`run`) and runs the chunks, with no conversion or packing (most of a
    small call's launch). Every array argument that differs between calls
    must be named in each run: the packed structs hold addresses, not tensors, and only the
    tensors of ``keep`` are kept alive with them (work buffers the launch owns)."""

    __slots__ = ("kernel", "_run", "_chunks", "_args", "_dims", "_pointers", "_fields", "_puts", "_bounds", "_sizes", "keep")

    def __init__(self, kernel, bounds: list[int], values: list, keep: tuple = ()) -> None:
        self.kernel = kernel
        self._chunks = len(bounds) - 1
        self._run = _runner(kernel, bounds, [values] * self._chunks, "cpu", None)
        self._args = [args for _, _, args in self._run.entries]
        self._dims = [dim for _, dim, _ in self._run.entries]
        self._pointers: dict = {}
        self._fields: dict = {}
        self._puts: dict = {}
        self._bounds = None  # (:meth:`resize`'s views of each chunk's first thread and thread count, made at its first use)
        self._sizes = None
        self.keep = keep

    def _pointer(self, name: str) -> tuple:
        """The data-pointer fields of the array argument ``name`` in every chunk's packed
        arguments, as ctypes views of those structs (an array in a struct argument:
        ``struct__field``): made once, a run only stores each call's address in them."""
        *outer, field = name.split("__")
        found = []
        for args in self._args:
            for part in outer:
                args = getattr(args, part)
            array = getattr(args, field)  # (a view into the packed struct's buffer)
            found.append(ctypes.c_uint64.from_buffer(array, type(array).data.offset))  # (keeps ``array``, so the struct, alive)
        found = self._pointers[name] = tuple(found)
        return found

    def run(self, **arrays: torch.Tensor) -> None:
        """Run the launch with the named array arguments on the given contiguous tensors (an
        array in a struct argument: ``struct__field``)."""
        self.run_at(self.fields(*arrays), *arrays.values())

    def fields(self, *names: str) -> tuple:
        """The pointer fields of the array arguments ``names`` for :meth:`run_at` (found once)."""
        found = self._fields.get(names)
        if found is None:
            found = self._fields[names] = tuple((pointer, i) for i, name in enumerate(names)
                                                for pointer in (self._pointers.get(name) or self._pointer(name)))
        return found

    def run_at(self, fields: tuple, *tensors: torch.Tensor) -> None:
        """:meth:`run` with the array arguments of ``fields`` (:meth:`fields`) given in their order:
        every run goes through here (or through :meth:`point` and :func:`run_together`)."""
        for pointer, i in fields:
            pointer.value = tensors[i].data_ptr()
        if self._chunks == 1:
            self._run(0)  # on the calling thread
        else:
            run_chunks(self._run, 0, self._chunks)

    def lengths(self, *groups: tuple) -> tuple:
        """The length fields (``shape[0]``; ``shape[d]`` for a name given as ``(name, d)``, the
        byte stride ``strides[d]`` for ``(name, d, "strides")``) of the array arguments named in
        ``groups`` (tuples of names) in every chunk's packed arguments, for :meth:`resize`, which
        gives each group's fields one value: a launch kept for a range of sizes (its kernel
        reading each array's length from its shape) is told each call's."""
        found = []
        for g, names in enumerate(groups):
            for name in names:
                name, dim, kind = (name, 0, "shape") if isinstance(name, str) else (*name, "shape")[:3]
                *outer, field = name.split("__")
                for args in self._args:
                    for part in outer:
                        args = getattr(args, part)
                    array = getattr(args, field)
                    found.append((ctypes.c_int32.from_buffer(array, getattr(type(array), kind).offset + 4 * dim), g))
        return tuple(found)

    def resize(self, lengths: tuple, *sizes: int, threads: typing.Optional[int] = None) -> None:
        """Set the lengths of the arrays of ``lengths`` (:meth:`lengths`, this launch's or other
        launches' of one plan: one call sets them all) to ``sizes`` (one a group), and where
        ``threads`` is given, the launch to that many threads, cut into its chunks as
        :func:`chunk_bounds` cuts a range (evenly; the caller keeps a launch for the sizes that
        have its number of chunks: :func:`chunk_count`)."""
        for field, i in lengths:
            field.value = sizes[i]
        if threads is not None:
            bounds = self._bounds
            if bounds is None:
                bounds = self._bounds = (*self._views("start"), *(_view(dim, name) for dim in self._dims for name in ("shape", "size")))
            chunks = self._chunks
            if chunks == 1:
                bounds[1][0] = bounds[2].value = threads
                return
            for c in range(chunks):
                first = threads * c // chunks
                size = threads * (c + 1) // chunks - first
                bounds[c].value = first
                bounds[chunks + 2 * c][0] = bounds[chunks + 2 * c + 1].value = size

    def size(self, groups: tuple, sizes: tuple, threads: typing.Optional[int] = None, values: tuple = ()) -> None:
        """:meth:`resize` of the arrays named in ``groups`` (:meth:`lengths`, found once) to
        ``sizes`` and of the launch to ``threads`` (None: as they are), where they differ from
        the last call's, and the scalar arguments of ``values`` ((name, value) pairs,
        :meth:`put`) set, where they differ from the last call's: a launch kept for a range of
        sizes (and of those values)."""
        last = self._sizes
        if last is not None and (sizes, threads, values) == last:
            return
        if last is None or sizes != last[0] or threads != last[1]:
            lengths = self._fields.get(groups)
            if lengths is None:
                lengths = self._fields[groups] = self.lengths(*groups)
            self.resize(lengths, *sizes, threads=threads)
        if last is None or values != last[2]:
            for name, value in values:
                self.put(name, value)
        self._sizes = sizes, threads, values

    def put(self, name: str, value) -> None:
        """Set the scalar argument ``name`` to ``value`` (a number; a vector argument's: a tuple of
        them) in every chunk's packed arguments, converted as they were packed (by ctypes: not
        a float16 scalar, packed as its bits, which no caller puts); a field of a struct
        argument: ``struct__field``. The fields are written through ctypes views of the packed
        structs, made once (Warp's vector assignment checks each element in Python)."""
        views = self._puts.get(name)
        if views is None:
            views = self._puts[name] = self._views(name)
        if isinstance(value, tuple):
            for view in views:
                view[:] = value
        else:
            for view in views:
                view.value = value

    def _views(self, name: str) -> tuple:
        """The field ``name`` (:meth:`put`) of every chunk's packed arguments as a ctypes view of
        its struct: a scalar's own type, a vector's as a plain ctypes array of its scalars."""
        *outer, field = name.split("__")
        found = []
        for args in self._args:
            for part in outer:
                args = getattr(args, part)
            found.append(_view(args, field))
        return tuple(found)

    def point(self, fields: tuple, *tensors: torch.Tensor) -> None:
        """Point the array arguments of ``fields`` at ``tensors`` without running (:func:`run_together`)."""
        for pointer, i in fields:
            pointer.value = tensors[i].data_ptr()

    def held(self) -> int:
        """The bytes this launch holds (:meth:`Kept.put`): its packed structs and their views
        (:data:`LAUNCH_BYTES`) and its ``keep`` tensors."""
        return LAUNCH_BYTES + held_bytes(self.keep)


def _view(struct: ctypes.Structure, field: str):
    """The field ``field`` of a ctypes struct as a ctypes view of its memory (which keeps
    ``struct`` alive): a scalar's own type, an array's a plain ctypes array of its scalars
    (Warp's vectors check each element in Python on assignment; not its float16 vectors, packed
    as bits, whose own view converts)."""
    kind = dict(type(struct)._fields_)[field]
    if issubclass(kind, ctypes.Array) and not getattr(kind, "_wp_is_bit_converted_", False):
        kind = kind._type_ * kind._length_
    return kind.from_buffer(struct, getattr(type(struct), field).offset)


LAUNCH_BYTES = 16 << 10  # a kept launch's Python structs, counted at the top of what tracemalloc finds (docs/benchmarks.md, design choices)


def run_together(launches: tuple) -> None:
    """Prepared launches independent of each other, each pointed at its arrays
    (:meth:`Prepared.point`), in one fork-join: their chunks taken in turn by the first free
    thread (two one-thread launches: one a thread)."""
    calls = [(launch._run, c) for launch in launches for c in range(launch._chunks)]

    def run(c: int) -> None:
        calls[c][0](calls[c][1])

    run.entries = [entry for launch in launches for entry in launch._run.entries]
    run_chunks(run, 0, len(calls))


class Kept:
    """The calling thread's kept objects (prepared launches, search plans, mesh builds) by key: at
    most ``most`` of them holding at most ``budget`` bytes together (what each is said to hold),
    the least recently used dropped first. A key is made on its second miss among the thread's
    last ``most`` misses: a stream of shapes seen once (a cloud of a new size every call) pays
    neither for making a kept object nor for dropping one, and a cycle of up to ``most`` shapes
    (clouds of a few hundred sizes in turn) stays kept whole (docs/benchmarks.md, design
    choices)."""

    def __init__(self, most: int, budget: int) -> None:
        self.most, self.budget = most, budget
        self._local = threading.local()

    def _mine(self):
        local = self._local
        if not hasattr(local, "found"):
            local.found, local.seen, local.bytes = {}, {}, 0  # (dicts keep their keys' order: oldest first)
        return local

    def get(self, key):
        """The object kept for ``key`` (now the most recently used), or None."""
        found = getattr(self._local, "found", None)
        entry = None if found is None else found.pop(key, None)
        if entry is None:
            return None
        found[key] = entry
        return entry[0]

    def admit(self, key) -> bool:
        """Whether to make ``key``'s object now, on a miss: where ``key`` was missed once among the
        last ``most`` misses, or is kept (made under other switches: the caller replaces it)."""
        mine = self._mine()
        if key in mine.found or key in mine.seen:
            return True
        mine.seen[key] = None
        if len(mine.seen) > self.most:
            del mine.seen[next(iter(mine.seen))]
        return False

    def put(self, key, value, nbytes: int = 0) -> None:
        """Keep ``value`` for ``key`` (holding ``nbytes``), dropping the least recently used past the bounds."""
        mine = self._mine()
        found = mine.found
        mine.seen.pop(key, None)
        old = found.pop(key, None)
        mine.bytes += nbytes - (old[1] if old is not None else 0)
        found[key] = (value, nbytes)
        while len(found) > self.most or (mine.bytes > self.budget and len(found) > 1):
            mine.bytes -= found.pop(next(iter(found)))[1]

    def keys(self) -> list:
        """The calling thread's kept keys, least recently used first."""
        return list(getattr(self._local, "found", {}))

    def clear(self) -> None:
        """Drop the calling thread's kept objects and sightings."""
        self._local.__dict__.clear()


def held_bytes(*values) -> int:
    """The bytes of the tensors among ``values`` (nested in tuples and lists, None skipped): what a
    kept object says it holds (:meth:`Kept.put`)."""
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.untyped_storage().nbytes()
        elif isinstance(value, (tuple, list)):
            total += held_bytes(*value)
    return total


# A thread's kept launches, search plans and mesh builds (:data:`KEPT`): this many at most (a
# cloud's calls keep a few each: a cycle of some hundred sizes is kept whole), holding at most
# this many bytes (what each says it holds: :meth:`Prepared.held`, the plans' and builds' arrays)
KEEP_PREPARED = 1024
KEEP_BYTES = 32 << 20
KEPT = Kept(KEEP_PREPARED, KEEP_BYTES)


def prepared(key, make):
    """The calling thread's :class:`Prepared` launch (or plan of them: any object with a
    ``held()``) for ``key`` and torch's thread count (which sets the chunks), kept in
    :data:`KEPT`: ``make()`` builds it on the key's second miss (None: not now, see
    :func:`prepare`); None before that (the caller launches as usual)."""
    if not PREPARED[0]:
        return None
    return _kept((key, _threads.requested()), make)


def kept(key):
    """:func:`prepared`'s object for ``key`` where one is kept, else None (nothing is made or
    counted as a miss): the lookup of a call's fast path, which takes the full path on None."""
    return KEPT.get((key, _threads.requested())) if PREPARED[0] else None


def _kept(key, make):
    """:func:`prepared` of a key that holds the thread count."""
    found = KEPT.get(key)
    if found is None and KEPT.admit(key):
        found = make()
        if found is not None:  # (None: asked again next time, once the kernel is loaded)
            KEPT.put(key, found, found.held())
    return found


PREPARED = [True]  # False: every launch packed anew (tests and measurements compare both)


def ranged(key, make, groups: tuple, sizes: tuple, threads: int, work: typing.Optional[int], min_chunk: int = 1,
           values: tuple = ()) -> typing.Optional[Prepared]:
    """:func:`prepared` for a launch that serves every size cut into as many chunks (``key`` names
    the rest: what its kernel's arguments hold besides the lengths of its arrays and the
    scalars of ``values``): the launch of ``threads`` threads that :func:`prepare` makes with
    ``work`` and ``min_chunk``, its arrays named in ``groups`` (:meth:`Prepared.lengths`) set
    to this call's ``sizes``, one a group, and its scalar arguments to ``values`` ((name,
    value) pairs: :meth:`Prepared.put`). The kernel must read each size from those lengths (or
    from arrays the caller points), and ``make()`` must give arrays it keeps room for every
    size of ``key``."""
    if not PREPARED[0]:
        return None
    requested = _threads.requested()
    launch = _kept((key, chunk_count(threads, work, min_chunk, requested), requested), make)
    if launch is not None:
        launch.size(groups, sizes, threads, values)
    return launch


def prepare(kernel, n: int, args: list, work: typing.Optional[int], min_chunk: int = 1, keep: tuple = ()) -> typing.Optional[Prepared]:
    """A :class:`Prepared` CPU launch of ``kernel`` over threads 0 .. n-1 with the arguments
    ``args`` (as :func:`launch` takes them), chunked as :func:`launch` chunks it (serial below
    :data:`SERIAL_WORK` steps of ``work``; None: by ``min_chunk`` alone); None where the kernel
    is not loaded yet (its first launch goes through :func:`launch`) or has no native entry point."""
    values = [convert(a) for a in args]
    if (kernel, "cpu") not in _loaded or _native(kernel, values) is None:
        return None
    chunks = chunk_count(n, work, min_chunk)  # (:func:`ranged` keys its launches by this count)
    bounds = [n * c // chunks for c in range(chunks + 1)]
    return Prepared(kernel, bounds, values, keep)


def recorded(kernel, n: int, args: list, like: torch.Tensor, min_chunk: int = MIN_CHUNK):
    """``launch`` prepared once, for a kernel launched many times with the same arrays (their
    contents may change between runs): returns a function of no arguments that runs it. The
    arguments are packed once: into the entry point's structs on the CPU (:func:`_runner`), into
    commands Warp records (``record_cmd``) on CUDA, so a run costs the kernel and little else."""
    dev = device(like)
    s = cuda_stream(like)
    bounds = chunk_bounds(n, s, min_chunk) if n > 0 else [0]
    values = [convert(a) for a in args]
    chunks = len(bounds) - 1

    def record(c: int):
        start, stop = bounds[c], bounds[c + 1]
        return wp.launch(kernel, dim=stop - start, inputs=[start, *values], device=dev, stream=s, record_cmd=True)

    if chunks == 0:
        return lambda: None
    first_load(kernel, dev, lambda: record(0))
    if s is None:
        run = _runner(kernel, bounds, [values] * chunks, dev, s)
        return lambda: run_chunks(run, 0, chunks)
    commands = [record(c) for c in range(chunks)]
    return lambda: run_chunks(lambda c: commands[c].launch(stream=s), 0, chunks)

