#!/bin/sh
# Prints the directory holding the llama-cpp-python wheel the image installs (deploy/Containerfile's
# LLAMA_CPP_VERSION and LLAMA_CMAKE_ARGS: every ggml CPU variant, chosen at run time), building it there first
# when it is not yet made. One directory per version and flags, keyed on both: pip's own wheel cache keys on
# neither the flags nor the build it made first. Mount it for the image build: podman build -v DIR:/wheels:ro ...
# The wheel is built with this machine's compiler and C library: use it for a base image whose glibc is at least
# as new (Debian 12 here, like the default base); elsewhere let the image build make its own.
# Environment: COSYLLAMA_WHEELS (default ~/.cache/cosyllama/wheels), LLAMA_CPP_VERSION, LLAMA_CMAKE_ARGS, PYTHON.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
version=${LLAMA_CPP_VERSION:-$(sed -n 's/^ARG LLAMA_CPP_VERSION=//p' "$here/Containerfile")}
flags=${LLAMA_CMAKE_ARGS:-$(sed -n 's/^ARG LLAMA_CMAKE_ARGS="\(.*\)"$/\1/p' "$here/Containerfile")}
want="llama-cpp-python==$version $flags"
key=$(printf '%s' "$want" | sha256sum | cut -c1-12)
root=${COSYLLAMA_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/cosyllama/wheels}
dir="$root/llama-cpp-python-$version-$key"
if [ -f "$dir/BUILD" ] && [ "$(cat "$dir/BUILD")" = "$want" ]; then
    echo "$dir"
    exit 0
fi
mkdir -p "$root"
tmp=$(mktemp -d "$root/.building-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "building $want into $dir (every CPU variant: 25 min on 2 AVX2 cores)" >&2
start=$(date +%s)
# --no-cache-dir: neither take a wheel pip built before with other flags nor leave this one in its cache
CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "${PYTHON:-python3}" -m pip wheel --no-deps --no-cache-dir \
    --no-binary llama-cpp-python "llama-cpp-python==$version" -w "$tmp" >&2
ls "$tmp"/llama_cpp_python-"$version"-*.whl >/dev/null
printf '%s' "$want" > "$tmp/BUILD"
rm -rf "$dir"
mv "$tmp" "$dir"
echo "built in $(( $(date +%s) - start )) s" >&2
echo "$dir"
