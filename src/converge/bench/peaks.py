"""Theoretical peak FLOP rates per precision: from a CPU's features, or from a GPU's datasheet.

CPU: ``peak = FLOP/cycle/core x cores x clock``. FLOP/cycle/core follows from the
vector units the ``/proc/cpuinfo`` flags reveal, counting a fused multiply-add
as 2 FLOP (:func:`cpu_flops_per_cycle` documents each case and its source).
Cores are the threads torch computes with (``torch.get_num_threads()``), the
clock is that of :func:`converge.bench.machine.cpu_clock`, which says where it
read it. GPU: the vendor's dense (no sparsity) datasheet figures, matched by
``torch.cuda.get_device_name()``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .machine import Clock, CpuInfo

PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")
AMD_ZEN5_FAMILY = 0x1A  # Zen 4 is family 0x19 (25): AVX-512 on 256-bit pipes; Zen 5 (0x1A) has 512-bit pipes


class PeakRate(NamedTuple):
    """FLOP per cycle of one core at one precision and the unit that sets it."""

    flops_per_cycle: float
    unit: str


def vector_fma_rates(cpu: CpuInfo) -> tuple[float, float, str]:
    """(fp64, fp32) FLOP/cycle/core of the FMA units and a description of them.

    ``FLOP/cycle = FMA units x lanes x 2``:

    - Intel with ``avx512f``: two 512-bit FMA units (ports 0+1 fused, port 5), fp64 32,
      fp32 64 (Intel 64 and IA-32 Architectures Optimization Reference Manual, order
      248966, Skylake Server chapter; Xeon Gold 6xxx/Platinum and later Xeon
      Scalable; Silver/Bronze parts have one unit and reach half).
    - AMD with ``avx512f`` and family < 0x1A (Zen 4): four 256-bit FP pipes, two of
      them FMA; a 512-bit instruction runs as two 256-bit halves: fp64 16, fp32 32
      (AMD Software Optimization Guide for Family 19h Processors, pub. 56665).
    - AMD family >= 0x1A (Zen 5 server/desktop): 512-bit FMA pipes, fp64 32, fp32 64
      (AMD Software Optimization Guide for Family 1Ah Processors, pub. 58455).
    - ``avx2`` + ``fma`` (Intel Haswell and later, AMD Zen 2/3): two 256-bit FMA units,
      fp64 16, fp32 32; AMD Zen 1 (family 0x17, model < 0x30) has 128-bit units: 8, 16.
    - ``avx`` without FMA: one 256-bit multiply and one add per cycle: fp64 8, fp32 16.
    - otherwise (SSE2): 128-bit multiply + add: fp64 4, fp32 8.
    """
    flags, amd = cpu.flags, cpu.vendor == "AuthenticAMD"
    if "avx512f" in flags:
        if amd and cpu.family < AMD_ZEN5_FAMILY:
            return 16, 32, "AVX-512 on 2 FMA pipes of 256 bits (AMD Zen 4)"
        return 32, 64, "AVX-512, 2 FMA units of 512 bits"
    if "avx2" in flags and "fma" in flags:
        if amd and cpu.family == 0x17 and cpu.model < 0x30:
            return 8, 16, "AVX2, 2 FMA units of 128 bits (AMD Zen 1)"
        return 16, 32, "AVX2, 2 FMA units of 256 bits"
    if "avx" in flags:
        return 8, 16, "AVX, 256-bit multiply + add"
    return 4, 8, "SSE2, 128-bit multiply + add"


def cpu_flops_per_cycle(cpu: CpuInfo) -> dict[str, PeakRate]:
    """FLOP/cycle/core at fp64, fp32, bf16 and fp16 (no tf32: a CUDA tensor-core mode).

    fp64/fp32 from :func:`vector_fma_rates`. bf16:

    - ``amx_bf16``: Intel AMX, 1024 FLOP/cycle: ``TDPBF16PS`` multiplies 16x32 by
      32x16 bf16 tiles into 16x16 fp32 (8192 multiply-adds) every 16 cycles (Intel
      Optimization Reference Manual, "Intel AMX" chapter; Sapphire Rapids and later).
    - ``avx512_bf16``: ``VDPBF16PS`` adds two bf16 products into each fp32 lane at the
      FMA rate, twice fp32: 128 on Intel (two 512-bit units), 64 on Zen 4.
    - otherwise bf16 is converted and computed in fp32: the fp32 rate.

    fp16: ``amx_fp16`` (Granite Rapids) 1024; ``avx512_fp16`` (Sapphire Rapids) FMA on
    32 fp16 lanes, twice fp32 (128); otherwise converted to fp32: the fp32 rate at
    best (a library without a converting kernel falls far below it).
    """
    fp64, fp32, unit = vector_fma_rates(cpu)
    rates = {"fp64": PeakRate(fp64, unit), "fp32": PeakRate(fp32, unit)}
    if "amx_bf16" in cpu.flags:
        rates["bf16"] = PeakRate(1024, "AMX TDPBF16PS (16x16x32 tile product per 16 cycles)")
    elif "avx512_bf16" in cpu.flags:
        rates["bf16"] = PeakRate(2 * fp32, "AVX512-BF16 VDPBF16PS at the FMA rate")
    else:
        rates["bf16"] = PeakRate(fp32, "no bf16 arithmetic: converted to fp32")
    if "amx_fp16" in cpu.flags:
        rates["fp16"] = PeakRate(1024, "AMX TDPFP16PS (16x16x32 tile product per 16 cycles)")
    elif "avx512_fp16" in cpu.flags:
        rates["fp16"] = PeakRate(2 * fp32, "AVX512-FP16 FMA on 32 fp16 lanes")
    else:
        rates["fp16"] = PeakRate(fp32, "no fp16 arithmetic: converted to fp32")
    return rates


def peak_tflops(flops_per_cycle: float, cores: int, clock_ghz: float) -> float:
    """``flops_per_cycle x cores x clock`` in TFLOP/s (clock in GHz)."""
    return flops_per_cycle * cores * clock_ghz / 1e3


def cpu_peaks(cpu: CpuInfo, cores: int, clock: Clock | None) -> dict[str, dict[str, Any]]:
    """Peak per precision of ``cores`` cores of ``cpu`` at ``clock``; ``tflops`` is None without a clock."""
    out = {}
    for precision, rate in cpu_flops_per_cycle(cpu).items():
        out[precision] = {"tflops": peak_tflops(rate.flops_per_cycle, cores, clock.ghz) if clock else None,
                          "flops_per_cycle_per_core": rate.flops_per_cycle, "unit": rate.unit, "cores": cores,
                          "clock_ghz": clock.ghz if clock else None, "clock_source": clock.source if clock else None}
    return out


# Dense (no sparsity) peak TFLOP/s by precision; fp64 is the tensor-core rate, which cuBLAS DGEMM uses.
# Matched in order by substring of torch.cuda.get_device_name(): the specific names first.
GPU_DATASHEETS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H200 NVL", "NVIDIA H200 NVL datasheet (sparsity figures halved)",
     {"fp64": 60, "fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H100 NVL", "NVIDIA H100 NVL datasheet (sparsity figures halved)",
     {"fp64": 60, "fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H100 PCIe", "NVIDIA H100 PCIe datasheet (sparsity figures halved)",
     {"fp64": 51, "fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756}),
    ("H200", "NVIDIA H200 SXM datasheet (sparsity figures halved)",
     {"fp64": 67, "fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    ("H100", "NVIDIA H100 SXM datasheet (sparsity figures halved)",
     {"fp64": 67, "fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    ("A100", "NVIDIA A100 datasheet (sparsity figures halved)",
     {"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}),
)


def gpu_peaks(device_name: str) -> dict[str, dict[str, Any]] | None:
    """Datasheet peak per precision for a GPU named ``device_name``; None for a GPU not in the table."""
    for key, source, table in GPU_DATASHEETS:
        if key.lower() in device_name.lower():
            return {p: {"tflops": float(v), "source": source, "matched": key} for p, v in table.items()}
    return None
