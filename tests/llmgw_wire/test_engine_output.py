"""An engine's output as it may leave the node: redacted, bounded, and its cause line."""

import pytest

import llmgw_wire as wire

HF = "hf_" + "AbCdEf0123" * 3
SK = "sk-proj-" + "q1W2e3R4t5" * 3


@pytest.mark.parametrize(
    ("line", "redacted"),
    [
        # Secret-carrying flags, as wire.SECRET_FLAG decides, in every spelling an engine echoes.
        ("serve --api-key s3cret --port 8000", "serve --api-key *** --port 8000"),
        ("serve --api-key=s3cret --hf-token 'x y'", "serve --api-key=*** --hf-token ***"),
        ("argv: ['vllm', '--api-key', 's3cret', '--port']", "argv: ['vllm', '--api-key', '***', '--port']"),
        # Credentials in headers.
        ("Authorization: Bearer eyJhbGciOi.J9x", "Authorization: Bearer ***"),
        ("headers={'authorization': 'Basic dXNlcjpw'}", "headers={'authorization': 'Basic ***'}"),
        ("retrying with bearer abc.DEF-123", "retrying with bearer ***"),
        ("X-Api-Key: k-123", "X-Api-Key: ***"),
        # Environment variables and parsed arguments whose names hold a secret.
        (f"HF_TOKEN={HF} OPENAI_API_KEY='x' DB_PASSWORD=\"p w\"", "HF_TOKEN=*** OPENAI_API_KEY=*** DB_PASSWORD=***"),
        ("AWS_SECRET_ACCESS_KEY=abc123 PATH=/usr/bin", "AWS_SECRET_ACCESS_KEY=*** PATH=/usr/bin"),
        ("Namespace(api_key='s3cret', port=8000)", "Namespace(api_key=***, port=8000)"),
        (
            "non-default args: {'hf_token': 's3cret', 'port': 8000}",
            "non-default args: {'hf_token': '***', 'port': 8000}",
        ),
        ('{"api_key": "s3cret"}', '{"api_key": "***"}'),
        # Tokens by their shape, wherever they are.
        (f"login with {HF} ok", "login with hf_*** ok"),
        (f"using key {SK}.", "using key sk-***."),
    ],
)
def test_secrets_are_masked(line, redacted):
    assert wire.redact(line) == redacted
    # Twice is once: the control plane redacts what the agent redacted.
    assert wire.redact(redacted) == redacted


@pytest.mark.parametrize(
    "line",
    [
        "OSError: [Errno 98] Address already in use",
        "KeyError: 'model.layers.0.weight'",
        "Namespace(max_num_batched_tokens=8192, tokenizer='meta/llama', api_key=None)",
        "serve --max-num-batched-tokens 8192 --tokenizer meta/llama --ssl-keyfile /etc/k.pem",
        "pip install hf_transfer; task-abc done",
    ],
)
def test_what_holds_no_secret_is_kept(line):
    assert wire.redact(line) == line


def test_secrets_the_agent_knows_are_masked_in_any_shape():
    secrets = wire.secret_values(
        ["vllm", "serve", "--api-key", "s3cret-1", "--hf-token=s3cret-22", "--port", "8000"],
        {"HF_TOKEN": "s3cret-333", "PATH": "/usr/bin", "USE_API_KEY": "true"},
    )
    # Longest first, so one secret inside another is masked whole; too short to search for: left out.
    assert secrets == ["s3cret-333", "s3cret-22", "s3cret-1"]
    assert wire.redact("echoed: s3cret-333 / s3cret-22 (s3cret-1)", secrets) == "echoed: *** / *** (***)"


def test_terminal_escapes_are_dropped():
    assert wire.redact("\x1b[1;31mERROR\x1b[0m boom\r") == "ERROR boom"


def test_the_tail_is_bounded_in_lines_characters_and_bytes():
    lines = [f"line {i:05d} " + "é" * 2000 for i in range(10_000)]
    tail = wire.bounded_tail(lines)
    # 1,024 characters a line (2 bytes each here), the last that fit in 8 KiB.
    cut = [line[:1023] + "…" for line in lines]
    size = len(cut[-1].encode()) + 1
    assert tail == cut[-(wire.TAIL_BYTES // size) :]
    assert len("\n".join(tail).encode()) <= wire.TAIL_BYTES
    short = [f"line {i}" for i in range(100)]
    assert wire.bounded_tail(short) == short[-wire.TAIL_LINES :]
    # An item holding several lines (an older or hostile agent) is several lines.
    assert wire.bounded_tail(["a\nb", "c"]) == ["a", "b", "c"]


PY_TRACEBACK = [
    "# llmgw-agent: starting ['vllm', 'serve']",
    "INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.11.0",
    "Traceback (most recent call last):",
    '  File "/venv/lib/python3.12/site-packages/vllm/error_handler.py", line 12, in bind',
    "    sock.bind(addr)",
    "OSError: [Errno 98] Address already in use",
    "[rank0]:[W1201 10:00:01.000] ProcessGroupNCCL.cpp:1250] Warning: process group was not destroyed",
]


@pytest.mark.parametrize(
    ("lines", "cause"),
    [
        (PY_TRACEBACK, ("OSError: [Errno 98] Address already in use", True)),
        (
            ["[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "shutting down"],
            ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ),
        (
            ["ERROR 12-01 10:00:00 [core.py:700] EngineCore failed to start.", "INFO cleaning up"],
            ("ERROR 12-01 10:00:00 [core.py:700] EngineCore failed to start.", True),
        ),
        (
            [
                "llama_model_load: error loading model: tensor 'blk.0' data is not within the file bounds",
                "common_init_from_params: failed to load model '/models/x.gguf'",
                "main: exiting due to model loading error",
            ],
            ("main: exiting due to model loading error", True),
        ),
        (
            ["loading weights", "Loading safetensors shards: 40% (2/5)", ""],
            ("Loading safetensors shards: 40% (2/5)", False),
        ),
        (["# llmgw-agent: starting ['vllm']", "   "], ("", False)),
        ([], ("", False)),
        (["RuntimeError: " + "x" * 400], ("RuntimeError: " + "x" * 285 + "…", True)),
    ],
)
def test_the_cause_line(lines, cause):
    assert wire.cause_line(lines) == cause


def test_the_reason_names_the_cause_once():
    reason = wire.with_cause("the engine exited with code 1", PY_TRACEBACK)
    assert reason == "the engine exited with code 1: OSError: [Errno 98] Address already in use"
    # Said already (by the agent): not said again (by the control plane).
    assert wire.with_cause(reason, PY_TRACEBACK) == reason
    assert (
        wire.with_cause("not ready after 1800s", ["Loading 40%"])
        == "not ready after 1800s; its last output: Loading 40%"
    )
    assert wire.with_cause("the engine was killed by SIGKILL", []) == "the engine was killed by SIGKILL"
    assert wire.with_cause("", PY_TRACEBACK) == "OSError: [Errno 98] Address already in use"
    assert wire.with_cause("", ["Loading 40%"]) == "its last output: Loading 40%"
