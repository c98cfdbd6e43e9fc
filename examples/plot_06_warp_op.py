"""
Your own Warp kernel as a compile-safe op
=========================================

:func:`pcops.warp_op` wraps a ``@wp.kernel`` in a ``torch.library`` custom op: the output
shapes are declared, the op gets an exact fake implementation, and its gradient is Warp's
generated adjoint, through a second custom op. Here a kernel evaluates a field
``f(x) = amp * sin(freq * |x|)`` at points, split over the CPU cores (its first parameter is
``start``); the learnable amplitude and the points get gradients. See the
:doc:`guide <../warp_op>` for the kernel contract.
"""

import matplotlib.pyplot as plt
import torch
import warp as wp

import pcops


@wp.kernel
def wave(
    start: int,  # a chunk's first thread: the launch is split over the CPU cores
    points: wp.array(dtype=wp.vec3f),  # input: float32 (N, 3)
    amp: wp.array(dtype=wp.float32),  # input: float32 (1,), learnable
    freq: float,  # input: a Python float
    value: wp.array(dtype=wp.float32),  # output: float32 (N,)
):
    i = wp.tid() + start
    value[i] = amp[0] * wp.sin(freq * wp.length(points[i]))


wave_op = pcops.warp_op(
    "pcops_examples::wave", wave,
    outputs={"value": lambda points, amp, freq: (points.shape[0],)},
    dim=lambda points, amp, freq: points.shape[0],
)

g = torch.linspace(-1, 1, 80)
gx, gy = torch.meshgrid(g, g, indexing="xy")
points = torch.stack([gx.flatten(), gy.flatten(), torch.zeros(80 * 80)], dim=1)
points.requires_grad_(True)
amp = torch.tensor([1.5], requires_grad=True)

value = wave_op(points, amp, 8.0)
value.sum().backward()  # Warp's adjoint, through pcops_examples::wave_backward
expected = amp * torch.sin(8.0 * points.norm(dim=1))
print("max |op - torch|:", (value - expected).abs().max().item())
print("d sum / d amp:", amp.grad.item(), "=", (value / amp).sum().item())

# %%
# The op compiles as one node of a graph, with no break, under the default options.

def loss(points, amp):
    return wave_op(points, amp, 8.0).square().mean()


explanation = torch._dynamo.explain(loss)(points, amp)
print(f"graphs: {explanation.graph_count}, breaks: {explanation.graph_break_count}")

# %%
# The field and its gradient with respect to the points (the adjoint's ``d value / d x``).

fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), constrained_layout=True)
field = value.detach().reshape(80, 80)
im = axes[0].imshow(field, origin="lower", extent=(-1, 1, -1, 1), cmap="RdBu")
fig.colorbar(im, ax=axes[0], shrink=0.8)
axes[0].set_title("value = amp sin(freq |x|)")
grad = points.grad.reshape(80, 80, 3)[::4, ::4]
axes[1].quiver(gx[::4, ::4], gy[::4, ::4], grad[..., 0], grad[..., 1], angles="xy")
axes[1].set_title("d value / d points (Warp adjoint)")
for ax in axes:
    ax.set_aspect("equal")
plt.show()
