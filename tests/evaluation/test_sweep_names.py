"""``kvlab sweep`` output names are unique by construction and every output path is checked
before the first task runs (issue 38, item 5)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.evaluation.execute import Runtime
from kvlab.evaluation.sweep import SLUG_MAX, SweepOptions, load_sweep, run_sweep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sha8(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def names_of(tmp_path: Path, models: list[str], texts: list[str], **extra) -> list[str]:
    sweep = tmp_path / "s.toml"
    listed = ", ".join(f'"{m}"' for m in models)
    text_list = ", ".join(f'"{t}"' for t in texts)
    sweep.write_text(
        f"models = [{listed}]\ntexts = [{text_list}]\nmethods = ['full']\n", encoding="utf-8"
    )
    groups = load_sweep(sweep, SweepOptions(output_dir=tmp_path / "out", **extra))
    for name, config in groups:
        assert config.output_dir == tmp_path / "out" / name
    return [name for name, _ in groups]


def test_names_that_do_not_collide_stay_as_they_were(tmp_path):
    assert names_of(tmp_path, ["smollm2-135m"], ["default"]) == ["smollm2-135m--default"]
    assert names_of(tmp_path, ["runs/tiny-llama", "gemma3-270m"], ["texts/hamlet.txt"]) == [
        "tiny-llama--hamlet",
        "gemma3-270m--hamlet",
    ]


def test_models_sharing_a_folder_name_get_a_hash_of_their_path(tmp_path):
    assert names_of(tmp_path, ["run1/model", "run2/model", "other"], ["default"]) == [
        f"model-{sha8('run1/model')}--default",
        f"model-{sha8('run2/model')}--default",
        "other--default",  # no collision: as before
    ]


def test_collisions_ignore_case_and_text_stems_collide_too(tmp_path):
    assert names_of(tmp_path, ["a/Model", "b/model"], ["x/t.txt", "y/t.md", "default"]) == [
        f"Model-{sha8('a/Model')}--t-{sha8('x/t.txt')}",
        f"Model-{sha8('a/Model')}--t-{sha8('y/t.md')}",
        f"Model-{sha8('a/Model')}--default",
        f"model-{sha8('b/model')}--t-{sha8('x/t.txt')}",
        f"model-{sha8('b/model')}--t-{sha8('y/t.md')}",
        f"model-{sha8('b/model')}--default",
    ]
    # a text file named like the package text
    assert names_of(tmp_path, ["m"], ["default", "default.txt"]) == [
        f"m--default-{sha8('default')}",
        f"m--default-{sha8('default.txt')}",
    ]


def test_non_ascii_and_dot_names_are_never_empty_nor_shared(tmp_path):
    assert names_of(tmp_path, ["模型", "модель", "x/.."], ["default"]) == [
        f"model-{sha8('模型')}--default",
        f"model-{sha8('модель')}--default",
        f"model-{sha8('x/..')}--default",
    ]


def test_a_long_name_keeps_its_head_and_a_hash(tmp_path):
    long = "m" * 300
    [name] = names_of(tmp_path, [long], ["default"])
    assert name == f"{'m' * (SLUG_MAX - 9)}-{sha8(long)}--default"


def test_two_pairs_that_would_share_a_folder_get_a_hash_of_both(tmp_path):
    names = names_of(tmp_path, ["a--b", "a"], ["b--c.txt", "c.txt"])
    assert names == [
        "a--b--b--c",
        f"a--b--c-{sha8('a--b' + chr(0) + 'c.txt')}",
        f"a--b--c-{sha8('a' + chr(0) + 'b--c.txt')}",
        "a--c",
    ]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.text(
            st.characters(codec="utf-8", exclude_characters='"\\\x7f'), min_size=1, max_size=90
        ).filter(lambda t: t.isprintable()),
        min_size=1,
        max_size=5,
        unique=True,
    )
)
def test_every_group_gets_its_own_short_folder(tmp_path_factory, models):
    names = names_of(tmp_path_factory.mktemp("names"), models, ["default"])
    assert len({n.casefold() for n in names}) == len(names)
    for name in names:
        assert 0 < len(name.encode()) <= 2 * SLUG_MAX + 2 and name.isascii()
        assert name not in (".", "..") and "/" not in name


def test_a_model_listed_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'models' lists 'm' twice"):
        names_of(tmp_path, ["m", "x", "m"], ["default"])


def _sweep_file(folder: Path, models: list[Path], text: Path) -> Path:
    path = folder / "two.toml"
    listed = ", ".join(f'"{m}"' for m in models)
    path.write_text(
        f"""
models = [{listed}]
texts = ["{text}"]
protocols = ["prefill-score"]
methods = ["streaming-llm@0.5"]

[prefill-score]
windows = 1
prefill = 192
score = 2
""",
        encoding="utf-8",
    )
    return path


def test_models_in_folders_of_the_same_name_each_get_their_outputs(
    tiny_model_dir, tiny_text, tmp_path
):
    """The issue's case: ``run1/model`` and ``run2/model`` wrote one group folder, table,
    artifact and Pareto plot; the first was silently overwritten."""
    models = []
    for run in ("run1", "run2"):
        models.append(tmp_path / run / "model")
        shutil.copytree(tiny_model_dir, models[-1])
    out = tmp_path / "out"
    options = SweepOptions(output_dir=out, device="cpu", progress=False, cpu_threads=1)
    outcome = run_sweep(_sweep_file(tmp_path, models, tiny_text), options)
    folders = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name != "tasks")
    expected = sorted(f"model-{sha8(str(m))}--{tiny_text.stem}" for m in models)
    assert folders == expected
    for folder in folders:
        assert (out / folder / "table-prefill-score.md").is_file()
        assert (out / folder / "metrics-prefill-score-cpu.json").is_file()
    assert sorted(p.name for p in outcome.pareto_paths) == [f"pareto-{f}.png" for f in folders]
    for path in outcome.pareto_paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert outcome.summary.count("\n## ") == 2


def test_every_output_path_is_checked_before_the_first_task(
    tiny_model_dir, tiny_text, tmp_path, monkeypatch
):
    """An output folder whose files' paths pass the file system's limit is refused before any
    task runs (it used to fail when the last file, the Pareto plot, was written)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a task ran")

    monkeypatch.setattr(Runtime, "run", refuse)
    monkeypatch.setattr(Runtime, "loaded", refuse)
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    # the folder itself is within the limit; its files are not
    room = path_max - 30 - len(os.fsencode(str(tmp_path)))  # 30 bytes left for the files
    out = tmp_path.joinpath(*["d" * 99] * (room // 100 - 1), "d" * (room % 100 + 99))
    assert len(os.fsencode(str(out))) == path_max - 30
    sweep = _sweep_file(tmp_path, [tiny_model_dir], tiny_text)
    options = SweepOptions(output_dir=out, device="cpu", progress=False)
    with pytest.raises(ValueError, match=r"bytes long; this file system allows"):
        run_sweep(sweep, options)
    assert not any(tmp_path.glob("d*"))  # nothing created


def test_a_name_longer_than_the_file_system_allows_is_refused_up_front(tmp_path, tiny_text):
    from kvlab.evaluation.outputs import check_output_paths

    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(ValueError, match=rf"is {name_max + 1} bytes long; .* allows {name_max}"):
        check_output_paths(tmp_path, [tmp_path / ("p" * (name_max + 1))])
    check_output_paths(tmp_path, [tmp_path / ("p" * name_max)])  # at the limit: fine
