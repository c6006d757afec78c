"""A CLI that respects the user's time: early checks, one error style, fast help, validate."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab
from kvlab.artifacts import validate_artifact
from kvlab.evaluation.plan import EvalConfig
from kvlab.userinput import quote

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT / "tests" / "fixtures" / "seeds"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def kvlab_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvlab.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=300,
        check=False,
    )


def assert_one_error(done: subprocess.CompletedProcess, fragment: str) -> None:
    """The common error style: exit 2, stdout empty, stderr one line ``error: ...``."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in done.stderr


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if any model is loaded."""
    import kvlab.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvlab.models, "load_model", refuse)


def _readonly_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return folder
    # root writes anywhere: use a folder the kernel keeps read-only for everyone
    for candidate in (Path("/sys/kernel"), Path("/proc/self")):
        try:
            with open(candidate / "kvlab-probe", "w"):
                pass
        except OSError:
            return candidate
    pytest.skip("no read-only folder available to this user")


def test_output_paths_are_checked_before_the_model_loads(tmp_path, tiny_text, no_model_load):
    from kvlab.evaluation import run_eval

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    readonly = _readonly_folder(tmp_path)
    plot_as_folder = tmp_path / "out"
    (plot_as_folder / "kl-vs-bytes.png").mkdir(parents=True)
    cases = [
        (a_file, "is not a folder"),
        (a_file / "below", "is not a folder"),
        (readonly / "runs", "cannot write in"),
        (plot_as_folder, "is a folder, where a file is written"),
    ]
    for folder, message in cases:
        config = EvalConfig(
            model="smollm2-135m",
            text=tiny_text,
            methods=["full"],
            device="cpu",
            output_dir=folder,
            progress=False,
        )
        with pytest.raises(ValueError, match=message):
            run_eval(config)
    assert not (readonly / "runs").exists()
    done = kvlab_cli("eval", "--model", str(tmp_path / "no-model"), "--output-dir", str(a_file))
    assert_one_error(done, "--output-dir")


def test_binary_and_short_texts_are_refused_before_the_model_loads(
    tmp_path, tiny_model_dir, no_model_load
):
    from kvlab.evaluation import run_eval

    nul = tmp_path / "weights.bin"
    nul.write_bytes(b"PK\x03\x04\x00\x00binary")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Élan, naïve café".encode("latin-1"))
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    for text, message in [
        (nul, "not a text file: NUL byte at offset 4"),
        (latin1, "not UTF-8 text: invalid byte at offset 0"),
        (short, "fewer than one window"),
    ]:
        config = EvalConfig(
            model=str(tiny_model_dir),
            text=text,
            methods=["full"],
            device="cpu",
            output_dir=tmp_path / "out",
            progress=False,
        )
        with pytest.raises(ValueError, match=message):
            run_eval(config)
        assert not (tmp_path / "out").exists()  # nothing created
    done = kvlab_cli("eval", "--model", str(tmp_path / "no-model"), "--text", str(nul))
    assert_one_error(done, "is not a text file")


def _relay_eval(model: Path, text: Path, out: Path, *, progress: bool) -> EvalConfig:
    """A one-window prefill-score eval of ``relay:snapkv@0.5`` on the tiny model."""
    return EvalConfig(
        model=str(model),
        text=text,
        methods=["relay:snapkv@0.5"],
        windows=1,
        prefill=192,
        score=3,
        device="cpu",
        output_dir=out,
        progress=progress,
    )


def test_the_table_is_written_before_the_plot(tmp_path, tiny_model_dir, tiny_text, monkeypatch):
    from kvlab.evaluation import plot, run_eval

    def broken(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr(plot, "plot_kl_vs_bytes", broken)
    config = _relay_eval(tiny_model_dir, tiny_text, tmp_path, progress=False)
    with pytest.raises(RuntimeError, match="no display"):
        run_eval(config)
    assert "relay:snapkv@0.5" in (tmp_path / "table-prefill-score.md").read_text()
    assert (tmp_path / "raw-prefill-score-cpu.json").is_file()
    assert validate_artifact(tmp_path / "metrics-prefill-score-cpu.json").ok
    assert len(list((tmp_path / "tasks").glob("*.json"))) == 2
    assert not (tmp_path / "kl-vs-bytes.png").exists()


def test_help_and_version_import_no_heavy_module():
    probe = (
        "import sys\n"
        "from kvlab.cli import app\n"
        "for args in (['--help'], ['eval', '--help'], ['sweep', '--help'], ['--version']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code in (0, None), (args, exit.code)\n"
        "heavy = ('torch', 'transformers', 'matplotlib', 'ray', 'numpy')\n"
        "print('HEAVY', sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout
    assert "sweep" in done.stdout and "--executor" in done.stdout and "needle" in done.stdout
    version = kvlab_cli("--version")
    assert version.returncode == 0 and version.stdout == f"kvlab {kvlab.__version__}\n"


def test_every_command_reports_a_mistake_the_same_way(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvlab.cli import app

    out = ["--output-dir", str(tmp_path / "o")]
    cases = [
        (["eval", "--protocol", "perplexity", *out], "--protocol must be one of"),
        (["eval", "--text", str(tmp_path / "missing.txt"), *out], "text file not found"),
        (["eval", "--text", str(tmp_path), *out], f"text file {quote(tmp_path)} is a folder"),
        (["eval", "--method", "zip-it", *out], "unknown method 'zip-it'"),
        (["eval", "--needle-lengths", "2K,lots", *out], "'lots' is not a number"),
        (["eval", "--executor", "spark", *out], "--executor must be local or ray"),
        (["reproduce", "--paper", "nope"], "known papers: rope-relay, pn-mix"),
        (["reproduce", "--paper", "rope-relay", "--seeds", "4,4"], "repeats a seed"),
        (["sweep", str(tmp_path / "missing.toml")], "sweep file not found"),
    ]
    # an unknown backend in the environment, before any model or diagnostic runs
    bogus = {"KVLAB_PNMIX_BACKEND": "fast"}
    cases += [
        (["eval", "--method", "pn-mix", *out], "KVLAB_PNMIX_BACKEND='fast'", bogus),
        (["reproduce", "--paper", "pn-mix", "--seeds", "42"], "KVLAB_PNMIX_BACKEND='fast'", bogus),
        (["sweep", str(tmp_path / "missing.toml")], "KVLAB_PNMIX_BACKEND='fast'", bogus),
    ]
    relay = {"KVLAB_RELAY_BACKEND": "gpu"}
    cases += [
        (["eval", "--method", "relay:snapkv@0.5", *out], "KVLAB_RELAY_BACKEND='gpu'", relay),
        (
            ["reproduce", "--paper", "rope-relay", "--seeds", "42"],
            "KVLAB_RELAY_BACKEND='gpu'",
            relay,
        ),
        (["sweep", str(tmp_path / "missing.toml")], "KVLAB_RELAY_BACKEND='gpu'", relay),
    ]
    # a backend variable set to "cpu" for a kernel that cannot be compiled: refused up front
    from kvlab.pnmix.kernels import cpu as pnmix_cpu
    from kvlab.relay.kernels import cpu as relay_cpu

    def no_compiler():
        raise RuntimeError("no C++ compiler here")

    for module in (pnmix_cpu, relay_cpu):
        monkeypatch.setattr(module._KERNEL, "state", {})
        monkeypatch.setattr(module, "_compile", no_compiler)
    cases += [
        (["eval", "--method", "relay:snapkv@0.5", *out], "RoPE-Relay CPU kernel is unavailable",
         {"KVLAB_RELAY_BACKEND": "cpu"}),
        (["eval", "--method", "pn-mix", *out], "PN-Mix CPU kernel is unavailable",
         {"KVLAB_PNMIX_BACKEND": "cpu"}),
    ]  # fmt: skip
    runner = CliRunner()
    for args, fragment, *env in cases:
        result = runner.invoke(app, args, env=env[0] if env else None)
        assert result.exit_code == 2, (args, result.output)
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
        assert fragment in lines[0], lines[0]
        assert not isinstance(result.exception, Exception) or isinstance(
            result.exception, SystemExit
        ), result.exception
    # and the same as a process (the missing-model case: test_eval_end_to_end)
    assert_one_error(kvlab_cli("sweep", str(tmp_path / "missing.toml")), "sweep file not found")


def test_validate_accepts_the_reference_records_and_says_what_it_could_not_check():
    record_000 = validate_artifact(SEEDS / "000_8249d5d9ce5c6fb7.txt")
    assert record_000.ok and record_000.kind == "metric artifact v2"
    assert any("no source_sha256" in note for note in record_000.unchecked)
    assert any("no command_argv" in note for note in record_000.unchecked)
    record_004 = validate_artifact(SEEDS / "004_aa707ff1932edf16.txt")
    assert record_004.ok and record_004.kind == "accelerator validation record v1"
    [note] = record_004.unchecked
    assert "4 recorded file(s): none exists" in note and "another source tree" in note
    done = kvlab_cli("validate", *(str(p) for p in sorted(SEEDS.glob("*.txt"))))
    assert done.returncode == 0, done.stdout
    assert done.stdout.count("not checked:") == 3


def test_validate_still_fails_a_tree_that_lost_some_of_its_files(tmp_path):
    record = json.loads((SEEDS / "004_aa707ff1932edf16.txt").read_text())
    present = next(iter(record["executed_source_sha256"]))
    (tmp_path / present).parent.mkdir(parents=True)
    (tmp_path / present).write_text("edited\n")
    report = validate_artifact(SEEDS / "004_aa707ff1932edf16.txt", root=tmp_path)
    assert not report.ok
    assert any("missing from the tree" in p for p in report.problems)
    assert any("sha256" in p and present in p for p in report.problems)


def test_docs_commands_say_where_their_text_comes_from():
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for doc in (results, readme):
        assert "/work/" not in doc
    texts = set(re.findall(r"--text (\S+)", results))
    assert texts == {"hamlet.txt", "devil.dict"}
    assert "gutenberg.org" in results and "c24e002c" in results
    assert "apt-get download dict-devil" in results and "703d1225d2fb9276" in results


def test_fast_subset_leaves_out_real_model_and_end_to_end_jobs():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "not slow",
            str(ROOT / "tests" / "evaluation"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    collected = done.stdout
    assert "test_plan.py" in collected
    for slow in (
        "test_smollm2_loads_offline_and_scores_tokens",
        "test_cli_eval_writes_table_artifact_and_plot",
        "test_ray_and_local_executors_give_identical_results",
        "test_ctrl_c_then_rerun_finishes_only_the_missing_tasks",
    ):
        assert slow not in collected


def test_a_reused_calibration_shows_no_layer_bar(
    tmp_path, tiny_model_dir, tiny_text, monkeypatch, capsys
):
    """The layer bar opens at the calibration's first layer: a computed calibration shows it,
    one read from the cache does not (a newcomer saw "calibrating: 0layer" on a rerun)."""
    from kvlab.evaluation import run_eval

    monkeypatch.setenv("KVLAB_CALIBRATION_CACHE", str(tmp_path / "calibration"))
    for run in ("first", "again"):
        run_eval(_relay_eval(tiny_model_dir, tiny_text, tmp_path / run, progress=True))
        shown = "relay:snapkv@0.5: calibrating" in capsys.readouterr().err
        assert shown == (run == "first"), run
