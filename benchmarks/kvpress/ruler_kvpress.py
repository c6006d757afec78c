"""RULER side by side, kvpress side: kvpress 0.5.5 presses and transformers' QuantizedCache on
the samples (and token ids) of kvlab's RULER protocol.

Runs in its OWN venv (kvpress 0.5.5 needs ``transformers < 5.3``; kvlab runs on the newer
transformers its pyproject pins; kvpress is never a kvlab dependency) and does not import
kvlab. The venv, as built for this script
(benchmarks/kvpress/README.md has the same commands)::

    python3.11 -m venv ~/venvs/kvpress
    ~/venvs/kvpress/bin/pip install torch==2.13.0      # FIRST: the CPU wheel
    ~/venvs/kvpress/bin/pip install --no-deps kvpress==0.5.5   # its deps: peft, pandas<3
    ~/venvs/kvpress/bin/pip install transformers==5.2.0 accelerate gguf optimum-quanto \\
        "cachetools<6,>=5.5.2" "fire<0.7,>=0.6.0" requests datasets  # kvpress/__init__ imports

(``--no-deps`` keeps pip from resolving kvpress's own pins, which would replace the CPU torch
by a CUDA one; pip then warns that ``peft`` and ``pandas<3`` are missing — nothing here uses
them. Versions: torch 2.13.0+cpu, kvpress 0.5.5, transformers 5.2.0, optimum-quanto 0.2.7,
accelerate 1.15.0, gguf 0.19.0.)

Usage::

    OMP_NUM_THREADS=1 ~/venvs/kvpress/bin/python benchmarks/kvpress/ruler_kvpress.py run \\
        --samples ruler.jsonl --model $QWEN05 \\
        --press snapkv --press expected_attention --ratio 0.5 --ratio 0.75 \\
        --quant 4 --quant 2 --out runs/ruler/kvpress.json
    # KVzip at several ratios from one scoring pass per sample (run_kvzip_shared), checked
    # against a pass per ratio on the first 2 samples
    OMP_NUM_THREADS=1 ~/venvs/kvpress/bin/python benchmarks/kvpress/ruler_kvpress.py run \\
        --samples ruler.jsonl --model $QWEN05 --no-full --press kvzip --ratio 0.5 \\
        --ratio 0.75 --share-kvzip --check-shared 2 --out runs/ruler/kvpress-kvzip.json
    # a tiny passkey fixture in the samples format (chat-templated as kvpress's pipeline does)
    ~/venvs/kvpress/bin/python benchmarks/kvpress/ruler_kvpress.py fixture \\
        --model $QWEN05 \\
        --tokens 1024 --count 2 --out fixture.jsonl

Samples (JSONL, one object a line, written by kvlab's RULER task builder): ``task``, ``length``,
``index``, ``seed``, ``context``, ``question``, ``context_ids``, ``question_ids``, ``outputs``
(references), ``max_new_tokens``, ``metric`` (``"all"`` | ``"part"``). Only the ids are fed to
the model; the texts serve ``--check-pipeline``.

Flow per (method, sample) — kvpress's ``KVPressTextGenerationPipeline._forward`` and
``generate_answer`` (kvpress 0.5.5, kvpress/pipeline.py) on the sample's ids, without the
pipeline's tokenization:

1. a fresh cache (``DynamicCache``; ``QuantizedCache(backend="quanto", config, nbits)`` with
   transformers' defaults — axis 0, groups of 64, residual 128 — as kvpress's tests and
   evaluation build it); ``model.model(input_ids=context_ids, past_key_values=cache)`` (no LM
   head) inside ``press(model)``: the press compresses the context only (query-agnostic, as
   kvpress's RULER leaderboard runs it);
2. the cache's bytes are measured (below);
3. the question ids at positions ``context_length ...`` (the uncompressed length),
   ``logits_to_keep=1``; argmax; then one token at a time at the next positions, greedy, until
   a stop token or ``max_new_tokens`` tokens in all. As in kvpress, the first generated token is
   not checked against the stop set (``first_token_stop`` in the row flags a sample where that
   mattered). Stop set: ``model.generation_config.eos_token_id`` (kvpress's) plus the
   tokenizer's eos and ``<|im_end|>`` where the vocabulary has it. The prediction is
   ``tokenizer.decode(ids, skip_special_tokens=True)``.

Score (RULER, NVIDIA/RULER scripts/eval/synthetic/constants.py): ``string_match_all`` = mean over
references r of ``r.lower() in prediction.lower()``; ``string_match_part`` = max over them.

Cache bytes after compression (before the question): ``cache_bytes`` sums, over layers, the
storage actually held by the key and value tensors (a quanto tensor: its packed data, scales and
shifts; plus the residual full-precision part; storages counted once); ``cache_bytes_16bit`` is
the same cache with every floating-point part (keys, values, quanto's scales and shifts, the
residual) at 2 bytes an element and packed integer data as held — what a 16-bit model's cache
would take; ``cache_tokens`` lists the tokens each layer holds. The model runs in float32, so
an uncompressed cache holds 2x ``cache_bytes_16bit``.
KVzip in kvpress 0.5.5 evicts nothing: it masks the evicted (head, token) entries in attention
(``module.masked_key_indices``) and keeps the whole cache — its ``cache_bytes`` is the full
cache's (more: the kept keys are a slice of the context + reconstruction tensor's storage);
``cache_bytes_16bit_effective`` counts only the unmasked entries (:func:`cache_footprint`).

The first ``QuantizedCache`` use compiles optimum-quanto's CPU extension (minutes; cached by
quanto afterwards): do not kill a run while it compiles.

Output JSON: ``provenance`` (versions, model sha256, samples digest, stop ids, presses' reprs)
and ``rows``, one per (method, ratio, sample): method, press, ratio, cache, task, length, index,
ids_sha256 (:func:`sample_ids_sha256`), context/question tokens, prediction, generated_ids,
score, metric, cache bytes, seconds (prefill, decode, total). Rows are written after each
sample; a rerun skips every (method, ratio, task, length, index) already in ``--out`` (after
checking the model and the ids agree), so a long run can be resumed.

Checks: ``--check-greedy`` decodes the no-press rows again with ``model.generate`` (greedy, the
stop set, the concatenated ids) and records whether the ids agree; ``--check-pipeline`` runs
kvpress's own pipeline on the sample's texts (same press, same cache kind) and records whether
its tokenization gives the sample's ids and its answer equals the prediction.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

PRESSES = ("snapkv", "expected_attention", "kvzip", "streaming_llm", "knorm", "tova")
RATIOS = (0.5, 0.75, 0.875)
SAMPLE_FIELDS = (
    "task", "length", "index", "context_ids", "question_ids", "outputs", "max_new_tokens",
    "metric",
)  # fmt: skip


# ----------------------------------------------------------------------------- pure helpers
def samples_digest(samples: list[dict[str, Any]]) -> str:
    """Hex sha256 over the samples' ``context_ids``, ``question_ids`` and ``outputs`` in order:
    canonical JSON (``separators=(",", ":")``, ``ensure_ascii=False``) of one
    ``[context_ids, question_ids, outputs]`` list per sample — the digest kvlab's RULER builder
    records (``kvlab.evaluation.ruler.samples.samples_digest``), restated here so this side
    needs no kvlab."""
    payload = [
        [list(s["context_ids"]), list(s["question_ids"]), list(s["outputs"])] for s in samples
    ]
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sample_ids_sha256(sample: dict[str, Any]) -> str:
    """One sample's digest: :func:`samples_digest` of that sample alone."""
    return samples_digest([sample])


_NON_PRINTABLE = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, replace each character ``\\x00``-``\\x1f`` by
    ``"\\n"``, strip again (NVIDIA/RULER scripts/eval/evaluate.py)."""
    return _NON_PRINTABLE.sub("\n", prediction.strip()).strip()


def ruler_score(prediction: str, references: list[str], metric: str) -> float:
    """RULER's string_match_all (``"all"``: mean over references of case-insensitive
    containment) or string_match_part (``"part"``: max over references) on the postprocessed
    prediction (:func:`postprocess_prediction`); in [0, 1].

    Raises:
        ValueError: an unknown metric or no references.
    """
    if not references:
        raise ValueError("a sample needs at least one reference")
    pred = postprocess_prediction(prediction).lower()
    hits = [1.0 if r.lower() in pred else 0.0 for r in references]
    if metric == "all":
        return sum(hits) / len(hits)
    if metric == "part":
        return max(hits)
    raise ValueError(f"metric must be 'all' or 'part', not {metric!r}")


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The samples JSONL, each checked for the fields this script needs.

    Raises:
        SystemExit: a line that is not JSON, lacks a field, or repeats (task, length, index).
    """
    samples, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            s = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"{path}:{n}: not JSON ({err})") from None
        missing = [f for f in SAMPLE_FIELDS if f not in s]
        if missing:
            raise SystemExit(f"{path}:{n}: missing {missing}")
        if s["metric"] not in ("all", "part") or not s["outputs"] or not s["context_ids"]:
            raise SystemExit(f"{path}:{n}: metric must be all|part, outputs and ids non-empty")
        key = (s["task"], s["length"], s["index"])
        if key in seen:
            raise SystemExit(f"{path}:{n}: (task, length, index) {key} repeats")
        seen.add(key)
        s["ids_sha256"] = sample_ids_sha256(s)
        samples.append(s)
    if not samples:
        raise SystemExit(f"{path}: no samples")
    return samples


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors behind ``t`` (a tensor subclass with ``__tensor_flatten__``, such as
    quanto's quantized tensors, through its inner tensors: packed data, scales, shifts)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _leaves(getattr(t, name))
    else:
        yield t


def _held_bytes(t: torch.Tensor, seen: set[int]) -> int:
    """Bytes of the storages behind ``t``, each storage counted once via ``seen``."""
    total = 0
    for leaf in _leaves(t):
        storage = leaf.untyped_storage()
        if leaf.numel() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _bytes_16bit(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements with every floating-point part at 2 bytes an element (packed
    integer data as held)."""
    return sum(
        leaf.numel() * (2 if leaf.is_floating_point() else leaf.element_size())
        for leaf in _leaves(t)
    )


def cache_footprint(cache: Any, model: Any = None) -> dict[str, Any]:
    """Bytes and tokens a DynamicCache / QuantizedCache holds (module docstring).

    ``masked_entries`` (per layer) counts the (head, token) entries a press masked instead of
    evicting (kvpress's "fake compression", ``module.masked_key_indices``, e.g. KVzip and
    AdaKV: the cache keeps them, attention ignores them); ``cache_bytes_16bit_effective`` is
    ``cache_bytes_16bit`` less those entries' keys and values at 2 bytes per element."""
    seen: set[int] = set()
    held = sixteen = masked_bytes = 0
    tokens, masked = [], []
    modules = [layer.self_attn for layer in model.model.layers] if model is not None else []
    for i, layer in enumerate(cache.layers):
        parts = [layer.keys, layer.values]
        n_tok = 0
        if hasattr(layer, "_quantized_keys"):
            parts += [layer._quantized_keys, layer._quantized_values]
            n_tok = layer._quantized_keys.shape[-2]
        if layer.keys is not None and layer.keys.dim() == 4:
            n_tok += layer.keys.shape[-2]
        head_dim = 0
        for t in parts:
            if t is None:
                continue
            held += _held_bytes(t, seen)
            sixteen += _bytes_16bit(t)
            if t.dim() == 4:
                head_dim = t.shape[-1]
        tokens.append(int(n_tok))
        idx = getattr(modules[i], "masked_key_indices", None) if i < len(modules) else None
        n_masked = len(idx[0]) if idx is not None else 0
        masked.append(n_masked)
        masked_bytes += n_masked * head_dim * 2 * 2  # keys and values, 2 bytes an element
    return {
        "cache_bytes": held,
        "cache_bytes_16bit": sixteen,
        "cache_bytes_16bit_effective": sixteen - masked_bytes,
        "cache_tokens": tokens,
        "masked_entries": masked,
    }


# ----------------------------------------------------------------------------- model side
def load(model_path: Path) -> tuple[Any, Any]:
    """The GGUF model (float32, eval, SDPA, as kvlab.models.load_model) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    folder, name = str(model_path.parent), model_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=torch.float32
    )
    model.set_attn_implementation("sdpa")
    model.eval()
    return model, tokenizer


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """kvpress's stop set (generation_config.eos_token_id) plus the tokenizer's eos and
    ``<|im_end|>`` when the vocabulary has it."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        ids.add(im_end)
    return sorted(ids)


def make_press(name: str, ratio: float) -> Any:
    """A kvpress press with its 0.5.5 defaults at ``compression_ratio = ratio``."""
    import kvpress as kp

    table: dict[str, Callable[[], Any]] = {
        "snapkv": lambda: kp.SnapKVPress(compression_ratio=ratio),
        "expected_attention": lambda: kp.ExpectedAttentionPress(compression_ratio=ratio),
        "kvzip": lambda: kp.KVzipPress(compression_ratio=ratio),
        "streaming_llm": lambda: kp.StreamingLLMPress(compression_ratio=ratio),
        "knorm": lambda: kp.KnormPress(compression_ratio=ratio),
        "tova": lambda: kp.TOVAPress(compression_ratio=ratio),
    }
    if name not in table:
        raise SystemExit(f"unknown press {name!r}; known: {sorted(table)}")
    return table[name]()


def make_cache(model: Any, nbits: int | None) -> Any:
    from transformers import DynamicCache, QuantizedCache

    if nbits is None:
        return DynamicCache()
    return QuantizedCache(backend="quanto", config=model.config, nbits=nbits)


@contextlib.contextmanager
def kvzip_tokenizer(tokenizer: Any, templated: bool) -> Iterator[None]:
    """KVzip loads ``AutoTokenizer.from_pretrained(model.config.name_or_path)`` (a GGUF's folder
    has no tokenizer files): hand it the loaded tokenizer — with its chat template when the
    samples' contexts start with the template's prefix (kvpress's pipeline layout), else
    without (KVzip's no-template path)."""
    import kvpress.presses.kvzip_press as kz

    given = tokenizer
    if not templated:
        given = copy.copy(tokenizer)
        given.chat_template = None

    class _Fixed:
        @staticmethod
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            return given

    saved = kz.AutoTokenizer
    kz.AutoTokenizer = _Fixed
    try:
        yield
    finally:
        kz.AutoTokenizer = saved


def chat_prefix_ids(tokenizer: Any) -> list[int]:
    """The ids the chat template puts before a user message (what kvpress's pipeline and KVzip
    split off); empty without a template."""
    if tokenizer.chat_template is None:
        return []
    dummy = "dummy context"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text.split(dummy)[0], add_special_tokens=False)


def generate_answer(
    model: Any,
    cache: Any,
    question_ids: torch.Tensor,
    context_length: int,
    max_new_tokens: int,
    stops: list[int],
) -> list[int]:
    """kvpress's ``generate_answer`` (pipeline.py, 0.5.5) returning ids: question at positions
    from ``context_length``, then greedy one token at a time; ``question_ids``: int64 [1, Q]."""
    position_ids = torch.arange(context_length, context_length + question_ids.shape[1])
    position_ids = position_ids.unsqueeze(0)
    out = model(
        input_ids=question_ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1
    )
    position_ids = position_ids[:, -1:] + 1
    generated = [out.logits[0, -1].argmax()]
    for i in range(max_new_tokens - 1):
        out = model(
            input_ids=generated[-1].view(1, 1), past_key_values=cache, position_ids=position_ids + i
        )
        new_id = out.logits[0, -1].argmax()
        generated.append(new_id)
        if int(new_id) in stops:
            break
    return [int(t) for t in generated]


def run_one(
    model: Any,
    sample: dict[str, Any],
    press: Any,
    nbits: int | None,
    stops: list[int],
) -> tuple[list[int], dict[str, Any], float, float]:
    """Prefill the context under ``press`` (or none), measure the cache, decode the answer.
    Returns (generated ids, cache footprint, prefill seconds, decode seconds)."""
    context = torch.tensor([sample["context_ids"]], dtype=torch.int64)
    question = torch.tensor([sample["question_ids"]], dtype=torch.int64)
    cache = make_cache(model, nbits)
    with torch.no_grad():
        begin = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context, past_key_values=cache)
        prefill_s = time.perf_counter() - begin
        footprint = cache_footprint(cache, model)
        begin = time.perf_counter()
        ids = generate_answer(
            model, cache, question, context.shape[1], int(sample["max_new_tokens"]), stops
        )
        decode_s = time.perf_counter() - begin
    return ids, footprint, prefill_s, decode_s


def run_kvzip_shared(
    model: Any, sample: dict[str, Any], ratios: list[float], stops: list[int]
) -> dict[float, tuple[list[int], dict[str, Any], float, float]]:
    """``KVzipPress`` at every ratio of ``ratios`` from ONE prefill and ONE reconstruction pass.

    kvpress 0.5.5's KVzip scores every (layer, kv head, token) in its reconstruction pass
    (``score_val``, float [layers, 1, kv heads, context tokens]) and only then turns the ratio
    into masked indices (``compress_post``: the lowest scores across layers, sinks kept); the
    cache itself is the same at every ratio (KVzip masks, it does not evict). So one pass per
    sample serves every ratio: the scores are kept as ``compress_post`` first sees them, the
    cache is deep-copied per ratio before any answer is decoded (decoding writes kvpress's fake
    keys into the cache at the masked indices), and each ratio's masks are set by a fresh
    ``KVzipPress(ratio).compress_post`` on a copy of the kept scores. ``--check-shared N``
    checks the answers against :func:`run_one` (a pass per ratio) on the first N samples.

    Returns ratio -> (generated ids, cache footprint, the shared prefill + scoring seconds,
    that ratio's decode seconds).
    """
    import kvpress as kp
    from transformers import DynamicCache

    context = torch.tensor([sample["context_ids"]], dtype=torch.int64)
    question = torch.tensor([sample["question_ids"]], dtype=torch.int64)
    cache = DynamicCache()
    press = kp.KVzipPress(compression_ratio=ratios[0])
    kept: dict[str, torch.Tensor] = {}
    compress_post = press.compress_post

    def keep_scores(m: Any) -> None:
        kept["score_val"] = press.score_val.clone()
        compress_post(m)

    press.compress_post = keep_scores  # type: ignore[method-assign]
    out: dict[float, tuple[list[int], dict[str, Any], float, float]] = {}
    with torch.no_grad():
        begin = time.perf_counter()
        with press(model):
            model.model(input_ids=context, past_key_values=cache)
        prefill_s = time.perf_counter() - begin
        if "score_val" not in kept:
            raise RuntimeError("KVzipPress did not score the context (compress_post not called)")
        copies = {ratio: copy.deepcopy(cache) for ratio in ratios}
        for ratio in ratios:
            masks = kp.KVzipPress(compression_ratio=ratio)
            masks.score_val = kept["score_val"].clone()
            masks.compress_post(model)
            footprint = cache_footprint(copies[ratio], model)
            begin = time.perf_counter()
            ids = generate_answer(
                model, copies[ratio], question, context.shape[1],
                int(sample["max_new_tokens"]), stops,
            )  # fmt: skip
            out[ratio] = (ids, footprint, prefill_s, time.perf_counter() - begin)
    return out


def kvzip_kept(model: Any, tokenizer: Any, sample: dict[str, Any], ratio: float) -> list[Any]:
    """The context positions ``KVzipPress(ratio)`` keeps in one sample: per decoder layer, per
    kv head, the sorted indices it does not mask (``masked_key_indices``' complement), the
    sample's context chat-templated or not as :func:`side_run` decides."""
    import kvpress as kp
    from transformers import DynamicCache

    context = torch.tensor([sample["context_ids"]], dtype=torch.int64)
    prefix = chat_prefix_ids(tokenizer)
    templated = bool(prefix) and sample["context_ids"][: len(prefix)] == prefix
    press = kp.KVzipPress(compression_ratio=ratio)
    with torch.no_grad(), kvzip_tokenizer(tokenizer, templated), press(model):
        model.model(input_ids=context, past_key_values=DynamicCache())
    n, heads = context.shape[1], model.config.num_key_value_heads
    kept = []
    for layer in model.model.layers:
        _, head, seq = layer.self_attn.masked_key_indices
        masked = [set(seq[head == h].tolist()) for h in range(heads)]
        kept.append([[i for i in range(n) if i not in masked[h]] for h in range(heads)])
    return kept


def side_kept(args: argparse.Namespace) -> None:
    """``kept``: :func:`kvzip_kept` of the samples named ``TASK:INDEX``, as JSON ``{"TASK:INDEX":
    [layers][kv heads][positions]}`` (what benchmarks/kvpress/kvzip_needle_retention.py
    compares)."""
    samples = {f"{s['task']}:{s['index']}": s for s in read_samples(Path(args.samples))}
    missing = [name for name in args.sample if name not in samples]
    if missing:
        raise SystemExit(f"not in {args.samples}: {missing}")
    model, tokenizer = load(Path(args.model))
    out = {name: kvzip_kept(model, tokenizer, samples[name], args.ratio) for name in args.sample}
    Path(args.out).write_text(json.dumps(out))


def greedy_reference(model: Any, sample: dict[str, Any], stops: list[int]) -> list[int]:
    """``model.generate`` greedy on context + question ids (the no-press check)."""
    ids = torch.tensor([sample["context_ids"] + sample["question_ids"]], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=int(sample["max_new_tokens"]),
            do_sample=False,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else 0,
        )
    return [int(t) for t in out[0, ids.shape[1] :]]


# ----------------------------------------------------------------------------- run
def _versions() -> dict[str, str]:
    names = ("kvpress", "transformers", "torch", "optimum-quanto", "accelerate", "gguf")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    found["python"] = platform.python_version()
    return found


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def row_key(row: dict[str, Any]) -> tuple[str, float, str, int, int]:
    return (row["method"], float(row["ratio"]), row["task"], int(row["length"]), int(row["index"]))


def methods_of(args: argparse.Namespace) -> list[tuple[str, str | None, float, int | None]]:
    """(method name, press name, ratio, nbits) in run order; ``full`` first."""
    out: list[tuple[str, str | None, float, int | None]] = []
    if not args.no_full:
        out.append(("full", None, 0.0, None))
    for name in args.press:
        for ratio in args.ratio:
            if not 0.0 < ratio < 1.0:
                raise SystemExit(f"--ratio {ratio}: kvpress's compression_ratio is in (0, 1)")
            out.append((f"kvpress:{name}", name, ratio, None))
    for nbits in args.quant:
        if nbits not in (2, 4):
            raise SystemExit(f"--quant {nbits}: quanto's QuantizedCache takes 2 or 4 bits")
        out.append((f"quanto-int{nbits}", None, 0.0, nbits))
    return out


def side_run(args: argparse.Namespace) -> None:
    samples = read_samples(Path(args.samples))
    if args.limit:
        samples = samples[: args.limit]
    methods = methods_of(args)
    for name, _, _, _ in methods:
        if name.startswith("kvpress:"):
            make_press(name.split(":", 1)[1], 0.5)  # unknown names fail before the model loads
    model_path = Path(args.model)
    if not model_path.is_file():
        raise SystemExit(f"{model_path}: no such GGUF file")
    out = Path(args.out)
    model_sha = file_sha256(model_path)
    by_key = {(s["task"], s["length"], s["index"]): s for s in samples}
    result: dict[str, Any] = {"provenance": {}, "rows": []}
    if out.is_file():
        result = json.loads(out.read_text())
        if result["provenance"].get("model_sha256") != model_sha:
            raise SystemExit(f"{out}: written for another model; use another --out")
        for row in result["rows"]:
            s = by_key.get((row["task"], row["length"], row["index"]))
            if s is not None and s["ids_sha256"] != row["ids_sha256"]:
                raise SystemExit(f"{out}: sample {row_key(row)[2:]} has other ids than --samples")
    done = {row_key(r) for r in result["rows"]}
    jobs = plan_jobs(methods, samples, done, args.share_kvzip)
    todo = [(m, s) for group, s in jobs for m in group]
    print(f"{len(todo)} (method, ratio, sample) to run, {len(done)} already in {out}", flush=True)
    if not todo:
        return

    torch.manual_seed(0)
    random.seed(0)
    begin = time.perf_counter()
    model, tokenizer = load(model_path)
    load_s = time.perf_counter() - begin
    stops = stop_ids(model, tokenizer)
    prefix = chat_prefix_ids(tokenizer)
    templated = bool(prefix) and all(s["context_ids"][: len(prefix)] == prefix for s in samples)
    prov = result["provenance"]
    prov.update(
        {
            "versions": _versions(),
            "model": str(model_path),
            "model_sha256": model_sha,
            "dtype": "float32",
            "attention": "sdpa",
            "threads": torch.get_num_threads(),
            "samples": str(args.samples),
            "samples_digest": samples_digest(samples),
            "n_samples": len(samples),
            "stop_ids": stops,
            "generation_config_eos": model.generation_config.eos_token_id,
            "contexts_chat_templated": templated,
            "quantized_cache": "QuantizedCache(backend='quanto', axis 0, q_group_size 64, "
            "residual_length 128)",
            "model_load_seconds": load_s,
        }
    )
    presses = prov.setdefault("presses", {})
    pipe = None
    if args.check_pipeline:
        from kvpress import KVPressTextGenerationPipeline

        pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    checked_shared: set[tuple[str, int, int]] = set()

    def emit(
        m: tuple[str, str | None, float, int | None],
        sample: dict[str, Any],
        ran: tuple[list[int], dict[str, Any], float, float],
        extra: dict[str, Any],
    ) -> None:
        method, press_name, ratio, nbits = m
        ids, footprint, prefill_s, decode_s = ran
        prediction = tokenizer.decode(ids, skip_special_tokens=True)
        score = ruler_score(prediction, sample["outputs"], sample["metric"])
        row: dict[str, Any] = {
            "method": method,
            "press": press_name,
            "ratio": ratio,
            "cache": f"quanto-int{nbits}" if nbits else "dynamic",
            "task": sample["task"],
            "length": sample["length"],
            "index": sample["index"],
            "seed": sample.get("seed"),
            "ids_sha256": sample["ids_sha256"],
            "context_tokens": len(sample["context_ids"]),
            "question_tokens": len(sample["question_ids"]),
            "max_new_tokens": int(sample["max_new_tokens"]),
            "prediction": prediction,
            "generated_ids": ids,
            "stopped": "stop" if ids[-1] in stops else "max_new_tokens",
            "first_token_stop": len(ids) > 1 and ids[0] in stops,
            "outputs": sample["outputs"],
            "metric": sample["metric"],
            "score": score,
            **footprint,
            "prefill_seconds": prefill_s,
            "decode_seconds": decode_s,
            "seconds": prefill_s + decode_s,
            **extra,
        }
        if args.check_greedy and press_name is None and nbits is None:
            ref = greedy_reference(model, sample, stops)
            row["greedy_generate_ids"] = ref
            row["greedy_equal"] = ref == ids
        if pipe is not None and "context" in sample and "question" in sample:
            ptoks = pipe.preprocess(sample["context"], [sample["question"]], "", int(1e10))
            row["pipeline_ids_equal"] = (
                ptoks["context_ids"][0].tolist() == sample["context_ids"]
                and ptoks["questions_ids"][0][0].tolist() == sample["question_ids"]
            )
            with guard(press_name):
                answer = pipe(
                    sample["context"],
                    question=sample["question"],
                    press=make_press(press_name, ratio) if press_name else None,
                    cache=make_cache(model, nbits),
                    max_new_tokens=int(sample["max_new_tokens"]),
                )["answer"]
            row["pipeline_answer"] = answer
            row["pipeline_answer_equal"] = answer == prediction
        result["rows"].append(row)
        _write(out, result)
        checks = "".join(
            f" {k}={row[k]}"
            for k in ("greedy_equal", "pipeline_answer_equal", "separate_equal")
            if k in row
        )
        print(
            f"{method}@{ratio} {sample['task']}/{sample['length']}/{sample['index']}: "
            f"score {score:.2f} {prediction!r} kv {footprint['cache_bytes']} B "
            f"({footprint['cache_bytes_16bit']} B at 16 bit) {row['seconds']:.1f} s{checks}",
            flush=True,
        )

    def guard(name: str | None) -> contextlib.AbstractContextManager:
        if name == "kvzip":
            return kvzip_tokenizer(tokenizer, templated)
        return contextlib.nullcontext()

    for group, sample in jobs:
        for _, press_name, ratio, _ in group:
            if press_name is not None:
                presses[f"kvpress:{press_name}@{ratio}"] = repr(make_press(press_name, ratio))
        if args.share_kvzip and group[0][1] == "kvzip":
            ratios = [m[2] for m in group]
            with guard("kvzip"):
                shared = run_kvzip_shared(model, sample, ratios, stops)
            check = len(checked_shared) < args.check_shared
            checked_shared.add((sample["task"], sample["length"], sample["index"]))
            for m in group:
                extra: dict[str, Any] = {
                    "kvzip_scoring": f"shared: one reconstruction pass for ratios {ratios}"
                }
                if check:
                    with guard("kvzip"):
                        alone = run_one(model, sample, make_press("kvzip", m[2]), None, stops)
                    extra["separate_ids"] = alone[0]
                    extra["separate_equal"] = alone[0] == shared[m[2]][0]
                emit(m, sample, shared[m[2]], extra)
            continue
        (m,) = group
        press = make_press(m[1], m[2]) if m[1] else None
        with guard(m[1]):
            ran = run_one(model, sample, press, m[3], stops)
        emit(m, sample, ran, {})


def plan_jobs(
    methods: list[tuple[str, str | None, float, int | None]],
    samples: list[dict[str, Any]],
    done: set[tuple[str, float, str, int, int]],
    share_kvzip: bool,
) -> list[tuple[list[tuple[str, str | None, float, int | None]], dict[str, Any]]]:
    """The (methods, sample) jobs still to run, in order: one method per job, except that with
    ``share_kvzip`` the KVzip ratios of a sample not yet in ``done`` form one job (one scoring
    pass, :func:`run_kvzip_shared`), after the other methods."""

    def todo(m: tuple[str, str | None, float, int | None], s: dict[str, Any]) -> bool:
        return (m[0], m[2], s["task"], s["length"], s["index"]) not in done

    shared = [m for m in methods if share_kvzip and m[1] == "kvzip"]
    jobs = [([m], s) for m in methods if m not in shared for s in samples if todo(m, s)]
    for s in samples:
        group = [m for m in shared if todo(m, s)]
        if group:
            jobs.append((group, s))
    return jobs


# ----------------------------------------------------------------------------- fixture
def side_fixture(args: argparse.Namespace) -> None:
    """A passkey-style JSONL in the samples format, tokenized as kvpress's pipeline does
    (chat template around the context; the question carries the template's suffix)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    path = Path(args.model)
    tok = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    filler = (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    )
    head = (
        "There is an important info hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about the important information there.\n"
    )
    rng = random.Random(args.seed)
    n_fill = max(1, args.tokens // len(tok.encode(filler, add_special_tokens=False)))
    with Path(args.out).open("w") as f:
        for index in range(args.count):
            key = str(rng.randint(10000, 99999))
            needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
            depth = rng.randint(0, n_fill)
            context = head + filler * depth + needle + filler * (n_fill - depth)
            question = "What is the pass key? The pass key is"
            sep = "#" * (len(context) + 10)
            text = tok.apply_chat_template(
                [{"role": "user", "content": context + sep}],
                add_generation_prompt=True,
                tokenize=False,
            )
            ctx_text, suffix = text.split(sep)
            sample = {
                "task": "passkey",
                "length": args.tokens,
                "index": index,
                "seed": args.seed,
                "context": context,
                "question": question,
                "context_ids": tok.encode(ctx_text, add_special_tokens=False),
                "question_ids": tok.encode(question + suffix, add_special_tokens=False),
                "outputs": [key],
                "max_new_tokens": 16,
                "metric": "all",
            }
            f.write(json.dumps(sample) + "\n")
            print(f"sample {index}: {len(sample['context_ids'])} context tokens, key {key}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run presses / quantized caches on the samples")
    p.add_argument("--samples", required=True, help="samples JSONL (module docstring)")
    p.add_argument("--model", required=True, help="the .gguf file")
    p.add_argument("--press", action="append", default=[], help=f"one of {PRESSES} (repeat)")
    p.add_argument("--ratio", action="append", type=float, default=[], help="compression_ratio")
    p.add_argument("--quant", action="append", type=int, default=[], help="QuantizedCache bits")
    p.add_argument("--no-full", action="store_true", help="skip the no-press baseline")
    p.add_argument("--limit", type=int, default=0, help="only the first N samples")
    p.add_argument("--check-greedy", action="store_true", help="baseline vs model.generate")
    p.add_argument("--check-pipeline", action="store_true", help="vs kvpress's own pipeline")
    p.add_argument(
        "--share-kvzip",
        action="store_true",
        help="one KVzip scoring pass per sample for all --ratio values (run_kvzip_shared)",
    )
    p.add_argument(
        "--check-shared",
        type=int,
        default=0,
        metavar="N",
        help="with --share-kvzip: also run each ratio alone on the first N samples, compare",
    )
    p.add_argument("--out", required=True, help="results JSON (resumed if present)")
    p = sub.add_parser("kept", help="KVzipPress's kept positions per layer and kv head")
    p.add_argument("--samples", required=True, help="samples JSONL (module docstring)")
    p.add_argument("--model", required=True, help="the .gguf file")
    p.add_argument("--sample", action="append", required=True, help="TASK:INDEX (repeat)")
    p.add_argument("--ratio", type=float, required=True, help="compression_ratio")
    p.add_argument("--out", required=True, help="JSON output")
    p = sub.add_parser("fixture", help="write a passkey-style samples JSONL")
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=1024, help="about this many context tokens")
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        if args.press and not args.ratio:
            args.ratio = list(RATIOS)
        side_run(args)
    elif args.cmd == "kept":
        side_kept(args)
    else:
        side_fixture(args)


if __name__ == "__main__":
    sys.exit(main())
