"""The RoPE-Relay mechanism diagnostic (paper key ``rope-relay``, tier ``l1_mechanism``).

docs/design.md ("RoPE-Relay: Relay") / reference record 000. For each seed a seeded generator
draws raw keys, values and question queries (standard normal × ``amplitude``) and sorted
distinct original positions for the ``slots`` cache slots from a 4,096-token stream; keys are
rotated at those positions; each (layer, kv head) keeps a seeded subset of its retained count;
the relay runs per layer.
Every boolean below is *computed* from tensors, never asserted.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from kvlab.diagnostics.paper import Paper, RunContext, SeedResult
from kvlab.relay.core import relay, relay_attention
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

    slots, dim = cfg["slots"], cfg["key_dimension"]
    endpoint = slots - 1  # docs/design.md, "RoPE-Relay: Relay": positions never exceed slots
    max_error = 0.0
    values_same = tails_same = endpoints_aligned = synchronized = True
    loss = torch.zeros((), device=device)
    unsync_errors = []
    kept_counts = []
    next_positions: set[int] = set()
    for layer in range(cfg["layers"]):
        keys_rotated = apply_rotary(raw_keys[layer], positions, rotary)
        relayed = relay(keys_rotated, values[layer], positions, keep[layer], rotary)
        out = relay_attention(queries[layer], relayed, rotary)  # [1, H, Q, Dv]
        loss = loss + out.pow(2).mean()
        next_positions.add(int(relayed.next_position))
        # Every check below compares the relay's output with a reference built here from
        # the keep mask and docs/design.md ("RoPE-Relay: Relay") alone, never from the relay's
        # own bookkeeping.
        for head in range(cfg["physical_kv_heads"]):
            kept = keep[layer, 0, head].nonzero().squeeze(-1)  # original slots, in order
            count = int(kept.numel())
            kept_counts.append(count)
            new_positions = torch.arange(endpoint - count + 1, endpoint + 1, device=device)
            expected_valid = torch.arange(slots, device=device) >= slots - count
            got_keys = relayed.keys[0, head, slots - count :]
            got_values = relayed.values[0, head]
            endpoints_aligned &= bool(torch.equal(relayed.valid[0, head], expected_valid))
            endpoints_aligned &= bool(
                torch.equal(relayed.positions[0, head, slots - count :], new_positions)
            )
            reference = apply_rotary(raw_keys[layer, 0, head, kept], new_positions, rotary)
            max_error = max(max_error, float((got_keys - reference).detach().abs().max()))
            values_same &= bool(
                torch.equal(got_values[slots - count :], values[layer, 0, head, kept])
            )
            values_same &= bool((got_values[: slots - count] == 0).all())
            tails_same &= bool(torch.equal(got_keys[:, rot:], raw_keys[layer, 0, head, kept, rot:]))
            # Synchronized: the answer equals float64 attention of the questions rotated at
            # endpoint + 1, endpoint + 2, ... over the directly rotated kept keys.
            sync_positions = torch.arange(questions, device=device) + endpoint + 1
            q_sync = apply_rotary(queries[layer, 0, head].double(), sync_positions, rotary)
            logits = q_sync @ reference.double().T / dim**0.5
            expected = torch.softmax(logits, dim=-1) @ values[layer, 0, head, kept].double()
            synchronized &= bool(
                (out[0, head].double() - expected).detach().abs().max() <= SYNC_TOLERANCE
            )
            # Unsynchronized: the questions keep their original-stream positions (after the
            # last original position) against the same relayed keys.
            unsync_positions = torch.arange(questions, device=device) + positions.max() + 1
            q_unsync = apply_rotary(queries[layer, 0, head], unsync_positions, rotary)
            q_synced = apply_rotary(queries[layer, 0, head], sync_positions, rotary)
            diff = (q_unsync - q_synced) @ got_keys.T  # raw logits, before 1/sqrt(d)
            unsync_errors.append(diff.detach().abs().flatten())
    synchronized &= next_positions == {endpoint + 1}
    endpoints_aligned &= kept_counts == list(cfg["retained_counts"])
    endpoints_aligned &= len(set(kept_counts)) > 1
    loss.backward()
    unsync_error = torch.cat(unsync_errors).mean()
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
    implementation_modules=(
        "kvlab.rope",
        "kvlab.rope.config",
        "kvlab.rope.scaling",
        "kvlab.rope.rotation",
        "kvlab.relay.core",
    ),
    runner_modules=("kvlab.diagnostics.rope_relay",),
    configuration=CONFIGURATION,
    run_seed=run_seed,
    dataset=_dataset,
)
