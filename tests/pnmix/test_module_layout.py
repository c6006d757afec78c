"""The PN-Mix and RoPE module layout: old import paths, no codec import cycle, hashed modules."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvlab.pnmix
from kvlab.evaluation.plan import IMPLEMENTATION_MODULES

SRC = Path(kvlab.pnmix.__file__).resolve().parents[1]

# public names other modules and branches import from these paths (issue 18 split)
OLD_PATHS = {
    "kvlab.pnmix.codecs": (
        "KEY_CODING_NAMES",
        "CartesianCodec",
        "KeyCodec",
        "KeyCodes",
        "KeyLayout",
        "MixCodec",
        "PairCodec",
        "PairCodes",
        "PerTokenCodec",
        "PhaseNormCodec",
        "SaliencyRule",
        "TableStatistics",
        "first_group_error_saliency",
        "key_codec_from_name",
        "query_logit_saliency",
        "BitAllocCodec",
    ),
    "kvlab.pnmix.cache": ("KeyCoding", "PNMixCache", "PNMixConfig", "PackedGroup"),
    "kvlab.rope": (
        "ROTATION_ERROR_BOUND",
        "Layout",
        "RotaryConfig",
        "apply_rotary",
        "rotate_by_delta",
        "rotation_tables",
    ),
}


@pytest.mark.parametrize("module", sorted(OLD_PATHS))
def test_public_names_stay_importable_from_their_old_paths(module: str) -> None:
    mod = importlib.import_module(module)
    for name in OLD_PATHS[module]:
        assert hasattr(mod, name), f"{module}.{name}"
    assert set(mod.__all__) <= set(dir(mod))
    for name in kvlab.pnmix.__all__:
        assert hasattr(kvlab.pnmix, name)


def _kvlab_imports(path: Path) -> set[str]:
    """Modules a source file imports (under ``if TYPE_CHECKING:`` too: tests/test_import_graph.py
    counts those)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_codec_families_import_the_seam_not_each_other_through_the_registry() -> None:
    pnmix = SRC / "pnmix"
    for name in ("key_codec", "pair_codecs", "mix_codec", "width_codec"):
        imports = _kvlab_imports(pnmix / f"{name}.py")
        assert "kvlab.pnmix.codecs" not in imports, name
    assert not {"kvlab.pnmix.pair_codecs", "kvlab.pnmix.mix_codec", "kvlab.pnmix.width_codec"} & (
        _kvlab_imports(pnmix / "key_codec.py")
    )


def test_every_pnmix_and_rope_module_is_hashed_into_task_keys() -> None:
    files = [*sorted((SRC / "pnmix").glob("*.py")), *sorted((SRC / "rope").glob("*.py"))]
    for path in files:
        if path.name == "__init__.py" and path.parent.name == "pnmix":
            continue
        name = "kvlab." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        assert name in IMPLEMENTATION_MODULES, name
