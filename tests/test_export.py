"""torch.export of the models built on pcops: dynamic sizes, the exported program equal to
eager at the traced size and at another one, and after torch.export.save / load in a fresh
process (which must import pcops first: the program calls its ops by name)."""

import pathlib
import subprocess
import sys

import pytest
import torch

import pcops
from torch.export import Dim, export

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _MeshSDF(torch.nn.Module):
    """The signed distance to a fixed mesh (a buffer), as a neural-SDF pipeline queries its target."""

    def __init__(self):
        super().__init__()
        from tests.op_table import icosphere

        vertices, faces = icosphere(1, torch.float32)
        self.register_buffer("vertices", vertices * torch.tensor([1.0, 0.7, 1.2]))
        self.register_buffer("faces", faces)

    def forward(self, points):
        out = pcops.mesh_distance(points, self.vertices, self.faces, signed=True)
        return out.dists, out.closest


def _models():
    from models import nets
    from models.pointnet2 import PointNet2
    from models.ptv3 import PointTransformerV3

    gen = torch.Generator().manual_seed(0)
    cloud = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    normals = lambda *s: torch.nn.functional.normalize(cloud(*s) - 0.5, dim=-1)  # noqa: E731
    n, m = Dim("N", min=8, max=100_000), Dim("M", min=1, max=100_000)
    small = [(32, 0.3, 16, [16, 16]), (8, 0.5, 8, [16, 32])]
    return {
        # (model, example args, args at another size, dynamic shapes)
        "radius_projector": (nets.radius_projector(radius=0.2), (cloud(2, 300, 3), cloud(2, 100, 3)),
                             (cloud(2, 420, 3), cloud(2, 77, 3)), ({1: n}, {1: m})),
        # k <= N is a guard on the reference cloud's size: N's minimum must be at least k (7 here)
        "knn_projector": (nets.knn_projector(), (cloud(2, 300, 3), cloud(2, 100, 3)),
                          (cloud(2, 420, 3), cloud(2, 77, 3)), ({1: Dim("N", min=7, max=100_000)}, {1: m})),
        "sdf": (nets.SDFNet(hidden=8, scales=((4, 0.05), (8, 0.1))), (cloud(2, 300, 3), normals(2, 300, 3), cloud(2, 100, 3)),
                (cloud(2, 350, 3), normals(2, 350, 3), cloud(2, 60, 3)), ({1: n}, {1: n}, {1: m})),
        "pointnet2": (PointNet2(3, levels=small, global_widths=(16, 16), hidden=16), (cloud(2, 300, 3),), (cloud(2, 333, 3),), ({1: n},)),
        "mesh_distance": (_MeshSDF(), (3 * cloud(300, 3) - 1.5,), (3 * cloud(420, 3) - 1.5,), ({0: Dim("M", min=2, max=100_000)},)),
        "ptv3": (PointTransformerV3(3, channels=(16, 32), depths=(1, 1), heads=(2, 2), patch=(8, 8)), (cloud(2, 200, 3),),
                 (cloud(2, 260, 3),), ({1: Dim("N", min=16, max=100_000)},)),
    }


@pytest.mark.parametrize("name", ["radius_projector", "knn_projector", "sdf", "pointnet2", "ptv3", "mesh_distance"])
def test_models_export_with_dynamic_sizes_and_load_in_a_fresh_process(name, tmp_path):
    model, args, other, shapes = _models()[name]
    model = model.eval()
    program = export(model, args, dynamic_shapes=shapes)
    for a in (args, other):
        torch.testing.assert_close(program.module()(*a), model(*a), rtol=1e-5, atol=1e-6)
    path = tmp_path / f"{name}.pt2"
    torch.export.save(program, path)
    torch.save({"args": other, "expected": model(*other)}, tmp_path / "io.pt")
    script = (
        "import sys, torch, pcops\n"  # pcops registers the ops the program calls
        f"program = torch.export.load({str(path)!r})\n"
        f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
        "torch.testing.assert_close(program.module()(*io['args']), io['expected'], rtol=1e-5, atol=1e-6)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_a_saved_program_names_the_missing_ops_without_pcops(tmp_path):
    from models import nets

    model = nets.radius_projector(radius=0.2).eval()
    args = (torch.rand(1, 50, 3), torch.rand(1, 20, 3))
    path = tmp_path / "p.pt2"
    torch.export.save(export(model, args), path)
    script = f"import torch\nprogram = torch.export.load({str(path)!r})\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0 and "pcops" in result.stderr  # import pcops first (docs/compiling.md)
