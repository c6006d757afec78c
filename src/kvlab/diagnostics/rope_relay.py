"""The RoPE-Relay mechanism diagnostic (paper key ``rope-relay``, tier ``l1_mechanism``).

SPEC §2 / reference record 000. For each seed a seeded generator draws raw keys, values and
question queries (standard normal × ``amplitude``) and sorted distinct original positions
for the ``slots`` cache slots from a 4,096-token stream; keys are rotated at those positions;
each (layer, kv head) keeps a seeded subset of its retained count; the relay runs per layer.
Every boolean below is *computed* from tensors, never asserted.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from kvlab.diagnostics.paper import Paper, RunContext, SeedResult
from kvlab.relay import relay, relay_attention, relay_logits
from kvlab.rope import RotaryConfig, apply_rotary

__all__ = ["CONFIGURATION", "PAPER", "run_seed"]

CONFIGURATION: dict[str, Any] = {
    "layers": 2,
    "physical_kv_heads": 2,
    "slots": 8,
    "retained_counts": [8, 6, 4, 2],
    "key_dimension": 12,
    "rotary_dimension": 8,
    "amplitude": 1.3,
    "question_length": 3,
}
STREAM_TOKENS = 4096
"""Length of the original token stream the slot positions are drawn from (tokens)."""
SYNC_TOLERANCE = 1e-5
"""Max abs difference allowed between relay attention and the direct-rotation reference."""


def _draw(seed: int) -> dict[str, torch.Tensor]:
    """The seed's raw inputs, drawn on the CPU in float32 in a fixed order."""
    cfg = CONFIGURATION
    layers, heads, slots = cfg["layers"], cfg["physical_kv_heads"], cfg["slots"]
    dim, amp, questions = cfg["key_dimension"], cfg["amplitude"], cfg["question_length"]
    gen = torch.Generator().manual_seed(seed)
    raw_keys = torch.randn(layers, 1, heads, slots, dim, generator=gen) * amp
    values = torch.randn(layers, 1, heads, slots, dim, generator=gen) * amp
    queries = torch.randn(layers, 1, heads, questions, dim, generator=gen) * amp
    positions = torch.randperm(STREAM_TOKENS, generator=gen)[:slots].sort().values
    keep = torch.zeros(layers, 1, heads, slots, dtype=torch.bool)
    for index, count in enumerate(cfg["retained_counts"]):
        layer, head = divmod(index, heads)
        keep[layer, 0, head, torch.randperm(slots, generator=gen)[:count]] = True
    return {
        "raw_keys": raw_keys,
        "values": values,
        "queries": queries,
        "positions": positions,
        "keep": keep,
    }


def _fingerprint(inputs: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(inputs):
        digest.update(name.encode())
        digest.update(inputs[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_seed(context: RunContext, seed: int) -> SeedResult:
    """Run the diagnostic for one seed (see module docstring); metrics in artifact order."""
    cfg = CONFIGURATION
    device = context.device
    rotary = RotaryConfig(head_dim=cfg["key_dimension"], rotary_dim=cfg["rotary_dimension"])
    inputs = _draw(seed)
    fingerprint = _fingerprint(inputs)
    raw_keys = inputs["raw_keys"].to(device).requires_grad_(True)
    values = inputs["values"].to(device).requires_grad_(True)
    queries = inputs["queries"].to(device).requires_grad_(True)
    positions = inputs["positions"].to(device)
    keep = inputs["keep"].to(device)
    rot = cfg["rotary_dimension"]
    questions = cfg["question_length"]

    max_error = 0.0
    values_same = tails_same = endpoints_aligned = synchronized = True
    next_positions: set[int] = set()
    loss = torch.zeros((), device=device)
    unsync_errors = []
    kept_counts = []
    for layer in range(cfg["layers"]):
        keys_rotated = apply_rotary(raw_keys[layer], positions, rotary)
        relayed = relay(keys_rotated, values[layer], positions, keep[layer], rotary)
        valid = relayed.valid
        kept_counts.extend(relayed.kept_counts.flatten().tolist())
        # Reference: the raw keys rotated directly at the new positions.
        source = relayed.source_index.clamp(min=0)
        gathered_raw = torch.gather(
            raw_keys[layer], 2, source.unsqueeze(-1).expand(-1, -1, -1, cfg["key_dimension"])
        )
        reference = apply_rotary(gathered_raw, relayed.positions.clamp(min=0), rotary)
        error = (relayed.keys - reference).abs()[valid]
        max_error = max(max_error, float(error.detach().max()))
        gathered_values = torch.gather(
            values[layer], 2, source.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1])
        )
        values_same &= bool(torch.equal(relayed.values[valid], gathered_values[valid]))
        gathered_rotated = torch.gather(
            keys_rotated, 2, source.unsqueeze(-1).expand(-1, -1, -1, cfg["key_dimension"])
        )
        tails_same &= bool(
            torch.equal(relayed.keys[..., rot:][valid], gathered_rotated[..., rot:][valid])
        )
        # Every head's kept tokens end at the shared endpoint, contiguously.
        endpoint = relayed.next_position - 1
        counts = relayed.kept_counts
        last_slot_pos = relayed.positions[..., -1]
        first_pos = torch.where(valid, relayed.positions, torch.iinfo(torch.int64).max).amin(-1)
        endpoints_aligned &= bool((last_slot_pos == endpoint).all())
        endpoints_aligned &= bool((first_pos == endpoint - counts + 1).all())
        next_positions.add(int(relayed.next_position))
        # Synchronized question positions: relay attention equals the direct reference with
        # queries rotated at next_position, next_position + 1, ...
        sync_positions = torch.arange(questions, device=device) + relayed.next_position
        out = relay_attention(queries[layer], relayed, rotary)
        sync_raw = relay_logits(queries[layer], relayed, rotary, query_positions=sync_positions)
        logits = (sync_raw / cfg["key_dimension"] ** 0.5).masked_fill(
            ~valid.unsqueeze(-2), float("-inf")
        )
        expected = torch.softmax(logits, dim=-1) @ relayed.values.float()
        synchronized &= bool((out.float() - expected).abs().max() <= SYNC_TOLERANCE)
        loss = loss + out.pow(2).mean()
        # Unsynchronized: the questions keep their original-stream positions.
        unsync_positions = torch.arange(questions, device=device) + positions.max() + 1
        unsync = relay_logits(queries[layer], relayed, rotary, query_positions=unsync_positions)
        diff = (unsync - sync_raw).abs()
        unsync_errors.append(diff.masked_select(valid.unsqueeze(-2).expand_as(diff)))
    synchronized &= len(next_positions) == 1
    endpoints_aligned &= len(set(kept_counts)) > 1
    loss.backward()
    unsync_error = torch.cat(unsync_errors).detach().mean()
    metrics: dict[str, Any] = {
        "max_reference_absolute_error": max_error,
        "values_unchanged": values_same,
        "nonrotary_tail_unchanged": tails_same,
        "heterogeneous_endpoints_aligned": endpoints_aligned,
        "query_and_answer_positions_synchronized": synchronized,
        "gradient_norm_keys": float(raw_keys.grad.norm()),
        "gradient_norm_values": float(values.grad.norm()),
        "gradient_norm_queries": float(queries.grad.norm()),
        "unsynchronized_query_mean_logit_error": float(unsync_error),
    }
    details = {"kept_counts": kept_counts, "next_positions": sorted(next_positions)}
    return SeedResult(metrics=metrics, data_sha256=fingerprint, details=details)


def _dataset(context: RunContext, results: list[SeedResult]) -> tuple[dict[str, Any], str]:
    joined = "".join(r.data_sha256 for r in results).encode()
    dataset = {
        "id": "synthetic-formula-tensors",
        "revision": "kvlab-rope-relay-generator-v1",
        "checkpoint": None,
        "capability_benchmark": False,
    }
    return dataset, hashlib.sha256(joined).hexdigest()


PAPER = Paper(
    key="rope-relay",
    title="RoPE-Relay: heterogeneous per-head eviction + relay of rotated keys (L1 mechanism)",
    manifest_ref="foundation-models:rope-relay",
    tier="l1_mechanism",
    claim_policy=(
        "synthetic fixed-cache phase/attention/gradient diagnostics; "
        "no model capability or service overhead evidence"
    ),
    implementation_status="component_only",
    diagnostic_only=True,
    implementation_modules=("kvlab.rope", "kvlab.relay"),
    runner_modules=(
        "kvlab.diagnostics.rope_relay",
        "kvlab.diagnostics.runner",
        "kvlab.diagnostics.paper",
        "kvlab.cli",
    ),
    configuration=CONFIGURATION,
    run_seed=run_seed,
    dataset=_dataset,
)
