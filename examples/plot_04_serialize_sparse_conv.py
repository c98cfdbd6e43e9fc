"""
Serialization and sparse convolution
====================================

:func:`pcops.grid_sample` voxelises a cloud (one point per occupied voxel, with its integer
grid coordinates), :func:`pcops.serialize` orders the voxels along space-filling curves (the
patches of Point Transformer V3 are runs of this order), and :class:`pcops.SparseConv3d`
convolves features over the occupied voxels only: a submanifold convolution, equal to a dense
``conv3d`` read at the occupied sites.
"""

import math

import matplotlib.pyplot as plt
import torch

import pcops

torch.manual_seed(0)

# A flat spiral (one voxel thick) of 4,000 points.
t = torch.rand(4_000) * 4 * math.pi
r = 0.1 + 0.8 * t / (4 * math.pi)
x, y = 0.5 + 0.45 * r * torch.cos(t), 0.5 + 0.45 * r * torch.sin(t)
points = torch.stack([x, y, torch.zeros_like(t)], dim=1)
points[:, :2] += 0.01 * torch.randn(4_000, 2)

voxels = pcops.grid_sample(points, voxel_size=1 / 32)
coords = voxels.grid_coord  # (V, 3) int64 voxel coordinates
print(f"{len(points)} points -> {len(coords)} occupied voxels")

codes = pcops.serialize(coords, depth=6, order=["z", "hilbert"])
print("orders:", codes.order.shape)  # (2, V): one permutation per curve

# %%
# The voxels visited in each curve's order: consecutive voxels are near in space, so a
# patch of consecutive voxels is a local neighbourhood.

fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), constrained_layout=True)
for ax, name, order in zip(axes, ["z-order (Morton)", "Hilbert"], codes.order):
    c = coords[order]
    ax.plot(c[:, 0], c[:, 1], lw=0.6, c="0.6")
    ax.scatter(c[:, 0], c[:, 1], c=torch.arange(len(c)), cmap="viridis", s=12)
    ax.set_title(f"{name}: {len(c)} voxels in order")
    ax.set_aspect("equal")
plt.show()

# %%
# A sparse 3x3x3 convolution over the occupied voxels, checked against ``conv3d`` on the
# dense 32 x 32 x 1 grid (read back at the occupied sites). The kernel map (which site
# neighbours which, for each kernel offset) is built once and shared by both layers.

conv1 = pcops.SparseConv3d(1, 4, kernel_size=3)
conv2 = pcops.SparseConv3d(4, 1, kernel_size=3)
kmap = pcops.sparse_kernel_map(coords, kernel_size=3)
features = torch.ones(len(coords), 1)                      # occupancy
hidden = torch.relu(conv1(features, coords, kernel_map=kmap))
out = conv2(hidden, coords, kernel_map=kmap)


def dense(layer, grid):  # the same layer as a dense conv3d
    cin, cout = layer.weight.shape[1:]
    w = layer.weight.view(3, 3, 3, cin, cout).permute(4, 3, 0, 1, 2)
    return torch.nn.functional.conv3d(grid, w, layer.bias, padding=1)


size = int(coords.max()) + 1
grid = torch.zeros(1, 1, size, size, size)
grid[0, 0, coords[:, 0], coords[:, 1], coords[:, 2]] = 1.0
mask = (grid > 0).float()
dense_hidden = torch.relu(dense(conv1, grid)) * mask  # submanifold: occupied sites only
reference = dense(conv2, dense_hidden)[0, 0, coords[:, 0], coords[:, 1], coords[:, 2]]
print("max |sparse - dense|:", (out[:, 0] - reference).abs().max().item())

fig, ax = plt.subplots(figsize=(4.8, 4.5), constrained_layout=True)
sc = ax.scatter(coords[:, 0], coords[:, 1], c=out[:, 0].detach(), cmap="magma", marker="s")
fig.colorbar(sc, ax=ax, shrink=0.8)
ax.set_title("two SparseConv3d layers on the voxels")
ax.set_aspect("equal")
plt.show()
