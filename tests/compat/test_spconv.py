"""pcops.compat.spconv against float64 dense references (torch's conv3d / conv_transpose3d /
max_pool3d on each sample's dense grid, read at the sites), against spconv 2.x's own CPU
forward where it is installed, by gradcheck, and its state_dicts, indice_key and aliases."""

import contextlib
import itertools
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pcops.compat import spconv as sp

F64 = torch.float64
SHAPE = [9, 8, 10]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def random_tensor(gen, channels=3, batch_size=2, n=120, shape=SHAPE, shuffle=False, dtype=F64):
    """A SparseConvTensor of unique random sites in ``shape`` over ``batch_size`` samples (rows
    grouped by sample, or shuffled)."""
    cells = torch.randperm(batch_size * shape[0] * shape[1] * shape[2], generator=gen)[:n]
    b, rest = cells // (shape[0] * shape[1] * shape[2]), cells % (shape[0] * shape[1] * shape[2])
    x, y, z = rest // (shape[1] * shape[2]), rest // shape[2] % shape[1], rest % shape[2]
    indices = torch.stack([b, x, y, z], 1)
    order = torch.randperm(n, generator=gen) if shuffle else torch.argsort(b * 10**6 + rest)
    indices = indices[order].int()
    features = torch.randn(n, channels, generator=gen, dtype=dtype)
    return sp.SparseConvTensor(features, indices, shape, batch_size)


def dense_grid(x):
    """(B, C, X, Y, Z) float64 with the features at the sites, zeros elsewhere (written directly)."""
    grid = torch.zeros(x.batch_size, x.features.shape[1], *x.spatial_shape, dtype=F64)
    for row, (b, i, j, k) in enumerate(x.indices.tolist()):
        grid[b, :, i, j, k] = x.features[row].double()
    return grid


def read_sites(grid, indices):
    """Rows (M, C) of a dense (B, C, X, Y, Z) grid at the sites ``indices`` (M, 4)."""
    i = indices.long()
    return grid[i[:, 0], :, i[:, 1], i[:, 2], i[:, 3]]


def conv3d_weight(weight):
    """spconv's (Cout, K0, K1, K2, Cin) as conv3d's (Cout, Cin, K0, K1, K2)."""
    return weight.detach().double().permute(0, 4, 1, 2, 3)


def bias_of(layer):
    return 0 if layer.bias is None else layer.bias.detach().double()


# ----------------------------------------------------------------------------------------------
# SubMConv3d


@pytest.mark.parametrize("shuffle", [False, True], ids=["grouped", "shuffled"])
@pytest.mark.parametrize("kernel_size,dilation", [(3, 1), (5, 1), (3, 2), (1, 1)])
def test_submconv_is_dense_conv3d_read_at_the_input_sites(gen, kernel_size, dilation, shuffle):
    x = random_tensor(gen, shuffle=shuffle)
    conv = sp.SubMConv3d(3, 4, kernel_size, dilation=dilation).double()
    y = conv(x)
    assert torch.equal(y.indices, x.indices) and y.spatial_shape == x.spatial_shape
    if kernel_size == 1:  # spconv's one-tap kernel: features @ weight.view(Cin, Cout) (its layout read as (Cin, Cout))
        expected = x.features @ conv.weight.detach().reshape(3, 4) + bias_of(conv)
    else:
        dense = F.conv3d(dense_grid(x), conv3d_weight(conv.weight), padding=(kernel_size // 2) * dilation, dilation=dilation)
        expected = read_sites(dense, x.indices) + bias_of(conv)
    torch.testing.assert_close(y.features, expected)


def test_samples_never_meet(gen):
    # the same sites in two samples: each sample's output equals its own convolution alone
    x = random_tensor(gen, batch_size=1, n=60)
    both = sp.SparseConvTensor(torch.cat([x.features, 2 * x.features]),
                               torch.cat([x.indices, x.indices + torch.tensor([1, 0, 0, 0], dtype=torch.int32)]), SHAPE, 2)
    conv = sp.SubMConv3d(3, 2, 3, bias=False).double()
    y = conv(both).features
    torch.testing.assert_close(y[:60], conv(x).features)
    torch.testing.assert_close(y[60:], 2 * conv(x).features)


def gradcheck_layer(layer, x):
    """float64 gradcheck of a layer's output features with respect to input features, weight and bias."""
    params = [p.detach().clone().requires_grad_() for p in (layer.weight, layer.bias) if p is not None]
    names = ["weight", "bias"][: len(params)]

    def fn(f, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (x.replace_feature(f),)).features

    return torch.autograd.gradcheck(fn, (x.features.detach().clone().requires_grad_(), *params))


def test_submconv_gradcheck_features_weight_bias(gen):
    x = random_tensor(gen, channels=2, n=20, shape=[3, 3, 4])
    assert gradcheck_layer(sp.SubMConv3d(2, 2, 3).double(), x)


def test_indice_key_shares_one_kernel_map_between_submanifold_layers(gen):
    x = random_tensor(gen)
    a, b = sp.SubMConv3d(3, 5, 3, indice_key="subm1").double(), sp.SubMConv3d(5, 2, 3, indice_key="subm1").double()
    ya = a(x)
    record = ya.indice_dict["subm1"]
    yb = b(ya)
    assert yb.indice_dict["subm1"] is record and "subm1" not in x.indice_dict  # the input's dict is not changed
    fresh = sp.SubMConv3d(5, 2, 3).double()
    fresh.load_state_dict(b.state_dict())
    torch.testing.assert_close(yb.features, fresh(ya.replace_feature(ya.features)).features)


def test_indice_key_reuse_with_another_kernel_size_raises(gen):
    x = random_tensor(gen)
    y = sp.SubMConv3d(3, 3, 3, indice_key="k").double()(x)
    with pytest.raises(ValueError, match="indice_key='k' was recorded with kernel_size"):
        sp.SubMConv3d(3, 3, 5, indice_key="k").double()(y)


# ----------------------------------------------------------------------------------------------
# SparseConvTensor, SparseSequential, modules


def test_dense_is_channels_first_and_from_dense_round_trips(gen):
    x = random_tensor(gen)
    dense = x.dense()
    assert dense.shape == (2, 3, *SHAPE)
    torch.testing.assert_close(dense, dense_grid(x))
    torch.testing.assert_close(x.dense(channels_first=False), dense_grid(x).permute(0, 2, 3, 4, 1))
    back = sp.SparseConvTensor.from_dense(x.dense(channels_first=False))
    assert back.indices.dtype == torch.int32 and back.spatial_shape == SHAPE and back.batch_size == 2
    order = torch.argsort(((x.indices[:, 0] * 100 + x.indices[:, 1]) * 100 + x.indices[:, 2]) * 100 + x.indices[:, 3])
    assert torch.equal(back.indices, x.indices[order])
    torch.testing.assert_close(back.features, x.features[order])
    assert x.spatial_size == 9 * 8 * 10


def test_replace_feature_keeps_sites_and_indice_dict(gen):
    x = random_tensor(gen)
    x.indice_dict["k"] = "record"
    y = x.replace_feature(x.features * 2)
    assert y.indices is x.indices and y.indice_dict is x.indice_dict and y.batch_size == 2
    with pytest.raises(ValueError, match="replace_feature"):
        y.features = x.features
    torch.testing.assert_close((x + y).features, 3 * x.features)


def test_sparse_sequential_gives_sparse_modules_the_tensor_and_others_the_features(gen):
    x = random_tensor(gen)
    conv = sp.SubMConv3d(3, 4, 3).double()
    seq = sp.SparseSequential(conv, nn.BatchNorm1d(4).double(), nn.ReLU(), sp.Identity())
    assert sp.modules.is_spconv_module(conv) and sp.modules.is_spconv_module(seq)
    assert not sp.modules.is_spconv_module(nn.ReLU()) and not sp.modules.is_spconv_module(sp.Identity())
    y = seq(x)
    expected = torch.relu(seq[1](conv(x).features))
    assert isinstance(y, sp.SparseConvTensor) and len(seq) == 4 and seq[-1] is seq[3]
    torch.testing.assert_close(y.features, expected)


def test_bad_inputs_name_the_argument(gen):
    x = random_tensor(gen)
    with pytest.raises(TypeError, match="indices must have an integer dtype"):
        sp.SparseConvTensor(x.features, x.indices.float(), SHAPE, 2)
    with pytest.raises(ValueError, match="indices must be a tensor of shape"):
        sp.SparseConvTensor(x.features, x.indices[:, :3], SHAPE, 2)
    with pytest.raises(ValueError, match="spatial_shape must have 3 entries"):
        sp.SparseConvTensor(x.features, x.indices, SHAPE[:2], 2)
    with pytest.raises(ValueError, match=r"input.features must have shape \(N, 5\)"):
        sp.SubMConv3d(5, 2, 3).double()(x)
    with pytest.raises(TypeError, match="input must be a SparseConvTensor"):
        sp.SubMConv3d(3, 2, 3)(x.features)
    with pytest.raises(TypeError, match="kernel_size must be an int or a sequence of 3 ints"):
        sp.SubMConv3d(3, 2, (3, 3))


def test_aliases_make_pointcepts_imports_resolve(monkeypatch):
    monkeypatch.setitem(sys.modules, "spconv", sp)
    for name, module in sp.__aliases__.items():
        monkeypatch.setitem(sys.modules, name, module)
    import spconv.pytorch as spconv  # the line Pointcept writes
    from spconv.pytorch.modules import SparseModule, is_spconv_module

    assert spconv is sp and spconv.modules.is_spconv_module is is_spconv_module and SparseModule is sp.SparseModule
    assert spconv.SubMConv3d is sp.SubMConv3d and spconv.SparseConvTensor is sp.SparseConvTensor


# ----------------------------------------------------------------------------------------------
# against spconv itself (its CPU wheel: forward only, no bias on the CPU: bias added after)


def spconv_or_skip():
    return pytest.importorskip("spconv.pytorch")


@contextlib.contextmanager
def one_thread():
    """spconv 2.3.8's CPU kernels race on more than one torch thread (Pointcept's PTv3 here: 33 of 92
    convolutions off on 2 threads, none on 1): the originals run on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def spconv_input(spconv, x, dtype=torch.float32):
    return spconv.SparseConvTensor(x.features.to(dtype), x.indices, x.spatial_shape, x.batch_size)


def test_state_dicts_of_spconv_modules_load_unchanged():
    spconv = spconv_or_skip()

    def build(lib):
        return lib.SparseSequential(
            lib.SubMConv3d(4, 8, 3, bias=False, indice_key="stem"), nn.BatchNorm1d(8), nn.ReLU(),
            lib.SparseConv3d(8, 16, 2, stride=2, bias=False, indice_key="down1"),
            lib.SubMConv3d(16, 16, 3, padding=1, indice_key="subm2"),
            lib.SparseInverseConv3d(16, 8, 2, bias=False, indice_key="down1"),
            lib.SubMConv3d(8, 5, 1, bias=True),
        )

    theirs, ours = build(spconv), build(sp)
    state = theirs.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("kernel_size,dilation", [(3, 1), (5, 2), (1, 1)])
def test_submconv_equals_spconv_forward(gen, kernel_size, dilation):
    spconv = spconv_or_skip()
    x = random_tensor(gen, channels=6, n=300, shape=[12, 11, 13], dtype=torch.float32, shuffle=True)
    theirs = spconv.SubMConv3d(6, 7, kernel_size, dilation=dilation, bias=False)
    ours = sp.SubMConv3d(6, 7, kernel_size, dilation=dilation)
    ours.load_state_dict({"weight": theirs.weight.detach(), "bias": torch.randn(7, generator=gen)})
    with torch.no_grad():
        with one_thread():
            expected = theirs(spconv_input(spconv, x))
        y = ours(x)
    assert torch.equal(y.indices, expected.indices)
    if kernel_size == 1:
        reference = x.features.double() @ ours.weight.double().reshape(6, 7)
    else:
        dense = F.conv3d(dense_grid(x), conv3d_weight(ours.weight), padding=(kernel_size // 2) * dilation, dilation=dilation)
        reference = read_sites(dense, x.indices)
    assert_equals_spconv(y.features - ours.bias, expected.features, reference)


# ----------------------------------------------------------------------------------------------
# strided SparseConv3d, SparseInverseConv3d, SparseMaxPool3d (float64 dense references)


def sort_rows(indices, features=None):
    """Rows ordered by (sample, x, y, z)."""
    i = indices.long()
    order = torch.argsort(((i[:, 0] * 1000 + i[:, 1]) * 1000 + i[:, 2]) * 1000 + i[:, 3])
    return indices[order], (None if features is None else features[order])


def reached_cells(x, kernel_size, stride, padding, dilation):
    """(M, 4) sites of the dense conv3d of the occupancy grid with a ones kernel that are > 0: the
    output cells some input reaches, in (sample, x, y, z) order."""
    occupancy = (dense_grid(x).abs().sum(1, keepdim=True) > 0).double()
    ones = torch.ones(1, 1, *kernel_size, dtype=F64)
    reach = F.conv3d(occupancy, ones, stride=stride, padding=padding, dilation=dilation)[:, 0]
    return reach.nonzero().int(), reach.shape[1:]


GEOMETRIES = [  # kernel_size, stride, padding, dilation
    ((2, 2, 2), 2, 0, 1),  # SpUNet's and OA-CNNs' down-sampling
    ((3, 3, 3), 2, 1, 1),
    ((3, 3, 3), 1, 0, 1),  # stride 1, unpadded: the grid shrinks, the active set grows
    ((3, 3, 3), 1, 1, 1),
    ((3, 3, 3), 2, 0, 2),
    ((1, 1, 1), 2, 0, 1),
    ((2, 3, 1), (2, 1, 3), (0, 1, 0), (1, 1, 1)),
]


@pytest.mark.parametrize("shuffle", [False, True], ids=["grouped", "shuffled"])
@pytest.mark.parametrize("kernel_size,stride,padding,dilation", GEOMETRIES)
def test_strided_conv_outputs_are_the_reached_cells_with_dense_conv3d_values(gen, kernel_size, stride, padding, dilation, shuffle):
    x = random_tensor(gen, shuffle=shuffle)
    conv = sp.SparseConv3d(3, 4, kernel_size, stride=stride, padding=padding, dilation=dilation).double()
    y = conv(x)
    expected_sites, out_shape = reached_cells(x, conv.kernel_size, conv.stride, conv.padding, conv.dilation)
    assert y.spatial_shape == list(out_shape) and y.indices.dtype == torch.int32
    assert torch.equal(sort_rows(y.indices)[0], expected_sites)
    dense = F.conv3d(dense_grid(x), conv3d_weight(conv.weight), stride=conv.stride, padding=conv.padding, dilation=conv.dilation)
    torch.testing.assert_close(y.features, read_sites(dense, y.indices) + bias_of(conv))


def transpose_reference(y, weight, kernel_size, stride, padding, dilation, sites):
    """The transpose of the strided convolution on dense grids: conv_transpose3d (no padding) of
    the grid of ``y``, cell i of the input grid at i + padding, read at ``sites``."""
    full = F.conv_transpose3d(dense_grid(y), weight.detach().double().permute(4, 0, 1, 2, 3), stride=stride, dilation=dilation)
    i = sites.long()
    pad = [max(0, int(i[:, a + 1].max()) + padding[a] + 1 - full.shape[a + 2]) for a in range(3)]
    full = F.pad(full, (0, pad[2], 0, pad[1], 0, pad[0]))
    return full[i[:, 0], :, i[:, 1] + padding[0], i[:, 2] + padding[1], i[:, 3] + padding[2]]


@pytest.mark.parametrize("shuffle", [False, True], ids=["grouped", "shuffled"])
@pytest.mark.parametrize("kernel_size,stride,padding,dilation", [g for g in GEOMETRIES if g[0] != (1, 1, 1)])
def test_inverse_conv_is_the_transpose_back_to_the_strided_inputs(gen, kernel_size, stride, padding, dilation, shuffle):
    x = random_tensor(gen, shuffle=shuffle)
    down = sp.SparseConv3d(3, 4, kernel_size, stride=stride, padding=padding, dilation=dilation, indice_key="down").double()
    up = sp.SparseInverseConv3d(4, 2, kernel_size, indice_key="down").double()
    y = down(x)
    z = up(y)
    assert torch.equal(z.indices, x.indices) and z.spatial_shape == x.spatial_shape
    expected = transpose_reference(y, up.weight, down.kernel_size, down.stride, down.padding, down.dilation, x.indices)
    torch.testing.assert_close(z.features, expected + bias_of(up))


@pytest.mark.parametrize("shuffle", [False, True], ids=["grouped", "shuffled"])
@pytest.mark.parametrize("kernel_size,stride,padding", [(2, None, 0), (3, 2, 1), (3, 1, 1), ((2, 1, 3), (2, 1, 1), (0, 0, 1))])
def test_max_pool_is_dense_max_pool3d_over_active_cells(gen, kernel_size, stride, padding, shuffle):
    x = random_tensor(gen, shuffle=shuffle)
    pool = sp.SparseMaxPool3d(kernel_size, stride, padding=padding)
    y = pool(x)
    grid = dense_grid(x)
    grid[(grid == 0).all(1, keepdim=True).expand_as(grid)] = float("-inf")  # inactive cells take no part
    dense = F.max_pool3d(grid, pool.kernel_size, pool.stride, pool.padding)
    sites = torch.isfinite(dense[:, 0]).nonzero().int()
    assert torch.equal(sort_rows(y.indices)[0], sites) and y.spatial_shape == list(dense.shape[2:])
    torch.testing.assert_close(y.features, read_sites(dense, y.indices))


def test_inverse_conv_inverts_a_pooling_by_its_key(gen):
    x = random_tensor(gen)
    pooled = sp.SparseMaxPool3d(2, 2, indice_key="pool")(x)
    up = sp.SparseInverseConv3d(3, 2, 2, indice_key="pool").double()
    z = up(pooled)
    assert torch.equal(z.indices, x.indices)
    torch.testing.assert_close(z.features, transpose_reference(pooled, up.weight, [2] * 3, [2] * 3, [0] * 3, [1] * 3, x.indices) + bias_of(up))


def test_strided_maps_reach_each_output_and_each_input_once_per_offset(gen):
    # the convolution ops' plain indexed writes need it in both directions (the map and its transpose)
    x = random_tensor(gen, n=300, shape=[7, 7, 7])
    for ksize, stride, padding, dilation in [([3] * 3, [2] * 3, [1] * 3, [1] * 3), ([2] * 3, [1] * 3, [0] * 3, [2] * 3)]:
        y = sp.SparseConv3d(3, 3, ksize, stride, padding, dilation, indice_key="k").double()(x)
        data = y.indice_dict["k"]
        bounds = [0] + torch.cumsum(data.counts, 0).tolist()
        assert bounds[-1] > 0
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert data.out_index[a:b].unique().numel() == b - a and data.in_index[a:b].unique().numel() == b - a


def test_strided_and_inverse_gradcheck(gen):
    x = random_tensor(gen, channels=2, n=40, shape=[5, 4, 5])
    down = sp.SparseConv3d(2, 3, 3, stride=2, padding=1, indice_key="d").double()
    assert gradcheck_layer(down, x)
    y = down(x)
    assert gradcheck_layer(sp.SparseInverseConv3d(3, 2, 3, indice_key="d").double(), y.replace_feature(y.features.detach()))


def test_max_pool_gradient_reaches_the_max(gen):
    x = random_tensor(gen, n=60)
    f = x.features.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda f: sp.SparseMaxPool3d(2)(x.replace_feature(f)).features, (f,))


def test_a_one_tap_inverse_conv_is_a_matmul_at_its_input_sites_as_in_spconv(gen):
    # spconv treats any kernel of one tap with stride 1 (an inverse convolution's) as features @ weight.view(Cin, Cout)
    x = random_tensor(gen)
    y = sp.SparseConv3d(3, 4, 1, stride=2, indice_key="d").double()(x)
    up = sp.SparseInverseConv3d(4, 2, 1, indice_key="d").double()
    z = up(y)
    assert torch.equal(z.indices, y.indices)
    torch.testing.assert_close(z.features, y.features @ up.weight.detach().reshape(4, 2) + bias_of(up))


def test_inverse_without_its_key_raises(gen):
    x = random_tensor(gen)
    with pytest.raises(ValueError, match="no kernel map is recorded under indice_key='up'"):
        sp.SparseInverseConv3d(3, 2, 2, indice_key="up").double()(x)
    y = sp.SubMConv3d(3, 3, 3, indice_key="s").double()(x)
    with pytest.raises(ValueError, match="belongs to a submanifold convolution"):
        sp.SparseInverseConv3d(3, 2, 3, indice_key="s").double()(y)


def test_conv_ops_pass_opcheck(gen):
    x = random_tensor(gen, n=50, shape=[5, 5, 5])
    coord, batch = x.indices[:, 1:].contiguous(), x.indices[:, 0].contiguous()
    geometry = ([3, 3, 3], [2, 2, 2], [1, 1, 1], [1, 1, 1])
    out_coord, out_batch, in_index, out_index, counts = torch.ops.pcops.sparse_conv_sites_map(coord, batch, *geometry, [3, 3, 3])
    f = torch.randn(50, 3, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(27, 3, 2, generator=gen, dtype=F64, requires_grad=True)
    m = out_coord.shape[0]
    torch.library.opcheck(torch.ops.pcops.sparse_conv_map.default, (coord, batch, out_coord, out_batch, *geometry))
    torch.library.opcheck(torch.ops.pcops.sparse_conv_sites_map.default, (coord, batch, *geometry, [3, 3, 3]))
    torch.library.opcheck(torch.ops.pcops.sparse_conv.default, (f, w, in_index, out_index, counts, m))
    torch.library.opcheck(torch.ops.pcops.sparse_conv.default, (w.new_ones(m, 2).requires_grad_(), w.transpose(1, 2).contiguous(),
                                                                out_index, in_index, counts, 50))
    g = torch.randn(m, 2, generator=gen, dtype=F64)
    torch.library.opcheck(torch.ops.pcops.sparse_conv_backward.default, (g, f.detach(), w.detach(), in_index, out_index, counts,
                                                                         True, True, m))


@pytest.mark.parametrize("geometry", [([2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1]), ([3, 3, 3], [2, 2, 2], [1, 1, 1], [1, 1, 1]),
                                      ([3, 2, 3], [1, 2, 3], [0, 1, 2], [2, 1, 1])])
def test_strided_sites_and_map_equal_brute_force_and_the_walked_map(gen, geometry):
    """pcops::sparse_conv_sites_map: the output sites are the cells of the output grid that some
    input reaches (every input and tap tried in Python), sorted by (sample, x, y, z); its pairs
    (unpadded) are those of pcops::sparse_conv_map's walk to the same sites; duplicate inputs raise."""
    x = random_tensor(gen, n=300, shape=[9, 11, 10], shuffle=True)
    coord, batch = x.indices[:, 1:].contiguous(), x.indices[:, 0].contiguous()
    ksize, stride, padding, dilation = geometry
    out_shape = [-(-(s + 2 * p - d * (k - 1)) // st) for s, k, st, p, d in zip([9, 11, 10], *geometry)]
    expected = set()
    for b, *c in x.indices.tolist():
        for taps in itertools.product(*(range(k) for k in ksize)):
            cell = [(ci + p - t * d) / s for ci, p, t, d, s in zip(c, padding, taps, dilation, stride)]
            if all(v == int(v) and 0 <= v < size for v, size in zip(cell, out_shape)):
                expected.add((b, *(int(v) for v in cell)))
    out_coord, out_batch, in_index, out_index, counts = torch.ops.pcops.sparse_conv_sites_map(coord, batch, *geometry, out_shape)
    assert [tuple(r) for r in torch.cat([out_batch[:, None], out_coord.long()], 1).tolist()] == sorted(expected)
    _, walked_in, walked_out, walked_counts = torch.ops.pcops.sparse_conv_map(coord, batch, out_coord, out_batch, *geometry)
    p = int(walked_counts.sum())
    assert p > 0 and in_index.shape == (p,) and torch.equal(counts, walked_counts)
    assert torch.equal(in_index, walked_in[:p]) and torch.equal(out_index, walked_out[:p])
    twice = torch.cat([coord, coord[7:8]]), torch.cat([batch, batch[7:8]])
    with pytest.raises(ValueError, match="duplicate sites"):
        torch.ops.pcops.sparse_conv_sites_map(*twice, *geometry, out_shape)


def test_strided_sites_compile_with_a_dynamic_size(gen):
    x = random_tensor(gen, n=50, shape=[6, 6, 6])
    coord, batch = x.indices[:, 1:].contiguous(), x.indices[:, 0].contiguous()

    def fn(coord, batch):
        geometry = ([2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], [3, 3, 3])
        return torch.ops.pcops.sparse_conv_sites_map(coord, batch, *geometry)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(coord, batch), fn(coord, batch)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel_size", [(3, 1, 5), (1, 3, 3)])
def test_submconv_with_a_kernel_size_per_axis(gen, kernel_size):
    x = random_tensor(gen)
    conv = sp.SubMConv3d(3, 2, kernel_size).double()
    dense = F.conv3d(dense_grid(x), conv3d_weight(conv.weight), padding=[k // 2 for k in kernel_size])
    torch.testing.assert_close(conv(x).features, read_sites(dense, x.indices) + bias_of(conv))


def test_spunet_style_encoder_decoder_restores_the_sites(gen):
    x = random_tensor(gen, channels=4, n=200, shape=[16, 16, 16])
    net = sp.SparseSequential(
        sp.SubMConv3d(4, 8, 3, padding=1, bias=False, indice_key="stem"), nn.BatchNorm1d(8), nn.ReLU(),
        sp.SparseConv3d(8, 16, 2, stride=2, bias=False, indice_key="spconv1"), nn.BatchNorm1d(16), nn.ReLU(),
        sp.SubMConv3d(16, 16, 3, padding=1, bias=False, indice_key="subm2"),
        sp.SparseConv3d(16, 32, 2, stride=2, bias=False, indice_key="spconv2"),
        sp.SparseInverseConv3d(32, 16, 2, bias=False, indice_key="spconv2"),
        sp.SparseInverseConv3d(16, 8, 2, bias=False, indice_key="spconv1"),
        sp.SubMConv3d(8, 5, 1, indice_key="stem"),
    ).double()
    y = net(x)
    assert torch.equal(y.indices, x.indices) and y.spatial_shape == x.spatial_shape and y.features.shape == (200, 5)
    y.features.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_to_dense_module(gen):
    x = random_tensor(gen)
    torch.testing.assert_close(sp.ToDense()(x), dense_grid(x))


def assert_equals_spconv(ours, theirs, reference, tol=1e-5):
    """Rows of ours equal spconv's, except rows where spconv's CPU forward itself misses the float64
    dense reference: its stride-1 SparseConv3d gave a wrong row now and then in repeated runs here
    (1 of ~2,400 rows in 1 of 12 runs; a race in its CPU kernels), which ours must still match."""
    torch.testing.assert_close(ours.double(), reference, rtol=tol, atol=tol)
    theirs_wrong = ((theirs.double() - reference).abs() > 10 * tol).any(1)
    assert int(theirs_wrong.sum()) <= max(1, theirs.shape[0] // 100), "spconv misses the reference in many rows"
    torch.testing.assert_close(ours[~theirs_wrong], theirs[~theirs_wrong], rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel_size,stride,padding,dilation", [(2, 2, 0, 1), (3, 2, 1, 1), (3, 1, 0, 1), ((2, 3, 1), (2, 1, 3), (0, 1, 0), 1)])
def test_strided_and_inverse_conv_equal_spconv_forward(gen, kernel_size, stride, padding, dilation):
    spconv = spconv_or_skip()
    x = random_tensor(gen, channels=6, n=400, shape=[14, 12, 13], dtype=torch.float32, shuffle=True)
    theirs_down = spconv.SparseConv3d(6, 5, kernel_size, stride, padding, dilation, bias=False, indice_key="d")
    theirs_up = spconv.SparseInverseConv3d(5, 4, kernel_size, indice_key="d", bias=False)
    ours_down = sp.SparseConv3d(6, 5, kernel_size, stride, padding, dilation, bias=False, indice_key="d")
    ours_up = sp.SparseInverseConv3d(5, 4, kernel_size, indice_key="d", bias=False)
    ours_down.load_state_dict(theirs_down.state_dict())
    ours_up.load_state_dict(theirs_up.state_dict())
    with torch.no_grad():
        with one_thread():
            their_y = theirs_down(spconv_input(spconv, x))
        y = ours_down(x)
        z = ours_up(y)
    assert y.spatial_shape == list(their_y.spatial_shape)
    ours_sorted, theirs_sorted = sort_rows(y.indices, y.features), sort_rows(their_y.indices, their_y.features)
    assert torch.equal(ours_sorted[0], theirs_sorted[0])  # spconv's row order is its own: compared as sets
    dense = F.conv3d(dense_grid(x), conv3d_weight(ours_down.weight), stride=ours_down.stride, padding=ours_down.padding,
                     dilation=ours_down.dilation)
    assert_equals_spconv(ours_sorted[1], theirs_sorted[1], read_sites(dense, ours_sorted[0]))
    # the inverse of both, fed the same features (ours, in spconv's row order): back to x's sites
    _, their_rows = sort_rows(their_y.indices, torch.arange(their_y.indices.shape[0]))
    _, our_rows = sort_rows(y.indices, torch.arange(y.indices.shape[0]))
    their_features = torch.empty_like(their_y.features)
    their_features[their_rows] = y.features[our_rows]
    with torch.no_grad():
        with one_thread():
            their_z = theirs_up(their_y.replace_feature(their_features))
    assert torch.equal(z.indices, x.indices) and torch.equal(their_z.indices, x.indices)
    reference = transpose_reference(y, ours_up.weight, ours_down.kernel_size, ours_down.stride, ours_down.padding,
                                    ours_down.dilation, x.indices)
    assert_equals_spconv(z.features, their_z.features, reference)


def test_max_pool_equals_spconv_forward_on_non_negative_features(gen):
    # spconv's CPU pooling starts each output at 0 (a max with 0): equal on features >= 0, e.g. after a ReLU
    spconv = spconv_or_skip()
    x = random_tensor(gen, channels=5, n=400, shape=[14, 12, 13], dtype=torch.float32, shuffle=True)
    x = x.replace_feature(x.features.relu())
    with torch.no_grad():
        with one_thread():
            theirs = spconv.SparseMaxPool3d(3, 2, padding=1)(spconv_input(spconv, x))
    ours = sp.SparseMaxPool3d(3, 2, padding=1)(x)
    assert ours.spatial_shape == list(theirs.spatial_shape)
    a, b = sort_rows(ours.indices, ours.features), sort_rows(theirs.indices, theirs.features)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize("kernel_size,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 0)], ids=["k2s2", "k3s2p1", "k3s1"])
def test_strided_conv_rejects_duplicate_sites(gen, kernel_size, stride, padding):
    x = random_tensor(gen)
    dup = sp.SparseConvTensor(torch.cat([x.features, x.features[5:6]]), torch.cat([x.indices, x.indices[5:6]]), x.spatial_shape, x.batch_size)
    conv = sp.SparseConv3d(3, 4, kernel_size, stride=stride, padding=padding).double()
    conv(x)  # unique sites: fine
    with pytest.raises(ValueError, match="duplicate"):
        conv(dup)


def _stack_run(x, device):
    """A SpUNet-style stack (submanifold, strided k2 s2 and k3 s2 p1, pooling, the inverse of the
    k2 s2) on ``device``: (sites and features of its two ends, gradients of the input and weights)."""
    torch.manual_seed(0)
    layers = nn.ModuleList([sp.SubMConv3d(4, 8, 3, indice_key="stem"), sp.SparseConv3d(8, 16, 2, stride=2, indice_key="down"),
                            sp.SubMConv3d(16, 16, 3, indice_key="mid"), sp.SparseConv3d(16, 16, 3, stride=2, padding=1),
                            sp.SparseMaxPool3d(2, 2), sp.SparseInverseConv3d(16, 8, 2, indice_key="down")]).to(device)
    stem, down, mid, deep, pool, up = layers
    features = x.features.detach().to(device).requires_grad_()  # a leaf on every device
    xi = sp.SparseConvTensor(features, x.indices.to(device), x.spatial_shape, x.batch_size)
    m = mid(down(stem(xi)))
    deepest, back = pool(deep(m)), up(m)
    (deepest.features.square().sum() + back.features.square().sum()).backward()
    return [t.detach().cpu() for t in (deepest.indices, deepest.features, back.indices, back.features, features.grad,
                                       *(p.grad for p in layers.parameters()))]


@pytest.mark.cuda
def test_cuda_results_and_gradients_equal_the_cpu_ones(gen):
    x = random_tensor(gen, channels=4, n=3000, shape=[40, 36, 30], shuffle=True, dtype=torch.float32)
    cpu, cuda = _stack_run(x, "cpu"), _stack_run(x, "cuda")
    assert torch.equal(cpu[2], x.indices) and torch.equal(cuda[0], cpu[0]) and torch.equal(cuda[2], cpu[2])
    for a, b in zip(cpu[1:], cuda[1:]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("column, value", [(0, -1), (0, 2), (1, -1), (2, SHAPE[1]), (3, SHAPE[2] + 5)])
def test_sites_outside_the_grid_are_an_error(gen, column, value):
    """A sample id outside [0, batch_size) or a coordinate outside [0, spatial_shape), which spconv
    leaves undefined: a ValueError naming the indices where a layer builds its kernel map, and in
    dense() (where a negative site would wrap around to the grid's far side)."""
    x = random_tensor(gen)
    indices = x.indices.clone()
    indices[3, column] = value
    bad = sp.SparseConvTensor(x.features, indices, SHAPE, 2)
    for layer in (sp.SubMConv3d(3, 2, 3), sp.SparseConv3d(3, 2, 2, stride=2), sp.SparseMaxPool3d(2, 2)):
        with pytest.raises(ValueError, match=r"input\.indices hold the .* outside \[0, "):
            layer.double()(bad)
    with pytest.raises(ValueError, match=r"^indices hold the "):
        bad.dense()
    x.dense()  # the grid's own sites pass
