#!/usr/bin/env bash
# Make a stand-in for the official base image, docker.io/library/python:3.11-slim-bookworm,
# from Debian's archive alone, for machines that reach Debian and PyPI but no container
# registry (CI). Real builds use the official image; this one only has to look the same to
# the Dockerfile:
#
#   sudo bash .ci/standin_base.sh          # then: buildah bud --pull=never ...
#
# A minbase Debian 12 root (what debian:bookworm-slim is), Debian's python3.11, and /usr/local
# made a virtual environment of it: /usr/local/bin/python and pip, installing into
# /usr/local/lib/python3.11/site-packages, exactly where the official image's own build of
# Python has them. It is imported with buildah under the official name, so the Dockerfile's
# FROM needs no build argument. Needs root, mmdebstrap and buildah.
set -euo pipefail

tag=${STANDIN_TAG:-docker.io/library/python:3.11-slim-bookworm}
storage=${STORAGE_DRIVER:-overlay}
work=$(mktemp -d)
container=""
cleanup() {
    [ -z "$container" ] || buildah --storage-driver "$storage" rm "$container" >/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

# ca-certificates, netbase and tzdata: what the official slim image adds to Debian's slim.
# python3.11-venv brings ensurepip (and the pip wheel it installs).
mmdebstrap --variant=minbase --quiet \
    --include=python3.11,python3.11-venv,ca-certificates,netbase,tzdata \
    --customize-hook='chroot "$1" python3.11 -m venv /usr/local' \
    --customize-hook='rm -rf "$1"/usr/local/lib/python3.11/site-packages/*/__pycache__ "$1"/var/cache/ldconfig/aux-cache' \
    bookworm "$work/root.tar" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"

container=$(buildah --storage-driver "$storage" from --quiet scratch)
buildah --storage-driver "$storage" add --quiet "$container" "$work/root.tar" /
# The official image's configuration, which the Dockerfile's stages inherit.
buildah --storage-driver "$storage" config \
    --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --env PYTHON_VERSION="$(tar -xOf "$work/root.tar" ./usr/local/pyvenv.cfg | sed -n 's/^version = //p')" \
    --cmd python3 \
    --os linux --arch amd64 \
    "$container"
buildah --storage-driver "$storage" commit --quiet --format docker "$container" "$tag"
buildah --storage-driver "$storage" images "$tag"
