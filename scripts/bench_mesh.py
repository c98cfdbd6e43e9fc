"""Mesh benchmarks (issue #33): ``pcops.mesh_distance``, ``pcops.mesh_bvh`` and
``pcops.point_mesh_face_distance`` against Open3D, trimesh, PhysicsNeMo and a dense torch loss;
``pcops.marching_cubes`` against scikit-image and PyMCubes.

Run through ``scripts/benchmark.py --only mesh`` (``--quick`` shrinks it), or alone:
``python scripts/bench_mesh.py [--quick]``. CPU only. Rows are medians of interleaved turns
(``bench_timer.median_ms``: the functions take turns, each timed on its second call); the ratio
peer / pcops is what to read (> 1: pcops is faster).

Meshes: the pyvista wheel's airplane (2,452 faces), ant (912) and nut (1,046)
(``bench_meshes.py``; airplane is open), centred and scaled to [-1, 1], and ``icosphere``: a
5,120-face icosphere with its vertices moved radially by up to +-15% (the op table's
``mesh_distance`` builder). Queries are uniform in the mesh's box enlarged by 10% of its size on
every side, float32.

* ``mesh_distance`` at 10^4, 10^5 and 10^6 queries, three variants. pcops: ``pcops.mesh_distance(q,
  v, f)`` (``pcops``: the hierarchy built in the call) and ``pcops.mesh_distance(q, bvh)``
  (``pcops_prebuilt``: ``bvh = pcops.mesh_bvh(v, f)`` kept, as DoMINO queries a fixed mesh);
  unsigned and ``signed=True``; the closest-point variant is the unsigned call (it returns the
  closest points). Open3D: a ``RaycastingScene`` built once (``add_triangles``, its BVH built by
  a first query), ``compute_distance`` / ``compute_signed_distance`` (ray parity) /
  ``compute_closest_points``, ``nthreads=0`` (all cores). trimesh (at 10^4 queries only: it
  is slow): ``trimesh.proximity.closest_point`` (unsigned and closest point) and
  ``signed_distance`` on a ``Trimesh`` kept between calls (its tree cached). These run
  interleaved in one ``median_ms``. Open3D and trimesh keep their structures, so they compare
  with ``pcops_prebuilt`` (the ``vs`` field of a row). PhysicsNeMo 2.2.2's
  ``signed_distance_field`` (winding-number sign, as DoMINO calls it, and its normal sign)
  builds its Warp mesh in every call: it compares with ``pcops``. It runs through
  ``scripts/bench_physicsnemo.py`` in the interpreter of ``PCOPS_PHYSICSNEMO_PYTHON``, right
  after the in-process turns on the same inputs (written to .npz); left out with a note where
  the variable is unset, and in ``--quick``.
* ``mesh_agreement``: per mesh and size, the largest |pcops - peer| of the unsigned distance
  (|sdf| for PhysicsNeMo), the fraction of queries whose sign differs from pcops' (inside =
  negative), and for up to 200 of those queries the exact winding number (a dense float64 sum
  of solid angles, ``tests.reference.winding_number``): ``pcops_right`` counts those where
  pcops' sign is the exact winding number's (inside: w >= 1/2), ``near_half`` those with
  |w - 1/2| < 0.1 (where the fast winding number may go either way). The ``exact`` peer checks
  pcops' sign on 200 random queries.
* ``point_mesh_face_distance``: 2,000 points (sampled on the mesh's surface, noise 0.02)
  against the same loss written densely in torch with PyTorch3D's semantics ((P, F) squared
  point-triangle distances from matrix products, min over faces and over points, means),
  forward and forward + backward (gradients to points and vertices).
* ``mesh_bvh``: ``pcops.mesh_bvh(v, f)`` against an Open3D scene's build (``RaycastingScene()``,
  ``add_triangles`` and a first one-point query, which builds its BVH).
* ``marching_cubes``: ``pcops.marching_cubes(volume, 0.0, validate=False)`` against
  scikit-image's ``measure.marching_cubes`` (Lewiner's method, its default, and Lorensen's),
  PyMCubes' ``mcubes.marching_cubes`` and PyTorch3D's C++ CPU marching cubes (what
  ``pytorch3d.ops.marching_cubes`` runs on a CPU volume; ``bench_pytorch3d.py``: an installed
  pytorch3d, or its source built from ``PCOPS_PYTORCH3D_SRC``), on float32 grids of 128^3 and 256^3 values (64^3 in
  ``--quick``): a bumpy sphere's signed distance, and at 128^3 the airplane's signed distance
  (``pcops.mesh_distance`` on the grid, in [-1.1, 1.1]^3).

Threads: pcops runs on torch's threads, Open3D on all cores, trimesh and PhysicsNeMo's Warp CPU
kernels on one. Turns: 3 (2 at 10^6 queries; PhysicsNeMo: 3 timed calls after its warm-up), 5 for
the loss, 7 for the build. The first note row gives the CPU and the load average at the start and
the end of the section; each timed row has the 1-minute load average after its turns (``load``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_meshes  # noqa: E402
import bench_pytorch3d  # noqa: E402
import pcops  # noqa: E402
from bench_timer import median_ms  # noqa: E402
from tests.op_table import BY_NAME  # noqa: E402
from tests.reference import winding_number  # noqa: E402

SYNTHETIC = "icosphere"
CHECKED = 200  # disagreeing queries checked against the exact winding number


def cpu_model() -> str:
    """The CPU's model name as lscpu gives it (else /proc/cpuinfo's)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def load_mesh(name: str, faces: int = 5120) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 vertices (V, 3) and int64 faces (F, 3): a real mesh centred and scaled to [-1, 1],
    or the op table's perturbed icosphere."""
    if name == SYNTHETIC:
        inp = BY_NAME["mesh_distance"].inputs(0, n=1, faces=faces, dtype=torch.float32)
        return inp["vertices"], inp["faces"]
    m = bench_meshes.mesh(name)
    v = np.asarray(m.vertices, dtype=np.float64)
    v -= (v.max(0) + v.min(0)) / 2
    v /= np.abs(v).max()
    return torch.from_numpy(v.astype(np.float32)), torch.from_numpy(np.asarray(m.faces, dtype=np.int64))


def queries(vertices: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n float32 points uniform in the vertices' box enlarged by 10% of its size per side."""
    lo, hi = vertices.amin(0).double(), vertices.amax(0).double()
    pad = 0.1 * (hi - lo)
    u = torch.rand(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (lo - pad + u * (hi - lo + 2 * pad)).float()


def _load() -> float:
    """The 1-minute load average now (the machine may be shared: a row's ``load`` says how busy)."""
    return round(os.getloadavg()[0], 2)


def _interleaved(fns: dict, repeats: int, budget_s: float = float("inf")) -> dict:
    return {name: round(ms, 3) for name, ms in median_ms(fns, repeats=repeats, budget_s=budget_s).items()}


# ----------------------------------------------------------------------------------------------
# PhysicsNeMo in its own interpreter


def physicsnemo_run(arrays: dict, cases: list[dict], repeats: int, warmup: int, fields: tuple = ()) -> tuple:
    """``scripts/bench_physicsnemo.py`` run by the interpreter ``PCOPS_PHYSICSNEMO_PYTHON`` names
    (PhysicsNeMo's own virtual environment) on ``cases`` (its spec's cases, each reading the
    .npz of ``arrays``, {name: NumPy array}): (its JSON result, {"<case>/<field>": array} for
    ``fields`` of each case's last call), or (None, why) where the variable is unset or the run
    fails."""
    python = os.environ.get("PCOPS_PHYSICSNEMO_PYTHON")
    if not python:
        return None, "PCOPS_PHYSICSNEMO_PYTHON is unset (scripts/bench_physicsnemo.py)"
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = pathlib.Path(tmp, "inputs.npz"), pathlib.Path(tmp, "out.npz")
        np.savez(inp, **arrays)
        spec = {"repeats": repeats, "warmup": warmup, "cases": [{**case, "input": str(inp)} for case in cases]}
        if fields:
            spec["output"] = str(out)
        done = subprocess.run([python, str(ROOT / "scripts/bench_physicsnemo.py"), json.dumps(spec)],
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            return None, f"PhysicsNeMo failed: {done.stderr.strip()[-500:]}"
        result = json.loads(done.stdout.strip().splitlines()[-1])
        saved = {}
        if fields:
            with np.load(out) as data:
                saved = {f"{case['name']}/{field}": np.asarray(data[f"{case['name']}/{field}"]) for case in cases for field in fields}
    return result, saved


def physicsnemo(v, f, q, repeats: int, warmup: int) -> tuple[dict, dict, str]:
    """PhysicsNeMo's signed_distance_field (winding and normal sign) on these inputs in a
    subprocess: ({variant: median ms}, {variant: sdf (Q,)}, note); empty where it cannot run."""
    cases = [{"name": f"physicsnemo_{sign}", "op": "signed_distance_field", "sign": sign} for sign in ("winding", "normal")]
    result, saved = physicsnemo_run({"vertices": v.numpy(), "faces": f.numpy().astype(np.int32), "points": q.numpy()}, cases,
                                    repeats, warmup, fields=("sdf",))
    if result is None:
        return {}, {}, f"PhysicsNeMo rows left out: {saved}"
    ms = {r["name"]: round(r["median_ms"], 3) for r in result["results"]}
    sdf = {name: torch.from_numpy(saved[f"{name}/sdf"]) for name in ms}
    return ms, sdf, f"physicsnemo {result['physicsnemo']}, warp {result['warp']}, torch {result['torch']}"


# ----------------------------------------------------------------------------------------------
# mesh_distance against Open3D, trimesh and PhysicsNeMo


def _agreement(mesh, faces, n, peer, q, v, f, ours_unsigned, ours_signed, theirs_unsigned, theirs_inside, seed) -> dict:
    """How a peer's distances and signs compare with pcops', and who is right where signs differ."""
    row = {"bench": "mesh_agreement", "mesh": mesh, "faces": faces, "queries": n, "peer": peer}
    if theirs_unsigned is not None:
        row["max_abs_diff"] = float((ours_unsigned.double() - theirs_unsigned.double()).abs().max())
    if theirs_inside is not None:
        differ = torch.nonzero((ours_signed < 0) != theirs_inside).flatten()
        row["sign_disagree"] = differ.numel() / n
        pick = differ[torch.randperm(differ.numel(), generator=torch.Generator().manual_seed(seed))[:CHECKED]]
        w = winding_number(q[pick], v, f)
        row["checked"] = int(pick.numel())
        row["pcops_right"] = int(((ours_signed[pick] < 0) == (w >= 0.5)).sum())
        row["near_half"] = int(((w - 0.5).abs() < 0.1).sum())
    return row


def _exact_check(mesh, faces, n, q, v, f, ours_signed, seed) -> dict:
    """pcops' sign against the exact winding number on CHECKED random queries."""
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:CHECKED]
    w = winding_number(q[pick], v, f)
    return {"bench": "mesh_agreement", "mesh": mesh, "faces": faces, "queries": n, "peer": "exact",
            "sign_disagree": float(((ours_signed[pick] < 0) != (w >= 0.5)).double().mean()), "checked": int(pick.numel()),
            "pcops_right": int(((ours_signed[pick] < 0) == (w >= 0.5)).sum()), "near_half": int(((w - 0.5).abs() < 0.1).sum())}


def _open3d():
    """open3d, or None where it is not installed (a benchmark-only extra: open3d-cpu)."""
    try:
        import open3d
    except ImportError:
        return None
    return open3d


def run_distance(mesh: str, v, f, n: int, repeats: int, budget_s: float, with_trimesh: bool, with_physicsnemo: bool,
                 notes: list) -> list[dict]:
    o3d = _open3d()
    faces = int(f.shape[0])
    seed = 1000 * faces + n % 997
    q = queries(v, n, seed)
    bvh = pcops.mesh_bvh(v, f)
    fns = {
        "pcops_unsigned": lambda: pcops.mesh_distance(q, v, f),
        "pcops_unsigned_prebuilt": lambda: pcops.mesh_distance(q, bvh),
        "pcops_signed": lambda: pcops.mesh_distance(q, v, f, signed=True),
        "pcops_signed_prebuilt": lambda: pcops.mesh_distance(q, bvh, signed=True),
    }
    if o3d is not None:
        scene = o3d.t.geometry.RaycastingScene()
        scene.add_triangles(o3d.core.Tensor(v.numpy()), o3d.core.Tensor(f.numpy().astype(np.uint32)))
        qo = o3d.core.Tensor(q.numpy())
        scene.compute_distance(qo[:1], nthreads=0)  # builds the scene's BVH: kept, as users keep the scene
        fns["open3d_unsigned"] = lambda: scene.compute_distance(qo, nthreads=0)
        fns["open3d_signed"] = lambda: scene.compute_signed_distance(qo, nthreads=0)
        fns["open3d_closest"] = lambda: scene.compute_closest_points(qo, nthreads=0)
    if with_trimesh:
        import trimesh

        tm = trimesh.Trimesh(v.numpy(), f.numpy(), process=False)
        qn = q.numpy()
        fns["trimesh_closest"] = lambda: trimesh.proximity.closest_point(tm, qn)
        fns["trimesh_signed"] = lambda: trimesh.proximity.signed_distance(tm, qn)
    with torch.no_grad():
        ms = _interleaved(fns, repeats, budget_s)
        ours_u = pcops.mesh_distance(q, bvh)
        ours_s = pcops.mesh_distance(q, bvh, signed=True).dists
    pn_ms, pn_sdf = {}, {}
    if with_physicsnemo:
        pn_ms, pn_sdf, note = physicsnemo(v, f, q, repeats=max(3, repeats), warmup=1 if n >= 10**6 else 2)
        if note not in notes:
            notes.append(note)

    base = {"bench": "mesh_distance", "mesh": mesh, "faces": faces, "queries": n}
    ours = {"unsigned": ("pcops_unsigned", "pcops_unsigned_prebuilt"), "signed": ("pcops_signed", "pcops_signed_prebuilt"),
            "closest": ("pcops_unsigned", "pcops_unsigned_prebuilt")}
    peers = {"unsigned": {"open3d": "open3d_unsigned", "trimesh": "trimesh_closest"},
             "signed": {"open3d": "open3d_signed", "trimesh": "trimesh_signed"},
             "closest": {"open3d": "open3d_closest", "trimesh": "trimesh_closest"}}
    rows = []
    for variant, (built, prebuilt) in ours.items():
        times = {"pcops": ms[built], "pcops_prebuilt": ms[prebuilt]}
        vs = {}
        for peer, key in peers[variant].items():
            if key in ms:
                times[peer], vs[peer] = ms[key], "pcops_prebuilt"
        if variant == "signed":
            for name, t in pn_ms.items():
                times[name], vs[name] = t, "pcops"
        rows.append({**base, "variant": variant, "ms": times, "vs": vs, "load": _load()})

    # agreement, from one more call of each (outside the timing)
    rows.append(_exact_check(mesh, faces, n, q, v, f, ours_s, seed + 1))
    if o3d is not None:
        o3d_u = torch.from_numpy(scene.compute_distance(qo, nthreads=0).numpy())
        o3d_s = torch.from_numpy(scene.compute_signed_distance(qo, nthreads=0).numpy())
        o3d_c = torch.from_numpy(scene.compute_closest_points(qo, nthreads=0)["points"].numpy())
        row = _agreement(mesh, faces, n, "open3d", q, v, f, ours_u.dists, ours_s, o3d_u, o3d_s < 0, seed + 2)
        row["max_closest_gap"] = float(((q - o3d_c).norm(dim=-1).double() - ours_u.dists.double()).abs().max())
        rows.append(row)
    if with_trimesh:
        _, tm_d, _ = trimesh.proximity.closest_point(tm, qn)
        tm_s = trimesh.proximity.signed_distance(tm, qn)  # positive inside
        rows.append(_agreement(mesh, faces, n, "trimesh", q, v, f, ours_u.dists, ours_s, torch.from_numpy(np.asarray(tm_d)),
                               torch.from_numpy(np.asarray(tm_s)) > 0, seed + 3))
    for k, (name, sdf) in enumerate(pn_sdf.items()):
        rows.append(_agreement(mesh, faces, n, name, q, v, f, ours_u.dists, ours_s, sdf.abs(), sdf < 0, seed + 4 + k))
    return rows


# ----------------------------------------------------------------------------------------------
# point_mesh_face_distance against the dense loss in torch


def dense_point_face_sq(points: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
    """(P, F) squared distances from points to triangles in torch, from (P, F) matrix products:
    the plane's distance where the point projects inside the triangle, else the nearest edge's."""
    a, b, c = (vertices[faces[:, k]] for k in range(3))
    n = torch.linalg.cross(b - a, c - a, dim=-1)
    nn = (n * n).sum(-1)
    flat = nn > 0
    pp = (points * points).sum(-1, keepdim=True)

    def edge(x0, x1):
        e = x1 - x0
        ee = (e * e).sum(-1)
        pe = points @ e.T - (x0 * e).sum(-1)  # (p - x0) . e
        t = (pe / torch.where(ee > 0, ee, 1)).clamp(0, 1)
        d0 = pp - 2 * points @ x0.T + (x0 * x0).sum(-1)  # |p - x0|^2
        return (d0 - 2 * t * pe + t * t * ee).clamp_min(0)

    edges = torch.minimum(torch.minimum(edge(a, b), edge(b, c)), edge(c, a))
    inside = flat
    for x0, x1 in ((a, b), (b, c), (c, a)):  # (p - x0) . (n x e) >= 0 on every edge
        m = torch.linalg.cross(n, x1 - x0, dim=-1)
        inside = inside & (points @ m.T - (x0 * m).sum(-1) >= 0)
    plane = (points @ n.T - (a * n).sum(-1)).square() / torch.where(flat, nn, 1)
    return torch.where(inside, torch.minimum(plane, edges), edges)


def dense_point_mesh_face_distance(points, vertices, faces) -> torch.Tensor:
    """PyTorch3D's point_mesh_face_distance for one mesh and one cloud, densely."""
    d = dense_point_face_sq(points, vertices, faces)
    return d.amin(1).mean() + d.amin(0).mean()


def run_loss(mesh: str, v, f, n: int, repeats: int) -> list[dict]:
    import trimesh

    tm = trimesh.Trimesh(v.numpy(), f.numpy(), process=False)
    pts, _ = trimesh.sample.sample_surface(tm, n, seed=5)
    g = torch.Generator().manual_seed(6)
    points = (torch.from_numpy(np.asarray(pts, dtype=np.float32)) + 0.02 * torch.randn(n, 3, generator=g))
    base = {"bench": "point_mesh_face_distance", "mesh": mesh, "faces": int(f.shape[0]), "points": n}
    with torch.no_grad():
        ours, dense = pcops.point_mesh_face_distance(points, v, f), dense_point_mesh_face_distance(points, v, f)
        rel = float((ours.double() - dense.double()).abs() / dense.double().abs())
        ms = _interleaved({"pcops": lambda: pcops.point_mesh_face_distance(points, v, f),
                           "torch_dense": lambda: dense_point_mesh_face_distance(points, v, f)}, repeats)
    rows = [{**base, "pass": "forward", "ms": ms, "rel_diff": rel, "load": _load()}]
    p, vv = points.clone().requires_grad_(), v.clone().requires_grad_()
    ms = _interleaved({"pcops": lambda: pcops.point_mesh_face_distance(p, vv, f).backward(),
                       "torch_dense": lambda: dense_point_mesh_face_distance(p, vv, f).backward()}, repeats)
    rows.append({**base, "pass": "forward_backward", "ms": ms, "rel_diff": rel, "load": _load()})
    return rows


# ----------------------------------------------------------------------------------------------
# mesh_bvh against Open3D's scene build


def run_build(mesh: str, v, f, repeats: int) -> dict:
    o3d = _open3d()
    if o3d is None:
        return {"bench": "mesh_bvh", "mesh": mesh, "faces": int(f.shape[0]), "ms": _interleaved({"pcops": lambda: pcops.mesh_bvh(v, f)}, repeats)}
    vo, fo = o3d.core.Tensor(v.numpy()), o3d.core.Tensor(f.numpy().astype(np.uint32))
    one = o3d.core.Tensor(np.zeros((1, 3), np.float32))

    def scene():
        s = o3d.t.geometry.RaycastingScene()
        s.add_triangles(vo, fo)
        return s.compute_distance(one, nthreads=0)

    ms = _interleaved({"pcops": lambda: pcops.mesh_bvh(v, f), "open3d": scene}, repeats)
    return {"bench": "mesh_bvh", "mesh": mesh, "faces": int(f.shape[0]), "ms": ms, "load": _load()}


# ----------------------------------------------------------------------------------------------
# marching_cubes against scikit-image (Lewiner's, its default, and Lorensen's) and PyMCubes


def bumpy_sphere(n: int) -> torch.Tensor:
    """(n, n, n) float32 values on [-1, 1]^3: a sphere's signed distance (radius 0.7) with a
    bump of amplitude 0.1, the level set 0 a closed wavy surface."""
    axis = torch.linspace(-1, 1, n, dtype=torch.float64)
    x, y, z = torch.meshgrid(axis, axis, axis, indexing="ij")
    return ((x**2 + y**2 + z**2).sqrt() - 0.7 + 0.1 * torch.sin(6 * x) * torch.sin(5 * y)).float().contiguous()


def mesh_sdf(name: str, n: int) -> torch.Tensor:
    """(n, n, n) float32 signed distances to the real mesh ``name`` (pcops.mesh_distance, winding-number
    sign) on [-1.1, 1.1]^3: the grid a learnt SDF of that shape approximates."""
    v, f = load_mesh(name)
    axis = torch.linspace(-1.1, 1.1, n, dtype=torch.float32)
    points = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    bvh = pcops.mesh_bvh(v, f)
    return torch.cat([pcops.mesh_distance(p, bvh, signed=True).dists for p in points.split(1 << 20)]).reshape(n, n, n)


def run_marching_cubes(field: str, volume: torch.Tensor, repeats: int) -> dict:
    n = volume.shape[0]
    fns = {"pcops": lambda: pcops.marching_cubes(volume, 0.0, validate=False)}
    array = volume.numpy()
    try:
        from skimage import measure

        fns["skimage_lewiner"] = lambda: measure.marching_cubes(array, 0.0)
        fns["skimage_lorensen"] = lambda: measure.marching_cubes(array, 0.0, method="lorensen")
    except ImportError:
        pass
    try:
        import mcubes

        fns["pymcubes"] = lambda: mcubes.marching_cubes(array, 0.0)
    except ImportError:
        pass
    pytorch3d = bench_pytorch3d.marching_cubes()  # (its C++ CPU function: pytorch3d.ops.marching_cubes' work on a CPU volume)
    if pytorch3d is not None:
        fns["pytorch3d_cpu"] = lambda: pytorch3d(volume, 0.0)
    ms = _interleaved(fns, repeats)
    faces = int(pcops.marching_cubes(volume, 0.0).faces.shape[0])
    return {"bench": "marching_cubes", "mesh": field, "faces": faces, "grid": n, "ms": ms, "load": _load()}


# ----------------------------------------------------------------------------------------------


def _fmt(ms: float) -> str:
    return f"{ms:,.1f}" if ms >= 1 else f"{ms:.3f}"


def _print(row: dict) -> None:
    if row["bench"] == "mesh_agreement":
        extra = " ".join(f"{k} {row[k]:.3g}" if isinstance(row[k], float) else f"{k} {row[k]}"
                         for k in ("max_abs_diff", "max_closest_gap", "sign_disagree", "checked", "pcops_right", "near_half") if k in row)
        print(f"{'mesh_agreement':<25} {row['mesh']:<9} F={row['faces']:>5,} n={row['queries']:>9,}  {row['peer']:<20} {extra}", flush=True)
        return
    if row["bench"] == "mesh_note":
        print(f"note: {row['note']}", flush=True)
        return
    ms, vs = row["ms"], row.get("vs", {})
    label = {"mesh_distance": lambda: f"n={row['queries']:>9,} {row['variant']:<8}",
             "point_mesh_face_distance": lambda: f"P={row['points']:>9,} {row['pass']:<16}",
             "mesh_bvh": lambda: "",
             "marching_cubes": lambda: f"grid={row['grid']}^3"}[row["bench"]]()
    ours = " ".join(f"{k} {_fmt(t)} ms" for k, t in ms.items() if k.startswith("pcops"))
    peers = "  ".join(f"{k} {_fmt(t)} ms ({t / ms[vs.get(k, 'pcops')]:.2f}x)" for k, t in ms.items() if not k.startswith("pcops"))
    print(f"{row['bench']:<25} {row['mesh']:<9} F={row['faces']:>5,} {label}  {ours}  |  {peers}  (load {row.get('load')})", flush=True)


def run(quick: bool = False, meshes=None, sizes=None) -> list[dict]:
    """All mesh rows (printed as they come); ``quick``: one small synthetic mesh, one size, no
    PhysicsNeMo. ``meshes`` / ``sizes`` restrict the full run."""
    notes = [f"CPU: {cpu_model()} ({os.cpu_count()} cores), torch threads {torch.get_num_threads()}, "
             f"load average {os.getloadavg()[0]:.2f} at the start",
             "threads: pcops on torch's threads, Open3D nthreads=0 (all cores), trimesh and PhysicsNeMo's Warp CPU kernels on one"]
    try:
        import trimesh  # noqa: F401
    except ImportError as err:
        return [{"bench": "mesh_note", "note": f"mesh rows left out: {err} (pip install trimesh)"}]
    if _open3d() is None:
        notes.append("Open3D rows left out: open3d is not installed (pip install open3d-cpu)")
    if quick:
        names, sizes, faces, repeats = [SYNTHETIC], [2_000], 1280, 1
        notes.append("quick: PhysicsNeMo left out (its process takes ~10 s to start)")
    else:
        names = list(meshes or (*bench_meshes.available(), SYNTHETIC))
        sizes, faces, repeats = list(sizes or [10_000, 100_000, 1_000_000]), 5120, 3
    trimesh_n = 2_000 if quick else 10_000
    rows = []

    def add(row):
        rows.append(row)
        _print(row)

    loaded = {name: load_mesh(name, faces) for name in names}
    for name, (v, f) in loaded.items():
        for n in sizes:
            for row in run_distance(name, v, f, n, min(2, repeats) if n >= 10**6 else repeats, 120.0, n == trimesh_n,
                                    not quick, notes):
                add(row)
    for name, (v, f) in loaded.items():
        for row in run_loss(name, v, f, 500 if quick else 2_000, 1 if quick else 5):
            add(row)
    for name, (v, f) in loaded.items():
        add(run_build(name, v, f, 1 if quick else 7))
    grids = [("bumpy_sphere", 64)] if quick else [("bumpy_sphere", 128), ("bumpy_sphere", 256), ("airplane", 128)]
    for field, n in grids:
        if field == "bumpy_sphere" or field in loaded:
            add(run_marching_cubes(field, bumpy_sphere(n) if field == "bumpy_sphere" else mesh_sdf(field, n), 1 if quick else 5))
    pytorch3d = ("PyTorch3D's C++ CPU marching cubes (" + bench_pytorch3d.REASON[0] + ") on one thread" if bench_pytorch3d.marching_cubes()
                 else "PyTorch3D's marching_cubes is left out: " + bench_pytorch3d.REASON[0])
    notes.append("marching_cubes: float32 grids, level 0; scikit-image and PyMCubes on one thread (they have no threaded mode); " + pytorch3d)
    notes[0] += f", {os.getloadavg()[0]:.2f} at the end"
    for note in notes:
        add({"bench": "mesh_note", "note": note})
    return rows


if __name__ == "__main__":
    run("--quick" in sys.argv)
