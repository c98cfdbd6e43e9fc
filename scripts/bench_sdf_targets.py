"""The file SDF task's mesh targets: ``pcops.mesh_distance`` (what models.FileSDFDataModule uses)
against ``trimesh.proximity.signed_distance`` (what it used before), on the pyvista wheel's four meshes
(scripts/fetch_meshes.py) and on imperfect versions of them (issue #33).

    python scripts/bench_sdf_targets.py                  # 10,000 queries per mesh, a markdown table
    python scripts/bench_sdf_targets.py --queries 2000 --json out.json

Each mesh is centred and scaled into [-0.9, 0.9]^3 and gets the task's queries
(``models.data.sdf_queries``: half near 1,024 surface points, a quarter uniform in [-1, 1]^3, a
quarter on a 24^3 grid), as FileSDFDataModule makes them. Timed (``bench_timer.median_ms``, the
two interleaved): the targets of one sample as the data module computes them: pcops builds the
mesh's hierarchy (``pcops.mesh_bvh``) and queries it, signed, in float64; trimesh answers the
same queries (its sign flipped to negative inside).

Compared: the largest difference of |distance| and how many targets change sign (queries within
1e-9 of the surface left out). Where the two signs differ the exact generalised winding number
(float64, summed over every face, Van Oosterom and Strackee's solid angle) says which is right:
inside is w >= 1/2. The imperfect meshes: ``holes`` (2% of the faces deleted at random, seeded),
``overlap`` (the mesh and a copy shifted by a fifth of its extent, one self-intersecting mesh:
the overlap has winding number 2), and the airplane as the wheel ships it (open).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import pcops  # noqa: E402
from bench_meshes import WHEEL, _wheel  # noqa: E402
from fetch_meshes import MESHES  # noqa: E402
from bench_timer import median_ms  # noqa: E402
from models.data import sdf_queries  # noqa: E402


def wheel_mesh(name: str):
    """The wheel's mesh ``name`` (airplane, ant, nut, sphere) as trimesh reads it from the file."""
    import io
    import zipfile

    import trimesh

    wheel = _wheel()
    if wheel is None:
        raise SystemExit(f"error: pip could not download {WHEEL}")
    with zipfile.ZipFile(wheel) as z:
        return trimesh.load(io.BytesIO(z.read(f"pyvista/examples/{name}.ply")), file_type="ply", force="mesh")


def normalised(m):
    """A copy of the trimesh mesh centred and scaled into [-0.9, 0.9]^3, as the data module does."""
    m = m.copy()
    lo, hi = m.bounds
    m.apply_translation(-(lo + hi) / 2)
    m.apply_scale(1.8 / float((hi - lo).max()))
    return m


def imperfect(m, kind: str, seed: int = 0):
    """The mesh with holes (2% of its faces deleted) or overlapping a shifted copy of itself."""
    import trimesh

    if kind == "holes":
        keep = np.random.default_rng(seed).random(len(m.faces)) >= 0.02
        return trimesh.Trimesh(m.vertices, m.faces[keep], process=False)
    shift = np.array([0.2, 0.1, 0.0]) * float((m.bounds[1] - m.bounds[0]).max())
    return trimesh.Trimesh(np.vstack([m.vertices, m.vertices + shift]), np.vstack([m.faces, m.faces + len(m.vertices)]),
                           process=False)


def winding_number(q: np.ndarray, vertices: np.ndarray, faces: np.ndarray, chunk: int = 256) -> np.ndarray:
    """The exact generalised winding number of each query (float64, every face)."""
    tri = vertices[faces]  # (F, 3, 3)
    out = np.empty(len(q))
    for s in range(0, len(q), chunk):
        d = tri[None] - q[s : s + chunk, None, None]  # (C, F, 3, 3)
        a, b, c = d[..., 0, :], d[..., 1, :], d[..., 2, :]
        la, lb, lc = (np.linalg.norm(x, axis=-1) for x in (a, b, c))
        det = np.einsum("...i,...i", a, np.cross(b, c))
        den = la * lb * lc + np.einsum("...i,...i", a, b) * lc + np.einsum("...i,...i", b, c) * la + np.einsum("...i,...i", c, a) * lb
        out[s : s + chunk] = np.arctan2(det, den).sum(-1) / (2 * np.pi)
    return out


def exact_distance(q: np.ndarray, vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """The distance of each query to the mesh in float64, every face: the plane distance where the
    projection falls inside a face, else the nearest of its three edges."""
    a, b, c = (vertices[faces[:, i]][None] for i in range(3))  # (1, F, 3)
    p = q[:, None]
    dot = lambda x, y: (x * y).sum(-1)  # noqa: E731

    def segment(a, b):
        ab = b - a
        t = np.clip(dot(p - a, ab) / np.maximum(dot(ab, ab), 1e-300), 0, 1)
        return np.linalg.norm(p - a - t[..., None] * ab, axis=-1)

    n = np.cross(b - a, c - a)
    nn = dot(n, n)
    ok = nn > 0
    height = dot(p - a, n) / np.where(ok, nn, 1)
    proj = p - height[..., None] * n
    u = dot(np.cross(c - b, proj - b), n)
    v = dot(np.cross(a - c, proj - c), n)
    w = dot(np.cross(b - a, proj - a), n)
    inside = ok & (u >= 0) & (v >= 0) & (w >= 0)
    edges = np.minimum(np.minimum(segment(a, b), segment(b, c)), segment(c, a))
    return np.where(inside, np.abs(height) * np.sqrt(nn), edges).min(1)


def case(name: str, m, n_queries: int, seed: int = 0) -> dict:
    import trimesh

    gen = torch.Generator().manual_seed(seed)
    surface, _ = trimesh.sample.sample_surface(m, 1024, seed=seed)
    queries, _ = sdf_queries(lambda x: x[:, 0], torch.from_numpy(np.asarray(surface, dtype=np.float64)), n_queries, gen, 0.05, 24)
    vertices = torch.from_numpy(np.asarray(m.vertices, dtype=np.float64))
    faces = torch.from_numpy(np.asarray(m.faces, dtype=np.int64))

    def ours():
        return pcops.mesh_distance(queries, pcops.mesh_bvh(vertices, faces), signed=True).dists

    def theirs():
        return -trimesh.proximity.signed_distance(m, queries.numpy())

    t0 = time.perf_counter()
    ours()
    first_s = time.perf_counter() - t0
    ms = median_ms({"pcops": ours, "trimesh": theirs}, repeats=3, budget_s=30.0)
    d_ours, d_theirs = ours().numpy(), theirs()
    clear = np.minimum(np.abs(d_ours), np.abs(d_theirs)) > 1e-9
    flips = np.flatnonzero(clear & (np.sign(d_ours) != np.sign(d_theirs)))
    vertices_np, faces_np = np.asarray(m.vertices, dtype=np.float64), np.asarray(m.faces)
    w = winding_number(queries.numpy()[flips], vertices_np, faces_np)
    worst = np.argsort(-np.abs(np.abs(d_ours) - np.abs(d_theirs)))[:20]  # who is off where the two differ most
    exact = exact_distance(queries.numpy()[worst], vertices_np, faces_np)
    build_ms = median_ms(lambda: pcops.mesh_bvh(vertices, faces), repeats=5)
    inside = w >= 0.5
    return {
        "mesh": name, "faces": len(m.faces), "watertight": bool(m.is_watertight), "queries": n_queries,
        "pcops_ms": ms["pcops"], "trimesh_ms": ms["trimesh"], "speedup": ms["trimesh"] / ms["pcops"],
        "pcops_first_call_ms": 1e3 * first_s,
        "pcops_build_ms": build_ms,
        "max_abs_diff": float(np.abs(np.abs(d_ours) - np.abs(d_theirs)).max()),
        "pcops_error_there": float(np.abs(np.abs(d_ours[worst]) - exact).max()),
        "trimesh_error_there": float(np.abs(np.abs(d_theirs[worst]) - exact).max()),
        "sign_changes": len(flips),
        "pcops_sign_right": int(((d_ours[flips] < 0) == inside).sum()),
        "trimesh_sign_right": int(((d_theirs[flips] < 0) == inside).sum()),
        "ambiguous": int((np.abs(w - 0.5) < 0.1).sum()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--meshes", nargs="*", default=None, help="names of the wheel's meshes (default: all)")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    import trimesh

    names = args.meshes or [name.removesuffix(".ply") for name in MESHES]
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    for name in names:
        m = normalised(wheel_mesh(name))
        cases = [(name, m)]
        if m.is_watertight:
            cases += [(f"{name}, holes", imperfect(m, "holes")), (f"{name}, overlap", imperfect(m, "overlap"))]
        if name == "airplane":
            cases.append(("airplane, subdivided", trimesh.Trimesh(*trimesh.remesh.subdivide(m.vertices, m.faces), process=False)))
        for label, mm in cases:
            rows.append(case(label, mm, args.queries))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"trimesh {trimesh.__version__}; {args.queries:,} queries per mesh")
    print()
    print("| mesh | faces | watertight | pcops ms (build + query) | of it build | trimesh ms | speed-up | largest \\|d\\| difference | "
          "error there: pcops / trimesh | sign changes | right: pcops / trimesh |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for r in rows:
        print(f"| {r['mesh']} | {r['faces']:,} | {'yes' if r['watertight'] else 'no'} | {r['pcops_ms']:.1f} | {r['pcops_build_ms']:.1f} | "
              f"{r['trimesh_ms']:.0f} | {r['speedup']:.0f}x | {r['max_abs_diff']:.1e} | "
              f"{r['pcops_error_there']:.0e} / {r['trimesh_error_there']:.0e} | {r['sign_changes']} | "
              f"{r['pcops_sign_right']} / {r['trimesh_sign_right']} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "torch": torch.__version__, "trimesh": trimesh.__version__}, indent=1))


if __name__ == "__main__":
    main()
