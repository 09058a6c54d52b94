"""Settings for the end-to-end subset of the suite on the embedded default: SQLite and the file cache.

The embedded default is a supported database, not a fallback: the agent
protocol, the reconciler and the demo must work on it as they do on
PostgreSQL. `make test` runs the tests marked `e2e` a second time with these
settings. The database is a file (never SQLite's in-memory database), since
some of those tests start the control plane as a process of its own that
must open the same database.
"""

import os
from pathlib import Path

# Everything the embedded default keeps on disk, apart from any developer's var/.
_VAR = Path(os.environ.get("LLMGW_TEST_SQLITE_DIR") or Path(__file__).resolve().parents[1] / "var" / "test-sqlite")
# Under `pytest -n N` each worker (gw0, gw1, ...) has a folder of its own: its database, cache and broker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _VAR = _VAR / os.environ["PYTEST_XDIST_WORKER"]
os.environ["LLMGW_VAR_DIR"] = str(_VAR)
os.environ["DATABASE_URL"] = f"sqlite:///{_VAR / 'llmgw.sqlite3'}"
# The embedded default has no Redis: the cache is the file cache the web process and the worker share.
os.environ["REDIS_URL"] = ""
os.environ.setdefault("CELERY_BROKER_URL", "memory://")
os.environ.setdefault("SECRET_KEY", "llmgw-test-key")
# As in llmgw/settings_test.py: the test servers are scraped from loopback.
os.environ.setdefault("LLMGW_METRICS_ALLOW", "127.0.0.1/32,::1/128")

from llmgw.settings import *  # noqa: E402, F403
from llmgw.settings import DATABASES  # noqa: E402

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
CELERY_TASK_ALWAYS_EAGER = False
# pytest-django's test database: a file beside the one it stands for.
DATABASES["default"]["TEST"] = {"NAME": str(_VAR / "test_llmgw.sqlite3")}
