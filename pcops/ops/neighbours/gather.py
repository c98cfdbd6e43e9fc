"""Gather rows of features by index, -1 giving zeros (PyTorch3D's ``knn_gather``).

    out[..., :] = features[idx[...]]        (flat features (N, *))
    out[b, ..., :] = features[b, idx[b, ...]]  (padded features (B, N, *))
    out = 0 where idx == -1 (padding of neighbour lists: ball_query, knn with lengths)

Plain torch (no custom op): one ``index_select`` over flat rows, whose backward is an
``index_add`` (several times faster on the CPU than the accumulating ``index_put`` of advanced
indexing, see :func:`pcops._layout.select_rows`), and a ``where`` for the padding. It compiles with
``torch.compile(fullgraph=True)`` like any torch code.
"""

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from ... import _layout, _threads, _validate


def _check_args(features, idx) -> bool:
    """Checks of gather's arguments (types, shapes, devices, names); True for padded features."""
    _validate.instance("features", features, torch.Tensor, "torch.Tensor")
    _validate.integer("idx", idx)
    _validate.shape("features", features, ndim=(1, 2, 3), shape_doc="(N,), (N, F) or padded (B, N, F)")
    _validate.same_device(features=features, idx=idx)
    padded = features.dim() == 3
    if padded:
        _validate.shape("idx", idx, ndim=_validate.ROWS, size=features.shape[0], shape_doc="(B, ...)")
    return padded


@_threads.limits
def gather(features: torch.Tensor, idx: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Rows of ``features`` at ``idx``, zeros where ``idx`` is -1 (PyTorch3D's ``knn_gather``).

    Args:
        features: Tensor of shape (N, F) or (N,) (one cloud or a packed batch), or padded
            (B, N, F) (PyTorch3D's layout: indices are per sample).
        idx: integer Tensor of any shape (e.g. (M, K)) for flat features, (B, ...) (e.g.
            (B, M, K)) for padded ones; values in [0, N), or -1 for padding.
        validate: check that every index is in [-1, N) (reads the indices; skipped under
            ``torch.compile``). Unchecked, an index out of range gives a zero row, as -1
            does: never a read out of bounds.

    Returns:
        Tensor of shape ``(*idx.shape, F)`` (flat) or (B, ..., F) (padded; ``(*idx.shape, F)``), the
        dtype of ``features``; zero rows where idx == -1. Differentiable with respect to
        ``features`` (rows gathered several times accumulate their gradients; padding gets none).

    Example:
        >>> import torch, pcops
        >>> features = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
        >>> pcops.gather(features, torch.tensor([2, 0, -1]))  # -1: a zero row
        tensor([[ 3., 30.],
                [ 1., 10.],
                [ 0.,  0.]])
    """
    padded = _check_args(features, idx)
    n = features.shape[1] if padded else features.shape[0]
    _layout.values(validate, ranges={"idx": (idx, -1, n - 1, lambda: f"in [-1, N) = [-1, {n}) (-1: padding)")})
    return rows_or_zeros(features, idx, padded)


def rows_or_zeros(features: torch.Tensor, idx: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """gather without checks: rows of flat (N, ...) or padded (B, N, ...) ``features`` at ``idx``
    (per sample for padded ones), zeros where an index is outside [0, N) (-1: padding)."""
    n = features.shape[1] if padded else features.shape[0]
    flat = features.reshape(-1, *features.shape[2:]) if padded else features
    if guard_or_false(n == 0):  # nothing to read: every index is padding (a traced size unknown here is taken as > 0)
        return flat.new_zeros((*idx.shape, *flat.shape[1:]))
    idx = idx.to(torch.int64)
    valid = (idx >= 0) & (idx < n)
    at = idx.clamp(0, n - 1)
    if padded:
        b = features.shape[0]
        at = at + (torch.arange(b, device=idx.device) * n).reshape(b, *([1] * (idx.dim() - 1)))
    out = _layout.select_rows(flat, at)
    valid = valid.reshape((*idx.shape, *([1] * (flat.dim() - 1))))
    if _threads.differentiable(features):
        return torch.where(valid, out, out.new_zeros(()))
    return out.masked_fill_(~valid, 0)  # (nothing to differentiate: the new rows zeroed in place, one large tensor where two would be)


__all__ = ["gather"]
