"""Table tests of incremental detokenisation with stop strings (pure, no model)."""

from __future__ import annotations

import pytest

from stoker.engine.text import TextTracker


def run(pieces: list[bytes], stop: tuple[str, ...]) -> tuple[list[str], str, bool]:
    """Feed tokens whose bytes are `pieces`, decoded as a byte-level tokenizer does; collect the deltas."""
    tokens: list[int] = []
    tracker = TextTracker(lambda toks: b"".join(pieces[i] for i in toks).decode("utf-8", "replace"), stop)
    deltas = []
    for i in range(len(pieces)):
        tokens.append(i)
        deltas.append(tracker.update(tokens))
        if tracker.stopped:
            return deltas, tracker.text, True
    deltas.append(tracker.flush())
    return deltas, tracker.text, False


@pytest.mark.parametrize(
    ("pieces", "stop", "deltas", "stopped"),
    [
        ([b"Hel", b"lo", b" world"], (), ["Hel", "lo", " world", ""], False),
        ([b"Hel", b"lo", b" world"], ("lo w",), ["He", "l", ""], True),  # held back, then cut at the stop
        ([b"ab", b"c", b"d"], ("cx",), ["ab", "", "cd", ""], False),  # held back, then ruled out
        ([b"x", b"EN", b"D", b"y"], ("END",), ["x", "", ""], True),
        ([b"a", b"STOP"], ("STOP", "a"), [""], True),  # the earliest stop wins
        (
            [b"caf", b"\xc3", b"\xa9!"],
            (),
            ["caf", "", "\u00e9!", ""],
            False,
        ),  # half a character is never sent
        ([b"one", b"\xc3"], (), ["one", "", ""], False),  # a dangling half character is dropped at the end
    ],
)
def test_deltas(pieces, stop, deltas, stopped):
    got, text, did_stop = run(pieces, stop)
    assert got == deltas
    assert did_stop == stopped
    assert "".join(got) == (text.rstrip("\ufffd") if not stopped else text)


@pytest.mark.parametrize(
    ("pieces", "stop", "min_tokens", "deltas", "stopped"),
    [
        # A stop string wholly inside the first min_tokens tokens' text never counts...
        ([b"ab", b"END", b"cd"], ("END",), 2, ["ab", "END", "cd"], False),
        # ...one that ends after it does, even if it began inside (held back meanwhile)...
        ([b"ab", b"EN", b"Dcd"], ("END",), 2, ["ab", "", ""], True),
        # ...and so does a later one.
        ([b"ab", b"x", b"END"], ("END",), 2, ["ab", "x", ""], True),
        ([b"END", b"x"], ("END",), 0, [""], True),  # min_tokens 0: from the first token
    ],
)
def test_stop_strings_count_only_past_min_tokens(pieces, stop, min_tokens, deltas, stopped):
    tokens: list[int] = []
    tracker = TextTracker(lambda toks: b"".join(pieces[i] for i in toks).decode(), stop)
    got = []
    for i in range(len(pieces)):
        tokens.append(i)
        got.append(tracker.update(tokens, check_stop=len(tokens) > min_tokens))
        if tracker.stopped:
            break
    assert (got, tracker.stopped) == (deltas, stopped)
