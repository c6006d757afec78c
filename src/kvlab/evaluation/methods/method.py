"""A KV-cache method as plain, picklable data (:class:`Method`), what its budget depends on
(:class:`MethodContext`), and the kvlab mechanisms it runs (:func:`method_backends`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvlab.evaluation.methods.caches import CACHE_FACTORIES
from kvlab.userinput import quote

__all__ = ["METHOD_PROTOCOLS", "Method", "MethodContext", "check_method", "method_backends"]

#: The protocols a method's budget may be built for (:class:`MethodContext`; ``"ruler"``
#: compresses a prefill once, as ``"prefill-score"`` does).
METHOD_PROTOCOLS = ("prefill-score", "stream", "needle", "ruler")


@dataclass(frozen=True)
class Method:
    """A named KV-cache method, as plain data (:mod:`kvlab.evaluation.methods`).

    Attributes:
        name: the name as given (table row label).
        family: ``"full"``, ``"quantized"`` (kvlab PN-Mix family), ``"hf-quantized"`` or
            ``"eviction"``.
        attention: the attention implementation it runs with (``"sdpa"`` or ``"kvlab"``).
        description: one line for tables and artifacts.
        settings: the method's configuration as recorded in artifacts (JSON-ready).
        factory: key of its cache factory in
            :data:`~kvlab.evaluation.methods.caches.CACHE_FACTORIES`.
        params: the factory's arguments (JSON-ready).
        preparation: key of a one-time preparation in
            :data:`~kvlab.evaluation.methods.preparations.PREPARATIONS`, or ``None``.
    """

    name: str
    family: str
    attention: str
    description: str
    settings: Mapping[str, Any]
    factory: str
    params: Mapping[str, Any] = field(default_factory=dict)
    preparation: str | None = None

    def make_cache(self, model_config: Any, prepared: Mapping[str, Any] | None = None) -> Any:
        """A fresh ``transformers`` cache for ``model_config``.

        Args:
            prepared: the state :attr:`preparation` produced (required when it is set).

        Raises:
            RuntimeError: the method needs a preparation and ``prepared`` is ``None``.
        """
        if self.preparation is not None and prepared is None:
            raise RuntimeError(
                f"method {quote(self.name)} must be prepared (calibrated) before use: pass "
                "prepared=kvlab.prepare(method, loaded) with loaded = kvlab.load_model(...) "
                f"(its preparation {self.preparation!r}; kvlab eval runs it itself)"
            )
        return CACHE_FACTORIES[self.factory](self.params, model_config, prepared)

    def record(self) -> dict[str, Any]:
        """JSON-ready description (hashed into tasks; see :mod:`kvlab.evaluation.plan`)."""
        return {
            "name": self.name,
            "family": self.family,
            "attention": self.attention,
            "description": self.description,
            "settings": dict(self.settings),
            "factory": self.factory,
            "params": dict(self.params),
            "preparation": self.preparation,
        }


def check_method(method: Any) -> None:
    """A ``TypeError`` unless ``method`` is a :class:`Method`, saying to parse a name first."""
    if isinstance(method, str):
        raise TypeError(
            f"method must be a Method, got a str: call kvlab.parse_method({quote(method)}) first"
        )
    if not isinstance(method, Method):
        raise TypeError(
            f"method must be a Method (from kvlab.parse_method(name)), got {type(method).__name__}"
        )


@dataclass(frozen=True)
class MethodContext:
    """What a method's budget may depend on: the protocol and the stream cache window.

    Attributes:
        protocol: one of :data:`METHOD_PROTOCOLS`.
        cache_slots: tokens per kv head of the stream/needle cache window.
    """

    protocol: str = "prefill-score"
    cache_slots: int = 2048


def method_backends(method: Method) -> dict[str, str]:
    """The requested attention backend of each kvlab mechanism ``method`` runs: ``"pnmix"``
    (``KVLAB_PNMIX_BACKEND``) for the PN-Mix and composed families, ``"relay"``
    (``KVLAB_RELAY_BACKEND``) for the eviction and composed families; ``{}`` otherwise
    (:func:`kvlab.backends.family_backends`).

    Raises:
        ValueError: a variable that is not a backend name (see :mod:`kvlab.backends`).
    """
    from kvlab.backends import family_backends

    return family_backends(method.family)
