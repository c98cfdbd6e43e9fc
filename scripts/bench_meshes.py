"""Real meshes for the benchmarks, sampled as point clouds: the example meshes that ship inside
the pyvista wheel (a benchmark-only extra, pinned below; nothing of pyvista is imported, so
neither it nor VTK needs to be installed).

    python scripts/bench_meshes.py        # fetch the wheel once, list the meshes and their sizes

The wheel is fetched with ``pip download --no-deps`` into ``$PCOPS_BENCH_CACHE`` (default
``~/.cache/pcops-bench``) and the meshes are read from it with trimesh. A cloud of n points is
sampled area-uniformly on a mesh's surface (trimesh, seeded), so its density follows the
surface as a scan's does.
"""

from __future__ import annotations

import functools
import io
import os
import pathlib
import subprocess
import sys
import zipfile

import numpy as np
import torch

WHEEL = "pyvista==0.49.1"  # pinned: these files are in this wheel (checked), under pyvista/examples/
_FILES = {"airplane": "airplane.ply", "ant": "ant.ply", "nut": "nut.ply"}  # the wheel's .ply meshes


def _cache() -> pathlib.Path:
    return pathlib.Path(os.environ.get("PCOPS_BENCH_CACHE", pathlib.Path.home() / ".cache" / "pcops-bench"))


@functools.cache
def _wheel() -> pathlib.Path | None:
    """The pinned pyvista wheel on disk (fetched once), or None where pip cannot fetch it."""
    folder = _cache()
    name = WHEEL.replace("==", "-")
    found = sorted(folder.glob(f"{name}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(folder)],
                              capture_output=True, text=True)
        found = sorted(folder.glob(f"{name}-*.whl"))
        if done.returncode != 0 or not found:
            return None
    return found[0]


def available() -> tuple[str, ...]:
    """Names of the real meshes that can be read here (empty without the wheel or trimesh)."""
    try:
        import trimesh  # noqa: F401
    except ImportError:
        return ()
    return tuple(_FILES) if _wheel() is not None else ()


@functools.cache
def clouds() -> tuple[str, ...]:
    """The real meshes as cloud kinds of ``bench_search.cloud`` ("mesh:<name>")."""
    return tuple(f"mesh:{name}" for name in available())


@functools.cache
def mesh(name: str):
    """The named example mesh as a trimesh.Trimesh."""
    import trimesh

    wheel = _wheel()
    if wheel is None:
        raise RuntimeError(f"the {WHEEL} wheel could not be fetched (pip download)")
    with zipfile.ZipFile(wheel) as z:
        data = z.read(f"pyvista/examples/{_FILES[name]}")
    return trimesh.load(io.BytesIO(data), file_type="ply", force="mesh")


def cloud(name: str, n: int, seed: int) -> torch.Tensor:
    """n float32 points sampled area-uniformly on the named mesh, centred and scaled to [-1, 1]."""
    import trimesh

    m = mesh(name)
    points, _ = trimesh.sample.sample_surface(m, n, seed=seed)
    points = np.asarray(points, dtype=np.float64)
    points -= (points.max(0) + points.min(0)) / 2
    points /= np.abs(points).max()
    return torch.from_numpy(points.astype(np.float32))


if __name__ == "__main__":
    for name in available():
        m = mesh(name)
        print(f"{name}: {len(m.vertices)} vertices, {len(m.faces)} faces, area {m.area:.4g}")
