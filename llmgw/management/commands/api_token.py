"""manage.py api_token create|revoke: operator API tokens from the command line."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from llmgw import tokens


class Command(BaseCommand):
    """`api_token create --user U --name N [--days D]` prints only the token; `api_token revoke --user U --name N`."""

    help = "Create (printing only the token, shown this once) or revoke an operator's API token."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a token and print it (only it, on one line)")
        revoke = sub.add_parser("revoke", help="revoke a token by its name")
        for p in (create, revoke):
            p.add_argument("--user", required=True, help="the username the token acts as")
            p.add_argument("--name", required=True, help="what the token is for; unique per user")
        create.add_argument("--days", type=int, default=None, help="lifetime in days (default: LLMGW_API_TOKEN_DAYS)")

    def handle(self, *args, action: str, user: str, name: str, days: int | None = None, **options) -> None:
        try:
            who = get_user_model().objects.get_by_natural_key(user)
        except get_user_model().DoesNotExist:
            raise CommandError(f"--user: no user named {user!r}") from None
        if action == "create":
            try:
                _, secret = tokens.create(who, name, now=timezone.now(), days=days)
            except tokens.TokenError as e:
                raise CommandError(str(e)) from None
            tokens.record(who, name, created=True, via="manage.py api_token")
            self.stdout.write(secret)
            return
        if not tokens.revoke(who, name):
            raise CommandError(f"--name: {user} has no token named {name!r}")
        tokens.record(who, name, created=False, via="manage.py api_token")
        self.stderr.write(f"revoked {user}'s token {name!r}")
