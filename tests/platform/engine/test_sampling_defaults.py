"""Sampling defaults from the snapshot's generation_config.json, applied as vLLM applies them."""

from __future__ import annotations

import json

import pytest

from stoker.engine.protocol import parse_request, sampling_defaults

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"temperature": 0.2, "top_p": 0.9, "eos_token_id": 2}, {"temperature": 0.2, "top_p": 0.9}),
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"temperature": 3.0, "top_p": 1.5}, {}),  # out of range: ignored, OpenAI's defaults stand
        ({"temperature": True, "top_p": "0.9"}, {}),
        ({"top_p": 0.0}, {}),  # top_p 0 would keep no token at all
        ({"eos_token_id": 2}, {}),
        ([], {}),
    ],
)
def test_sampling_defaults_read_what_the_snapshot_sets(tmp_path, config, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(tmp_path) == expected


def test_no_or_broken_generation_config_means_no_defaults(tmp_path):
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}


def test_defaults_fill_in_only_what_the_request_leaves_out():
    defaults = {"temperature": 0.2, "top_p": 0.9}
    params = parse_request("chat", dict(CHAT), defaults).params
    assert (params.temperature, params.top_p) == (0.2, 0.9)
    params = parse_request("chat", {**CHAT, "temperature": 1.0}, defaults).params
    assert (params.temperature, params.top_p) == (1.0, 0.9)
    params = parse_request("chat", dict(CHAT)).params
    assert (params.temperature, params.top_p) == (1.0, 1.0)  # OpenAI's defaults without a config
