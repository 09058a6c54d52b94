"""What the agent needs from hardware discovery, and the real thing (llmgw_agent.discovery)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import llmgw_wire as wire
from llmgw_agent import discovery


class Probe(Protocol):
    """What the loop needs from hardware discovery (llmgw_agent.discovery, or a test's own)."""

    def discover(self) -> Any: ...
    def sample(self, previous: Any = None) -> Any: ...
    def gpu_fabrics(self) -> list[wire.GPUFabricReport]: ...
    def ibnetdiscover(self, *, hca: str, port: int, timeout: float) -> Any: ...


class DiscoveryProbe:
    """The real probe: llmgw_agent.discovery, on the live machine or a fixture root."""

    def __init__(self, *, root: str | Path | None, model_dirs: list[str], engines_live: bool = False) -> None:
        self._d = discovery
        self.root = Path(root) if root else None
        self.model_dirs = list(model_dirs)
        self.engines_live = engines_live

    def discover(self) -> Any:
        """The node's whole inventory, for a registration."""
        return self._d.discover(root=self.root, model_dirs=self.model_dirs, engines_live=self.engines_live)

    def sample(self, previous: Any = None) -> Any:
        """One heartbeat's sensors (rates from `previous`)."""
        return self._d.sample(root=self.root, previous=previous)

    def gpu_fabrics(self) -> list[wire.GPUFabricReport]:
        """The GPUs' NVLink fabric state."""
        return self._d.gpu_fabrics(root=self.root)

    def ibnetdiscover(self, *, hca: str, port: int, timeout: float) -> Any:
        """A fabric scan from one port."""
        return self._d.ibnetdiscover(hca=hca, port=port, timeout=timeout, root=self.root)
