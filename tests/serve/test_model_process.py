"""BatchConfig.model_process: the queue, the batching and the model in a process of their own (serve.worker)."""
import functools
import sys
import textwrap
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from converge.serve import BatchConfig, ServerSettings, create_app
from converge.serve.batcher import BatchFailed, QueueFull, ShuttingDown
from converge.serve.worker import ModelInstances, ModelProcessError, ProcessBatcher

CRASH = -999.0  # a sample starting with this kills the worker process mid-batch

# The child process (spawn) must import the loader: a module on sys.path, which the child inherits.
MODELS = textwrap.dedent("""
    import os

    import torch

    from converge.contract import TensorSpec
    from converge.serve import ServedModel

    INPUTS = [TensorSpec("x", "FP32", (-1, 4))]
    OUTPUTS = [TensorSpec("y", "FP32", (-1, 3)), TensorSpec("total", "FP64", (-1,))]


    class Crashy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x):
            if float(x[0, 0]) == -999.0:
                os._exit(3)
            if float(x[0, 0]) == -2.0:
                time.sleep(0.5)  # a slow batch: what arrives meanwhile queues in the child
            if float(x[0, 0]) == -1.0:
                raise ValueError("no negative ones")
            y = torch.tanh(self.linear(x))
            return y, y.sum(1)


    BIG = 1 << 16  # floats per sample of Wide's output: 4 samples are a 1 MiB answer, 16 pipes' worth


    class Wide(torch.nn.Module):
        def forward(self, x):
            return x[:, :1].expand(-1, BIG).contiguous()


    def make_wide():
        return ServedModel.from_module("wide", Wide(), INPUTS, [TensorSpec("y", "FP32", (-1, BIG))],
                                       loader=make_wide)


    def make(name="crashy", fail=False):
        if fail:
            raise RuntimeError("cannot load this one")
        return ServedModel.from_module(name, Crashy(), INPUTS, OUTPUTS, loader=functools.partial(make, name))
""").replace("import os\n", "import functools\nimport os\nimport time\n", 1)


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "mp_test_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mp_test_models", None)
    import mp_test_models
    yield mp_test_models
    sys.modules.pop("mp_test_models", None)


def batch(n=5, first=0.5):
    x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
    x[0, 0] = first
    return x


def test_results_are_identical_to_in_process(models):
    model = models.make()
    with ProcessBatcher(model.loader, BatchConfig(max_batch_size=8), model.name) as b:
        for n in (1, 3, 8):
            x = {"x": batch(n)}
            here, there = model.predict(x), b.infer(x)
            assert set(here) == set(there) == {"y", "total"}
            for k in here:
                assert here[k].dtype == there[k].dtype
                np.testing.assert_array_equal(here[k], there[k])
    assert not b.alive


def test_requests_queued_while_the_model_is_busy_run_as_one_batch_split_back_in_order(models):
    model, records = models.make(), []
    with ProcessBatcher(model.loader, BatchConfig(max_batch_size=8), model.name, on_batch=records.append) as b:
        slow = b.submit({"x": batch(1, first=-2.0)})
        time.sleep(0.2)  # the child is inside the slow batch
        xs = [batch(2, first=i) for i in range(3)]
        futures = [b.submit({"x": x}) for x in xs]
        slow.result(10)
        for x, f in zip(xs, futures):
            np.testing.assert_array_equal(f.result(10)["y"], model.predict({"x": x})["y"])
    assert [(r.samples, r.requests) for r in records] == [(1, 1), (6, 3)]
    assert all(q >= 0 for r in records for q in r.queue_s)


def test_a_dead_child_fails_only_its_batch_and_is_restarted(models):
    model = models.make()
    with ProcessBatcher(model.loader, BatchConfig(max_batch_size=2), model.name) as b:
        first = b.pid
        crash = b.submit({"x": batch(2, first=CRASH)})
        queued = b.submit({"x": batch(2)})  # held by the child behind the crashing batch: must not be lost
        with pytest.raises(BatchFailed, match=r"'crashy'.*worker process died \(exit code 3\)"):
            crash.result(60)
        np.testing.assert_array_equal(queued.result(60)["y"], model.predict({"x": batch(2)})["y"])
        assert b.alive and b.pid != first and b.restarts == 1 and b.queued_samples == 0


def test_model_errors_fail_their_batch_and_the_child_lives_on(models):
    model = models.make()
    with ProcessBatcher(model.loader, BatchConfig(), model.name) as b:
        pid = b.pid
        with pytest.raises(BatchFailed, match="ValueError: no negative ones"):
            b.infer({"x": batch(2, first=-1.0)})
        assert b.alive and b.pid == pid and b.restarts == 0
        b.infer({"x": batch(2)})


def test_a_model_that_cannot_load_is_a_clear_error(models):
    b = ProcessBatcher(functools.partial(models.make, fail=True), BatchConfig(), "broken", start=False)
    with pytest.raises(ModelProcessError, match="could not load the model: RuntimeError: cannot load this one"):
        b.start()
    assert not b.alive and not b.running
    b.close()


def test_close_answers_everything_queued_then_refuses(models):
    model = models.make()
    b = ProcessBatcher(model.loader, BatchConfig(max_batch_size=4), model.name)
    futures = [b.submit({"x": batch(1, first=-2.0 if i == 0 else i)}) for i in range(9)]
    b.close()
    assert all(f.result(0)["y"].shape == (1, 3) for f in futures)
    assert not b.alive
    with pytest.raises(ShuttingDown):
        b.submit({"x": batch(1)})


def test_app_serves_through_model_processes_and_stops_them(models):
    model = models.make()
    app = create_app({"crashy": model}, ServerSettings(BatchConfig(max_batch_size=8, model_process=True)))
    x = batch(3)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": x.reshape(-1).tolist()}]}
    with TestClient(app) as c:
        b = app.state.batchers["crashy"]
        assert isinstance(b, ProcessBatcher) and b.alive
        r = c.post("/v2/models/crashy/infer", json=doc)
        assert r.status_code == 200, r.text
        y = next(o for o in r.json()["outputs"] if o["name"] == "y")
        np.testing.assert_array_equal(np.array(y["data"], np.float32).reshape(3, 3), model.predict({"x": x})["y"])
        crash = {"inputs": [{**doc["inputs"][0], "data": batch(3, first=CRASH).reshape(-1).tolist()}]}
        r = c.post("/v2/models/crashy/infer", json=crash)
        assert r.status_code == 500 and "worker process died" in r.json()["error"]
        assert c.post("/v2/models/crashy/infer", json=doc).status_code == 200
        assert 'converge_inference_executions_total{model="crashy"} 3.0' in c.get("/metrics").text
    assert not b.alive  # shutdown stopped it


def test_models_without_a_loader_stay_in_process(known):
    app = create_app({"linear": known.model()}, ServerSettings(BatchConfig(model_process=True)))
    assert not isinstance(app.state.batchers["linear"], ProcessBatcher)


def test_instances_answer_as_one_process_and_share_the_load(models):
    model, records = models.make(), []
    config = BatchConfig(max_batch_size=8, model_process=True, instances=2)
    with ModelInstances(model.loader, config, model.name, on_batch=records.append) as pool:
        assert len(set(pool.pids)) == 2 and pool.running
        slow = pool.submit({"x": batch(1, first=-2.0)})  # holds one child for 0.5 s
        time.sleep(0.1)
        t = time.monotonic()
        quick = pool.infer({"x": batch(3)})  # the other child answers meanwhile
        assert time.monotonic() - t < 0.4
        np.testing.assert_array_equal(quick["y"], model.predict({"x": batch(3)})["y"])
        slow.result(10)
        futures = [pool.submit({"x": batch(2, first=i)}) for i in range(6)]
        for i, f in enumerate(futures):
            np.testing.assert_array_equal(f.result(10)["y"], model.predict({"x": batch(2, first=i)})["y"])
        assert pool.queued_samples == 0
    assert sum(r.samples for r in records) == 1 + 3 + 12
    assert not pool.running and not any(m.alive for m in pool.members)


def test_while_every_instance_runs_a_batch_requests_wait_and_the_first_free_takes_them_as_one(models):
    model, records = models.make(), []
    config = BatchConfig(max_batch_size=8, model_process=True, instances=2)
    with ModelInstances(model.loader, config, model.name, on_batch=records.append) as pool:
        slow = [pool.submit({"x": batch(1, first=-2.0)})]  # one child busy for 0.5 s
        time.sleep(0.15)
        slow.append(pool.submit({"x": batch(1, first=-2.0)}))  # the other child: both busy
        time.sleep(0.15)
        assert all(m.busy for m in pool.members)
        waiting = [pool.submit({"x": batch(1, first=float(i))}) for i in range(6)]
        assert pool._held_samples == 6 and pool.queued_samples == 8  # here, not in either child
        for i, f in enumerate(waiting):
            np.testing.assert_array_equal(f.result(10)["y"], model.predict({"x": batch(1, first=float(i))})["y"])
        for f in slow:
            f.result(10)
        assert pool.queued_samples == 0
    assert sorted(r.samples for r in records) == [1, 1, 6]  # the six went as one batch to the first child free


def test_instances_bound_the_queue_as_one_model_and_survive_a_crash(models):
    model = models.make()
    config = BatchConfig(max_batch_size=2, max_queue_size=4, model_process=True, instances=2)
    with ModelInstances(model.loader, config, model.name) as pool:
        held = [pool.submit({"x": batch(1, first=-2.0)}) for _ in range(4)]  # 4 samples: the model's limit
        with pytest.raises(QueueFull, match=r"queue full \(4 of 4"):
            pool.submit({"x": batch(1)})
        for f in held:
            f.result(10)
        crash = pool.submit({"x": batch(2, first=CRASH)})
        with pytest.raises(BatchFailed, match="worker process died"):
            crash.result(60)
        np.testing.assert_array_equal(pool.infer({"x": batch(2)})["y"], model.predict({"x": batch(2)})["y"])
        assert pool.restarts == 1
        t = time.monotonic()
        pool.close()  # while the crashed child's successor may still be loading: it is stopped once up
        assert time.monotonic() - t < 15, "close waited out its 30 s timeout for a child started meanwhile"
    with pytest.raises(ShuttingDown):
        pool.submit({"x": batch(1)})


def test_an_instance_whose_child_ended_is_passed_over_until_its_next_child_is_up(models):
    import os
    import signal

    model = models.make()
    config = BatchConfig(max_batch_size=4, model_process=True, instances=2)
    with ModelInstances(model.loader, config, model.name) as pool:
        first = pool.members[0]
        assert all(m.taking for m in pool.members)
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while first.taking and first.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(5):  # meanwhile the other child answers everything
            np.testing.assert_array_equal(pool.infer({"x": batch(1, first=i)})["y"],
                                          model.predict({"x": batch(1, first=i)})["y"])
        while not (first.restarts and first.taking) and time.monotonic() < deadline:  # its next child loads
            time.sleep(0.05)
        assert first.restarts == 1 and first.taking and first.alive
        np.testing.assert_array_equal(pool.infer({"x": batch(2)})["y"], model.predict({"x": batch(2)})["y"])


def test_requests_awaited_on_the_loop_that_reads_the_answers_take_no_threadsafe_future(models):
    import asyncio
    from concurrent.futures import Future

    from converge.serve.batcher import LoopFuture, RequestTimeout

    model = models.make()
    b = ProcessBatcher(model.loader, BatchConfig(max_batch_size=4), model.name, start=False)

    async def main():
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, b.start, loop)  # start(loop) waits for the child: not on the loop
        awaited = b.submit_waiter({"x": batch(2)})
        assert isinstance(awaited.future, LoopFuture)
        np.testing.assert_array_equal((await awaited.waiter)["y"], model.predict({"x": batch(2)})["y"])
        slow = b.submit_waiter({"x": batch(1, first=-2.0)})  # the child runs this one for 0.5 s
        late = b.submit_waiter({"x": batch(1)}, timeout=0.1)  # given up on while it waits behind it
        with pytest.raises(RequestTimeout):
            await late.waiter
        assert late.future.cancelled()
        await slow.waiter
        threaded = b.submit({"x": batch(1)})  # not awaited on a loop: a Future another thread can wait on
        assert isinstance(threaded, Future)
        assert (await loop.run_in_executor(None, threaded.result, 10))["y"].shape == (1, 3)
        await loop.run_in_executor(None, b.close)

    asyncio.run(main())
    assert b.queued_samples == 0


def test_loop_future_keeps_the_future_protocol_the_batchers_use():
    from concurrent.futures import CancelledError, InvalidStateError

    from converge.serve.batcher import LoopFuture

    f = LoopFuture()
    with pytest.raises(InvalidStateError):
        f.result()
    assert f.cancel() and f.cancelled() and f.done() and not f.set_running_or_notify_cancel()
    with pytest.raises(CancelledError):
        f.exception()
    g = LoopFuture()
    assert g.set_running_or_notify_cancel() and not g.cancel() and not g.done()
    g.set_result({"y": 1})
    assert g.done() and g.result(0) == {"y": 1} and g.exception(0) is None
    h = LoopFuture()
    h.set_exception(ValueError("no"))
    with pytest.raises(ValueError, match="no"):
        h.result()


def test_instances_need_model_processes():
    with pytest.raises(ValueError, match="instances=2: several instances run in processes of their own"):
        BatchConfig(instances=2, model_process=False)
    with pytest.raises(ValueError, match="instances=0: must be >= 1"):
        BatchConfig(instances=0, model_process=True)


def test_app_serves_through_instances(models):
    model = models.make()
    app = create_app({"crashy": model}, ServerSettings(BatchConfig(max_batch_size=8, model_process=True,
                                                                   instances=2)))
    x = batch(3)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": x.reshape(-1).tolist()}]}
    with TestClient(app) as c:
        pool = app.state.batchers["crashy"]
        assert isinstance(pool, ModelInstances) and pool.running
        for _ in range(4):
            r = c.post("/v2/models/crashy/infer", json=doc)
            assert r.status_code == 200, r.text
        assert 'converge_inference_executions_total{model="crashy"} 4.0' in c.get("/metrics").text
    assert not pool.running


def test_requests_put_on_an_event_loop_reach_the_child_as_one_pile_per_turn():
    """The server's path: what one turn of the loop enqueues is one pipe message (the writer woken once); puts
    from other threads go straight on; closing sends what the loop piled before the sentinel."""
    import asyncio
    import multiprocessing as mp

    from converge.serve.worker import RequestFeed

    child, parent = mp.Pipe(False)
    feed = RequestFeed(parent, "t")

    async def one_turn():
        loop = asyncio.get_running_loop()
        for i in range(5):
            feed.put(i, loop)
        assert not child.poll(0.05)  # nothing is handed over before the turn ends
        await asyncio.sleep(0)

    asyncio.run(one_turn())
    assert child.poll(5) and child.recv() == [0, 1, 2, 3, 4]
    feed.put("direct")
    assert child.poll(5) and child.recv() == ["direct"]

    async def piled_then_closed():
        feed.put("late", asyncio.get_running_loop())
        feed.close()  # before the loop's turn ends

    asyncio.run(piled_then_closed())
    received = []
    try:
        while child.poll(1):
            received += child.recv()
    except EOFError:  # the feed closed its end after the sentinel
        pass
    assert received == ["late", None]


def test_pipe_room_counts_what_the_reader_has_not_read():
    import multiprocessing as mp

    from converge.serve.worker import enlarge_pipe, pipe_room

    child, parent = mp.Pipe(False)
    capacity = enlarge_pipe(parent.fileno())
    if capacity == 0:
        pytest.skip("pipe sizes are Linux's")
    assert pipe_room(parent.fileno(), capacity) == capacity
    parent.send_bytes(b"x" * 10_000)  # 4 bytes of length, then the message
    assert pipe_room(parent.fileno(), capacity) == capacity - 10_004
    child.recv_bytes()
    assert pipe_room(parent.fileno(), capacity) == capacity
    assert pipe_room(parent.fileno(), 0) == 0  # unknown capacity: never write from the loop


def test_a_pile_the_pipe_has_no_room_for_goes_to_the_writer_and_the_loop_never_waits():
    """The loop writes a turn's pile itself only when it fits; a larger one waits in the writer thread for the
    child to read, and what the loop puts meanwhile queues behind it, in order."""
    import asyncio
    import multiprocessing as mp

    from converge.serve.worker import RequestFeed

    child, parent = mp.Pipe(False)
    feed = RequestFeed(parent, "t")
    big = b"x" * (3 * 2**20)  # more than the pipe holds: a write of it blocks until the child reads

    async def turns():
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        feed.put(big, loop)
        await asyncio.sleep(0)
        feed.put("small", loop)
        await asyncio.sleep(0)
        return time.monotonic() - t0

    assert asyncio.run(turns()) < 0.5  # nobody has read yet: the loop did not wait for the child
    received = []
    while len(received) < 2 and child.poll(5):  # one pile or two, as the writer woke
        received += child.recv()
    assert received == [big, "small"]
    feed.close()


def test_answers_read_on_the_servers_loop_settle_its_requests_and_survive_a_crash(models):
    """start(loop): no reader thread; the loop reads the child's answers, a dead child is replaced, close()
    from another thread answers what is queued."""
    import asyncio
    import threading

    model = models.make()
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    b = ProcessBatcher(model.loader, BatchConfig(max_batch_size=4), model.name, start=False)
    try:
        b.start(loop)
        assert b._reader is None and not any(t.name.startswith("results-") for t in threading.enumerate())

        def infer(x):
            return asyncio.run_coroutine_threadsafe(b.infer_async({"x": x}), loop).result(60)

        np.testing.assert_array_equal(infer(batch(3))["y"], model.predict({"x": batch(3)})["y"])
        first = b.pid
        with pytest.raises(BatchFailed, match="worker process died"):
            infer(batch(2, first=CRASH))
        np.testing.assert_array_equal(infer(batch(2))["y"], model.predict({"x": batch(2)})["y"])
        assert b.pid != first and b.restarts == 1
        queued = [b.submit({"x": batch(1, first=-2.0 if i == 0 else i)}) for i in range(5)]
        b.close()
        assert all(f.result(0)["y"].shape == (1, 3) for f in queued)
        assert not b.alive
    finally:
        b.close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_the_reader_gives_whole_messages_only_however_the_bytes_arrive():
    """Connection.send's framing read back from a non-blocking pipe: a length whose bytes are not there yet, a
    message split anywhere, several at once, then the writer's end."""
    import multiprocessing as mp
    import os
    import threading

    from converge.serve.worker import MessageReader

    reader_end, writer_end = mp.Pipe(False)
    reader = MessageReader(reader_end)
    assert reader.read() and reader.messages() == []  # nothing yet, and the read did not block
    big = {"y": np.arange(20_000, dtype=np.float32)}  # 80 KB: Connection.send writes its length, then its bytes

    def framed(message) -> bytes:
        """``message`` as Connection.send puts it on a pipe."""
        probe_reader, probe_writer = mp.Pipe(False)
        sender = threading.Thread(target=lambda: (probe_writer.send(message), probe_writer.close()))
        sender.start()
        chunks = list(iter(lambda: os.read(probe_reader.fileno(), 1 << 16), b""))
        sender.join()
        probe_reader.close()
        return b"".join(chunks)

    stream = b"".join(framed(m) for m in (("done", [1, 2], big), ("start", [3]), ("expired", [4])))
    os.write(writer_end.fileno(), stream[:4])  # the length alone
    assert reader.read() and reader.messages() == []
    os.write(writer_end.fileno(), stream[4:50_000])  # part of the message
    assert reader.read() and reader.messages() == []
    os.write(writer_end.fileno(), stream[50_000:])  # its rest and two more
    assert reader.read()
    got = reader.messages()
    assert [m[0] for m in got] == ["done", "start", "expired"] and got[1] == ("start", [3])
    np.testing.assert_array_equal(got[0][2]["y"], big["y"])
    assert reader.buffer == bytearray()
    writer_end.close()
    assert reader.read() is False  # the writer's end: end of file


def test_answers_larger_than_the_pipe_are_read_whole_on_uvloop(models):
    """uvloop leaves the pipe of answers non-blocking; a 1 MiB answer arrives in pieces. Read with
    Connection.recv, the first piece raised BlockingIOError, taken for the child's death: it was killed."""
    import asyncio

    uvloop = pytest.importorskip("uvloop")
    b = ProcessBatcher(models.make_wide, BatchConfig(max_batch_size=8), "wide", start=False)

    async def run():
        await asyncio.to_thread(b.start, asyncio.get_running_loop())
        try:
            return await asyncio.gather(*(b.infer_async({"x": batch(4, first=float(i))}) for i in range(3)))
        finally:
            await asyncio.to_thread(b.close)

    loop = uvloop.new_event_loop()
    try:
        answers = loop.run_until_complete(run())
    finally:
        loop.close()
    for i, answer in enumerate(answers):
        assert answer["y"].shape == (4, models.BIG)
        np.testing.assert_array_equal(answer["y"][:, 0], batch(4, first=float(i))[:, 0])
    assert b.restarts == 0
