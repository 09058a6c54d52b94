"""An engine's output as it leaves the node: redacted, bounded, and the line that says why it failed.

The agent sends the end of a failed shard's log in its heartbeat
(ShardStatus.log_tail), so an operator reads why an engine failed where they
already look (the API, the admin, the doctor) instead of on the node. Engines
print their own secrets: vLLM logs its parsed arguments (`api_key='...'`), a
launcher echoes its command line, a wrapper script its environment. So the
tail is redacted before it leaves the node, and again on receipt: an older
agent sent it as it was.

Both ends use the same functions, and redacting twice changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from llmgw_wire.common import MASK, SECRET_ENV, SECRET_FLAG, mask_args

TAIL_LINES = 40
TAIL_BYTES = 8 * 1024
# A line cut to this many characters: a 64 KiB line of progress bars or a
# dumped tensor would otherwise fill the tail alone.
LINE_CHARS = 1024
CAUSE_CHARS = 300
# A secret value known to the agent (a flag's, an environment variable's) is
# masked wherever it appears; a shorter one ("1", "true" in USE_API_KEY=true)
# would mask every occurrence of an ordinary word.
MIN_SECRET = 6
# The agent's own lines in a shard's log: never the engine's cause.
AGENT_PREFIX = "# llmgw-agent:"

# A name carries a secret when it contains one of these words: HF_TOKEN,
# AWS_SECRET_ACCESS_KEY, api_key, db_password. Not "tokens" (a count, as in
# max_num_batched_tokens) and not "tokenizer" (a model path): masking those
# would hide what the engine was told, not a secret.
_SECRET_IN_NAME = re.compile(r"key|token(?!s|izer)|secret|password|passwd", re.I)
# A bare `name: value` is a secret only when the name ends in the word
# (`X-Api-Key: ...`, `token: ...`): `KeyError: 'x'` is the cause line itself.
_SECRET_NAME_END = re.compile(r"(key|token|secret|password|passwd)$", re.I)
# A value as it follows a name or a flag: quoted, or up to a separator.
_VALUE = r"(?:\"[^\"\n]*\"|'[^'\n]*'|[^\s\"',;)\]}]+)"
# Values that hold no secret and say something when kept (vLLM's `api_key=None`).
_EMPTY = frozenset({"None", "null", "''", '""'})

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")
_AUTHORIZATION = re.compile(
    r"\b((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)((?:bearer|basic|token)\s+)?([^\s\"',;]+)", re.I
)
_BEARER = re.compile(r"\b(bearer\s+)([A-Za-z0-9._~+/=-]+)", re.I)
# A flag and its value: `--api-key X`, `--api-key=X`, and in a Python list's
# repr `'--api-key', 'X'`. Which flags carry a secret is wire.SECRET_FLAG's call.
_FLAG = re.compile(rf"(?<![\w-])(--?[A-Za-z][\w-]*)(=|[ \t]+|[\"'],[ \t]*[\"'])({_VALUE})")
_ASSIGN = re.compile(rf"(?<![\w.-])([A-Za-z_][\w.]*)([ \t]*=[ \t]*)({_VALUE})")
_QUOTED_KEY = re.compile(rf"([\"'])([A-Za-z_][\w.-]*)\1([ \t]*:[ \t]*)({_VALUE})")
_COLON = re.compile(rf"(?<![\w.\"'-])([A-Za-z_][\w.-]*)(:[ \t]*)({_VALUE})")
_TOKEN_SHAPES = (
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), f"hf_{MASK}"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), f"sk-{MASK}"),
)

# The line that says why: a Python exception (`OSError: [Errno 98] ...`, also
# behind torch's `[rank0]: ` prefix), then anything that reads as an error
# (vLLM's `ERROR ... EngineCore failed to start`, llama.cpp's
# `... error: ...` and `main: exiting due to ...`), then the last line.
_PY_EXCEPTION = re.compile(
    r"^(?:\[[^\]]*\]:?\s*)*(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*|:)?$"
)
_ERRORISH = re.compile(r"\berror\b|\bfailed\b|\bfatal\b|address already in use|exiting due to", re.I)
# A traceback's own lines name files (error.py) and say nothing themselves.
_TRACEBACK = re.compile(r"^(File \"|Traceback \(most recent call last\)|During handling of the above)")


def _mask_value(value: str) -> str:
    if value in _EMPTY:
        return value
    return MASK


def _flag(m: re.Match[str]) -> str:
    flag, sep, value = m.groups()
    if not SECRET_FLAG.match(flag):
        return m.group(0)
    return f"{flag}{sep}{_mask_value(value)}"


def _assign(m: re.Match[str]) -> str:
    name, sep, value = m.groups()
    if not (_SECRET_IN_NAME.search(name) or SECRET_ENV.match(name)):
        return m.group(0)
    return f"{name}{sep}{_mask_value(value)}"


def _quoted_key(m: re.Match[str]) -> str:
    quote, name, sep, value = m.groups()
    if not _SECRET_IN_NAME.search(name):
        return m.group(0)
    masked = _mask_value(value)
    if masked != value and value[:1] in "\"'":
        masked = f"{value[0]}{MASK}{value[0]}"
    return f"{quote}{name}{quote}{sep}{masked}"


def _colon(m: re.Match[str]) -> str:
    name, sep, value = m.groups()
    if not _SECRET_NAME_END.search(name):
        return m.group(0)
    return f"{name}{sep}{_mask_value(value)}"


def redact(text: str, secrets: Sequence[str] = ()) -> str:
    """`text` with every secret it shows masked, and terminal escapes dropped.

    `secrets` are values known to be secret (longest first, see
    secret_values): masked wherever they appear. Then, by shape: the values of
    secret-carrying flags (wire.SECRET_FLAG), `Authorization:` and `Bearer`
    credentials, `NAME=value` and `'name': value` where the name holds a
    secret, and Hugging Face (`hf_...`) and OpenAI-style (`sk-...`) tokens.
    """
    for value in secrets:
        if len(value) >= MIN_SECRET:
            text = text.replace(value, MASK)
    text = _ANSI.sub("", text)
    text = _AUTHORIZATION.sub(lambda m: f"{m.group(1)}{m.group(2) or ''}{MASK}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{MASK}", text)
    text = _FLAG.sub(_flag, text)
    text = _ASSIGN.sub(_assign, text)
    text = _QUOTED_KEY.sub(_quoted_key, text)
    text = _COLON.sub(_colon, text)
    for shape, masked in _TOKEN_SHAPES:
        text = shape.sub(masked, text)
    return text


def secret_values(argv: Iterable[str], env: Mapping[str, str]) -> list[str]:
    """The secrets an engine was started with, longest first: its secret flags' values and secret variables'.

    The agent knows them, so it masks them in the engine's output whatever
    shape the engine prints them in (a flag's value echoed in a sentence).
    """
    argv = list(argv)
    found: set[str] = set()
    for arg, masked in zip(argv, mask_args(argv), strict=True):
        if masked == MASK:
            found.add(arg)
        elif masked != arg:
            found.add(arg.partition("=")[2])
    found.update(v for k, v in env.items() if SECRET_ENV.match(k))
    return sorted((v for v in found if len(v) >= MIN_SECRET), key=len, reverse=True)


def _cut(line: str, limit: int) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"


def bounded_tail(lines: Iterable[str], *, secrets: Sequence[str] = ()) -> list[str]:
    """The end of an engine's output as it may travel and be stored: redacted, then bounded.

    At most TAIL_LINES lines of at most LINE_CHARS characters, TAIL_BYTES in
    all (UTF-8, a newline after each): the last lines that fit. Lines are
    redacted whole before they are cut, so no cut leaves half a secret that
    no longer looks like one.
    """
    split = [part for line in lines for part in str(line).splitlines()]
    out = [_cut(redact(line, secrets), LINE_CHARS) for line in split[-TAIL_LINES:]]
    size, start = 0, len(out)
    while start > 0:
        size += len(out[start - 1].encode()) + 1
        if size > TAIL_BYTES:
            break
        start -= 1
    return out[start:]


def cause_line(lines: Sequence[str]) -> tuple[str, bool]:
    """The line of an engine's output that best says why it ended, and whether it reads as an error.

    The last Python exception line; else the last line that reads as an
    error; else the last line the engine wrote ("", False when it wrote
    nothing). One line, at most CAUSE_CHARS characters.
    """
    engine = [s for s in (line.strip() for line in lines) if s and not s.startswith(AGENT_PREFIX)]
    for test in (_PY_EXCEPTION.match, lambda s: not _TRACEBACK.match(s) and _ERRORISH.search(s)):
        for line in reversed(engine):
            if test(line):
                return _cut(line, CAUSE_CHARS), True
    return (_cut(engine[-1], CAUSE_CHARS), False) if engine else ("", False)


def with_cause(reason: str, lines: Sequence[str]) -> str:
    """`reason` followed by the cause line of the engine's output, unless it names it already.

    "the engine exited with code 1: OSError: [Errno 98] Address already in
    use"; a last line that does not read as an error is labelled as only
    that ("...; its last output: Loading weights 40%").
    """
    line, is_error = cause_line(lines)
    if not line or line in reason:
        return reason
    if not reason:
        return line if is_error else f"its last output: {line}"
    return f"{reason}: {line}" if is_error else f"{reason}; its last output: {line}"
