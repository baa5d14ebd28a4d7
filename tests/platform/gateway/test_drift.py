"""Drift: the PSI, the refusal check, windows and the reference on a logical clock, the gauges."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from stoker.gateway.drift import STATS, Drift, DriftCollector, is_refusal, psi


@dataclass
class Answer:  # the fields of a request_log.RequestRecord that drift reads
    deployment: str = "chat"
    prompt_chars: int = 100
    completion_tokens: int | None = 20
    finish_reason: str | None = "stop"
    refusal: bool = False


@pytest.mark.parametrize(
    ("reference", "window", "expected"),
    [
        ([9, 1], [9, 1], 0.0),
        ([90, 10], [45, 5], 0.0),  # shares, not counts
        ([9, 1], [5, 5], (0.5 - 0.9) * math.log(0.5 / 0.9) + (0.5 - 0.1) * math.log(0.5 / 0.1)),  # the docstring's 0.88
        ([10, 0], [9, 1], (0.9 - 1.0) * math.log(0.9 / 1.0) + (0.1 - 0.001) * math.log(0.1 / 0.001)),  # floored
        ([0, 0], [3, 1], 0.0),  # nothing to compare with
    ],
)  # fmt: skip
def test_psi(reference, window, expected):
    assert psi(reference, window) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("answer", "refused"),
    [
        ("I'm sorry, but I can't help with that.", True),
        ("I\u2019m unable to share that.", True),  # a typographic apostrophe
        ("As an AI language model, I cannot", True),
        ("Paris is the capital of France.", False),
        ("Sorry to hear that! Here is a recipe:", False),
        ("x" * 400 + " I cannot help", False),  # only the first 300 characters are read
        ("", False),
    ],
)
def test_refusal(answer, refused):
    assert is_refusal(answer) is refused


def test_the_first_full_window_is_the_reference_and_a_shift_scores():
    drift = Drift(window_s=60, min_requests=4)
    for t in range(5):  # window [0, 60): 5 answers, all `stop`
        drift.record(Answer(), now=t)
    assert drift.scores("chat") == {}  # nothing closed yet
    for t in range(60, 64):  # window [60, 120): the same mix
        drift.record(Answer(), now=t)
    drift.roll(120)
    assert drift.scores("chat") == {stat: 0.0 for stat in STATS}
    report = drift.report("chat", 120)
    assert report["reference"]["requests"] == 5 and report["last"]["requests"] == 4
    for t in range(200, 204):  # [180, 240): half cut by length, half refusals, long prompts
        drift.record(
            Answer(prompt_chars=5000, finish_reason="length" if t % 2 else "stop", refusal=t % 2 == 0), now=t
        )
    drift.roll(240)
    scores = drift.scores("chat")
    assert scores["output_tokens"] == 0.0
    assert scores["prompt_length"] > 0.25 and scores["finish_reason"] > 0.25 and scores["refusal"] > 0.25


def test_a_small_window_is_not_scored_nor_the_reference():
    drift = Drift(window_s=10, min_requests=3)
    drift.record(Answer(), now=0)
    drift.roll(10)
    assert drift.report("chat", 10)["reference"] is None and drift.scores("chat") == {}


def test_pin_the_current_window_and_errors():
    drift = Drift(window_s=10, min_requests=2)
    with pytest.raises(LookupError):
        drift.pin("chat", "last", now=0)
    drift.record(Answer(), now=0)
    with pytest.raises(ValueError, match="holds 1 answer"):
        drift.pin("chat", "current", now=1)
    drift.record(Answer(finish_reason="length"), now=2)
    drift.pin("chat", "current", now=3)
    drift.record(Answer(finish_reason="length"), now=4)  # the pinned copy does not move
    report = drift.report("chat", 5)
    assert report["reference_pinned"] and report["reference"]["requests"] == 2
    for t in range(10, 12):
        drift.record(Answer(), now=t)
    drift.roll(20)
    assert drift.scores("chat")["finish_reason"] > 0  # [stop, length] against [stop, stop]


@pytest.mark.parametrize(("window_s", "min_requests"), [(0.5, 20), (60, 0)])
def test_bad_settings(window_s, min_requests):
    with pytest.raises(ValueError):
        Drift(window_s, min_requests)


def test_the_gauges_roll_at_scrape_time():
    now = [0.0]
    drift = Drift(window_s=10, min_requests=1)
    registry = CollectorRegistry()
    registry.register(DriftCollector(drift, clock=lambda: now[0]))
    drift.record(Answer(), now=0)
    drift.record(Answer(), now=10)
    now[0] = 25.0  # the second window closes at the scrape
    text = generate_latest(registry).decode()
    assert 'stoker_drift_score{deployment="chat",stat="refusal"} 0.0' in text
    assert 'stoker_drift_window_requests{deployment="chat",window="last"} 1.0' in text
    assert 'stoker_drift_window_requests{deployment="chat",window="current"} 0.0' in text
