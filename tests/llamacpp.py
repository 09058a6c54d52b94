"""A real llama.cpp `llama-server` for the tests: the binary `make llama-server` builds, a tiny
model written on the spot, and a server started on them and stopped cleanly.

The binary comes through one variable, LLMGW_LLAMA_SERVER (the Makefile sets it for pytest).
Unset, the tests that need it skip; set to a path that is not there, they fail, since `make
test` promised a build. The model is a llama of 2 layers, 64 wide, with a byte-level BPE
vocabulary of 263 tokens and random weights from a fixed seed: it answers noise, fast, and
exercises the same server code (slots, prompt cache, metrics) a real model does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from tests.ports import free_port_range

ENV = "LLMGW_LLAMA_SERVER"
ALIAS = "tiny-llama"
# ChatML, which llama-server's template engine renders for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
# A few merges so the BPE path is taken (a vocabulary of bare bytes has none): 256 + 3 + 4 = 263.
MERGES = ("Ġ t", "h e", "Ġt he")
N_EMBD, N_HEAD, N_LAYER, N_FF, N_CTX_TRAIN = 64, 4, 2, 128, 2048


def llama_server_binary() -> Path:
    """The llama-server binary named by LLMGW_LLAMA_SERVER; skips the test when it is unset
    and fails it when it names nothing runnable."""
    named = os.environ.get(ENV)
    if not named:
        pytest.skip(f"{ENV} is not set: run `make llama-server` (make test sets it)")
    path = Path(named)
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{ENV}={named} is not an executable file: run `make llama-server` to build it")
    return path


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (byte-level BPE's base vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in stand_in:
            stand_in[b] = chr(256 + extra)
            extra += 1
    return [stand_in[b] for b in range(256)]


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write a 2-layer llama GGUF of random F32 weights (seeded) with a 263-token byte-level BPE
    vocabulary and a ChatML chat template to `path`; returns `path`."""
    tokens = [*byte_tokens(), *(a + b for a, b in (m.split(" ") for m in MERGES)), *SPECIAL_TOKENS]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)) + [gguf.TokenType.CONTROL] * len(
        SPECIAL_TOKENS
    )
    n_vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llmgw tiny llama (random weights)")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    # numpy shapes are ggml's dimensions reversed: token_embd is ne {n_embd, n_vocab}.
    writer.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(N_EMBD, N_FF))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass
class LlamaServer:
    """A llama-server process serving one model on 127.0.0.1:`port`; its output goes to `log`."""

    process: subprocess.Popen
    port: int
    alias: str
    log: Path

    @property
    def url(self) -> str:
        """The server's base URL (the OpenAI API is under /v1)."""
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        """The last lines the server printed, for a failure message."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start_llama_server(
    binary: Path,
    model: Path,
    port: int,
    *,
    alias: str = ALIAS,
    log: Path,
    ctx: int = 512,
    parallel: int = 2,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
) -> LlamaServer:
    """Start llama-server on `model` at 127.0.0.1:`port` with /metrics on, and return once its
    /health answers 200 (the model is loaded). Raises RuntimeError, with the server's last output,
    when it exits or is not healthy within `timeout` seconds."""
    args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--alias", alias]
    args += ["--metrics", "-c", str(ctx), "-np", str(parallel), *extra_args]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = LlamaServer(process=process, port=port, alias=alias, log=log)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {process.returncode}:\n{server.log_tail()}")
            try:
                # 503 while the model loads; 200 once a slot can take a request.
                if client.get(f"{server.url}/health").status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    stop_llama_server(server)
    raise RuntimeError(f"llama-server was not healthy within {timeout} s:\n{server.log_tail()}")


def stop_llama_server(server: LlamaServer, timeout: float = 10.0) -> int:
    """Stop the server (SIGTERM, then SIGKILL past `timeout` seconds) and return its exit status."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@contextmanager
def running_llama_server(binary: Path, model: Path, log: Path, **options) -> Iterator[LlamaServer]:
    """A llama-server on a free port for the `with` block (options as for start_llama_server)."""
    server = start_llama_server(binary, model, free_port_range(1), log=log, **options)
    try:
        yield server
    finally:
        stop_llama_server(server)


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """The llama-server binary (skips when LLMGW_LLAMA_SERVER is unset; fails when it is missing)."""
    return llama_server_binary()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny llama GGUF, written once per session into a temporary directory."""
    return write_tiny_model(tmp_path_factory.mktemp("llama-model") / "tiny-llama.gguf")


@pytest.fixture
def llama_server(llama_server_bin, tiny_model, tmp_path) -> Iterator[LlamaServer]:
    """A fresh llama-server on the tiny model (`-c 512 -np 2`, /metrics on), stopped after the test."""
    with running_llama_server(llama_server_bin, tiny_model, tmp_path / "llama-server.log") as server:
        yield server
