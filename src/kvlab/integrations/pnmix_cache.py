"""PN-Mix as a ``transformers`` cache: one :class:`kvlab.pnmix.PNMixCache` per decoder layer.

``PNMixModelCache(model.config, PNMixConfig(...))`` is a ``transformers.Cache`` usable as
``model(..., cache=cache)`` and in ``model.generate(..., cache=cache)``, including a second
``generate`` that continues the same conversation. Switch the model to the ``"kvlab"``
attention first: :func:`kvlab.integrations.enable_kvlab_attention`.

Per forward and layer (docs/design.md, "Model integration"): ``update`` stashes the new
(already rotated) keys and values and returns a :class:`PNMixView`; the ``"kvlab"`` attention
function hands the view the query and the 2-D attention mask, and the view commits the stash
to the layer's PN-Mix storage — dropping padding, flushing groups — then attends with
:func:`kvlab.pnmix.pnmix_attention`, which reads the packed codes directly. The one exception
is the prefill (the first forward into an empty cache, more than one token): by default it
attends to its freshly computed keys and values exactly and stores them packed, as
``transformers``' ``QuantizedCache`` and KIVI do (``exact_prefill=False`` makes the prefill read
its own codes too).

Padded batches (left padding, a 2-D ``attention_mask``): the new part of each row's mask must
be zeros then ones (real tokens right-aligned); pads are never stored, never enter a group, the
mix saliency or a score, and each row's storage, and its logits given its own
``position_ids``, equal the row run alone. ``get_seq_length()`` counts token columns seen,
pads included — what ``transformers`` uses to align the next mask and cache positions.

Checks and host syncs: every input check (shapes, dtypes, mask format and lengths) runs in the
first layer before any layer stores anything. A multi-token forward reads its mask once (one
host sync) and checks values eagerly; a single-token forward (decode) reads nothing back from
the device: its value checks and mask check are recorded on the device and raised by
:meth:`PNMixModelCache.check_values` (or the next multi-token forward).

Beam search: ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
row-select every buffer and count with :meth:`PNMixCache.select_batch`; nothing is
re-quantized, so a reorder is bit-exact.

Speculative decoding (``generate(assistant_model=...)``, prompt lookup; docs/design.md "Cache
life cycle"): once ``transformers`` calls :meth:`PNMixModelCache.activate_past_recording`, the
tokens after the prompt's end (the ``generate`` call's, or
:meth:`PNMixModelCache.expect_prompt`'s) are stored with the bytes of one-token decode steps,
an undo entry each, and attend in one call with their numbers
(:mod:`kvlab.integrations.decode_steps`); ``crop(-r)`` removes the last forward's last ``r``
such tokens byte for byte (groups they flushed are un-flushed); codes already written are
never rewritten. The recording ends with the ``generate`` call.

Per-layer group sizes: ``layer_group_tokens`` gives each decoder layer its own
``group_tokens`` (everything else as ``config``), e.g. an allocation from
:func:`kvlab.integrations.pnmix_calibration.calibrate_group_tokens`.

Position-aware (pre-RoPE) key codings: every full-attention layer gets the model's RoPE
(:func:`kvlab.integrations.model_support.layer_rotary`); a full-attention layer without RoPE
(NoPE) codes its keys in their own frame, which is position 0 already
(:meth:`kvlab.pnmix.codecs.KeyCodec.without_positions`). A token's position is its row's
stream index (plus the row's offset, 0 unless a relay sets it): what ``generate`` gives
left-padded rows. Query-aware per-pair tables read the queries of the forward that computes
them (the view hands them to the commit; docs/design.md, "Per-pair tables").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvlab.integrations.model_cache import KVLabModelCache
from kvlab.integrations.model_support import layer_rotary, plan_model
from kvlab.integrations.pnmix_layer import PNMixLayer, PNMixState, PNMixView
from kvlab.pnmix import PNMixCache, PNMixConfig
from kvlab.pnmix.kernels.dispatch import requested_backend

__all__ = [
    "PNMixLayer",
    "PNMixModelCache",
    "PNMixView",
    "check_pnmix_fits_model",
    "pnmix_config_for_model",
    "sum_backends",
]


def pnmix_config_for_model(model_config: Any, base: PNMixConfig | None = None) -> PNMixConfig:
    """``base`` (default ``PNMixConfig()``) with ``rotary_dim`` and ``rotary_layout`` taken from
    the RoPE of the model's full-attention layers
    (:func:`kvlab.integrations.model_support.layer_rotary`), so that Phase–Norm pairs are the
    model's true rotary pairs (partial rotary and interleaved layouts included).

    Raises:
        ValueError: the config has no supported RoPE (see ``RotaryConfig.from_hf_config``).
    """
    base = base or PNMixConfig()
    rotary = layer_rotary(model_config)  # model-matrix: per-layer-type RoPE (Gemma 3)
    return dataclasses.replace(base, rotary_dim=rotary.rotary_dim, rotary_layout=rotary.layout)


def sum_backends(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Per-backend call counts summed over layers, backends in name order."""
    total: dict[str, int] = {}
    for one in counts:
        for backend, calls in one.items():
            total[backend] = total.get(backend, 0) + calls
    return dict(sorted(total.items()))


def check_pnmix_fits_model(text_config: Any, config: PNMixConfig) -> None:
    """Build an empty one-row :class:`~kvlab.pnmix.PNMixCache` of the model's head shape
    (``num_key_value_heads``, ``head_dim`` or ``hidden_size / num_attention_heads``, its RoPE for
    a position-aware key codec), so that a configuration PN-Mix refuses for this model fails
    when a model cache is built, not inside the first forward.

    Raises:
        ValueError: what ``PNMixCache`` raises for that shape (e.g. ``value_group_channels``
            not dividing the head_dim, Hadamard values at a head_dim that is no power of two).
    """
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    PNMixCache(
        config,
        batch_size=1,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary=layer_rotary(text_config) if config.key_codec.position_aware else None,
    )


class PNMixModelCache(KVLabModelCache):
    """A ``transformers`` cache holding every decoder layer in PN-Mix form.

    Args:
        model_config: the model's ``PretrainedConfig`` (number of layers, RoPE).
        config: the PN-Mix configuration; ``rotary_dim``/``rotary_layout`` are overridden from
            the model's RoPE unless ``match_rotary=False``.
        match_rotary: see ``config``.
        exact_prefill: the first forward (the prefill) attends to its own keys and values
            exactly; every later forward reads the packed storage (see :class:`PNMixView`).
        layer_group_tokens: one ``group_tokens`` per decoder layer (tokens); ``None`` = every
            layer uses ``config.group_tokens``.

    Sliding-window and chunked layers (Mistral, Gemma 2/3, GPT-OSS, ...) are not compressed:
    each keeps exactly its last ``window - 1`` tokens
    (:class:`kvlab.integrations.model_support.WindowLayer`); the full-attention layers hold
    PN-Mix. ``plan`` is the :class:`~kvlab.integrations.model_support.ModelPlan` used.

    Raises:
        ValueError: a model :func:`kvlab.integrations.model_support.plan_model` marks
            unsupported (linear-attention or KV-sharing layers, latent attention), a RoPE that
            :class:`kvlab.rope.RotaryConfig` does not support, ``layer_group_tokens`` of the
            wrong length or with a value PNMixConfig rejects, a configuration PN-Mix refuses
            at the model's head shape (:func:`check_pnmix_fits_model`), or an unknown
            ``KVLAB_PNMIX_BACKEND`` (:func:`kvlab.pnmix.kernels.dispatch.requested_backend`).
    """

    kind: ClassVar[str] = "PN-Mix"

    def __init__(
        self,
        model_config: Any,
        config: PNMixConfig | None = None,
        *,
        match_rotary: bool = True,
        exact_prefill: bool = True,
        layer_group_tokens: Sequence[int] | None = None,
    ) -> None:
        text_config = model_config.get_text_config(decoder=True)
        # model-matrix: refuse unsupported models before any layer exists (one line, every
        # reason); full-attention layers hold PN-Mix, sliding/chunked layers only their window.
        plan = plan_model(text_config)
        plan.check(type(self).__name__)
        requested_backend("auto")  # the layers build their PNMixCache at the first token
        config = config or PNMixConfig()
        if match_rotary:
            config = pnmix_config_for_model(text_config, config)
        check_pnmix_fits_model(text_config, config)
        self.pnmix_config = config
        n_layers = text_config.num_hidden_layers
        groups = [config.group_tokens] * n_layers
        if layer_group_tokens is not None:
            groups = list(layer_group_tokens)
            if len(groups) != n_layers:
                raise ValueError(
                    f"layer_group_tokens has {len(groups)} entries; the model has {n_layers} layers"
                )
        self.layer_group_tokens = tuple(groups)
        # window layers (WindowLayer) keep their window exactly, as transformers does; their
        # layer_group_tokens entries are unused. PN-Mix layers share one forward state.
        self.plan = plan
        shared = PNMixState()
        codec = config.key_codec
        rotary = layer_rotary(text_config) if codec.position_aware else None

        def full_layer(i: int) -> PNMixLayer:
            layer_config = dataclasses.replace(config, group_tokens=groups[i])
            uses_rope = plan.layers[i].uses_rope
            if codec.position_aware and not uses_rope:  # NoPE: its keys are position-0 keys
                layer_config = dataclasses.replace(
                    layer_config, key_coding=codec.without_positions(), key_outlier_fraction=0.0
                )
            return PNMixLayer(
                layer_config, exact_prefill, shared, rotary if uses_rope else None, layer_idx=i
            )

        super().__init__(plan.build_layers(full_layer), shared)

    def storage_report(self) -> dict[str, int]:
        """Bytes by component, summed over layers (see :meth:`PNMixCache.nbytes`)."""
        total: dict[str, int] = {}
        for layer in self.layers:
            if getattr(layer, "store", None) is not None:  # model-matrix: skip window layers
                for name, value in layer.store.nbytes().items():
                    total[name] = total.get(name, 0) + value
        return total

    def attention_calls(self) -> int:
        """Packed-attention calls over all layers (each reads codes, never a dequantized copy)."""
        stores = [getattr(layer, "store", None) for layer in self.layers]  # window layers: None
        return sum(0 if store is None else store.attention_calls for store in stores)

    def attention_backends(self) -> dict[str, int]:
        """Packed-attention calls over all layers by the backend that ran them."""
        stores = [getattr(layer, "store", None) for layer in self.layers]  # window layers: None
        return sum_backends(store.attention_backends for store in stores if store is not None)

    # ---------------- evaluation protocol (kvlab.integrations.cache_protocol.KVLabCache)
    def details(self) -> dict[str, Any]:
        """``{"packed_attention_calls": ..., "packed_attention_backends": {backend: calls}}``
        (:meth:`attention_calls`, :meth:`attention_backends`: whether the compiled kernels or
        the torch reference attended)."""
        return {
            "packed_attention_calls": self.attention_calls(),
            "packed_attention_backends": self.attention_backends(),
        }
