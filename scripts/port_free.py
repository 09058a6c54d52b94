"""Exit 1 naming the first HOST:PORT another program already holds; 0 when every one is free to bind.

The servers' own start is no proof: granian binds with SO_REUSEPORT, so a
second llmgw on a busy port shared it with the first (requests split between
two control planes), and a probe of the port answered from the other one.
So `make run` and the server scripts ask first, by binding as a server does
(SO_REUSEADDR, without SO_REUSEPORT), and refuse a port already held.

    python scripts/port_free.py 127.0.0.1:8000 127.0.0.1:8080
"""

from __future__ import annotations

import socket
import sys


def held(addr: str) -> str:
    """Why HOST:PORT cannot be bound now ("" when it can)."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as e:
        return f"{addr} is not an address to listen on ({e})"
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            return f"port {port} on {host} is already in use ({e.strerror or e}): another program listens on it"
    return ""


def main(argv: list[str]) -> int:
    """Check each address; print why the first held one is and return 1, else 0."""
    for addr in argv:
        why = held(addr)
        if why:
            print(f"llmgw: {why}; stop it or choose another address", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
