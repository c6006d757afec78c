"""``kvlab sweep FILE.toml``: a grid of evaluations run as one plan.

The file (TOML; an example: ``examples/sweep-smollm2.toml``)::

    models = ["smollm2-135m"]          # model specs, as ``kvlab eval --model``
    texts = ["default"]                # "default" = the package's text; else a path
                                       # (relative to the sweep file)
    protocols = ["prefill-score"]      # any of prefill-score, stream, needle
    methods = ["relay:snapkv", "streaming-llm", "pn-mix"]
    ratios = [0.25, 0.5]               # R for methods that take one (name@R), or "{ratio}"
    bits = [3, 4]                      # substituted for "{bits}" in a name, e.g. "pn-mix-{bits}bit"
    dtype = "float32"

    [prefill-score]                    # options of each protocol, as kvlab eval's
    windows = 2
    prefill = 512
    score = 128

    [stream]                           # stream_length, chunk_size, cache_slots, segment
    [needle]                           # lengths, depths, trials, seed, chunk_size, cache_slots

The grid is models × texts × protocols, each with every method (× ratios, × bits). One group
(model, text, protocol) is one ``kvlab eval`` run; all groups' tasks form one plan and share
one task store, ``<output-dir>/tasks/`` (a task shared by groups — e.g. the ``full`` reference
of a window — runs once). Each finished task is stored as it finishes and skipped on rerun.

Written under the output folder: per group ``<model>--<text>/`` with the files of
``kvlab eval`` (:mod:`kvlab.evaluation.report`); ``summary.md`` — every group's table without
wall times (so it compares across executors and machines); and per model and text with the
prefill-score protocol, ``pareto-<model>--<text>.png``, KL against bytes with the Pareto front.

Names are unique by construction (:func:`group_names`): ``<model>`` is the slug of the model's
file or folder name, ``<text>`` of the text file's stem (``default`` for the package text) —
unchanged when no other model (text) of the sweep has the same slug, case aside, and it is at
most :data:`SLUG_MAX` characters. Otherwise the slug gets ``-<first 8 hex digits of the sha256
of the spec as written>`` (``run1/model`` and ``run2/model``: ``model-<hash>`` each; a long
name keeps its first characters), and a name without any ASCII letter or digit becomes
``model-<hash>`` / ``text-<hash>``. A model, text or protocol listed twice is refused. Every
path the sweep writes — names and whole paths against the file system's limits included — is
checked before any model loads (:func:`sweep_paths`,
:func:`~kvlab.evaluation.outputs.check_output_paths`).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvlab.evaluation.plan import PROTOCOLS, EvalConfig
from kvlab.userinput import quote

__all__ = ["SweepOptions", "SweepOutcome", "expand_methods", "load_sweep", "run_sweep"]

_TOP = {"models", "texts", "protocols", "methods", "ratios", "bits", "dtype", *PROTOCOLS}
_PROTOCOL_OPTIONS = {
    "prefill-score": {"windows": "windows", "prefill": "prefill", "score": "score"},
    "stream": {
        "stream_length": "stream_length",
        "chunk_size": "chunk",
        "cache_slots": "cache_slots",
        "segment": "segment",
    },
    "needle": {
        "lengths": "needle_lengths",
        "depths": "needle_depths",
        "trials": "needle_trials",
        "seed": "needle_seed",
        "digits": "needle_digits",
        "chunk_size": "chunk",
        "cache_slots": "cache_slots",
    },
}


@dataclass
class SweepOptions:
    """Command-line options of ``kvlab sweep`` (see its ``--help``)."""

    output_dir: Path
    executor: str = "local"
    workers: int = 2
    ray_address: str | None = None
    device: str = "auto"
    cpu_threads: int | None = None
    calibration_cache: Path | None = None
    use_calibration_cache: bool = True
    resume: bool = True
    progress: bool = True
    argv: list[str] = field(default_factory=list)

    def eval_fields(self) -> dict[str, Any]:
        """The :class:`~kvlab.evaluation.plan.EvalConfig` fields these options set in every
        group, by name: all but ``output_dir`` (each group writes in a folder below it)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "output_dir"}


@dataclass
class SweepOutcome:
    """What a sweep wrote."""

    summary: str
    summary_path: Path
    pareto_paths: list[Path]
    groups: list[Any]


def _list(
    data: Mapping[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    what: str,
    default: Sequence[Any] = (),
) -> list[Any]:
    value = data.get(key, list(default))
    if not isinstance(value, list) or not all(
        isinstance(v, kind) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"sweep file: {quote(key)} must be a list of {what}")
    return value


def expand_methods(
    methods: Sequence[str], ratios: Sequence[float], bits: Sequence[int]
) -> list[str]:
    """Method names of the grid: ``{ratio}`` / ``{bits}`` substituted; a name that takes an
    ``@R`` and has none gets each ratio appended; other names as they are.

    Raises:
        ValueError: a name needs ratios or bits and the list is empty.
    """
    from kvlab.evaluation.methods import takes_ratio

    names: list[str] = []
    for name in methods:
        variants = [name]
        if "{bits}" in name:
            if not bits:
                raise ValueError(f"sweep file: method {quote(name)} needs 'bits'")
            variants = [v.replace("{bits}", str(b)) for v in variants for b in bits]
        if "{ratio}" in name or takes_ratio(name):
            if not ratios:
                raise ValueError(f"sweep file: method {quote(name)} needs 'ratios'")
            pattern = name if "{ratio}" in name else name + "@{ratio}"
            variants = [
                v.replace("{ratio}", f"{r:g}")
                for v in (pattern.replace("{bits}", str(b)) for b in (bits or [None]))
                for r in ratios
            ]
            if "{bits}" not in name:
                variants = list(dict.fromkeys(variants))
        names.extend(v for v in variants if v not in names)
    return names


#: Characters of a model or text slug at most; a longer one keeps its head and a hash.
SLUG_MAX = 64
_HASH = 8


def _slug(text: str) -> str:
    """ASCII letters, digits, ``.``, ``_`` and ``-`` of ``text``, other runs as one ``-``;
    empty when ``text`` has none, or only dots (``..`` is no folder name of its own)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")
    return "" if not slug.strip(".") else slug


def short_hash(text: str, length: int = _HASH) -> str:
    """The first ``length`` hex digits of the sha256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:length]


def unique_slugs(items: Sequence[str], base: Mapping[str, str], kind: str) -> dict[str, str]:
    """A folder-name slug per distinct item, unique by construction (case-insensitively):
    ``base[item]`` as it is when no other item's slug is the same and it is at most
    :data:`SLUG_MAX` characters; else with ``-<8 hex digits of the item's sha256>`` (a
    longer slug cut to leave room); ``<kind>-<hash>`` for an empty one (a name of
    non-ASCII characters only). Hashes lengthen until every slug differs.

    Args:
        items: the items as written (model specs, text paths).
        base: each item's slug before this (:func:`_slug` of its file name).
        kind: ``"model"`` or ``"text"``.
    """
    distinct = list(dict.fromkeys(items))
    claims: dict[str, int] = {}
    for item in distinct:
        claims[base[item].casefold()] = claims.get(base[item].casefold(), 0) + 1
    for length in range(_HASH, 65, 8):
        out = {}
        for item in distinct:
            slug = base[item]
            if not slug:
                slug = f"{kind}-{short_hash(item, length)}"
            elif claims[slug.casefold()] > 1 or len(slug) > SLUG_MAX:
                slug = f"{slug[: SLUG_MAX - length - 1]}-{short_hash(item, length)}"
            out[item] = slug
        if len({v.casefold() for v in out.values()}) == len(out):
            return out
    raise AssertionError("distinct items with equal sha256")  # pragma: no cover


def group_names(models: Sequence[str], texts: Mapping[str, str]) -> dict[tuple[str, str], str]:
    """The folder name ``<model slug>--<text slug>`` of each (model, text) group
    (:func:`unique_slugs`); a name two groups would share (``a--b`` + ``c`` and ``a`` +
    ``b--c``) gets ``-<hash of both>``. The Pareto plot is ``pareto-<name>.png``.

    Args:
        models: the model specs as written.
        texts: each text as written -> its slug before :func:`unique_slugs`.
    """
    model_slugs = unique_slugs(models, {m: _slug(Path(m).name) for m in models}, "model")
    text_slugs = unique_slugs(list(texts), dict(texts), "text")
    pairs = [(m, t) for m in model_slugs for t in text_slugs]
    names = {pair: f"{model_slugs[pair[0]]}--{text_slugs[pair[1]]}" for pair in pairs}
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name.casefold()] = counts.get(name.casefold(), 0) + 1
    for (model, text), name in names.items():
        if counts[name.casefold()] > 1:
            names[(model, text)] = f"{name}-{short_hash(model + chr(0) + text)}"
    return names


def load_sweep(file: Path, options: SweepOptions) -> list[tuple[str, EvalConfig]]:
    """The groups of a sweep file: ``(group folder name, EvalConfig)`` each, one per model,
    text and protocol (the protocols of a model and text share the folder:
    :func:`group_names`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not TOML, an unknown key, a value of the wrong type, or a model, text or
            protocol listed twice.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"sweep file not found: {quote(file)}")
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"sweep file {quote(file)}: {exc}") from exc
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise ValueError(
            f"sweep file {quote(file)}: unknown key(s) {', '.join(map(quote, unknown))}; "
            f"known: {sorted(_TOP)}"
        )
    models = _list(data, "models", str, "strings", ["smollm2-135m"])
    texts = _list(data, "texts", str, "strings", ["default"])
    protocols = _list(data, "protocols", str, "strings", ["prefill-score"])
    ratios = [float(r) for r in _list(data, "ratios", (int, float), "numbers")]
    bits = _list(data, "bits", int, "integers")
    methods = expand_methods(_list(data, "methods", str, "strings"), ratios, bits)
    dtype = data.get("dtype", "float32")
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            raise ValueError(f"sweep file {quote(file)}: unknown protocol {quote(protocol)}")
    for protocol in PROTOCOLS:
        section = data.get(protocol, {})
        if not isinstance(section, dict):
            raise ValueError(f"sweep file {quote(file)}: [{protocol}] must be a table")
        for key, value in section.items():
            name = key.replace("-", "_")
            if name not in _PROTOCOL_OPTIONS[protocol]:
                raise ValueError(
                    f"sweep file {quote(file)}: [{protocol}] has unknown option {quote(key)}; "
                    f"known: {sorted(_PROTOCOL_OPTIONS[protocol])}"
                )
            if name in ("lengths", "depths"):
                _list(section, key, (int, float) if name == "depths" else int, "numbers")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"sweep file {quote(file)}: [{protocol}] {quote(key)} must be an integer"
                )
    for key, values in (("models", models), ("texts", texts), ("protocols", protocols)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"sweep file {quote(file)}: {key!r} lists {quote(repeated[0])} twice")
    text_bases = {t: "default" if t == "default" else _slug(Path(t).stem) for t in texts}
    names = group_names(models, text_bases)
    groups = []
    for model in models:
        for text in texts:
            path = None if text == "default" else (file.parent / text)
            for protocol in protocols:
                section = data.get(protocol, {})
                extra = {}
                for key, value in section.items():
                    extra[_PROTOCOL_OPTIONS[protocol][key.replace("-", "_")]] = value
                config = EvalConfig(
                    model=model,
                    text=path,
                    methods=methods,
                    protocol=protocol,
                    dtype=dtype,
                    output_dir=options.output_dir / names[(model, text)],
                    **options.eval_fields(),
                    **extra,
                )
                groups.append((names[(model, text)], config))
    if not methods:
        raise ValueError(f"sweep file {quote(file)}: 'methods' is empty")
    return groups


def summary_table(
    protocol: str, summaries: Sequence[Mapping[str, Any]], context: int, config: EvalConfig
) -> str:
    """A group's table without wall-time columns (deterministic for a given plan)."""
    from kvlab.evaluation.table import format_bytes, markdown_table, needle_table

    if protocol == "prefill-score":
        headers = [
            "method",
            "KV bytes (16-bit)",
            "vs full",
            "PPL",
            "ΔPPL %",
            "KL mean (nats)",
            "KL p95 (nats)",
        ]
        rows = [
            [
                s["method"],
                format_bytes(s["kv_bytes_16bit"]),
                f"{s['kv_fraction_of_full']:.3f}",
                f"{s['ppl']:.4f}",
                f"{s['delta_ppl_pct']:+.3f}",
                f"{s['kl_mean']:.5f}",
                f"{s['kl_p95']:.5f}",
            ]
            for s in summaries
        ]
        return markdown_table(headers, rows)
    if protocol == "stream":
        headers = [
            "method",
            f"PPL (< {context})",
            f"PPL (≥ {context})",
            "PPL (all)",
            "final position",
            "peak KV (16-bit)",
        ]
        rows = [
            [
                s["method"],
                None if s["ppl_within_context"] is None else f"{s['ppl_within_context']:.4f}",
                None if s["ppl_beyond_context"] is None else f"{s['ppl_beyond_context']:.4f}",
                f"{s['ppl']:.4f}",
                s["final_position"],
                format_bytes(s["peak_kv_bytes_16bit"]),
            ]
            for s in summaries
        ]
        return markdown_table(headers, rows)
    return needle_table(summaries, list(config.needle_lengths), list(config.needle_depths))


def sweep_paths(
    out: Path, groups: Sequence[tuple[str, EvalConfig]], device_type: str
) -> list[Path]:
    """Every file a sweep writes under ``out``: ``summary.md``, the task store's files (a
    longest name standing for all), each group's files
    (:func:`~kvlab.evaluation.outputs.eval_paths`) and Pareto plots."""
    from kvlab.evaluation.outputs import eval_paths, task_file_names

    paths = [out / "summary.md", *(out / "tasks" / name for name in task_file_names())]
    for name, config in groups:
        paths += eval_paths(out / name, config.protocol, device_type).files()
        if config.protocol == "prefill-score":
            paths.append(out / f"pareto-{name}.png")
    return list(dict.fromkeys(paths))


def run_sweep(file: Path, options: SweepOptions, console: Any = None) -> SweepOutcome:
    """Run a sweep file (module docstring).

    Raises:
        ValueError / FileNotFoundError: a bad sweep file, text, model or output folder (all
            checked before any model loads).
        KeyboardInterrupt: interrupted; finished tasks are stored (rerun to resume).
    """
    from rich.console import Console

    from kvlab.device import resolve_device
    from kvlab.evaluation.execute import TaskStore
    from kvlab.evaluation.executors import run_schedule
    from kvlab.evaluation.harness import (
        console_warning,
        execution_context,
        plan_line,
        prepare_inputs,
        stored_schedule,
    )
    from kvlab.evaluation.outputs import check_output_paths
    from kvlab.evaluation.plot import plot_pareto
    from kvlab.evaluation.report import write_eval_report

    console = console or Console(stderr=True)
    out = Path(options.output_dir)
    check_output_paths(out, [out / "summary.md"])
    groups = load_sweep(file, options)
    # every path the sweep writes, lengths included, before any model or tokenizer loads
    check_output_paths(out, sweep_paths(out, groups, resolve_device(options.device).type))
    inputs = [prepare_inputs(config, config.output_dir) for _, config in groups]
    plan = inputs[0].plan
    for item in inputs[1:]:
        plan = plan + item.plan
    store = TaskStore(out / "tasks", warn=console_warning(console))
    schedule = stored_schedule(plan, store, options.resume)
    console.print(plan_line(schedule, store.folder), highlight=False, soft_wrap=True)
    run_schedule(
        options.executor,
        schedule,
        store,
        execution_context(groups[0][1]),
        workers=options.workers,
        address=options.ray_address,
        progress=options.progress,
        announce=lambda line: console.print(line, highlight=False, soft_wrap=True),
    )
    sections = [f"# kvlab sweep {file.name}\n"]
    outcomes = []
    for (_, config), item in zip(groups, inputs, strict=True):
        outcome = write_eval_report(
            config,
            item.plan,
            schedule.results,
            item.paths,
            model=item.model,
            text=item.text,
            text_tokens=item.text_tokens,
            accelerator=item.accelerator,
            device_type=item.device_type,
        )
        outcomes.append(outcome)
        context = int(schedule.results[item.plan.tasks[0].key]["context"])
        sections.append(
            f"\n## {config.model} · {item.text.id} · {config.protocol}\n\n"
            + summary_table(config.protocol, outcome.summaries, context, config)
        )
    summary = "".join(sections)
    summary_path = out / "summary.md"
    summary_path.write_text(summary, encoding="utf-8")
    pareto_paths = []
    for (name, config), item, outcome in zip(groups, inputs, outcomes, strict=True):
        if config.protocol == "prefill-score":
            title = (
                f"{config.model} on {item.text.id}: KL vs KV bytes, {config.windows} windows, "
                f"prefill {config.prefill}, {config.score} scored"
            )
            path = out / f"pareto-{name}.png"
            pareto_paths.append(plot_pareto(outcome.summaries, path, title))
    return SweepOutcome(summary, summary_path, pareto_paths, outcomes)
