"""Checks on the cards and what runs them: GPU wear and health, engine installations."""

from __future__ import annotations

import llmgw_wire as wire
from inventory import gpus as gpu_rules
from inventory.doctor import registry
from inventory.doctor.loader import Inventory
from inventory.doctor.results import CheckResult, Findings, verdict


def find_gpu_health(inv: Inventory) -> Findings:
    """Each node's findings of check_gpu_health, flagged "card" and/or "app_xid" for the action they call for."""
    out = Findings()
    found, fails = out.found, out.fails
    for n in inv.nodes:
        # What the findings call for: the card (reset, replace) and/or the engine (an application XID).
        card_trouble = app_xids = False
        sensors = {s.get("index"): s for s in (inv.telemetry.get(n.id) or {}).get("gpus") or []}
        for g in inv.gpus(n.id):
            problems = list(g.problems or [])
            if g.ecc_errors:
                problems.append(f"{g.ecc_errors} uncorrected ECC errors")
                fails.add(n.id)
                card_trouble = True
            sensor = sensors.get(g.index) or {}
            wear_data = sensor.get("wear")
            if wear_data:
                try:
                    wear = wire.GPUWear.model_validate(wear_data)
                except ValueError:
                    wear = None
                if wear is not None:
                    problems.extend(gpu_rules.wear_problems(wear))
                    if wear.remap_failure or wear.remapped_rows_uncorrectable > 0 or wear.retired_pages_dbe > 0:
                        fails.add(n.id)
                    app_xid = wear.xid_errors > 0 and gpu_rules.xid_is_application(wear.last_xid)
                    if gpu_rules.hardware_xid(wear):
                        fails.add(n.id)
                    app_xids = app_xids or app_xid
                    # Everything in the wear column but an application XID is the card's.
                    card_trouble = card_trouble or len(gpu_rules.wear_problems(wear)) > int(app_xid)
            # The agent's own line for a fatal XID ("XID 79: ...") repeats the wear column's.
            said = {p.split(" (", 1)[0] for p in problems if p.startswith("XID ")}
            extra = [p for p in sensor.get("problems") or [] if p not in problems and p.split(":", 1)[0] not in said]
            card_trouble = card_trouble or bool(extra) or bool(g.problems)
            problems.extend(extra)
            for p in problems:
                found.setdefault(n.id, []).append(f"GPU {g.index}: {p}")
        if card_trouble:
            out.flag(n.id, "card")
        if app_xids:
            out.flag(n.id, "app_xid")
    return out


def verdict_gpu_health(f: Findings, inv: Inventory) -> CheckResult:
    """The verdict of check_gpu_health over every node's findings; its action follows the flags."""
    card_trouble = any("card" in v for v in f.flags.values())
    app_xids = any("app_xid" in v for v in f.flags.values())
    actions = []
    if card_trouble:
        actions.append(
            "drain the node and reset the card (pending remaps and retirements need one); a card out of "
            "spare rows or with uncorrectable errors needs replacing"
        )
    if app_xids:
        actions.append(
            "an application XID (13, 31, 43, 45, 68) is the engine's own fault: read the shard's log and fix "
            "or restart the engine; do not reset the card for it"
        )
    return verdict(
        "gpu_health",
        f.found,
        fails=f.fails,
        ok="no GPU reports wear or health problems",
        bad="{n} node(s) with GPU problems",
        action="; ".join(actions),
    )


def check_gpu_health(inv: Inventory) -> CheckResult:
    """The wear and health problems agents report for their cards."""
    return verdict_gpu_health(find_gpu_health(inv), inv)


def check_engine_installs(inv: Inventory) -> CheckResult:
    """Engine installations that failed."""
    found: dict[str, list[str]] = {}
    for i in inv.failed_installs:
        detail = f": {i.detail}" if i.detail else ""
        found.setdefault(i.node_id, []).append(f"{i.engine} {i.version} failed{detail}".replace("  ", " "))
    return verdict(
        "engine_installs",
        found,
        fails=set(found),
        ok="no engine installation failed",
        bad="{n} node(s) with a failed engine installation",
        action="read the detail, fix the cause (disk space, network, a wheel for this CUDA), and reinstall "
        "the engine on the node from the admin",
    )


registry.per_node(check_gpu_health, find=find_gpu_health, verdict=verdict_gpu_health)
