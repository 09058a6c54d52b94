"""Settings for the test suite: real PostgreSQL and Redis on localhost.

Tests run against the production stores (a mock database proves nothing);
only the broker is in memory, since tests call tasks directly. Redis database 12 by
default, so the four workers of `make test` (`pytest -n 4`) take 12 to 15.
"""

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("CELERY_BROKER_URL", "memory://")
os.environ.setdefault("SECRET_KEY", "llmgw-test-key")
os.environ.setdefault("LLMGW_CACHE_PREFIX", "llmgw-test")
# A request waits at most this long for a pooled connection (30 s otherwise):
# a test that cannot get one fails sooner.
os.environ.setdefault("DATABASE_POOL_TIMEOUT", "10")
# The test client and the test servers scrape from loopback (tests/inventory/test_metrics.py checks the refusals).
os.environ.setdefault("LLMGW_METRICS_ALLOW", "127.0.0.1/32,::1/128")


def _isolate_xdist_worker() -> None:
    """Under `pytest -n N`, give this worker (gw0, gw1, ...) a Redis database, cache prefix and var/ of its own.

    pytest-django already gives each worker its own test database (test_<name>_gw<N>).
    Redis database = the base URL's + N, so workers of two runs started with bases
    4 apart never meet. The environment is rewritten, not only the settings, so the
    processes a test starts (gateways, agents, the web server) inherit the worker's
    stores; LLMGW_TEST_WORKER marks it done, so a child loading these settings
    again keeps what its test gave it.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker or os.environ.get("LLMGW_TEST_WORKER") == worker:
        return
    number = int(worker.removeprefix("gw"))
    redis = urlsplit(os.environ["REDIS_URL"])
    db = int(redis.path.strip("/") or 0) + number
    if db > 15:
        raise ValueError(
            f"REDIS_URL={os.environ['REDIS_URL']}: worker {worker} would need Redis database {db}"
            " (0-15): lower the URL's database or run fewer workers"
        )
    os.environ["REDIS_URL"] = urlunsplit(redis._replace(path=f"/{db}"))
    os.environ["LLMGW_CACHE_PREFIX"] = f"{os.environ['LLMGW_CACHE_PREFIX']}-{worker}"
    var = Path(os.environ.get("LLMGW_VAR_DIR") or Path(__file__).resolve().parents[1] / "var")
    os.environ["LLMGW_VAR_DIR"] = str(var / f"test-{worker}")
    os.environ["LLMGW_TEST_WORKER"] = worker


_isolate_xdist_worker()

from llmgw.settings import *  # noqa: E402, F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
CELERY_TASK_ALWAYS_EAGER = False
