"""The cockpit's own admin pages: NVLink racks and physical fabrics.

Served inside the admin (its login, its header) through admin_view; their
content comes from plain functions (inventory/nvlink_view.py,
inventory/fabric_view.py) that are tested without a browser.
"""

from __future__ import annotations

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

from inventory import fabric_view, nvlink_view


def _require_view(request: HttpRequest) -> None:
    if not request.user.has_perm("inventory.view_node"):
        raise PermissionDenied


def nvlink_page(request: HttpRequest) -> TemplateResponse:
    """Each NVLink domain drawn as a rack of trays, with what keeps each tray out."""
    _require_view(request)
    racks, machines = nvlink_view.overview()
    trays = [t for r in racks for t in r.trays]
    context = {
        **admin.site.each_context(request),
        "title": "NVLink domains",
        "racks": racks,
        "machines": machines,
        "totals": {
            "racks": len([r for r in racks if r.domain]),
            "trays": len(trays),
            "joined": sum(1 for t in trays if t.state == nvlink_view.TrayState.JOINED),
            "degraded": sum(1 for t in trays if t.state == nvlink_view.TrayState.DEGRADED),
            "out": sum(1 for t in trays if t.state == nvlink_view.TrayState.OUT),
            "machines": len(machines),
        },
    }
    return TemplateResponse(request, "admin/nvlink.html", context)


def fabrics_page(request: HttpRequest) -> TemplateResponse:
    """Each physical fabric: declared names, nodes and ports, subnet managers, changes, last scan."""
    _require_view(request)
    now = timezone.now()
    context = {
        **admin.site.each_context(request),
        "title": "Fabrics",
        "page": fabric_view.gather(now=now),
        "now": now,
    }
    return TemplateResponse(request, "admin/fabrics.html", context)


# Included under /admin/ ahead of the admin's own URLs.
urlpatterns = [
    path("nvlink/", admin.site.admin_view(nvlink_page), name="cockpit-nvlink"),
    path("fabrics/", admin.site.admin_view(fabrics_page), name="cockpit-fabrics"),
]
