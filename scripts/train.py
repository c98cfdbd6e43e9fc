"""Train a pcops model from a YAML config, with Lightning's CLI.

    python scripts/train.py --config configs/sdf.yaml
    python scripts/train.py --config configs/sdf.yaml --trainer.max_epochs 3 --data.init_args.batch_size 8
    python scripts/train.py --config configs/sdf.yaml --print_config
    python scripts/train.py --config configs/sdf.yaml --ckpt_path runs/sdf/version_0/checkpoints/last.ckpt

A config has ``model`` and ``data`` (class_path + init_args), ``trainer`` (any Trainer
argument), and the extra keys ``seed_everything``, ``ckpt_path`` (resume) and ``rmm_pool``
(share one RMM pool on CUDA; applied before anything touches CUDA). Unknown keys, wrong types
and missing files are errors before any work. Each run writes to a new directory
``runs/<name>/version_<n>`` (CSV logs, the resolved config.yaml, checkpoints best + last, and
field_slice.png, a predicted vs true slice of the field); an existing run directory is never
overwritten (Lightning refuses to save a config over an existing one). After training the
best checkpoint is tested and its metrics printed.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # models/ lives beside pcops/, outside the library

from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

import pcops.memory  # noqa: E402

TRAINER_DEFAULTS = {
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "run"}},
    "log_every_n_steps": 10,
}


class TrainCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")  # best (by val/mae) + last, always
        parser.set_defaults(
            {"checkpoint.monitor": "val/mae", "checkpoint.mode": "min", "checkpoint.save_last": True, "checkpoint.filename": "best-{epoch}"}
        )
        parser.add_argument("--ckpt_path", type=Optional[str], default=None, help="resume training from this checkpoint")
        parser.add_argument("--rmm_pool", type=bool, default=False, help="one RMM pool for torch/CuPy/cuML (CUDA)")
        parser.add_argument("--figure", type=bool, default=True, help="save field_slice.png in the run directory")

    def before_instantiate_classes(self) -> None:
        ckpt = self.config.get("ckpt_path")
        if ckpt:
            check_checkpoint(pathlib.Path(ckpt))
        if self.config.get("rmm_pool"):
            pcops.memory.use_rmm_pool()  # before the model, the data or the trainer touch CUDA


def check_checkpoint(path: pathlib.Path) -> None:
    """Fail before any work (and before a run directory exists) unless ``path`` loads as a checkpoint."""
    import torch

    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)  # a checkpoint is trusted code, as for Lightning
    except Exception as err:  # truncated, empty, not a checkpoint: torch raises many kinds
        raise ValueError(f"ckpt_path: {path} is not a readable checkpoint (empty, truncated or another format): {err}") from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"ckpt_path: {path} is not a Lightning checkpoint (no 'state_dict')")


def check_checkpoint_fits(path: pathlib.Path, model: LightningModule) -> None:
    """Fail before the run directory exists unless the checkpoint's weights are this model's:
    the same parameter and buffer names with the same shapes (another config's checkpoint
    would otherwise fail inside ``fit``, after the run directory was made)."""
    import torch

    theirs = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    theirs = {k.replace("_orig_mod.", ""): v for k, v in theirs.items()}  # a compiled submodule's prefix
    ours = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    missing, unexpected = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    shapes = sorted(k for k in ours.keys() & theirs.keys() if tuple(ours[k].shape) != tuple(theirs[k].shape))
    if missing or unexpected or shapes:
        listing = "; ".join(f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                            for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)) if keys)
        raise ValueError(f"ckpt_path: {path} holds another model's weights than this config's {type(model).__name__} ({listing})")


def save_figure(model: LightningModule, data: LightningDataModule, path: pathlib.Path) -> None:
    """Predicted vs true field on a z = 0 slice (data.figure_sample) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    sample = {k: v.to(model.device) for k, v in data.figure_sample().items()}
    model.eval()
    with torch.no_grad():
        pred = model(sample)[0].float().cpu()
    true = sample["target"][0].float().cpu()
    side = int(round(true.numel() ** 0.5))
    extent = (-1, 1, -1, 1)
    lim = float(true.abs().max())
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, field, title in ((axes[0], true, "true"), (axes[1], pred, "predicted")):
        img = ax.imshow(field.reshape(side, side).T, origin="lower", extent=extent, cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.contour(field.reshape(side, side).T, levels=[0.0], colors="k", extent=extent)
        ax.set_title(f"{title} field (z = 0)")
        fig.colorbar(img, ax=ax)
    err = (pred - true).abs().reshape(side, side).T
    img = axes[2].imshow(err, origin="lower", extent=extent, cmap="magma")
    axes[2].set_title(f"|error|, mean {float(err.mean()):.4f}")
    fig.colorbar(img, ax=axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(args=None) -> dict:
    cli = TrainCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": False},
        trainer_defaults=TRAINER_DEFAULTS,
        args=args,
    )
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    if cli.config.get("ckpt_path"):  # before fit creates the run directory
        check_checkpoint_fits(pathlib.Path(cli.config.get("ckpt_path")), model)
    trainer.fit(model, datamodule=data, ckpt_path=cli.config.get("ckpt_path"))
    best = "best" if getattr(trainer.checkpoint_callback, "best_model_path", "") else None
    results = trainer.test(model, datamodule=data, ckpt_path=best)[0]  # fast_dev_run: one test batch
    run_dir = pathlib.Path(trainer.log_dir or ".")  # a collective under DDP: every rank asks
    if trainer.is_global_zero:
        if results.get("test/mae") and results.get("test/mean_baseline_mae"):
            ratio = results["test/mean_baseline_mae"] / results["test/mae"]
            print(f"test MAE {results['test/mae']:.4f}; predicting the training mean: "
                  f"{results['test/mean_baseline_mae']:.4f} ({ratio:.1f}x higher)")
        if cli.config.get("figure") and hasattr(data, "figure_sample"):
            save_figure(model, data, run_dir / "field_slice.png")
            print(f"figure: {run_dir / 'field_slice.png'}")
        print(f"run directory: {run_dir}")
    _end_process_group()
    return results


def _end_process_group() -> None:
    """Destroy the DDP process group (Lightning leaves it): otherwise gloo's threads are still
    running while the interpreter exits, and a run that did all its work sometimes aborts
    there ("terminate called without an active exception", seen in 1 of 7-19 two-process runs)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
