"""Trust-gated serving: a sample the surrogate should not answer goes to the simulator, or is refused.

After the batcher has run the model on a request, :class:`TrustGate` reviews
each sample. A sample is *untrusted* when

- its uncertainty score (``App.uncertainty`` on an ensemble's mean and
  ``<name>_std`` outputs, in the app's unit: chem, the energy spread per atom in
  kcal/mol; gw, the std of the signal probability) exceeds ``max_uncertainty``; or
- the run records its training distribution (``App.distribution_check``; chem:
  the ``ood.json`` envelope of its conformers) and the sample lies outside it.

Untrusted samples are never answered silently by the surrogate. With
``fallback="simulator"`` they are answered by ``App.simulate_inputs`` on exactly
the request's inputs (chem: DFT energy and forces at the run's level), run in a
thread pool off the event loop, within ``timeout_s`` (queueing included) for
the whole request; past it the request fails with HTTP 504
(:class:`FallbackTimeout`); a simulator error fails it with 502. Without a
fallback the request is refused with HTTP 422 naming each sample's reasons
(:class:`Untrusted`). Every answered request carries an extra output
``source`` (INT8, (B,)): 0 = surrogate, 1 = simulator. For simulator samples
the ``<name>_std`` outputs keep the ensemble's spread: why it fell back.

Fallback queue (``queue_dir``): each request with simulator samples adds one
file ``<unix ns>-<8 hex>.npz``, written to a temp file, verified and renamed
(:func:`~converge.data.atomic.atomic_write_bytes`), so a reader sees whole files
only and may ignore names starting with '.'. It holds, for the B' fallback
samples of that request, in request order:

- each served input under its own name, batch first, as received (chem:
  ``species`` (B', A) int64, ``coordinates`` (B', A, 3) float32 Å);
- each simulator output under its own name (chem: ``energy`` (B',) float64
  hartree, ``forces`` (B', A, 3) float64 hartree/Å): with the inputs, the
  names of the app's stored samples, so the file is training data;
- ``reasons``: (B',) unicode, why each sample fell back ('; '-joined);
- ``meta``: a 0-d unicode JSON string ``{"model", "app", "app_config", "time"}``.

No pickles (``np.load(path)`` with the default ``allow_pickle=False`` reads it).
A simulation that finishes after its request timed out is still queued.
"""
from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from ..contract import App, TensorSpec, load_app
from ..config import to_dict
from ..data.atomic import atomic_write_bytes
from .metrics import ServerMetrics
from .registry import OUTSIDE, ServedModel, std_name

SOURCE = TensorSpec("source", "INT8", (-1,))  # per sample: 0 surrogate, 1 simulator
FALLBACKS = ("simulator",)
OOD = "out of distribution"  # how an out-of-distribution reason starts


class TrustSetupError(ValueError):
    """Trust settings that cannot work for a served model (refused at startup)."""


class Untrusted(ValueError):
    """Samples the surrogate should not answer and no fallback is configured (HTTP 422)."""


class FallbackTimeout(TimeoutError):
    """The simulator did not answer an untrusted request within the timeout (HTTP 504)."""


class FallbackFailed(RuntimeError):
    """The simulator raised on an untrusted request (HTTP 502)."""


@dataclass(frozen=True)
class TrustConfig:
    max_uncertainty: float | None = None  # in the app's unit (App.uncertainty_label); None: no uncertainty gate
    fallback: str | None = None  # "simulator", or None: refuse untrusted samples
    timeout_s: float = 60.0  # per request, the simulator's queue and run together
    queue_dir: Path | None = None  # where fallback samples are kept as training data (module docstring)
    workers: int = 1  # simulator threads

    def __post_init__(self) -> None:
        if self.fallback is not None and self.fallback not in FALLBACKS:
            raise ValueError(f"fallback={self.fallback!r}: choose one of {', '.join(FALLBACKS)} (or none)")
        if self.max_uncertainty is not None and not self.max_uncertainty >= 0:
            raise ValueError(f"max_uncertainty={self.max_uncertainty}: must be >= 0 (0 sends every sample to the "
                             "fallback)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0 seconds")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: must be >= 1")
        if self.queue_dir is not None and self.fallback is None:
            raise ValueError("queue_dir keeps simulator answers: give it together with fallback='simulator'")


class Fallback(NamedTuple):
    """A request the simulator must finish: its inputs, the model's results, per sample the reasons not to
    trust them, and the indices of the samples with reasons."""

    inputs: Mapping[str, np.ndarray]
    results: dict[str, np.ndarray]
    reasons: list[list[str]]
    flagged: list[int]


def measured_outputs(model: ServedModel) -> list[str]:
    """The outputs of ``model`` that come with a spread ``<name>_std`` (none unless it is an ensemble)."""
    names = {s.name for s in model.outputs}
    return [s.name for s in model.outputs if std_name(s.name) in names]


def untrusted_reasons(scores: np.ndarray | None, limit: float | None, label: str,
                      outside: Sequence[list[str]] | None, n: int) -> list[list[str]]:
    """Per sample, why the surrogate should not answer it: the score above ``limit``, then ``outside``'s reasons."""
    reasons: list[list[str]] = [[] for _ in range(n)]
    if limit is not None and scores is not None:
        for i in np.flatnonzero(~(scores <= limit)):  # NaN counts as too uncertain
            reasons[i].append(f"{label} {scores[i]:.4g} exceeds the limit {limit:g}")
    for i, found in enumerate(() if outside is None else outside):
        reasons[i].extend(f"{OOD}: {r}" for r in found)
    return reasons


def describe(reasons: Sequence[list[str]], indices: Sequence[int]) -> str:
    return "; ".join(f"sample {i}: {', '.join(reasons[i])}" for i in indices)


def queue_bytes(inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], reasons: Sequence[str],
                meta: Mapping[str, Any]) -> bytes:
    """One fallback queue file (module docstring) as .npz bytes."""
    clash = set(inputs) & (set(outputs) | {"reasons", "meta"})
    if clash:
        raise ValueError(f"queue file: names {sorted(clash)} are both inputs and outputs")
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.asarray(v) for k, v in {**inputs, **outputs}.items()},
             reasons=np.array(list(reasons), dtype=str), meta=np.array(json.dumps(dict(meta))))
    return buffer.getvalue()


def write_queue_file(queue_dir: Path, data: bytes) -> Path:
    """``queue_dir/<ns>-<hex>.npz``, written atomically."""
    path = Path(queue_dir) / f"{time.time_ns()}-{uuid.uuid4().hex[:8]}.npz"
    atomic_write_bytes(path, data)
    return path


class TrustGate:
    """Reviews a model's answers per sample (module docstring); one per served model that needs it."""

    def __init__(self, model: ServedModel, app: App, config: TrustConfig,
                 outside: Callable[[Mapping[str, np.ndarray]], list[list[str]]] | None,
                 metrics: ServerMetrics | None = None) -> None:
        self.model, self.app, self.config, self.outside = model, app, config, outside
        self.measured = measured_outputs(model) or [s.name for s in model.outputs]  # outputs the simulator gives
        self.metrics = metrics or ServerMetrics()
        self.executor = (ThreadPoolExecutor(config.workers, thread_name_prefix=f"fallback-{model.name}")
                         if config.fallback else None)
        if config.queue_dir is not None:
            Path(config.queue_dir).mkdir(parents=True, exist_ok=True)

    @classmethod
    def build(cls, model: ServedModel, config: TrustConfig | None,
              metrics: ServerMetrics | None = None) -> "TrustGate | None":
        """The gate ``model`` needs under ``config``, None if none; a setting that cannot work is refused here."""
        config = config or TrustConfig()
        app = load_app(model.app) if model.app is not None else None
        outside = model.distribution_check or (app.distribution_check(model.app_config, model.run_dir)
                                               if app is not None and model.run_dir is not None else None)
        gating = config.max_uncertainty is not None or config.fallback is not None
        if not gating and outside is None:
            return None
        where = f"model {model.name!r}"
        if app is None:
            raise TrustSetupError(f"{where} was not loaded from a `converge train` run: it has no app to score "
                                  "uncertainty or run a simulator; serve it without --max-uncertainty/--fallback")
        if config.fallback == "simulator" and type(app).simulate_inputs is App.simulate_inputs:
            raise TrustSetupError(f"{where}: app {app.name!r} has no simulator for served inputs "
                                  "(App.simulate_inputs), so --fallback simulator could not answer its untrusted "
                                  "samples; serve it without --fallback (untrusted samples are then refused)")
        if config.max_uncertainty is not None:
            if not measured_outputs(model):
                raise TrustSetupError(f"{where} gives no spread: --max-uncertainty needs an ensemble run "
                                      "(`converge train --ensemble K`)")
            if type(app).uncertainty is App.uncertainty:
                raise TrustSetupError(f"{where}: app {app.name!r} defines no uncertainty score "
                                      "(App.uncertainty); serve it without --max-uncertainty")
        if config.fallback and config.max_uncertainty is None and outside is None:
            raise TrustSetupError(f"{where}: --fallback needs something to fall back on: give --max-uncertainty, "
                                  "or serve a run that records its training distribution (ood.json)")
        return cls(model, app, config, outside, metrics)

    def judge(self, inputs: Mapping[str, np.ndarray], results: Mapping[str, np.ndarray]) -> list[list[str]]:
        """Per sample, the reasons not to trust the surrogate ([] = trusted). The distribution check's reasons
        are read from ``results`` when the model ran it (``ServedModel.serve``'s :data:`OUTSIDE`)."""
        n = len(next(iter(inputs.values())))
        scores = None
        if self.config.max_uncertainty is not None:
            names = self.measured
            scores = np.asarray(self.app.uncertainty(self.model.app_config, inputs, {k: results[k] for k in names},
                                                     {k: results[std_name(k)] for k in names}), dtype=np.float64)
        outside = results.get(OUTSIDE)
        if outside is None and self.outside is not None:
            outside = self.outside(inputs)
        return untrusted_reasons(scores, self.config.max_uncertainty, self.app.uncertainty_label, outside, n)

    def review_now(self, inputs: Mapping[str, np.ndarray],
                   results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | Fallback:
        """At once, without waiting: ``results`` with ``source`` added when every sample is trusted, or the
        :class:`Fallback` the simulator must answer (:meth:`fall_back`); :class:`Untrusted` without a fallback."""
        outside = results.get(OUTSIDE)
        if self.config.max_uncertainty is None and outside is not None and not any(map(len, outside)):
            trusted = {k: v for k, v in results.items() if k != OUTSIDE}  # the common case, with no reasons to build
            trusted[SOURCE.name] = np.zeros(len(outside), dtype=np.int8)
            return trusted
        reasons = self.judge(inputs, results)
        results = {k: v for k, v in results.items() if k != OUTSIDE}
        flagged = [i for i, r in enumerate(reasons) if r]
        if not flagged:
            return {**results, SOURCE.name: np.zeros(len(reasons), dtype=np.int8)}
        name = self.model.name
        # a sample outside the training distribution counts as that, whatever its spread
        kinds = ["out_of_distribution" if any(r.startswith(OOD) for r in reasons[i]) else "uncertainty"
                 for i in flagged]
        if self.executor is None:
            for kind in set(kinds):
                self.metrics.untrusted_refused(name, kind, kinds.count(kind))
            raise Untrusted(f"the surrogate is not trusted on {len(flagged)} of {len(reasons)} samples and no "
                            f"fallback is configured (serve with --fallback simulator): {describe(reasons, flagged)}")
        for kind in set(kinds):
            self.metrics.fallback(name, kind, kinds.count(kind))
        return Fallback(inputs, results, reasons, flagged)

    async def review(self, inputs: Mapping[str, np.ndarray],
                     results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``results`` with ``source`` added and untrusted samples answered by the simulator (or refused)."""
        verdict = self.review_now(inputs, results)
        return await self.fall_back(verdict) if isinstance(verdict, Fallback) else verdict

    async def fall_back(self, pending: Fallback) -> dict[str, np.ndarray]:
        """The request's answer with its flagged samples simulated (:class:`FallbackTimeout`,
        :class:`FallbackFailed`)."""
        name, inputs, results, reasons, flagged = self.model.name, *pending
        subset = {k: np.array(v[flagged]) for k, v in inputs.items()}
        job = self.executor.submit(self.simulate_and_queue, subset, ["; ".join(reasons[i]) for i in flagged])
        try:
            simulated = await asyncio.wait_for(asyncio.wrap_future(job), self.config.timeout_s)
        except asyncio.TimeoutError:
            self.metrics.fallback_failed(name, "timeout")
            raise FallbackTimeout(f"the surrogate was too uncertain ({describe(reasons, flagged)}) and the simulator "
                                  f"did not answer within {self.config.timeout_s:g} s; retry later or raise "
                                  "--fallback-timeout") from None
        except Exception as err:  # noqa: BLE001 - any simulator failure fails this request, never the server
            self.metrics.fallback_failed(name, "simulator_error")
            raise FallbackFailed(f"the surrogate was too uncertain ({describe(reasons, flagged)}) and the simulator "
                                 f"failed: {type(err).__name__}: {err}") from None
        answer = {k: np.array(v) for k, v in results.items()}
        for key, value in simulated.items():
            if key in answer:
                answer[key][flagged] = value
        source = np.zeros(len(reasons), dtype=np.int8)
        source[flagged] = 1
        return {**answer, SOURCE.name: source}

    def simulate_and_queue(self, inputs: Mapping[str, np.ndarray], reasons: Sequence[str]) -> dict[str, np.ndarray]:
        """The simulator's outputs for ``inputs`` (runs in the pool), kept in the queue folder if there is one."""
        outputs = self.app.simulate_inputs(self.model.app_config, inputs)
        missing = [k for k in self.measured if k not in outputs]
        if missing:
            raise RuntimeError(f"App.simulate_inputs gave no {', '.join(missing)}")
        if self.config.queue_dir is not None:
            meta = {"model": self.model.name, "app": self.app.name, "time": time.time(),
                    "app_config": to_dict(self.model.app_config)}
            write_queue_file(self.config.queue_dir, queue_bytes(inputs, outputs, reasons, meta))
        return outputs

    def close(self) -> None:
        """Stop taking simulations; those running finish in their threads (and are still queued)."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
