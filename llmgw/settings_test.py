"""Settings for the test suite: real PostgreSQL and Redis on localhost.

Tests run against the production stores (a mock database proves nothing);
only the broker is in memory, since tests call tasks directly.
"""

import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("CELERY_BROKER_URL", "memory://")
os.environ.setdefault("SECRET_KEY", "llmgw-test-key")
os.environ.setdefault("LLMGW_CACHE_PREFIX", "llmgw-test")
# A request waits at most this long for a pooled connection (30 s otherwise):
# a test that cannot get one fails sooner.
os.environ.setdefault("DATABASE_POOL_TIMEOUT", "10")
# The test client and the test servers scrape from loopback (tests/inventory/test_metrics.py checks the refusals).
os.environ.setdefault("LLMGW_METRICS_ALLOW", "127.0.0.1/32,::1/128")

from llmgw.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
CELERY_TASK_ALWAYS_EAGER = False
