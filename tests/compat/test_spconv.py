"""pcops.compat.spconv against float64 dense references (torch's conv3d / conv_transpose3d /
max_pool3d on each sample's dense grid, read at the sites), against spconv 2.x's own CPU
forward where it is installed, by gradcheck, and its state_dicts, indice_key and aliases."""

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
    x = random_tensor(gen, channels=2, n=40, shape=[4, 4, 4])
    assert gradcheck_layer(sp.SubMConv3d(2, 3, 3).double(), x)


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
    import spconv.pytorch as spconv  # noqa: the line Pointcept writes
    from spconv.pytorch.modules import SparseModule, is_spconv_module

    assert spconv is sp and spconv.modules.is_spconv_module is is_spconv_module and SparseModule is sp.SparseModule
    assert spconv.SubMConv3d is sp.SubMConv3d and spconv.SparseConvTensor is sp.SparseConvTensor


# ----------------------------------------------------------------------------------------------
# against spconv itself (its CPU wheel: forward only, no bias on the CPU: bias added after)


def spconv_or_skip():
    return pytest.importorskip("spconv.pytorch")


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
        expected = theirs(spconv_input(spconv, x))
    y = ours(x)
    assert torch.equal(y.indices, expected.indices)
    torch.testing.assert_close(y.features, expected.features + ours.bias, rtol=1e-5, atol=1e-5)
