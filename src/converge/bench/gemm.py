"""Matrix-multiply (GEMM) throughput per precision and size, against the theoretical peak.

``run_gemm_benchmark(cfg)`` times ``C = A @ B`` for square ``M = N = K`` in fp64,
fp32, tf32 (CUDA only: fp32 tensors with the tensor cores' TF32 mode), bf16 and
fp16, on the CPU or a CUDA device, and reports for each point

- ``tflops = 2 M N K / t``, ``t`` the mean of timed repeats after warm-up
  (``time.perf_counter`` on the CPU; CUDA events around the repeats on a GPU);
- ``relative_to_fp32``: the speed-up over fp32 at the same size;
- ``fraction_of_peak`` against :mod:`.peaks` (CPU: from the cores' vector units,
  torch's thread count and the clock; GPU: the datasheet).

Repeats adapt so each point is timed for about ``target_s``. On the CPU a time
budget caps the run: sizes go smallest first, each precision's cost at the next
size is extrapolated as ``t x (n / n_prev)^3``, the cheapest go first, and a point
whose estimate exceeds what is left of the budget is skipped (recorded with its
reason), as are its larger sizes; so is a point estimated beyond ``max_point_s``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..config import parse_positive_ints
from .artifacts import pyplot, save_figure, write_results_with_plot
from .machine import Clock, cpu_clock, describe_machine, read_cpuinfo
from .peaks import PRECISIONS, cpu_peaks, gpu_peaks

SIZES = (512, 1024, 2048, 4096, 8192)
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}
PROBE_SIZE = 256  # first estimate of a precision's speed, extrapolated to its first size


@dataclass(frozen=True)
class GemmConfig:
    sizes: tuple[int, ...] = SIZES
    precisions: tuple[str, ...] = PRECISIONS  # tf32 is recorded as skipped on the CPU
    device: str = "cpu"  # cpu | cuda | cuda:N
    target_s: float = 0.5  # timed seconds per (size, precision)
    warmup: int = 1  # untimed products first; on the CPU none for a product longer than target_s
    max_repeats: int = 10_000
    budget_s: float = 100.0  # the whole run; points estimated beyond what is left of it are skipped
    max_point_s: float = 30.0  # one (size, precision) estimated longer than this is skipped
    clock_ghz: float | None = None  # CPU clock for the peak, overriding the one read from the machine

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"sizes={self.sizes}: give one or more matrix sizes >= 1, e.g. 512,1024")
        unknown = set(self.precisions) - set(PRECISIONS)
        if not self.precisions or unknown:
            raise ValueError(f"precisions={self.precisions}: choose from {', '.join(PRECISIONS)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}: give cpu, cuda or cuda:N")
        if min(self.target_s, self.budget_s, self.max_point_s) <= 0 or self.warmup < 0 or self.max_repeats < 1:
            raise ValueError(f"target_s={self.target_s}, budget_s={self.budget_s}, max_point_s={self.max_point_s}, "
                             f"warmup={self.warmup}, max_repeats={self.max_repeats}: need times > 0, warm-up >= 0, "
                             "repeats >= 1")
        if self.clock_ghz is not None and not self.clock_ghz > 0:
            raise ValueError(f"clock_ghz={self.clock_ghz}: give the CPU clock in GHz, e.g. 2.6")

    @classmethod
    def quick(cls, device: str = "cpu") -> "GemmConfig":
        """Seconds, for tests: two small sizes, short windows."""
        return cls(sizes=(64, 128), device=device, target_s=0.02, budget_s=20.0, max_point_s=5.0)


def gemm_flops(m: int, n: int, k: int) -> int:
    """FLOP of ``(M, K) @ (K, N)``: ``2 M N K`` (a multiply and an add per term)."""
    return 2 * m * n * k


def gemm_tflops(size: int, seconds: float) -> float:
    """TFLOP/s of a square product of ``size`` taking ``seconds``."""
    return gemm_flops(size, size, size) / seconds / 1e12


def extrapolate_seconds(size_from: int, seconds_from: float, size_to: int) -> float:
    """Time of a ``size_to`` product from one of ``size_from``: the work grows as ``n^3``."""
    return seconds_from * (size_to / size_from) ** 3


def repeats_for(seconds_per_call: float, target_s: float, max_repeats: int) -> int:
    """Calls that fill about ``target_s``: at least 1, at most ``max_repeats``."""
    return max(1, min(max_repeats, math.ceil(target_s / max(seconds_per_call, 1e-9))))


@contextmanager
def tf32_mode(enabled: bool) -> Iterator[None]:
    """fp32 CUDA matmuls on the tensor cores' TF32 mode (``enabled``) or in full fp32; restored after."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9; mixing it with allow_tf32 raises
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:
        before = matmul.allow_tf32
        matmul.allow_tf32 = enabled
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def time_products(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, repeats: int) -> float:
    """Mean seconds of ``repeats`` products ``out = a @ b``: CUDA events on a GPU, perf_counter on the CPU."""
    if a.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(a.device)
        start.record()
        for _ in range(repeats):
            torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b, out=out)
    return (time.perf_counter() - t0) / repeats


def operands(size: int, precision: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A, B with N(0, 1) entries and the output buffer, in the precision's dtype."""
    dtype = DTYPES[precision]
    a = torch.randn(size, size, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    b = torch.randn_like(a)
    return a.to(dtype), b.to(dtype), torch.empty(size, size, device=device, dtype=dtype)


def probe_seconds(size: int, precision: str, device: torch.device) -> float:
    """One product at ``min(size, PROBE_SIZE)`` (after one untimed), extrapolated to ``size``."""
    n = min(size, PROBE_SIZE)
    a, b, out = operands(n, precision, device)
    with tf32_mode(precision == "tf32"):
        time_products(a, b, out, 1)
        return extrapolate_seconds(n, time_products(a, b, out, 1), size)


def measure_point(size: int, precision: str, device: torch.device, estimate_s: float, cfg: GemmConfig
                  ) -> dict[str, Any]:
    """Warm up, re-estimate one call where that is cheap, then time the repeats; one result row."""
    a, b, out = operands(size, precision, device)
    cheap = device.type == "cuda" or estimate_s <= cfg.target_s
    warmup = cfg.warmup if cheap else 0
    with tf32_mode(precision == "tf32"):
        for _ in range(warmup):
            torch.matmul(a, b, out=out)
        if cheap:
            estimate_s = time_products(a, b, out, 1)
        repeats = repeats_for(estimate_s, cfg.target_s, cfg.max_repeats)
        seconds = time_products(a, b, out, repeats)
    if not torch.isfinite(out[:4, :4].float()).all():  # a broken kernel must not pass as a fast one
        raise RuntimeError(f"{precision} {size}x{size} product is not finite")
    return {"size": size, "precision": precision, "dtype": str(DTYPES[precision]).removeprefix("torch."),
            "seconds": seconds, "repeats": repeats, "warmup": warmup, "tflops": gemm_tflops(size, seconds)}


def skipped(size: int, precision: str, reason: str) -> dict[str, Any]:
    return {"size": size, "precision": precision, "skipped": reason}


def device_peaks(device: torch.device, cfg: GemmConfig) -> tuple[str, dict[str, dict[str, Any]] | None]:
    """(device name, peak per precision or None) for ``device``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return name, gpu_peaks(name)
    cpu = read_cpuinfo()
    clock = Clock(cfg.clock_ghz, "given (GemmConfig.clock_ghz)") if cfg.clock_ghz else cpu_clock(cpu)
    cores = min(torch.get_num_threads(), cpu.logical_cpus)
    return cpu.model_name, cpu_peaks(cpu, cores, clock)


def run_gemm_benchmark(cfg: GemmConfig = GemmConfig()) -> dict[str, Any]:
    """Every (size, precision) of ``cfg``, rows smallest size first; see the module docstring."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={cfg.device!r} but CUDA is not available; use --device cpu")
    name, peaks = device_peaks(device, cfg)
    rows: list[dict[str, Any]] = []
    last: dict[str, tuple[int, float]] = {}  # precision -> (size, seconds) of its latest product
    over_budget: set[str] = set()
    t0 = time.perf_counter()
    for size in sorted(set(cfg.sizes)):
        estimates = {}
        for precision in cfg.precisions:
            if precision == "tf32" and device.type != "cuda":
                rows.append(skipped(size, precision, "TF32 is a CUDA tensor-core mode"))
            elif precision in over_budget:
                rows.append(skipped(size, precision, "a smaller size was already skipped for time"))
            elif precision in last:
                estimates[precision] = extrapolate_seconds(*last[precision], size)
            else:
                estimates[precision] = probe_seconds(size, precision, device)
        for precision in sorted(estimates, key=estimates.get):  # cheapest first: the budget drops the slowest
            estimate = estimates[precision]
            calls = repeats_for(estimate, cfg.target_s, cfg.max_repeats) + (cfg.warmup if estimate <= cfg.target_s
                                                                             else 0)
            left = cfg.budget_s - (time.perf_counter() - t0)
            if calls * estimate > min(left, cfg.max_point_s):
                over_budget.add(precision)
                why = f"the {left:.3g} s left of the {cfg.budget_s:g} s budget" if left < cfg.max_point_s else \
                    f"the {cfg.max_point_s:g} s allowed one point"
                rows.append(skipped(size, precision, f"estimated {calls * estimate:.3g} s exceeds {why}"))
                continue
            row = measure_point(size, precision, device, estimate, cfg)
            last[precision] = (size, row["seconds"])
            rows.append(row)
    rows.sort(key=lambda r: (PRECISIONS.index(r["precision"]), r["size"]))
    add_relative_and_peak(rows, peaks)
    return {"device": device.type, "device_name": name, "threads": torch.get_num_threads(),
            "config": asdict(cfg), "peaks": peaks, "rows": rows, "summary": summarize(rows, peaks),
            "notes": notes(rows, peaks), "seconds": time.perf_counter() - t0, "machine": describe_machine()}


def add_relative_and_peak(rows: list[dict[str, Any]], peaks: dict[str, dict[str, Any]] | None) -> None:
    """Fill ``relative_to_fp32`` (speed-up over fp32 at the same size) and ``fraction_of_peak`` in place."""
    fp32 = {r["size"]: r["tflops"] for r in rows if r["precision"] == "fp32" and "tflops" in r}
    for r in rows:
        if "tflops" not in r:
            continue
        r["relative_to_fp32"] = r["tflops"] / fp32[r["size"]] if r["size"] in fp32 else None
        peak = (peaks or {}).get(r["precision"], {}).get("tflops")
        r["peak_tflops"] = peak
        r["fraction_of_peak"] = r["tflops"] / peak if peak else None


def notes(rows: Sequence[dict[str, Any]], peaks: dict[str, dict[str, Any]] | None) -> list[str]:
    """Warnings a reader of the numbers needs: no peak known, or a measured rate above the peak."""
    out = []
    if not peaks:
        out.append("no peak known for this device: fractions of peak are left out")
    above = sorted({r["precision"] for r in rows if (r.get("fraction_of_peak") or 0) > 1.02})
    if above:
        source = next(iter(peaks.values())).get("clock_source") or next(iter(peaks.values())).get("source")
        out.append(f"{', '.join(above)} measured above the peak: the clock or table it assumes ({source}) is below "
                   "what the hardware ran at (turbo, or a faster unit); on a CPU give the real clock (clock_ghz)")
    return out


def summarize(rows: Sequence[dict[str, Any]], peaks: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """Per precision: the best TFLOP/s, its size, its fraction of peak and its speed-up over fp32 there."""
    out: dict[str, Any] = {}
    for precision in dict.fromkeys(r["precision"] for r in rows):
        measured = [r for r in rows if r["precision"] == precision and "tflops" in r]
        if not measured:
            continue
        best = max(measured, key=lambda r: r["tflops"])
        out[precision] = {"best_tflops": best["tflops"], "at_size": best["size"],
                          "fraction_of_peak": best.get("fraction_of_peak"),
                          "relative_to_fp32": best.get("relative_to_fp32"),
                          "peak_tflops": (peaks or {}).get(precision, {}).get("tflops")}
    return out


def plot_gemm(result: dict[str, Any], path: str | Path) -> Path:
    """Left: TFLOP/s against size per precision, the peaks dashed. Right: speed-up over fp32 per size."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for k, precision in enumerate(dict.fromkeys(r["precision"] for r in result["rows"])):
        rows = [r for r in result["rows"] if r["precision"] == precision and "tflops" in r]
        if not rows:
            continue
        color = f"C{k}"
        ax1.plot([r["size"] for r in rows], [r["tflops"] for r in rows], "o-", color=color, label=precision)
        peak = (result.get("peaks") or {}).get(precision, {}).get("tflops")
        if peak:
            ax1.axhline(peak, color=color, ls="--", lw=0.8)
        if precision != "fp32":
            rel = [r for r in rows if r.get("relative_to_fp32")]
            ax2.plot([r["size"] for r in rel], [r["relative_to_fp32"] for r in rel], "o-", color=color,
                     label=f"{precision} / fp32")
    ax1.set(yscale="log", xlabel="M = N = K", ylabel="TFLOP/s",
            title=f"{result['device_name']} ({result['threads']} threads); dashed: peak")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set(yscale="log", xlabel="M = N = K", ylabel="speed-up over fp32", title="relative to fp32 at each size")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["size"] for r in result["rows"]}))
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def write_results(result: dict[str, Any], out_dir: str | Path, stem: str = "gemm") -> tuple[Path, Path]:
    """``OUT/STEM.json`` and ``OUT/STEM.png``, each written atomically."""
    return write_results_with_plot(result, out_dir, stem, plot_gemm)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"512,1024"`` -> (512, 1024), with a clear error otherwise."""
    return parse_positive_ints(text, "512,1024,2048")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.gemm [--device cpu] [--sizes 512,1024] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="converge bench gemm", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="M = N = K values, e.g. 512,1024")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="from fp64,fp32,tf32,bf16,fp16")
    parser.add_argument("--target-s", type=float, default=0.5, help="timed seconds per point")
    parser.add_argument("--budget-s", type=float, default=100.0, help="whole-run budget; costlier points skipped")
    parser.add_argument("--max-point-s", type=float, default=30.0, help="skip a point estimated longer")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads torch computes with (the peak's cores)")
    parser.add_argument("--clock-ghz", type=float, default=None, help="CPU clock for the peak (default: read)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where STEM.json and STEM.png go")
    parser.add_argument("--stem", default="gemm", help="file name stem, e.g. gemm_gpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        cfg = GemmConfig(sizes=parse_sizes(args.sizes), precisions=tuple(p.strip() for p in args.precisions.split(",")),
                         device=args.device, target_s=args.target_s, budget_s=args.budget_s, clock_ghz=args.clock_ghz,
                         max_point_s=args.max_point_s,
                         warmup=3 if args.device.startswith("cuda") else 1)
        result = run_gemm_benchmark(cfg)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    paths = write_results(result, args.out, args.stem)
    print(json.dumps(result["summary"], indent=2))
    print(f"written {paths[0]} and {paths[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
