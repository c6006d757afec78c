"""The attention backends of kvlab's mechanisms: one registry, one selection rule per
mechanism, kernel preloading and the CLI's up-front check (docs/design.md, "Kernels";
"RoPE-Relay: Attention", "Compiled decode kernel").

Each mechanism has one environment variable naming the backend it asks for, described once
by a static :class:`BackendSpec` in :data:`REGISTRY`:

* ``"pnmix"``: ``KVLAB_PNMIX_BACKEND`` = ``auto`` (default), ``torch``, ``cpu`` or ``triton``
  (the rule that turns it into the backend that runs is
  :func:`kvlab.pnmix.kernels.dispatch.select_backend`);
* ``"relay"``: ``KVLAB_RELAY_BACKEND`` = ``auto`` (default), ``torch`` or ``cpu``
  (:func:`kvlab.relay.attention.ragged_attention`; the variable is read at every call).

This module sits low in the import graph: it imports no other kvlab module. A spec names its
compiled CPU kernel's module (:attr:`BackendSpec.kernel_module`, which exposes ``load()`` and
``cpu_kernel_status()``) and it is imported only when a kernel is loaded, so the kernel
modules can read their variable here without an import cycle. :mod:`kvlab.native` only
compiles.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

from kvlab.userinput import quote

__all__ = [
    "PNMIX",
    "REGISTRY",
    "RELAY",
    "BackendSpec",
    "check_backend_variables",
    "check_choice",
    "env_backend",
    "family_backends",
    "get_spec",
    "kernel_status",
    "load_kernel",
    "preload",
    "requested",
]


@dataclass(frozen=True)
class BackendSpec:
    """One mechanism's backend variable and its compiled CPU kernel.

    Attributes:
        mechanism: the registry key (``"pnmix"``, ``"relay"``), also the key of
            :func:`family_backends`' result (and of the evaluation's task records).
        env_var: the environment variable that requests a backend.
        choices: the backends it accepts besides ``"auto"`` (in error messages as this tuple).
        default: what an unset or empty variable means (``"auto"``).
        kernel_module: the module of the compiled CPU kernel (``load() -> ModuleType | None``,
            ``cpu_kernel_status() -> str``); imported when a kernel is loaded.
        kernel_name: the kernel in messages (``"PN-Mix CPU kernel"``).
        kernel_backends: the requested backends that run the compiled CPU kernel on the CPU
            (preloaded by :func:`preload`).
        families: the evaluation's method families that run this mechanism.
    """

    mechanism: str
    env_var: str
    choices: tuple[str, ...]
    default: str
    kernel_module: str
    kernel_name: str
    kernel_backends: tuple[str, ...]
    families: tuple[str, ...]

    def kernel(self) -> ModuleType:
        """The kernel's module (:attr:`kernel_module`, imported now if need be)."""
        return importlib.import_module(self.kernel_module)


#: PN-Mix packed attention (:mod:`kvlab.pnmix.kernels.dispatch`).
PNMIX = BackendSpec(
    mechanism="pnmix",
    env_var="KVLAB_PNMIX_BACKEND",
    choices=("torch", "cpu", "triton"),
    default="auto",
    kernel_module="kvlab.pnmix.kernels.cpu",
    kernel_name="PN-Mix CPU kernel",
    kernel_backends=("auto", "cpu"),
    families=("quantized", "composed"),
)

#: RoPE-Relay ragged attention (:mod:`kvlab.relay.kernels.cpu`).
RELAY = BackendSpec(
    mechanism="relay",
    env_var="KVLAB_RELAY_BACKEND",
    choices=("torch", "cpu"),
    default="auto",
    kernel_module="kvlab.relay.kernels.cpu",
    kernel_name="RoPE-Relay CPU kernel",
    kernel_backends=("auto", "cpu"),
    families=("eviction", "composed"),
)

#: Every mechanism's spec by :attr:`BackendSpec.mechanism`, in the order they are checked.
REGISTRY: dict[str, BackendSpec] = {spec.mechanism: spec for spec in (PNMIX, RELAY)}


def get_spec(mechanism: str) -> BackendSpec:
    """The :class:`BackendSpec` of ``mechanism``.

    Raises:
        ValueError: not a mechanism of :data:`REGISTRY`.
    """
    try:
        return REGISTRY[mechanism]
    except KeyError:
        raise ValueError(f"unknown mechanism {mechanism!r}; known: {tuple(REGISTRY)}") from None


def check_choice(mechanism: str, backend: str) -> str:
    """``backend`` itself when it is ``"auto"`` or one of the mechanism's choices.

    Raises:
        ValueError: any other value (``backend must be 'auto' or one of (...), got '...'``).
    """
    choices = get_spec(mechanism).choices
    if backend not in ("auto", *choices):
        raise ValueError(f"backend must be 'auto' or one of {choices}, got {quote(backend)}")
    return backend


def env_backend(mechanism: str) -> str:
    """The backend the mechanism's environment variable requests (stripped; unset or empty:
    the spec's default, ``"auto"``). Read at every call: a changed variable counts.

    Raises:
        ValueError: a value that is not ``"auto"`` or a choice
            (``KVLAB_..._BACKEND='...': must be 'auto' or one of (...)``).
    """
    spec = get_spec(mechanism)
    env = os.environ.get(spec.env_var, "").strip()
    if env and env not in ("auto", *spec.choices):
        raise ValueError(f"{spec.env_var}={quote(env)}: must be 'auto' or one of {spec.choices}")
    return env or spec.default


def requested(mechanism: str, backend: str = "auto") -> str:
    """``backend`` unless it is ``"auto"``; then what the environment variable requests
    (:func:`env_backend`).

    Raises:
        ValueError: ``backend`` or the variable is not ``"auto"`` or a choice.
    """
    if check_choice(mechanism, backend) != "auto":
        return backend
    return env_backend(mechanism)


def load_kernel(mechanism: str) -> ModuleType | None:
    """The mechanism's compiled CPU kernel, compiled on the first call of the process (about
    a minute, one log line), or ``None`` when it cannot be built (the reason is logged once,
    :func:`kernel_status`)."""
    module: ModuleType | None = get_spec(mechanism).kernel().load()
    return module


def kernel_status(mechanism: str) -> str:
    """``"not loaded"``, ``"loaded"`` or ``"unavailable: <reason>"`` for the mechanism's
    compiled CPU kernel."""
    status: str = get_spec(mechanism).kernel().cpu_kernel_status()
    return status


def family_backends(family: str) -> dict[str, str]:
    """The requested backend (:func:`env_backend`) of each mechanism a method of ``family``
    runs, by mechanism: ``"pnmix"`` for the ``quantized`` and ``composed`` families,
    ``"relay"`` for ``eviction`` and ``composed``; ``{}`` for any other family.

    Raises:
        ValueError: a variable that is not ``"auto"`` or a choice.
    """
    return {m: env_backend(m) for m, spec in REGISTRY.items() if family in spec.families}


def preload(backends: Mapping[str, str]) -> None:
    """Compile (first use on this machine) or load the CPU kernels of the requested
    ``backends`` (mechanism -> backend, as :func:`family_backends` gives them), in that
    order, e.g. before timing starts (a compilation must not count as model time). Backends
    that do not run a CPU kernel (``torch``, ``triton``) load nothing; a kernel that cannot be
    built is logged once (its callers then run the torch reference or refuse)."""
    for mechanism, backend in backends.items():
        if backend in get_spec(mechanism).kernel_backends:
            load_kernel(mechanism)


def check_backend_variables() -> None:
    """Refuse a bad ``KVLAB_PNMIX_BACKEND`` or ``KVLAB_RELAY_BACKEND`` value up front (the CLI
    calls this before any model loads, so the error is one line, not a late traceback). A
    variable set to ``cpu`` insists on that compiled kernel: it is compiled (or loaded) here,
    and a kernel that cannot be built is refused here too. Mechanisms are checked in
    :data:`REGISTRY` order.

    Raises:
        ValueError: a value that is not ``auto`` or one of the mechanism's backends, or ``cpu``
            for a kernel that cannot be compiled on this machine
            (``KVLAB_..._BACKEND=cpu: the ... CPU kernel is unavailable: <reason>``).
    """
    for mechanism, spec in REGISTRY.items():
        if env_backend(mechanism) == "cpu" and load_kernel(mechanism) is None:
            raise ValueError(
                f"{spec.env_var}=cpu: the {spec.kernel_name} is {kernel_status(mechanism)}"
            )
