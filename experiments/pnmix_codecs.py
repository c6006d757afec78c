"""Research codecs for issue 8 (key and value codings of one PN-Mix group), used by
``pnmix_sim.SimCache``. Each decodes a group exactly as a real codec would store it (float16
scalars, codes chosen against the stored scalars) and counts its bytes exactly.

Frames: a *rotated* codec codes the keys as the model hands them (RoPE applied at each token's
position, today's PN-Mix); a *pre-RoPE* codec first rotates each key back to position 0
(KVQuant, Hooper et al. 2024, arXiv:2401.18079, §3.2), codes it there (float16 storage of the
pre-RoPE key), and rotates the decoded key forward again for attention.
"""

from __future__ import annotations

import math

import torch
from pnmix_sim import BITS, STORAGE, Codec, LayerContext, codes_bytes
from torch import Tensor

from kvlab.pnmix.quantizers import (
    minmax_dequantize,
    minmax_quantize,
    phase_norm_dequantize,
    phase_norm_quantize,
)
from kvlab.rope import rotate_by_delta

SCALAR = 2  # bytes of one stored float16 scalar
OUTLIER = 4  # bytes of one sparse outlier: float16 value + int16 index


def to_frame(x: Tensor, positions: Tensor, ctx: LayerContext, prerope: bool) -> Tensor:
    """Storage-rounded keys in the codec's frame (pre-RoPE: rotated back to position 0)."""
    if not prerope:
        return x
    return rotate_by_delta(x, (-positions).to(x.device), ctx.rotary).to(STORAGE).float()


def from_frame(x: Tensor, positions: Tensor, ctx: LayerContext, prerope: bool) -> Tensor:
    if not prerope:
        return x
    return rotate_by_delta(x, positions.to(x.device), ctx.rotary)


# ----------------------------------------------------------------------------- min-max helpers


def minmax_fit(x: Tensor, lo: Tensor, hi: Tensor, bits: int, dim: int) -> Tensor:
    """Decode of ``x`` with zero ``lo`` and scale ``(hi - lo) / L`` (both float16-stored),
    codes chosen against the stored scalars (as ``minmax_quantize``); ``lo``/``hi`` keep
    ``dim``. Values outside ``[lo, hi]`` clamp to the end levels."""
    levels = (1 << bits) - 1
    x64 = x.double()
    zero = lo.double().to(STORAGE).double()
    scale = ((hi.double() - lo.double()) / levels).to(STORAGE).double()
    valid = scale > 0
    ratio = (x64 - zero) / torch.where(valid, scale, torch.ones_like(scale))
    codes = torch.where(valid, torch.round(ratio).clamp(0, levels), torch.zeros_like(ratio))
    return (zero.float() + codes.float() * scale.float()).float()


def outlier_mask(x: Tensor, count: int, dim: int, weight: Tensor | None = None) -> Tensor:
    """Bool mask of the ``count`` elements per ``x[..., :, :]`` slab (the last two dims) that
    lie farthest from their channel's median along ``dim`` (KVQuant §3.3 dense-and-sparse; the
    distance optionally scaled per channel by ``weight``, broadcast like the median)."""
    if count <= 0:
        return torch.zeros_like(x, dtype=torch.bool)
    med = x.median(dim=dim, keepdim=True).values
    dist = (x - med).abs()
    if weight is not None:
        dist = dist * weight
    flat = dist.flatten(-2)
    idx = flat.topk(count, dim=-1).indices
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask.scatter_(-1, idx, True)
    return mask.view_as(x)


def minmax_sparse(x: Tensor, bits: int, dim: int, mask: Tensor) -> Tensor:
    """Min-max decode along ``dim`` with the ``mask``ed elements excluded from the range and
    restored exactly (they are stored in float16, ``x`` is storage-rounded)."""
    big = torch.finfo(torch.float32).max
    lo = torch.where(mask, torch.full_like(x, big), x).amin(dim=dim, keepdim=True)
    hi = torch.where(mask, torch.full_like(x, -big), x).amax(dim=dim, keepdim=True)
    allout = lo > hi  # a channel whose every element is an outlier
    lo = torch.where(allout, torch.zeros_like(lo), lo)
    hi = torch.where(allout, torch.zeros_like(hi), hi)
    dec = minmax_fit(x, lo, hi, bits, dim)
    return torch.where(mask, x, dec)


def clip_search(x: Tensor, bits: int, dim: int, weight: Tensor | None, grid: int) -> Tensor:
    """Min-max decode with the range shrunk per channel to the (lo, hi) on a grid of
    ``grid x grid`` shrink fractions (0 .. 0.3 of the range each side) that minimizes the
    squared error of the channel (zero extra bytes: the stored scalars are just other values)."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    rng = hi - lo
    best = minmax_fit(x, lo, hi, bits, dim)
    best_err = ((best - x) ** 2).sum(dim=dim, keepdim=True)
    fr = torch.linspace(0, 0.3, grid)[1:] if grid > 1 else torch.zeros(0)
    for a in [0.0, *fr.tolist()]:
        for c in [0.0, *fr.tolist()]:
            if a == 0.0 and c == 0.0:
                continue
            dec = minmax_fit(x, lo + a * rng, hi - c * rng, bits, dim)
            err = ((dec - x) ** 2).sum(dim=dim, keepdim=True)
            better = err < best_err
            best = torch.where(better, dec, best)
            best_err = torch.where(better, err, best_err)
    return best


# ----------------------------------------------------------------------------- key codecs


class CartesianKeys(Codec):
    """Per-channel min-max over the group's tokens (KIVI keys), rotated or pre-RoPE, with an
    optional fraction of exact sparse outliers per group and optional clipping search."""

    def __init__(
        self,
        prerope: bool = False,
        outliers: float = 0.0,
        clip: int = 0,
        outlier_weighting: str = "none",
    ) -> None:
        self.prerope, self.outliers, self.clip = prerope, outliers, clip
        self.outlier_weighting = outlier_weighting
        tag = "pre" if prerope else "rot"
        self.name = (
            f"cart-{tag}"
            + (f"+out{outliers:g}" if outliers else "")
            + (f"+clip{clip}" if clip else "")
        )

    def count(self, tokens: int, dim: int) -> int:
        return round(self.outliers * tokens * dim)

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        y = to_frame(x, positions, ctx, self.prerope)
        n_out = self.count(y.shape[-2], y.shape[-1])
        if n_out:
            weight = None
            if self.outlier_weighting == "query":
                cov = ctx.query_cov_pre if self.prerope else ctx.query_cov
                weight = cov.diagonal(dim1=-2, dim2=-1).sqrt().float()[None, :, None, :]
            mask = outlier_mask(y, n_out, -2, weight)
            dec = minmax_sparse(y, BITS, -2, mask)
        elif self.clip:
            dec = clip_search(y, BITS, -2, None, self.clip)
        else:
            dec = minmax_dequantize(*minmax_quantize(y, BITS, -2, STORAGE), dim=-2)
        return from_frame(dec, positions, ctx, self.prerope)

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        return (
            codes_bytes(tokens, heads, dim)
            + heads * dim * 2 * SCALAR
            + heads * self.count(tokens, dim) * OUTLIER
        )


def _pairs(ctx: LayerContext) -> tuple[Tensor, Tensor]:
    return ctx.rotary.pair_indices()


class PhaseNormKeys(Codec):
    """Phase–Norm on every rotary pair (norm and phase ``BITS`` bits each, SPEC §3), rotated or
    with the phase measured at position 0 (pre-RoPE)."""

    def __init__(self, prerope: bool = False, norm_bits: int = BITS, phase_bits: int = BITS):
        self.prerope = prerope
        self.norm_bits, self.phase_bits = norm_bits, phase_bits
        self.name = f"pn{norm_bits}+{phase_bits}-{'pre' if prerope else 'rot'}"

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        y = to_frame(x, positions, ctx, self.prerope)
        first, second = _pairs(ctx)
        a, b = y[..., first], y[..., second]
        out = y.clone()
        if self.norm_bits == self.phase_bits:
            pn = phase_norm_quantize(a, b, self.norm_bits, -2, STORAGE)
            ah, bh = phase_norm_dequantize(*pn, bits=self.norm_bits, dim=-2)
        else:
            ah, bh = _phase_norm_unequal(a, b, self.norm_bits, self.phase_bits)
        out[..., first], out[..., second] = ah, bh
        return from_frame(out, positions, ctx, self.prerope)

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        return codes_bytes(tokens, heads, dim) + heads * dim * 2 * SCALAR


def _phase_norm_unequal(a: Tensor, b: Tensor, nb: int, pb: int) -> tuple[Tensor, Tensor]:
    """Phase–Norm with ``nb`` norm bits and ``pb`` phase bits (0 norm bits: the group's mean
    norm, stored as one float16 scalar)."""
    a64, b64 = a.double(), b.double()
    norm = torch.sqrt(a64 * a64 + b64 * b64)
    if nb == 0:
        r = norm.mean(-2, keepdim=True).to(STORAGE).float().expand_as(a)
    else:
        r = minmax_dequantize(*minmax_quantize(norm, nb, -2, STORAGE), dim=-2)
    pn = phase_norm_quantize(a, b, pb, -2, STORAGE)
    one = torch.ones_like(pn.norm_zero)
    ca, cb = phase_norm_dequantize(
        torch.zeros_like(pn.norm_codes),
        pn.phase_codes,
        torch.zeros_like(one),
        one,
        pn.phase_span,
        pn.phase_offset,
        pb,
        -2,
    )
    return r * ca, r * cb


class MixKeys(Codec):
    """Per (kv head, rotary pair) one of two codecs, chosen once at prefill (1 bit per pair).

    ``select="saliency"``: today's rule — smaller key reconstruction error on the first flushed
    group. ``select="query"``: smaller expected squared logit error, ``E_t[(q_t,pair ·
    (k_pair - k_hat_pair))^2]`` over the prefill's queries ``t`` and the keys of every group
    flushed at prefill (rotated frame, where logits are formed), computed from the per-head
    second moment of the rotated prefill queries.
    """

    def __init__(self, a: Codec, b: Codec, select: str = "query") -> None:
        self.a, self.b, self.select = a, b, select
        self.name = f"mix[{a.name}|{b.name}|{select}]"

    def prepare(self, ctx: LayerContext) -> None:
        keys, pos = ctx.prefill_keys, ctx.prefill_positions
        first, second = _pairs(ctx)
        key = id(self)
        if keys is None or keys.shape[2] == 0:
            ctx.state[key] = None
            return
        g = ctx.state.get("group_tokens")
        t_all = keys.shape[2]
        g = g or t_all
        if self.select == "saliency":
            keys, pos = keys[:, :, :g], pos[:g]
            groups = [(keys, pos)]
        else:
            groups = [(keys[:, :, j : j + g], pos[j : j + g]) for j in range(0, t_all, g)]
        err_a = err_b = 0.0
        for kg, pg in groups:
            da = self.a.decode(kg, pg, ctx).double() - kg.double()
            db = self.b.decode(kg, pg, ctx).double() - kg.double()
            err_a = err_a + self._pair_error(da, ctx, first, second)
            err_b = err_b + self._pair_error(db, ctx, first, second)
        ctx.state[key] = err_b < err_a  # True = codec b, [B, H, P]
        ctx.state.setdefault("mix_share", []).append(float(ctx.state[key].float().mean()))

    def _pair_error(self, e: Tensor, ctx: LayerContext, first: Tensor, second: Tensor) -> Tensor:
        ea, eb = e[..., first], e[..., second]  # [B,H,T,P]
        if self.select == "saliency":
            return (ea**2 + eb**2).sum(-2)
        cov = ctx.query_cov  # [H, D, D] rotated-query second moment
        caa = cov[:, first, first][None, :, None, :]
        cbb = cov[:, second, second][None, :, None, :]
        cab = cov[:, first, second][None, :, None, :]
        return (caa * ea**2 + cbb * eb**2 + 2 * cab * ea * eb).sum(-2)

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        sel = ctx.state.get(id(self))
        da = self.a.decode(x, positions, ctx)
        if sel is None:
            return da
        db = self.b.decode(x, positions, ctx)
        first, second = _pairs(ctx)
        out = da.clone()
        s = sel.unsqueeze(-2)
        out[..., first] = torch.where(s, db[..., first], da[..., first])
        out[..., second] = torch.where(s, db[..., second], da[..., second])
        return out

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        return max(self.a.group_bytes(tokens, heads, dim), self.b.group_bytes(tokens, heads, dim))

    def layer_bytes(self, heads: int, dim: int) -> int:
        return math.ceil(heads * (dim // 2) / 8)


# ----------------------------------------------------------------------------- value codecs


def hadamard(n: int) -> Tensor:
    """The package's orthonormal Hadamard matrix (:func:`kvlab.pnmix.hadamard.hadamard_matrix`)."""
    from kvlab.pnmix.hadamard import hadamard_matrix

    return hadamard_matrix(n)


class TokenValues(Codec):
    """Per-token min-max over groups of ``channels`` value channels (KIVI values), with an
    optional fraction of exact sparse outliers per group; ``hadamard=True`` codes ``v H``
    (a fixed orthonormal Hadamard rotation of the channels, as QuaRot, Ashkboos et al. 2024,
    arXiv:2404.00456, rotates activations) and decodes ``(v H)_hat H^T``: zero extra bytes."""

    def __init__(
        self,
        channels: int | None = None,
        outliers: float = 0.0,
        clip: int = 0,
        hadamard: bool = False,
        exact: bool = False,
    ):
        self.channels, self.outliers, self.clip = channels, outliers, clip
        self.hadamard = hadamard
        self.exact = exact
        self.name = (
            f"val{channels or 'all'}"
            + (f"+out{outliers:g}" if outliers else "")
            + (f"+clip{clip}" if clip else "")
            + ("+had" if hadamard else "")
        )

    def count(self, tokens: int, dim: int) -> int:
        return round(self.outliers * tokens * dim)

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        if self.hadamard:
            rot = hadamard(x.shape[-1])
            if self.exact:  # the product's frame: exact ±1 sums in float64, then rounded
                from kvlab.pnmix.values import HadamardValueCodec

                y = HadamardValueCodec().frame(x, STORAGE).float()
            else:
                y = (x @ rot).to(STORAGE).float()
            return self._decode(y) @ rot.T
        return self._decode(x)

    def _decode(self, x: Tensor) -> Tensor:
        b, h, t, d = x.shape
        c = self.channels or d
        y = x.reshape(b, h, t, d // c, c)
        n_out = self.count(t, d)
        if n_out:
            # outliers counted over the whole group (T x D per head), by distance from the token
            # median of its channel group
            med = y.median(dim=-1, keepdim=True).values
            dist = (y - med).abs().reshape(b, h, t * d)
            idx = dist.topk(n_out, dim=-1).indices
            mask = torch.zeros_like(dist, dtype=torch.bool).scatter_(-1, idx, True)
            dec = minmax_sparse(y, BITS, -1, mask.view_as(y))
        elif self.clip:
            dec = clip_search(y, BITS, -1, None, self.clip)
        else:
            dec = minmax_dequantize(*minmax_quantize(y, BITS, -1, STORAGE), dim=-1)
        return dec.reshape(b, h, t, d)

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        c = self.channels or dim
        return (
            codes_bytes(tokens, heads, dim)
            + heads * tokens * (dim // c) * 2 * SCALAR
            + heads * self.count(tokens, dim) * OUTLIER
        )


class ExactCodec(Codec):
    """No quantization (float16 exact): for keys-only / values-only ablations."""

    name = "exact"

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        return x

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        return heads * tokens * dim * 2


# ----------------------------------------------------------------------------- bit allocation


def _decode_bits(y: Tensor, bits: Tensor, dim: int) -> Tensor:
    """Per-channel min-max decode along ``dim`` (tokens) with ``bits [..., D]`` bits per
    channel (0 bits: the channel's float16-stored mean)."""
    out = torch.empty_like(y)
    for b in bits.unique().tolist():
        sel = (bits == b).unsqueeze(dim)
        if b == 0:
            dec = y.double().mean(dim, keepdim=True).to(STORAGE).float().expand_as(y)
        else:
            dec = minmax_dequantize(*minmax_quantize(y, int(b), dim, STORAGE), dim=dim)
        out = torch.where(sel, dec, out)
    return out


def rotated_pair_error(e: Tensor, positions: Tensor, ctx: LayerContext, prerope: bool) -> Tensor:
    """Query-weighted squared logit error per (batch, kv head, rotary pair), summed over the
    tokens: ``Σ_i (R_i e_i)_pair^T C_pair (R_i e_i)_pair`` with ``C`` the second moment of the
    rotated prefill queries (``ctx.query_cov``); ``e [B, H, T, D]`` in the codec's frame."""
    if prerope:
        e = rotate_by_delta(e.double(), positions.to(e.device), ctx.rotary)
    first, second = _pairs(ctx)
    ea, eb = e[..., first].double(), e[..., second].double()
    cov = ctx.query_cov
    caa = cov[:, first, first][None, :, None, :]
    cbb = cov[:, second, second][None, :, None, :]
    cab = cov[:, first, second][None, :, None, :]
    return (caa * ea**2 + cbb * eb**2 + 2 * cab * ea * eb).sum(-2)


class BitAllocKeys(Codec):
    """Per-channel min-max keys with a per-(kv head, rotary pair) bit width in
    ``0 .. max_bits`` (both channels of a pair get the same width), chosen once at prefill so
    that the layer's codes cost exactly ``avg_bits`` per element: greedy marginal allocation
    (reverse water-filling, e.g. Gersho & Gray 1992 §8.3) of the query-weighted squared logit
    error measured on the groups flushed at prefill (``rotated_pair_error``).

    Bytes: codes as ``avg_bits`` everywhere; 2 float16 scalars per channel and group (a
    0-bit channel needs only one: counted as two, an upper bound); the allocation table of
    3 bits per (kv head, pair) once per layer; optional sparse outliers as ``CartesianKeys``.
    """

    def __init__(
        self,
        prerope: bool = True,
        avg_bits: int = BITS,
        max_bits: int = 4,
        outliers: float = 0.0,
        criterion: str = "query",
        min_bits: int = 0,
        allow_1bit: bool = False,
    ) -> None:
        self.prerope, self.avg_bits, self.max_bits = prerope, avg_bits, max_bits
        self.outliers, self.criterion, self.min_bits = outliers, criterion, min_bits
        self.allow_1bit = allow_1bit
        self.name = f"alloc{min_bits}-{max_bits}-{'pre' if prerope else 'rot'}-{criterion}" + (
            f"+out{outliers:g}" if outliers else ""
        )

    def count(self, tokens: int, dim: int) -> int:
        return round(self.outliers * tokens * dim)

    def _decode_frame(self, y: Tensor, bits: Tensor) -> Tensor:
        n_out = self.count(y.shape[-2], y.shape[-1])
        if not n_out:
            return _decode_bits(y, bits, -2)
        mask = outlier_mask(y, n_out, -2)
        out = torch.empty_like(y)
        for b in bits.unique().tolist():
            sel = (bits == b).unsqueeze(-2)
            if b == 0:
                dec = torch.where(mask, y, y.double().mean(-2, keepdim=True).to(STORAGE).float())
            else:
                dec = minmax_sparse(y, int(b), -2, mask)
            out = torch.where(sel, dec, out)
        return out

    def prepare(self, ctx: LayerContext) -> None:
        keys, pos = ctx.prefill_keys, ctx.prefill_positions
        g = ctx.state["group_tokens"]
        b_, h, t_all, d = keys.shape
        p = d // 2
        first, second = _pairs(ctx)
        levels = [b for b in range(self.min_bits, self.max_bits + 1) if b != 1 or self.allow_1bit]
        dist = torch.zeros(len(levels), b_, h, p, dtype=torch.float64)
        for j in range(0, t_all, g):
            kg, pg = keys[:, :, j : j + g], pos[j : j + g]
            y = to_frame(kg, pg, ctx, self.prerope)
            for li, b in enumerate(levels):
                bits = torch.full((b_, h, d), b)
                e = self._decode_frame(y, bits) - y
                if self.criterion == "query":
                    dist[li] += rotated_pair_error(e, pg, ctx, self.prerope)
                else:
                    dist[li] += (e.double()[..., first] ** 2 + e.double()[..., second] ** 2).sum(-2)
        # greedy on gain per bit: each step moves one pair to its next allowed width
        lv = torch.tensor(list(levels))
        step_bits = (lv[1:] - lv[:-1]).double()  # [n-1]
        gain = (dist[:-1] - dist[1:]) / step_bits[:, None, None, None]  # [n-1, B, H, P]
        alloc = torch.zeros((b_, h, p), dtype=torch.long)  # index into levels
        budget = (self.avg_bits - self.min_bits) * h * p * 1.0
        top = len(levels) - 1
        for bi in range(b_):
            a, left = alloc[bi], budget
            while left > 0:
                idx = a.clamp(max=top - 1)
                cur = gain[:, bi].gather(0, idx.unsqueeze(0))[0]
                cost = step_bits[idx]
                ok = (a < top) & (cost <= left)
                if not bool(ok.any()):
                    break
                cur = torch.where(ok, cur, torch.full_like(cur, -math.inf))
                flat = int(cur.flatten().argmax())
                left -= float(cost.view(-1)[flat])
                a.view(-1)[flat] += 1
        alloc = lv[alloc] - self.min_bits
        bits = alloc + self.min_bits  # [B, H, P]
        per_channel = torch.empty(b_, h, d, dtype=torch.long)
        per_channel[..., first] = bits
        per_channel[..., second] = bits
        ctx.state[id(self)] = per_channel
        hist = torch.bincount(bits.flatten(), minlength=self.max_bits + 1)
        ctx.state.setdefault("bit_hist", []).append(hist.tolist())

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        y = to_frame(x, positions, ctx, self.prerope)
        bits = ctx.state[id(self)]
        return from_frame(self._decode_frame(y, bits), positions, ctx, self.prerope)

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        return (
            codes_bytes(tokens, heads, dim, self.avg_bits)
            + heads * dim * 2 * SCALAR
            + heads * self.count(tokens, dim) * OUTLIER
        )

    def layer_bytes(self, heads: int, dim: int) -> int:
        return math.ceil(heads * (dim // 2) * 3 / 8)


class PackageBitAllocKeys(BitAllocKeys):
    """:class:`BitAllocKeys` computed with the package's tested functions
    (:mod:`kvlab.pnmix.bitalloc`, :mod:`kvlab.pnmix.prerope`, :mod:`kvlab.pnmix.outliers`):
    the configuration the recommendation names. Same algorithm; outlier ties are broken by the
    package's stable float64 order."""

    def __init__(
        self,
        outliers: float = 0.0,
        widths: tuple[int, ...] = (0, 2, 3, 4),
        per_group: bool = False,
        moments: Tensor | None = None,
        per_head: bool = False,
        exact: bool = False,
    ) -> None:
        super().__init__(prerope=True, outliers=outliers)
        self.widths = widths
        self.per_group = per_group
        self.per_head = per_head
        self.exact = exact
        self.moments = moments  # [L, H_kv, D, D] static query second moments, or None
        self.name = (
            "pkg-"
            + self.name
            + ("-pergroup" if per_group else "")
            + ("-static" if moments is not None else "")
            + ("-perhead" if per_head else "")
            + ("-exact" if exact else "")
        )

    def _frame(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        from kvlab.pnmix.prerope import to_prerope

        return to_prerope(x, positions, ctx.rotary, STORAGE).float()

    def _decode_frame(self, y: Tensor, bits: Tensor) -> Tensor:
        from kvlab.pnmix.bitalloc import mixed_bits_quantize
        from kvlab.pnmix.outliers import sparse_minmax_dequantize, sparse_minmax_quantize

        n_out = self.count(y.shape[-2], y.shape[-1])
        if not n_out:
            return minmax_dequantize(*mixed_bits_quantize(y, bits, -2, STORAGE), dim=-2)
        out = torch.empty_like(y)
        for b in bits.unique().tolist():
            sel = (bits == b).unsqueeze(-2)
            if b == 0:
                sp = sparse_minmax_quantize(y, 1, n_out, STORAGE)
                mask = torch.zeros_like(y, dtype=torch.bool).flatten(-2)
                mask.scatter_(-1, sp.outlier_index.long(), True)
                if self.exact:  # the product: the mean of the tokens that are not outliers
                    kept = (~mask.view_as(y)).double()
                    total = (y.double() * kept).sum(-2, keepdim=True)
                    mean = (total / kept.sum(-2, keepdim=True).clamp(min=1.0)).to(STORAGE).float()
                else:
                    mean = y.double().mean(-2, keepdim=True).to(STORAGE).float()
                dec = torch.where(mask.view_as(y), y, mean)
            else:
                dec = sparse_minmax_dequantize(sparse_minmax_quantize(y, int(b), n_out, STORAGE))
            out = torch.where(sel, dec, out)
        return out

    def _allocate(self, groups, ctx: LayerContext) -> Tensor:
        """Per-channel widths ``[B, H, D]`` from the groups ``[(frame keys, positions)]``."""
        from kvlab.pnmix.bitalloc import allocate_pair_bits, pair_logit_error
        from kvlab.pnmix.prerope import from_prerope

        b_, h, _, d = groups[0][0].shape
        first, second = _pairs(ctx)
        dist = torch.zeros(len(self.widths), b_, h, d // 2, dtype=torch.float64)
        for y, pg in groups:
            for li, w in enumerate(self.widths):
                e = self._decode_frame(y, torch.full((b_, h, d), w)) - y
                if self.exact:  # the product's arithmetic: the error rotated in float64
                    rotated = rotate_by_delta(e.double(), pg.to(e.device), ctx.rotary)
                else:
                    rotated = from_prerope(e.double(), pg, ctx.rotary).double()
                moment = ctx.query_cov if self.moments is None else self.moments[ctx.layer_idx]
                dist[li] += pair_logit_error(rotated, moment, first, second)
        if self.per_head:  # one budget per kv head, as the product's BitAllocCodec
            flat = dist.reshape(len(self.widths), b_ * h, 1, d // 2)
            bits = allocate_pair_bits(flat, self.widths, self.avg_bits).reshape(b_, h, d // 2)
        else:
            bits = allocate_pair_bits(dist, self.widths, self.avg_bits)
        per_channel = torch.empty(b_, h, d, dtype=torch.long)
        per_channel[..., first] = bits
        per_channel[..., second] = bits
        hist = torch.bincount(bits.flatten(), minlength=self.max_bits + 1)
        ctx.state.setdefault("bit_hist", []).append(hist.tolist())
        return per_channel

    def prepare(self, ctx: LayerContext) -> None:
        if self.per_group:
            return
        keys, pos = ctx.prefill_keys, ctx.prefill_positions
        g = ctx.state["group_tokens"]
        groups = [
            (self._frame(keys[:, :, j : j + g], pos[j : j + g], ctx), pos[j : j + g])
            for j in range(0, keys.shape[2], g)
        ]
        ctx.state[id(self)] = self._allocate(groups, ctx)

    def decode(self, x: Tensor, positions: Tensor, ctx: LayerContext) -> Tensor:
        from kvlab.pnmix.prerope import from_prerope

        y = self._frame(x, positions, ctx)
        bits = self._allocate([(y, positions)], ctx) if self.per_group else ctx.state[id(self)]
        return from_prerope(self._decode_frame(y, bits), positions, ctx.rotary)

    def group_bytes(self, tokens: int, heads: int, dim: int) -> int:
        table = math.ceil(heads * (dim // 2) * 2 / 8) if self.per_group else 0
        return super().group_bytes(tokens, heads, dim) + table

    def layer_bytes(self, heads: int, dim: int) -> int:
        return 0 if self.per_group else math.ceil(heads * (dim // 2) * 2 / 8)
