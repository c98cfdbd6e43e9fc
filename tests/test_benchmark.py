"""scripts/benchmark.py runs end to end at tiny sizes and writes the documented JSON."""

import json
import pathlib
import subprocess
import sys

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
