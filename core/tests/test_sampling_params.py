"""SamplingParams: defaults, normalisation and validation messages."""

from __future__ import annotations

import pytest

from inference_engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, None, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.is_greedy and not p.has_penalties


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=[]).stop is None


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False)])
def test_tiny_temperature_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_max_tokens_none_means_until_context_limit():
    assert SamplingParams(max_tokens=None, min_tokens=3).max_tokens is None


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], extra_args={"k": [1]})
    q = p.clone()
    q.stop.append("y")
    q.extra_args["k"].append(2)
    assert p.stop == ["x"] and p.extra_args == {"k": [1]}


def test_forked_samples_get_seed_plus_index():
    p = SamplingParams(n=3, seed=10)
    children = [p.for_sample(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 for c in children)
    assert SamplingParams(n=2).for_sample(1).seed is None
