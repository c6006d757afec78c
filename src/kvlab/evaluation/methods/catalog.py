"""The methods a user picks from, as data: one :class:`MethodDoc` per method name (or
parametric form) with what it does and its source, and the bytes each stores measured on one
reference shape. ``kvlab methods`` prints it; the README's and docs/methods.md's method
tables are generated from it (``kvlab methods --markdown``) and a test regenerates them.

Every fixed name the registry knows (:func:`~kvlab.evaluation.methods.registry.parse_method`)
and every eviction scorer has an entry (a test checks it), so a new method cannot ship without
a line here.

Bytes
-----
:func:`measure_fractions` builds each method's cache the way ``kvlab eval`` does
(:func:`~kvlab.evaluation.questions.compress_context`) on a one-layer random model of
SmolLM2-135M's attention shape (9 query heads, 3 kv heads, ``head_dim`` 64, float32) and a
prompt of :data:`REFERENCE_TOKENS` random tokens, and divides the bytes the cache stores, its
floating-point elements counted at 2 bytes as in a 16-bit model
(:attr:`~kvlab.integrations.cache_protocol.CacheStorage.kv_bytes_16bit`; PN-Mix stores float16
anyway, codes count as stored, eviction's per-token positions are bookkeeping, not counted), by
the same prompt in a 16-bit ``DynamicCache`` (``2 * 2 * tokens * kv_heads * head_dim`` bytes:
keys and values).
The fraction depends on the prompt's length for every method with exact sink and residual
tokens (their share shrinks as the prompt grows), and for calibrated eviction on the per-layer
split (a one-layer model keeps ``1 - R`` of its tokens); it does not depend on the values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CATALOG",
    "REFERENCE_TOKENS",
    "MethodDoc",
    "catalog_entry",
    "markdown_table",
    "measure_fractions",
    "render_tables",
]

#: Prompt length (tokens) of the reference shape the bytes column is measured on.
REFERENCE_TOKENS = 4096


@dataclass(frozen=True)
class MethodDoc:
    """One method as the method table shows it.

    Attributes:
        shown_as: the name as written (a parametric form uses ``R``, ``SCORER``, ``PNMIX``).
        example: a concrete name that parses (``R = 0.5``): the one measured.
        summary: what it does, one sentence.
        source: the paper or tool it follows (author, year, arXiv id), or ``"kvlab"``.
        headline: shown in the README's short table (every entry is in docs/methods.md).
        needs: an optional extra the method needs installed (``""``: none).
    """

    shown_as: str
    example: str
    summary: str
    source: str
    headline: bool = False
    needs: str = ""


_KIVI = "KIVI (Liu et al. 2024, arXiv:2402.02750)"
_PNMIX = "kvlab (docs/pnmix-key-coding-research.md)"
_ABLATION = "kvlab ablation of `pn-mix` (docs/pnmix-key-coding-research.md)"

#: Every method, in the order the tables list them.
CATALOG: tuple[MethodDoc, ...] = (
    MethodDoc("full", "full", "transformers `DynamicCache`, exact: the reference", "—", True),
    MethodDoc(
        "pn-mix",
        "pn-mix",
        "PN-Mix, 2-bit: exact sinks and recent window; pre-RoPE keys at 0–4 bits per rotary "
        "pair (2 on average) chosen once at prefill, 1 % exact key outliers, Hadamard values; "
        "attention reads the packed codes",
        _PNMIX + "; pre-RoPE keys and outliers as KVQuant (Hooper et al. 2024, "
        "arXiv:2401.18079), Hadamard values as QuaRot (Ashkboos et al. 2024, arXiv:2404.00456)",
        True,
    ),
    MethodDoc(
        "pn-mix-lean",
        "pn-mix-lean",
        "`pn-mix`'s coding with 4 sinks and an 8-token residual, for composing with eviction",
        _PNMIX,
        True,
    ),
    MethodDoc(
        "pn-mix-values64",
        "pn-mix-values64",
        "`pn-mix` with one value scale and zero per 64 channels (its density at head_dim 64) "
        "instead of one per token: for head_dim 128–256",
        _PNMIX + "; value groups as KIVI's",
    ),
    MethodDoc(
        "pn-mix-3bit / pn-mix-4bit",
        "pn-mix-4bit",
        "the seed layout (mixed Cartesian / Phase–Norm keys, groups of 128) at 3 or 4 bits",
        _PNMIX,
    ),
    MethodDoc(
        "pn-mix-seed",
        "pn-mix-seed",
        "the seed record's layout: 2-bit mixed Cartesian / Phase–Norm keys, groups of 128",
        _PNMIX,
    ),
    MethodDoc(
        "pn-mix-v1",
        "pn-mix-v1",
        "the previous `pn-mix`: Cartesian / Phase–Norm mix, one group size per layer "
        "calibrated on the package's text (a calibration before the run)",
        _PNMIX,
    ),
    MethodDoc(
        "pn-mix-uniform", "pn-mix-uniform", "`pn-mix-v1` with groups of 32 everywhere", _PNMIX
    ),
    MethodDoc("pn-mix-prerope", "pn-mix-prerope", "pre-RoPE Cartesian keys", _ABLATION),
    MethodDoc(
        "pn-mix-prerope-qmix",
        "pn-mix-prerope-qmix",
        "+ a query-aware 1-bit choice of Cartesian / Phase–Norm per pair",
        _ABLATION,
    ),
    MethodDoc("pn-mix-alloc", "pn-mix-alloc", "pre-RoPE keys with per-pair widths", _ABLATION),
    MethodDoc(
        "pn-mix-alloc-outliers",
        "pn-mix-alloc-outliers",
        "+ 1 % exact key outliers (`pn-mix` adds Hadamard values)",
        _ABLATION,
    ),
    MethodDoc(
        "kivi-2bit",
        "kivi-2bit",
        "per-channel keys / per-token values, 2-bit, groups of 32, same exact sinks and residual",
        _KIVI,
        True,
    ),
    MethodDoc("kivi-4bit", "kivi-4bit", "the same at 4 bits, groups of 128", _KIVI),
    MethodDoc(
        "kivi-2bit-hadamard",
        "kivi-2bit-hadamard",
        "KIVI keys with Hadamard-rotated values",
        _ABLATION,
    ),
    MethodDoc(
        "kivi-2bit-calibrated",
        "kivi-2bit-calibrated",
        "KIVI keys with `pn-mix-v1`'s per-layer group calibration",
        _KIVI,
    ),
    MethodDoc(
        "int4 / int2",
        "int4",
        "per-token min-max keys and values, no exact tokens",
        "per-token quantization baseline",
        True,
    ),
    MethodDoc(
        "relay:SCORER@R",
        "relay:snapkv@0.5",
        "evict a fraction R per kv head (budgets differ per head and layer), then RoPE-Relay: "
        "kept keys rotated to contiguous positions with synchronized query positions",
        "kvlab (RoPE-Relay); scores: SnapKV (Li et al. 2024, arXiv:2404.14469), per-head "
        "budgets as Ada-KV (Feng et al. 2024, arXiv:2407.11550)",
        True,
    ),
    MethodDoc(
        "evict-no-relay:SCORER@R",
        "evict-no-relay:snapkv@0.5",
        "the same eviction, kept keys left at their original positions",
        "SnapKV (Li et al. 2024, arXiv:2404.14469)",
        True,
    ),
    MethodDoc(
        "evict-no-relay:kvzip@R",
        "evict-no-relay:kvzip@0.5",
        "KVzip: score every context token by a reconstruction pass (the model re-reads the "
        "context), then evict; query-agnostic",
        "KVzip (Kim et al. 2025, arXiv:2505.23416)",
        True,
    ),
    MethodDoc(
        "evict-no-relay:SCORER@R+PNMIX",
        "evict-no-relay:kvzip@0.5+pn-mix-lean",
        "eviction composed with PN-Mix: the kept tokens stored as `PNMIX` codes "
        "(`relay:...+PNMIX` relays them too)",
        "kvlab",
        True,
    ),
    MethodDoc(
        "streaming-llm@R",
        "streaming-llm@0.5",
        "4 sinks + the recent window, positions within the cache",
        "StreamingLLM (Xiao et al. 2023, arXiv:2309.17453)",
        True,
    ),
    MethodDoc(
        "SCORER = keynorm",
        "relay:keynorm@0.5",
        "evict the keys of largest L2 norm",
        "Devoto et al. 2024, arXiv:2406.11430",
    ),
    MethodDoc("SCORER = recency", "relay:recency@0.5", "keep the most recent tokens", "—"),
    MethodDoc(
        "SCORER = expected-attention",
        "relay:expected-attention@0.5",
        "score by the attention expected from future queries",
        "Expected Attention (Devoto et al. 2025, arXiv:2510.00636)",
    ),
    MethodDoc(
        "SCORER = tova",
        "relay:tova@0.5",
        "score by the newest query's attention, averaged over heads",
        "TOVA (Oren et al. 2024, arXiv:2401.06104)",
    ),
    MethodDoc(
        "SCORER = combined",
        "relay:combined@0.5",
        "SnapKV's and Expected Attention's scores, normalized and mixed",
        "kvlab",
    ),
    MethodDoc(
        "relay-legacy:SCORER@R / evict-no-relay-legacy:SCORER@R",
        "relay-legacy:snapkv@0.5",
        "kvlab's first eviction policy, before its per-head policy search "
        "(reproduces earlier rows)",
        "kvlab",
    ),
    MethodDoc(
        "hf-quanto-2bit / hf-quanto-4bit / hf-quanto-2bit-per-token / hf-quanto-4bit-per-token",
        "hf-quanto-2bit-per-token",
        "transformers' own `QuantizedCache` with quanto, groups of 64, residual 128 "
        "(per-channel keys; `-per-token`: quanto's defaults, any prompt length)",
        "transformers `QuantizedCache` (optimum-quanto)",
        needs="optimum-quanto",
    ),
    MethodDoc(
        "hf-hqq-2bit / hf-hqq-4bit",
        "hf-hqq-2bit",
        "transformers' own `QuantizedCache` with HQQ",
        "transformers `QuantizedCache` (hqq)",
        needs="hqq",
    ),
)


def catalog_entry(name: str) -> MethodDoc | None:
    """The entry documenting the method named ``name`` (a fixed name, or a parametric one by
    its kind and scorer), or ``None``."""
    for doc in CATALOG:
        forms = [form.strip() for form in doc.shown_as.split("/")]
        if name == doc.example or name in forms:
            return doc
    return None


def _reference_model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=576,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2 * REFERENCE_TOKENS,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _stand_in_prepared(method: Any) -> dict[str, Any] | None:
    """A preparation's state for the one-layer reference model (budgets: ``1 - R``)."""
    if method.preparation == "relay-layer-budgets":
        return {"layer_fractions": [1.0 - float(method.params["ratio"])]}
    if method.preparation == "pnmix-group-allocation":
        return {"layer_group_tokens": [int(method.params.get("group_tokens", 128))]}
    if method.preparation == "kvzip-prompt":
        return {"kvzip_prompt": {"first_ids": [5, 6, 7], "next_ids": [8, 9], "suffix_ids": [10]}}
    return None


def measure_fractions(names: Iterable[str]) -> dict[str, float]:
    """Bytes stored by each named method over a 16-bit cache's, on the reference shape
    (module docstring). Methods that need an optional extra (transformers' ``QuantizedCache``
    rows) are left out, installed or not, so the tables are the same on every machine.

    Raises:
        ValueError: an unknown method name.
    """
    import torch

    from kvlab.evaluation.methods.registry import parse_method
    from kvlab.evaluation.questions import compress_context

    model = _reference_model()
    config = model.config
    ids = torch.randint(
        3, config.vocab_size, (1, REFERENCE_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    sixteen_bit = 2 * 2 * REFERENCE_TOKENS * config.num_key_value_heads * config.head_dim
    out: dict[str, float] = {}
    for name in names:
        doc = catalog_entry(name)
        if doc is not None and doc.needs:  # a peer's extra: its bytes are in kvlab eval's tables
            continue
        method = parse_method(name)
        with torch.no_grad():
            compressed = compress_context(model, ids, method, prepared=_stand_in_prepared(method))
        out[name] = compressed.storage.kv_bytes_16bit / sixteen_bit
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(docs: Sequence[MethodDoc], fractions: dict[str, float] | None = None) -> str:
    """The method table in Markdown: name, what it does, bytes vs a 16-bit cache (from
    ``fractions``, keyed by :attr:`MethodDoc.example`; ``R = 0.5`` for parametric rows), and
    source."""
    lines = [
        "| method | what it does | bytes vs 16-bit | source |",
        "|---|---|---|---|",
    ]
    for doc in docs:
        value = (fractions or {}).get(doc.example)
        if value is None:
            size = "—" if not doc.needs else f"(needs `{doc.needs}`)"
        elif doc.example != doc.shown_as and "@" in doc.example:
            size = f"{value:.3f} (`{doc.example}`)"
        else:
            size = f"{value:.3f}"
        lines.append(
            f"| `{_cell(doc.shown_as)}` | {_cell(doc.summary)} | {size} | {_cell(doc.source)} |"
        )
    return "\n".join(lines) + "\n"


#: The marker pair around a generated table in a Markdown file; the opening marker names the
#: command that prints its content (``--headline``: the README's short table).
TABLE_START = "<!-- methods-table: kvlab methods --markdown --bytes"
TABLE_END = "<!-- /methods-table -->"


def render_tables(text: str, fractions: dict[str, float]) -> str:
    """``text`` (Markdown) with every generated method table replaced by the current one.

    Raises:
        ValueError: an opening marker without its closing one.
    """
    out: list[str] = []
    rest = text
    while TABLE_START in rest:
        head, _, tail = rest.partition(TABLE_START)
        options, _, tail = tail.partition("-->")
        if TABLE_END not in tail:
            raise ValueError(f"{TABLE_START}{options}--> has no {TABLE_END}")
        _, _, rest = tail.partition(TABLE_END)
        docs = [d for d in CATALOG if d.headline or "--headline" not in options]
        out += [head, TABLE_START, options, "-->\n", markdown_table(docs, fractions), TABLE_END]
    return "".join(out) + rest


def main(paths: Sequence[str]) -> None:
    """Rewrite the generated method tables of the Markdown files ``paths`` in place:
    ``python -m kvlab.evaluation.methods.catalog README.md docs/methods.md``."""
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    fractions = measure_fractions(doc.example for doc in CATALOG)
    for path in map(Path, paths):
        path.write_text(render_tables(path.read_text("utf-8"), fractions), "utf-8")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
