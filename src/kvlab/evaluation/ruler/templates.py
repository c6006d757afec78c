"""RULER's task templates and answer prefixes, and the chat rendering with the context/question
split.

The templates and answer prefixes are RULER's, verbatim: NVIDIA/RULER
``scripts/data/synthetic/constants.py`` (``TASKS[...]['template']`` /
``['answer_prefix']``, commit c3f5e3b). RULER's ``scripts/data/prepare.py`` builds a task's
prompt as ``model_template.format(task_template=template) + answer_prefix``; with the ``base``
model template that is ``template + answer_prefix``, and for a chat model the answer prefix comes
after the assistant turn's opening.

The split (query-agnostic compression, as kvpress's RULER dataset,
NVIDIA/kvpress ``evaluation/benchmarks/ruler/create_huggingface_dataset.py``, whose
``QUESTION_PATTERNS`` mark where each task's question starts): everything before the question
text is the *context* (what a cache compresses), the question text and what follows it is the
*question*. Every RULER template ends with its question after ``{context}``, so the template is
cut once, at :data:`QUESTION_START` (the first character of kvpress's pattern), into a head (with
``{context}``) and a question part; the two are formatted separately.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ANSWER_PREFIXES",
    "QUESTION_START",
    "SPLIT_MARKER",
    "TEMPLATES",
    "TOKENS_TO_GENERATE",
    "render_split",
    "singular_niah",
    "split_template",
]

#: RULER ``scripts/data/synthetic/constants.py`` ``TASKS[kind]['template']``, verbatim.
TEMPLATES: dict[str, str] = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
        "all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
        "above."
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
        "common words in the above list?"
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
        "words in the above coded text?"
    ),
}

#: RULER ``constants.py`` ``TASKS[kind]['answer_prefix']``, verbatim (each starts with a space).
ANSWER_PREFIXES: dict[str, str] = {
    "niah": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    "variable_tracking": (
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: "
    ),
    "common_words_extraction": (
        " Answer: The top 10 words that appear most often in the list are:"
    ),
    "freq_words_extraction": (
        " Answer: According to the coded text above, the three most frequently appeared words are:"
    ),
}

#: RULER ``constants.py`` ``TASKS[kind]['tokens_to_generate']``.
TOKENS_TO_GENERATE: dict[str, int] = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
}

#: Where each template's question starts: the start of kvpress's ``QUESTION_PATTERNS``
#: (``What (?:is|are all) the special magic``, ``Question: Find all ...``, ...).
QUESTION_START: dict[str, str] = {
    "niah": "What are all the special magic",
    "variable_tracking": "Question: Find all variables",
    "common_words_extraction": "Question: What are the 10 most common words",
    "freq_words_extraction": "Question: Do not provide any explanation.",
}

#: Put between the context and the question in the user turn to find the split in the rendered
#: chat; never left in a sample.
SPLIT_MARKER = "\u2063<kvlab-ruler-split>\u2063"


def singular_niah(text: str) -> str:
    """RULER ``niah.py``'s rewrite of the template when one value is asked for
    (``num_needle_q * num_needle_v == 1``): ``Some`` -> ``A``, ``are all`` -> ``is``, ``are`` ->
    ``is``, ``answers`` -> ``answer``, in that order (RULER applies it to the template with the
    answer prefix; the type word loses its final ``s`` separately)."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


def split_template(kind: str, template: str | None = None) -> tuple[str, str]:
    """``(head, question)``: the template ``kind`` (or the given rewrite of it) cut at the
    start of its question (:data:`QUESTION_START`, after ``singular_niah`` where applied: the
    cut is searched for with ``are all`` and with ``is``).

    Raises:
        ValueError: the question start is not found after ``{context}``.
    """
    text = TEMPLATES[kind] if template is None else template
    starts = [QUESTION_START[kind], singular_niah(QUESTION_START[kind])]
    context_at = text.find("{context}")
    for start in starts:
        at = text.rfind(start)
        if at > context_at >= 0:
            return text[:at], text[at:]
    raise ValueError(f"the {kind} template has no question after its {{context}}")


def render_split(
    tokenizer: Any, head: str, question: str, answer_prefix: str, *, chat: bool
) -> tuple[str, str]:
    """``(context, question)`` strings of one prompt.

    With ``chat``: ``tokenizer.apply_chat_template([{"role": "user", "content": head +
    question}], tokenize=False, add_generation_prompt=True)`` cut where the question text
    starts (found by rendering ``head + SPLIT_MARKER + question`` and checked against the
    unmarked rendering), then the answer prefix with its leading whitespace removed appended
    after the generation prompt (as kvpress's pipeline does: ``question + question_suffix +
    answer_prefix``). Without ``chat``: RULER's ``base`` template, ``head + question +
    answer_prefix``, with the tokenizer's BOS token text in front of the head when the tokenizer
    adds one by default (kvpress's pipeline does the same for a tokenizer without a chat
    template). So ``context + question`` is the whole prompt text, and tokenizing both with
    ``add_special_tokens=False`` puts BOS (if any) once, in the context.

    Raises:
        ValueError: ``chat`` and the tokenizer has no chat template, or the template changes
            the message so that the split cannot be found or does not reproduce the rendering.
    """
    if not chat:
        return _bos_text(tokenizer) + head, question + answer_prefix
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: generate RULER samples with chat=False "
            "(the base template)"
        )
    if SPLIT_MARKER in head or SPLIT_MARKER in question:
        raise ValueError("the RULER split marker occurs in the prompt text")

    def render(content: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    marked = render(head + SPLIT_MARKER + question)
    if marked.count(SPLIT_MARKER) != 1:
        raise ValueError("the chat template does not keep the user message intact")
    before, after = marked.split(SPLIT_MARKER)
    if before + after != render(head + question):
        raise ValueError("the chat template renders the marked and unmarked message differently")
    return before, after + answer_prefix.lstrip()


def _bos_text(tokenizer: Any) -> str:
    bos = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    ids = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return bos if ids[:1] == [bos_id] else ""
