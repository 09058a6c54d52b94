"""Every code block that README.md and docs/*.md mark as runnable runs, against a live stack.

The marker is an HTML comment on the line right before the fence (GitHub
does not show it); the fence's language and the marker's kind say how the
block runs:

    <!-- runnable -->              bash or python: run as written
    <!-- runnable: agent.yaml -->  yaml: loaded by the node agent's own config loader
    <!-- runnable: prometheus -->  yaml: a Prometheus configuration: parsed, its keys checked,
                                   and it must be the one tests/test_prometheus.py runs a real
                                   Prometheus with (every target up, every panel answering)
    <!-- runnable: newcomer -->    bash: the README's first hour, run by tests/test_newcomer.py
                                   (`make run` and `make demo` in a clean copy)

A marker with another language or kind, or not followed by a fence, fails
here. The blocks are written for a newcomer's machine; before running one,
the documented defaults are replaced by the live stack's: the control
plane's `http://127.0.0.1:8000` (and `llmgw.example.internal:8000`), the
gateway's `http://127.0.0.1:8080`, and the gateway key `llmgw-sk-...` that
`make demo` prints. bash blocks run in the repository's top folder with
`DEBUG=1`, the stack's store settings, `LLMGW_LISTEN` and an operator API
token in `$TOKEN` (as the README's first hour leaves them); python blocks run
in the test's interpreter (its virtualenv has the OpenAI SDK).

One stack per page: the web server (pytest-django's live server), and, when
a block of the page talks to the gateway, one gateway process with an echo
replica serving the model `demo` and a key for it, as `make demo` leaves them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from django.core.management import call_command

from llmgw_agent import config as agent_config
from llmgw_sim import echo
from tests.gateway.conftest import Gateway, database_url, make_deployment, make_key, url_of
from tests.test_prometheus import documented_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*runnable(?::\s*(?P<kind>[\w.-]+))?\s*-->\s*$")
OPEN_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<language>[\w+-]*)\s*$")
# (language, kind) -> how it runs; anything else marked is an error.
RUNNERS = {
    ("bash", ""): "bash",
    ("sh", ""): "bash",
    ("python", ""): "python",
    ("yaml", "agent.yaml"): "agent.yaml",
    ("yaml", "prometheus"): "prometheus",
    ("bash", "newcomer"): "newcomer",
}
GATEWAY_PLACEHOLDERS = ("http://127.0.0.1:8080", "llmgw-sk-...")
# The keys of a Prometheus scrape_config this project's examples may use (Prometheus's own names).
SCRAPE_KEYS = {
    "job_name", "scrape_interval", "scrape_timeout", "metrics_path", "scheme", "params", "authorization",
    "basic_auth", "tls_config", "static_configs", "http_sd_configs", "relabel_configs", "metric_relabel_configs",
    "honor_labels", "honor_timestamps",
}  # fmt: skip
HTTP_SD_KEYS = {"url", "refresh_interval", "authorization", "basic_auth", "tls_config"}
AUTHORIZATION_KEYS = {"type", "credentials", "credentials_file"}


class MarkerError(ValueError):
    """A runnable marker that names no known runner, or marks no block."""


@dataclass(frozen=True)
class Block:
    """One marked code block: where it is, its language and kind, and its text (dedented)."""

    page: str
    line: int
    language: str
    kind: str
    code: str

    @property
    def runner(self) -> str:
        """How it runs; MarkerError when the marker names no known runner."""
        try:
            return RUNNERS[(self.language, self.kind)]
        except KeyError:
            known = ", ".join(f"{lang} {kind}".strip() for lang, kind in RUNNERS)
            raise MarkerError(
                f"{self.page}:{self.line}: a runnable block in {self.language or 'no language'!r}"
                f"{f' of kind {self.kind!r}' if self.kind else ''}: no test runs that (known: {known})"
            ) from None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def marked_blocks(text: str, page: str) -> list[Block]:
    """The blocks of a Markdown page marked runnable, in order; MarkerError for a marker on no fence."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        marker = MARKER.match(line)
        if not marker:
            continue
        fence = OPEN_FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            raise MarkerError(f"{page}:{i + 1}: a runnable marker must be the line right before a code fence")
        indent, ticks = fence["indent"], fence["fence"]
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise MarkerError(f"{page}:{i + 2}: the code fence is never closed")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 2 : end]]
        blocks.append(Block(page, i + 2, fence["language"], marker["kind"] or "", "\n".join(body) + "\n"))
    return blocks


def page_blocks(page: Path) -> list[Block]:
    """A page's marked blocks (the page named relative to the repository)."""
    return marked_blocks(page.read_text(), str(page.relative_to(ROOT)))


def test_the_reader_finds_marked_blocks_and_refuses_unknown_ones():
    text = (
        "# Page\n\n<!-- runnable -->\n```bash\necho hi\n```\n\n```bash\nnot marked\n```\n\n"
        "- a list item:\n\n  <!-- runnable: prometheus -->\n  ```yaml\n  scrape_configs: []\n  ```\n"
        "<!-- runnable -->\n```ruby\nputs 1\n```\n"
    )
    first, second, third = marked_blocks(text, "page.md")
    assert (first.line, first.language, first.kind, first.code, first.runner) == (4, "bash", "", "echo hi\n", "bash")
    assert (second.line, second.kind, second.code) == (15, "prometheus", "scrape_configs: []\n")
    assert second.runner == "prometheus"
    with pytest.raises(MarkerError, match=r"page\.md:19: a runnable block in 'ruby': no test runs that"):
        _ = third.runner
    with pytest.raises(MarkerError, match=r"page\.md:1: a runnable marker must be the line right before a code fence"):
        marked_blocks("<!-- runnable -->\n\n```bash\necho\n```\n", "page.md")
    with pytest.raises(MarkerError, match=r"of kind 'grafana'"):
        _ = marked_blocks("<!-- runnable: grafana -->\n```yaml\na: 1\n```\n", "p.md")[0].runner


def test_every_marked_block_has_a_runner():
    problems = []
    for page in PAGES:
        try:
            for block in page_blocks(page):
                _ = block.runner
        except MarkerError as e:
            problems.append(str(e))
    assert not problems, problems


def test_the_newcomer_block_is_the_readmes_first_hour():
    from tests.test_newcomer import readme_first_hour

    (block,) = [b for b in page_blocks(ROOT / "README.md") if b.runner == "newcomer"]
    steps = readme_first_hour(ROOT / "README.md")
    assert steps[0].endswith("make run") and any(s.endswith("make demo") for s in steps)
    assert all(step in block.code for step in steps)


def pages_with_blocks() -> list[str]:
    """The pages with a block this module runs (the newcomer's is tests/test_newcomer.py's)."""
    pages = []
    for page in PAGES:
        try:
            if any(b.runner != "newcomer" for b in page_blocks(page)):
                pages.append(str(page.relative_to(ROOT)))
        except MarkerError:
            pages.append(str(page.relative_to(ROOT)))  # fails in its test, with the reason
    return pages


class Stack:
    """The live stack a page's blocks run against; the gateway started only when a block needs it."""

    def __init__(self, live_server, tmp_path: Path, settings, admin) -> None:
        self.control_plane = live_server.url
        self.tmp_path = tmp_path
        self.settings = settings
        self.admin = admin
        out = StringIO()
        call_command("api_token", "create", "--user", admin.username, "--name", "docs", stdout=out)
        self.token = out.getvalue().strip()
        self.gateway: Gateway | None = None
        self.key = ""
        self._echoes: list = []

    def start_gateway(self) -> None:
        """A gateway process routing `demo` to one echo replica, and a key for it (what `make demo` leaves)."""
        if self.gateway is not None:
            return
        srv = echo.serve(host="127.0.0.1", port=0, model="demo", load_seconds=0.0)
        self._echoes.append(srv)
        make_deployment("demo", [url_of(srv)])
        self.key = make_key(self.admin, name="docs")
        self.gateway = Gateway(self.tmp_path, "gateway")
        self.gateway.start()
        self.gateway.wait_ready(self.key, "demo", 1, timeout=30)

    def stop(self) -> None:
        """Stop what was started."""
        if self.gateway is not None:
            self.gateway.stop()
        for srv in self._echoes:
            srv.shutdown()
            srv.server_close()

    def substituted(self, code: str) -> str:
        """The block with the newcomer's defaults replaced by this stack's addresses and key."""
        if any(p in code for p in GATEWAY_PLACEHOLDERS):
            self.start_gateway()
        assert self.gateway is not None or not any(p in code for p in GATEWAY_PLACEHOLDERS)
        cp = urlparse(self.control_plane).netloc
        code = code.replace("http://127.0.0.1:8000", self.control_plane).replace("llmgw.example.internal:8000", cp)
        if self.gateway is not None:
            code = code.replace("http://127.0.0.1:8080", self.gateway.url).replace("llmgw-sk-...", self.key)
        return code

    def env(self) -> dict[str, str]:
        """What a bash block sees: the README's first-hour shell, on this stack's stores."""
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "DEBUG": "1",
            "DATABASE_URL": database_url(),
            "LLMGW_LISTEN": urlparse(self.control_plane).netloc,
            "LLMGW_VAR_DIR": str(self.tmp_path / "var"),
            "TOKEN": self.token,
        }
        if self.gateway is not None:
            env["LLMGW_GATEWAY_LISTEN"] = urlparse(self.gateway.url).netloc
        return env

    def run(self, block: Block) -> str:
        """Run one block; '' when it worked, else what went wrong."""
        runner = block.runner
        code = self.substituted(block.code)
        if runner in ("bash", "python"):
            argv = ["bash", "-euo", "pipefail", "-c", code] if runner == "bash" else [sys.executable, "-c", code]
            cwd = ROOT if runner == "bash" else self.tmp_path
            try:
                done = subprocess.run(
                    argv, cwd=cwd, env=self.env(), capture_output=True, text=True, timeout=120, check=False
                )
            except subprocess.TimeoutExpired:
                return "ran past 120 s"
            if done.returncode != 0:
                return f"exit {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
            return ""
        if runner == "agent.yaml":
            path = self.tmp_path / "agent.yaml"
            path.write_text(code)
            try:
                agent_config.load(path)
            except agent_config.ConfigError as e:
                return f"the agent's loader refused it: {e}"
            return ""
        if runner == "prometheus":
            # As written: tests/test_prometheus.py substitutes the live addresses itself.
            return self.check_prometheus(block.code)
        raise AssertionError(f"{block}: {runner} blocks are not run here")

    def check_prometheus(self, code: str) -> str:
        """Parse a Prometheus configuration and check its keys; it must be the one a real Prometheus runs.

        tests/test_prometheus.py starts Debian's Prometheus with this very block
        (host names and intervals changed) against a live control plane, gateway
        and fleet, and waits for every target to be up: what a block of another
        page could configure is not run by anything, so it is refused.
        """
        problems = []
        config = yaml.safe_load(code)
        jobs = config.get("scrape_configs") if isinstance(config, dict) else None
        if not isinstance(jobs, list) or not jobs:
            return "no scrape_configs list"
        names = [job.get("job_name") for job in jobs]
        if len(set(names)) != len(names) or not all(names):
            problems.append(f"job names must be present and distinct: {names}")
        for job in jobs:
            name = job.get("job_name")
            problems += [f"{name}: unknown key {k!r}" for k in sorted(set(job) - SCRAPE_KEYS)]
            if set(job.get("authorization") or {}) - AUTHORIZATION_KEYS:
                problems.append(f"{name}: authorization keys {sorted(job['authorization'])}")
            for sd in job.get("http_sd_configs") or []:
                problems += [f"{name}: http_sd_configs: unknown key {k!r}" for k in sorted(set(sd) - HTTP_SD_KEYS)]
                if set(sd.get("authorization") or {}) - AUTHORIZATION_KEYS:
                    problems.append(f"{name}: http_sd_configs authorization keys {sorted(sd['authorization'])}")
        if code != documented_config():
            problems.append("not the configuration tests/test_prometheus.py runs a real Prometheus with")
        return "\n".join(problems)


@pytest.fixture
def stack(live_server, tmp_path, settings, django_user_model) -> Iterator[Stack]:
    """A live control plane (and a gateway when a block asks) for one page's blocks."""
    admin = django_user_model.objects.create_superuser("admin", password="docs-admin-pw-1")
    s = Stack(live_server, tmp_path, settings, admin)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("page", pages_with_blocks())
def test_the_runnable_blocks_of(page, stack):
    failed = []
    for block in page_blocks(ROOT / page):
        if block.runner == "newcomer":
            continue
        problem = stack.run(block)
        if problem:
            failed.append(f"{block} ({block.runner}): {problem}")
    assert not failed, "\n\n".join(failed)
