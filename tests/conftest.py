"""Session-wide test setup.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and ``transformers`` (through
``kvlab.integrations``) imports it while test modules are collected; so on a machine without a
GPU the interpreter is switched on here, before any test module is imported, for the Triton
kernel's tests (tests/pnmix/test_triton.py) to run on the CPU whatever the collection order.
It only affects Triton kernels.

Hypothesis profiles: under CI (``CI`` set, as ``.ci/run`` runs) the ``ci`` profile is loaded:
derandomized (each property test draws the same examples on every run, so a green suite stays
green) and without the example database. Local runs keep the random search (``default``);
``HYPOTHESIS_PROFILE=ci`` reproduces CI's draws locally.
"""

from __future__ import annotations

import os

import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
