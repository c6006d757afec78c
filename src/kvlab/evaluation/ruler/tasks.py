"""The RULER synthetic task generators and the length fitting.

(One module of ~660 lines on purpose, above the project's ~600: the generators mirror RULER's
four scripts side by side, and the length fitting calls each generator's draft builder; split
apart, every reader of one would need the other open.)

Each generator follows NVIDIA/RULER ``scripts/data/synthetic/`` (commit c3f5e3b), with the task
arguments of ``scripts/synthetic.yaml``:

* ``niah.py`` (``niah_*``): needles ``"One of the special magic {type_needle_v} for {key} is:
  {value}."`` (7-digit numbers, ``adjective-noun`` words or uuid4s) in a ``noise``, ``essay``
  or ``needle`` (distractor needles) haystack; essay needles go between sentences at depths
  drawn from RULER's 40 depths, noise/needle ones between lines; ``num_needle_k =
  max(num_needle_k, num_needle_q)``; the template is made singular when one value is asked.
* ``variable_tracking.py`` (``vt``): one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of
  ``num_hops`` hops, its lines placed among noise lines; the answer is every variable of the
  chain. RULER prepends one in-context example (a chain over a noise haystack fitted to 500
  tokens, with 3-letter variables, then its variables and value replaced by random ones) and so
  does kvlab.
* ``common_words_extraction.py`` (``cwe``): a numbered list where 10 words appear ``freq_cw``
  times and the others ``freq_ucw`` times (6 and 1 below 4096 tokens), after one solved
  example; the answer is the 10 common words.
* ``freq_words_extraction.py`` (``fwe``): coded 6-letter words with Zipf counts
  ``int(N * k**-alpha / zeta(alpha))`` over a vocabulary of ``(length - 50) // 50`` words, the
  top-ranked one replaced by ``...``; the answer is ranks 2-4.

Differences from RULER, all deliberate:

* Randomness: every sample draws from :class:`random.Random` seeded with the string
  ``"ruler:<task>:<length>:<index>:<seed>"`` (string seeds hash with SHA-512: the same on every
  machine), re-seeded for every haystack size tried, so the keys, values and positions do not
  depend on the search. RULER's fixed-seed shuffles (``random.Random(args.random_seed)``)
  come from the same generator.
* Length fitting: per sample, the largest haystack size whose prompt fits (RULER searches once
  per task and steps down by its increment when a sample does not fit; ``fwe`` grows by
  ``max_len // 32`` words). The count is the tokens of the split prompt as fed:
  ``len(context_ids) + len(question_ids) + tokens_to_generate <= length``.
* Collisions RULER leaves to chance are redrawn: a distractor needle with a real key or value,
  two needles with one value, an in-context vt variable equal to a real one or to ``VAR``, an
  answer (vt variable, fwe coded word) that is a piece of the template's own words; ``cwe``
  leaves out the list words found in its template ("are", "list", "most", ...), since RULER's
  substring scoring would credit them from the question.
* Sentences: a regex splitter instead of nltk's punkt (:mod:`.haystack`). ``cwe``'s words:
  wonderwords's nouns, adjectives and verbs (no whitespace in a word); where a list needs more
  words than those, RULER draws from ``english_words.json``, kvlab from its adjective-noun keys.
* RULER's ``cwe`` few-shot example repeats the model template; kvlab puts the example inside
  the one user turn.

QA tasks (``qa_1`` SQuAD, ``qa_2`` HotpotQA) are left out: they need the datasets downloaded.
"""

from __future__ import annotations

import functools
import math
import random
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvlab.evaluation.ruler.haystack import (
    DEPTHS,
    NOISE,
    cwe_words,
    essay_words,
    key_count,
    key_word,
    split_sentences,
)
from kvlab.evaluation.ruler.samples import RulerSample
from kvlab.evaluation.ruler.templates import (
    ANSWER_PREFIXES,
    TEMPLATES,
    TOKENS_TO_GENERATE,
    render_split,
    singular_niah,
    split_template,
)
from kvlab.userinput import quote

__all__ = ["NEEDLE", "TASKS", "Draft", "TaskConfig", "build_draft", "generate_samples"]

#: RULER ``niah.py``'s needle.
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


@dataclass(frozen=True)
class TaskConfig:
    """One RULER task.

    Attributes:
        name: the task name (``synthetic.yaml`` key).
        kind: the RULER generator: ``niah``, ``variable_tracking``, ``common_words_extraction``
            or ``freq_words_extraction``.
        args: the generator's arguments from ``synthetic.yaml``.
        tokens_to_generate: RULER ``constants.py``'s value for the kind.
        metric: ``"all"`` (``string_match_all``; every synthetic task).
    """

    name: str
    kind: str
    args: Mapping[str, Any]
    tokens_to_generate: int
    metric: str = "all"


def _task(name: str, kind: str, **args: Any) -> TaskConfig:
    return TaskConfig(name, kind, MappingProxyType(args), TOKENS_TO_GENERATE[kind])


def _niah(name: str, haystack: str, k: str, v: str, nk: int, nv: int, nq: int) -> TaskConfig:
    return _task(
        name,
        "niah",
        type_haystack=haystack,
        type_needle_k=k,
        type_needle_v=v,
        num_needle_k=nk,
        num_needle_v=nv,
        num_needle_q=nq,
    )


#: The synthetic tasks of RULER ``scripts/synthetic.yaml`` (all but ``qa_1``/``qa_2``), in
#: ``config_tasks.sh``'s order.
TASKS: Mapping[str, TaskConfig] = MappingProxyType(
    {
        t.name: t
        for t in (
            _niah("niah_single_1", "noise", "words", "numbers", 1, 1, 1),
            _niah("niah_single_2", "essay", "words", "numbers", 1, 1, 1),
            _niah("niah_single_3", "essay", "words", "uuids", 1, 1, 1),
            _niah("niah_multikey_1", "essay", "words", "numbers", 4, 1, 1),
            _niah("niah_multikey_2", "needle", "words", "numbers", 1, 1, 1),
            _niah("niah_multikey_3", "needle", "uuids", "uuids", 1, 1, 1),
            _niah("niah_multivalue", "essay", "words", "numbers", 1, 4, 1),
            _niah("niah_multiquery", "essay", "words", "numbers", 1, 1, 4),
            _task("vt", "variable_tracking", type_haystack="noise", num_chains=1, num_hops=4),
            _task("cwe", "common_words_extraction", freq_cw=30, freq_ucw=3, num_cw=10),
            _task("fwe", "freq_words_extraction", alpha=2.0),
        )
    }
)


@dataclass(frozen=True)
class Draft:
    """A task prompt before rendering: ``head`` (instruction + haystack, ends where the
    question starts), ``question`` (the question text), ``answer_prefix`` (RULER's, with its
    leading space) and the references."""

    head: str
    question: str
    answer_prefix: str
    outputs: tuple[str, ...]


# ----------------------------------------------------------------------------- niah


def _random_value(rng: random.Random, kind: str) -> str:
    """RULER ``niah.py`` ``generate_random``: 7-digit number, adjective-noun word, uuid4."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return key_word(rng.randrange(key_count()))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown RULER needle type {kind!r}")


def _fresh(rng: random.Random, kind: str, taken: set[str]) -> str:
    while True:
        value = _random_value(rng, kind)
        if value not in taken:
            taken.add(value)
            return value


def _niah_draft(cfg: TaskConfig, rng: random.Random, size: int, words: tuple[str, ...]) -> Draft:
    a = cfg.args
    type_k, type_v = a["type_needle_k"], a["type_needle_v"]
    num_k = max(a["num_needle_k"], a["num_needle_q"])
    taken: set[str] = set()
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    for _ in range(num_k):
        keys.append(_fresh(rng, type_k, taken))
        value: list[str] = []
        for _ in range(a["num_needle_v"]):
            value.append(_fresh(rng, type_v, taken))
            needles.append(NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value[-1]))
        values.append(value)
    rng.shuffle(needles)

    if a["type_haystack"] == "essay":
        if size <= len(words):
            text = " ".join(words[:size])
        else:
            repeats = -(-size // len(words))
            text = " ".join((words * repeats)[:size])
        sents = split_sentences(text)
        depths = rng.sample(DEPTHS, len(needles))
        cuts = [0, *sorted(int(len(sents) * (d / 100)) for d in depths), len(sents)]
        parts: list[str] = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if a["type_haystack"] == "noise":
            lines = [NOISE] * size
        else:  # needle: distractors with fresh keys and values
            lines = [
                NEEDLE.format(
                    type_needle_v=type_v,
                    key=_fresh(rng, type_k, taken),
                    value=_fresh(rng, type_v, taken),
                )
                for _ in range(size)
            ]
        for at, needle in zip(
            sorted(rng.sample(range(size), len(needles)), reverse=True), needles, strict=True
        ):
            lines.insert(at, needle)
        context = "\n".join(lines)

    picked = rng.sample(range(num_k), a["num_needle_q"])
    queries = [keys[i] for i in picked]
    answers = tuple(v for i in picked for v in values[i])
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    template, prefix, type_word = TEMPLATES["niah"], ANSWER_PREFIXES["niah"], type_v
    if a["num_needle_q"] * a["num_needle_v"] == 1:
        template, prefix, type_word = singular_niah(template), singular_niah(prefix), type_v[:-1]
    head, question = split_template("niah", template)
    return Draft(
        head.format(type_needle_v=type_word, context=context),
        question.format(type_needle_v=type_word, query=query),
        prefix.format(type_needle_v=type_word, query=query),
        answers,
    )


def _niah_min_size(cfg: TaskConfig) -> int:
    a = cfg.args
    if a["type_haystack"] == "essay":
        return 1
    return max(a["num_needle_k"], a["num_needle_q"]) * a["num_needle_v"]


# ----------------------------------------------------------------------------- vt

_VAR = re.compile(r"\b[A-Z]+\b")


def _prompt_words(kind: str) -> str:
    """The task's template and answer prefix, lower case: an answer found in it would be in the
    question (or matched by the answer prefix), so generated answers avoid it."""
    return (TEMPLATES[kind] + ANSWER_PREFIXES[kind]).lower()


def _chain_vars(rng: random.Random, count: int, letters: int, avoid: set[str]) -> list[str]:
    """``count`` distinct upper-case names of ``letters`` letters, none in ``avoid``, nor
    ``VAR``, nor a piece of the template's words (RULER ``generate_chains``:
    ``random.choices(string.ascii_uppercase, k=k)``)."""
    out: list[str] = []
    words = _prompt_words("variable_tracking")
    while len(out) < count:
        name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=letters))
        if name != "VAR" and name not in avoid and name not in out and name.lower() not in words:
            out.append(name)
    return out


def _chain(names: list[str], value: str) -> list[str]:
    """RULER's chain lines: ``VAR A = value``, then ``VAR B = VAR A `` (trailing space)."""
    return [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(len(names) - 1)
    ]


def _noise_with_chain(rng: random.Random, size: int, chain: list[str]) -> str:
    """RULER ``variable_tracking.py`` noise haystack: the chain's lines at sorted random
    positions among ``size`` noise lines, in order."""
    lines = [NOISE] * size
    positions = sorted(rng.sample(range(len(lines)), len(chain)))
    for j, at in enumerate(positions):
        lines.insert(at + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n")


def _vt_prompt(context: str, value: str, num_v: int) -> tuple[str, str, str]:
    head, question = split_template("variable_tracking")
    prefix = ANSWER_PREFIXES["variable_tracking"]
    return (
        head.format(context=context),
        question.format(query=value),
        prefix.format(query=value, num_v=num_v),
    )


@dataclass(frozen=True)
class _Icl:
    text: str  # RULER's icl_example: input + " " + answers + "\n"
    names: tuple[str, ...]


def _vt_icl(cfg: TaskConfig, seed: str, measure: Callable[[str], int]) -> _Icl:
    """RULER's in-context example: ``sys_vartrack_w_noise_random(num_samples=1,
    max_seq_length=500, incremental=5)``: 3-letter variables, value ``12345``, the largest noise
    haystack whose base prompt (template + answer prefix, no chat) has <= 500 tokens."""
    hops = min(10, cfg.args["num_hops"])

    def make(size: int) -> tuple[str, tuple[str, ...]]:
        rng = random.Random(seed + ":icl")
        names = _chain_vars(rng, hops + 1, 3, set())
        context = _noise_with_chain(rng, size, _chain(names, "12345"))
        head, question, prefix = _vt_prompt(context, "12345", hops + 1)
        return head + question + prefix, tuple(names)

    size = _fit_size(lambda s: measure(make(s)[0]), hops + 1, 500, what="the vt example")
    text, names = make(size)
    return _Icl(text + " " + " ".join(names) + "\n", names)


def _vt_draft(cfg: TaskConfig, rng: random.Random, size: int, icl: _Icl) -> Draft:
    hops = cfg.args["num_hops"]
    names = _chain_vars(rng, hops + 1, 5, set())
    value = str(rng.randint(10000, 99998))  # np.random.randint(10000, 99999): high exclusive
    # RULER randomize_icl: the example's variables and value replaced by random ones.
    new = _chain_vars(rng, len(icl.names), 3, set(names))
    mapping = dict(zip(icl.names, new, strict=True))
    example = _VAR.sub(lambda m: mapping.get(m.group(0), m.group(0)), icl.text)
    icl_value = value
    while icl_value == value:
        icl_value = str(rng.randint(10000, 99998))
    example = example.replace("12345", icl_value)
    context = _noise_with_chain(rng, size, _chain(names, value))
    head, question, prefix = _vt_prompt(context, value, hops + 1)
    return Draft(example + "\n" + head, question, prefix, tuple(names))


# ----------------------------------------------------------------------------- cwe


def _cwe_example(
    rng: random.Random, num_words: int, common: int, uncommon: int, num_cw: int
) -> tuple[str, list[str]]:
    """RULER ``get_example``: ``num_words`` distinct words, the first ``num_cw`` repeated
    ``common`` times and the rest ``uncommon`` times, shuffled, numbered ``"1. w 2. w ..."``."""
    pool = _cwe_pool()
    if num_words <= len(pool):
        full = rng.sample(pool, num_words)
    elif num_words <= key_count():
        full = [key_word(i) for i in rng.sample(range(key_count()), num_words)]
    else:
        raise ValueError(f"cwe needs {num_words} distinct words; the lists have {key_count()}")
    common_words, rest = full[:num_cw], full[num_cw:]
    items = common_words * common + rest * uncommon
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common_words


@functools.lru_cache(maxsize=1)
def _cwe_pool() -> tuple[str, ...]:
    """:func:`~.haystack.cwe_words` less the words found (as a lower-case substring) in the
    template or answer prefix ("are", "list", "most", ...): RULER's substring scoring would
    credit them from the question's own words."""
    words = _prompt_words("common_words_extraction")
    return tuple(w for w in cwe_words() if w.lower() not in words)


def _cwe_draft(cfg: TaskConfig, rng: random.Random, size: int, length: int) -> Draft:
    a = cfg.args
    num_cw = a["num_cw"]
    if length < 4096:
        shot, main = (20, 3, 1), (size, 6, 1)
    else:
        shot, main = (40, 10, 3), (size, a["freq_cw"], a["freq_ucw"])
    head, question = split_template("common_words_extraction")
    prefix = ANSWER_PREFIXES["common_words_extraction"]
    shot_text, shot_answer = _cwe_example(rng, *shot, num_cw)
    example = (
        head.format(context=shot_text)
        + question
        + prefix
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    )
    context, answer = _cwe_example(rng, *main, num_cw)
    return Draft(example + "\n" + head.format(context=context), question, prefix, tuple(answer))


# ----------------------------------------------------------------------------- fwe


def _zeta(alpha: float) -> float:
    """Riemann zeta for ``alpha > 1`` (scipy's ``zeta(alpha)`` in RULER): partial sum to 1000
    plus the Euler-Maclaurin tail (error far below one part in 1e15)."""
    n = 1000
    head = math.fsum(k**-alpha for k in range(1, n))
    tail = n ** (1 - alpha) / (alpha - 1) + n**-alpha / 2 + alpha * n ** (-alpha - 1) / 12
    return head + tail


def _fwe_counts(num_words: int, vocab: int, alpha: float) -> list[int]:
    z = _zeta(alpha)
    return [int(num_words * (k**-alpha) / z) for k in range(1, vocab + 1)]


def _fwe_vocab_size(length: int) -> int:
    return (length - TOKENS_TO_GENERATE["freq_words_extraction"]) // 50


def _fwe_draft(cfg: TaskConfig, rng: random.Random, size: int, length: int) -> Draft:
    vocab_size = _fwe_vocab_size(length)
    vocab: list[str] = []
    seen: set[str] = set()
    avoid = _prompt_words("freq_words_extraction")
    while len(vocab) < vocab_size:  # RULER: 6 random lower-case letters, distinct
        word = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=6))
        if word not in seen and word not in avoid:
            seen.add(word)
            vocab.append(word)
    vocab.sort()
    rng.shuffle(vocab)
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    counts = _fwe_counts(size, vocab_size, cfg.args["alpha"])
    words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
    rng.shuffle(words)
    head, question = split_template("freq_words_extraction")
    return Draft(
        head.format(context=" ".join(words)),
        question,
        ANSWER_PREFIXES["freq_words_extraction"],
        tuple(vocab[1:4]),
    )


def _fwe_min_size(cfg: TaskConfig, length: int) -> int:
    """The fewest words for which ranks 2-4 are the three most frequent unambiguously (the
    4th-ranked word strictly more frequent than the 5th)."""
    vocab = _fwe_vocab_size(length)
    if vocab < 5:
        raise ValueError(f"fwe needs a vocabulary of >= 5 words: length >= 300, got {length}")
    size = 1
    while True:
        c = _fwe_counts(size, 5, cfg.args["alpha"])
        if c[3] > c[4]:
            return size
        size += 1


# ----------------------------------------------------------------------------- fitting


def build_draft(
    task: str,
    length: int,
    index: int,
    seed: int,
    size: int,
    *,
    haystack_text: str | None = None,
    icl_measure: Callable[[str], int] | None = None,
) -> Draft:
    """The draft of one sample at haystack size ``size`` (noise lines, essay words, distractor
    needles, vt noise lines, cwe distinct words or fwe words), seeded as in the module
    docstring. ``icl_measure`` (vt only) counts a text's tokens, for the in-context example.

    Raises:
        ValueError: an unknown task, or vt without ``icl_measure``.
    """
    cfg = _config(task)
    key = _seed_key(task, length, index, seed)
    rng = random.Random(key)
    if cfg.kind == "niah":
        words = essay_words(haystack_text) if cfg.args["type_haystack"] == "essay" else ()
        return _niah_draft(cfg, rng, size, words)
    if cfg.kind == "variable_tracking":
        if icl_measure is None:
            raise ValueError("vt drafts need icl_measure (the tokenizer's token count)")
        return _vt_draft(cfg, rng, size, _vt_icl(cfg, key, icl_measure))
    if cfg.kind == "common_words_extraction":
        return _cwe_draft(cfg, rng, size, length)
    return _fwe_draft(cfg, rng, size, length)


def _seed_key(task: str, length: int, index: int, seed: int) -> str:
    return f"ruler:{task}:{length}:{index}:{seed}"


def _config(task: str) -> TaskConfig:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {quote(task)}; known: {', '.join(TASKS)}")
    return TASKS[task]


def _fit_size(total: Callable[[int], int], lo: int, budget: int, *, what: str) -> int:
    """The largest size ``s >= lo`` with ``total(s) <= budget`` found by galloping from a
    linear estimate and bisecting (exact when ``total`` is non-decreasing; the size returned
    always fits).

    Raises:
        ValueError: ``total(lo) > budget``.
    """
    cache: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in cache:
            cache[size] = total(size)
        return cache[size] <= budget

    if not fits(lo):
        raise ValueError(
            f"{what} does not fit: its smallest prompt needs {cache[lo]} tokens "
            f"(with the tokens to generate), the length is {budget}"
        )
    probe = lo + 16
    fits(probe)
    per_unit = max((cache[probe] - cache[lo]) / 16, 1e-3)
    room = budget - cache[lo]
    # every unit adds about a token or more: never guess past two units per free token
    guess = max(lo, lo + min(int(room / per_unit), 2 * room + 16))
    step = max(4, guess // 64)
    if fits(guess):
        best = guess
        while fits(best + step):
            best += step
            step *= 2
        worst = best + step
    else:
        worst = guess
        while True:
            low = max(lo, worst - step)
            if fits(low):
                best = low
                break
            worst = low
            step *= 2
    while worst - best > 1:
        mid = (best + worst) // 2
        if fits(mid):
            best = mid
        else:
            worst = mid
    return best


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    return encode


def generate_samples(
    task: str,
    length: int,
    n: int,
    seed: int,
    tokenizer: Any,
    *,
    haystack_text: str | None = None,
    chat: bool = True,
) -> list[RulerSample]:
    """``n`` samples (indices ``0 .. n-1``) of ``task`` fitted to ``length`` tokens.

    Each sample's haystack is the largest whose split prompt fits: ``len(context_ids) +
    len(question_ids) + tokens_to_generate <= length`` (tokens of ``tokenizer``, an HF
    tokenizer called as ``tokenizer(text, add_special_tokens=False)``). ``chat`` renders the
    prompt with the tokenizer's chat template (:func:`~.templates.render_split`), else RULER's
    base template. ``haystack_text`` replaces the default essay text (the KJV Bible) for the
    ``essay`` tasks; the other tasks ignore it. The same arguments give the same samples on
    every machine (module docstring).

    Raises:
        ValueError: an unknown task, ``n < 1``, ``length < 1``, a ``length`` too short for the
            task's smallest prompt, ``chat`` with a tokenizer that has no chat template, or a
            ``haystack_text`` without words.
    """
    cfg = _config(task)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"RULER needs n >= 1 samples, got {n!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"RULER needs a length >= 1 token, got {length!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"RULER's seed is an int, got {seed!r}")
    if haystack_text is not None:
        essay_words(haystack_text)  # refuse an empty text up front
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: generate RULER samples with chat=False "
            "(the base template)"
        )
    encode = _encoder(tokenizer)
    if cfg.kind == "niah":
        lo = _niah_min_size(cfg)
    elif cfg.kind == "variable_tracking":
        lo = cfg.args["num_hops"] + 1
    elif cfg.kind == "common_words_extraction":
        lo = cfg.args["num_cw"]
    else:
        lo = _fwe_min_size(cfg, length)
    return [
        _fit_sample(cfg, length, index, seed, lo, tokenizer, encode, haystack_text, chat)
        for index in range(n)
    ]


def _fit_sample(
    cfg: TaskConfig,
    length: int,
    index: int,
    seed: int,
    lo: int,
    tokenizer: Any,
    encode: Callable[[str], list[int]],
    haystack_text: str | None,
    chat: bool,
) -> RulerSample:
    """One sample with the largest haystack that fits (:func:`_fit_size` over the size)."""
    built: dict[int, tuple[Draft, str, str, list[int], list[int]]] = {}
    icl_counts: dict[str, int] = {}

    def icl_measure(text: str) -> int:
        if text not in icl_counts:
            icl_counts[text] = len(encode(text))
        return icl_counts[text]

    def total(size: int) -> int:
        draft = build_draft(
            cfg.name,
            length,
            index,
            seed,
            size,
            haystack_text=haystack_text,
            icl_measure=icl_measure,
        )
        context, question = render_split(
            tokenizer, draft.head, draft.question, draft.answer_prefix, chat=chat
        )
        cids, qids = encode(context), encode(question)
        built[size] = (draft, context, question, cids, qids)
        return len(cids) + len(qids) + cfg.tokens_to_generate

    size = _fit_size(total, lo, length, what=f"RULER {cfg.name} at length {length}")
    draft, context, question, cids, qids = built[size]
    return RulerSample(
        task=cfg.name,
        length=length,
        index=index,
        seed=seed,
        context=context,
        question=question,
        context_ids=tuple(cids),
        question_ids=tuple(qids),
        outputs=draft.outputs,
        max_new_tokens=cfg.tokens_to_generate,
        metric=cfg.metric,
    )
