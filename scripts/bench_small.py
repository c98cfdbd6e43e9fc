"""Small clouds: one cloud per call, 16 to 4,096 points, quiet and next to a busy process.

Run through ``scripts/benchmark.py --only small`` (``--quick``: 16 and 256 points, uniform, quiet).
Each row is one op at one size on one cloud, its ``ms`` the medians of pcops and its peers taken
in turns (``bench_timer.median_ms``), all on the same threads (torch's default, pykdtree's and
Open3D's OpenMP, cKDTree's ``workers=-1``), pcops called as a user writes it (``validate`` on).
Clouds: ``uniform`` in [-1, 1]^3 and ``mesh:airplane`` (pyvista's airplane sampled as a scan,
scripts/bench_meshes.py). Radii follow the cloud: ``r`` is the median distance to the 16th
nearest neighbour, so a ball holds about 16 points (32 at most are kept).

Ops and peers (each peer computes the same answer from the same numpy / torch inputs):

* ``knn`` (self-query, k = 4 at 16 points, 8 at 256, 16 above): pykdtree, cKDTree, Open3D's
  ``knn_search``, torch ``cdist`` + ``topk``;
* ``knn_aggregate`` (mean of the k neighbours' 32 features): pykdtree / torch search + torch gather;
* ``ball_query`` (K = 32 within r) and ``ball_queries`` (r/2 with K = 16 and r with K = 32):
  cKDTree ``query(k=K, distance_upper_bound=r)`` (the K closest within r), Open3D's
  ``hybrid_search``, torch ``cdist`` + ``topk`` + a mask;
* ``radius_aggregate`` (mean of every neighbour's 32 features within r, uncapped): cKDTree's
  ``sparse_distance_matrix`` pairs + torch ``index_add``, and torch ``(cdist <= r) @ features``;
* ``knn_graph`` (k = 16) and ``radius_graph`` (r, at most 32 neighbours): pykdtree / cKDTree /
  Open3D / torch, as edge lists;
* ``farthest_point_sample`` (n / 4 picks from point 0, their points and indices): fpsample's
  ``bucket_fps_kdline_sampling`` (its fastest exact variant, h = 3) and ``fps_sampling``, each
  returning indices, with the picked points gathered from them (NumPy; the bucket variant takes
  ``start_idx`` in its kd-tree's order, so it starts at another point: the same work), and
  Open3D's ``farthest_point_down_sample`` (the picked points only: it has no indices to return);
* ``chamfer_distance`` (two clouds of n, squared distances, mean both ways): pykdtree both ways,
  torch ``cdist`` + ``min``;
* ``estimate_normals`` (k = 16): Open3D's ``estimate_normals`` (KNN 16), torch ``cdist`` +
  ``topk`` + covariance + ``eigh``;
* ``knn_interpolate`` (n queries, n / 4 reference points with 32 features, k = 3, inverse
  squared distance): pykdtree / torch search + torch weights;
* ``mesh_distance`` (unsigned, 10^3 and 10^4 queries around pyvista's airplane, the hierarchy
  built in the call): Open3D's ``RaycastingScene`` (scene built in the call) ``compute_distance``.

``uniform, 60 sizes``: the ops above on uniform clouds of 60 sizes about 256 and 1,024 points
(226-285, 994-1,053), each call taking the next cloud of the cycle (a dataset of scans of varying
sizes): what a library keeps per shape must hold them all or cost nothing where it does not.
``uniform, new sizes``: the same cycle, with pcops keeping few objects during its calls
(:func:`_stream`), so that no size finds what was kept for it, as in a stream of scans of more
distinct sizes than pcops keeps (thousands of them): the cost of a size seen once.

``neighbour``: ``quiet``, or ``busy`` with one other process spinning a core (a DataLoader
worker, a second job), or ``quiet, paired``: the busy row's quiet twin from the same turns. The
busy rows (uniform clouds and ``mesh_distance``) are each timed in ``PAIRED_TURNS`` turns of a
quiet block and a busy block (the spinning process kept, stopped between its blocks, ``SETTLE``
seconds after each switch: pcops reads the machine's load over a quarter of a second), in the
order quiet, busy, then busy, quiet, so that a drift of the machine's speed falls on both
alike; each figure is the mean of its blocks' medians. The ratio of a busy row to its paired
quiet row is what a shared machine costs each library. Peers are imported lazily; a missing
one leaves its column out.
"""

from __future__ import annotations

import importlib
import itertools
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import bench_search
import pcops
from bench_timer import median_ms

SIZES = (16, 256, 1024, 4096)
QUICK_SIZES = (16, 256)
CLOUDS = ("uniform", "mesh:airplane")
BALL_K = 32
FEATURES = 32
MESH_QUERIES = (1_000, 10_000)
IN_TURN, IN_TURN_SIZES = 60, (256, 1024)  # clouds of 60 sizes in turn, about 256 and 1,024 points
PAIRED_TURNS = 2  # turns of a quiet and a busy block per busy row
SETTLE = 0.4  # seconds after the spinning process starts or stops, before a block (pcops._threads.WINDOW: 0.25)


def _k(n: int) -> int:
    return 4 if n <= 16 else 8 if n <= 256 else 16


def _lib(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class _Spinner:
    """One other process spinning a core, stopped (SIGSTOP) except in the busy blocks."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        self.proc.send_signal(signal.SIGSTOP)

    def set(self, busy: bool) -> None:
        self.proc.send_signal(signal.SIGCONT if busy else signal.SIGSTOP)
        time.sleep(SETTLE)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _paired(fns: dict, spin: _Spinner, timer: dict) -> dict:
    """{"quiet, paired": ms, "busy": ms}: ``fns`` timed in PAIRED_TURNS turns of a quiet and a busy
    block (quiet first, then busy first), each figure the mean of its blocks' medians."""
    blocks = {"quiet, paired": [], "busy": []}
    for turn in range(PAIRED_TURNS):
        for kind in ("quiet, paired", "busy") if turn % 2 == 0 else ("busy", "quiet, paired"):
            spin.set(kind == "busy")
            blocks[kind].append(median_ms(fns, **timer))
    spin.set(False)
    return {kind: {name: statistics.fmean(b[name] for b in got) for name in got[0]} for kind, got in blocks.items()}


def _dense_knn(a: torch.Tensor, b: torch.Tensor, k: int):
    return torch.cdist(a, b).topk(min(k, b.shape[0]), dim=1, largest=False)


def _dense_ball(a: torch.Tensor, b: torch.Tensor, r: float, k: int):
    d, idx = _dense_knn(a, b, k)
    inside = d <= r
    return torch.where(inside, d, float("inf")), torch.where(inside, idx, -1)


def _ckdtree_ball(x: np.ndarray, r: float, k: int):
    from scipy.spatial import cKDTree

    return cKDTree(x).query(x, k=min(k, len(x)), distance_upper_bound=r, workers=-1)


def _o3d_index(x: np.ndarray, kind: str, radius: float = 0.0):
    o3c = importlib.import_module("open3d.core")
    index = o3c.nns.NearestNeighborSearch(o3c.Tensor(x))
    index.knn_index() if kind == "knn" else index.hybrid_index(radius)
    return index, o3c.Tensor(x)


def _gather_mean(f: torch.Tensor, idx) -> torch.Tensor:
    return f[torch.as_tensor(np.asarray(idx), dtype=torch.int64)].mean(1)


def _cases(p: torch.Tensor, n: int, r: float, gen: torch.Generator, k: int = 0) -> dict:
    """{op: {name: function}} of pcops and its importable peers on the cloud ``p`` of n points
    (``k``: the kNN rows' k, else the size's)."""
    x = p.numpy()
    f = torch.randn(n, FEATURES, generator=gen)
    k, kk = k or _k(n), min(16, n - 1) if n > 1 else 1
    pykd = getattr(_lib("pykdtree.kdtree"), "KDTree", None)
    ckd = getattr(_lib("scipy.spatial"), "cKDTree", None)
    o3d = _lib("open3d")
    fps = _lib("fpsample")
    out = {}

    knn = out["knn"] = {"pcops": lambda: pcops.knn(p, p, k), "torch_cdist_topk": lambda: _dense_knn(p, p, k)}
    if pykd is not None:
        knn["pykdtree"] = lambda: pykd(x).query(x, k=k)
    if ckd is not None:
        knn["cKDTree"] = lambda: ckd(x).query(x, k=k, workers=-1)
    if o3d is not None:
        knn["open3d"] = lambda: (lambda i, t: i.knn_search(t, k))(*_o3d_index(x, "knn"))

    agg = out["knn_aggregate"] = {"pcops": lambda: pcops.knn_aggregate(p, p, f, k, weights="uniform"),
                                  "torch_cdist_topk": lambda: f[_dense_knn(p, p, k).indices].mean(1)}
    if pykd is not None:
        agg["pykdtree"] = lambda: _gather_mean(f, pykd(x).query(x, k=k)[1].astype(np.int64).reshape(n, k))

    ball = out["ball_query"] = {"pcops": lambda: pcops.ball_query(p, p, r, BALL_K), "torch_cdist_topk": lambda: _dense_ball(p, p, r, BALL_K)}
    if ckd is not None:
        ball["cKDTree"] = lambda: _ckdtree_ball(x, r, BALL_K)
    if o3d is not None:
        ball["open3d"] = lambda: (lambda i, t: i.hybrid_search(t, r, BALL_K))(*_o3d_index(x, "hybrid", r))

    radii, caps = (r / 2, r), (BALL_K // 2, BALL_K)
    balls = out["ball_queries"] = {"pcops": lambda: pcops.ball_queries(p, p, radii, caps)}

    def dense_balls():
        d, idx = _dense_knn(p, p, BALL_K)
        return [(torch.where(d[:, :c] <= rr, d[:, :c], float("inf")), torch.where(d[:, :c] <= rr, idx[:, :c], -1)) for rr, c in zip(radii, caps)]

    balls["torch_cdist_topk"] = dense_balls
    if ckd is not None:
        def ckd_balls():  # one query for the larger ball; the smaller one is its prefix (sorted)
            d, idx = _ckdtree_ball(x, r, BALL_K)
            inside = d[:, :caps[0]] <= radii[0]
            return (d, idx), (np.where(inside, d[:, :caps[0]], np.inf), np.where(inside, idx[:, :caps[0]], len(x)))

        balls["cKDTree"] = ckd_balls
    if o3d is not None:
        def o3d_balls():
            index, t = _o3d_index(x, "hybrid", r)
            return [index.hybrid_search(t, rr, c) for rr, c in zip(radii, caps)]

        balls["open3d"] = o3d_balls

    rad = out["radius_aggregate"] = {"pcops": lambda: pcops.radius_aggregate(p, p, f, r, weights="uniform")}

    def dense_radius():
        inside = (torch.cdist(p, p) <= r).to(f.dtype)
        return (inside @ f) / inside.sum(1, keepdim=True)

    rad["torch_cdist_matmul"] = dense_radius
    if ckd is not None:
        def ckd_radius():
            tree = ckd(x)
            pairs = tree.sparse_distance_matrix(tree, r, output_type="ndarray")
            i, j = torch.from_numpy(pairs["i"].astype(np.int64)), torch.from_numpy(pairs["j"].astype(np.int64))
            if len(i) and not bool((i == j).any()):  # (scipy's ndarray output holds the self pairs, d = 0; a sparse format drops them)
                i, j = torch.cat([i, torch.arange(n)]), torch.cat([j, torch.arange(n)])
            total = torch.zeros(n, FEATURES).index_add_(0, i, f[j])
            return total / torch.zeros(n).index_add_(0, i, torch.ones(len(i)))[:, None]

        rad["cKDTree"] = ckd_radius

    kg = out["knn_graph"] = {"pcops": lambda: pcops.knn_graph(p, kk)}
    rows = torch.arange(n).repeat_interleave(kk)
    kg["torch_cdist_topk"] = lambda: torch.stack([_dense_knn(p, p, kk + 1).indices[:, 1:].reshape(-1), rows])
    if pykd is not None:
        kg["pykdtree"] = lambda: np.stack([pykd(x).query(x, k=kk + 1)[1][:, 1:].reshape(-1), rows.numpy()])
    if o3d is not None:
        def o3d_knn_graph():
            index, t = _o3d_index(x, "knn")
            return np.stack([index.knn_search(t, kk + 1)[0].numpy()[:, 1:].reshape(-1), rows.numpy()])

        kg["open3d"] = o3d_knn_graph

    rg = out["radius_graph"] = {"pcops": lambda: pcops.radius_graph(p, r, max_neighbors=BALL_K)}

    def dense_radius_graph():
        d, idx = _dense_knn(p, p, BALL_K + 1)
        keep = (d[:, 1:] <= r) & (idx[:, 1:] >= 0)
        return torch.stack([idx[:, 1:][keep], torch.arange(n)[:, None].expand_as(keep)[keep]])

    rg["torch_cdist_topk"] = dense_radius_graph
    if ckd is not None:
        def ckd_radius_graph():
            d, idx = _ckdtree_ball(x, r, BALL_K + 1)
            keep = np.isfinite(d[:, 1:])
            return np.stack([idx[:, 1:][keep], np.broadcast_to(np.arange(n)[:, None], keep.shape)[keep]])

        rg["cKDTree"] = ckd_radius_graph

    s = max(n // 4, 1)
    fp = out["farthest_point_sample"] = {"pcops": lambda: pcops.farthest_point_sample(p, s, start_idx=0)}
    if fps is not None:
        picked = lambda idx: (x[idx], idx)  # noqa: E731 (the op's answer: the picked points and their indices)
        fp["fpsample_bucket_kdline"] = lambda: picked(fps.bucket_fps_kdline_sampling(x, s, h=3, start_idx=0))
        fp["fpsample_vanilla"] = lambda: picked(fps.fps_sampling(x, s, start_idx=0))
    if o3d is not None:
        def o3d_fps():
            cloud = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(x.astype(np.float64)))
            return cloud.farthest_point_down_sample(s)

        fp["open3d"] = o3d_fps

    y = p[torch.randperm(n, generator=gen)] + 0.01 * torch.randn(n, 3, generator=gen)
    yx = y.numpy()
    ch = out["chamfer_distance"] = {"pcops": lambda: pcops.chamfer_distance(p[None], y[None])}

    def dense_chamfer():
        d = torch.cdist(p, y).square_()
        return d.min(1).values.mean() + d.min(0).values.mean()

    ch["torch_cdist_min"] = dense_chamfer
    if pykd is not None:
        ch["pykdtree"] = lambda: float(np.mean(pykd(yx).query(x, k=1)[0] ** 2) + np.mean(pykd(x).query(yx, k=1)[0] ** 2))

    nm = out["estimate_normals"] = {"pcops": lambda: pcops.estimate_normals(p, kk)}

    def dense_normals():
        nb = p[_dense_knn(p, p, kk).indices]
        centred = nb - nb.mean(1, keepdim=True)
        return torch.linalg.eigh(centred.transpose(1, 2) @ centred).eigenvectors[..., 0]

    nm["torch_cdist_eigh"] = dense_normals
    if o3d is not None:
        def o3d_normals():
            cloud = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(x.astype(np.float64)))
            cloud.estimate_normals(o3d.geometry.KDTreeSearchParamKNN(kk), fast_normal_computation=False)
            return np.asarray(cloud.normals)

        nm["open3d"] = o3d_normals

    m = max(n // 4, 3)
    ref, rf = p[:m], f[:m]
    refx = ref.numpy()
    ip = out["knn_interpolate"] = {"pcops": lambda: pcops.knn_interpolate(p, ref, rf, 3)}

    def weighted(d2: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        w = 1.0 / d2.clamp_min(1e-16)
        return (rf[idx] * w[..., None]).sum(1) / w.sum(1, keepdim=True)

    ip["torch_cdist_topk"] = lambda: (lambda d, i: weighted(d.square(), i))(*_dense_knn(p, ref, 3))
    if pykd is not None:
        ip["pykdtree"] = lambda: (lambda d, i: weighted(torch.from_numpy(d).square(), torch.from_numpy(i.astype(np.int64))))(*pykd(refx).query(x, k=3))
    return out


def _mesh_cases(queries: int, gen: torch.Generator) -> dict:
    import bench_meshes

    if "airplane" not in bench_meshes.available():
        return {}
    mesh = bench_meshes.mesh("airplane")
    v = torch.tensor(np.asarray(mesh.vertices), dtype=torch.float32)
    faces = torch.tensor(np.asarray(mesh.faces), dtype=torch.int64)
    lo, hi = v.amin(0), v.amax(0)
    q = lo - 0.1 * (hi - lo) + 1.2 * (hi - lo) * torch.rand(queries, 3, generator=gen)
    fns = {"pcops": lambda: pcops.mesh_distance(q, v, faces)}
    o3d = _lib("open3d")
    if o3d is not None:
        o3c = o3d.core

        def scene_distance():
            scene = o3d.t.geometry.RaycastingScene()
            scene.add_triangles(o3c.Tensor(v.numpy()), o3c.Tensor(faces.numpy().astype(np.uint32)))
            return scene.compute_distance(o3c.Tensor(q.numpy()))

        fns["open3d"] = scene_distance
    return fns


def _in_turn(n: int, sizes: int) -> dict:
    """{op: {name: function}} of :func:`_cases` over uniform clouds of ``sizes`` sizes about n
    (n - sizes / 2 .. n + sizes / 2 - 1 points), each function taking the next cloud of the cycle
    at every call: a stream of clouds of varying sizes, each size seen again ``sizes`` calls later
    (each function run over the cycle twice before it is timed)."""
    cases = []
    for size in range(n - sizes // 2, n - sizes // 2 + sizes):
        p = bench_search.cloud("uniform", size, size)
        cases.append(_cases(p, size, _radius16(p), torch.Generator().manual_seed(size), k=_k(n)))

    def cycle(fns: list):
        turn = itertools.cycle(fns)
        return lambda: next(turn)()

    out = {op: {name: cycle([case[op][name] for case in cases]) for name in fns} for op, fns in cases[0].items()}
    for fns in out.values():  # (two passes first: what a library keeps per shape is made, as an epoch's first calls make it)
        for fn in fns.values():
            for _ in range(2 * sizes):
                fn()
    return out


STREAM_KEEP = 16  # kept objects of pcops' calls in a ``new sizes`` row (:func:`_stream`)


def _stream(fn):
    """``fn`` with pcops' kept objects (``pcops._warp.KEPT``) limited to :data:`STREAM_KEEP` during
    its calls: with the row's 60 sizes in turn, no object kept for one size is kept again, as in a
    stream of more distinct sizes than pcops keeps (thousands of scans of their own sizes), while
    what serves a range of sizes, used at nearly every call, stays kept, as in such a stream."""
    kept = pcops._warp.Kept(STREAM_KEEP, pcops._warp.KEEP_BYTES)

    def call():
        saved = pcops._warp.KEPT
        pcops._warp.KEPT = kept
        try:
            return fn()
        finally:
            pcops._warp.KEPT = saved

    return call


def _radius16(p: torch.Tensor) -> float:
    """The median distance to the 16th nearest neighbour (self excluded) of the cloud ``p``."""
    k = min(17, p.shape[0])
    return float(torch.cdist(p.double(), p.double()).topk(k, dim=1, largest=False).values[:, -1].median())


def run(quick: bool = False) -> list[dict]:
    rows = []
    sizes = QUICK_SIZES if quick else SIZES
    timer = dict(repeats=2 if quick else 11, budget_s=0.5 if quick else 4.0, min_s=0.0 if quick else 0.3)

    def record(op, cloud, n, neighbour, ms):
        rows.append({"bench": op, "cloud": cloud, "points": n, "neighbour": neighbour, "ms": ms})
        print(f"small {op:22s} {cloud:14s} n={n:5d} {neighbour:13s} " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items()), flush=True)

    def cases(cloud, n):
        gen = torch.Generator().manual_seed(n)
        p = bench_search.cloud(cloud, n, 0)
        return _cases(p, n, _radius16(p), gen).items()

    for cloud in ("uniform",) if quick else CLOUDS:
        for n in sizes:
            for op, fns in cases(cloud, n):
                record(op, cloud, n, "quiet", median_ms(fns, **timer))
    for n in IN_TURN_SIZES[:1] if quick else IN_TURN_SIZES:
        table = _in_turn(n, IN_TURN)
        for op, fns in table.items():
            record(op, f"uniform, {IN_TURN} sizes", n, "quiet", median_ms(fns, **timer))
        for op, fns in table.items():
            record(op, "uniform, new sizes", n, "quiet", median_ms({**fns, "pcops": _stream(fns["pcops"])}, **timer))
    for queries in MESH_QUERIES[:1] if quick else MESH_QUERIES:
        fns = _mesh_cases(queries, torch.Generator().manual_seed(queries))
        if fns:
            record("mesh_distance", "mesh:airplane", queries, "quiet", median_ms(fns, **timer))
    if quick:
        return rows
    spin = _Spinner()
    try:
        block = dict(timer, budget_s=timer["budget_s"] / 2)
        for n in sizes:
            for op, fns in cases("uniform", n):
                for neighbour, ms in _paired(fns, spin, block).items():
                    record(op, "uniform", n, neighbour, ms)
        for queries in MESH_QUERIES:
            fns = _mesh_cases(queries, torch.Generator().manual_seed(queries))
            if fns:
                for neighbour, ms in _paired(fns, spin, block).items():
                    record("mesh_distance", "mesh:airplane", queries, neighbour, ms)
    finally:
        spin.close()
    return rows
