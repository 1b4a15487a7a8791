"""Which autocast precision pays on a device: bf16 only where the hardware computes in it natively.

An app's ``default_precision`` was chosen by measurement on hardware with bf16 units
(gw: bf16 trained 1.6x faster than fp32 on a CPU with AVX512-BF16, same accuracy).
Where bf16 is emulated it costs instead: on an AVX2-only CPU one gw training step
took 784 ms in bf16 against 108 ms in fp32 (2026-12-01, one thread). ``auto`` therefore
means the app's default where the device has bf16 units, and fp32 elsewhere; an
explicit ``bf16`` is always honoured.
"""
from __future__ import annotations

import functools
import platform
from typing import Any, Mapping

import torch

from ..bench.machine import read_cpuinfo

X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo "flags": VDPBF16PS, AMX tiles
ARM_BF16_FEATURE = "bf16"  # /proc/cpuinfo "Features" on aarch64 (FEAT_BF16, Armv8.6)


@functools.lru_cache(maxsize=1)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's ``flags`` (x86) or ``Features`` (aarch64); empty where unreadable."""
    return read_cpuinfo(cpuinfo).flags


def native_bf16(device: torch.device, flags: frozenset[str] | None = None) -> bool:
    """True where ``device`` multiplies bf16 in hardware: a CUDA GPU that supports it, a CPU with bf16 units."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() in ("aarch64", "arm64"):
        return ARM_BF16_FEATURE in flags
    return bool(flags & X86_BF16_FLAGS)


def resolve_precision(requested: str, app_default: str, device: torch.device,
                      flags: frozenset[str] | None = None) -> str:
    """``auto`` -> the app's measured default, but fp32 instead of bf16 where ``device`` lacks bf16 units."""
    if requested != "auto":
        return requested
    if app_default == "bf16" and not native_bf16(device, flags):
        return "fp32"
    return app_default


def inference_precision(trained: str, device: torch.device) -> str:
    """The precision to run a trained model in: its training precision, but fp32 for bf16 where bf16 is
    emulated (the weights are fp32 either way; autocast only trades digits for speed, and there it loses)."""
    return "fp32" if trained == "bf16" and not native_bf16(device) else trained


def run_precision(config: Mapping[str, Any], app_default: str, device: torch.device) -> str:
    """The precision to run a trained run's model in on ``device``: the one its ``config`` trained in."""
    trained = resolve_precision(config.get("train", {}).get("precision", "auto"), app_default, device)
    return inference_precision(trained, device)
