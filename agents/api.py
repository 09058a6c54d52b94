"""The agent endpoints: POST /api/v1/agent/{register,heartbeat,scans,rotate}.

Thin: authenticate, check the body's type and size, validate it against the
wire schema, and hand it to agents/protocol.py. The checks come in an order
that tells a stranger nothing: credentials first (401), then the envelope
(415, 413), then the body (400 naming each field), then whether the
credential may speak for the node the body names (403). The body is read
only after the credential's check, so a stranger's is never read at all.

A heartbeat arrives every few seconds from every node, so these are plain
Django views: the DRF classes below only describe the endpoints for the
OpenAPI document (`as_view` returns a function that calls `serve` directly,
skipping DRF's request wrapping, content negotiation and permission layers,
which cost more than the heartbeat's own work). agents/wsgi.py serves them
without the middleware stack, which sessions, CSRF and messages need but
bearer-token agents do not.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import ClassVar

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from pydantic import BaseModel, ValidationError
from rest_framework.parsers import JSONParser
from rest_framework.renderers import JSONRenderer
from rest_framework.views import APIView

import llmgw_wire as wire
from agents import credentials, limits, protocol
from inventory import heartbeat as hb_rules
from llmgw import validation
from llmgw.front import RECEIVED_AT

KiB = 1024
MiB = 1024 * KiB
# Bodies are bounded before they are read. A registration carries the whole
# inventory (up to 4,096 weight paths); a scan carries ibnetdiscover's text,
# which JSON escaping may grow, hence twice its own bound.
MAX_REGISTER_BODY = 4 * MiB
MAX_HEARTBEAT_BODY = 1 * MiB
MAX_SCAN_BODY = 2 * wire.MAX_SCAN_TEXT + 64 * KiB
MAX_ROTATE_BODY = 4 * KiB
MAX_ERRORS = 50


class FieldProblem(BaseModel):
    """One thing wrong with a request body."""

    field: str
    problem: str


class Problem(BaseModel):
    """An error answer: what was refused, and for a bad body, each field's problem."""

    detail: str
    errors: list[FieldProblem] = []


class ScanStored(BaseModel):
    """What the control plane kept of a fabric scan."""

    key: str
    at: float
    error: str
    has_output: bool


def received_at(django_request: HttpRequest, *, now: dt.datetime) -> dt.datetime:
    """When the web server's front had the whole request (llmgw/front.py); `now` under a server without it.

    A request that waited for a thread (an agent's routine status behind the
    others) was sent that much earlier than it is handled: what it says of its
    sender's clock is read against its arrival.
    """
    at = django_request.META.get(RECEIVED_AT)
    if not isinstance(at, float):
        return now
    return min(now, dt.datetime.fromtimestamp(at, tz=dt.UTC))


def problem(status: int, detail: str, errors: list[dict] | None = None) -> JsonResponse:
    """An error answer in the one shape every agent endpoint uses."""
    resp = JsonResponse({"detail": detail, "errors": errors or []}, status=status)
    if status == 401:
        resp["WWW-Authenticate"] = 'Bearer realm="llmgw-agent"'
    return resp


def field_errors(exc: ValidationError) -> list[dict]:
    """pydantic's errors as (field path, problem), without echoing the input back."""
    out = []
    for e in exc.errors(include_url=False, include_input=False, include_context=False)[:MAX_ERRORS]:
        path = ".".join(str(p) for p in e["loc"]) or "(body)"
        out.append({"field": path, "problem": e["msg"]})
    return out


def check_envelope(content_type: str, content_length: str | None, max_body: int) -> None:
    """Refuse (415, 400, 413) a body that is not JSON or declares more than `max_body` bytes, before it is read."""
    if content_type != "application/json":
        raise protocol.Refused(415, "the body must be application/json")
    try:
        declared = int(content_length or 0)
    except ValueError:
        raise protocol.Refused(400, "invalid Content-Length") from None
    if declared > max_body:
        raise protocol.Refused(413, f"the body must be at most {max_body} bytes")


def parse_message(
    message: type[wire.Message],
    body: bytes,
    *,
    max_body: int,
    problems: Callable[..., list[dict]] | None = None,
) -> wire.Message:
    """A body read (at most max_body + 1 bytes of it) as `message`; raises Refused (413, 400 naming each field)."""
    if len(body) > max_body:
        raise protocol.Refused(413, f"the body must be at most {max_body} bytes")
    try:
        msg = message.model_validate_json(body)
    except ValidationError as exc:
        raise protocol.Refused(400, "invalid request body", field_errors(exc)) from None
    too_big = (problems(msg) if problems else None) or validation.nul_problems(body)
    if too_big:
        raise protocol.Refused(400, "invalid request body", too_big[:MAX_ERRORS])
    return msg


def _responses(ok: type[BaseModel]) -> dict:
    return {
        200: ok,
        400: OpenApiResponse(Problem, description="A field is missing, malformed or out of range: each is named."),
        401: OpenApiResponse(Problem, description="Missing or invalid credentials."),
        403: OpenApiResponse(
            Problem,
            description="The credential does not authorise the node the body names, "
            "or (scans) no unanswered scan command of this node asked for it.",
        ),
        409: OpenApiResponse(Problem, description="A concurrent registration of the same new node won."),
        413: OpenApiResponse(Problem, description="The body is larger than this endpoint accepts."),
        415: OpenApiResponse(Problem, description="The body is not application/json."),
    }


class AgentEndpoint(APIView):
    """Common handling of an agent request; subclasses name the message, its bounds and the protocol function.

    An APIView only so that drf-spectacular documents it (see `documented`);
    requests never go through DRF (see `as_view`).
    """

    authentication_classes = ()
    permission_classes = ()
    throttle_classes = ()
    # Declared for the OpenAPI document; the body is read and validated by
    # the wire schema itself (request.data is never touched).
    parser_classes = (JSONParser,)
    renderer_classes = (JSONRenderer,)
    message: ClassVar[type[wire.Message]]
    max_body: ClassVar[int]
    allow_join: ClassVar[bool] = False
    # The protocol function answering (caller, message, now=).
    handle: ClassVar[Callable[..., BaseModel | dict]]
    # Values the schema allows but the inventory cannot hold (agents/limits.py).
    problems: ClassVar[Callable[..., list[dict]] | None] = None
    # Whether the digest of each body read is kept with it (a status's: the agent's floor sends it back).
    keeps_digest: ClassVar[bool] = False

    @classmethod
    def as_view(cls, **initkwargs):
        """A plain Django view serving POST; `cls` stays visible to the schema generator."""
        endpoint = cls(**initkwargs)

        def view(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method != "POST":
                resp = problem(405, f'method "{request.method}" not allowed')
                resp["Allow"] = "POST"
                return resp
            return endpoint.serve(request)

        view.cls = cls
        view.initkwargs = initkwargs
        view.view_class = cls
        view.__doc__ = cls.__doc__
        return csrf_exempt(view)

    def post(self, request):
        return self.serve(request._request)

    def serve(self, django_request: HttpRequest) -> HttpResponse:
        """Answer one agent request (a Django request: no DRF wrapping)."""
        now = timezone.now()
        token = credentials.bearer(django_request.META.get("HTTP_AUTHORIZATION"))
        body = self.parse(django_request)
        try:
            result = self.call(token, body, now=now, received=received_at(django_request, now=now))
        except protocol.Refused as exc:
            return problem(exc.status, exc.detail, exc.errors)
        return self.answer(result)

    def call(
        self, token: str | None, body: protocol.Body, *, now: dt.datetime, received: dt.datetime
    ) -> BaseModel | dict:
        """The protocol's answer: authenticate, then the body's refusal if it earned one, then `handle`."""
        caller = protocol.authenticate(token, now=now, allow_join=self.allow_join)
        return self.handle(caller, body.message(), now=now)

    def parse(self, django_request: HttpRequest) -> protocol.Body:
        """The request's message, or the refusal (415, 413, 400 naming each field) of a body that cannot be one.

        Read when the protocol first asks for it, after the credential's check: a request
        without one is refused from its headers, its body never read.
        """
        body: protocol.Body = protocol.Body(read=lambda: self.read(django_request, into=body))
        return body

    def read(self, django_request: HttpRequest, into: protocol.Body | None = None) -> wire.Message:
        """The request's message; raises Refused (415, 413, 400 naming each field) for a body it cannot be.

        For an endpoint that keeps its bodies' digests (`keeps_digest`), the digest of the bytes read
        is kept on `into`.
        """
        check_envelope(django_request.content_type, django_request.META.get("CONTENT_LENGTH"), self.max_body)
        body = django_request.read(self.max_body + 1)
        msg = parse_message(self.message, body, max_body=self.max_body, problems=self.problems)
        if into is not None and self.keeps_digest:
            into.digest = hb_rules.status_digest(body)
        return msg

    @staticmethod
    def answer(result: BaseModel | dict) -> HttpResponse:
        """The 200 answer."""
        if isinstance(result, BaseModel):
            return HttpResponse(result.model_dump_json(), content_type="application/json")
        return JsonResponse(result)


def documented(operation_id: str, ok: type[BaseModel], description: str):
    """The endpoint's entry in the OpenAPI document: its message, its 200 answer and every refusal."""

    def decorate(cls: type[AgentEndpoint]) -> type[AgentEndpoint]:
        schema = extend_schema(
            operation_id=operation_id,
            tags=["agent"],
            request=cls.message,
            responses=_responses(ok),
            auth=[],
            description=description,
        )
        return extend_schema_view(post=schema)(cls)

    return decorate


@documented(
    "agent_register",
    wire.RegisterResponse,
    "An agent's registration: the whole inventory and the shards already running. "
    "Authorization: Bearer <join token> at first, <node credential> after; the answer carries "
    "the credential when one was issued, the adopted shards, and the pending commands.",
)
class RegisterView(AgentEndpoint):
    """Register a node (join token the first time, the node's credential after)."""

    message = wire.Register
    max_body = MAX_REGISTER_BODY
    allow_join = True
    handle = staticmethod(protocol.register)
    problems = staticmethod(limits.register_problems)


@documented(
    "agent_heartbeat",
    wire.HeartbeatResponse,
    "Load, sensors, wear, IB ports, shard states and acknowledgements. The answer lists "
    "every command not yet acknowledged; list their ids in `acks` of a later heartbeat.",
)
class HeartbeatView(AgentEndpoint):
    """A node's heartbeat; the answer carries its pending commands until acknowledged."""

    message = wire.Heartbeat
    max_body = MAX_HEARTBEAT_BODY
    problems = staticmethod(limits.heartbeat_problems)
    # The agent's floor sends the status's digest back instead of the status (agents/lease.py).
    keeps_digest = True

    def call(
        self, token: str | None, body: protocol.Body, *, now: dt.datetime, received: dt.datetime
    ) -> BaseModel | dict:
        # The credential lookup is the lease renewal's own statement
        # (protocol.heartbeat_request); the refusals come in the same order.
        return protocol.heartbeat_request(token, body, now=now, received=received)


@documented(
    "agent_scan_upload",
    ScanStored,
    "A failed scan keeps the last good text and records the error beside it.",
)
class ScanUploadView(AgentEndpoint):
    """A fabric scan's result (ibnetdiscover text, or why it failed)."""

    message = wire.ScanUpload
    max_body = MAX_SCAN_BODY
    handle = staticmethod(protocol.upload_scan)
    problems = staticmethod(limits.scan_problems)


@documented(
    "agent_rotate_credential",
    wire.RegisterResponse,
    "Issue a new node credential (in `credential`). The current one stays valid until "
    "the new one is first used, so a lost answer does not lock the agent out.",
)
class RotateView(AgentEndpoint):
    """Replace the calling node's credential."""

    message = wire.RotateCredential
    max_body = MAX_ROTATE_BODY
    handle = staticmethod(protocol.rotate)
