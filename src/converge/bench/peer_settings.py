"""The peers' settings: the grid each peer is swept over, and the configuration files each reads.

Every peer is measured at each point of its grid (the product of its axes) and reported at its best
(:func:`.peers.best_over_settings`). One :class:`PeerSettings` covers all three, and names each setting
in the peer's own terms (:func:`native_settings`):

- ``max_batch_size``: ``max_batch_size`` of all three;
- ``delay_ms``: Triton's ``dynamic_batching.max_queue_delay_microseconds``, MLServer's ``max_batch_time``,
  LitServe's ``batch_timeout``;
- ``workers``: Triton's ``instance_group [{count, kind: KIND_CPU}]``, MLServer's ``parallel_workers``,
  LitServe's ``workers_per_device``.

The default grids (:func:`default_grid`) span the knobs each documents for throughput: Triton's batch
size, queue delay and instance count; MLServer's adaptive-batching window and parallel workers; LitServe's
batch timeout and workers. ``converge serve`` itself runs one model process, ``max_batch_size`` 64 and no
queue delay.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping, Sequence

from .peer_envs import check_peer

RUNTIMES = "converge.bench.peer_runtimes"  # the module the peers run (TritonPythonModel, MLServerRuntime, ...)
AXES = ("max_batch_size", "delay_ms", "workers")


@dataclass(frozen=True)
class PeerSettings:
    """One set-up of a peer: batches of up to ``max_batch_size`` requests, waiting up to ``delay_ms`` for
    more, with ``workers`` model workers (each its own process, one torch thread, as our model process)."""

    max_batch_size: int = 64
    delay_ms: float = 0.0
    workers: int = 1

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.delay_ms < 0 or self.workers < 1:
            raise ValueError(f"{self}: need max_batch_size >= 1, delay_ms >= 0 and workers >= 1")

    @property
    def label(self) -> str:
        """``b64-d0.5ms-w2``: short, for log names and plot legends."""
        return f"b{self.max_batch_size}-d{self.delay_ms:g}ms-w{self.workers}"


def check_settings(peer: str, settings: PeerSettings) -> PeerSettings:
    """``settings`` if ``peer`` can run them; a ValueError that says what to change otherwise."""
    if check_peer(peer) == "mlserver" and not settings.delay_ms > 0:
        raise ValueError(f"mlserver {settings}: MLServer's adaptive batching wants a positive max_batch_time; "
                         "give delay_ms > 0")
    return settings


def native_settings(peer: str, s: PeerSettings) -> dict:
    """``s`` under the names the peer's own configuration gives them."""
    if check_peer(peer) == "triton":
        return {"max_batch_size": s.max_batch_size,
                "dynamic_batching.max_queue_delay_microseconds": round(1000 * s.delay_ms),
                "instance_group": [{"count": s.workers, "kind": "KIND_CPU"}]}
    if peer == "mlserver":
        return {"max_batch_size": s.max_batch_size, "max_batch_time": s.delay_ms / 1000,
                "parallel_workers": s.workers}
    return {"max_batch_size": s.max_batch_size, "batch_timeout": s.delay_ms / 1000, "workers_per_device": s.workers,
            "fast_queue": True}


def grid(axes: Mapping[str, Sequence[float]]) -> tuple[PeerSettings, ...]:
    """Every combination of the values of ``axes`` (names from :data:`AXES`), in order."""
    names = list(axes)
    return tuple(PeerSettings(**dict(zip(names, values))) for values in itertools.product(*axes.values()))


def default_axes(peer: str, max_batch_size: int = 64) -> dict[str, tuple]:
    """The axes swept when none are given. A LitServe ``batch_timeout`` of 0 spins its worker on
    ``get_nowait`` (a core lost on a small machine), so its shortest is 1 ms."""
    if check_peer(peer) == "triton":
        return {"max_batch_size": (max_batch_size, 2 * max_batch_size), "delay_ms": (0.0, 1.0), "workers": (1, 2)}
    if peer == "mlserver":
        return {"max_batch_size": (max_batch_size,), "delay_ms": (2.0, 10.0), "workers": (1, 2)}
    return {"max_batch_size": (max_batch_size,), "delay_ms": (1.0, 5.0), "workers": (1, 2)}


def default_grid(peer: str, max_batch_size: int = 64) -> tuple[PeerSettings, ...]:
    return grid(default_axes(peer, max_batch_size))


def parse_peer_grid(text: str, peers: Sequence[str], max_batch_size: int = 64) -> dict[str, tuple[PeerSettings, ...]]:
    """Each of ``peers``' grid: its default axes, with those named in ``text`` replaced.

    ``text`` holds ``PEER.AXIS=V1,V2`` items, separated by spaces or ``;``:
    ``"triton.delay_ms=0,0.5,2 triton.workers=1 mlserver.workers=1,2"``.
    """
    axes = {peer: default_axes(peer, max_batch_size) for peer in peers}
    example = "e.g. triton.delay_ms=0,0.5 mlserver.workers=1,2"
    for item in text.replace(";", " ").split():
        key, sep, values = item.partition("=")
        peer, dot, axis = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"peer grid {item!r}: give PEER.AXIS=V1,V2 ({example})")
        if peer not in axes:
            raise ValueError(f"peer grid {item!r}: {peer!r} is not among the peers {', '.join(peers) or '(none)'}")
        if axis not in AXES:
            raise ValueError(f"peer grid {item!r}: axis {axis!r}: choose from {', '.join(AXES)}")
        kind = float if axis == "delay_ms" else int
        try:
            axes[peer][axis] = tuple(kind(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"peer grid {item!r}: {axis} takes {kind.__name__} values ({example})") from None
        if not axes[peer][axis]:
            raise ValueError(f"peer grid {item!r}: give at least one value")
    return {peer: tuple(check_settings(peer, s) for s in grid(a)) for peer, a in axes.items()}


def settings_dict(s: PeerSettings) -> dict:
    return {f.name: getattr(s, f.name) for f in fields(s)}


# -- what each peer reads --------------------------------------------------------------------------------------------
def mlserver_settings(http_port: int, grpc_port: int, parallel_workers: int) -> dict:
    """settings.json: ``parallel_workers`` inference processes, no metrics server."""
    return {"host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port,
            "parallel_workers": parallel_workers, "metrics_endpoint": None, "load_models_at_startup": True}


def mlserver_model_settings(name: str, run_dir: str | Path, settings: PeerSettings, threads: int) -> dict:
    """model-settings.json: :class:`MLServerRuntime` on ``run_dir`` with adaptive batching."""
    check_settings("mlserver", settings)
    return {"name": name, "implementation": f"{RUNTIMES}.MLServerRuntime",
            "max_batch_size": settings.max_batch_size, "max_batch_time": settings.delay_ms / 1000,
            "parameters": {"extra": {"run": str(Path(run_dir).resolve()), "threads": threads}}}


TRITON_DATATYPES = {"BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "INT8": "TYPE_INT8", "INT16": "TYPE_INT16",
                    "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "FP16": "TYPE_FP16", "FP32": "TYPE_FP32",
                    "FP64": "TYPE_FP64"}


def triton_tensor(name: str, datatype: str, shape: Sequence[int]) -> str:
    """One config.pbtxt tensor of a batched model: ``shape`` is ours, batch first (-1).

    Triton cannot batch a scalar per sample (``dims: []`` is refused), so a ``(-1,)`` tensor is declared
    ``dims: [1]`` with the model's own shape ``reshape: []``: clients get it as ``(n, 1)``. A variable axis
    past the batch (chem's atoms) is ``-1`` there too: Triton's dynamic batcher then batches only requests
    of one shape (without ragged batching), as our batcher batches molecules of one atom count together."""
    if datatype not in TRITON_DATATYPES:
        raise ValueError(f"tensor {name!r}: datatype {datatype!r} has no Triton type here")
    dims = list(shape[1:])
    if any(d < 1 and d != -1 for d in dims):
        raise ValueError(f"tensor {name!r}: shape {list(shape)}: Triton takes sizes >= 1 or -1 (variable) "
                         "past the batch axis")
    body = f"name: {json.dumps(name)} data_type: {TRITON_DATATYPES[datatype]} dims: {dims or [1]}"
    return "{ " + body + (" reshape: { shape: [] }" if not dims else "") + " }"


def triton_model_config(name: str, inputs: Sequence, outputs: Sequence, settings: PeerSettings, run_dir: str | Path,
                        threads: int) -> str:
    """config.pbtxt of our model (tensors with ``name``, ``datatype``, ``shape``) on Triton's Python backend
    with dynamic batching, ``settings.workers`` CPU instances (each a process), on ``run_dir``."""
    s = native_settings("triton", settings)
    tensors = lambda specs: ",\n  ".join(triton_tensor(t.name, t.datatype, t.shape) for t in specs)  # noqa: E731
    params = {"run": str(Path(run_dir).resolve()), "threads": str(threads)}
    return "\n".join([
        f"name: {json.dumps(name)}", 'backend: "python"', f"max_batch_size: {settings.max_batch_size}",
        f"input [\n  {tensors(inputs)}\n]", f"output [\n  {tensors(outputs)}\n]",
        f"dynamic_batching {{ max_queue_delay_microseconds: {s['dynamic_batching.max_queue_delay_microseconds']} }}",
        f"instance_group [ {{ count: {settings.workers} kind: KIND_CPU }} ]",
        *(f"parameters: {{ key: {json.dumps(k)} value: {{ string_value: {json.dumps(v)} }} }}"
          for k, v in params.items()), ""])
