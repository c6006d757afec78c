"""kvlab.integrations.forward: the shared stash, checks and plan of a forward through the
evicting layers (used by RelayLayer and ComposedLayer)."""

from __future__ import annotations

import pytest
import torch

from kvlab.integrations.forward import (
    Pending,
    StoredShape,
    check_states,
    leading_zeros,
    plan_decode,
    plan_forward,
)


def _pending(batch: int = 2, tokens: int = 4, position_ids=None) -> Pending:
    keys = torch.zeros(batch, 2, tokens, 8)
    return Pending(keys, torch.zeros(batch, 2, tokens, 6), position_ids)


def test_check_states_names_what_differs():
    keys, values = torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 6)
    check_states(keys, values, 0)
    with pytest.raises(ValueError, match=r"must be \[B, H_kv, T, D\]"):
        check_states(keys[0], values, 0)
    stored = StoredShape(2, 2, 8, 6, torch.float32, torch.device("cpu"))
    check_states(keys, values, 1, stored)
    with pytest.raises(ValueError, match=r"layer 1 stores \[B, H_kv, D, Dv\] = \(2, 2, 8, 6\)"):
        check_states(keys[:1], values[:1], 1, stored)
    with pytest.raises(ValueError, match=r"layer 3 takes torch\.float32, got torch\.float64"):
        taking = StoredShape(2, 2, 8, 6, torch.float32, torch.device("cpu"), dtype_verb="takes")
        check_states(keys.double(), values.double(), 3, taking)


def test_plan_forward_reads_left_padding_and_the_rope_shift():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    plan = plan_forward(
        _pending(), mask, {}, seen=0, stream=[0, 0], nexts=[0, 0], padding=[0, 0], forward_index=0
    )
    assert plan.real == [4, 2] and plan.padded and plan.first_eviction == []
    # transformers' default positions count the padding columns: row 1 shifts back by 2
    assert plan.shift is not None and plan.shift.view(-1).tolist() == [0, -2]
    with pytest.raises(ValueError, match="zero after a one"):
        plan_forward(
            _pending(),
            torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]),
            {},
            seen=0,
            stream=[0, 0],
            nexts=[0, 0],
            padding=[0, 0],
            forward_index=0,
        )
    ids = torch.tensor([[7, 8, 9, 10]])
    plan = plan_forward(
        _pending(position_ids=ids),
        None,
        {},
        seen=6,
        stream=[6, 6],
        nexts=[3, 5],
        padding=[0, 0],
        forward_index=2,
    )
    assert plan.real == [4, 4] and plan.forward_index == 2
    assert plan.shift is not None and plan.shift.view(-1).tolist() == [-4, -2]
    with pytest.raises(ValueError, match="consecutive position_ids"):
        plan_forward(
            _pending(position_ids=torch.tensor([[0, 1, 3, 4]])),
            None,
            {},
            seen=0,
            stream=[0, 0],
            nexts=[0, 0],
            padding=[0, 0],
            forward_index=0,
        )


def test_plan_decode_reads_the_mask_and_refuses_a_bad_one():
    kwargs = dict(seen=3, nexts=[3, 3], padding=[1, 0], forward_index=5)
    good = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    plan = plan_decode(_pending(tokens=1), good, {}, **kwargs)
    assert plan.real == [1, 1] and plan.shift is None and plan.forward_index == 5
    for bad in (
        torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]),  # row 1: its new token as padding
        torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1]]),  # row 0: a hole in a past position
        torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]]),  # row 0: its stored padding as real
    ):
        with pytest.raises(ValueError, match="hole in a past position"):
            plan_decode(_pending(tokens=1), bad, {}, **kwargs)
    with pytest.raises(ValueError, match=r"position_ids \[1 or B, 1\]"):
        plan_decode(
            _pending(tokens=1, position_ids=torch.zeros(1, 2, dtype=torch.int64)),
            None,
            {},
            **kwargs,
        )


def test_leading_zeros():
    assert leading_zeros([0, 0, 1, 0]) == 2 and leading_zeros([]) == 0
