"""``pcops.warp_op``: a user's Warp kernel as a ``torch.compile``-safe PyTorch custom op.

:func:`warp_op` wraps an already built ``@wp.kernel`` in a ``torch.library`` custom op the
way every op of pcops is written: an exact fake implementation (from the declared output
shapes), a launch on PyTorch's current stream (CUDA) or split over the CPU cores, and
autograd through a second, explicit custom op (``name + "_backward"``) over the saved input
and output tensors. No ``wp.Tape`` is kept across the forward/backward boundary: hidden
state there gave corrupted compiled outputs, wrong compiled gradients and ``retain_graph``
failures elsewhere (docs/warp_op.md).

The rules this module follows:

* the kernel's annotations are the op's signature: its parameters are the op's inputs
  followed by its outputs (the last ``len(outputs)`` parameters, named as ``outputs``'
  keys); an array parameter is a tensor of the array's element scalar dtype and of rank
  ``ndim`` plus the element's own dims (``wp.array(dtype=wp.vec3d)`` is a float64 (N, 3)
  tensor), a scalar parameter a Python number;
* outputs are allocated by the op, zeroed; their torch shapes are declared, as functions of
  the inputs, and checked against the kernel's annotations in the fake and real
  implementations alike;
* a kernel whose first parameter is ``start: int`` is launched by :func:`pcops._warp.launch`
  (split into one chunk per CPU thread; outputs declared ``accumulate`` get a private copy
  per chunk), any other kernel by one ``wp.launch`` (one CPU thread);
* the backward launches Warp's generated adjoint (``adjoint=True``) with zeroed gradient
  arrays as ``adj_inputs`` (split kernels: a private copy per extra CPU chunk, summed back,
  since Warp's adjoint accumulations are plain adds on the CPU) and the output gradients as
  the output adjoints, or a user-supplied backward kernel;
* every tensor reaches Warp through :func:`pcops._warp.array` (no gradient buffer, no sync).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy
import torch
import warp as wp

from . import _threads, _warp

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INT_TYPES = (wp.int8, wp.uint8, wp.int16, wp.uint16, wp.int32, wp.uint32, wp.int64, wp.uint64)
_FLOAT_TYPES = (wp.float16, wp.float32, wp.float64)
_FLOAT_MAX = {t: float(numpy.finfo(d).max) for t, d in zip(_FLOAT_TYPES, (numpy.float16, numpy.float32, numpy.float64))}


@dataclasses.dataclass(frozen=True)
class _Param:
    """One kernel parameter as the op sees it."""

    name: str
    warp_type: Any  # the kernel's annotation
    schema: str  # "Tensor", "float", "SymInt" or "bool"
    dtype: Optional[torch.dtype] = None  # arrays: the tensor dtype
    ndim: int = 0  # arrays: the tensor rank (array dims + element dims)
    inner: tuple = ()  # arrays: the element's dims ((3,) for vec3, (3, 3) for mat33)

    @property
    def is_array(self) -> bool:
        return self.schema == "Tensor"

    @property
    def differentiable(self) -> bool:
        return self.is_array and self.dtype.is_floating_point

    def describe(self) -> str:
        if not self.is_array:
            return f"a Python {self.schema.replace('SymInt', 'int')}"
        trailing = ", ".join(map(str, self.inner))
        shape = ", ".join(["..."] * (self.ndim - len(self.inner))) + (f", {trailing}" if trailing else "")
        return f"a {self.dtype} tensor of rank {self.ndim} ({shape})"


def _param(kernel_arg, what: str) -> _Param:
    """The :class:`_Param` of a kernel argument (``what`` names the declaration checked)."""
    name, t = kernel_arg.label, kernel_arg.type
    if wp.types.is_array(t):
        if type(t) is not wp.array:
            raise TypeError(f"{what}: parameter {name!r} is a {type(t).__name__}; only wp.array parameters are supported")
        element = t.dtype
        scalar = getattr(element, "_wp_scalar_type_", element)
        inner = tuple(getattr(element, "_shape_", ()))
        try:
            dtype = wp.dtype_to_torch(scalar)
        except Exception as err:  # noqa: BLE001 (re-raised naming the parameter)
            raise TypeError(f"{what}: parameter {name!r} has elements of type {wp.types.type_repr(element)}, "
                            "which have no torch dtype (use scalar, vector or matrix elements)") from err
        return _Param(name, t, "Tensor", dtype, t.ndim + len(inner), inner)
    if t in _FLOAT_TYPES:
        return _Param(name, t, "float")
    if t in _INT_TYPES:
        return _Param(name, t, "SymInt")
    if t is wp.bool:
        return _Param(name, t, "bool")
    raise TypeError(f"{what}: parameter {name!r} has type {wp.types.type_repr(t)}; warp_op supports wp.array "
                    "parameters and int, float and bool scalars (pass vectors as tensors)")


def _registered(name: str) -> bool:
    """Whether an operator ``namespace::op`` exists in torch's dispatcher."""
    namespace, op = name.split("::")
    try:
        getattr(getattr(torch.ops, namespace), op)
        return True
    except (AttributeError, RuntimeError):
        return False


def _split(kernel, what: str) -> bool:
    """Whether the kernel's first parameter is the ``start: int`` of a split launch."""
    args = kernel.adj.args
    if not args or args[0].label != "start":
        return False
    if args[0].type not in _INT_TYPES:
        raise TypeError(f"{what}: the first parameter 'start' must be an int (the index of a chunk's first thread)")
    return True


def _check_kernel(kernel, what: str) -> None:
    if not isinstance(kernel, wp.Kernel):
        raise TypeError(f"{what} must be a Warp kernel (a function decorated with @wp.kernel), got {type(kernel).__name__}")
    if kernel.is_generic:
        raise TypeError(f"{what}: {kernel.key!r} is generic (typing.Any annotations); pass a concrete overload "
                        "(annotate its types, or use wp.overload)")


def _shape_function(name: str, declared) -> Callable:
    if callable(declared):
        return declared
    if isinstance(declared, Sequence) and all(isinstance(d, int) and not isinstance(d, bool) for d in declared):
        shape = tuple(declared)
        return lambda *_: shape
    raise TypeError(f"outputs[{name!r}] must be a function of the inputs returning the output's shape, or a tuple of ints")


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What :func:`warp_op` derived from the kernel and the declarations."""

    name: str
    kernel: Any
    split: bool
    inputs: tuple  # of _Param
    outputs: tuple  # of _Param
    shapes: tuple  # per output: a function of the inputs giving its torch shape
    dim: Callable
    grad: tuple  # positions in ``inputs`` of the differentiable inputs
    accumulate: tuple  # positions in ``outputs`` of the outputs accumulated by several threads
    backward: Any  # a user backward kernel, or None (Warp's adjoint)
    backward_split: bool
    min_chunk: int
    per_thread: tuple = ()  # (input or output, position) of the arrays indexed by the thread id along their first axis

    @property
    def float_outputs(self) -> tuple:
        return tuple(i for i, p in enumerate(self.outputs) if p.differentiable)

    def like(self, args) -> torch.Tensor:
        return next(a for a, p in zip(args, self.inputs) if p.is_array)

    def check_inputs(self, args) -> list:
        """The inputs, tensors made contiguous, after checking them against the kernel's annotations."""
        like = self.like(args)
        checked = []
        for a, p in zip(args, self.inputs):
            if p.is_array:
                if a.dtype != p.dtype:
                    raise TypeError(f"{self.name}: {p.name} must be {p.describe()} (the kernel declares "
                                    f"{wp.types.type_repr(p.warp_type)}), got dtype {a.dtype}")
                if a.ndim != p.ndim or (p.inner and tuple(a.shape[a.ndim - len(p.inner):]) != p.inner):
                    raise ValueError(f"{self.name}: {p.name} must be {p.describe()} (the kernel declares "
                                     f"{wp.types.type_repr(p.warp_type)}), got shape {tuple(a.shape)}")
                if a.device != like.device:
                    raise ValueError(f"{self.name}: {p.name} is on {a.device}, the other inputs on {like.device}")
                a = a.contiguous()
            elif p.warp_type in _INT_TYPES and type(a) is int:
                info = numpy.iinfo(numpy.dtype(p.warp_type._type_))
                if not info.min <= a <= info.max:
                    raise ValueError(f"{self.name}: {p.name} = {a} does not fit the kernel's "
                                     f"{wp.types.type_repr(p.warp_type)} ({info.min} .. {info.max})")
            elif p.warp_type in _FLOAT_TYPES and isinstance(a, float) and math.isfinite(a) and abs(a) > _FLOAT_MAX[p.warp_type]:
                # (NaN and inf pass as given; the schema makes an int argument a float)
                raise ValueError(f"{self.name}: {p.name} = {a} does not fit the kernel's {wp.types.type_repr(p.warp_type)} "
                                 f"(|value| <= {_FLOAT_MAX[p.warp_type]:.6g}; it would be inf there)")
            checked.append(a)
        return checked

    def output_shapes(self, args) -> list:
        shapes = []
        for p, shape_of in zip(self.outputs, self.shapes):
            shape = shape_of(*args)
            if isinstance(shape, int) or isinstance(shape, torch.SymInt):
                shape = (shape,)
            shape = tuple(shape)
            if any(isinstance(d, bool) or not isinstance(d, (int, torch.SymInt)) for d in shape) or any(d < 0 for d in shape):
                raise ValueError(f"{self.name}: outputs[{p.name!r}] declared shape {shape}; a shape holds ints >= 0")
            if len(shape) != p.ndim or (p.inner and tuple(shape[p.ndim - len(p.inner):]) != p.inner):
                raise ValueError(f"{self.name}: outputs[{p.name!r}] declared shape {shape}, but the kernel's "
                                 f"{wp.types.type_repr(p.warp_type)} needs {p.describe()}")
            shapes.append(shape)
        return shapes

    def check_rows(self, args, shapes: list, dims=None) -> None:
        """Each ``per_thread`` array has at least as many rows (first axis) as the first launch
        dimension has threads, else a ValueError naming it (shapes only: compile-safe). ``dims``:
        the checked launch dimensions (eager); None: ``dim``'s own, possibly symbolic, sizes (the
        fake: no ``operator.index``, which would fix a dynamic size)."""
        if not self.per_thread:
            return
        if dims is None:
            dims = self.dim(*args)
        threads = dims[0] if isinstance(dims, Sequence) else dims
        for kind, i in self.per_thread:
            p, rows = (self.inputs[i], args[i].shape) if kind == "input" else (self.outputs[i], shapes[i])
            if rows[0] < threads:
                what = p.name if kind == "input" else f"outputs[{p.name!r}]"
                raise ValueError(f"{self.name}: {what} has {rows[0]} rows, fewer than the {threads} threads of dim's "
                                 f"first dimension (per_thread: each thread indexes it by its id)")

    def threads(self, args, split: bool):
        """The launch dimensions: an int for a split kernel, an int or a tuple of ints otherwise."""
        dim = self.dim(*args)
        try:
            dims = (operator.index(dim),) if not isinstance(dim, Sequence) else tuple(operator.index(d) for d in dim)
        except TypeError:
            dims = ()
        if isinstance(dim, bool) or (isinstance(dim, Sequence) and any(isinstance(d, bool) for d in dim)):
            dims = ()  # (True is not a thread count)
        if not 1 <= len(dims) <= 4 or min(dims) < 0:
            raise ValueError(f"{self.name}: dim returned {dim!r}; it must return an int >= 0 or a tuple of 1 to 4 of them")
        if split and len(dims) != 1:
            raise ValueError(f"{self.name}: dim returned {dim!r}; a kernel with a 'start' parameter takes one dimension")
        return dims[0] if len(dims) == 1 else dims


def _typed(t: torch.Tensor, p: _Param):
    return _warp.Typed(t, p.warp_type.dtype)


def _size(dim) -> int:
    if isinstance(dim, int):
        return dim
    size = 1
    for d in dim:
        size *= d
    return size


def _launch(kernel, split: bool, dim, args: list, like: torch.Tensor, scatter: tuple, min_chunk: int) -> None:
    """A forward launch of ``kernel`` over ``dim`` threads (``args`` without ``start``)."""
    _warp.init()
    if split:
        _warp.launch(kernel, dim, args, like=like, scatter=scatter, min_chunk=min_chunk)
        return
    if _size(dim) == 0:
        return
    dev, stream = _warp.device(like), _warp.cuda_stream(like)
    values = [_warp.convert(a) for a in args]

    def run() -> None:
        wp.launch(kernel, dim, inputs=values, device=dev, stream=stream)

    if not _warp.first_load(kernel, dev, run):  # the first launch on a device loads the module, under the build lock
        run()


def _launch_adjoint(kernel, split: bool, dim, args: list, adj: list, like: torch.Tensor, private: tuple, min_chunk: int) -> None:
    """Warp's generated adjoint of ``kernel`` over ``dim`` threads: ``args`` the forward's
    arguments, ``adj`` their adjoints (None: none); the tensors of ``adj`` at the positions
    ``private`` are accumulated into, so each extra CPU chunk gets a zeroed copy of them."""
    _warp.init()
    if _size(dim) == 0:
        return
    dev, stream = _warp.device(like), _warp.cuda_stream(like)
    values = [_warp.convert(a) for a in args]
    if not split:
        adj_values = [None if a is None else _warp.convert(a) for a in adj]

        def run_all() -> None:
            wp.launch(kernel, dim, inputs=values, adj_inputs=adj_values, device=dev, stream=stream, adjoint=True)

        if not _warp.first_load(kernel, dev, run_all):
            run_all()
        return
    bounds = _warp.chunk_bounds(dim, stream, min_chunk)
    chunks = len(bounds) - 1
    extras = [{i: _warp.zeros_like(adj[i]) for i in private} for _ in range(chunks - 1)]
    adj_chunks = [[extra.get(i, a) for i, a in enumerate(adj)] for extra in [{}] + extras]
    adj_values = [[None, *(None if a is None else _warp.convert(a) for a in chunk)] for chunk in adj_chunks]

    def run(c: int) -> None:
        wp.launch(kernel, bounds[c + 1] - bounds[c], inputs=[bounds[c], *values], adj_inputs=adj_values[c],
                  device=dev, stream=stream, adjoint=True)

    first = _warp.first_load(kernel, dev, lambda: run(0))
    _warp.run_chunks(run, 1 if first else 0, chunks)
    for extra in extras:
        for i, t in extra.items():
            adj[i].tensor.add_(t.tensor)


def _schema(params: Sequence[tuple[str, str]], results: int) -> str:
    args = ", ".join(f"{schema} {name}" for name, schema in params)
    out = "Tensor" if results == 1 else "(" + ", ".join(["Tensor"] * results) + ")"
    return f"({args}) -> {out}"


def _unique(name: str, taken: set) -> str:
    while name in taken:
        name = "_" + name
    taken.add(name)
    return name


def _forward_impl(spec: _Spec):
    def forward(*args):
        args = spec.check_inputs(args)
        like = spec.like(args)
        shapes, dims = spec.output_shapes(args), spec.threads(args, spec.split)
        spec.check_rows(args, shapes, dims)
        outs = [torch.zeros(shape, dtype=p.dtype, device=like.device) for shape, p in zip(shapes, spec.outputs)]
        launch_args = [_typed(a, p) if p.is_array else a for a, p in zip(args, spec.inputs)]
        launch_args += [_typed(o, p) for o, p in zip(outs, spec.outputs)]
        scatter = tuple(len(spec.inputs) + i for i in spec.accumulate)
        _launch(spec.kernel, spec.split, dims, launch_args, like, scatter, spec.min_chunk)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def fake(*args):
        spec.check_inputs(args)
        like = spec.like(args)
        shapes = spec.output_shapes(args)
        spec.check_rows(args, shapes)
        outs = [like.new_empty(shape, dtype=p.dtype) for shape, p in zip(shapes, spec.outputs)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return forward, fake


def _backward_impl(spec: _Spec):
    n_in, n_out = len(spec.inputs), len(spec.outputs)

    def backward(*args):
        inputs = spec.check_inputs(args[:n_in])
        outs = [o.contiguous() for o in args[n_in:n_in + n_out]]
        grad_outs = dict(zip(spec.float_outputs, (g.contiguous() for g in args[n_in + n_out:])))
        like = spec.like(inputs)
        grads = {i: torch.zeros(inputs[i].shape, dtype=inputs[i].dtype, device=like.device) for i in spec.grad}
        dim = spec.threads(inputs, spec.split if spec.backward is None else spec.backward_split)
        forward_args = [_typed(a, p) if p.is_array else a for a, p in zip(inputs, spec.inputs)]
        forward_args += [_typed(o, p) for o, p in zip(outs, spec.outputs)]
        if spec.backward is None:
            adj = [_typed(grads[i], spec.inputs[i]) if i in grads else None for i in range(n_in)]
            adj += [_typed(grad_outs[i], spec.outputs[i]) if i in grad_outs else None for i in range(n_out)]
            _launch_adjoint(spec.kernel, spec.split, dim, forward_args, adj, like, tuple(spec.grad), spec.min_chunk)
        else:
            tail = [_typed(grad_outs[i], spec.outputs[i]) for i in spec.float_outputs]
            offset = len(forward_args) + len(tail)
            tail += [_typed(grads[i], spec.inputs[i]) for i in spec.grad]
            scatter = tuple(range(offset, offset + len(spec.grad)))
            _launch(spec.backward, spec.backward_split, dim, forward_args + tail, like, scatter, spec.min_chunk)
        result = [grads[i] for i in spec.grad]
        return result[0] if len(result) == 1 else tuple(result)

    def fake(*args):
        inputs = spec.check_inputs(args[:n_in])
        result = [inputs[i].new_empty(inputs[i].shape) for i in spec.grad]
        return result[0] if len(result) == 1 else tuple(result)

    return backward, fake


def _autograd(spec: _Spec, backward_op):
    n_in = len(spec.inputs)
    tensor_inputs = [i for i, p in enumerate(spec.inputs) if p.is_array]

    def setup_context(ctx, inputs, output):
        outs = output if isinstance(output, tuple) else (output,)
        ctx.scalars = {i: a for i, (a, p) in enumerate(zip(inputs, spec.inputs)) if not p.is_array}
        if backward_op is None:
            ctx.mark_non_differentiable(*outs)
            return
        ctx.mark_non_differentiable(*(o for o, p in zip(outs, spec.outputs) if not p.differentiable))
        ctx.save_for_backward(*(inputs[i] for i in tensor_inputs), *outs)

    def backward(ctx, *grad_outputs):
        need = ctx.needs_input_grad
        if backward_op is None or not any(need[i] for i in spec.grad):
            return (None,) * n_in
        saved = ctx.saved_tensors
        inputs = [None] * n_in
        for i, t in zip(tensor_inputs, saved):
            inputs[i] = t
        for i, a in ctx.scalars.items():
            inputs[i] = a
        outs = saved[len(tensor_inputs):]
        grads = [grad_outputs[i] if grad_outputs[i] is not None else torch.zeros_like(outs[i]) for i in spec.float_outputs]
        result = backward_op(*inputs, *outs, *grads)
        result = (result,) if isinstance(result, torch.Tensor) else result
        per_input = [None] * n_in
        for i, g in zip(spec.grad, result):
            per_input[i] = g if need[i] else None
        return tuple(per_input)

    return setup_context, backward


def warp_op(
    name: str,
    kernel,
    *,
    outputs: Mapping[str, Any],
    dim: Callable[..., Any],
    grad: Optional[Sequence[str]] = None,
    accumulate: Sequence[str] = (),
    backward=None,
    min_chunk: int = _warp.MIN_CHUNK,
    per_thread: Sequence[str] = (),
):
    """Make a Warp kernel a ``torch.library`` custom op that is safe under ``torch.compile``.

    The kernel's parameters, in order, are the op's inputs and then its outputs::

        @wp.kernel
        def wave(start: int,                             # optional: splits the launch over CPU cores
                 points: wp.array(dtype=wp.vec3d),       # input: a float64 tensor (N, 3)
                 amp: wp.array(dtype=wp.float64),        # input: a float64 tensor (1,)
                 value: wp.array(dtype=wp.float64)):     # output: a float64 tensor (N,), zeroed
            i = wp.tid() + start
            value[i] = amp[0] * wp.sin(wp.length(points[i]))

        wave_op = pcops.warp_op("mylib::wave", wave, outputs={"value": lambda points, amp: (points.shape[0],)},
                                dim=lambda points, amp: points.shape[0])
        value = wave_op(points, amp)        # differentiable in points and amp; appears as mylib.wave in graphs

    Kernel contract:

    * Inputs: a ``wp.array`` parameter takes a tensor of the array's element scalar dtype (no
      conversion is made: a mismatch is a TypeError) whose rank is the array's ``ndim`` plus
      the element's dims, the element dims trailing: ``wp.array(dtype=wp.vec3f)`` is a float32
      (N, 3) tensor, ``wp.array2d(dtype=wp.mat33d)`` a float64 (N, M, 3, 3) one. Int, float and
      bool scalar parameters take Python numbers. Other parameter types (structs, vector
      values, generic ``Any`` annotations) are rejected. Inputs are read only.
    * Outputs: the last ``len(outputs)`` parameters, ``wp.array`` s named as the keys of
      ``outputs``, in order. The op allocates them zeroed and returns them (one tensor, or a
      tuple in the declared order).
    * Threads: ``dim(*inputs)`` gives the launch dimensions (an int, or a tuple of up to 4).
      As in ``wp.launch``, nothing checks that a thread's index lies within the arrays it
      indexes (past an array's end: wrong values or a crash); name in ``per_thread`` the arrays
      each thread indexes by its id along their first axis, and every call checks their rows.
      A kernel whose first parameter is ``start: int`` must take its thread index as
      ``wp.tid() + start``; pcops then splits the range over the CPU cores (chunks of at least
      ``min_chunk`` threads; on CUDA one launch with ``start = 0``). Without ``start`` a
      launch is one ``wp.launch``, which runs on one CPU thread.
    * A split kernel must write each output element from one thread only, or declare the
      output in ``accumulate`` when several threads add into it (``atomic_add`` / ``+=``):
      Warp's atomics are plain adds on the CPU, so each extra chunk then gets a zeroed private
      copy, summed back after the launch.
    * Gradients (Warp's generated adjoint) are right when the kernel does not overwrite its
      inputs, does not read what it writes to its outputs (except the value it just stored
      in the same thread), uses no in-place ``*=`` / ``/=`` on arrays (not differentiated),
      and in loops with bounds known only at run time (``range(n)``, hash-grid queries)
      accumulates into arrays (``+=``, ``atomic_add``) rather than carrying a reassigned local
      variable across iterations (Warp does not replay those). Check with float64
      ``torch.autograd.gradcheck``; otherwise pass ``backward``.

    Args:
        name: the op's qualified name, ``"namespace::op"`` (both identifiers); it appears in
            compiled graphs as ``namespace.op``. The backward op is ``name + "_backward"``.
            Names are process-wide: register each once.
        kernel: a ``@wp.kernel`` with concrete annotations.
        outputs: ``{parameter name: shape}`` for each output, in the kernel's order; a shape is
            a function of the op's inputs (called with the same positional arguments as the
            op; tensors may be fake, with symbolic sizes) returning the output tensor's shape,
            element dims included, or a fixed tuple of ints.
        dim: a function of the op's inputs (as for shapes) returning the launch dimensions.
        grad: names of the float array inputs that get gradients; None: all of them. Float
            outputs carry gradients; integer outputs are non-differentiable.
        accumulate: names of outputs that several threads add into (split kernels).
        backward: optional ``@wp.kernel`` used instead of Warp's adjoint, launched over the
            same ``dim`` (it may have its own ``start`` parameter): its parameters are the
            forward's inputs, its outputs (the values the forward returned), the gradients of
            the float outputs, then the gradients of the ``grad`` inputs (zeroed, same types as
            the inputs; several threads may add into them: split launches give each extra
            chunk a private copy).
        min_chunk: the fewest threads a CPU chunk of a split launch runs.
        per_thread: names of array inputs and outputs that each thread indexes by its id
            along their first axis (``points[i]``, ``value[i]``): each must have at least as
            many rows as the first launch dimension has threads, checked at every call (and
            under ``torch.compile``, on the shapes): a ValueError naming it.

    Returns:
        The forward op (a ``torch.library.CustomOpDef``): call it with the inputs, positionally
        or by the kernel's parameter names. It has an exact fake implementation, a registered
        autograd formula (first-order gradients), and the ``cudagraph_unsafe`` tag.

    Raises:
        TypeError, ValueError: naming the argument whose declaration does not fit the kernel.
    """
    if not isinstance(name, str) or name.count("::") != 1 or not all(_IDENTIFIER.match(part) for part in name.split("::")):
        raise ValueError(f"name must be a qualified op name 'namespace::op' of two identifiers, got {name!r}")
    _check_kernel(kernel, "kernel")
    split = _split(kernel, "kernel")
    params = [_param(a, "kernel") for a in kernel.adj.args[int(split):]]
    if not isinstance(outputs, Mapping) or not outputs:
        raise TypeError("outputs must be a non-empty dict {output parameter name: shape}")
    out_names = list(outputs)
    n_in = len(params) - len(out_names)
    if n_in < 0 or [p.name for p in params[n_in:]] != out_names:
        raise ValueError(f"outputs must name the kernel's last {len(out_names)} parameters in order, "
                         f"{[p.name for p in params[max(n_in, 0):]]}, got {out_names}")
    inputs, outs = tuple(params[:n_in]), tuple(params[n_in:])
    for p in outs:
        if not p.is_array:
            raise TypeError(f"outputs[{p.name!r}]: the kernel parameter is a {p.schema} scalar; outputs must be wp.array parameters")
    if not any(p.is_array for p in inputs):
        raise ValueError("kernel must take at least one wp.array input (the op's device comes from its inputs)")
    shapes = tuple(_shape_function(n, outputs[n]) for n in out_names)
    if not callable(dim):
        raise TypeError(f"dim must be a function of the inputs returning the launch dimensions, got {type(dim).__name__}")
    in_names = [p.name for p in inputs]
    if grad is None:
        grad_pos = tuple(i for i, p in enumerate(inputs) if p.differentiable)
    else:
        if isinstance(grad, str):
            raise TypeError(f"grad must be a sequence of input names, got the string {grad!r}")
        unknown = [g for g in grad if g not in in_names]
        if unknown:
            raise ValueError(f"grad names {unknown}, which are not inputs of the kernel ({in_names})")
        grad_pos = tuple(i for i, p in enumerate(inputs) if p.name in grad)
        for i in grad_pos:
            if not inputs[i].differentiable:
                raise TypeError(f"grad: input {inputs[i].name!r} is {inputs[i].describe()}; only float array inputs get gradients")
    if isinstance(accumulate, str):
        raise TypeError(f"accumulate must be a sequence of output names, got the string {accumulate!r}")
    unknown = [a for a in accumulate if a not in out_names]
    if unknown:
        raise ValueError(f"accumulate names {unknown}, which are not outputs ({out_names})")
    accumulate_pos = tuple(i for i, n in enumerate(out_names) if n in accumulate)
    if not isinstance(min_chunk, int) or min_chunk < 1:
        raise ValueError(f"min_chunk must be an int >= 1, got {min_chunk!r}")
    backward_split = False
    if backward is not None:
        _check_kernel(backward, "backward")
        backward_split = _split(backward, "backward")
        float_outs = [p for p in outs if p.differentiable]
        expected = [*inputs, *outs, *float_outs, *(inputs[i] for i in grad_pos)]
        got = [_param(a, "backward") for a in backward.adj.args[int(backward_split):]]
        if len(got) != len(expected):
            raise ValueError(f"backward must take {len(expected)} parameters (inputs, outputs, gradients of the "
                             f"{len(float_outs)} float outputs, gradients of the {len(grad_pos)} grad inputs), "
                             f"plus an optional start; it takes {len(got)}")
        for g, e in zip(got, expected):
            if not wp.types.types_equal(g.warp_type, e.warp_type):
                raise TypeError(f"backward: parameter {g.name!r} is {wp.types.type_repr(g.warp_type)}, "
                                f"expected {wp.types.type_repr(e.warp_type)} (as {e.name!r})")
    elif grad_pos:
        options = kernel.module.options | kernel.options
        if not options.get("enable_backward", True):
            raise ValueError(f"kernel {kernel.key!r} was built with enable_backward=False: it has no adjoint; "
                             "pass backward=, or grad=() for an op without gradients")

    for taken_name in (name, name + "_backward"):
        if _registered(taken_name):
            raise ValueError(f"name {name!r}: the op {taken_name!r} is already registered in this process (op names are "
                             "process-wide: define each warp_op once, at import time, or pick another name)")
    if isinstance(per_thread, str):
        raise TypeError(f"per_thread must be a sequence of input and output names, got the string {per_thread!r}")
    unknown = [n for n in per_thread if n not in in_names and n not in out_names]
    if unknown:
        raise ValueError(f"per_thread names {unknown}, which are not inputs or outputs of the kernel ({in_names + out_names})")
    for n in per_thread:
        if n in in_names and not inputs[in_names.index(n)].is_array:
            raise TypeError(f"per_thread: input {n!r} is a scalar; only arrays have rows")
    rows = tuple(("input", in_names.index(n)) if n in in_names else ("output", out_names.index(n)) for n in dict.fromkeys(per_thread))
    spec = _Spec(name, kernel, split, inputs, outs, shapes, dim, grad_pos, accumulate_pos, backward, backward_split, min_chunk, rows)
    tags = (torch.Tag.cudagraph_unsafe,)
    forward, fake = _forward_impl(spec)
    op = _threads.custom_op(
        name, forward, mutates_args=(), schema=_schema([(p.name, p.schema) for p in inputs], len(outs)), tags=tags
    )
    op.register_fake(fake)
    backward_op = None
    if grad_pos:
        taken = set(in_names)
        bwd_params = [(p.name, p.schema) for p in inputs] + [(_unique(p.name, taken), "Tensor") for p in outs]
        bwd_params += [(_unique(f"grad_{outs[i].name}", taken), "Tensor") for i in spec.float_outputs]
        impl, bwd_fake = _backward_impl(spec)
        backward_op = _threads.custom_op(
            name + "_backward", impl, mutates_args=(), schema=_schema(bwd_params, len(grad_pos)), tags=tags
        )
        backward_op.register_fake(bwd_fake)
    setup_context, autograd_backward = _autograd(spec, backward_op)
    op.register_autograd(autograd_backward, setup_context=setup_context)
    return op


__all__ = ["warp_op"]
