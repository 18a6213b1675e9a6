#!/usr/bin/env bash
# Run on a machine with network access, before borrowing a GPU machine that has none: fills DIR
# (default .whl, ignored by git) with what scripts/gpu_check.sh installs there:
#   * wheels (CPython 3.12, manylinux x86-64) of cosyllama's dependencies that a stock CUDA PyTorch
#     image usually lacks (soundfile, the text frontend's, the server's, gguf);
#   * llama-cpp-python's source, trimmed of the model files and docs its build does not read
#     (76 MB -> ~12 MB), for a CUDA build of llama.cpp there.
# Usage: scripts/gpu_prepare.sh [DIR]
set -euo pipefail
dir=${1:-.whl}
py=${PY_VERSION:-3.12}
llama=${LLAMA_CPP_PYTHON:-0.3.36}
mkdir -p "$dir"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any)
# One version of each, pinned to what CI tests with (pip show on this machine), deps named one by one.
pkgs=(soundfile cffi pycparser wetext kaldifst contractions textsearch anyascii pyahocorasick num2words
      gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn python-multipart
      diskcache)
pins=()
for p in "${pkgs[@]}"; do
  v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  pins+=("$p${v:+==$v}")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${plat[@]}" \
  -d "$dir" "${pins[@]}"
# docopt (num2words' CLI dependency) ships only a source archive: build its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w "$dir" "docopt==0.6.2"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "llama-cpp-python==$llama"
tar -xzf "$tmp"/llama_cpp_python-"$llama".tar.gz -C "$tmp"
src="$tmp/llama_cpp_python-$llama"
rm -rf "$src"/vendor/llama.cpp/{models,docs,benches,media,.github,.devops} "$src"/examples "$src"/.git
tar -czf "$dir/llama_cpp_python-$llama.tar.gz" -C "$tmp" "llama_cpp_python-$llama"
rm -rf "$tmp"
du -sh "$dir"
ls "$dir"
