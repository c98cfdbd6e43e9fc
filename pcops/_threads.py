"""CPU threads for pcops' work on a machine other processes share.

pcops' CPU work (its own chunked Warp launches and the torch operations inside its ops) runs
on ``torch.get_num_threads()`` threads, less the cores other processes kept busy in the last
:data:`WINDOW` seconds (:func:`available`). A fork-join over more threads than there are free
cores waits, at each join, for a thread the scheduler has not run yet, and static chunks wait for
the slowest: a call made of many short parallel steps then takes several times its serial time.
With the busy cores left out, a call on a shared machine costs at most what its share of the
machine allows.

The busy cores are read from Linux's ``/proc/stat`` (the CPU time of the cores this process
may run on) less this process's own CPU time, at most once per window; where that cannot be
read, every thread is used. :func:`custom_op` defines pcops' custom ops with a CPU kernel that
runs under :func:`limited`, and :func:`limits` runs every public function under it, so torch
operations inside an op follow the same count; the count torch reports outside pcops' ops is
never changed. A launch is still cut into the chunks of the caller's count (:func:`requested`)
and only run on fewer threads, so results do not depend on how busy the machine is.
"""

import contextlib
import functools
import os
import threading
import time

import torch
from torch.autograd import forward_ad as _forward_ad

from . import _validate

# Seconds between two readings of the machine's CPU time: the busy cores are those of the last one.
WINDOW = 0.25

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_lock = threading.Lock()
# [time, busy ticks of this process's cores, own CPU seconds, cores free for pcops] of the last
# reading (free cores None where no other process keeps a core busy, or before two readings)
_last: list = [None, None, None, None]


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) reads the machine afresh, under a lock of its own
    (another thread of the parent may have held it at the fork)."""
    global _lock
    _lock = threading.Lock()
    _last[:] = [None, None, None, None]


os.register_at_fork(after_in_child=_after_fork_in_child)


def available() -> int:
    """How many threads pcops' CPU work runs on: torch's count, or, where other processes kept
    a core or more busy in the last window, at most the cores of this process's affinity they
    left free (at least 1)."""
    wanted = torch.get_num_threads()
    if wanted <= 1:
        return wanted
    now = time.monotonic()
    if _last[0] is None or now - _last[0] >= WINDOW:
        _refresh(now)
    free = _last[3]
    return wanted if free is None else max(1, min(wanted, free))


def _all_free() -> bool:
    """Whether the last reading, within the window, found no other process keeping a core busy:
    :func:`available` is then torch's count, known without reading torch's count (the common
    case's check, in every eager call)."""
    then = _last[0]
    return then is not None and _last[3] is None and time.monotonic() - then < WINDOW


def _refresh(now: float) -> None:
    with _lock:
        if _last[0] is not None and now - _last[0] < WINDOW:
            return
        cores = _cores()
        busy = _busy_ticks(cores)
        own = sum(os.times()[:2])
        if busy is None:
            _last[:] = [now, None, None, None]
            return
        then, busy0, own0, _ = _last
        free = None
        if then is not None and busy0 is not None:
            others = int(max(((busy - busy0) / _TICKS - (own - own0)) / (now - then), 0.0) + 0.5)
            free = len(cores) - others if others else None
        _last[:] = [now, busy, own, free]


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _busy_ticks(cores: list[int]):
    """The ticks the CPUs ``cores`` spent on anything but idling (steal included: a
    hypervisor's other guests), from /proc/stat; None where it cannot be read."""
    wanted = {f"cpu{c}" for c in cores}
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and not line.startswith("cpu ")]
        total = 0
        for fields in lines:
            if fields[0] in wanted:
                ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks) - ticks[3] - ticks[4]
        return total
    except (OSError, ValueError, IndexError):
        return None


def requested() -> int:
    """torch's thread count as the caller set it, inside :func:`limited` too: the number of
    chunks a CPU launch is split into, so that results (sums of private copies) do not depend on
    how busy the machine is; :func:`available` threads run them."""
    return _local.requested or torch.get_num_threads()


class _Local(threading.local):
    """Per-thread state; the class attribute is every thread's default (a missing attribute's
    lookup costs an exception, a third of a small call's thread-count read)."""

    requested = None


_local = _Local()


def limited():
    """A context manager: torch's thread count set to :func:`available` for the block (where that
    is fewer), then restored. Where every thread is available (the common case) it does nothing,
    and costs a call less than a generator's context."""
    if _all_free():
        return _ALL
    wanted = torch.get_num_threads()
    n = available()
    return _ALL if n >= wanted else _Fewer(n, wanted)


_ALL = contextlib.nullcontext()


class _Fewer:
    """The block of :func:`limited` on ``n`` threads of the caller's ``wanted``."""

    def __init__(self, n: int, wanted: int) -> None:
        self.n, self.wanted = n, wanted

    def __enter__(self) -> None:
        self.outer = _fewer(self.n, self.wanted)

    def __exit__(self, *exc) -> None:
        _restore(self.wanted, self.outer)


def _fewer(n: int, wanted: int):
    """Enter a block on ``n`` threads of the caller's ``wanted``: the thread's requested count before it."""
    outer = _local.requested
    _local.requested = outer or wanted
    torch.set_num_threads(n)
    return outer


def _restore(wanted: int, outer) -> None:
    """Leave the block :func:`_fewer` entered."""
    torch.set_num_threads(wanted)
    _local.requested = outer


def custom_op(name: str, fn=None, /, **kwargs):
    """``torch.library.custom_op(name, fn, **kwargs)`` (also as a decorator) with a CPU kernel
    that runs ``fn`` under :func:`limited`, its calls taken as :func:`_call` says."""
    if fn is None:
        return functools.partial(custom_op, name, **kwargs)
    op = torch.library.custom_op(name, fn, **kwargs)

    @functools.wraps(fn)
    def cpu(*args, **kw):
        with limited():
            return fn(*args, **kw)

    op.register_kernel("cpu", cpu)
    # an op whose schema was given (warp_op's) is always dispatched: the schema converts and
    # checks its arguments for ``fn``; one read from ``fn``'s signature has nothing to convert
    op._pcops_direct = {} if "schema" in kwargs else {"cpu": cpu, "cuda": fn}
    op.__class__ = _op_type(type(op))  # the same op, called through :func:`_call`
    return op


@functools.cache
def _op_type(base: type) -> type:
    return type("Op", (base,), {"__call__": _call, "__module__": __name__})


def _call(op, *args, **kwargs):
    """A call of a pcops custom op. With plain CPU or CUDA tensors in eager mode and no gradient
    to record (the common small call), its kernel runs directly: the dispatcher's round trip
    (autograd's and the device's keys, about 20 us a call) decides nothing there. Any other call
    (compiled or traced by torch.jit, under a dispatch or function mode, functorch, forward-mode
    AD, the profiler; tensor subclasses, negated or conjugated views, a gradient to record; an
    op whose schema was given) goes through the dispatcher, as ``torch.ops.pcops.<name>``
    always does."""
    direct = op._pcops_direct.get(plain_device(args, kwargs)) if DIRECT[0] and op._pcops_direct else None
    return direct(*args, **kwargs) if direct is not None else super(type(op), op).__call__(*args, **kwargs)


# Whether plain eager calls of pcops custom ops run their kernels directly (:func:`_call`;
# tests switch it off to compare both paths)
DIRECT = [True]


def plain_eager() -> bool:
    """Whether a call runs in plain eager mode: not compiled or traced by torch.jit, under no
    dispatch or function mode, functorch transform, forward-mode AD or the profiler."""
    return not (_compiling() or _dispatch_modes() or _function_modes() or _profiling() or _transforms() is not None
                or _jit_tracing() is not None or _forward_ad._current_level >= 0)


def values_readable() -> bool:
    """Whether a call may read tensors' values outside torch (NumPy views of CPU tensors): eager
    mode, under no dispatch or function mode, functorch transform or torch.jit trace (forward-mode
    AD and the profiler allowed)."""
    return not (_compiling() or _dispatch_modes() or _function_modes() or _transforms() is not None or _jit_tracing() is not None)


def forward_mode() -> bool:
    """Whether forward-mode AD (``torch.autograd.forward_ad``'s dual level) is on."""
    return _forward_ad._current_level >= 0


def plain_device(args, kwargs, read_only: bool = False):
    """The device type of a plain eager call's tensors ("cpu" or "cuda"; None for any other call);
    ``read_only``: for a call that only reads their values (a tensor may require grad)."""
    if not plain_eager():
        return None
    grad = not read_only and torch.is_grad_enabled()
    kind = None
    for value in (*args, *kwargs.values()) if kwargs else args:
        for t in value if type(value) in (list, tuple) else (value,):
            if isinstance(t, torch.Tensor):
                if type(t) is not torch.Tensor or (grad and t.requires_grad) or t.is_neg() or t.is_conj():
                    return None  # (a negated or conjugated view: the dispatcher materialises it)
                device = "cpu" if t.is_cpu else "cuda" if t.is_cuda else None
                if kind is None:
                    kind = device
                if device is None or device != kind:  # another kind, or mixed: the dispatcher's to decide
                    return None
    return kind


_compiling, _dispatch_modes, _function_modes = torch.compiler.is_compiling, torch._C._len_torch_dispatch_stack, torch._C._is_torch_function_mode_enabled
_profiling, _transforms, _jit_tracing = torch.autograd._profiler_enabled, torch._C._functorch.peek_interpreter_stack, torch._C._get_tracing_state


def differentiable(*tensors: torch.Tensor) -> bool:
    """Whether a derivative with respect to ``tensors`` may be asked for: a gradient to record
    (grad mode on, one of them requires grad), or, in eager mode, forward-mode AD or a torch.func
    transform (whose tensors need not require grad). Ops that skip their differentiable torch
    formula when nothing is to be differentiated ask this (under torch.compile: the first rule)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return not _compiling() and (_forward_ad._current_level >= 0 or _transforms() is not None)


def reverse_only(name: str, *tensors) -> None:
    """Raise NotImplementedError where a forward-mode derivative would flow through ``tensors``
    into a custom op whose autograd is reverse-mode only (torch.library's ``register_autograd``:
    forward mode gets no tangent from it, a silent zero): a dual tensor of
    ``torch.autograd.forward_ad``, ``torch.func.jvp`` or ``jacfwd`` with a tangent (eager calls;
    None entries skipped)."""
    if _compiling():
        return
    if _forward_ad._current_level >= 0 and any(  # (torch.func.jvp and jacfwd hold their tangents so too)
            isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(
            f"{name} has no forward-mode derivative (torch.func.jvp, jacfwd, torch.autograd.forward_ad): its custom op's "
            "autograd is reverse-mode only; take reverse-mode derivatives with backward() or torch.autograd.grad (torch.func's "
            "transforms do not reach through it either)")


def limits(fn):
    """Decorator of a public function: its eager calls run under :func:`limited` (the torch
    operations around its custom ops included); traced by ``torch.compile``, it is ``fn``. A
    ``validate`` keyword must be a bool (a TypeError naming it).

    A call with an argument of a type in :data:`PROTOCOL_TYPES` (or a subclass) goes through
    torch's ``__torch_function__`` protocol, as torch's own Python functions do: the type's
    ``__torch_function__`` receives the public function itself (PhysicsNeMo's ShardTensor, whose
    handlers :func:`pcops.distributed.shard_tensor.register` adds); under ``torch.compile``
    eagerly, at a graph break."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs:
            checked = kwargs.get("validate", True)
            if checked is not True and checked is not False:  # (every public op's flag, keyword-only: None or 1 would pass a truth test)
                _validate.flag(validate=checked)
        if PROTOCOL_TYPES:
            types = tuple(PROTOCOL_TYPES)
            routed = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, types))
            if routed and (_compiling() or torch._C._is_torch_function_enabled()):
                return _protocol(call, routed, args, kwargs)
        if _compiling() or _all_free():
            return fn(*args, **kwargs)
        wanted = torch.get_num_threads()
        n = available()
        if n >= wanted:  # (:func:`limited` without its context)
            return fn(*args, **kwargs)
        outer = _fewer(n, wanted)  # (:class:`_Fewer`'s block without a context object: a small call's time)
        try:
            return fn(*args, **kwargs)
        finally:
            _restore(wanted, outer)

    return call


@torch.compiler.disable
def _protocol(public, routed: tuple, args: tuple, kwargs: dict):
    return torch.overrides.handle_torch_function(public, routed, *args, **kwargs)


# Tensor subclasses whose __torch_function__ the public functions call (empty: none; other
# subclasses run through the functions as plain tensors do)
PROTOCOL_TYPES: set = set()
