#!/usr/bin/env python3
"""Read every command-line flag of vLLM and SGLang releases out of their wheels.

    python scripts/engine_flags.py                      the releases below, newest included
    python scripts/engine_flags.py vllm==0.11.1 ...     only these

For each release: `pip download --no-deps --only-binary=:all:` the wheel into a
temporary folder, open it with zipfile, read the flag names with `ast` (nothing
installed, nothing imported), write tests/fixtures/engines/flags/ENGINE-VERSION.txt
and delete the wheel. The fixture is a header (release, wheel file, its sha256,
then `# entry:`, `# rule:`, `# abbreviations:` and `# alias:` facts) and one flag per line,
sorted. Flags are what the package's own code registers; argparse's own
`-h/--help` are left out.

How each engine's parser gets its flags, read from the releases' code:

vLLM (`vllm serve`). vllm/entrypoints/cli/serve.py's ServeSubcommand hands its
subparser to `make_arg_parser` (imported from vllm/entrypoints/openai/cli_args.py
up to 0.11, vllm/entrypoints/common/cli_args.py later), which registers
`--headless`, `--api-server-count`, `--config` and friends itself, then calls
FrontendArgs.add_cli_args and AsyncEngineArgs.add_cli_args (which calls
EngineArgs.add_cli_args in vllm/engine/arg_utils.py). Those register:
- literal `add_argument("--x", "-y", ...)` calls (EngineArgs names every flag
  as a literal, its kwargs from `get_kwargs(SomeConfig)["field"]`, splatted
  directly, through `**{**kw["field"], ...}` or a local `x = kw["field"]`),
  and a few from a `for arg, type in [("--x", str), ...]` loop, one flag each;
- the frontend's flags from its dataclass: `for key, value in
  get_kwargs(cls).items(): add_argument(f"--{key.replace('_', '-')}", ...)`,
  one flag per dataclass field (the class's and its dataclass bases'), field
  name with `_` turned into `-`. Later releases also splat `value.pop("flags",
  [])`: no release read here sets that key, and the reader refuses one that does;
- `get_kwargs` (`_compute_kwargs`) gives a field whose type, with Optional/
  Union/`|`/Annotated unwrapped, includes `bool` the action
  argparse.BooleanOptionalAction, which also registers `--no-x` beside `--x`
  (each `--` name, not a `-x` short one). Not when the type includes a
  dataclass (that branch comes first), nor, where `_compute_kwargs` has the
  case `type_hints == {bool, str, type(None)}` (an optional-valued flag, in
  0.33.0 but not 0.11.x), for exactly bool | str | None. An explicit
  `action=argparse.BooleanOptionalAction` does the same; a kwargs edit
  `kw["field"]["action"] = ...` replaces the field's action.
- where FlexibleArgumentParser swaps BooleanOptionalAction for its
  EnableDisableAction (`self.register("action", BooleanOptionalAction, ...)`,
  in 0.33.0, not 0.11.x), such a flag named `--enable-x` also answers to
  `--disable-x` and back (its `_inverse_prefixes`), `--no-` names kept.
The platform hook `current_platform.pre_register_and_update(parser)` adds
nothing on CUDA (checked: vllm/platforms/cuda.py does not override it and the
base one adds no argument). FlexibleArgumentParser keeps argparse's
abbreviations and rewrites `--x_y` to `--x-y` before parsing: it adds no names.

SGLang (`python3 -m sglang.launch_server`). sglang/srt/server_args.py's
`prepare_server_args` builds a plain argparse.ArgumentParser and calls
ServerArgs.add_cli_args. Up to 0.4.x that method is all literal
`parser.add_argument(...)` calls. Later (0.5.23 here) it first calls
`add_cli_args_from_dataclass(parser, ServerArgs)` (sglang/srt/arg_groups/
arg_utils.py): ServerArgs's fields are collected from the namespace classes in
`_INPUT_NAMESPACES`; a field annotated `A[T, "help"]` or `A[T, Arg(...)]`
becomes `Arg.cli_name` or `--` + field name with `_` -> `-`, plus
`Arg.aliases`; `Arg(no_cli=True)` and fields with no such metadata are skipped;
a bool is `store_true` (no `--no-x`) unless `Arg.action` says otherwise
(BooleanOptionalAction: `--no-x` too).

Whatever this reader cannot resolve to literal names (a computed flag name, an
unknown kwargs source, an add_argument outside the functions above) stops it
with the place in the source: read that code and extend the reader, never
guess.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "engines" / "flags"
# The releases the fixtures pin: each engine's floor for a feature the agent
# gates on, the release before it, and the newest pip finds ("newest").
RELEASES = {
    "vllm": ["0.11.0", "0.11.1", "newest"],
    "sglang": ["0.4.6.post1", "0.4.6.post2", "newest"],
}
BOOL_ACTION = "BooleanOptionalAction"


class ReadError(RuntimeError):
    """The source registers a flag in a way this reader does not know."""


@dataclass
class Flags:
    """What one release's parser accepts: names, alias groups and facts."""

    names: set[str] = field(default_factory=set)
    aliases: list[tuple[str, ...]] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    # Prefix -> prefix a BooleanOptionalAction flag also answers to (vLLM's EnableDisableAction).
    inverses: dict[str, str] = field(default_factory=dict)

    def add(self, names: list[str], boolean: bool) -> None:
        """Record one add_argument call's option strings (and `--no-x` for a BooleanOptionalAction)."""
        opts = [n for n in names if n.startswith("-")]
        if len(opts) > 1:
            self.aliases.append(tuple(opts))
        if boolean:
            inverse = [b + n.removeprefix(a) for n in opts for a, b in self.inverses.items() if n.startswith(a)]
            opts += ["--no-" + n[2:] for n in opts if n.startswith("--")] + inverse
        self.names.update(opts)


class Wheel:
    """The Python sources of one wheel, parsed on demand."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path)
        self.files = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        """The parsed module at `path` inside the wheel."""
        if path not in self._trees:
            if path not in self.files:
                raise ReadError(f"{path} is not in the wheel")
            self._trees[path] = ast.parse(self.zip.read(path).decode(), filename=path)
        return self._trees[path]

    def module_path(self, dotted: str) -> str:
        """The file of module `dotted` (a package's __init__.py)."""
        base = dotted.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self.files:
                return path
        raise ReadError(f"module {dotted} is not in the wheel")

    def lookup(self, path: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where module-level `name` of `path` is defined: (file, ClassDef or the assigned expression)."""
        if depth > 8:
            return None
        tree = self.tree(path)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return path, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return path, node.value
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return (path, node.value) if node.value is not None else None
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        module = _absolute(path, node.module, node.level)
                        try:
                            target = self.module_path(module)
                        except ReadError:
                            return None
                        return self.lookup(target, alias.name, depth + 1)
        return None

    def cls(self, path: str, name: str) -> tuple[str, ast.ClassDef]:
        """The class `name` as seen from module `path`."""
        found = self.lookup(path, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            raise ReadError(f"{path}: cannot find class {name}")
        return found  # type: ignore[return-value]

    def mro(self, path: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases found in the wheel, most derived first."""
        out = [(path, node)]
        for base in node.bases:
            if isinstance(base, ast.Name):
                found = self.lookup(path, base.id)
                if found and isinstance(found[1], ast.ClassDef):
                    out += self.mro(*found)  # type: ignore[arg-type]
        return out

    def fields(self, path: str, node: ast.ClassDef) -> list[tuple[str, str, ast.AnnAssign]]:
        """Annotated fields of a dataclass-like class and its bases: (file, name, statement), bases first."""
        seen: dict[str, tuple[str, str, ast.AnnAssign]] = {}
        for where, cls in reversed(self.mro(path, node)):
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if "ClassVar" in ast.unparse(stmt.annotation) or "InitVar" in ast.unparse(stmt.annotation):
                        continue
                    seen[stmt.target.id] = (where, stmt.target.id, stmt)
        return list(seen.values())


def _absolute(path: str, module: str, level: int) -> str:
    if not level:
        return module
    package = path.rsplit("/", 1)[0].split("/")
    package = package[: len(package) - (level - 1)]
    return ".".join([*package, module]) if module else ".".join(package)


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _enclosing(node: ast.AST, parents: dict[ast.AST, ast.AST], kind: type | tuple[type, ...]) -> list[ast.AST]:
    out = []
    while node in parents:
        node = parents[node]
        if isinstance(node, kind):
            out.append(node)
    return out


def _add_argument_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
    ]


def _is_bool_action(expr: ast.AST | None) -> bool:
    return expr is not None and ast.unparse(expr).split(".")[-1] == BOOL_ACTION


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _where(path: str, node: ast.AST) -> str:
    return f"{path}:{getattr(node, 'lineno', '?')}"


def _members(wheel: Wheel, path: str, ann: ast.AST, depth: int = 0) -> set[str]:
    """The names a type annotation unions over, the way vLLM's get_type_hints unwraps it.

    Optional/Union/`|` are split, Annotated keeps its first argument, a
    module-level alias is followed; a class is "class:<name>", Literal[...]
    "Literal", None "None".
    """
    if depth > 6:
        raise ReadError(f"{path}: annotation {ast.unparse(ann)} nests too deep")
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        return _members(wheel, path, ast.parse(ann.value, mode="eval").body, depth + 1)
    if isinstance(ann, ast.Constant) and ann.value is None:
        return {"None"}
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _members(wheel, path, ann.left, depth) | _members(wheel, path, ann.right, depth)
    if isinstance(ann, ast.Subscript):
        head = ast.unparse(ann.value).split(".")[-1]
        args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if head == "Optional":
            return _members(wheel, path, args[0], depth) | {"None"}
        if head == "Union":
            return set().union(*(_members(wheel, path, a, depth) for a in args))
        if head in {"Annotated", "SkipValidation"}:
            # pydantic's SkipValidation[T] is Annotated[T, SkipValidation()].
            return _members(wheel, path, args[0], depth)
        if head == "Literal":
            return {"Literal"}
        return {head}
    name = ast.unparse(ann).split(".")[-1]
    if name in {"bool", "str", "int", "float", "dict", "list", "tuple", "set", "Any", "None"}:
        return {name}
    found = wheel.lookup(path, name)
    if found is None:
        return {name}
    where, node = found
    if isinstance(node, ast.ClassDef):
        return {f"class:{name}"}
    if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in {"TypeAliasType", "NewType", "TypeVar"}:
        return {name}
    return _members(wheel, where, node, depth + 1)


def _vllm_bool_rule(wheel: Wheel) -> tuple[bool, str]:
    """Whether this vLLM's `_compute_kwargs` has the optional-valued bool | str | None case, and its text."""
    path = "vllm/engine/arg_utils.py"
    fn = next(
        (n for n in ast.walk(wheel.tree(path)) if isinstance(n, ast.FunctionDef) and n.name == "_compute_kwargs"),
        None,
    )
    if fn is None or BOOL_ACTION not in ast.unparse(fn) or "contains_type(type_hints, bool)" not in ast.unparse(fn):
        raise ReadError(f"{path}: _compute_kwargs no longer gives bool fields a {BOOL_ACTION}; read it again")
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare) and ast.unparse(node.left) == "type_hints":
            sides = {ast.unparse(e) for e in getattr(node.comparators[0], "elts", [])}
            if sides == {"bool", "str", "type(None)"}:
                return True, "bool | str | None is an optional-valued flag, not --x/--no-x"
    return False, ""


def _vllm_field_is_bool(wheel: Wheel, path: str, stmt: ast.AnnAssign, optional_valued: bool) -> bool:
    members = _members(wheel, path, stmt.annotation)
    if "bool" not in members:
        return False
    classes = sorted(m for m in members if m.startswith("class:"))
    if classes:
        raise ReadError(f"{_where(path, stmt)}: {ast.unparse(stmt.annotation)} mixes bool with {classes}")
    return not (optional_valued and members == {"bool", "str", "None"})


@dataclass
class _KwargsSource:
    """A `kw = get_kwargs(Cls)` dict: the classes it may be for, and the edits made to it."""

    classes: list[tuple[str, ast.ClassDef]]
    action: dict[str, ast.AST] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)


def _kwargs_edits(trees: list[tuple[str, ast.AST]], source: _KwargsSource) -> None:
    """Note `kw["f"]["action"] = X`, `del kw["f"]` and `kw.pop("f")` in the given functions.

    A `kw["f"]["flags"] = ...` would add option strings (splatted by later
    releases' `*value.pop("flags", [])`): the reader stops on one.
    """
    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if not (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Subscript)):
                        continue
                    if _is_key(t.slice, "flags"):
                        raise ReadError(f"{_where(path, node)}: sets a kwargs 'flags' entry: extra flag names to read")
                    if _is_key(t.slice, "action") and isinstance(t.value.slice, ast.Constant):
                        source.action[t.value.slice.value] = node.value
            elif isinstance(node, ast.Delete):
                for t in node.targets:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                        source.removed.add(ast.literal_eval(t.slice))
            elif (
                isinstance(node, ast.Call)
                and ast.unparse(node.func).endswith("kwargs.pop")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                source.removed.add(node.args[0].value)


def _get_kwargs_source(
    wheel: Wheel, path: str, fn: ast.FunctionDef, name: str, callers: list[tuple[str, ast.ClassDef]]
) -> _KwargsSource:
    """The classes behind `name = get_kwargs(X)` in `fn`; `X` may be `cls`, bound to the callers' classes."""
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func).split(".")[-1] == "get_kwargs"
        ):
            arg = node.value.args[0]
            if isinstance(arg, ast.Name) and arg.id == "cls":
                owner = _enclosing_class(wheel, path, fn)
                classes = [c for c in callers if owner in [n for _, n in wheel.mro(*c)]]
                if not classes:
                    raise ReadError(f"{_where(path, node)}: get_kwargs(cls) with no caller class found")
                return _KwargsSource(classes)
            if isinstance(arg, ast.Name):
                return _KwargsSource([wheel.cls(path, arg.id)])
            raise ReadError(f"{_where(path, node)}: get_kwargs({ast.unparse(arg)}) is not a class name")
    raise ReadError(f"{path}: {fn.name} has no `{name} = get_kwargs(...)`")


def _enclosing_class(wheel: Wheel, path: str, fn: ast.FunctionDef) -> ast.ClassDef:
    tree = wheel.tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and fn in node.body:
            return node
    raise ReadError(f"{_where(path, fn)}: {fn.name} is not a method")


def _loop_values(call: ast.Call, name: str, parents: dict[ast.AST, ast.AST], path: str) -> list[str]:
    """The values `name` takes in an enclosing `for ... in [literal, ...]` loop."""
    for loop in _enclosing(call, parents, ast.For):
        target = loop.target
        if not isinstance(loop.iter, (ast.List, ast.Tuple)):
            continue
        if isinstance(target, ast.Name) and target.id == name:
            return [ast.literal_eval(e) for e in loop.iter.elts]
        if isinstance(target, ast.Tuple):
            ids = [getattr(t, "id", None) for t in target.elts]
            if name in ids:
                i = ids.index(name)
                return [ast.literal_eval(e.elts[i]) for e in loop.iter.elts]  # type: ignore[attr-defined]
    raise ReadError(f"{_where(path, call)}: flag name {name} is not a literal or a literal loop's value")


def _read_vllm(wheel: Wheel) -> Flags:
    flags = Flags()
    serve = "vllm/entrypoints/cli/serve.py"
    imported = next(
        (
            n.module
            for n in ast.walk(wheel.tree(serve))
            if isinstance(n, ast.ImportFrom) and n.module and any(a.name == "make_arg_parser" for a in n.names)
        ),
        None,
    )
    if imported is None:
        raise ReadError(f"{serve}: no make_arg_parser import; the serve parser is built elsewhere now")
    flags.facts.append(f"entry: vllm serve ({serve}, parser from {wheel.module_path(imported)})")
    modules = ["vllm/engine/arg_utils.py", wheel.module_path(imported), serve]
    flags.inverses = _vllm_inverses(wheel)
    if flags.inverses:
        pairs = ", ".join(f"{a}x also {b}x" for a, b in flags.inverses.items())
        flags.facts.append(f"rule: a --x/--no-x flag named {pairs} (FlexibleArgumentParser's EnableDisableAction)")
    optional_valued, rule = _vllm_bool_rule(wheel)
    if rule:
        flags.facts.append(f"rule: {rule}")
    callers = [
        wheel.cls(path, n.func.value.id)
        for path in modules
        for n in ast.walk(wheel.tree(path))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "add_cli_args"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id not in {"cls", "super"}
    ]
    for path in modules:
        tree = wheel.tree(path)
        parents = _parents(tree)
        for call in _add_argument_calls(tree):
            fns = _enclosing(call, parents, ast.FunctionDef)
            if not fns or fns[0].name not in {"make_arg_parser", "add_cli_args"}:
                raise ReadError(f"{_where(path, call)}: add_argument outside make_arg_parser/add_cli_args")
            _read_vllm_call(wheel, path, fns[0], call, parents, callers, optional_valued, flags)
    _check_vllm_platform(wheel)
    return flags


def _read_vllm_call(
    wheel: Wheel,
    path: str,
    fn: ast.FunctionDef,
    call: ast.Call,
    parents: dict[ast.AST, ast.AST],
    callers: list[tuple[str, ast.ClassDef]],
    optional_valued: bool,
    flags: Flags,
) -> None:
    names: list[str] = []
    per_field: _KwargsSource | None = None
    if len(call.args) == 1 and isinstance(call.args[0], ast.Name):
        # One call per value of a literal loop, each value its own flag.
        for value in _loop_values(call, call.args[0].id, parents, path):
            flags.add([value], _is_bool_action(_keyword(call, "action")))
        return
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            names.append(arg.value)
        elif isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            _check_no_extra_flags(fn, arg.value.id, path)
        elif isinstance(arg, ast.JoinedStr):
            per_field = _field_loop(wheel, path, fn, call, arg, parents, callers)
        else:
            raise ReadError(f"{_where(path, call)}: flag name {ast.unparse(arg)} is not literal")
    if per_field is not None:
        edits = [(p, f) for p, c in per_field.classes for _, f in _methods(c, "_customize_cli_kwargs", p, wheel)]
        _kwargs_edits([(path, fn), *edits], per_field)
        for cpath, cls in per_field.classes:
            for fpath, fname, stmt in wheel.fields(cpath, cls):
                if fname in per_field.removed:
                    continue
                action = per_field.action.get(fname)
                boolean = (
                    _is_bool_action(action)
                    if action is not None
                    else _vllm_field_is_bool(wheel, fpath, stmt, optional_valued)
                )
                flags.add([*names, "--" + fname.replace("_", "-")], boolean)
        return
    boolean = _is_bool_action(_keyword(call, "action"))
    for kw in call.keywords:
        if kw.arg is not None:
            continue
        splats, action = [kw.value], None
        if isinstance(kw.value, ast.Dict):
            # `**{**kw["field"], "default": None}`: the field's kwargs with some replaced.
            splats = [v for k, v in zip(kw.value.keys, kw.value.values, strict=True) if k is None]
            action = next(
                (v for k, v in zip(kw.value.keys, kw.value.values, strict=True) if _is_key(k, "action")), None
            )
        for splat in splats:
            if isinstance(splat, ast.Name):
                boolean = _named_field_kwargs_bool(wheel, path, fn, call, splat.id, callers, optional_valued)
            elif isinstance(splat, ast.Subscript) and isinstance(splat.value, ast.Name):
                boolean = _field_kwargs_bool(wheel, path, fn, call, splat, callers, optional_valued)
            else:
                raise ReadError(f"{_where(path, call)}: **{ast.unparse(kw.value)} is not get_kwargs(...)[field]")
        if action is not None:
            boolean = _is_bool_action(action)
    flags.add(names, boolean)


def _is_key(node: ast.AST | None, key: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == key


def _field_kwargs_bool(
    wheel: Wheel,
    path: str,
    fn: ast.FunctionDef,
    call: ast.Call,
    splat: ast.Subscript,
    callers: list[tuple[str, ast.ClassDef]],
    optional_valued: bool,
) -> bool:
    """Whether `**kw["field"]` (kw = get_kwargs(Cls)) carries a BooleanOptionalAction."""
    source = _get_kwargs_source(wheel, path, fn, splat.value.id, callers)  # type: ignore[attr-defined]
    _kwargs_edits([(path, fn)], source)
    fname = ast.literal_eval(splat.slice)
    if fname in source.action:
        return _is_bool_action(source.action[fname])
    cpath, cls = source.classes[0]
    match = [(p, s) for p, n, s in wheel.fields(cpath, cls) if n == fname]
    if not match:
        raise ReadError(f"{_where(path, call)}: {cls.name} has no field {fname}")
    return _vllm_field_is_bool(wheel, match[0][0], match[0][1], optional_valued)


def _named_field_kwargs_bool(
    wheel: Wheel,
    path: str,
    fn: ast.FunctionDef,
    call: ast.Call,
    name: str,
    callers: list[tuple[str, ast.ClassDef]],
    optional_valued: bool,
) -> bool:
    """`kw = get_kwargs(Cls)["field"]` (or `= kwargs["field"]`) then `**kw`: whether it is a BooleanOptionalAction."""
    assigned = [
        n.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]
    value = assigned[0] if len(assigned) == 1 else None
    if not (isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant)):
        raise ReadError(f"{_where(path, call)}: **{name} is not one get_kwargs(Cls)[field]")
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) == name and _is_key(t.slice, "action"):
                    return _is_bool_action(n.value)
    if isinstance(value.value, ast.Name):
        return _field_kwargs_bool(wheel, path, fn, call, value, callers, optional_valued)
    if not (
        isinstance(value.value, ast.Call)
        and ast.unparse(value.value.func).split(".")[-1] == "get_kwargs"
        and isinstance(value.value.args[0], ast.Name)
    ):
        raise ReadError(f"{_where(path, call)}: **{name} is not one get_kwargs(Cls)[field]")
    cpath, cls = wheel.cls(path, value.value.args[0].id)
    match = [(p, st) for p, n, st in wheel.fields(cpath, cls) if n == value.slice.value]
    if not match:
        raise ReadError(f"{_where(path, call)}: {cls.name} has no field {value.slice.value}")
    return _vllm_field_is_bool(wheel, match[0][0], match[0][1], optional_valued)


def _methods(cls: ast.ClassDef, name: str, path: str, wheel: Wheel) -> list[tuple[str, ast.FunctionDef]]:
    return [
        (p, stmt)
        for p, c in wheel.mro(path, cls)
        for stmt in c.body
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name
    ]


def _check_no_extra_flags(fn: ast.FunctionDef, name: str, path: str) -> None:
    """`*name` must be `value.pop("flags", [])`, a list no code here fills (checked in _kwargs_edits)."""
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and re.fullmatch(r"\w+\.pop\('flags', \[\]\)", ast.unparse(node.value))
        ):
            return
    raise ReadError(f"{_where(path, fn)}: *{name} is not value.pop('flags', [])")


def _field_loop(
    wheel: Wheel,
    path: str,
    fn: ast.FunctionDef,
    call: ast.Call,
    arg: ast.JoinedStr,
    parents: dict[ast.AST, ast.AST],
    callers: list[tuple[str, ast.ClassDef]],
) -> _KwargsSource:
    """`for key, value in kw.items(): add_argument(f"--{key.replace('_', '-')}", **value)`: kw's source."""
    for loop in _enclosing(call, parents, ast.For):
        if (
            isinstance(loop.target, ast.Tuple)
            and isinstance(loop.iter, ast.Call)
            and isinstance(loop.iter.func, ast.Attribute)
            and loop.iter.func.attr == "items"
            and isinstance(loop.iter.func.value, ast.Name)
        ):
            key = ast.unparse(loop.target.elts[0])
            if ast.unparse(arg) != f"f\"--{{{key}.replace('_', '-')}}\"":
                raise ReadError(f"{_where(path, call)}: flag name {ast.unparse(arg)} is not --field-name")
            return _get_kwargs_source(wheel, path, fn, loop.iter.func.value.id, callers)
    raise ReadError(f"{_where(path, call)}: f-string flag name outside a kwargs loop")


def _check_vllm_platform(wheel: Wheel) -> None:
    """The CUDA platform's pre_register_and_update must add no argument (it is called with the parser)."""
    for path in ("vllm/platforms/interface.py", "vllm/platforms/cuda.py"):
        if path not in wheel.files:
            raise ReadError(f"{path} is not in the wheel")
        for node in ast.walk(wheel.tree(path)):
            if (
                isinstance(node, ast.FunctionDef)
                and node.name == "pre_register_and_update"
                and _add_argument_calls(node)
            ):
                raise ReadError(f"{_where(path, node)}: the platform hook registers arguments")


def _read_sglang(wheel: Wheel) -> Flags:
    flags = Flags()
    if "sglang/launch_server.py" not in wheel.files:
        raise ReadError("sglang/launch_server.py is not in the wheel: `python3 -m sglang.launch_server` is gone")
    flags.facts.append("entry: python3 -m sglang.launch_server (sglang/launch_server.py)")
    path = "sglang/srt/server_args.py"
    tree = wheel.tree(path)
    parents = _parents(tree)
    prepare = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "prepare_server_args"), None
    )
    if prepare is None or "ServerArgs.add_cli_args(parser)" not in ast.unparse(prepare):
        raise ReadError(f"{path}: prepare_server_args no longer builds the parser with ServerArgs.add_cli_args")
    parser = next(n for n in ast.walk(prepare) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("Parser"))
    abbrev = _keyword(parser, "allow_abbrev")
    flags.facts.append(_abbrev_fact(abbrev is None or ast.literal_eval(abbrev)))
    for call in _add_argument_calls(tree):
        fns = _enclosing(call, parents, ast.FunctionDef)
        if not fns or fns[0].name != "add_cli_args":
            raise ReadError(f"{_where(path, call)}: add_argument outside ServerArgs.add_cli_args")
        names = []
        for arg in call.args:
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                raise ReadError(f"{_where(path, call)}: flag name {ast.unparse(arg)} is not literal")
            names.append(arg.value)
        flags.add(names, _is_bool_action(_keyword(call, "action")))
    from_dataclass = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "add_cli_args_from_dataclass"
    ]
    for call in from_dataclass:
        if ast.unparse(call.args[1]) != "ServerArgs" or call.keywords:
            raise ReadError(f"{_where(path, call)}: {ast.unparse(call)} is not the whole ServerArgs")
        _read_sglang_dataclass(wheel, path, flags)
    return flags


def _read_sglang_dataclass(wheel: Wheel, path: str, flags: Flags) -> None:
    utils = wheel.tree("sglang/srt/arg_groups/arg_utils.py")
    text = ast.unparse(utils)
    if "return '--' + name.replace('_', '-')" not in text or "action='store_true'" not in text:
        raise ReadError("sglang/srt/arg_groups/arg_utils.py: the field -> flag rule changed; read it again")
    tree = wheel.tree(path)
    spaces = next(
        (n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_INPUT_NAMESPACES"),
        None,
    )
    if not isinstance(spaces, ast.List):
        raise ReadError(f"{path}: _INPUT_NAMESPACES is not a literal list")
    classes = [wheel.cls(path, e.id) for e in spaces.elts if isinstance(e, ast.Name)]
    classes.append(wheel.cls(path, "ServerArgs"))
    for cpath, cls in classes:
        for fpath, fname, stmt in wheel.fields(cpath, cls):
            _read_sglang_field(fpath, fname, stmt, flags)


def _read_sglang_field(path: str, name: str, stmt: ast.AnnAssign, flags: Flags) -> None:
    ann = stmt.annotation
    if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) in {"A", "Annotated"}):
        return  # no Arg metadata: not registered
    elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    meta = next(
        (
            m
            for m in elts[1:]
            if (isinstance(m, ast.Constant) and isinstance(m.value, str))
            or (isinstance(m, ast.Call) and ast.unparse(m.func) == "Arg")
        ),
        None,
    )
    if meta is None:
        return
    cli_name, aliases, action = "--" + name.replace("_", "-"), [], None
    if isinstance(meta, ast.Call):
        if meta.args or any(k.arg is None for k in meta.keywords):
            raise ReadError(f"{_where(path, stmt)}: Arg({ast.unparse(meta)}) is not keywords")
        kw = {k.arg: k.value for k in meta.keywords}
        try:
            if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                return
            cli_name = ast.literal_eval(kw["cli_name"]) if "cli_name" in kw else cli_name
            aliases = ast.literal_eval(kw["aliases"]) if "aliases" in kw else []
        except ValueError as e:
            raise ReadError(f"{_where(path, stmt)}: {name}'s Arg is not literal") from e
        action = kw.get("action")
    if name.startswith("_"):
        # msgspec keeps such a field private: whether argparse would see it is not plain from here.
        raise ReadError(f"{_where(path, stmt)}: field {name} starts with _ and has a CLI entry")
    flags.add([cli_name, *(aliases or [])], _is_bool_action(action))


def _abbrev_fact(on: bool) -> str:
    if on:
        return "abbreviations: on (argparse allow_abbrev left at its default): a unique prefix stands for the flag"
    return "abbreviations: off (allow_abbrev=False)"


def _flexible_parser(wheel: Wheel) -> tuple[str, ast.ClassDef]:
    for path in ("vllm/utils/argparse_utils.py", "vllm/utils/__init__.py"):
        if path in wheel.files:
            for node in ast.walk(wheel.tree(path)):
                if isinstance(node, ast.ClassDef) and node.name == "FlexibleArgumentParser":
                    return path, node
    raise ReadError("FlexibleArgumentParser not found")


def _vllm_inverses(wheel: Wheel) -> dict[str, str]:
    """The prefixes a BooleanOptionalAction flag also answers to, where FlexibleArgumentParser swaps the action.

    From 0.1x on, `self.register("action", BooleanOptionalAction, EnableDisableAction)`:
    `--enable-x` also registers `--disable-x` (and back), beside argparse's `--no-` names.
    """
    path, parser = _flexible_parser(wheel)
    swaps = [
        n
        for n in ast.walk(parser)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) == "self.register"
        and len(n.args) == 3
        and ast.unparse(n.args[1]).split(".")[-1] == BOOL_ACTION
    ]
    if not swaps:
        if "register(" in ast.unparse(parser):
            raise ReadError(f"{path}: FlexibleArgumentParser registers an action this reader does not know")
        return {}
    _, action = wheel.cls(path, ast.unparse(swaps[0].args[2]))
    if BOOL_ACTION not in [ast.unparse(b).split(".")[-1] for b in action.bases]:
        raise ReadError(f"{_where(path, action)}: {action.name} is not a BooleanOptionalAction")
    table = next(
        (
            st.value
            for st in action.body
            if isinstance(st, ast.Assign) and ast.unparse(st.targets[0]) == "_inverse_prefixes"
        ),
        None,
    )
    if not isinstance(table, ast.Dict):
        raise ReadError(f"{_where(path, action)}: {action.name} has no literal _inverse_prefixes")
    return ast.literal_eval(table)


def _vllm_abbrev(wheel: Wheel) -> str:
    """FlexibleArgumentParser subclasses argparse.ArgumentParser; abbreviations stay on unless it sets allow_abbrev."""
    _, parser = _flexible_parser(wheel)
    return _abbrev_fact("allow_abbrev" not in ast.unparse(parser))


def read(engine: str, wheel_path: Path) -> Flags:
    """All flags of the engine release in `wheel_path`."""
    wheel = Wheel(wheel_path)
    if engine == "vllm":
        flags = _read_vllm(wheel)
        flags.facts.append(_vllm_abbrev(wheel))
        return flags
    return _read_sglang(wheel)


def fixture_text(engine: str, version: str, wheel_path: Path, flags: Flags) -> str:
    """The fixture file: header, facts, then one flag per line, sorted."""
    digest = hashlib.sha256(wheel_path.read_bytes()).hexdigest()
    lines = [f"# {engine} {version}, from {wheel_path.name}, sha256 {digest}, read by scripts/engine_flags.py"]
    lines += [f"# {fact}" for fact in flags.facts]
    lines += [f"# alias: {' '.join(group)}" for group in sorted(set(flags.aliases))]
    lines += sorted(flags.names)
    return "\n".join(lines) + "\n"


def newest(engine: str) -> str:
    """The newest release `pip index versions` finds."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", engine], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(rf"^{engine} \(([^)]+)\)", out, re.M)
    if not match:
        raise ReadError(f"pip index versions {engine} printed no version")
    return match.group(1)


def download(engine: str, version: str, into: Path) -> Path:
    """The release's wheel, downloaded alone (no dependencies, never a source build)."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
    subprocess.run([*pip, f"{engine}=={version}", "-d", str(into)], check=True)
    (wheel,) = into.glob("*.whl")
    return wheel


def main(argv: list[str] | None = None) -> int:
    """Download, read and write the fixture of each release asked for (all of RELEASES by default)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("releases", nargs="*", help="ENGINE==VERSION (VERSION may be 'newest')")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    wanted = [r.split("==", 1) for r in args.releases] or [[e, v] for e, vs in RELEASES.items() for v in vs]
    args.out.mkdir(parents=True, exist_ok=True)
    for engine, version in wanted:
        if engine not in RELEASES:
            ap.error(f"unknown engine {engine!r} (known: {', '.join(RELEASES)})")
        version = newest(engine) if version == "newest" else version
        # One wheel at a time: vLLM's are ~400 MB.
        with tempfile.TemporaryDirectory() as tmp:
            wheel = download(engine, version, Path(tmp))
            flags = read(engine, wheel)
            target = args.out / f"{engine}-{version}.txt"
            target.write_text(fixture_text(engine, version, wheel, flags))
        print(f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}: {len(flags.names)} flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
