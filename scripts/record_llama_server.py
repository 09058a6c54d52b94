"""Record what the llama-server `make llama-server` builds prints and serves, for the tests.

    LLMGW_LLAMA_SERVER=... python scripts/record_llama_server.py tests/fixtures/engines
    (or: make record-llama-server)

Writes, into the directory given:
- llamacpp-11434-version.stdout.txt / .stderr.txt: `llama-server --version`, stream by stream
  (this build prints its version on stderr and nothing on stdout);
- llamacpp-11434-help.stdout.txt / .stderr.txt: `llama-server --help`, the same way;
- llamacpp-11434-metrics.txt: one /metrics scrape of the server on the tests' tiny model, taken
  after two requests sharing a long prefix (so the prompt-cache counter is not zero) and while
  two other requests are being generated (so requests_processing reads 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.llamacpp import ALIAS, ENV, running_llama_server, write_tiny_model

PREFIX = "You are a terse assistant. Answer with one word only, and never explain the answer. " * 2
# Long enough to be caught running: each request generates this many tokens (the context allows it).
LONG = 3000
SERVER_OPTIONS = {"ctx": 8192, "parallel": 2}


def record_streams(binary: Path, flag: str, out: Path, stem: str) -> None:
    """Run `binary flag` and write its stdout and stderr to `stem`.stdout.txt and .stderr.txt."""
    run = subprocess.run([str(binary), flag], capture_output=True, timeout=60, check=True)
    (out / f"{stem}.stdout.txt").write_bytes(run.stdout)
    (out / f"{stem}.stderr.txt").write_bytes(run.stderr)


def busy_metrics(url: str, attempts: int = 5) -> str:
    """A /metrics scrape taken while two long requests are both being generated."""
    for _ in range(attempts):
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(f"{url}/v1/completions",),
                kwargs={
                    "json": {"model": ALIAS, "prompt": f"story {i}", "max_tokens": LONG, "ignore_eos": True},
                    "timeout": 120,
                },
            )
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        try:
            while any(thread.is_alive() for thread in threads):
                scrape = httpx.get(f"{url}/metrics", timeout=10).text
                if "\nllamacpp:requests_processing 2\n" in scrape:
                    return scrape
                time.sleep(0.01)
        finally:
            for thread in threads:
                thread.join()
    raise RuntimeError(f"no scrape in {attempts} tries saw two requests running")


def main(out: Path) -> None:
    """Write the recordings into `out`."""
    if not os.environ.get(ENV):
        sys.exit(f"{ENV} is not set: run `make record-llama-server`, or name the llama-server to record")
    binary = Path(os.environ[ENV])
    out.mkdir(parents=True, exist_ok=True)
    record_streams(binary, "--version", out, "llamacpp-11434-version")
    record_streams(binary, "--help", out, "llamacpp-11434-help")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-llama.gguf")
        with running_llama_server(binary, model, Path(tmp) / "llama-server.log", **SERVER_OPTIONS) as server:
            for question in ("Is the sky blue?", "Is the sea wet?"):
                response = httpx.post(
                    f"{server.url}/v1/completions",
                    json={"model": ALIAS, "prompt": PREFIX + question, "max_tokens": 4, "ignore_eos": True},
                    timeout=60,
                )
                response.raise_for_status()
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if not cached:
                raise RuntimeError("the second request reused no cached prompt tokens")
            (out / "llamacpp-11434-metrics.txt").write_text(busy_metrics(server.url))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
