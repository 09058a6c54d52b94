"""The docs against the code: every environment variable read is documented, every link resolves.

docs/configuration.md's tables are the one list of the environment the
project reads. The variables read are found in the source, not kept in a
second list: in Python, `os.environ.get/[]/setdefault`, `os.getenv`, `in
os.environ` and the `env_*` helpers (llmgw/settings.py's, the benchmarks'
`_env*`), with a variable's name given as a literal, a module constant or a
`for` loop over literal pairs; in scripts/*.sh, `${NAME:-...}` and the
upper-case names a script reads without assigning; in the Makefile, its
shell's `$${NAME...}` and its `NAME ?=` defaults. The tests' own variables
(tests/) are not the project's configuration.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
ENV_HELPER = re.compile(r"^_?env(_\w+)?$")
# Bash sets these itself; reading one is not reading the environment.
SHELL_SPECIAL = frozenset({"SECONDS", "RANDOM", "LINENO", "BASH_SOURCE", "PIPESTATUS", "OPTARG", "OPTIND"})


def tracked(*patterns: str) -> list[Path]:
    """The repository's tracked files matching the git pathspecs, outside tests/."""
    out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split() if not p.startswith("tests/")]


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)


def _names(node: ast.AST, constants: dict[str, set[str]]) -> set[str]:
    """The variable names an expression may hold: a literal, or a name bound to literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    return set()


def _scope_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of one scope (a module or a function), not those of the functions inside it."""
    nodes, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        nodes.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return nodes


def _bindings(nodes: list[ast.AST]) -> dict[str, set[str]]:
    """Names bound to string literals: assignments, and `for a, b in ((lit, lit), ...)` loops."""
    bound: dict[str, set[str]] = {}
    for node in nodes:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, set()).add(node.value.value)
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple | ast.List):
            targets = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
            for item in node.iter.elts:
                values = item.elts if isinstance(item, ast.Tuple) else [item]
                for target, value in zip(targets, values, strict=False):
                    if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                        bound.setdefault(target.id, set()).add(str(value.value))
    return bound


def _reads_by_name(func: ast.expr) -> bool:
    """Whether a call's first argument names a variable it reads: environ.get/setdefault, getenv, env helpers."""
    if isinstance(func, ast.Attribute):
        return func.attr == "getenv" or (func.attr in ("get", "setdefault") and _is_environ(func.value))
    return isinstance(func, ast.Name) and ENV_HELPER.match(func.id) is not None


def _reads_in(nodes: list[ast.AST], constants: dict[str, set[str]]) -> set[str]:
    """The variables read by the given nodes, names resolved through `constants`."""
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Call) and node.args:
            if _reads_by_name(node.func):
                found |= _names(node.args[0], constants)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            found |= _names(node.slice, constants)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            found |= _names(node.left, constants)
    return found


def python_reads(path: Path) -> set[str]:
    """Environment variables one Python module reads, a name resolved in its own scope or the module's."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module_nodes = _scope_nodes(tree)
    module = _bindings(module_nodes)
    found = _reads_in(module_nodes, module)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            params = {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
            nodes = _scope_nodes(node)
            local = _bindings(nodes)
            constants = {k: v for k, v in module.items() if k not in params and k not in local} | local
            found |= _reads_in(nodes, constants)
    return found


def shell_reads(text: str) -> set[str]:
    """Environment variables a bash script reads: defaults taken, or upper-case names never assigned."""
    defaulted = set(re.findall(r"\$\{([A-Za-z_]\w*):?[-=?]", text))
    assigned = set(re.findall(r"^\s*(?:export\s+|local\s+)?([A-Za-z_]\w*)=", text, re.M))
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", text))
    return defaulted | {name for name in used - assigned if name not in SHELL_SPECIAL}


def makefile_reads(text: str) -> set[str]:
    """What the Makefile takes from the environment: its recipes' `$${NAME}` and its `NAME ?=`."""
    return set(re.findall(r"\$\$\{?([A-Za-z_]\w*)", text)) | set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*\?=", text, re.M))


def variables_read() -> dict[str, set[str]]:
    """Every environment variable the project reads, with the files that read it."""
    reads: dict[str, set[str]] = {}
    for path in tracked("*.py"):
        for name in python_reads(path):
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for path in tracked("scripts/*.sh"):
        for name in shell_reads(path.read_text()):
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for name in makefile_reads((ROOT / "Makefile").read_text()):
        reads.setdefault(name, set()).add("Makefile")
    return reads


def variables_documented() -> set[str]:
    """The names in the first column of docs/configuration.md's tables."""
    names: set[str] = set()
    for line in CONFIGURATION.read_text().splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first = line.split("|")[1]
            names |= set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", first))
    return names


def test_the_readers_find_what_the_code_reads(tmp_path):
    # The shapes the project uses, so a reader that stopped seeing one fails here, not silently.
    module = (
        'import os\nA = "VAR_CONST"\nos.environ.get("VAR_GET")\nos.environ["VAR_ITEM"]\nos.getenv("VAR_GETENV")\n'
        'os.environ.setdefault("VAR_DEFAULT", "x")\nos.environ["VAR_WRITTEN"] = "1"\nenv_int("VAR_HELPER", 3)\n'
        '_env("VAR_PRIVATE_HELPER", 1)\nos.environ.get(A)\nif "VAR_IN" in os.environ: pass\n'
        'for knob, var in (("VAR_KNOB", "VAR_TARGET"),):\n    os.environ.get(knob)\n'
    )
    path = tmp_path / "sample.py"
    path.write_text(module)
    assert python_reads(path) == {
        "VAR_GET", "VAR_ITEM", "VAR_GETENV", "VAR_DEFAULT", "VAR_HELPER", "VAR_PRIVATE_HELPER", "VAR_CONST",
        "VAR_IN", "VAR_KNOB",
    }  # fmt: skip
    script = 'ADDR="${1:?x}"\nPY="${PYTHON:-py}"\nexport W="${W:-$(nproc)}"\necho "$ADDR $SECONDS $TOKEN $W $PY"\n'
    assert shell_reads(script) == {"PYTHON", "W", "TOKEN"}
    assert makefile_reads("PYTHON ?= python3\nrun:\n\tX=$${NODES:-6} $$HOME\n") == {"PYTHON", "NODES", "HOME"}


def test_every_variable_read_is_documented():
    missing = {name: sorted(files) for name, files in variables_read().items() if name not in variables_documented()}
    assert not missing, f"read by the code, missing from docs/configuration.md: {missing}"


def test_every_variable_documented_is_read():
    stale = variables_documented() - set(variables_read())
    assert not stale, f"documented in docs/configuration.md, read by no code: {sorted(stale)}"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
    assert len(pages) > 10, "docs/ holds the reference"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_readme_links_every_page_of_the_docs():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name}" not in readme]
    assert not unlinked, f"docs/ pages the README's table does not link: {unlinked}"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 300
