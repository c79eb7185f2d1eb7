"""The accelerators the planner prices programs on: each chip's published peaks (dot rates,
HBM, interconnect and host bandwidth, a collective step's latency), and which one a JAX device is."""

from __future__ import annotations

import dataclasses


# Per chip. TPU: Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p,
# v6e); their ICI figure is bidirectional per chip (v5p's "4800 Gbps" is 600 GB/s; v4: six
# 50 GB/s links, Jouppi et al., ISCA 2023). JAX computes float32 dots on a TPU in one bf16
# pass at its default precision, so float32 runs at the bf16 rate. GPU: the NVIDIA H100/H200
# SXM datasheets, dense (no sparsity); float32 dots run as TF32 at JAX's default precision;
# NVLink 4 is 900 GB/s per GPU. `host` is the host link each direction (PCIe; H100/H200 Gen5 x16).
# `hop_latency`: 1 us per ICI link hop, the TPU link latency ASTRA-sim's TPU validation takes
# ("as per TPU research team"); assumed the same for an NVLink step. The least certain figure here.
@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # FLOP/s for dots with 16-bit (or narrower) operands
    fp32_flops: float  # FLOP/s for float32 dots at JAX's default precision
    hbm_bytes: float  # bytes/s
    ici_bytes: float  # bytes/s each chip moves over its interconnect
    host_bytes: float  # bytes/s host <-> chip
    hop_latency: float = 1e-6  # seconds per step of a collective (module docstring)


CHIPS = {
    "v4": Chip("TPU v4", 275e12, 275e12, 1200e9, 300e9, 16e9),
    "v5e": Chip("TPU v5e", 197e12, 197e12, 819e9, 400e9, 16e9),
    "v5p": Chip("TPU v5p", 459e12, 459e12, 2765e9, 600e9, 32e9),
    "v6e": Chip("TPU v6e", 918e12, 918e12, 1638e9, 800e9, 32e9),
    "h100": Chip("NVIDIA H100 SXM", 989e12, 494.5e12, 3350e9, 900e9, 64e9),
    "h200": Chip("NVIDIA H200 SXM", 989e12, 494.5e12, 4800e9, 900e9, 64e9),
}


def peak_flops(chip: Chip, dtype) -> float:
    """The chip's dot rate for a model computing in `dtype` (MFU's denominator)."""
    return chip.fp32_flops if str(dtype) in ("float32", "float64") else chip.bf16_flops


def published_chip(device_kind: str) -> Chip | None:
    """The CHIPS entry of a device kind ("TPU v5 lite", "NVIDIA H100 80GB HBM3", ...), or None."""
    kind = device_kind.lower()
    for name, marks in (
        ("h200", ("h200",)),
        ("h100", ("h100",)),
        ("v5e", ("v5 lite", "v5e")),
        ("v6e", ("v6 lite", "v6e")),
        ("v5p", ("v5p", "v5")),
        ("v4", ("v4",)),
    ):
        if any(mark in kind for mark in marks):
            return CHIPS[name]
    return None
