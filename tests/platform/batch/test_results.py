"""The result files as the journal (`stoker.batch.results`): read back after a crash, a torn last
line cut off, each input line counted once."""

from __future__ import annotations

import json

from stoker.batch.results import ResultLog, line_of, request_id


async def test_recovery_reads_back_what_is_answered_and_cuts_a_torn_line(tmp_path):
    log = ResultLog(tmp_path, "batch_" + "a" * 24)
    log.recover()
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    await log.answer(1, "q1", 200, {"usage": usage})
    await log.answer(2, "q2", 404, {"error": {}})
    await log.refuse(3, None, "invalid_request", "Line 3: bad.")
    log.close()
    with (tmp_path / "output.jsonl").open("ab") as f:  # a write the kill cut in half
        f.write(json.dumps({"id": request_id(log.batch_id, 4), "custom_id": "q4"}).encode()[:20])

    again = ResultLog(tmp_path, log.batch_id)
    tally = again.recover()
    assert tally.done == {1, 2, 3}
    assert (tally.completed, tally.failed, tally.input_tokens, tally.output_tokens) == (1, 2, 5, 2)
    assert (tmp_path / "output.jsonl").read_bytes().endswith(b"\n")  # the torn line is gone
    await again.answer(4, "q4", 200, {"usage": usage})
    again.close()
    ids = [json.loads(x)["custom_id"] for x in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert ids == ["q1", "q4"]


def test_a_request_id_names_its_line():
    assert line_of(request_id("batch_" + "0" * 24, 17)) == 17
    assert line_of("batch_req_x") is None and line_of(7) is None
