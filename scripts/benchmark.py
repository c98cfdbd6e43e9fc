"""Benchmarks: the PhysicsNeMo tutorial's two models, the bare ops against their strongest peers,
and how cost grows with size. Ratios are what to read: every figure of a run comes from one
machine in one process.

    python scripts/benchmark.py                  # tutorial sizes: models + bare ops
    python scripts/benchmark.py --sweep          # 10^4 .. 10^6 points, time and peak memory
    python scripts/benchmark.py --quick          # everything at small sizes (a smoke test)
    python scripts/benchmark.py --json out.json  # also write every figure as JSON
    python scripts/benchmark.py --search         # only the CPU search rows (kNN, radius) against peers
    python scripts/benchmark.py --only sampling  # only some sections: search, models, geometry, sampling, networks, sparse, transformer, mesh, transport
    OMP_NUM_THREADS=1 python scripts/benchmark.py --search --cpu-time   # their work, on a busy machine

Variants: ``torch_eager`` / ``torch_compiled`` (the tutorial's dense torch references, run in
query chunks when the dense matrices would not fit: noted "chunked"), ``scipy_torch``
(cKDTree search + torch gather / index_add aggregation), ``pcops_eager``, ``pcops_compiled``
(``torch.compile(fullgraph=True)``), and on CUDA ``pcops_rmm`` (in a fresh process with
``pcops.memory.use_rmm_pool()``). Times are medians after a warm-up (scripts/bench_timer.py,
the one timer of every section): forward without gradients, and a full train step (forward,
backward, optimizer step). Peak memory: growth of
the resident set (CPU) or ``pcops.memory.max_memory_allocated`` (CUDA: torch's peak, or the RMM
pool's peak from RMM's statistics in the ``pcops_rmm`` child). Speed-up lines compare rows of
the same model and sizes only. The bare ops' inputs come from the op table's builders
(``tests/op_table.py``: the tests' own inputs at the benchmark's sizes and cloud shapes), and
each peer is timed on the same tensors as pcops.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
from typing import NamedTuple, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import bench_meshes  # noqa: E402
import bench_search  # noqa: E402
import bench_small  # noqa: E402
import bench_grouping  # noqa: E402
import bench_features  # noqa: E402
import bench_transformer  # noqa: E402
import bench_sparse  # noqa: E402
import bench_mesh  # noqa: E402
import bench_compile  # noqa: E402
import bench_transport  # noqa: E402
from bench_timer import median_ms, speed  # noqa: E402  the one timer, and its ratios in words
import pcops  # noqa: E402
import pcops.memory  # noqa: E402
from models.nets import Projector, knn_projector, radius_projector  # noqa: E402
from models.shapes import grid as grid_points  # noqa: E402
from tests.op_table import BY_NAME  # noqa: E402  the tests' input builders (bench_* below use them too)

CHUNK = 2048  # query rows per chunk of the dense references
COMPILE_BACKEND = "inductor"  # --quick uses "aot_eager": same tracing (fullgraph, fakes, autograd), no codegen


# ----------------------------------------------------------------------------------------------
# References: the tutorial's dense torch operators, and the scipy + torch peers


def _dense_knn_chunk(q, p, f, k: int, sigma: float):
    with torch.no_grad():
        idx = torch.cdist(q, p).topk(k, dim=1, largest=False).indices  # the tutorial's search
    d = (q[:, None, :] - p[idx]).norm(dim=-1)
    w = torch.softmax(-d / sigma, dim=1)
    return (w[..., None] * f[idx]).sum(1)


def _dense_radius_chunk(q, p, f, radius: float, sigma: float):
    d = torch.cdist(q, p)
    logits = torch.where(d <= radius, -d / sigma, float("-inf"))
    w = torch.nan_to_num(torch.softmax(logits, dim=1))  # rows without neighbours: 0
    return w @ f


class DenseAggregation(nn.Module):
    """The tutorial's dense reference, run over query chunks (each chunk checkpointed in training)."""

    def __init__(self, chunk_fn, compiled: bool, **kwargs):
        super().__init__()
        self.fn = torch.compile(chunk_fn, dynamic=False, backend=COMPILE_BACKEND) if compiled else chunk_fn
        self.kwargs = kwargs

    def forward(self, query, ref, features):
        outs = []
        for b in range(query.shape[0]):
            rows = []
            for s in range(0, query.shape[1], CHUNK):
                args = (query[b, s : s + CHUNK], ref[b], features[b])
                if torch.is_grad_enabled():
                    rows.append(torch.utils.checkpoint.checkpoint(self.fn, *args, use_reentrant=False, **self.kwargs))
                else:
                    rows.append(self.fn(*args, **self.kwargs))
            outs.append(torch.cat(rows))
        return torch.stack(outs)


def scipy_knn_aggregate(query, ref, features, k: int, sigma: float):
    """cKDTree.query (all cores) + torch gather and softmax: the CPU peer of knn_aggregate."""
    from scipy.spatial import cKDTree

    _, idx = cKDTree(ref.detach().numpy()).query(query.detach().numpy(), k=k, workers=-1)
    idx = torch.from_numpy(np.asarray(idx, dtype=np.int64).reshape(query.shape[0], k))
    d = (query[:, None, :] - ref[idx]).norm(dim=-1)
    w = torch.softmax(-d / sigma, dim=1)
    return (w[..., None] * features[idx]).sum(1)


def scipy_radius_aggregate(query, ref, features, radius: float, sigma: float):
    """cKDTree.query_ball_point (all cores) + torch index_add: the CPU peer of radius_aggregate."""
    from scipy.spatial import cKDTree

    lists = cKDTree(ref.detach().numpy()).query_ball_point(query.detach().numpy(), radius, workers=-1)
    counts = torch.tensor([len(x) for x in lists])
    rows = torch.repeat_interleave(torch.arange(query.shape[0]), counts)
    cols = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]) if len(lists) else np.zeros(0, np.int64))
    d = (query[rows] - ref[cols]).norm(dim=-1)
    shift = torch.full((query.shape[0],), float("inf")).scatter_reduce(0, rows, d.detach(), "amin")
    w = torch.exp(-(d - shift[rows]) / sigma)
    total = torch.zeros(query.shape[0], dtype=w.dtype).index_add(0, rows, w)
    out = torch.zeros(query.shape[0], features.shape[1], dtype=features.dtype).index_add(0, rows, w[:, None] * features[cols])
    return out / total.clamp_min(1e-30)[:, None]


class ScipyAggregation(nn.Module):
    def __init__(self, fn, *args):
        super().__init__()
        self.fn, self.args = fn, args

    def forward(self, query, ref, features):
        return torch.stack([self.fn(query[b], ref[b], features[b], *self.args) for b in range(query.shape[0])])


# ----------------------------------------------------------------------------------------------
# Measurement


def _rss_mb() -> float | None:
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _reset_peak(device) -> float | None:
    if device.type == "cuda":
        pcops.memory.reset_peak_memory_stats(device)  # RMM's statistics under the pool, else torch's
        return None
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    return _rss_mb()


def _peak_mb(device, base) -> float | None:
    if device.type == "cuda":
        return pcops.memory.max_memory_allocated(device) / 2**20
    now = _rss_mb()
    return None if now is None or base is None else max(now - base, 0.0)


def _steps(net: nn.Module, inputs: tuple):
    """(forward, step) of a network: the forward without gradients, and a train step (an MSE
    loss against zeros, its backward and an Adam step)."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4) if params else None
    target = None

    def forward():
        with torch.no_grad():
            return net(*inputs)

    def step():
        nonlocal target
        out = net(*inputs)
        if target is None:
            target = torch.zeros_like(out)
        loss = (out - target).square().mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return forward, step


def measure(net: nn.Module, inputs: tuple, device, iters: int, budget_s: float) -> dict:
    """forward_ms (no grad), train_step_ms (Adam step on an MSE loss), peak_mem_mb."""
    forward, step = _steps(net.to(device), inputs)
    base = _reset_peak(device)
    fwd = median_ms(forward, repeats=iters, budget_s=budget_s, device=device)
    train = median_ms(step, repeats=iters, budget_s=budget_s, device=device)
    return {"forward_ms": round(fwd, 3), "train_step_ms": round(train, 3), "peak_mem_mb": _peak_mb(device, base)}


def measured(row: dict, fields: tuple, figures, peer: bool) -> dict:
    """``row`` updated with ``figures()`` (a dict of its timings), or, when they cannot be had, with
    None for each of ``fields`` and a note: "skipped: ..." (a peer not installed), "out of memory
    (...)", or "failed: <the error's first line>" when a peer's call raises a RuntimeError on this
    device (torch's batched eigh on CUDA raised a cuSOLVER error). pcops' own RuntimeErrors are
    raised: the benchmark does not hide a failing op. The rows of the models, bare ops,
    geometry and sampling sections go through here."""
    try:
        row.update(figures())
    except (torch.OutOfMemoryError, MemoryError) as err:  # before RuntimeError: torch's is one
        row.update(dict.fromkeys(fields), note=f"out of memory ({type(err).__name__})")
    except ImportError as err:
        row.update(dict.fromkeys(fields), note=f"skipped: {err}")
    except RuntimeError as err:
        if not peer:
            raise
        row.update(dict.fromkeys(fields), note=f"failed: {(str(err).strip().splitlines() or [type(err).__name__])[0]}")
    return row


class _OpNet(nn.Module):
    """A bare op as a module with features as its parameter (so a train step has gradients)."""

    def __init__(self, fn, features):
        super().__init__()
        self.features = nn.Parameter(features.clone())
        self.fn = fn

    def forward(self, query, ref):
        return self.fn(query, ref, self.features)


# ----------------------------------------------------------------------------------------------
# Inputs: the op table's builders (tests/op_table.py), as the tests build them


def shaped(kind: str):
    """A ``cloud`` option of the table's builders: (generator, n) -> n float32 points of the
    ``bench_search.cloud`` shape ``kind``, each draw seeded from the generator."""
    return lambda g, n: bench_search.cloud(kind, n, int(torch.randint(0, 2**31 - 1, (), generator=g)))


def op_inputs(op: str, seed: int, n: int, device, cloud=None, **options) -> dict:
    """float32 inputs of the table's row ``op`` with ``n`` points on ``device``: coordinates of
    the ``bench_search.cloud`` shape ``cloud`` (a name), drawn by ``cloud`` (a function), or in
    the table's unit cube (None). pcops and its peers are timed on these same tensors."""
    draw = shaped(cloud) if isinstance(cloud, str) else cloud
    made = BY_NAME[op].inputs(seed, n=n, dtype=torch.float32, cloud=draw, **options)
    return {name: t.to(device) for name, t in made.items()}


def _box(g, n: int) -> torch.Tensor:
    """n points uniform in [-1, 1]^3 (the tutorial's box)."""
    return torch.rand(n, 3, generator=g) * 2 - 1


# ----------------------------------------------------------------------------------------------
# Suites


def tutorial_inputs(n_ref: int, grid: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    points = (torch.rand(1, n_ref, 3, generator=gen) * 2 - 1).to(device)
    queries = grid_points(grid)[None].to(device)
    return points, queries


def model_variants(kind: str, device, hidden: int):
    """(variant, network, note) for the kNN or radius projector."""
    if kind == "knn_projector":
        agg = dict(chunk_fn=_dense_knn_chunk, k=7, sigma=0.1)
        make_pcops = lambda: knn_projector(7, 0.1, hidden)  # noqa: E731
        peer = lambda: Projector(ScipyAggregation(scipy_knn_aggregate, 7, 0.1), hidden)  # noqa: E731
    else:
        agg = dict(chunk_fn=_dense_radius_chunk, radius=0.1, sigma=0.1)
        make_pcops = lambda: radius_projector(0.1, 0.1, hidden)  # noqa: E731
        peer = lambda: Projector(ScipyAggregation(scipy_radius_aggregate, 0.1, 0.1), hidden)  # noqa: E731
    torch.manual_seed(0)
    yield "torch_eager", Projector(DenseAggregation(compiled=False, **agg), hidden), "chunked"
    torch.manual_seed(0)
    yield "torch_compiled", Projector(DenseAggregation(compiled=True, **agg), hidden), "chunked, each chunk compiled"
    if device.type == "cpu":
        torch.manual_seed(0)
        yield "scipy_torch", peer(), ""
    torch.manual_seed(0)
    yield "pcops_eager", make_pcops(), ""
    torch.manual_seed(0)
    yield "pcops_compiled", torch.compile(make_pcops(), fullgraph=True, backend=COMPILE_BACKEND), ""


def run_models(args, device) -> list[dict]:
    sizes = {"knn_projector": (args.knn_points, args.grid), "radius_projector": (args.radius_points, args.grid)}
    results = []
    for kind, (n_ref, grid) in sizes.items():
        points, queries = tutorial_inputs(n_ref, grid, device)
        ours = {}  # the pcops variants: timed again, taking turns (eager against compiled)
        for variant, net, note in model_variants(kind, device, args.hidden):
            row = {"model": kind, "variant": variant, "n_ref": n_ref, "n_query": queries.shape[1], "note": note}
            mine = variant.startswith("pcops")
            measured(row, ("forward_ms", "train_step_ms", "peak_mem_mb"),
                     lambda net=net: measure(net, (points, queries), device, args.iters, args.budget), peer=not mine)
            if mine and row["forward_ms"] is not None:
                ours[variant] = row, _steps(net, (points, queries))
            results.append(row)
            if variant not in ours:
                print(_format(row), flush=True)
        if ours:  # timed one after the other, compiled / eager moved by up to 20% (quiet 2-core machine)
            for key, index in (("forward_ms", 0), ("train_step_ms", 1)):
                ms = median_ms({v: fns[index] for v, (_, fns) in ours.items()}, repeats=2 * args.iters, budget_s=args.budget, device=device)
                for variant, (row, _) in ours.items():
                    row[key] = round(ms[variant], 3)
            for row, _ in ours.values():
                row["note"] = "; ".join(filter(None, [row["note"], "times: the pcops variants taking turns"]))
                print(_format(row), flush=True)
    if device.type == "cuda":
        results += run_rmm_variant(args)
    return results


def run_rmm_variant(args) -> list[dict]:
    """pcops under the RMM pool, in a fresh process (the pool must precede CUDA's initialisation)."""
    try:
        import rmm  # noqa: F401
    except ImportError:
        return [{"model": m, "variant": "pcops_rmm", "note": "skipped: rmm not installed"} for m in ("knn_projector", "radius_projector")]
    out = pathlib.Path(f"/tmp/pcops_rmm_{os.getpid()}.json")
    cmd = [sys.executable, __file__, "--rmm-child", "--json", str(out), "--iters", str(args.iters),
           "--knn-points", str(args.knn_points), "--radius-points", str(args.radius_points), "--grid", str(args.grid),
           "--hidden", str(args.hidden), "--budget", str(args.budget)]
    subprocess.run(cmd, check=True)
    rows = json.loads(out.read_text())["results"]
    for row in rows:  # printed too: a log without the JSON keeps them
        print(_format(row), flush=True)
    return rows


def rmm_child(args) -> None:
    pcops.memory.use_rmm_pool()
    device = torch.device("cuda")
    results = []
    for kind, n_ref in (("knn_projector", args.knn_points), ("radius_projector", args.radius_points)):
        points, queries = tutorial_inputs(n_ref, args.grid, device)
        net = knn_projector(7, 0.1, args.hidden) if kind == "knn_projector" else radius_projector(0.1, 0.1, args.hidden)
        row = {"model": kind, "variant": "pcops_rmm", "n_ref": n_ref, "n_query": queries.shape[1], "note": "RMM pool"}
        row.update(measure(torch.compile(net, fullgraph=True), (points, queries), device, args.iters, args.budget))
        results.append(row)
    pathlib.Path(args.json).write_text(json.dumps({"results": results}))


def run_ops(args, device, sizes=None, sweep: bool = False) -> list[dict]:
    """Bare ops, forward and backward (features get gradients), pcops against scipy + torch."""
    results = []
    f = 16
    cases = sizes or [("knn_aggregate", args.knn_points, args.grid**3), ("radius_aggregate", args.radius_points, args.grid**3)]
    for op, n_ref, n_query in cases:
        made = op_inputs(op, 1, n_ref, device, cloud=_box, n_query=n_query, channels=f)
        query, ref, features = made["query"], made["ref"], made["features"]
        # radius: about 13 neighbours per query at any size (the tutorial's density at 25,000 points)
        radius = 0.1 * (25_000 / n_ref) ** (1 / 3)
        if op == "knn_aggregate":
            ours = lambda q, p, x: pcops.knn_aggregate(q, p, x, 7, 0.1, validate=False)  # noqa: E731
            peer = lambda q, p, x: scipy_knn_aggregate(q, p, x, 7, 0.1)  # noqa: E731
        else:
            ours = lambda q, p, x, r=radius: pcops.radius_aggregate(q, p, x, r, 0.1, validate=False)  # noqa: E731
            peer = lambda q, p, x, r=radius: scipy_radius_aggregate(q, p, x, r, 0.1)  # noqa: E731
        variants = [("pcops_eager", ours)] + ([("scipy_torch", peer)] if device.type == "cpu" else [])
        for variant, fn in variants:
            row = {"model": op, "variant": variant, "n_ref": n_ref, "n_query": n_query, "note": "sweep" if sweep else ""}
            measured(row, ("forward_ms", "train_step_ms", "peak_mem_mb"),
                     lambda fn=fn: measure(_OpNet(fn, features), (query, ref), device, args.iters, args.budget),
                     peer=not variant.startswith("pcops"))
            results.append(row)
            print(_format(row), flush=True)
    return results


# ----------------------------------------------------------------------------------------------
# Sampling and grouping ops: farthest_point_sample, ball_query, knn_graph / radius_graph,
# voxel_pool against their strongest CPU peers, forward only, in one process. Peers are
# benchmark-only and imported lazily: a missing one is skipped with a note. Rows go to
# report["sampling"] as {"op", "variant", "n", "ms", "note"}.


def _optional(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        return None


SAMPLING_CLOUDS = ("randn", "uniform", "clustered", "surface")  # bench_search.cloud shapes


FPS_BATCH = 16  # clouds of the batch rows: one padded call against 16 calls


def _picked(points: np.ndarray, idx: np.ndarray) -> tuple:
    """An index-only FPS peer's result as the op's: the picked points (gathered) and their indices."""
    return points[idx], idx


def _fps_cases(args, device, shape: str):
    """Farthest point sampling rows of one cloud shape: (op, variant, n, fn or None, note, S).

    Sizes 10^4 and 10^5 (10^6 with --sweep), S = n/64 and n/4 picks (and n/16 from 10^5 points:
    pcops builds Morton-ordered leaves below n/10 picks, a kd-tree above), each against fpsample's
    fastest exact variant (``bucket_fps_kdline_sampling``: QuickFPS, exact, one thread; its
    start is the first point of its tree, pcops starts at the first point of the cloud) and at
    10^4 its plain ``fps_sampling`` and the torch loop. fpsample 1.0.2 has no multi-threaded
    variant: the batch rows run its 16 calls one after another and on a thread pool. Batch
    rows: 16 clouds of n points (n/4 picks each) in one padded call against 16 calls."""
    fpsample = _optional("fpsample")
    sizes = [1_000, 4_000] if args.quick else [10_000, 100_000] + ([1_000_000] if args.sweep else [])
    op = "farthest_point_sample"
    cases = []
    for n in sizes:
        cloud = op_inputs(op, 2, n, "cpu", shape, channels=1)["points"]
        dev, x = cloud.to(device), cloud.numpy()
        h = 9 if n >= 1_000_000 else (7 if n >= 10_000 else 5)  # fpsample's advice: 5-7 for medium, 9 for large clouds
        for frac in (64, 16, 4) if n >= 100_000 else (64, 4):  # n/16: below the kd-tree's threshold (n/10)
            s = n // frac
            cases.append((op, "pcops", n, lambda dev=dev, s=s: pcops.farthest_point_sample(dev, s, validate=False), f"S=n/{frac}", s))
            if fpsample is None:
                cases.append((op, "fpsample_bucket", n, None, "pip install fpsample to compare", s))
                continue
            cases.append((op, "fpsample_bucket", n, lambda x=x, s=s, h=h: _picked(x, fpsample.bucket_fps_kdline_sampling(x, s, h=h, start_idx=0)),
                          f"S=n/{frac}, bucket_fps_kdline_sampling h={h}: exact, one thread", s))
            if n <= 10_000:
                cases.append((op, "fpsample_plain", n, lambda x=x, s=s: _picked(x, fpsample.fps_sampling(x, s, start_idx=0)),
                              f"S=n/{frac}, fps_sampling: exact, one thread", s))
        if n <= 10_000:
            s = n // 64

            def torch_fps_loop(dev=dev, n=n, s=s):  # the loop users write in torch: a few tensor ops per pick
                dist = torch.full((n,), float("inf"), device=device)
                picked = torch.zeros(s, dtype=torch.int64, device=device)
                for t in range(1, s):
                    dist = torch.minimum(dist, (dev - dev[picked[t - 1]]).square().sum(1))
                    picked[t] = dist.argmax()
                return dev[picked], picked

            cases.append((op, "torch_loop", n, torch_fps_loop, "S=n/64, float32 argmax per pick", s))
    # a batch: FPS_BATCH clouds of the smallest size, n/4 picks each
    n = sizes[0]
    s = n // 4
    clouds = [op_inputs(op, 10 + i, n, "cpu", shape, channels=1)["points"] for i in range(FPS_BATCH)]
    padded = torch.stack(clouds).to(device)
    singles = [c.to(device) for c in clouds]
    batch_op = f"{op}_batch{FPS_BATCH}"
    cases.append((batch_op, "pcops", n, lambda: pcops.farthest_point_sample(padded, s, validate=False), f"{FPS_BATCH} clouds in one padded call, S=n/4", s))
    cases.append((batch_op, "pcops_calls", n, lambda: [pcops.farthest_point_sample(c, s, validate=False) for c in singles],
                  f"{FPS_BATCH} calls one after another", s))
    if fpsample is not None:
        arrays = [c.numpy() for c in clouds]
        h = 7 if n >= 10_000 else 5
        cases.append((batch_op, "fpsample_bucket_calls", n, lambda: [_picked(a, fpsample.bucket_fps_kdline_sampling(a, s, h=h, start_idx=0)) for a in arrays],
                      f"{FPS_BATCH} calls one after another, h={h}", s))
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(os.cpu_count() or 1)
        cases.append((batch_op, "fpsample_bucket_threads", n,
                      lambda: list(pool.map(lambda a: _picked(a, fpsample.bucket_fps_kdline_sampling(a, s, h=h, start_idx=0)), arrays)),
                      f"{FPS_BATCH} calls on {os.cpu_count()} Python threads, h={h}", s))
    return cases


# PhysicsNeMo's radius_search benchmark (physicsnemo/nn/functional/neighbors/radius_search:
# torch.rand points and queries, r = 0.1, at most 32) and GeoTransolver's six ball queries per
# forward (radii and caps of its volume configs), on the same unit-cube inputs
RADIUS_SEARCH_SIZES = ((1_024, 512), (4_096, 2_048), (8_192, 4_096))  # (points, queries)
GEOTRANSOLVER = ([0.01, 0.05, 0.25, 1.0, 2.5, 5.0], [4, 8, 16, 64, 128, 256])


class Timed(NamedTuple):
    """A case's time measured elsewhere (a peer in a process of its own), in place of its function."""

    ms: Optional[float]


def _physicsnemo_radius_search(points: torch.Tensor, queries: torch.Tensor, radius: float, max_points: int, repeats: int):
    """(median ms, note) of PhysicsNeMo's ``radius_search`` (its default, Warp, implementation; the
    first ``max_points`` within the radius with their distances) on these inputs, in its own
    interpreter (:func:`bench_mesh.physicsnemo_run`); (None, why) where it cannot run."""
    case = {"name": "radius_search", "op": "radius_search", "radius": radius, "max_points": max_points, "return_dists": True,
            "return_points": False}
    result, why = bench_mesh.physicsnemo_run({"points": points.numpy(), "queries": queries.numpy()}, [case], repeats, 3)
    if result is None:
        return None, why
    return (round(result["results"][0]["median_ms"], 3),
            f"physicsnemo {result['physicsnemo']} radius_search (Warp on one thread; torch {result['torch']}, {result['torch_threads']} threads): "
            f"the first {max_points} within r and their distances, in a process of its own")


def _radius_search_cases(args, device, ckdtree, o3c):
    """(op, variant, n, fn or None, note, queries) rows at PhysicsNeMo's radius_search sizes (the
    first only with --quick): ``ball_query:physicsnemo`` (r = 0.1, K = 32) and
    ``ball_queries:geotransolver`` (six radii 0.01-5.0, caps 4-256) against separate ball_query
    calls, cKDTree's query (k = K, distance_upper_bound = r, workers=-1: the K nearest within r
    and their distances, as a ball query returns them; ``scipy_ckdtree_counts``: and each ball's
    count, ``query_ball_point(return_length=True)``, the rest of a ball query's answer), Open3D's hybrid_search (the K nearest
    within r, d < r), each peer's index built in the call, and (``ball_query:physicsnemo``
    on the CPU) PhysicsNeMo's own ``radius_search`` (:class:`Timed`, in its own process); and
    ``ball_query:clusters`` (:data:`CLUSTERS`), balls crowded where the points' box says
    they spread, against the same peers."""
    cases = []
    for n, m in RADIUS_SEARCH_SIZES[:1] if args.quick else RADIUS_SEARCH_SIZES:
        made = op_inputs("ball_query", 20, n, "cpu", None, n_query=m, channels=1)  # the table's unit cube: torch.rand
        query, ref = made["query"], made["ref"]
        dq, dref = query.to(device), ref.to(device)
        for op, (radii, caps) in (("ball_query:physicsnemo", ([0.1], [32])), ("ball_queries:geotransolver", GEOTRANSOLVER)):
            shown = f"{m:,} queries, r={radii[0]}, K={caps[0]}" if len(radii) == 1 else f"{m:,} queries, radii 0.01-5.0, K 4-256"
            if len(radii) == 1:
                cases.append((op, "pcops", n, lambda q=dq, p=dref, r=radii[0], k=caps[0]: pcops.ball_query(q, p, r, k, validate=False), shown, m))
            else:
                cases.append((op, "pcops", n, lambda q=dq, p=dref: pcops.ball_queries(q, p, *GEOTRANSOLVER, validate=False), shown, m))
                cases.append((op, "pcops_calls", n, lambda q=dq, p=dref: [pcops.ball_query(q, p, r, k, validate=False) for r, k in zip(*GEOTRANSOLVER)],
                              f"{shown}: one ball_query call per radius", m))
            cases += _ball_peer_cases(op, n, m, query, ref, radii, caps, shown, ckdtree, o3c)
            if len(radii) == 1 and device.type == "cpu":
                ms, note = _physicsnemo_radius_search(ref, query, radii[0], caps[0], args.iters)
                cases.append((op, "physicsnemo", n, Timed(ms), f"{shown}: {note}", m))
    n, m, clusters, sigma, r, k = (20_000, 2_000) + CLUSTERS[2:] if args.quick else CLUSTERS
    gen = torch.Generator().manual_seed(9)
    centres = torch.rand(clusters, 3, generator=gen) * 2 - 1
    ref = centres[torch.randint(0, clusters, (n,), generator=gen)] + sigma * torch.randn(n, 3, generator=gen)
    query = (ref[torch.randperm(n, generator=gen)[:m]] + 0.001).contiguous()
    dq, dref = query.to(device), ref.to(device)
    shown = f"{m:,} queries among {n:,} points in {clusters} clusters (sigma {sigma}), r={r}, K={k}"
    cases.append(("ball_query:clusters", "pcops", n, lambda: pcops.ball_query(dq, dref, r, k, validate=False), shown, m))
    cases += _ball_peer_cases("ball_query:clusters", n, m, query, ref, [r], [k], shown, ckdtree, o3c)
    return cases


# Balls crowded where the points' box says they spread (docs/benchmarks.md, design choices):
# (points, queries among them, clusters, their sigma, radius, K), the clusters' centres in [-1, 1]^3
CLUSTERS = (100_000, 10_000, 64, 0.02, 0.04, 32)


def _ball_peer_cases(op: str, n: int, m: int, query, ref, radii: list, caps: list, shown: str, ckdtree, o3c) -> list:
    """The peers' rows of a radius-search row (:func:`_radius_search_cases`) on CPU points
    ``query`` and ``ref``: cKDTree's K nearest within each radius, with and without the counts,
    and Open3D's hybrid_search, each index built in the call."""
    cases = []
    q_pts, p_pts = query.numpy(), ref.numpy()
    if ckdtree is not None:
        def nearest_within(q=q_pts, p=p_pts, radii=radii, caps=caps):
            tree = ckdtree(p)
            return [tree.query(q, k, distance_upper_bound=r, workers=-1) for r, k in zip(radii, caps)]

        cases.append((op, "scipy_ckdtree", n, nearest_within, f"{shown}: query(k=K, distance_upper_bound=r), workers=-1", m))

        def counted(q=q_pts, p=p_pts, radii=radii, caps=caps):
            tree = ckdtree(p)
            return [(tree.query(q, k, distance_upper_bound=r, workers=-1), tree.query_ball_point(q, r, return_length=True, workers=-1))
                    for r, k in zip(radii, caps)]

        cases.append((op, "scipy_ckdtree_counts", n, counted,
                      f"{shown}: query(k=K, distance_upper_bound=r) and query_ball_point(r, return_length=True), workers=-1: "
                      "the counts too, as a ball query returns them", m))
    if o3c is not None:
        def hybrid(q=q_pts, p=p_pts, radii=radii, caps=caps):
            index = o3c.nns.NearestNeighborSearch(o3c.Tensor(p))
            index.hybrid_index(max(radii))
            return [index.hybrid_search(o3c.Tensor(q), r, k) for r, k in zip(radii, caps)]

        cases.append((op, "open3d", n, hybrid, f"{shown}: hybrid_search (d < r)", m))
    return cases


def _sampling_cases(args, device, shape: str = "uniform"):
    """(op, variant, n, fn or None, note[, S]) for every row of the sampling section on one cloud
    shape (FPS rows carry their number of picks S); radii and voxel sizes follow the cloud
    (medians of its k-th neighbour distances)."""
    quick = args.quick
    n = 4_000 if quick else 100_000
    # one cloud for the graphs and voxel pooling (their rows share the table's one-cloud builder), 16 feature channels
    made = op_inputs("voxel_pool", 2, n, "cpu", shape, channels=16)
    cloud, feats = made["points"], made["features"]
    o3c = _optional("open3d.core")
    ckdtree = getattr(_optional("scipy.spatial"), "cKDTree", None)
    dev_cloud = cloud.to(device)
    cases = _fps_cases(args, device, shape)

    # ball query: n reference points, n/10 queries, the radius holding 32 points for half of them
    k = 32
    made = op_inputs("ball_query", 3, n, "cpu", shape, n_query=n // 10, channels=1)
    query, ref = made["query"], made["ref"]
    radius = float(pcops.knn(query, ref, k).dists[:, -1].median())
    dq, dref = query.to(device), ref.to(device)
    cases.append(("ball_query", "pcops", n, lambda k=k: pcops.ball_query(dq, dref, radius, k, validate=False), f"K={k}"))
    if ckdtree is not None:
        tree_pts, q_pts = ref.numpy(), query.numpy()
        cases.append(("ball_query", "scipy_ckdtree", n,
                      lambda k=k: ckdtree(tree_pts).query(q_pts, k, distance_upper_bound=radius, workers=-1), "K nearest within r, no counts"))
    if o3c is None:
        cases.append(("ball_query", "open3d", n, None, "pip install open3d-cpu to compare"))
    else:
        def o3d_hybrid(k=k):
            index = o3c.nns.NearestNeighborSearch(o3c.Tensor(ref.numpy()))
            index.hybrid_index(radius)
            return index.hybrid_search(o3c.Tensor(query.numpy()), radius, k)

        cases.append(("ball_query", "open3d", n, o3d_hybrid, "hybrid_search (d < r)"))
    if shape == "uniform":  # PhysicsNeMo's own inputs (the unit cube), once
        cases += _radius_search_cases(args, device, ckdtree, o3c)

    # graphs over the cloud: k = 16, and a radius with 16 neighbours for half of the points
    k = 16
    r16 = float(pcops.knn(cloud, cloud, k + 1).dists[:, -1].median())
    cases.append(("knn_graph", "pcops", n, lambda: pcops.knn_graph(dev_cloud, k, validate=False), f"k={k}"))
    cases.append(("radius_graph", "pcops", n, lambda: pcops.radius_graph(dev_cloud, r16, validate=False), "all neighbours"))
    if ckdtree is not None:
        pts = cloud.numpy()

        def scipy_knn_graph():
            _, idx = ckdtree(pts).query(pts, k + 1, workers=-1)
            return np.stack([idx[:, 1:].reshape(-1), np.repeat(np.arange(n), k)])

        def scipy_radius_graph():
            lists = ckdtree(pts).query_ball_point(pts, r16, workers=-1, return_sorted=True)
            sizes = np.fromiter(map(len, lists), dtype=np.int64, count=n)
            e = np.stack([np.concatenate(lists), np.repeat(np.arange(n), sizes)])
            return e[:, e[0] != e[1]]  # (no self edges, as pcops' loop=False)

        cases.append(("knn_graph", "scipy_ckdtree", n, scipy_knn_graph, "query k+1, workers=-1"))
        cases.append(("radius_graph", "scipy_ckdtree", n, scipy_radius_graph, "query_ball_point, by index, self edges dropped"))
    if o3c is not None:
        def o3d_knn_graph():
            index = o3c.nns.NearestNeighborSearch(o3c.Tensor(cloud.numpy()))
            index.knn_index()
            idx, _ = index.knn_search(o3c.Tensor(cloud.numpy()), k + 1)
            return np.stack([idx.numpy()[:, 1:].reshape(-1), np.repeat(np.arange(n), k)])

        def o3d_radius_graph():
            index = o3c.nns.NearestNeighborSearch(o3c.Tensor(cloud.numpy()))
            index.fixed_radius_index(r16)
            idx, _, splits = index.fixed_radius_search(o3c.Tensor(cloud.numpy()), r16, sort=True)
            e = np.stack([idx.numpy(), np.repeat(np.arange(n), np.diff(splits.numpy()))])
            return e[:, e[0] != e[1]]  # (no self edges, as pcops' loop=False)

        cases.append(("knn_graph", "open3d", n, o3d_knn_graph, "knn_search k+1"))
        cases.append(("radius_graph", "open3d", n, o3d_radius_graph, "fixed_radius_search sorted (d < r), self edges dropped"))

    # voxel pooling: about 8 points per voxel were the cloud uniform in its box, 16 feature channels
    size = (8 * float((cloud.amax(0) - cloud.amin(0)).prod()) / n) ** (1 / 3)
    dev_feats = feats.to(device)
    cases.append(("voxel_pool", "pcops", n, lambda: pcops.voxel_pool(dev_cloud, size, dev_feats, validate=False), "mean, F=16"))

    def torch_scatter_pool():  # PyG's voxel_grid + avg_pool in plain torch: unique rows, scatter means
        cells = torch.floor(cloud / size).long()
        _, cluster = torch.unique(cells, dim=0, return_inverse=True)
        v = int(cluster.max()) + 1
        counts = torch.zeros(v).index_add_(0, cluster, torch.ones(n))[:, None]
        return torch.zeros(v, 3).index_add_(0, cluster, cloud) / counts, torch.zeros(v, 16).index_add_(0, cluster, feats) / counts

    cases.append(("voxel_pool", "torch_scatter", n, torch_scatter_pool, "unique(dim=0) + index_add"))
    o3d = _optional("open3d")
    if o3d is not None:
        tcloud = o3d.t.geometry.PointCloud(o3d.core.Tensor(cloud.numpy()))
        tcloud.point["features"] = o3d.core.Tensor(feats.numpy())  # (means of the features too, on the grid from the origin: pcops')
        cases.append(("voxel_pool", "open3d", n, lambda: tcloud.voxel_down_sample(size), "t.geometry voxel_down_sample, points and F=16"))
    return cases


# Surface sampling: pcops.sample_points_on_mesh against PyTorch3D's sample_points_from_meshes
# formula in plain torch and trimesh.sample.sample_surface, on the real meshes of bench_meshes
# (pyvista's example meshes, and the airplane subdivided three times: 157k faces; --quick: the
# op table's icosphere)

MESH_SAMPLES = (10_000, 100_000, 1_000_000)


def pytorch3d_sample(vertices, faces, n: int):
    """PyTorch3D's sample_points_from_meshes for one mesh with return_normals, its formula in
    torch: face areas (no graph), multinomial with replacement, the square-root barycentrics,
    the weighted corners and the faces' unit normals."""
    corners = vertices[faces]
    v0, v1, v2 = corners.unbind(1)
    cross = torch.linalg.cross(v1 - v0, v2 - v0)
    with torch.no_grad():
        face = (cross.norm(dim=-1) / 2).multinomial(n, replacement=True)
    u, v = torch.rand(n, dtype=vertices.dtype, device=vertices.device), torch.rand(n, dtype=vertices.dtype, device=vertices.device)
    root = u.sqrt()
    w0, w1, w2 = 1.0 - root, root * (1.0 - v), root * v
    points = w0[:, None] * v0[face] + w1[:, None] * v1[face] + w2[:, None] * v2[face]
    normals = torch.nn.functional.normalize(cross, dim=-1)[face]
    return points, normals


def _sample_meshes(quick: bool) -> list:
    """(name, vertices float32, faces int64, trimesh.Trimesh) of the meshes the sampling rows use."""
    import trimesh

    if quick:
        made = BY_NAME["sample_points_on_mesh"].inputs(0, dtype=torch.float32, faces=1280)
        v, f = made["vertices"], made["faces"]
        return [("icosphere", v, f, trimesh.Trimesh(v.double().numpy(), f.numpy(), process=False))]
    out = []
    for name in bench_meshes.available():
        m = bench_meshes.mesh(name)
        out.append((name, m))
        if name == "airplane":
            v, f = trimesh.remesh.subdivide(m.vertices, m.faces)
            for _ in range(2):
                v, f = trimesh.remesh.subdivide(v, f)
            out.append(("airplane/64", trimesh.Trimesh(v, f, process=False)))
    return [(name, torch.tensor(m.vertices, dtype=torch.float32), torch.tensor(m.faces, dtype=torch.int64), m) for name, m in out]


def run_mesh_sampling(args, device) -> list[dict]:
    """Rows of report["sampling"] for sample_points_on_mesh (op, variant, cloud "mesh:<name>",
    n draws): the three functions interleaved in one timing (scripts/bench_timer.py)."""
    import trimesh

    rows = []
    for name, v, f, m in _sample_meshes(args.quick):
        dv, df = v.to(device), f.to(device)
        for n in (1_000, 4_000) if args.quick else MESH_SAMPLES:
            fns = {"pcops": lambda n=n: pcops.sample_points_on_mesh(dv, df, n, seed=n, validate=False),
                   "pytorch3d_torch": lambda n=n: pytorch3d_sample(dv, df, n),
                   "trimesh": lambda n=n: trimesh.sample.sample_surface(m, n, seed=n)}
            times = median_ms(fns, repeats=args.iters, budget_s=args.budget, device=device)
            notes = {"pcops": "seed=, points, faces, weights, normals",
                     "pytorch3d_torch": "multinomial + sqrt barycentrics, points and normals, float32",
                     "trimesh": "sample_surface(seed=): points and faces, float64, NumPy"}
            for variant, ms in times.items():
                rows.append({"op": "sample_points_on_mesh", "variant": variant, "cloud": f"mesh:{name}", "n": n, "s": None,
                             "ms": round(ms, 3), "note": notes[variant]})
                print(f"{'sample_points_on_mesh':<28} {variant:<24} {name:<10} n={n:>9,} {ms:>10,.1f} ms  F={len(f):,}", flush=True)
    return rows


def run_sampling(args, device) -> list[dict]:
    """Forward times of the sampling and grouping ops and their peers on each cloud shape, with
    ratios printed (rows of the same op, cloud, size and number of picks only)."""
    rows = []
    for shape in ("uniform",) if args.quick else SAMPLING_CLOUDS + bench_meshes.clouds():
        for op, variant, n, fn, note, *s in _sampling_cases(args, device, shape):
            row = {"op": op, "variant": variant, "cloud": shape, "n": n, "s": s[0] if s else None, "ms": None, "note": note}
            if isinstance(fn, Timed):
                row["ms"] = fn.ms
            elif fn is not None:
                measured(row, ("ms",), lambda fn=fn: {"ms": round(median_ms(fn, repeats=args.iters, budget_s=args.budget, device=device), 3)},
                         peer=not variant.startswith("pcops"))
            rows.append(row)
            ms = row["ms"]
            print(f"{op:<28} {variant:<24} {shape:<10} n={n:>9,} {'-' if ms is None else f'{ms:,.1f}':>10} ms  {row['note']}", flush=True)
    rows += run_mesh_sampling(args, device)
    key = lambda r: (r["op"], r["cloud"], r["n"], r["s"])  # noqa: E731
    ours = {key(r): r for r in rows if r["variant"] == "pcops" and r["ms"]}
    for r in rows:
        mine = ours.get(key(r))
        if r["variant"] != "pcops" and r["ms"] and mine:
            size = f"n={r['n']:,}" + (f", S={r['s']:,}" if r["s"] else "")
            print(f"{r['op']} ({r['cloud']}, {size}): pcops vs {r['variant']}: {speed(r['ms'] / mine['ms'], 2)}")
    return rows


# Interpolation, Chamfer distance and normals against their peers (peers imported lazily;
# rows under report["geometry_ops"]: Open3D has no train step)

GEOMETRY_SIZES = {  # (n_ref, n_query): interpolation coarse -> dense, Chamfer x and y, normals points
    "knn_interpolate": (10_000, 40_000),
    "chamfer_distance": (8_192, 8_192),
    "estimate_normals": (20_000, 20_000),
    "radius_max": (25_000, 27_000),
}
NORMALS_SIZES = (5_000, 100_000)  # estimate_normals' extra sizes (full runs), next to GEOMETRY_SIZES'
GEOMETRY_QUICK = {"knn_interpolate": (500, 2_000), "chamfer_distance": (1_000, 1_000), "estimate_normals": (1_000, 1_000),
                  "radius_max": (2_000, 2_000)}


def _knn_indices_peer(query, ref, k: int):
    """cKDTree (all cores) on CPU, dense cdist + topk elsewhere: the peers' search."""
    if query.device.type == "cpu":
        from scipy.spatial import cKDTree

        _, idx = cKDTree(ref.detach().numpy()).query(query.detach().numpy(), k=k, workers=-1)
        return torch.from_numpy(np.asarray(idx, dtype=np.int64).reshape(query.shape[0], k))
    return torch.cdist(query.detach(), ref.detach()).topk(k, dim=1, largest=False).indices


def pyg_knn_interpolate(query, ref, features, k: int = 3):
    """PyTorch Geometric's knn_interpolate, its torch logic verbatim, on the peer search."""
    m = query.shape[0]
    y_idx = torch.arange(m, device=query.device).repeat_interleave(k)
    x_idx = _knn_indices_peer(query, ref, k).reshape(-1)
    diff = ref[x_idx] - query[y_idx]
    squared_distance = (diff * diff).sum(dim=-1, keepdim=True)
    weights = 1.0 / torch.clamp(squared_distance, min=1e-16)
    num = torch.zeros(m, features.shape[1], dtype=features.dtype, device=query.device).index_add(0, y_idx, features[x_idx] * weights)
    den = torch.zeros(m, 1, dtype=weights.dtype, device=query.device).index_add(0, y_idx, weights)
    return num / den


def cdist_chamfer(x, y):
    """Dense Chamfer loss on the (P1, P2) torch.cdist matrix."""
    d = torch.cdist(x, y).square()
    return d.min(1).values.mean() + d.min(0).values.mean()


EIGH_CHUNK = 16_384  # 3 x 3 matrices per torch.linalg.eigh call on CUDA (see smallest_eigenvectors)


def smallest_eigenvectors(cov, chunk: int | None = None):
    """The eigenvector of the smallest eigenvalue of each symmetric matrix of ``cov`` (B, 3, 3):
    torch.linalg.eigh in one call, or in calls of ``chunk`` matrices. On CUDA one call of 100,000
    matrices raised CUSOLVER_STATUS_INTERNAL_ERROR in cusolverDnXsyevBatched (H200, torch
    2.11.0+cu130; 5,000 ran), so the peer runs it in chunks there; every matrix is solved alone
    either way, so the chunks change no value."""
    if chunk is None or cov.shape[0] <= chunk:
        return torch.linalg.eigh(cov).eigenvectors[..., 0]
    return torch.cat([torch.linalg.eigh(part).eigenvectors[..., 0] for part in cov.split(chunk)])


def torch_normals(points, k: int):
    """PyTorch3D's estimate_pointcloud_normals method in torch: kNN, covariances, torch.linalg.eigh
    (one call on the CPU, chunks of EIGH_CHUNK matrices on CUDA)."""
    idx = _knn_indices_peer(points, points, k)
    nb = points[idx]
    centred = nb - nb.mean(1, keepdim=True)
    cov = centred.transpose(1, 2) @ centred / k
    return smallest_eigenvectors(cov, None if points.device.type == "cpu" else EIGH_CHUNK)


def scipy_radius_max(query, ref, features, radius: float):
    """cKDTree.query_ball_point (all cores) + torch scatter_reduce("amax"): PointNet++ grouping's max."""
    from scipy.spatial import cKDTree

    lists = cKDTree(ref.detach().numpy()).query_ball_point(query.detach().numpy(), radius, workers=-1)
    rows = torch.repeat_interleave(torch.arange(query.shape[0]), torch.tensor([len(x) for x in lists]))
    cols = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]))
    out = features.new_full((query.shape[0], features.shape[1]), float("-inf"))
    out = out.scatter_reduce(0, rows[:, None].expand(-1, features.shape[1]), features[cols], "amax")
    return torch.where(torch.isinf(out), 0, out)


def open3d_normals(points, k: int):
    import open3d as o3d

    cloud = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(points.detach().double().numpy()))
    cloud.estimate_normals(o3d.geometry.KDTreeSearchParamKNN(k))
    return np.asarray(cloud.normals)


def _geometry_cases(device, sizes, shape: str = "uniform"):
    """(op, variant, n_ref, n_query, forward(), loss() or None) for each op and peer on one cloud
    shape (``bench_search.cloud``; radius_max's radius holds 13 points for half of the queries)."""
    n_ref, n_query = sizes["knn_interpolate"]
    made = op_inputs("knn_interpolate", 4, n_ref, device, shape, n_query=n_query, channels=64)
    coarse, dense, feats = made["ref"], made["query"], made["features"].requires_grad_()
    ours = lambda: pcops.knn_interpolate(dense, coarse, feats, 3, validate=False)  # noqa: E731
    peer = lambda: pyg_knn_interpolate(dense, coarse, feats, 3)  # noqa: E731
    yield "knn_interpolate", "pcops_eager", n_ref, n_query, ours, lambda: ours().square().mean()
    yield "knn_interpolate", "pyg_torch", n_ref, n_query, peer, lambda: peer().square().mean()

    n_x, n_y = sizes["chamfer_distance"]
    made = op_inputs("chamfer_distance", 6, n_y, device, shape, n_query=n_x)
    x, y = made["x"].requires_grad_(), made["y"]
    ours = lambda: pcops.chamfer_distance(x, y, validate=False)  # noqa: E731
    yield "chamfer_distance", "pcops_eager", n_y, n_x, ours, ours
    yield "chamfer_distance", "torch_cdist", n_y, n_x, lambda: cdist_chamfer(x, y), lambda: cdist_chamfer(x, y)

    # normals from 5k to 100k points; the GEOMETRY_SIZES size last (the summary's ratios are those of each
    # shape's last rows). Forward rows run under no_grad: pcops' one-kernel path; train steps: its torch path.
    extra = () if sizes is GEOMETRY_QUICK else NORMALS_SIZES
    for n in extra + (sizes["estimate_normals"][0],):
        surface = op_inputs("estimate_normals", 8, n, device, shape, channels=1)["points"].requires_grad_()
        ours = lambda surface=surface: pcops.estimate_normals(surface, 16, validate=False)  # noqa: E731
        peer = lambda surface=surface: torch_normals(surface, 16)  # noqa: E731
        yield "estimate_normals", "pcops_eager", n, n, ours, lambda ours=ours: ours()[:, 0].sum()
        yield "estimate_normals", "pytorch3d_torch", n, n, peer, lambda peer=peer: peer()[:, 0].sum()
        if device.type == "cpu":
            yield "estimate_normals", "open3d", n, n, lambda surface=surface: open3d_normals(surface, 16), None

    n_ref, n_query = sizes["radius_max"]
    made = op_inputs("radius_aggregate", 9, n_ref, device, shape, n_query=n_query, channels=32)
    ref, query, feats = made["ref"], made["query"], made["features"].requires_grad_()
    radius = float(pcops.knn(query.cpu(), ref.cpu(), 13).dists[:, -1].median())  # 13 neighbours for half the queries
    ours = lambda: pcops.radius_aggregate(query, ref, feats, radius, reduce="max", validate=False)  # noqa: E731
    yield "radius_max", "pcops_eager", n_ref, n_query, ours, lambda: ours().square().mean()
    if device.type == "cpu":
        peer = lambda: scipy_radius_max(query, ref, feats, radius)  # noqa: E731
        yield "radius_max", "scipy_torch", n_ref, n_query, peer, lambda: peer().square().mean()


def run_geometry(args, device) -> list[dict]:
    """Forward (no grad) and forward + backward of each op and its peers on each cloud shape, in one process."""
    results = []
    sizes = GEOMETRY_QUICK if args.quick else GEOMETRY_SIZES
    for shape in ("uniform",) if args.quick else SAMPLING_CLOUDS + bench_meshes.clouds():
        for op, variant, n_ref, n_query, forward, loss in _geometry_cases(device, sizes, shape):
            row = {"model": op, "variant": variant, "cloud": shape, "n_ref": n_ref, "n_query": n_query, "peak_mem_mb": None, "note": ""}

            def figures(forward=forward, loss=loss):
                with torch.no_grad():
                    fwd = round(median_ms(forward, repeats=args.iters, budget_s=args.budget, device=device), 3)
                step = None if loss is None else round(
                    median_ms(lambda: loss().backward(), repeats=args.iters, budget_s=args.budget, device=device), 3)
                return {"forward_ms": fwd, "train_step_ms": step}

            measured(row, ("forward_ms", "train_step_ms"), figures, peer=not variant.startswith("pcops"))
            results.append(row)
            print(_format(row) + f" {shape}", flush=True)
    by = {(r["model"], r["cloud"], r["variant"]): r for r in results if r.get("forward_ms")}
    for (op, shape, variant), r in by.items():
        ours = by.get((op, shape, "pcops_eager"))
        if variant == "pcops_eager" or ours is None:
            continue
        step = "" if not r.get("train_step_ms") else f"train step {speed(r['train_step_ms'] / ours['train_step_ms'])}, "
        print(f"{op} ({shape}): pcops_eager vs {variant}: {step}forward {speed(r['forward_ms'] / ours['forward_ms'])}")
    return results


def run_networks(args, configs=None) -> list[dict]:
    """Training throughput of the point networks (samples/s, eager and compiled with fullgraph)
    and the share of an eager step inside pcops ops: scripts/profile_models.py's measurement."""
    import profile_models

    names = configs or (["pointnet_cls"] if args.quick else profile_models.CONFIGS)
    rows = []
    for name in names:
        r = profile_models.measure(name, 1 if args.quick else args.iters)
        rows.append(r)
        print(f"{'point_network':<17} {r['config']:<15} points={r['points']:>5} batch={r['batch']:>3}  samples/s: eager {r['eager']:,.1f}, "
              f"compiled {r['compiled']:,.1f} ({r['compiled'] / r['eager']:.2f}x)  pcops share {100 * r['share']:.0f}% ({r['top']})", flush=True)
    return rows


def _format(row: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    return (f"{row['model']:<17} {row['variant']:<15} n_ref={row.get('n_ref', 0):>9,} n_query={row.get('n_query', 0):>9,} "
            f"forward={fmt(row.get('forward_ms')):>10} ms  train_step={fmt(row.get('train_step_ms')):>10} ms  "
            f"peak={fmt(row.get('peak_mem_mb')):>8} MB  {row.get('note', '')}")


def ratios(results: list[dict]) -> list[str]:
    """Speed-ups of pcops over each reference, per model / op and size: only rows of the same sizes are compared."""
    lines = []
    by = {(r["model"], r.get("n_ref"), r.get("n_query"), r["variant"]): r for r in results if r.get("train_step_ms")}
    for model, n_ref, n_query in dict.fromkeys((r["model"], r.get("n_ref"), r.get("n_query")) for r in results):
        for ours in ("pcops_eager", "pcops_compiled"):
            if (model, n_ref, n_query, ours) not in by:
                continue
            for ref in ("torch_eager", "torch_compiled", "scipy_torch", "pcops_eager"):
                if ref != ours and (model, n_ref, n_query, ref) in by:
                    a, b = by[(model, n_ref, n_query, ours)], by[(model, n_ref, n_query, ref)]
                    lines.append(f"{model} (n_ref={n_ref:,}, n_query={n_query:,}): {ours} vs {ref}: train step "
                                 f"{speed(b['train_step_ms'] / a['train_step_ms'])}, forward {speed(b['forward_ms'] / a['forward_ms'])}")
    return lines


def environment(device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import scipy
    import warp

    return {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "warp": warp.__version__,
                     "scipy": scipy.__version__, "numpy": np.__version__, "pcops": pcops.__version__},
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, a few iterations (well under a minute)")
    parser.add_argument("--sweep", action="store_true", help="bare ops from 10^4 to 10^6 points")
    parser.add_argument("--json", help="write all figures to this JSON file")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--budget", type=float, default=30.0, help="seconds of repeats per measurement at most")
    parser.add_argument("--knn-points", type=int, default=100_000)
    parser.add_argument("--radius-points", type=int, default=25_000)
    parser.add_argument("--grid", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=25)
    parser.add_argument("--search", action="store_true", help="only the CPU neighbour-search rows against peers (bench_search.py)")
    parser.add_argument("--only", action="append", choices=["search", "small", "models", "geometry", "sampling", "networks", "sparse", "transformer", "mesh", "transport", "compile"],
                        help="run only these sections (repeatable; default: all)")
    parser.add_argument("--cpu-time", action="store_true", help="search rows in CPU time (run with OMP_NUM_THREADS=1)")
    parser.add_argument("--rmm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global COMPILE_BACKEND
    if args.quick:
        args.knn_points, args.radius_points, args.grid, args.iters, args.budget = 4000, 2000, 8, 2, 5.0
        COMPILE_BACKEND = "aot_eager"
    if args.rmm_child:
        rmm_child(args)
        return {}
    pcops._warp.init()
    device = torch.device(args.device)
    report = environment(device)
    report["compile_backend"] = COMPILE_BACKEND
    print(json.dumps(report))
    sections = set(args.only or (["search"] if args.search else ["search", "small", "models", "geometry", "sampling", "networks", "sparse", "transformer", "mesh", "transport"]))
    if device.type == "cpu" and "search" in sections:  # kNN search and radius aggregation against pykdtree / open3d / cKDTree / a numba cell list
        report["search"], report["search_notes"] = bench_search.run(args.quick, cpu_time=args.cpu_time)
    if device.type == "cpu" and "small" in sections:  # one small cloud per call, quiet and beside a busy process (bench_small.py)
        report["small"] = bench_small.run(args.quick) + bench_grouping.run(args.quick) + bench_features.run(args.quick)
    if "models" in sections:
        results = run_models(args, device) + run_ops(args, device)
        if args.sweep:
            sizes = [10_000, 100_000, 1_000_000] if not args.quick else [1_000, 4_000]
            cases = [(op, n, n) for op in ("knn_aggregate", "radius_aggregate") for n in sizes]
            results += run_ops(args, device, cases, sweep=True)
        print("\n".join(ratios(results)))
        report["results"] = results
    if "geometry" in sections:
        report["geometry_ops"] = run_geometry(args, device)
    if "sampling" in sections:
        report["sampling"] = run_sampling(args, device)
    if "networks" in sections and device.type == "cpu":  # the point networks' CPU configs
        report["point_networks"] = run_networks(args)
    if "sparse" in sections and device.type == "cpu":  # grid_sample, kernel map, sparse conv against torch (bench_sparse.py)
        report["sparse"] = bench_sparse.run(args.quick)
    if "transformer" in sections and device.type == "cpu":  # serialize, segment_reduce, serialized_pool, gather (bench_transformer.py)
        report["transformer"] = bench_transformer.run(args.quick)
    if "mesh" in sections and device.type == "cpu":  # mesh_distance, mesh_bvh, point_mesh_face_distance against Open3D / trimesh / PhysicsNeMo (bench_mesh.py)
        report["mesh"] = bench_mesh.run(args.quick)
    if "transport" in sections and device.type == "cpu":  # sinkhorn_divergence against GeomLoss, earth_movers_distance against POT (bench_transport.py)
        report["transport"] = bench_transport.run(args.quick)
    if "compile" in sections and device.type == "cpu":  # models eager / default compile / fullgraph (bench_compile.py)
        report["compile"] = bench_compile.run(args.quick)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
