"""Served models: a module, its signature and how to call it, loaded from a training run.

:class:`ServedModel` is what the server needs of a model, app-agnostic:
``predict`` takes numpy arrays by input name and returns numpy arrays by output
name, in the signature's datatypes. ``load_served_model`` builds one from a
``converge train`` run folder through the app's entry point; ``from_module``
wraps any ``nn.Module`` (used by tests and by users with their own modules).

An ensemble run (``ensemble.json`` and ``member-{i}/``, from ``converge train
--ensemble K``) is served as one model: each output is the members' mean under
its usual name, and its spread (std, ddof = 1) is an extra output ``<name>_std``
of the same datatype and shape.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..contract import App, TensorSpec, load_app
from ..train.checkpoint import load_checkpoint
from ..train.loop import PRECISIONS, autocast_context, load_model, resolve_device
from ..train.precision import run_precision
from ..validate.ensemble import ENSEMBLE_FILE, EnsembleError, load_ensemble
from .protocol import DATATYPES

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# serve_predict(model, inputs by name) -> outputs by name, as App.serve_predict
PredictFn = Callable[[nn.Module, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
# distribution_check(inputs by name) -> per sample, the reasons it lies outside the training data, as
# App.distribution_check gives
DistributionCheck = Callable[[Mapping[str, np.ndarray]], list[list[str]]]
# ServedModel.serve's extra output: (B,) object array, per sample the list of those reasons ([] = inside)
OUTSIDE = "__outside__"


class ModelLoadError(RuntimeError):
    """A run folder that cannot be served, with what to do about it."""


def check_model_name(name: str) -> str:
    if not NAME.match(name):
        raise ModelLoadError(f"model name {name!r}: use letters, digits, '_', '.' and '-' (a URL path segment)")
    return name


@dataclass
class ServedModel:
    name: str
    module: nn.Module
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    predict_fn: PredictFn
    version: str = "1"
    precision: str = "fp32"  # autocast for bf16/fp16 runs
    platform: str = "pytorch"
    app: str | None = None  # the converge app, when loaded from a run
    # builds this model again in another process (picklable, e.g. a partial of load_served_model); None: cannot
    loader: Callable[[], "ServedModel"] | None = field(default=None, repr=False, compare=False)
    app_config: Any = field(default=None, repr=False, compare=False)  # the app's config, when loaded from a run
    run_dir: Path | None = None  # the run it was loaded from
    # outputs the server adds after the model (the trust gate's "source" flag): listed and requested like outputs
    server_outputs: tuple[TensorSpec, ...] = ()
    # the run's check of inputs against its training data (App.distribution_check), run by :meth:`serve`
    distribution_check: DistributionCheck | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_model_name(self.name)
        check_model_name(self.version)
        if self.precision not in PRECISIONS:
            raise ModelLoadError(f"precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        for spec in [*self.inputs, *self.all_outputs]:
            if spec.datatype not in DATATYPES:
                raise ModelLoadError(f"tensor {spec.name!r}: datatype {spec.datatype!r} cannot be served; "
                                     f"use one of {', '.join(DATATYPES)}")
            if not spec.shape or spec.shape[0] != -1:
                raise ModelLoadError(f"tensor {spec.name!r}: shape {spec.shape} must start with the batch axis -1")

    @property
    def all_outputs(self) -> list[TensorSpec]:
        """What a request may ask for: the model's outputs, then the server's."""
        return [*self.outputs, *self.server_outputs]

    @property
    def device(self) -> torch.device:
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @classmethod
    def from_module(cls, name: str, module: nn.Module, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                    **kw) -> "ServedModel":
        """Serve ``module(*inputs in signature order)``, returning a tensor or a tuple in output order."""
        in_names, out_names = [s.name for s in inputs], [s.name for s in outputs]

        def predict(model: nn.Module, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = model(*(x[k] for k in in_names))
            out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            return dict(zip(out_names, out))

        return cls(name, module.eval(), list(inputs), list(outputs), predict, **kw)

    def predict(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for a batch of validated inputs, cast to the signature's datatypes."""
        device = self.device
        # binary inputs are read-only views of the request body; torch wants writable memory
        x = {k: torch.from_numpy(np.array(v) if not v.flags.writeable else np.ascontiguousarray(v)).to(device)
             for k, v in inputs.items()}
        with torch.inference_mode(), autocast_context(device, self.precision):
            out = self.predict_fn(self.module, x)
        result = {}
        for spec in self.outputs:
            if spec.name not in out:
                raise RuntimeError(f"the model gave no output {spec.name!r} (it gave {', '.join(out)})")
            t = out[spec.name].detach().cpu()
            t = t.float() if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
            arr = t.numpy().astype(DATATYPES[spec.datatype], copy=False)
            ok = arr.ndim == len(spec.shape) and all(w in (-1, d) for w, d in zip(spec.shape, arr.shape))
            if not ok:
                raise RuntimeError(f"output {spec.name!r} has shape {list(arr.shape)}, signature says "
                                   f"{list(spec.shape)}")
            result[spec.name] = arr
        return result

    def serve(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What the server's batchers run on a batch: :meth:`predict`, and with a distribution check its
        reasons per sample under :data:`OUTSIDE`.

        The check runs beside the model (in the model's process) on the whole batch, once, rather than on the
        event loop once per request: the chem envelope test took 110 us for one structure and 680 us for 64.
        """
        outputs = self.predict(inputs)
        if self.distribution_check is not None:
            found = self.distribution_check(inputs)
            outputs[OUTSIDE] = reasons = np.empty(len(found), dtype=object)
            reasons[:] = [list(r) for r in found]  # element by element: equal-length lists would make a 2-D array
        return outputs

    def metadata(self) -> dict:
        """KServe v2 model metadata."""
        def tensors(specs: Sequence[TensorSpec]) -> list[dict]:
            return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]

        return {"name": self.name, "versions": [self.version], "platform": self.platform,
                "inputs": tensors(self.inputs), "outputs": tensors(self.all_outputs)}


def run_config(run_dir: Path, which: str = "best") -> dict:
    """The config a run was trained with (config.json, else the checkpoint's copy)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ModelLoadError(f"{run_dir}: no such run folder (the --out of `converge train`)")
    if (run_dir / "config.json").is_file():
        return json.loads((run_dir / "config.json").read_text())
    if not (run_dir / f"{which}.pt").is_file():
        raise ModelLoadError(f"{run_dir} holds neither config.json nor {which}.pt: is it a `converge train` run?")
    return load_checkpoint(run_dir / f"{which}.pt")["config"]


def served_app(run_dir: Path, config: Mapping[str, Any]) -> tuple[App, Any, list[TensorSpec], list[TensorSpec]]:
    """The app a run's ``config`` (``app``, ``app_config``) names, its config and its serving signature."""
    from ..config import from_dict

    try:
        app = load_app(config["app"])
    except KeyError as err:
        raise ModelLoadError(f"{run_dir}: {err.args[0]}") from None
    app_cfg = from_dict(app.config_cls, config["app_config"], "app")
    try:
        inputs, outputs = app.serving_signature(app_cfg)
    except NotImplementedError as err:
        raise ModelLoadError(f"{run_dir}: {err}") from None
    return app, app_cfg, list(inputs), list(outputs)


def served_precision(app: App, config: Mapping[str, Any], device: torch.device) -> str:
    """The precision a run trained in, which it is served in; fp32 for bf16 where ``device`` only emulates bf16."""
    return run_precision(config, app.default_precision, device)


def load_served_model(run_dir: Path | str, name: str | None = None, version: str = "1", which: str = "best",
                      device: str = "cpu") -> ServedModel:
    """The trained model of ``run_dir`` ready to serve; its name defaults to the folder's name."""
    run_dir = Path(run_dir)
    if (run_dir / ENSEMBLE_FILE).is_file():
        return load_served_ensemble(run_dir, name, version, which, device)
    config = run_config(run_dir, which)
    if "app" not in config or "app_config" not in config:
        raise ModelLoadError(f"{run_dir}: config has no 'app'/'app_config'; is it a `converge train` run?")
    app, app_cfg, inputs, outputs = served_app(run_dir, config)
    if not (run_dir / f"{which}.pt").is_file():
        raise ModelLoadError(f"{run_dir}: no {which}.pt checkpoint; has training finished an epoch?")
    model, config = load_model(app, run_dir, which, str(resolve_device(device)))
    model = app.inference_model(model)
    precision = served_precision(app, config, resolve_device(device))
    return ServedModel(check_model_name(name or run_dir.resolve().name), model, list(inputs), list(outputs),
                       app.serve_predict, version=version, precision=precision, platform=f"converge-{app.name}",
                       app=app.name, loader=partial(load_served_model, str(run_dir), name, version, which, device),
                       app_config=app_cfg, run_dir=run_dir,
                       distribution_check=app.distribution_check(app_cfg, run_dir))


def std_name(output: str) -> str:
    """The name of an ensemble output's spread."""
    return f"{output}_std"


def predict_ensemble(app: App, ensemble: nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each served output's mean over the members under its name, and its std as ``<name>_std``."""
    prediction = ensemble.reduce(inputs)  # in the server's grad mode: chem's forces need autograd
    return {**prediction.mean, **{std_name(k): v for k, v in prediction.std.items()}}


def load_served_ensemble(run_dir: Path, name: str | None = None, version: str = "1", which: str = "best",
                         device: str = "cpu") -> ServedModel:
    """An ensemble run (``ensemble.json``) served as one model: outputs' means plus ``<name>_std`` spreads."""
    record = json.loads((run_dir / ENSEMBLE_FILE).read_text())
    app, app_cfg, inputs, outputs = served_app(run_dir, record)
    try:
        ensemble = load_ensemble(app, run_dir, which, str(resolve_device(device)))
    except (EnsembleError, FileNotFoundError) as err:
        raise ModelLoadError(f"{run_dir}: {err}") from None
    for k, member in enumerate(ensemble.members):
        ensemble.members[k] = app.inference_model(member)
    spreads = [TensorSpec(std_name(s.name), s.datatype, s.shape) for s in outputs]
    precision = served_precision(app, record, resolve_device(device))
    return ServedModel(check_model_name(name or run_dir.resolve().name), ensemble, list(inputs), [*outputs, *spreads],
                       partial(predict_ensemble, app), version=version, precision=precision,
                       platform=f"converge-{app.name}-ensemble", app=app.name,
                       loader=partial(load_served_model, str(run_dir), name, version, which, device),
                       app_config=app_cfg, run_dir=run_dir,
                       distribution_check=app.distribution_check(app_cfg, run_dir))
