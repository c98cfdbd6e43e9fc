"""Farthest point sampling: exact, deterministic, on CPU (all cores) and CUDA.

Iterative farthest point sampling picks a start point, then repeatedly the point whose
distance to the points picked so far is largest:

    s_0 = start,   s_t = argmax_{j not picked} min_{u < t} ||p_j - p_{s_u}||

Ties go to the smaller index; points already picked are never picked again (a duplicate of a
picked point, at distance 0, still can be, once nothing farther is left). Work is O(N * S),
memory O(N): each point keeps its squared distance to the picked set, updated once per pick.

Large inputs: one Warp kernel launch per pick, for every sample at once: the points of each
sample are split into blocks, each thread updates one block's distances to the newest pick and
writes the block's farthest point. The newest pick is the farthest of the previous launch's
blocks: on the CPU (a block per core) each thread finds it itself (two buffers
alternate), on CUDA (many blocks) torch finds it between launches. The launch is recorded
once (:func:`pcops._warp.recorded`). The blocks spread one large cloud, or many small ones,
over all CPU cores or the GPU, and the loop over picks never reads a value on the host. Small
inputs on the CPU (at most ``SINGLE_LAUNCH`` points in all): one launch, a thread per sample
doing all its picks, which saves the per-pick launch overhead. Both give identical results.
"""

import math
from typing import NamedTuple, Optional

import torch
import warp as wp

from .. import _validate, _warp


class FPS(NamedTuple):
    """Result of :func:`farthest_point_sample`: the sampled ``points`` and their ``idx`` (int64)."""

    points: torch.Tensor
    idx: torch.Tensor


@_warp.kernels
def _kernels(dtype: torch.dtype):
    """(step, whole): one pick for every block of every sample; all picks of a sample per thread."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)

    @wp.func(module="unique")
    def update(points: wp.array(dtype=v), dist: wp.array(dtype=s), row: int, lo: int, hi: int, last: int):
        """Distances of points lo..hi-1 of a sample to its newest pick ``last``; their farthest (first on ties)."""
        c = points[row + last]
        top = s(-2.0)
        top_j = int(-1)
        for j in range(lo, hi):  # branch-free: selects, no jumps
            d = dist[row + j]
            x = wp.length_sq(points[row + j] - c)
            d = wp.where(d < x, d, x)  # picked points (-1) stay; a NaN point's distance is NaN
            d = wp.where(j == last, s(-1.0), d)  # picked: never again
            dist[row + j] = d
            better = d > top
            top = wp.where(better, d, top)
            top_j = wp.where(better, j, top_j)
        return top, top_j

    @wp.kernel(enable_backward=False, module="unique")
    def step(
        start: int,
        points: wp.array(dtype=v),
        n: int,
        block: int,
        blocks: int,
        lengths: wp.array(dtype=wp.int32),
        picked: wp.array(dtype=wp.int64),
        first_pick: int,
        prev_best: wp.array(dtype=s),
        prev_idx: wp.array(dtype=wp.int64),
        dist: wp.array(dtype=s),
        best: wp.array(dtype=s),
        best_idx: wp.array(dtype=wp.int64),
        idx: wp.array2d(dtype=wp.int64),
        count: wp.array(dtype=wp.int32),
    ):
        """One pick for a block of a sample: the newest pick is ``picked`` (``first_pick``), else
        the farthest of the previous launch's blocks (``prev_*``; the first block also writes it
        into ``idx``); then the block's distances to it, and the block's farthest point."""
        t = wp.tid() + start
        b = t // blocks
        last = int(picked[b])
        if first_pick == 0:
            row = b * blocks
            top_c = int(0)
            for c in range(1, blocks):  # the first maximum: the smaller index wins ties
                if prev_best[row + c] > prev_best[row + top_c]:
                    top_c = c
            last = wp.max(int(prev_idx[row + top_c]), 0)  # -1: the sample is exhausted
            if t == row:
                idx[b, int(count[b])] = wp.int64(last)
                count[b] = count[b] + 1
        lo = (t - b * blocks) * block
        top, top_j = update(points, dist, b * n, lo, wp.min(lo + block, lengths[b]), last)
        best[t] = top
        best_idx[t] = wp.int64(top_j)

    @wp.kernel(enable_backward=False, module="unique")
    def whole(
        start: int,
        points: wp.array(dtype=v),
        n: int,
        lengths: wp.array(dtype=wp.int32),
        counts: wp.array(dtype=wp.int64),
        first: wp.array(dtype=wp.int64),
        dist: wp.array(dtype=s),
        idx: wp.array2d(dtype=wp.int64),
    ):
        b = wp.tid() + start
        if counts[b] == wp.int64(0):
            return
        last = int(first[b])
        idx[b, 0] = wp.int64(last)
        for t in range(1, int(counts[b])):
            top, top_j = update(points, dist, b * n, 0, lengths[b], last)
            last = top_j
            idx[b, t] = wp.int64(last)

    return step, whole


# On the CPU, below this many points in all samples together, one launch does every pick (a
# thread per sample); above it, and always on CUDA, one launch per pick spreads each pick's
# work over all cores or the GPU.
SINGLE_LAUNCH = 1 << 16


def _reduce_in_kernel(device: torch.device) -> bool:
    """Whether each per-pick launch finds the newest pick itself from the previous launch's
    blocks (every thread reads all blocks of its sample: the CPU's few blocks, not a GPU's many)."""
    return device.type == "cpu"


def _block(n: int, b: int, device: torch.device) -> int:
    """Points per thread of the per-pick kernel: CUDA 128 (many threads); CPU a block per core
    (``pcops._warp.launch`` runs a chunk per core), of at least 4096 points each."""
    if device.type != "cpu":
        return 128
    per_block = math.ceil(b * n / max(1, torch.get_num_threads()))
    return max(1, min(n, max(per_block, 4096)))


@torch.library.custom_op("pcops::farthest_point_sample", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fps(points: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor, start: torch.Tensor, n_samples: int, validate: bool) -> torch.Tensor:
    """points (B, N, 3) float32/64, lengths (B,), counts (B,) picks per sample (<= lengths),
    start (B,) first pick; returns idx (B, n_samples) int64, -1 past each sample's count."""
    b, n, _ = points.shape
    if validate:
        _validate.finite(points=points)
    idx = torch.full((b, n_samples), -1, dtype=torch.int64, device=points.device)
    if b == 0 or n == 0 or n_samples == 0:
        return idx
    _warp.init()
    pts = points.reshape(b * n, 3).contiguous()
    lengths32 = lengths.to(torch.int32).contiguous()
    dist = points.new_full((b * n,), float("inf"))
    picked = start.to(torch.int64).clamp(min=0).contiguous()
    step, whole = _kernels(points.dtype)
    vec = _warp.array(pts, dtype=_warp.vec3(points.dtype))  # (B N,) 3-vectors: one load per point
    with _warp.stream(points):
        if b * n <= SINGLE_LAUNCH and points.device.type == "cpu":  # a GPU wants many threads per pick
            counts = counts.to(torch.int64).contiguous()
            _warp.launch(whole, b, [vec, n, lengths32, counts, picked, dist, idx], like=points)
            return idx
        block = _block(n, b, points.device)
        blocks = math.ceil(n / block)
        # two buffers of the blocks' farthest points: each launch reads one and writes the other
        bests = [points.new_empty((b * blocks,)) for _ in range(2)]
        best_idx = [torch.empty((b * blocks,), dtype=torch.int64, device=points.device) for _ in range(2)]
        count = torch.ones(b, dtype=torch.int32, device=points.device)
        common = [vec, n, block, blocks, lengths32, picked]

        def args(first_pick: int, read: int) -> list:
            return [*common, first_pick, bests[read], best_idx[read], dist, bests[1 - read], best_idx[1 - read], idx, count]

        picks = min(n_samples, n)  # picks past a sample's count are masked below
        idx[:, 0] = picked
        if picks > 1 and not _reduce_in_kernel(points.device):
            # many blocks per sample (a GPU): torch takes each sample's farthest block between launches
            pick = _warp.recorded(step, b * blocks, args(1, 1), like=points, min_chunk=1)
            rows = torch.arange(b, device=points.device)
            for t in range(1, picks):
                pick()
                top = bests[0].view(b, blocks).argmax(1)  # first maximum: the smaller index wins ties
                picked.copy_(best_idx[0].view(b, blocks)[rows, top].clamp(min=0))  # -1: sample exhausted
                idx[:, t] = picked
        elif picks > 1:  # few blocks per sample (the CPU): each launch reduces the previous one's
            _warp.launch(step, b * blocks, args(1, 1), like=points, min_chunk=1)  # from ``picked``: writes buffer 0
            steps = [_warp.recorded(step, b * blocks, args(0, read), like=points, min_chunk=1) for read in (0, 1)]
            for t in range(2, picks):  # launch t reads the buffer launch t - 1 wrote, and writes pick t - 1
                steps[t % 2]()
            last = 1 - (picks - 1) % 2 if picks > 2 else 0  # the buffer the last launch wrote: its farthest is the last pick
            top = bests[last].view(b, blocks).argmax(1)  # first maximum: the smaller index wins ties
            idx[:, picks - 1] = best_idx[last].view(b, blocks)[torch.arange(b, device=points.device), top].clamp(min=0)
    return torch.where(torch.arange(n_samples, device=idx.device) < counts[:, None], idx, -1)


@_fps.register_fake
def _(points, lengths, counts, start, n_samples, validate):
    return points.new_empty((points.shape[0], n_samples), dtype=torch.int64)


def _counts(lengths: torch.Tensor, n_samples: Optional[int], ratio) -> torch.Tensor:
    if ratio is None:
        return lengths.clamp(max=n_samples)
    return torch.ceil(lengths.to(torch.float64) * ratio).to(torch.int64).clamp(max=lengths)


def _start(lengths: torch.Tensor, random_start: bool, generator) -> torch.Tensor:
    if not random_start:
        return torch.zeros_like(lengths)
    u = torch.rand(lengths.shape, generator=generator, dtype=torch.float64, device="cpu").to(lengths.device)
    return (u * lengths).to(torch.int64).clamp(max=(lengths - 1).clamp(min=0))


def _check(points, n_samples, ratio, lengths, batch):
    _validate.tensor("points", points)
    if points.dim() not in (2, 3) or points.shape[-1] != 3:
        raise ValueError(f"points must be a tensor of shape (N, 3) or (B, N, 3), got shape {tuple(points.shape)}")
    if (n_samples is None) == (ratio is None):
        raise ValueError("give exactly one of n_samples and ratio")
    if n_samples is not None:
        _validate.count("n_samples", n_samples)
    else:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"ratio must be a number, got {type(ratio).__name__}")
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if points.dim() == 3 and batch is not None:
        raise ValueError("batch describes packed (N, 3) points; padded (B, N, 3) points take lengths")
    if points.dim() == 2 and lengths is not None:
        raise ValueError("lengths describes padded (B, N, 3) points; packed (N, 3) points take batch")
    if points.dim() == 3 and ratio is not None:
        raise ValueError("ratio needs packed (N, 3) points with batch; padded points take n_samples")
    _validate.ids("lengths", lengths, points.shape[0], "(B,)")
    _validate.ids("batch", batch, points.shape[0], "(N,)")
    _validate.same_device(points=points, lengths=lengths, batch=batch)


def farthest_point_sample(
    points: torch.Tensor,
    n_samples: Optional[int] = None,
    *,
    lengths: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
    ratio: Optional[float] = None,
    random_start: bool = False,
    generator: Optional[torch.Generator] = None,
    validate: bool = True,
) -> FPS:
    """Iterative farthest point sampling, exact and deterministic.

    Args:
        points: Tensor of shape (N, 3) (one cloud), (B, N, 3) padded with ``lengths``, or
            (N_total, 3) packed with ``batch``.
        n_samples: points to pick per sample (S). A sample with fewer points gives all of them.
        lengths: optional int tensor (B,) of valid rows per sample of padded points.
        batch: optional int tensor (N_total,) of sample ids of packed points (sorted or not).
        ratio: instead of ``n_samples``, for packed (or single) points: pick ceil(ratio * n_b)
            points of a sample of n_b points, 0 < ratio <= 1 (torch_cluster's ``fps``).
        random_start: start each sample at a random point (drawn with ``generator``, on the
            CPU) instead of its first point.
        validate: check the points for NaN/inf and lengths/ids for range.

    Returns:
        FPS(points, idx). Single: (S, 3) and (S,). Padded: (B, S, 3) and (B, S) with idx per
        sample, -1 (and zero points) past a sample's length. Packed: (K, 3) and (K,) with
        idx into the packed points, grouped by sample in ascending id order, each in pick
        order (K = sum of the per-sample counts: its size depends on the data). The first
        pick of a sample is its first point (its smallest index) unless ``random_start``.
        ``points`` is ``points[idx]``, differentiable with respect to the input points.

    Points are compared in their own precision (float32/float64; float16/bfloat16 in float32).
    """
    n_samples, ratio = _validate.plain(n_samples), _validate.plain(ratio)  # NumPy scalars as Python numbers
    _check(points, n_samples, ratio, lengths, batch)
    dtype, _ = _validate.compute_dtype(points)
    if points.dim() == 3:
        b, n = points.shape[:2]
        if lengths is None:
            lengths = torch.full((b,), n, dtype=torch.int64, device=points.device)
        elif validate and not torch.compiler.is_compiling():
            _validate.ids_in_range("lengths", lengths, 0, n)
        lengths = lengths.to(torch.int64)
        counts = _counts(lengths, n_samples, None)
        start = _start(lengths, random_start, generator)
        idx = torch.ops.pcops.farthest_point_sample(points.detach().to(dtype), lengths, counts, start, n_samples, validate)
        gathered = points.gather(1, idx.clamp(min=0)[..., None].expand(b, n_samples, 3))
        return FPS(torch.where(idx[..., None] >= 0, gathered, 0), idx)
    if batch is None:
        if ratio is not None:
            n_samples = max(1, math.ceil(points.shape[0] * ratio))
        out = farthest_point_sample(points[None], n_samples, random_start=random_start, generator=generator, validate=validate)
        return FPS(out.points[0], out.idx[0])
    if validate and not torch.compiler.is_compiling():
        _validate.ids_in_range("batch", batch, 0, None)
    idx = torch.ops.pcops.farthest_point_sample_packed(
        points.detach().to(dtype), batch, n_samples or 0, float(ratio or 0.0), random_start,
        _seed(generator) if random_start else 0, validate,
    )
    return FPS(points[idx], idx)


def _seed(generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator))


@torch.library.custom_op("pcops::farthest_point_sample_packed", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fps_packed(points: torch.Tensor, batch: torch.Tensor, n_samples: int, ratio: float, random_start: bool, seed: int, validate: bool) -> torch.Tensor:
    """Packed points (P, 3) with sample ids (P,): idx (K,) into them, by sample, in pick order."""
    if points.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=points.device)
    order = torch.sort(batch.to(torch.int64), stable=True)
    ids, perm = order.values, order.indices
    samples, sizes = torch.unique_consecutive(ids, return_counts=True)
    b, n = samples.numel(), int(sizes.max())
    offsets = torch.cumsum(sizes, 0) - sizes
    local = torch.arange(ids.numel(), device=ids.device) - offsets.repeat_interleave(sizes)
    slot = torch.searchsorted(samples, ids)
    padded = points.new_zeros((b, n, 3))
    padded[slot, local] = points[perm]
    counts = _counts(sizes, n_samples or None, ratio or None)
    gen = torch.Generator().manual_seed(seed)
    start = _start(sizes, random_start, gen)
    idx = _fps(padded, sizes, counts, start, int(counts.max()), validate)
    keep = idx >= 0
    return perm[(offsets[:, None] + idx.clamp(min=0))[keep]]


@_fps_packed.register_fake
def _(points, batch, n_samples, ratio, random_start, seed, validate):
    k = torch.library.get_ctx().new_dynamic_size()
    return points.new_empty((k,), dtype=torch.int64)


__all__ = ["FPS", "farthest_point_sample"]
