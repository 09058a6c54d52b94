"""The bounds of what an operator may ask for, one set for every door.

The admin's forms (through the models' validators), the API's input
serializers and the database's named check constraints read these same
numbers and shapes: a value one door accepts, every other accepts, and a
value none should accept (an args list with a null, an env that is a list,
a power of NaN, two billion replicas) is refused at each with a message
naming the field. Args and env are bounded as the wire carries them to the
agent (wire.EngineProfile): an argv list of strings, a map of strings.
"""

from __future__ import annotations

import json
import math
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import BooleanField, F, Func

from llmgw_wire.common import MAX_LIST

# Desired replicas of one deployment. The reconciler creates them in batches
# (placement/reconciler.py), but each is a row and, while pending, a planning attempt.
MAX_REPLICAS = 10_000
# A profile's power claim, per shard (W): more than any rack draws, less than a float's surprises.
MAX_POWER_W = 1_000_000.0
# As the wire's Text and Short.
MAX_ARG_LEN = 4096
MAX_ENV_NAME_LEN = 128
MAX_ENV_VALUE_LEN = 4096
MAX_ITEMS = MAX_LIST


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def args_problem(value: Any) -> str | None:
    """Why `value` is not a profile's args (an argv list of at most MAX_ITEMS strings); None when it is."""
    if not isinstance(value, list):
        return f"must be a list of strings (an argv list), not {_kind(value)}"
    if len(value) > MAX_ITEMS:
        return f"at most {MAX_ITEMS} arguments, not {len(value)}"
    for i, arg in enumerate(value):
        if not isinstance(arg, str):
            return f"item {i} is {_kind(arg)}: every argument is a string"
        if len(arg) > MAX_ARG_LEN:
            return f"item {i} is longer than {MAX_ARG_LEN} characters"
    return None


def env_problem(value: Any) -> str | None:
    """Why `value` is not a profile's env (a map of at most MAX_ITEMS names to strings); None when it is."""
    if not isinstance(value, dict):
        return f"must be an object of names to strings, not {_kind(value)}"
    if len(value) > MAX_ITEMS:
        return f"at most {MAX_ITEMS} variables, not {len(value)}"
    for name, v in value.items():
        if not name or len(name) > MAX_ENV_NAME_LEN:
            return f"variable names are 1 to {MAX_ENV_NAME_LEN} characters ({name[:20]!r})"
        if not isinstance(v, str):
            return f"{name} is {_kind(v)}: every value is a string"
        if len(v) > MAX_ENV_VALUE_LEN:
            return f"{name} is longer than {MAX_ENV_VALUE_LEN} characters"
    return None


def power_problem(value: Any) -> str | None:
    """Why `value` is not a profile's power claim (a finite number of watts, 0 to MAX_POWER_W); None when it is."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "must be a number of watts"
    if not math.isfinite(value):
        return "must be a finite number of watts"
    if not 0 <= value <= MAX_POWER_W:
        return f"must be between 0 and {MAX_POWER_W:g} W"
    return None


def _raise(why: str | None) -> None:
    if why:
        raise ValidationError(why)


def validate_args(value: Any) -> None:
    """The model field's validator: args_problem as a ValidationError."""
    _raise(args_problem(value))


def validate_env(value: Any) -> None:
    """The model field's validator: env_problem as a ValidationError."""
    _raise(env_problem(value))


def validate_power(value: Any) -> None:
    """The model field's validator: power_problem as a ValidationError."""
    _raise(power_problem(value))


class JSONShape(Func):
    """A check constraint's condition: the JSON column `column` holds `shape`.

    "strings": a list of at most MAX_ITEMS strings; "string_map": an object
    whose values are strings. PostgreSQL checks every item; SQLite (the
    embedded default, where a check cannot look inside) the outer type only.
    """

    output_field = BooleanField()

    def __init__(self, column: str, shape: str) -> None:
        if shape not in ("strings", "string_map"):
            raise ValueError(f"unknown JSON shape {shape!r}")
        super().__init__(F(column))
        self.shape = shape

    def as_sql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list]:
        """The outer type only (every backend but PostgreSQL)."""
        sql, params = compiler.compile(self.source_expressions[0])
        outer = "array" if self.shape == "strings" else "object"
        return f"(json_type({sql}) = '{outer}')", list(params)

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list]:
        """The outer type, the count, and each item's type."""
        sql, params = compiler.compile(self.source_expressions[0])
        if self.shape == "strings":
            checks = [
                f"jsonb_typeof({sql}) = 'array'",
                f"jsonb_array_length({sql}) <= {MAX_ITEMS}",
                f"NOT jsonb_path_exists({sql}, '$[*] ? (@.type() != \"string\")')",
            ]
            return "(" + " AND ".join(checks) + ")", list(params) * 3
        checks = [
            f"jsonb_typeof({sql}) = 'object'",
            f"NOT jsonb_path_exists({sql}, '$.* ? (@.type() != \"string\")')",
        ]
        return "(" + " AND ".join(checks) + ")", list(params) * 2


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def mended_args(value: Any) -> list[str]:
    """What a stored args value that breaks the bounds becomes: its items as strings, nulls dropped."""
    if not isinstance(value, list):
        return []
    return [_as_text(a) for a in value if a is not None][:MAX_ITEMS]


def mended_env(value: Any) -> dict[str, str]:
    """What a stored env value that breaks the bounds becomes: its values as strings, nulls dropped."""
    if not isinstance(value, dict):
        return {}
    return {str(k): _as_text(v) for k, v in value.items() if v is not None}


def mended_power(value: Any) -> float:
    """A stored power claim within the bounds: not a finite number or below 0 is 0 (derived from the cards)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return 0.0
    return min(float(value), MAX_POWER_W)
