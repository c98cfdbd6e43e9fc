"""Gather rows of features by index, -1 giving zeros (PyTorch3D's ``knn_gather``).

    out[..., :] = features[idx[...]]        (flat features (N, *))
    out[b, ..., :] = features[b, idx[b, ...]]  (padded features (B, N, *))
    out = 0 where idx == -1 (padding of neighbour lists: ball_query, knn with lengths)

Plain torch (no custom op): one ``index_select`` over flat rows, whose backward is an
``index_add`` (several times faster on the CPU than the accumulating ``index_put`` of advanced
indexing, see :func:`pcops._batch.rows`), and a ``where`` for the padding. It compiles with
``torch.compile(fullgraph=True)`` like any torch code.
"""

import torch


def _layout(features, idx) -> bool:
    """Checks of gather's arguments (types, shapes, devices, names); True for padded features."""
    if not isinstance(features, torch.Tensor):
        raise TypeError(f"features must be a torch.Tensor, got {type(features).__name__}")
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"idx must have an integer dtype, got {idx.dtype}")
    if features.dim() not in (1, 2, 3):
        raise ValueError(f"features must be a tensor of shape (N,), (N, F) or padded (B, N, F), got shape {tuple(features.shape)}")
    if features.device != idx.device:
        raise ValueError(f"all tensors must be on the same device, got features on {features.device}, idx on {idx.device}")
    padded = features.dim() == 3
    if padded and (idx.dim() < 1 or idx.shape[0] != features.shape[0]):
        raise ValueError(f"idx must be a tensor of shape (B, ...) with B = {features.shape[0]} for padded features {tuple(features.shape)}, got shape {tuple(idx.shape)}")
    return padded


def _check_values(idx: torch.Tensor, n: int) -> None:
    """Every index in [-1, n). Reads values."""
    if idx.numel():
        low, high = int(idx.min()), int(idx.max())
        if low < -1 or high >= n:
            raise ValueError(f"idx values must be in [-1, N) = [-1, {n}) (-1: padding), got min {low}, max {high}")


def gather(features: torch.Tensor, idx: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Rows of ``features`` at ``idx``, zeros where ``idx`` is -1 (PyTorch3D's ``knn_gather``).

    Args:
        features: Tensor of shape (N, F) or (N,) (one cloud or a packed batch), or padded
            (B, N, F) (PyTorch3D's layout: indices are per sample).
        idx: integer Tensor of any shape (e.g. (M, K)) for flat features, (B, ...) (e.g.
            (B, M, K)) for padded ones; values in [0, N), or -1 for padding.
        validate: check that every index is in [-1, N) (reads the indices; skipped under
            ``torch.compile``, where an index out of range is an error of ``index_select``).

    Returns:
        Tensor of shape ``(*idx.shape, F)`` (flat) or (B, ..., F) (padded; ``(*idx.shape, F)``), the
        dtype of ``features``; zero rows where idx == -1. Differentiable with respect to
        ``features`` (rows gathered several times accumulate their gradients; padding gets none).
    """
    padded = _layout(features, idx)
    n = features.shape[1] if padded else features.shape[0]
    if validate and not torch.compiler.is_compiling():
        _check_values(idx, n)
    idx = idx.to(torch.int64)
    valid = idx >= 0
    rows = idx.clamp_min(0)
    flat = features
    if padded:
        b = features.shape[0]
        rows = rows + (torch.arange(b, device=idx.device) * n).reshape(b, *([1] * (idx.dim() - 1)))
        flat = features.reshape(b * n, *features.shape[2:])
    out = flat.index_select(0, rows.reshape(-1)).view(*idx.shape, *flat.shape[1:])
    mask = valid.reshape(*idx.shape, *([1] * (flat.dim() - 1)))
    return torch.where(mask, out, out.new_zeros(()))


__all__ = ["gather"]
