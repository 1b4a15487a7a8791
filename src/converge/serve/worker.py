"""Batches formed where the model runs: the model and its queue in a process of their own.

With ``BatchConfig.model_process`` each model loaded from a run is served by a
:class:`ProcessBatcher` instead of a thread :class:`~converge.serve.batcher.Batcher`.
The server's event loop only hands requests over; a child process
(multiprocessing ``spawn``) holds the model, drains its queue the moment the
model is free, forms the batch with the same :func:`~converge.serve.batcher.collect_batch`
and sends each batch's outputs back. Nothing in the server process stands
between two batches, so the model never waits for the event loop's GIL. (With
the model on a thread of the server, every op of the forward pass waits for
the GIL while the loop parses requests: a batch of 32 gw windows took 12.8 ms
there against 6 ms alone, on this 2-core CPU.)

The child says ``("ready", None)`` once loaded, then per batch
``("start", ids)``, then ``("done", ids, outputs, record)`` or
``("failed", ids, error, record)``, and ``("expired", ids)`` for requests past
their timeout. A child that dies fails the batch it was running with
:class:`ModelProcessDied` (HTTP 500) and is started again; the requests it held
but had not started go to the new child, so a crash loses only its own batch.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing as mp
import os
import struct
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Hashable, Mapping

import numpy as np

from .batcher import (BatchConfig, BatchFailed, BatchRecord, Pending, QueueFull, RequestQueue, RequestTimeout,
                      ShuttingDown, collect_batch, hand_over, predict_batch, running_loop, shape_key,
                      split_outputs)

READY_TIMEOUT_S = 300.0


class ModelProcessDied(RuntimeError):
    """The model's process exited while running a batch."""


class ModelProcessError(RuntimeError):
    """The model's process could not load the model."""


@dataclass
class Queued:
    """A request as the child holds it (what :func:`~converge.serve.batcher.collect_batch` reads)."""

    id: int
    inputs: Mapping[str, np.ndarray]
    n: int
    arrived: float  # time.monotonic() in the server: one clock for every process of the machine

    @cached_property
    def shape_key(self) -> Hashable:
        return shape_key(self.inputs)


def take_arrivals(requests: Connection, held: deque, timeout: float | None) -> bool:
    """Move what has arrived on ``requests`` into ``held``, waiting up to ``timeout`` for it; False at the end.

    ``timeout`` 0: take only what is there; None: wait for something. The end is
    the sentinel (None) or the server gone (end of file).
    """
    if not requests.poll(timeout):
        return True
    while True:
        try:
            items = requests.recv()
        except (EOFError, OSError):
            return False
        for item in items:
            if item is None:
                return False
            held.append(Queued(*item))
        if not requests.poll(0):
            return True


class RequestFeed:
    """Requests on their way to the child: a thread writes whatever has piled up as one pipe message.

    One write per pile, not per request: a thread of the server process takes
    the GIL back after every write, and while the event loop is busy that waits
    up to the switch interval. Written one by one (a multiprocessing ``Queue``),
    the requests reached the child at only ~2,300 a second.

    Requests put from an event loop (``put(item, loop)``, the server's path) are piled on the loop and written
    by the loop itself once per turn, all the requests one turn read as one message, when the writer has
    nothing queued or in hand (so nothing overtakes it) and the pipe has room for the message (so the write
    cannot block the loop). Otherwise the pile goes to the writer. Waking the writer for each pile took the
    GIL from the event loop and left the cores idle while requests waited (README, serve). The loop must keep
    running until its turn ends (a server's does), or the feed must be closed: either hands the pile over.
    """

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn, self._items, self._cond = conn, deque(), threading.Condition()
        self._turn: list = []  # put on the event loop during its current turn, handed over at its end
        self._writing = False  # the writer holds a pile it has not finished writing
        self._capacity = enlarge_pipe(conn.fileno())
        self._thread = threading.Thread(target=self._write, name=f"requests-{name}", daemon=True)
        self._thread.start()

    def put(self, item, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queue ``item`` for the child (None: the sentinel, then the feed ends); ``loop``: the running event
        loop this is called on, which hands the item over when its turn ends."""
        if loop is not None and item is not None:
            with self._cond:
                self._turn.append(item)
                if len(self._turn) > 1:
                    return
            loop.call_soon(self._end_turn)
            return
        with self._cond:
            self._take_turn()
            if not self._items:  # the writer takes the whole pile once awake: wake it once per pile
                self._cond.notify()
            self._items.append(item)

    def _end_turn(self) -> None:
        with self._cond:
            if not self._turn:
                return
            if self._items or self._writing:  # the writer is behind: the pile queues after its own
                self._take_turn()
                return
            message = ForkingPickler.dumps(self._turn)
            if len(message) + PIPE_MARGIN > pipe_room(self._conn.fileno(), self._capacity):
                self._take_turn()  # the write could block the loop: the writer waits instead
                return
            self._turn.clear()
            try:  # the condition held: nothing else writes meanwhile
                self._conn.send_bytes(message)
            except (OSError, ValueError):  # the child is gone: the result reader sees to it
                pass

    def _take_turn(self) -> None:
        """Move the loop's pile to the writer (the condition held); wake it if it had nothing."""
        if self._turn:
            if not self._items:
                self._cond.notify()
            self._items.extend(self._turn)
            self._turn.clear()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                pile = list(self._items)
                self._items.clear()
                self._writing = True
            try:
                self._conn.send(pile)
            except (OSError, ValueError):  # the child is gone: the result reader sees to it
                return
            finally:
                with self._cond:
                    self._writing = False
            if pile[-1] is None:
                return

    def close(self) -> None:
        """Stop writing (the child is gone or has its sentinel)."""
        self.put(None)
        self._thread.join(5)
        self._conn.close()


PIPE_BYTES = 1 << 20  # Linux's default maximum for an unprivileged pipe (/proc/sys/fs/pipe-max-size)


PIPE_MARGIN = 2 * 4096  # bytes kept free beyond a message: a pipe fills by pages, a last page may be part used


def enlarge_pipe(fd: int, size: int = PIPE_BYTES) -> int:
    """Let one write of a pile of requests go through in one system call (64 KB pipes hold 8 gw windows); the
    pipe's capacity in bytes after (0 where that is not known: not Linux)."""
    try:
        import fcntl
    except ImportError:
        return 0
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except OSError:  # over the system's limit: smaller writes, same result
        pass
    try:
        return fcntl.fcntl(fd, getattr(fcntl, "F_GETPIPE_SZ", 1032))
    except OSError:
        return 0


def pipe_room(fd: int, capacity: int) -> int:
    """Bytes a write to pipe ``fd`` of ``capacity`` bytes can add without blocking: its capacity less what the
    reader has not read yet (FIONREAD, which Linux answers on either end); 0 where that is not known."""
    if capacity <= 0:
        return 0
    try:
        import fcntl
        import termios

        unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except (ImportError, OSError):
        return 0
    return capacity - unread


def serve_batches(requests: Connection, results: Connection, loader: Callable, config: BatchConfig, threads: int) -> None:
    """The child's life: load the model, then batch and run requests until the sentinel, finishing what is held."""
    import torch

    torch.set_num_threads(threads)
    try:
        model = loader()
    except BaseException as err:  # noqa: BLE001 - report, then exit
        results.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        return
    results.send(("ready", None))
    held: deque[Queued] = deque()
    delay, open_ = config.max_queue_delay_us * 1e-6, True
    while True:
        if open_:
            open_ = take_arrivals(requests, held, 0)
        count, wait = collect_batch(held, time.monotonic(), config.max_batch_size, delay if open_ else 0.0)
        if not count:
            if not open_:
                return
            open_ = take_arrivals(requests, held, None if math.isinf(wait) else wait)
            continue
        batch = [held.popleft() for _ in range(count)]
        now = time.monotonic()
        expired = [q.id for q in batch if now - q.arrived > config.timeout_s]
        if expired:
            results.send(("expired", expired))
            batch = [q for q in batch if now - q.arrived <= config.timeout_s]
        if batch:
            run_and_report(model.serve, batch, results)


def run_and_report(predict: Callable, batch: list[Queued], results) -> None:
    """Run one batch in the child and send its outcome (a failing batch fails its requests, never the child)."""
    ids = [q.id for q in batch]
    results.send(("start", ids))
    start = time.monotonic()
    try:
        outputs = predict_batch(predict, batch)
    except Exception as err:  # noqa: BLE001
        error = f"{type(err).__name__}: {err}"
        outputs = None
    else:
        error = None
    record = BatchRecord(sum(q.n for q in batch), len(batch), tuple(start - q.arrived for q in batch),
                         time.monotonic() - start, error)
    results.send(("done", ids, [q.n for q in batch], outputs, record) if error is None
                 else ("failed", ids, error, record))


class MessageReader:
    """Whole messages of a :class:`~multiprocessing.connection.Connection`'s reading end, read without blocking.

    The event loop reads the child's answers when their pipe is readable. ``Connection.send`` writes a message
    of more than 16 KiB as two writes (its length, then its bytes), and a child writes a message larger than the
    pipe in pieces, while uvloop's ``add_reader`` leaves the pipe non-blocking: ``Connection.recv`` on the loop
    then found a length whose bytes were not there yet and raised ``BlockingIOError``, which read as the child's
    end, and the live child was killed with its batch (chem batches of ~100 structures at 128 clients). This
    reads what is there (the pipe set non-blocking on any loop), keeps a partial message for later, and gives
    only whole ones, decoded as ``Connection.recv`` does.
    """

    CHUNK = 1 << 20

    def __init__(self, conn: Connection) -> None:
        self.conn, self.fd, self.buffer = conn, conn.fileno(), bytearray()  # conn held: it owns the fd
        os.set_blocking(self.fd, False)

    def read(self) -> bool:
        """Take in what the pipe holds; False once the writer's end is closed (end of file)."""
        while True:
            try:
                chunk = os.read(self.fd, self.CHUNK)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self.buffer += chunk

    def messages(self) -> list:
        """The whole messages taken in so far, in order (Connection's framing: a 4-byte big-endian length, or
        -1 and an 8-byte one, then the pickle)."""
        found, buffer, at = [], self.buffer, 0
        while len(buffer) - at >= 4:
            (size,), head = struct.unpack_from("!i", buffer, at), 4
            if size == -1:
                if len(buffer) - at < 12:
                    break
                (size,), head = struct.unpack_from("!Q", buffer, at + 4), 12
            if len(buffer) - at - head < size:
                break
            found.append(ForkingPickler.loads(buffer[at + head:at + head + size]))
            at += head + size
        del buffer[:at]
        return found


class ProcessBatcher(RequestQueue):
    """A :class:`~converge.serve.batcher.RequestQueue` whose queue, batching and model live in a child process.

    ``loader()`` builds the model's ``ServedModel`` in the child (e.g. a
    ``functools.partial`` of :func:`~converge.serve.registry.load_served_model`).
    ``queued_samples`` counts samples handed over and not yet answered;
    ``close`` finishes them and stops the child.
    """

    def __init__(self, loader: Callable, config: BatchConfig = BatchConfig(), name: str = "model",
                 on_batch: Callable[[BatchRecord], None] | None = None, start: bool = True, threads: int = 1,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.loader, self.config, self.name, self.on_batch = loader, config, name, on_batch
        self.threads, self.ready_timeout_s, self.clock = threads, ready_timeout_s, time.monotonic
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._inflight: dict[int, Pending] = {}
        self._started: set[int] = set()  # ids of the batch the child runs now
        self._batch_started = 0.0
        self._ids = itertools.count()
        self._queued_samples = 0
        self._closing = False
        self._broken: str | None = None
        self._ended = False  # the answers' reader has seen the child's end and not yet a new child
        self._proc = self._feed = self._results = None
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # where the answers are read, if not on _reader
        self._read_all = threading.Event()  # the loop has read the last child's last answer
        self.restarts = 0
        self.on_idle: Callable[[ProcessBatcher], None] | None = None  # called when a batch ends (where it is read)
        if start:
            self.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def running(self) -> bool:
        return self.alive and not self._closing and self._broken is None

    @property
    def taking(self) -> bool:
        """Whether requests put now reach a child (:attr:`running` without asking the system whether the child
        lives, as ``is_alive`` does: a request given to a child that died unseen waits for the next one)."""
        return self._proc is not None and not self._ended and not self._closing and self._broken is None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the child, wait until it has loaded the model, and start reading its answers: on ``loop``, a
        running event loop (the server's) that then settles its own requests as it reads them, or else on a
        thread of their own. With ``loop``, call this and :meth:`close` from another thread: they wait."""
        if self._reader is not None or self._loop is not None:
            return
        self._spawn()
        if loop is not None:
            self._loop = loop
            loop.call_soon_threadsafe(self._watch_results)
            return
        self._reader = threading.Thread(target=self._read_results, name=f"results-{self.name}", daemon=True)
        self._reader.start()

    def _spawn(self) -> None:
        """A new child on a new request queue; raises :class:`ModelProcessError` if it cannot load the model."""
        (child_requests, requests), (results, child_results) = self._ctx.Pipe(False), self._ctx.Pipe(False)
        proc = self._ctx.Process(target=serve_batches, args=(child_requests, child_results, self.loader,
                                                             self.config, self.threads),
                                 name=f"converge-model-{self.name}", daemon=True)
        proc.start()
        child_requests.close()  # the child's ends: so that either side sees end of file when the other dies
        child_results.close()
        try:
            if not results.poll(self.ready_timeout_s):
                raise ModelProcessError(f"model {self.name!r}: model process not ready after "
                                        f"{self.ready_timeout_s:g} s")
            kind, detail = results.recv()
            if kind != "ready":
                raise ModelProcessError(f"model {self.name!r}: model process could not load the model: {detail}")
        except (EOFError, OSError):
            proc.join(5)
            requests.close()
            raise ModelProcessError(f"model {self.name!r}: model process exited (code {proc.exitcode}) while "
                                    "loading the model") from None
        except ModelProcessError:
            proc.kill()
            proc.join(5)
            requests.close()
            raise
        feed = RequestFeed(requests, self.name)
        with self._lock:  # requests that reached the old child but never started go to this one
            waiting = [(i, p) for i, p in self._inflight.items() if i not in self._started]
            old, self._proc, self._feed, self._results = self._feed, proc, feed, results
            self._ended = False
            closing = self._closing
            for request_id, p in waiting:
                feed.put((request_id, p.inputs, p.n, p.arrived))
        if old is not None:
            old.close()
        if closing:  # close() came while this child loaded, and found no child to stop: it ends after these
            feed.put(None)

    @property
    def busy(self) -> bool:
        """Whether the child is running a batch now (between its "start" and its answer)."""
        return bool(self._started)

    def _enqueue(self, inputs: Mapping[str, np.ndarray], waiter: asyncio.Future | None = None) -> Pending:
        pending = self._pending(inputs, waiter)
        self._put(pending)
        return pending

    def _settles_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self._loop is loop  # answers read on the loop (start(loop)), not on a thread of their own

    def _put(self, pending: Pending) -> None:
        """Hand ``pending`` to the child (or raise :class:`ShuttingDown` / :class:`QueueFull`)."""
        with self._lock:
            if self._closing or self._broken:
                raise ShuttingDown(f"model {self.name!r} is shutting down" if self._closing else self._broken)
            if self._queued_samples + pending.n > self.config.max_queue_size:
                raise self._queue_full(self._queued_samples)
            request_id = next(self._ids)
            self._inflight[request_id] = pending
            self._queued_samples += pending.n
            self._feed.put((request_id, pending.inputs, pending.n, pending.arrived), running_loop())

    def _pop(self, ids) -> dict[int, Pending]:
        """Forget the requests ``ids`` (those still here), by id."""
        with self._lock:
            popped = {i: self._inflight.pop(i) for i in ids if i in self._inflight}
            self._started.difference_update(ids)
            self._queued_samples -= sum(p.n for p in popped.values())
        return popped

    def _settle(self, requests: dict[int, Pending], outcome: Callable[[Pending, int], None]) -> None:
        """``outcome(pending, id)`` for each request its caller still waits for; then wake their event loops."""
        for request_id, p in requests.items():
            if p.future.set_running_or_notify_cancel():  # False: its caller gave up on it
                outcome(p, request_id)
        hand_over(list(requests.values()))

    def _read_results(self) -> None:
        """The reader thread: settle each answer; on the child's death fail its batch and start another."""
        while True:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                self._ended = True
                if not self._child_died():
                    return
                self._idle()
                continue
            self._answer(message)

    def _watch_results(self) -> None:
        """On the loop: read the child's answers as they arrive."""
        self._loop.add_reader(self._results.fileno(), self._results_ready, MessageReader(self._results))

    def _results_ready(self, reader: MessageReader) -> None:
        """On the loop: settle each whole message the child has sent (:class:`MessageReader`). Its end goes to
        a thread, which may wait for the child and a new one to load."""
        try:
            open_ = reader.read()
        except OSError:
            open_ = False
        for message in reader.messages():
            self._answer(message)
        if not open_:
            self._ended = True
            self._loop.remove_reader(reader.fd)
            threading.Thread(target=self._recover, name=f"recover-{self.name}", daemon=True).start()

    def _recover(self) -> None:
        """After the child's end was read on the loop: fail its batch, start another and read it on the loop."""
        if not self._child_died():
            self._read_all.set()
            return
        try:
            self._loop.call_soon_threadsafe(self._watch_results)
        except RuntimeError:  # the loop is closed: nobody left to answer
            self._read_all.set()
            return
        self._loop.call_soon_threadsafe(self._idle)

    def _answer(self, message: tuple) -> None:
        """Settle one message of the child: a batch started, answered, failed or expired."""
        kind, ids = message[0], message[1]
        if kind == "start":
            with self._lock:
                self._started.update(ids)
            self._batch_started = time.monotonic()
        elif kind == "done":
            parts = dict(zip(ids, split_outputs(message[3], message[2])))
            answered = self._pop(ids)
            self._settle(answered, lambda p, request_id: p.future.set_result(parts[request_id]))
            self._observe(message[4])
        elif kind == "failed":
            batch, record = self._pop(ids), message[3]
            err = BatchFailed(f"model {self.name!r} failed on a batch of {record.samples} samples: {message[2]}")
            self._settle(batch, lambda p, i: p.future.set_exception(err))
            self._observe(record)
        elif kind == "expired":
            self._settle(self._pop(ids), lambda p, i: p.future.set_exception(RequestTimeout(
                f"model {self.name!r}: request waited longer than its timeout ({self.config.timeout_s:g} s) "
                "in the queue")))
        if kind != "start":
            self._idle()

    def _idle(self) -> None:
        if self.on_idle is not None and not self.busy:
            self.on_idle(self)

    def _observe(self, record: BatchRecord) -> None:
        if self.on_batch is not None:
            try:
                self.on_batch(record)
            except Exception:  # noqa: BLE001 - metrics must not stop serving
                pass

    def _child_died(self) -> bool:
        """Fail the batch the dead child was running; start another unless closing. True: keep reading."""
        code = self._reap()
        with self._lock:
            running = [i for i in self._inflight if i in self._started]
        if running:
            samples = sum(self._inflight[i].n for i in running)
            err = BatchFailed(f"model {self.name!r} failed on a batch of {samples} samples: ModelProcessDied: "
                              f"model {self.name!r}: its worker process died (exit code {code}) while running "
                              "this batch; it is restarted for the next batch")
            self._settle(self._pop(running), lambda p, i: p.future.set_exception(err))
            self._observe(BatchRecord(samples, len(running), (), time.monotonic() - self._batch_started,
                                      "ModelProcessDied"))
        if self._closing:
            self._settle(self._pop(list(self._inflight)), lambda p, i: p.future.set_exception(
                ShuttingDown(f"model {self.name!r} stopped before answering")))
            return False
        self.restarts += 1
        try:
            self._spawn()
        except ModelProcessError as err:
            self._broken = f"{err}; restart the server"
            self._settle(self._pop(list(self._inflight)), lambda p, i: p.future.set_exception(BatchFailed(str(err))))
            return False
        return True

    def _reap(self) -> int | None:
        """Wait for the (dead or dying) child; its exit code."""
        proc = self._proc
        if proc is None:
            return None
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        return proc.exitcode

    def close(self, timeout: float | None = 30.0) -> None:
        """Take no more requests, let the child finish the queued ones, stop it (killed after ``timeout``)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            feed = self._feed
        if feed is not None and self.alive:
            feed.put(None)
        self._wait_for_reader(timeout)
        if self.alive:
            self._proc.kill()
        self._wait_for_reader(5)
        if self._proc is not None:
            self._proc.join(5)
        if self._feed is not None:
            self._feed.close()

    def _wait_for_reader(self, timeout: float | None) -> None:
        """Until the answers' reader has read the child's end (``timeout`` s at most)."""
        if self._reader is not None:
            self._reader.join(timeout)
        elif self._loop is not None:
            self._read_all.wait(timeout)

    def __enter__(self) -> "ProcessBatcher":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ModelInstances(RequestQueue):
    """``config.instances`` :class:`ProcessBatcher` children of one model, as Triton's ``instance_group``
    ``count``, fed as Triton feeds them: a request goes to a child that is not running a batch (it collects
    its batch as one process would, ``max_queue_delay_us`` included); while every child runs one, requests
    wait here, and the first child to finish takes them all (up to ``max_batch_size`` samples) as its next
    batch. So one batch runs while the next forms, and batches stay as large as one process would make
    them (handing each request to the least busy child halved them). On a CPU, one torch thread per child:
    as many children as cores, less the server's share.

    A child that dies is restarted by its own batcher and fails only its own batch; ``max_queue_size`` bounds
    the samples held here and by all the children together."""

    def __init__(self, loader: Callable, config: BatchConfig = BatchConfig(), name: str = "model",
                 on_batch: Callable[[BatchRecord], None] | None = None, start: bool = True, threads: int = 1,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        if config.instances < 2:
            raise ValueError(f"instances={config.instances}: ModelInstances holds two or more (one: ProcessBatcher)")
        self.config, self.name, self.clock = config, name, time.monotonic
        self.members = [ProcessBatcher(loader, config, name, on_batch, start=False, threads=threads,
                                       ready_timeout_s=ready_timeout_s) for _ in range(config.instances)]
        for member in self.members:
            member.on_idle = self._member_idle
        self._lock = threading.Lock()
        self._held: deque[Pending] = deque()  # while every child runs a batch
        self._held_samples = 0
        self._closing = False
        self._turn = itertools.count()
        if start:
            self.start()

    @property
    def _queued_samples(self) -> int:
        return self._held_samples + sum(m.queued_samples for m in self.members)

    @property
    def pids(self) -> list[int | None]:
        return [m.pid for m in self.members]

    @property
    def restarts(self) -> int:
        return sum(m.restarts for m in self.members)

    @property
    def running(self) -> bool:
        return any(m.running for m in self.members)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start every child at once (each loads the model: seconds; answers read on ``loop`` as
        :meth:`ProcessBatcher.start` reads them); the first failure is raised."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.members)) as pool:
            for done in [pool.submit(m.start, loop) for m in self.members]:
                done.result()

    def _settles_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        return all(m._settles_on(loop) for m in self.members)

    def _enqueue(self, inputs: Mapping[str, np.ndarray], waiter: asyncio.Future | None = None) -> Pending:
        pending = self._pending(inputs, waiter)
        with self._lock:
            if self._queued_samples + pending.n > self.config.max_queue_size:  # the model's limit, not a child's
                raise self._queue_full(self._queued_samples)
            running = [(i, m) for i, m in enumerate(self.members) if m.taking] if not self._closing else []
            if not running:
                broken = next((m._broken for m in self.members if m._broken), None)
                raise ShuttingDown(broken or f"model {self.name!r} is shutting down")
            free = [(i, m) for i, m in running if not m.busy]
            if not free:
                self._held.append(pending)
                self._held_samples += pending.n
                return pending
            turn = next(self._turn)  # among free children: the one holding fewest, ties round the children
            _, member = min(free, key=lambda im: (im[1].queued_samples, (im[0] - turn) % len(self.members)))
            try:
                member._put(pending)
            except ShuttingDown:  # closed or broken between the check and the call: wait for another
                self._held.append(pending)
                self._held_samples += pending.n
        return pending

    def _member_idle(self, member: ProcessBatcher) -> None:
        """A child ended a batch: the requests held here become its next one (where its answers are read)."""
        with self._lock:
            if not member.taking:
                if not any(m.taking for m in self.members):
                    self._fail_held(member._broken or f"model {self.name!r} stopped before answering")
                return
            room = self.config.max_batch_size - member.queued_samples
            while self._held and self._held[0].n <= room:
                try:
                    member._put(self._held[0])
                except (ShuttingDown, QueueFull):  # closing or broken since the check: another child takes them
                    return
                pending = self._held.popleft()
                self._held_samples -= pending.n
                room -= pending.n

    def _fail_held(self, why: str) -> None:
        held, self._held, self._held_samples = list(self._held), deque(), 0
        err = ShuttingDown(why)
        for p in held:
            if p.future.set_running_or_notify_cancel():
                p.future.set_exception(err)
        hand_over(held)

    def close(self, timeout: float | None = 30.0) -> None:
        """Close every child at once, each finishing what it holds (the requests held here included)."""
        from concurrent.futures import ThreadPoolExecutor

        with self._lock:
            self._closing = True
            running = [m for m in self.members if m.running]
            for k, pending in enumerate(list(self._held) if running else []):  # the children finish them
                try:
                    running[k % len(running)]._put(pending)
                except (ShuttingDown, QueueFull):
                    break
                self._held.popleft()
                self._held_samples -= pending.n
            self._fail_held(f"model {self.name!r} stopped before answering")
        with ThreadPoolExecutor(len(self.members)) as pool:
            list(pool.map(lambda m: m.close(timeout), self.members))

    def __enter__(self) -> "ModelInstances":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
