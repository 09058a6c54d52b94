"""What the data plane holds in memory: the routing table and the usable keys.

Built from the database in a constant number of queries, by the data plane
at start, on a push (gateway/notify.py) and every LLMGW_GATEWAY_REFRESH
seconds; never per request.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from django.db.models import Case, Q, Value, When
from django.utils import timezone

from gateway import usage
from gateway.models import ApiKey
from placement.models import Deployment, Replica, ReplicaState, Shard


@dataclass(frozen=True)
class Backend:
    """A replica that takes new requests: ready and not being retired."""

    id: str
    endpoint: str
    engine: str
    # The engine's version as the rank-0 node's agent reported it ("" when unknown).
    engine_version: str
    deployment: str


@dataclass(frozen=True)
class ModelRoute:
    """One served model: its ready replicas and, when there are none, why."""

    name: str
    backends: tuple[Backend, ...]
    desired: int
    # The planner's reason for the oldest pending replica ("" when none is pending).
    pending_reason: str
    # Autoscaled: a request finding no ready replica is held while one starts (gateway/dataplane/hold.py).
    hold: bool = False
    # The planner's refusal of a pending replica ("" when none was refused): a held request is answered at once.
    unplaceable: str = ""

    def unavailable_reason(self) -> str:
        """The 503's message: "llama-70b: 0 of 2 replicas ready; pending: 3 free GPUs, needs 4"."""
        text = f"{self.name}: {len(self.backends)} of {self.desired} replicas ready"
        if self.pending_reason:
            text += f"; pending: {self.pending_reason[:300]}"
        return text


NOTHING_SPENT = usage.Spent()


@dataclass(frozen=True)
class KeyEntry:
    """A key as the data plane checks it: no secret, only what a request is judged by."""

    id: int
    name: str
    expires_at: dt.datetime | None
    # None: every model.
    allowed_models: frozenset[str] | None
    rpm_limit: int
    tpm_limit: int
    # Budgets per UTC day and month (0: none), and the spend recorded in the database for the
    # day `recorded_on` (and its month) when the keys were loaded: what the budget counters
    # are checked against (gateway/dataplane/budgets.py).
    tokens_per_day: int = 0
    tokens_per_month: int = 0
    recorded: usage.Spent = NOTHING_SPENT
    recorded_on: dt.date | None = None

    def expired(self, now: dt.datetime) -> bool:
        """Whether the key has expired at `now`."""
        return self.expires_at is not None and self.expires_at <= now

    def allows(self, model: str) -> bool:
        """Whether the key may use `model`."""
        return self.allowed_models is None or model in self.allowed_models


def load_routes() -> dict[str, ModelRoute]:
    """Every served model with its ready replicas (three queries, whatever the cluster's size)."""
    deployments = list(Deployment.objects.select_related("profile").order_by("id"))
    by_name: dict[str, list[Deployment]] = defaultdict(list)
    for d in deployments:
        by_name[d.served_model].append(d)
    replicas = list(
        Replica.objects.filter(state__in=[ReplicaState.READY, ReplicaState.PENDING])
        .order_by("created_at", "id")
        .annotate(refused=Case(When(pending_reasons={}, then=Value(False)), default=Value(True)))
        .values("id", "deployment_id", "state", "endpoint", "reason", "refused")
    )
    ready_ids = [r["id"] for r in replicas if r["state"] == ReplicaState.READY]
    versions = {
        s["replica_id"]: s["node__engine_versions"] or {}
        for s in Shard.objects.filter(replica_id__in=ready_ids, rank=0).values("replica_id", "node__engine_versions")
    }
    per_dep: dict[int, list[dict]] = defaultdict(list)
    for r in replicas:
        per_dep[r["deployment_id"]].append(r)
    table: dict[str, ModelRoute] = {}
    for name, deps in by_name.items():
        backends: list[Backend] = []
        pending = unplaceable = ""
        for d in deps:
            engine = d.profile.engine
            for r in per_dep.get(d.id, []):
                if r["state"] == ReplicaState.READY and r["endpoint"]:
                    version = versions.get(r["id"], {}).get(engine, "")
                    backends.append(Backend(str(r["id"]), r["endpoint"], engine, str(version), d.name))
                elif r["state"] == ReplicaState.PENDING:
                    pending = pending or r["reason"]
                    if r["refused"] and not unplaceable:
                        unplaceable = r["reason"]
        hold = any(d.autoscaled for d in deps)
        table[name] = ModelRoute(name, tuple(backends), sum(d.replicas for d in deps), pending, hold, unplaceable)
    return table


def load_keys() -> dict[str, KeyEntry]:
    """Usable keys by hash, with the recorded spend of those with a budget (two queries).

    Revoked keys are left out, expired ones kept to say so.
    """
    out: dict[str, KeyEntry] = {}
    now = timezone.now()
    rows = list(
        ApiKey.objects.filter(Q(revoked_at__isnull=True)).only(
            "id",
            "name",
            "key_hash",
            "expires_at",
            "allowed_models",
            "rpm_limit",
            "tpm_limit",
            "tokens_per_day",
            "tokens_per_month",
        )
    )
    spent = usage.spent([k.id for k in rows if k.tokens_per_day or k.tokens_per_month], now)
    for k in rows:
        out[k.key_hash] = KeyEntry(
            id=k.id,
            name=k.name,
            expires_at=k.expires_at,
            allowed_models=frozenset(k.allowed_models) if k.allowed_models else None,
            rpm_limit=k.rpm_limit,
            tpm_limit=k.tpm_limit,
            tokens_per_day=k.tokens_per_day,
            tokens_per_month=k.tokens_per_month,
            recorded=spent.get(k.id, NOTHING_SPENT),
            recorded_on=now.astimezone(dt.UTC).date(),
        )
    return out
