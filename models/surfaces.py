"""The learnt surface of a signed-distance model: its zero level set as a mesh, against the true surface.

For a test shape, the model's field on a grid of resolution^3 points in [-1, 1]^3 becomes a mesh
with ``pcops.marching_cubes``; points sampled on it with ``pcops.sample_points_on_mesh`` are
compared with points sampled on the true surface (with its normals):

* ``chamfer_l2``: ``pcops.chamfer_distance`` of the two samples (PyTorch3D's: the mean squared
  distance to the nearest point of the other sample, both ways, summed);
* ``chamfer_l1``: the same with distances, not squared (both ways, halved: a mean distance);
* ``normal_consistency``: the mean |cos| between each point's normal and its nearest point's in
  the other sample, both ways (PyTorch3D's ``1 - loss_normals``; 1 is perfect);

each beside the same figures for the true field's mesh on the same grid (``floor_*``: what the
grid's resolution alone costs).
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import torch

from pcops import chamfer_distance, knn, marching_cubes, sample_points_on_mesh

SAMPLES = 20_000  # points sampled on each surface for the metrics


class Surface(NamedTuple):
    vertices: torch.Tensor  # (V, 3) the learnt zero level set
    faces: torch.Tensor  # (F, 3)
    floor_vertices: torch.Tensor  # the true field's zero level set on the same grid
    floor_faces: torch.Tensor
    metrics: dict


def grid_points(resolution: int) -> torch.Tensor:
    """(resolution, resolution, resolution, 3) points of [-1, 1]^3, ``indexing="ij"`` (marching_cubes' order)."""
    axis = torch.linspace(-1, 1, resolution)
    return torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1)


@torch.no_grad()
def predicted_field(model, sample: dict, resolution: int, chunk: int = 1 << 16) -> torch.Tensor:
    """The model's field on the grid, (resolution,) * 3, for the cloud of ``sample``."""
    model.eval()
    points = grid_points(resolution).reshape(-1, 3)
    parts = []
    for queries in points.split(chunk):
        batch = {"points": sample["points"][None].float(), "normals": sample["normals"][None].float(), "queries": queries[None]}
        batch = {k: v.to(model.device) for k, v in batch.items()}
        parts.append(model(batch)[0].float().cpu())
    return torch.cat(parts).reshape((resolution,) * 3)


def compare(vertices, faces, true_points, true_normals, seed: int) -> dict:
    """Chamfer distances and normal consistency of a mesh against points on the true surface."""
    if faces.shape[0] == 0:
        return {"chamfer_l2": float("inf"), "chamfer_l1": float("inf"), "normal_consistency": 0.0}
    drawn = sample_points_on_mesh(vertices.double(), faces, SAMPLES, seed=seed)
    x, y = drawn.points, true_points.double()
    cham_x, cham_y = chamfer_distance(x, y, point_reduction=None, batch_reduction=None)
    near_y = knn(x, y, 1).idx[:, 0]
    near_x = knn(y, x, 1).idx[:, 0]
    cos_x = (drawn.normals * true_normals.double()[near_y]).sum(-1).abs()
    cos_y = (true_normals.double() * drawn.normals[near_x]).sum(-1).abs()
    return {"chamfer_l2": float(cham_x.mean() + cham_y.mean()),
            "chamfer_l1": float((cham_x.sqrt().mean() + cham_y.sqrt().mean()) / 2),
            "normal_consistency": float((cos_x.mean() + cos_y.mean()) / 2)}


def surfaces(model, data, count: int = 3, resolution: int = 64) -> list[Surface]:
    """The learnt and the true field's meshes of the first ``count`` test shapes of ``data`` (a
    data module with ``surface_sample(i)``), with their metrics."""
    step = 2 / (resolution - 1)
    out = []
    for i in range(count):
        sample = data.surface_sample(i, SAMPLES)
        learnt = marching_cubes(predicted_field(model, sample, resolution), 0.0, origin=-1.0, voxel_size=step)
        true_grid = sample["sdf"](grid_points(resolution).double()).float()
        floor = marching_cubes(true_grid, 0.0, origin=-1.0, voxel_size=step)
        metrics = compare(learnt.vertices, learnt.faces, sample["true_points"], sample["true_normals"], seed=i)
        metrics |= {f"floor_{k}": v for k, v in compare(floor.vertices, floor.faces, sample["true_points"], sample["true_normals"], i).items()}
        out.append(Surface(learnt.vertices, learnt.faces, floor.vertices, floor.faces, metrics))
    return out


def write_ply(path: pathlib.Path, vertices: torch.Tensor, faces: torch.Tensor) -> None:
    import trimesh

    trimesh.Trimesh(vertices.double().numpy(), faces.numpy(), process=False).export(path)


def render(found: list[Surface], path: pathlib.Path) -> None:
    """Learnt (top) and true-field (bottom) meshes side by side, shaded by their normals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mpl_toolkits.mplot3d.art3d import Poly3DCollection

    fig = plt.figure(figsize=(4 * len(found), 8))
    light = torch.tensor([0.4, -0.5, 0.75]) / torch.tensor([0.4, -0.5, 0.75]).norm()
    for col, s in enumerate(found):
        for row, (v, f, title) in enumerate(((s.vertices, s.faces, "learnt"), (s.floor_vertices, s.floor_faces, "true field"))):
            ax = fig.add_subplot(2, len(found), row * len(found) + col + 1, projection="3d")
            if f.shape[0]:
                corners = v[f].float()
                normal = torch.nn.functional.normalize(torch.linalg.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0]), dim=-1)
                shade = (0.35 + 0.65 * (normal @ light).clamp(min=0)).numpy()
                colors = plt.cm.Blues(0.3 + 0.6 * shade) if row == 0 else plt.cm.Greys(0.3 + 0.6 * shade)
                ax.add_collection3d(Poly3DCollection(corners.numpy(), facecolors=colors, linewidths=0))
            ax.set(xlim=(-0.9, 0.9), ylim=(-0.9, 0.9), zlim=(-0.9, 0.9))
            ax.set_box_aspect((1, 1, 1))
            ax.set_axis_off()
            m = s.metrics
            label = (f"Chamfer-L1 {m['chamfer_l1']:.4f}, NC {m['normal_consistency']:.3f}" if row == 0
                     else f"Chamfer-L1 {m['floor_chamfer_l1']:.4f}, NC {m['floor_normal_consistency']:.3f}")
            ax.set_title(f"test shape {col}, {title}\n{label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save(model, data, run_dir: pathlib.Path, count: int = 3, resolution: int = 64) -> list[Surface]:
    """surface_<i>.ply (the learnt mesh of test shape i), surfaces.png and surfaces.json in ``run_dir``."""
    import json

    found = surfaces(model, data, count, resolution)
    for i, s in enumerate(found):
        write_ply(run_dir / f"surface_{i}.ply", s.vertices, s.faces)
    render(found, run_dir / "surfaces.png")
    (run_dir / "surfaces.json").write_text(json.dumps([s.metrics for s in found], indent=1))
    return found
