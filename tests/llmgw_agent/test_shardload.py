"""Per-shard load from /proc: cores busy over a session's processes, as a rate between samples."""

from __future__ import annotations

import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import llmgw_wire as wire
from llmgw_agent.shardload import ProcStat, Sample, ShardMeter, parse_stat, read_stats, shard_loads

# A real /proc/<pid>/stat line (Linux 6.x), with its fields as the kernel writes them.
REAL = (
    "2617 (cat) R 2615 2615 771 0 -1 4194304 98 0 0 0 7 3 0 0 20 0 1 0 178022 3133440 393 "
    "18446744073709551615 94053698949120 94053698969001 140732794736720 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 "
    "94053698985008 94053698986624 94054219300864 140732794739228 140732794739248 140732794739248 "
    "140732794740715 0"
)


def stat_line(pid: int, comm: str, *, session: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0, rss: int):
    """REAL with the fields the shard load reads replaced."""
    f = REAL.split()
    f[0], f[1], f[5] = str(pid), f"({comm})", str(session)
    f[13], f[14], f[15], f[16], f[23] = str(utime), str(stime), str(cutime), str(cstime), str(rss)
    return " ".join(f)


def write_proc(root: Path, lines: dict[int, str]) -> Path:
    proc = root / "proc"
    shutil.rmtree(proc, ignore_errors=True)
    for pid, line in lines.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(line + "\n")
    (proc / "self").mkdir(exist_ok=True)  # not a pid: skipped
    return proc


def test_parse_stat_counts_fields_from_the_last_parenthesis():
    assert parse_stat(REAL) == ProcStat(pid=2617, session=771, ticks=10, rss_pages=393)
    odd = stat_line(4101, "python3 (vllm) worker 0)", session=4100, utime=5, stime=1, cutime=2, cstime=1, rss=9)
    assert parse_stat(odd) == ProcStat(pid=4101, session=4100, ticks=9, rss_pages=9)
    assert parse_stat("") is None
    assert parse_stat("12 (x) R 1 2") is None


def test_cores_busy_over_the_session_between_two_samples(tmp_path):
    first = {
        4100: stat_line(4100, "vllm", session=4100, utime=50, stime=10, rss=1000),
        4101: stat_line(4101, "VllmWorker TP0)", session=4100, utime=1000, stime=200, rss=240000),
        4102: stat_line(4102, "VllmWorker TP1", session=4100, utime=800, stime=100, rss=240000),
        900: stat_line(900, "sshd", session=900, utime=99999, stime=9999, rss=2000),
    }
    pids = {"shard-a": 4100}
    loads, sample = shard_loads(
        pids, read_stats(write_proc(tmp_path, first)), previous=None, now=100.0, clock_ticks=100, page_size=4096
    )
    # The first sample has nothing to compare with: 0 cores, not a guess.
    assert loads == {"shard-a": wire.ShardLoad(cpu_cores=0.0, rss_bytes=481000 * 4096)}
    assert sample == Sample(at=100.0, ticks={"shard-a": 2160})

    # Ten seconds later TP1 has exited and been reaped by the leader (its 1700 ticks move to the
    # leader's cutime/cstime); a second shard has started; a third shard's process is gone.
    second = {
        4100: stat_line(4100, "vllm", session=4100, utime=58, stime=12, cutime=1500, cstime=200, rss=1000),
        4101: stat_line(4101, "VllmWorker TP0)", session=4100, utime=1800, stime=300, rss=250000),
        5200: stat_line(5200, "llama-server", session=5200, utime=40, stime=2, rss=500),
        900: stat_line(900, "sshd", session=900, utime=199999, stime=9999, rss=2000),
    }
    pids = {"shard-a": 4100, "shard-b": 5200, "shard-c": 6000}
    loads, sample = shard_loads(
        pids, read_stats(write_proc(tmp_path, second)), previous=sample, now=110.0, clock_ticks=100, page_size=4096
    )
    # (70 + 1700 + 2100) - 2160 = 1710 ticks / 100 Hz / 10 s
    assert loads == {
        "shard-a": wire.ShardLoad(cpu_cores=1.71, rss_bytes=251000 * 4096),
        "shard-b": wire.ShardLoad(cpu_cores=0.0, rss_bytes=500 * 4096),
    }
    assert sample == Sample(at=110.0, ticks={"shard-a": 3870, "shard-b": 42})

    # A worker reaped outside the session takes its ticks away: 0 cores, never negative.
    third = {4100: stat_line(4100, "vllm", session=4100, utime=60, stime=12, cutime=1500, cstime=200, rss=1000)}
    loads, _ = shard_loads(
        {"shard-a": 4100},
        read_stats(write_proc(tmp_path, third)),
        previous=sample,
        now=115.0,
        clock_ticks=100,
        page_size=4096,
    )
    assert loads == {"shard-a": wire.ShardLoad(cpu_cores=0.0, rss_bytes=1000 * 4096)}


def test_meter_reads_the_live_proc_for_a_busy_child():
    # The child says when it runs its own code: read before that, a process still
    # being exec'd showed a resident size of 0 on a loaded machine. It spins
    # until killed, however late the test gets to measure it.
    code = "import sys\nprint('running', flush=True)\nwhile True: pass"
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready and child.stdout.readline() == b"running\n", "the child did not start within 30 s"
        meter = ShardMeter()
        assert meter.measure({}) == {}
        first = meter.measure({"s": child.pid})
        assert first["s"].cpu_cores == 0.0 and first["s"].rss_bytes > 0
        time.sleep(0.5)
        second = meter.measure({"s": child.pid})
        # A spinning process on a shared machine: busy, and at most one core.
        assert 0.05 < second["s"].cpu_cores <= 1.2
    finally:
        child.kill()
        child.wait()
