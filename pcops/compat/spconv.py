"""spconv 2.x's ``spconv.pytorch`` API on pcops' sparse convolution: Pointcept's PTv3, SpUNet and
OA-CNNs run with no compiled extension, on the CPU as on a GPU.

``import spconv.pytorch as spconv`` becomes ``import pcops.compat.spconv as spconv`` (or
``pcops.compat.install("spconv")`` maps the module names of ``__aliases__``). What it mirrors:

* ``SparseConvTensor(features (N, C), indices (N, 4) int [batch, x, y, z], spatial_shape,
  batch_size)`` with ``indice_dict``, ``replace_feature``, ``dense(channels_first=True)``,
  ``from_dense``, ``spatial_size``, ``shadow_copy``, ``+``.
* ``SubMConv3d``, ``SparseConv3d``, ``SparseInverseConv3d`` with spconv 2.x's constructor
  arguments and parameters: ``weight`` (Cout, K0, K1, K2, Cin) (spconv's "KRSC" layout,
  kernel axes in the order of the index columns), ``bias`` (Cout,), so state_dicts of spconv
  modules load unchanged; ``SparseMaxPool3d``, ``SparseSequential``, ``ToDense``, ``Identity``
  and ``modules`` (``SparseModule``, ``is_spconv_module``).
* ``indice_key``: a layer records its kernel map in the tensor's ``indice_dict`` under its key;
  later submanifold layers with the key reuse it, and ``SparseInverseConv3d`` finds the strided
  convolution (or pooling) it inverts by the key and sends its features back to that layer's
  input sites, as spconv does.

The arithmetic is pcops' (:mod:`pcops.ops.sparse.sparse_conv`): a kernel map by sorting and a
gather-matmul-scatter convolution with registered gradients to features, weight and bias.
Differences from spconv and what was measured: docs/interop.md, section "spconv".
"""

from __future__ import annotations

import math
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .. import _validate


def _triple(name: str, value, low: int) -> list[int]:
    """spconv's ``expand_nd`` for three axes, checked: an int or a sequence of three ints >= low."""
    if isinstance(value, torch.Tensor) or hasattr(value, "tolist"):
        value = value.tolist()
    items = [value] * 3 if not isinstance(value, (list, tuple)) else list(value)
    if len(items) != 3 or any(isinstance(v, bool) or not isinstance(_validate.plain(v), int) for v in items):
        raise TypeError(f"{name} must be an int or a sequence of 3 ints, got {value!r}")
    items = [int(v) for v in items]
    if min(items) < low:
        raise ValueError(f"{name} must be >= {low} on every axis, got {value!r}")
    return items


class SparseConvTensor:
    """A batch of sparse 3-d feature grids, as ``spconv.pytorch.SparseConvTensor``.

    Args:
        features: Tensor of shape (N, C), one row per active site.
        indices: integer Tensor of shape (N, 4): sample id, then x, y, z (spconv uses int32).
        spatial_shape: the grid size per axis (3 ints); sites lie in ``[0, spatial_shape)``.
        batch_size: the number of samples (ids in ``[0, batch_size)``).
        grid, voxel_num, benchmark, permanent_thrust_allocator, enable_timer, force_algo:
            accepted for spconv's signature; unused.
        indice_dict: the kernel maps recorded by layers with an ``indice_key`` (shared with
            tensors derived by ``replace_feature``; a convolution's output gets a copy with its
            own entry added).
    """

    def __init__(self, features: torch.Tensor, indices: torch.Tensor, spatial_shape, batch_size: int, grid=None,
                 voxel_num=None, indice_dict: Optional[dict] = None, benchmark: bool = False,
                 permanent_thrust_allocator: bool = False, enable_timer: bool = False, force_algo=None):
        if not isinstance(features, torch.Tensor) or features.dim() != 2:
            raise ValueError(f"features must be a tensor of shape (N, C), got {getattr(features, 'shape', type(features).__name__)}")
        _validate.integer("indices", indices, ndim=2, last=4, shape_doc="(N, 4) [batch, x, y, z]", what="sample id and x, y, z")
        shape = list(spatial_shape.tolist() if hasattr(spatial_shape, "tolist") else spatial_shape)
        if len(shape) != 3:
            raise ValueError(f"spatial_shape must have 3 entries (x, y, z), got {spatial_shape!r}")
        self._features = features
        self.indices = indices
        self.spatial_shape = [int(v) for v in shape]
        self.batch_size = int(_validate.plain(batch_size))
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.indice_dict = {} if indice_dict is None else indice_dict
        self.grid = grid
        self.voxel_num = voxel_num
        self.benchmark = benchmark
        self.benchmark_record = {}
        self.force_algo = force_algo

    def __repr__(self) -> str:
        return f"SparseConvTensor[shape={self._features.shape}]"

    @property
    def features(self) -> torch.Tensor:
        return self._features

    @features.setter
    def features(self, value):
        raise ValueError("features cannot be set: use x = x.replace_feature(new_features), as in spconv")

    @property
    def spatial_size(self) -> int:
        return math.prod(self.spatial_shape)

    @property
    def is_quantized(self) -> bool:
        return False

    def replace_feature(self, feature: torch.Tensor) -> "SparseConvTensor":
        """The same sites (and ``indice_dict``) with new features."""
        out = SparseConvTensor(feature, self.indices, self.spatial_shape, self.batch_size, self.grid, self.voxel_num,
                               self.indice_dict, self.benchmark)
        out.benchmark_record = self.benchmark_record
        return out

    def shadow_copy(self) -> "SparseConvTensor":
        return self.replace_feature(self._features)

    def minus(self) -> "SparseConvTensor":
        return self.replace_feature(-self._features)

    def select_by_index(self, valid_indices: torch.Tensor) -> "SparseConvTensor":
        """The sites ``valid_indices`` (their recorded kernel maps no longer apply: a fresh ``indice_dict``)."""
        return SparseConvTensor(self._features[valid_indices], self.indices[valid_indices], self.spatial_shape, self.batch_size)

    def find_indice_pair(self, key):
        return None if key is None else self.indice_dict.get(key)

    @classmethod
    def from_dense(cls, x: torch.Tensor) -> "SparseConvTensor":
        """From a channels-last dense tensor (B, X, Y, Z, C): the sites where any channel is non-zero."""
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            raise ValueError(f"x must be a channels-last tensor of shape (B, X, Y, Z, C), got {getattr(x, 'shape', type(x).__name__)}")
        active = (x != 0).any(-1)
        indices = active.nonzero().to(torch.int32)
        return cls(x[active], indices, list(x.shape[1:-1]), x.shape[0])

    def dense(self, channels_first: bool = True) -> torch.Tensor:
        """The dense grid (B, C, X, Y, Z) (or (B, X, Y, Z, C)) with zeros at inactive sites."""
        _check_sites(self, "indices")
        f = self._features
        grid = f.new_zeros((self.batch_size, *self.spatial_shape, f.shape[1]))
        idx = self.indices.to(f.device).long()
        grid = grid.index_put((idx[:, 0], idx[:, 1], idx[:, 2], idx[:, 3]), f)
        return grid.permute(0, 4, 1, 2, 3).contiguous() if channels_first else grid

    def _other(self, other) -> torch.Tensor:
        if isinstance(other, SparseConvTensor):
            return other.features
        if isinstance(other, torch.Tensor):
            return other
        raise TypeError(f"other must be a SparseConvTensor or a torch.Tensor, got {type(other).__name__}")

    def __add__(self, other) -> "SparseConvTensor":
        return self.replace_feature(self._features + self._other(other))

    __radd__ = __add__

    def __iadd__(self, other) -> "SparseConvTensor":
        self._features = self._features + self._other(other)
        return self


@dataclass
class IndiceData:
    """A recorded kernel map (``SparseConvTensor.indice_dict[indice_key]``): the pairs of pcops'
    :class:`pcops.KernelMap` (``in_index``, ``out_index``, ``counts``) from the input sites
    ``indices`` to the output sites ``out_indices``, with the geometry that made them."""

    out_indices: torch.Tensor
    indices: torch.Tensor
    in_index: torch.Tensor
    out_index: torch.Tensor
    counts: torch.Tensor
    spatial_shape: list
    out_spatial_shape: list
    is_subm: bool
    ksize: list
    stride: list
    padding: list
    dilation: list


class SparseModule(nn.Module):
    """The base of the modules that take a :class:`SparseConvTensor` (``SparseSequential`` passes them the tensor itself)."""

    def __init__(self, name=None):
        super().__init__()
        self.name = name
        self._sparse_unique_name = ""


class SparseBatchNorm(nn.BatchNorm1d):
    """``BatchNorm1d`` on a sparse tensor's features."""

    def forward(self, input):
        return input.replace_feature(super().forward(input.features)) if isinstance(input, SparseConvTensor) else super().forward(input)


class SparseReLU(nn.ReLU):
    """``ReLU`` on a sparse tensor's features."""

    def forward(self, input):
        return input.replace_feature(super().forward(input.features)) if isinstance(input, SparseConvTensor) else super().forward(input)


class SparseIdentity(nn.Identity):
    """``Identity`` that also passes sparse tensors."""


class Identity(nn.Module):
    """spconv's ``Identity`` (a plain module: ``SparseSequential`` applies it to the features)."""

    def forward(self, input):
        return input


def is_spconv_module(module) -> bool:
    """Whether ``module`` takes a :class:`SparseConvTensor` (rather than its features)."""
    return isinstance(module, (SparseModule, SparseBatchNorm, SparseReLU))


def is_sparse_conv(module) -> bool:
    return isinstance(module, SparseConvolution)


class SparseSequential(SparseModule):
    """``nn.Sequential`` for sparse tensors: sparse modules get the tensor, other modules its features.

    Built from modules, an ``OrderedDict`` of named modules, or keyword arguments.
    """

    def __init__(self, *args, **kwargs):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), module)
        for key, module in kwargs.items():
            if key in self._modules:
                raise ValueError(f"SparseSequential: the name {key!r} is given twice")
            self.add_module(key, module)

    def __getitem__(self, idx: int):
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range for {n} modules")
        return list(self._modules.values())[idx % n]

    def __len__(self) -> int:
        return len(self._modules)

    def add(self, module, name=None):
        if name is None:
            name = str(len(self._modules))
            if name in self._modules:
                raise KeyError(f"the name {name!r} exists")
        self.add_module(name, module)

    def forward(self, input):
        for module in self._modules.values():
            if is_spconv_module(module):
                input = module(input)
            elif isinstance(input, SparseConvTensor):
                if input.indices.shape[0] != 0:
                    input = input.replace_feature(module(input.features))
            else:
                input = module(input)
        return input


class ToDense(SparseModule):
    """The dense (B, C, X, Y, Z) tensor of a sparse tensor."""

    def forward(self, x: SparseConvTensor) -> torch.Tensor:
        return x.dense()


class RemoveGrid(SparseModule):
    def forward(self, x: SparseConvTensor) -> SparseConvTensor:
        x.grid = None
        return x


def _conv_output_size(shape, ksize, stride, padding, dilation) -> list[int]:
    """The output grid of a strided convolution: ``(in + 2p - d (k - 1) - 1) // s + 1`` per axis."""
    out = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(shape, ksize, stride, padding, dilation)]
    if min(out) < 1:
        raise ValueError(f"the convolution (kernel_size={ksize}, stride={stride}, padding={padding}, dilation={dilation}) "
                         f"leaves no output of the spatial_shape {shape}")
    return out


def _check_input(input, name: str = "input") -> None:
    if not isinstance(input, SparseConvTensor):
        raise TypeError(f"{name} must be a SparseConvTensor, got {type(input).__name__}")


def _weight_rows(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """spconv's (Cout, K0, K1, K2, Cin) weight as pcops' (K0 K1 K2, Cin, Cout), offsets x slowest."""
    cout, cin = weight.shape[0], weight.shape[-1]
    return weight.to(dtype).permute(1, 2, 3, 4, 0).reshape(-1, cin, cout).contiguous()


class SparseConvolution(SparseModule):
    """The sparse convolutions of spconv 2.x (its ``SparseConvolution`` signature; ``ndim`` = 3).

    ``subm=True``: submanifold (outputs at the input sites, the kernel centred on them; stride
    and padding unused, as in spconv); ``inverse=True``: the transpose of the strided
    convolution or pooling recorded under ``indice_key`` (outputs at its input sites); else a
    strided convolution whose outputs are the sites of the output grid that some input reaches.
    ``weight`` is (Cout, K0, K1, K2, Cin), ``bias`` (Cout,); initialised as spconv does
    (uniform, bound 1 / sqrt(Cin K0 K1 K2)).
    """

    def __init__(self, ndim: int, in_channels: int, out_channels: int, kernel_size=3, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, subm: bool = False, output_padding=0, transposed: bool = False,
                 inverse: bool = False, indice_key: Optional[str] = None, algo=None, fp32_accum=None,
                 record_voxel_count: bool = False, act_type=None, act_alpha: float = 0, act_beta: float = 0,
                 large_kernel_fast_algo: bool = False, name=None, device=None, dtype=None):
        super().__init__(name=name)
        if ndim != 3:
            raise NotImplementedError(f"pcops.compat.spconv has 3-d sparse convolutions only, got ndim={ndim}")
        if groups != 1:
            raise NotImplementedError(f"groups must be 1 (as in spconv), got {groups}")
        if transposed:
            raise NotImplementedError("SparseConvTranspose3d is not provided (Pointcept uses SparseInverseConv3d)")
        self.ndim = ndim
        self.in_channels = _validate.count("in_channels", in_channels)
        self.out_channels = _validate.count("out_channels", out_channels)
        self.kernel_size = _triple("kernel_size", kernel_size, 1)
        self.stride = _triple("stride", stride, 1)
        self.padding = _triple("padding", padding, 0)
        self.dilation = _triple("dilation", dilation, 1)
        self.output_padding = _triple("output_padding", output_padding, 0)
        self.groups, self.subm, self.transposed, self.inverse = groups, bool(subm), bool(transposed), bool(inverse)
        self.indice_key = indice_key
        self.algo, self.fp32_accum, self.act_type, self.act_alpha, self.act_beta = algo, fp32_accum, act_type, act_alpha, act_beta
        self.record_voxel_count = bool(record_voxel_count)
        kv = math.prod(self.kernel_size)
        # spconv computes a kernel of one tap (not strided) as one matmul with weight.view(Cin, Cout)
        self.conv1x1 = kv == 1 and (self.subm or math.prod(self.stride) == 1)
        if self.conv1x1 and not self.subm and self.padding != [0, 0, 0]:
            raise ValueError(f"padding must be 0 for a 1x1x1 convolution, got {self.padding}")
        if self.inverse and indice_key is None:
            raise ValueError("SparseInverseConv3d needs the indice_key of the convolution it inverts")
        if self.record_voxel_count and not self.subm and not self.inverse:
            self.register_buffer("max_num_voxels_during_training", torch.zeros(1, dtype=torch.int32, device=device))
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_channels, *self.kernel_size, self.in_channels, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(fan_in), fan_in = Cin K0 K1 K2 (``kaiming_uniform_`` with a = sqrt(5), as spconv)."""
        bound = 1.0 / math.sqrt(self.in_channels * math.prod(self.kernel_size))
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != [0, 0, 0]:
            s += f", padding={self.padding}"
        if self.dilation != [1, 1, 1]:
            s += f", dilation={self.dilation}"
        if self.bias is None:
            s += ", bias=False"
        if self.indice_key is not None:
            s += f", indice_key={self.indice_key!r}"
        return s

    def forward(self, input: SparseConvTensor, add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
        _check_input(input)
        features = input.features
        if features.dim() != 2 or features.shape[1] != self.in_channels:
            raise ValueError(f"input.features must have shape (N, {self.in_channels}), got {tuple(features.shape)}")
        dtype, out_dtype = _validate.compute_dtype(features, self.weight)
        if self.conv1x1:
            out = features.to(dtype) @ self.weight.to(dtype).reshape(self.in_channels, self.out_channels)
            shape = input.spatial_shape if self.subm else _conv_output_size(input.spatial_shape, self.kernel_size, self.stride,
                                                                           self.padding, self.dilation)
            result = input.replace_feature(self._finish(out, dtype, out_dtype, add_input))
            result.spatial_shape = shape
            return result
        indice_dict = dict(input.indice_dict)
        data = self._kernel_map(input, indice_dict)
        pairs = (data.in_index, data.out_index, data.counts)
        if self.inverse:  # the recorded convolution's pairs, reversed: back to its input sites
            pairs, num_out, out_indices, shape = (data.out_index, data.in_index, data.counts), data.indices.shape[0], data.indices, data.spatial_shape
        else:
            num_out, out_indices, shape = (None if self.subm else data.out_indices.shape[0]), data.out_indices, data.out_spatial_shape
            if self.record_voxel_count and num_out is not None:
                self.max_num_voxels_during_training.clamp_(min=num_out)
        out = torch.ops.pcops.sparse_conv(features=features.to(dtype).contiguous(), weight=_weight_rows(self.weight, dtype),
                                          in_index=pairs[0], out_index=pairs[1], counts=pairs[2], num_out=num_out)
        result = SparseConvTensor(self._finish(out, dtype, out_dtype, add_input), out_indices, shape, input.batch_size,
                                  indice_dict=indice_dict, benchmark=input.benchmark)
        return result

    def _finish(self, out: torch.Tensor, dtype, out_dtype, add_input) -> torch.Tensor:
        if self.bias is not None:
            out = out + self.bias.to(dtype)
        out = out.to(out_dtype)
        if add_input is not None:
            out = out + add_input.features
        return out

    def _kernel_map(self, input: SparseConvTensor, indice_dict: dict) -> IndiceData:
        """The layer's kernel map: recorded under its ``indice_key`` or found (and then recorded)."""
        key = self.indice_key
        data = indice_dict.get(key) if key is not None else None
        if self.inverse:
            if data is None:
                raise ValueError(f"SparseInverseConv3d: no kernel map is recorded under indice_key={key!r} "
                                 "(the strided convolution with that key must run first on this tensor's ancestors)")
            if data.is_subm:
                raise ValueError(f"SparseInverseConv3d: indice_key={key!r} belongs to a submanifold convolution; "
                                 "an inverse convolution inverts a strided convolution or pooling")
            if data.ksize != self.kernel_size:
                raise ValueError(f"SparseInverseConv3d: kernel_size {self.kernel_size} differs from {data.ksize} of the "
                                 f"convolution recorded under indice_key={key!r}")
            if input.indices.shape[0] != data.out_indices.shape[0] or input.spatial_shape != data.out_spatial_shape:
                raise ValueError(f"SparseInverseConv3d: the input ({input.indices.shape[0]} sites, spatial_shape "
                                 f"{input.spatial_shape}) is not the output of the convolution recorded under indice_key={key!r} "
                                 f"({data.out_indices.shape[0]} sites, spatial_shape {data.out_spatial_shape})")
            return data
        if data is not None:
            if not self.subm or not data.is_subm:
                raise ValueError(f"indice_key={key!r} is already recorded in this tensor: only submanifold convolutions "
                                 "share a key (as in spconv)")
            if data.ksize != self.kernel_size or data.dilation != self.dilation:
                raise ValueError(f"indice_key={key!r} was recorded with kernel_size={data.ksize}, dilation={data.dilation}; "
                                 f"this layer has kernel_size={self.kernel_size}, dilation={self.dilation}")
            if input.indices.shape[0] != data.indices.shape[0] or input.spatial_shape != data.spatial_shape:
                raise ValueError(f"indice_key={key!r} was recorded for {data.indices.shape[0]} sites of spatial_shape "
                                 f"{data.spatial_shape}; this input has {input.indices.shape[0]} of {input.spatial_shape}")
            return data
        data = _find_map(input, self.kernel_size, self.stride, self.padding, self.dilation, self.subm)
        if key is not None:
            indice_dict[key] = data
        return data


def _check_sites(t: SparseConvTensor, name: str) -> None:
    """Every site of ``t`` inside its grid: sample ids in [0, batch_size), x, y, z in
    [0, spatial_shape) (spconv leaves other sites undefined; a negative one would wrap around in
    ``dense()``). One host read, in eager calls (a ValueError naming ``name``)."""
    if torch.compiler.is_compiling() or not t.indices.shape[0]:
        return
    low, high = torch.stack([t.indices.amin(0), t.indices.amax(0)]).tolist()
    for axis, bound, lo, hi in zip(("sample id", "x", "y", "z"), (t.batch_size, *t.spatial_shape), low, high):
        if lo < 0 or hi >= bound:
            given = f"batch_size {bound}" if axis == "sample id" else f"spatial_shape {t.spatial_shape}"
            raise ValueError(f"{name} hold the {axis} {lo if lo < 0 else hi}, outside [0, {bound}) ({given})")


def _find_map(input: SparseConvTensor, ksize, stride, padding, dilation, subm: bool) -> IndiceData:
    """The kernel map of a submanifold or strided convolution (or pooling) of ``input``'s sites."""
    _check_sites(input, "input.indices")
    indices = input.indices
    batch, grid_coord = indices[:, 0], indices[:, 1:]
    if subm:
        if min(k % 2 for k in ksize) == 0:
            raise ValueError(f"SubMConv3d needs an odd kernel_size on every axis here (a kernel centred on the site), got {ksize}")
        reach = [(k // 2) * d for k, d in zip(ksize, dilation)]  # outputs = inputs, stride 1, the kernel centred
        out_indices, out_shape = indices, input.spatial_shape
        _, in_index, out_index, counts = torch.ops.pcops.sparse_conv_map(
            grid_coord=grid_coord, batch=batch, out_coord=grid_coord, out_batch=batch, kernel_size=ksize, stride=[1, 1, 1],
            padding=reach, dilation=dilation, validate=True)
    else:  # the output sites and the map to them from one sort
        out_shape = _conv_output_size(input.spatial_shape, ksize, stride, padding, dilation)
        out_coord, out_batch, in_index, out_index, counts = torch.ops.pcops.sparse_conv_sites_map(
            grid_coord=grid_coord, batch=batch, kernel_size=ksize, stride=stride, padding=padding, dilation=dilation,
            out_shape=out_shape, validate=True)
        out_indices = torch.cat([out_batch[:, None], out_coord], 1).to(indices.dtype)
    return IndiceData(out_indices, indices, in_index, out_index, counts, input.spatial_shape, out_shape, subm,
                      list(ksize), list(stride), list(padding), list(dilation))


class SubMConv3d(SparseConvolution):
    """Submanifold 3-d convolution (spconv's ``SubMConv3d``): outputs at the input sites.

    Example:
        >>> import torch
        >>> from pcops.compat import spconv
        >>> indices = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1], [1, 5, 5, 5]], dtype=torch.int32)  # batch, x, y, z
        >>> x = spconv.SparseConvTensor(torch.randn(3, 4), indices, spatial_shape=[8, 8, 8], batch_size=2)
        >>> conv = spconv.SubMConv3d(4, 8, 3, bias=False, indice_key="subm1")
        >>> y = conv(x)
        >>> y.features.shape, y.indices is x.indices, tuple(conv.weight.shape)
        (torch.Size([3, 8]), True, (8, 3, 3, 3, 4))
        >>> down = spconv.SparseConv3d(8, 16, 2, stride=2, indice_key="down1")(y)  # outputs where inputs reach
        >>> down.indices.tolist(), down.spatial_shape
        ([[0, 0, 0, 0], [1, 2, 2, 2]], [4, 4, 4])
        >>> up = spconv.SparseInverseConv3d(16, 8, 2, indice_key="down1")(down)  # back to y's sites
        >>> torch.equal(up.indices, y.indices)
        True
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 indice_key=None, algo=None, fp32_accum=None, large_kernel_fast_algo=False, name=None):
        super().__init__(3, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, True,
                         indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class SparseConv3d(SparseConvolution):
    """Strided sparse 3-d convolution (spconv's ``SparseConv3d``): outputs at every site of the
    output grid ``(in + 2p - d (k - 1) - 1) // s + 1`` that some input reaches."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 indice_key=None, algo=None, fp32_accum=None, record_voxel_count=False, large_kernel_fast_algo=False, name=None):
        super().__init__(3, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         indice_key=indice_key, algo=algo, fp32_accum=fp32_accum, record_voxel_count=record_voxel_count,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class SparseInverseConv3d(SparseConvolution):
    """The inverse of the strided convolution recorded under ``indice_key`` (spconv's
    ``SparseInverseConv3d``): outputs at that convolution's input sites, each fed by the outputs
    it reached, through this layer's weight of the same offset."""

    def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True, algo=None, fp32_accum=None,
                 large_kernel_fast_algo=False, name=None):
        super().__init__(3, in_channels, out_channels, kernel_size, bias=bias, inverse=True, indice_key=indice_key, algo=algo,
                         fp32_accum=fp32_accum, large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class SparseMaxPool3d(SparseModule):
    """Sparse 3-d max pooling (spconv's ``SparseMaxPool3d``): the output sites of the strided
    convolution of the same geometry, each the channel-wise max over the input sites its window
    holds (inactive cells take no part). With an ``indice_key`` it records its map, which a
    ``SparseInverseConv3d`` with that key inverts. ``stride`` None is ``kernel_size``."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, indice_key=None, algo=None,
                 record_voxel_count: bool = False, name=None):
        super().__init__(name=name)
        self.ndim = 3
        self.kernel_size = _triple("kernel_size", kernel_size, 1)
        self.stride = list(self.kernel_size) if stride is None else _triple("stride", stride, 1)
        self.padding = _triple("padding", padding, 0)
        self.dilation = _triple("dilation", dilation, 1)
        self.subm, self.indice_key, self.algo = False, indice_key, algo
        self.record_voxel_count = bool(record_voxel_count)
        if self.record_voxel_count:
            self.register_buffer("max_num_voxels_during_training", torch.zeros(1, dtype=torch.int32))

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, dilation={self.dilation}"

    def forward(self, input: SparseConvTensor) -> SparseConvTensor:
        _check_input(input)
        indice_dict = dict(input.indice_dict)
        if self.indice_key is not None and self.indice_key in indice_dict:
            raise ValueError(f"indice_key={self.indice_key!r} is already recorded in this tensor")
        data = _find_map(input, self.kernel_size, self.stride, self.padding, self.dilation, False)
        if self.indice_key is not None:
            indice_dict[self.indice_key] = data
        f = input.features
        m, p = data.out_indices.shape[0], int(data.counts.sum())
        rows, cols = data.out_index[:p], data.in_index[:p]
        out = f.new_zeros((m, f.shape[1])).scatter_reduce(0, rows[:, None].expand(p, f.shape[1]), f.index_select(0, cols), "amax",
                                                          include_self=False)
        if self.record_voxel_count:
            self.max_num_voxels_during_training.clamp_(min=m)
        return SparseConvTensor(out, data.out_indices, data.out_spatial_shape, input.batch_size, indice_dict=indice_dict,
                                benchmark=input.benchmark)


def _namespace(name: str, doc: str, **members) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    for key, value in members.items():
        setattr(module, key, value)
    return module


modules = _namespace(
    __name__ + ".modules", "spconv.pytorch.modules: the sparse module base and its test.",
    SparseModule=SparseModule, SparseSequential=SparseSequential, SparseBatchNorm=SparseBatchNorm, SparseReLU=SparseReLU,
    SparseIdentity=SparseIdentity, is_spconv_module=is_spconv_module, is_sparse_conv=is_sparse_conv,
)
pytorch = sys.modules[__name__]  # `spconv.pytorch` from the top-level alias

# the module names that pcops.compat.install("spconv") maps to this module (and its parts)
__aliases__ = {
    "spconv.pytorch": pytorch,
    "spconv.pytorch.modules": modules,
    "spconv.pytorch.core": pytorch,
    "spconv.pytorch.conv": pytorch,
    "spconv.pytorch.pool": pytorch,
}

__all__ = ["SparseConvTensor", "SparseModule", "SparseSequential", "SubMConv3d", "SparseConv3d", "SparseInverseConv3d",
           "SparseConvolution", "SparseMaxPool3d", "ToDense", "Identity", "SparseBatchNorm", "SparseReLU", "SparseIdentity", "RemoveGrid",
           "modules", "is_spconv_module"]
