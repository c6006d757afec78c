"""One exact forward of a calibration window's scored tokens, captured at every decoder layer,
then per-layer replays that run only the layers a perturbation can change.

Both per-layer calibrations (PN-Mix's group sizes, :mod:`kvlab.integrations.pnmix_calibration`;
the eviction budgets, :mod:`kvlab.integrations.relay_calibration`) measure, for every decoder
layer ``l`` and candidate ``c``, ``KL(full || perturbed)`` of the ``S`` scored tokens'
next-token distributions when **only** layer ``l``'s cached prefix is perturbed. The scored
tokens' hidden states entering layers ``0 .. l`` are then exactly those of the unperturbed
forward: :func:`capture_layer_inputs` records them once (one forward, hooks on every decoder
layer), and :func:`start_at_layer` makes a later forward skip layers ``0 .. l-1`` (each returns
its input; the last one returns the captured input of layer ``l``), so a measurement costs
``L - l`` decoder layers and the head instead of ``L`` layers and the head (about half over all
layers). The layers that run see the same inputs, caches and kernels as in a full forward, so
the logits are bit-identical to the full forward's
(``tests/integrations/test_calibration_capture.py``).

Batched candidates (:func:`layer_output`, ``start_at_layer(model, l + 1, stacked)``): only
layer ``l`` differs between a layer's candidates (its perturbed cache); its output for each
candidate is taken alone (:func:`layer_output` stops the forward after layer ``l``), and layers
``l+1 .. L-1`` and the head then run once for all ``C`` candidates stacked along the batch
dimension over exact caches (``[C, S, hidden]``): the same flops, one forward per layer instead
of ``C``, and larger matrix products. On one CPU thread every row of those products is the
batch-1 row to the bit (``tests/integrations/test_calibration_capture.py``; oneDNN/MKL may split
differently with more threads, a change in the last bits).

Scaled measure (:func:`layer_sensitivities` with ``measure="scaled"``, the calibrations'
default): the downstream layers and the head, which dominate the cost (on Qwen2.5-0.5B the head
alone is 35 GFLOP per candidate over 128 tokens), run for **one** candidate per layer. Every
candidate's layer output ``o_c`` is computed (one decoder layer each) and so is the exact one
``o``; the candidate whose squared error ``e_c = ||o_c - o||^2`` (float64, summed over tokens
and channels) is the geometric middle of the layer's errors is measured exactly, ``KL_r``, and
the others are scaled by their error, ``KL_c = KL_r * e_c / e_r``. For a small perturbation the
KL is a quadratic form in it (its second-order Taylor expansion: the Fisher information of the
next-token distribution, pulled back through the later layers), so within one layer, where the
candidates perturb the same states in the same way at different strengths, the ratio of
squared errors estimates the ratio of KLs, and the exact measurement of one candidate carries
the scale that differs by orders of magnitude between layers. The error of the estimate is
measured against the exact measure on the real models (docs/archive/results-history.md,
section 11.2, "The scaled measure: one exact candidate per layer").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "MEASURES",
    "ExactDistribution",
    "capture_layer_inputs",
    "decoder_layers",
    "later_layers",
    "layer_output",
    "layer_sensitivities",
    "start_at_layer",
]

#: How :func:`layer_sensitivities` measures a layer's candidates (module docstring).
MEASURES = ("exact", "scaled")


def decoder_layers(model: Any) -> nn.ModuleList:
    """The model's decoder layers: the ``nn.ModuleList`` named ``...layers`` holding
    ``num_hidden_layers`` modules (``model.model.layers`` for Llama/Qwen2-style models).

    Raises:
        ValueError: no such list, or several.
    """
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    found = [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and name.rsplit(".", 1)[-1] == "layers"
        and len(module) == count
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected one ModuleList 'layers' of {count} decoder layers, found {len(found)}"
        )
    return found[0]


def _hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, Tensor):
        raise TypeError("a decoder layer was called without a hidden_states tensor")
    return hidden


@contextlib.contextmanager
def capture_layer_inputs(model: Any) -> Iterator[list[Tensor]]:
    """Record the hidden states entering every decoder layer during the forwards run inside.

    Yields:
        a list filled with one tensor per decoder layer, in layer order (``[B, Q, hidden]``,
        the model's dtype), by the first forward run in the block (later forwards are not
        recorded).
    """
    layers = decoder_layers(model)
    captured: list[Tensor] = []

    def hook(index: int) -> Callable[..., None]:
        def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if len(captured) == index:
                captured.append(_hidden_of(args, kwargs).detach())

        return record

    handles = [
        layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def start_at_layer(model: Any, layer: int, hidden: Tensor | None) -> Iterator[None]:
    """Forwards inside skip decoder layers ``0 .. layer-1``: each returns its input, except
    layer ``layer - 1``, which returns ``hidden`` (the captured input of layer ``layer``,
    ``[B, Q, hidden]``). ``layer == 0`` changes nothing (``hidden`` is then ignored);
    ``layer == L`` skips every decoder layer (``hidden`` then enters the final norm and the
    head: the output of the last layer).

    Skipped layers neither compute nor touch their cache layer. Decoder layers must return
    their hidden states tensor (``transformers`` 5.x).

    Raises:
        ValueError: ``layer`` outside ``0 .. L``, or ``hidden`` missing for ``layer > 0``.
    """
    layers = decoder_layers(model)
    if not 0 <= layer <= len(layers):
        raise ValueError(f"layer must lie in 0..{len(layers)}, got {layer}")
    if layer == 0:
        yield
        return
    if hidden is None:
        raise ValueError("start_at_layer needs the captured hidden states for layer > 0")

    def skip(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states

    def jump(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if hidden_states.shape != hidden.shape:
            raise ValueError(
                f"captured hidden states {tuple(hidden.shape)} do not match this forward's "
                f"{tuple(hidden_states.shape)}"
            )
        return hidden

    patched = list(layers[:layer])
    saved = [module.__dict__.get("forward") for module in patched]
    for i, module in enumerate(patched):
        module.forward = jump if i == layer - 1 else skip  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module, forward in zip(patched, saved, strict=True):
            if forward is None:
                del module.forward  # back to the class's forward
            else:
                module.forward = forward  # type: ignore[method-assign]


class _Stopped(Exception):
    """Raised by :func:`layer_output`'s hook to end a forward after the layer it wants."""


def layer_output(
    model: Any, layer: int, hidden: Tensor | None, forward: Callable[[], Any]
) -> Tensor:
    """The output of decoder layer ``layer`` in ``forward()`` (a call of ``model``), run from
    ``hidden``, the captured input of that layer (:func:`start_at_layer`); the forward stops
    after that layer, so the later layers and the head never run (their cache layers are not
    touched).

    Returns:
        ``[B, Q, hidden]`` in the model's dtype, what the layer returned (bit for bit the
        tensor a full forward passes to layer ``layer + 1``).

    Raises:
        ValueError: ``layer`` outside ``0 .. L-1``, or what :func:`start_at_layer` raises.
        RuntimeError: ``forward()`` returned without running that layer.
    """
    layers = decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must lie in 0..{len(layers) - 1}, got {layer}")
    output: list[Tensor] = []

    def stop(module: Any, args: Any, result: Any) -> None:
        output.append(result[0] if isinstance(result, tuple) else result)
        raise _Stopped

    handle = layers[layer].register_forward_hook(stop)
    try:
        with start_at_layer(model, layer, hidden), contextlib.suppress(_Stopped):
            forward()
    finally:
        handle.remove()
    if not output:
        raise RuntimeError(f"the forward did not run decoder layer {layer}")
    return output[0]


class ExactDistribution:
    """The unperturbed next-token distributions ``p`` of ``S`` scored tokens, ready to measure
    ``KL(p || q)`` against many perturbed ``q`` (:meth:`kl`).

    Args:
        logits: ``[S, V]`` logits of the unperturbed forward (any float dtype).
    """

    def __init__(self, logits: Tensor) -> None:
        self.logprobs = torch.log_softmax(logits.double(), dim=-1)  # float64 [S, V]
        self.probs = self.logprobs.exp()
        self._neg_entropy = (self.probs * self.logprobs).sum(-1)  # sum_v p log p, [S]
        self._mass = self.probs.sum(-1)  # sum_v p (1 up to rounding), [S]

    def kl(self, logits: Tensor, *, clamp: bool = False) -> float:
        """Mean over the ``S`` tokens of ``KL(p || softmax(logits))`` in nats.

        ``logits``: ``[S, V]`` (any float dtype, read in float64). Per token ``KL = sum_v p log p
        - sum_v p z_v + (sum_v p) logsumexp(z)``, which equals ``sum_v p (log p - log_softmax(z))``
        (what the calibrations computed before) up to float64 rounding (about 1e-14 nats at
        SmolLM2's vocabulary), in fewer passes over the vocabulary. ``clamp`` clips each
        token's KL at 0 before the mean (rounding can make a near-zero KL negative).

        Raises:
            ValueError: ``logits`` not shaped like the exact logits.
        """
        if logits.shape != self.logprobs.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} must be shaped {tuple(self.logprobs.shape)}"
            )
        z = logits.double()
        cross = torch.einsum("sv,sv->s", self.probs, z)
        kl = self._neg_entropy - cross + torch.logsumexp(z, dim=-1) * self._mass
        if clamp:
            kl = kl.clamp_min(0.0)
        return float(kl.mean())


def layer_sensitivities(
    model: Any,
    layer: int,
    hidden: Tensor | None,
    exact: ExactDistribution,
    forwards: Sequence[Callable[[], Tensor]],
    unperturbed: Callable[[], Tensor],
    downstream: Callable[[Tensor], Tensor],
    *,
    measure: str = "exact",
    batch_candidates: bool = True,
    clamp: bool = False,
) -> list[float]:
    """Mean ``KL(full || candidate)`` in nats of the scored tokens, for each of a layer's
    candidates (module docstring).

    Args:
        model: the model the calibration runs.
        layer: the decoder layer perturbed.
        hidden: the captured input of that layer, ``[1, S, hidden]`` (:func:`capture_layer_inputs`).
        exact: the unperturbed distributions of the ``S`` scored tokens.
        forwards: per candidate, a forward of the scored tokens with that candidate's caches
            returning the logits ``[S, V]`` (it runs from ``hidden`` inside
            :func:`start_at_layer` / :func:`layer_output`).
        unperturbed: the same forward over exact caches (for the exact layer output; the
            scaled measure only).
        downstream: layer outputs ``[C, S, hidden]`` -> logits ``[C, S, V]`` through layers
            ``layer + 1 ..`` and the head over exact caches (``start_at_layer(model, layer + 1,
            stacked)``).
        measure: ``"exact"`` (every candidate through the later layers and the head) or
            ``"scaled"`` (one candidate; the others scaled by their layer-output error).
        batch_candidates: exact measure only: the candidates' later layers run once, stacked
            along the batch; ``False``: one forward per candidate from ``layer``.
        clamp: clip each token's KL at 0 (:meth:`ExactDistribution.kl`).

    Returns:
        one KL per candidate, in the order of ``forwards``.

    Raises:
        ValueError: ``measure`` not in :data:`MEASURES`, or no candidates.
    """
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if not forwards:
        raise ValueError("layer_sensitivities needs at least one candidate")
    if measure == "exact" and not batch_candidates:
        with start_at_layer(model, layer, hidden):
            return [exact.kl(forward(), clamp=clamp) for forward in forwards]
    outputs = [layer_output(model, layer, hidden, forward) for forward in forwards]
    if measure == "exact":
        logits = downstream(torch.cat(outputs))
        return [exact.kl(z, clamp=clamp) for z in logits]
    base = layer_output(model, layer, hidden, unperturbed).double()
    errors = [float((out.double() - base).pow(2).sum()) for out in outputs]
    del base
    moved = [i for i, e in enumerate(errors) if e > 0.0]
    if not moved:  # no candidate changes the layer's output: the forward is the exact one
        return [0.0] * len(errors)
    middle = sum(math.log(errors[i]) for i in moved) / len(moved)
    ref = min(moved, key=lambda i: abs(math.log(errors[i]) - middle))
    ref_kl = exact.kl(downstream(outputs[ref])[0], clamp=clamp)
    return [ref_kl * e / errors[ref] for e in errors]


def later_layers(
    model: Any,
    layer: int,
    tail: Tensor,
    positions: Tensor,
    exact_cache: Callable[[int], Any],
    attention: str = "kvlab",
) -> Callable[[Tensor], Tensor]:
    """The ``downstream`` of :func:`layer_sensitivities`: layer outputs ``[C, S, hidden]`` ->
    logits ``[C, S, V]`` of the scored tokens ``tail`` (``[1, S]`` ids at ``positions``,
    ``[1, S]``) through layers ``layer + 1 ..`` and the head, over ``exact_cache(C)`` (the
    exact prefix, ``C`` rows) under attention implementation ``attention``."""
    from kvlab.integrations.attention import use_attention

    def run(stacked: Tensor) -> Tensor:
        rows = stacked.shape[0]
        with start_at_layer(model, layer + 1, stacked), use_attention(model, attention):
            return model(
                tail.expand(rows, -1),
                cache=exact_cache(rows),
                position_ids=positions.expand(rows, -1),
                use_cache=True,
            ).logits

    return run
