"""kvlab: KV-cache compression for RoPE transformers — RoPE-Relay eviction, PN-Mix 2-bit
caches, and their composition — inside Hugging Face ``transformers`` models.

The names a user needs, importable from here (each loads its module on first use, so
``import kvlab`` is cheap)::

    import kvlab

    loaded = kvlab.load_model("smollm2-135m")                  # model + tokenizer, offline
    method = kvlab.parse_method("pn-mix")                      # any name of `kvlab methods`
    cache = method.make_cache(loaded.model.config, kvlab.prepare(method, loaded))

* configs: :class:`PNMixConfig`, :class:`EvictionConfig`;
* model caches (``transformers`` ``Cache`` subclasses): :class:`PNMixModelCache`,
  :class:`RelayModelCache`, :class:`ComposedModelCache`; :func:`plan_model` (which layers a
  cache compresses); :func:`enable_kvlab_attention` / :func:`use_attention` (the ``"kvlab"``
  attention that reads them);
* models and methods: :func:`load_model`, :func:`parse_method`, :func:`prepare` (a
  method's calibration, cached as ``kvlab eval`` caches it);
* compress once, answer many: :func:`compress_context`, :func:`answer`, :func:`answer_nll`;
  :func:`cache_storage` (the bytes a cache holds).

Everything else lives in the subpackages: :mod:`kvlab.rope`, :mod:`kvlab.relay`,
:mod:`kvlab.pnmix` (the mechanisms, torch only), :mod:`kvlab.integrations`,
:mod:`kvlab.evaluation`, :mod:`kvlab.models`, :mod:`kvlab.artifacts`, :mod:`kvlab.diagnostics`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first use)
_WHERE = {
    "PNMixConfig": "kvlab.pnmix",
    "EvictionConfig": "kvlab.relay",
    "PNMixModelCache": "kvlab.integrations",
    "RelayModelCache": "kvlab.integrations",
    "ComposedModelCache": "kvlab.integrations",
    "enable_kvlab_attention": "kvlab.integrations",
    "use_attention": "kvlab.integrations",
    "plan_model": "kvlab.integrations",
    "load_model": "kvlab.models",
    "parse_method": "kvlab.evaluation.methods",
    "prepare": "kvlab.evaluation.calibration",
    "compress_context": "kvlab.evaluation.questions",
    "answer": "kvlab.evaluation.questions",
    "answer_nll": "kvlab.evaluation.questions",
    "cache_storage": "kvlab.evaluation.metrics",
}

__all__ = ["__version__", *_WHERE]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
