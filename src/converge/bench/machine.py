"""What machine a benchmark ran on: CPU model, features and clock, GPUs and driver, software versions.

Parsing is done by pure functions on the text of ``/proc/cpuinfo`` (so tests feed
them any CPU); :func:`describe_machine` reads this machine's files and is what the
benchmarks store beside their numbers and what the report prints.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

# The flags that decide the peak FLOP rate of a core (see .peaks) and are worth printing.
FLAGS_OF_INTEREST = ("fma", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
                     "amx_int8", "avx512_vnni")
PACKAGES = ("numpy", "scipy", "torch", "matplotlib", "pyscf", "lalsuite", "pycbc", "ase", "fastapi", "uvicorn",
            "converge")


@dataclass(frozen=True)
class CpuInfo:
    """One CPU as ``/proc/cpuinfo`` describes it (the first processor block; all are alike here)."""

    model_name: str
    vendor: str  # "GenuineIntel", "AuthenticAMD", ...
    family: int  # "cpu family", decimal (AMD Zen 4 = 25 = 0x19, Zen 5 = 26 = 0x1A)
    model: int
    flags: frozenset[str]
    mhz: float | None  # "cpu MHz": the current clock, or the nominal (TSC) clock under a hypervisor
    logical_cpus: int  # processor blocks

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["flags"] = sorted(f for f in self.flags if f in FLAGS_OF_INTEREST)
        return out


def parse_cpuinfo(text: str) -> CpuInfo:
    """The fields of the first processor block of ``/proc/cpuinfo`` text; missing fields become empty or 0."""
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    fields: dict[str, str] = {}
    for line in (blocks[0] if blocks else "").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())

    def number(key: str) -> float | None:
        try:
            return float(fields[key])
        except (KeyError, ValueError):
            return None

    return CpuInfo(
        model_name=fields.get("model name", platform.processor() or platform.machine()),
        vendor=fields.get("vendor_id", ""),
        family=int(number("cpu family") or 0),
        model=int(number("model") or 0),
        flags=frozenset((fields.get("flags") or fields.get("Features", "")).split()),  # x86 | aarch64
        mhz=number("cpu MHz"),
        logical_cpus=sum(1 for b in blocks if b.lstrip().startswith("processor")) or (os.cpu_count() or 1),
    )


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """This machine's :class:`CpuInfo` (an empty one where the file does not exist, e.g. macOS)."""
    try:
        return parse_cpuinfo(Path(path).read_text())
    except OSError:
        return parse_cpuinfo("")


@dataclass(frozen=True)
class Clock:
    ghz: float
    source: str  # where the number came from, printed beside every peak


def cpu_clock(cpu: CpuInfo, cpufreq_dir: str | Path = "/sys/devices/system/cpu/cpu0/cpufreq") -> Clock | None:
    """The clock that peak FLOP rates are computed at.

    ``cpufreq/cpuinfo_max_freq`` (kHz, the highest clock the driver allows, turbo
    included: the peak is then an upper bound), else ``scaling_max_freq``, else
    ``/proc/cpuinfo``'s ``cpu MHz`` (the current clock; under a hypervisor
    usually the nominal TSC clock, which turbo can exceed: a measured fraction of
    peak above 1 means the core ran faster than that). None when nothing is known.
    """
    for name in ("cpuinfo_max_freq", "scaling_max_freq"):
        try:
            khz = float((Path(cpufreq_dir) / name).read_text().strip())
        except (OSError, ValueError):
            continue
        if khz > 0:
            return Clock(khz / 1e6, f"{Path(cpufreq_dir) / name} (maximum, turbo included)")
    if cpu.mhz:
        return Clock(cpu.mhz / 1e3, "/proc/cpuinfo 'cpu MHz' (current or nominal clock; turbo may exceed it)")
    return None


def gpu_description() -> list[dict[str, Any]]:
    """Name, memory and compute capability of each visible CUDA device, with the driver version; [] without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        driver = nvidia_driver_version()
        gpus = []
        for k in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(k)
            gpus.append({"index": k, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "capability": f"{props.major}.{props.minor}", "driver": driver,
                         "cuda_runtime": torch.version.cuda})
        return gpus
    except Exception:  # a broken driver must not stop a CPU benchmark from describing its machine
        return []


def nvidia_driver_version() -> str | None:
    """The driver version ``nvidia-smi`` reports, or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed versions of ``names`` (those not installed are left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def memory_gib(meminfo: str | Path = "/proc/meminfo") -> float | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe_machine() -> dict[str, Any]:
    """This machine and its software, with the UTC date: stored in every benchmark result."""
    import torch

    cpu = read_cpuinfo()
    clock = cpu_clock(cpu)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "os": platform.platform(),
        "cpu": {**cpu.as_dict(), "clock_ghz": clock.ghz if clock else None,
                "clock_source": clock.source if clock else None},
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": memory_gib(),
        "gpus": gpu_description(),
        "python": sys.version.split()[0],
        "versions": package_versions(),
    }


def machine_line(machine: Mapping[str, Any] | None) -> str:
    """One line for a caption: CPU model and cores, GPUs, torch version, date. Tolerates the smaller
    ``machine`` records older results carry (``{"cpu": "x86_64", "torch": ...}``)."""
    if not isinstance(machine, Mapping) or not machine:
        return "machine not recorded"
    cpu = machine.get("cpu")
    parts = [cpu.get("model_name", "?") if isinstance(cpu, Mapping) else str(cpu or "?")]
    if "logical_cpus" in machine:
        parts.append(f"{machine['logical_cpus']} CPUs, {machine.get('torch_threads', '?')} torch threads")
    for gpu in machine.get("gpus") or []:
        parts.append(f"{gpu.get('name', '?')} (driver {gpu.get('driver') or '?'})")
    versions = machine.get("versions") if isinstance(machine.get("versions"), Mapping) else {}
    torch_version = versions.get("torch") or machine.get("torch")
    if torch_version:
        parts.append(f"torch {torch_version}")
    if machine.get("date"):
        parts.append(str(machine["date"]))
    return "; ".join(parts)
