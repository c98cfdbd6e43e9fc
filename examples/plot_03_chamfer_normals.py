"""
Chamfer distance and estimated normals
======================================

:func:`pcops.estimate_normals` fits a plane to each point's ``k`` nearest neighbours (the
smallest eigenvector of their covariance), oriented towards a viewpoint;
:func:`pcops.chamfer_distance` is PyTorch3D's Chamfer loss on pcops' exact kNN search (no
``(N, M)`` distance matrix). Here a noisy sample of a sphere is denoised by gradient descent on
the Chamfer distance to a clean sample, and the normals of both are compared with the true
ones.
"""

import matplotlib.pyplot as plt
import torch

import pcops

torch.manual_seed(0)


def sphere(n):
    p = torch.randn(n, 3)
    return p / p.norm(dim=1, keepdim=True)


clean = sphere(2_000)
noisy = (sphere(2_000) * (1 + 0.05 * torch.randn(2_000, 1))).requires_grad_(True)


def normal_error(points):
    # oriented to the centre: inward normals; a sphere's true inward normal is -p / |p|
    n = pcops.estimate_normals(points, k=16, orient_to=torch.zeros(3))
    cos = (n * -points / points.norm(dim=1, keepdim=True)).sum(dim=1)
    return torch.rad2deg(torch.arccos(cos.clamp(-1, 1)))


before = normal_error(noisy.detach())
optimizer = torch.optim.Adam([noisy], lr=0.005)
losses = []
for step in range(60):
    loss = pcops.chamfer_distance(noisy, clean)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
after = normal_error(noisy.detach())
print(f"Chamfer distance {losses[0]:.5f} -> {losses[-1]:.5f}")
print(f"median normal error {before.median():.1f} -> {after.median():.1f} degrees")

# %%
# The loss, and the angle between estimated and true normals before and after.

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
ax.semilogy(losses)
ax.set_xlabel("Adam step")
ax.set_ylabel("chamfer_distance(noisy, clean)")
bins = torch.linspace(0, 40, 41)
ax2.hist(before.numpy(), bins=bins.numpy(), alpha=0.6, label="noisy cloud")
ax2.hist(after.numpy(), bins=bins.numpy(), alpha=0.6, label="after descent")
ax2.set_xlabel("normal error (degrees)")
ax2.set_ylabel("points")
ax2.legend()
plt.show()

# %%
# The estimated normals of the points near the equator (``|z| < 0.1``), seen from above.

p = noisy.detach()
n = pcops.estimate_normals(p, k=16, orient_to=torch.zeros(3))
band = p[:, 2].abs() < 0.1
fig, ax = plt.subplots(figsize=(4.5, 4.5), constrained_layout=True)
ax.quiver(p[band, 0], p[band, 1], n[band, 0], n[band, 1], angles="xy", scale=25)
ax.set_aspect("equal")
ax.set_title("inward normals at the equator")
plt.show()
