"""Session-wide test setup.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and ``transformers`` (through
``kvlab.integrations``) imports it while test modules are collected; so on a machine without a
GPU the interpreter is switched on here, before any test module is imported, for the Triton
kernel's tests (tests/pnmix/test_triton.py) to run on the CPU whatever the collection order.
It only affects Triton kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
