"""Addresses of this machine's network interfaces."""

from __future__ import annotations

import fcntl
import socket
import struct


def interface_addr(name: str) -> str:
    """The IPv4 address of a network interface, '' when it has none."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
        except OSError:
            return ""
    return socket.inet_ntoa(res[20:24])
