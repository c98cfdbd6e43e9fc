"""The prepared check of pcops' CUDA half (issue #44), started once on a GPU machine with pcops'
requirements installed (docs/gpu.md): the device and versions, the GPU rows against dense torch, the
search crossover, a profile of the fixed costs, which ops synchronise with the host, and
``pytest -m cuda``, each section inside its share of a wall-clock budget.

    python3 scripts/gpu_check.py --out "$OUT"                  # everything (about 4 minutes on an H200)
    python3 scripts/gpu_check.py --out /tmp/g --device cpu --quick --no-tests   # the script's smoke test

Files under ``--out``: ``check.json`` (the environment and every row, rewritten after each row,
so a run stopped early keeps what it measured), ``profile.txt`` (torch's profiler tables of a
few calls), ``cuda-tests.log`` and ``cuda-junit.xml``.

Sections (rows ``{"section", "op", "n", "variant", "forward_ms", "train_step_ms", "note"}``):

* ``crossover``: the Warp kNN search (k = 16 and 3) and the ball query (about 16 points within
  r, K = 32) at m = n from 10^3 to 6.5 x 10^4 points, forced to measure every pair (``scan``)
  or to build the tree / cell list (``tree`` / ``cells``), against dense torch (``cdist`` +
  ``topk``): where :data:`pcops._warp.CUDA_SCAN_POINTS` and ``CUDA_SCAN_PAIRS`` belong;
* ``rows``: ``chamfer_distance``, ``estimate_normals`` (k = 16), ``knn`` (k = 16),
  ``knn_interpolate`` (n queries, n / 4 points, k = 3), ``ball_query`` and
  ``farthest_point_sample`` (n / 8 picks) at 5,000, 8,192 and 32,768 points against the dense
  torch each user would write (scripts/benchmark.py's peers), forward and train step;
* ``large``: ``knn`` 10^6 x 10^6 (k = 16), ``estimate_normals`` at 10^5 against torch;
* ``projectors``: the tutorial's kNN and radius projectors, eager and ``torch.compile`` (default);
* ``syncs``: each op of the op table (tests/op_table.py) on CUDA inputs with ``validate=False``
  under ``torch.cuda.set_sync_debug_mode("error")``: the first synchronising call, or none;
* ``tests``: ``pytest -m cuda`` (pytest-xdist workers when installed).

Times are medians between CUDA events (scripts/bench_timer.py), pcops and its peer taking turns.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

import benchmark  # noqa: E402  the peers: cdist_chamfer, torch_normals, pyg_knn_interpolate, the projectors
import pcops  # noqa: E402
from bench_timer import median_ms  # noqa: E402
from pcops import _warp  # noqa: E402

ROW_SIZES = (5_000, 8_192, 32_768)
CROSSOVER_SIZES = (1_024, 4_096, 8_192, 16_384, 32_768, 65_536)
QUICK_SIZES = (500, 1_000)


class Check:
    """The run's report: rows appended and the JSON rewritten after each, within a deadline."""

    def __init__(self, out: pathlib.Path, budget_s: float, device, quick: bool):
        self.out, self.start, self.budget_s, self.device, self.quick = out, time.perf_counter(), budget_s, device, quick
        self.report = {"environment": environment(device), "rows": [], "syncs": {}, "skipped": [], "errors": []}
        self.save()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def save(self) -> None:
        (self.out / "check.json").write_text(json.dumps(self.report, indent=1, default=str))

    def time(self, section: str, op: str, n: int, fns: dict, losses: dict | None = None, note: str = "") -> None:
        """Forward (no grad) of each of ``fns`` and, where ``losses`` has one, its train step
        (loss().backward()), all taking turns; one row per variant."""
        iters = 2 if self.quick else 7
        budget = 2.0 if self.quick else 6.0
        try:
            with torch.no_grad():
                fwd = median_ms(fns, repeats=iters, budget_s=budget, device=self.device)
            steps = {}
            if losses:
                steps = median_ms({v: (lambda f=f: f().backward()) for v, f in losses.items()}, repeats=iters, budget_s=budget, device=self.device)
        except Exception as err:  # a failing row is reported, the run goes on
            self.report["errors"].append({"section": section, "op": op, "n": n, "error": f"{type(err).__name__}: {str(err)[:300]}",
                                          "where": traceback.format_exc(limit=-3)[-800:]})
            print(f"{section} {op} n={n}: {type(err).__name__}: {str(err)[:200]}", flush=True)
            self.save()
            return
        for variant, ms in fwd.items():
            row = {"section": section, "op": op, "n": n, "variant": variant, "forward_ms": round(ms, 4),
                   "train_step_ms": round(steps[variant], 4) if variant in steps else None, "note": note}
            self.report["rows"].append(row)
            step = f" train step {row['train_step_ms']:.3f} ms" if row["train_step_ms"] is not None else ""
            print(f"{section:<10} {op:<22} n={n:<8} {variant:<12} forward {ms:8.3f} ms{step} {note}", flush=True)
        self.save()


def environment(device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "host_cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    for name in ("warp-lang", "cupy-cuda13x", "cupy-cuda12x", "rmm-cu13", "rmm-cu12", "cuml-cu13", "cuml-cu12", "trimesh", "scipy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[name] = importlib.metadata.version(name)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.strip()
    env["commit"] = os.environ.get("PCOPS_COMMIT") or _git_commit()
    return env


def _git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    return "unknown"


def uniform(n: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, generator=gen) * 2 - 1).to(device)


@contextlib.contextmanager
def cuda_scan(every_pair: bool):
    """Every pair measured (True) or the tree / cell list (False), whatever the sizes."""
    saved = _warp.CUDA_SCAN_POINTS, _warp.CUDA_SCAN_PAIRS
    _warp.CUDA_SCAN_POINTS, _warp.CUDA_SCAN_PAIRS = (1 << 62, 1 << 62) if every_pair else (0, 0)
    try:
        yield
    finally:
        _warp.CUDA_SCAN_POINTS, _warp.CUDA_SCAN_PAIRS = saved


def switched(fn, every_pair: bool):
    def call():
        with cuda_scan(every_pair):
            return fn()
    return call


def ball_radius(n: int) -> float:
    """The radius holding about 16 of n uniform points in [-1, 1]^3 (away from the faces)."""
    return (16 * 8 / (n * 4 / 3 * math.pi)) ** (1 / 3)


def dense_ball_query(q, p, radius: float, cap: int):
    """The K closest within r in dense torch: cdist, topk, a mask."""
    d, idx = torch.cdist(q, p).topk(min(cap, p.shape[0]), dim=1, largest=False)
    inside = d <= radius
    return torch.where(inside, d, float("inf")), torch.where(inside, idx, -1)


def dense_knn(q, p, k: int):
    d, idx = torch.cdist(q, p).topk(k, dim=1, largest=False)
    return d, idx


def torch_fps(points, picks: int):
    """Farthest point sampling as users write it in torch: a few tensor ops per pick."""
    dist = torch.full((points.shape[0],), float("inf"), device=points.device)
    picked = torch.zeros(picks, dtype=torch.int64, device=points.device)
    for t in range(1, picks):
        dist = torch.minimum(dist, (points - points[picked[t - 1]]).square().sum(1))
        picked[t] = dist.argmax()
    return picked


def crossover(check: Check) -> None:
    dev = check.device
    sizes = QUICK_SIZES if check.quick else CROSSOVER_SIZES
    for n in sizes:
        if check.left() < 0:
            check.report["skipped"].append(f"crossover from n={n}")
            return
        q, p = uniform(n, 1, dev), uniform(n, 2, dev)
        for k in (16, 3):
            search = lambda: pcops.knn(q, p, k, backend="warp", validate=False)  # noqa: E731
            check.time("crossover", f"knn_k{k}", n, {"scan": switched(search, True), "tree": switched(search, False),
                                                     "cdist_topk": lambda: dense_knn(q, p, k)})
        r = ball_radius(n)
        ball = lambda: pcops.ball_query(q, p, r, 32, validate=False)  # noqa: E731
        check.time("crossover", "ball_query_K32", n, {"scan": switched(ball, True), "cells": switched(ball, False),
                                                      "cdist_topk": lambda: dense_ball_query(q, p, r, 32)}, note=f"r={r:.4g}")


def rows(check: Check) -> None:
    dev = check.device
    for n in QUICK_SIZES if check.quick else ROW_SIZES:
        if check.left() < 0:
            check.report["skipped"].append(f"rows from n={n}")
            return
        x, y = uniform(n, 3, dev).requires_grad_(), uniform(n, 4, dev)
        ours = lambda: pcops.chamfer_distance(x, y, validate=False)  # noqa: E731
        peer = lambda: benchmark.cdist_chamfer(x, y)  # noqa: E731
        check.time("rows", "chamfer_distance", n, {"pcops": ours, "torch_cdist": peer}, {"pcops": ours, "torch_cdist": peer})

        pts = uniform(n, 5, dev).requires_grad_()
        ours = lambda: pcops.estimate_normals(pts, 16, validate=False)  # noqa: E731
        peer = lambda: benchmark.torch_normals(pts, 16)  # noqa: E731
        check.time("rows", "estimate_normals_k16", n, {"pcops": ours, "pytorch3d_torch": peer},
                   {"pcops": lambda: ours()[:, 0].sum(), "pytorch3d_torch": lambda: peer()[:, 0].sum()})

        q = uniform(n, 6, dev).requires_grad_()
        ours = lambda: pcops.knn(q, q, 16, validate=False).dists  # noqa: E731
        peer = lambda: dense_knn(q, q, 16)[0]  # noqa: E731
        check.time("rows", "knn_k16", n, {"pcops": ours, "cdist_topk": peer},
                   {"pcops": lambda: ours().sum(), "cdist_topk": lambda: peer().sum()})

        coarse = uniform(n // 4, 7, dev)
        feats = torch.rand(n // 4, 64, device=dev, requires_grad=True)
        dense = uniform(n, 8, dev)
        ours = lambda: pcops.knn_interpolate(dense, coarse, feats, 3, validate=False)  # noqa: E731
        peer = lambda: benchmark.pyg_knn_interpolate(dense, coarse, feats, 3)  # noqa: E731
        check.time("rows", "knn_interpolate_k3", n, {"pcops": ours, "pyg_torch": peer},
                   {"pcops": lambda: ours().square().mean(), "pyg_torch": lambda: peer().square().mean()}, note="n queries, n/4 points, C=64")

        r = ball_radius(n)
        b = uniform(n, 9, dev)
        check.time("rows", "ball_query_K32", n, {"pcops": lambda: pcops.ball_query(b, b, r, 32, validate=False),
                                                 "cdist_topk": lambda: dense_ball_query(b, b, r, 32)}, note=f"r={r:.4g}")

        picks = n // 8
        f = uniform(n, 10, dev)
        check.time("rows", "farthest_point_sample", n, {"pcops": lambda: pcops.farthest_point_sample(f, picks, validate=False),
                                                        "torch_loop": lambda: torch_fps(f, picks)}, note=f"S={picks}")


def large(check: Check) -> None:
    dev = check.device
    n = 2_000 if check.quick else 1_000_000
    if check.left() < 0:
        check.report["skipped"].append("large")
        return
    p, q = uniform(n, 11, dev), uniform(n, 12, dev)
    check.time("large", "knn_k16", n, {"pcops": lambda: pcops.knn(q, p, 16, validate=False)}, note="m = n")
    m = 2_000 if check.quick else 100_000
    pts = uniform(m, 13, dev)
    check.time("large", "estimate_normals_k16", m, {"pcops": lambda: pcops.estimate_normals(pts, 16, validate=False),
                                                   "pytorch3d_torch": lambda: benchmark.torch_normals(pts, 16)})


def projectors(check: Check) -> None:
    dev = check.device
    grid = 6 if check.quick else 30
    for kind, n_ref in (("knn_projector", 2_000 if check.quick else 100_000), ("radius_projector", 2_000 if check.quick else 25_000)):
        if check.left() < 0:
            check.report["skipped"].append(kind)
            return
        points, queries = benchmark.tutorial_inputs(n_ref, grid, dev)
        make = (lambda: benchmark.knn_projector(7, 0.1, 25)) if kind == "knn_projector" else (lambda: benchmark.radius_projector(0.1, 0.1, 25))
        torch.manual_seed(0)
        nets = {"pcops_eager": make().to(dev)}
        torch.manual_seed(0)
        nets["pcops_compiled"] = torch.compile(make().to(dev))
        forwards, steps = {}, {}
        for variant, net in nets.items():
            forwards[variant], steps[variant] = benchmark._steps(net, (points, queries))
        try:
            with torch.no_grad():
                fwd = median_ms(forwards, repeats=7, budget_s=10.0, device=dev)
            train = median_ms(steps, repeats=7, budget_s=10.0, device=dev)
        except Exception as err:
            check.report["errors"].append({"section": "projectors", "op": kind, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            continue
        for variant in nets:
            row = {"section": "projectors", "op": kind, "n": n_ref, "variant": variant, "forward_ms": round(fwd[variant], 4),
                   "train_step_ms": round(train[variant], 4), "note": f"{grid}^3 queries, default torch.compile"}
            check.report["rows"].append(row)
            print(f"projectors {kind:<22} n={n_ref:<8} {variant:<14} forward {fwd[variant]:8.3f} ms train step {train[variant]:8.3f} ms", flush=True)
        check.save()


def profile(check: Check) -> None:
    """torch.profiler tables of a few calls at the sizes where fixed costs showed (8,192 / 5,000 points)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev = check.device
    n = 1_000 if check.quick else 8_192
    x, y = uniform(n, 3, dev).requires_grad_(), uniform(n, 4, dev)
    pts = uniform(5_000 if not check.quick else 1_000, 5, dev)
    b = uniform(n, 9, dev)
    calls = {
        "chamfer_distance train step": lambda: pcops.chamfer_distance(x, y, validate=False).backward(),
        "estimate_normals forward": lambda: pcops.estimate_normals(pts, 16, validate=False),
        "ball_query forward": lambda: pcops.ball_query(b, b, ball_radius(n), 32, validate=False),
        "knn tree forward (forced)": switched(lambda: pcops.knn(b, b, 16, backend="warp", validate=False), False),
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    with open(check.out / "profile.txt", "w") as out:
        for name, fn in calls.items():
            fn()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            with torch_profile(activities=activities) as prof:
                for _ in range(3):
                    fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            events = prof.key_averages()
            out.write(f"==== {name} (n = {n}), 3 calls\n")
            out.write(events.table(sort_by=sort, row_limit=25, max_name_column_width=60) + "\n")
            out.write(events.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60) + "\n")
            out.flush()


def syncs(check: Check) -> None:
    """{op: None or the first synchronising operation's message} over the op table, on CUDA."""
    from tests import op_table
    from tests.test_host_reads import first_sync

    if check.device.type != "cuda":
        check.report["skipped"].append("syncs: not a CUDA device")
        return
    for op in op_table.OPS:
        try:
            check.report["syncs"][op.name] = first_sync(op)
        except Exception as err:
            check.report["syncs"][op.name] = f"call failed: {type(err).__name__}: {str(err)[:200]}"
        print(f"syncs {op.name}: {check.report['syncs'][op.name]}", flush=True)
    check.save()


def tests(check: Check, timeout_s: float) -> None:
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={check.out / 'cuda-junit.xml'}"]
    with contextlib.suppress(ImportError):
        import xdist  # noqa: F401

        command += ["-n", str(min(12, os.cpu_count() or 1))]
    with open(check.out / "cuda-tests.log", "w") as log:
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=max(timeout_s, 10))
            check.report["tests"] = {"command": " ".join(command[1:]), "returncode": done.returncode}
        except subprocess.TimeoutExpired:
            check.report["tests"] = {"command": " ".join(command[1:]), "returncode": None, "note": f"stopped after {timeout_s:.0f} s"}
    tail = (check.out / "cuda-tests.log").read_text().strip().splitlines()[-1:]
    check.report["tests"]["summary"] = tail[0] if tail else ""
    print("tests:", check.report["tests"], flush=True)
    check.save()


SECTIONS = {"rows": rows, "crossover": crossover, "profile": profile, "syncs": syncs, "large": large, "projectors": projectors}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the results (the device machine's $OUT)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test of the script)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for the measuring sections together")
    parser.add_argument("--tests-timeout", type=float, default=180.0, help="seconds for pytest -m cuda")
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--only", action="append", choices=sorted(SECTIONS))
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    check = Check(out, args.budget, device, args.quick)
    print(json.dumps(check.report["environment"], indent=1), flush=True)
    for name, section in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        began = time.perf_counter()
        try:
            section(check)
        except Exception as err:
            check.report["errors"].append({"section": name, "error": f"{type(err).__name__}: {str(err)[:300]}",
                                           "where": traceback.format_exc(limit=-4)[-1200:]})
            print(f"section {name} failed: {type(err).__name__}: {err}", flush=True)
        check.report.setdefault("section_s", {})[name] = round(time.perf_counter() - began, 1)
        check.save()
    if not args.no_tests:
        tests(check, args.tests_timeout)
    return check.report


if __name__ == "__main__":
    main()
