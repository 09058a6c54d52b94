"""The doctor: checks that tell an operator something is wrong before a job hangs.

Each check is a plain function over an `Inventory` (a snapshot read in a
constant number of queries, plus the telemetry cache: `loader`) and answers
pass, warn or fail, the nodes it concerns, what it found and what to do
(`results`). The checks live one module per family (`nodes`, `nvlink`,
`infiniband`, `gpus`) and run in the order they were registered
(`registry`): the inventory's below, then those other apps add from their
AppConfig.ready() (placement's pending replicas). `manage.py doctor`,
`GET /api/v1/doctor` and the `llmgw_doctor_checks` metric all run
`run_checks` on the same snapshot; the last two reuse a run for
settings.LLMGW_DOCTOR_CACHE seconds (`caching.latest`), so what they show
can be that old, and the report's `at` says when it ran.
"""

from __future__ import annotations

from inventory.doctor.caching import cached, forget_cached, latest, run, store
from inventory.doctor.gpus import check_engine_installs, check_gpu_health
from inventory.doctor.infiniband import (
    COUNTER_WINDOW,
    ERROR_COUNTERS,
    FAIL_COUNTERS,
    check_ib_errors,
    check_ib_physical_fabric,
    check_ib_ports,
    check_ib_scan_coverage,
    check_ib_subnet_manager,
)
from inventory.doctor.loader import FabricRow, GPURow, Inventory, counter_key, load_inventory
from inventory.doctor.nodes import (
    SKEW_FAIL_S,
    SKEW_WARN_S,
    check_clock_skew,
    check_control_plane_liveness,
    check_nodes_reachable,
)
from inventory.doctor.nvlink import (
    check_imex,
    check_nvlink_bandwidth,
    check_nvlink_domains,
    check_nvlink_health,
    check_nvlink_joined,
)
from inventory.doctor.registry import check_names, checks, register, run_checks
from inventory.doctor.results import CheckResult, Result, overall, report, verdict

for _check in (
    check_control_plane_liveness,
    check_nodes_reachable,
    check_clock_skew,
    check_nvlink_joined,
    check_nvlink_bandwidth,
    check_nvlink_health,
    check_nvlink_domains,
    check_imex,
    check_ib_physical_fabric,
    check_ib_ports,
    check_ib_subnet_manager,
    check_ib_errors,
    check_ib_scan_coverage,
    check_gpu_health,
    check_engine_installs,
):
    register(_check)

__all__ = [
    "COUNTER_WINDOW",
    "ERROR_COUNTERS",
    "FAIL_COUNTERS",
    "SKEW_FAIL_S",
    "SKEW_WARN_S",
    "CheckResult",
    "FabricRow",
    "GPURow",
    "Inventory",
    "Result",
    "cached",
    "check_clock_skew",
    "check_control_plane_liveness",
    "check_engine_installs",
    "check_gpu_health",
    "check_ib_errors",
    "check_ib_physical_fabric",
    "check_ib_ports",
    "check_ib_scan_coverage",
    "check_ib_subnet_manager",
    "check_imex",
    "check_names",
    "check_nodes_reachable",
    "check_nvlink_bandwidth",
    "check_nvlink_domains",
    "check_nvlink_health",
    "check_nvlink_joined",
    "checks",
    "counter_key",
    "forget_cached",
    "latest",
    "load_inventory",
    "overall",
    "register",
    "report",
    "run",
    "run_checks",
    "store",
    "verdict",
]
