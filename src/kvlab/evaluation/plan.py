"""Planning an evaluation: pure data, content-hashed tasks, and their dependencies.

A :class:`Plan` lists every :class:`Task` — one method on one token sequence under one
protocol (a prefill-score window, a stream, or a needle prompt) — and every
:class:`PrepTask` (a method's one-time preparation, e.g. PN-Mix's calibration). A task holds
everything a worker needs (model fingerprint, method as data, the token ids themselves), so it
pickles and ships to another process or machine. Its :attr:`Task.key` is the sha256 of its
content: the protocol, the model checkpoint's sha256 with dtype and device type, the method's
record, the protocol parameters that change the result, the sha256 of the token ids, the keys
it depends on, and the code hash of the modules that compute a result (:data:`RESULT_MODULES`).
Two tasks with the same key give the same result, which is what lets an executor skip a task
that a previous run already stored (:mod:`kvlab.evaluation.execute`).

Dependencies: a prefill-score method task depends on the ``full`` task of its window (the
reference of the KL: its per-token log-probabilities), and a method with a preparation on its
:class:`PrepTask`.

Prefill-score windows are ``P + S`` tokens long, evenly spaced over the tokenized text (first
at token 0, last ending at the text's end), non-overlapping when the text is long enough. The
``full`` method always runs on each window (added when not requested).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.evaluation.fingerprint import code_digest, content_hash, package_modules
from kvlab.evaluation.methods import MODULES as METHOD_MODULES
from kvlab.evaluation.methods import Method, method_backends
from kvlab.userinput import quote

__all__ = [
    "DTYPES",
    "IMPLEMENTATION_MODULES",
    "PROTOCOLS",
    "RESULT_MODULES",
    "EvalConfig",
    "ModelRef",
    "Plan",
    "PrepTask",
    "Task",
    "TextRef",
    "plan_eval",
    "select_methods",
    "window_starts",
]

PROTOCOLS = ("prefill-score", "stream", "needle", "ruler")
DTYPES = ("float32", "bfloat16", "float16")

#: The kvlab modules that implement the compressed caches and the model they run in (the
#: artifact lists their files; each is part of :data:`RESULT_MODULES`). The Triton kernel is
#: not listed: it needs the optional ``triton`` package and runs only on CUDA.
IMPLEMENTATION_MODULES = (
    "kvlab.rope",
    "kvlab.rope.config",
    "kvlab.rope.scaling",
    "kvlab.rope.rotation",
    "kvlab.models.loading",
    "kvlab.relay.core",
    "kvlab.relay.attention",
    "kvlab.relay.kernels.cpu",
    "kvlab.relay.storage",
    "kvlab.relay.storage_views",
    "kvlab.relay.scorers",
    "kvlab.relay.budgets",
    "kvlab.relay.policies",
    "kvlab.relay.layer_budgets",
    "kvlab.relay.expected_attention",
    "kvlab.relay.tova",
    "kvlab.relay.combined",
    "kvlab.relay.kvzip",
    "kvlab.relay.kvzip_attention",
    "kvlab.relay.config",
    "kvlab.relay.evictor",
    "kvlab.relay.reconstruction",
    "kvlab.pnmix.cache",
    "kvlab.pnmix.cache_state",
    "kvlab.pnmix.cache_tables",
    "kvlab.pnmix.cache_flush",
    "kvlab.pnmix.cache_decode",
    "kvlab.pnmix.attention",
    "kvlab.pnmix.reference",
    "kvlab.pnmix.packing",
    "kvlab.pnmix.quantizers",
    "kvlab.pnmix.allocation",
    "kvlab.pnmix.codecs",
    "kvlab.pnmix.key_codec",
    "kvlab.pnmix.pair_codecs",
    "kvlab.pnmix.mix_codec",
    "kvlab.pnmix.config",
    "kvlab.pnmix.store",
    "kvlab.pnmix.store_buffers",
    "kvlab.pnmix.bitalloc",
    "kvlab.pnmix.hadamard",
    "kvlab.pnmix.outliers",
    "kvlab.pnmix.prerope",
    "kvlab.pnmix.values",
    "kvlab.pnmix.width_codec",
    "kvlab.pnmix.kernels.cpu",
    "kvlab.pnmix.kernels.dispatch",
    "kvlab.pnmix.kernels.spec",
    "kvlab.pnmix.kernels.splits",
    "kvlab.pnmix.kernels.tables",
    "kvlab.backends",
    "kvlab.native",
    "kvlab.kernels_common",  # kvlab_simd.h, included by both CPU kernels
    "kvlab.integrations.model_support",
    "kvlab.integrations.attention",
    "kvlab.integrations.cache_protocol",
    "kvlab.integrations.pnmix_cache",
    "kvlab.integrations.pnmix_calibration",
    "kvlab.integrations.calibration_record",
    "kvlab.integrations.forward",
    "kvlab.integrations.layer",
    "kvlab.integrations.model_cache",
    "kvlab.integrations.speculative",
    "kvlab.integrations.window_layer",
    "kvlab.integrations.dense_attention",
    "kvlab.integrations.pnmix_layer",
    "kvlab.integrations.decode_steps",
    "kvlab.integrations.relay_cache",
    "kvlab.integrations.relay_layer",
    "kvlab.integrations.relay_eviction",
    "kvlab.integrations.composed_layer",
    "kvlab.integrations.relay_calibration",
    "kvlab.integrations.composed_cache",
    "kvlab.integrations.kvzip",
    "kvlab.integrations.prefill_replay",
)

#: Modules whose source decides a task's result; their code hash is part of every task key.
RESULT_MODULES = (
    *IMPLEMENTATION_MODULES,
    "kvlab.evaluation.methods",
    "kvlab.evaluation.metrics",
    "kvlab.evaluation.foreign_cache",
    "kvlab.evaluation.protocols",
    "kvlab.evaluation.needle",
    "kvlab.evaluation.questions",
    "kvlab.evaluation.ruler_protocol",
    *package_modules("kvlab.evaluation.ruler"),
    "kvlab.evaluation.execute",
    *METHOD_MODULES,
)


@dataclass
class EvalConfig:
    """Everything ``kvlab eval`` needs (see ``kvlab eval --help`` for the meaning of each)."""

    model: str = "smollm2-135m"
    text: Path | None = None
    methods: Sequence[str] = ()
    protocol: str = "prefill-score"
    windows: int = 4
    prefill: int = 512
    score: int = 512
    device: str = "auto"
    dtype: str = "float32"
    output_dir: Path = Path("runs/eval")
    cache_slots: int = 2048
    chunk: int = 256
    stream_length: int = 12288
    segment: int = 1024
    argv: list[str] = field(default_factory=list)
    progress: bool = True
    needle_lengths: Sequence[int] = (2048, 4096, 8192, 16384)
    needle_depths: Sequence[float] = (0, 25, 50, 75, 100)
    needle_trials: int = 3
    needle_seed: int = 0
    needle_digits: int = 5
    ruler_tasks: Sequence[str] = ()
    ruler_lengths: Sequence[int] = (4096,)
    ruler_samples: int = 10
    ruler_seed: int = 0
    ruler_chat: bool | None = None
    ruler_shared_prefill: bool = True
    executor: str = "local"
    workers: int = 2
    ray_address: str | None = None
    cpu_threads: int | None = None
    calibration_cache: Path | None = None
    use_calibration_cache: bool = True
    resume: bool = True

    def validate(self) -> None:
        """Raises ValueError for an unknown protocol, dtype or executor, or bad sizes."""
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"--protocol must be one of {', '.join(PROTOCOLS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.executor not in ("local", "ray"):
            raise ValueError("--executor must be local or ray")
        for name in ("windows", "prefill", "score", "cache_slots", "chunk", "segment"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("workers", "needle_trials", "needle_digits", "ruler_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.stream_length < 2:
            raise ValueError("--stream-length must be >= 2")
        if not self.needle_lengths or any(n < 1 for n in self.needle_lengths):
            raise ValueError("--needle-lengths must be positive token counts")
        if not self.needle_depths or any(not 0 <= d <= 100 for d in self.needle_depths):
            raise ValueError("--needle-depths must lie in 0..100 (percent)")
        if not self.ruler_lengths or any(n < 1 for n in self.ruler_lengths):
            raise ValueError("--ruler-lengths must be positive token counts")


@dataclass(frozen=True)
class ModelRef:
    """A model as tasks refer to it.

    Attributes:
        spec: as given (``"smollm2-135m"`` or a path).
        checkpoint: the label artifacts record (:func:`kvlab.models.checkpoint_label`).
        checkpoint_sha256: content fingerprint (:func:`kvlab.models.checkpoint_sha256`).
        dtype: weight dtype name.
        device: ``"cpu"``, ``"cuda:0"``, ...
    """

    spec: str
    checkpoint: str
    checkpoint_sha256: str
    dtype: str
    device: str

    def fingerprint(self) -> dict[str, str]:
        """What of the model decides results (hashed into task keys)."""
        return {
            "checkpoint_sha256": self.checkpoint_sha256,
            "dtype": self.dtype,
            "device": self.device.split(":")[0],
        }


@dataclass(frozen=True)
class TextRef:
    """The evaluation text: id, sha256 of its bytes, the file (if any), where it comes from."""

    id: str
    sha256: str
    path: str | None = None
    source_url: str | None = None


@dataclass(frozen=True)
class PrepTask:
    """A method's one-time preparation on one model; ``key`` is its calibration-cache key
    (:func:`kvlab.evaluation.calibration.calibration_key`)."""

    model: ModelRef
    method: Method
    key: str

    @property
    def label(self) -> str:
        return f"{self.method.name}: prepare"


@dataclass(frozen=True)
class Task:
    """One method on one token sequence (module docstring).

    Attributes:
        protocol: ``"prefill-score"``, ``"stream"`` or ``"needle"``.
        model: the model.
        text: the text the tokens come from.
        method: the method (data).
        unit: protocol parameters that decide the result (hashed), e.g. ``prefill``/``score``.
        where: where the tokens sit (window index, start; needle length, depth, trial) —
            reported, not hashed: the token ids already say what they are.
        tokens: the token ids fed.
        depends_on: keys of the tasks / preparations it needs.
        reference: key of the ``full`` task whose log-probabilities it needs, if any.
        preparation: key of its :class:`PrepTask`, if any.
        code: code hash of :data:`RESULT_MODULES`.
        backends: the attention backends requested for the method's mechanisms
            (``KVLAB_PNMIX_BACKEND`` / ``KVLAB_RELAY_BACKEND``; :func:`method_backends`):
            compiled kernels agree with the references only to float rounding, so a result
            computed under one is not resumed under another.
        key: the content hash (computed).
    """

    protocol: str
    model: ModelRef
    text: TextRef
    method: Method
    unit: Mapping[str, Any]
    where: Mapping[str, Any]
    tokens: tuple[int, ...]
    reference: str | None = None
    preparation: str | None = None
    code: str = ""
    backends: Mapping[str, str] = field(default_factory=dict)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        from kvlab.artifacts.provenance import sha256_bytes

        tokens_sha = sha256_bytes(",".join(map(str, self.tokens)).encode("ascii"))
        content = {
            "protocol": self.protocol,
            "model": self.model.fingerprint(),
            "method": self.method.record(),
            "unit": dict(self.unit),
            "tokens_sha256": tokens_sha,
            "reference": self.reference,
            "preparation": self.preparation,
            "code": self.code,
        }
        if self.backends:
            content["backends"] = dict(self.backends)
        object.__setattr__(self, "key", content_hash(content))

    @property
    def depends_on(self) -> tuple[str, ...]:
        return tuple(k for k in (self.reference, self.preparation) if k is not None)

    @property
    def label(self) -> str:
        parts = [
            f"{k} {v}"
            for k, v in self.where.items()
            if k in ("window", "task", "length", "depth", "index")
        ]
        return f"{self.method.name} ({', '.join(parts)})" if parts else self.method.name

    def record(self) -> dict[str, Any]:
        """JSON-ready description (stored with the result; token ids left out)."""
        return {
            "key": self.key,
            "protocol": self.protocol,
            "model": {"spec": self.model.spec, **self.model.fingerprint()},
            "text": {"id": self.text.id, "sha256": self.text.sha256},
            "method": self.method.name,
            "unit": dict(self.unit),
            "where": dict(self.where),
            "tokens": len(self.tokens),
            "reference": self.reference,
            "preparation": self.preparation,
            "backends": dict(self.backends),
        }


@dataclass(frozen=True)
class Plan:
    """Preparations and tasks, in execution order (a task after everything it depends on).
    Keys may repeat (identical token sequences): each key runs once."""

    preparations: tuple[PrepTask, ...]
    tasks: tuple[Task, ...]

    def __add__(self, other: Plan) -> Plan:
        preps = {p.key: p for p in (*self.preparations, *other.preparations)}
        return Plan(tuple(preps.values()), self.tasks + other.tasks)


def window_starts(n_tokens: int, length: int, windows: int) -> list[int]:
    """Start indices of ``windows`` windows of ``length`` tokens, evenly spaced over
    ``n_tokens`` (first at 0, last ending at ``n_tokens``).

    Raises:
        ValueError: the text is shorter than one window.
    """
    if n_tokens < length:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one window ({length})")
    if windows == 1:
        return [0]
    span = n_tokens - length
    return [round(i * span / (windows - 1)) for i in range(windows)]


_STREAM_DEFAULT = ("full", "relay:snapkv@0.5", "evict-no-relay:snapkv@0.5", "streaming-llm@0.5")
_NEEDLE_DEFAULT = ("full", "relay:snapkv@0.5", "evict-no-relay:snapkv@0.5")
_RULER_DEFAULT = (
    "full",
    "pn-mix",
    "kivi-2bit",
    "relay:snapkv@0.5",
    "evict-no-relay:snapkv@0.5",
    "evict-no-relay:snapkv@0.5+pn-mix-lean",
)
#: The method context of each protocol: the ruler protocol compresses a prefill once, as
#: prefill-score does (ratio-mode eviction, calibrations, composition).
_METHOD_PROTOCOL = {"ruler": "prefill-score"}


def select_methods(config: EvalConfig) -> list[Method]:
    """The methods of a run, ``full`` first (added for prefill-score when not requested).

    Raises:
        ValueError: an unknown or repeated method.
    """
    from kvlab.evaluation.methods import (
        DEFAULT_METHODS,
        hf_quantized_backend_available,
        parse_method,
    )

    names = list(config.methods)
    if not names:
        if config.protocol == "prefill-score":
            names = list(DEFAULT_METHODS)
            for backend in ("quanto", "hqq"):
                if hf_quantized_backend_available(backend):
                    names.append(f"hf-{backend}-2bit")
        else:
            defaults = {"stream": _STREAM_DEFAULT, "needle": _NEEDLE_DEFAULT}
            names = list(defaults.get(config.protocol, _RULER_DEFAULT))
    seen: set[str] = set()
    methods = []
    protocol = _METHOD_PROTOCOL.get(config.protocol, config.protocol)
    for name in names:
        method = parse_method(name, protocol=protocol, cache_slots=config.cache_slots)
        if method.name in seen:
            raise ValueError(f"method {quote(method.name)} given twice")
        seen.add(method.name)
        methods.append(method)
    if config.protocol in ("prefill-score", "ruler") and "full" not in seen:
        methods.insert(0, parse_method("full"))
    methods.sort(key=lambda m: m.name != "full")  # the reference runs first
    return methods


def _preparations(
    methods: Sequence[Method], model: ModelRef
) -> tuple[tuple[PrepTask, ...], dict[str, str]]:
    from kvlab.evaluation.calibration import calibration_key
    from kvlab.evaluation.methods import PREPARATIONS

    preps: dict[str, PrepTask] = {}
    by_method: dict[str, str] = {}
    for method in methods:
        if method.preparation is None:
            continue
        text = PREPARATIONS[method.preparation].text()
        _, key = calibration_key(
            method,
            checkpoint_sha256=model.checkpoint_sha256,
            text_sha256=text.sha256,
            dtype=model.dtype,
            device=model.device.split(":")[0],
        )
        preps.setdefault(key, PrepTask(model, method, key))
        by_method[method.name] = key
    return tuple(preps.values()), by_method


def plan_eval(
    config: EvalConfig,
    methods: Sequence[Method],
    model: ModelRef,
    text: TextRef,
    tokens: Sequence[int],
    tokenizer: Any = None,
    text_data: str | None = None,
) -> Plan:
    """The plan of one ``kvlab eval`` run (module docstring).

    Args:
        tokens: the text's token ids.
        tokenizer: the model's tokenizer (needed by the needle and ruler protocols' prompts).
        text_data: the text itself (the ruler protocol's essay haystack).

    Raises:
        ValueError: a text shorter than one window, a stream shorter than 2 tokens, or a
            needle prompt the text cannot fill.
    """
    preparations, prepared_by = _preparations(methods, model)
    code = code_digest(RESULT_MODULES)
    tasks: list[Task] = []

    def task(
        method: Method,
        unit: dict[str, Any],
        where: dict[str, Any],
        ids: Sequence[int],
        reference: str | None = None,
    ) -> Task:
        return Task(
            protocol=config.protocol,
            model=model,
            text=text,
            method=method,
            unit=unit,
            where=where,
            tokens=tuple(int(t) for t in ids),
            reference=reference,
            preparation=prepared_by.get(method.name),
            code=code,
            backends=method_backends(method),
        )

    if config.protocol == "prefill-score":
        length = config.prefill + config.score
        unit = {"prefill": config.prefill, "score": config.score}
        for w, start in enumerate(window_starts(len(tokens), length, config.windows)):
            window = tokens[start : start + length]
            where = {"window": w, "start": start}
            full = task(methods[0], unit, where, window)
            tasks.append(full)
            tasks.extend(task(m, unit, where, window, full.key) for m in methods[1:])
    elif config.protocol == "ruler":
        from kvlab.evaluation.ruler_protocol import ruler_units

        for unit, where, ids in ruler_units(
            tokenizer,
            tasks=config.ruler_tasks,
            lengths=config.ruler_lengths,
            samples=config.ruler_samples,
            seed=config.ruler_seed,
            haystack_text=text_data,
            chat=config.ruler_chat,
            shared_prefill=config.ruler_shared_prefill,
        ):
            tasks.extend(task(m, unit, where, ids) for m in methods)
    elif config.protocol == "stream":
        stream = tokens[: config.stream_length]
        if len(stream) < 2:
            raise ValueError(f"the text has {len(tokens)} tokens; a stream needs at least 2")
        where = {"stream_tokens": len(stream)}
        tasks.extend(task(m, {"chunk": config.chunk}, where, stream) for m in methods)
    else:
        from kvlab.evaluation.needle import build_needle_prompt

        for length in config.needle_lengths:
            for depth in config.needle_depths:
                for trial in range(config.needle_trials):
                    prompt = build_needle_prompt(
                        tokenizer,
                        tokens,
                        length=length,
                        depth=float(depth),
                        trial=trial,
                        seed=config.needle_seed,
                        digits=config.needle_digits,
                    )
                    unit = {
                        "chunk": config.chunk,
                        "passkey": prompt.passkey,
                        "max_new_tokens": config.needle_digits + 3,
                    }
                    where = {
                        "length": length,
                        "depth": depth,
                        "trial": trial,
                        "needle_start": prompt.needle_start,
                    }
                    tasks.extend(task(m, unit, where, prompt.tokens) for m in methods)
    return Plan(preparations, tuple(tasks))
