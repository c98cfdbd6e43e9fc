"""Pointcept's own Point Transformer V3 (PT-v3m1) on pcops' drop-ins, with no compiled extension.

Imports ``pointcept/models/point_transformer_v3/point_transformer_v3m1_base.py`` from a Pointcept
checkout, unmodified, with what it imports, and runs it on CPU::

    python scripts/pointcept_ptv3.py --pointcept /path/to/Pointcept --backend spconv --save ref.pt
    python scripts/pointcept_ptv3.py --pointcept /path/to/Pointcept --backend pcops --compare ref.pt --train-steps 3

``--backend pcops`` calls ``pcops.compat.install("spconv", "torch_scatter", "pointops", replace=True)`` before the
import, so ``spconv.pytorch``, ``torch_scatter`` and ``pointops`` are pcops' drop-ins.
``--backend spconv`` runs the originals (spconv's CPU wheel; torch_scatter from ``PYTHONPATH``):
spconv's CPU path has no bias and no backward, so that run is forward only and each convolution's
bias is added after spconv's product (a wrapper around spconv's ``SparseConvolution.forward``;
Pointcept's code is not touched). It runs on one torch thread: with two, spconv 2.3.8's CPU
``SubMConv3d`` gave wrong results that changed from run to run (``--check-convs --threads 2``
shows it: 33 of 92 calls off by up to 22% of their scale against a float64 reference). ``--save`` writes the weights, the input and the output of an
``eval()`` forward; ``--compare`` loads them (spconv's state_dict, unchanged) and reports the
largest difference of the output. ``--train-steps`` times forward + backward + an AdamW step in
training mode, and the same for ``models.PointTransformerV3`` at the same widths and depths.

What is stubbed, and only when it is not installed: ``timm`` (``timm.layers.DropPath``, written
here as stochastic depth per point), and the packages of Pointcept's other modules that the
import chain reaches without running them (``wandb``, ``SharedArray``, ``pointops`` for the
spconv run, ...): each becomes an empty module whose attributes raise when used.
``flash_attn`` and ``ocnn``, which Pointcept imports inside ``try`` blocks, are left missing, so the
model takes its own attention path (``enable_flash=False``).
Pointcept's package ``__init__`` files that import every backbone are skipped: the packages
``pointcept``, ``pointcept.models`` and ``pointcept.models.point_transformer_v3`` are created
empty with their real ``__path__``, and everything below them is imported from the checkout.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import itertools
import sys
import time
import types
from pathlib import Path

import torch

MODEL = "pointcept.models.point_transformer_v3.point_transformer_v3m1_base"
KEEP_MISSING = {"flash_attn", "ocnn"}  # optional imports Pointcept guards with try/except ImportError


class _Missing:
    """The value of every attribute of a stubbed package: fails loudly when used."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a stub (not installed): the PTv3 path must not use it")

    def __getattr__(self, attr):
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: an import that nothing else finds becomes a stub, if a file of the
    checkout asked for it (other packages' optional imports still fail as they expect)."""

    def __init__(self, root: Path):
        self.root, self.stubbed = str(root), set()

    def _importer(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
        return "" if frame is None else frame.f_code.co_filename

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in KEEP_MISSING or not self._importer().startswith(self.root):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        self.stubbed.add(spec.name.split(".")[0])
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class DropPath(torch.nn.Module):
    """Stochastic depth (what ``timm.layers.DropPath`` does): zero a row with probability p, scale the rest."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob, self.scale_by_keep = float(drop_prob), scale_by_keep

    def forward(self, x):
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * (mask / keep if self.scale_by_keep else mask)


def _stub_timm() -> None:
    if importlib.util.find_spec("timm") is not None:
        return
    timm, layers = types.ModuleType("timm"), types.ModuleType("timm.layers")
    layers.DropPath = DropPath
    timm.layers = layers
    timm.__path__, layers.__path__ = [], []
    sys.modules.update({"timm": timm, "timm.layers": layers})


def _spconv_bias_after() -> None:
    """spconv's CPU convolution refuses a bias: run it without and add the bias after."""
    from spconv.pytorch.conv import SparseConvolution

    forward = SparseConvolution.forward

    def without_bias(self, input, *args, **kwargs):
        bias = self.bias
        if bias is None:
            return forward(self, input, *args, **kwargs)
        self.bias = None
        try:
            out = forward(self, input, *args, **kwargs)
        finally:
            self.bias = bias
        return out.replace_feature(out.features + bias)

    SparseConvolution.forward = without_bias


def load_model_class(pointcept: Path, backend: str):
    """Pointcept's PointTransformerV3 class, imported from the checkout with the chosen backend."""
    if backend == "pcops":
        import pcops.compat

        pcops.compat.install("spconv", "torch_scatter", "pointops", replace=True)
    _stub_timm()
    finder = _StubFinder(pointcept)
    sys.meta_path.append(finder)
    sys.path.insert(0, str(pointcept))
    for package in ("pointcept", "pointcept.models", "pointcept.models.point_transformer_v3"):
        module = types.ModuleType(package)
        module.__path__ = [str(pointcept.joinpath(*package.split(".")))]
        sys.modules[package] = module
    if backend == "spconv":
        _spconv_bias_after()
    module = importlib.import_module(MODEL)
    print(f"imported {module.__file__}; stubbed packages: {sorted(finder.stubbed) or 'none'}")
    import spconv.pytorch
    import torch_scatter

    where = [getattr(m, "__file__", None) or "a stub (not installed)" for m in (spconv.pytorch, torch_scatter)]
    print(f"spconv.pytorch from {where[0]}; torch_scatter from {where[1]}")
    return module.PointTransformerV3


def scene(clouds: int, points: int, grid_size: float, seed: int) -> dict:
    """Pointcept's input after GridSampling: unique grid coordinates per cloud, coord, feat (xyz + rgb), offset."""
    gen = torch.Generator().manual_seed(seed)
    coords, grids, feats, offset = [], [], [], []
    for _ in range(clouds):
        xyz = torch.rand(points, 3, generator=gen) * torch.tensor([4.0, 4.0, 2.0])
        grid = torch.div(xyz - xyz.min(0).values, grid_size, rounding_mode="trunc").int()
        _, first = torch.unique(grid, dim=0, return_inverse=True)
        keep = torch.zeros(first.max() + 1, dtype=torch.long).scatter_reduce(0, first, torch.arange(points), "amin", include_self=False)
        coords.append(xyz[keep])
        grids.append(grid[keep])
        feats.append(torch.cat([xyz[keep], torch.rand(keep.shape[0], 3, generator=gen)], 1))
        offset.append(keep.shape[0])
    return {
        "coord": torch.cat(coords), "grid_coord": torch.cat(grids), "feat": torch.cat(feats),
        "offset": torch.tensor(offset).cumsum(0), "grid_size": grid_size,
    }


SMALL = dict(  # the widths and depths of models.PointTransformerV3's defaults, for the train-step comparison
    stride=(2, 2), enc_depths=(1, 1, 1), enc_channels=(32, 48, 64), enc_num_head=(2, 3, 4), enc_patch_size=(48, 48, 48),
    dec_depths=(1, 1), dec_channels=(48, 48), dec_num_head=(3, 3), dec_patch_size=(48, 48), mlp_ratio=2, drop_path=0.1,
)


def build(cls, size: str, seed: int):
    torch.manual_seed(seed)
    kwargs = dict(in_channels=6, enable_flash=False)
    if size == "small":
        kwargs.update(SMALL)
    return cls(**kwargs)


def submanifold_reference(features, indices, weight, bias) -> torch.Tensor:
    """A submanifold convolution in float64 by sorted-key lookups, for spconv's weight layout (Cout, K, K, K, Cin):
    out[i] = bias + sum_(a,b,c) weight[:, a, b, c, :] @ features[j], j the site at indices[i] + (a, b, c) - K // 2."""
    f, w, idx = features.double(), weight.double(), indices.long()
    k = w.shape[1]
    shift = 1 << 20
    key = lambda t: ((t[:, 0] * shift + t[:, 1] + k) * shift + t[:, 2] + k) * shift + t[:, 3] + k  # noqa: E731
    keys = key(idx)
    order = keys.argsort()
    ordered = keys[order]
    out = f.new_zeros((f.shape[0], w.shape[0]))
    for a, b, c in itertools.product(range(k), repeat=3):
        q = key(idx + idx.new_tensor([0, a - k // 2, b - k // 2, c - k // 2]))
        pos = torch.searchsorted(ordered, q).clamp(max=ordered.shape[0] - 1)
        hit = ordered[pos] == q
        out[hit] += f[order[pos[hit]]] @ w[:, a, b, c, :].t()
    return out if bias is None else out + bias.double()


def check_convs(model) -> list:
    """Hooks on every SubMConv3d: the largest difference of its output from :func:`submanifold_reference`."""
    errors = []

    def hook(module, inputs, output):
        x = inputs[0]
        ref = submanifold_reference(x.features, x.indices, module.weight, module.bias)
        errors.append((ref - output.features.double()).abs().max().item() / max(ref.abs().max().item(), 1e-30))

    for module in model.modules():
        if type(module).__name__ == "SubMConv3d":
            module.register_forward_hook(hook)
    return errors


def time_steps(step, steps: int) -> float:
    step()  # warm-up (kernel compilation, caches)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return min(times)


def train_step_pointcept(model, data, classes: int = 13):
    head = torch.nn.Linear(_out_channels(model, data), classes)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-3)
    labels = torch.randint(classes, (data["coord"].shape[0],), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        point = model({k: (v.clone() if torch.is_tensor(v) else v) for k, v in data.items()})
        loss = torch.nn.functional.cross_entropy(head(point.feat), labels)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _out_channels(model, data) -> int:
    with torch.no_grad():
        return model({k: (v.clone() if torch.is_tensor(v) else v) for k, v in data.items()}).feat.shape[1]


def train_step_pcops(data, classes: int = 13):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models.ptv3 import PointTransformerV3

    model = PointTransformerV3(classes, segment=True, voxel_size=data["grid_size"], orders=["z", "z-trans"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ends = data["offset"].tolist()
    starts = [0] + ends[:-1]
    n = min(e - s for s, e in zip(starts, ends))  # padded clouds (B, N, 3) of equal size: the first n of each
    points = torch.stack([data["coord"][s:s + n] for s in starts])
    labels = torch.randint(classes, points.shape[:2], generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(points).reshape(-1, classes), labels.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step, points.shape[0] * n


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pointcept", type=Path, required=True, help="a Pointcept checkout (the folder holding pointcept/)")
    parser.add_argument("--backend", choices=("pcops", "spconv"), default="pcops")
    parser.add_argument("--size", choices=("default", "small"), default="default",
                        help="default: PT-v3m1's defaults; small: models.PointTransformerV3's widths and depths")
    parser.add_argument("--clouds", type=int, default=2)
    parser.add_argument("--points", type=int, default=6000)
    parser.add_argument("--grid-size", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="write weights, input and eval output here")
    parser.add_argument("--compare", type=Path, help="load weights and input from a --save file and compare the output")
    parser.add_argument("--train-steps", type=int, default=0, help="time this many train steps (pcops backend)")
    parser.add_argument("--check-convs", action="store_true", help="check every SubMConv3d call against a float64 reference")
    parser.add_argument("--repeat", type=int, default=1, help="run the eval forward this many times (spconv's CPU output varies)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.backend == "spconv" and not args.threads:
        args.threads = 1
        print("spconv backend: one torch thread (spconv 2.3.8's CPU convolution gives wrong, varying results with more)")
    if args.threads:
        torch.set_num_threads(args.threads)
    cls = load_model_class(args.pointcept.resolve(), args.backend)
    model = build(cls, args.size, args.seed)
    data = scene(args.clouds, args.points, args.grid_size, args.seed)
    if args.compare:
        saved = torch.load(args.compare)
        model.load_state_dict(saved["state_dict"])  # strict: spconv's names and shapes, unchanged
        data = saved["data"]
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters; {data['coord'].shape[0]:,} points in {len(data['offset'])} clouds")
    model.eval()
    errors = check_convs(model) if args.check_convs else None
    outs = []
    for _ in range(args.repeat):
        with torch.no_grad():
            torch.manual_seed(args.seed)  # serialization's shuffle of the orders
            outs.append(model({k: (v.clone() if torch.is_tensor(v) else v) for k, v in data.items()}).feat)
    out = outs[0]
    spread = max((o - out).abs().max().item() for o in outs)
    print(f"eval forward: feat {tuple(out.shape)}; {args.repeat} runs differ by up to {spread:.3g}")
    if errors is not None:
        bad = sum(e > 1e-5 for e in errors)
        print(f"SubMConv3d calls against a float64 reference: {len(errors)} calls, {bad} off by more than 1e-5 relative "
              f"(largest {max(errors):.3g})")
    if args.save:
        torch.save({"state_dict": model.state_dict(), "data": data, "outs": outs, "backend": args.backend}, args.save)
    if args.compare:
        refs = saved["outs"]
        diffs = [(out - ref).abs().max().item() for ref in refs]
        print(f"against {saved['backend']}'s {len(refs)} runs: max |diff| {min(diffs):.3g} (closest) .. {max(diffs):.3g} "
              f"(output scale {refs[0].abs().max().item():.3g})")
    if args.backend == "pcops":
        model.train()
        point = model({k: (v.clone() if torch.is_tensor(v) else v) for k, v in data.items()})
        point.feat.square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        missing = sum(g is None for g in grads)
        finite = all(torch.isfinite(g).all() for g in grads if g is not None)
        print(f"train forward + backward: {len(grads) - missing}/{len(grads)} parameters have gradients, all finite: {finite}")
    if args.train_steps and args.backend == "pcops":
        model.zero_grad()
        t_pointcept = time_steps(train_step_pointcept(model, data), args.train_steps)
        step, n = train_step_pcops(data)
        t_pcops = time_steps(step, args.train_steps)
        print(f"train step (min of {args.train_steps}, {torch.get_num_threads()} threads): Pointcept PT-v3m1 on pcops "
              f"{t_pointcept * 1e3:.0f} ms ({data['coord'].shape[0]:,} points); models.PointTransformerV3 {t_pcops * 1e3:.0f} ms "
              f"({n:,} points); ratio {t_pointcept / t_pcops:.2f}")


if __name__ == "__main__":
    main()
