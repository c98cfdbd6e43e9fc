"""
Fitting a mesh to a point cloud
===============================

A sphere's vertices are moved by gradient descent until its surface fits a target cloud (here
5,000 points on a rounded box), with three terms, as PyTorch3D's "deform a source mesh" tutorial
has them, on pcops alone:

* :func:`pcops.chamfer_distance` between points drawn on the current mesh
  (:func:`pcops.sample_points_on_mesh`, differentiable in the vertices) and the cloud;
* :func:`pcops.point_mesh_face_distance`: each cloud point's squared distance to the nearest
  face, and each face's to the nearest point (PyTorch3D's ``point_mesh_face_distance``);
* a uniform Laplacian term: the mean distance of each vertex to the average of its neighbours,
  which keeps the mesh smooth while it moves.

300 steps of SGD (learning rate 1, momentum 0.9) on the vertices' offsets take about 9 s on 2
CPU cores: the Chamfer distance falls from 0.30 to 0.0007 (the floor of two samples of 5,000
points) and the point-to-face distance from 0.28 to 1e-5.
"""

import matplotlib.pyplot as plt
import torch
import trimesh

import pcops

torch.manual_seed(0)

# the target: 5,000 points on a rounded box (a fine icosphere pushed out towards its corners)
fine = trimesh.creation.icosphere(subdivisions=5)
corners = torch.tensor(fine.vertices, dtype=torch.float32)
rounded = corners.sign() * corners.abs() ** 0.4 * torch.tensor([0.8, 0.5, 0.35])
target = pcops.sample_points_on_mesh(rounded, torch.tensor(fine.faces), 5_000, seed=1).points

# the source: a unit icosphere (642 vertices, 1,280 faces)
sphere = trimesh.creation.icosphere(subdivisions=3)
faces = torch.tensor(sphere.faces)
start = torch.tensor(sphere.vertices, dtype=torch.float32)
offset = torch.zeros_like(start, requires_grad=True)

# each vertex's neighbours, for the Laplacian: the mesh's unique edges, both ways
edges = torch.cat([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
edges = torch.unique(torch.sort(edges, dim=1).values, dim=0)
ends = torch.cat([edges, edges.flip(1)])
degree = torch.bincount(ends[:, 0], minlength=len(start)).float()[:, None]


def laplacian(vertices):
    mean = torch.zeros_like(vertices).index_add_(0, ends[:, 0], vertices[ends[:, 1]]) / degree
    return (mean - vertices).norm(dim=1).mean()


optimizer = torch.optim.SGD([offset], lr=1.0, momentum=0.9)
history = []
for step in range(300):
    vertices = start + offset
    drawn = pcops.sample_points_on_mesh(vertices, faces, 5_000, seed=step).points
    chamfer = pcops.chamfer_distance(drawn, target)
    faces_term = pcops.point_mesh_face_distance(target, vertices, faces)
    smooth = laplacian(vertices)
    loss = chamfer + faces_term + 0.1 * smooth
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    history.append((chamfer.item(), faces_term.item(), smooth.item()))

print(f"Chamfer distance {history[0][0]:.4f} -> {history[-1][0]:.5f}, "
      f"point-face distance {history[0][1]:.4f} -> {history[-1][1]:.5f} after {len(history)} steps")

# %%
# The three terms along the descent, and the fitted mesh with the target cloud.

fig = plt.figure(figsize=(11, 4), constrained_layout=True)
ax = fig.add_subplot(1, 2, 1)
for i, name in enumerate(("chamfer_distance", "point_mesh_face_distance", "Laplacian")):
    ax.semilogy([h[i] for h in history], label=name)
ax.set_xlabel("SGD step")
ax.legend()
ax = fig.add_subplot(1, 2, 2, projection="3d")
fitted = (start + offset).detach()
ax.plot_trisurf(fitted[:, 0], fitted[:, 1], fitted[:, 2], triangles=faces, color="tab:blue", alpha=0.5, linewidth=0.1)
ax.scatter(*target[::5].T, s=1, color="k")
ax.set(xlim=(-0.9, 0.9), ylim=(-0.9, 0.9), zlim=(-0.9, 0.9))
ax.set_box_aspect((1, 1, 1))
ax.set_title("fitted mesh and target points")
plt.show()
