"""One reading of an engine's version, for the agent and the control plane alike.

Every layer that compares an engine's version with a feature's floor reads it
here, so the agent and the gateway can no longer disagree about one build
(the agent once read vLLM's source build `0.1.dev20051+g...` as 0.1 and
refused multi-node, while the gateway read it as unknown, so newest).

The rule, said once: a build whose version says nothing about its age is
*unknown*, and an unknown version passes every floor (read as the newest):
- a Python engine built from a checkout without tags calls itself `0.1.devN`
  or `0.0.0` (setuptools-scm's fallback);
- llama.cpp built from a source tarball has no git and reports build 0
  (`version: 0.6.0-dev (build 0, commit unknown)`).
A `.devN` or `rcN` *after* a real version (`0.11.1.dev12+g...`, `0.11.1rc1`)
is read as that version: such a build is on its way to it, and the floors here
are the releases that introduced a flag, which their release candidates carry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (major, minor, patch, post); llama.cpp: (build,).
Key = tuple[int, ...]


@dataclass(frozen=True)
class Version:
    """An engine's version as reported (`text`) and as compared (`key`; None: unknown, newest)."""

    text: str = ""
    key: Key | None = None

    @property
    def known(self) -> bool:
        """Whether the version says how old the build is."""
        return self.key is not None

    def at_least(self, floor: Key) -> bool:
        """Whether this build has what arrived at `floor`; an unknown build is taken as the newest."""
        if self.key is None:
            return True
        width = max(len(self.key), len(floor))
        return self.key + (0,) * (width - len(self.key)) >= tuple(floor) + (0,) * (width - len(floor))


_UNTAGGED = re.compile(r"^(?:0\.1\.dev\d+|0\.0\.0)(?:[.+-]|$)", re.I)
_RELEASE = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")
_POST = re.compile(r"\.?post(\d+)", re.I)


def python_release(text: str) -> Version:
    """A Python engine's version (vLLM, SGLang): "0.4.6.post2" -> (0, 4, 6, 2); "0.1.dev20051+g1" -> unknown."""
    text = text.strip()
    if not text or _UNTAGGED.match(text):
        return Version(text=text)
    head = text.split("+")[0]
    m = _RELEASE.match(head)
    if not m:
        return Version(text=text)
    post = _POST.search(head)
    major, minor, patch = (int(g or 0) for g in m.groups())
    return Version(text=text, key=(major, minor, patch, int(post.group(1)) if post else 0))


# `version: 6500 (1a2b3c4)` (builds before the semantic versions), `b6500` (how a build is named),
# and `version: 0.6.0-dev (build 7012, commit abc1234)` (later builds).
_LLAMA_BUILD = re.compile(r"\(build (\d+)")
_LLAMA_OLD = re.compile(r"^(?:version:\s*)?b?(\d+)(?:\s*\(([0-9a-f]+|unknown)\))?$", re.I)
_LLAMA_SEMVER = re.compile(r"^(?:version:\s*)?(\d+\.\d+\.\d+(?:-[0-9A-Za-z.]+)?)")


def llamacpp_build(text: str) -> Version:
    """llama.cpp's build number: "b6500", "version: 6500 (1a2b3c4)", "version: 0.6.0 (build 7012, ...)" -> (build,).

    Build 0 is a build from a tarball (no git to count commits): unknown. Its
    text keeps the semantic version the build printed ("0.6.0-dev").
    """
    text = text.strip()
    m = _LLAMA_BUILD.search(text)
    if m:
        build = int(m.group(1))
        sem = _LLAMA_SEMVER.match(text)
        if build:
            return Version(text=f"b{build}", key=(build,))
        return Version(text=sem.group(1) if sem else text)
    m = _LLAMA_OLD.match(text)
    if m and int(m.group(1)):
        return Version(text=f"b{int(m.group(1))}", key=(int(m.group(1)),))
    sem = _LLAMA_SEMVER.match(text)
    return Version(text=sem.group(1) if sem else text)


def dotted(floor: Key) -> str:
    """A floor as its release is spelled: (0, 4, 6, 2) -> "0.4.6.post2", (0, 11, 1) -> "0.11.1"."""
    base = ".".join(map(str, floor[:3]))
    return f"{base}.post{floor[3]}" if len(floor) > 3 and floor[3] else base
