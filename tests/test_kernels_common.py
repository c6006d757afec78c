"""The C++ headers shared by both CPU kernels (kvlab.kernels_common): what the kernels
include is there, and it is part of what the evaluation's keys hash (docs/design.md,
"Kernels")."""

from __future__ import annotations

import re
from importlib import resources

from kvlab import kernels_common
from kvlab.evaluation.fingerprint import module_file
from kvlab.evaluation.methods import PREPARATIONS
from kvlab.evaluation.plan import RESULT_MODULES

KERNELS = {
    "kvlab.pnmix.kernels": ("cpu_kernel.cpp", "cpu_flush.cpp"),
    "kvlab.relay.kernels": ("cpu_decode.cpp",),
}


def test_the_kernels_include_only_shipped_headers():
    included = set()
    for package, names in KERNELS.items():
        for name in names:
            text = resources.files(package).joinpath(name).read_text("utf-8")
            included |= set(re.findall(r'^#include "([^"]+)"', text, flags=re.M))
    assert included == set(kernels_common.HEADERS)
    for header, text in zip(kernels_common.HEADERS, kernels_common.header_sources(), strict=True):
        assert (kernels_common.INCLUDE_DIR / header).is_file() and "#pragma once" in text


def test_the_shared_headers_are_hashed_with_the_kernels():
    # code_digest hashes the *.cpp and *.h beside each listed module
    assert module_file("kvlab.kernels_common").parent == kernels_common.INCLUDE_DIR
    assert "kvlab.kernels_common" in RESULT_MODULES
    relay = [p for p in PREPARATIONS.values() if "kvlab.relay.kernels.cpu" in p.modules]
    assert relay and all("kvlab.kernels_common" in p.modules for p in relay)


def test_code_digest_follows_a_header_beside_a_module(tmp_path, monkeypatch):
    from kvlab.evaluation import fingerprint

    (tmp_path / "kvlab_probe_headers.py").write_text("x = 1\n")
    header = tmp_path / "probe.h"
    header.write_text("#pragma once\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(fingerprint, "_DIGESTS", {})
    first = fingerprint.code_digest(["kvlab_probe_headers"])
    fingerprint._DIGESTS.clear()
    header.write_text("#pragma once\ninline int f() { return 2; }\n")
    assert fingerprint.code_digest(["kvlab_probe_headers"]) != first
