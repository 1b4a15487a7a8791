"""The dynamic batcher: the deadline with an injected clock, ordering, failures, limits, shutdown."""
import asyncio
import math
import threading

import numpy as np
import pytest

from converge.serve.batcher import (BatchConfig, Batcher, BatchFailed, Pending, QueueFull, RequestTimeout,
                                    ShuttingDown, collect_batch)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """predict = 2x, remembering the batch sizes it saw."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, inputs):
        self.sizes.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}


def rows(start: int, n: int, width: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.arange(start, start + n * width, dtype=np.float64).reshape(n, width)}


def pending(n: int, arrived: float = 0.0, width: int = 2) -> Pending:
    return Pending(rows(0, n, width), n, arrived)


def test_collect_batch_decisions():
    assert collect_batch([], 0.0, 8, 1e-3) == (0, math.inf)
    # delay 0: whatever is queued, at once
    assert collect_batch([pending(1)], 0.0, 8, 0.0) == (1, 0.0)
    # below max_batch_size and before the deadline: wait the rest of the delay
    take, wait = collect_batch([pending(3, arrived=1.0)], 1.0004, 8, 1e-3)
    assert take == 0 and wait == pytest.approx(6e-4)
    # full: exactly max_batch_size samples
    assert collect_batch([pending(4), pending(4), pending(1)], 0.0, 8, 1.0) == (2, 0.0)
    # the next request would not fit: take the prefix now, never split a request
    assert collect_batch([pending(5), pending(5)], 0.0, 8, 1.0) == (1, 0.0)
    # a different non-batch shape ends the batch
    assert collect_batch([pending(1, width=2), pending(1, width=3)], 0.0, 8, 1.0) == (1, 0.0)


def test_batch_forms_at_max_batch_size_before_the_deadline():
    clock, model = FakeClock(), Recorder()
    b = Batcher(model, BatchConfig(max_batch_size=8, max_queue_delay_us=1000), clock=clock, start=False)
    futures = [b.submit(rows(0, 2)), b.submit(rows(10, 2))]
    assert b.step() == 0  # 4 of 8 samples, deadline not reached
    clock.now = 0.0005
    futures.append(b.submit(rows(20, 4)))
    assert b.step() == 8 and model.sizes == [8]  # full at t = 0.5 ms < 1 ms
    for f, start, n in zip(futures, (0, 10, 20), (2, 2, 4)):
        np.testing.assert_array_equal(f.result(0)["y"], rows(start, n)["x"] * 2)


def test_batch_forms_at_the_deadline_with_fewer_samples():
    clock, model = FakeClock(), Recorder()
    b = Batcher(model, BatchConfig(max_batch_size=8, max_queue_delay_us=1000), clock=clock, start=False)
    first = b.submit(rows(0, 1))
    clock.now = 0.0004
    second = b.submit(rows(5, 2))
    clock.now = 0.000999
    assert b.step() == 0
    clock.now = 0.001  # 1 ms after the oldest request
    assert b.step() == 3 and model.sizes == [3]
    assert first.result(0)["y"].shape == (1, 2) and second.result(0)["y"].shape == (2, 2)


def test_zero_delay_runs_whatever_is_queued():
    model = Recorder()
    b = Batcher(model, BatchConfig(max_batch_size=4), clock=FakeClock(), start=False)
    for i in range(3):
        b.submit(rows(i, 2))
    assert b.step() == 4 and b.step() == 2 and b.step() == 0
    assert model.sizes == [4, 2]


def test_worker_thread_gives_each_of_many_concurrent_callers_its_own_answer():
    records = []
    b = Batcher(Recorder(), BatchConfig(max_batch_size=16, max_queue_delay_us=500), on_batch=records.append)
    errors = []

    def client(i: int) -> None:
        for k in range(20):
            x = rows(1000 * i + 10 * k, 1 + (i + k) % 3)
            out = b.infer(x, timeout=10)
            if not np.array_equal(out["y"], x["x"] * 2):
                errors.append((i, k))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    b.close(5)
    assert not errors
    assert sum(r.requests for r in records) == 160
    assert len(records) < 160  # some requests shared a model call
    assert all(r.samples <= 16 and r.error is None for r in records)


def test_a_failing_batch_fails_each_request_and_the_worker_survives():
    def fragile(inputs):
        if (inputs["x"] < 0).any():
            raise RuntimeError("negative input")
        return {"y": inputs["x"] * 2}

    clock = FakeClock()
    b = Batcher(fragile, BatchConfig(max_batch_size=8), clock=clock, start=False)
    bad = [b.submit(rows(0, 1)), b.submit({"x": -np.ones((1, 2))})]
    b.step()
    for f in bad:
        with pytest.raises(BatchFailed, match="failed on a batch of 2 samples: RuntimeError: negative input"):
            f.result(0)
    threaded = Batcher(fragile, BatchConfig(max_batch_size=8))
    with pytest.raises(BatchFailed, match="negative input"):
        threaded.infer({"x": -np.ones((1, 2))}, timeout=5)
    np.testing.assert_array_equal(threaded.infer(rows(0, 1), timeout=5)["y"], rows(0, 1)["x"] * 2)
    threaded.close(5)


def test_wrong_number_of_output_rows_is_a_clear_failure():
    b = Batcher(lambda x: {"y": x["x"][:1]}, BatchConfig(), clock=FakeClock(), start=False)
    f = b.submit(rows(0, 3))
    b.step()
    with pytest.raises(BatchFailed, match="output 'y' has 1 rows for a batch of 3 samples"):
        f.result(0)


def test_full_queue_and_oversized_requests_are_refused():
    b = Batcher(Recorder(), BatchConfig(max_batch_size=4, max_queue_size=6), clock=FakeClock(), start=False)
    b.submit(rows(0, 4))
    with pytest.raises(QueueFull, match=r"queue full \(4 of 6 samples waiting\)"):
        b.submit(rows(0, 3))
    with pytest.raises(ValueError, match="5 samples exceeds max_batch_size=4"):
        b.submit(rows(0, 5))
    b.step()
    b.submit(rows(0, 3))  # room again once the batch ran


def test_requests_past_their_timeout_are_dropped_not_run():
    clock, model = FakeClock(), Recorder()
    b = Batcher(model, BatchConfig(timeout_s=1.0), clock=clock, start=False)
    stale = b.submit(rows(0, 1))
    clock.now = 1.5
    fresh = b.submit(rows(0, 1))
    b.step()
    with pytest.raises(RequestTimeout, match="waited 1.5 s in the queue"):
        stale.result(0)
    assert fresh.result(0)["y"].shape == (1, 2) and model.sizes == [1]


def test_infer_times_out_and_cancels_its_request():
    release = threading.Event()
    b = Batcher(lambda x: release.wait(5) and {"y": x["x"]}, BatchConfig(max_batch_size=2))
    blocker = b.submit(rows(0, 1))  # occupies the model
    with pytest.raises(RequestTimeout, match="no result within 0.05 s"):
        b.infer(rows(0, 1), timeout=0.05)
    release.set()
    assert blocker.result(5)["y"].shape == (1, 2)
    b.close(5)


def test_infer_async_awaits_the_worker_without_blocking_the_loop():
    release, model = threading.Event(), Recorder()
    # the model waits for the loop itself: a blocked loop would never release it
    b = Batcher(lambda x: release.wait(5) and model(x), BatchConfig(max_batch_size=16))

    async def scenario():
        requests = [asyncio.create_task(b.infer_async(rows(10 * i, 1 + i % 3))) for i in range(20)]
        await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(*requests)

    outs = asyncio.run(scenario())
    b.close(5)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], rows(10 * i, 1 + i % 3)["x"] * 2)
    assert sum(model.sizes) == sum(1 + i % 3 for i in range(20))


def test_infer_async_times_out_and_cancels_its_queued_request():
    release, model = threading.Event(), Recorder()
    b = Batcher(lambda x: release.wait(5) and model(x), BatchConfig(max_batch_size=1))

    async def scenario():
        blocker = b.submit(rows(0, 1))  # occupies the model
        with pytest.raises(RequestTimeout, match="model 'model': no result within 0.05 s"):
            await b.infer_async(rows(5, 1), timeout=0.05)
        abandoned = asyncio.create_task(b.infer_async(rows(7, 1)))
        await asyncio.sleep(0.01)
        abandoned.cancel()  # the caller went away: its request leaves the queue too
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        release.set()
        return await asyncio.wrap_future(blocker)

    assert asyncio.run(scenario())["y"].shape == (1, 2)
    b.close(5)
    assert model.sizes == [1]  # neither the timed-out nor the cancelled request ran


def test_infer_async_raises_the_batch_failure():
    def fragile(inputs):
        raise RuntimeError("no physics today")

    b = Batcher(fragile, BatchConfig())
    with pytest.raises(BatchFailed, match="failed on a batch of 1 samples: RuntimeError: no physics today"):
        asyncio.run(b.infer_async(rows(0, 1), timeout=5))
    b.close(5)


def test_close_finishes_queued_requests_then_refuses_new_ones():
    # a 10 s delay: only shutdown can make these run now
    b = Batcher(Recorder(), BatchConfig(max_batch_size=64, max_queue_delay_us=10_000_000))
    futures = [b.submit(rows(i, 1)) for i in range(5)]
    b.close(5)
    assert [f.result(0)["y"][0, 0] for f in futures] == [0, 2, 4, 6, 8]
    with pytest.raises(ShuttingDown, match="shutting down"):
        b.submit(rows(0, 1))
    unstarted = Batcher(Recorder(), BatchConfig(), start=False)
    f = unstarted.submit(rows(0, 1))
    unstarted.close()
    assert f.result(0)["y"].shape == (1, 2)


def test_metrics_callback_errors_do_not_stop_the_worker():
    def broken(record):
        raise RuntimeError("metrics down")

    b = Batcher(Recorder(), BatchConfig(), on_batch=broken)
    assert b.infer(rows(0, 1), timeout=5)["y"].shape == (1, 2)
    b.close(5)


@pytest.mark.parametrize("kw, message", [
    ({"max_batch_size": 0}, "max_batch_size=0: must be >= 1"),
    ({"max_queue_delay_us": -1}, "must be >= 0"),
    ({"max_batch_size": 8, "max_queue_size": 4}, "max_queue_size=4: must be >= max_batch_size=8"),
    ({"timeout_s": 0}, "timeout_s=0: must be > 0"),
])
def test_batch_config_is_validated(kw, message):
    with pytest.raises(ValueError, match=message):
        BatchConfig(**kw)


def test_deadlines_expire_in_order_with_one_timer_and_spare_the_answered():
    from converge.serve.batcher import Deadlines

    async def scenario():
        loop = asyncio.get_running_loop()
        deadlines, expired = Deadlines(loop), []
        waiters = [loop.create_future() for _ in range(4)]
        start = loop.time()
        for i, w in enumerate(waiters[:3]):
            deadlines.add(start + 0.05 * (i + 1), w, lambda i=i: expired.append((i, loop.time() - start)))
        first_timer = deadlines.timer
        waiters[1].set_result("answered")  # answered before its deadline: never expired
        deadlines.add(start + 0.01, waiters[3], lambda: expired.append((3, loop.time() - start)))  # out of order
        assert deadlines.timer is first_timer and len(deadlines.entries) == 3  # one timer for the ordered ones
        await asyncio.sleep(0.25)
        return expired, deadlines

    expired, deadlines = asyncio.run(scenario())
    assert [i for i, _ in expired] == [3, 0, 2]
    for (i, t), due in zip(expired, (0.01, 0.05, 0.15)):
        assert due <= t < due + 0.05, (i, t)
    assert not deadlines.entries and deadlines.timer is None
