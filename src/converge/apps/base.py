"""The App contract: what a science case gives the generic stages.

The stages (``simulate``, ``data``, ``train``, ``evaluate``) know nothing of any
science; an app plugs into them by implementing :class:`App`:

- ``config_cls``: a frozen dataclass of the app's physics settings (the
  ``[app]`` section of a config file), saved with every dataset and run;
- ``schema``: the arrays one simulated sample stores (name, shape, dtype);
- ``sample_parameters`` / ``simulate``: the parameter sampler and the simulator
  (parameters -> arrays); the ensemble runner calls these in worker processes;
- ``make_model`` / ``make_datasets`` / ``loss`` / ``metrics``: what the trainer
  needs; datasets may draw cheap randomness (noise, shifts) afresh each epoch;
- ``evaluate``: the surrogate against the classical baseline on a test set.

Apps are found through the ``converge.apps`` entry-point group, so a user's
package adds one by declaring, in its ``pyproject.toml``::

    [project.entry-points."converge.apps"]
    myapp = "mypackage.app:MyApp"
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Protocol

import numpy as np
import torch
from torch import nn

ENTRY_POINT_GROUP = "converge.apps"


@dataclass(frozen=True)
class ArraySpec:
    """One array of a stored sample: ``shape`` excludes the sample axis."""

    shape: tuple[int, ...]
    dtype: str


class BatchSource(Protocol):
    """What the trainer iterates: batches (dicts of tensors), reproducible per epoch.

    ``batches`` must depend only on (the source's seed, ``epoch``, ``rank``,
    ``world``) so a resumed run sees exactly the data an uninterrupted one would;
    ranks get disjoint shares of each epoch's samples.
    """

    def __len__(self) -> int:
        """Samples per epoch (all ranks together)."""

    def batches(
        self, epoch: int, batch_size: int, rank: int = 0, world: int = 1
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield dicts of tensors (by default the model takes ``batch["input"]``)."""


@dataclass(frozen=True)
class TensorSpec:
    """A served tensor in Open Inference Protocol terms: -1 marks a variable dimension."""

    name: str
    datatype: str  # KServe v2 datatype: FP32, FP64, INT64, ...
    shape: tuple[int, ...]  # including the batch axis (-1)


@dataclass(frozen=True)
class Monitor:
    """The validation metric that picks the best checkpoint and stops early."""

    name: str
    mode: str  # "min" or "max"

    def better(self, new: float, old: float | None) -> bool:
        if old is None:
            return True
        return new < old if self.mode == "min" else new > old


class App(ABC):
    """Base class of a converge application (see the module docstring)."""

    name: ClassVar[str]
    config_cls: ClassVar[type]
    monitor: ClassVar[Monitor]
    packages: ClassVar[tuple[str, ...]] = ()  # distributions whose versions go in manifests
    evaluate_config_cls: ClassVar[type | None] = None  # the [evaluate] table, if the app has one
    grad_at_inference: ClassVar[bool] = False  # outputs need autograd (e.g. forces = -dE/dr)
    default_precision: ClassVar[str] = "fp32"  # training precision chosen by measurement per app

    # -- simulate -----------------------------------------------------------------
    @abstractmethod
    def schema(self, cfg: Any) -> dict[str, ArraySpec]:
        """Arrays of one stored sample, by name."""

    @abstractmethod
    def sample_parameters(self, cfg: Any, rng: np.random.Generator) -> dict[str, float]:
        """Draw one task's physical parameters."""

    @abstractmethod
    def simulate(self, cfg: Any, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        """Run the simulator for one parameter set; arrays must match ``schema``."""

    # -- train ----------------------------------------------------------------------
    @abstractmethod
    def make_model(self, cfg: Any) -> nn.Module:
        """A fresh, untrained model for this config."""

    @abstractmethod
    def make_datasets(
        self, cfg: Any, arrays: Mapping[str, np.ndarray], seed: int, val_fraction: float
    ) -> tuple[BatchSource, BatchSource]:
        """(train, validation) batch sources over the stored ``arrays``."""

    def forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> Any:
        """The model's output on a batch (a tensor or a NamedTuple of tensors), in float32."""
        return model(batch["input"]).float()

    @abstractmethod
    def loss(self, cfg: Any, output: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Scalar training loss of a model output on a batch."""

    @abstractmethod
    def metrics(self, outputs: Any, batches: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Validation metrics from all outputs and the concatenated batches."""

    def fit_to_data(self, model: nn.Module, train_source: BatchSource) -> None:
        """Set data-derived constants of a fresh model (e.g. self-energies) before training."""

    def on_epoch_start(self, train_source: BatchSource, epoch: int, epochs: int) -> None:
        """Hook for curricula: adjust the training source before an epoch."""

    # -- evaluate -------------------------------------------------------------------
    @abstractmethod
    def evaluate(self, run_dir: Path, data_dir: Path, out_dir: Path, **options: Any) -> dict:
        """Surrogate against the classical baseline; writes plots, returns the report."""

    # -- serve --------------------------------------------------------------------
    def serving_signature(self, cfg: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """(inputs, outputs) of the served model; the first axis of each is the batch."""
        raise NotImplementedError(f"app {self.name!r} does not define a serving signature")

    def serving_example(self, cfg: Any, n: int, seed: int = 0) -> dict[str, np.ndarray]:
        """``n`` realistic inputs for the served model (benchmarks and smoke tests)."""
        raise NotImplementedError(f"app {self.name!r} gives no serving example")

    def serve_predict(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Outputs by name for a batch of validated inputs (called under inference mode)."""
        raise NotImplementedError(f"app {self.name!r} cannot be served")

    # trust-gated serving (converge.serve.fallback): a sample the surrogate should not answer
    uncertainty_label: ClassVar[str] = "uncertainty"  # what App.uncertainty measures, with its unit

    def uncertainty(self, cfg: Any, inputs: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray],
                    std: Mapping[str, np.ndarray]) -> np.ndarray:
        """(B,) uncertainty score of an ensemble's served outputs, in the app's natural unit.

        ``mean``/``std``: each served output's mean and spread over the members, by output name.
        """
        raise NotImplementedError(f"app {self.name!r} defines no uncertainty score")

    def simulate_inputs(self, cfg: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The simulator's answer to exactly these served inputs: the served outputs by name, batch first.

        Not every app has one: a served input may not be a simulator parameter
        (gw: a strain window's matched-filter SNR is no logit). Such an app cannot
        fall back to its simulator and leaves this unimplemented.
        """
        raise NotImplementedError(f"app {self.name!r} cannot simulate served inputs")

    def record_training_distribution(self, cfg: Any, arrays: Mapping[str, np.ndarray], run_dir: Path) -> None:
        """Store what the training inputs covered, for :meth:`distribution_check` (default: nothing)."""

    def distribution_check(self, cfg: Any, run_dir: Path) -> Callable[[Mapping[str, np.ndarray]], list[list[str]]] | None:
        """A check of served inputs against the run's training data, or None if the run records none.

        The check returns, per sample, the reasons it is out of distribution ([] when inside).
        """
        return None

    def predict_file(self, run_dir: Path, path: Path, out: Path | None = None) -> Path:
        """Run the surrogate on an input file; returns the output file written."""
        raise NotImplementedError(f"app {self.name!r} has no `converge predict`; use its Python API")

    def summary(self, report: dict) -> dict:
        """The headline figures of an evaluation report, for the terminal."""
        return report


def available_apps() -> dict[str, type[App]]:
    """Apps registered under the ``converge.apps`` entry-point group."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}  # type: ignore[misc]


def load_app(name: str) -> App:
    """Instantiate the app registered as ``name``, or say which ones exist."""
    found = available_apps()
    if name not in found:
        known = ", ".join(sorted(found)) or "none (is converge installed with `pip install -e .`?)"
        raise KeyError(f"unknown app {name!r}; installed apps: {known}")
    cls = found[name].load()  # type: ignore[attr-defined]
    if not (isinstance(cls, type) and issubclass(cls, App)):
        raise TypeError(f"entry point {name!r} does not name a converge App subclass: {cls!r}")
    return cls()
