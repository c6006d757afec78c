"""The KV-cache methods ``kvlab eval`` compares: pure data, and a registry that builds them.

The names, and the grammar they follow, are in :mod:`kvlab.evaluation.methods.grammar`.

Modules
-------
* :mod:`~kvlab.evaluation.methods.grammar` — method names: the grammar, its parser
  (:func:`~kvlab.evaluation.methods.grammar.parse_name`) and every name documented.
* :mod:`~kvlab.evaluation.methods.method` — :class:`Method`, :class:`MethodContext`,
  :func:`method_backends`.
* :mod:`~kvlab.evaluation.methods.caches` — the cache factories (:data:`CACHE_FACTORIES`).
* :mod:`~kvlab.evaluation.methods.preparations` — one-time preparations (calibrations,
  :data:`PREPARATIONS`).
* :mod:`~kvlab.evaluation.methods.builtin` — the built-in methods' tables
  (:data:`PNMIX_METHODS`, :data:`DEFAULT_METHODS`) and builders.
* :mod:`~kvlab.evaluation.methods.registry` — name -> :class:`Method`
  (:func:`parse_method`, :func:`register_method`, :func:`register_pattern`).

How a method is represented
---------------------------
A :class:`Method` is plain, picklable data: its name, family, attention implementation, the
settings recorded in artifacts, and ``factory`` + ``params`` — the key of a *cache factory*
in :data:`CACHE_FACTORIES` and the JSON-ready arguments it gets. A factory is a module-level
function ``factory(params, model_config, prepared) -> transformers cache``; ``prepared`` is the
JSON-ready state a *preparation* (:data:`PREPARATIONS`, e.g. a calibration) produced once per
model, or ``None``. No closures and no mutable state, so tasks ship to other processes (Ray
workers) and hash to the same content everywhere.

Adding a method
---------------
One registry entry:

* **A fixed name on an existing factory** (e.g. a new PN-Mix key codec or bit width): one line
  in :data:`PNMIX_METHODS` (:mod:`~kvlab.evaluation.methods.builtin`), the
  :class:`~kvlab.pnmix.PNMixConfig` keyword arguments (``"calibrated": True`` adds the
  per-layer group calibration), e.g.
  ``"pn-mix-lattice": dict(bits=2, key_coding="lattice", group_tokens=32)``.
* **A new eviction scorer**: add it to :data:`kvlab.relay.scorers.SCORERS`; ``relay:NAME@R``
  and ``evict-no-relay:NAME@R`` then work as they are, with the default policy's protected
  window (a scorer-specific default policy: one branch in
  :func:`kvlab.relay.policies.default_policy_settings`), and ``relay-legacy:NAME@R`` with
  ``EvictionConfig``'s plain settings.
* **A new kind of cache** (e.g. eviction composed with PN-Mix): write a module-level factory
  ``def _my_cache(params, model_config, prepared): ...`` (import heavy modules inside it),
  add it to :data:`CACHE_FACTORIES` (:mod:`~kvlab.evaluation.methods.caches`), and register
  the name with :func:`register_method` (a fixed name) or :func:`register_pattern` (a
  parametric name outside the grammar, a regular expression), returning a :class:`Method`.
  A new form of the grammar itself (as ``relay:SCORER@R+PNMIX``, the composed methods, was) is
  one rule in :func:`~kvlab.evaluation.methods.grammar.parse_name` and one builder in
  :mod:`~kvlab.evaluation.methods.builtin`. If it needs a one-time preparation, add a
  :class:`Preparation` to :data:`PREPARATIONS` (:mod:`~kvlab.evaluation.methods.preparations`)
  and set ``Method.preparation`` to its key; list in ``Preparation.modules`` the modules whose
  source decides its result (their code hash keys the on-disk cache,
  :mod:`kvlab.evaluation.calibration`).

Existing names and their numbers must stay unchanged: a method's name, ``params`` and
``settings`` are part of the task hash (:mod:`kvlab.evaluation.plan`; :data:`MODULES` are the
modules whose code it hashes). (Issue 9 changed the eviction defaults once, with new settings
recorded; the ``-legacy`` names keep the earlier rows and settings.)
"""

from __future__ import annotations

from kvlab.evaluation.methods.builtin import (
    DEFAULT_METHODS,
    PNMIX_METHODS,
    hf_quantized_backend_available,
)
from kvlab.evaluation.methods.caches import CACHE_FACTORIES, CacheFactory
from kvlab.evaluation.methods.grammar import MethodName, parse_name
from kvlab.evaluation.methods.method import Method, MethodContext, method_backends
from kvlab.evaluation.methods.preparations import PREPARATIONS, Preparation
from kvlab.evaluation.methods.registry import (
    available_method_names,
    parse_method,
    register_method,
    register_pattern,
    takes_ratio,
)

__all__ = [
    "CACHE_FACTORIES",
    "DEFAULT_METHODS",
    "MODULES",
    "PNMIX_METHODS",
    "PREPARATIONS",
    "CacheFactory",
    "Method",
    "MethodContext",
    "MethodName",
    "Preparation",
    "available_method_names",
    "hf_quantized_backend_available",
    "method_backends",
    "parse_method",
    "parse_name",
    "register_method",
    "register_pattern",
    "takes_ratio",
]

#: The modules below this package (with the package itself, their source decides a method's
#: settings and cache: task keys hash them, :data:`kvlab.evaluation.plan.RESULT_MODULES`).
MODULES = (
    "kvlab.evaluation.methods.builtin",
    "kvlab.evaluation.methods.caches",
    "kvlab.evaluation.methods.grammar",
    "kvlab.evaluation.methods.method",
    "kvlab.evaluation.methods.preparations",
    "kvlab.evaluation.methods.registry",
)
