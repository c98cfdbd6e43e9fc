"""Train a pcops model from a YAML config, with Lightning's CLI.

    python scripts/train.py --config configs/sdf.yaml
    python scripts/train.py --config configs/sdf.yaml --trainer.max_epochs 3 --data.init_args.batch_size 8
    python scripts/train.py --config configs/sdf.yaml --print_config
    python scripts/train.py --config configs/sdf.yaml --ckpt_path runs/sdf/version_0/checkpoints/last.ckpt

A config has ``model`` and ``data`` (class_path + init_args), ``trainer`` (any Trainer
argument), and the extra keys ``seed_everything``, ``ckpt_path`` (resume) and ``rmm_pool``
(share one RMM pool on CUDA; applied before anything touches CUDA). Unknown keys, wrong types
and missing files are errors before any work. Each run writes to a new directory
``runs/<name>/version_<n>`` (CSV logs, the resolved config.yaml, checkpoints best + last,
field_slice.png, a predicted vs true slice of the field, and the learnt surfaces below); an existing run directory is never
overwritten (Lightning refuses to save a config over an existing one). After training the
best checkpoint is tested and its metrics printed.

Besides Lightning's own lines it prints the data modules' progress while they make their data
(stderr), the run directory when training starts, and at the end every file the run wrote
(``fast_dev_run`` writes none). A config that does not parse (an unknown key, a wrong type, a
missing config file), a missing or unusable checkpoint, and a GPU config without a GPU give an
``error: ...`` line (the GPU one: the command that runs it on the CPU) and exit status 2, not a
usage summary or a traceback.

A signed-distance run whose data module has ``surface_sample`` (configs/sdf.yaml) also extracts
the learnt zero level set of the first three test shapes with ``pcops.marching_cubes``
(models/surfaces.py): ``surface_<i>.ply``, ``surfaces.png`` (learnt and true-field meshes) and
``surfaces.json`` (Chamfer distances and normal consistency against the true surfaces), printed
at the end.
"""

from __future__ import annotations

import difflib
import os
import pathlib
import re
import shlex
import sys
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # models/ lives beside pcops/, outside the library

from lightning.pytorch import Callback, LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402

import pcops.memory  # noqa: E402
from models import surfaces  # noqa: E402

TRAINER_DEFAULTS = {
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "run"}},
    "log_every_n_steps": 10,
}


HINT = "run with --help for every option, or add --print_config to see the resolved config"


class ConfigError(ValueError):
    """A config this run cannot use. Run as a script (:func:`run`), train.py prints ``error:
    <message>`` (no traceback) and exits with status 2; called as ``main(args)`` it raises."""


class TrainParser(LightningArgumentParser):
    """Lightning's parser, whose errors are one line saying what is wrong (with the key probably
    meant, for an unknown one) and a hint, instead of jsonargparse's usage summary of 60-odd lines
    followed by the nested message of every type the value failed to match."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG", "").lower() in ("1", "true", "yes"):
            return super().error(message, ex)  # inner parsers raise (jsonargparse relies on it); debug mode raises
        self._logger.error(message)
        sys.stderr.write(f"error: {explain(message, self)}\n{HINT}\n")
        self.exit(2)


def _options(parser) -> list[str]:
    """The parser's long options without their dashes (``trainer.max_epochs``, ...)."""
    return [option[2:] for option in getattr(parser, "_option_string_actions", {}) if option.startswith("--")]


def _class_keys(class_path: str) -> list[str]:
    """The arguments jsonargparse accepts for the class at ``class_path`` (empty if that fails)."""
    import importlib

    from jsonargparse import ArgumentParser

    try:
        module, _, name = class_path.rpartition(".")
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(getattr(importlib.import_module(module), name), fail_untyped=False)
        return list(parser.get_defaults().keys())
    except Exception:  # a guess for the message only
        return []


def _guess(name: str, keys: list[str]) -> str | None:
    """The key most like ``name``: one ending in ``.name`` (a key given at the wrong level), else a near spelling."""
    ends = [key for key in keys if key.endswith("." + name)]
    if ends:
        return ends[0]
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    return close[0] if close else None


def _type_name(text: str) -> str:
    """``<class 'int'>`` -> ``int``, ``typing.Literal[64, 32]`` -> ``one of 64, 32``."""
    text = re.sub(r"<class '(?:[\w.]*\.)?([\w]+)'>", r"\1", text.strip())
    return re.sub(r"^typing\.Literal\[(.*)\]$", r"one of \1", text)


def _value(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def explain(message: str, parser) -> str:
    """One line from a jsonargparse error message: the full key, what is wrong with it and, for an
    unknown key, the accepted key most like it (``unknown key 'trainer.max_epoch'; did you mean
    'trainer.max_epochs'?``). Messages of other shapes give their first line."""
    message = message.strip()
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "invalid arguments"
    if m := re.match(r"unrecognized arguments: (.*)", lines[0]):
        words = [w.split("=")[0] for w in m.group(1).split() if w.startswith("--")] or [m.group(1)]
        parts = []
        for word in words:
            guess = _guess(word[2:], _options(parser)) if word.startswith("--") else None
            parts.append(f"unknown option {word}" + (f"; did you mean --{guess}?" if guess else ""))
        return "; ".join(parts)
    if m := re.search(r"Group '([^']+)' does not accept option '([^']+)'", message):
        group, name = m.groups()
        under = [key[len(group) + 1 :] for key in _options(parser) if key.startswith(group + ".")]
        guess = _guess(name, under)
        return f"unknown key '{group}.{name}'" + (f"; did you mean '{group}.{guess}'?" if guess else "")

    # Walk the nesting: 'Parser key "model":' > "- Problem with given class_path 'C':" > 'Parser key "x":' > the problem.
    path: list[str] = []
    class_path = None
    expected: list[str] = []
    given = None
    for line in lines:
        if m := re.match(r'Parser key "([^"]+)":\s*(.*)', line):
            if expected:
                break
            path.append(m.group(1))
            if m.group(2):
                return f"{'.'.join(path)}: {m.group(2)}"
        elif m := re.match(r"- Problem with given class_path '([^']+)':", line):
            if expected:
                break
            class_path = m.group(1)
            path.append("init_args")
        elif line.startswith(("Does not validate against", "Subtypes:", "Errors:", "Given value type:")):
            continue
        elif line.startswith("Given value:"):
            given = given if given is not None else line[len("Given value:") :].strip()
        elif m := re.match(r"-?\s*Expected an? (.+)", line):
            what, _, got = m.group(1).partition(". Got value: ")
            if "NoneType" not in what:
                expected.append(_type_name(what))
            if got and given is None:
                given = got
        elif "NoneType" in line or expected:
            continue
        elif m := re.search(r"Option '([^']+)' is not accepted", line):
            name = m.group(1)
            if inner := re.search(r"class_path='([^']+)'", line):  # an argument of a class given to the class
                class_path = inner.group(1)
                path.append("init_args")
            guess = _guess(name, _class_keys(class_path) if class_path else _options(parser))
            where = f" ({class_path} has no argument '{name}')" if class_path else ""
            meant = f"; did you mean '{'.'.join([*path, guess])}'?" if guess else ""
            return f"unknown key '{'.'.join([*path, name])}'{where}{meant}"
        elif path and path[-1] == "init_args":  # the class itself failed (not found, not importable)
            return f"{'.'.join(path[:-1])}: class_path '{class_path}': {line.lstrip('- ')}"
        else:
            return f"{'.'.join(path)}: {line.lstrip('- ')}" if path else line
    if expected:
        got = f", got {_value(given)}" if given is not None else ""
        return f"{'.'.join(path) or 'value'}: expected {' or '.join(expected)}{got}"
    return lines[0]


def check_cuda(config, args: list[str]) -> None:
    """A config that needs CUDA (a GPU accelerator, the RMM pool, the cuML backend) fails here, before
    any work, when torch sees no CUDA GPU: one paragraph naming the settings and the command that
    runs the same config on the CPU."""
    import torch

    if torch.cuda.is_available():
        return
    needs, fixes = [], []
    accelerator = config.get("trainer.accelerator")
    if isinstance(accelerator, str) and accelerator.lower() in ("gpu", "cuda"):
        needs.append(f"trainer.accelerator: {accelerator}")
        fixes.append("--trainer.accelerator cpu")
    if config.get("rmm_pool"):
        needs.append("rmm_pool: true")
        fixes.append("--rmm_pool false")
    model = config.get("model")
    backend = model.get("init_args.backend") if model is not None and hasattr(model, "get") else None
    if backend == "cuml":
        needs.append("model.init_args.backend: cuml")
        fixes.append("--model.init_args.backend auto")
    if not needs:
        return
    precision = str(config.get("trainer.precision"))
    if precision not in ("None", "32", "32-true", "64", "64-true"):  # half / mixed: runs on a CPU, but slower there
        fixes.append("--trainer.precision 32")
    script = os.path.relpath(__file__)
    script = script if not script.startswith("..") else os.path.abspath(__file__)
    fixed = {fix.split()[0] for fix in fixes}
    kept, skip = [], False
    for arg in args:  # the given arguments less those the fixes replace (``--rmm_pool true``)
        if skip or arg.split("=")[0] in fixed:
            skip = not skip and "=" not in arg
            continue
        kept.append(arg)
    command = shlex.join(["python", script, *kept]) + " " + " ".join(fixes)
    raise ConfigError(
        f"this config needs a CUDA GPU ({', '.join(needs)}), but torch sees none (torch.cuda.is_available() "
        f"is False: no GPU, no driver, or a CPU-only torch build). To run it on the CPU instead:\n    {command}\n"
        + (f"(--trainer.precision 32 is optional: {precision} runs on a CPU too, but slower on most; " if "--trainer.precision 32" in fixes else "(")
        + "add --trainer.max_epochs 1 for a quick try)"
    )


class RunDirectory(Callback):
    """Says where the run writes (its run directory) when training starts."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or trainer.fast_dev_run:
            return
        run = trainer.log_dir  # a collective under DDP: every rank asks
        if trainer.is_global_zero and run:
            print(f"writing to {run} (config, CSV logs, checkpoints; figures after the test)", flush=True)


class TrainCLI(LightningCLI):
    def __init__(self, *args, **kwargs):
        given = kwargs.get("args")
        self.given_args = list(sys.argv[1:] if given is None else given)  # for check_cuda's command line
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")  # best (by val/mae) + last, always
        parser.set_defaults(
            {"checkpoint.monitor": "val/mae", "checkpoint.mode": "min", "checkpoint.save_last": True, "checkpoint.filename": "best-{epoch}"}
        )
        parser.add_argument("--ckpt_path", type=Optional[str], default=None, help="resume training from this checkpoint")
        parser.add_argument("--rmm_pool", type=bool, default=False, help="one RMM pool for torch/CuPy/cuML (CUDA)")
        parser.add_argument("--figure", type=bool, default=True, help="save field_slice.png (and an SDF run's learnt surfaces) in the run directory")

    def before_instantiate_classes(self) -> None:
        if self.config.get("rmm_pool"):
            check_cuda(self.config, self.given_args)  # the pool is set up below, before anything touches CUDA
        ckpt = self.config.get("ckpt_path")
        if ckpt:
            check_checkpoint(pathlib.Path(ckpt))
        if self.config.get("rmm_pool"):
            pcops.memory.use_rmm_pool()  # before the model, the data or the trainer touch CUDA


    def instantiate_trainer(self, **kwargs):
        check_cuda(self.config, self.given_args)  # after the data and model modules have checked their arguments
        return super().instantiate_trainer(**kwargs)


def check_checkpoint(path: pathlib.Path) -> None:
    """Fail before any work (and before a run directory exists) unless ``path`` loads as a checkpoint."""
    import torch

    if not path.is_file():
        raise ConfigError(f"ckpt_path: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)  # a checkpoint is trusted code, as for Lightning
    except Exception as err:  # truncated, empty, not a checkpoint: torch raises many kinds
        raise ConfigError(f"ckpt_path: {path} is not a readable checkpoint (empty, truncated or another format): {err}") from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"ckpt_path: {path} is not a Lightning checkpoint (no 'state_dict')")


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
        raise ConfigError(f"ckpt_path: {path} holds another model's weights than this config's {type(model).__name__} ({listing})")


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
        trainer_defaults={**TRAINER_DEFAULTS, "callbacks": [RunDirectory()]},  # persistent: not configurable
        parser_class=TrainParser,
        args=args,
    )
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    if trainer.fast_dev_run:  # a smoke test writes no file: Lightning's save_last would write ./checkpoints/last.ckpt
        for callback in trainer.checkpoint_callbacks:
            callback.save_last = False
    if cli.config.get("ckpt_path"):  # before fit creates the run directory
        check_checkpoint_fits(pathlib.Path(cli.config.get("ckpt_path")), model)
    trainer.fit(model, datamodule=data, ckpt_path=cli.config.get("ckpt_path"))
    best = "best" if getattr(trainer.checkpoint_callback, "best_model_path", "") else None
    results = trainer.test(model, datamodule=data, ckpt_path=best)[0]  # fast_dev_run: one test batch
    run_dir = pathlib.Path(trainer.log_dir or ".")  # a collective under DDP: every rank asks
    if trainer.is_global_zero:
        if results.get("test/mae") and results.get("test/mean_baseline_mae"):
            print(f"test MAE {results['test/mae']:.4f}; predicting the training mean: "
                  f"{results['test/mean_baseline_mae']:.4f} ({baseline_words(results['test/mean_baseline_mae'] / results['test/mae'])})")
        if not trainer.fast_dev_run:  # fast_dev_run writes no run directory (and no figure in the working directory)
            if cli.config.get("figure") and hasattr(data, "figure_sample"):
                save_figure(model, data, run_dir / "field_slice.png")
            if cli.config.get("figure") and hasattr(data, "surface_sample"):
                report_surfaces(surfaces.save(model, data, run_dir))
            report_files(run_dir)
    _end_process_group()
    return results


def report_surfaces(found: list) -> None:
    """One line per test shape: the learnt surface's Chamfer distance and normal consistency, and
    the true field's on the same grid."""
    for i, s in enumerate(found):
        m = s.metrics
        print(f"test shape {i}: learnt surface ({len(s.faces)} faces) Chamfer-L1 {m['chamfer_l1']:.4f}, Chamfer-L2 "
              f"{m['chamfer_l2']:.2e}, normal consistency {m['normal_consistency']:.3f}; the true field on the same grid: "
              f"{m['floor_chamfer_l1']:.4f}, {m['floor_chamfer_l2']:.2e}, {m['floor_normal_consistency']:.3f}")


def baseline_words(ratio: float) -> str:
    """The mean predictor's MAE / the model's, in words: "3.2x higher", or "1.3x lower: the model is worse"."""
    if ratio >= 1:
        return f"{ratio:.1f}x higher"
    return f"{1 / ratio:.1f}x lower: the model does worse than the mean"


def report_files(run_dir: pathlib.Path) -> None:
    """Every file in the run directory, which a run makes new (config, logs, checkpoints, figures)."""
    files = sorted(path for path in run_dir.rglob("*") if path.is_file())
    print(f"run directory: {run_dir}, {len(files)} files:")
    for path in files:
        print(f"  {path}")


def _end_process_group() -> None:
    """Destroy the DDP process group (Lightning leaves it): otherwise gloo's threads are still
    running while the interpreter exits, and a run that did all its work sometimes aborts
    there ("terminate called without an active exception", seen in 1 of 7-19 two-process runs)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run(args=None) -> int:
    """The command line: :func:`main`, a :class:`ConfigError` printed as ``error: <message>`` (no
    traceback) with exit status 2; 0 after a run (the parser's own errors exit as argparse does)."""
    try:
        main(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run())
