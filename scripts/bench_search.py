"""CPU neighbour-search benchmarks of pcops against its strongest peers, interleaved in one process.

Run through ``scripts/benchmark.py`` (``--search`` runs only these; ``--quick`` shrinks them).
Every row is a median over interleaved repeats (pcops and each peer take turns; in its turn
each runs twice, the second call timed: ``bench_timer.median_ms``), and the ratio peer / pcops is what
to read (> 1: pcops is faster).

* kNN search (k = 7, distances and indices, build included): ``pcops.knn`` with the default
  backend against pykdtree, scipy ``cKDTree(workers=-1)`` and open3d-cpu
  ``NearestNeighborSearch``, on four cloud shapes: ``randn`` (the tutorial's
  ``torch.randn(N, 3)`` with its 30^3 grid queries on [-1, 1]^3), ``uniform`` (in [-1, 1]^3),
  ``clustered`` (50 Gaussian blobs of width 0.03 plus 10% uniform background) and
  ``surface`` (points sampled on a sphere, a box and a capsule, trimesh), each with N
  queries of the same shape; and ``surface_grid`` (surface points, grid queries, most of
  them far from the surface).
* kNN self-queries with k = 16 and 32 (DGCNN's graphs, normal estimation) against pykdtree, on
  the four shapes and the real meshes of ``bench_meshes.py``, at 10^4 and 10^5 points;
* batched kNN: 16 clouds of 10,000 points as one padded batch, and 16 clouds of 6,000 to 10,000
  points as one packed batch of self-queries (and 8 of 600 to 1,000), against per-sample loops.
* knn_aggregate's train step (forward + backward to F = 25 features, k = 7, sigma = 0.1) on the
  tutorial's cloud against pykdtree's search + the same weighting and gather in torch.
* radius aggregation (the tutorial's 25,000 points, then 10^5 and 10^6 in the same box; 30^3
  grid queries, r = 0.1, sigma = 0.1, F = 25): forward, and forward + backward (gradients for
  the queries and the features),
  against a multi-threaded float32 numba cell list written here as the reference (counting
  sort, online softmax, per-thread gradient buffers; search included).

Peers are imported lazily; a missing one leaves its rows out with a note. They are never
requirements of pcops.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import pcops
from bench_timer import median_ms

K = 7


# ----------------------------------------------------------------------------------------------
# Clouds


def _surface(n: int, seed: int) -> torch.Tensor:
    import trimesh

    mesh = trimesh.util.concatenate([
        trimesh.creation.icosphere(3, radius=0.8),
        trimesh.creation.box((1.2, 0.6, 1.6)),
        trimesh.creation.capsule(1.2, 0.3),
    ])
    points, _ = trimesh.sample.sample_surface(mesh, n, seed=seed)
    return torch.from_numpy(np.asarray(points, dtype=np.float32))


def _clustered(n: int, gen: torch.Generator) -> torch.Tensor:
    centres = torch.rand(50, 3, generator=gen) * 2 - 1
    p = centres[torch.randint(0, 50, (n,), generator=gen)] + 0.03 * torch.randn(n, 3, generator=gen)
    p[: n // 10] = torch.rand(n // 10, 3, generator=gen) * 2 - 1
    return p


def grid_queries(resolution: int = 30) -> torch.Tensor:
    axis = torch.linspace(-1, 1, resolution)
    return torch.cartesian_prod(axis, axis, axis)


def cloud(kind: str, n: int, seed: int) -> torch.Tensor:
    """n float32 points of a cloud shape (see the module docs)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(n, 3, generator=gen)
    if kind == "uniform":
        return torch.rand(n, 3, generator=gen) * 2 - 1
    if kind == "clustered":
        return _clustered(n, gen)
    if kind == "surface":
        return _surface(n, seed)
    if kind.startswith("mesh:"):  # a real mesh sampled as a cloud (scripts/bench_meshes.py)
        import bench_meshes

        return bench_meshes.cloud(kind[len("mesh:"):], n, seed)
    raise ValueError(kind)


def knn_case(kind: str, n: int, grid: int):
    """(query, ref) of a kNN row: grid queries for randn / surface_grid, else n queries of the shape."""
    if kind == "surface_grid":
        return grid_queries(grid), cloud("surface", n, 0)
    if kind == "randn":
        return grid_queries(grid), cloud("randn", n, 0)
    return cloud(kind, n, 1), cloud(kind, n, 0)


# ----------------------------------------------------------------------------------------------
# kNN peers: each returns (dists, idx) for float32 numpy/torch inputs


def _pykdtree():
    from pykdtree.kdtree import KDTree

    return lambda q, p: KDTree(p.numpy()).query(q.numpy(), k=K)


def _ckdtree():
    from scipy.spatial import cKDTree

    return lambda q, p: cKDTree(p.numpy()).query(q.numpy(), k=K, workers=-1)


def _open3d():
    import open3d as o3d

    def search(q, p):
        nns = o3d.core.nns.NearestNeighborSearch(o3d.core.Tensor.from_numpy(p.numpy()))
        nns.knn_index()
        return nns.knn_search(o3d.core.Tensor.from_numpy(q.numpy()), K)

    return search


KNN_PEERS = {"pykdtree": _pykdtree, "scipy_ckdtree": _ckdtree, "open3d": _open3d}


# ----------------------------------------------------------------------------------------------
# Radius reference: a numba cell list (search included), forward and feature gradient


def numba_radius():
    """(forward, backward) numba functions of the radius aggregation over a cell list, float32.

    The standard multi-threaded cell list: a counting sort of the reference points into cells
    of width r (points and features gathered in cell order), one parallel pass per query over
    its 27 cells with an online softmax accumulated in the output row; the backward (gradients
    of the queries and features) repeats the scan, each thread scattering the feature gradient
    into its own buffer, summed at the end.
    """
    import numba

    @numba.njit(cache=True)
    def build(points, feats, low, inv, dims):
        n, nx, ny, nz = points.shape[0], dims[0], dims[1], dims[2]
        cell = np.empty(n, np.int64)
        starts = np.zeros(nx * ny * nz + 1, np.int64)
        for j in range(n):
            x = min(max(int((points[j, 0] - low[0]) * inv), 0), nx - 1)
            y = min(max(int((points[j, 1] - low[1]) * inv), 0), ny - 1)
            z = min(max(int((points[j, 2] - low[2]) * inv), 0), nz - 1)
            cell[j] = (z * ny + y) * nx + x
            starts[cell[j] + 1] += 1
        for c in range(nx * ny * nz):
            starts[c + 1] += starts[c]
        fill = starts[:-1].copy()
        order = np.empty(n, np.int64)
        for j in range(n):
            order[fill[cell[j]]] = j
            fill[cell[j]] += 1
        return starts, order, points[order], feats[order]

    @numba.njit(parallel=True, cache=True)
    def forward_kernel(query, pts, feats, starts, low, inv, dims, radius, inv_s, out, wsum, dmin):
        nf, r2 = feats.shape[1], radius * radius
        for i in numba.prange(query.shape[0]):
            q0, q1, q2 = query[i, 0], query[i, 1], query[i, 2]
            cx, cy, cz = int((q0 - low[0]) * inv), int((q1 - low[1]) * inv), int((q2 - low[2]) * inv)
            acc = out[i]
            m = np.float32(0.0)
            total = np.float32(0.0)
            count = 0
            for z in range(max(cz - 1, 0), min(cz + 2, dims[2])):
                for y in range(max(cy - 1, 0), min(cy + 2, dims[1])):
                    row = (z * dims[1] + y) * dims[0]
                    for j in range(starts[row + max(cx - 1, 0)], starts[row + min(cx + 2, dims[0])]):
                        dx, dy, dz = q0 - pts[j, 0], q1 - pts[j, 1], q2 - pts[j, 2]
                        sq = dx * dx + dy * dy + dz * dz
                        if sq <= r2:
                            d = np.sqrt(sq)
                            if count == 0:
                                m = d
                            if d < m:  # a new nearest neighbour: rescale what was accumulated
                                scale = np.exp((d - m) * inv_s)
                                total *= scale
                                for c in range(nf):
                                    acc[c] *= scale
                                m = d
                            w = np.exp((m - d) * inv_s)
                            total += w
                            for c in range(nf):
                                acc[c] += w * feats[j, c]
                            count += 1
            if count:
                inv_w = np.float32(1.0) / total
                for c in range(nf):
                    acc[c] *= inv_w
            wsum[i] = total
            dmin[i] = m

    @numba.njit(parallel=True, cache=True)
    def backward_kernel(query, pts, feats, starts, low, inv, dims, radius, inv_s, grad_out, out, wsum, dmin, grad_q, grad_f):
        nf, r2, chunks, m = feats.shape[1], radius * radius, grad_f.shape[0], query.shape[0]
        for t in numba.prange(chunks):
            mine = grad_f[t]
            for i in range(t * m // chunks, (t + 1) * m // chunks):
                if wsum[i] == 0:
                    continue
                q0, q1, q2 = query[i, 0], query[i, 1], query[i, 2]
                cx, cy, cz = int((q0 - low[0]) * inv), int((q1 - low[1]) * inv), int((q2 - low[2]) * inv)
                inv_w = np.float32(1.0) / wsum[i]
                g_out = np.float32(0.0)
                for c in range(nf):
                    g_out += grad_out[i, c] * out[i, c]
                g0, g1, g2 = np.float32(0.0), np.float32(0.0), np.float32(0.0)
                for z in range(max(cz - 1, 0), min(cz + 2, dims[2])):
                    for y in range(max(cy - 1, 0), min(cy + 2, dims[1])):
                        row = (z * dims[1] + y) * dims[0]
                        for j in range(starts[row + max(cx - 1, 0)], starts[row + min(cx + 2, dims[0])]):
                            dx, dy, dz = q0 - pts[j, 0], q1 - pts[j, 1], q2 - pts[j, 2]
                            sq = dx * dx + dy * dy + dz * dz
                            if sq <= r2:
                                d = np.sqrt(sq)
                                w = np.exp((dmin[i] - d) * inv_s) * inv_w
                                g_f = np.float32(0.0)
                                for c in range(nf):
                                    g_f += grad_out[i, c] * feats[j, c]
                                    mine[j, c] += w * grad_out[i, c]
                                if d > 0:
                                    a = -w * (g_f - g_out) * inv_s / d
                                    g0 += a * dx
                                    g1 += a * dy
                                    g2 += a * dz
                grad_q[i, 0], grad_q[i, 1], grad_q[i, 2] = g0, g1, g2

    def frame(query, ref, radius):
        low = np.minimum(query.min(0), ref.min(0)).astype(np.float32)
        high = np.maximum(query.max(0), ref.max(0))
        dims = np.maximum(np.floor((high - low) / radius).astype(np.int64) + 1, 1)
        return low, np.float32(1.0 / radius), dims

    def forward(query, ref, feats, radius, sigma):
        """(out, saved): the weighted means and what the backward reuses (the cell list included)."""
        low, inv, dims = frame(query, ref, radius)
        starts, order, pts, fs = build(ref, feats, low, inv, dims)
        out = np.zeros((query.shape[0], feats.shape[1]), np.float32)
        wsum, dmin = np.zeros(query.shape[0], np.float32), np.zeros(query.shape[0], np.float32)
        forward_kernel(query, pts, fs, starts, low, inv, dims, np.float32(radius), np.float32(1.0 / sigma), out, wsum, dmin)
        return out, (low, inv, dims, starts, order, pts, fs, wsum, dmin)

    def backward(query, radius, sigma, out, saved, grad_out):
        """(grad_query, grad_features) in the input order."""
        low, inv, dims, starts, order, pts, fs, wsum, dmin = saved
        grad_q = np.zeros((query.shape[0], 3), np.float32)
        grad_f = np.zeros((numba.get_num_threads(),) + fs.shape, np.float32)
        backward_kernel(query, pts, fs, starts, low, inv, dims, np.float32(radius), np.float32(1.0 / sigma),
                        grad_out, out, wsum, dmin, grad_q, grad_f)
        grad = np.empty_like(fs)
        grad[order] = grad_f.sum(0)
        return grad_q, grad

    return forward, backward


# ----------------------------------------------------------------------------------------------
# Measurement


CLOCK = time.perf_counter  # time.process_time with --cpu-time: work in CPU ms, robust to a loaded machine
MIN_S = 1.0  # seconds of turns at least (more turns for fast rows): see bench_timer.median_ms


def _peers(table: dict, notes: list) -> dict:
    fns = {}
    for name, make in table.items():
        try:
            fns[name] = make()
        except ImportError as err:
            notes.append(f"{name} skipped: not installed ({err.name})")
    return fns


def run_knn(sizes, kinds, grid: int, repeats: int, budget_s: float) -> tuple[list[dict], list[str]]:
    notes: list[str] = []
    peers = _peers(KNN_PEERS, notes)
    rows = []
    for kind in kinds:
        for n in sizes:
            q, p = knn_case(kind, n, grid)
            fns = {"pcops": lambda: pcops.knn(q, p, K, validate=False)}
            fns.update({name: (lambda f=f: f(q, p)) for name, f in peers.items()})
            ms = median_ms(fns, repeats=repeats, budget_s=budget_s, min_s=MIN_S, clock=CLOCK)
            row = {"bench": "knn_search", "cloud": kind, "n_ref": n, "n_query": q.shape[0], "ms": ms}
            rows.append(row)
            print(format_row(row), flush=True)
    return rows, notes


def run_knn_self(sizes, kinds, ks, repeats: int, budget_s: float) -> list[dict]:
    """Self-queries (the cloud searched against itself, the point itself included) with the k of
    DGCNN's graphs and of normal estimation, against pykdtree, the strongest kNN peer."""
    try:
        from pykdtree.kdtree import KDTree
    except ImportError:
        return []
    rows = []
    for kind in kinds:
        for n in sizes:
            p = cloud(kind, n, 0)
            for k in ks:
                fns = {"pcops": lambda: pcops.knn(p, p, k, validate=False), "pykdtree": lambda: KDTree(p.numpy()).query(p.numpy(), k=k)}
                row = {"bench": "knn_self", "cloud": f"{kind} k={k}", "n_ref": n, "n_query": n,
                       "ms": median_ms(fns, repeats=repeats, budget_s=budget_s, min_s=MIN_S, clock=CLOCK)}
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def run_batched_knn(b: int, n: int, repeats: int, budget_s: float, padded: bool = True) -> list[dict]:
    """``b`` clouds of ``n`` points as one padded batch (queries another cloud each; ``padded``), then ``b``
    clouds of 0.6 n to n points each as one packed batch of self-queries (sample ids sorted, as
    PyTorch Geometric batches them: ``knn_graph``'s and DGCNN's search), against the same
    searches one cloud at a time (pcops, pykdtree)."""
    try:
        search = _pykdtree()
    except ImportError:
        search = None
    rows = []
    if padded:
        clouds = torch.stack([cloud("randn", n, s) for s in range(b)])
        queries = torch.stack([cloud("randn", n, 100 + s) for s in range(b)])
        fns = {
            "pcops": lambda: pcops.knn(queries, clouds, K, validate=False),
            "pcops_loop": lambda: [pcops.knn(queries[i], clouds[i], K, validate=False) for i in range(b)],
        }
        if search is not None:
            fns["pykdtree_loop"] = lambda: [search(queries[i], clouds[i]) for i in range(b)]
        rows.append({"bench": "knn_batched", "cloud": f"{b} x randn", "n_ref": n, "n_query": n,
                     "ms": median_ms(fns, repeats=repeats, budget_s=budget_s, min_s=MIN_S, clock=CLOCK)})
    sizes = torch.randint(int(0.6 * n), n + 1, (b,), generator=torch.Generator().manual_seed(0)).tolist()
    parts = [cloud("randn", size, 200 + s) for s, size in enumerate(sizes)]
    packed, ids = torch.cat(parts), torch.repeat_interleave(torch.arange(b), torch.tensor(sizes))
    fns = {
        "pcops": lambda: pcops.knn(packed, packed, K, query_batch=ids, ref_batch=ids, validate=False),
        "pcops_loop": lambda: [pcops.knn(x, x, K, validate=False) for x in parts],
    }
    if search is not None:
        fns["pykdtree_loop"] = lambda: [search(x, x) for x in parts]
    rows.append({"bench": "knn_batched", "cloud": f"{b} x randn packed", "n_ref": len(packed), "n_query": len(packed),
                 "ms": median_ms(fns, repeats=repeats, budget_s=budget_s, min_s=MIN_S, clock=CLOCK)})
    for row in rows:
        print(format_row(row), flush=True)
    return rows


def run_knn_aggregate(n_ref: int, grid: int, features: int, repeats: int, budget_s: float) -> list[dict]:
    """knn_aggregate's train step (forward + backward to the features) on the tutorial's cloud,
    against a pykdtree search + the same softmax weighting and gather in torch."""
    p, q = cloud("randn", n_ref, 0), grid_queries(grid)
    f = torch.randn(n_ref, features, generator=torch.Generator().manual_seed(2)).requires_grad_()
    sigma = 0.1

    def train():
        out = pcops.knn_aggregate(q, p, f, K, sigma, validate=False)
        out.backward(torch.ones_like(out))

    fns = {"pcops_train": train}
    try:
        search = _pykdtree()

        def peer_train():
            d, i = search(q, p)
            d, i = torch.from_numpy(d), torch.from_numpy(i.astype(np.int64))
            w = torch.softmax(-d / sigma, dim=1)
            out = (w[..., None] * f[i]).sum(1)
            out.backward(torch.ones_like(out))

        fns["pykdtree_torch_train"] = peer_train
    except ImportError:
        pass
    row = {"bench": "knn_aggregate", "cloud": "randn", "n_ref": n_ref, "n_query": q.shape[0],
           "ms": median_ms(fns, repeats=repeats, budget_s=budget_s, min_s=MIN_S, clock=CLOCK)}
    print(format_row(row), flush=True)
    return [row]


def run_radius(n_ref: int, grid: int, features: int, repeats: int, budget_s: float) -> tuple[list[dict], list[str]]:
    notes: list[str] = []
    try:
        forward, backward = numba_radius()
    except ImportError:
        forward = None
        notes.append("numba cell list skipped: numba not installed")
    rows = []
    radius, sigma = 0.1, 0.1
    for kind in ("uniform", "randn"):
        p = cloud(kind, n_ref, 0)
        q = grid_queries(grid)
        f = torch.randn(n_ref, features, generator=torch.Generator().manual_seed(2))
        fg, qg = f.clone().requires_grad_(), q.clone().requires_grad_()
        qn, pn, fn_ = q.numpy(), p.numpy(), f.numpy()
        ones = np.ones((q.shape[0], features), np.float32)
        ones_t = torch.from_numpy(ones)

        def train():  # fresh gradients, as the cell list returns them (and as after zero_grad(set_to_none=True))
            out = pcops.radius_aggregate(qg, p, fg, radius, sigma, validate=False)
            return torch.autograd.grad(out, (qg, fg), ones_t)

        fns = {"pcops_forward": lambda: pcops.radius_aggregate(q, p, f, radius, sigma, validate=False), "pcops_train": train}
        if forward is not None:
            fns["cell_list_forward"] = lambda: forward(qn, pn, fn_, radius, sigma)

            def cell_train():
                out, saved = forward(qn, pn, fn_, radius, sigma)
                backward(qn, radius, sigma, out, saved, ones)

            fns["cell_list_train"] = cell_train
        row = {"bench": "radius_aggregate", "cloud": kind, "n_ref": n_ref, "n_query": q.shape[0],
               "ms": median_ms(fns, repeats=repeats, budget_s=budget_s, min_s=MIN_S, clock=CLOCK)}
        rows.append(row)
        print(format_row(row), flush=True)
    return rows, notes


def format_row(row: dict) -> str:
    ms = row["ms"]
    parts = [f"{name} {t:,.1f}" for name, t in ms.items()]
    return f"{row['bench']:<17} {row['cloud']:<13} n_ref={row['n_ref']:>9,} n_query={row['n_query']:>9,}  ms: " + ", ".join(parts)


def table(rows: list[dict]) -> str:
    """Markdown tables: milliseconds and peer / pcops ratios (> 1: pcops faster)."""
    lines = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        group = [r for r in rows if r["bench"] == bench]
        names = list(dict.fromkeys(name for r in group for name in r["ms"]))
        ours = [x for x in names if x.startswith("pcops")]
        lines += ["", f"{bench}:", "", "| cloud | n_ref | n_query | " + " | ".join(f"{x} ms" for x in names) + " | ratios |",
                  "| --- " * (4 + len(names)) + "|"]
        for r in group:
            if bench == "radius_aggregate":
                pairs = [("cell_list_forward", "pcops_forward"), ("cell_list_train", "pcops_train")]
            elif bench == "knn_batched":
                pairs = [("pcops_loop", "pcops"), ("pykdtree_loop", "pcops")]
            elif bench == "knn_aggregate":
                pairs = [("pykdtree_torch_train", "pcops_train")]
            else:
                pairs = [(x, "pcops") for x in names if x not in ours]
            ratio = ", ".join(f"{a}/{b} {r['ms'][a] / r['ms'][b]:.2f}" for a, b in pairs if a in r["ms"] and b in r["ms"])
            cells = " | ".join(f"{r['ms'][x]:,.1f}" if x in r["ms"] else "-" for x in names)
            lines.append(f"| {r['cloud']} | {r['n_ref']:,} | {r['n_query']:,} | {cells} | {ratio} |")
    return "\n".join(lines)


def run(quick: bool, repeats: int = 7, budget_s: float = 20.0, cpu_time: bool = False) -> tuple[list[dict], list[str]]:
    """All search rows; ``quick`` uses tiny sizes (a smoke test); ``cpu_time`` measures the
    process's CPU time instead of wall time (with OMP_NUM_THREADS=1 and torch.set_num_threads(1)
    for everyone: the work each implementation does, whatever else runs on the machine)."""
    global CLOCK
    CLOCK = time.process_time if cpu_time else time.perf_counter
    if cpu_time:
        torch.set_num_threads(1)
        try:
            import numba

            numba.set_num_threads(1)
        except ImportError:
            pass
    sizes = [2_000] if quick else [10_000, 100_000, 1_000_000]
    grid = 8 if quick else 30
    repeats = 2 if quick else repeats
    rows, notes = run_knn(sizes, ["randn", "uniform", "clustered", "surface", "surface_grid"], grid, repeats, budget_s)
    import bench_meshes

    shapes = ["uniform"] if quick else ["randn", "uniform", "clustered", "surface", *bench_meshes.clouds()]
    rows += run_knn_self([2_000] if quick else [10_000, 100_000], shapes, [16] if quick else [16, 32], repeats, budget_s)
    rows += run_batched_knn(4 if quick else 16, 1_000 if quick else 10_000, repeats, budget_s)
    if not quick:
        rows += run_batched_knn(8, 1_000, repeats, budget_s, padded=False)  # (small packed clouds)
    rows += run_knn_aggregate(2_000 if quick else 100_000, grid, 25, repeats, budget_s)
    radius_rows, radius_notes = [], []
    for n_ref in [2_000] if quick else [25_000, 100_000, 1_000_000]:  # the tutorial's size, then denser clouds
        more_rows, radius_notes = run_radius(n_ref, grid, 25, repeats, budget_s)
        radius_rows += more_rows
    print(table(rows + radius_rows))
    for note in notes + radius_notes:
        print("note:", note)
    return rows + radius_rows, notes + radius_notes
