"""scripts/benchmark.py runs end to end at tiny sizes and writes the documented JSON."""

import json
import pathlib
import subprocess
import sys

import pytest

from tests import op_table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_every_variant(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "scripts/benchmark.py"), "--quick", "--sweep", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
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


def _benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pcops_benchmark", ROOT / "scripts/benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratios_compare_rows_of_the_same_sizes_only():
    bench = _benchmark_module()
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
