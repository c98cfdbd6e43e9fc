"""scripts/benchmark.py's interpolation, Chamfer and normals rows run at tiny sizes, with their ratio lines."""

import argparse
import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_geometry_rows_time_pcops_and_each_peer(capsys):
    spec = importlib.util.spec_from_file_location("pcops_benchmark_geometry", ROOT / "scripts/benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run_geometry(argparse.Namespace(quick=True, iters=1, budget=1.0), torch.device("cpu"))
    timed = {(r["model"], r["variant"]) for r in rows if r["forward_ms"]}
    assert {("knn_interpolate", "pyg_torch"), ("chamfer_distance", "torch_cdist"), ("estimate_normals", "pytorch3d_torch")} <= timed
    assert {("radius_max", "pcops_eager"), ("radius_max", "scipy_torch")} <= timed
    assert {(op, "pcops_eager") for op in ("knn_interpolate", "chamfer_distance", "estimate_normals")} <= timed
    for r in rows:
        assert r["forward_ms"] is None or r["forward_ms"] > 0
        assert r["train_step_ms"] is None or r["train_step_ms"] > 0
    assert capsys.readouterr().out.count("faster") >= 3
