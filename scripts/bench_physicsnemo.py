"""Time PhysicsNeMo's ``signed_distance_field`` and ``radius_search`` on the CPU, as a peer for
pcops' mesh-distance and ball-query benchmarks (issue #33).

This script runs in a virtual environment of its own, never in the project's: PhysicsNeMo
(pinned ``nvidia-physicsnemo==2.2.2``) pulls timm, torchvision and a multi-GB CUDA build of
torch that must not replace the project's torch. Set up once:

    python -m venv /work/pnvenv
    /work/pnvenv/bin/pip install nvidia-physicsnemo==2.2.2
    export PCOPS_PHYSICSNEMO_PYTHON=/work/pnvenv/bin/python      # set by the user

The project's benchmark spawns this file with that interpreter as a subprocess (and leaves the
PhysicsNeMo rows out where the variable is unset); it never imports this file, and this file
never imports pcops. It reads a
JSON spec (argv[1], or stdin when there is no argument), loads each case's inputs from an .npz
file, times the call (warm-up calls first: Warp compiles its kernels on the first), and prints
one JSON line:

    {"physicsnemo": "2.2.2", "warp": ..., "torch": ..., "torch_threads": n,
     "results": [{"name": ..., "median_ms": ..., "min_ms": ..., "cpu_median_ms": ...,
                  "times_ms": [...]}, ...]}

``median_ms``/``min_ms``/``times_ms``: wall time (``time.perf_counter``) of each timed call;
``cpu_median_ms``: the median of the process's CPU time per call (``time.process_time``). Each
call is timed as PhysicsNeMo's users make it: ``signed_distance_field`` builds its Warp mesh
(BVH) in every call, ``radius_search`` its hash grid. Warp's CPU kernels run on one thread; the
torch glue around them (output allocation) on torch's threads, which stall when other processes
hold the cores: on a shared 2-core machine radius_search took 3-7x longer with torch's 2 threads
than with ``"torch_threads": 1``, while signed_distance_field hardly moved.

The spec:

    {"repeats": 7, "warmup": 2, "output": "out.npz",          # output: optional
     "torch_threads": null,                                   # null: torch's default
     "cases": [
       {"name": "sdf", "op": "signed_distance_field", "input": "mesh.npz",
        "sign": "normal" | "winding",       # use_sign_winding_number False / True (DoMINO: True)
        "variant": "functional" | "mesh",   # physicsnemo.nn.functional.signed_distance_field, or
                                            # physicsnemo.mesh.spatial's wrapper (repairs
                                            # near-degenerate faces first, unbounded max_dist)
        "max_dist": null},                  # null: the function's default
       {"name": "rs", "op": "radius_search", "input": "cloud.npz", "radius": 0.1,
        "max_points": 32, "return_dists": true, "return_points": true,
        "implementation": "warp" | "torch"}]}   # null/absent: PhysicsNeMo's dispatch (warp)

Inputs (.npz): signed_distance_field reads ``vertices`` (V, 3), ``faces`` (F, 3) and ``points``
(Q, 3); radius_search reads ``points`` (N, 3) and ``queries`` (M, 3). Coordinates are passed as
float32 (PhysicsNeMo's Warp path computes in float32), faces as int32.

With ``output``, each case's results from its last timed call go to that .npz as
``<name>/<field>``: ``sdf`` (Q,) signed distance, negative inside; ``closest`` (Q, 3) the closest
point on the mesh; ``face`` (Q,) int64 face index (NaN / NaN / -1 beyond ``max_dist``);
``indices`` (M, max_points) neighbour indices within the radius, unused slots 0 (warp: int32, the
first max_points found, not the nearest; torch: int64, the nearest), with ``points``
(M, max_points, 3) and ``distances`` (M, max_points) when asked; with ``max_points`` null,
``indices`` is (2, total) (query, point) pairs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch


def _sdf_case(case: dict):
    data = np.load(case["input"])
    vertices = torch.as_tensor(np.asarray(data["vertices"], dtype=np.float32))
    faces = torch.as_tensor(np.asarray(data["faces"], dtype=np.int32))
    points = torch.as_tensor(np.asarray(data["points"], dtype=np.float32))
    winding = {"normal": False, "winding": True}[case.get("sign", "normal")]
    kwargs = {"use_sign_winding_number": winding}
    if case.get("max_dist") is not None:
        kwargs["max_dist"] = float(case["max_dist"])
    if case.get("variant", "functional") == "mesh":
        from physicsnemo.mesh import Mesh
        from physicsnemo.mesh.spatial import signed_distance_field

        mesh = Mesh(points=vertices, cells=faces.long())

        def call():
            return signed_distance_field(mesh, points, **kwargs)
    else:
        from physicsnemo.nn.functional import signed_distance_field

        def call():
            return signed_distance_field(vertices, faces, points, **kwargs)

    def fields(out):
        sdf, closest, face = out
        return {"sdf": sdf, "closest": closest, "face": face}

    return call, fields


def _radius_case(case: dict):
    from physicsnemo.nn.functional import radius_search

    data = np.load(case["input"])
    points = torch.as_tensor(np.asarray(data["points"], dtype=np.float32))
    queries = torch.as_tensor(np.asarray(data["queries"], dtype=np.float32))
    return_points = bool(case.get("return_points", True))
    return_dists = bool(case.get("return_dists", True))
    kwargs = {"max_points": case.get("max_points", 32), "return_dists": return_dists,
              "return_points": return_points}
    if case.get("implementation"):
        kwargs["implementation"] = case["implementation"]

    def call():
        return radius_search(points, queries, float(case["radius"]), **kwargs)

    def fields(out):
        # PhysicsNeMo's order: indices, then points if asked, then distances if asked.
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        named = {"indices": out.pop(0)}
        if return_points:
            named["points"] = out.pop(0)
        if return_dists:
            named["distances"] = out.pop(0)
        return named

    return call, fields


_CASES = {"signed_distance_field": _sdf_case, "radius_search": _radius_case}
PINNED = "2.2.2"  # nvidia-physicsnemo==2.2.2: the version these cases were written against


def main() -> None:
    spec = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    # Warp prints its banner and kernel-compile notes to stdout: send everything to stderr,
    # keeping the real stdout for the one JSON line.
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)
    repeats, warmup = int(spec.get("repeats", 7)), int(spec.get("warmup", 2))
    if spec.get("torch_threads"):
        torch.set_num_threads(int(spec["torch_threads"]))
    saved, results = {}, []
    for case in spec["cases"]:
        call, fields = _CASES[case["op"]](case)
        with torch.no_grad():
            for _ in range(warmup):
                call()
            times, cpu = [], []
            for _ in range(repeats):
                start, start_cpu = time.perf_counter(), time.process_time()
                out = call()
                cpu.append((time.process_time() - start_cpu) * 1e3)
                times.append((time.perf_counter() - start) * 1e3)
        name = case.get("name", case["op"])
        results.append({"name": name, "median_ms": statistics.median(times), "min_ms": min(times),
                        "cpu_median_ms": statistics.median(cpu),
                        "times_ms": [round(t, 3) for t in times]})
        for key, value in fields(out).items():
            saved[f"{name}/{key}"] = value.detach().cpu().numpy()
    if spec.get("output"):
        np.savez(spec["output"], **saved)
    import physicsnemo
    import warp

    if physicsnemo.__version__ != PINNED:
        print(f"warning: physicsnemo {physicsnemo.__version__}, not the pinned {PINNED}", file=sys.stderr)

    line = json.dumps({"physicsnemo": physicsnemo.__version__, "warp": warp.__version__,
                       "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                       "results": results})
    sys.stdout.flush()
    os.write(result_fd, (line + "\n").encode())


if __name__ == "__main__":
    main()
