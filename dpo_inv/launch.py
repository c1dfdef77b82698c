"""The launch environment, read before the Accelerator is built."""

from __future__ import annotations

import os

import torch
from accelerate.utils import is_xpu_available


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def use_cpu() -> bool:
    """Several processes on a machine without CUDA or XPU devices: Accelerate must be told to use the CPU
    (gloo); otherwise every process would train alone."""
    return world_size() > 1 and not torch.cuda.is_available() and not is_xpu_available()
