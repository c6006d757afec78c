"""Device selection and accelerator descriptions (no host, user or driver strings)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvlab.userinput import quote

__all__ = ["AcceleratorInfo", "accelerator_info", "resolve_device", "set_cpu_threads"]


def resolve_device(spec: str) -> torch.device:
    """Resolve ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` to a :class:`torch.device`.

    ``auto`` is CUDA device 0 when CUDA is available, else the CPU. Asking for a device that
    is absent is an error, never a silent fallback to the CPU.

    Raises:
        ValueError: unknown spec, CUDA unavailable, or index out of range.
    """
    text = spec.strip().lower()
    if text == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise ValueError(f"unknown device {quote(spec)}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {quote(spec)} requested but CUDA is not available on this machine"
        )
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {quote(spec)} requested but only {count} CUDA device(s) exist")
    return torch.device(f"cuda:{index}")


def set_cpu_threads(threads: int | None) -> None:
    """Set torch's intra-op CPU thread count (``None`` leaves it unchanged).

    Raises:
        ValueError: ``threads`` < 1.
    """
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--cpu-threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class AcceleratorInfo:
    """``vendor`` and ``model`` of the device a run used, and a one-string ``label``."""

    vendor: str
    model: str

    @property
    def label(self) -> str:
        return "CPU" if self.vendor == "CPU" else f"{self.vendor} {self.model}"


def accelerator_info(device: torch.device) -> AcceleratorInfo:
    """Describe ``device``: ``CPU`` or the GPU vendor and marketing model name (e.g.
    ``NVIDIA`` / ``A100-SXM4-80GB``), with no host name, user name or driver version."""
    if device.type != "cuda":
        return AcceleratorInfo(vendor="CPU", model="CPU")
    name = torch.cuda.get_device_name(device)
    vendor = "AMD" if getattr(torch.version, "hip", None) else "NVIDIA"
    model = re.sub(rf"^{vendor}\s+", "", name, flags=re.IGNORECASE).strip().replace(" ", "-")
    return AcceleratorInfo(vendor=vendor, model=model)
