"""The planner's reasons, node by node, as an answer someone can read.

At 10,000 nodes a reason for each is 10,000 lines nobody reads, and
rendering them cost the dry run more than planning did. What an operator
asks is what keeps a replica off most nodes, and which nodes could take it:
each distinct reason with how many nodes it holds off and a few of them, and
the nodes that fit, up to a bound. Every node's reason is there on request.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from placement import planner

# What a dry run answers: the summary, or every node's reason too.
SUMMARY, EVERY_NODE = "summary", "all"
# Node names shown per reason.
EXAMPLES = 3
# Nodes that fit, shown by name.
FITS_SHOWN = 20


@dataclass(frozen=True)
class ReasonCount:
    """One reason the planner gave, how many nodes it gave it for, and the first few of them by name."""

    reason: str
    nodes: int
    examples: tuple[str, ...]


def summary(reasons: Mapping[str, str], *, examples: int = EXAMPLES) -> list[ReasonCount]:
    """Each distinct reason with its node count and up to `examples` node names: commonest first."""
    seen: dict[str, tuple[list[int], list[str]]] = {}
    for node, why in reasons.items():
        group = seen.get(why)
        if group is None:
            seen[why] = ([1], [node])
            continue
        group[0][0] += 1
        if len(group[1]) < examples:
            group[1].append(node)
    rows = [ReasonCount(why, count[0], tuple(names)) for why, (count, names) in seen.items()]
    return sorted(rows, key=lambda r: (-r.nodes, r.reason))


def fitting(reasons: Mapping[str, str], *, limit: int = FITS_SHOWN) -> list[str]:
    """The first `limit` nodes (in the reasons' order) that could take the replica too."""
    return list(itertools.islice((n for n, why in reasons.items() if why.startswith("fits")), limit))


def shown(result: planner.Plan | planner.NoPlace, *, every: bool = False) -> dict[str, Any]:
    """A plan or a refusal as the dry run answers it: the reasons summarised, every node's with `every`."""
    out: dict[str, Any] = {"ok": result.ok}
    if isinstance(result, planner.Plan):
        out.update(
            nvlink_domain=result.nvlink_domain,
            fabric=result.fabric,
            fabric_name=result.fabric_name,
            env=result.env,
            shards=result.shards,
        )
    else:
        out["reason"] = result.reason
    out["summary"] = summary(result.reasons)
    out["fits"] = fitting(result.reasons)
    if every:
        out["reasons"] = result.reasons
    return out
