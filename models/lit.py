"""LightningModules: field regression from a point cloud, with pcops layers inside.

All of them take a batch dict (see models/data.py) and predict ``target`` at ``queries``. The
optimiser and scheduler are injected (``OptimizerCallable`` / ``LRSchedulerCallable``), so a
config chooses them::

    model:
      class_path: models.SDFModel
      init_args:
        optimizer: {class_path: torch.optim.AdamW, init_args: {lr: 0.003}}
        scheduler: {class_path: torch.optim.lr_scheduler.CosineAnnealingLR, init_args: {T_max: 20}}

``compile: true`` compiles the network in place (``nn.Module.compile(fullgraph=True)``), which
keeps the state_dict keys free of ``_orig_mod.``: checkpoints load into uncompiled models.
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from . import nets
from .task import Task, adam


class FieldRegressor(Task):
    """Base: L1 loss on the field, MAE/RMSE metrics, and the constant-mean baseline's MAE."""

    def __init__(self, optimizer: OptimizerCallable = adam, scheduler: LRSchedulerCallable | None = None, compile: bool = False, compile_mode: str | None = None):
        super().__init__(optimizer, scheduler, compile, compile_mode)
        self.register_buffer("target_mean", torch.zeros(()))

    def predict_field(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.predict_field(batch)

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if stage == "fit" and data is not None and hasattr(data, "target_mean"):
            self.target_mean.fill_(data.target_mean)

    def _step(self, batch, split: str) -> torch.Tensor:
        pred = self(batch)
        target = batch["target"]
        error = (pred.float() - target).abs()
        loss = error.mean()
        size = target.shape[0]
        self.log(f"{split}/loss", loss, prog_bar=split != "test", batch_size=size, sync_dist=split != "train")
        if split != "train":
            self.log(f"{split}/mae", loss, prog_bar=True, batch_size=size, sync_dist=True)
            self.log(f"{split}/rmse", error.square().mean().sqrt(), batch_size=size, sync_dist=True)
            baseline = (self.target_mean - target).abs().mean()
            self.log(f"{split}/mean_baseline_mae", baseline, batch_size=size, sync_dist=True)
        return loss


class SDFModel(FieldRegressor):
    """Signed distance from an oriented surface cloud (models.nets.SDFNet): the default task."""

    def __init__(self, hidden: int = 32, scales: list[tuple[int, float]] = [(8, 0.02), (24, 0.1)], backend: str = "auto", **kwargs):  # noqa: B006
        super().__init__(**kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = nets.SDFNet(hidden, [tuple(s) for s in scales], backend)

    def predict_field(self, batch):
        return self.net(batch["points"], batch["normals"], batch["queries"])


class KNNProjector(FieldRegressor):
    """The tutorial's kNN_Projector: MLP on the cloud, kNN aggregation onto the queries, MLP out."""

    def __init__(self, k: int = 7, sigma: float = 0.1, hidden: int = 25, backend: str = "auto", **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = nets.knn_projector(k, sigma, hidden, 1, backend)

    def predict_field(self, batch):
        return self.net(batch["points"], batch["queries"]).squeeze(-1)


class RadiusProjector(FieldRegressor):
    """The tutorial's radius projector: as KNNProjector with RadiusAggregation."""

    def __init__(self, radius: float = 0.1, sigma: float = 0.1, hidden: int = 25, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = nets.radius_projector(radius, sigma, hidden, 1)

    def predict_field(self, batch):
        return self.net(batch["points"], batch["queries"]).squeeze(-1)
