"""Point Transformer V3 (models/ptv3.py): configs, patches, attention, permutation, compile."""

import math
import pathlib
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import pcops

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import train  # noqa: E402

from models.ptv3 import PatchAttention, PointTransformerV3, patch_slots  # noqa: E402

TINY = ["--data.init_args.train_size", "18", "--data.init_args.val_size", "9", "--data.init_args.test_size", "9",
        "--data.init_args.n_points", "128", "--data.init_args.batch_size", "9"]
CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true", "--rmm_pool", "false"]
SMALL = dict(voxel_size=0.1, channels=(16, 32), depths=(2, 1), heads=(2, 2), patch=(16, 8),
             dec_channels=(16,), dec_depths=(1,), dec_heads=(2,), dec_patch=(16,), hidden=16)


def small(segment: bool, num_classes: int = 5) -> PointTransformerV3:
    torch.manual_seed(0)
    return PointTransformerV3(num_classes, segment=segment, **SMALL)


def clouds(gen, b: int, n: int) -> torch.Tensor:
    """Points on a sphere of radius 0.5 (a surface, as the tasks' clouds), often several per voxel."""
    p = torch.randn(b, n, 3, generator=gen)
    return 0.5 * p / p.norm(dim=-1, keepdim=True)


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["ptv3_cls", "ptv3_seg"])
def test_config_runs_with_fast_dev_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = train.main(["--config", str(ROOT / f"configs/{name}.yaml"), *CPU, *TINY, "--trainer.fast_dev_run", "true"])
    assert results and all(math.isfinite(v) for v in results.values()), results
    assert ("test/miou" in results) == name.endswith("seg")


# ---------------------------------------------------------------- patches and attention


def test_patches_start_at_each_sample_and_never_mix_samples():
    batch = torch.tensor([0] * 5 + [1] * 1 + [3] * 9)  # sample 2 is empty
    v, patch = batch.shape[0], 4
    inverse = torch.stack([torch.arange(v), torch.arange(v).flip(0).sort().values])  # two curves (the second one the same)
    slots, key_valid = patch_slots(batch, inverse, 4, patch)
    assert key_valid.shape == (v // patch + 4 + 1, 1, 1, patch)
    expected = torch.tensor([0, 1, 2, 3, 4] + [8] + [12, 13, 14, 15, 16, 17, 18, 19, 20])  # 5 -> 2 patches, 1 -> 1, 9 -> 3
    assert torch.equal(slots[0], expected) and torch.equal(slots[1], expected)
    valid = key_valid.flatten()
    assert torch.equal(valid.nonzero().flatten(), expected)
    # every patch holds one sample's voxels only, consecutive along the curve
    patch_of = expected // patch
    for p in patch_of.unique():
        members = (patch_of == p).nonzero().flatten()
        assert batch[members].unique().numel() == 1
        assert torch.equal(members, torch.arange(int(members[0]), int(members[-1]) + 1))


def test_patch_attention_equals_softmax_attention_within_each_patch(gen):
    torch.manual_seed(0)
    channels, heads, patch = 8, 2, 4
    attn = PatchAttention(channels, heads, patch).double()
    batch = torch.tensor([0] * 6 + [1] * 3)
    v = batch.shape[0]
    order = torch.cat([torch.randperm(6, generator=gen), 6 + torch.randperm(3, generator=gen)])  # a curve: voxel at each position
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(v)
    x = torch.randn(v, channels, dtype=torch.float64, generator=gen)
    slots, key_valid = patch_slots(batch, inverse[None], 2, patch)
    out = attn(x, slots[0], key_valid)
    # reference: walk the curve sample by sample, cut into patches of `patch`, plain softmax attention
    expected = torch.empty_like(x)
    q, k, val = attn.qkv(x).split(channels, -1)
    for b in (0, 1):
        seq = order[batch[order] == b]
        for start in range(0, seq.numel(), patch):
            rows = seq[start:start + patch]
            heads_out = []
            for h in range(heads):
                cols = slice(h * channels // heads, (h + 1) * channels // heads)
                weights = torch.softmax(q[rows, cols] @ k[rows, cols].T / math.sqrt(channels // heads), -1)
                heads_out.append(weights @ val[rows, cols])
            expected[rows] = attn.proj(torch.cat(heads_out, -1))
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- the network


@pytest.mark.parametrize("segment", [False, True], ids=["cls", "seg"])
def test_output_does_not_depend_on_the_order_of_the_points(gen, segment):
    """Voxels are numbered by (sample, x, y, z) and hold the mean of their points, curve codes are
    unique: shuffling a cloud shuffles its labels (segmentation) and leaves its class logits alone."""
    net = small(segment).eval()
    points = clouds(gen, 3, 300)
    sampled = pcops.grid_sample(points, net.voxel_size, mode="mean")
    assert sampled.points.shape[0] < 0.8 * points.shape[0] * points.shape[1]  # voxels do merge points
    perm = torch.randperm(300, generator=gen)
    with torch.no_grad():
        out, shuffled = net(points), net(points[:, perm])
    assert out.shape == ((3, 300, 5) if segment else (3, 5))
    torch.testing.assert_close(shuffled, out[:, perm] if segment else out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("segment", [False, True], ids=["cls", "seg"])
def test_a_sample_does_not_depend_on_the_rest_of_the_batch(gen, segment):
    """Patches never cross samples and evaluation normalises with running statistics."""
    net = small(segment).eval()
    points = clouds(gen, 3, 200)
    with torch.no_grad():
        together, alone = net(points)[1], net(points[1:2])[0]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_segmentation_labels_points_of_one_voxel_by_their_offsets(gen):
    net = small(True).eval()
    points = clouds(gen, 1, 300)
    pair = torch.cat([points[:, :1], points[:, :1] + 1e-3], 1)  # two points in (almost surely) one voxel
    assert pcops.grid_sample(pair, net.voxel_size).points.shape[0] == 1
    with torch.no_grad():
        out = net(pair)
    assert not torch.allclose(out[0, 0], out[0, 1])


# the segmenter (18 s) adds the decoder, whose unpooling compiles whole in its own tests: `pytest -m slow`
@pytest.mark.parametrize("segment", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["cls", "seg"])
def test_compiles_with_fullgraph_without_graph_breaks_for_new_sizes(gen, segment):
    """One graph (fullgraph, dynamic) serves clouds with other numbers of points, in training
    (shuffled curves, drop-path, backward), and equals eager in evaluation. (The batch size is
    specialised: a new batch size compiles once more.)"""
    torch._dynamo.reset()
    counters.clear()
    net = small(segment)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, fullgraph=True, dynamic=True, backend=counter)
    for b, n in ((2, 200), (2, 260)):
        points = clouds(gen, b, n)
        out = compiled(points)
        assert out.shape == ((b, n, 5) if segment else (b, 5))
        out.square().mean().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters() if p.requires_grad)
    graphs = [g for g in counter.graphs if any("call" in node.op for node in g.graph.nodes)]  # not the empty first frame
    assert len(graphs) == 1, "recompiled for a new size"
    assert "pcops." in graphs[0].code  # the ops are traced into the graph
    assert not counters["graph_break"], dict(counters["graph_break"])
    net.eval()
    points = clouds(gen, 2, 150)
    with torch.no_grad():
        torch.testing.assert_close(compiled(points), net(points), rtol=1e-4, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_bad_stage_lists_are_clear_errors():
    with pytest.raises(ValueError, match="one entry per encoder stage"):
        PointTransformerV3(3, channels=(16, 32), depths=(1,), heads=(2, 2), patch=(8, 8))
    with pytest.raises(ValueError, match="encoder stages - 1"):
        PointTransformerV3(3, segment=True, channels=(16, 32), depths=(1, 1), heads=(2, 2), patch=(8, 8), dec_channels=(16, 16))
    with pytest.raises(ValueError, match="orders must be"):
        PointTransformerV3(3, orders=["peano"])
