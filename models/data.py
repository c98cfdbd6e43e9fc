"""Lightning data modules. Every batch is a dict of padded tensors:

    points  (B, N, 3)  input cloud (surface samples, or the tutorial's random cloud)
    normals (B, N, 3)  unit normals of the cloud (zeros when the source has none)
    queries (B, M, 3)  where the field is predicted
    target  (B, M)     the field there (signed distance, negative inside, for the SDF tasks)

* :class:`ShapesSDFDataModule` - the default task, procedural and offline: random shapes with
  exact signed distance (models/shapes.py), deterministic from a seed.
* :class:`FileSDFDataModule` - the same task from files (meshes, point clouds, HDF5; see
  models/files.py).
* :class:`TutorialCloudDataModule` - PhysicsNeMo tutorial's synthetic set-up: a random cloud
  and a 30^3 grid, for the projector models and benchmarks.

The procedural modules make their samples in ``setup``, in memory (nothing is written to disk);
a :class:`Progress` tells how far that has come on stderr (rank 0 only).
"""

from __future__ import annotations

import sys
import time

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, Dataset, Sampler

from .shapes import PRIMITIVES, Shape, grid, slice_grid


PROGRESS_EVERY = 15.0  # seconds between two progress lines


@rank_zero_only
def say(message: str) -> None:
    """A line on stderr, from rank 0 only (every rank makes its own data under DDP)."""
    print(message, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """``12 s``, ``3.5 min``."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class Progress:
    """Lines on stderr while a data module makes ``total`` samples (``what``: a plural noun).

    A first line when it starts (``making 1584 scenes (train 1200, val 128, test 256)``), one every
    :data:`PROGRESS_EVERY` seconds (``making scenes: 200/1584 (31 s, about 3.6 min left)``) and
    a last one with the total time: a quick set-up prints two lines, a long one a line every
    15 s. Call :meth:`step` after each sample and :meth:`done` at the end.
    """

    def __init__(self, total: int, what: str, detail: str = "", every: float | None = None):
        self.total, self.what, self.count = total, what, 0
        self.every = PROGRESS_EVERY if every is None else every
        self.start = self.last = time.monotonic()
        say(f"making {total} {what}{f' ({detail})' if detail else ''} ...")

    def step(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every and self.count < self.total:
            self.last = now
            spent = now - self.start
            left = spent / self.count * (self.total - self.count)
            say(f"making {self.what}: {self.count}/{self.total} ({duration(spent)}, about {duration(left)} left)")

    def done(self) -> None:
        say(f"made {self.count} {self.what} in {duration(time.monotonic() - self.start)}")


class TensorDictDataset(Dataset):
    """Samples stored as stacked tensors: item i is {key: tensor[i]}."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.size = len(next(iter(tensors.values())))

    @classmethod
    def stack(cls, samples: list[dict[str, torch.Tensor]]) -> "TensorDictDataset":
        """Samples of equal shapes stacked into float32 tensors."""
        return cls({key: torch.stack([s[key] for s in samples]).float() for key in samples[0]})

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: value[i] for key, value in self.tensors.items()}


class EpochShuffleSampler(Sampler):
    """A shuffle that depends only on (seed, epoch): resuming from a checkpoint replays it exactly.

    Lightning calls ``set_epoch`` on samplers that have it at the start of every epoch.
    """

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=gen).tolist())

    def __len__(self) -> int:
        return self.size


def sdf_queries(shape_sdf, surface: torch.Tensor, n: int, gen: torch.Generator, near_std: float, grid_resolution: int):
    """n query points: half near the surface, a quarter uniform in [-1, 1]^3, a quarter on a grid."""
    near = n // 2
    uniform = n // 4
    on_grid = n - near - uniform
    pick = torch.randint(surface.shape[0], (near,), generator=gen)
    q_near = surface[pick] + near_std * torch.randn(near, 3, generator=gen, dtype=surface.dtype)
    q_uniform = torch.rand(uniform, 3, generator=gen, dtype=surface.dtype) * 2 - 1
    g = grid(grid_resolution, dtype=surface.dtype)
    q_grid = g[torch.randperm(g.shape[0], generator=gen)[:on_grid]]
    queries = torch.cat([q_near, q_uniform, q_grid])
    return queries, shape_sdf(queries)


class _Module(LightningDataModule):
    """Shared loaders: a seeded epoch shuffle for training, fixed order for validation and test."""

    def __init__(self, batch_size: int, seed: int, num_workers: int):
        super().__init__()
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.splits: dict[str, TensorDictDataset] = {}

    @property
    def target_mean(self) -> float:
        """Mean target over the training split (the constant predictor's value)."""
        return float(self.splits["train"].tensors["target"].mean())

    def _make_splits(self, sizes: dict[str, int], what: str) -> dict[str, list[dict[str, torch.Tensor]]]:
        """``self._sample(split, i)`` for i < size, for each split not made yet, with :class:`Progress` lines."""
        todo = {split: size for split, size in sizes.items() if split not in self.splits}
        if not todo:
            return {}
        progress = Progress(sum(todo.values()), what, ", ".join(f"{split} {size}" for split, size in todo.items()))
        made = {}
        for split, size in todo.items():
            made[split] = []
            for i in range(size):
                made[split].append(self._sample(split, i))
                progress.step()
        progress.done()
        return made

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        data = self.splits[split]
        sampler = EpochShuffleSampler(len(data), self.seed) if shuffle else None
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)

    def train_dataloader(self):
        return self._loader("train", True)

    def val_dataloader(self):
        return self._loader("val", False)

    def test_dataloader(self):
        return self._loader("test", False)


class ShapesSDFDataModule(_Module):
    """Random shapes -> signed distance. Surface clouds in, SDF at query points out.

    Args:
        train_size, val_size, test_size: number of shapes per split.
        n_points: surface points per shape. n_queries: query points per shape.
        noise: std of Gaussian noise added to the surface points (not to the targets).
        normals: give the model unit normals (else zeros).
        near_std: spread of the near-surface queries.
        grid_resolution: grid the grid-queries are drawn from (and the figure's slice).
        primitives: which shape families to draw from.
        seed: everything is a function of it.
    """

    def __init__(
        self,
        train_size: int = 512,
        val_size: int = 64,
        test_size: int = 64,
        n_points: int = 1024,
        n_queries: int = 1024,
        noise: float = 0.0,
        normals: bool = True,
        near_std: float = 0.05,
        grid_resolution: int = 24,
        primitives: tuple[str, ...] = PRIMITIVES,
        batch_size: int = 16,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__(batch_size, seed, num_workers)
        unknown = set(primitives) - set(PRIMITIVES)
        if unknown:
            raise ValueError(f"primitives must be among {PRIMITIVES}, got {sorted(unknown)}")
        self.save_hyperparameters()

    def make_shape(self, split: str, i: int) -> tuple[Shape, torch.Generator]:
        offset = {"train": 0, "val": 1, "test": 2}[split]
        gen = torch.Generator().manual_seed((self.hparams.seed * 3 + offset) * 1_000_003 + i)
        return Shape.random(gen, tuple(self.hparams.primitives)), gen

    def _sample(self, split: str, i: int) -> dict[str, torch.Tensor]:
        h = self.hparams
        shape, gen = self.make_shape(split, i)
        points, normals = shape.sample_surface(h.n_points, gen)
        queries, target = sdf_queries(shape.sdf, points, h.n_queries, gen, h.near_std, h.grid_resolution)
        if h.noise:
            points = points + h.noise * torch.randn(points.shape, generator=gen, dtype=points.dtype)
        if not h.normals:
            normals = torch.zeros_like(normals)
        return {"points": points, "normals": normals, "queries": queries, "target": target}

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        made = self._make_splits({"train": h.train_size, "val": h.val_size, "test": h.test_size}, "shapes")
        for split, samples in made.items():
            self.splits[split] = TensorDictDataset.stack(samples)

    def surface_sample(self, i: int, n: int) -> dict:
        """Test shape i as the model sees it (its cloud's ``points`` and ``normals``), ``n`` points on
        its true surface with their unit normals (``true_points``, ``true_normals``, float64) and
        its signed distance (``sdf``, a function of (..., 3) points), for models.surfaces."""
        self.setup()
        sample = self.splits["test"][i]
        shape, _ = self.make_shape("test", i)
        true_points, true_normals = shape.sample_surface(n, torch.Generator().manual_seed(i))
        return {"points": sample["points"], "normals": sample["normals"], "true_points": true_points,
                "true_normals": true_normals, "sdf": shape.sdf}

    def figure_sample(self, resolution: int = 64) -> dict[str, torch.Tensor]:
        """The first test shape with queries on the z = 0 slice (resolution^2) and their true SDF."""
        shape, gen = self.make_shape("test", 0)
        points, normals = shape.sample_surface(self.hparams.n_points, gen)
        queries = slice_grid(resolution, dtype=torch.float64)
        if not self.hparams.normals:
            normals = torch.zeros_like(normals)
        sample = {"points": points, "normals": normals, "queries": queries, "target": shape.sdf(queries)}
        return {key: value[None].float() for key, value in sample.items()}


class TutorialCloudDataModule(_Module):
    """The tutorial's set-up: a random cloud in [-1, 1]^3 and a grid^3 query grid.

    The target on the grid is the smooth field sin(pi x) sin(pi y) sin(pi z), so that
    training has something to learn; the cloud carries no features beyond its coordinates.
    """

    def __init__(self, n_points: int = 100_000, grid_resolution: int = 30, samples: int = 4, batch_size: int = 1, seed: int = 0, num_workers: int = 0):
        super().__init__(batch_size, seed, num_workers)
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        gen = torch.Generator().manual_seed(h.seed)
        queries = grid(h.grid_resolution)
        target = torch.sin(torch.pi * queries).prod(-1)
        for split in ("train", "val", "test"):
            points = torch.rand(h.samples, h.n_points, 3, generator=gen) * 2 - 1
            self.splits[split] = TensorDictDataset(
                {
                    "points": points,
                    "normals": torch.zeros_like(points),
                    "queries": queries.expand(h.samples, -1, -1).contiguous(),
                    "target": target.expand(h.samples, -1).contiguous(),
                }
            )

    def figure_sample(self, resolution: int | None = None) -> dict[str, torch.Tensor]:
        """The first test cloud with the grid's middle z slice as queries."""
        self.setup()
        sample = self.splits["test"][0]
        r = self.hparams.grid_resolution
        middle = torch.arange(r * r) * r + r // 2  # x-major cartesian product: z varies fastest
        return {
            "points": sample["points"][None],
            "normals": sample["normals"][None],
            "queries": sample["queries"][middle][None],
            "target": sample["target"][middle][None],
        }
