"""Shared check: a model compiles with fullgraph=True, matches eager, and does not recompile per size."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend


def assert_compiles_like_eager(model: torch.nn.Module, sizes, gen: torch.Generator) -> None:
    """``model(query, ref)`` compiled (inductor, dynamic) equals eager in output and query gradient.

    ``sizes`` is a list of (M, N); the second and later sizes must reuse the first graph.
    """
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for m, n in sizes:
        q = torch.rand(m, 3, generator=gen).requires_grad_()
        p = torch.rand(n, 3, generator=gen)
        eager = model(q, p)
        (g_eager,) = torch.autograd.grad(eager.sum(), q)
        out = compiled(q, p)
        (g_comp,) = torch.autograd.grad(out.sum(), q)
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_comp, g_eager, rtol=1e-4, atol=1e-5)  # float32, fused differently
        frames.append(counter.frame_count)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert frames[0] >= 1 and all(f == frames[0] for f in frames)  # no recompile for a new size
