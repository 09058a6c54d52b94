"""Operator permissions for the REST API."""

from rest_framework.permissions import DjangoModelPermissions


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
