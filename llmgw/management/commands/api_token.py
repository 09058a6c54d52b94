"""`manage.py api_token create --user USER --name NAME`: print a new operator API token."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from llmgw.tokens import TokenError, create_api_token


class Command(BaseCommand):
    """Create an API token and print only its secret on stdout, so scripts can capture it."""

    help = "Create an operator API token (Authorization: Token <secret>) and print it."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a token for a user and print it")
        create.add_argument("--user", required=True, help="the user the token acts as")
        create.add_argument("--name", required=True, help="what the token is for, e.g. ci")

    def handle(self, *args, action: str, user: str, name: str, **options) -> None:
        try:
            secret = create_api_token(user, name)
        except TokenError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(secret)
        self.stderr.write(f"API token {name!r} for {user!r}: send it as 'Authorization: Token <secret>'")
