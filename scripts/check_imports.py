#!/usr/bin/env python3
"""Import every module of llmgw in the interpreter that runs this script.

`make` runs it right after installing requirements.txt, before it marks the
virtualenv installed, and the suite runs it in a virtualenv built from the run
requirements alone. A module that imports something requirements.txt does
not list (sortedcontainers once came only through hypothesis, a test tool)
then fails here, at install time, instead of at `migrate` on a fresh clone.

    check_imports.py            the control plane and the agent (llmgw, inventory, placement, agents)
    check_imports.py --agent    the node agent alone, which must not import Django
    check_imports.py -v         and say how many modules imported

It prints nothing when every module imports (`make run`'s install step is
quiet unless something fails): what the modules log or warn while they are
imported is not the install's news.

It imports the packages installed in the interpreter, or the checkout's when
run from it; run it from another directory to check an installed copy.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import logging
import os
import pkgutil
import shutil
import sys
import tempfile

CONTROL_PLANE_PACKAGES = (
    "llmgw",
    "llmgw_wire",
    "inventory",
    "placement",
    "agents",
    "gateway",
    "llmgw_agent",
    "llmgw_sim",
)
AGENT_PACKAGES = ("llmgw_wire", "llmgw_agent")
# Modules that run-time code reaches by name, never by an import statement:
# the Celery transports the settings name, the web servers scripts/serve.sh
# runs with `python -m`, the connection pool the settings name. kombu's Redis transport imports `packaging`.
CONTROL_PLANE_NAMED = (
    "kombu.transport.redis",
    "kombu.transport.filesystem",
    "celery.beat",
    "celery.apps.worker",
    "django_prometheus",
    "granian",
    "gunicorn.app.wsgiapp",
    "psycopg",
    "psycopg_pool",
    "whitenoise.middleware",
    "drf_spectacular_sidecar",
)
# Templates the control plane's own pages need, wherever it is installed.
TEMPLATES = (
    "drf_spectacular/redoc.html",
    "admin/base_site.html",
    "admin/nvlink.html",
    "admin/fabrics.html",
    "admin/placement/replica_why.html",
)


def walk(package: str) -> list[str]:
    """The package and every module below it, by dotted name."""
    pkg = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
        names.append(info.name)
    return names


def import_all(names: list[str]) -> list[str]:
    """Import each module; return 'module: error' for every one that fails."""
    failures = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # every failure is reported, not only the first
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return failures


def check_control_plane() -> tuple[int, list[str]]:
    """Set Django up on the default settings and import every module and named dependency."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "llmgw.settings"
    # Production settings refuse to load without a key; this process serves nothing.
    if not os.environ.get("SECRET_KEY"):
        os.environ["SECRET_KEY"] = "llmgw-import-check"
    # Settings create the embedded database's folder: keep it out of the checkout or site-packages.
    var_dir = tempfile.mkdtemp(prefix="llmgw-import-check-")
    atexit.register(shutil.rmtree, var_dir, ignore_errors=True)
    os.environ["LLMGW_VAR_DIR"] = var_dir
    # Where settings put collected static files: whitenoise warns of a missing one when the middleware loads.
    os.makedirs(os.path.join(var_dir, "static"))
    import django

    django.setup()
    names: list[str] = []
    for package in CONTROL_PLANE_PACKAGES:
        names += walk(package)
    names += CONTROL_PLANE_NAMED
    failures = import_all(names)
    from django.core.management import call_command
    from django.template.loader import get_template

    for template in TEMPLATES:
        try:
            get_template(template)
        except Exception as exc:
            failures.append(f"template {template}: {type(exc).__name__}: {exc}")
    try:
        call_command("check", stdout=io.StringIO())
    except Exception as exc:
        failures.append(f"manage.py check: {type(exc).__name__}: {exc}")
    return len(names), failures


def check_agent() -> tuple[int, list[str]]:
    """Import the node agent's modules; none of them may bring Django in."""
    names: list[str] = []
    for package in AGENT_PACKAGES:
        names += walk(package)
    failures = import_all(names)
    pulled = sorted(m for m in sys.modules if m == "django" or m.startswith(("django.", "rest_framework", "celery")))
    if pulled:
        failures.append(f"the agent imported {', '.join(pulled[:5])}: it must run without Django")
    return len(names), failures


def main(argv: list[str] | None = None) -> int:
    """Run the check; print each failure and exit 1 if there is any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", action="store_true", help="check the node agent alone (no Django)")
    parser.add_argument("-v", "--verbose", action="store_true", help="say how many modules imported")
    args = parser.parse_args(argv)
    # Modules that start something when imported say so at INFO (the gateway's data plane does): not news here.
    logging.disable(logging.INFO)
    count, failures = check_agent() if args.agent else check_control_plane()
    for failure in failures:
        print(f"import check: {failure}", file=sys.stderr)
    if failures:
        print(f"import check: {len(failures)} of {count} modules failed in {sys.executable}", file=sys.stderr)
        return 1
    if args.verbose:
        print(f"import check: {count} modules imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
