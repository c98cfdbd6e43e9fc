"""
Farthest point sampling and ball-query grouping
===============================================

The set abstraction of PointNet++: :func:`pcops.farthest_point_sample` picks centres that
cover the cloud, :func:`pcops.ball_query` finds up to ``K`` points within a radius of each
centre (sorted by distance, with the true count), and :func:`pcops.gather` collects their
coordinates, relative to the centre, into a ``(S, K, 3)`` group tensor.
"""

import math

import matplotlib.pyplot as plt
import torch

import pcops

torch.manual_seed(0)

# A flat cloud (z = 0): a ring and a dense blob.
angle = torch.rand(1_500) * 2 * math.pi
ring = torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)
ring = ring * (1 + 0.05 * torch.randn(1_500, 1))
blob = 0.25 * torch.randn(1_500, 2)
xy = torch.cat([ring, blob])
points = torch.cat([xy, torch.zeros(len(xy), 1)], dim=1)          # (3000, 3)

centres, centre_idx = pcops.farthest_point_sample(points, 24)  # FPS(points, idx)
radius, K = 0.15, 32
dists, idx, counts = pcops.ball_query(centres, points, radius, K)  # (24, 32), counts (24,)
groups = pcops.gather(points, idx) - centres[:, None, :]  # (24, 32, 3); idx -1 gathers 0
print("centres:", centres.shape, "groups:", groups.shape)
print("points within the radius per centre:", counts.tolist())

# %%
# Each centre (black) with its group: its nearest points within the radius, at most ``K``.
# ``counts`` is the true number within the radius: the centres in the dense blob find more
# than ``K`` (the ``K`` closest are kept), sparse ones fewer (``idx`` is -1 and the gathered
# rows are zeros past the count).

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.6), constrained_layout=True)
ax.scatter(xy[:, 0], xy[:, 1], s=1, c="0.8")
colors = plt.cm.tab20(torch.arange(len(centres)) % 20)
for s in range(len(centres)):
    found = idx[s][idx[s] >= 0]
    ax.scatter(xy[found, 0], xy[found, 1], s=4, color=colors[s])
    centre = centres[s, :2].tolist()
    ax.add_patch(plt.Circle(centre, radius, fill=False, lw=0.6, color=colors[s]))
ax.scatter(centres[:, 0], centres[:, 1], s=18, c="k", marker="x")
ax.set_aspect("equal")
ax.set_title("FPS centres and their ball-query groups")
ax2.bar(range(len(centres)), counts, color=colors)
ax2.axhline(K, color="k", lw=0.8, ls="--", label=f"K = {K} kept")
ax2.set_xlabel("centre")
ax2.set_ylabel("points within the radius (true count)")
ax2.legend()
plt.show()
