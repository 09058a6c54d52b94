"""The ports in use on a node: the listening sockets read from /proc, and the bind check before a start."""

from __future__ import annotations

import socket

import pytest

import llmgw_wire as wire
from llmgw_agent import ports
from llmgw_agent.supervisor import Supervisor
from tests.llmgw_agent.helpers import echo_start, free_port

S = wire.ShardState


def test_listening_ports_from_recorded_proc_net_tcp(fixture_text):
    # Only the listening sockets count: the established and TIME_WAIT lines' local ports are not.
    assert ports.parse_proc_net_tcp(fixture_text("proc-net/tcp.txt")) == {
        1883,
        2024,
        3306,
        4222,
        4369,
        5432,
        5672,
        6379,
        25672,
    }
    assert ports.parse_proc_net_tcp(fixture_text("proc-net/tcp6.txt")) == {4369, 6379}


def test_listening_ports_from_a_proc_directory(tmp_path, fixture_text):
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(fixture_text("proc-net/tcp.txt"))
    (tmp_path / "net" / "tcp6").write_text(fixture_text("proc-net/tcp6.txt") + "garbage line\n  9: zz:zz\n")
    assert ports.listening_ports(proc=tmp_path) == [1883, 2024, 3306, 4222, 4369, 5432, 5672, 6379, 25672]
    # No /proc/net at all (not Linux, a locked-down container): nothing reported, nothing fatal.
    assert ports.listening_ports(proc=tmp_path / "absent") == []


def test_the_live_proc_lists_a_listener_and_the_bind_check_finds_it_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port in ports.listening_ports()
        # A listener on loopback takes the port for an engine binding every address.
        assert ports.taken([free_port(), port]) == port
    assert ports.taken([port]) is None


@pytest.mark.slow
def test_a_taken_port_fails_the_shard_at_once_naming_it(tmp_path):
    sup = Supervisor(tmp_path / "state")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            shard = sup.start(echo_start("s1", port=port))
        # No engine ran: no process, no log to read; the reason and the status name the port.
        assert (shard.st, shard.pid) == (S.FAILED, None)
        assert shard.reason == f"port {port} is already in use on this node (another program listens on it)"
        (status,) = sup.statuses()
        assert (status.state, status.port_in_use, status.http_port) == (S.FAILED, port, port)
    finally:
        sup.close()
