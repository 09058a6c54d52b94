"""The agent's HTTP client of the control plane: one POST per message, and what each answer means.

Every failure is one of three kinds, which the loop treats differently: the
control plane did not answer usefully (Unreachable: back off and retry), it
refused the request (Refused), or it no longer knows this node or its
credential (NeedsRegister: register again).
"""

from __future__ import annotations

import socket
from typing import TypeVar
from urllib.parse import urlparse

import httpx
import pydantic

_Answer = TypeVar("_Answer", bound=pydantic.BaseModel)


class Unreachable(Exception):
    """The control plane did not answer, or answered with a server error: try again later."""


class Refused(Exception):
    """The control plane refused the request (a 4xx other than an auth failure)."""


class NeedsRegister(Exception):
    """The control plane no longer knows this agent's credential or node: register again."""


def route_addr(url: str) -> str:
    """The local address this host uses to reach a URL (no packet is sent)."""
    host = urlparse(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return ""


class ControlPlane:
    """The control plane's agent endpoints, reached over `http` (its base URL is `url`)."""

    def __init__(self, http: httpx.Client, url: str) -> None:
        self.http = http
        self.url = url

    def post(
        self,
        path: str,
        body: pydantic.BaseModel,
        token: str,
        *,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST one message with a bearer token; raises Unreachable for no answer or a server error.

        `path` is under the control plane's URL, or a whole URL of its own (the gateway's lease endpoint).
        """
        extra = {"timeout": httpx.Timeout(timeout, connect=min(5.0, timeout))} if timeout else {}
        try:
            r = self.http.post(
                path,
                content=body.model_dump_json(exclude_none=True),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json", **(headers or {})},
                **extra,
            )
        except httpx.TransportError as e:
            where = path if "://" in path else f"{self.url}{path}"
            raise Unreachable(f"{where}: {type(e).__name__}: {e}") from e
        if r.status_code >= 500:
            raise Unreachable(f"{path}: HTTP {r.status_code}")
        return r

    @staticmethod
    def why(r: httpx.Response) -> str:
        """The control plane's own words for a refusal (its `detail`), else the start of the body."""
        try:
            detail = r.json().get("detail")
        except (ValueError, AttributeError):
            detail = None
        return f"HTTP {r.status_code}: {detail if isinstance(detail, str) else r.text[:500]}"

    @classmethod
    def answer(
        cls, r: httpx.Response, model: type[_Answer], what: str, *, reregister_on: tuple[int, ...] = ()
    ) -> _Answer:
        """The control plane's answer to `what`, read as `model`.

        A status in `reregister_on` means the control plane no longer knows
        this node or its credential (NeedsRegister); any other status but 200
        is a refusal; an answer that does not parse is treated like no answer.
        """
        if r.status_code in reregister_on:
            raise NeedsRegister(f"{what} refused ({r.status_code})")
        if r.status_code != 200:
            raise Refused(f"{what} refused: {cls.why(r)}")
        try:
            return model.model_validate_json(r.content)
        except pydantic.ValidationError as e:
            raise Unreachable(f"unreadable {what} answer: {e}") from e
