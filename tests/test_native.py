"""kvlab.native's build lock: an interrupted build's torch lock never hangs a later build."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvlab import native

NAME = "kvlab_lock_probe_0000000000000000"


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def _folder(root: Path) -> Path:
    return root / NAME


def test_a_stale_torch_lock_is_removed_under_kvlabs_lock(extensions, caplog) -> None:
    _folder(extensions).mkdir(parents=True)
    (_folder(extensions) / "lock").write_bytes(b"")  # what a killed load_inline leaves
    with caplog.at_level(logging.WARNING, logger="kvlab"), native.build_lock(NAME):
        assert not (_folder(extensions) / "lock").exists()
    assert "interrupted build" in caplog.text and NAME in caplog.text
    assert (_folder(extensions) / "kvlab.flock").is_file()


def test_nothing_to_clear_logs_nothing(extensions, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvlab"), native.build_lock(NAME):
        pass
    assert caplog.text == ""


def test_a_killed_holder_releases_the_lock(extensions) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom kvlab.native import build_lock\n"
            f"with build_lock({NAME!r}):\n    print('held', flush=True)\n    time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def take() -> None:
            with native.build_lock(NAME):
                entered.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        assert not entered.wait(0.5)  # held by the other process
        holder.kill()  # SIGKILL: no cleanup runs in the holder
        holder.wait()
        assert entered.wait(30)
    finally:
        holder.kill()


@pytest.mark.slow  # compiles a one-function C++ module (~20 s of CPU)
def test_compile_module_succeeds_after_an_interrupted_build(extensions) -> None:
    source = "int64_t kvlab_probe(int64_t x) { return x + 1; }"
    name = native.module_name("kvlab_probe", source, native.FLAGS)
    del name  # the folder is the one compile_module picks: make every candidate's lock stale
    for openmp in (["-fopenmp"], []):
        hashed = "\0".join(
            [source, *native.header_sources(), str(native.INCLUDE_DIR)]  # as compile_module
        )
        folder = extensions / native.module_name("kvlab_probe", hashed, [*native.FLAGS, *openmp])
        folder.mkdir(parents=True)
        (folder / "lock").write_bytes(b"")
    done: dict[str, object] = {}

    def build() -> None:
        done["module"] = native.compile_module("kvlab_probe", source, ["kvlab_probe"], "probe")

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(600)
    assert not thread.is_alive(), "the build waited on the stale lock"
    assert done["module"].kvlab_probe(41) == 42
