"""Collective communication over torch.distributed: time, algorithm and bus bandwidth, and a correctness check.

``run_collectives_benchmark(cfg)`` runs allreduce (sum), allgather, reduce_scatter
(sum) and broadcast on float32 messages of ``min_bytes`` to ``max_bytes`` (times
``factor``) between ``world`` processes on this node: Gloo on the CPU, NCCL on
GPUs (one per rank). It spawns the ranks itself (``torch.multiprocessing``, a free
127.0.0.1 port) or, started by ``torchrun`` (``RANK``/``WORLD_SIZE`` set), joins the
ranks that exist. Per size: one call with a known pattern checked on every rank,
``warmup`` calls, then repeats sized to about ``target_s``; the time of the
slowest rank counts. Sizes follow nccl-tests: ``S`` is the message of allreduce
and broadcast, and the whole gathered (or scattered) array of allgather and
reduce_scatter, ``S / world`` per rank. ``algbw = S / t``; ``busbw`` applies the
factors of nccl-tests' ``doc/PERFORMANCE.md`` (:func:`bus_bandwidth`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .artifacts import finish, pyplot, save_figure, write_results_with_plot
from .machine import describe_machine
from .server_process import free_port

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast")
ELEMENT_BYTES = 4  # float32, nccl-tests' default type
CPU_MAX_BYTES = 256 * 2**20
GPU_MAX_BYTES = 2**30
ROOT = 0  # of broadcast


# -- bus bandwidth (nccl-tests, doc/PERFORMANCE.md) ------------------------------------------------------------------
def algorithm_bandwidth(nbytes: int, seconds: float) -> float:
    """``algbw = S / t`` [bytes/s] (nccl-tests doc/PERFORMANCE.md, "Algorithm bandwidth")."""
    return nbytes / seconds


def allreduce_busbw(algbw: float, world: int) -> float:
    """``busbw = algbw x 2 (n - 1) / n``: each element needs n - 1 additions and n assignments over n links
    (nccl-tests doc/PERFORMANCE.md, "AllReduce")."""
    return algbw * 2 * (world - 1) / world


def allgather_busbw(algbw: float, world: int) -> float:
    """``busbw = algbw x (n - 1) / n``, ``S`` the gathered array (nccl-tests doc/PERFORMANCE.md, "AllGather")."""
    return algbw * (world - 1) / world


def reduce_scatter_busbw(algbw: float, world: int) -> float:
    """``busbw = algbw x (n - 1) / n``, ``S`` the whole input array (nccl-tests doc/PERFORMANCE.md, "ReduceScatter")."""
    return algbw * (world - 1) / world


def broadcast_busbw(algbw: float, world: int) -> float:
    """``busbw = algbw``: all data leaves the root through its one link (nccl-tests doc/PERFORMANCE.md, "Broadcast")."""
    return algbw


BUSBW: dict[str, Callable[[float, int], float]] = {"allreduce": allreduce_busbw, "allgather": allgather_busbw,
                                                   "reduce_scatter": reduce_scatter_busbw,
                                                   "broadcast": broadcast_busbw}


def bus_bandwidth(op: str, algbw: float, world: int) -> float:
    return BUSBW[op](algbw, world)


# -- patterns and their checks ---------------------------------------------------------------------------------------
# Small integers, exact in float32 for any world below ~200 ranks.
def element_count(op: str, nbytes: int, world: int) -> int:
    """float32 elements of a message of ``nbytes``; for allgather/reduce_scatter a multiple of ``world``."""
    count = max(1, nbytes // ELEMENT_BYTES)
    if op in ("allgather", "reduce_scatter"):
        count = max(world, count // world * world)
    return count


def allreduce_input(rank: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank ``r`` holds ``r + 1`` everywhere."""
    return torch.full((count,), float(rank + 1), device=device)


def check_allreduce(result: torch.Tensor, world: int) -> bool:
    """The sum of ``r + 1`` over ranks, ``n (n + 1) / 2``, in every element."""
    return bool((result == world * (world + 1) / 2).all())


def allgather_input(rank: int, count_per_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.full((count_per_rank,), float(rank + 1), device=device)


def check_allgather(result: torch.Tensor, world: int) -> bool:
    """Chunk ``k`` of the gathered array is rank ``k``'s ``k + 1``."""
    expected = torch.arange(1, world + 1, dtype=result.dtype, device=result.device)
    return bool((result.view(world, -1) == expected[:, None]).all())


def reduce_scatter_input(rank: int, world: int, count_per_rank: int, device: torch.device | str = "cpu"
                         ) -> torch.Tensor:
    """Chunk ``j`` of rank ``r``'s input holds ``r + 1 + j n``: every chunk sums to a different value."""
    chunk = torch.arange(world, dtype=torch.float32, device=device) * world + rank + 1
    return chunk.repeat_interleave(count_per_rank)


def check_reduce_scatter(result: torch.Tensor, world: int, rank: int) -> bool:
    """Rank ``r`` receives the sum of chunk ``r``: ``n (n + 1) / 2 + r n^2``."""
    return bool((result == world * (world + 1) / 2 + rank * world**2).all())


def broadcast_input(rank: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.full((count,), float(rank + 1), device=device)


def check_broadcast(result: torch.Tensor, root: int = ROOT) -> bool:
    """The root's ``root + 1`` everywhere (each rank started from its own ``r + 1``)."""
    return bool((result == root + 1).all())


def prepare(op: str, count: int, rank: int, world: int, device: torch.device
            ) -> tuple[Callable[[], None], Callable[[], bool], Callable[[], None]]:
    """(call, check, reset) of one collective on fresh buffers holding the pattern.

    ``reset`` runs after the check: an in-place allreduce repeated on the pattern
    multiplies it by ``n (n + 1) / 2`` each time and overflows float32 to inf, so
    the timed repeats sum zeros (a sum costs the same whatever the values).
    """
    if op == "allreduce":
        buf = allreduce_input(rank, count, device)
        return lambda: dist.all_reduce(buf), lambda: check_allreduce(buf, world), buf.zero_
    if op == "allgather":
        inp, out = allgather_input(rank, count // world, device), torch.empty(count, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp), lambda: check_allgather(out, world), lambda: None
    if op == "reduce_scatter":
        inp, out = reduce_scatter_input(rank, world, count // world, device), torch.empty(count // world, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp), lambda: check_reduce_scatter(out, world, rank), lambda: None
    if op == "broadcast":
        buf = broadcast_input(rank, count, device)
        return lambda: dist.broadcast(buf, ROOT), lambda: check_broadcast(buf, ROOT), lambda: None
    raise ValueError(f"unknown collective {op!r}: choose from {', '.join(OPS)}")


# -- configuration ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectivesConfig:
    ops: tuple[str, ...] = OPS
    world: int = 2  # ranks on this node; NCCL: at most one per GPU
    device: str = "cpu"  # cpu (Gloo) | cuda (NCCL)
    backend: str = "auto"  # auto: gloo on cpu, nccl on cuda
    min_bytes: int = 8
    max_bytes: int | None = None  # None: 256 MiB on the CPU, 1 GiB on GPUs
    factor: int = 2
    warmup: int = 2
    target_s: float = 0.2  # timed seconds per (op, size)
    min_repeats: int = 3
    max_repeats: int = 1000
    threads: int = 1  # torch threads per rank
    timeout_s: float = 600.0  # of each collective (torch.distributed timeout)

    def __post_init__(self) -> None:
        if not self.ops or set(self.ops) - set(OPS):
            raise ValueError(f"ops={self.ops}: choose from {', '.join(OPS)}")
        if self.world < 1:
            raise ValueError(f"world={self.world}: need at least 1 rank")
        if self.device not in ("cpu", "cuda") or self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"device={self.device!r}, backend={self.backend!r}: device cpu|cuda, "
                             "backend auto|gloo|nccl")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("backend nccl needs device cuda (NCCL moves GPU memory)")
        if self.min_bytes < 1 or (self.max_bytes is not None and self.max_bytes < self.min_bytes) or self.factor < 2:
            raise ValueError(f"min_bytes={self.min_bytes}, max_bytes={self.max_bytes}, factor={self.factor}: need "
                             "1 <= min_bytes <= max_bytes and factor >= 2")
        if not self.target_s > 0 or self.warmup < 0 or not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(f"target_s={self.target_s}, warmup={self.warmup}, repeats {self.min_repeats}.."
                             f"{self.max_repeats}: need target_s > 0, warmup >= 0, 1 <= min <= max")

    @property
    def resolved_backend(self) -> str:
        return self.backend if self.backend != "auto" else ("nccl" if self.device == "cuda" else "gloo")

    @property
    def sizes(self) -> tuple[int, ...]:
        top = self.max_bytes or (GPU_MAX_BYTES if self.device == "cuda" else CPU_MAX_BYTES)
        return message_sizes(self.min_bytes, top, self.factor)

    @classmethod
    def quick(cls) -> "CollectivesConfig":
        """Seconds, for tests: 2 Gloo ranks, 8 B to 64 KiB in steps of 16, a few repeats."""
        return cls(world=2, max_bytes=64 * 2**10, factor=16, warmup=1, target_s=0.005, min_repeats=1,
                   max_repeats=20, timeout_s=120.0)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> tuple[int, ...]:
    """``min_bytes, min_bytes x factor, ...`` up to ``max_bytes`` (as nccl-tests' ``-b -e -f``)."""
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= factor
    return tuple(sizes)


# -- one rank --------------------------------------------------------------------------------------------------------
def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (an allreduce MAX; every rank gets it)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed_calls(call: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Seconds per call of ``repeats`` calls, the slowest rank's; ranks start together."""
    slowest(0.0, device)  # a barrier that works on Gloo and NCCL alike
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return slowest(time.perf_counter() - t0, device) / repeats


def measure(op: str, nbytes: int, rank: int, world: int, device: torch.device, cfg: CollectivesConfig
            ) -> dict[str, Any]:
    """One row: the checked call, warm-up, then the timed repeats of ``op`` on ``nbytes``."""
    count = element_count(op, nbytes, world)
    call, check, reset = prepare(op, count, rank, world, device)
    call()
    wrong = torch.tensor([0 if check() else 1], device=device)
    dist.all_reduce(wrong)
    reset()
    for _ in range(cfg.warmup):
        call()
    one = timed_calls(call, 1, device)
    repeats = max(cfg.min_repeats, min(cfg.max_repeats, math.ceil(cfg.target_s / max(one, 1e-9))))
    seconds = timed_calls(call, repeats, device)
    size = count * ELEMENT_BYTES
    algbw = algorithm_bandwidth(size, seconds)
    return {"op": op, "bytes": size, "count": count, "seconds": seconds, "repeats": repeats,
            "algbw_GBps": algbw / 1e9, "busbw_GBps": bus_bandwidth(op, algbw, world) / 1e9,
            "correct": int(wrong.item()) == 0, "wrong_ranks": int(wrong.item())}


def rank_main(rank: int, world: int, init_method: str, cfg: CollectivesConfig, local_rank: int | None = None
              ) -> dict[str, Any] | None:
    """Join the group, measure every (op, size); rank 0 returns the rows, the others None."""
    torch.set_num_threads(cfg.threads)
    backend = cfg.resolved_backend
    if cfg.device == "cuda":
        device = torch.device("cuda", (rank if local_rank is None else local_rank) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout_s))
    try:
        rows = [measure(op, nbytes, rank, world, device, cfg) for op in cfg.ops for nbytes in cfg.sizes]
    finally:
        dist.destroy_process_group()
    return {"rows": rows, "backend": backend} if rank == 0 else None


def _spawned_rank(rank: int, world: int, port: int, cfg: CollectivesConfig, out_path: str) -> None:
    result = rank_main(rank, world, f"tcp://127.0.0.1:{port}", cfg)
    if result is not None:
        Path(out_path).write_text(json.dumps(result))


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


# -- the benchmark ---------------------------------------------------------------------------------------------------
def run_collectives_benchmark(cfg: CollectivesConfig = CollectivesConfig()) -> dict[str, Any] | None:
    """Every (op, size) of ``cfg``; under torchrun the ranks that exist, else ``cfg.world`` spawned ones.

    Returns the result dict (on rank 0 under torchrun; None on the other ranks).
    """
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda but CUDA is not available; use --device cpu (Gloo)")
    t0 = time.perf_counter()
    if under_torchrun():
        cfg = replace(cfg, world=int(os.environ["WORLD_SIZE"]))
        check_world(cfg)
        ranks = rank_main(int(os.environ["RANK"]), cfg.world, "env://", cfg, int(os.environ.get("LOCAL_RANK", "0")))
        if ranks is None:
            return None
    else:
        check_world(cfg)
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "rank0.json"
            mp.start_processes(_spawned_rank, args=(cfg.world, free_port(), cfg, str(out)), nprocs=cfg.world,
                               start_method="spawn")
            ranks = json.loads(out.read_text())
    rows = ranks["rows"]
    return {"backend": ranks["backend"], "device": cfg.device, "world": cfg.world, "dtype": "float32",
            "launcher": "torchrun" if under_torchrun() else "torch.multiprocessing.spawn",
            "config": {**asdict(cfg), "sizes": list(cfg.sizes)}, "rows": rows, "summary": summarize(rows),
            "all_correct": all(r["correct"] for r in rows), "notes": notes(cfg), "seconds": time.perf_counter() - t0,
            "machine": describe_machine()}


def check_world(cfg: CollectivesConfig) -> None:
    if cfg.resolved_backend == "nccl" and cfg.world > torch.cuda.device_count():
        raise ValueError(f"world={cfg.world} but {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per rank")


def notes(cfg: CollectivesConfig) -> list[str]:
    out = []
    if cfg.world == 1:
        out.append("one rank: each collective is a local copy; the bus bandwidth of allreduce, allgather and "
                   "reduce_scatter is 0 by definition (factor (n - 1) / n)")
    if cfg.device == "cpu" and cfg.world > (os.cpu_count() or 1):
        out.append(f"{cfg.world} ranks on {os.cpu_count()} CPUs: ranks share cores, times include waiting")
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per op: the smallest message's time (the latency), the best bus bandwidth and its size, all checks passed."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        best = max(mine, key=lambda r: r["busbw_GBps"])
        out[op] = {"latency_us": min(mine, key=lambda r: r["bytes"])["seconds"] * 1e6,
                   "best_busbw_GBps": best["busbw_GBps"], "best_algbw_GBps": best["algbw_GBps"],
                   "at_bytes": best["bytes"], "all_correct": all(r["correct"] for r in mine)}
    return out


def plot_collectives(result: dict[str, Any], path: str | Path) -> Path:
    """Bus bandwidth and time against message size, one line per op; failed checks marked with a red x."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    bandwidth = "busbw_GBps" if result["world"] > 1 else "algbw_GBps"  # one rank: busbw is 0 by definition
    for k, op in enumerate(dict.fromkeys(r["op"] for r in result["rows"])):
        rows = [r for r in result["rows"] if r["op"] == op]
        x = [r["bytes"] for r in rows]
        ax1.plot(x, [r[bandwidth] for r in rows], "o-", ms=3, color=f"C{k}", label=op)
        ax2.plot(x, [r["seconds"] * 1e6 for r in rows], "o-", ms=3, color=f"C{k}", label=op)
        bad = [r for r in rows if not r["correct"]]
        if bad:
            ax2.plot([r["bytes"] for r in bad], [r["seconds"] * 1e6 for r in bad], "rx", ms=9, label=f"{op}: wrong")
    title = f"{result['backend']}, {result['world']} ranks ({result['device']})"
    ax1.set(xscale="log", yscale="log", xlabel="message size S [bytes]",
            ylabel="bus bandwidth [GB/s]" if bandwidth == "busbw_GBps" else "algorithm bandwidth [GB/s]",
            title=f"{title}: {bandwidth.split('_')[0]} (nccl-tests)")
    ax2.set(xscale="log", yscale="log", xlabel="message size S [bytes]", ylabel="time per call [us]",
            title=f"{title}: time")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def write_results(result: dict[str, Any], out_dir: str | Path, stem: str = "allreduce") -> tuple[Path, Path]:
    """``OUT/STEM.json`` and ``OUT/STEM.png``, each written atomically."""
    return write_results_with_plot(result, out_dir, stem, plot_collectives)


def parse_bytes(text: str) -> int:
    """``"8"``, ``"64K"``, ``"256M"``, ``"1G"`` (binary units) -> bytes."""
    found = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.I)
    if not found:
        raise ValueError(f"{text!r}: give a size like 8, 64K, 256M or 1G")
    return int(found.group(1)) * 1024 ** "_KMG".index(found.group(2).upper() or "_")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.collectives [--world 2] [--device cpu|cuda] [--max-bytes 256M] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="converge bench allreduce", description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, all GPUs on cuda)")
    parser.add_argument("--device", default="cpu", help="cpu (Gloo) | cuda (NCCL)")
    parser.add_argument("--backend", default="auto", help="auto | gloo | nccl")
    parser.add_argument("--ops", default=",".join(OPS), help="from allreduce,allgather,reduce_scatter,broadcast")
    parser.add_argument("--min-bytes", default="8", help="smallest message, e.g. 8")
    parser.add_argument("--max-bytes", default=None, help="largest message (default 256M on CPU, 1G on GPU)")
    parser.add_argument("--factor", type=int, default=2, help="size step (multiplier)")
    parser.add_argument("--target-s", type=float, default=0.2, help="timed seconds per (op, size)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where STEM.json and STEM.png go")
    parser.add_argument("--stem", default="allreduce", help="file name stem, e.g. allreduce_gpu")
    args = parser.parse_args(argv)
    try:
        world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
        cfg = CollectivesConfig(ops=tuple(o.strip() for o in args.ops.split(",")), world=world, device=args.device,
                                backend=args.backend, min_bytes=parse_bytes(args.min_bytes),
                                max_bytes=parse_bytes(args.max_bytes) if args.max_bytes else None,
                                factor=args.factor, target_s=args.target_s)
        result = run_collectives_benchmark(cfg)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result is None:  # a torchrun rank other than 0
        return 0
    return finish(result, write_results(result, args.out, args.stem), result["all_correct"], "SOME CHECKS FAILED")


if __name__ == "__main__":
    sys.exit(main())
