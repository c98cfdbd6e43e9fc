"""Shared check: a function compiles with fullgraph=True into ONE graph that calls the pcops ops,
equals eager in outputs and gradients, and is not recompiled for new sizes."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters


def _close(a, b, what: str) -> None:
    if a.dtype.is_floating_point:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")  # fused differently; NaN where eager has NaN
    else:
        assert torch.equal(a, b), f"{what}: compiled and eager differ"


def assert_compiles(fn, calls, ops=("pcops.",), backend: str = "inductor") -> None:
    """``fn(*args)`` compiled (fullgraph, dynamic) equals eager for every ``args`` in ``calls``.

    Each output (a tensor or a tuple of tensors) and the gradient of the sum of the floating
    outputs with respect to every input that requires grad must match eager. The first call
    compiles exactly one graph; later calls (other sizes) reuse it. Dynamo must record no graph
    break and the graph must call every name in ``ops`` (so the op was traced, not run eagerly).
    """
    torch._dynamo.reset()
    counters.clear()  # reset() leaves the global counters alone
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    for n, args in enumerate(calls):
        outs = []
        for f in (fn, compiled):
            out = f(*args)
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            floats = [o for o in out if o.dtype.is_floating_point and o.requires_grad]
            loss = sum(torch.where(torch.isfinite(o), o, 0).sum() for o in floats)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True) if leaves and floats else ()
            outs.append((out, grads))
        (eager, g_eager), (comp, g_comp) = outs
        assert len(eager) == len(comp)
        for i, (a, b) in enumerate(zip(comp, eager)):
            _close(a, b, f"call {n} output {i}")
        for i, (a, b) in enumerate(zip(g_comp, g_eager)):
            assert (a is None) == (b is None), f"call {n}: gradient {i} missing on one side"
            if a is not None:
                _close(a, b, f"call {n} gradient {i}")
        # inductor's first compile may add an empty frame (no call in it): count the real graphs
        graphs = [g for g in counter.graphs if any("call" in node.op for node in g.graph.nodes)]
        assert len(graphs) == 1, f"call {n}: {len(graphs)} graphs compiled (recompiled for a new size?)"
    assert not counters["graph_break"], dict(counters["graph_break"])
    code = "\n".join(g.code for g in graphs)
    for op in ops:
        assert op in code, f"{op} is not in the compiled graph"


def assert_compiles_like_eager(model: torch.nn.Module, sizes, gen: torch.Generator) -> None:
    """``model(query, ref)`` compiled equals eager in output and query gradient, for each (M, N) in ``sizes``."""
    calls = [
        (torch.rand(m, 3, generator=gen).requires_grad_(), torch.rand(n, 3, generator=gen)) for m, n in sizes
    ]
    assert_compiles(model, calls)


def compiled_breaks(fn, calls, **options):
    """``fn`` compiled by Dynamo (aot_eager) with ``options`` equals eager in outputs and in the
    gradients of its floating outputs, for every call; returns the graph breaks by reason."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="aot_eager", **options)
    for args in calls:
        results = []
        for f in (fn, compiled):
            out = f(*args)
            leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            loss = sum(o.sum() for o in out if o.dtype.is_floating_point)
            results.append((out, torch.autograd.grad(loss, leaves)))
        (eager, g_eager), (comp, g_comp) = results
        for a, b in zip(comp + g_comp, eager + g_eager):
            torch.testing.assert_close(a, b)  # exact for integer outputs
    return dict(counters["graph_break"])
