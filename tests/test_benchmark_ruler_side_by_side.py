"""benchmarks/kvpress/ruler_kvpress.py (the kvpress side's pure parts and decode flow, on a tiny
random Qwen2) and benchmarks/kvpress/ruler_side_by_side.py (the paired table and its id checks).
kvpress itself lives in its own venv and is not imported here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


rk = load_benchmark("kvpress/ruler_kvpress")
sbs = load_benchmark("kvpress/ruler_side_by_side")


def _sample(task: str = "niah", index: int = 0, **kw: Any) -> dict[str, Any]:
    s = {
        "task": task,
        "length": 1024,
        "index": index,
        "seed": 0,
        "context": "c",
        "question": "q",
        "context_ids": [1, 2, 3, index],
        "question_ids": [4, 5],
        "outputs": ["Alpha", "beta"],
        "max_new_tokens": 8,
        "metric": "all",
    }
    s.update(kw)
    return s


def _write_jsonl(path: Path, samples: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


# ----------------------------------------------------------------------------- scoring, digests
def test_ruler_score_all_part_case_and_postprocess() -> None:
    assert rk.ruler_score("the ALPHA word", ["alpha", "beta"], "all") == 0.5
    assert rk.ruler_score("the ALPHA word", ["alpha", "beta"], "part") == 1.0
    assert rk.ruler_score("nothing", ["alpha", "beta"], "part") == 0.0
    # RULER's postprocess: control characters become newlines before matching
    assert rk.ruler_score("a\tb", ["a\nb"], "all") == 1.0
    with pytest.raises(ValueError, match="metric"):
        rk.ruler_score("x", ["x"], "any")
    with pytest.raises(ValueError, match="reference"):
        rk.ruler_score("x", [], "all")


def test_samples_digest_is_canonical_json_of_ids_and_outputs() -> None:
    a, b = _sample(index=0), _sample(index=1)
    text = json.dumps(
        [
            [a["context_ids"], a["question_ids"], a["outputs"]],
            [b["context_ids"], [4, 5], b["outputs"]],
        ],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert rk.samples_digest([a, b]) == hashlib.sha256(text.encode()).hexdigest()
    assert rk.sample_ids_sha256(a) == rk.samples_digest([a])
    moved = _sample(context_ids=[1, 2, 3], question_ids=[0, 4, 5])  # same ids, other split
    assert rk.sample_ids_sha256(moved) != rk.sample_ids_sha256(a)


def test_read_samples_refuses_bad_lines(tmp_path: Path) -> None:
    ok = _write_jsonl(tmp_path / "ok.jsonl", [_sample(index=0), _sample(index=1)])
    assert [s["index"] for s in rk.read_samples(ok)] == [0, 1]
    bad = {k: v for k, v in _sample().items() if k != "outputs"}
    cases = {
        "missing": [bad],
        "repeats": [_sample(), _sample()],
        "metric": [_sample(metric="any")],
    }
    for word, rows in cases.items():
        with pytest.raises(SystemExit, match=word):
            rk.read_samples(_write_jsonl(tmp_path / f"{word}.jsonl", rows))


# ----------------------------------------------------------------------------- cache bytes
def test_cache_footprint_counts_storage_once_and_16bit_elements() -> None:
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.randn(1, 2, 6, 8)
    cache.update(k, torch.randn(1, 2, 6, 8), 0)
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 1)
    got = rk.cache_footprint(cache)
    elements = 2 * (2 * 6 * 8) + 2 * (2 * 3 * 8)
    assert got == {
        "cache_bytes": 4 * elements,
        "cache_bytes_16bit": 2 * elements,
        "cache_bytes_16bit_effective": 2 * elements,
        "cache_tokens": [6, 3],
        "masked_entries": [0, 0],
    }
    # entries a press masks (kvpress's masked_key_indices) stay held but are not effective
    attn = [SimpleNamespace(masked_key_indices=None), SimpleNamespace()]
    attn[0].masked_key_indices = (torch.zeros(5, dtype=torch.long),) * 3
    model = SimpleNamespace(
        model=SimpleNamespace(layers=[SimpleNamespace(self_attn=a) for a in attn])
    )
    got = rk.cache_footprint(cache, model)
    assert got["masked_entries"] == [5, 0]
    assert got["cache_bytes"] == 4 * elements
    assert got["cache_bytes_16bit_effective"] == 2 * elements - 5 * 8 * 2 * 2
    # a view into a larger storage holds that whole storage
    cache.layers[1].keys = cache.layers[0].keys[:, :, :3]
    got = rk.cache_footprint(cache)
    assert got["cache_bytes"] == 4 * (2 * 2 * 6 * 8 + 2 * 3 * 8)  # layer 0's keys once


# ----------------------------------------------------------------------------- decode flow
def _tiny_qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def test_kvpress_flow_without_press_is_plain_greedy() -> None:
    model = _tiny_qwen2()
    sample = _sample(context_ids=list(range(3, 40)), question_ids=[7, 9, 11], max_new_tokens=10)
    ids, footprint, _, _ = rk.run_one(model, sample, None, None, stops=[])
    assert len(ids) == 10
    assert ids == rk.greedy_reference(model, sample, stops=[])
    assert footprint["cache_tokens"] == [37, 37]  # the context only, before the question

    def cut_at(stop: int) -> list[int]:
        # kvpress keeps the stop token and never checks the first generated one
        j = next((i for i in range(1, len(ids)) if ids[i] == stop), len(ids) - 1)
        return ids[: j + 1]

    for stop in (ids[0], ids[4]):
        cut, _, _, _ = rk.run_one(model, sample, None, None, stops=[stop])
        assert cut == cut_at(stop)


def test_plan_jobs_groups_kvzip_ratios_per_sample_after_the_rest() -> None:
    kv5, kv75 = ("kvpress:kvzip", "kvzip", 0.5, None), ("kvpress:kvzip", "kvzip", 0.75, None)
    snap = ("kvpress:snapkv", "snapkv", 0.5, None)
    full = ("full", None, 0.0, None)
    methods = [full, kv5, snap, kv75]
    s0, s1 = _sample(index=0), _sample(index=1)
    done = {("kvpress:kvzip", 0.5, "niah", 1024, 1), ("full", 0.0, "niah", 1024, 0)}

    def named(jobs: list[Any]) -> list[tuple[list[float], int]]:
        return [([m[2] for m in group], s["index"]) for group, s in jobs]

    shared = rk.plan_jobs(methods, [s0, s1], done, share_kvzip=True)
    assert [[m[0] for m in g] for g, _ in shared] == [
        ["full"], ["kvpress:snapkv"], ["kvpress:snapkv"], ["kvpress:kvzip"] * 2, ["kvpress:kvzip"]
    ]  # fmt: skip
    # every not-done (method, sample) exactly once; KVzip ratios of one sample in one job, last
    assert named(shared) == [([0.0], 1), ([0.5], 0), ([0.5], 1), ([0.5, 0.75], 0), ([0.75], 1)]
    alone = rk.plan_jobs(methods, [s0, s1], done, share_kvzip=False)
    assert all(len(group) == 1 for group, _ in alone)
    pairs = sorted((m, s["index"]) for g, s in alone for m in g)
    assert pairs == sorted((m, s["index"]) for g, s in shared for m in g)
    assert rk.plan_jobs(methods, [s0, s1], {
        (m[0], m[2], "niah", 1024, i) for m in methods for i in (0, 1)
    }, share_kvzip=True) == []  # fmt: skip


# ----------------------------------------------------------------------------- merge
def _kvpress_json(
    path: Path, samples: list[dict[str, Any]], scores: dict[str, list[float]]
) -> Path:
    rows = []
    for method, per in scores.items():
        name, _, ratio = method.partition("@")
        for s, score in zip(samples, per, strict=True):
            rows.append({
                "method": name, "ratio": float(ratio or 0), "task": s["task"],
                "length": s["length"], "index": s["index"], "score": score,
                "prediction": "alpha beta" if score else "none",
                "ids_sha256": rk.sample_ids_sha256(s),
                "cache_bytes_16bit": 100 if name == "full" else 50,
            })  # fmt: skip
    path.write_text(json.dumps({"provenance": {}, "rows": rows}))
    return path


def test_merge_pairs_on_shared_samples_and_checks_ids(tmp_path: Path, capsys: Any) -> None:
    samples = [_sample("niah", 0), _sample("niah", 1), _sample("vt", 0, metric="part")]
    spath = _write_jsonl(tmp_path / "s.jsonl", samples)
    kp = _kvpress_json(
        tmp_path / "kp.json", samples,
        {"full": [1, 1, 1], "kvpress:snapkv@0.5": [1, 0, 1]},
    )  # fmt: skip
    # kvlab rows: no per-row digest, a file digest over the samples they name; lacks vt/0
    kvlab_rows = [
        {"task": "niah", "length": 1024, "index": i, "method": "relay:snapkv", "ratio": 0.5,
         "prediction": "alpha beta" if i == 0 else "no"}
        for i in (0, 1)
    ]  # fmt: skip
    kl = tmp_path / "kl.json"
    kl.write_text(
        json.dumps({"samples_digest": rk.samples_digest(samples[:2]), "rows": kvlab_rows})
    )
    sbs.main(["--samples", str(spath), "--kvpress", str(kp), "--kvlab", str(kl),
              "--json", str(tmp_path / "t.json")])  # fmt: skip
    table = json.loads((tmp_path / "t.json").read_text())
    assert table["paired_samples"] == 2 and table["tasks"] == ["niah"]
    rows = table["rows"]
    assert rows["kvpress:full"]["mean"] == 100.0
    assert rows["kvpress:snapkv@0.5"]["mean"] == 50.0
    assert rows["kvlab:relay:snapkv@0.5"]["per_task"] == {"niah": 50.0}  # scored here
    assert rows["kvpress:snapkv@0.5"]["kv_over_full"] == 0.5
    assert "paired samples (held by every method): 2" in capsys.readouterr().out

    # --diff: A − B on the paired samples, the interval from kvlab's paired bootstrap
    sbs.main(["--samples", str(spath), "--kvpress", str(kp), "--kvlab", str(kl),
              "--diff", "kvlab:relay:snapkv@0.5", "kvpress:full",
              "--json", str(tmp_path / "t.json")])  # fmt: skip
    (diff,) = json.loads((tmp_path / "t.json").read_text())["differences"]
    assert (diff["a"], diff["b"]) == ("kvlab:relay:snapkv@0.5", "kvpress:full")
    assert diff["delta"] == -50.0
    assert diff["low"] == -100.0 and diff["high"] == 0.0  # resamples of the two differences 0, -1
    # kvpress's full answered "alpha beta" on both samples, kvlab's row on sample 0 only
    assert diff["same_prediction"] == 1
    assert (
        "kvlab:relay:snapkv@0.5 − kvpress:full: -50.0 [-100.0, +0.0]; "
        "the same answer text on 1 of 2 samples"
    ) in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"no row 'kvpress:tova@0\.5'"):
        sbs.main(["--samples", str(spath), "--kvpress", str(kp), "--diff", "kvpress:tova@0.5",
                  "kvpress:full"])  # fmt: skip

    # other ids on either side are refused
    kl.write_text(
        json.dumps({"samples_digest": rk.samples_digest(samples[1:]), "rows": kvlab_rows})
    )
    with pytest.raises(SystemExit, match="samples_digest differs"):
        sbs.main(["--samples", str(spath), "--kvpress", str(kp), "--kvlab", str(kl)])
    data = json.loads(kp.read_text())
    data["rows"][0]["ids_sha256"] = "0" * 64
    kp.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="other token ids"):
        sbs.main(["--samples", str(spath), "--kvpress", str(kp)])


def test_kvlab_rows_alone_and_a_method_from_two_runs(tmp_path: Path, capsys: Any) -> None:
    """Without --kvpress the table pairs kvlab's rows alone; ``full`` from two runs is merged
    where they agree and refused where they do not."""
    samples = [_sample("niah", 0), _sample("niah", 1)]
    spath = _write_jsonl(tmp_path / "s.jsonl", samples)

    def rows(method: str, predictions: list[str]) -> list[dict[str, Any]]:
        return [
            {"task": "niah", "length": 1024, "index": i, "method": method, "prediction": p,
             "ids_sha256": rk.sample_ids_sha256(samples[i])}
            for i, p in enumerate(predictions)
        ]  # fmt: skip

    run_a = tmp_path / "a.json"
    run_a.write_text(json.dumps(rows("full", ["alpha beta", "alpha"]) + rows("pn-mix", ["x", "y"])))
    run_b = tmp_path / "b.json"
    run_b.write_text(json.dumps(rows("full", ["alpha beta", "alpha"]) + rows("kvzip", ["a", "b"])))
    out = tmp_path / "t.json"
    sbs.main(["--samples", str(spath), "--kvlab", str(run_a), "--kvlab", str(run_b),
              "--json", str(out)])  # fmt: skip
    table = json.loads(out.read_text())
    assert table["paired_samples"] == 2
    assert set(table["rows"]) == {"kvlab:full", "kvlab:pn-mix", "kvlab:kvzip"}
    assert table["rows"]["kvlab:full"]["mean"] == 75.0
    plot = tmp_path / "frontier.png"
    sbs.main(["--samples", str(spath), "--kvlab", str(run_a), "--kvlab", str(run_b),
              "--plot", str(plot)])  # fmt: skip
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # rows without bytes: no points
    drawn = sbs.plot_frontier(
        {"rows": {"kvlab:full": {"mean": 75.0, "kv_over_full": 1.0},
                  "kvlab:pn-mix": {"mean": 70.0, "kv_over_full": 0.2},
                  "kvpress:kvzip@0.5": {"mean": 72.0, "kv_over_full": 0.5}}},
        tmp_path / "sub" / "f.png", "t",
    )  # fmt: skip
    assert drawn.read_bytes()[:4] == b"\x89PNG"
    run_b.write_text(json.dumps(rows("full", ["alpha beta", "beta"]) + rows("kvzip", ["a", "b"])))
    with pytest.raises(SystemExit, match="differs from another file"):
        sbs.main(["--samples", str(spath), "--kvlab", str(run_a), "--kvlab", str(run_b)])
    with pytest.raises(SystemExit, match="give --kvpress"):
        sbs.main(["--samples", str(spath)])
