"""The ``converge`` command line: parse, load config, call the library.

Every command takes ``--config FILE`` (TOML with [app], [simulate], [train],
[evaluate], [detect] tables) and ``--set section.key=value`` overrides; the
named flags override both. The resolved config is saved with every output.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 OpenMP threads on 2 vCPUs stalled FFTs 40x here

import typer
from rich.console import Console
from rich.markup import escape

from .config import ConfigError, check_sections, load_section, parse_overrides, read_toml
from .data.store import StoreError

SECTIONS = {"app", "simulate", "cluster", "train", "evaluate", "learn"}
console = Console(stderr=True)
cli = typer.Typer(
    help="converge: turn an expensive simulation into a trusted neural surrogate.\n\n"
    "Pipeline: simulate -> train -> evaluate (surrogate vs classical baseline) -> serve / predict; apps add "
    "commands of their own (converge VERB APP, e.g. detect gw).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts hold [app], [train] ... literally
)

ConfigOpt = typer.Option(None, "--config", "-c", help="TOML config file with [app], [simulate], [cluster], [train], ... tables.")
SetOpt = typer.Option(None, "--set", help="Override one key: section.key=value (repeatable), e.g. train.lr=0.001.")


def _tables(config: Optional[Path], sets: Optional[list[str]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    tables = read_toml(config)
    check_sections(tables, SECTIONS)
    overrides = parse_overrides(sets)
    check_sections(overrides, SECTIONS)
    return tables, overrides


def _fail(message: str, code: int = 2) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun, every rank fails alike; one says why
        console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)  # not markup; paths unwrapped
    raise typer.Exit(code)


def _threads() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


@cli.command("apps")
def apps_cmd() -> None:
    """List the installed apps (the `converge.apps` entry-point group)."""
    from .contract import available_apps

    for name, ep in sorted(available_apps().items()):
        print(f"{name}\t{ep.value}")  # type: ignore[attr-defined]


@cli.command("simulate")
def simulate_cmd(
    app: str = typer.Argument(..., help="App name, e.g. gw."),
    out: Path = typer.Option(..., "--out", "-o", help="Dataset directory (created; resumed if present)."),
    samples: Optional[int] = typer.Option(None, "--samples", "-n", help="Number of samples to simulate."),
    seed: Optional[int] = typer.Option(None, help="Seed: same seed, same dataset, byte for byte."),
    workers: Optional[int] = typer.Option(None, "--workers", "-j",
                                          help="Worker processes on this machine (local pool or Dask LocalCluster)."),
    shard_size: Optional[int] = typer.Option(None, help="Samples per shard file."),
    repair: bool = typer.Option(False, help="Re-verify every shard and recreate corrupt or missing ones."),
    executor: Optional[str] = typer.Option(None, help="Where samples run: local (a process pool on this machine) "
                                           "or dask. The dataset is the same byte for byte either way."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Dask: use the running scheduler at ADDRESS "
                                            "(e.g. tcp://10.0.0.5:8786) instead of starting a cluster."),
    cluster: Optional[str] = typer.Option(None, help="Dask: start a LocalCluster of --workers processes (local), or "
                                          "SLURM/PBS batch jobs (slurm|pbs) set by the [cluster] table of --config "
                                          "(see docs/cluster.md)."),
    config: Optional[Path] = ConfigOpt,
    sets: Optional[list[str]] = SetOpt,
) -> None:
    """Run an ensemble of the app's simulator into a sharded dataset.

    Interrupted runs resume: run the same command again and only missing shards
    are computed. A larger --samples grows a finished dataset by the new samples
    only. Failed samples are retried, then recorded, and the command exits with
    status 1 naming them.
    """
    from .contract import load_app
    from .simulate.executors import ClusterConfig
    from .simulate.runner import SimulateConfig, run_ensemble

    try:
        tables, ov = _tables(config, sets)
        application = load_app(app)
        app_cfg = load_section(application.config_cls, tables, "app", ov.get("app"))
        sim_cfg = load_section(SimulateConfig, tables, "simulate", {
            **ov.get("simulate", {}), "samples": samples, "seed": seed, "workers": workers, "shard_size": shard_size,
            "executor": executor, "scheduler_address": scheduler, "cluster": cluster})
        cluster_cfg = load_section(ClusterConfig, tables, "cluster", ov.get("cluster"))
    except (ConfigError, KeyError) as err:
        _fail(str(err).strip("'\""))
    try:
        result = run_ensemble(application, app_cfg, sim_cfg, out, progress=True, repair=repair,
                              cluster_cfg=cluster_cfg)
    except (StoreError, ConnectionError, ConfigError) as err:
        _fail(str(err))
    console.print(f"{result.n_ok} samples stored in {out} ({result.shards_computed} shards computed, "
                  f"{result.shards_skipped} already complete)")
    if result.n_failed:
        for f in result.failures[:10]:
            console.print(f"  sample {f['index']}: {f['error']}")
        _fail(f"{result.n_failed} sample(s) failed after retries; see {out}/manifest.json", code=1)


@cli.command("train")
def train_cmd(
    app: str = typer.Argument(..., help="App name, e.g. gw."),
    data: Optional[Path] = typer.Option(None, "--data", "-d", help="Dataset directory made by `converge simulate`."),
    out: Path = typer.Option(..., "--out", "-o", help="Run directory for checkpoints, metrics and config."),
    follow: Optional[Path] = typer.Option(None, "--follow", help="Instead of --data: a dataset an ensemble is still "
                                          "writing. Training starts once its first samples land and takes in new "
                                          "shards at every epoch start (the LR schedule is sized for the finished "
                                          "dataset). One process."),
    epochs: Optional[int] = typer.Option(None, help="Training epochs (default: the app's train_defaults, else 8; "
                                         "chem: 300 epochs, batch 16, lr 1e-3). Early stopping is off unless "
                                         "--set train.patience=N."),
    batch_size: Optional[int] = typer.Option(None, help="Samples per optimizer step, all processes together."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate of the one-cycle schedule."),
    precision: Optional[str] = typer.Option(None, help="auto | bf16 | fp16 | fp32: autocast precision (auto = the app default, measured: gw bf16, chem fp32; fp32 where the device has no bf16 units; fp16 uses a GradScaler)."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda | cuda:N."),
    resume: bool = typer.Option(False, help="Continue from OUT/last.pt (OUT/last.dcp/ with --shard) at the next "
                                "epoch, on any number of processes."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Processes on this machine: N > 1 re-launches this "
                                        "command through torchrun (python -m torch.distributed.run --standalone "
                                        "--nproc-per-node N) for data-parallel training: one GPU per process on "
                                        "CUDA, Gloo on the CPU. Across nodes, run `torchrun ... -m converge train "
                                        "...` on each node instead, without --nproc."),
    bucket_cap_mb: Optional[float] = typer.Option(None, "--bucket-cap-mb", help="DDP gradient bucket size in MB "
                                                  "(default 25): bigger buckets mean fewer, larger all-reduces, "
                                                  "less overlap with the backward pass."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-steps per optimizer step (default "
                                             "1). --batch-size stays the samples per optimizer step, split over "
                                             "processes and micro-steps; gradients are synchronised on the last "
                                             "micro-step only."),
    shard: Optional[bool] = typer.Option(None, "--shard/--no-shard", help="Shard parameters, gradients and "
                                         "optimizer state over the processes (FSDP2) instead of replicating them "
                                         "(DDP). Checkpoints become OUT/last.dcp/ directories "
                                         "(torch.distributed.checkpoint), loadable on any number of processes; "
                                         "needs bf16 or fp32."),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", help="Epochs between checkpoint "
                                                   "writes (default 1; the last epoch is always written). A kill "
                                                   "loses at most N-1 epochs; raise it when epochs are much "
                                                   "shorter than a checkpoint write (~40 ms for chem)."),
    ensemble: Optional[int] = typer.Option(None, "--ensemble", help="Train K members (seeds seed..seed+K-1: other "
                                           "initialisation and data order) into OUT/member-i/; predictions then "
                                           "carry the members' mean and spread. Resumes member by member."),
    config: Optional[Path] = ConfigOpt,
    sets: Optional[list[str]] = SetOpt,
) -> None:
    """Train the app's surrogate on a simulated dataset (AdamW, one-cycle LR, autocast, DDP or FSDP)."""
    from .contract import load_app
    from .data.store import ShardStore, sha256_file
    from .train.checkpoint import CheckpointError
    from .train.distributed import launched_by_torchrun, plan_steps
    from .train.loop import TrainConfig, train

    _threads()
    if (data is None) == (follow is None):
        _fail("give the dataset with --data DIR, or with --follow DIR for one still being simulated")
    follower = None
    if follow is not None:
        from .data.follow import DatasetFollower, FollowTimeout

        try:
            follower = DatasetFollower.wait(follow, report=console.print)
        except FollowTimeout as err:
            _fail(str(err))
        data = follow
    try:
        tables, ov = _tables(config, sets)
        application = load_app(app)
        store = ShardStore.open(data)
        app_tables = {"app": {**store.manifest["app_config"], **tables.get("app", {})}}
        app_cfg = load_section(application.config_cls, app_tables, "app", ov.get("app"))
        train_tables = {"train": {**application.train_defaults, **tables.get("train", {})}}  # the app's, then yours
        cfg = load_section(TrainConfig, train_tables, "train", {
            **ov.get("train", {}), "epochs": epochs, "batch_size": batch_size, "lr": lr,
            "precision": precision, "device": device, "bucket_cap_mb": bucket_cap_mb,
            "grad_accum_steps": grad_accum, "shard": shard, "checkpoint_every": checkpoint_every})
    except (ConfigError, KeyError, FileNotFoundError, ValueError, StoreError) as err:
        _fail(str(err).strip("'\""))
    if follow is not None and ((nproc or 1) > 1 or ensemble):
        _fail("--follow trains one model in one process: leave out --nproc and --ensemble")
    if ensemble is not None and (ensemble < 2 or (nproc or 1) > 1):
        _fail(f"--ensemble {ensemble}: give K >= 2 members, trained one after the other (without --nproc)")
    if nproc is not None:
        if nproc < 1:
            _fail(f"--nproc {nproc}: give the number of processes, >= 1")
        if launched_by_torchrun():
            _fail("--nproc re-launches the command through torchrun; under torchrun leave --nproc out")
        if nproc > 1:
            try:  # the ranks would all fail alike after starting
                plan_steps(len(store), cfg.batch_size, nproc, cfg.grad_accum_steps)
            except ConfigError as err:
                _fail(str(err))
            command = torchrun_command(sys.argv[1:], nproc)
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(command[0], command)  # torchrun runs this command again in every process
    try:
        arrays = follower.refresh() if follower else store.load()
    except (ValueError, StoreError) as err:
        _fail(str(err))
    main_rank = os.environ.get("RANK", "0") == "0"
    if main_rank:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        mode = ("FSDP" if cfg.shard else "DDP") + f" over {world} processes" if world > 1 or cfg.shard else "1 process"
        console.print(f"training {app} on {len(store)} samples from {data} -> {out} "
                      f"({cfg.precision}, {cfg.device}, {mode})")
    extra = {"data": str(data), "data_manifest_sha256": sha256_file(Path(data) / "manifest.json")}
    if ensemble:
        from .validate.ensemble import EnsembleError, train_ensemble

        try:
            record = train_ensemble(application, app_cfg, cfg, arrays, out, members=ensemble, progress=True,
                                    extra_config=extra)
            application.record_training_distribution(app_cfg, arrays, out)
        except (CheckpointError, ConfigError, EnsembleError, ValueError) as err:
            _fail(str(err))
        console.print(f"ensemble of {ensemble} members in {out}: {json.dumps(record.get('members', ''))[:200]}")
        return
    try:
        result = train(application, app_cfg, cfg, arrays, out, resume=resume, extra_config=extra, follow=follower)
    except (CheckpointError, ConfigError) as err:
        _fail(str(err))
    if main_rank:  # what serving checks inputs against (chem: ood.json); a followed dataset: what it had
        application.record_training_distribution(app_cfg, follower.store.load() if follower else arrays, out)
    if main_rank:
        console.print(f"best {application.monitor.name} {result.best_value:.4f} at epoch {result.best_epoch + 1}; "
                      f"{result.samples_seen} samples seen in {result.seconds:.0f} s"
                      + ("; stopped early" if result.stopped_early else ""))


def torchrun_command(args: list[str], nproc: int) -> list[str]:
    """``converge ARGS`` as a torchrun launch of ``nproc`` local processes, with ``--nproc`` taken out."""
    rest, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "converge", *rest]


@cli.command("evaluate")
def evaluate_cmd(
    app: str = typer.Argument(..., help="App name, e.g. gw."),
    run: Path = typer.Option(..., "--run", "-r", help="Run directory made by `converge train`."),
    data: Path = typer.Option(..., "--data", "-d", help="Test dataset (simulated with another seed)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where evaluation.json and plots go (default RUN)."),
    config: Optional[Path] = ConfigOpt,
    sets: Optional[list[str]] = SetOpt,
) -> None:
    """Surrogate against the classical baseline on a fixed test set; writes RUN/evaluation.json and PNGs."""
    from .contract import load_app
    from .train.checkpoint import CheckpointError

    _threads()
    try:
        tables, ov = _tables(config, sets)
        application = load_app(app)
        options = {}
        if application.evaluate_config_cls is not None:
            options["ev"] = load_section(application.evaluate_config_cls, tables, "evaluate", ov.get("evaluate"))
        report = application.evaluate(run, data, out or run, **options)
    except (ConfigError, KeyError, FileNotFoundError, ValueError, StoreError, CheckpointError) as err:
        _fail(str(err).strip("'\""))
    print(json.dumps(application.summary(report), indent=2))


@cli.command("predict")
def predict_cmd(
    app: str = typer.Argument(..., help="App name, e.g. chem."),
    path: Path = typer.Argument(..., help="Input file (chem: .xyz / extxyz, coordinates in Å; gw: a GWOSC strain "
                                "file)."),
    run: Path = typer.Option(..., "--run", "-r", help="A trained run directory."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output file (chem: FILE.predicted.extxyz)."),
) -> None:
    """Use a trained surrogate on a file (App.predict_file; chem: energies and forces of each frame as extxyz, gw:
    triggers at the run's FAP 1e-3 threshold)."""
    from .contract import load_app
    from .train.checkpoint import CheckpointError

    _threads()
    try:
        written = load_app(app).predict_file(run, path, out)
    except (KeyError, FileNotFoundError, ValueError, CheckpointError, NotImplementedError) as err:
        _fail(str(err).strip("'\""))
    console.print(f"written {written}")


@cli.command("serve")
def serve_cmd(
    runs: list[str] = typer.Argument(..., help="Run folders to serve, as PATH or NAME=PATH (any app)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; anything but loopback needs --token or --insecure."),
    port: int = typer.Option(8000, help="TCP port."),
    max_batch_size: int = typer.Option(64, help="Samples per model call at most."),
    max_queue_delay_us: int = typer.Option(0, help="Wait this long for more requests (0: take what is queued)."),
    max_queue_size: int = typer.Option(1024, help="Queued samples before requests get 503 + Retry-After."),
    token: Optional[str] = typer.Option(None, help="Require `Authorization: Bearer TOKEN`."),
    insecure: bool = typer.Option(False, help="Allow a non-loopback bind without a token."),
    device: str = typer.Option("cpu", help="cpu | cuda | auto."),
    access_log: bool = typer.Option(True, "--access-log/--no-access-log", help="One JSON line per request on stderr."),
    model_process: bool = typer.Option(True, "--model-process/--no-model-process",
                                       help="Queue, batch and run each model in a process of its own, clear of the "
                                            "server's GIL (1.4-1.5x the requests/s under load here); "
                                            "--no-model-process runs it on a thread (about 0.5 ms less for a lone "
                                            "client)."),
    instances: int = typer.Option(1, help="Model processes per model, each request to the least busy one (Triton's "
                                          "instance_group count). On a CPU give each one torch thread "
                                          "(OMP_NUM_THREADS=1): two on 2 cores let one batch run while the next "
                                          "forms."),
    fallback: Optional[str] = typer.Option(None, help="Answer untrusted samples with the app's simulator "
                                                      "('simulator'); without it they are refused (HTTP 422)."),
    max_uncertainty: Optional[float] = typer.Option(None, help="Untrusted above this ensemble uncertainty, in the "
                                                               "app's unit (chem: energy spread per atom, kcal/mol; "
                                                               "gw: probability std). Needs an ensemble run."),
    fallback_timeout: float = typer.Option(60.0, help="Seconds the simulator may take per request (else 504)."),
    fallback_queue: Optional[Path] = typer.Option(None, help="Keep each simulator answer here as an .npz "
                                                             "(training data; see converge.serve.fallback)."),
    fallback_workers: int = typer.Option(1, help="Simulator threads."),
    direct_infer: bool = typer.Option(True, "--direct-infer/--asgi-infer",
                                      help="Answer POST .../infer straight from the HTTP protocol (with httptools); "
                                           "--asgi-infer sends it through the ASGI app like every other route."),
) -> None:
    """Serve trained runs over the Open Inference Protocol (KServe v2) with dynamic batching.

    Endpoints: /v2/health/{live,ready}, /v2, /v2/models/NAME[/versions/V][/ready],
    POST /v2/models/NAME[/versions/V]/infer (JSON or binary tensors), /metrics (Prometheus).
    The Triton Python client (tritonclient[http]) works against it unchanged.
    An ensemble run also gives each output's spread as NAME_std; with --max-uncertainty
    or a run's ood.json, untrusted samples go to --fallback simulator or are refused.
    """
    from .serve.fallback import TrustConfig, TrustSetupError
    from .serve.registry import ModelLoadError
    from .serve.server import ServeConfigError, serve

    _threads()
    try:
        trust = TrustConfig(max_uncertainty, fallback, fallback_timeout, fallback_queue, fallback_workers)
    except ValueError as err:
        _fail(f"--fallback options: {err}")
    try:
        serve(runs, host=host, port=port, max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us,
              max_queue_size=max_queue_size, token=token, insecure=insecure, device=device, access_log=access_log,
              model_process=model_process, instances=instances, trust=trust, direct_infer=direct_infer)
    except (ServeConfigError, ModelLoadError, TrustSetupError) as err:
        _fail(str(err))


bench_cli = typer.Typer(help="Platform benchmarks (results as JSON and PNG).", no_args_is_help=True)
cli.add_typer(bench_cli, name="bench")


@bench_cli.command("serve")
def bench_serve_cmd(
    run: Path = typer.Argument(..., help="A `converge train` run folder (any app)."),
    duration: float = typer.Option(5.0, help="Measured seconds per concurrency level."),
    warmup: float = typer.Option(1.0, help="Seconds of load before each measured window."),
    concurrency: str = typer.Option("1,2,4,8,16,32,64,128", help="Client counts to sweep, comma-separated."),
    formats: str = typer.Option("binary,json", help="Tensor encodings: binary, json or both."),
    max_batch_size: int = typer.Option(64, help="max_batch_size of the batched server (the other runs with 1)."),
    device: str = typer.Option("cpu", help="cpu | cuda | auto, for the model and the server."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="Where serve.json, serve.png and the server logs go (default RUN)."),
    peers: str = typer.Option("", help="Also serve the model with triton, mlserver, litserve (comma-separated; "
                                       "Triton over binary tensors, the others over JSON; each is installed once "
                                       "into runs/peer-envs/<peer>, Triton's from Debian's /usr/bin/python3.11) "
                                       "and report each at its best over a grid of its own settings."),
    peer_grid: str = typer.Option("", "--peer-grid", help="Narrow or widen a peer's settings grid, e.g. "
                                  "\"triton.delay_ms=0,0.5 triton.workers=1\" (see converge.bench.peer_settings)."),
) -> None:
    """Throughput and latency of a served run: the model alone, then `converge serve` with dynamic
    batching on and off, swept over client concurrency (a perf_analyzer-style load generator);
    with --peers, MLServer and LitServe serving the same model, side by side."""
    from .bench.peers import PeerError
    from .bench.serve import ServeBenchConfig, headline, run_serve_benchmark, write_results
    from .bench.server_process import ServeBenchError
    from .serve.registry import ModelLoadError

    _threads()
    try:
        cfg = ServeBenchConfig.from_options(concurrency, duration, warmup, formats, max_batch_size, device, peers,
                                            peer_grid)
        report = run_serve_benchmark(run, cfg, log_dir=out or run)
    except (ValueError, ModelLoadError, ServeBenchError, PeerError) as err:
        _fail(str(err))
    json_path, png_path = write_results({report["app"]: report}, out or run)
    print(json.dumps(headline(report), indent=2))
    console.print(f"written {json_path} and {png_path}")


@cli.command("learn")
def learn_cmd(
    app: str = typer.Argument(..., help="App name (see `converge apps`)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder of the rounds (resumed if present)."),
    budget: int = typer.Option(64, help="Simulator calls added over all rounds after the initial set."),
    rounds: int = typer.Option(4, help="Rounds of select -> simulate -> retrain."),
    initial: int = typer.Option(16, help="Simulated samples the first ensemble trains on."),
    pool: int = typer.Option(1024, help="Cheap candidates scored by the ensemble each round."),
    members: int = typer.Option(4, help="Ensemble members (the committee)."),
    test: int = typer.Option(48, help="Held-out simulated samples for the learning curve."),
    strategy: str = typer.Option("qbc", help="qbc (highest ensemble disagreement), random, or both (side by side)."),
    seed: int = typer.Option(0, help="Seed of pools, initial and test sets (shared by both strategies)."),
    diversity: float = typer.Option(0.0, help="qbc batch diversity: skip candidates closer than this fraction of "
                                    "the pool's median distance to one already chosen (0: plain top-k)."),
    epochs: int = typer.Option(300, help="Training epochs per member per round."),
    batch_size: int = typer.Option(8, help="Training batch size."),
    checkpoint_every: int = typer.Option(25, "--checkpoint-every", help="Epochs between a member's checkpoint "
                                         "writes: on a few dozen samples an epoch takes ~10 ms, a write ~40 ms."),
    from_queue: Optional[Path] = typer.Option(None, "--from-queue", help="Instead: turn the simulator answers "
                                              "`converge serve --fallback-queue DIR` kept into a dataset at "
                                              "--out, for `converge train --data`."),
    config: Optional[Path] = ConfigOpt,
    sets: Optional[list[str]] = SetOpt,
) -> None:
    """Active learning: simulate only where the ensemble disagrees (query by committee).

    Each round trains an ensemble, scores a pool of cheap candidates drawn from the app's
    prior (App.learning_problem says what a candidate is and how the simulator labels it),
    simulates the most disputed ones and retrains. The app's own options are the [learn]
    table (e.g. chem: --set learn.temperatures=150,300,600,1200 --set learn.shares=8,4,2,1).
    Every round is checkpointed: rerun the same command to continue. Writes
    OUT/learning_curve.png and per-round metrics.json (test error against simulator calls).
    """
    from .contract import load_app
    from .train.loop import TrainConfig
    from .validate.active import compare_strategies, run_active_learning

    _threads()
    if from_queue is not None:
        from .validate.queue import QueueError, queue_to_dataset

        try:
            store = queue_to_dataset(load_app(app), from_queue, out)
        except (QueueError, KeyError, StoreError) as err:
            _fail(str(err).strip("'\""))
        console.print(f"{len(store)} queued simulator answers stored in {out}; train on them with "
                      f"`converge train {app} --data {out}`")
        return
    if strategy not in ("qbc", "random", "both"):
        _fail(f"--strategy {strategy!r}: choose qbc, random or both")
    try:
        tables, ov = _tables(config, sets)
        application = load_app(app)
        app_cfg = load_section(application.config_cls, tables, "app", ov.get("app"))
        tcfg = load_section(TrainConfig, tables, "train", {**ov.get("train", {}), "epochs": epochs,
                                                           "batch_size": batch_size, "patience": epochs,
                                                           "checkpoint_every": checkpoint_every})
        options = dict(initial=initial, budget=budget, rounds=rounds, pool_size=pool, seed=seed, members=members,
                       n_test=test, diversity=diversity, train_cfg=tcfg, progress=True)
        if application.learn_config_cls is not None:
            learn_options = load_section(application.learn_config_cls, tables, "learn", ov.get("learn"))
        elif tables.get("learn") or ov.get("learn"):
            raise ConfigError(f"app {application.name!r} takes no [learn] options")
        else:
            learn_options = None
        options["problem"] = application.learning_problem(app_cfg, learn_options)
        if strategy == "both":
            result = compare_strategies(application, app_cfg, out, **options)
            console.print(f"active reaches random's final error with {result['calls_to_reach_random_final']} calls")
        else:
            history = run_active_learning(application, app_cfg, out, strategy=strategy, **options)
            console.print(json.dumps(history[-1], indent=2)[:1500])
    except (ConfigError, KeyError, ValueError, NotImplementedError) as err:
        _fail(str(err).strip("'\""))


PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _run_module_main(module: str, ctx: typer.Context) -> None:
    """Hand the arguments to a benchmark module's own parser (its --help lists every option)."""
    import importlib

    _threads()
    raise typer.Exit(importlib.import_module(module).main(ctx.args))


@bench_cli.command("gemm", context_settings=PASS_THROUGH)
def bench_gemm_cmd(ctx: typer.Context) -> None:
    """Matrix-product TFLOP/s by size and precision (fp64, fp32, tf32, bf16, fp16) against the peak. --help: options."""
    _run_module_main("converge.bench.gemm", ctx)


@bench_cli.command("allreduce", context_settings=PASS_THROUGH)
def bench_allreduce_cmd(ctx: typer.Context) -> None:
    """allreduce/allgather/reduce_scatter/broadcast bandwidth (Gloo or NCCL), nccl-tests busbw. --help: options."""
    _run_module_main("converge.bench.collectives", ctx)


@bench_cli.command("ddp", context_settings=PASS_THROUGH)
def bench_ddp_cmd(ctx: typer.Context) -> None:
    """Data-parallel training samples/s and scaling efficiency over 1..N processes (Gloo or NCCL). --help: options."""
    _run_module_main("converge.bench.ddp", ctx)


@bench_cli.command("surrogate", context_settings=PASS_THROUGH)
def bench_surrogate_cmd(ctx: typer.Context) -> None:
    """Each app's classical method against its surrogate, time per sample, with accuracy. --help: options."""
    _run_module_main("converge.bench.surrogate", ctx)


@cli.command("report", context_settings=PASS_THROUGH)
def report_cmd(ctx: typer.Context) -> None:
    """One self-contained HTML page of every benchmark and evaluation result. --help: options."""
    _run_module_main("converge.bench.report", ctx)


@cli.command("demo")
def demo_cmd(
    out: Path = typer.Option(Path("demo-output"), "--out", "-o", help="Where everything is written (OUT/APP/)."),
    quick: bool = typer.Option(False, help="A much smaller run (a smoke test of a minute or two)."),
    app: str = typer.Option("default", help="Comma-separated app names, or default: the reference apps gw and "
                            "chem (any installed app with a demo can be named, a third party's included)."),
) -> None:
    """Apps end to end on small defaults; by default the two reference apps (2 cores: see the README's timings).

    gw: simulate -> train -> evaluate vs matched filtering -> detect in a strain file.
    chem: DFT ensemble -> train -> evaluate vs DFT and GFN2-xTB -> NVE dynamics.
    """
    from .contract import available_apps
    from .demo import run_demo

    names = None if app == "default" else tuple(a.strip() for a in app.split(",") if a.strip())
    unknown = sorted(set(names or ()) - set(available_apps()))
    if unknown:
        _fail(f"--app {app!r}: no installed app {', '.join(unknown)}; installed: {', '.join(sorted(available_apps()))}")
    _threads()
    try:
        run_demo(out, quick=quick, apps=names)
    except NotImplementedError as err:
        _fail(str(err))


def app_command(function: Callable[..., Any]) -> Callable[..., Any]:
    """An app's command function with its clear failures (:class:`~converge.contract.CommandError`) turned into
    the CLI's error message and exit status 2; the signature (arguments, options) is the app's."""
    from .contract import CommandError

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        _threads()
        try:
            return function(*args, **kwargs)
        except CommandError as err:
            _fail(str(err))

    return run


def add_app_commands(root: typer.Typer) -> dict[str, list[str]]:
    """``converge VERB APP ...`` for each command an installed app supplies (``App.commands``); returns the apps
    by verb. An app that fails to load is skipped with a warning, so one broken package cannot take the CLI down."""
    from .contract import app_classes

    builtin = {c.name or c.callback.__name__ for c in root.registered_commands}
    builtin |= {g.name for g in root.registered_groups}
    classes, errors = app_classes()
    for name, error in errors.items():
        console.print(f"[yellow]warning:[/] app {name!r} did not load ({escape(error)}); its commands are left out")
    verbs: dict[str, dict[str, Callable[..., Any]]] = {}
    for name, cls in classes.items():
        for verb, function in cls().commands().items():
            if verb in builtin:
                console.print(f"[yellow]warning:[/] app {name!r} offers the command {verb!r}, which converge "
                              "already has; left out (name it otherwise)")
                continue
            verbs.setdefault(verb, {})[name] = function
    for verb, by_app in sorted(verbs.items()):
        group = typer.Typer(help=f"{verb}: a command of the app(s) {', '.join(by_app)}; "
                            f"`converge {verb} APP --help` for its options.", no_args_is_help=True,
                            rich_markup_mode=None)
        for name, function in by_app.items():
            group.command(name)(app_command(function))
        root.add_typer(group, name=verb)
    return {verb: list(by_app) for verb, by_app in verbs.items()}


APP_COMMANDS = add_app_commands(cli)


def main() -> None:
    try:
        cli()
    except KeyboardInterrupt:
        console.print("interrupted: rerun the same command to resume")
        sys.exit(130)


if __name__ == "__main__":
    main()
