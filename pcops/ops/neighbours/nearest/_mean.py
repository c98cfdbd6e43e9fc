"""The weighted mean of :func:`pcops.knn_aggregate` (and so :func:`pcops.knn_interpolate`) of a
plain CPU call in one Warp launch, for calls with nothing to differentiate.

``mean(dists, idx, features, inverse)`` returns what the op's torch formula computes from the
search's distances and indices (``_weighting.inverse_distance(dists.square(), None)`` or the
uniform ``1 / k``, then ``(w[..., None] * features[idx]).sum(1)``), the same values bit for bit:
each weight by the same operations in the same order (the squares clamped at
``MIN_SQUARED_DISTANCE``, scaled by the row's smallest, normalised by their sum), each product
rounded and the k products summed left to right, one operation a statement (the CPU compiler
fuses no multiply-add across statements). torch sums up to four terms left to right (its sums
keep four partial sums); for more neighbours it orders them its own way, so ``k`` is at most
:data:`MAX_K` here (PointNet++'s interpolation takes 3). One launch instead of about ten small
torch operations for inverse-distance weights, four for uniform ones (docs/ops/knn_interpolate.md).
"""

from typing import Optional

import torch
import warp as wp

from .... import _warp
from .. import _weighting

# The most neighbours whose products torch sums left to right (its sums keep four partial sums)
MAX_K = 4


@_warp.kernels
def _kernel(dtype: torch.dtype, k: int, inverse: bool):
    """Thread i: row i's weights (inverse distance or uniform) and its weighted mean of the
    features of its k neighbours; a row whose last neighbour is -1 (cut short) sets ``cut[0]``
    and writes nothing."""
    s = _warp.scalar(dtype)
    weights = wp.types.vector(length=MAX_K, dtype=s)
    indices = wp.types.vector(length=MAX_K, dtype=wp.int32)
    least = s(_weighting.MIN_SQUARED_DISTANCE)

    @wp.kernel(enable_backward=False, module="unique")
    def mean(start: int, dists: wp.array2d(dtype=s), idx: wp.array2d(dtype=wp.int64), features: wp.array2d(dtype=s),
             out: wp.array2d(dtype=s), cut: wp.array(dtype=wp.int32)):
        i = wp.tid() + start
        if idx[i, wp.static(k - 1)] < wp.int64(0):  # (rows are sorted: a -1 is last)
            cut[0] = 1
            return
        w = weights()
        if wp.static(inverse):  # torch: sq = d.square().clamp_min(least); w = smallest / sq; w / sum
            smallest = s(wp.inf)
            for j in range(wp.static(k)):
                d = dists[i, j]
                sq = d * d
                sq = wp.where(sq < least, least, sq)
                w[j] = sq
                smallest = wp.where(sq < smallest, sq, smallest)
            smallest = wp.where(wp.isinf(smallest), s(1.0), smallest)
            total = s(0.0)
            for j in range(wp.static(k)):
                w[j] = smallest / w[j]
                total = total + w[j]
            total = wp.where(total > s(0.0), total, s(1.0))
            for j in range(wp.static(k)):
                w[j] = w[j] / total
        else:  # torch: ones(()) / k
            for j in range(wp.static(k)):
                w[j] = s(1.0) / s(wp.static(float(k)))
        rows = indices()  # (the neighbours' rows read once; a while loop over the features: Warp's dynamic range loop costs more per step)
        for j in range(wp.static(k)):
            rows[j] = int(idx[i, j])
        nf = features.shape[1]
        f = int(0)
        while f < nf:
            acc = s(0.0)
            for j in range(wp.static(k)):
                p = w[j] * features[rows[j], f]
                acc = acc + p
            out[i, f] = acc
            f += 1

    return mean


_GROUPS = (("dists", "idx", "out"), ("features",))  # (the lengths a call sets: its rows', its points')


def mean(dists: torch.Tensor, idx: torch.Tensor, features: torch.Tensor, inverse: bool) -> Optional[torch.Tensor]:
    """(M, F): the weighted mean of each row's neighbours' features (see the module docs) for a
    plain search's ``dists`` and ``idx`` (M, k), k <= :data:`MAX_K`, and CPU ``features`` (N, F)
    of the distances' dtype; None where a row was cut short (the general path's masks)."""
    m, k = idx.shape
    dists, idx, features = dists.contiguous(), idx.contiguous(), features.contiguous()
    out = features.new_empty(m, features.shape[1])
    cut = torch.zeros(1, dtype=torch.int32)
    if m == 0:
        return out
    kernel = _kernel(dists.dtype, k, inverse)
    args = [dists, idx, features, out, cut]
    work = m * k * max(features.shape[1], 1)
    launch = _warp.ranged(("knn_mean", dists.dtype, k, features.shape[1], inverse), lambda: _warp.prepare(kernel, m, args, work=work),
                          _GROUPS, (m, features.shape[0]), m, work)
    if launch is not None:
        launch.run(dists=dists, idx=idx, features=features, out=out, cut=cut)
    else:
        _warp.launch(kernel, m, args, like=features, min_chunk=1, work=work)
    return None if cut.item() else out
