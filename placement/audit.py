"""Operator changes to engine profiles, holds and power budgets: each saved or deleted
together with an event saying who, when and what changed.

The API and the admin both write through here, so neither can change one of
these rows without leaving its record.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.db import models, transaction

from placement import replicas, secrets
from placement.models import EngineProfile, Hold, PlacementEvent, PowerBudget

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

Audited = EngineProfile | Hold | PowerBudget

KINDS: dict[type[models.Model], str] = {EngineProfile: "profile", Hold: "hold", PowerBudget: "power_budget"}
# Fields shown masked in events (placement/secrets.py).
SHOWN = {(EngineProfile, "env"): secrets.shown_env, (EngineProfile, "args"): secrets.shown_args}


def subject(obj: Audited) -> str:
    """What the row is, in the words an operator reads in the events."""
    if isinstance(obj, EngineProfile):
        return f"profile {obj.name}"
    if isinstance(obj, PowerBudget):
        return f"power budget {obj.label_key}={obj.label_value}"
    return str(obj)


def _described(obj: Audited) -> str:
    """The subject with what matters about a row that appears or goes."""
    if isinstance(obj, Hold) and obj.reason:
        return f"{subject(obj)} ({obj.reason})"
    if isinstance(obj, PowerBudget):
        return f"{subject(obj)} ({obj.budget_w:g} W)"
    return subject(obj)


def _fields(model: type[models.Model]) -> list[models.Field]:
    return [f for f in model._meta.concrete_fields if f.editable and not f.primary_key]


def changes(before: Audited, after: Audited) -> list[str]:
    """Each field an operator changed, as "field old -> new"."""
    out = []
    for f in _fields(type(after)):
        old, new = f.to_python(getattr(before, f.attname)), f.to_python(getattr(after, f.attname))
        if old == new:
            continue
        shown = SHOWN.get((type(after), f.name))
        if shown is not None:
            # Events are read by every viewer: a secret never appears in one.
            old, new = shown(old), shown(new)
            if old == new:
                out.append(f"{f.name}: a secret value replaced")
                continue
        out.append(f"{f.name} {old!r} -> {new!r}")
    return out


def _event(obj: Audited, reason: str, *, now: dt.datetime, actor: AbstractBaseUser | None) -> PlacementEvent:
    return replicas.event(KINDS[type(obj)], now=now, reason=reason, actor=actor)


def save(obj: Audited, *, now: dt.datetime, actor: AbstractBaseUser | None) -> Audited:
    """Create or change a row (its new values already set on `obj`) and record it.

    A new hold is created by `actor`. Saving without a change records nothing.
    """
    with transaction.atomic():
        before = type(obj).objects.select_for_update().filter(pk=obj.pk).first() if obj.pk else None
        if before is None and isinstance(obj, Hold):
            obj.created_by = actor
        obj.save()
        if before is None:
            _event(obj, f"created: {_described(obj)}", now=now, actor=actor).save()
        elif diff := changes(before, obj):
            _event(obj, f"changed: {subject(before)}: {', '.join(diff)}", now=now, actor=actor).save()
    return obj


def delete(objs: Iterable[Audited], *, now: dt.datetime, actor: AbstractBaseUser | None) -> None:
    """Delete rows and record each; a refused delete (a profile still in use) records nothing."""
    with transaction.atomic():
        for obj in objs:
            _event(obj, f"deleted: {_described(obj)}", now=now, actor=actor).save()
            obj.delete()
