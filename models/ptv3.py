"""Point Transformer V3 (Wu et al. 2024), small, from pcops' public ops.

The network takes padded clouds ``points`` (B, N, 3) (every row a real point) and returns
logits: (B, C) for classification, (B, N, C) for segmentation.

* Voxelisation: ``pcops.grid_sample(mode="mean")`` - one site per occupied voxel of side
  ``voxel_size``, at the mean of its points, with integer grid coordinates and each input
  point's voxel (``inverse``). Voxels are numbered by (sample, x, y, z), so nothing downstream
  depends on the order of the input points.
* Embedding: a submanifold sparse convolution (``pcops.nn.SparseConv3d``) of the voxels'
  coordinates, BatchNorm, GELU.
* Serialization: ``pcops.serialize`` codes the voxels along several space-filling curves
  (``orders``, default z, z-trans, hilbert, hilbert-trans). Grid coordinates are unique per
  sample, so the codes are too: the curve orders have no ties.
* Blocks (pre-norm): x += LayerNorm(Linear(SubMConv3d(x))) (the conditional positional
  encoding, xCPE), x += Attn(LayerNorm(x)), x += MLP(LayerNorm(x)). Attention is
  ``scaled_dot_product_attention`` within patches of ``patch_size`` consecutive voxels along one
  curve; patches never cross samples: each sample's sequence starts a new patch and its last
  patch is padded, the padding masked out of the keys. Block i of a stage uses curve i mod K;
  in training the K curves are shuffled at every stage (PTv3's ``shuffle_orders``).
* Pooling between stages: Linear, ``pcops.serialized_pool`` (max over the voxels sharing a
  cell twice as large, along the first curve's code), BatchNorm, GELU; the pooled voxels keep
  their codes for every curve.
* Decoder (segmentation): ``pcops.serialized_unpool`` of the coarse features plus a
  projection of the encoder's features at that stage (skip), then blocks at that stage.
* Heads: classification pools each sample's voxels (mean and max, ``pcops.segment_reduce``)
  into an MLP; segmentation reads each input point's voxel feature (``pcops.gather`` with
  ``inverse``), adds the point's offset from its voxel's mean, and labels it with an MLP.

Differences from Pointcept's PT-v3m1: no flash attention (patches are masked, not padded by
repeating points), patch attention through ``torch.nn.functional.scaled_dot_product_attention``,
grid coordinates serialized at depth 16 (codes of small grids are valid curves of that depth),
drop-path per voxel as there, no RPE, no PDNorm; sizes are small enough to train on 2 CPU cores.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import pcops.nn
from pcops import gather, grid_sample, segment_reduce, serialize, serialized_pool, serialized_unpool, sparse_kernel_map

from .classify import _PointTask, _SegmentTask

ORDERS = ("z", "z-trans", "hilbert", "hilbert-trans")
DEPTH = 16  # serialization depth: any grid of up to 2^16 cells per axis


class Stage(NamedTuple):
    """The voxels of one stage: what every block and the pooling of that stage share."""

    coord: torch.Tensor  # (V, 3) float: mean position of the voxel's points
    grid: torch.Tensor  # (V, 3) int64 grid coordinates (unique per sample)
    batch: torch.Tensor  # (V,) int64 sample ids, sorted
    code: torch.Tensor  # (K, V) int64 serialization codes, one row per curve
    slots: torch.Tensor  # (K, V) int64 each voxel's slot in the patch buffer of each curve
    key_valid: torch.Tensor  # (patches, 1, 1, P) bool: slot holds a voxel
    kernel_map: pcops.KernelMap  # 3x3x3 submanifold neighbours of the voxels


def patch_slots(batch: torch.Tensor, inverse: torch.Tensor, num_samples: int, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the voxels in a buffer of patches of ``patch`` rows, per curve.

    ``batch`` (V,) sorted sample ids; ``inverse`` (K, V) each voxel's position along each curve
    (the batch id is the code's top bits, so every curve visits sample 0's voxels first, then
    sample 1's...). Each sample's run starts at a patch boundary: position t of sample b goes to
    slot t + shift[b], with shift[b] the padding of the samples before b. The buffer has
    (V // patch + B + 1) patches, enough for any split of V voxels over B samples (static in B,
    linear in the dynamic V). Returns slots (K, V) and key_valid (patches, 1, 1, patch).
    """
    v = batch.shape[0]
    counts = torch.zeros(num_samples, dtype=torch.int64, device=batch.device).index_add_(0, batch, torch.ones_like(batch))
    pad = (-counts) % patch  # rows padding the last patch of each sample
    shift = torch.cumsum(pad, 0) - pad  # padding before sample b
    position = torch.arange(v, device=batch.device) + shift[batch]  # slot of curve position t (batch[t] = batch of t-th voxel)
    slots = position[inverse]  # (K, V): voxel i sits at curve position inverse[k, i]
    patches = v // patch + num_samples + 1
    valid = torch.zeros(patches * patch, dtype=torch.bool, device=batch.device).index_fill(0, position, True)
    return slots, valid.view(patches, 1, 1, patch)


def make_stage(coord, grid, batch, code, inverse, num_samples: int, patch: int) -> Stage:
    slots, key_valid = patch_slots(batch, inverse, num_samples, patch)
    return Stage(coord, grid, batch, code, slots, key_valid, sparse_kernel_map(grid, batch=batch, kernel_size=3))


class DropPath(nn.Module):
    """Stochastic depth per voxel (as timm's DropPath on Pointcept's (N, C) features)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        return x * (torch.rand(x.shape[0], 1, device=x.device, dtype=x.dtype) < keep).to(x.dtype) / keep


class PatchAttention(nn.Module):
    """Multi-head self-attention within patches of consecutive voxels along one curve."""

    def __init__(self, channels: int, heads: int, patch: int):
        super().__init__()
        if channels % heads:
            raise ValueError(f"channels ({channels}) must be a multiple of heads ({heads})")
        self.heads, self.patch = heads, patch
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, slots: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        v, c = x.shape
        patches, p, h = key_valid.shape[0], self.patch, self.heads
        qkv = self.qkv(x)
        buffer = qkv.new_zeros(patches * p, 3 * c).index_copy(0, slots, qkv)  # voxels to their slots along the curve
        q, k, val = buffer.view(patches, p, 3, h, c // h).permute(2, 0, 3, 1, 4).unbind(0)  # (patches, H, P, C/H)
        # a padding slot attends to itself only (no row is fully masked; its output is dropped)
        mask = key_valid | torch.eye(p, dtype=torch.bool, device=x.device)
        out = F.scaled_dot_product_attention(q, k, val, attn_mask=mask)
        out = out.transpose(1, 2).reshape(patches * p, c)
        return self.proj(gather(out, slots, validate=False))


class Block(nn.Module):
    """xCPE (SubMConv3d + Linear + LayerNorm), patch attention and MLP, each residual (pre-norm)."""

    def __init__(self, channels: int, heads: int, patch: int, mlp_ratio: float, drop_path: float):
        super().__init__()
        self.cpe_conv = pcops.nn.SparseConv3d(channels, channels, 3)
        self.cpe = nn.Sequential(nn.Linear(channels, channels), nn.LayerNorm(channels))
        self.norm1, self.attn = nn.LayerNorm(channels), PatchAttention(channels, heads, patch)
        hidden = int(channels * mlp_ratio)
        self.norm2 = nn.LayerNorm(channels)
        self.mlp = nn.Sequential(nn.Linear(channels, hidden), nn.GELU(), nn.Linear(hidden, channels))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, stage: Stage, slots: torch.Tensor) -> torch.Tensor:
        x = x + self.cpe(self.cpe_conv(x, None, kernel_map=stage.kernel_map))
        x = x + self.drop_path(self.attn(self.norm1(x), slots, stage.key_valid))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class Blocks(nn.Module):
    """The blocks of one stage; block i attends along curve i mod K (after the stage's shuffle)."""

    def __init__(self, channels: int, depth: int, heads: int, patch: int, mlp_ratio: float, drop_paths: list[float]):
        super().__init__()
        self.blocks = nn.ModuleList(Block(channels, heads, patch, mlp_ratio, drop_paths[i]) for i in range(depth))

    def forward(self, x: torch.Tensor, stage: Stage, curves: torch.Tensor) -> torch.Tensor:
        k = stage.slots.shape[0]
        for i, block in enumerate(self.blocks):
            x = block(x, stage, stage.slots.index_select(0, curves[i % k : i % k + 1])[0])
        return x


class VoxelBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over rows (voxels) whose count is data-dependent, written out in torch ops.

    ``nn.BatchNorm1d`` checks that a training batch has more than one row and its aten op that
    it is not empty: on a voxel count, a size the data decides, those are guards that
    ``torch.compile(fullgraph=True)`` cannot resolve. The same normalisation written out has no
    such branch. Running statistics are updated with ``momentum`` as BatchNorm does, the running
    variance from the biased batch variance (the voxels number in the hundreds). Parameters and
    buffers are BatchNorm1d's, so checkpoints look the same.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean = x.mean(0)
            var = (x - mean).square().mean(0)
            with torch.no_grad():
                self.running_mean.lerp_(mean.detach(), self.momentum)
                self.running_var.lerp_(var.detach(), self.momentum)
                self.num_batches_tracked.add_(1)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def _norm_act(channels: int) -> list[nn.Module]:
    return [VoxelBatchNorm(channels, eps=1e-3, momentum=0.1), nn.GELU()]


class Down(nn.Module):
    """Serialized pooling: Linear, max over the voxels sharing a twice-coarser cell, BatchNorm, GELU."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.proj = nn.Linear(c_in, c_out)
        self.norm_act = nn.Sequential(*_norm_act(c_out))

    def forward(self, x: torch.Tensor, stage: Stage, num_samples: int, patch: int) -> tuple[torch.Tensor, Stage, torch.Tensor]:
        pooled = serialized_pool(stage.code, 1, self.proj(x), stage.coord, stage.grid, stage.batch, reduce="max")
        coarse = make_stage(pooled.coord, pooled.grid_coord, pooled.batch, pooled.code, pooled.inverse, num_samples, patch)
        return self.norm_act(pooled.features), coarse, pooled.cluster


class Up(nn.Module):
    """Serialized unpooling: projected coarse features copied to their children plus projected skip features."""

    def __init__(self, c_coarse: int, c_skip: int, c_out: int):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(c_coarse, c_out), *_norm_act(c_out))
        self.proj_skip = nn.Sequential(nn.Linear(c_skip, c_out), *_norm_act(c_out))

    def forward(self, coarse: torch.Tensor, skip: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        return self.proj_skip(skip) + serialized_unpool(self.proj(coarse), cluster)


class PointTransformerV3(nn.Module):
    """PTv3 on padded clouds (B, N, 3): logits (B, C) (``segment=False``) or (B, N, C).

    Per encoder stage s: ``channels[s]``, ``depths[s]`` blocks, ``heads[s]``, ``patch[s]``;
    pooling halves the grid between stages. The decoder (segmentation) has one stage per
    encoder stage but the last, with ``dec_channels``, ``dec_depths``, ``dec_heads``,
    ``dec_patch`` (finest first, as in Pointcept).
    """

    def __init__(self, num_classes: int, segment: bool = False, voxel_size: float = 0.06, orders=ORDERS,
                 channels=(32, 48, 64), depths=(1, 1, 1), heads=(2, 3, 4), patch=(48, 48, 48),
                 dec_channels=(48, 48), dec_depths=(1, 1), dec_heads=(3, 3), dec_patch=(48, 48),
                 mlp_ratio: float = 2.0, drop_path: float = 0.1, embed_kernel: int = 3, hidden: int = 128, dropout: float = 0.3):
        super().__init__()
        stages = len(channels)
        if not (len(depths) == len(heads) == len(patch) == stages):
            raise ValueError("channels, depths, heads and patch need one entry per encoder stage")
        if segment and not (len(dec_channels) == len(dec_depths) == len(dec_heads) == len(dec_patch) == stages - 1):
            raise ValueError(f"dec_channels, dec_depths, dec_heads and dec_patch need {stages - 1} entries (encoder stages - 1)")
        orders = [orders] if isinstance(orders, str) else list(orders)
        if not orders or any(o not in ORDERS for o in orders):
            raise ValueError(f"orders must be a non-empty list of {ORDERS}, got {orders}")
        self.segment, self.voxel_size, self.orders = segment, float(voxel_size), orders
        self.patch = [int(p) for p in patch]
        self.embed = pcops.nn.SparseConv3d(3, channels[0], embed_kernel, bias=False)
        self.embed_norm = nn.Sequential(*_norm_act(channels[0]))
        rates = torch.linspace(0, drop_path, sum(depths)).tolist()
        self.down = nn.ModuleList(Down(channels[s - 1], channels[s]) for s in range(1, stages))
        self.enc = nn.ModuleList(
            Blocks(channels[s], depths[s], heads[s], patch[s], mlp_ratio, rates[sum(depths[:s]):sum(depths[: s + 1])]) for s in range(stages)
        )
        if segment:
            rates = torch.linspace(0, drop_path, max(sum(dec_depths), 1)).tolist()
            widths = list(dec_channels) + [channels[-1]]
            self.up = nn.ModuleList(Up(widths[s + 1], channels[s], widths[s]) for s in range(stages - 1))
            self.dec = nn.ModuleList(
                Blocks(widths[s], dec_depths[s], dec_heads[s], dec_patch[s], mlp_ratio, rates[sum(dec_depths[:s]):sum(dec_depths[: s + 1])][::-1])
                for s in range(stages - 1)
            )
            self.dec_patch = [int(p) for p in dec_patch]
            width = widths[0] if stages > 1 else channels[0]
            self.head = nn.Sequential(nn.Linear(width + 3, hidden), *_norm_act(hidden), nn.Dropout(dropout), nn.Linear(hidden, num_classes))
        else:
            self.head = nn.Sequential(nn.Linear(2 * channels[-1], hidden), *_norm_act(hidden), nn.Dropout(dropout), nn.Linear(hidden, num_classes))

    def _curves(self, device) -> torch.Tensor:
        """Which curve each block slot uses: shuffled per stage in training (PTv3's shuffle_orders)."""
        k = len(self.orders)
        return torch.randperm(k, device=device) if self.training else torch.arange(k, device=device)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        b = points.shape[0]
        voxels = grid_sample(points, self.voxel_size, mode="mean")  # voxel means, grid coords, point -> voxel
        s = serialize(voxels.grid_coord, voxels.batch, DEPTH, self.orders)
        stage = make_stage(voxels.points, voxels.grid_coord, voxels.batch, s.code, s.inverse, b, self.patch[0])
        x = self._embed(voxels.points, stage)
        stages, skips, clusters = [], [], []
        for i, blocks in enumerate(self.enc):
            if i > 0:
                skips.append(x)
                stages.append(stage)
                x, stage, cluster = self.down[i - 1](x, stage, b, self.patch[i])
                clusters.append(cluster)
            x = blocks(x, stage, self._curves(x.device))
        if not self.segment:
            pooled = [segment_reduce(x, ids=stage.batch, reduce=r, num_segments=b) for r in ("mean", "max")]
            return self.head(torch.cat(pooled, -1))
        for i in reversed(range(len(self.dec))):
            x = self.up[i](x, skips[i], clusters[i])
            stage = stages[i]
            x = self.dec[i](x, stage, self._curves(x.device))
        per_point = gather(x, voxels.inverse, validate=False)  # (B, N, C): each point's voxel feature
        offset = (points - gather(voxels.points, voxels.inverse, validate=False)) / self.voxel_size
        h = torch.cat([per_point, offset], -1)
        return self._seg_head(h)

    def _embed(self, coord: torch.Tensor, stage: Stage) -> torch.Tensor:
        km = stage.kernel_map if self.embed.kernel_size == 3 else None
        return self.embed_norm(self.embed(coord, stage.grid if km is None else None, stage.batch if km is None else None, kernel_map=km))

    def _seg_head(self, h: torch.Tensor) -> torch.Tensor:
        b, n, c = h.shape
        return self.head(h.reshape(b * n, c)).reshape(b, n, -1)


# ---------------------------------------------------------------- Lightning tasks


class PTv3Classifier(_PointTask):
    """Point Transformer V3 encoder, per-sample mean + max pooling of the last stage, an MLP head."""

    def __init__(self, num_classes: int = 9, voxel_size: float = 0.06, orders: list[str] = list(ORDERS),  # noqa: B006
                 channels: list[int] = [32, 48, 64], depths: list[int] = [1, 1, 1], heads: list[int] = [2, 3, 4],  # noqa: B006
                 patch: list[int] = [48, 48, 48], mlp_ratio: float = 2.0, drop_path: float = 0.1, embed_kernel: int = 3,  # noqa: B006
                 hidden: int = 128, dropout: float = 0.3, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = PointTransformerV3(num_classes, False, voxel_size, orders, channels, depths, heads, patch,
                                      mlp_ratio=mlp_ratio, drop_path=drop_path, embed_kernel=embed_kernel, hidden=hidden, dropout=dropout)


class PTv3Segmenter(_SegmentTask):
    """Point Transformer V3 encoder-decoder: a label per input point from its voxel's feature and offset."""

    def __init__(self, num_classes: int = 9, voxel_size: float = 0.06, orders: list[str] = list(ORDERS),  # noqa: B006
                 channels: list[int] = [32, 48, 64], depths: list[int] = [1, 1, 1], heads: list[int] = [2, 3, 4],  # noqa: B006
                 patch: list[int] = [48, 48, 48], dec_channels: list[int] = [48, 48], dec_depths: list[int] = [1, 1],  # noqa: B006
                 dec_heads: list[int] = [3, 3], dec_patch: list[int] = [48, 48], mlp_ratio: float = 2.0,  # noqa: B006
                 drop_path: float = 0.1, embed_kernel: int = 3, hidden: int = 64, dropout: float = 0.3, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = PointTransformerV3(num_classes, True, voxel_size, orders, channels, depths, heads, patch,
                                      dec_channels, dec_depths, dec_heads, dec_patch, mlp_ratio, drop_path, embed_kernel, hidden, dropout)
