"""How far a recording PN-Mix cache's multi-token forward is from one-token forwards, through a
model (docs/design.md, "Cache life cycle": crop).

The inputs of ``tests/integrations/test_speculative.py::
test_multi_token_forward_logits_equal_one_token_steps``: the tiny random Llama of the model
matrix (seed 7), 2 sinks, a 4-token residual, 4-token groups, a 30-token prefill then 10 tokens
in one forward. Prints the max absolute logit difference from the 10 one-token forwards for the
recording cache, for the plain multi-token path (store, then attend) and for ``DynamicCache``
with the model's own attention.

    PYTHONPATH=src:tests/fixtures OMP_NUM_THREADS=1 python experiments/speculative_logits.py
"""

from __future__ import annotations

from typing import Any

import torch
from tiny_models import FAMILIES  # tests/fixtures on PYTHONPATH
from transformers import DynamicCache

from kvlab.integrations import PNMixModelCache, enable_kvlab_attention
from kvlab.pnmix import PNMixConfig

SMALL = PNMixConfig(sink_tokens=2, residual_tokens=4, group_tokens=4)
PROMPT, TOTAL = 30, 40


def _steps(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    out = [model(ids[:, :PROMPT], cache=cache).logits]
    out += [model(ids[:, j : j + 1], cache=cache).logits for j in range(PROMPT, TOTAL)]
    return torch.cat(out, 1)


def _two(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    first = model(ids[:, :PROMPT], cache=cache).logits
    return torch.cat([first, model(ids[:, PROMPT:], cache=cache).logits], 1)


def main() -> None:
    model = FAMILIES["llama"].build(seed=7)
    ids = torch.randint(3, 96, (1, TOTAL), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = (
            (
                _two(model, ids, DynamicCache(config=model.config))
                - _steps(model, ids, DynamicCache(config=model.config))
            )
            .abs()
            .max()
        )
        enable_kvlab_attention(model)
        want = _steps(model, ids, PNMixModelCache(model.config, SMALL))
        rec = PNMixModelCache(model.config, SMALL)
        rec.activate_past_recording()
        rec.expect_prompt(PROMPT)
        recorded = (_two(model, ids, rec) - want).abs().max()
        plain = (_two(model, ids, PNMixModelCache(model.config, SMALL)) - want).abs().max()
    print(f"recording PN-Mix cache: {float(recorded):.2e}")
    print(f"plain multi-token path: {float(plain):.2e}")
    print(f"DynamicCache:           {float(dense):.2e}")


if __name__ == "__main__":
    main()
