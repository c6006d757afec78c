"""The backend registry (kvlab.backends): one reader per variable, the values and messages the
mechanisms' own tests pin, preloading and the CLI's check (docs/design.md, "Kernels")."""

from __future__ import annotations

import types

import pytest

from kvlab import backends
from kvlab.pnmix.kernels import dispatch
from kvlab.relay.kernels import cpu as relay_cpu


def test_the_registry_is_what_the_mechanisms_export():
    assert list(backends.REGISTRY) == ["pnmix", "relay"]
    assert dispatch.ENV_VAR == backends.PNMIX.env_var == "KVLAB_PNMIX_BACKEND"
    assert dispatch.BACKENDS == backends.PNMIX.choices == ("torch", "cpu", "triton")
    assert relay_cpu.ENV_VAR == backends.RELAY.env_var == "KVLAB_RELAY_BACKEND"
    assert relay_cpu.BACKENDS == backends.RELAY.choices == ("torch", "cpu")
    for spec in backends.REGISTRY.values():
        kernel = spec.kernel()
        assert callable(kernel.load) and callable(kernel.cpu_kernel_status)
    with pytest.raises(ValueError, match="unknown mechanism 'cuda'"):
        backends.get_spec("cuda")


def test_one_reader_per_variable(monkeypatch):
    for spec in backends.REGISTRY.values():
        monkeypatch.delenv(spec.env_var, raising=False)
        assert backends.env_backend(spec.mechanism) == "auto"
        monkeypatch.setenv(spec.env_var, " torch ")
        assert backends.env_backend(spec.mechanism) == "torch"
        assert backends.requested(spec.mechanism) == "torch"
        assert backends.requested(spec.mechanism, "cpu") == "cpu"  # the argument wins
        monkeypatch.setenv(spec.env_var, "fast")
        with pytest.raises(ValueError) as err:
            backends.env_backend(spec.mechanism)
        assert str(err.value) == (f"{spec.env_var}='fast': must be 'auto' or one of {spec.choices}")
        with pytest.raises(ValueError) as err:
            backends.check_choice(spec.mechanism, "gpu")
        assert str(err.value) == f"backend must be 'auto' or one of {spec.choices}, got 'gpu'"
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "triton")
    assert dispatch.requested_backend("auto") == "triton"
    monkeypatch.setenv("KVLAB_RELAY_BACKEND", "cpu")
    assert relay_cpu.decode_backend() == "cpu"


def test_family_backends(monkeypatch):
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "triton")
    monkeypatch.delenv("KVLAB_RELAY_BACKEND", raising=False)
    assert backends.family_backends("quantized") == {"pnmix": "triton"}
    assert backends.family_backends("eviction") == {"relay": "auto"}
    assert backends.family_backends("composed") == {"pnmix": "triton", "relay": "auto"}
    assert backends.family_backends("full") == {}


def _fake_kernels(monkeypatch, available: bool) -> list[str]:
    """Replace both kernels' modules by fakes that record their loads."""
    loads: list[str] = []

    def fake(mechanism: str) -> types.SimpleNamespace:
        def load() -> types.ModuleType | None:
            loads.append(mechanism)
            return types.ModuleType(mechanism) if available else None

        status = "loaded" if available else "unavailable: no compiler"
        return types.SimpleNamespace(load=load, cpu_kernel_status=lambda: status)

    fakes = {m: fake(m) for m in backends.REGISTRY}
    monkeypatch.setattr(backends.BackendSpec, "kernel", lambda self: fakes[self.mechanism])
    return loads


def test_preload_loads_the_cpu_kernels_of_the_requested_backends(monkeypatch):
    loads = _fake_kernels(monkeypatch, available=True)
    backends.preload({"pnmix": "auto", "relay": "cpu"})
    assert loads == ["pnmix", "relay"]
    loads.clear()
    backends.preload({"pnmix": "triton", "relay": "torch"})
    backends.preload({})
    assert loads == []


def test_the_cli_check_refuses_a_cpu_backend_that_cannot_compile(monkeypatch):
    loads = _fake_kernels(monkeypatch, available=False)
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)
    monkeypatch.delenv("KVLAB_RELAY_BACKEND", raising=False)
    backends.check_backend_variables()  # auto: nothing compiled up front
    assert loads == []
    monkeypatch.setenv("KVLAB_RELAY_BACKEND", "cpu")
    with pytest.raises(ValueError) as err:
        backends.check_backend_variables()
    assert str(err.value) == (
        "KVLAB_RELAY_BACKEND=cpu: the RoPE-Relay CPU kernel is unavailable: no compiler"
    )
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "cpu")  # checked first
    with pytest.raises(ValueError, match=r"^KVLAB_PNMIX_BACKEND=cpu: the PN-Mix CPU kernel is"):
        backends.check_backend_variables()
