"""The dynamic batcher: requests queue up, one worker per model runs them in batches.

The decision is one plain function, :func:`collect_batch`: given the queue and
the time, either take a batch now or say how long to wait. Like Triton:

- ``max_queue_delay_us == 0`` (the default): take whatever is queued the moment
  the model is free, up to ``max_batch_size`` samples;
- otherwise wait until ``max_batch_size`` samples are queued (or the next
  request would not fit) or ``max_queue_delay_us`` has passed since the oldest
  request arrived, whichever comes first.

A request of n samples is never split. :class:`Batcher` holds the queue and the
worker thread; its ``clock`` is injected so the deadline logic is tested without
sleeping, and ``start=False`` with :meth:`Batcher.step` drives it by hand.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

Predict = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


class QueueFull(RuntimeError):
    """The queue holds ``max_queue_size`` samples already (HTTP 503, retry later)."""

    retry_after_s = 1


class RequestTimeout(TimeoutError):
    """A request waited longer than its timeout (HTTP 504)."""


class BatchFailed(RuntimeError):
    """The model raised on the batch holding this request (HTTP 500)."""


class ShuttingDown(RuntimeError):
    """The batcher is closed and takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class BatchConfig:
    max_batch_size: int = 64  # samples per model call
    max_queue_delay_us: int = 0  # 0: run whatever is queued as soon as the model is free
    max_queue_size: int = 1024  # samples waiting; more -> QueueFull
    timeout_s: float = 30.0  # per request, queue plus compute
    # queue, batch and run each model in a process of its own (converge.serve.worker), clear of the event loop's GIL
    model_process: bool = False
    # model processes per model (Triton's instance_group count); each request goes to the least busy one
    instances: int = 1

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size}: must be >= 1")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us={self.max_queue_delay_us}: must be >= 0 (0 = no waiting)")
        if self.max_queue_size < self.max_batch_size:
            raise ValueError(f"max_queue_size={self.max_queue_size}: must be >= max_batch_size={self.max_batch_size}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0 seconds")
        if self.instances < 1:
            raise ValueError(f"instances={self.instances}: must be >= 1")
        if self.instances > 1 and not self.model_process:
            raise ValueError(f"instances={self.instances}: several instances run in processes of their own; "
                             "drop --no-model-process")


class LoopFuture:
    """A request's outcome where every step of it happens on one event loop's thread: what the batchers use of
    a ``concurrent.futures.Future``, without its lock and condition (their six acquisitions per request took
    12 us on this 2-core machine, under load).

    For a request submitted on an event loop to a batcher that reads its model's answers on that same loop
    (:class:`~converge.serve.worker.ProcessBatcher` in the server): the request is queued, settled and handed
    to its waiter there. A child's death is settled from a thread (its replacement loads there), and its
    waiters are then woken through the loop (:func:`hand_over`), which reads the outcome only after it is set.
    Nothing waits on it: ``result`` and ``exception`` are read once it is done.
    """

    __slots__ = ("_state", "_result", "_exception")
    PENDING, RUNNING, CANCELLED, FINISHED = range(4)

    def __init__(self) -> None:
        self._state, self._result, self._exception = self.PENDING, None, None

    def cancel(self) -> bool:
        if self._state in (self.RUNNING, self.FINISHED):
            return False
        self._state = self.CANCELLED
        return True

    def cancelled(self) -> bool:
        return self._state == self.CANCELLED

    def done(self) -> bool:
        return self._state in (self.CANCELLED, self.FINISHED)

    def set_running_or_notify_cancel(self) -> bool:
        """As ``Future``'s: False if cancelled (its caller gave up), else it is running."""
        if self._state == self.CANCELLED:
            return False
        self._state = self.RUNNING
        return True

    def set_result(self, result) -> None:
        self._result, self._state = result, self.FINISHED

    def set_exception(self, exception: BaseException) -> None:
        self._exception, self._state = exception, self.FINISHED

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._check_done()
        return self._exception

    def result(self, timeout: float | None = None):
        self._check_done()
        if self._exception is not None:
            raise self._exception
        return self._result

    def _check_done(self) -> None:
        if self._state == self.CANCELLED:
            raise CancelledError()
        if self._state != self.FINISHED:
            raise InvalidStateError("a LoopFuture is read once it is done: nothing waits on it")


@dataclass
class Pending:
    """One queued request."""

    inputs: Mapping[str, np.ndarray]
    n: int  # samples
    arrived: float  # clock() at submission
    future: Future | LoopFuture = field(default_factory=Future)
    waiter: asyncio.Future | None = None  # of infer_async: given the outcome on its own event loop

    @cached_property
    def shape_key(self) -> Hashable:
        return shape_key(self.inputs)


def shape_key(inputs: Mapping[str, np.ndarray]) -> Hashable:
    """Requests batch together only when their inputs' non-batch shapes agree."""
    return tuple((k, v.shape[1:]) for k, v in inputs.items())


@dataclass(frozen=True)
class BatchRecord:
    """What one model call did, for metrics."""

    samples: int
    requests: int
    queue_s: tuple[float, ...]  # per request: arrival -> start of compute
    compute_s: float
    error: str | None = None


def collect_batch(queue: Sequence[Pending], now: float, max_batch_size: int, max_delay_s: float) -> tuple[int, float]:
    """(requests to take now, seconds to wait): exactly one of the two is non-zero unless the queue is empty.

    The batch is the longest prefix of the queue that fits in ``max_batch_size``
    samples and shares one shape; it is taken when it is full (or the next
    request would not fit), or when the oldest request has waited ``max_delay_s``.
    """
    if not queue:
        return 0, math.inf
    take, samples, shape = 0, 0, queue[0].shape_key
    for p in queue:
        if (take and samples + p.n > max_batch_size) or p.shape_key != shape:
            break
        take, samples = take + 1, samples + p.n
    full = samples >= max_batch_size or take < len(queue)
    wait = queue[0].arrived + max_delay_s - now
    if full or wait <= 0:
        return take, 0.0
    return 0, wait


def predict_batch(predict: Predict, batch: Sequence[Pending]) -> dict[str, np.ndarray]:
    """Concatenate the requests' inputs and call ``predict`` once; every output must have a row per sample."""
    names = batch[0].inputs.keys()
    inputs = {k: np.concatenate([p.inputs[k] for p in batch]) if len(batch) > 1 else batch[0].inputs[k]
              for k in names}
    outputs = predict(inputs)
    total = sum(p.n for p in batch)
    for name, out in outputs.items():
        if len(out) != total:
            raise BatchFailed(f"model output {name!r} has {len(out)} rows for a batch of {total} samples")
    return outputs


def split_outputs(outputs: Mapping[str, np.ndarray], counts: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """The batch's outputs cut back into one dict per request of ``counts[i]`` samples, in order."""
    bounds = np.cumsum([0, *counts])
    return [{k: v[a:b] for k, v in outputs.items()} for a, b in zip(bounds[:-1], bounds[1:])]


def run_batch(predict: Predict, batch: Sequence[Pending]) -> list[dict[str, np.ndarray]]:
    """Concatenate the requests' inputs, call ``predict`` once, split the outputs back in order."""
    return split_outputs(predict_batch(predict, batch), [p.n for p in batch])


def settle_waiters(batch: Sequence[Pending]) -> None:
    """On an event loop: give each request's waiter the outcome of its (finished) future."""
    for p in batch:
        if p.waiter is None or p.waiter.done():  # done: timed out or cancelled on the loop already
            continue
        if p.future.cancelled():
            p.waiter.cancel()
        elif (err := p.future.exception(0)) is not None:
            p.waiter.set_exception(err)
        else:
            p.waiter.set_result(p.future.result(0))


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def hand_over(batch: Sequence[Pending]) -> None:
    """From the worker: wake each event loop awaiting part of ``batch`` once, with all of its requests (the loop
    this runs on, if any, settles its own at once)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Pending]] = {}
    for p in batch:
        if p.waiter is not None:
            by_loop.setdefault(p.waiter.get_loop(), []).append(p)
    here = running_loop()
    for loop, mine in by_loop.items():
        if loop is here:
            settle_waiters(mine)
            continue
        try:
            loop.call_soon_threadsafe(settle_waiters, mine)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting
            pass


class RequestQueue:
    """What a server sees of a batcher: ``submit``, ``infer``, ``infer_async``; subclasses queue and run.

    ``submit`` returns a ``concurrent.futures.Future`` of the request's outputs;
    ``infer`` waits for it and ``infer_async`` awaits it on an event loop.
    A subclass implements ``_enqueue`` (queue a :class:`Pending` or raise
    :class:`QueueFull` / :class:`ShuttingDown`), ``start``, ``close``,
    ``running`` and keep ``_queued_samples``.
    """

    config: BatchConfig
    name: str
    clock: Callable[[], float]
    _queued_samples: int

    @property
    def queued_samples(self) -> int:
        """Samples taken and not yet answered (what ``max_queue_size`` bounds)."""
        return self._queued_samples

    def _pending(self, inputs: Mapping[str, np.ndarray], waiter: asyncio.Future | None) -> Pending:
        n = len(next(iter(inputs.values())))
        if n > self.config.max_batch_size:
            raise ValueError(f"a request of {n} samples exceeds max_batch_size={self.config.max_batch_size}; "
                             "split it")
        future = LoopFuture() if waiter is not None and self._settles_on(waiter.get_loop()) else Future()
        return Pending(inputs, n, self.clock(), future, waiter)

    def _settles_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether every request submitted on ``loop`` is queued, settled and handed over on that loop's thread
        (then its outcome is a :class:`LoopFuture`)."""
        return False

    def _queue_full(self, queued: int) -> QueueFull:
        return QueueFull(f"model {self.name!r}: queue full ({queued} of {self.config.max_queue_size} samples "
                         "waiting); retry later")

    def _enqueue(self, inputs: Mapping[str, np.ndarray], waiter: asyncio.Future | None = None) -> Pending:
        raise NotImplementedError

    def submit(self, inputs: Mapping[str, np.ndarray]) -> Future:
        """Queue one request (every input has the same first axis, n >= 1 samples)."""
        return self._enqueue(inputs).future

    def infer(self, inputs: Mapping[str, np.ndarray], timeout: float | None = None) -> dict[str, np.ndarray]:
        """Submit and wait (at most ``timeout``, default the config's) for the outputs."""
        future = self.submit(inputs)
        timeout = self.config.timeout_s if timeout is None else timeout
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise RequestTimeout(f"model {self.name!r}: no result within {timeout:g} s") from None

    def submit_waiter(self, inputs: Mapping[str, np.ndarray], timeout: float | None = None) -> Awaited:
        """Submit on the running event loop: the :class:`Awaited` request, whose ``waiter`` (a future of that
        loop) gets the outputs, or :class:`RequestTimeout` after ``timeout`` (default the config's) with the
        request cancelled if still queued, as :meth:`infer` does.

        The worker wakes the loop once per batch, not once per request (see :func:`hand_over`), and one timer
        per loop keeps every request's time limit (:class:`Deadlines`), not one timer each.
        """
        timeout = self.config.timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        future = self._enqueue(inputs, waiter).future

        def expire() -> None:
            future.cancel()  # dropped by the worker if still queued
            waiter.set_exception(RequestTimeout(f"model {self.name!r}: no result within {timeout:g} s"))

        deadlines = self._deadlines.get(loop)
        if deadlines is None:
            deadlines = self._deadlines[loop] = Deadlines(loop)
        deadlines.add(loop.time() + timeout, waiter, expire)
        return Awaited(waiter, future)

    async def infer_async(self, inputs: Mapping[str, np.ndarray], timeout: float | None = None
                          ) -> dict[str, np.ndarray]:
        """Submit and await the outputs on the running event loop, which is never blocked (:meth:`submit_waiter`)."""
        awaited = self.submit_waiter(inputs, timeout)
        try:
            return await awaited.waiter
        except asyncio.CancelledError:  # the caller went away (client disconnect)
            awaited.future.cancel()
            raise

    @cached_property
    def _deadlines(self) -> dict[asyncio.AbstractEventLoop, Deadlines]:
        """The time limits of the requests awaited on each event loop."""
        return {}


@dataclass(frozen=True)
class Awaited:
    """A request submitted on an event loop: ``waiter`` (that loop's future of its outputs) and ``future`` (the
    batcher's, which :meth:`cancel` cancels too, so a request nobody awaits leaves the queue)."""

    waiter: asyncio.Future
    future: Future

    def cancel(self) -> None:
        self.future.cancel()
        self.waiter.cancel()


class Deadlines:
    """The time limits of the requests awaited on one event loop, kept by one timer rather than one per request.

    Requests of one batcher share its timeout, so they come in order of their deadlines: the timer waits for the
    oldest, expires every request past its deadline from the front, and waits for the next; answered requests
    are dropped from the front as new ones come. A deadline earlier than the last one (a shorter timeout)
    gets a timer of its own.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.entries: deque[tuple[float, asyncio.Future, Callable[[], None]]] = deque()
        self.timer: asyncio.TimerHandle | None = None

    def add(self, deadline: float, waiter: asyncio.Future, expire: Callable[[], None]) -> None:
        """Call ``expire()`` at ``deadline`` (the loop's clock) unless ``waiter`` is done by then."""
        entries = self.entries
        while entries and entries[0][1].done():
            entries.popleft()
        if entries and deadline < entries[-1][0]:
            own = self.loop.call_at(deadline, lambda: None if waiter.done() else expire())
            waiter.add_done_callback(lambda _: own.cancel())
            return
        entries.append((deadline, waiter, expire))
        if self.timer is None:
            self.timer = self.loop.call_at(deadline, self._expire_due)

    def _expire_due(self) -> None:
        self.timer, now, entries = None, self.loop.time(), self.entries
        while entries and (entries[0][1].done() or entries[0][0] <= now):
            _, waiter, expire = entries.popleft()
            if not waiter.done():
                expire()
        if entries:
            self.timer = self.loop.call_at(entries[0][0], self._expire_due)


class Batcher(RequestQueue):
    """A queue of requests and one worker thread that runs them through ``predict`` in batches.

    ``close`` stops taking requests, finishes the queued ones and joins the worker.
    """

    def __init__(self, predict: Predict, config: BatchConfig = BatchConfig(), name: str = "model",
                 clock: Callable[[], float] = time.monotonic, on_batch: Callable[[BatchRecord], None] | None = None,
                 start: bool = True) -> None:
        self.predict, self.config, self.name, self.clock, self.on_batch = predict, config, name, clock, on_batch
        self._queue: deque[Pending] = deque()
        self._queued_samples = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the worker thread (``loop``: unused; a thread settles its requests through their loops)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"batcher-{self.name}", daemon=True)
            self._thread.start()

    def _enqueue(self, inputs: Mapping[str, np.ndarray], waiter: asyncio.Future | None = None) -> Pending:
        pending = self._pending(inputs, waiter)
        n = pending.n
        with self._cond:
            if self._closing:
                raise ShuttingDown(f"model {self.name!r} is shutting down")
            if self._queued_samples + n > self.config.max_queue_size:
                raise self._queue_full(self._queued_samples)
            self._queue.append(pending)
            self._queued_samples += n
            self._cond.notify()
        return pending

    def _take(self, count: int) -> list[Pending]:
        """Pop ``count`` requests; drop those cancelled by their caller or past their timeout."""
        now, batch, expired = self.clock(), [], []
        for _ in range(count):
            p = self._queue.popleft()
            self._queued_samples -= p.n
            if now - p.arrived > self.config.timeout_s:
                if p.future.set_running_or_notify_cancel():
                    p.future.set_exception(RequestTimeout(
                        f"model {self.name!r}: request waited {now - p.arrived:.3g} s in the queue "
                        f"(timeout {self.config.timeout_s:g} s)"))
                    expired.append(p)
            elif p.future.set_running_or_notify_cancel():
                batch.append(p)
        hand_over(expired)
        return batch

    def step(self) -> int:
        """One decision without waiting: run a batch if one is due; returns its samples (0: none due)."""
        with self._cond:
            delay = 0.0 if self._closing else self.config.max_queue_delay_us * 1e-6
            count, _ = collect_batch(self._queue, self.clock(), self.config.max_batch_size, delay)
            batch = self._take(count)
        self._execute(batch)
        return sum(p.n for p in batch)

    def _work(self) -> None:
        while True:
            with self._cond:
                while True:
                    delay = 0.0 if self._closing else self.config.max_queue_delay_us * 1e-6
                    count, wait = collect_batch(self._queue, self.clock(), self.config.max_batch_size, delay)
                    if count or (self._closing and not self._queue):
                        break
                    self._cond.wait(None if math.isinf(wait) else wait)
                if not count:
                    return
                batch = self._take(count)
            self._execute(batch)

    def _execute(self, batch: list[Pending]) -> None:
        if not batch:
            return
        start = self.clock()
        error = None
        try:
            results = run_batch(self.predict, batch)
        except Exception as err:  # noqa: BLE001 - a bad batch fails its requests, never the worker
            error = f"{type(err).__name__}: {err}"
            for p in batch:
                p.future.set_exception(BatchFailed(f"model {self.name!r} failed on a batch of "
                                                   f"{sum(q.n for q in batch)} samples: {error}"))
        else:
            for p, out in zip(batch, results):
                p.future.set_result(out)
        hand_over(batch)
        if self.on_batch is not None:
            record = BatchRecord(sum(p.n for p in batch), len(batch), tuple(start - p.arrived for p in batch),
                                 self.clock() - start, error)
            try:
                self.on_batch(record)
            except Exception:  # noqa: BLE001 - metrics must not stop serving
                pass

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests, finish the queued ones, join the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            while self._queue:
                self.step()
