"""The architecture's contract, read from the source: imports run one way, none hides in a function.

Layers, low to high: `llmgw_wire` (the agent protocol's schema: no Django,
no project package but itself) <- `llmgw`'s utilities <- `inventory` <-
`placement` <- `agents` (the protocol's server side) and `gateway`
(siblings: neither imports the other). `llmgw_agent`, the node agent, imports
only `llmgw_wire` and itself, and no Django: it installs on a GPU node without
the control plane. `llmgw_sim`, the fleet simulator and the echo engine, is a
development tool over the agent: nothing shipped to a node imports it. The
project's wiring modules (settings, URLs, WSGI/ASGI, the Celery app) may
import anything: they put the layers together. A migration imports only its
own app.

An import of a project module inside a function is how a cycle is usually
dodged, so it fails unless it sits in `AppConfig.ready()` (registration),
under `if TYPE_CHECKING:`, or in `ALLOWLIST` with its reason. A module over
`MAX_LINES` lines that keeps separate jobs apart with comment banners
(`# ---`, `# ===`) should be a package, one job per module.

Each violation is named file:line. `PENDING` lists those known today and
being fixed elsewhere; it only shrinks, and an entry that no longer matches
anything fails, as does a stale `ALLOWLIST` entry.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("llmgw_wire", "llmgw", "inventory", "placement", "agents", "gateway", "llmgw_agent", "llmgw_sim")
MAX_LINES = 350
BANNER = re.compile(r"^\s*#\s*(-{3,}|={3,})")
# Modules that put the layers together, allowed to import any of them.
WIRING = frozenset(
    {
        "llmgw",
        "llmgw.settings",
        "llmgw.settings_test",
        "llmgw.settings_test_sqlite",
        "llmgw.urls",
        "llmgw.api_urls",
        "llmgw.wsgi",
        # The web server's entry point: the front (llmgw/front.py) and the agents' refusal in it.
        "llmgw.web",
        "llmgw.asgi",
        "llmgw.celery",
        # The gateway's process entry point: the data plane, and the agents'
        # long-poll beside it (agents/wakeup.py), in one ASGI process.
        "gateway.asgi",
        # The same process over granian's RSGI interface: gateway.asgi's application, carried.
        "gateway.rsgi",
        # The same process on the gateway's own HTTP/1.1 server: gateway.asgi's application, its workers.
        "gateway.native",
    }
)
# Who may import whom (besides itself): the one-way direction.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "llmgw_wire": frozenset(),
    "llmgw": frozenset({"llmgw_wire"}),
    "inventory": frozenset({"llmgw_wire", "llmgw"}),
    "placement": frozenset({"llmgw_wire", "llmgw", "inventory"}),
    # The simulate command drives the development fleet against this control plane.
    "agents": frozenset({"llmgw_wire", "llmgw", "inventory", "placement", "llmgw_sim"}),
    "gateway": frozenset({"llmgw_wire", "llmgw", "inventory", "placement"}),
    "llmgw_agent": frozenset({"llmgw_wire"}),
    "llmgw_sim": frozenset({"llmgw_wire", "llmgw_agent"}),
}
# Layers that must run without Django installed.
DJANGO_FREE = frozenset({"llmgw_wire", "llmgw_agent", "llmgw_sim"})
DJANGO_PACKAGES = frozenset({"django", "rest_framework", "django_filters", "celery"})

# Lazy imports of project modules inside functions that are not cycle dodges:
# "file: module" -> why.
ALLOWLIST: dict[str, str] = {}

# Violations known when this test was written, fixed by work in progress
# elsewhere: "file: rule: detail". Remove an entry when its violation goes.
PENDING: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Violation:
    """One broken rule, where it is and what it is."""

    path: str
    line: int
    rule: str
    detail: str
    note: str = ""

    @property
    def key(self) -> str:
        """The violation without its line number (lines move, the import does not)."""
        return f"{self.path}: {self.rule}: {self.detail}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.detail}{self.note}"


def module_name(path: Path) -> str:
    """The dotted name of a project source file."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the project packages (tests and the virtualenv excluded), by dotted name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def layer(module: str) -> str:
    """The layer a project module belongs to ("wiring" for the modules that assemble the project)."""
    if module in WIRING:
        return "wiring"
    return module.split(".")[0]


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(importer: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules an import statement loads; `from pkg import sub` names the submodule when it is one."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _resolve(importer, is_package, node)
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in known else base)
    return out


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_with_context(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str | None]]:
    """Every import with why it may sit where it is: None at module level, else the enclosing function's rule."""
    out: list[tuple[ast.Import | ast.ImportFrom, str | None]] = []

    def visit(node: ast.AST, where: str | None, cls: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append((child, where))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), "type-checking", cls)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), where, cls)
            elif isinstance(child, ast.ClassDef):
                visit(child, where, child)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                is_ready = (
                    child.name == "ready"
                    and cls is not None
                    and any(ast.unparse(b).endswith("AppConfig") for b in cls.bases)
                )
                inner = where if where is not None and where != "function" else None
                visit(child, "ready" if is_ready else (inner or "function"), None)
            else:
                visit(child, where, cls)

    visit(tree, None, None)
    return out


def violations() -> list[Violation]:
    """Every broken rule in the project packages."""
    modules = project_modules()
    known = set(modules)
    found: list[Violation] = []
    for name, path in modules.items():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        tree = ast.parse(text, filename=rel)
        own = layer(name)
        is_migration = ".migrations." in f".{name}."
        for node, where in _imports_with_context(tree):
            for target in dict.fromkeys(imported_modules(name, path.name == "__init__.py", node, known)):
                top = target.split(".")[0]
                if own in DJANGO_FREE and top in DJANGO_PACKAGES:
                    found.append(Violation(rel, node.lineno, "imports Django", target))
                if not _is_project(target):
                    continue
                theirs = layer(target)
                if is_migration and top != name.split(".")[0]:
                    found.append(Violation(rel, node.lineno, "migration imports another app", target))
                elif own != "wiring" and theirs != own and theirs not in MAY_IMPORT[own]:
                    found.append(Violation(rel, node.lineno, "against the direction", target))
                if where == "function" and f"{rel}: {target}" not in ALLOWLIST:
                    found.append(Violation(rel, node.lineno, "import inside a function", target))
        lines = text.splitlines()
        banners = [i + 1 for i, line in enumerate(lines) if BANNER.match(line)]
        if len(lines) > MAX_LINES and banners:
            found.append(
                Violation(
                    rel, banners[0], "long module", "jobs kept apart by comment banners", f" ({len(lines)} lines)"
                )
            )
    return found


def _allowlisted_imports() -> set[str]:
    """Every "file: module" of a project import inside a function, to tell stale ALLOWLIST entries."""
    modules = project_modules()
    known = set(modules)
    out = set()
    for name, path in modules.items():
        rel = path.relative_to(ROOT).as_posix()
        for node, where in _imports_with_context(ast.parse(path.read_text())):
            if where == "function":
                out.update(
                    f"{rel}: {t}"
                    for t in imported_modules(name, path.name == "__init__.py", node, known)
                    if _is_project(t)
                )
    return out


def test_the_architecture_holds():
    new = [str(v) for v in violations() if v.key not in PENDING]
    assert not new, "architecture violations:\n" + "\n".join(new)


def test_no_stale_pending_entries():
    current = {v.key for v in violations()}
    stale = sorted(PENDING - current)
    assert not stale, "fixed, remove from PENDING:\n" + "\n".join(stale)


def test_no_stale_allowlist_entries():
    stale = sorted(set(ALLOWLIST) - _allowlisted_imports())
    assert not stale, "no longer imported inside a function, remove from ALLOWLIST:\n" + "\n".join(stale)
    assert all(reason.strip() for reason in ALLOWLIST.values()), "every ALLOWLIST entry says why"


def test_the_checker_sees_what_it_must():
    """The rules fire on small sources, so a green run means something."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "import placement.models\n"
        "if TYPE_CHECKING:\n    import agents.models\n"
        "def f():\n    import placement.planner\n"
        "class C(AppConfig):\n    def ready(self):\n        import placement.signals\n"
    )
    found = [(n.lineno, w) for n, w in _imports_with_context(ast.parse(src))]
    assert found == [(1, None), (2, None), (4, "type-checking"), (6, "function"), (9, "ready")]
    assert layer("llmgw_agent.loop") == "llmgw_agent" and layer("llmgw.settings") == "wiring"
    assert "placement" not in MAY_IMPORT["inventory"] and "gateway" not in MAY_IMPORT["agents"]
