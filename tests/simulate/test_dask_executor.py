"""The Dask executor against the local pool, on the oscillator app of test_runner.

Every run here must give the dataset the local pool gives: the same shard bytes
and manifest entries (hashes, failure records). Clusters are LocalClusters of two
single-threaded worker processes without a dashboard.
"""
from __future__ import annotations

import ast
import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from converge.config import ConfigError, from_dict
from converge.data.store import ShardStore
from converge.simulate import dask_executor
from converge.simulate.dask_executor import WORKER_ENVIRON, batch_cluster, sample_keys
from converge.simulate.executors import ClusterConfig
from converge.simulate.runner import WORKER_DIED, SimulateConfig, run_ensemble
from converge.simulate.sample import SampleJob
from tests.simulate.test_runner import SAMPLES, SHARD_SIZE, OscillatorApp, OscillatorConfig, tree_bytes
from tests.simulate.test_runner import baseline  # noqa: F401  (the local pool's dataset, a fixture)

KILLER_FREQUENCY = 1.85  # samples 3 and 19 of seed 7 lie above it


def simulate(out: Path, executor: str = "dask", address: str = "", retries: int = 2, **app_options: Any):
    cfg = SimulateConfig(samples=SAMPLES, seed=7, shard_size=SHARD_SIZE, workers=2, retries=retries,
                         executor=executor, scheduler_address=address)
    return run_ensemble(OscillatorApp(), OscillatorConfig(**app_options), cfg, out, progress=False)


def shard_entries(root: Path) -> list[dict[str, Any]]:
    return json.loads((root / "manifest.json").read_text())["shards"]


def shard_bytes(root: Path) -> dict[str, bytes]:
    return tree_bytes(root / "shards")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LocalCluster, Client]]:
    """A running scheduler that charges a task for its second dying worker (KilledWorker) to keep tests short."""
    settings = {"distributed.scheduler.allowed-failures": 1, "distributed.scheduler.worker-saturation": 1.0,
                "distributed.deploy.lost-worker-timeout": "1 hour"}  # read on each death: keep restarting them
    with (dask.config.set(settings),
          LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                       silence_logs=logging.CRITICAL) as made,
          Client(made) as client):
        yield made, client


def both_workers_up(client: Client) -> None:
    client.wait_for_workers(2, timeout=120)


def test_dask_gives_the_local_pools_dataset_byte_for_byte(baseline: Path, tmp_path: Path) -> None:  # noqa: F811
    result = simulate(tmp_path)  # a LocalCluster of its own
    assert result.complete and result.n_ok == SAMPLES
    assert [e["sha256"] for e in shard_entries(tmp_path)] == [e["sha256"] for e in shard_entries(baseline)]
    assert tree_bytes(tmp_path) == tree_bytes(baseline)  # the manifest too: the executor is not recorded


def test_a_running_scheduler_can_be_used(baseline: Path, tmp_path: Path, cluster) -> None:  # noqa: F811
    result = simulate(tmp_path, address=cluster[0].scheduler_address)
    assert result.complete and tree_bytes(tmp_path) == tree_bytes(baseline)


def test_app_exceptions_are_recorded_as_on_the_local_pool(tmp_path: Path, cluster) -> None:
    simulate(tmp_path / "local", executor="local", fail_above=1.5)
    result = simulate(tmp_path / "dask", address=cluster[0].scheduler_address, fail_above=1.5)
    assert 0 < result.n_failed < SAMPLES
    assert all(f["error"].startswith("ValueError: frequency ") and f["params"] for f in result.failures)
    assert tree_bytes(tmp_path / "dask") == tree_bytes(tmp_path / "local")


def test_a_sample_that_fails_once_is_stored_on_its_dask_retry(baseline: Path, tmp_path: Path,  # noqa: F811
                                                              cluster) -> None:
    result = simulate(tmp_path / "data", address=cluster[0].scheduler_address, flaky_dir=str(tmp_path))
    assert result.n_ok == SAMPLES and result.n_failed == 0
    assert len(list(tmp_path.glob("*.*"))) == SAMPLES  # every sample did fail once
    assert shard_bytes(tmp_path / "data") == shard_bytes(baseline)


def test_a_worker_killed_mid_run_costs_only_its_task(baseline: Path, tmp_path: Path, cluster) -> None:  # noqa: F811
    made, client = cluster
    both_workers_up(client)
    killed: list[int] = []

    def kill_a_busy_worker() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [address for address, keys in client.processing().items() if keys]
            if busy:
                pid = client.run(os.getpid, workers=busy[:1])[busy[0]]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_a_busy_worker)
    killer.start()
    result = simulate(tmp_path, address=made.scheduler_address, sleep_s=0.2)  # 20 x 0.2 s on two workers
    killer.join()
    assert killed, "no worker was busy to kill"
    assert result.complete and result.n_ok == SAMPLES and result.n_failed == 0
    assert shard_bytes(tmp_path) == shard_bytes(baseline)  # sleep_s changes only the manifest's app_config
    assert shard_entries(tmp_path) == shard_entries(baseline)
    both_workers_up(client)
    assert killed[0] not in client.run(os.getpid).values()  # its nanny started a new one


def test_a_sample_that_keeps_killing_workers_is_recorded_alone(baseline: Path, tmp_path: Path,  # noqa: F811
                                                               cluster) -> None:
    both_workers_up(cluster[1])
    result = simulate(tmp_path, address=cluster[0].scheduler_address, kill_above=KILLER_FREQUENCY)
    assert [f["index"] for f in result.failures] == [3, 19]  # not 18, which ran beside 19 at the end
    assert all(f["error"] == WORKER_DIED for f in result.failures)
    assert result.failures[0]["params"]["frequency"] > KILLER_FREQUENCY  # drawn again by the client
    kept = np.setdiff1d(np.arange(SAMPLES), [3, 19])
    np.testing.assert_array_equal(ShardStore.open(tmp_path).load()["x"], ShardStore.open(baseline).load()["x"][kept])
    both_workers_up(cluster[1])


def worker_threads() -> tuple[str | None, ...]:
    import torch

    return (*(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")),
            str(torch.get_num_threads()))


def test_workers_it_starts_run_one_thread_with_glibcs_malloc_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the client's own setting does not reach the workers
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with dask_executor.dask_client("local", "", 1, ClusterConfig()) as run:
        assert run.planned_threads == 1 and sum(run.client.nthreads().values()) == 1
        assert list(run.client.run(worker_threads).values()) == [("1", "1", None, "1")]
    assert os.environ["OMP_NUM_THREADS"] == "4" and "MALLOC_TRIM_THRESHOLD_" not in os.environ


def test_task_keys_are_a_hash_of_what_makes_the_sample() -> None:
    job = SampleJob(OscillatorApp, OscillatorConfig(), {"x": {"shape": [32], "dtype": "float32"}}, 7, 2)
    key = sample_keys(job)
    assert key(3) == sample_keys(job._replace(retries=0))(3)  # how often to try is not what it is
    others = {key(4), sample_keys(job._replace(seed=8))(3), sample_keys(job._replace(app_cfg=OscillatorConfig(
        n_times=16)))(3)}
    assert key(3).startswith("simulate_sample-") and key(3) not in others and len(others) == 3


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")  # the scheduler's default dashboard port
def test_batch_jobs_run_one_single_threaded_worker_per_core() -> None:
    cfg = ClusterConfig(queue="short", account="proj42", cores=4, memory="16GB", walltime="01:00:00",
                        job_extra_directives=("--constraint=cpu",), job_script_prologue=("module load python",))
    made = batch_cluster("slurm", cfg)  # builds the job script; submits nothing
    try:
        script = made.job_script()
    finally:
        made.close()
    for line in ("#SBATCH -p short", "#SBATCH -A proj42", "#SBATCH --cpus-per-task=4", "#SBATCH -t 01:00:00",
                 "#SBATCH --constraint=cpu", "export OMP_NUM_THREADS=1", "module load python"):
        assert line in script
    assert "--nthreads 1" in script and "--nworkers 4" in script
    environ = next(line for line in script.splitlines() if "PRE_SPAWN_ENVIRON" in line)  # as for local workers
    value = subprocess.run(["bash", "-c", environ + ' && echo "$DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON"'],
                           capture_output=True, text=True, check=True).stdout
    assert ast.literal_eval(value.strip()) == WORKER_ENVIRON


def test_config_errors_name_the_key_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^simulate\.executor='spark': choose one of 'local', 'dask'"):
        SimulateConfig(executor="spark")
    with pytest.raises(ConfigError, match=r"^simulate\.cluster='k8s': choose one of 'local', 'slurm', 'pbs'"):
        SimulateConfig(executor="dask", cluster="k8s")
    with pytest.raises(ConfigError, match=r"^simulate\.scheduler_address='tcp://h:8786' needs simulate\.executor"):
        SimulateConfig(scheduler_address="tcp://h:8786")
    with pytest.raises(ConfigError, match=r"^simulate\.cluster='slurm' needs simulate\.executor=\"dask\""):
        from_dict(SimulateConfig, {"cluster": "slurm"}, "simulate")
    with pytest.raises(ConfigError, match=r"scheduler_address=.* and simulate\.cluster='pbs' both say"):
        SimulateConfig(executor="dask", cluster="pbs", scheduler_address="tcp://h:8786")
    with pytest.raises(ConfigError, match=r"^simulate\.scheduler_address='tcp://h :8786': .*without spaces"):
        SimulateConfig(executor="dask", scheduler_address="tcp://h :8786")
    with pytest.raises(ConfigError, match=r"^cluster\.cores=-1: must be >= 0"):
        ClusterConfig(cores=-1)
    with pytest.raises(ConfigError, match=r"^cluster\.minimum_jobs=3 exceeds cluster\.maximum_jobs=2"):
        from_dict(ClusterConfig, {"minimum_jobs": "3", "maximum_jobs": "2"}, "cluster")
    with pytest.raises(ConfigError, match=r"^cluster\.memory='lots': .*like \"64GB\""):
        ClusterConfig(memory="lots")
    with pytest.raises(ConfigError, match=r"^cluster\.walltime='2h': write it as HH:MM:SS"):
        ClusterConfig(walltime="2h")
    with pytest.raises(ConfigError, match=r"unknown key cluster\.nodes; valid keys in \[cluster\]"):
        from_dict(ClusterConfig, {"nodes": 2}, "cluster")
    slurm = SimulateConfig(samples=2, executor="dask", cluster="slurm")
    with pytest.raises(ConfigError, match=r"^cluster\.cores is required with simulate\.cluster='slurm'.*\[cluster\]"):
        run_ensemble(OscillatorApp(), OscillatorConfig(), slurm, tmp_path / "data", progress=False)
    with pytest.raises(ConfigError, match=r"^cluster\.memory is required with simulate\.cluster='slurm'"):
        run_ensemble(OscillatorApp(), OscillatorConfig(), slurm, tmp_path / "data", progress=False,
                     cluster_cfg=ClusterConfig(cores=8))
    assert not (tmp_path / "data").exists()  # refused before anything was written


def test_an_unreachable_scheduler_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dask_executor, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(ConnectionError, match=r"simulate\.scheduler_address='tcp://127\.0\.0\.1:9'.*`dask scheduler`"):
        simulate(tmp_path, address="tcp://127.0.0.1:9")
    assert ShardStore.open(tmp_path).missing_shards() == [0, 1, 2, 3]  # resumable, nothing lost
