#!/bin/bash
# `make image`: build deploy/Dockerfile with whichever container engine works here, offline.
#
#   IMAGE=ghcr.io/datacache/datacache:0.1.0 VERSION=0.1.0 deploy/build-image.sh
#   BASE=python:3.11-slim ...     # where a registry answers: the usual base instead
#
# It needs build/wheels (make wheels: the project and its pinned dependencies, built on the host)
# and, unless BASE names another image, the base image localhost/datacache-base:bookworm: Debian 12
# (Python 3.11) from Debian's own packages by debootstrap, as root, once; the root filesystem is
# kept as build/base/bookworm.tar, so a rerun, or another engine, imports it in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${IMAGE:?set IMAGE, the name to build}"
: "${VERSION:?set VERSION, the project version the wheels carry}"
LOCAL_BASE=localhost/datacache-base:bookworm
: "${BASE:=$LOCAL_BASE}"
: "${DEBIAN_MIRROR:=http://deb.debian.org/debian}"
BASE_TAR=build/base/bookworm.tar
BASE_PACKAGES=python3,python3-venv,passwd,ca-certificates

read -r -a engine <<<"$(deploy/container-engine.sh)"

if ! compgen -G "build/wheels/datacache-${VERSION}-*.whl" >/dev/null; then
    echo "build-image: no wheel of datacache ${VERSION} in build/wheels: run make wheels first" >&2
    exit 1
fi

if [ "$BASE" = "$LOCAL_BASE" ] && ! "${engine[@]}" image inspect "$BASE" >/dev/null 2>&1; then
    if [ ! -s "$BASE_TAR" ]; then
        if [ "$(id -u)" != 0 ] || ! command -v debootstrap >/dev/null; then
            echo "build-image: the base image needs debootstrap, as root (apt-get install debootstrap)," \
                "or BASE=python:3.11-slim where a registry answers" >&2
            exit 1
        fi
        rootfs=build/base/rootfs.partial
        rm -rf "$rootfs" && mkdir -p build/base
        echo "build-image: debootstrap bookworm ($BASE_PACKAGES) into $rootfs, about 3 minutes, once" >&2
        debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$DEBIAN_MIRROR" >&2
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -cf "$BASE_TAR.partial" . && mv "$BASE_TAR.partial" "$BASE_TAR"
        rm -rf "$rootfs"
    fi
    "${engine[@]}" import --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "CMD [\"/bin/bash\"]" "$BASE_TAR" "$BASE" >/dev/null
fi

flags=()
if [ "${engine[0]}" != docker ]; then
    # podman/buildah: the Dockerfile's own ignore file, and rlimits no higher than the host's
    # (an OCI spec raising a hard limit fails in an unprivileged setup: setrlimit EPERM).
    flags+=(--ignorefile deploy/Dockerfile.dockerignore --format docker)
    for limit in "nofile $(ulimit -Hn)" "nproc $(ulimit -Hu)"; do
        read -r name hard <<<"$limit"
        value=4096
        if [ "$hard" != unlimited ] && [ "$hard" -lt "$value" ]; then value=$hard; fi
        flags+=(--ulimit "$name=$value:$value")
    done
fi
"${engine[@]}" build "${flags[@]}" -f deploy/Dockerfile --build-arg "BASE=$BASE" --build-arg "VERSION=$VERSION" \
    -t "$IMAGE" .
