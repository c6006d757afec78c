"""The grammar of method names: every name ``kvlab eval --method`` accepts, parsed once.

A name is a *plain name* (a registered fixed name: ``full``, ``pn-mix``, ``int4``, ...,
looked up as it is) or a *parametric name*::

    name       := parametric | plain
    parametric := KIND [":" SCORER] "@" RATIO ["+" PNMIX]
    KIND       := "relay" | "evict-no-relay" | "relay-legacy" | "evict-no-relay-legacy"
                | "streaming-llm"
    SCORER     := [a-z0-9_-]+
    RATIO      := [0-9.]+            (a number in [0, 1): checked by :func:`parse_ratio`)
    PNMIX      := [a-z0-9-]+         (only after KIND "relay" or "evict-no-relay")
    plain      := any text without "@"

:func:`parse_name` returns a parametric name's parts (:class:`MethodName`, as text) or
``None``; what the parts mean (a known scorer, R in [0, 1), a known PN-Mix method) is the registry's
(:mod:`kvlab.evaluation.methods.registry`), which maps a name to its
:class:`~kvlab.evaluation.methods.method.Method`.

The names
---------
``--method`` is repeatable.

* ``full`` — ``transformers.DynamicCache``, exact (the reference), SDPA attention.
* ``pn-mix`` — :class:`~kvlab.integrations.PNMixModelCache`, 2-bit, 32 sinks, 32 residual,
  float16 storage, groups of 32 tokens in every layer (no calibration): the issue-8 coding
  (docs/pnmix-key-coding-research.md) — pre-RoPE keys with a code width in {0, 2, 3, 4} bits
  per (kv head, rotary pair) averaging 2, chosen once per row by the query-weighted logit error
  (key coding ``bit_alloc``), 1 % of each group's key elements kept exact (dense-and-sparse
  outliers), and per-token values of Hadamard-rotated channels.
* Its ablation ladder (each row adds one component, groups of 32): ``pn-mix-prerope``
  (pre-RoPE Cartesian keys), ``pn-mix-prerope-qmix`` (+ the query-aware 1-bit mix of
  pre-RoPE Cartesian / Phase–Norm), ``pn-mix-alloc`` (pre-RoPE keys with query-aware per-pair
  widths), ``pn-mix-alloc-outliers`` (+ 1 % exact key outliers); ``pn-mix`` adds Hadamard
  values. ``kivi-2bit-hadamard``: KIVI keys with Hadamard values (values alone).
* ``pn-mix-values64`` — ``pn-mix`` with one value scale and zero per 64 channels of the
  Hadamard frame (``PNMixConfig(value_group_channels=64)``): 2.5 bits per value channel at any
  head_dim, where ``pn-mix`` spends ``2 + 32 / head_dim`` (2.125 at Gemma 3's 256); the CPU
  and Triton kernels read the grouped value scalars.
* ``pn-mix-v1`` — the previous ``pn-mix``: Cartesian / Phase–Norm mix by first-group saliency,
  one group size per layer chosen by
  :func:`~kvlab.integrations.pnmix_calibration.calibrate_group_tokens` on the package's own
  text (not the evaluation text) under the scalar-byte budget of uniform groups of 32 tokens.
  ``pn-mix-uniform``: the same with every layer at 32 tokens.
* ``pn-mix-seed`` — the seed layout, :class:`~kvlab.pnmix.PNMixConfig` defaults (2-bit mix,
  groups of 128). ``pn-mix-3bit`` / ``pn-mix-4bit`` — the same layout at 3 or 4 bits.
* ``kivi-2bit`` / ``kivi-4bit`` — the same cache with every key channel Cartesian (per-channel
  min-max over a group of tokens: KIVI keys, Liu et al. 2024, arXiv:2402.02750), per-token
  values, same sinks and residual; ``kivi-2bit`` uses KIVI's groups of 32 tokens in every
  layer, ``kivi-2bit-calibrated`` the allocation procedure of ``pn-mix-v1`` (ablation: the
  allocation without Phase–Norm).
* ``int4`` / ``int2`` — per-token min-max keys and values (groups of 128 tokens flushed as they
  fill, no sinks, no residual window beyond the filling group).
* ``hf-quanto-2bit`` / ``hf-quanto-4bit`` / ``hf-hqq-2bit`` / ``hf-hqq-4bit`` — ``transformers``'
  own ``QuantizedCache`` (peer rows; need ``optimum-quanto`` or ``hqq``): per-channel keys
  (quanto ``axis_key=-1``, hqq ``axis_key=0``), per-token values, groups of 64, residual 128.
  quanto's per-channel groups run along the flattened (kv head, token) axis, so they need
  ``num_key_value_heads * tokens`` to be a multiple of 64 at every quantization (quanto raises
  "Group size (64) must be a divisor of ..." otherwise, e.g. on most RULER contexts);
  ``hf-quanto-2bit-per-token`` / ``hf-quanto-4bit-per-token`` are ``QuantizedCache``'s own
  quanto defaults (``axis_key=0``, ``axis_value=0``: per-token keys and values), which run at
  any length.
* ``relay@R`` / ``relay:SCORER@R`` — :class:`~kvlab.integrations.RelayModelCache`, RoPE-Relay
  after eviction; ``SCORER`` is any name in :data:`kvlab.relay.scorers.SCORERS` (``snapkv``,
  the default, ``keynorm``, ``recency``, ``expected-attention``, ``tova``, ``combined``,
  ``kvzip``), with
  the default policy of :func:`kvlab.relay.policies.default_policy` (chosen by the search in
  docs/archive/results-history.md, section 6, "Policy search"). With SnapKV in the
  prefill-score protocol the budget is also split across layers by a calibration on the
  package's own text before the run (the preparation ``"relay-layer-budgets"``,
  :func:`~kvlab.integrations.relay_calibration.calibrate_layer_budgets`, like ``pn-mix``; relay
  and no relay share it).
* ``evict-no-relay@R`` / ``evict-no-relay:SCORER@R`` — the same selection, keys left at their
  original positions.
* ``relay:kvzip@R`` / ``evict-no-relay:kvzip@R`` — KVzip (Kim et al. 2025, arXiv:2505.23416):
  the cache stores the prefill, a reconstruction pass (the model re-reading the context after
  "Repeat the previous context exactly.") scores every stored token, then it evicts
  (:func:`kvlab.integrations.kvzip.compress`, called by the prefill-score protocol right after
  the prefill forward). The repeat prompt is tokenized once (preparation ``"kvzip-prompt"``).
  Prefill-score protocol only (one eviction after the prefill).
* ``relay-legacy:SCORER@R`` / ``evict-no-relay-legacy:SCORER@R`` — the policy before that
  search (:func:`kvlab.relay.policies.legacy_policy`); reproduces the earlier rows.
* ``streaming-llm@R`` — StreamingLLM (Xiao et al. 2023): 4 sinks + recent window, uniform per
  head, positions within the cache (i.e. relayed), as in the paper.
* ``relay:SCORER@R+PNMIX`` / ``evict-no-relay:SCORER@R+PNMIX`` — eviction composed with PN-Mix
  (:class:`~kvlab.integrations.composed_cache.ComposedModelCache`): the eviction method
  ``relay:SCORER@R`` (or ``evict-no-relay:...``) with its full policy — its default policy
  and, for SnapKV, its calibrated per-layer budgets (the same preparation
  ``"relay-layer-budgets"``, shared) — then the kept tokens stored by the PN-Mix method
  ``PNMIX`` (any uncalibrated name of :data:`PNMIX_METHODS`: ``pn-mix``, ``pn-mix-lean``,
  ``kivi-2bit``, ...). Prefill-score and RULER protocols (one eviction after the prefill).
  With ``kvzip`` (``evict-no-relay:kvzip@0.5+pn-mix-lean``) the cache stores the prefill,
  KVzip's reconstruction pass scores it, and the kept tokens are packed after that eviction.
* ``pn-mix-lean`` — ``pn-mix``'s coding with 4 sinks and an 8-token residual instead of 32 +
  32, meant for composition (``evict-no-relay:snapkv@0.5625+pn-mix-lean``): a kept stream of
  ``k`` tokens keeps ``4 + 8`` to ``4 + 39`` of them exact (docs/design.md, "Flush rule"), so
  at 56 % eviction the composed cache is about 1/8 of the full cache's bytes
  (docs/archive/results-history.md, section 9, "At 1/8 of full bytes"). Usable alone too.

``R`` is the evicted fraction, in [0, 1). Protocol ``prefill-score``: the cache keeps
``(1 - R) * P`` tokens per kv head (layer average) after the prefill of ``P`` tokens.
Protocols ``stream`` and ``needle``: the cache keeps at most ``(1 - R) * cache_slots`` tokens
per kv head.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

from kvlab.userinput import quote

__all__ = [
    "COMPOSABLE_KINDS",
    "EVICTION_KINDS",
    "GRAMMAR_NAMES",
    "MethodName",
    "parse_name",
    "parse_ratio",
]

#: The eviction kinds of a parametric name, as written before ``[:SCORER]@R``.
EVICTION_KINDS = (
    "relay",
    "evict-no-relay",
    "relay-legacy",
    "evict-no-relay-legacy",
    "streaming-llm",
)
#: The kinds that may be composed with PN-Mix (``+PNMIX``).
COMPOSABLE_KINDS = ("relay", "evict-no-relay")
#: How help texts show the parametric names
#: (:func:`~kvlab.evaluation.methods.registry.available_method_names`).
GRAMMAR_NAMES = (
    "relay[:SCORER]@R",
    "evict-no-relay[:SCORER]@R",
    "relay-legacy[:SCORER]@R",
    "evict-no-relay-legacy[:SCORER]@R",
    "relay[:SCORER]@R+PNMIX / evict-no-relay[:SCORER]@R+PNMIX",
    "streaming-llm@R",
)

_SCORER_CHARS = frozenset(string.ascii_lowercase + string.digits + "_-")
_RATIO_CHARS = frozenset(string.digits + ".")
_PNMIX_CHARS = frozenset(string.ascii_lowercase + string.digits + "-")


@dataclass(frozen=True)
class MethodName:
    """A parsed parametric method name (module docstring): its parts as written.

    Attributes:
        text: the whole name.
        kind: one of :data:`EVICTION_KINDS`.
        scorer: the ``SCORER`` after ``:``, or ``None`` when not given.
        ratio: the ``RATIO`` text after ``@`` (not yet a number).
        pnmix: the ``PNMIX`` method name after ``+``, or ``None`` when not composed.
    """

    text: str
    kind: str
    scorer: str | None
    ratio: str
    pnmix: str | None = None

    def eviction(self) -> MethodName:
        """The eviction part of a composed name: ``KIND[:SCORER]@R`` without ``+PNMIX``
        (the name itself when not composed)."""
        if self.pnmix is None:
            return self
        text = self.text[: len(self.text) - len(self.pnmix) - 1]
        return MethodName(text, self.kind, self.scorer, self.ratio)


def _word(text: str, chars: frozenset[str]) -> bool:
    return bool(text) and all(c in chars for c in text)


def parse_name(text: str) -> MethodName | None:
    """The parts of ``text`` when it is a parametric name of the grammar (module docstring),
    taken as given (not stripped).

    Returns:
        A :class:`MethodName` for a well-formed ``KIND[:SCORER]@RATIO[+PNMIX]``, else ``None``
        (a plain name, looked up as it is, or no name of the grammar).
    """
    head, at, tail = text.partition("@")
    kind, colon, scorer = head.partition(":")
    ratio, plus, pnmix = tail.partition("+")
    if not at or kind not in EVICTION_KINDS or (colon and not _word(scorer, _SCORER_CHARS)):
        return None
    if not _word(ratio, _RATIO_CHARS):
        return None
    if plus and (kind not in COMPOSABLE_KINDS or not _word(pnmix, _PNMIX_CHARS)):
        return None
    return MethodName(text, kind, scorer if colon else None, ratio, pnmix if plus else None)


def parse_ratio(name: str, text: str) -> float:
    """The evicted fraction ``R`` of the parametric name ``name``, from its ``RATIO`` text.

    Raises:
        ValueError: a number outside [0, 1) ("R must lie in [0, 1), got -0.1"), or text that is
            not a number written with digits and ``.`` (``nan``, ``1e-1``, `` 0.5``, ``abc``).
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    written = _word(text, _RATIO_CHARS) and not math.isnan(value)  # digits and '.' (or inf)
    if (written or math.isfinite(value)) and not 0.0 <= value < 1.0:
        raise ValueError(f"method {quote(name)}: R must lie in [0, 1), got {value}")
    if not written:
        raise ValueError(
            f"method {quote(name)}: R (after '@') must be a number in [0, 1) written with digits "
            f"and '.', e.g. @0.5, got {quote(text)}"
        )
    return value
