"""converge against a real Slurm: a single-node cluster on this machine, three checks, timed.

    .venv/bin/python benchmarks/slurm_check.py          # about 2 minutes; merges "slurm" into scale.json
    .venv/bin/python benchmarks/slurm_check.py --out /tmp/slurm.json

The cluster is Debian's slurm-wlm, started (and installed with apt if missing, as
root) by scripts/slurm/localhost-cluster.sh; one already running is used and left
running. tests/slurm asserts the same checks, through the same functions:

- ensemble: ``converge simulate gw --executor dask --cluster slurm`` (dask-jobqueue,
  one 1-core worker job) gives the local pool's dataset (one worker) byte for byte;
- ddp: the sbatch + torchrun script of docs/cluster.md, as the doc has it, run with
  sbatch options and environment for one node: 2 DDP ranks, Gloo on the CPU;
- scancel: ``converge simulate`` as a batch job (with its worker job) cancelled
  midway, then the same sbatch again: the rerun skips the shards already written
  and ends with the local pool's dataset. Also: cancelling only the worker job
  midway, the same run gets another job and finishes with that dataset.

Wall times count from submission (or the command's start) to the end, job start-up
included; they describe this small cluster, not a cluster's throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CLUSTER_SCRIPT = REPO / "scripts" / "slurm" / "localhost-cluster.sh"
CLUSTER_DOC = REPO / "docs" / "cluster.md"
DEFAULT_DIR = Path(os.environ.get("CONVERGE_SLURM_DIR", "/tmp/converge-slurm"))
CANNOT_INSTALL = 3  # the cluster script's exit status when Slurm is missing and cannot be installed
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
JOB_TIMEOUT_S = 300
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here (not root, no apt, apt failed)."""


class LocalSlurm:
    """The single-node cluster of scripts/slurm/localhost-cluster.sh, whose files are under ``state_dir``."""

    def __init__(self, state_dir: Path = DEFAULT_DIR) -> None:
        self.state_dir = Path(state_dir)
        self.env = {**os.environ, **THREAD_ENV, "SLURM_CONF": str(self.state_dir / "slurm.conf")}

    def script(self, action: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(CLUSTER_SCRIPT), action, str(self.state_dir)], capture_output=True,
                              text=True, timeout=timeout)

    def answers(self) -> bool:
        return self.script("status").returncode == 0

    def start(self) -> None:
        """Start the cluster (installing Slurm if missing); :class:`SlurmUnavailable` if it cannot be."""
        try:
            done = self.script("start", timeout=900)  # a fresh apt install takes minutes on a slow mirror
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{CLUSTER_SCRIPT.name} start (apt-get install) ran past 900 s") from None
        if done.returncode == CANNOT_INSTALL:
            raise SlurmUnavailable(done.stderr.strip().splitlines()[-1].removeprefix("localhost-cluster: "))
        if done.returncode:
            raise RuntimeError(f"{CLUSTER_SCRIPT.name} start failed:\n{done.stderr.strip()}")

    def stop(self) -> None:
        self.script("stop").check_returncode()

    def command(self, *args: str, timeout: float = 30) -> str:
        return subprocess.run(args, capture_output=True, text=True, check=True, env=self.env,
                              timeout=timeout).stdout.strip()

    def version(self) -> str:
        return self.command("sinfo", "--version").split()[-1]  # "slurm-wlm 22.05.8"

    def partition(self) -> str:
        return self.command("sinfo", "--noheader", "--format=%R").splitlines()[0]

    def cpus(self) -> int:
        return int(self.command("sinfo", "--noheader", "--format=%c").splitlines()[0])

    def wait_until_idle(self, timeout: float = 60) -> None:
        """Until no job is queued and the node shows ``idle`` (jobs of an earlier check may still be ending)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.command("squeue", "--noheader") and self.command(
                    "sinfo", "--noheader", "--format=%t") == "idle":
                return
            time.sleep(0.25)
        raise TimeoutError(f"the Slurm node is not idle after {timeout} s:\n{self.command('squeue')}")

    def submit(self, script: Path, *options: str, env: dict[str, str] | None = None) -> int:
        return int(subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True, text=True,
                                  check=True, env={**self.env, **(env or {})}).stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> tuple[str, str]:
        """(JobState, ExitCode) of a job the controller still holds (MinJobAge in slurm.conf)."""
        record = self.command("scontrol", "--oneliner", "show", "job", str(job_id))
        fields = dict(re.findall(r"(\w+)=(\S+)", record))
        return fields["JobState"], fields["ExitCode"]

    def wait_for_job(self, job_id: int, timeout: float = JOB_TIMEOUT_S) -> tuple[str, str]:
        """Poll until the job ends (sbatch --wait polls with backoff: it adds up to half a minute)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state[0] in ENDED:
                return state
            time.sleep(0.25)
        raise TimeoutError(f"job {job_id} still {state[0]} after {timeout} s")

    def jobs_named(self, *names: str) -> list[int]:
        listed = self.command("squeue", "--noheader", "--format=%i", f"--name={','.join(names)}")
        return [int(job) for job in listed.split()]


# -- ensembles ----------------------------------------------------------------------------
class Ensemble(NamedTuple):
    """A gw ensemble small enough for a 2-core machine: 300 samples in 15 shards."""

    samples: int = 300
    shard_size: int = 20
    seed: int = 11

    @property
    def n_shards(self) -> int:
        return -(-self.samples // self.shard_size)

    def command(self, out: Path, *options: str) -> list[str]:
        return [sys.executable, "-m", "converge", "simulate", "gw", "--samples", str(self.samples),
                "--shard-size", str(self.shard_size), "--seed", str(self.seed), "--out", str(out), *options]


def same_dataset(a: Path, b: Path) -> bool:
    """The same manifest (shard hashes, failures, header) and the same shard files, byte for byte."""
    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    return (a / "manifest.json").is_file() and files(a) == files(b)


def complete_shards(out: Path) -> int:
    """Shard files written so far (temp files of writes in progress start with a dot)."""
    return len(list((out / "shards").glob("shard-*.h5"))) if (out / "shards").is_dir() else 0


def run_converge(command: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    """Run a converge command to its end; its wall time (s), or its stderr in a RuntimeError."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=JOB_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def simulate_on_local_pool(ensemble: Ensemble, out: Path) -> float:
    """The reference dataset: the local pool, one worker. Returns the wall time (s)."""
    return run_converge(ensemble.command(out, "--workers", "1"), {**os.environ, **THREAD_ENV})


def write_cluster_config(path: Path, partition: str, logs: Path) -> Path:
    """The [cluster] table: one 1-core worker job on ``partition``; its Slurm output in ``logs``."""
    path.write_text(
        "[cluster]\n"
        f'queue = "{partition}"\ncores = 1\nmemory = "1GB"\nwalltime = "00:10:00"\nmaximum_jobs = 1\n'
        f'job_extra_directives = ["--output={logs}/dask-worker-%j.out"]\n'
    )
    return path


def worker_jobs_run(logs: Path) -> list[int]:
    """The ids of the worker jobs that ran, from their output files."""
    return sorted(int(p.stem.split("-")[-1]) for p in logs.glob("dask-worker-*.out"))


def check_ensemble(slurm: LocalSlurm, work: Path, ensemble: Ensemble, reference: Path) -> dict[str, Any]:
    """``converge simulate --executor dask --cluster slurm``, uninterrupted, against the local pool's dataset."""
    work.mkdir(parents=True, exist_ok=True)
    config = write_cluster_config(work / "cluster.toml", slurm.partition(), work)
    out = work / "data"
    wall = run_converge(ensemble.command(out, "--executor", "dask", "--cluster", "slurm", "--config", str(config)),
                        slurm.env, cwd=work)
    return {"ensemble_hashes_equal_local": same_dataset(out, reference), "wall_s": wall,
            "worker_jobs": worker_jobs_run(work)}


def cancel_midway(slurm: LocalSlurm, out: Path, n_shards: int, job_names: tuple[str, ...],
                  running: Callable[[], bool]) -> dict[str, Any]:
    """Once the first shard is written, scancel the jobs named ``job_names``; return when they are gone.

    ``running`` says whether the run still runs: one that ended before its first shard is an error.
    """
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while complete_shards(out) < 1:
        if not running():
            raise RuntimeError(f"the run ended before it wrote a shard of {out}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no shard in {out} after {JOB_TIMEOUT_S} s")
        time.sleep(0.05)
    jobs = slurm.jobs_named(*job_names)
    slurm.command("scancel", *map(str, jobs))
    while set(jobs) & set(slurm.jobs_named(*job_names)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs {jobs} still queued after scancel")
        time.sleep(0.25)
    written = complete_shards(out)
    if written >= n_shards:
        raise RuntimeError(f"scancel came too late to interrupt anything: all {n_shards} shards were written")
    return {"cancelled_jobs": jobs, "shards_at_cancel": written}


def check_scancel_of_everything(slurm: LocalSlurm, work: Path, ensemble: Ensemble, reference: Path) -> dict[str, Any]:
    """``converge simulate`` as a batch job, it and its worker job scancelled midway, then resubmitted."""
    work.mkdir(parents=True, exist_ok=True)
    config = write_cluster_config(work / "cluster.toml", slurm.partition(), work)
    out = work / "data"
    simulate = shlex.join(ensemble.command(out, "--executor", "dask", "--cluster", "slurm", "--config", str(config)))
    script = work / "simulate.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=converge-simulate\n#SBATCH --cpus-per-task=1\n#SBATCH --time=00:10:00\n"
        f"#SBATCH --output={work}/simulate-%j.out\ncd {shlex.quote(str(work))}\nexec {simulate}\n"
    )
    start = time.perf_counter()
    first = slurm.submit(script)
    cancelled = cancel_midway(slurm, out, ensemble.n_shards, ("converge-simulate", "dask-worker"),
                              running=lambda: slurm.job_state(first)[0] not in ENDED)
    first_s = time.perf_counter() - start
    shards_kept = cancelled["shards_at_cancel"]
    rerun = slurm.submit(script)
    state = slurm.wait_for_job(rerun)
    log = (work / f"simulate-{rerun}.out").read_text()
    skipped = re.search(r"(\d+) shards computed, (\d+) already complete", " ".join(log.split()))
    resumed = (state == ("COMPLETED", "0:0") and skipped is not None
               and (int(skipped[1]), int(skipped[2])) == (ensemble.n_shards - shards_kept, shards_kept))
    return {"resumed_after_scancel": resumed and same_dataset(out, reference), "first_run_s": first_s,
            "rerun_s": time.perf_counter() - start - first_s, **cancelled,
            "rerun_job": rerun, "rerun_state": list(state), "rerun_said": skipped[0] if skipped else None}


def check_scancel_of_the_worker(slurm: LocalSlurm, work: Path, ensemble: Ensemble, reference: Path) -> dict[str, Any]:
    """Only the worker job scancelled midway: the same ``converge simulate`` gets another job and finishes."""
    work.mkdir(parents=True, exist_ok=True)
    config = write_cluster_config(work / "cluster.toml", slurm.partition(), work)
    out = work / "data"
    start = time.perf_counter()
    run = subprocess.Popen(ensemble.command(out, "--executor", "dask", "--cluster", "slurm", "--config", str(config)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=slurm.env, cwd=work)
    try:
        cancelled = cancel_midway(slurm, out, ensemble.n_shards, ("dask-worker",), running=lambda: run.poll() is None)
        _, err = run.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    if run.returncode:
        raise RuntimeError(f"converge simulate exited {run.returncode} after its worker job was cancelled:\n{err}")
    jobs = worker_jobs_run(work)
    return {"worker_job_replaced_after_scancel": len(jobs) >= 2 and same_dataset(out, reference),
            "wall_s": time.perf_counter() - start, **cancelled, "worker_jobs": jobs}


# -- DDP training ------------------------------------------------------------------------
def doc_sbatch_script(doc: Path = CLUSTER_DOC) -> str:
    """The sbatch script of docs/cluster.md: its one ``bash`` block that holds ``#SBATCH`` lines."""
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S) if "#SBATCH" in b]
    if len(blocks) != 1:
        raise ValueError(f"{doc} has {len(blocks)} bash blocks with #SBATCH lines; expected the one training script")
    return blocks[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DDP_RANKS, DDP_EPOCHS, DDP_BATCH = 2, 2, 16
DDP_DATA = Ensemble(samples=64, shard_size=32, seed=5)
DDP_TRAIN_OPTIONS = f"--epochs {DDP_EPOCHS} --batch-size {DDP_BATCH}"


def check_ddp(slurm: LocalSlurm, work: Path) -> dict[str, Any]:
    """docs/cluster.md's script on one node, 2 ranks on the CPU, a 64-sample gw dataset, 2 epochs."""
    work.mkdir(parents=True, exist_ok=True)
    data, run = work / "data", work / "run"
    simulate_on_local_pool(DDP_DATA, data)
    script = work / "train.sbatch"
    script.write_text(doc_sbatch_script())
    env = {"VENV": sys.prefix, "RANKS_PER_NODE": str(DDP_RANKS), "DATA": str(data), "RUN": str(run),
           "RDZV_PORT": str(free_port()), "TRAIN_OPTIONS": DDP_TRAIN_OPTIONS}
    options = ("--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={min(DDP_RANKS, slurm.cpus())}", "--time=00:10:00")
    start = time.perf_counter()
    job = slurm.submit(script, *options, f"--output={work}/train-%j.out", env=env)
    state = slurm.wait_for_job(job)
    wall = time.perf_counter() - start
    log = " ".join((work / f"train-{job}.out").read_text().split())
    epochs = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    completed = (state == ("COMPLETED", "0:0") and f"DDP over {DDP_RANKS} processes" in log
                 and len(epochs) == DDP_EPOCHS and (run / "last.pt").is_file())
    return {"ddp_sbatch_completed": completed, "wall_s": wall, "job": job, "state": list(state),
            "epochs_written": len(epochs), "sbatch_options": list(options)}


# -- the benchmark -----------------------------------------------------------------------
def measure(slurm: LocalSlurm, work: Path, ensemble: Ensemble = Ensemble()) -> dict[str, Any]:
    from converge.bench.machine import describe_machine

    reference = work / "local"
    local_s = simulate_on_local_pool(ensemble, reference)
    checks = {}
    for name, check in (("ensemble", check_ensemble), ("scancel", check_scancel_of_everything),
                        ("scancel_worker", check_scancel_of_the_worker)):
        slurm.wait_until_idle()
        checks[name] = check(slurm, work / name, ensemble, reference)
    slurm.wait_until_idle()
    checks["ddp"] = check_ddp(slurm, work / "ddp")
    return {
        "ensemble_hashes_equal_local": checks["ensemble"]["ensemble_hashes_equal_local"],
        "ddp_sbatch_completed": checks["ddp"]["ddp_sbatch_completed"],
        "resumed_after_scancel": checks["scancel"]["resumed_after_scancel"],
        "worker_job_replaced_after_scancel": checks["scancel_worker"]["worker_job_replaced_after_scancel"],
        "wall_s": {
            "ensemble_local_pool": local_s, "ensemble_slurm": checks["ensemble"]["wall_s"],
            "ddp_sbatch": checks["ddp"]["wall_s"], "scancel_first_run": checks["scancel"]["first_run_s"],
            "scancel_rerun": checks["scancel"]["rerun_s"], "scancel_worker_run": checks["scancel_worker"]["wall_s"],
        },
        "checks": checks,
        "ensemble": {"app": "gw", **ensemble._asdict(), "local_pool_workers": 1, "slurm_worker_jobs": "1 x 1 core"},
        "ddp": {"app": "gw", "ranks": DDP_RANKS, "train_options": DDP_TRAIN_OPTIONS, "samples": DDP_DATA.samples,
                "backend": "gloo (CPU)", "script": "docs/cluster.md, its sbatch block as written"},
        "slurm_version": slurm.version(),
        "cluster": "one node (this machine, localhost), started by scripts/slurm/localhost-cluster.sh",
        "note": "wall times include job start-up and polling every 0.25 s; slurm runs one 1-core worker job, "
                "the local pool one worker",
        "machine": describe_machine(),
    }


def save(result: dict[str, Any], path: Path) -> None:
    """Put ``result`` under "slurm" in the JSON file at ``path``, keeping its other keys."""
    from converge.bench.artifacts import write_json

    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged["slurm"] = result
    write_json(path, merged)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json", help="JSON file to merge into")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_DIR, help="the cluster's files")
    args = parser.parse_args()
    slurm = LocalSlurm(args.state_dir)
    started = not slurm.answers()
    try:
        if started:
            slurm.start()
        with tempfile.TemporaryDirectory(prefix="converge-slurm-check-") as work:
            result = measure(slurm, Path(work))
    except SlurmUnavailable as err:
        print(f"no Slurm here: {err}", file=sys.stderr)
        return 1
    finally:
        if started:
            slurm.stop()
    save(result, args.out)
    keys = ("ensemble_hashes_equal_local", "ddp_sbatch_completed", "resumed_after_scancel",
            "worker_job_replaced_after_scancel", "wall_s", "slurm_version")
    print(json.dumps({k: result[k] for k in keys}, indent=2))
    print(f"saved under 'slurm' in {args.out}", file=sys.stderr)
    return 0 if all(result[k] for k in keys[:4]) else 1


if __name__ == "__main__":
    sys.exit(main())
