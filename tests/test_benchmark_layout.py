"""The benchmarks/ and experiments/ layout: every maintained benchmark states its command and is
documented, no benchmark imports a private kvlab name (but the ones waiting for a public name),
and nothing in src/ or tests/ imports an archived probe of experiments/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
EXPERIMENTS = ROOT / "experiments"

#: Private kvlab names a maintained benchmark still imports, each until the module offers a
#: public name for it (benchmarks/ may add no others).
PENDING_PUBLIC: set[tuple[str, str]] = set()


def _scripts() -> list[Path]:
    return sorted(BENCHMARKS.rglob("*.py"))


def _imports(tree: ast.AST) -> list[str]:
    """Dotted names a module imports (``from a.b import c`` gives ``a.b.c``)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_every_benchmark_states_its_command_and_is_documented() -> None:
    docs = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    harness = (BENCHMARKS / "kvpress" / "README.md").read_text(encoding="utf-8")
    scripts = _scripts()
    assert len(scripts) >= 20
    for path in scripts:
        rel = path.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert f"python {rel}" in doc, f"{rel}: no command in its docstring"
        if path.parent == BENCHMARKS:
            assert f"`{rel}`" in docs, f"{rel} is not in docs/benchmarks.md"
        else:
            assert f"`{path.name}`" in harness, f"{rel} is not in benchmarks/kvpress/README.md"
    assert "`benchmarks/gpu_session.sh`" in docs
    for script in ("splitk_decode.py", "decode_bytes.py", "pnmix_cpu_cuda_agreement.py"):
        assert f"benchmarks/{script}" in (BENCHMARKS / "gpu_session.sh").read_text()


def test_benchmarks_import_no_private_kvlab_name() -> None:
    found = set()
    for path in _scripts():
        for name in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            parts = name.split(".")
            if parts[0] == "kvlab" and any(p.startswith("_") for p in parts):
                found.add((path.name, name))
    assert found <= PENDING_PUBLIC, sorted(found - PENDING_PUBLIC)


def test_nothing_in_src_or_tests_imports_an_experiment() -> None:
    probes = {path.stem for path in EXPERIMENTS.glob("*.py")}
    assert {"pnmix_sim", "speculative_logits", "try_bfloat16_tail"} <= probes
    offenders = []
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(name.split(".")[0] in probes | {"experiments"} for name in _imports(tree)):
            offenders.append(path.relative_to(ROOT).as_posix())
    assert offenders == []
