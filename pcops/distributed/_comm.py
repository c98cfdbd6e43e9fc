"""The collectives of pcops.distributed, on torch.distributed (gloo on CPU, NCCL on CUDA), each
counting the bytes it moves (:data:`traffic`), and differentiable where values flow through them:
a gradient goes back to the rank that sent the value."""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist


class Traffic:
    """Bytes this process sent to and received from other ranks through pcops.distributed's
    collectives since the last :meth:`reset` (its own share, which never leaves it, not counted)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0

    def reset(self) -> None:
        self.sent = self.received = 0


traffic = Traffic()


def rank_and_size(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pcops.distributed needs an initialised process group (torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group, like: torch.Tensor) -> torch.device:
    """Where the group's collectives take tensors: the current CUDA device for NCCL, else ``like``'s."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return like.device


def _count(t: torch.Tensor, others: int) -> None:
    """An all-gather of ``t`` from every rank: ``t`` sent to, and one like it received from, each other rank."""
    size = t.numel() * t.element_size()
    traffic.sent += size * others
    traffic.received += size * others


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order; not differentiable."""
    _, world = rank_and_size(group)
    moved = t.to(_device(group, t)).contiguous()
    out = [torch.empty_like(moved) for _ in range(world)]
    dist.all_gather(out, moved, group=group)
    _count(t, world - 1)
    return [o.to(t.device) for o in out]


class _Exchange(torch.autograd.Function):
    """all_to_all_single with its gradient: the gradients of the received rows go back to their
    senders (the same exchange with the splits swapped). Every rank runs both, in the same order."""

    @staticmethod
    def forward(ctx, data, receive, send, group):
        ctx.splits, ctx.group, ctx.rows = (receive, send), group, data.shape[0]
        out = data.new_empty((sum(receive), *data.shape[1:]))
        dist.all_to_all_single(out, data.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        receive, send = ctx.splits
        back = grad.new_empty((ctx.rows, *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, receive, group=ctx.group)
        return back, None, None, None


class _Shared(torch.autograd.Function):
    """The sum over the ranks of ``t``, a value every rank then holds: its gradient is each rank's
    own (every rank differentiates the same value), not a sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, t, group):
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce(t: torch.Tensor, op, group, shared: bool = False) -> torch.Tensor:
    """``t`` reduced over the ranks (a new tensor); ``shared``: a differentiable sum that every
    rank holds and differentiates alike (a loss of the whole cloud)."""
    _, world = rank_and_size(group)
    _count(t, world - 1)
    if shared:
        return _Shared.apply(t, group)
    out = t.to(_device(group, t), copy=True)
    dist.all_reduce(out, op=op, group=group)
    return out.to(t.device)


def exchange(rows: list[torch.Tensor], group) -> torch.Tensor:
    """Rank r's ``rows[j]`` (n_rj, ...) to rank j, for every pair: the rows received from every
    rank, in rank order (a rank's own ``rows[r]`` kept as they are). Differentiable: the
    gradient of a received row goes back to the rank that sent it."""
    me, world = rank_and_size(group)
    data = torch.cat(rows).contiguous()
    needs_grad = torch.is_grad_enabled() and data.requires_grad
    sizes = torch.tensor([r.shape[0] for r in rows] + [int(needs_grad)], dtype=torch.int64)
    matrix = torch.stack(all_gather(sizes, group))  # matrix[i, j]: rows from rank i to rank j; last column: i needs gradients
    send = [int(n) for n in matrix[me, :world]]
    receive = [int(n) for n in matrix[:world, me]]
    width = math.prod(data.shape[1:]) * data.element_size()
    traffic.sent += (sum(send) - send[me]) * width
    traffic.received += (sum(receive) - receive[me]) * width
    if bool(matrix[:, world].any()):
        # differentiable on every rank when one rank's rows need gradients (a rank whose own rows
        # do not takes part all the same), so that every rank's backward runs the collective
        # that sends the gradients back
        return _Exchange.apply(data if data.requires_grad else data.detach().requires_grad_(), receive, send, group)
    out = data.new_empty((sum(receive), *data.shape[1:]))
    dist.all_to_all_single(out, data, receive, send, group=group)
    return out


def agree(check, group, same: dict | None = None):
    """``check()`` (this rank's input checks; its result returned) on every rank, and the outcome
    agreed: where any rank's raises a ValueError or TypeError, every rank raises (that rank its
    own error, the others one naming it), so that no rank is left waiting in a collective.
    ``same``: {name: value} that every rank must pass alike (a number, a torch.dtype or None:
    a dtype, a channel count, k), one all-gather with the outcome; where the checks pass but a
    value differs between ranks, every rank raises a ValueError naming it (the collectives that
    follow would wait for another rank's, or abort on rows of another size)."""
    try:
        result, error = check(), None
    except (ValueError, TypeError) as err:
        result, error = None, err
    same = same or {}
    row = torch.tensor([float(error is not None), *(_code(v) for v in same.values())], dtype=torch.float64)
    table = torch.stack(all_gather(row, group))
    failed = [r for r in range(table.shape[0]) if table[r, 0] != 0]
    if not failed:
        for c, name in enumerate(same, start=1):
            if not bool((table[:, c] == table[0, c]).all()):
                got = ", ".join(f"{_decode(float(v))} on rank {r}" for r, v in enumerate(table[:, c].tolist()))
                raise ValueError(f"{name} must be the same on every rank, got {got}")
        return result
    if error is not None:
        raise error
    raise ValueError(f"the inputs of rank {failed[0]} failed their checks there (its error says which); every rank stops")


# torch's dtypes in a fixed order (the same on every rank): a dtype's code in :func:`agree`
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_DTYPE, _NONE, _OTHER = 2.0**40, -(2.0**41), -(2.0**42)  # the codes of the first dtype, None and a value of another kind
_STRING = -(2.0**43)  # a string's code: this plus its CRC-32
_SPELLED: dict = {}  # the strings coded in this process, by code (the ops' option names: :func:`spell`)


def spell(*names: str) -> None:
    """Names whose codes :func:`_decode` spells back, in a message about another rank's value."""
    for name in names:
        _code(name)


def _code(value) -> float:
    """A float64 code of a value that ranks must pass alike (see :func:`agree`)."""
    if value is None:
        return _NONE
    if isinstance(value, torch.dtype):
        return _DTYPE + _DTYPES.index(value)
    if isinstance(value, str):  # (a name: its CRC-32, the same in every process, spelled back by :func:`_decode`)
        code = _STRING + zlib.crc32(value.encode())
        _SPELLED[code] = value
        return code
    try:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    except (OverflowError, ValueError, TypeError, RuntimeError):  # (an int beyond float64: another kind, the checks refuse it)
        pass
    return _OTHER


def _decode(code: float) -> str:
    if code == _NONE:
        return "None"
    if code == _OTHER:
        return "another kind of value"
    if _STRING <= code < _STRING + 2.0**32:
        return repr(_SPELLED[code]) if code in _SPELLED else "another string"
    if _DTYPE <= code < _DTYPE + len(_DTYPES):
        return str(_DTYPES[int(code - _DTYPE)])
    return repr(int(code)) if code == int(code) else repr(code)
