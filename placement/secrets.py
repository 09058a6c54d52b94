"""Secrets in engine profiles are write-only: stored, sent to the agent, shown to nobody.

Which env values and flag values are secrets is decided by name in
llmgw_wire/, as the agent's log masking decides. Everything that shows a
profile (the API, the admin, the audit events, queued commands) shows the
mask in their place; a profile written back with the mask keeps the stored
value, so an operator edits other fields without retyping a token, and
replaces a secret by sending a new value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import llmgw_wire as wire

MASK = wire.MASK


class HiddenWithoutValue(ValueError):
    """A masked value was written where no stored value exists to keep; the message names it."""


def shown_env(env: Mapping[str, str] | Any) -> Any:
    """A profile's env as anyone may see it."""
    return wire.mask_env(env) if isinstance(env, Mapping) else env


def shown_args(args: Sequence[str] | Any) -> Any:
    """A profile's args as anyone may see them."""
    return wire.mask_args(args) if isinstance(args, list | tuple) else args


def kept_env(new: Mapping[str, str], stored: Mapping[str, str] | None) -> dict[str, str]:
    """The env to store: a masked secret in `new` keeps its stored value."""
    out = {}
    for k, v in new.items():
        if v == MASK and wire.SECRET_ENV.match(k):
            if not stored or k not in stored:
                raise HiddenWithoutValue(f"{k} is {MASK} but has no stored value to keep: send its value")
            v = stored[k]
        out[k] = v
    return out


def _secret_values(args: Sequence[str]) -> dict[str, list[str]]:
    # Each secret flag's values in order, whichever form it was written in.
    found: dict[str, list[str]] = {}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if wire.SECRET_FLAG.match(flag):
            if eq:
                found.setdefault(flag, []).append(value)
            elif i + 1 < len(args):
                found.setdefault(flag, []).append(args[i + 1])
    return found


def kept_args(new: Sequence[str], stored: Sequence[str] | None) -> list[str]:
    """The args to store: a masked secret flag value in `new` keeps the stored value of the same flag."""
    old = _secret_values(stored or [])
    used: dict[str, int] = {}
    out: list[str] = []

    def keep(flag: str) -> str:
        n = used.get(flag, 0)
        used[flag] = n + 1
        values = old.get(flag, [])
        if n >= len(values):
            raise HiddenWithoutValue(f"{flag}'s value is {MASK} but has no stored value to keep: send its value")
        return values[n]

    pending = ""
    for arg in new:
        if pending:
            out.append(keep(pending) if arg == MASK else arg)
            if arg != MASK:
                used[pending] = used.get(pending, 0) + 1
            pending = ""
            continue
        flag, eq, value = arg.partition("=")
        if wire.SECRET_FLAG.match(flag):
            if eq:
                out.append(f"{flag}={keep(flag)}" if value == MASK else arg)
                if value != MASK:
                    used[flag] = used.get(flag, 0) + 1
            else:
                out.append(arg)
                pending = flag
            continue
        out.append(arg)
    return out
