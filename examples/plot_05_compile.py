"""
A compiled layer with zero graph breaks
=======================================

Every pcops op is a ``torch.library`` custom op with an exact fake implementation and a
registered backward, so ``torch.compile`` traces a model that uses them as one graph, with the
default options users write. ``torch._dynamo.explain`` counts the graphs and the breaks.
"""

import time

import matplotlib.pyplot as plt
import torch

import pcops

torch.manual_seed(0)


class Projector(torch.nn.Module):
    """Point features onto query points by radius aggregation, then a small MLP."""

    def __init__(self):
        super().__init__()
        self.aggregate = pcops.RadiusAggregation(0.1, sigma=0.05, learnable_sigma=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, query, ref, features):
        return self.mlp(self.aggregate(query, ref, features))


model = Projector()
query, ref, features = torch.rand(2_000, 3), torch.rand(8_000, 3), torch.randn(8_000, 8)

explanation = torch._dynamo.explain(model)(query, ref, features)
graphs, breaks = explanation.graph_count, explanation.graph_break_count
print(f"graphs: {graphs}, graph breaks: {breaks}")
assert explanation.graph_break_count == 0
nodes = explanation.graphs[0].graph.nodes
calls = [getattr(n.target, "__name__", str(n.target)) for n in nodes if n.op == "call_function"]
print("the graph's calls:", ", ".join(dict.fromkeys(calls)))

# %%
# ``torch.compile(model)`` as users write it: one graph, the same values and gradients as
# eager. The first call compiles (a few seconds on a CPU); later calls reuse the graph.

compiled = torch.compile(model)
start = time.perf_counter()
out = compiled(query, ref, features)
print(f"first compiled call (compiles): {time.perf_counter() - start:.1f} s")
out.square().mean().backward()
compiled_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
model.zero_grad()
eager = model(query, ref, features)
eager.square().mean().backward()
torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
for name, p in model.named_parameters():
    torch.testing.assert_close(p.grad, compiled_grads[name], rtol=1e-4, atol=1e-6)


def best_ms(fn, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(query, ref, features).sum().backward()
        times.append(1e3 * (time.perf_counter() - start))
    return min(times)


eager_ms, compiled_ms = best_ms(model), best_ms(compiled)
print(f"train step here: eager {eager_ms:.1f} ms, compiled {compiled_ms:.1f} ms (best of 5)")

# %%
# The compiled model's outputs and its gradient with respect to ``sigma`` (through the
# custom op's registered backward) against eager.

fig, ax = plt.subplots(figsize=(4.6, 4.2), constrained_layout=True)
ax.scatter(eager.detach()[:, 0], out.detach()[:, 0], s=3)
lims = [eager.min().item(), eager.max().item()]
ax.plot(lims, lims, "k--", lw=0.8)
ax.set_xlabel("eager model(query, ref, features)")
ax.set_ylabel("torch.compile(model)(...)")
sigma_grad = compiled_grads["aggregate.log_sigma"].item()
ax.set_title(f"{graphs} graph, {breaks} breaks; d loss / d log sigma {sigma_grad:+.2e}")
plt.show()
