"""The two roles of a real install: groups an administrator puts people in.

"llmgw viewer" may look at everything llmgw keeps (every view_* permission of
the inventory, placement, agents and gateway apps) and change nothing; "llmgw operator"
may also act: every permission of those apps, the custom ones included
(cordon, drain, change labels, forget a node, join tokens and node
credentials). The groups are kept after every `migrate` (post_migrate), so a
new model or permission reaches them with the migration that adds it. They
are managed: a permission added to or removed from them by hand is put back
as it was at the next migrate; give extra rights through another group.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Q

VIEWER = "llmgw viewer"
OPERATOR = "llmgw operator"
APPS = ("inventory", "placement", "agents", "gateway")


def _perms(permission_model: Any, using: str, *, view_only: bool):
    q = Q(content_type__app_label__in=APPS)
    if view_only:
        q &= Q(codename__startswith="view_")
    return permission_model.objects.using(using).filter(q)


def ensure_roles(*, using: str = "default", apps: Any = None) -> dict[str, int]:
    """Create or update both groups to exactly their permissions; returns each group's permission count.

    Idempotent. `apps` is the app registry to use (post_migrate passes the
    migration state's, so this works while migrating); the live one by default.
    """
    if apps is None:
        from django.apps import apps
    group_model = apps.get_model("auth", "Group")
    permission_model = apps.get_model("auth", "Permission")
    counts = {}
    for name, view_only in ((VIEWER, True), (OPERATOR, False)):
        group, _ = group_model.objects.using(using).get_or_create(name=name)
        perms = list(_perms(permission_model, using, view_only=view_only))
        group.permissions.set(perms)
        counts[name] = len(perms)
    return counts


def on_post_migrate(sender: Any, *, using: str = "default", apps: Any = None, **kwargs: Any) -> None:
    """post_migrate receiver: keep the groups after each app's migrations.

    post_migrate is sent once per app, after auth has created that app's
    permissions; the groups are brought up to date each time, so after the
    last app they hold every permission there is.
    """
    if sender.label not in (*APPS, "llmgw"):
        return
    if apps is not None:
        try:
            apps.get_model("auth", "Group")
        except LookupError:
            return  # auth is not migrated yet (a partial migrate)
    ensure_roles(using=using, apps=apps)
