"""The distance update of distributed farthest point sampling, as the single-process op computes it:
``length_sq(p_j - c)`` in a Warp kernel in the points' (compute) dtype, so that both round alike
and pick the same points, ties included."""


import torch
import warp as wp

from .. import _warp


@_warp.kernels
def _update_kernel(dtype: torch.dtype):
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def update(start: int, points: wp.array(dtype=v), picked: wp.array(dtype=v), far: wp.array(dtype=s)):
        i = wp.tid() + start
        far[i] = wp.min(far[i], wp.length_sq(points[i] - picked[0]))

    return update


def lower(far: torch.Tensor, points: torch.Tensor, picked: torch.Tensor) -> None:
    """far[j] = min(far[j], |points[j] - picked|^2) in place (a picked point's -1 stays)."""
    if points.shape[0]:
        _warp.init()
        _warp.launch(_update_kernel(points.dtype), points.shape[0], [points, picked.reshape(1, 3).contiguous(), far], like=points)
