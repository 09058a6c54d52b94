"""manage.py gateway_key create|list|rotate|revoke: the gateway's API keys from the command line.

`create` and `rotate` print the secret, and only it, on stdout (shown this
once: only its hash is kept); what was done goes to stderr. Every change is
a KeyEvent. Its actor is `--actor USERNAME` when given; otherwise no llmgw
user acted, and the event names the command and the login that ran it
("manage.py gateway_key (root)"): the key's owner is its client, not the
operator who changed it.
"""

from __future__ import annotations

import datetime as dt
import getpass
import re

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db.models import Q
from django.utils import timezone

from gateway import keys
from gateway.models import ApiKey
from gateway.serializers import KeyIn

# The serializer's field for each option: its errors are reported under the option's name.
OPTIONS = {
    "name": "--name",
    "owner": "--owner",
    "allowed_models": "--models",
    "rpm_limit": "--rpm",
    "tpm_limit": "--tpm",
    "tokens_per_day": "--tokens-per-day",
    "tokens_per_month": "--tokens-per-month",
    "expires_at": "--expires",
}
_DAYS = re.compile(r"^(\d{1,5})d$")
COLUMNS = ("id", "name", "prefix", "owner", "models", "rpm", "tpm", "tokens/day", "tokens/month", "expires", "revoked")


def _errors(errors: dict) -> str:
    parts = []
    for field, problems in errors.items():
        if isinstance(problems, dict):  # a list's errors, by the index of the item at fault
            problems = [f"item {i + 1}: {' '.join(str(p) for p in v)}" for i, v in sorted(problems.items())]
        text = "; ".join(str(p) for p in (problems if isinstance(problems, list) else [problems]))
        parts.append(f"{OPTIONS.get(field, field)}: {text}")
    return "; ".join(parts)


def expiry(value: str | None, now: dt.datetime) -> str | None:
    """--expires as the serializer takes it: `30d` is thirty days from now; a date or date-time is ISO 8601 (UTC)."""
    if value is None:
        return None
    m = _DAYS.match(value.strip())
    if m:
        return (now + dt.timedelta(days=int(m.group(1)))).isoformat()
    try:
        when = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise CommandError(f"--expires: {value!r} is neither Nd (days from now) nor an ISO 8601 date-time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.isoformat()


class Command(BaseCommand):
    """`gateway_key create --name N --owner U [...]`, `list [--all]`, `rotate KEY`, `revoke KEY`."""

    help = "Create, list, rotate or revoke gateway API keys; a new secret is printed once, on stdout."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a key and print its secret (only it, on one line)")
        create.add_argument("--name", required=True, help="what the key is for")
        create.add_argument("--owner", required=True, help="the username of the key's owner")
        create.add_argument("--models", default="", help="served model names, comma-separated (default: every model)")
        create.add_argument("--rpm", default="0", help="requests a minute (0: no limit)")
        create.add_argument("--tpm", default="0", help="tokens a minute (0: no limit)")
        create.add_argument("--tokens-per-day", default="0", help="tokens a UTC day (0: no budget)")
        create.add_argument("--tokens-per-month", default="0", help="tokens a UTC month (0: no budget)")
        create.add_argument("--expires", default=None, help="Nd (days from now) or an ISO 8601 date-time (UTC)")
        listing = sub.add_parser("list", help="list keys (never their secrets)")
        listing.add_argument("--all", action="store_true", help="revoked keys too")
        rotate = sub.add_parser("rotate", help="give a key a new secret and print it; the old one stops working")
        revoke = sub.add_parser("revoke", help="revoke a key")
        for p in (rotate, revoke):
            p.add_argument("key", help="the key's id, or its prefix as `list` shows it (llmgw-sk-xxxxxx)")
        for p in (create, rotate, revoke):
            p.add_argument("--actor", default=None, help="the username recorded as acting (default: the login)")

    def handle(self, *args, action: str, **options) -> None:
        if action == "list":
            self._list(options["all"])
            return
        actor, actor_name = self._actor(options["actor"])
        now = timezone.now()
        if action == "create":
            self._create(options, now=now, actor=actor, actor_name=actor_name)
            return
        key = self._key(options["key"])
        if action == "rotate":
            try:
                key, secret = keys.rotate(key.id, now=now, actor=actor, actor_name=actor_name)
            except keys.KeyRefused as e:
                raise CommandError(f"key: {e}") from None
            self.stdout.write(secret)
            self.stderr.write(f"rotated key {key.id} ({key.name}): the old secret no longer opens the gateway")
            return
        if not keys.revoke(key.id, now=now, actor=actor, actor_name=actor_name):
            raise CommandError(f"key: {key.name!r} ({key.id}) is already revoked")
        self.stderr.write(f"revoked key {key.id} ({key.name})")

    def _actor(self, username: str | None):
        if username is None:
            return None, f"manage.py gateway_key ({getpass.getuser()})"
        try:
            return get_user_model().objects.get_by_natural_key(username), None
        except get_user_model().DoesNotExist:
            raise CommandError(f"--actor: no user named {username!r}") from None

    def _key(self, ref: str) -> ApiKey:
        ref = ref.strip()
        q = Q(id=int(ref)) if ref.isdigit() and len(ref) < 19 else Q(prefix=ref.rstrip("…"))
        found = list(ApiKey.objects.filter(q)[:2])
        if not found:
            raise CommandError(f"key: no key has the id or prefix {ref!r}")
        if len(found) > 1:
            raise CommandError(f"key: more than one key has the prefix {ref!r}; use its id")
        return found[0]

    def _create(self, options: dict, *, now: dt.datetime, actor, actor_name: str | None) -> None:
        data = KeyIn(
            data={
                "name": options["name"],
                "owner": options["owner"],
                "allowed_models": [m.strip() for m in options["models"].split(",") if m.strip()],
                "rpm_limit": options["rpm"],
                "tpm_limit": options["tpm"],
                "tokens_per_day": options["tokens_per_day"],
                "tokens_per_month": options["tokens_per_month"],
                "expires_at": expiry(options["expires"], now),
            }
        )
        if not data.is_valid():
            raise CommandError(_errors(data.errors))
        key, secret = keys.create_key(**data.validated_data, now=now, actor=actor, actor_name=actor_name)
        self.stdout.write(secret)
        self.stderr.write(
            f"created key {key.id} ({key.name}, {key.prefix}…): copy the secret now, it is not shown again"
        )

    def _list(self, everything: bool) -> None:
        qs = ApiKey.objects.select_related("owner").order_by("id")
        if not everything:
            qs = qs.filter(revoked_at__isnull=True)
        rows = [COLUMNS]
        for k in qs:
            rows.append(
                (
                    str(k.id),
                    k.name,
                    k.prefix,
                    k.owner.get_username(),
                    ",".join(k.allowed_models) or "all",
                    str(k.rpm_limit or "-"),
                    str(k.tpm_limit or "-"),
                    str(k.tokens_per_day or "-"),
                    str(k.tokens_per_month or "-"),
                    f"{k.expires_at:%Y-%m-%d %H:%M}" if k.expires_at else "-",
                    f"{k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        for r in rows:
            self.stdout.write("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
