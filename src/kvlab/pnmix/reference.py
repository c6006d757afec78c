"""The torch reference of packed attention (docs/design.md, "Attention"): softmax attention
over a :class:`~kvlab.pnmix.store.PackedKV` — a store's raw buffers, its per-row counts and the
codec description, what every compiled kernel reads too — decoding the packed codes block by
block. It is the ``"torch"`` backend of :func:`kvlab.pnmix.attention.pnmix_attention` and the
reference every kernel of :mod:`kvlab.pnmix.kernels` is tested against (docs/design.md,
"Kernels"); its decode steps (:func:`decode_key_block`, :func:`apply_key_payload`,
:func:`rotate_to_positions`, :func:`transform_values`) are the ones a kernel mirrors, and
:func:`reference_keys` gives the rows' reference keys ``mu`` that kernels are handed.

Algorithm (split-K softmax, as FlashDecoding): the stream of every row — exact sinks, quantized
groups, exact residual — is cut into segments: the exact tokens (sinks and residual together)
and blocks of ``block_groups`` group slots. Per segment: logits ``q · (k - mu)`` in float32,
where a block's keys are first decoded to float32 (element for element what
:meth:`~kvlab.pnmix.cache.PNMixCache.dequantize` computes) in separable steps — the codec's
``unpack`` and ``decode`` (:func:`decode_key_block`), its payload (exact sparse entries,
:func:`apply_key_payload`), and for a position-aware codec the rotation of each decoded
key to its RoPE position (:func:`rotate_to_positions`) — and ``mu`` is one
stored key of the row: the softmax is unchanged, while float32 rounding becomes relative to the
spread of the row's keys rather than their magnitude (large zero points do not cancel); logits
are masked where a slot lies beyond the row's count or, causally, beyond what a query may see;
then the segment's maximum ``m``, ``l = Σ exp(logit - m)`` and ``Σ exp(logit - m) v``. Values
of a block are read from their codes in the per-token affine form ``Σ_t p_t z_t + Σ_t (p_t s_t)
c_t`` (the terms of ``Σ_t p_t (z_t + s_t c_t)`` regrouped; float32 rounding relative to the
values' scale); a value codec that codes values in a rotated frame (Hadamard) has the
attention-weighted sum of a query row's decoded values of all blocks mapped back once
(:func:`transform_values`). Segments are merged with weights ``exp(m - max m)``. A query row
that sees nothing (a padding query) returns zeros.

Memory: the largest temporaries are one block's decoded keys and unpacked value codes
(``B * H_kv * block_groups * group_tokens * (D + Dv)`` floats) and its logits; nothing grows
with the context beyond one block except the per-segment ``(m, l, acc)`` triples.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.attention_logits import softcap_logits
from kvlab.pnmix.packing import unpack_codes
from kvlab.pnmix.store import PackedKV
from kvlab.rope import rotate_by_delta

__all__ = [
    "apply_key_payload",
    "decode_key_block",
    "packed_attention_reference",
    "reference_keys",
    "rotate_to_positions",
    "transform_values",
]


_LUTS: dict[tuple[int, torch.device], Tensor] = {}


def _unpack_float(packed: Tensor, bits: int, n: int) -> Tensor:
    """Float32 codes ``[..., n]`` of packed rows ``[..., bytes]`` (the values
    :func:`~kvlab.pnmix.packing.unpack_codes` returns, as floats)."""
    if 8 % bits:
        return unpack_codes(packed, bits, n).float()
    per_byte = 8 // bits
    key = (bits, packed.device)
    lut = _LUTS.get(key)
    if lut is None:
        byte = torch.arange(256, device=packed.device)[:, None]
        shifts = torch.arange(per_byte, device=packed.device) * bits
        lut = ((byte >> shifts) & ((1 << bits) - 1)).float()
        _LUTS[key] = lut
    codes = F.embedding(packed.int(), lut).flatten(-2)
    return codes if codes.shape[-1] == n else codes[..., :n]


def _limits(kv: PackedKV, nq: int, rep: int, causal: bool, device: torch.device) -> Tensor | None:
    """Per (b, h, query row) how many slots of the sinks, the group region and the residual a
    query may see: int64 ``[3, B, H, M, 1]``; ``None`` when every query sees every stored
    token (equal rows, and one query or no causal mask)."""
    uniform = all(
        int(a.min()) == int(a.max(initial=0))
        for a in (kv.sink_lengths, kv.group_counts, kv.residual_lengths)
    )
    if uniform and (not causal or nq == 1):
        return None
    ns, ng, nr = kv.sink_lengths, kv.group_counts * kv.group_tokens, kv.residual_lengths
    n = ns + ng + nr
    j = np.tile(np.arange(nq), rep)  # query row m = r * Q + j
    visible = (
        n[..., None] - nq + j + 1 if causal else np.broadcast_to(n[..., None], (*n.shape, j.size))
    )
    sinks = np.clip(np.minimum(visible, ns[..., None]), 0, None)
    groups = np.clip(np.minimum(visible - ns[..., None], ng[..., None]), 0, None)
    res = np.clip(np.minimum(visible - (ns + ng)[..., None], nr[..., None]), 0, None)
    return torch.from_numpy(np.stack([sinks, groups, res])[..., None]).to(device)


def decode_key_block(kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Step 1 of a block's keys: group slots ``g0 .. g1 - 1`` of every row unpacked and decoded
    by the key codec, float32 ``[B, H, n * T, D]`` in the codec's frame (no payload, no
    rotation)."""
    b, h = kv.sink_keys.shape[:2]
    d, t, n = kv.sink_keys.shape[-1], kv.group_tokens, g1 - g0
    packed = kv.key_codes[:, :, g0:g1]
    mask = kv.mask
    if kv.codec.uniform_code_width:
        codes = _unpack_float(packed, kv.bits, t * d).reshape(b, h, n, t, d)
    else:  # per-pair widths: the codec's own layout
        table = None if mask is None else mask[:, :, None]
        codes = kv.codec.unpack(packed, t, kv.layout, table).float()
    if mask is not None:
        mask = mask.unsqueeze(2).expand(-1, -1, n, -1)
    keys = kv.codec.decode(codes, kv.key_scalars[:, :, g0:g1], kv.layout, mask, kv.active_pairs)
    return keys.reshape(b, h, n * t, d)


def apply_key_payload(keys: Tensor, kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Step 2 (codecs with a payload): the block's decoded keys ``[B, H, n * T, D]`` with the
    codec's per-group side data applied — exact sparse outliers written back."""
    if kv.key_payload is None or kv.key_payload.shape[-1] == 0:
        return keys
    b, h, _, d = keys.shape
    n, t = g1 - g0, kv.group_tokens
    grouped = keys.reshape(b, h, n, t, d)
    out = kv.codec.apply_payload(grouped, kv.key_payload[:, :, g0:g1], kv.sink_keys.dtype)
    return out.reshape(b, h, n * t, d)


def rotate_to_positions(keys: Tensor, kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Step 3 (position-aware codecs): the block's decoded pre-RoPE keys ``[B, H, n * T, D]``
    rotated to their RoPE positions ``offset + S + g * T + t`` (:func:`kvlab.rope.
    rotate_by_delta`: angles in float64, rotation in float32)."""
    if not kv.codec.position_aware:
        return keys
    assert kv.rotary is not None and kv.position_offsets is not None
    t = kv.group_tokens
    local = kv.sink_tokens + np.arange(g0 * t, g1 * t, dtype=np.int64)
    pos = torch.from_numpy(kv.position_offsets[..., None] + local).to(keys.device)
    return rotate_by_delta(keys, pos, kv.rotary)


def transform_values(acc: Tensor, kv: PackedKV) -> Tensor:
    """The value codec's output transform of an attention-weighted sum of decoded values
    ``[..., Dv]`` (Hadamard: ``@ H^T``; identity for per-token min-max)."""
    codec = kv.value_codec
    return acc if codec is None else codec.output_transform(acc)


def _key_block(kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Decoded float32 keys of group slots ``g0 .. g1 - 1`` at their positions: the three
    steps above."""
    keys = decode_key_block(kv, g0, g1)
    keys = apply_key_payload(keys, kv, g0, g1)
    return rotate_to_positions(keys, kv, g0, g1)


def reference_keys(kv: PackedKV) -> Tensor:
    """A stored key of every row, float32 ``[B, H, 1, D]``: the first sink slot, else the first
    residual slot, else the decoded first token of group slot 0. Logits are computed against
    keys minus this reference: softmax is invariant to the row's constant ``q · mu``, and the
    subtraction (exact when a key lies within a factor of 2 of ``mu``, Sterbenz) makes the
    float32 rounding of a logit relative to the spread of the row's keys, not their magnitude
    (large zero points: docs/design.md, "Attention"). Compiled kernels are handed these keys as
    their ``mu``."""
    if kv.sink_keys.shape[2]:
        return kv.sink_keys[:, :, :1].float()
    if kv.residual_keys.shape[2]:
        return kv.residual_keys[:, :, :1].float()
    b, h = kv.sink_keys.shape[:2]
    d = kv.sink_keys.shape[-1]
    if kv.key_codes.shape[2] == 0:
        return kv.sink_keys.new_zeros((b, h, 1, d), dtype=torch.float32)
    return _key_block(kv, 0, 1)[:, :, :1]


class _Partials:
    """Per-segment softmax partials ``(m, l, acc)``, merged at the end."""

    def __init__(self) -> None:
        self.m: list[Tensor] = []
        self.l: list[Tensor] = []
        self.acc: list[Tensor] = []
        self.coded: list[bool] = []  # acc in the value codec's frame (a quantized block)

    def logits(self, s: Tensor, hidden: Tensor | None) -> Tensor:
        """Mask logits ``[B, H, M, w]`` where ``hidden`` (bool, broadcastable); return the
        unnormalized probabilities ``exp(s - m)`` and record ``m`` and ``l``."""
        if hidden is not None:
            s = s.masked_fill(hidden, -math.inf)
        m = s.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
        p = torch.exp(s - m)
        self.m.append(m)
        self.l.append(p.sum(dim=-1, keepdim=True))
        return p

    def merge(self, transform: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """``Σ w acc / Σ w l``; ``transform`` maps the summed accumulators of the quantized
        blocks (in the value codec's frame) back, once per query row."""
        tiny = torch.finfo(torch.float32).tiny
        coded = self.coded + [False] * (len(self.acc) - len(self.coded))
        if transform is None or not any(coded):
            if len(self.m) == 1:
                return self.acc[0] / self.l[0].clamp_min(tiny)
            m = torch.stack(self.m)
            w = torch.exp(m - m.amax(dim=0))
            l_sum = (w * torch.stack(self.l)).sum(dim=0)
            acc = (w * torch.stack(self.acc)).sum(dim=0)
            return acc / l_sum.clamp_min(tiny)
        m = torch.stack(self.m)
        w = torch.exp(m - m.amax(dim=0))
        l_sum = (w * torch.stack(self.l)).sum(dim=0)
        parts = [wi * a for wi, a in zip(w, self.acc, strict=True)]
        exact = [p for p, c in zip(parts, coded, strict=True) if not c]
        quantized = torch.stack([p for p, c in zip(parts, coded, strict=True) if c]).sum(dim=0)
        acc = transform(quantized)
        if exact:
            acc = acc + torch.stack(exact).sum(dim=0)
        return acc / l_sum.clamp_min(tiny)


def packed_attention_reference(
    query: Tensor,
    kv: PackedKV,
    *,
    scale: float,
    causal: bool = True,
    block_groups: int = 32,
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """Softmax attention of ``query`` over packed storage, in float32 (module docstring).

    Args:
        query: ``[B, H_q, Q, D]`` on the buffers' device, ``H_q`` a multiple of ``H``: query
            head ``i`` reads kv head ``i // (H_q / H)`` (GQA). Query ``j`` of row ``(b, h)``
            is that row's stream token ``n - Q + j`` (``n`` its length).
        kv: the packed storage.
        scale: softmax scale of the logits.
        causal: query ``j`` sees stream indices ``<= n - Q + j`` (bottom-right); ``False``: all
            of the row's ``n`` tokens.
        block_groups: group slots decoded at a time (>= 1).
        logit_softcap: Gemma 2 soft-cap of the scaled logits, applied before masking
            (:func:`kvlab.attention_logits.softcap_logits`), or ``None``. ``tanh`` is not
            shift-invariant, so with a cap the logits are ``q · (k - mu) + q · mu``.
        sink_logits: ``[H_q]`` learned sink logits (GPT-OSS ``s_aux``): one extra logit per
            query row in the softmax, with no value, or ``None``.

    Returns:
        float32 ``[B, H_q, Q, Dv]``; zeros for a query that sees no token (and no sink).
    """
    b, hq, nq, d = query.shape
    hkv = kv.sink_keys.shape[1]
    rep = hq // hkv
    t = kv.group_tokens
    dev = kv.sink_keys.device
    q = query.to(device=dev, dtype=torch.float32).reshape(b, hkv, rep * nq, d) * scale
    limits = _limits(kv, nq, rep, causal, dev)
    mu = reference_keys(kv)
    # q . mu: what the centred logits lack, needed where the true logit value matters
    q_mu = q @ mu.mT if logit_softcap is not None or sink_logits is not None else None

    def transform(s: Tensor) -> Tensor:
        if logit_softcap is None:
            return s
        return softcap_logits(s + q_mu, logit_softcap)

    parts = _Partials()
    n_sink = int(kv.sink_lengths.max(initial=0))
    n_res = int(kv.residual_lengths.max(initial=0))
    if n_sink or n_res:  # the exact tokens, sinks then residual, as one segment
        keys = torch.cat([kv.sink_keys[:, :, :n_sink], kv.residual_keys[:, :, :n_res]], 2)
        values = torch.cat([kv.sink_values[:, :, :n_sink], kv.residual_values[:, :, :n_res]], 2)
        hidden = None
        if limits is not None:
            cols = torch.arange(n_sink + n_res, device=dev)
            hidden = torch.where(cols < n_sink, cols >= limits[0], (cols - n_sink) >= limits[2])
        p = parts.logits(transform(q @ keys.float().sub_(mu).mT), hidden)
        parts.acc.append(p @ values.float())
        parts.coded.append(False)
    n_groups = int(kv.group_counts.max(initial=0))
    dv = kv.sink_values.shape[-1]
    for g0 in range(0, n_groups, block_groups):
        g1 = min(g0 + block_groups, n_groups)
        n = g1 - g0
        keys = _key_block(kv, g0, g1).sub_(mu)
        hidden = None
        if limits is not None:
            hidden = torch.arange(g0 * t, g1 * t, device=dev) >= limits[1]
        p = parts.logits(transform(q @ keys.mT), hidden)
        vcodes = _unpack_float(kv.value_codes[:, :, g0:g1], kv.bits, t * dv).reshape(b, hkv, -1, dv)
        # [B, H, n, 2TG]: scale(T, G) | zero(T, G), G scale/zero pairs per token (docs/design.md)
        vs = kv.value_scalars[:, :, g0:g1].float()
        cg = vs.shape[-1] // (2 * t)
        v_scale = vs[..., : t * cg].reshape(b, hkv, 1, n * t, cg)
        v_zero = vs[..., t * cg :].reshape(b, hkv, 1, n * t, cg)
        width = dv // cg
        parts.acc.append(
            torch.cat(
                [
                    (p * v_scale[..., j]) @ vcodes[..., j * width : (j + 1) * width]
                    + (p * v_zero[..., j]).sum(dim=-1, keepdim=True)
                    for j in range(cg)
                ],
                dim=-1,
            )
        )
        parts.coded.append(True)
    if sink_logits is not None:  # row r * Q + j of kv head h is query head h * rep + r
        sinks = sink_logits.detach().to(device=dev, dtype=torch.float32).view(1, hkv, rep, 1)
        sinks = sinks.expand(b, hkv, rep, nq).reshape(b, hkv, rep * nq, 1)
        if logit_softcap is None:
            sinks = sinks - q_mu  # into the centred logits' frame
        parts.m.append(sinks)
        parts.l.append(torch.ones_like(sinks))
        parts.acc.append(sinks.new_zeros((b, hkv, rep * nq, kv.sink_values.shape[-1])))
        parts.coded.append(False)
    coded_frame = kv.value_codec is not None and kv.value_codec.transforms_output
    post = (lambda acc: transform_values(acc, kv)) if coded_frame else None
    return parts.merge(post).reshape(b, hq, nq, -1)
