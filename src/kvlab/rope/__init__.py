"""Rotary position embeddings (RoPE): configuration, rotation and relay-by-delta.

RoPE (RoFormer; Su et al. 2021, arXiv:2104.09864) splits the first ``rotary_dim`` channels of
every query/key head into ``P = rotary_dim / 2`` pairs ``(x_a, x_b)`` and rotates pair ``i`` by
the angle ``position * inv_freq[i]``::

    y_a = x_a * cos(theta) - x_b * sin(theta)
    y_b = x_a * sin(theta) + x_b * cos(theta)

with ``inv_freq[i] = base ** (-2i / rotary_dim)`` (before any context-extension scaling).
Rotations compose additively in the angle, so a key already rotated at position ``p`` and then
rotated by ``p' - p`` equals the raw key rotated at ``p'``: the identity RoPE-Relay rests on
(see :mod:`kvlab.relay`).

Conventions follow Hugging Face ``transformers`` (5.x):

* ``layout="half"``: pair ``i`` is channels ``(i, i + rotary_dim/2)`` (GPT-NeoX / Llama
  ``rotate_half``); ``layout="interleaved"``: pair ``i`` is channels ``(2i, 2i + 1)`` (GPT-J
  ``rotate_every_two``).
* Partial rotary (``rotary_dim < head_dim``, HF ``partial_rotary_factor``): only the first
  ``rotary_dim`` channels rotate; channels ``rotary_dim .. head_dim - 1`` are returned
  bit-identical.
* Scaling (``rope_parameters`` / legacy ``rope_scaling``): ``"linear"``, ``"llama3"`` and
  ``"yarn"`` with exactly HF's parameter names and formulas, transcribed from
  ``transformers/modeling_rope_utils.py`` (``_compute_linear_scaling_rope_parameters``,
  ``_compute_llama3_parameters``, ``_compute_yarn_parameters``), but evaluated in float64.

Numerics: angles are formed and their cos/sin evaluated in float64 (positions can be large);
the rotation itself runs in float32 (float64 for float64 inputs) and the result is cast back
to the input dtype. For float32 rotation and ``|position| <= 2**24`` (about 1.7e7 tokens) each
rotated output component differs from the exact rotation (by the angle
``position * inv_freq`` with this module's float64 ``inv_freq``) by at most
``ROTATION_ERROR_BOUND * ||(x_a, x_b)||`` with ``ROTATION_ERROR_BOUND = 4 * 2**-24``
(about 2.4e-7): 3 float32 roundings (cos/sin storage, products, sum) plus at most
``|position| * inv_freq * 2**-53 <= 2**-29`` rad of float64 angle error. Outputs in float16 or
bfloat16 add one rounding to that dtype.

Modules: :mod:`kvlab.rope.config` (:class:`RotaryConfig`: the pair layouts, partial rotary and
the ``transformers`` config reader), :mod:`kvlab.rope.scaling` (HF scaling dicts and the inverse
frequencies they give) and :mod:`kvlab.rope.rotation` (the rotation, its error bound and the
cos/sin tables); every public name is importable from ``kvlab.rope``.
"""

from __future__ import annotations

from kvlab.rope.config import Layout, RotaryConfig
from kvlab.rope.rotation import (
    ROTATION_ERROR_BOUND,
    apply_rotary,
    rotate_by_delta,
    rotation_tables,
)

__all__ = [
    "ROTATION_ERROR_BOUND",
    "Layout",
    "RotaryConfig",
    "apply_rotary",
    "rotate_by_delta",
    "rotation_tables",
]
