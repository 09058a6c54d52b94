"""Settings for llmgw.

Everything that differs between a laptop and production comes from the
environment. Unset, each falls back to the embedded default: SQLite and a
Celery broker on the filesystem, so `make run` needs nothing but Python.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import socket
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
# A checkout keeps its state in ./var; an installed copy (pip install .) must
# not write into site-packages, so it uses var/ under the working directory.
_DEFAULT_VAR_DIR = BASE_DIR / "var" if (BASE_DIR / "manage.py").exists() else Path.cwd() / "var"
VAR_DIR = Path(os.environ.get("LLMGW_VAR_DIR", _DEFAULT_VAR_DIR))


def env_bool(name: str, default: bool = False) -> bool:
    """Read a boolean from the environment; anything but a known word is an error."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def env_seconds(name: str, default: float) -> float:
    """Read a duration in seconds from the environment."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number of seconds") from exc
    if value <= 0:
        raise ImproperlyConfigured(f"{name}={raw!r} must be positive")
    return value


def env_networks(name: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Read a comma-separated list of addresses or networks (CIDR) from the environment."""
    out = []
    for part in os.environ.get(name, "").split(","):
        if part.strip():
            try:
                out.append(ipaddress.ip_network(part.strip(), strict=False))
            except ValueError as exc:
                raise ImproperlyConfigured(f"{name}: {part.strip()!r} is not an address or network") from exc
    return out


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    """Read a whole number from the environment, at least `minimum`."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a whole number") from exc
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be at least {minimum}")
    return value


DEBUG = env_bool("DEBUG", False)

SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off (or set DEBUG=1 on a laptop)")
    # Only a development server on a laptop gets here.
    SECRET_KEY = "llmgw-insecure-development-key-do-not-use-in-production"
# Keys being retired, comma-separated: what they signed (sessions, CSRF tokens, password reset
# links) stays valid while the new SECRET_KEY signs everything new (docs/operations.md, rotation).
SECRET_KEY_FALLBACKS = [k.strip() for k in os.environ.get("SECRET_KEY_FALLBACKS", "").split(",") if k.strip()]

ALLOWED_HOSTS = [
    h.strip() for h in os.environ.get("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",") if h.strip()
]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_prometheus",
    "llmgw",
    "inventory",
    "placement",
    "agents",
    "gateway",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # A NUL in a URL is refused before a view takes it to the database (llmgw/validation.py).
    "llmgw.validation.UnstorableRequestMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "llmgw.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # templates/ in a checkout; llmgw/templates/ where pip installed it (pyproject.toml maps it).
        "DIRS": [BASE_DIR / "templates", Path(__file__).resolve().parent / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "llmgw.wsgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'llmgw.sqlite3'}",
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60),
        conn_health_checks=True,
    )
}
# PostgreSQL connections come from a pool of at most DATABASE_POOL_MAX per
# process. Persistent connections are one per thread, and a server that starts
# a thread per request (runserver under `make run`) kept every one of them:
# six demo agents had PostgreSQL refuse everyone ("too many clients already")
# within minutes. A pooled connection goes back to the pool at the end of each
# request; a request finding none free waits up to DATABASE_POOL_TIMEOUT.
# DATABASE_POOL_MAX=0: persistent connections (DATABASE_CONN_MAX_AGE), one per
# thread, for servers with a fixed number of threads.
DATABASE_POOL_MAX = env_int("DATABASE_POOL_MAX", 4)
DATABASE_POOL_TIMEOUT = env_seconds("DATABASE_POOL_TIMEOUT", 30.0)
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and DATABASE_POOL_MAX:
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": min(1, DATABASE_POOL_MAX),
        "max_size": DATABASE_POOL_MAX,
        "timeout": DATABASE_POOL_TIMEOUT,
        # Above min_size, a connection idle this long is closed.
        "max_idle": 60.0,
    }
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The web process and the worker share one file: WAL lets readers run
    # beside a writer, and the busy timeout makes a writer wait its turn
    # instead of failing with "database is locked".
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # SQLite creates the file, not its directory: a fresh checkout has no var/.
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;",
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL", "")
LLMGW_CACHE_PREFIX = os.environ.get("LLMGW_CACHE_PREFIX", "llmgw")
# Seconds a Redis call may take (the cache, the gateway's shared counters) before it is given up.
LLMGW_CACHE_TIMEOUT = env_seconds("LLMGW_CACHE_TIMEOUT", 1.0)
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "llmgw.cache.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": LLMGW_CACHE_PREFIX,
            # A hung Redis must fail a cache call within a second or two, not hold a
            # heartbeat's request (and its lease transaction) open (inventory/telemetry.py).
            "OPTIONS": {
                "socket_connect_timeout": LLMGW_CACHE_TIMEOUT,
                "socket_timeout": LLMGW_CACHE_TIMEOUT,
            },
        }
    }
else:
    # Shared by the web process and the worker, unlike local memory.
    CACHES = {
        "default": {
            "BACKEND": "llmgw.file_cache.FileCache",
            "LOCATION": str(VAR_DIR / "cache"),
        }
    }

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Operator API tokens, stored hashed, with an expiry and a name (llmgw.models.OperatorToken).
        # First, so a request without credentials is a 401 saying which scheme to use.
        "llmgw.auth.OperatorTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["llmgw.permissions.ModelPermissions"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    # JSON only, bounded in depth, holding only strings PostgreSQL can store (llmgw/validation.py).
    "DEFAULT_PARSER_CLASSES": ["llmgw.validation.BoundedJSONParser"],
    "DEFAULT_PAGINATION_CLASS": "llmgw.validation.BoundedPagination",
    "PAGE_SIZE": 100,
}

KNOX_TOKEN_MODEL = "llmgw.OperatorToken"
# knox's migrations create its own token table even when the model is swapped
# out, and that orphan (referencing auth_user) breaks flushing the database.
MIGRATION_MODULES = {"knox": None}
REST_KNOX = {
    # "Authorization: Token llmgw-op-…"; the prefix tells an operator token from a node credential.
    "AUTH_HEADER_PREFIX": "Token",
    "TOKEN_PREFIX": "llmgw-op-",
    "TOKEN_TTL": dt.timedelta(days=env_int("LLMGW_API_TOKEN_DAYS", 90, minimum=1)),
    "AUTO_REFRESH": False,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "llmgw API",
    "DESCRIPTION": "Control plane for self-hosted LLM inference on GPU clusters.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "OAS_VERSION": "3.1.0",
    # Swagger UI and Redoc from drf-spectacular-sidecar's static files, never a CDN:
    # GPU clusters are often air-gapped, and a CDN's "latest" changes under us.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The refusals DRF answers with, declared on every operator operation (llmgw/schema.py).
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "llmgw.schema.declare_refusals"],
    # Several models have a `state`: each enum keeps its model's name.
    "ENUM_NAME_OVERRIDES": {
        "NodeStateEnum": "inventory.models.NodeState",
        "EngineInstallStateEnum": "inventory.models.EngineInstallState",
        "ReplicaStateEnum": "placement.models.ReplicaState",
        "ShardStateEnum": "placement.models.ShardState",
    },
}

# Celery: the broker is Redis (or anything kombu speaks) in production, the
# filesystem on a laptop so that a worker needs no server.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL == "filesystem://":
    # The filesystem has no host, but kombu warns "No hostname was supplied" in
    # every process given a URL without one: three lines of noise per `make run`.
    CELERY_BROKER_URL = "filesystem://localhost/"
    _broker_dir = VAR_DIR / "celery" / "broker"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(VAR_DIR / "celery" / "processed"),
        "control_folder": str(VAR_DIR / "celery" / "control"),
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celery" / "beat-schedule")
# One beat in the cluster: every beat takes a lock first (llmgw/beat.py).
CELERY_BEAT_SCHEDULER = "llmgw.beat.LockedScheduler"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Each app adds its periodic tasks here (see llmgw/celery.py).
CELERY_BEAT_SCHEDULE: dict = {}

# llmgw's own knobs.
LLMGW_JOIN_TOKEN = os.environ.get("LLMGW_JOIN_TOKEN", "")
# Who may scrape /metrics (it names every node, its state and allocations):
# a bearer token, and/or peers in these networks (0.0.0.0/0,::/0 opens it to
# all). Neither set: only a signed-in user who may view nodes.
LLMGW_METRICS_TOKEN = os.environ.get("LLMGW_METRICS_TOKEN", "")
LLMGW_METRICS_ALLOW = env_networks("LLMGW_METRICS_ALLOW")
# How long a join whose answer was lost may be retried with the same nonce (agents/credentials.py rejoin).
LLMGW_JOIN_RETRY_WINDOW = env_seconds("LLMGW_JOIN_RETRY_WINDOW", 600.0)
LLMGW_UNREACHABLE_AFTER = env_seconds("LLMGW_UNREACHABLE_AFTER", 30.0)
LLMGW_LOST_AFTER = env_seconds("LLMGW_LOST_AFTER", 300.0)
LLMGW_HEARTBEAT_INTERVAL = env_seconds("LLMGW_HEARTBEAT_INTERVAL", 5.0)
LLMGW_TELEMETRY_TTL = env_seconds("LLMGW_TELEMETRY_TTL", 120.0)
LLMGW_SM_CHANGES_KEPT = 500
# Fabric scans: how often one port per InfiniBand fabric runs ibnetdiscover,
# and how long the agent lets it run.
LLMGW_FABRIC_SCAN_INTERVAL = env_seconds("LLMGW_FABRIC_SCAN_INTERVAL", 600.0)
LLMGW_FABRIC_SCAN_TIMEOUT = env_seconds("LLMGW_FABRIC_SCAN_TIMEOUT", 120.0)
# How long the doctor's results are reused by /metrics and GET /api/v1/doctor
# (a Prometheus scrape interval or less; `manage.py doctor` always runs anew).
LLMGW_DOCTOR_CACHE = env_seconds("LLMGW_DOCTOR_CACHE", 15.0)
CELERY_BEAT_SCHEDULE["inventory.schedule_fabric_scans"] = {
    "task": "inventory.schedule_fabric_scans",
    "schedule": LLMGW_FABRIC_SCAN_INTERVAL,
}

# The liveness sweep (inventory/tasks.py; its name predates the move there):
# often enough that "unreachable" is seen within seconds of LLMGW_UNREACHABLE_AFTER.
LLMGW_LIVENESS_INTERVAL = env_seconds("LLMGW_LIVENESS_INTERVAL", 10.0)
CELERY_BEAT_SCHEDULE["agents.liveness_sweep"] = {
    "task": "agents.liveness_sweep",
    "schedule": LLMGW_LIVENESS_INTERVAL,
}
# The sweep's view of its own faults (inventory/liveness.py). Two sweeps further
# apart than LLMGW_SWEEP_GAP mean the control plane could not listen in between;
# more than LLMGW_MASS_SILENCE (a fraction) of the fleet, and at least
# LLMGW_MASS_SILENCE_MIN_NODES nodes, silent at once is read as the control
# plane's own outage, as Kubernetes' node lifecycle controller does; and no
# more than LLMGW_LOST_RATE of the fleet (at least one node) is declared lost
# per sweep.
LLMGW_SWEEP_GAP = env_seconds("LLMGW_SWEEP_GAP", 2.5 * LLMGW_LIVENESS_INTERVAL)
LLMGW_MASS_SILENCE = float(os.environ.get("LLMGW_MASS_SILENCE") or 0.55)
LLMGW_MASS_SILENCE_MIN_NODES = env_int("LLMGW_MASS_SILENCE_MIN_NODES", 3, minimum=1)
LLMGW_LOST_RATE = float(os.environ.get("LLMGW_LOST_RATE") or 0.1)

# Placement: the first HTTP port a shard gets on a node, and how often the
# reconciler runs (it is also queued by events).
LLMGW_SHARD_PORT_BASE = env_int("LLMGW_SHARD_PORT_BASE", 18000, minimum=1)
# Unique shard ports across the whole cluster. Nodes at one management
# address (a simulated fleet on one host) share their ports without it.
LLMGW_SHARD_PORTS_UNIQUE = env_bool("LLMGW_SHARD_PORTS_UNIQUE", False)
LLMGW_RECONCILE_INTERVAL = env_seconds("LLMGW_RECONCILE_INTERVAL", 10.0)
# The placement index each worker process keeps (placement/kept.py): brought up to date in the
# background this often, and rebuilt whole this often regardless.
LLMGW_KEPT_REFRESH_S = env_seconds("LLMGW_KEPT_REFRESH_S", 2.0)
LLMGW_KEPT_REBUILD_S = env_seconds("LLMGW_KEPT_REBUILD_S", 300.0)
# A deployment whose replicas keep failing to start is placed again after a
# growing delay (base x 2^(failures-1), capped), counting failures within the
# window since its last ready replica; a node where it failed to start
# LLMGW_AVOID_AFTER times in the window is kept off for that deployment.
LLMGW_START_BACKOFF_BASE = env_seconds("LLMGW_START_BACKOFF_BASE", 10.0)
LLMGW_START_BACKOFF_CAP = env_seconds("LLMGW_START_BACKOFF_CAP", 600.0)
LLMGW_START_FAILURE_WINDOW = env_seconds("LLMGW_START_FAILURE_WINDOW", 1800.0)
LLMGW_AVOID_AFTER = env_int("LLMGW_AVOID_AFTER", 2, minimum=1)
CELERY_BEAT_SCHEDULE["placement-reconcile"] = {
    "task": "placement.reconcile",
    "schedule": LLMGW_RECONCILE_INTERVAL,
    "options": {"expires": LLMGW_RECONCILE_INTERVAL},
}

# The gateway's data plane: how often it reloads its whole routing table and
# key list (pushes over Redis make changes visible sooner; this heals a lost
# one), how many consecutive failures eject a replica, and for how long.
LLMGW_GATEWAY_REFRESH = env_seconds("LLMGW_GATEWAY_REFRESH", 5.0)
LLMGW_GATEWAY_EJECT_AFTER = env_int("LLMGW_GATEWAY_EJECT_AFTER", 3, minimum=1)
LLMGW_GATEWAY_EJECT_FOR = env_seconds("LLMGW_GATEWAY_EJECT_FOR", 30.0)
LLMGW_GATEWAY_UPSTREAM_TIMEOUT = env_seconds("LLMGW_GATEWAY_UPSTREAM_TIMEOUT", 600.0)
# A request for an autoscaled model with no ready replica (scaled to zero) is held
# this long while one starts, at most this many per model and gateway process.
LLMGW_GATEWAY_HOLD_TIMEOUT = env_seconds("LLMGW_GATEWAY_HOLD_TIMEOUT", 120.0)
LLMGW_GATEWAY_HOLD_QUEUE = env_int("LLMGW_GATEWAY_HOLD_QUEUE", 100, minimum=1)
# How the data plane picks a replica: "prefix" (the replica holding the longest
# cached prefix of the prompt, within a load bound, gateway/routing.py) or
# "round-robin" (the baseline the benchmark measures it against).
LLMGW_GATEWAY_POLICY = os.environ.get("LLMGW_GATEWAY_POLICY", "prefix")
if LLMGW_GATEWAY_POLICY not in ("prefix", "round-robin"):
    raise ImproperlyConfigured(f"LLMGW_GATEWAY_POLICY={LLMGW_GATEWAY_POLICY!r}: use prefix or round-robin")
# Prompt blocks (128 bytes of text each) the prefix index remembers per replica:
# about what the replica's KV cache holds; the least recently sent go first.
LLMGW_GATEWAY_PREFIX_BLOCKS = env_int("LLMGW_GATEWAY_PREFIX_BLOCKS", 4096, minimum=1)
# How often each data plane reads every replica's engine /metrics (load and cache figures).
LLMGW_GATEWAY_SCRAPE = env_seconds("LLMGW_GATEWAY_SCRAPE", 1.0)
# How long a retiring replica's requests may run before its shards are stopped anyway.
LLMGW_DRAIN_REQUESTS_TIMEOUT = env_seconds("LLMGW_DRAIN_REQUESTS_TIMEOUT", 300.0)
# How often each data plane writes its usage counts (one upsert per flush).
LLMGW_GATEWAY_USAGE_FLUSH = env_seconds("LLMGW_GATEWAY_USAGE_FLUSH", 5.0)
# Seconds a client has to send a request's whole body, at the web server's front
# (llmgw/front.py) and at the gateway alike: a body trickled a byte at a time is
# cut off with a 408 then, and until then it holds a coroutine, never a thread.
LLMGW_BODY_TIMEOUT = env_seconds("LLMGW_BODY_TIMEOUT", 10.0)
# How long the agents' wakeup long-poll (agents/wakeup.py) is held before a 204:
# under the 30-60 s idle timeouts of the usual proxies and load balancers, so a
# quiet wait is never cut by one in the middle and read as an error.
LLMGW_AGENT_WAIT_S = env_seconds("LLMGW_AGENT_WAIT_S", 25.0)


def wakeup_url(explicit: str, gateway_listen: str) -> str:
    """Where agents hold the wakeup long-poll: LLMGW_WAKEUP_URL, else the gateway's listen address; "" for none.

    The control plane hands it to every agent in its register and heartbeat
    answers, so an agent configured with nothing but `control_plane` still
    hears its commands at once whenever a gateway runs. A wildcard listen
    address names no host an agent could dial: this host's name stands in.
    """
    if explicit:
        url = explicit.rstrip("/")
        if not re.match(r"^https?://[^\s/?#]+(/[^\s?#]*)?$", url):
            raise ImproperlyConfigured(
                f"LLMGW_WAKEUP_URL={explicit!r}: an http(s) URL with a host, e.g. http://gw:8080"
            )
        return url
    if not gateway_listen:
        return ""
    host, sep, port = gateway_listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ImproperlyConfigured(f"LLMGW_GATEWAY_LISTEN={gateway_listen!r}: use host:port")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


LLMGW_WAKEUP_URL = wakeup_url(os.environ.get("LLMGW_WAKEUP_URL", ""), os.environ.get("LLMGW_GATEWAY_LISTEN", ""))


def lease_url(explicit: str, wakeup: str, *, postgresql: bool) -> str:
    """Where agents send their leases (the batched endpoint, agents/lease_asgi.py); "" for the web's own.

    LLMGW_LEASE_URL, the endpoint's whole URL; unset or "on" for the lease
    path on the gateway that serves the wakeup long-poll, with PostgreSQL
    (the embedded default's SQLite takes one writer at a time: its agents
    keep the web's endpoint); "off", none. On by default: a lease there costs
    a third of the web's (docs/benchmarks.md), and an agent falls back to the
    web's endpoint whenever this one fails or is slow to answer.
    """
    choice = explicit.strip().lower()
    if choice == "off":
        return ""
    if choice in ("", "on"):
        return wakeup + "/api/v1/agent/lease" if wakeup and postgresql else ""
    if explicit:
        url = explicit.rstrip("/")
        if not re.match(r"^https?://[^\s/?#]+(/[^\s?#]*)?$", url):
            raise ImproperlyConfigured(
                f"LLMGW_LEASE_URL={explicit!r}: an http(s) URL with a host, e.g. http://gw:8080/api/v1/agent/lease"
            )
        return url
    return ""


LLMGW_LEASE_URL = lease_url(
    os.environ.get("LLMGW_LEASE_URL", ""),
    LLMGW_WAKEUP_URL,
    postgresql=DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql",
)
# How long the batched lease endpoint gathers leases before writing them in one statement:
# each lease's answer waits up to this long. At 2,000 leases a second, 5 ms made batches of ten
# and a lease cost 0.20 ms of CPU (gateway and PostgreSQL), most of it each batch's own round
# trips; 20 ms makes batches of forty at 0.14 ms, and an agent renewing every 5 s does not
# notice 20 ms (docs/benchmarks.md, the lease bench of 2026-12-03).
LLMGW_LEASE_BATCH_S = env_seconds("LLMGW_LEASE_BATCH_S", 0.02)

# Access logs (every request the web server and the gateway answer) are off
# unless LLMGW_ACCESS_LOG is set; scripts/serve.sh and scripts/gateway.sh read
# the same variable for granian and gunicorn. Routine library chatter is
# DEBUG (llmgw/logs.py).
LLMGW_ACCESS_LOG = env_bool("LLMGW_ACCESS_LOG")
_ROUTINE_LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace", "httpx")
if not LLMGW_ACCESS_LOG:
    _ROUTINE_LOGGERS += ("django.server",)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"routine": {"()": "llmgw.logs.Routine"}},
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        **{name: {"filters": ["routine"]} for name in _ROUTINE_LOGGERS},
    },
}
