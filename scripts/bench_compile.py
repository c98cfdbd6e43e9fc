"""torch.compile as users write it: train steps of models built on pcops, eager against
``torch.compile(model)`` (default options) and ``torch.compile(model, fullgraph=True)``.

Run through ``scripts/benchmark.py --only compile`` (``--quick`` shrinks it). For each model:
the graph breaks of the default compile (Dynamo's reasons: the op each one is at), the wall
time of the first compiled step of each (compilation included), and the median train step
(forward, MSE loss, backward, Adam) of the three variants taking turns; the ratio
eager / compiled is what to read (> 1: compiling is faster).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import torch
from torch._dynamo.utils import counters

import benchmark
from bench_timer import median_ms, once_s


def _models(quick: bool):
    from models import nets
    from models.dgcnn import DGCNN
    from models.pointnet2 import PointNet2
    from models.ptv3 import PointTransformerV3

    gen = torch.Generator().manual_seed(0)
    n_knn, n_radius, grid = (4000, 2000, 8) if quick else (100_000, 25_000, 30)
    tutorial = lambda n: benchmark.tutorial_inputs(n, grid, torch.device("cpu"))  # noqa: E731
    clouds = torch.rand(8 if not quick else 2, 1024 if not quick else 256, 3, generator=gen)
    scene = torch.rand(2, 4000 if not quick else 500, 3, generator=gen)
    yield "radius_projector", lambda: nets.radius_projector(0.1, 0.1, 25), tutorial(n_radius)
    yield "knn_projector", lambda: nets.knn_projector(7, 0.1, 25), tutorial(n_knn)
    yield "pointnet2_cls", lambda: PointNet2(9), (clouds,)
    yield "dgcnn_cls", lambda: DGCNN(9, k=16), (clouds,)
    yield "ptv3_cls", lambda: PointTransformerV3(9, channels=(32, 64), depths=(1, 1), heads=(2, 4), patch=(64, 64)), (scene,)


def _reasons() -> list[str]:
    """The ops (or lines) of Dynamo's graph-break reasons so far."""
    out = []
    for reason, count in counters["graph_break"].items():
        where = reason.split("Developer debug context:")[-1].strip().splitlines()[0] if "Developer debug context:" in reason else reason.splitlines()[0]
        out.append(f"{where} x{count}")
    return out


def measure(name: str, variant: str, quick: bool) -> dict:
    """Eager against one compiled variant of one model, taking turns (in a process of its own:
    Dynamo's cache is per code object, so a second compiled copy of the same model class in the
    same process would run the first one's graphs)."""
    iters, budget = (2, 5.0) if quick else (9, 60.0)
    backend = "aot_eager" if quick else "inductor"
    make, inputs = {n: (m, i) for n, m, i in _models(quick)}[name]
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    compiled = torch.compile(make(), backend=backend, fullgraph=variant == "fullgraph")
    steps = {v: benchmark._steps(net.train(), inputs)[1] for v, net in (("eager", eager), ("compiled", compiled))}
    steps["eager"]()
    counters.clear()
    first = once_s(steps["compiled"])  # compiles
    breaks = _reasons()
    ms = median_ms(steps, repeats=iters, budget_s=budget)
    return {"model": name, "variant": variant, "backend": backend, "eager_ms": round(ms["eager"], 2),
            "compiled_ms": round(ms["compiled"], 2), "eager_over_compiled": round(ms["eager"] / ms["compiled"], 3),
            "breaks": breaks, "first_step_s": round(first, 1)}


def run(quick: bool = False) -> list[dict]:
    rows = []
    for name, _, _ in _models(quick):
        for variant in ("default", "fullgraph"):
            args = [sys.executable, __file__, name, variant] + (["--quick"] if quick else [])
            done = subprocess.run(args, capture_output=True, text=True, cwd=pathlib.Path(__file__).parent)
            if done.returncode != 0:
                raise RuntimeError(f"bench_compile {name} {variant} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(row, flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], "--quick" in sys.argv)))
