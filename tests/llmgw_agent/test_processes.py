"""The engines' log files as the supervisor reads them."""

from __future__ import annotations

from llmgw_agent.processes import log_tail


def test_log_tail_returns_whole_lines_only(tmp_path):
    log = tmp_path / "s1.log"
    log.write_text("".join(f"line {i} " + "x" * 20 + "\n" for i in range(10)))
    # The whole file: every line, the last ones asked for.
    assert log_tail(log, 3) == [f"line {i} " + "x" * 20 for i in (7, 8, 9)]
    # A window that starts inside a line drops what it holds of it: the end of a line is not a line.
    assert log_tail(log, 10, window=70) == [f"line {i} " + "x" * 20 for i in (8, 9)]
    assert log_tail(tmp_path / "absent.log", 3) == []
