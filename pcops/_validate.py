"""Every input check of pcops, in one place. Two kinds, run at two moments:

Eager checks (metadata and Python values only: free, and also run under ``torch.compile``):
    :func:`layout` (the tensors of any batch layout: types, dtypes, ranks, shapes, devices),
    :func:`tensor`, :func:`integer`, :func:`shape`, :func:`points`, :func:`same_device`,
    :func:`ids` (shapes and dtypes), :func:`same_size` (a size two inputs share),
    :func:`instance` (a type), :func:`count` (``k``), :func:`int_option` (an int in a range,
    odd: ``kernel_size``, ``depth``, ``num_segments``), :func:`positive_number` (``radius``, a
    number ``sigma``), :func:`interval` (``ratio``, ``scaling``), :func:`one_of`,
    :func:`reductions`, :func:`flag`, :func:`scale` (a number or one-element tensor ``sigma``),
    :func:`scale_tensor` (a number ``sigma`` that rounds to 0 in the compute dtype), and how many
    of a group of arguments are given (:func:`exactly_one`, :func:`at_most_one`,
    :func:`together`, :func:`groups_paired`, :func:`compile_needs`). They run in the public
    functions and layers, before any work, and each message names the argument as the caller
    typed it.

Value checks (read tensor data, so a host read, one device sync on CUDA; a data-dependent
branch would break ``torch.compile(fullgraph=True)``), only with ``validate=True``:
    In eager mode the layout layer (``pcops._layout.pair`` / ``single``) gathers every value
    check of a call in :class:`Checks` (NaN/inf in points, features and the op's own tensors,
    lengths and ids in range, a tensor sigma > 0) and reads them all at once: one host read per
    call, messages naming the caller's arguments. Under ``torch.compile`` it cannot read
    values; :func:`op_values` then runs inside the custom ops' real implementations (which
    always execute eagerly; NaN/inf and sigma, named as the op names its inputs), and ranges
    are not checked.

Numbers may be Python or NumPy scalars (``np.float32`` sigma, ``np.int64`` k).
"""

from __future__ import annotations

import math
import numbers
import sys

import numpy as np
import torch


def instance(name: str, value, cls, said: str) -> None:
    """``value`` is an instance of ``cls`` (``said``: how the message names it), else a TypeError naming it."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {said}, got {type(value).__name__}")


ROWS = range(1, 1 << 16)  # the ranks of a tensor of rows (N, ...): any but 0-d


def shape(name: str, t, *, ndim=None, size=None, last=None, shape_doc: str = "") -> None:
    """``t`` (a tensor) has rank ``ndim`` (an int, or a tuple or range of the ranks allowed),
    first dimension ``size`` and last dimension ``last`` where given, else a ValueError quoting
    ``shape_doc``."""
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    if (ranks is not None and t.dim() not in ranks) or (t.dim() and ((size is not None and t.shape[0] != size)
                                                                      or (last is not None and t.shape[-1] != last))):
        if size is not None:  # formatted only here: a size read early would specialise a traced shape
            shape_doc += f" = ({size},)" if ndim == 1 else f" = ({size}, {'...' if last is None else last})"
        raise ValueError(f"{name} must be a tensor of shape {shape_doc}, got shape {tuple(t.shape)}")


def tensor(name: str, t, *, ndim=None, last: int | None = None, size: int | None = None, shape_doc: str = "") -> None:
    """``t`` is a real floating tensor of rank ``ndim`` (see :func:`shape`) whose first dimension
    is ``size`` and last ``last``."""
    instance(name, t, torch.Tensor, "torch.Tensor")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64), got {t.dtype}")
    shape(name, t, ndim=ndim, size=size, last=last, shape_doc=shape_doc)


def points(name: str, t, dim: int = 3) -> None:
    """``t`` is a point set of shape (P, dim) (dim 3 unless a feature-space op says otherwise)."""
    tensor(name, t, ndim=2, last=dim, shape_doc="(P, 3)" if dim == 3 else f"(P, D) with D = {dim}")


def integer(name: str, t, *, ndim=None, size: int | None = None, last: int | None = None,
            shape_doc: str = "", what: str = "", dtype: torch.dtype | None = None) -> None:
    """``t`` is an integer tensor (not bool; of ``dtype`` if given) of rank ``ndim``, first
    dimension ``size`` and last dimension ``last`` where given (see :func:`shape`): the one check
    of every integer input (sites, ids, offsets, indices); ``what`` names the quantity in the
    dtype message."""
    instance(name, t, torch.Tensor, "torch.Tensor")
    said = f" ({what})" if what else ""
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {str(dtype).removeprefix('torch.')}{said}, got {t.dtype}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype{said}, got {t.dtype}")
    shape(name, t, ndim=ndim, size=size, last=last, shape_doc=shape_doc)


def grid_coords(name: str, t, what: str, size: int | None = None) -> None:
    """``t`` is an integer tensor of shape (N, 3) (N = ``size`` if given): grid or voxel coordinates (``what`` says which)."""
    integer(name, t, ndim=2, size=size, last=3, shape_doc="(N, 3)", what=what)


def same_device(**named: torch.Tensor) -> None:
    """All tensors live on one device."""
    devices = {name: t.device for name, t in named.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on the same device, got {listing}")


def flag(**named) -> None:
    """Each value a bool (numpy's and 0-d tensors' are not: a flag is a Python bool), else a
    TypeError naming it."""
    for name, value in named.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")


def one_of(name: str, value, options) -> None:
    """``value`` is one of ``options`` (a tuple; None may be one; a number equals a number of the
    same value, never a bool), else a ValueError naming it."""
    if (type(value) is str or value is None) and value in options:  # (a name, or None: equal as _same has it, without a generator)
        return
    if type(value) is int and value in options and type(options[options.index(value)]) is int:  # (an int option: never a bool's)
        return
    if isinstance(value, torch.Tensor) or not any(_same(value, o) for o in options):
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def reductions(point_reduction, batch_reduction, point_options: tuple, batch_options: tuple = ("mean", "sum", None)) -> None:
    """A loss's ``point_reduction`` and ``batch_reduction`` (PyTorch3D's pair): each one of its
    options, and no batch reduction of unreduced points."""
    one_of("point_reduction", point_reduction, point_options)
    one_of("batch_reduction", batch_reduction, batch_options)
    if point_reduction is None and batch_reduction is not None:
        raise ValueError("batch_reduction must be None when point_reduction is None")


def _same(value, option) -> bool:
    if value is option or isinstance(value, bool) != isinstance(option, bool):
        return value is option
    return (isinstance(value, type(option)) or (is_number(value) and is_number(option))) and value == option


def _given(value) -> bool:
    return value is not None and value is not False


def exactly_one(note: str = "", /, **named) -> None:
    """Exactly one of the named arguments given (not None; a flag: True), else a ValueError naming them."""
    if sum(map(_given, named.values())) != 1:
        raise ValueError(f"give exactly one of {' and '.join(named)}{note}")


def at_most_one(note: str = "", /, **named) -> None:
    """At most one of the named arguments given (not None; a flag: True)."""
    if sum(map(_given, named.values())) > 1:
        raise ValueError(f"give {' or '.join(named)}, not both{note}")


def together(note: str = "", /, **named) -> None:
    """The named arguments all given or none of them."""
    if len({_given(v) for v in named.values()}) > 1:
        raise ValueError(f"{' and '.join(named)} go together: give both or neither{note}")


def same_size(name: str, size, other: str, other_size, what: str) -> None:
    """Two named inputs agree on a size (``what``: which), else a ValueError naming both."""
    if size != other_size:
        raise ValueError(f"{name} and {other} must have the same {what}, got {size} and {other_size}")


def compile_needs(name: str, value, why: str) -> None:
    """``value`` is given under ``torch.compile``, where reading it from the data cannot be traced."""
    if value is None and torch.compiler.is_compiling():
        raise ValueError(f"{name} is required under torch.compile ({why})")


def is_number(value) -> bool:
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


INT64_MAX = 2**63 - 1
FLOAT_MAX = sys.float_info.max  # (plain paths' bound of a finite Python number: an int may lie beyond float64)


def is_finite_number(value) -> bool:
    """Whether the (Python or NumPy) number ``value`` is finite in float64: an int beyond its
    range is not (math.isfinite raises OverflowError on one)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown_number(value) -> str:
    """``value`` for a message (an int beyond float64's range named, not printed in full)."""
    return "an int beyond float64's range" if isinstance(value, int) and not is_finite_number(value) else f"{value}"


def finite_number(name: str, value) -> None:
    """``value`` is a finite Python or NumPy number (symbolic under ``torch.compile``: not read)."""
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not torch.compiler.is_compiling() and not is_finite_number(value):
        raise ValueError(f"{name} must be finite, got {shown_number(value)}")


WEIGHTS = ("softmax", "inverse_distance", "uniform")  # the aggregations' weightings (pcops.ops.neighbours._weighting)
REDUCE = ("mean", "max")


def weighting_name(weights, reduce: str) -> str:
    """The weighting that ``weights`` means for ``reduce``, after checking both names.

    ``weights=None`` means ``"softmax"`` for ``reduce="mean"`` and ``"uniform"`` for
    ``reduce="max"`` (whose max is unweighted).
    """
    one_of("reduce", reduce, REDUCE)
    if weights is None:
        weights = "softmax" if reduce == "mean" else "uniform"
    one_of("weights", weights, WEIGHTS)
    if reduce == "max" and weights != "uniform":
        raise ValueError(f"reduce='max' takes the max of the unweighted features: weights must be None or 'uniform', got {weights!r}")
    return weights


def weighting(weights, reduce: str, sigma) -> str:
    """:func:`weighting_name`, and sigma given exactly when the weighting uses it (``"softmax"`` only)."""
    weights = weighting_name(weights, reduce)
    if weights == "softmax" and sigma is None:
        raise ValueError("sigma is required for weights='softmax'")
    if weights != "softmax" and sigma is not None:
        raise ValueError(f"sigma is used by weights='softmax' only; pass sigma=None with weights={weights!r}, reduce={reduce!r}")
    return weights


def positive_number(name: str, value) -> None:
    """``value`` is a finite Python or NumPy number > 0.

    Under ``torch.compile`` a number may be symbolic: its value is then checked again inside
    the op (see the ops' real implementations), where it is concrete.
    """
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if torch.compiler.is_compiling():
        return
    if not is_finite_number(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {shown_number(value)}")


def triple(name: str, value, positive: bool = False) -> tuple:
    """``value`` a finite number or a sequence of three (Python or NumPy; > 0 with ``positive``),
    as a tuple of three Python floats: one per axis."""
    items = [value] * 3 if is_number(plain(value)) else value
    if isinstance(value, (str, bytes, torch.Tensor)) or not hasattr(items, "__len__") or len(items) != 3:
        raise TypeError(f"{name} must be a number or a sequence of three numbers, got {value!r}")
    out = tuple(plain(v) for v in items)
    if not all(is_number(v) for v in out):
        raise TypeError(f"{name} must be a number or a sequence of three numbers, got {value!r}")
    if not torch.compiler.is_compiling() and not all(is_finite_number(v) and (v > 0 or not positive) for v in out):
        raise ValueError(f"{name} must be finite{' and > 0' if positive else ''}, got {value!r}")
    return out


def origin(value, owner: str, like: torch.Tensor) -> torch.Tensor:
    """A grid's ``origin`` (a finite number, three, or a real tensor of shape (3,) or () on the
    device of ``like``, the argument ``owner``) as a float64 (3,) tensor on that device; a tensor
    keeps its gradient, and its values are the caller's to check (with the op's other values)."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_complex or value.dtype == torch.bool or value.shape not in ((3,), ()):
            raise ValueError(f"origin must be a number, 3 numbers or a real tensor of shape (3,), got {value.dtype} {tuple(value.shape)}")
        same_device(**{owner: like, "origin": value})
        return value.to(torch.float64).expand(3).contiguous()
    return torch.tensor([float(x) for x in triple("origin", value)], dtype=torch.float64, device=like.device)


def int_option(name: str, value, low: int | None = None, high: int | None = None, *, odd: bool = False, note: str = ""):
    """``value`` is an integer (Python, NumPy or symbolic; not a bool) in [low, high] (either
    bound may be None), odd with ``odd``; returned as an int. ``note`` follows the range in the
    message."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not isinstance(value, torch.SymInt):
        value = int(value)
    if (low is not None and value < low) or (high is not None and value > high) or (odd and value % 2 == 0):
        bounds = (f" in [{low}, {high}]" if high is not None else f" >= {low}") if low is not None else f" <= {high}" if high is not None else ""
        raise ValueError(f"{name} must be{' an odd int' if odd else ''}{bounds}{note}, got {value}")
    return value


def count(name: str, value, most: int | None = None, what: str = "") -> int:
    """``value`` is an integer (Python, NumPy or symbolic) with 1 <= value <= most; returned as an int."""
    value = int_option(name, value, 1)
    if not isinstance(value, torch.SymInt) and value > INT64_MAX:  # (torch's sizes are int64)
        raise ValueError(f"{name} must be <= {INT64_MAX} (an int64), got {value}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be <= the number of {what}, got {name}={value} for {most} {what}")
    return value


def interval(name: str, value, low, high, *, closed_high: bool = False, tensor: bool = False) -> None:
    """``value`` is a number in (low, high) ((low, high] with ``closed_high``; a symbolic one is
    not read), or with ``tensor`` a 0-d floating tensor (its value is the op's to check)."""
    if tensor and isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be a number or a 0-d floating tensor, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        return
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not isinstance(value, (torch.SymInt, torch.SymFloat)) and not (low < value < high or (closed_high and value == high)):
        raise ValueError(f"{name} must be in ({low}, {high}{']' if closed_high else ')'}, got {value}")


def scale(name: str, value) -> None:
    """``value`` is a positive number or a one-element floating tensor (values checked in the op)."""
    if isinstance(value, torch.Tensor):
        tensor(name, value)
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
    else:
        positive_number(name, value)


def is_positive_in(value, dtype: torch.dtype) -> bool:
    """Whether the number ``value`` is finite and > 0 as ``dtype`` (float32 rounds it): what
    :func:`scale_tensor` checks."""
    if not is_finite_number(value):
        return False
    with np.errstate(over="ignore"):  # beyond float32's range: inf there
        rounded = float(np.float32(value)) if dtype == torch.float32 else float(value)
    return math.isfinite(rounded) and rounded > 0


def scale_tensor(value, dtype: torch.dtype, device, name: str = "sigma") -> torch.Tensor:
    """A checked scale (number or one-element tensor) as a 0-d tensor of ``dtype`` (differentiable).

    A number that rounds to 0 in ``dtype`` (the compute dtype) raises here, the same error
    :func:`positive_values` gives for a tensor that does.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype).reshape(())
    if not torch.compiler.is_compiling() and not is_positive_in(value, dtype):  # checked in Python: no tensor read
        with np.errstate(over="ignore"):
            rounded = float(np.float32(value)) if dtype == torch.float32 else float(value)
        raise ValueError(f"{name} must be finite and > 0 in {dtype} (the dtype it is computed in), got [{rounded}]")
    return torch.full((), float(value), dtype=dtype, device=device)  # a fill on the device: no copy from the host


def compute_dtype(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the kernels run in, dtype returned): float64 or float32; half types run in float32."""
    out = tensors[0].dtype
    for t in tensors[1:]:
        out = torch.promote_types(out, t.dtype)
    return (torch.float64 if out == torch.float64 else torch.float32), out


def detached(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.detach().to(dtype)``: ``t`` itself where that changes nothing (a cheaper call, and a
    cloud passed as both query and ref stays one tensor)."""
    return t if t.dtype == dtype and not t.requires_grad else t.detach().to(dtype)


_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # the sum of a finiteness check


def sum_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool: the sum of ``t`` is finite. True implies every value is finite (a NaN or inf
    makes the sum NaN or inf); False may also be an overflow of finite values, which
    :func:`all_finite` then decides. One pass without a temporary: several times cheaper
    than ``isfinite(t).all()``."""
    return t.sum(dtype=_SUM_DTYPE.get(t.dtype)).isfinite()


def sum_is_finite(t: torch.Tensor) -> bool:
    """Whether a CPU tensor's values are all finite, as a Python bool, without an autograd node
    for a tensor that requires grad: True only where they are. False also where a value is so
    large that the reduction overflows: callers then check exactly (or take the general path)."""
    if t.requires_grad:
        t = t.detach()
    return math.isfinite(t.sum(dtype=_SUM_DTYPE.get(t.dtype)).item())


def all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def finite(**named: torch.Tensor) -> None:
    """No NaN or inf in the tensors (None is skipped). Reads values."""
    for name, t in named.items():
        if t is not None and t.numel() and not bool(sum_finite(t)) and not all_finite(t):
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
    together(query_group=query_group, ref_group=ref_group)


def ids(name: str, t, size: int, shape_doc: str) -> None:
    """``t`` is None or an integer tensor of shape (size,): batch ids or lengths."""
    if t is not None:
        integer(name, t, ndim=1, size=size, shape_doc=shape_doc)


def layout(query, ref, features, *, query_lengths, ref_lengths, query_batch, ref_batch, dim: int | None = 3, names=None) -> bool:
    """Eager checks of any batch layout (see pcops._layout); True for the padded (B, P, 3) layout.

    ``dim`` is the points' last dimension (None: any D shared by query and ref); ``names`` the
    caller's names of the arguments (a ``pcops._layout.Names``; query, ref, ... by default).
    """
    n = names if names is not None else _DEFAULT_NAMES
    one = n.query == n.ref  # a one-cloud op: the points are both clouds
    tensor(n.query, query)
    padded = query.dim() == 3
    d = query.shape[-1] if dim is None else dim
    sym = "3" if dim == 3 else "D"
    if dim is None and isinstance(ref, torch.Tensor) and ref.dim() == query.dim() and ref.shape[-1] != d:
        raise ValueError(f"{n.query} and {n.ref} must have the same last dimension D, got {n.query} {tuple(query.shape)} and {n.ref} {tuple(ref.shape)}")
    if padded:
        tensor(n.query, query, ndim=3, last=d, shape_doc=f"(B, M, {sym})" if not one else f"(P, {sym}) or (B, P, {sym})")
        tensor(n.ref, ref, ndim=3, last=d, shape_doc=f"(B, N, {sym})")
        same_size(n.query, query.shape[0], n.ref, ref.shape[0], "batch size B")
        for name, t in ((n.query_batch, query_batch), (n.ref_batch, ref_batch)):
            if t is not None:
                raise ValueError(f"{name} describes packed (P, {sym}) points; padded (B, P, {sym}) points take {n.query_lengths if one else 'lengths (' + n.query_lengths + ', ' + n.ref_lengths + ')'}")
    else:
        shape = f"(P, {sym}) or (B, P, {sym})" if one else ("(P, 3)" if d == 3 else f"(P, D) with D = {d}")
        tensor(n.query, query, ndim=2, last=d, shape_doc=shape)
        tensor(n.ref, ref, ndim=2, last=d, shape_doc=shape)
        for name, t in ((n.query_lengths, query_lengths), (n.ref_lengths, ref_lengths)):
            if t is not None:
                raise ValueError(f"{name} describes padded (B, P, {sym}) points; packed (P, {sym}) points take {n.query_batch if one else 'batch ids (' + n.query_batch + ', ' + n.ref_batch + ')'}")
        if (query_batch is None) != (ref_batch is None):
            raise ValueError(f"packed inputs need both {n.query_batch} and {n.ref_batch}")
    if features is not None:
        shape = "(B, N, F)" if padded else "(N, F)"
        tensor(n.features, features, ndim=ref.dim(), shape_doc=shape)
        if features.shape[:-1] != ref.shape[:-1]:
            raise ValueError(f"{n.features} must have one row per point of {n.ref}: got shape {tuple(features.shape)} for {n.ref} {tuple(ref.shape)}")
    b = query.shape[0] if padded else 0
    for name, t in ((n.query_lengths, query_lengths), (n.ref_lengths, ref_lengths)):
        ids(name, t, b, "(B,)")
    ids(n.query_batch, query_batch, query.shape[0], "(M_total,)" if not one else "(P_total,)")
    ids(n.ref_batch, ref_batch, ref.shape[0], "(N_total,)" if not one else "(P_total,)")
    same_device(**{
        n.query: query, n.ref: ref, n.features: features, n.query_lengths: query_lengths, n.ref_lengths: ref_lengths,
        n.query_batch: query_batch, n.ref_batch: ref_batch,
    })
    return padded


class _Names:
    query, ref, features = "query", "ref", "features"
    query_lengths, ref_lengths, query_batch, ref_batch = "query_lengths", "ref_lengths", "query_batch", "ref_batch"


_DEFAULT_NAMES = _Names()


def checks(validate: bool):
    """A :class:`Checks` to gather a call's value checks in, or None where they do not run
    (``validate=False``, or under ``torch.compile``, which cannot read values): the one rule of
    when the layouts' value checks run."""
    if not validate or torch.compiler.is_compiling():
        return None
    return Checks()


def _widened(t: torch.Tensor, low, high) -> torch.Tensor:
    """``t``, or ``t`` as int64 where a bound is not a Python int within its integer dtype's range:
    torch compares a tensor with a Python number in the tensor's dtype, so ``uint8 >= -1`` or
    ``int8 >= -200`` would wrap the bound (and be False for every value)."""
    if t.dtype in (torch.int64, torch.bool) or t.is_floating_point():
        return t
    info = torch.iinfo(t.dtype)
    if all(b is None or (type(b) is int and info.min <= b <= info.max) for b in (low, high)):
        return t
    return t.to(torch.int64)


class Checks:
    """Value checks gathered over one call and read from the device at once (:meth:`run`): one
    host read (one device sync on CUDA) however many tensors a call checks. Each check is a 0-d
    bool tensor (on the CPU, where reading costs no sync, read as it is added: one dispatch less
    each); its message is built only if it fails."""

    def __init__(self) -> None:
        self._items: list = []

    def add(self, ok, message, exact=None) -> None:
        """``ok`` a 0-d bool tensor (or a bool); ``exact``: a function deciding a failed ``ok`` (True: passed)."""
        if isinstance(ok, torch.Tensor):
            ok = bool(ok) if ok.device.type == "cpu" else ok.reshape(())
        self._items.append((ok, message, exact))

    def finite(self, name: str, t) -> None:
        """No NaN or inf in ``t`` (None is skipped)."""
        if t is not None and t.numel():
            if t.is_cpu:  # the sum read at once: one dispatch, no autograd node
                ok = sum_is_finite(t)
            else:
                ok = sum_finite(t)
            self.add(ok, lambda: f"{name} contains NaN or inf (pass validate=False to skip this check)", lambda: all_finite(t))

    def in_range(self, name: str, t, low: int, high, bound=None) -> None:
        """All values of ``t`` (None is skipped) in [low, high] (no upper bound if high is None);
        ``bound`` (a function, called only on failure, so that no traced size is read) says the
        range in the message in the op's terms (default: [low, high])."""
        if t is None or not t.numel():
            return
        t = _widened(t, low, high)
        ok = (t >= low).all() if high is None else ((t >= low) & (t <= high)).all()
        said = lambda: bound() if callable(bound) else bound or (f"[{low}, {high}]" if high is not None else f">= {low}")  # noqa: E731
        self.add(ok, lambda: f"{name} values must be {said()}, got min {int(t.min())}, max {int(t.max())}")

    def non_decreasing(self, name: str, t, low: int, high: int) -> None:
        """``t`` (1-d, None is skipped) non-decreasing with values in [low, high]: a CSR pointer."""
        if t is None or not t.numel():
            return
        t = _widened(t, low, high)
        ok = (t[1:] >= t[:-1]).all() & (t[0] >= low) & (t[-1] <= high)
        shown = lambda: f"{t.tolist()[:8]}{'...' if t.numel() > 8 else ''}"  # noqa: E731
        self.add(ok, lambda: f"{name} must be non-decreasing with values in [{low}, {high}] (a CSR pointer), got {shown()}")

    def positive(self, name: str, t) -> None:
        """All values finite and > 0 in ``t``'s dtype (the compute dtype)."""
        if t is not None and t.numel():
            got = lambda: t.detach().cpu().reshape(-1)[:4].tolist()  # noqa: E731
            self.add((torch.isfinite(t) & (t > 0)).all(), lambda: f"{name} must be finite and > 0 in {t.dtype} (the dtype it is computed in), got {got()}")

    def run(self) -> None:
        """Read every check at once; raise the first failure's ValueError."""
        if not self._items:
            return
        pending = [ok for ok, _, _ in self._items if isinstance(ok, torch.Tensor)]
        read = iter(())  # (bound in every case: dynamo breaks the graph on a comprehension's unbound cell)
        if pending:
            device = pending[0].device
            read = iter(torch.stack([ok.to(device) for ok in pending]).tolist())  # the one host read
        oks = [next(read) if isinstance(ok, torch.Tensor) else ok for ok, _, _ in self._items]
        for ok, (_, message, exact) in zip(oks, self._items):
            if not ok and (exact is None or not exact()):
                raise ValueError(message())
