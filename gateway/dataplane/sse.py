"""A stream as the client asked for it: without the usage the gateway asked the engine for on its own account.

The gateway sets stream_options.include_usage on every chat and text
completion stream, to count its tokens. A client that did not ask must not
get the usage-only last chunk (`"choices": []`): OpenAI's documented loop,
`chunk.choices[0].delta.content`, fails on it with an IndexError.
"""

from __future__ import annotations

import json
from typing import Any


class UsageStripper:
    """Removes the usage-only chunk (and its blank line) and any `usage` field from a stream of server-sent events.

    Fed the stream's bytes as they arrive; gives back the complete lines, so a
    line split across two reads is held until its end arrives.
    """

    def __init__(self) -> None:
        self.tail = b""
        # The blank line that ends a dropped event is dropped with it.
        self.drop_blank = False
        # The last usage seen on the way (the relay counts it: each usage line is parsed once).
        self.usage: Any = None

    def feed(self, data: bytes) -> bytes:
        """The part of the stream that can go to the client now."""
        buf = self.tail + data if self.tail else data
        passed = b""
        if not self.drop_blank:
            # The lines before the first that names a usage go as they are, unsplit: most reads
            # hold none, and the last holds it near its end.
            at = buf.find(b'"usage"')
            cut = buf.rfind(b"\n") + 1 if at < 0 else buf.rfind(b"\n", 0, at) + 1
            if at < 0:
                self.tail = buf[cut:]
                return buf[:cut] if cut < len(buf) else buf
            passed, buf = buf[:cut], buf[cut:]
        *lines, self.tail = buf.split(b"\n")
        out: list[bytes] = [passed]
        for line in lines:
            if self.drop_blank:
                self.drop_blank = False
                if not line.strip():
                    continue
            if line.startswith(b"data:") and b'"usage"' in line:
                kept = self._without_usage(line)
                if kept is None:
                    self.drop_blank = True
                    continue
                line = kept
            out.append(line + b"\n")
        return b"".join(out)

    def end(self) -> bytes:
        """What is left at the stream's end (a last line without its newline)."""
        rest, self.tail = self.tail, b""
        if rest.startswith(b"data:") and b'"usage"' in rest:
            return self._without_usage(rest) or b""
        return rest

    def _without_usage(self, line: bytes) -> bytes | None:
        """A `data:` line without its usage (kept in `usage`); None for the usage-only chunk."""
        cr = line.endswith(b"\r")
        try:
            obj = json.loads(line[5:])
        except (ValueError, UnicodeDecodeError):
            return line
        if not isinstance(obj, dict) or "usage" not in obj:
            return line
        self.usage = obj["usage"]
        if obj.get("choices") == []:
            return None
        del obj["usage"]
        return b"data: " + json.dumps(obj).encode() + (b"\r" if cr else b"")
