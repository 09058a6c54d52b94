#!/usr/bin/env bash
# Build llmgw's container images with podman, from a Debian base made here (no image registry needed).
#   scripts/image.sh base     the Debian base (debootstrap minbase + Python), once per machine
#   scripts/image.sh server   the control plane and gateway image (make image)
#   scripts/image.sh agent    the node agent's image (make image-agent)
#   scripts/image.sh podman ARGS...   podman with this project's settings (deploy/image/containers.conf)
# Settings:
#   LLMGW_IMAGE          the control plane's image name (default localhost/llmgw:latest)
#   LLMGW_AGENT_IMAGE    the agent's image name (default localhost/llmgw-agent:latest)
#   LLMGW_BASE_IMAGE     the Debian base (default localhost/llmgw-base:bookworm)
#   LLMGW_DEBIAN_MIRROR  the Debian mirror debootstrap reads (default: the one apt uses here)
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${LLMGW_IMAGE:-localhost/llmgw:latest}"
AGENT_IMAGE="${LLMGW_AGENT_IMAGE:-localhost/llmgw-agent:latest}"
BASE="${LLMGW_BASE_IMAGE:-localhost/llmgw-base:bookworm}"
export CONTAINERS_CONF="$(pwd)/deploy/image/containers.conf"
PY="${PYTHON:-python3}"

# podman, debootstrap and runc from Debian's packages when missing (as `make browser` installs Chromium).
need_tools() {
    if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman debootstrap runc >/dev/null
    fi
}

mirror() {
    if [ -n "${LLMGW_DEBIAN_MIRROR:-}" ]; then
        echo "$LLMGW_DEBIAN_MIRROR"
        return
    fi
    # The mirror apt already uses for bookworm, else Debian's own.
    local mirror_url
    mirror_url=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
        grep -oE 'https?://[^ ]+' | head -n1 || true)
    [ -n "$mirror_url" ] || mirror_url=http://deb.debian.org/debian
    echo "$mirror_url"
}

base() {
    need_tools
    if podman image exists "$BASE"; then
        return
    fi
    local root
    root=$(mktemp -d)
    # minbase: dpkg, apt and the essential packages; Python and the CA bundle are all the images add.
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$(mirror)" >/dev/null
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
    tar -C "$root" -c . | podman import --message "Debian bookworm minbase with Python 3 (llmgw)" - "$BASE" >/dev/null
    rm -rf "$root"
}

# The run requirements as wheels for the image's Python (3.11, like Debian bookworm's), built here so
# that the image build needs no network and no compiler.
wheels() {
    local dir=$1
    shift
    mkdir -p "$dir"
    # (Locations a machine's pip configuration names that do not exist are warned about, once each.)
    "$PY" -m pip wheel --quiet --wheel-dir "$dir" "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

server() {
    base
    rm -rf var/image/wheels
    # The project's own wheel (what `pip install .` installs) and its pinned run requirements. pip
    # resolves markers for the Python running it, not the image's: Debian's 3.11.2 is below redis's
    # python_full_version < "3.11.3" and so also needs async-timeout, at the version that marker takes.
    wheels var/image/wheels -r requirements.txt . async-timeout==5.0.1
    rm -rf build ./*.egg-info
    podman build --quiet --network=host --build-arg BASE="$BASE" -f deploy/image/Containerfile -t "$IMAGE" . >/dev/null
    podman image inspect --format '{{.Size}}' "$IMAGE" | awk -v i="$IMAGE" '{ printf "%s: %.0f MB\n", i, $1 / 1e6 }'
}

agent() {
    base
    rm -rf var/image/agent-wheels
    # The agent's own distribution (deploy/agent) and its dependencies, nothing of the control plane.
    wheels var/image/agent-wheels ./deploy/agent
    # setuptools builds in the source folder: leave deploy/agent as it was.
    rm -rf deploy/agent/build deploy/agent/*.egg-info
    podman build --quiet --network=host --build-arg BASE="$BASE" -f deploy/image/Containerfile.agent \
        -t "$AGENT_IMAGE" . >/dev/null
    podman image inspect --format '{{.Size}}' "$AGENT_IMAGE" | awk -v i="$AGENT_IMAGE" '{ printf "%s: %.0f MB\n", i, $1 / 1e6 }'
}

case "${1:-}" in
base) base ;;
server) server ;;
agent) agent ;;
podman)
    shift
    exec podman "$@"
    ;;
*)
    echo "usage: scripts/image.sh base|server|agent|podman ARGS..." >&2
    exit 2
    ;;
esac
