"""The fault suite's parts, in seconds: its tally and lines, which process of a kind it kills, its trickle.

The suite itself (`make faults`, bench/faults.py) takes minutes on a stack of
its own; what each scenario does is proved by the tests named in
docs/operations.md, on real servers. Here: that a scenario's line says what
it lost, that the victim of each kind is the one named, that the process
table is read as it is, and that the trickle records a server's cut-off.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

from bench import faults, procs
from bench.hostile import Trickle, request_head


def test_a_scenarios_line_says_what_was_done_and_what_was_lost():
    lost = faults.Lost(nodes={"gpu-2", "gpu-1"}, failed=3, requests=412)
    line = lost.line("kill web master", "SIGKILL one web master under load; replaced in 4 s")
    assert line.startswith("kill web master          SIGKILL one web master under load; replaced in 4 s")
    assert line.endswith("lost: 2 nodes left ready, 3 of 412 gateway requests failed (0 refused)")
    assert (
        faults.Lost(failed=2, refused=1)
        .line("x", "y")
        .endswith("0 nodes left ready, 2 of 0 gateway requests failed (1 refused)")
    )
    assert faults.Lost().line("x", "y").endswith("lost: 0 nodes left ready, 0 of 0 gateway requests failed (0 refused)")


def test_the_victim_is_a_worker_or_the_master_as_named():
    # The socket's holder (9), its master (10) with two workers (11, 12): a worker is a leaf, the master their parent.
    parents = {9: 1, 10: 9, 11: 10, 12: 10}
    assert faults.victim([9, 10, 11, 12], [11, 12], leaf=True, parents=parents) == 11
    assert faults.victim([9, 10, 11, 12], [11, 12], leaf=False, parents=parents) == 10
    # A kind with one process (Celery beat): that one, whatever it is called.
    assert faults.victim([20], [20], leaf=False, parents={20: 1}) == 20
    # A master and its worker, the master's parent not of the kind (Celery's worker): the master.
    assert faults.victim([30, 31], [31], leaf=False, parents={30: 5, 31: 30}) == 30
    assert {k for k, _, _ in faults.KINDS} == {
        "web worker", "web master", "gateway worker", "gateway master", "Celery worker", "Celery beat",
    }  # fmt: skip
    assert set(faults.SCENARIOS) == {"trickle", "kill", "web-outage", "redis", "web-outage-100"}
    assert set(faults.FLEET_SCENARIOS) == {"web-outage-100"}


def test_the_process_tree_is_read_from_proc():
    # A shell (the master) with two sleeping children: both below it, neither with children of its own.
    parent = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        found = {}
        for _ in range(200):
            found = procs.descendants(parent.pid)
            if len(found) == 2:
                break
            threading.Event().wait(0.02)
        assert len(found) == 2 and all("sleep 60" in cmd for cmd in found.values()), found
        assert procs.find(parent.pid, "sleep 60", leaf=True) == sorted(found)
        assert procs.find(parent.pid, "no such command") == []
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(10)


def test_the_trickle_records_a_servers_answer_and_cut_off():
    # A server that reads nothing, answers 408 after half a second and closes: every connection is recorded so.
    ready = threading.Event()
    port: list[int] = []

    async def serve() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(0.5)
            writer.write(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        async with server:
            await asyncio.sleep(5)

    t = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    t.start()
    assert ready.wait(5)
    trickle = Trickle("127.0.0.1", port[0], request_head("/x"), n=20, every_s=0.1).start()
    try:
        for _ in range(200):
            if trickle.open() == 0:
                break
            threading.Event().wait(0.02)
        assert trickle.statuses() == {408: 20}
        assert 0.5 <= trickle.held_s() < 3
    finally:
        trickle.stop()


def test_an_unknown_scenario_is_refused_naming_the_known_ones():
    done = subprocess.run([sys.executable, "-m", "bench", "faults", "nosuch"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DJANGO_SETTINGS_MODULE": "llmgw.settings_test"})  # fmt: skip
    assert done.returncode == 1
    assert "unknown scenario(s) nosuch; known: trickle, kill, web-outage, redis" in done.stderr
