"""Reading request traces: the Azure CSV format, thinning, time scaling, and one-line errors."""

from __future__ import annotations

import pytest

from warm_pool.trace import TraceError, TraceRequest, load_trace


def write(tmp_path, text: str, name: str = "t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.4799600,110,27
2023-11-16 18:17:13.9799600,7433,14
"""


def test_azure_timestamps_become_seconds_after_the_first_request(tmp_path):
    trace = load_trace(write(tmp_path, AZURE))
    assert [r.t for r in trace] == pytest.approx([0.0, 0.052, 1.5, 10.0])
    assert trace[0] == TraceRequest(0.0, 4808, 10)


def test_thin_keeps_every_kth_and_time_scale_stretches(tmp_path):
    trace = load_trace(write(tmp_path, AZURE), thin=2, time_scale=0.5)
    assert [(round(r.t, 3), r.context_tokens) for r in trace] == [(0.0, 4808), (0.75, 110)]


def test_plain_seconds_out_of_order_are_sorted(tmp_path):
    trace = load_trace(write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n5,1,1\n2.5,2,2\n\n"))
    assert [(r.t, r.context_tokens) for r in trace] == [(0.0, 2), (2.5, 1)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "TIMESTAMP,Context,GeneratedTokens\n1,2,3\n",
            "missing column ContextTokens (found: TIMESTAMP, Context,",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests in it"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n", "line 2: bad TIMESTAMP 'yesterday'"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,-4,1\n", "line 2: bad ContextTokens '-4'"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,4,x\n", "line 2: bad GeneratedTokens 'x'"),
        ("", "missing column TIMESTAMP (found: nothing"),
    ],
)
def test_bad_traces_are_one_clear_error(tmp_path, text, message):
    with pytest.raises(TraceError) as err:
        load_trace(write(tmp_path, text))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_file_a_directory_and_bad_options(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match="--thin must be a whole number ≥ 1, got 0"):
        load_trace(write(tmp_path, AZURE), thin=0)
    with pytest.raises(TraceError, match="--time-scale must be a number > 0, got -1"):
        load_trace(write(tmp_path, AZURE), time_scale=-1.0)
