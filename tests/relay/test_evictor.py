"""The torch-only eviction modules (kvlab.relay.config / evictor / reconstruction / policies):
no transformers import, the config's scorer resolved once, scorers and policies round-trip
through their one settings shape, and the Evictor's budget rules."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_llama_config

from kvlab.relay import SCORERS, EvictionConfig, Evictor, get_scorer, scorer_from_settings
from kvlab.relay.policies import (
    DEFAULT_POLICIES,
    EvictionPolicy,
    default_policy,
    default_policy_settings,
    eviction_policy,
)
from kvlab.relay.reconstruction import split_by_scores
from kvlab.rope import RotaryConfig


def test_the_eviction_modules_import_no_transformers():
    code = (
        "import sys\n"
        "import kvlab.relay.config, kvlab.relay.evictor, kvlab.relay.reconstruction\n"
        "import kvlab.relay.policies\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_integrations_reexport_the_same_config():
    from kvlab import integrations
    from kvlab.integrations import relay_cache

    assert integrations.EvictionConfig is relay_cache.EvictionConfig is EvictionConfig
    assert integrations.EvictionEvent is relay_cache.EvictionEvent


def test_the_scorer_is_resolved_once_and_kept_out_of_the_fields():
    config = EvictionConfig(ratio=0.5, scorer="keynorm")
    assert config.resolved_scorer is config.resolved_scorer
    assert config.resolved_allocation == "adaptive"
    assert set(vars(config)) == {f.name for f in dataclasses.fields(config)}
    assert EvictionConfig(**vars(config)) == config
    copy = dataclasses.replace(config, ratio=0.25)
    assert copy.resolved_scorer.name == "keynorm"
    assert EvictionConfig(capacity=40, scorer="recency").resolved_allocation == "uniform"
    with pytest.raises(ValueError, match="unknown scorer"):
        EvictionConfig(ratio=0.5, scorer="oracle")


def test_every_layer_reads_the_configs_scorer():
    from kvlab.integrations import RelayModelCache

    config = EvictionConfig(ratio=0.5, scorer="snapkv")
    cache = RelayModelCache(tiny_llama_config(), config)
    assert all(layer.evictor.scorer is config.resolved_scorer for layer in cache.layers)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_scorers_round_trip_through_their_settings(name):
    scorer = get_scorer(name)
    again = scorer_from_settings(name, scorer.settings())
    assert again == scorer and repr(again) == repr(scorer)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_policies_have_one_settings_shape(name):
    settings = default_policy_settings(name)
    policy = EvictionPolicy.from_settings(settings)
    assert policy == eviction_policy(name) and policy.settings() == settings
    kwargs = default_policy(name)
    assert repr(kwargs) == repr(policy.kwargs())
    EvictionConfig(ratio=0.5, **kwargs)  # a valid configuration
    if "scorer_options" in settings:
        assert kwargs["scorer"] == scorer_from_settings(name, settings["scorer_options"])
    with pytest.raises(ValueError, match="not eviction policy settings"):
        EvictionPolicy.from_settings({**settings, "ratio": 0.5})


def test_default_policies_keep_their_recorded_settings():
    assert DEFAULT_POLICIES["snapkv"].settings() == {
        "scorer": "snapkv",
        "scorer_options": {"kernel_size": 7, "pooling": "max", "value_norm": True},
        "window_fraction": 0.75,
    }
    assert default_policy_settings("expected-attention") == {
        "scorer": "expected-attention",
        "window_tokens": 0,
    }
    assert default_policy_settings("recency") == {"scorer": "recency"}


def _evictor(**settings) -> Evictor:
    rotary = RotaryConfig(head_dim=16)
    return Evictor(EvictionConfig(**settings), rotary, layer_idx=0)


def test_the_protected_window_follows_the_budget():
    assert _evictor(ratio=0.5, window_tokens=8).protected_window(40) == 8
    ev = _evictor(ratio=0.5, window_fraction=0.5, sink_tokens=4)
    assert ev.protected_window(40) == 20
    assert ev.protected_window(6) == 2  # capped at per_head - sink_tokens
    assert ev.observation_tokens(20) == 20
    assert _evictor(ratio=0.5, observation_tokens=3).observation_tokens(20) == 3


def test_layer_budgets_keep_the_total():
    ev = _evictor(ratio=0.5, layer_budget="pyramid", pyramid_beta=4.0, window_tokens=2)
    ev.num_layers = 4
    budgets = ev.layer_budgets(100, 100)
    assert sum(budgets) == 4 * 50 and budgets == sorted(budgets, reverse=True)
    capacity = _evictor(capacity=16, window_tokens=4)
    assert capacity.layer_budget([30, 20]) == (16, 32)


def test_an_impossible_first_eviction_is_refused_up_front():
    ev = _evictor(ratio=0.5, sink_tokens=8, window_tokens=16)
    with pytest.raises(ValueError, match="cannot evict after the 20-token prefill of row 3"):
        ev.check_first_eviction(20, 2, 3)
    ev.check_first_eviction(64, 2, 0)


def test_split_by_scores_keeps_the_budget():
    keys = [torch.tensor([5.0, 1.0, float("inf")]), torch.tensor([4.0, 3.0, 2.0, 0.0])]
    assert split_by_scores(keys, 4, 1.0) == [2, 2]
    assert sum(split_by_scores(keys, 5, 0.5)) == 5
