"""Research harness for issue 8: simulated PN-Mix caches with pluggable key/value codings.

Not part of the package: benchmark/research code that the scripts ``pnmix_key_codings.py`` and
``pnmix_explore.py`` import. It answers "what KL/ΔPPL would a PN-Mix cache with coding X get
under ``kvlab eval --protocol prefill-score``?" in seconds instead of minutes.

**Simulated quantization, all scored tokens in one forward.** The prefill-score protocol
(``kvlab.evaluation.protocols.score_window``) prefills ``P`` tokens and then feeds one token at
a time. In a PN-Mix cache which key ``i`` a query at position ``t`` sees depends only on the
cache length ``t + 1`` (the flush rule: ``sink_tokens`` exact sinks, groups of
``group_tokens`` flushed once the residual exceeds ``residual_tokens + group_tokens``; which
tokens form a group depends on the total length only), and a flushed group's codes never
change. So the sequential protocol equals ONE forward over the window's first ``P + S - 1``
tokens in which each query ``t`` attends, per key ``i``:

* ``t < P`` (the prefill forward): the exact float32 keys/values (``exact_prefill``);
* ``t >= P``: ``i`` in a group flushed at length ``t + 1`` → the group's decoded key/value
  (quantize → dequantize, float32); otherwise the float16-rounded exact key/value (sinks and
  residual are stored in the storage dtype).

:class:`SimCache` implements this as a ``transformers`` cache whose layers hand a view to the
``"kvlab"`` attention; attention is plain masked softmax over dequantized float keys.
``pnmix_explore.py check`` verifies it against the real ``PNMixModelCache`` run one token at a
time.

Codings are :class:`LayerPlan` objects: a group size and a key / value *codec* per layer, where a
codec maps a group's storage-rounded keys ``[B, H_kv, T, D]`` (with their positions) to the
decoded float32 keys and reports its stored bytes exactly.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.evaluation.harness import window_starts
from kvlab.integrations.attention import CacheView, dense_causal_attention, use_attention
from kvlab.rope import RotaryConfig

STORAGE = torch.float16
SINKS = 32
RESIDUAL = 32
BITS = 2

# ----------------------------------------------------------------------------- data / model


def load(spec: str = "smollm2-135m") -> tuple[Any, Any]:
    """``(model, tokenizer)`` loaded offline by :func:`kvlab.models.load_model`."""
    from kvlab.models import load_model

    loaded = load_model(spec)
    return loaded.model, loaded.tokenizer


def text_ids(tokenizer: Any, path: str | None) -> Tensor:
    """Token ids of a text file (``None``: the package's King James text), tokenized as
    ``kvlab eval`` does (``add_special_tokens=False``): int64 ``[N]``."""
    from kvlab.data import load_text

    data = load_text(path).data.decode("utf-8", errors="replace")
    ids = tokenizer(data, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def eval_windows(ids: Tensor, prefill: int, score: int, windows: int) -> list[Tensor]:
    """The windows ``kvlab eval --protocol prefill-score`` scores (same starts)."""
    length = prefill + score
    return [ids[s : s + length] for s in window_starts(ids.numel(), length, windows)]


def rotary_of(model: Any) -> RotaryConfig:
    return RotaryConfig.from_hf_config(model.config.get_text_config(decoder=True))


# ----------------------------------------------------------------------------- capture


class _CaptureView(CacheView):
    def __init__(self, sink: list, layer_idx: int, keys: Tensor, values: Tensor) -> None:
        self.sink, self.layer_idx, self.keys, self.values = sink, layer_idx, keys, values

    def attend(self, module, query, *, scaling, attention_mask, kwargs):
        self.sink.append((self.layer_idx, query.detach(), self.keys, self.values))
        return dense_causal_attention(query, self.keys, self.values, scaling=scaling)


class _CaptureLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, sink: list, layer_idx: int) -> None:
        super().__init__()
        self.sink, self.layer_idx = sink, layer_idx

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        view = _CaptureView(self.sink, self.layer_idx, key_states, value_states)
        self.n = key_states.shape[2]
        return view, view

    def get_seq_length(self) -> int:
        return getattr(self, "n", 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


@torch.no_grad()
def capture_qkv(model: Any, ids: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """One exact forward of ``ids [N]``; per layer the rotated queries ``[1, H_q, N, D]``,
    rotated keys ``[1, H_kv, N, D]`` and values ``[1, H_kv, N, Dv]`` (float32)."""
    n_layers = model.config.num_hidden_layers
    sink: list = []
    cache = Cache(layers=[_CaptureLayer(sink, i) for i in range(n_layers)])
    with use_attention(model, "kvlab"):
        model(ids.view(1, -1), cache=cache, use_cache=True, logits_to_keep=1)
    sink.sort(key=lambda x: x[0])
    return [(q, k, v) for _, q, k, v in sink]


# ----------------------------------------------------------------------------- flush rule


def flushed_groups(length: int, group_tokens: int) -> int:
    """Groups a PN-Mix layer holds at ``length`` tokens (sinks 32, residual 32)."""
    rest = length - SINKS
    if rest < RESIDUAL:
        return 0
    return (rest - RESIDUAL) // group_tokens


def round16(x: Tensor) -> Tensor:
    """Round to the float16 storage dtype, returned as float32."""
    return x.to(STORAGE).float()


# ----------------------------------------------------------------------------- codecs


@dataclass
class LayerContext:
    """What a codec may know about its layer: index, RoPE, and prefill statistics filled by
    :class:`SimCache` from the prefill (``query_cov``: per kv head the second moment of the
    rotated prefill queries of its GQA group, float64 ``[H_kv, D, D]``; ``prefill_keys``: the
    storage-rounded keys of the groups flushed at prefill ``[1, H_kv, T, D]`` and their
    positions)."""

    layer_idx: int
    rotary: RotaryConfig
    query_cov: Tensor | None = None
    query_cov_pre: Tensor | None = None
    prefill_keys: Tensor | None = None
    prefill_positions: Tensor | None = None
    state: dict = field(default_factory=dict)


class Codec:
    """A key or value coding of one group: ``decode(x, positions, ctx)`` → float32 decoded group
    (``x``: storage-rounded float32 ``[B, H_kv, T, D]``); ``group_bytes(T, H_kv, D)``: exact
    stored bytes of one group; ``layer_bytes(H_kv, D)``: per-layer side data (masks,
    codebooks); ``prepare(ctx)``: one-time prefill work (masks from prefill statistics)."""

    name = "codec"

    def prepare(self, ctx: LayerContext) -> None:
        return None

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        raise NotImplementedError

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        raise NotImplementedError

    def layer_bytes(self, heads: int, dim: int) -> int:
        return 0


def codes_bytes(tokens: int, heads: int, dim: int, bits: int = BITS) -> int:
    """Packed code bytes of one group (per kv head the ``T * D`` codes are packed)."""
    return heads * math.ceil(tokens * dim * bits / 8)


@dataclass
class LayerPlan:
    """One layer's coding: ``group_tokens`` and the key and value codecs."""

    group_tokens: int
    key: Codec
    value: Codec


def plan_bytes(plans: Sequence[LayerPlan], length: int, heads: int, dim: int) -> int:
    """Exact stored bytes of a whole simulated cache at ``length`` tokens, every float stored
    in 2 bytes (so this is also the 16-bit-normalized size)."""
    total = 0
    for p in plans:
        g = p.group_tokens
        n_groups = flushed_groups(length, g)
        exact = length - n_groups * g
        total += exact * heads * 2 * dim * 2  # sinks + residual, keys and values, float16
        total += n_groups * (p.key.group_bytes(g, heads, dim) + p.value.group_bytes(g, heads, dim))
        total += p.key.layer_bytes(heads, dim) + p.value.layer_bytes(heads, dim)
    return total


# ----------------------------------------------------------------------------- simulated cache


class _SimView(CacheView):
    def __init__(self, layer: _SimLayer, keys: Tensor, values: Tensor) -> None:
        self.layer, self.keys, self.values = layer, keys, values

    def attend(self, module, query, *, scaling, attention_mask, kwargs):
        return self.layer.attend(query, self.keys, self.values, scaling)


class _SimLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SimCache, idx: int) -> None:
        super().__init__()
        self.owner, self.idx = owner, idx

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.n = key_states.shape[2]
        view = _SimView(self, key_states, value_states)
        return view, view

    def get_seq_length(self) -> int:
        return getattr(self, "n", 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scaling: float) -> Tensor:
        return self.owner.attend_layer(self.idx, q, k, v, scaling)


class SimCache(Cache):
    """A one-forward simulated PN-Mix cache (module docstring).

    Args:
        plans: one :class:`LayerPlan` per decoder layer.
        rotary: the model's RoPE.
        prefill: ``P``; the forward's first ``P`` queries attend exactly.
        key_only / value_only: quantize only keys (values exact, float16) or only values.
    """

    def __init__(
        self,
        plans: Sequence[LayerPlan],
        rotary: RotaryConfig,
        prefill: int,
        *,
        quantize_keys: bool = True,
        quantize_values: bool = True,
    ) -> None:
        self.plans = list(plans)
        self.rotary = rotary
        self.prefill = prefill
        self.quantize_keys = quantize_keys
        self.quantize_values = quantize_values
        self.contexts: list[LayerContext] = []
        self.decoded: dict[int, tuple[Tensor, Tensor]] = {}
        super().__init__(layers=[_SimLayer(self, i) for i in range(len(plans))])

    def attend_layer(self, idx: int, q: Tensor, k: Tensor, v: Tensor, scaling: float) -> Tensor:
        plan = self.plans[idx]
        b, hq, n, d = q.shape
        hkv = k.shape[1]
        rep = hq // hkv
        p_len = self.prefill
        g = plan.group_tokens
        kr, vr = round16(k), round16(v)
        positions = torch.arange(n, device=q.device)
        # prefill statistics for codecs (the real cache sees exactly these at prefill)
        qp = q[:, :, :p_len].double()  # rotated prefill queries
        qp = qp.reshape(b, hkv, rep, p_len, d)
        cov = torch.einsum("bhrtd,bhrte->hde", qp, qp) / (b * rep * p_len)
        q_pre = _derotate(q[:, :, :p_len].double(), positions[:p_len], self.rotary)
        q_pre = q_pre.reshape(b, hkv, rep, p_len, d)
        cov_pre = torch.einsum("bhrtd,bhrte->hde", q_pre, q_pre) / (b * rep * p_len)
        g_prefill = flushed_groups(p_len, g)
        ctx = LayerContext(
            layer_idx=idx,
            rotary=self.rotary,
            query_cov=cov,
            query_cov_pre=cov_pre,
            prefill_keys=kr[:, :, SINKS : SINKS + g_prefill * g],
            prefill_positions=positions[SINKS : SINKS + g_prefill * g],
        )
        ctx.state["group_tokens"] = g
        self.contexts.append(ctx)
        plan.key.prepare(ctx)
        plan.value.prepare(ctx)
        n_groups = flushed_groups(n, g)
        end = SINKS + n_groups * g
        k_hat, v_hat = kr.clone(), vr.clone()
        if n_groups:
            grouped = slice(SINKS, end)
            kg = kr[:, :, grouped].reshape(b, hkv, n_groups, g, d).transpose(1, 2)
            vg = vr[:, :, grouped].reshape(b, hkv, n_groups, g, v.shape[-1]).transpose(1, 2)
            pos = positions[grouped].reshape(n_groups, g)
            if self.quantize_keys:
                dec = torch.stack(
                    [plan.key.decode(kg[:, j], pos[j], ctx) for j in range(n_groups)], dim=1
                )
                k_hat[:, :, grouped] = dec.transpose(1, 2).reshape(b, hkv, end - SINKS, d)
            if self.quantize_values:
                dec = torch.stack(
                    [plan.value.decode(vg[:, j], pos[j], ctx) for j in range(n_groups)], dim=1
                )
                k_shape = (b, hkv, end - SINKS, v.shape[-1])
                v_hat[:, :, grouped] = dec.transpose(1, 2).reshape(k_shape)
        self.decoded[idx] = (k_hat, v_hat)
        # per query t >= P: key i quantized iff SINKS <= i < SINKS + G(t + 1) * g
        t = positions[p_len:]
        g_at = torch.tensor([flushed_groups(int(x) + 1, g) for x in t], device=q.device)
        limit = SINKS + g_at * g  # [n - P]
        quant = (positions[None, :] >= SINKS) & (positions[None, :] < limit[:, None])
        causal = positions[None, :] <= positions[:, None]
        out = torch.empty(b, hq, n, v.shape[-1], dtype=q.dtype, device=q.device)
        kx = k.repeat_interleave(rep, 1)
        vx = v.repeat_interleave(rep, 1)
        # prefill rows: exact
        out[:, :, :p_len] = (
            torch.softmax(
                (q[:, :, :p_len] @ kx.transpose(-1, -2)[..., :, :])
                .mul(scaling)
                .masked_fill(~causal[:p_len], -math.inf),
                dim=-1,
            )
            @ vx
        )
        qd = q[:, :, p_len:]
        if qd.shape[2]:
            krx, khx = kr.repeat_interleave(rep, 1), k_hat.repeat_interleave(rep, 1)
            vrx, vhx = vr.repeat_interleave(rep, 1), v_hat.repeat_interleave(rep, 1)
            lr = qd @ krx.transpose(-1, -2)
            lq = qd @ khx.transpose(-1, -2)
            logits = torch.where(quant, lq, lr) * scaling
            logits = logits.masked_fill(~causal[p_len:], -math.inf)
            prob = torch.softmax(logits, dim=-1)
            pq = prob * quant
            out[:, :, p_len:] = (prob - pq) @ vrx + pq @ vhx
        return out


def _derotate(x: Tensor, positions: Tensor, rotary: RotaryConfig) -> Tensor:
    from kvlab.rope import rotate_by_delta

    return rotate_by_delta(x, (-positions).to(x.device), rotary)


# ----------------------------------------------------------------------------- evaluation


@dataclass
class WindowResult:
    kl: Tensor  # float64 [S]
    nll: Tensor  # float64 [S]


@torch.no_grad()
def full_reference(model: Any, windows: Sequence[Tensor], prefill: int) -> list[WindowResult]:
    """Exact log-probs of each window's scored tokens (one forward, SDPA): the ``full`` row."""
    out = []
    for w in windows:
        inp = w[:-1].view(1, -1)
        logits = model(inp, use_cache=False).logits[0, prefill - 1 :].double()
        logp = torch.log_softmax(logits, -1)
        nll = -logp.gather(-1, w[prefill:].view(-1, 1)).squeeze(-1)
        out.append(WindowResult(kl=torch.zeros_like(nll), nll=nll))
        out[-1].logp = logp  # type: ignore[attr-defined]
    return out


@torch.no_grad()
def simulate(
    model: Any,
    windows: Sequence[Tensor],
    prefill: int,
    plans: Sequence[LayerPlan],
    reference: Sequence[WindowResult],
    caches: list | None = None,
    **cache_kwargs: Any,
) -> list[WindowResult]:
    """KL(full || simulated) and NLL per scored token of each window (``caches``: a list
    that receives each window's :class:`SimCache`)."""
    rotary = rotary_of(model)
    out = []
    with use_attention(model, "kvlab"):
        for w, ref in zip(windows, reference, strict=True):
            cache = SimCache(plans, rotary, prefill, **cache_kwargs)
            if caches is not None:
                caches.append(cache)
            inp = w[:-1].view(1, -1)
            logits = model(inp, cache=cache, use_cache=True).logits[0, prefill - 1 :].double()
            logp = torch.log_softmax(logits, -1)
            nll = -logp.gather(-1, w[prefill:].view(-1, 1)).squeeze(-1)
            rl = ref.logp  # type: ignore[attr-defined]
            kl = (rl.exp() * (rl - logp)).sum(-1).clamp_min(0.0)
            out.append(WindowResult(kl=kl, nll=nll))
    return out


def summarize(results: Sequence[WindowResult], reference: Sequence[WindowResult]) -> dict:
    """Pooled KL mean, PPL and ΔPPL % (as ``kvlab eval`` pools them), plus per-window KL."""
    nll = torch.cat([r.nll for r in results])
    ref_nll = torch.cat([r.nll for r in reference])
    ppl, ref_ppl = math.exp(float(nll.mean())), math.exp(float(ref_nll.mean()))
    return {
        "kl": float(torch.cat([r.kl for r in results]).mean()),
        "ppl": ppl,
        "dppl": 100.0 * (ppl / ref_ppl - 1.0),
        "kl_windows": [round(float(r.kl.mean()), 5) for r in results],
    }


class Timer:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t, 1)


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs)


def default_out() -> Path:
    p = Path("/tmp/pnmix-research")
    p.mkdir(parents=True, exist_ok=True)
    return p


__all__ = [
    "Callable",
    "Codec",
    "LayerContext",
    "LayerPlan",
    "SimCache",
    "capture_qkv",
    "codes_bytes",
    "eval_windows",
    "flushed_groups",
    "full_reference",
    "load",
    "plan_bytes",
    "rotary_of",
    "round16",
    "simulate",
    "summarize",
    "text_ids",
]
