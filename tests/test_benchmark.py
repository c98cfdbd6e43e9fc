"""scripts/benchmark.py runs end to end at tiny sizes and writes the documented JSON.

Marked slow (about a minute: every section's quick run), to keep the default suite within CI's
time; run it with ``pytest -m slow tests/test_benchmark.py`` after changing a benchmark script."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests import op_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `--quick --sweep` run shared by this file's tests: (the finished process, its JSON file)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    cmd = [sys.executable, str(ROOT / "scripts/benchmark.py"), "--quick", "--sweep", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, out


def test_quick_benchmark_writes_every_variant(quick_run):
    result, out = quick_run
    report = json.loads(out.read_text())
    assert {"device", "versions", "results", "cpu", "cores"} <= report.keys()
    assert {"torch", "warp", "scipy", "pcops"} <= report["versions"].keys()
    rows = {(r["model"], r["variant"]) for r in report["results"]}
    for model in ("knn_projector", "radius_projector"):
        for variant in ("torch_eager", "torch_compiled", "scipy_torch", "pcops_eager", "pcops_compiled"):
            assert (model, variant) in rows
    for op in ("knn_aggregate", "radius_aggregate"):
        assert {(op, "pcops_eager"), (op, "scipy_torch")} <= rows
    assert any(r["note"] == "sweep" for r in report["results"])
    for r in report["results"]:
        assert r["forward_ms"] > 0 and r["train_step_ms"] > 0
        assert {"model", "variant", "n_ref", "n_query", "forward_ms", "train_step_ms", "peak_mem_mb", "note"} <= r.keys()
    assert "faster" in result.stdout  # the ratio lines
    geometry = {(r["model"], r["variant"]) for r in report["geometry_ops"] if r["forward_ms"]}
    assert {("knn_interpolate", "pyg_torch"), ("chamfer_distance", "torch_cdist"), ("estimate_normals", "pytorch3d_torch")} <= geometry
    assert {(op, "pcops_eager") for op in ("knn_interpolate", "chamfer_distance", "estimate_normals")} <= geometry

    # the CPU search rows against peers (scripts/bench_search.py)
    benches = {r["bench"] for r in report["search"]}
    assert {"knn_search", "knn_batched", "radius_aggregate"} <= benches
    clouds = {r["cloud"] for r in report["search"] if r["bench"] == "knn_search"}
    assert {"randn", "uniform", "clustered", "surface", "surface_grid"} <= clouds
    for r in report["search"]:
        assert all(ms > 0 for ms in r["ms"].values()) and any(name.startswith("pcops") for name in r["ms"])

    # sampling rows and the point networks' training throughput, eager and compiled
    assert {r["op"] for r in report["sampling"] if r["variant"] == "pcops" and r["ms"]} >= {
        "farthest_point_sample", "ball_query", "knn_graph", "radius_graph", "voxel_pool"}
    # every op of the table (tests/op_table.py) has a row in some section
    named = {str(r.get(key)).split(":")[0] for section in report.values() if isinstance(section, list)
             for r in section if isinstance(r, dict) for key in ("model", "op", "bench")}
    missing = {op.name: op.bench for op in op_table.OPS if op.bench not in named}
    assert not missing, f"ops without a benchmark row (op: expected row name): {missing}"
    (net,) = report["point_networks"]
    assert net["config"] == "pointnet_cls" and net["eager"] > 0 and net["compiled"] > 0 and 0 <= net["share"]


def test_bench_report_renders_every_section_with_the_json_ratios(quick_run):
    """scripts/bench_report.py turns the quick run's JSON into markdown: a titled block for every
    section, and for a pcops / peer pair of each section its cell with ratio peer / pcops."""
    _, out = quick_run
    report = json.loads(out.read_text())
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench_report.py"), str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert text.startswith("## Benchmark run") and report["versions"]["torch"] in text and report["compile_backend"] in text
    for fallback in ("not known to bench_report", "rows as written", "rows of another shape"):
        assert fallback not in text  # every section and row of the JSON has its own table
    titles = {"results": "Models (results)", "search": "CPU search", "geometry_ops": "Geometry ops", "sampling": "Sampling",
              "point_networks": "Point networks", "sparse": "Sparse", "transformer": "Transformer", "mesh": "Meshes",
              "transport": "Transport", "small": "Small clouds"}
    assert {key for key, value in report.items() if isinstance(value, list) and key != "search_notes"} == set(titles)
    blocks = {key: "".join(b for b in text.split("\n### ")[1:] if b.startswith(title)) for key, title in titles.items()}
    assert all(blocks.values()), [key for key, block in blocks.items() if not block]

    def row(rows, **fields):
        return next(r for r in rows if all(r.get(k) == v for k, v in fields.items()))

    results, geometry, sampling = report["results"], report["geometry_ops"], report["sampling"]
    search = row(report["search"], bench="knn_search")
    pairs = {  # section: (pcops ms, peer ms) of one row from the JSON
        "results": (row(results, model="knn_projector", variant="pcops_eager")["train_step_ms"],
                    row(results, model="knn_projector", variant="torch_eager")["train_step_ms"]),
        "search": (search["ms"]["pcops"], next(ms for name, ms in search["ms"].items() if name != "pcops")),
        "geometry_ops": (row(geometry, model="chamfer_distance", variant="pcops_eager")["train_step_ms"],
                         row(geometry, model="chamfer_distance", variant="torch_cdist")["train_step_ms"]),
        "sampling": (row(sampling, op="voxel_pool", variant="pcops")["ms"], row(sampling, op="voxel_pool", variant="torch_scatter")["ms"]),
    }
    for key in ("sparse", "transformer", "transport", "small"):
        ms = report[key][0]["ms"]
        pairs[key] = (ms["pcops"], next(v for name, v in ms.items() if name != "pcops"))
    loss = row(report["mesh"], bench="point_mesh_face_distance")["ms"]  # its rows need no peer but torch
    pairs["mesh"] = (loss["pcops"], loss["torch_dense"])
    cell = _script("bench_report").cell
    for key, (ours, peer) in pairs.items():
        expected = cell(ours, peer)
        assert expected.endswith(f" ({peer / ours:.2f}x)")  # the printed ratio is peer / pcops from the JSON
        assert f"| {expected} |" in blocks[key], (key, expected)
    assert report["point_networks"][0]["config"] in blocks["point_networks"]


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"pcops_{name}", ROOT / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratios_compare_rows_of_the_same_sizes_only():
    bench = _script("benchmark")
    row = lambda variant, n_ref, ms, note="": dict(  # noqa: E731
        model="knn_aggregate", variant=variant, n_ref=n_ref, n_query=n_ref, forward_ms=ms, train_step_ms=ms, note=note
    )
    results = [
        row("pcops_eager", 25_000, 10.0), row("scipy_torch", 25_000, 15.0),  # tutorial size: 1.5x
        row("pcops_eager", 1_000_000, 100.0, "sweep"), row("scipy_torch", 1_000_000, 110.0, "sweep"),  # 1.1x
        row("pcops_eager", 50_000, 7.0, "sweep"),  # no peer at this size: no ratio
    ]
    lines = bench.ratios(results)
    assert len(lines) == 2
    assert "n_ref=25,000" in lines[0] and "train step 1.5x" in lines[0]
    assert "n_ref=1,000,000" in lines[1] and "train step 1.1x" in lines[1]


@pytest.mark.cuda
def test_gpu_benchmark_with_the_rmm_child_reports_peaks(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(ROOT / "scripts/benchmark.py"), "--quick", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    for r in rows:
        if r["variant"] == "pcops_rmm" and r["note"].startswith("skipped"):
            pytest.skip("rmm is not installed: pip install pcops[cuda12]")
        assert r["forward_ms"] > 0 and r["peak_mem_mb"] > 0, r
    assert {r["model"] for r in rows if r["variant"] == "pcops_rmm"} == {"knn_projector", "radius_projector"}


def test_a_peer_failing_at_run_time_gets_an_empty_row_with_the_error_and_pcops_errors_are_raised():
    bench = _script("benchmark")
    fields = ("forward_ms", "train_step_ms")

    def raising(err):
        def figures():
            raise err
        return figures

    cusolver = RuntimeError("cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR, when calling `x`.\nIf you keep seeing this error")
    row = bench.measured({"variant": "pytorch3d_torch", "note": ""}, fields, raising(cusolver), peer=True)
    assert row == {"variant": "pytorch3d_torch", "forward_ms": None, "train_step_ms": None,
                   "note": "failed: cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR, when calling `x`."}
    with pytest.raises(RuntimeError, match="CUSOLVER"):  # pcops' own failure is not hidden
        bench.measured({"variant": "pcops_eager", "note": ""}, fields, raising(cusolver), peer=False)
    oom = bench.measured({"note": ""}, fields, raising(torch.OutOfMemoryError("CUDA out of memory")), peer=False)
    assert oom["forward_ms"] is None and oom["note"] == "out of memory (OutOfMemoryError)"
    missing = bench.measured({"note": ""}, fields, raising(ImportError("No module named 'open3d'")), peer=True)
    assert missing["train_step_ms"] is None and missing["note"] == "skipped: No module named 'open3d'"
    fine = bench.measured({"note": "x"}, fields, lambda: {"forward_ms": 1.5, "train_step_ms": 2.5}, peer=True)
    assert fine == {"note": "x", "forward_ms": 1.5, "train_step_ms": 2.5}


def test_the_geometry_section_goes_on_past_a_failing_peer(monkeypatch):
    """The GPU run stopped at the torch normals peer's cuSOLVER error; now its row says so and the
    section's other rows are timed."""
    bench = _script("benchmark")

    def torch_normals(points, k):
        raise RuntimeError("cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR\nmore")

    monkeypatch.setattr(bench, "torch_normals", torch_normals)
    args = bench.argparse.Namespace(quick=True, iters=1, budget=1.0)
    rows = {(r["model"], r["variant"]): r for r in bench.run_geometry(args, torch.device("cpu"))}
    failed = rows[("estimate_normals", "pytorch3d_torch")]
    assert failed["forward_ms"] is None and failed["train_step_ms"] is None
    assert failed["note"] == "failed: cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR"
    for key in (("estimate_normals", "pcops_eager"), ("radius_max", "pcops_eager"), ("radius_max", "scipy_torch")):
        assert rows[key]["forward_ms"] > 0 and rows[key]["train_step_ms"] > 0, key


def test_the_torch_normals_peer_solves_in_chunks_the_same_eigenvectors(monkeypatch):
    bench = _script("benchmark")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20, 3, 3, generator=g, dtype=torch.float64)
    cov = a @ a.transpose(1, 2)
    sizes = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda m: sizes.append(m.shape[0]) or eigh(m))
    chunked = bench.smallest_eigenvectors(cov, chunk=7)
    assert sizes == [7, 7, 6]
    sizes.clear()
    whole = bench.smallest_eigenvectors(cov)
    assert sizes == [20]
    w, v = np.linalg.eigh(cov.numpy())  # ascending eigenvalues: column 0 is the smallest's
    for got in (chunked, whole):
        cos = np.abs(np.einsum("bi,bi->b", got.numpy(), v[:, :, 0]))  # an eigenvector's sign is free
        np.testing.assert_allclose(cos, 1.0, atol=1e-12)
    sizes.clear()
    points = torch.randn(300, 3, generator=g)
    normals = bench.torch_normals(points, 16)  # the CPU path: one call, as before
    assert sizes == [300] and normals.shape == (300, 3)


def test_ratios_are_put_in_words_the_right_way_round():
    benchmark = _script("benchmark")
    assert benchmark.speed(1.25) == "1.2x faster" and benchmark.speed(0.8) == "1.2x slower"
    assert benchmark.speed(1.0, 2) == "1.00x faster" and benchmark.speed(0.5, 2) == "2.00x slower"


@pytest.mark.slow
def test_the_distributed_benchmark_runs():
    """scripts/bench_distributed.py --quick: two ranks, every op's line (slow: it spawns processes)."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench_distributed.py"), "--quick"], capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 ranks" in out and all(op in out for op in ("knn (k=16)", "radius_aggregate", "ball_query"))


def test_the_gpu_check_runs_every_section_at_tiny_sizes(tmp_path):
    """scripts/gpu_check.py's smoke run on the CPU: every measuring section writes its rows (the
    synchronisation check needs CUDA and says so), the profile and the JSON."""
    cmd = [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--out", str(tmp_path), "--device", "cpu", "--quick", "--no-tests"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["errors"] == [] and report["environment"]["torch"] == torch.__version__
    ops = {(r["section"], r["op"], r["variant"]) for r in report["rows"] if r["forward_ms"] > 0}
    for op, peer in (("chamfer_distance", "torch_cdist"), ("knn_k16", "cdist_topk"), ("farthest_point_sample", "torch_loop")):
        assert {("rows", op, "pcops"), ("rows", op, peer)} <= ops
    assert {("crossover", "knn_k3", v) for v in ("scan", "tree", "cdist_topk")} <= ops
    assert {("crossover", "ball_query_K32", v) for v in ("scan", "cells", "cdist_topk")} <= ops
    assert {("projectors", "knn_projector", "pcops_compiled"), ("large", "knn_k16", "pcops")} <= ops
    assert report["skipped"] == ["syncs: not a CUDA device"]
    assert "chamfer_distance train step" in (tmp_path / "profile.txt").read_text()


def test_the_small_clouds_busy_rows_time_quiet_and_busy_blocks_in_turns(monkeypatch):
    """bench_small's busy rows: the spinning process runs in the busy blocks only (stopped in the
    quiet ones), the blocks go quiet, busy, busy, quiet, and each figure is its blocks' mean."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    small = _script("bench_small")
    monkeypatch.setattr(small, "SETTLE", 0.05)
    blocks = []

    def state():  # the spinning process's state letter (/proc/PID/stat: R running, T stopped)
        return open(f"/proc/{spin.proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]

    def timer(fns, **kwargs):
        for fn in fns.values():
            fn()
        blocks.append(state())
        return {name: float(len(blocks)) for name in fns}

    monkeypatch.setattr(small, "median_ms", timer)
    spin = small._Spinner()
    try:
        out = small._paired({"pcops": lambda: None, "peer": lambda: None}, spin, {})
        after = state()
    finally:
        spin.close()
    assert blocks == ["T", "R", "R", "T"] and after == "T"
    assert out == {"quiet, paired": {"pcops": 2.5, "peer": 2.5}, "busy": {"pcops": 2.5, "peer": 2.5}}


def test_the_small_clouds_peers_compute_the_ops_answers(monkeypatch):
    """Each peer of bench_small's rows returns what pcops' call returns (the same neighbours,
    picks, means and losses), for the peers installed here: a ratio compares equal work."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    small = _script("bench_small")
    p = small.bench_search.cloud("uniform", 64, 0)
    # (a radius off every pair's distance: the benchmark's median distance is one, where float32
    # rounding may keep or drop that pair in a peer's ball)
    cases = small._cases(p, 64, small._radius16(p) * 1.0001, torch.Generator().manual_seed(0))

    def arrays(out):
        return [np.asarray(t) for t in (out if isinstance(out, (tuple, list)) else (out,))]

    knn = cases["knn"]
    want = knn["pcops"]()
    got = knn["torch_cdist_topk"]()
    # (cdist's matrix product rounds: the same distances, and the same indices but where it swaps near ties)
    assert torch.allclose(got.values, want.dists, atol=1e-3) and (got.indices == want.idx).double().mean() > 0.99
    for name in ("pykdtree", "cKDTree"):
        if name in knn:
            d, i = knn[name]()
            assert np.array_equal(i, want.idx.numpy()) and np.allclose(d, want.dists.numpy(), atol=1e-6), name
    if "open3d" in knn:
        assert np.array_equal(knn["open3d"]()[0].numpy(), want.idx.numpy())

    def found(idx, n=64):  # a ball's neighbours with -1 past them (cKDTree marks a missing one by n)
        idx = np.asarray(idx).astype(np.int64)
        return np.where(idx == n, -1, idx)

    for op, pcops_balls, peers in (("ball_query", lambda o: [o], lambda o: [o]), ("ball_queries", list, list)):
        want = [b.idx.numpy() for b in pcops_balls(cases[op]["pcops"]())]
        for name, fn in cases[op].items():
            got = peers(fn())
            if name == "cKDTree":
                got = [found(got[0][1])] if op == "ball_query" else [found(got[1][1]), found(got[0][1])]
            elif name == "open3d":
                got = [found(b[0].numpy()) for b in got]
            elif name != "pcops":
                got = [found(b[1]) for b in got]
            else:
                continue
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), (op, name)
    for op in ("knn_graph", "radius_graph"):
        want = sorted(map(tuple, cases[op]["pcops"]().numpy().T.tolist()))
        for name, fn in cases[op].items():
            assert sorted(map(tuple, np.asarray(fn()).T.tolist())) == want, (op, name)
    want = cases["estimate_normals"]["pcops"]().numpy()
    for name, fn in cases["estimate_normals"].items():
        assert np.all(np.abs((np.asarray(fn()) * want).sum(1)) > 0.999), name  # (a normal up to its sign)
    fps = cases["farthest_point_sample"]
    for name in ("fpsample_bucket_kdline", "fpsample_vanilla"):
        if name in fps:
            points, idx = fps[name]()
            # (fpsample 1.0.2's bucket FPS takes start_idx in its kd-tree's order: its first pick is
            # another point than asked for, and from there its picks are exact FPS's)
            want = small.pcops.farthest_point_sample(p, len(idx), start_idx=int(idx[0]))
            assert np.array_equal(idx.astype(np.int64), want.idx.numpy()) and np.array_equal(points, want.points.numpy()), name
            assert name == "fpsample_bucket_kdline" or idx[0] == 0
    for op in ("knn_aggregate", "radius_aggregate", "chamfer_distance", "knn_interpolate"):
        want = arrays(cases[op]["pcops"]())
        for name, fn in cases[op].items():
            if name != "pcops":
                assert np.allclose(np.asarray(fn(), dtype=np.float64), want[0].astype(np.float64), rtol=1e-3, atol=1e-4), (op, name)


def test_the_sampling_peers_compute_the_ops_answers(monkeypatch):
    """The sampling section's installed peers return pcops' answers on its quick inputs: FPS
    picks with their points (fpsample's bucket FPS from its own first pick), the ball query's K
    nearest within r, the graphs' edges (no self edges, as pcops' loop=False), the voxel means
    of the points and features, and the radius-search rows' K nearest within each radius (and
    their counts, where a peer returns them)."""
    import types

    bench = _script("benchmark")
    monkeypatch.setattr(bench, "_physicsnemo_radius_search", lambda *a, **k: (None, "not run here"))
    args = types.SimpleNamespace(quick=True, sweep=False, iters=1)
    rows = bench._sampling_cases(args, torch.device("cpu"), "uniform")
    by_op = {}
    for op, variant, n, fn, *_ in rows:
        if callable(fn) and variant != "pcops_calls":  # (not PhysicsNeMo's rows: timed in a process of their own)
            by_op.setdefault((op, n, *_[1:]), {})[variant] = fn

    def found(idx, n_ref):  # cKDTree marks a missing neighbour by n_ref, Open3D by -1: pcops' -1
        idx = np.asarray(idx).astype(np.int64)
        return np.where(idx == n_ref, -1, idx)

    def same_rows(a, b):  # (a peer may order two neighbours at equal float32 distances the other way)
        return a.shape == b.shape and (a == b).all(1).mean() > 0.99

    checked = 0
    for (op, *_), fns in by_op.items():
        want = fns.pop("pcops")()
        for variant, fn in fns.items():
            got = fn()
            if op == "farthest_point_sample":
                points, idx = (np.asarray(t) for t in got)
                cloud = torch.as_tensor(np.asarray(fn.__defaults__[0]))
                again = bench.pcops.farthest_point_sample(cloud, len(idx), start_idx=int(idx[0]))  # (fpsample's bucket FPS: its own start)
                assert np.array_equal(idx.astype(np.int64), again.idx.numpy()) and np.array_equal(points, again.points.numpy()), variant
            elif op.startswith("farthest_point_sample_batch"):
                assert len(got) == len(want.idx) and all(len(g) == 2 for g in got), variant  # (each cloud's points and indices)
            elif op == "ball_query":
                idx = np.where(np.isinf(got[0]), -1, got[1]) if variant == "scipy_ckdtree" else got[0].numpy()
                assert same_rows(idx.astype(np.int64), want.idx.numpy()), variant
            elif op in ("knn_graph", "radius_graph"):
                theirs = set(map(tuple, np.asarray(got).T.tolist()))
                ours = set(map(tuple, want.numpy().T.tolist()))
                assert len(theirs ^ ours) <= 4, (op, variant, len(theirs ^ ours))  # (Open3D keeps d < r: a pair at r)
            elif op == "voxel_pool":
                if variant == "open3d":
                    got = (got.point.positions.numpy(), got.point["features"].numpy())
                pts, feats = (np.asarray(t) for t in got)
                a, b = np.lexsort(pts.T[::-1]), np.lexsort(want.points.numpy().T[::-1])
                assert np.allclose(pts[a], want.points.numpy()[b], atol=1e-5), variant
                assert np.allclose(feats[a], want.features.numpy()[b], atol=1e-5), variant
            else:  # the radius-search rows: one ball or GeoTransolver's six
                wants = [want] if op.startswith("ball_query:") else list(want)
                n_ref = len(fn.__defaults__[1])
                for g, w in zip(got, wants, strict=True):
                    if variant == "scipy_ckdtree_counts":  # (the K nearest within r, and the counts)
                        g, counts = g
                        assert np.array_equal(np.asarray(counts).astype(np.int64), w.counts.numpy()), (op, variant)
                    idx = found(g[1], n_ref) if variant.startswith("scipy_ckdtree") else g[0].numpy()
                    assert same_rows(idx, w.idx.numpy()), (op, variant)
            checked += 1
    assert checked >= 3  # (the torch FPS loop and voxel rows at least, with no optional peer installed)
