"""Real meshes for the file SDF task (configs/sdf_meshes.yaml): the example meshes that ship inside
the pinned pyvista wheel, extracted into data/pyvista/. The wheel is data only: it is fetched
with ``pip download --no-deps`` (scripts/bench_meshes.py, the benchmarks' copy, in
``$PCOPS_BENCH_CACHE``, default ``~/.cache/pcops-bench``) and read as a zip; neither pyvista nor
VTK is installed or imported.

    python scripts/fetch_meshes.py               # -> data/pyvista/{airplane,ant,nut,sphere}.ply
    python scripts/fetch_meshes.py --out DIR

pyvista 0.49.1's wheel holds, under pyvista/examples/, four triangle meshes as .ply (taken):

    airplane.ply  1,335 vertices, 2,452 faces, open (holes; consistently oriented)
    ant.ply         486 vertices,   912 faces, closed
    nut.ply         523 vertices, 1,046 faces, closed
    sphere.ply      422 vertices,   840 faces, closed

and, not taken: globe.vtk (a 540-point textured sphere as binary legacy-VTK polydata, which
trimesh does not read; one more sphere), hexbeam.vtk (a hexahedral volume grid), channels.vti,
frog_tissues.vti, rectilinear.vtk, uniform.vtk (image and grid volumes), and two pictures.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import zipfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_meshes import WHEEL, _wheel  # noqa: E402

MESHES = ("airplane.ply", "ant.ply", "nut.ply", "sphere.ply")  # the wheel's triangle meshes (checked)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def fetch(out: pathlib.Path = ROOT / "data" / "pyvista") -> list[pathlib.Path]:
    """Extract the wheel's meshes into ``out`` (the wheel fetched once); the paths written."""
    wheel = _wheel()
    if wheel is None:
        raise SystemExit(f"error: pip could not download {WHEEL} (pip download --no-deps {WHEEL})")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    with zipfile.ZipFile(wheel) as z:
        for name in MESHES:
            path = out / name
            path.write_bytes(z.read(f"pyvista/examples/{name}"))
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "data" / "pyvista", help="folder to write the meshes to")
    args = parser.parse_args(argv)
    for path in fetch(args.out):
        print(path)


if __name__ == "__main__":
    main()
