"""What every LightningModule of models/ shares: injected optimiser and scheduler, whole-network
compile, and one ``_step(batch, split)`` serving training, validation and test."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

import pcops.memory


def adam(params):
    """The default optimiser: Adam, learning rate 1e-3."""
    return torch.optim.Adam(params, lr=1e-3)


class Task(LightningModule):
    """Base of the tasks: subclasses set ``self.net`` and define ``_step(batch, split) -> loss``."""

    def __init__(self, optimizer: OptimizerCallable = adam, scheduler: LRSchedulerCallable | None = None,
                 compile: bool = False, compile_mode: str | None = None):
        super().__init__()
        self.optimizer, self.scheduler = optimizer, scheduler
        self.compile_net, self.compile_mode = compile, compile_mode
        self.net: torch.nn.Module

    def configure_model(self) -> None:
        if self.compile_net and not getattr(self, "_compiled", False):
            pcops.memory.check_compile_mode(self.compile_mode)
            self.net.compile(fullgraph=True, mode=self.compile_mode)
            self._compiled = True

    def _step(self, batch, split: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler(optimizer)}
