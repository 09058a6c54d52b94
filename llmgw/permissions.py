"""Operator permissions for the REST API."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rest_framework.permissions import BasePermission, DjangoModelPermissions
from rest_framework.request import Request


def holds(user: Any, perms: Iterable[str]) -> bool:
    """Whether a signed-in user holds every one of `perms` (anonymous users hold none)."""
    return bool(user and user.is_authenticated and user.has_perms(list(perms)))


class PermissionsRequired(BasePermission):
    """The request's user must hold every permission `required` names.

    Subclasses set `required`, or override `perms` when the permission
    depends on the view (its model, its action).
    """

    required: tuple[str, ...] = ()

    def perms(self, request: Request, view: Any) -> Iterable[str]:
        """The permissions this request needs."""
        return self.required

    def has_permission(self, request: Request, view: Any) -> bool:
        """DRF's hook: refuse unless the user holds them all."""
        return holds(request.user, self.perms(request, view))


class ModelPermissions(DjangoModelPermissions):
    """Django model permissions, reads included.

    DRF's stock class lets any logged-in user read; llmgw's inventory tells
    where every GPU in the building is, so reading needs the view permission.
    """

    perms_map = {
        **DjangoModelPermissions.perms_map,
        "GET": ["%(app_label)s.view_%(model_name)s"],
        "HEAD": ["%(app_label)s.view_%(model_name)s"],
        "OPTIONS": ["%(app_label)s.view_%(model_name)s"],
    }
