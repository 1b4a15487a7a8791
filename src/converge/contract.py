"""The App contract: what a science case gives the generic stages.

The stages (simulate, data, train, evaluate, serve, learn, bench, demo, report)
know nothing of any science; an app plugs into them by implementing :class:`App`.
This module imports no stage: the stages import it, and the apps sit on top of
both (an app may use the train helpers, validate's ensembles and data).

What each stage asks of an app:

- ``config_cls``: a frozen dataclass of the app's physics settings (the
  ``[app]`` section of a config file), saved with every dataset and run;
- ``schema``: the arrays one simulated sample stores (name, shape, dtype);
- ``sample_parameters`` / ``simulate``: the parameter sampler and the simulator
  (parameters -> arrays); the ensemble runner calls these in worker processes;
- ``make_model`` / ``make_datasets`` / ``loss`` / ``metrics``: what the trainer
  needs; datasets may draw cheap randomness (noise, shifts) afresh each epoch;
- ``evaluate``: the surrogate against the classical baseline on a test set;
- ``serving_signature`` / ``serving_example`` / ``serve_predict``: ``converge serve``,
  and with ``uncertainty`` / ``simulate_inputs`` / ``distribution_check`` its trust gate;
- ``learning_problem`` (and ``learn_config_cls``, the ``[learn]`` table): ``converge learn``;
- ``classical_baseline``: ``converge bench surrogate`` times it against ``serve_predict``
  on ``serving_example``; ``accuracy_summary`` picks the accuracy shown beside;
- ``synthetic_batch``: ``converge bench ddp`` trains the app's model on it;
- ``demo``: the app's part of ``converge demo``; ``report_sections``: its part of ``converge report``;
- ``predict_file`` and ``commands``: ``converge predict APP`` and the app's own
  subcommands, ``converge VERB APP ...``.

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
from typing import Any, Callable, ClassVar, Iterator, Mapping, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn

from .tables import Table

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


class CommandError(Exception):
    """An app command's clear failure: the CLI prints the message and exits with status 2."""


class Baseline(NamedTuple):
    """An app's classical method, as ``converge bench surrogate`` times it against the surrogate."""

    name: str  # what runs, e.g. "matched-filter bank, 1053 templates"
    run: Callable[[Mapping[str, np.ndarray]], Any]  # the classical answer for a batch of served inputs
    batch: int  # inputs per call it is timed on when batched (1: it has no batch)
    details: Mapping[str, Any]  # extra keys of the result entry (n_templates, level_of_theory, ...)


@dataclass(frozen=True)
class ReportSection:
    """A section of ``converge report``: the result files ``STEM*.json``/``STEM*.png`` and their tables."""

    key: str
    title: str
    stems: tuple[str, ...]  # file name stems: STEM.json, STEM_*.json, STEM-*.json and the PNGs alike
    about: str
    render: Callable[[dict], list[Table]]


class App(ABC):
    """Base class of a converge application (see the module docstring)."""

    name: ClassVar[str]
    config_cls: ClassVar[type]
    monitor: ClassVar[Monitor]
    packages: ClassVar[tuple[str, ...]] = ()  # distributions whose versions go in manifests
    evaluate_config_cls: ClassVar[type | None] = None  # the [evaluate] table, if the app has one
    grad_at_inference: ClassVar[bool] = False  # outputs need autograd (e.g. forces = -dE/dr)
    default_precision: ClassVar[str] = "fp32"  # training precision chosen by measurement per app
    train_defaults: ClassVar[Mapping[str, Any]] = {}  # the app's measured [train] settings, under the user's
    learn_config_cls: ClassVar[type | None] = None  # the [learn] table of the app's own options, if it has one
    bench_batch_size: ClassVar[int] = 32  # samples per process and step in `converge bench ddp`
    demo_by_default: ClassVar[bool] = False  # part of a plain `converge demo` (the built-in apps, on a budget)

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

    def inference_model(self, model: nn.Module) -> nn.Module:
        """The trained model (eval mode) as it is served: the same outputs to float rounding, rebuilt for speed
        where the app knows how (gw folds each BatchNorm into its convolution); by default the model itself."""
        return model

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

    # -- learn ------------------------------------------------------------------------
    def learning_problem(self, cfg: Any, options: Any = None) -> Any:
        """The app's part of active learning, a :class:`converge.validate.active.LearningProblem`:
        candidates from the prior, labelled with the simulator. ``options``: an instance of
        ``learn_config_cls`` (None: its defaults)."""
        raise NotImplementedError(f"app {self.name!r} defines no active-learning problem")

    # -- bench ----------------------------------------------------------------------
    def classical_baseline(self, cfg: Any, device: torch.device, quick: bool = False) -> Baseline:
        """The classical method the surrogate replaces, on inputs of ``serving_example``.

        ``quick``: a seconds-long variant for tests (fewer templates, a cheaper level).
        """
        raise NotImplementedError(f"app {self.name!r} names no classical baseline")

    def accuracy_summary(self, cfg: Any, report: Mapping[str, Any]) -> dict[str, Any]:
        """The accuracy figures shown beside the speed-up, from an ``evaluation.json`` or the app's
        ``benchmarks/results/NAME.json``."""
        return dict(self.summary(dict(report)))

    def synthetic_batch(self, cfg: Any, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A training batch for ``converge bench ddp`` (inputs of the right shape; labels may be zeros:
        they change no timing), as ``make_datasets``' sources yield them."""
        raise NotImplementedError(f"app {self.name!r} gives no synthetic training batch")

    # -- demo and report ----------------------------------------------------------------
    def demo(self, out: Path, quick: bool = False, workers: int = 2) -> dict:
        """The app end to end on small defaults into ``out``; returns its summary (``quick``: a smoke test)."""
        raise NotImplementedError(f"app {self.name!r} has no demo")

    def report_sections(self) -> list[ReportSection]:
        """The app's sections of ``converge report`` (tables of its result files)."""
        return []

    # -- files and commands -------------------------------------------------------------
    def predict_file(self, run_dir: Path, path: Path, out: Path | None = None) -> Path:
        """Run the surrogate on an input file; returns the output file written."""
        raise NotImplementedError(f"app {self.name!r} has no `converge predict`; use its Python API")

    def commands(self) -> dict[str, Callable[..., Any]]:
        """The app's own subcommands, by verb: ``converge VERB APP ...`` calls ``commands()[VERB]``.

        Each is a Typer command function (its parameters are the command's arguments and
        options, its docstring the help); it raises :class:`CommandError` with a message
        that says what to fix. A verb the CLI already has (train, predict, ...) is refused.
        """
        return {}

    def summary(self, report: dict) -> dict:
        """The headline figures of an evaluation report, for the terminal."""
        return report

    @classmethod
    def provides(cls, method: str) -> bool:
        """Whether this app implements the contract's optional ``method`` (a stage offers its part only then)."""
        return getattr(cls, method) is not getattr(App, method)


def available_apps() -> dict[str, type[App]]:
    """Apps registered under the ``converge.apps`` entry-point group."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}  # type: ignore[misc]


def app_classes() -> tuple[dict[str, type[App]], dict[str, str]]:
    """The installed apps' classes by name, and why each one that does not load failed (name -> message).

    A stage that lists apps (the demo, the benchmarks, the report, the CLI's app commands) skips a
    package that does not import instead of failing for all of them.
    """
    classes, errors = {}, {}
    for name, entry in sorted(available_apps().items()):
        try:
            cls = entry.load()  # type: ignore[attr-defined]
        except Exception as err:  # a third party's import error, say
            errors[name] = f"{type(err).__name__}: {err}"
            continue
        if isinstance(cls, type) and issubclass(cls, App):
            classes[name] = cls
        else:
            errors[name] = f"entry point does not name a converge App subclass: {cls!r}"
    return classes, errors


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
