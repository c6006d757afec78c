"""Haystacks and word lists for the RULER tasks.

* ``noise``: RULER's repeated sentence (NVIDIA/RULER ``scripts/data/synthetic/niah.py`` and
  ``variable_tracking.py``, ``haystack = "The grass is green. ..."``), one per line.
* ``essay``: RULER reads Paul Graham's essays (``json/PaulGrahamEssays.json``, downloaded by
  ``json/download_paulgraham_essay.py``) and splits them into words after collapsing whitespace
  (``re.sub(r'\\s+', " ", essay).split(" ")``). kvlab uses a public-domain text instead: the
  package's default text (:func:`kvlab.data.default_text`, the King James Bible, one verse a
  line) or any string the caller passes, split the same way. The first ``n`` words are the
  haystack (repeated when ``n`` exceeds the text, as RULER does).
* ``needle``: distractor needles (built in :mod:`kvlab.evaluation.ruler.tasks`).

RULER splits the essay text into sentences with ``nltk.tokenize.sent_tokenize`` (punkt, a model
it downloads); kvlab splits after ``.``, ``!`` or ``?`` (optionally followed by closing quotes or
brackets) followed by whitespace (:func:`split_sentences`), which needs no download.

Word lists: RULER takes them from ``wonderwords`` (``random_word._get_words_from_text_file`` of
``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``); kvlab reads the same files from the
``wonderwords`` package (a dependency, pinned) with :mod:`importlib.resources`.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = [
    "DEPTHS",
    "NOISE",
    "cwe_words",
    "essay_words",
    "key_count",
    "key_parts",
    "key_word",
    "split_sentences",
    "wonderwords_list",
]

#: RULER's noise haystack sentence (``niah.py`` / ``variable_tracking.py``).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: RULER's needle depths in percent: ``np.round(np.linspace(0, 100, num=40)).astype(int)``
#: (``100 * i / 39`` never falls on a half, so Python's ``round`` gives numpy's values).
DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (stripped): cut after ``.``/``!``/``?`` (and closing quotes or
    brackets) followed by whitespace; the whitespace is dropped. Stands in for RULER's
    ``nltk`` ``sent_tokenize`` (module docstring)."""
    text = text.strip()
    if not text:
        return []
    pieces: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        end = match.start() + len(match.group(0).rstrip())
        pieces.append(text[start:end])
        start = match.end()
    pieces.append(text[start:])
    return [p for p in pieces if p]


def essay_words(text: str | None = None) -> tuple[str, ...]:
    """RULER's essay haystack as words: ``re.sub(r"\\s+", " ", text).split(" ")`` of ``text``,
    or of the package's default text (KJV) when ``text`` is None.

    Raises:
        ValueError: the text has no word.
        FileNotFoundError: ``text`` is None and the default text is not installed.
    """
    if text is None:
        return _default_words()
    return _words_of(text)


@functools.lru_cache(maxsize=4)
def _words_of(text: str) -> tuple[str, ...]:
    words = tuple(w for w in re.sub(r"\s+", " ", text).strip().split(" ") if w)
    if not words:
        raise ValueError("the RULER essay haystack text has no words")
    return words


@functools.lru_cache(maxsize=1)
def _default_words() -> tuple[str, ...]:
    from kvlab.data import default_text

    return essay_words(default_text().data.decode("utf-8"))


@functools.lru_cache(maxsize=8)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """The words of ``wonderwords``'s ``assets/<name>`` (one a line, right-stripped, as
    ``wonderwords.random_word._get_words_from_text_file``).

    Raises:
        ModuleNotFoundError: ``wonderwords`` is not installed (the message says how to fix it).
    """
    try:
        folder = resources.files("wonderwords") / "assets"
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "the RULER tasks need the 'wonderwords' package (pip install wonderwords==3.0.1)"
        ) from err
    lines = (folder / name).read_text(encoding="utf-8").splitlines()
    return tuple(line.rstrip() for line in lines)


@functools.lru_cache(maxsize=1)
def key_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns): wonderwords's lists, each sorted and without duplicates or empty
    entries. RULER ``niah.py``'s keys are ``sorted(set(f"{adj}-{noun}"))``, over 6 million
    strings (slow to build); kvlab draws an adjective and a noun instead (:func:`key_word`),
    uniform over the same pairs."""
    adjs = tuple(sorted({w for w in wonderwords_list("adjectivelist.txt") if w}))
    nouns = tuple(sorted({w for w in wonderwords_list("nounlist.txt") if w}))
    return adjs, nouns


def key_count() -> int:
    """How many adjective-noun keys there are."""
    adjs, nouns = key_parts()
    return len(adjs) * len(nouns)


def key_word(number: int) -> str:
    """The adjective-noun key number ``number`` (``0 <= number < key_count()``), adjective
    major: ``f"{adjs[number // len(nouns)]}-{nouns[number % len(nouns)]}"``."""
    adjs, nouns = key_parts()
    return f"{adjs[number // len(nouns)]}-{nouns[number % len(nouns)]}"


@functools.lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """RULER ``common_words_extraction.py``'s words before its shuffle: ``sorted(set(nouns +
    adjs + verbs))`` from wonderwords, without words containing whitespace or that are empty
    (a list entry is one numbered item: ``"3. word"``)."""
    words = (
        wonderwords_list("nounlist.txt")
        + wonderwords_list("adjectivelist.txt")
        + wonderwords_list("verblist.txt")
    )
    return tuple(sorted({w for w in words if w and not any(c.isspace() for c in w)}))
