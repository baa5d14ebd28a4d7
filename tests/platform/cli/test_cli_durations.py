"""Durations as the CLI takes them (`stoker.spec.durations`): a table of what is read and what is refused."""

from __future__ import annotations

import pytest

from stoker.spec.durations import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("1.5", 1.5),
        ("0", 0.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1m30s", 90.0),
        ("2d", 172800.0),
        ("1d2h3m4s", 93784.0),
        ("500ms", 0.5),
        ("1.5h", 5400.0),
        (" 5M ", 300.0),
    ],
)
def test_what_is_read(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "5x",
        "m5",
        "-5",
        "-5m",
        "5m-1s",
        "1m1h",
        "5m5m",
        "1 h",
        "inf",
        "nan",
        "1e400",
        "h",
        "5mm",
        "1h 30m",
    ],
)
def test_what_is_refused_in_one_line_quoting_it(text):
    with pytest.raises(ValueError) as err:
        parse_duration(text)
    assert str(err.value).startswith(f"{text!r} is not a duration: ") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(300, "5m"), (5400, "1h30m"), (90, "1m30s"), (86400, "1d"), (0, "0s"), (0.5, "0.5s"), (30.0, "30s")],
)
def test_format_is_the_shortest_spelling_and_reads_back(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds
