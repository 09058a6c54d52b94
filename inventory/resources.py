"""What a node can offer a replica: free GPUs, local disk, weights, memory.

Zero and empty mean "not reported", never "none": each constrains nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def free_gpu_indices(gpus: Iterable[Any], taken: Iterable[int]) -> list[int]:
    """Indices of the cards neither allocated nor unhealthy, sorted.

    A GPU with an ECC fault or another process on it is not free in any
    useful sense, whatever the allocations say.
    """
    held = set(taken)
    return sorted(g.index for g in gpus if g.index not in held and g.healthy)


def local_disk(storage: Iterable[Any]) -> tuple[int, int]:
    """Free and total bytes on the filesystems this node fills itself.

    Shared filesystems are left out on purpose: a filer mounted by twenty
    nodes must not count as twenty free terabytes. (0, 0) is unknown (an agent
    too old to say, or no model directories), and callers must read it so,
    not as a full disk.
    """
    free = total = 0
    for s in storage:
        if s.shared:
            continue
        free += s.free_bytes
        total += s.total_bytes
    return free, total


def knows_its_weights(weights_reported: bool) -> bool:
    """Whether the node was asked to look for weights at all.

    A node reporting none because nobody configured a directory must not be
    excluded from placement; one that looked and has none should be. So it
    is whether the agent looked (sent a list, empty or not), never whether it
    found anything: an empty list from a node that looked is "has none".
    """
    return weights_reported


def has_weights(weights: Iterable[Any], source: str) -> bool:
    """Whether this node can see the given source: an exact path match.

    A source that is not a path (a model id the engine resolves itself) cannot
    be checked from here, and guessing would be worse than the honest answer.
    """
    return any(w.path == source for w in weights)
