"""The machine a result was computed on: CPU model and the vector-ISA flags that decide
which floating-point kernels run. Findings quote it, because the same model can round
differently on another CPU (AVX2 / AVX-512 / AMX dispatch, library builds, threads)."""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_flags", "cpu_model", "machine_line"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The vector-ISA flags of this CPU that decide kernel dispatch (``/proc/cpuinfo``)."""
    wanted = (
        "avx2",
        "fma",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    )
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def machine_line() -> str:
    """This machine in one line: CPU model, its vector-ISA flags, logical CPUs."""
    flags = cpu_flags()
    return (
        f"{cpu_model()}"
        + (f" ({', '.join(flags)})" if flags else "")
        + f", {os.cpu_count()} logical CPUs"
    )
