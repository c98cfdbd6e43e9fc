"""LightningModules for point-cloud classification and segmentation.

Batches are dicts (models/scenes.py, models/modelnet.py): ``points`` (B, N, 3) with ``label``
(B,) for classification or ``labels`` (B, N) for segmentation. Loss: cross-entropy. Metrics:
``*/acc`` (overall accuracy), ``*/mean_class_acc`` (the mean of the per-class accuracies; for
segmentation also ``*/miou``), and at test time ``test/acc_<class>`` per class. The test run
writes ``confusion_matrix.png`` (and for segmentation ``segmentation.png``, predicted vs true
labels of the first test clouds) into the run directory.

The optimiser, scheduler and ``compile`` work as for the field models (models/lit.py):
``compile: true`` compiles the whole network with ``fullgraph=True``.
"""

from __future__ import annotations

import pathlib

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from .dgcnn import DGCNN
from .pointnet2 import CLS_LEVELS, SEG_LEVELS, PointNet, PointNet2, PointNet2Seg, PointNetSeg
from .task import Task, adam


class _PointTask(Task):
    """Shared: optimiser/scheduler injection, whole-network compile, confusion-matrix metrics."""

    target_key = "label"

    def __init__(self, num_classes: int, optimizer: OptimizerCallable = adam, scheduler: LRSchedulerCallable | None = None,
                 compile: bool = False, compile_mode: str | None = None, label_smoothing: float = 0.0):
        super().__init__(optimizer, scheduler, compile, compile_mode)
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.confusion: dict[str, torch.Tensor] = {}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch["points"])

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        found = getattr(data, "num_classes", None)
        if found is not None and found != self.num_classes:
            raise ValueError(f"model.num_classes is {self.num_classes} but the data has {found} classes; set model.init_args.num_classes: {found}")

    def class_names(self) -> list[str]:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        names = getattr(data, "classes", None)
        return list(names) if names and len(names) == self.num_classes else [str(i) for i in range(self.num_classes)]

    def _step(self, batch, split: str) -> torch.Tensor:
        logits = self(batch).float()
        target = batch[self.target_key]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.num_classes), target.reshape(-1), label_smoothing=self.label_smoothing)
        pred = logits.argmax(-1)
        size = target.shape[0]
        self.log(f"{split}/loss", loss, prog_bar=split != "test", batch_size=size, sync_dist=split != "train")
        self.log(f"{split}/acc", (pred == target).float().mean(), prog_bar=True, batch_size=size, sync_dist=split != "train")
        if split != "train":
            pairs = target.reshape(-1) * self.num_classes + pred.reshape(-1)
            counts = torch.bincount(pairs, minlength=self.num_classes**2).reshape(self.num_classes, self.num_classes)
            self.confusion[split] = self.confusion.get(split, 0) + counts.cpu()
        return loss

    def _epoch_metrics(self, split: str) -> torch.Tensor | None:
        """Class-averaged metrics from the epoch's confusion matrix (rows: true, columns: predicted)."""
        confusion = self.confusion.pop(split, None)
        if confusion is None:
            return None
        confusion = self.trainer.strategy.reduce(confusion.to(self.device), reduce_op="sum").cpu() if self.trainer.world_size > 1 else confusion
        true = confusion.sum(1)
        present = true > 0
        recall = confusion.diag() / true.clamp_min(1)
        self.log(f"{split}/mean_class_acc", recall[present].mean().item())
        if self.target_key == "labels":
            union = true + confusion.sum(0) - confusion.diag()
            self.log(f"{split}/miou", (confusion.diag() / union.clamp_min(1))[present].mean().item())
        return confusion

    def on_validation_epoch_end(self) -> None:
        self._epoch_metrics("val")

    def on_test_epoch_end(self) -> None:
        confusion = self._epoch_metrics("test")
        if confusion is None:
            return
        names = self.class_names()
        recall = confusion.diag() / confusion.sum(1).clamp_min(1)
        for name, value, count in zip(names, recall.tolist(), confusion.sum(1).tolist()):
            if count:
                self.log(f"test/acc_{name}", value)
        if self.trainer.is_global_zero and self.trainer.log_dir and not self.trainer.fast_dev_run:
            run = pathlib.Path(self.trainer.log_dir)
            save_confusion(confusion, names, run / "confusion_matrix.png")
            self.write_figures(run)

    def write_figures(self, run: pathlib.Path) -> None:
        """Task-specific figures in the run directory (none by default)."""


def save_confusion(confusion: torch.Tensor, names: list[str], path: pathlib.Path) -> None:
    """Row-normalised confusion matrix (true class per row) with the counts, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = confusion.double() / confusion.sum(1, keepdim=True).clamp_min(1)
    size = max(4.0, 0.5 * len(names) + 2)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    img = ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    if len(names) <= 20:
        for i in range(len(names)):
            for j in range(len(names)):
                if confusion[i, j]:
                    ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=7, color="white" if rates[i, j] > 0.5 else "black")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    overall = float(confusion.diag().sum() / confusion.sum().clamp_min(1))
    ax.set_title(f"test accuracy {overall:.3f}")
    fig.colorbar(img, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


class PointNetClassifier(_PointTask):
    """The baseline: PointNet without grouping (models.pointnet2.PointNet)."""

    def __init__(self, num_classes: int = 9, widths: list[int] = [64, 128, 256], hidden: int = 128, dropout: float = 0.3, **kwargs):  # noqa: B006
        super().__init__(num_classes, **kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = PointNet(num_classes, widths, hidden, dropout)


class PointNet2Classifier(_PointTask):
    """PointNet++ SSG (models.pointnet2.PointNet2). ``levels``: [centroids, radius, k, [MLP widths]] per level."""

    def __init__(self, num_classes: int = 9, levels: list = CLS_LEVELS, global_widths: list[int] = [128, 256], hidden: int = 128,  # noqa: B006
                 dropout: float = 0.3, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = PointNet2(num_classes, [tuple(level) for level in levels], global_widths, hidden, dropout)


class DGCNNClassifier(_PointTask):
    """DGCNN (models.dgcnn.DGCNN): EdgeConv over dynamic kNN graphs in feature space."""

    def __init__(self, num_classes: int = 9, k: int = 20, widths: list[int] = [32, 32, 64, 128], embed: int = 256, hidden: int = 128,  # noqa: B006
                 dropout: float = 0.5, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = DGCNN(num_classes, k, widths, embed, hidden, dropout)


class _SegmentTask(_PointTask):
    """A label per point; the test also draws true vs predicted labels of the first test clouds."""

    target_key = "labels"

    def write_figures(self, run: pathlib.Path) -> None:
        data = self.trainer.datamodule
        batch = next(iter(data.test_dataloader()))
        batch = {key: value[:3].to(self.device) for key, value in batch.items()}
        self.eval()
        with torch.no_grad():
            pred = self(batch).argmax(-1).cpu()
        save_segmentation(batch["points"].cpu(), batch["labels"].cpu(), pred, self.class_names(), run / "segmentation.png")


class PointNetSegmenter(_SegmentTask):
    """The segmentation baseline: PointNet without grouping (models.pointnet2.PointNetSeg), a label per point."""

    def __init__(self, num_classes: int = 9, widths: list[int] = [64, 128, 256], head_widths: list[int] = [128, 64],  # noqa: B006
                 dropout: float = 0.3, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = PointNetSeg(num_classes, widths, head_widths, dropout)


class PointNet2Segmenter(_SegmentTask):
    """PointNet++ SSG with feature propagation (models.pointnet2.PointNet2Seg): a label per point."""

    def __init__(self, num_classes: int = 9, levels: list = SEG_LEVELS, global_widths: list[int] = [128, 256],  # noqa: B006
                 fp_widths: list[int] = [128, 128, 64], dropout: float = 0.3, **kwargs):  # noqa: B006
        super().__init__(num_classes, **kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = PointNet2Seg(num_classes, [tuple(level) for level in levels], global_widths, fp_widths, dropout)


def save_segmentation(points: torch.Tensor, true: torch.Tensor, pred: torch.Tensor, names: list[str], path: pathlib.Path) -> None:
    """True vs predicted labels of a few clouds (one row each), as a PNG of 3-D scatter plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    fig = plt.figure(figsize=(9, 4 * points.shape[0]))
    for row in range(points.shape[0]):
        for col, (labels, title) in enumerate(((true[row], "true"), (pred[row], "predicted"))):
            ax = fig.add_subplot(points.shape[0], 2, 2 * row + col + 1, projection="3d")
            p = points[row]
            ax.scatter(p[:, 0], p[:, 1], p[:, 2], c=cmap(labels.numpy() % cmap.N), s=3)
            acc = float((pred[row] == true[row]).float().mean())
            ax.set_title(title if col == 0 else f"{title} (accuracy {acc:.3f})")
            ax.set_axis_off()
    used = sorted(set(true.flatten().tolist()) | set(pred.flatten().tolist()))
    fig.legend([Line2D([], [], marker="o", ls="", color=cmap(i % cmap.N)) for i in used], [names[i] for i in used], loc="lower center", ncol=5)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)
