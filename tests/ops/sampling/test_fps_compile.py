"""torch.compile of ``farthest_point_sample``'s random start (and of Python start indices).

The start is drawn with ``torch.rand`` (torch's global RNG) and reaches the op as a tensor, so
the draw is part of the graph: ``fullgraph=True`` traces it, and Inductor draws with its own
generator. Whatever the draw, each sample's sequence must be the exact FPS run from the start
it drew. One small function, compiled once (Inductor on the CPU: ~20 s).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import pcops
from tests import reference

F64 = torch.float64


def _run_from_its_start(points, idx, count):
    """``idx`` is the plain FPS sequence of ``count`` picks of ``points`` from its first pick."""
    assert idx.shape == (count,) and 0 <= int(idx[0]) < points.shape[0]
    assert torch.equal(idx, reference.farthest_point_sample(points, count, start=int(idx[0])))


def test_random_start_is_drawn_in_the_graph_and_gives_fps_runs_from_it(gen):
    sizes = (40, 25, 33)
    samples = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
    ids = torch.cat([torch.full((n,), b) for b, n in enumerate(sizes)])
    order = torch.randperm(ids.numel(), generator=gen)  # packed ids need not be sorted
    packed, ids = torch.cat(samples)[order], ids[order]
    padded = torch.stack([s[:25] for s in samples])

    def fn(packed, ids, padded):
        a = pcops.farthest_point_sample(packed, ratio=0.25, batch=ids, random_start=True)
        b = pcops.farthest_point_sample(padded, 6, random_start=True)
        return a.idx, b.idx

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True)  # Inductor, its own random numbers
    torch.manual_seed(0)
    first = compiled(packed, ids, padded)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.manual_seed(0)
    again = compiled(packed, ids, padded)
    assert all(torch.equal(x, y) for x, y in zip(first, again)), "the seed does not set the compiled draw"

    packed_idx, padded_idx = first
    at = 0
    for b, n in enumerate(sizes):  # packed: grouped by sample, each a run from its random start
        rows = (ids == b).nonzero()[:, 0]  # the sample's points in packed order
        count = -(-n // 4)
        picks = packed_idx[at : at + count]
        assert bool((ids[picks] == b).all())
        local = torch.searchsorted(rows, picks)
        _run_from_its_start(packed[rows], local, count)
        at += count
    assert at == packed_idx.numel()
    for b in range(3):
        _run_from_its_start(padded[b], padded_idx[b], 6)
    starts = set()
    for seed in range(4):  # the start is random, not the first point
        torch.manual_seed(seed)
        starts.add(int(compiled(packed, ids, padded)[1][0, 0]))
    assert len(starts) > 1
    assert not counters["graph_break"]


def test_random_start_adds_no_graph_break_under_default_compile(gen):
    points, ids = torch.rand(60, 3, generator=gen), torch.arange(3).repeat_interleave(20)

    def fn(points, ids):
        packed = pcops.farthest_point_sample(points, ratio=0.25, batch=ids, random_start=True)
        padded = pcops.farthest_point_sample(points.view(3, 20, 3), 5, random_start=True)
        return packed.idx, padded.idx

    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(points, ids)  # default options: no capture of data-dependent sizes
    for reason in out.break_reasons:  # only at the packed op, whose result size follows the data
        assert "Dynamic shape operator" in reason.reason and "pcops.farthest_point_sample_packed" in reason.reason, reason.reason
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        captured = torch._dynamo.explain(fn)(points, ids)
    assert captured.graph_break_count == 0 and captured.graph_count == 1, [r.reason for r in captured.break_reasons]


@pytest.mark.parametrize("start", [3, [3, 5], (0, 7, 2)])
def test_python_start_indices_compile_without_a_graph_break(gen, start):
    """start_idx as Python ints (checked at trace time, no tensor to read): one graph under
    default torch.compile and fullgraph=True, the eager picks (the checks' one host read bound a
    variable only where a tensor check was pending, and dynamo broke the graph on it)."""
    points = torch.rand(40, 3, generator=gen)

    def fn(points):
        return pcops.farthest_point_sample(points, 7, start_idx=start).idx

    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(points)
    assert out.graph_break_count == 0 and out.graph_count == 1, [r.reason for r in out.break_reasons]
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True)(points), fn(points))
