"""A model run in its own process, so its forward passes do not share the GIL with the event loop.

:class:`ModelProcess` is a ``predict`` for :class:`~converge.serve.batcher.Batcher`:
the batcher thread still forms the batches; each batch's concatenated numpy
inputs go over a pipe to a child process (multiprocessing ``spawn``) that holds
the model (built there by ``loader``, e.g. a ``functools.partial`` of
:func:`~converge.serve.registry.load_served_model`) and the outputs come back.

A child that dies fails the batch it was running with :class:`ModelProcessDied`
(the batcher turns it into ``BatchFailed``, HTTP 500) and is started again on
the next batch; :meth:`ModelProcess.close` stops it.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import traceback
from typing import Callable, Mapping

import numpy as np

READY_TIMEOUT_S = 300.0


class ModelProcessDied(RuntimeError):
    """The model's worker process exited while running a batch."""


class ModelProcessError(RuntimeError):
    """The model's worker process could not load the model."""


def _child(conn, loader: Callable, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        model = loader()
    except BaseException as err:  # noqa: BLE001 - report, then exit
        conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server went away
            return
        if msg is None:
            return
        try:
            out = model.predict(msg)
        except Exception as err:  # noqa: BLE001 - a bad batch fails its requests, never the worker
            conn.send(("error", f"{type(err).__name__}: {err}"))
        else:
            conn.send(("ok", out))


class ModelProcess:
    """``predict(inputs) -> outputs`` run by a child process; one batch at a time (the batcher's thread)."""

    def __init__(self, loader: Callable, name: str = "model", threads: int = 1,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.loader, self.name, self.threads, self.ready_timeout_s = loader, name, threads, ready_timeout_s
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self._lock = threading.Lock()
        self.restarts = 0
        self._dead = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> None:
        """Start the child and wait until it has loaded the model (no-op when it runs already)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self.alive:
            return
        self._reap()
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_child, args=(child, self.loader, self.threads),
                                 name=f"converge-model-{self.name}", daemon=True)
        proc.start()
        child.close()  # so that recv sees EOF when the child dies
        self._proc, self._conn = proc, parent
        if not parent.poll(self.ready_timeout_s):
            self._reap()
            raise ModelProcessError(f"model {self.name!r}: worker process not ready after {self.ready_timeout_s:g} s")
        try:
            kind, detail = parent.recv()
        except (EOFError, OSError):
            code = self._reap()
            raise ModelProcessError(f"model {self.name!r}: worker process exited (code {code}) while loading "
                                    "the model") from None
        if kind != "ready":
            self._reap()
            raise ModelProcessError(f"model {self.name!r}: worker process could not load the model: {detail}")

    def _reap(self) -> int | None:
        """Forget the child (killing it if still alive); its exit code."""
        code = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            code = self._proc.exitcode
            if code is not None:
                self._proc.close()
            self._proc = None
        return code

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.predict(inputs)

    def predict(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            if not self.alive:
                if self._dead or self._proc is not None:  # died in a batch, or between batches
                    self.restarts += 1
                self._dead = False
                self._start()
            try:
                self._conn.send(dict(inputs))
                kind, payload = self._conn.recv()
            except (EOFError, OSError) as err:
                code = self._reap()
                self._dead = True
                raise ModelProcessDied(f"model {self.name!r}: its worker process died (exit code {code}) while "
                                       f"running this batch ({type(err).__name__}); it is restarted for the "
                                       "next batch") from None
        if kind != "ok":
            raise RuntimeError(payload)
        return payload

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child: ask it to exit, kill it if it does not within ``timeout``."""
        with self._lock:
            if self._proc is None:
                return
            try:
                if self._proc.is_alive():
                    self._conn.send(None)
                    self._proc.join(timeout)
            except (OSError, ValueError):
                pass
            self._reap()

    def __enter__(self) -> "ModelProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
