"""
Point features onto a grid
==========================

Scattered samples of a field carry one feature each; :func:`pcops.radius_aggregate` and
:func:`pcops.knn_aggregate` carry them onto the points of a regular grid, the way a point
encoder projects a cloud onto a latent grid. ``radius_aggregate`` averages every sample within
the radius, weighted by ``exp(-d / sigma)`` (a grid point with no sample in reach gets 0);
``knn_aggregate`` takes the ``k`` nearest samples, with softmax weights of ``-d / sigma``.
"""

import matplotlib.pyplot as plt
import torch

import pcops

torch.manual_seed(0)


def field(xy):
    return torch.sin(6 * xy[:, 0]) * torch.cos(4 * xy[:, 1])


# 3,000 samples in the unit square (z = 0), fewer on the right half.
xy = torch.rand(3_000, 2)
xy = xy[(xy[:, 0] < 0.5) | (torch.rand(3_000) < 0.3)]
ref = torch.cat([xy, torch.zeros(len(xy), 1)], dim=1)
features = field(xy)[:, None]                                    # (N, 1)

# The query points: a 64 x 64 grid over the same square.
g = torch.linspace(0, 1, 64)
gx, gy = torch.meshgrid(g, g, indexing="xy")
query = torch.stack([gx.flatten(), gy.flatten(), torch.zeros(64 * 64)], dim=1)

by_radius = pcops.radius_aggregate(query, ref, features, radius=0.04, sigma=0.02)
by_knn = pcops.knn_aggregate(query, ref, features, k=8, sigma=0.02)
truth = field(query[:, :2])
print(f"{len(ref)} samples onto {len(query)} grid points")
print(f"radius_aggregate: mean abs error {(by_radius[:, 0] - truth).abs().mean():.3f}")
print(f"knn_aggregate:    mean abs error {(by_knn[:, 0] - truth).abs().mean():.3f}")

# %%
# The samples, and the two aggregations read on the grid.

fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), constrained_layout=True)
colours = dict(cmap="coolwarm", vmin=-1, vmax=1)
axes[0].scatter(xy[:, 0], xy[:, 1], c=features[:, 0], s=3, **colours)
axes[0].set_title(f"{len(ref)} samples")
panels = [(by_radius, "radius_aggregate (r = 0.04)"), (by_knn, "knn_aggregate (k = 8)")]
for ax, (out, title) in zip(axes[1:], panels):
    im = ax.imshow(out.reshape(64, 64), origin="lower", extent=(0, 1, 0, 1), **colours)
    ax.set_title(title)
for ax in axes:
    ax.set_aspect("equal")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
fig.colorbar(im, ax=axes, shrink=0.8)
plt.show()

# %%
# Both ops are differentiable with respect to the points, the features and ``sigma``:
# a learnable ``sigma`` is what :class:`pcops.RadiusAggregation` and
# :class:`pcops.KNNAggregation` hold.

layer = pcops.KNNAggregation(k=8, sigma=0.02, learnable_sigma=True)
loss = (layer(query, ref, features)[:, 0] - truth).square().mean()
loss.backward()
print(f"loss {loss.item():.4f}, d loss / d log sigma {layer.log_sigma.grad.item():+.4f}")
