"""Operator API token authentication: django-rest-knox's, refusing malformed tokens as 401 before any lookup."""

from __future__ import annotations

import re

from drf_spectacular.contrib.knox_auth_token import KnoxTokenScheme
from knox.auth import TokenAuthentication
from rest_framework import exceptions

# What knox issues: our prefix, then hexadecimal. Anything else names no token.
_TOKEN = re.compile(rb"^[A-Za-z0-9_-]{1,10}[0-9a-f]{16,256}$")


class OperatorTokenAuthentication(TokenAuthentication):
    """knox's token authentication; a token that is not printable ASCII of knox's shape is a 401.

    knox decodes the header as UTF-8 and looks the token's first characters
    up in the database: bytes that are not UTF-8, or a NUL, made that a 500.
    """

    def authenticate_credentials(self, token: bytes):
        """The (user, token row) a well-formed token names; AuthenticationFailed otherwise."""
        if not _TOKEN.match(token):
            raise exceptions.AuthenticationFailed("Invalid token.")
        return super().authenticate_credentials(token)


class OperatorTokenScheme(KnoxTokenScheme):
    """The OpenAPI document's security scheme for operator tokens (knox's, for this subclass)."""

    target_class = "llmgw.auth.OperatorTokenAuthentication"
