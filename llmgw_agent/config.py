"""agent.yaml: what an operator tells the agent, loaded into a frozen dataclass.

The seed's lesson: its fabric keys were once silently ignored because nothing
ever loaded them from a file, so the documented `name:` produced an empty
fabric. Here every key is checked against the documented ones, top level and
inside each fabric: an unknown or misspelled key is an error naming the key,
the file and the closest known key, and a value of the wrong type names its key.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

DEFAULT_STATE_DIR = "/var/lib/llmgw-agent"
DEFAULT_CONFIG = "/etc/llmgw/agent.yaml"
METRICS_TOKEN_ENV = "LLMGW_AGENT_METRICS_TOKEN"

TOP_KEYS = (
    "control_plane",
    "join_token",
    "join_token_file",
    "node_id",
    "labels",
    "model_dirs",
    "state_dir",
    "heartbeat_interval",
    "mgmt_interface",
    "fabrics",
    "root",
    "engines_live",
    "metrics_listen",
    "metrics_token",
    "metrics_open",
    "wakeup_url",
    "wakeup",
)
FABRIC_KEYS = ("name", "hcas", "rate_gbps")

# A node id or fabric name: letters, digits, '.', '_' or '-', starting and ending with a letter or digit.
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


class ConfigError(ValueError):
    """agent.yaml is wrong; the message names the file and the key."""


@dataclass(frozen=True)
class Fabric:
    """A fabric this node is attached to, as the operator declares it."""

    name: str
    hcas: tuple[str, ...] = ()
    rate_gbps: int = 0


@dataclass(frozen=True)
class Config:
    """The agent's configuration (agent.yaml)."""

    control_plane: str
    join_token: str = field(default="", repr=False)
    join_token_file: str = ""
    node_id: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    model_dirs: tuple[str, ...] = ()
    state_dir: str = DEFAULT_STATE_DIR
    heartbeat_interval: float = 5.0
    mgmt_interface: str = ""
    fabrics: tuple[Fabric, ...] = ()
    root: str = ""
    # With `root`: probe the real engines on PATH all the same (a recorded
    # machine running a real engine, as the end-to-end tests do).
    engines_live: bool = False
    # The node's own Prometheus endpoint (host:port; "" = not served).
    metrics_listen: str = ""
    metrics_token: str = field(default="", repr=False)
    metrics_open: bool = False
    # Where GET /api/v1/agent/wait is served ("": where the control plane's answers say, else the
    # control_plane URL); llmgw_agent/wakeup.py.
    wakeup_url: str = ""
    # The wakeup long-poll at all: false keeps the agent to its heartbeat interval.
    wakeup: bool = True
    source: str = ""

    def token(self) -> str:
        """The join token, read from join_token_file when that is how it was given."""
        if self.join_token:
            return self.join_token
        if self.join_token_file:
            try:
                return Path(self.join_token_file).read_text().strip()
            except OSError as e:
                raise ConfigError(f"{self.source}: join_token_file {self.join_token_file!r}: {e.strerror}") from e
        return ""


def parse_listen(value: str) -> tuple[str, int]:
    """`host:port` (or `:port`, every address) into a bind address; ValueError saying what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not host:port (e.g. 0.0.0.0:9400 or :9400)")
    return host.strip("[]") or "0.0.0.0", int(port)


def _metrics(data: dict, *, source: str) -> tuple[str, str, bool]:
    """metrics_listen, metrics_token (or $LLMGW_AGENT_METRICS_TOKEN) and metrics_open, checked together."""
    listen = _str(data, "metrics_listen", source=source)
    token = _str(data, "metrics_token", source=source) or os.environ.get(METRICS_TOKEN_ENV, "")
    open_ = data.get("metrics_open", False)
    if not isinstance(open_, bool):
        raise ConfigError(f"{source}: metrics_open must be true or false, not {open_!r}")
    if listen:
        try:
            parse_listen(listen)
        except ValueError as e:
            raise ConfigError(f"{source}: metrics_listen {e}") from None
        # Sensors name the hardware and its faults: nobody reads them unasked.
        if not token and not open_:
            raise ConfigError(
                f"{source}: metrics_listen needs metrics_token (or ${METRICS_TOKEN_ENV}),"
                " or metrics_open: true to serve the node's metrics without one"
            )
    return listen, token, open_


def _suggest(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"


def _check_keys(data: dict, known: tuple[str, ...], *, where: str, source: str) -> None:
    for key in data:
        if not isinstance(key, str) or key not in known:
            raise ConfigError(f"{source}: unknown key {where}{key!r}{_suggest(str(key), known)}")


def _str(data: dict, key: str, *, source: str, where: str = "") -> str:
    v = data.get(key, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ConfigError(f"{source}: {where}{key} must be a string, not {type(v).__name__}")
    return v


def _str_list(data: dict, key: str, *, source: str, where: str = "") -> tuple[str, ...]:
    v = data.get(key) or []
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(f"{source}: {where}{key} must be a list of non-empty strings")
    return tuple(v)


def _fabric(i: int, raw: Any, *, source: str) -> Fabric:
    where = f"fabrics[{i}]."
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: fabrics[{i}] must be a mapping with keys {', '.join(FABRIC_KEYS)}")
    _check_keys(raw, FABRIC_KEYS, where=where, source=source)
    name = _str(raw, "name", source=source, where=where)
    if not name:
        raise ConfigError(f"{source}: {where}name is required")
    if not _NAME.match(name) or len(name) > 63:
        raise ConfigError(f"{source}: {where}name {name!r} must be letters, digits, '.', '_' or '-' (at most 63)")
    rate = raw.get("rate_gbps", 0)
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 0:
        raise ConfigError(f"{source}: {where}rate_gbps must be a whole number of Gb/s, not {rate!r}")
    return Fabric(name=name, hcas=_str_list(raw, "hcas", source=source, where=where), rate_gbps=rate)


def parse(data: Any, *, source: str = "<agent.yaml>") -> Config:
    """Check and convert a parsed agent.yaml mapping into a Config."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a mapping of keys to values")
    _check_keys(data, TOP_KEYS, where="", source=source)

    cp = _str(data, "control_plane", source=source)
    if not cp:
        raise ConfigError(f"{source}: control_plane is required (e.g. https://llmgw.example.com)")
    url = urlparse(cp)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"{source}: control_plane must be an http(s) URL, not {cp!r}")

    token, token_file = _str(data, "join_token", source=source), _str(data, "join_token_file", source=source)
    if token and token_file:
        raise ConfigError(f"{source}: give join_token or join_token_file, not both")

    given = _str(data, "node_id", source=source)
    node_id = given or socket.gethostname().split(".")[0]
    if not _NAME.match(node_id) or len(node_id) > 253:
        origin = "" if given else " (this host's name: node_id is not set; set it)"
        raise ConfigError(f"{source}: node_id {node_id!r}{origin} must be letters, digits, '.', '_' or '-'")

    labels = data.get("labels") or {}
    if not isinstance(labels, dict):
        raise ConfigError(f"{source}: labels must be a mapping of names to values")
    clean: dict[str, str] = {}
    for k, v in labels.items():
        if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
            raise ConfigError(f"{source}: labels.{k} must be a plain value")
        clean[k] = str(v).lower() if isinstance(v, bool) else str(v)

    interval = data.get("heartbeat_interval", 5)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.1 <= interval <= 600:
        raise ConfigError(f"{source}: heartbeat_interval must be seconds between 0.1 and 600, not {interval!r}")

    fabrics_raw = data.get("fabrics") or []
    if not isinstance(fabrics_raw, list):
        raise ConfigError(f"{source}: fabrics must be a list of {{name, hcas, rate_gbps}}")
    fabrics = tuple(_fabric(i, f, source=source) for i, f in enumerate(fabrics_raw))
    names = [f.name for f in fabrics]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"{source}: fabrics: name {n!r} appears twice")
    hcas = [h for f in fabrics for h in f.hcas]
    for h in hcas:
        if hcas.count(h) > 1:
            raise ConfigError(f"{source}: fabrics: HCA {h!r} is declared on two fabrics")

    metrics_listen, metrics_token, metrics_open = _metrics(data, source=source)
    wakeup_url = _str(data, "wakeup_url", source=source)
    if wakeup_url and (urlparse(wakeup_url).scheme not in ("http", "https") or not urlparse(wakeup_url).netloc):
        raise ConfigError(f"{source}: wakeup_url must be an http(s) URL, not {wakeup_url!r}")
    return Config(
        control_plane=cp.rstrip("/"),
        join_token=token,
        join_token_file=token_file,
        node_id=node_id,
        labels=clean,
        model_dirs=_str_list(data, "model_dirs", source=source),
        state_dir=_str(data, "state_dir", source=source) or DEFAULT_STATE_DIR,
        heartbeat_interval=float(interval),
        mgmt_interface=_str(data, "mgmt_interface", source=source),
        fabrics=fabrics,
        root=_str(data, "root", source=source),
        engines_live=_flag(data, "engines_live", source=source),
        metrics_listen=metrics_listen,
        metrics_token=metrics_token,
        metrics_open=metrics_open,
        wakeup_url=wakeup_url.rstrip("/"),
        wakeup=_flag(data, "wakeup", source=source, default=True),
        source=source,
    )


def _flag(data: dict, key: str, *, source: str, default: bool = False) -> bool:
    """A yes/no key: YAML's true or false, nothing else."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, not {value!r}")
    return value


def load(path: str | Path) -> Config:
    """Load agent.yaml from a file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return parse(data, source=str(path))
