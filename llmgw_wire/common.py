"""What every wire message shares: the bounds, the bounded field types, secret masking, the base message.

And the shard state, which both ends read (llmgw_wire/shard_states.py holds its moves).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

API_VERSION = "v1"

# Bounds. Generous for real hardware (a GB200 tray has 4 GPUs, an HGX 8, a
# future box 16), tight enough that a body cannot exhaust the server.
MAX_GPUS = 64
MAX_PORTS = 64
MAX_SHARDS = 256
MAX_LABELS = 64
MAX_LIST = 256
MAX_COMMANDS = 256
# The InfiniBand port error counters watched, by their sysfs names: the doctor
# judges them, the agent exports them. A rising link_downed is a link that
# flapped; the others are a bad cable or port getting worse.
IB_ERROR_COUNTERS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
MAX_SCAN_TEXT = 8 * 1024 * 1024

Name = Annotated[str, StringConstraints(max_length=253)]
Short = Annotated[str, StringConstraints(max_length=128)]
Text = Annotated[str, StringConstraints(max_length=4096)]
# A label key: what placement selectors match, for the agent's labels and the operator's alike.
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$"
LABEL_MAX = 63
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=LABEL_MAX, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=LABEL_MAX)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_LABELS)]
NodeId = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
]
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
# host:port, [v6]:port: handed to Prometheus as a scrape target, so nothing else (no scheme, path or query).
MetricsAddr = Annotated[
    str,
    StringConstraints(
        max_length=253, pattern=r"^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$"
    ),
]
# An http(s) URL with a host (the wakeup long-poll's base): nothing an agent would have to guess at.
HttpURL = Annotated[str, StringConstraints(max_length=2048, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")]
SmallInt = Annotated[int, Field(ge=0, le=1_000_000)]
GPUIndex = Annotated[int, Field(ge=0, lt=MAX_GPUS)]
Port = Annotated[int, Field(ge=1, le=65535)]
# Wear counters: -1 is "not reported for this card" (a card before Ampere has
# no remapped rows, one after no retired pages).
WearCount = Annotated[int, Field(ge=-1, le=2**53)]


# Secrets in a profile, decided by name on both ends of the wire: the agent
# masks them in shard logs, the control plane shows them to nobody. A flag or
# an environment variable whose name ends in one of these words carries one
# (`--api-key`, `--hf-token`, `--db-password`, HF_TOKEN, OPENAI_API_KEY).
# "tokens" is not one: it counts tokens in every engine's flags
# (`--max-num-batched-tokens`), and nor is `--tokenizer` or `--ssl-keyfile`.
_SECRET_WORD = r"(key|token|secret|password|passwd)"
SECRET_FLAG = re.compile(rf"^--?[\w-]*?{_SECRET_WORD}$", re.I)
SECRET_ENV = re.compile(rf"^\w*?{_SECRET_WORD}$", re.I)
MASK = "***"


def mask_args(argv: Iterable[str]) -> list[str]:
    """`argv` with the value of each secret-carrying flag masked (`--api-key X` and `--api-key=X` alike)."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        flag, eq, _value = arg.partition("=")
        if SECRET_FLAG.match(flag):
            out.append(f"{flag}={MASK}" if eq else arg)
            mask_next = not eq
        else:
            out.append(arg)
    return out


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the value of each secret-named variable masked."""
    return {k: (MASK if SECRET_ENV.match(k) else v) for k, v in env.items()}


def masked_command(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A queued command's payload for showing: a StartShard's profile env and args masked."""
    out = dict(payload)
    profile = out.get("profile")
    if isinstance(profile, Mapping):
        profile = dict(profile)
        if isinstance(profile.get("env"), Mapping):
            profile["env"] = mask_env(profile["env"])
        if isinstance(profile.get("args"), list):
            profile["args"] = mask_args(profile["args"])
        out["profile"] = profile
    return out


def empty_list() -> Any:
    """An empty list as a field's default, without a copy per message.

    pydantic deep-copies a mutable default (`= []`) for every message that
    omits the field; a factory builds a fresh one for less. The JSON schema
    still says the default is [].
    """
    return Field(default_factory=list, json_schema_extra={"default": []})


def empty_dict() -> Any:
    """An empty dict as a field's default (see empty_list)."""
    return Field(default_factory=dict, json_schema_extra={"default": {}})


class Message(BaseModel):
    """Base of every wire message: fields a newer peer adds are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=False)


class ShardState(StrEnum):
    """Where a shard stands, as the agent's supervisor sees it."""

    PENDING = "pending"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def shard_state_from_wire(value: Any) -> ShardState:
    """Read a shard state; an unrecognised one is FAILED.

    A newer agent reporting something this control plane does not understand
    must not be mistaken for a healthy shard.
    """
    if isinstance(value, ShardState):
        return value
    try:
        return ShardState(str(value).lower())
    except ValueError:
        return ShardState.FAILED
