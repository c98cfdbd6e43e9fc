"""pcops.sparse_conv3d against a dense torch.nn.functional.conv3d read at the active sites
(the shared op suite, plus the kernel map, duplicates, dilation, kernel sizes and the layer)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import pcops
import pcops.nn
from tests import reference
from tests.compile_check import assert_compiles
from tests.op_suite import F64, OpSuite, assert_matches, pack

CIN, COUT = 3, 4


def dense_reference(features, coords, weight, bias=None, batch=None, dilation=1):
    """conv3d (cross-correlation, zero padding) on each sample's dense grid, read at its sites."""
    k3, cin, cout = weight.shape[0], weight.shape[-2], weight.shape[-1]
    k = round(k3 ** (1 / 3)) if weight.dim() == 3 else weight.shape[0]
    w = weight.double().reshape(k, k, k, cin, cout).permute(4, 3, 0, 1, 2)  # (Cout, Cin, K, K, K)
    n = coords.shape[0]
    out = torch.zeros(n, cout, dtype=F64)
    ids = torch.zeros(n, dtype=torch.int64) if batch is None else batch
    for b in ids.unique().tolist():
        rows = (ids == b).nonzero().flatten()
        c = coords[rows].long()
        c = c - c.amin(0)
        size = (c.amax(0) + 1).tolist()
        grid = torch.zeros(1, cin, *size, dtype=F64)
        grid[0, :, c[:, 0], c[:, 1], c[:, 2]] = features[rows].double().t()
        dense = F.conv3d(grid, w, padding=(k // 2) * dilation, dilation=dilation)
        out[rows] = dense[0][:, c[:, 0], c[:, 1], c[:, 2]].t()
    return out if bias is None else out + bias.double()


def sites(points, size):
    """Unique voxel coordinates of points (the sites of a voxelised cloud)."""
    return torch.unique(torch.floor(points / size).long(), dim=0)


class TestSparseConv3d(OpSuite):
    differentiable = ("features", "weight", "bias")

    def inputs(self, kind, gen):
        _, p, r = reference.cloud(kind, gen)
        coords = sites(p, r / 2)
        n = coords.shape[0]
        return dict(
            features=torch.randn(n, CIN, generator=gen, dtype=F64),
            coords=coords,
            weight=0.2 * torch.randn(27, CIN, COUT, generator=gen, dtype=F64),
            bias=torch.randn(COUT, generator=gen, dtype=F64),
        )

    def run(self, features, coords, weight, bias):
        return (pcops.sparse_conv3d(features, coords, weight, bias),)

    def reference(self, features, coords, weight, bias):
        return (dense_reference(features, coords, weight, bias),)

    def grad_inputs(self, gen):
        coords = torch.unique(torch.randint(0, 4, (30, 3), generator=gen), dim=0)
        n = coords.shape[0]
        return dict(features=torch.randn(n, 2, generator=gen, dtype=F64), coords=coords,
                    weight=torch.randn(27, 2, 3, generator=gen, dtype=F64), bias=torch.randn(3, generator=gen, dtype=F64))

    def opcheck_cases(self, gen):
        coords = torch.unique(torch.randint(0, 5, (40, 3), generator=gen), dim=0)
        n = coords.shape[0]
        batch = torch.randint(0, 2, (n,), generator=gen)
        km = pcops.sparse_kernel_map(coords, batch=batch)
        f = torch.randn(n, CIN, generator=gen, dtype=F64)
        w = torch.randn(27, CIN, COUT, generator=gen, dtype=F64)
        g = torch.randn(n, COUT, generator=gen, dtype=F64)
        return [
            (torch.ops.pcops.sparse_kernel_map.default, (coords, None, 3, 1)),
            (torch.ops.pcops.sparse_kernel_map.default, (coords.int(), batch, 5, 2)),
            (torch.ops.pcops.sparse_conv.default, (f.requires_grad_(), w.requires_grad_(), km.in_index, km.out_index, km.counts)),
            (torch.ops.pcops.sparse_conv_backward.default, (g, f.detach(), w.detach(), km.in_index, km.out_index, km.counts, True, True)),
        ]

    def compile_calls(self, gen):
        def fn(features, coords, batch, weight):
            return pcops.sparse_conv3d(features, coords, weight, batch=batch)

        calls = []
        for n in (40, 61):
            coords = torch.randperm(8**3, generator=gen)[:n]
            coords = torch.stack([coords // 64, coords // 8 % 8, coords % 8], 1)
            calls.append((torch.randn(n, CIN, generator=gen).requires_grad_(), coords, torch.randint(0, 2, (n,), generator=gen),
                          torch.randn(27, CIN, COUT, generator=gen).requires_grad_()))
        return fn, calls

    def test_compile_fullgraph(self, gen):
        fn, calls = self.compile_calls(gen)
        assert_compiles(fn, calls, backend="aot_eager")

    def batched(self, gen):
        # sparse tensors are packed (sites with sample ids, as spconv and Pointcept): no padded layout
        sizes = [30, 0, 9, 1]
        coords = [torch.unique(torch.randint(-3, 3, (n, 3), generator=gen), dim=0) for n in sizes]
        feats = [torch.randn(c.shape[0], CIN, generator=gen, dtype=F64) for c in coords]
        weight = torch.randn(27, CIN, COUT, generator=gen, dtype=F64)
        expected = [(pcops.sparse_conv3d(f, c, weight),) for f, c in zip(feats, coords)]
        for f, c, e in zip(feats, coords, expected):
            assert_matches(e[0], dense_reference(f, c, weight), F64)
        results = []
        for shuffle in (False, True):
            if shuffle:
                packed_coords, ids, position = pack(coords, gen)
            else:
                packed_coords, position = torch.cat(coords), torch.arange(sum(c.shape[0] for c in coords))
                ids = torch.cat([torch.full((c.shape[0],), b) for b, c in enumerate(coords)])
            packed_feats = torch.empty(len(packed_coords), CIN, dtype=F64)
            packed_feats[position] = torch.cat(feats)
            out = pcops.sparse_conv3d(packed_feats, packed_coords, weight, batch=ids)
            rows, at = [], 0
            for c in coords:
                rows.append((out[position[at : at + c.shape[0]]],))
                at += c.shape[0]
            results.append(rows)
        return expected, results[0], results[1]

    def bad_inputs(self, gen):
        coords = torch.unique(torch.randint(0, 4, (10, 3), generator=gen), dim=0)[:8]
        f, w = torch.randn(8, CIN, generator=gen), torch.randn(27, CIN, COUT, generator=gen)
        dup = coords.clone()
        dup[3] = dup[5]
        nan = f.clone()
        nan[2, 1] = float("nan")
        sc = pcops.sparse_conv3d
        km = pcops.sparse_kernel_map(coords)
        return {
            "float coords": (lambda: sc(f, coords.float(), w), TypeError, "grid_coord must have an integer dtype"),
            "coords shape": (lambda: sc(f, coords[:, :2], w), ValueError, "grid_coord must be a tensor of shape"),
            "feature rows": (lambda: sc(f[:7], coords, w), ValueError, r"features and grid_coord must have the same number of rows \(one per site\), got 7 and 8"),
            "int features": (lambda: sc(f.long(), coords, w), TypeError, "features must have a floating dtype"),
            "weight shape": (lambda: sc(f, coords, w[:26]), ValueError, r"weight must be a tensor of shape \(K\^3, Cin, Cout\) or \(K, K, K, Cin, Cout\)"),
            "weight channels": (lambda: sc(f[:, :2], coords, w), ValueError, "features and weight must have the same number of input channels Cin, got 2 and 3"),
            "kernel_size": (lambda: sc(f, coords, w, kernel_size=5), ValueError, "kernel_size and weight must have the same kernel size K, got 5 and 3"),
            "even kernel": (lambda: pcops.sparse_kernel_map(coords, kernel_size=2), ValueError, "kernel_size must be an odd int"),
            "float kernel": (lambda: pcops.sparse_kernel_map(coords, kernel_size=3.0), TypeError, "kernel_size must be an int, got float"),
            "dilation": (lambda: sc(f, coords, w, dilation=0), ValueError, r"dilation must be in \[1, 2147483647\], got 0"),
            "bias shape": (lambda: sc(f, coords, w, torch.zeros(3)), ValueError, "bias must be a tensor of shape"),
            "batch dtype": (lambda: sc(f, coords, w, batch=torch.zeros(8)), TypeError, "batch must have an integer dtype"),
            "duplicate sites": (lambda: sc(f, dup, w), ValueError, "grid_coord has duplicate sites"),
            "kernel_map type": (lambda: sc(f, coords, w, kernel_map=(1, 2)), TypeError, "kernel_map must be a pcops.KernelMap"),
            "kernel_map size": (lambda: sc(f[:7], None, w, kernel_map=km), ValueError, "features and kernel_map must have the same number of sites, got 7 and 8"),
            "kernel_map dilation": (lambda: sc(f, None, w, dilation=2, kernel_map=km), ValueError, "kernel_map.dilation and dilation must have the same dilation, got 1 and 2"),
            "no coords": (lambda: sc(f, None, w), ValueError, "grid_coord is None"),
            "NaN features": (lambda: sc(nan, coords, w), ValueError, "features contains NaN or inf"),
        }


def test_kernel_map_matches_a_dictionary_of_sites(gen):
    coords = torch.unique(torch.randint(-5, 5, (300, 3), generator=gen), dim=0)
    batch = torch.randint(0, 3, (coords.shape[0],), generator=gen)
    km = pcops.sparse_kernel_map(coords, batch=batch, kernel_size=5, dilation=2)
    where = {(b, *c): i for i, (b, c) in enumerate(zip(batch.tolist(), coords.tolist()))}
    offsets = [(a, b, c) for a in range(-2, 3) for b in range(-2, 3) for c in range(-2, 3)]
    expected = torch.tensor([[where.get((s, x + 2 * a, y + 2 * b, z + 2 * c), -1) for (s, (x, y, z)) in zip(batch.tolist(), coords.tolist())]
                             for a, b, c in offsets])
    assert torch.equal(km.neighbours, expected)
    k, i = (expected >= 0).nonzero(as_tuple=True)
    pairs = i.shape[0]  # then -1 up to K^3 N (a size that follows from the inputs')
    assert km.in_index.shape == km.out_index.shape == (expected.numel(),)
    assert torch.equal(km.out_index[:pairs], i) and torch.equal(km.in_index[:pairs], expected[k, i])
    assert bool((km.in_index[pairs:] == -1).all()) and bool((km.out_index[pairs:] == -1).all())
    assert torch.equal(km.counts, (expected >= 0).sum(1))


@pytest.mark.parametrize("kernel_size,dilation", [(1, 1), (3, 2), (5, 1)])
def test_kernel_sizes_and_dilations_match_dense_conv3d(gen, kernel_size, dilation):
    coords = torch.unique(torch.randint(0, 9, (150, 3), generator=gen), dim=0)
    f = torch.randn(coords.shape[0], CIN, generator=gen, dtype=F64)
    w = torch.randn(kernel_size, kernel_size, kernel_size, CIN, COUT, generator=gen, dtype=F64)
    out = pcops.sparse_conv3d(f, coords, w, dilation=dilation)
    assert_matches(out, dense_reference(f, coords, w, dilation=dilation), F64)


def test_weight_index_is_the_offset_in_x_major_order():
    # one site at the origin, one at +x: the origin's output reads weight[(2 * 3 + 1) * 3 + 1] (offset (+1, 0, 0))
    coords = torch.tensor([[0, 0, 0], [1, 0, 0]])
    f = torch.tensor([[0.0], [1.0]], dtype=F64)
    w = torch.zeros(27, 1, 1, dtype=F64)
    w[(2 * 3 + 1) * 3 + 1] = 5.0
    assert pcops.sparse_conv3d(f, coords, w).flatten().tolist() == [5.0, 0.0]


def test_reused_kernel_map_equals_a_fresh_search(gen):
    coords = torch.unique(torch.randint(0, 10, (400, 3), generator=gen), dim=0)
    f = torch.randn(coords.shape[0], 8, generator=gen)
    layer1, layer2 = pcops.nn.SparseConv3d(8, 8), pcops.nn.SparseConv3d(8, 4, bias=False)
    km = pcops.sparse_kernel_map(coords)
    shared = layer2(layer1(f, None, kernel_map=km), None, kernel_map=km)
    fresh = layer2(layer1(f, coords), coords)
    assert torch.equal(shared, fresh)


def test_layer_compiles_two_convs_sharing_one_kernel_map(gen):
    layer1, layer2 = pcops.nn.SparseConv3d(CIN, 8), pcops.nn.SparseConv3d(8, COUT)

    def fn(features, coords):
        km = pcops.sparse_kernel_map(coords)
        return layer2(torch.relu(layer1(features, coords, kernel_map=km)), coords, kernel_map=km)

    calls = []
    for n in (50, 70):
        c = torch.randperm(9**3, generator=gen)[:n]
        calls.append((torch.randn(n, CIN, generator=gen).requires_grad_(), torch.stack([c // 81, c // 9 % 9, c % 9], 1)))
    assert_compiles(fn, calls, backend="aot_eager")


def test_layer_gradients_reach_weight_and_bias(gen):
    coords = torch.unique(torch.randint(0, 5, (60, 3), generator=gen), dim=0)
    layer = pcops.nn.SparseConv3d(CIN, COUT).double()
    f = torch.randn(coords.shape[0], CIN, generator=gen, dtype=F64)
    layer(f, coords).square().sum().backward()
    assert layer.weight.grad.abs().sum() > 0 and layer.bias.grad.abs().sum() > 0
    bound = 1 / (CIN * 27) ** 0.5
    assert layer.weight.abs().max() <= bound and tuple(layer.weight.shape) == (27, CIN, COUT)


def test_sites_without_neighbours_get_the_centre_tap_only(gen):
    coords = torch.tensor([[0, 0, 0], [10, 10, 10], [-10, 5, 3]])
    f = torch.randn(3, CIN, generator=gen, dtype=F64)
    w = torch.randn(27, CIN, COUT, generator=gen, dtype=F64)
    torch.testing.assert_close(pcops.sparse_conv3d(f, coords, w), f @ w[13])


def test_empty_sites():
    out = pcops.sparse_conv3d(torch.zeros(0, CIN), torch.zeros(0, 3, dtype=torch.int64), torch.zeros(27, CIN, COUT))
    assert out.shape == (0, COUT)


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    coords = torch.unique(torch.randint(0, 30, (5000, 3), generator=gen), dim=0)
    batch = torch.randint(0, 3, (coords.shape[0],), generator=gen)
    f = torch.randn(coords.shape[0], 16, generator=gen)
    w = torch.randn(27, 16, 8, generator=gen)
    cpu_map = pcops.sparse_kernel_map(coords, batch=batch)
    gpu_map = pcops.sparse_kernel_map(coords.cuda(), batch=batch.cuda())
    assert torch.equal(gpu_map.neighbours.cpu(), cpu_map.neighbours)
    torch.testing.assert_close(pcops.sparse_conv3d(f.cuda(), coords.cuda(), w.cuda(), batch=batch.cuda()).cpu(),
                               pcops.sparse_conv3d(f, coords, w, batch=batch), rtol=1e-4, atol=1e-4)


def test_gradients_of_gradients(gen):
    """The backward op is differentiable again (gradients of gradients for both inputs)."""
    coords = torch.unique(torch.randint(0, 5, (40, 3), generator=gen), dim=0)
    f = torch.rand(coords.shape[0], 2, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.rand(27, 2, 3, generator=gen, dtype=torch.float64).requires_grad_()
    km = pcops.sparse_kernel_map(coords)
    assert torch.autograd.gradgradcheck(lambda f, w: pcops.sparse_conv3d(f, None, w, kernel_map=km), (f, w))


def test_the_layer_is_importable_from_the_top_level_as_readme_lists_it():
    from pcops import SparseConv3d

    assert SparseConv3d is pcops.nn.SparseConv3d and "SparseConv3d" in pcops.__all__


def test_an_even_weight_is_rejected_by_its_own_name(gen):
    # a defect: a weight with 8 offsets (K = 2) was rejected with a message about kernel_size, which the caller never passed
    grid_coord = torch.tensor([[0, 0, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match=r"weight has K = 2 taps per axis \(shape \(8, 4, 2\)\): K must be odd"):
        pcops.sparse_conv3d(torch.randn(2, 4, generator=gen), grid_coord, torch.randn(8, 4, 2, generator=gen))


def test_the_former_keyword_coords_warns_and_gives_the_same_result(gen):
    grid_coord = torch.tensor([[0, 0, 0], [1, 0, 0], [3, 3, 3]])
    f, w = torch.randn(3, 4, generator=gen), torch.randn(27, 4, 2, generator=gen)
    expect = pcops.sparse_conv3d(f, grid_coord, w)
    with pytest.warns(FutureWarning, match="'coords' is renamed 'grid_coord'"):
        assert torch.equal(pcops.sparse_conv3d(f, coords=grid_coord, weight=w), expect)
    with pytest.warns(FutureWarning, match="'coords' is renamed 'grid_coord'"):
        km = pcops.sparse_kernel_map(coords=grid_coord)
    assert torch.equal(km.neighbours, pcops.sparse_kernel_map(grid_coord).neighbours)
    layer = pcops.SparseConv3d(4, 2)
    with pytest.warns(FutureWarning, match="'coords' is renamed 'grid_coord'"):
        assert torch.equal(layer(f, coords=grid_coord), layer(f, grid_coord))
    with pytest.raises(TypeError, match="pass only 'grid_coord'"):
        pcops.sparse_conv3d(f, weight=w, coords=grid_coord, grid_coord=grid_coord)


def test_validate_false_skips_the_duplicate_check():
    grid_coord = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="duplicate"):
        pcops.sparse_kernel_map(grid_coord)
    km = pcops.sparse_kernel_map(grid_coord, validate=False)  # unspecified pairs, no error, no hang
    assert km.neighbours.shape == (27, 3) and bool(((km.neighbours >= -1) & (km.neighbours < 3)).all())


def test_the_former_keyword_compiles_whole(gen):
    grid_coord = torch.tensor([[0, 0, 0], [1, 0, 0], [3, 3, 3]])
    f, w = torch.randn(3, 4, generator=gen), torch.randn(27, 4, 2, generator=gen)
    fn = torch.compile(lambda f, c, w: pcops.sparse_conv3d(f, coords=c, weight=w), fullgraph=True, backend="eager")
    assert torch.equal(fn(f, grid_coord, w), pcops.sparse_conv3d(f, grid_coord, w))


def test_dilations_up_to_the_largest_find_their_pairs_and_larger_ones_are_refused():
    """The map's kernel takes the dilation as a 32-bit int: from 2^31 it wrapped and not even a
    site was paired with itself (sparse_conv3d gave 0). Dilations up to 2^31 - 1 pair sites that
    far apart; larger ones, and kernel sizes above 1,289 (K^3 offsets past a 32-bit int), are
    ValueErrors naming them, and a bool or float kernel size is refused as a dilation is."""
    for d in (2**30, 2**31 - 1):
        grid = torch.tensor([[0, 0, 0], [d, 0, 0], [3 * d, 0, 0]])
        km = pcops.sparse_kernel_map(grid, kernel_size=3, dilation=d)
        assert km.neighbours[13].tolist() == [0, 1, 2]  # the centre: each site itself
        assert km.neighbours[13 + 9].tolist() == [1, -1, -1] and km.neighbours[13 - 9].tolist() == [-1, 0, -1]  # +-d along x
        out = pcops.sparse_conv3d(torch.ones(3, 1), grid, torch.ones(27, 1, 1), dilation=d)
        assert out.flatten().tolist() == [2.0, 2.0, 1.0]
    grid, f = torch.zeros(1, 3, dtype=torch.int64), torch.ones(1, 1)
    for call, match in ((lambda: pcops.sparse_kernel_map(grid, dilation=2**31), r"^dilation must be in \[1, 2147483647\]"),
                        (lambda: pcops.sparse_conv3d(f, grid, torch.ones(27, 1, 1), dilation=2**62 + 1), r"^dilation must be in"),
                        (lambda: pcops.sparse_kernel_map(grid, kernel_size=1291), r"^kernel_size must be an odd int in \[1, 1289\]")):
        with pytest.raises(ValueError, match=match):
            call()
    for bad in (True, 3.0):
        with pytest.raises(TypeError, match="^kernel_size must be an int"):
            pcops.sparse_conv3d(torch.ones(2, 1), torch.tensor([[0, 0, 0], [1, 0, 0]]), torch.ones(27, 1, 1), kernel_size=bad)
    for bad in (None, True, 3.0):  # (a kernel map has no weight to take its size from: None is no size)
        with pytest.raises(TypeError, match="^kernel_size must be an int"):
            pcops.sparse_kernel_map(grid, kernel_size=bad)


def test_a_grid_coord_given_with_a_kernel_map_is_checked():
    """With a kernel_map, grid_coord was ignored unchecked (any shape, dtype or row count); it is
    checked as without one (the map holds the sites)."""
    gc = torch.tensor([[0, 0, 0], [0, 0, 1]])
    km = pcops.sparse_kernel_map(gc)
    f, w = torch.ones(2, 1), torch.ones(27, 1, 1)
    for bad, error, message in ((torch.zeros(5, 3, dtype=torch.long), ValueError, "grid_coord and kernel_map must have the same number of sites"),
                                (torch.rand(2, 3), TypeError, "grid_coord must have an integer dtype"),
                                (torch.zeros(2, 2, dtype=torch.long), ValueError, r"grid_coord must be a tensor of shape \(N, 3\)")):
        with pytest.raises(error, match=message):
            pcops.sparse_conv3d(f, bad, w, kernel_map=km)
    assert torch.equal(pcops.sparse_conv3d(f, gc, w, kernel_map=km), pcops.sparse_conv3d(f, None, w, kernel_map=km))


@pytest.mark.parametrize("kernel_size", [5, 7, 9])
def test_dilations_whose_keys_leave_int64_are_value_errors_and_the_others_exact(kernel_size):
    """Sites (K // 2) 2^30 apart with dilation 2^30: along x the shifted keys fit int64 and the map
    is the brute force's; along y or z the padding's shift of the keys does not (Python's
    OverflowError, or int64 wrapping in the kernel, before): a ValueError naming grid_coord."""
    d = 2**30
    for axis in range(3):
        gc = torch.zeros(2, 3, dtype=torch.long)
        gc[1, axis] = (kernel_size // 2) * d
        if axis:
            with pytest.raises(ValueError, match="^grid_coord spans .* too wide for the int64 keys"):
                pcops.sparse_kernel_map(gc, kernel_size=kernel_size, dilation=d)
            continue
        km = pcops.sparse_kernel_map(gc, kernel_size=kernel_size, dilation=d)
        offsets = torch.tensor(list(itertools.product(range(kernel_size), repeat=3))) - kernel_size // 2
        expected = torch.full((kernel_size**3, 2), -1)
        for k, off in enumerate(offsets):
            for i in range(2):
                hit = (gc == gc[i] + off * d).all(1).nonzero().flatten()
                if hit.numel():
                    expected[k, i] = hit[0]
        assert torch.equal(km.neighbours, expected)
