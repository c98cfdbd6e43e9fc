"""PyTorch Geometric's own point-cloud functions and layers on pcops after
``pcops.compat.install()``: ``torch_geometric.nn.fps``, ``knn``, ``knn_graph``, ``radius``,
``radius_graph``, ``nearest``, ``voxel_grid``, ``knn_interpolate``, ``DynamicEdgeConv``,
``XConv`` and ``PointNetConv`` against float64 brute force and pcops.compat.torch_cluster;
``torch.library.opcheck`` of the ``torch.ops.pyg`` operators; ``install`` never shadowing a real
package. Everything that installs runs in a subprocess, so this process's ``sys.modules`` and
``torch.ops.pyg`` stay untouched. Skipped where torch_geometric is not installed."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("torch_geometric") is None:
    pytest.skip("torch_geometric is not installed", allow_module_level=True)

from pcops.compat import torch_cluster as tc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZES = (40, 7, 53)  # three examples; the second has fewer points than k
K, R, CAP, RATIO = 9, 0.3, 4, 0.3


def run_child(code: str, tmp_path: Path, pythonpath: str = "") -> dict:
    """Run ``code`` in a fresh interpreter (cwd ``tmp_path``); it prints one JSON line last."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# float64 brute force (no pcops, no PyG)


def ref_knn(x, y, k, bx, by):
    """(2, E): for each row i of y its k nearest rows of x in the same example, by distance."""
    x, y = x.double(), y.double()
    rows, cols = [], []
    for i in range(y.shape[0]):
        cand = (bx == by[i]).nonzero().flatten()
        d = ((x[cand] - y[i]) ** 2).sum(1)
        best = cand[d.argsort(stable=True)[:k]]
        rows += [i] * len(best)
        cols += best.tolist()
    return torch.tensor([rows, cols], dtype=torch.long)


def ref_radius(x, y, r, bx, by, cap):
    """(2, E): for each row i of y the first ``cap`` rows of x (by index) with d^2 < r^2."""
    x, y = x.double(), y.double()
    rows, cols = [], []
    for i in range(y.shape[0]):
        hit = (((x - y[i]) ** 2).sum(1) < r * r) & (bx == by[i])
        found = hit.nonzero().flatten()[:cap]
        rows += [i] * len(found)
        cols += found.tolist()
    return torch.tensor([rows, cols], dtype=torch.long)


def ref_fps(pos, batch, ratio):
    """Greedy farthest point sampling per example from its first point (float64)."""
    out = []
    for b in batch.unique().tolist():
        idx = (batch == b).nonzero().flatten()
        p = pos[idx].double()
        n_pick = int(torch.ceil(torch.tensor(len(idx), dtype=torch.float32) * torch.tensor(ratio, dtype=torch.float32)))
        picks = [0]
        dist = ((p - p[0]) ** 2).sum(1)
        for _ in range(n_pick - 1):
            j = int(dist.argmax())
            picks.append(j)
            dist = torch.minimum(dist, ((p - p[j]) ** 2).sum(1))
        out += idx[picks].tolist()
    return torch.tensor(out)


def ref_interpolate(f, pos_x, pos_y, bx, by, k):
    out = torch.zeros(pos_y.shape[0], f.shape[1], dtype=torch.float64)
    row, col = ref_knn(pos_x, pos_y, k, bx, by)
    for i in range(pos_y.shape[0]):
        j = col[row == i]
        w = 1.0 / ((pos_x[j].double() - pos_y[i].double()) ** 2).sum(1).clamp(min=1e-16)
        out[i] = (w[:, None] * f[j].double()).sum(0) / w.sum()
    return out


def batch_of(sizes):
    return torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))


# ----------------------------------------------------------------------------------------------
# one child process: install(), then PyG's functions and layers, the layers' brute-force twins and
# opcheck of the operators

CHILD = r"""
import json, sys, warnings
import pcops.compat
report = pcops.compat.install("pyg")
import torch
import torch_geometric
import torch_geometric.typing as tgt
from torch_geometric.nn import (MLP, DynamicEdgeConv, EdgeConv, PointNetConv, XConv, fps, knn, knn_graph,
                                knn_interpolate, nearest, radius, radius_graph, voxel_grid)

inp = torch.load("inputs.pt")
pos, batch, y, by = inp["pos"], inp["batch"], inp["y"], inp["by"]
K, R, CAP, RATIO = inp["K"], inp["R"], inp["CAP"], inp["RATIO"]
out = {
    "fps": fps(pos, batch, RATIO, random_start=False),
    "fps_random": fps(pos, batch, RATIO),
    "fps_one": fps(pos[:40], ratio=0.5, random_start=False),
    "knn": knn(pos, y, K, batch, by),
    "knn_nobatch": knn(pos, y, K),
    "knn_graph": knn_graph(pos, K, batch),
    "knn_graph_loop_t2s": knn_graph(pos, K, batch, loop=True, flow="target_to_source"),
    "radius": radius(pos, y, R, batch, by, max_num_neighbors=1000),
    "radius_cap": radius(pos, y, R, batch, by, max_num_neighbors=CAP),
    "radius_graph": radius_graph(pos, R, batch, max_num_neighbors=1000),
    "nearest": nearest(y, pos, by, batch),
    "voxel_grid": voxel_grid(pos.double(), 0.25, batch),
}


def brute_knn(x, y, ptr_x, ptr_y, k, cosine=False, num_workers=1):
    # the same layout as torch.ops.pyg.knn, float64 brute force: (2, E), row 0 into y
    bx = torch.zeros(len(x), dtype=torch.long) if ptr_x is None else torch.arange(len(ptr_x) - 1).repeat_interleave(ptr_x.diff())
    by = torch.zeros(len(y), dtype=torch.long) if ptr_x is None else torch.arange(len(ptr_y) - 1).repeat_interleave(ptr_y.diff())
    d = ((y.double()[:, None] - x.double()[None]) ** 2).sum(-1)
    d[by[:, None] != bx[None]] = float("inf")
    order = d.argsort(dim=1, stable=True)[:, :k]
    keep = torch.gather(d, 1, order).isfinite()
    rows = torch.arange(len(y))[:, None].expand_as(order)
    return torch.stack([rows[keep], order[keep]])


torch.manual_seed(0)
feat = torch.randn(len(pos), 16, requires_grad=True)
conv = DynamicEdgeConv(MLP([32, 32, 8]), K)
got = conv(feat, batch)
got.sum().backward()
grad, feat.grad = feat.grad.clone(), None
pos_ptr = torch.tensor([0] + torch.bincount(batch).cumsum(0).tolist())
twin = EdgeConv(MLP([32, 32, 8]))  # its own MLP (building a conv resets the MLP it gets), same weights
twin.nn.load_state_dict(conv.nn.state_dict())
ref = twin(feat, brute_knn(feat.detach(), feat.detach(), pos_ptr, pos_ptr, K).flip(0))
ref.sum().backward()
out["dynamic_edge_conv"] = (got.detach(), ref.detach(), grad, feat.grad)

big = batch != 1  # XConv needs at least K points in every example
xpos, xbatch = pos[big], torch.unique(batch[big], return_inverse=True)[1]
xconv = XConv(16, 8, dim=3, kernel_size=K, hidden_channels=4)
got = xconv(feat.detach()[big], xpos, xbatch)
setattr(torch.ops.pyg, "knn", brute_knn)
ref = xconv(feat.detach()[big], xpos, xbatch)
delattr(torch.ops.pyg, "knn")
assert torch.ops.pyg.knn is not brute_knn
out["xconv"] = (got.detach(), ref.detach())

pnc = PointNetConv(MLP([3 + 16, 16, 8]), add_self_loops=False)
idx = out["fps"]
row, col = radius(pos, pos[idx], R, batch, batch[idx], max_num_neighbors=64)
got = pnc((feat.detach(), feat.detach()[idx]), (pos, pos[idx]), torch.stack([col, row]))
out["pointnet_conv"] = got.detach()
out["pointnet_edges"] = torch.stack([row, col])

f = torch.randn(len(pos), 5)
out["knn_interpolate"] = knn_interpolate(f, pos, y, batch, by, k=3)
out["knn_interpolate_f"] = f
out["pnc_feat"] = feat.detach()

# opcheck of every operator, deterministic arguments (fps without a random start)
ptr = pos_ptr
ptr_y = torch.tensor([0] + torch.bincount(by, minlength=3).cumsum(0).tolist())
cases = {  # case: (operator, arguments)
    "fps": ("fps", (pos, ptr, RATIO, False)),
    "knn": ("knn", (pos, y, ptr, ptr_y, K, False, 1)),
    "knn_nobatch": ("knn", (pos, y, None, None, K, False, 1)),
    "radius": ("radius", (pos, y, ptr, ptr_y, R, CAP, 1, False)),
    "radius_same": ("radius", (pos, pos, ptr, ptr, R, CAP, 1, True)),
    "nearest": ("nearest", (y, pos, ptr_y, ptr)),
    "grid_cluster": ("grid_cluster", (pos, torch.tensor([0.25, 0.25, 0.25]), None, None)),
}
checks = {case: dict(torch.library.opcheck(getattr(torch.ops.pyg, op), args)) for case, (op, args) in cases.items()}

# a fullgraph compile of PyG's own call pattern: knn and radius with CSR pointers
def edges(x, y, px, py):
    return torch.ops.pyg.knn(x, y, px, py, K), torch.ops.pyg.radius(x, y, px, py, R, CAP)
compiled = torch.compile(edges, fullgraph=True, backend="aot_eager")(pos, y, ptr, ptr_y)
out["compiled"] = compiled

torch.save(out, "outputs.pt")
flags = {n: getattr(tgt, n) for n in ("WITH_PYG_LIB", "WITH_FPS", "WITH_KNN", "WITH_RADIUS", "WITH_NEAREST",
                                        "WITH_GRID_CLUSTER", "WITH_SEGMM", "WITH_SOFTMAX", "WITH_METIS")}
print(json.dumps({"report": {n: list(o) for n, o in report.items()}, "flags": flags, "opcheck": checks,
                  "version": torch_geometric.__version__, "graph": graph_features()}))
"""

# What PyG's graph features (which pyg-lib's other operators serve) do: the same with and without install()
GRAPH = r"""
def graph_features():
    import importlib.util
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.nn import Node2Vec
    from torch_geometric.testing import has_package
    from torch_geometric.utils import dropout_path
    edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    seen = {"find_spec": importlib.util.find_spec("pyg_lib") is not None, "has_package": has_package("pyg_lib")}
    for name, call in (("NeighborLoader", lambda: next(iter(NeighborLoader(Data(x=torch.randn(3, 2), edge_index=edge_index),
                                                                              num_neighbors=[2], batch_size=1)))),
                       ("Node2Vec", lambda: Node2Vec(edge_index, 4, 3, 2)),
                       ("dropout_path", lambda: dropout_path(edge_index))):
        try:
            call()
            seen[name] = "ran"
        except Exception as exc:
            seen[name] = type(exc).__name__ + ": " + str(exc)
    return seen
"""
CHILD = CHILD.replace("import torch_geometric.typing as tgt\n", "import torch_geometric.typing as tgt\n" + GRAPH, 1)

PLAIN = r"""
import json
import torch
""" + GRAPH + r"""
print(json.dumps(graph_features()))
"""


@pytest.fixture(scope="module")
def pyg(tmp_path_factory):
    """(inputs, outputs of the child, its JSON) for the tests below."""
    tmp = tmp_path_factory.mktemp("pyg_ops")
    gen = torch.Generator().manual_seed(0)
    batch = batch_of(SIZES)
    by = batch_of((11, 3, 9))
    inputs = {"pos": torch.rand(len(batch), 3, generator=gen), "batch": batch,
              "y": torch.rand(len(by), 3, generator=gen), "by": by, "K": K, "R": R, "CAP": CAP, "RATIO": RATIO}
    torch.save(inputs, tmp / "inputs.pt")
    meta = run_child(CHILD, tmp)
    return inputs, torch.load(tmp / "outputs.pt"), meta


def test_install_pyg_turns_on_exactly_the_point_cloud_flags(pyg):
    _, _, meta = pyg
    installed, reason, modules = meta["report"]["pyg"]
    assert installed and modules == [] and "WITH_FPS, WITH_KNN, WITH_RADIUS, WITH_NEAREST, WITH_GRID_CLUSTER set True" in reason
    flags = meta["flags"]
    assert all(flags[n] for n in ("WITH_FPS", "WITH_KNN", "WITH_RADIUS", "WITH_NEAREST", "WITH_GRID_CLUSTER"))
    assert not any(flags[n] for n in ("WITH_PYG_LIB", "WITH_SEGMM", "WITH_SOFTMAX", "WITH_METIS"))  # PyG keeps its own paths there


def test_pyg_graph_features_behave_as_without_install(pyg, tmp_path):
    """PyG's sampling and random walks (pyg-lib's graph operators, which pcops does not have) do
    after install() exactly what they do without it: pyg_lib stays unimportable, so PyG's own
    tests of them skip as before instead of failing."""
    _, _, meta = pyg
    plain = run_child(PLAIN, tmp_path)
    assert meta["graph"] == plain
    assert not plain["find_spec"] and not plain["has_package"]


def test_fps_equals_brute_force(pyg):
    inp, out, _ = pyg
    assert torch.equal(out["fps"], ref_fps(inp["pos"], inp["batch"], RATIO))
    assert torch.equal(out["fps_one"], ref_fps(inp["pos"][:40], torch.zeros(40, dtype=torch.long), 0.5))


def test_fps_random_start_picks_the_counts_and_a_valid_sequence(pyg):
    inp, out, _ = pyg
    picks, batch = out["fps_random"], inp["batch"]
    counts = torch.bincount(batch[picks], minlength=3)
    assert counts.tolist() == [int(torch.ceil(torch.tensor(float(n)) * torch.tensor(RATIO))) for n in SIZES]
    start = 0
    for b, n in enumerate(SIZES):  # from its own start, each example's picks are greedy FPS
        mine = picks[start:start + counts[b]]
        start += counts[b]
        idx = (batch == b).nonzero().flatten()
        first = int((idx == mine[0]).nonzero())
        rolled = torch.cat([idx[first:], idx[:first]])  # the start first: FPS from it
        assert torch.equal(mine, rolled[ref_fps(inp["pos"][rolled], torch.zeros(n, dtype=torch.long), RATIO)])


def test_knn_equals_brute_force_and_the_compat_function(pyg):
    inp, out, _ = pyg
    pos, batch, y, by = inp["pos"], inp["batch"], inp["y"], inp["by"]
    ref = ref_knn(pos, y, K, batch, by)
    assert torch.equal(out["knn"], ref)
    assert torch.equal(out["knn"], tc.knn(pos, y, K, batch, by))
    zeros = torch.zeros(len(pos), dtype=torch.long)
    assert torch.equal(out["knn_nobatch"], ref_knn(pos, y, K, zeros, torch.zeros(len(y), dtype=torch.long)))


def test_knn_graph_equals_brute_force(pyg):
    inp, out, _ = pyg
    pos, batch = inp["pos"], inp["batch"]
    row, col = ref_knn(pos, pos, K + 1, batch, batch)
    no_self = row != col
    assert torch.equal(out["knn_graph"], torch.stack([col[no_self], row[no_self]]))  # (neighbour, centre)
    assert torch.equal(out["knn_graph_loop_t2s"], ref_knn(pos, pos, K, batch, batch))  # (centre, neighbour)


def test_radius_equals_brute_force(pyg):
    inp, out, _ = pyg
    pos, batch, y, by = inp["pos"], inp["batch"], inp["y"], inp["by"]
    assert torch.equal(out["radius"], ref_radius(pos, y, R, batch, by, 1000))
    assert torch.bincount(out["radius"][0]).max() > CAP  # the cap below truncates
    assert torch.equal(out["radius_cap"], ref_radius(pos, y, R, batch, by, CAP))  # the first CAP by index
    assert torch.equal(out["radius_cap"], tc.radius(pos, y, R, batch, by, CAP))


def test_radius_graph_equals_brute_force(pyg):
    inp, out, _ = pyg
    pos, batch = inp["pos"], inp["batch"]
    row, col = ref_radius(pos, pos, R, batch, batch, 1000)
    no_self = row != col
    assert torch.equal(out["radius_graph"], torch.stack([col[no_self], row[no_self]]))


def test_nearest_equals_brute_force(pyg):
    inp, out, _ = pyg
    pos, batch, y, by = inp["pos"], inp["batch"], inp["y"], inp["by"]
    d = ((y.double()[:, None] - pos.double()[None]) ** 2).sum(-1)
    d[by[:, None] != batch[None]] = float("inf")
    assert torch.equal(out["nearest"], d.argmin(1))


def test_voxel_grid_equals_the_voxel_arithmetic(pyg):
    inp, out, _ = pyg
    pos, batch = inp["pos"].double(), inp["batch"]
    p = torch.cat([pos, batch[:, None].double()], 1)
    size = torch.tensor([0.25, 0.25, 0.25, 1.0], dtype=torch.float64)
    start, end = p.min(0).values, p.max(0).values
    cell = ((p - start) / size).trunc().long()
    extent = ((end - start) / size).trunc().long() + 1
    stride = torch.cat([torch.ones(1, dtype=torch.long), extent.cumprod(0)[:-1]])
    assert torch.equal(out["voxel_grid"], (cell * stride).sum(1))


def test_knn_interpolate_equals_brute_force(pyg):
    inp, out, _ = pyg
    ref = ref_interpolate(out["knn_interpolate_f"], inp["pos"], inp["y"], inp["batch"], inp["by"], 3)
    torch.testing.assert_close(out["knn_interpolate"].double(), ref, rtol=1e-5, atol=1e-5)


def test_dynamic_edge_conv_equals_edge_conv_on_brute_force_edges(pyg):
    _, out, _ = pyg
    got, ref, grad, ref_grad = out["dynamic_edge_conv"]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)  # the features' gradient flows past the search


def test_xconv_equals_xconv_on_brute_force_knn(pyg):
    _, out, _ = pyg
    got, ref = out["xconv"]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_pointnet_conv_edges_are_the_brute_force_ball(pyg):
    inp, out, _ = pyg
    pos, batch = inp["pos"], inp["batch"]
    idx = out["fps"]
    ref = ref_radius(pos, pos[idx], R, batch, batch[idx], 64)
    assert torch.equal(out["pointnet_edges"], ref)
    assert out["pointnet_conv"].shape == (len(idx), 8) and out["pointnet_conv"].isfinite().all()


def test_opcheck_passes_for_every_operator(pyg):
    _, _, meta = pyg
    assert set(meta["opcheck"]) == {"fps", "knn", "knn_nobatch", "radius", "radius_same", "nearest", "grid_cluster"}
    for name, res in meta["opcheck"].items():
        assert all(v == "SUCCESS" for v in res.values()), (name, res)


def test_fullgraph_compile_of_the_operators_gives_the_eager_edges(pyg):
    inp, out, _ = pyg
    knn_e, radius_e = out["compiled"]
    assert torch.equal(knn_e, out["knn"])
    assert torch.equal(radius_e, out["radius_cap"])


# ----------------------------------------------------------------------------------------------
# install() itself


def test_install_never_shadows_a_real_package(tmp_path):
    site = tmp_path / "site"
    for name, body in (("torch_cluster", "REAL = True\n"), ("pyg_lib", "REAL = True\nclass ops: pass\n"), ("spconv", "REAL = True\n")):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(body)
    meta = run_child(
        """
        import json, warnings
        import torch
        import pcops.compat
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = pcops.compat.install("torch_cluster", "pyg", "spconv")
        import torch_cluster, pyg_lib, spconv
        try:
            torch.ops.pyg.knn
            defined = True
        except (AttributeError, RuntimeError):
            defined = False
        print(json.dumps({"report": {n: list(o) for n, o in report.items()},
                          "real": [torch_cluster.REAL, pyg_lib.REAL, getattr(spconv, "REAL", False)],
                          "pyg_op_defined": defined, "warnings": [str(w.message) for w in caught]}))
        """, tmp_path, pythonpath=str(site))
    assert meta["real"] == [True, True, True]
    assert not meta["pyg_op_defined"]
    for name in ("torch_cluster", "pyg", "spconv"):
        installed, reason, modules = meta["report"][name]
        assert not installed and "real" in reason and modules == []
    assert len(meta["warnings"]) == 3


def test_install_replace_takes_the_named_package_but_never_pyg_lib(tmp_path):
    site = tmp_path / "site"
    (site / "torch_cluster").mkdir(parents=True)
    (site / "torch_cluster" / "__init__.py").write_text("REAL = True\n")
    meta = run_child(
        """
        import json
        import pcops.compat
        report = pcops.compat.install("torch_cluster", replace=True)
        import torch_cluster
        errors = []
        for call in (lambda: pcops.compat.install("pyg", replace=True), lambda: pcops.compat.install(replace=True),
                     lambda: pcops.compat.install("spconv", replace=1)):
            try:
                call()
            except (ValueError, TypeError) as exc:
                errors.append(type(exc).__name__ + ": " + str(exc))
        print(json.dumps({"installed": report.installed, "reason": report["torch_cluster"].reason,
                          "module": torch_cluster.__name__, "errors": errors}))
        """, tmp_path, pythonpath=str(site))
    assert meta["installed"] == ["torch_cluster"] and meta["module"] == "pcops.compat.torch_cluster"
    assert "replacing the real torch_cluster" in meta["reason"]
    assert len(meta["errors"]) == 3
    assert "'pyg'" in meta["errors"][0] and "needs the names" in meta["errors"][1] and meta["errors"][2].startswith("TypeError: replace")


def test_install_sets_the_aliases_and_is_idempotent(tmp_path):
    meta = run_child(
        """
        import json, sys
        import pcops.compat
        sys.modules["spconv"] = None  # hide the real spconv of this environment (find_spec then finds none)
        first = pcops.compat.install("pyg", "torch_cluster", "spconv")
        second = pcops.compat.install("pyg_lib", "torch_cluster", "spconv")
        import torch_cluster, spconv.pytorch
        print(json.dumps({"first": first.installed, "second": second.installed,
                          "modules": list(first["pyg"].modules), "spconv": list(first["spconv"].modules),
                          "ours": [torch_cluster.__name__, spconv.__name__], "pyg_lib": "pyg_lib" in sys.modules}))
        """, tmp_path)
    assert meta["first"] == meta["second"] == ["pyg", "torch_cluster", "spconv"]
    assert meta["modules"] == [] and not meta["pyg_lib"]  # "pyg" enters no module
    assert meta["spconv"][0] == "spconv" and "spconv.pytorch" in meta["spconv"]  # the drop-in's __aliases__
    assert meta["ours"] == ["pcops.compat.torch_cluster", "pcops.compat.spconv"]


def test_install_after_importing_torch_geometric_works(tmp_path):
    """PyG reads its flags at each call, so install("pyg") may come after ``import torch_geometric``."""
    meta = run_child(
        """
        import json, warnings
        import torch
        import torch_geometric.typing as tgt
        from torch_geometric.nn import knn
        import pcops.compat
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = pcops.compat.install("pyg")
        edges = knn(torch.tensor([[0.0, 0, 0], [1, 0, 0]]), torch.tensor([[0.9, 0, 0]]), 1)
        print(json.dumps({"installed": report["pyg"].installed, "flag": tgt.WITH_FPS, "edges": edges.tolist(),
                          "warnings": [str(w.message) for w in caught]}))
        """, tmp_path)
    assert meta["installed"] and meta["flag"] is True and meta["warnings"] == []
    assert meta["edges"] == [[0], [1]]


def test_install_rejects_unknown_names():
    import pcops.compat

    with pytest.raises(ValueError, match="names: unknown drop-in 'torch_sparse'"):
        pcops.compat.install("torch_sparse")
    with pytest.raises(TypeError, match="names must be strings"):
        pcops.compat.install(3)
