"""Create the first admin login if there is none, and say what it is and which roles there are.

`make run` passes --show-later: the password is then not printed here, among
the migrations, but by scripts/run-all.sh after its "llmgw is up" line, the
last thing on the screen before the log (SHOW_LATER marks that it is due).
"""

from __future__ import annotations

import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from llmgw import roles

# Beside the password file: present, scripts/run-all.sh prints the login once it is up, then removes it.
SHOW_LATER = "admin-password.show"


class Command(BaseCommand):
    """`manage.py ensure_admin`: a superuser for a fresh install, printed once and kept 0600."""

    help = "Create an admin login if no superuser exists, and print it."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default=os.environ.get("LLMGW_ADMIN_USER", "admin"))
        parser.add_argument(
            "--show-later",
            action="store_true",
            help="leave a new password for scripts/run-all.sh to print once the server is up",
        )

    def handle(self, *args, username: str, show_later: bool, **options) -> None:
        self._admin(username, show_later=show_later)
        counts = roles.ensure_roles()
        self.stdout.write(
            f"roles: group {roles.VIEWER!r} looks ({counts[roles.VIEWER]} permissions), "
            f"group {roles.OPERATOR!r} looks and acts ({counts[roles.OPERATOR]} permissions); "
            "put people in them at /admin/auth/user/"
        )

    def _admin(self, username: str, *, show_later: bool) -> None:
        user_model = get_user_model()
        secret_file = settings.VAR_DIR / "admin-password"
        if user_model.objects.filter(is_superuser=True).exists():
            where = f" (its password is in {secret_file})" if secret_file.exists() else ""
            self.stdout.write(f"admin login exists{where}")
            return
        password = os.environ.get("LLMGW_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        user_model.objects.create_superuser(username=username, email="", password=password)
        settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{username}\n{password}\n")
        if show_later:
            (settings.VAR_DIR / SHOW_LATER).touch(mode=0o600)
            self.stdout.write(
                f"admin login created: user {username!r}; its password is printed once the servers answer"
            )
            return
        self.stdout.write(self.style.SUCCESS(f"admin login created: user {username!r}, password {password!r}"))
        self.stdout.write(f"(also kept in {secret_file}, readable by you alone)")
