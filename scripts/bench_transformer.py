"""Benchmarks of the point-transformer ops (serialize, segment_reduce, serialized_pool, gather)
against the torch code models use today, interleaved in one process.

Run through ``scripts/benchmark.py --only transformer`` (``--quick`` shrinks it), or alone:
``python scripts/bench_transformer.py [--quick]``. Each row is a median over interleaved
turns (``bench_timer.median_ms``: the functions take turns, each timed on its second call),
and the ratio reference / pcops is what to read (> 1: pcops is faster). CPU only.

* serialize codes (N points, 16-bit grid, batch of 4): ``torch.ops.pcops.serialize_codes``
  against torch written the way Pointcept's ``encode`` computes them: Morton codes from
  256-entry lookup tables (OCNN's ``xyz2key``), Hilbert codes by Skilling's transform on
  (N, 3, depth) bit tensors (numpy-hilbert-curve's vectorisation); and the full
  ``pcops.serialize`` (codes, stable argsort, inverse) against ``encode`` + ``argsort`` +
  ``scatter`` for four orders (PTv3's default).
* segment_reduce (N rows, F = 32, segments of 8 rows on average, some empty): against
  ``torch.segment_reduce`` (CSR offsets) and ``scatter_reduce`` (unsorted ids), forward and
  forward + backward.
* serialized_pool (N points on a grid of about 1.5 points per occupied cell, F = 32, k = 1): against Pointcept's SerializedPooling body in torch
  (``unique`` with inverse and counts, ``sort``, ``torch.segment_reduce`` standing in for
  torch_scatter's ``segment_csr``), forward + backward.
* gather (N rows of F = 32, N/4 x 16 indices with 10% padding): against PyTorch3D's
  ``knn_gather`` (expand + gather) and advanced indexing with a mask, forward + backward.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

import bench_search  # noqa: E402
import pcops  # noqa: E402
from bench_timer import median_ms  # noqa: E402

DEPTH = 16
F = 32


# ----------------------------------------------------------------------------------------------
# torch references, in the way Pointcept computes them


def _morton_table(axis: int) -> torch.Tensor:
    """Bits of an 8-bit value spread to every third bit, at offset 2 - axis (x highest)."""
    v = torch.arange(256, dtype=torch.int64)
    out = torch.zeros_like(v)
    for i in range(8):
        out |= ((v >> i) & 1) << (3 * i + 2 - axis)
    return out


_TABLES = [_morton_table(a) for a in range(3)]


def torch_z_order(grid: torch.Tensor, depth: int = DEPTH) -> torch.Tensor:
    """Morton codes from lookup tables, 8 bits of each axis at a time (OCNN's xyz2key)."""
    x, y, z = grid[:, 0].long(), grid[:, 1].long(), grid[:, 2].long()
    ex, ey, ez = _TABLES
    key = ex[x & 255] | ey[y & 255] | ez[z & 255]
    if depth > 8:
        mask = (1 << (depth - 8)) - 1
        key = (ex[(x >> 8) & mask] | ey[(y >> 8) & mask] | ez[(z >> 8) & mask]) << 24 | key
    return key


def torch_hilbert(grid: torch.Tensor, depth: int = DEPTH) -> torch.Tensor:
    """Skilling's transform on (N, 3, depth) bit tensors (most significant bit first), then the
    interleaved Gray code decoded by shifted XORs: numpy-hilbert-curve's vectorisation."""
    shifts = torch.arange(depth - 1, -1, -1)
    bits = ((grid.long()[:, :, None] >> shifts) & 1).bool()  # (N, 3, depth)
    for bit in range(depth):
        for dim in range(3):
            mask = bits[:, dim, bit]
            bits[:, 0, bit + 1 :] ^= mask[:, None]
            flip = ~mask[:, None] & (bits[:, 0, bit + 1 :] ^ bits[:, dim, bit + 1 :])
            bits[:, dim, bit + 1 :] ^= flip
            bits[:, 0, bit + 1 :] ^= flip
    gray = bits.transpose(1, 2).reshape(-1, 3 * depth).long()
    weights = 1 << torch.arange(3 * depth - 1, -1, -1)
    h = (gray * weights).sum(1)
    shift = 1
    while shift < 3 * depth:
        h ^= h >> shift
        shift *= 2
    return h


def torch_encode(grid, batch, order: str, depth: int = DEPTH) -> torch.Tensor:
    if order.endswith("-trans"):
        grid = grid[:, [1, 0, 2]]
    code = torch_z_order(grid, depth) if order.startswith("z") else torch_hilbert(grid, depth)
    return batch.long() << (3 * depth) | code


def torch_serialization(grid, batch, orders):
    """Pointcept's Point.serialization: codes, argsort, inverse by scatter."""
    code = torch.stack([torch_encode(grid, batch, o) for o in orders])
    order = torch.argsort(code)
    inverse = torch.zeros_like(order).scatter_(1, order, torch.arange(code.shape[1]).repeat(code.shape[0], 1))
    return code, order, inverse


def pointcept_pool(code, features, coord, grid, batch, k: int = 1):
    """The body of Pointcept's SerializedPooling (no projection), segment_csr as torch.segment_reduce."""
    code = code >> (3 * k)
    _, cluster, counts = torch.unique(code[0], sorted=True, return_inverse=True, return_counts=True)
    _, indices = torch.sort(cluster)
    ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    head = indices[ptr[:-1]]
    parent = code[:, head]
    order = torch.argsort(parent)
    inverse = torch.zeros_like(order).scatter_(1, order, torch.arange(parent.shape[1]).repeat(parent.shape[0], 1))
    feat = torch.segment_reduce(features[indices], "max", offsets=ptr, axis=0)
    xyz = torch.segment_reduce(coord[indices], "mean", offsets=ptr, axis=0)
    return feat, xyz, grid[head] >> k, batch[head], parent, order, inverse, cluster


def knn_gather(x, idx):
    """PyTorch3D's knn_gather without lengths: (B, N, U), (B, M, K) -> (B, M, K, U)."""
    u = x.shape[2]
    k = idx.shape[2]
    return x[:, :, None].expand(-1, -1, k, -1).gather(1, idx[:, :, :, None].expand(-1, -1, -1, u))


# ----------------------------------------------------------------------------------------------
# Cases


def _cloud_grid(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A clustered cloud on an integer grid whose cell holds 1.5 points on average (as after
    PTv3's grid sampling, which keeps about one point per cell), 4 samples, sorted by sample."""
    points = bench_search.cloud("clustered", n, 5)
    points = points - points.amin(0)
    lo, hi = 1e-6, float(points.max())  # cell sizes: the occupied cells fall as the cell grows
    for _ in range(16):
        h = (lo * hi) ** 0.5
        g = torch.floor(points / h).long().clamp_max(2**21 - 1)
        cells = torch.unique((g[:, 0] << 42) | (g[:, 1] << 21) | g[:, 2]).shape[0]
        lo, hi = (h, hi) if cells > n / 1.5 else (lo, h)
    grid = torch.floor(points / hi).long()
    assert int(grid.max()) < 2**DEPTH
    batch = torch.sort(torch.randint(0, 4, (n,), generator=gen)).values
    return grid, batch


def _segments(n: int, gen: torch.Generator):
    segments = n // 8
    ids = torch.sort(torch.randint(0, segments, (n,), generator=gen)).values
    offsets = torch.searchsorted(ids, torch.arange(segments + 1))
    return ids, offsets, segments


def _backward(fn, leaf):
    def step():
        leaf.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    return step


def cases(n: int, gen: torch.Generator) -> list[tuple[str, str, dict]]:
    """(op, note, {variant: function}) for every row at size n; the first variant is pcops."""
    rows = []
    grid, batch = _cloud_grid(n, gen)
    for order in ("z", "hilbert"):
        kind = [("z", "z-trans", "hilbert", "hilbert-trans").index(order)]
        rows.append((f"serialize_codes:{order}", "codes only, depth 16, batch in the high bits", {
            "pcops": lambda kind=kind: torch.ops.pcops.serialize_codes(grid, batch, DEPTH, kind),
            "torch_pointcept": lambda order=order: torch_encode(grid, batch, order),
        }))
    orders = ["z", "z-trans", "hilbert", "hilbert-trans"]
    rows.append(("serialize", "4 orders: codes, argsort, inverse", {
        "pcops": lambda: pcops.serialize(grid, batch, DEPTH, orders),
        "torch_pointcept": lambda: torch_serialization(grid, batch, orders),
    }))

    values = torch.randn(n, F, generator=gen)
    leaf = values.clone().requires_grad_()
    ids, offsets, segments = _segments(n, gen)
    shuffled = ids[torch.randperm(n, generator=gen)]
    for reduce in ("sum", "max"):
        how = {"sum": "sum", "max": "amax"}[reduce]
        rows.append((f"segment_reduce:{reduce}", f"offsets, F={F}, forward", {
            "pcops": lambda reduce=reduce: pcops.segment_reduce(values, offsets, reduce=reduce),
            "torch_segment_reduce": lambda reduce=reduce: torch.segment_reduce(values, reduce, offsets=offsets, axis=0),
        }))
        rows.append((f"segment_reduce:{reduce}", f"offsets, F={F}, forward + backward", {
            "pcops": _backward(lambda reduce=reduce: pcops.segment_reduce(leaf, offsets, reduce=reduce), leaf),
            "torch_segment_reduce": _backward(lambda reduce=reduce: torch.segment_reduce(leaf, reduce, offsets=offsets, axis=0), leaf),
        }))
        index = shuffled[:, None].expand(-1, F)
        rows.append((f"segment_reduce:{reduce}", f"unsorted ids, F={F}, forward + backward", {
            "pcops": _backward(lambda reduce=reduce: pcops.segment_reduce(leaf, ids=shuffled, reduce=reduce, num_segments=segments), leaf),
            "torch_scatter_reduce": _backward(
                lambda how=how: leaf.new_zeros((segments, F)).scatter_reduce(0, index, leaf, how, include_self=False), leaf),
        }))

    code = pcops.serialize(grid, batch, DEPTH, orders).code
    coord = (grid.float() * 1e-3).requires_grad_()
    rows.append(("serialized_pool", f"k=1, 4 orders, F={F} max, coord mean, forward + backward", {
        "pcops": _backward(lambda: pcops.serialized_pool(code, 1, leaf, coord, grid, batch, reduce="max")[3:5], leaf),
        "torch_pointcept": _backward(lambda: pointcept_pool(code, leaf, coord, grid, batch)[:2], leaf),
    }))

    m = n // 4
    idx = torch.randint(0, n, (m, 16), generator=gen)
    idx[torch.rand(m, 16, generator=gen) < 0.1] = -1
    padded_leaf = values[None].clone().requires_grad_()
    full = idx.clamp_min(0)[None]
    rows.append(("gather", f"(N, {F}) rows at ({m}, 16) indices, 10% -1, forward + backward", {
        "pcops": _backward(lambda: pcops.gather(leaf, idx), leaf),
        "torch_indexing": _backward(lambda: torch.where((idx >= 0)[..., None], leaf[idx.clamp_min(0)], 0), leaf),
    }))
    rows.append(("gather:padded", f"(1, N, {F}) at (1, {m}, 16), no padding, forward + backward", {
        "pcops": _backward(lambda: pcops.gather(padded_leaf, full), padded_leaf),
        "pytorch3d_knn_gather": _backward(lambda: knn_gather(padded_leaf, full), padded_leaf),
    }))
    return rows


def run(quick: bool, repeats: int = 5, budget_s: float = 20.0) -> list[dict]:
    """Every row at 10^5 and 10^6 points (10^4 with ``quick``), with ratios printed."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in ([10_000] if quick else [100_000, 1_000_000]):
        for op, note, fns in cases(n, gen):
            ms = median_ms(fns, repeats=2 if quick else repeats, budget_s=2.0 if quick else budget_s, min_s=0.2 if quick else 1.0)
            ours = ms["pcops"]
            row = {"op": op, "n": n, "note": note, "ms": {k: round(v, 3) for k, v in ms.items()}}
            row["ratio"] = {k: round(v / ours, 2) for k, v in ms.items() if k != "pcops"}
            out.append(row)
            peers = ", ".join(f"{k} {v:,.2f} ms ({row['ratio'][k]:.2f}x)" for k, v in ms.items() if k != "pcops")
            print(f"{op:<22} n={n:>9,}  pcops {ours:,.2f} ms  vs {peers}  [{note}]", flush=True)
    return out


if __name__ == "__main__":
    pcops._warp.init()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratios are reference / pcops (> 1: pcops faster)")
    run("--quick" in sys.argv)
