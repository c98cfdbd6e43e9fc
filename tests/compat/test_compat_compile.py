"""torch.compile of the drop-ins the way PyG and PyTorch3D models call them.

PyG's PointNet++ samples with ``fps`` (torch_cluster's default random start included) and
groups with ``radius`` or ``knn`` around the sampled points, whose number depends on the data.
Under ``fullgraph=True`` all of it must trace into one graph; under the default
``torch.compile(fn)`` Dynamo may break the graph only at the ops whose result size depends on
the data (it captures those only with ``capture_dynamic_output_shape_ops``): ``pcops.edges``
(ragged edge lists) and the packed FPS op. Never at a host read (``.item()``, ``int(t)``), the
random start or a branch on a data-dependent size. Compiles are few and shared: Inductor's
first compile on a CPU takes ~20 s; where only tracing is checked ``aot_eager`` or
``torch._dynamo.explain`` is used.
"""

import pathlib
import re
import textwrap

import torch
from torch._dynamo.utils import counters

import pcops.compat.pytorch3d as p3
import pcops.compat.torch_cluster as tc

ROOT = pathlib.Path(__file__).resolve().parents[2]

# the ops whose result size depends on the data: the only places a default compile may break
DATA_DEPENDENT = ("pcops.edges.default", "pcops.farthest_point_sample_packed.default")


def pointnet2(pos, batch):
    """PyG's PointNet++ sampling and grouping: fps (random start), then radius and knn on the picks."""
    idx = tc.fps(pos, batch, ratio=0.5)
    row, col = tc.radius(pos, pos[idx], 0.3, batch, batch[idx], max_num_neighbors=16)
    k_row, k_col = tc.knn(pos, pos[idx], 4, batch, batch[idx])
    return idx, torch.stack([col, row]), torch.stack([k_col, k_row])


def _clouds(gen, n=96, examples=2):
    pos = torch.rand(examples * n, 3, generator=gen)
    return pos, torch.arange(examples).repeat_interleave(n)


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


def _run_seeded(fn, *args, seed=0):
    torch.manual_seed(seed)
    return fn(*args)


def test_pointnet2_pattern_compiles_fullgraph_and_equals_eager(gen):
    pos, batch = _clouds(gen)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(pointnet2, fullgraph=True)  # Inductor
    with torch._inductor.config.patch(fallback_random=True):  # Inductor draws as eager does
        for seed in (0, 1):
            _equal(_run_seeded(compiled, pos, batch, seed=seed), _run_seeded(pointnet2, pos, batch, seed=seed))
    assert not counters["graph_break"], dict(counters["graph_break"])
    starts = {int(_run_seeded(compiled, pos, batch, seed=s)[0][0]) for s in range(4)}
    assert len(starts) > 1, "fps's start is not random in the compiled graph"


def test_pointnet2_pattern_breaks_only_at_data_dependent_sizes(gen):
    pos, batch = _clouds(gen)
    torch._dynamo.reset()
    out = torch._dynamo.explain(pointnet2)(pos, batch)  # default options, as torch.compile(fn)
    assert out.graph_break_count > 0 and out.break_reasons
    for reason in out.break_reasons:
        text = reason.reason
        assert "Dynamic shape operator" in text and any(op in text for op in DATA_DEPENDENT), text
        # where it broke: the call of the op itself (below it, the op's own call machinery)
        frame = [f for f in reason.user_stack if "torch/_library" not in f.filename and not f.filename.endswith("pcops/_threads.py")][-1]
        assert re.search(r"(_edges_op|_fps_packed|torch\.ops\.pcops\.(edges|farthest_point_sample_packed))\(", frame.line), frame
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        captured = torch._dynamo.explain(pointnet2)(pos, batch)
    assert captured.graph_break_count == 0, [r.reason for r in captured.break_reasons]
    assert captured.graph_count == 1


def test_empty_and_deeper_data_dependent_inputs_trace_and_equal_eager(gen):
    """Queries (or searched points) picked by the data: no branch on their size; an empty pick
    runs through the ops. A second level samples (a ratio per example, a tensor: no host read)
    and searches the picked points again."""
    pos, batch = _clouds(gen)
    ratios = torch.tensor([0.5, 0.3])

    def fn(pos, batch, keep, ratios):
        idx = tc.fps(pos, batch, ratio=0.5)
        sel = idx[keep[idx]]  # 0 to all of the picks
        near = tc.radius(pos, pos[sel], 0.3, batch, batch[sel], max_num_neighbors=16)
        grouped = tc.knn(pos, pos[sel], 4, batch, batch[sel])
        graph = tc.knn_graph(pos[sel], 3, batch[sel])  # searched points of a data-dependent number
        p1, b1 = pos[idx], batch[idx]
        idx2 = tc.fps(p1, b1, ratio=ratios)
        level2 = tc.radius(p1, p1[idx2], 0.4, b1, b1[idx2], max_num_neighbors=8)
        return idx, near, grouped, graph, idx2, level2

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")  # aot_eager: eager's random draws
    for keep in (torch.zeros(192, dtype=torch.bool), torch.rand(192, generator=gen) < 0.05, torch.ones(192, dtype=torch.bool)):
        _equal(_run_seeded(compiled, pos, batch, keep, ratios), _run_seeded(fn, pos, batch, keep, ratios))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # no recompile for an empty pick


def _interop_snippet() -> str:
    """docs/interop.md's PointNet++ snippet (tests/test_docs.py runs it eagerly)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "interop.md").read_text(), re.S)
    found = [b for b in blocks if "fps(" in b and "radius(" in b]
    assert len(found) == 1, "docs/interop.md has no (or more than one) fps + radius snippet"
    return found[0]


def test_interop_snippet_compiles_fullgraph():
    code = _interop_snippet()
    assert "edge_index =" in code and "idx =" in code
    namespace = {}
    exec(compile("def snippet():\n" + textwrap.indent(code, "    ") + "    return idx, edge_index\n", "<docs/interop.md>", "exec"), namespace)
    snippet = namespace["snippet"]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(snippet, fullgraph=True, backend="aot_eager")
    _equal(_run_seeded(compiled), _run_seeded(snippet))
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_ball_query_has_no_graph_break_under_default_compile(gen):
    p1, p2 = torch.rand(2, 30, 3, generator=gen), torch.rand(2, 40, 3, generator=gen)
    lengths2 = torch.tensor([40, 25])

    def fn(p1, p2, lengths2):
        out = p3.ball_query(p1, p2, lengths2=lengths2, K=8, radius=0.3)
        out64 = p3.ball_query(p1.double(), p2.double(), K=5, radius=0.25, return_nn=False)
        return out.dists, out.idx, out.knn, out64.dists, out64.idx

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(p1, p2, lengths2)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    torch._dynamo.reset()
    counters.clear()
    _equal(torch.compile(fn)(p1, p2, lengths2), fn(p1, p2, lengths2))
    assert not counters["graph_break"], dict(counters["graph_break"])
