#!/bin/sh
# Print the command that builds and runs containers on this machine, or say why there is none.
#
#   ENGINE="podman --runtime runc" make image    # choose it yourself
#
# docker where its daemon answers (the client alone is not enough); else podman, with runc where
# runc is installed: podman's default runtime, crun, fails on hosts with hybrid cgroups ("cgroups in
# hybrid mode not supported"). Exit 1 with one line on stderr when neither works (the container
# tests skip with that line).
if [ -n "${ENGINE:-}" ]; then
    echo "$ENGINE"
    exit 0
fi
if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then
    echo docker
    exit 0
fi
if command -v podman >/dev/null 2>&1; then
    engine=podman
    if command -v runc >/dev/null 2>&1; then
        engine="podman --runtime runc"
    fi
    if timeout 60 $engine info >/dev/null 2>&1; then
        echo "$engine"
        exit 0
    fi
    echo "no container engine works here: '$engine info' fails (try: apt-get install podman runc)" >&2
    exit 1
fi
if command -v docker >/dev/null 2>&1; then
    echo "no container engine works here: docker's daemon does not answer and podman is not installed" >&2
else
    echo "no container engine here: install docker, or podman and runc (apt-get install podman runc)" >&2
fi
exit 1
