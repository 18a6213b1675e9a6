#!/bin/sh
# The image's entry point (deploy/Containerfile; docs/deploy.md). `serve [FLAG ...]` (the default) runs the server
# on all interfaces: the HTTP API on $COSYLLAMA_PORT, Wyoming on $COSYLLAMA_WYOMING_PORT, the model in
# $COSYLLAMA_MODEL_DIR (its GGUF: $COSYLLAMA_GGUF, else the directory's only *.gguf, else the PyTorch LLM) and the
# voices in $COSYLLAMA_VOICES; FLAGs are added to (and win over) those. Any other command is cosyllama's own
# (`demo`, `convert`, `synth`, `--help`, ...). The API key: $COSYLLAMA_API_KEY, or the file
# $COSYLLAMA_API_KEY_FILE names (a secret; default /run/secrets/cosyllama_api_key where it exists).
set -eu

key_file=${COSYLLAMA_API_KEY_FILE:-/run/secrets/cosyllama_api_key}
if [ -z "${COSYLLAMA_API_KEY:-}" ] && [ -f "$key_file" ]; then
    # a secret file readable only by its owner on the host stays unreadable to uid 1000: say so, not cat's line
    if ! COSYLLAMA_API_KEY=$(cat "$key_file" 2>/dev/null); then
        echo "cosyllama: the API key file $key_file cannot be read by uid $(id -u): make it readable (chmod 0444, or chown $(id -u) on the host)" >&2
        exit 2
    fi
    export COSYLLAMA_API_KEY
elif [ -n "${COSYLLAMA_API_KEY_FILE:-}" ] && [ ! -f "$key_file" ]; then
    echo "cosyllama: COSYLLAMA_API_KEY_FILE=$key_file is not a readable file" >&2
    exit 2
fi

if [ "${1:-serve}" != serve ]; then
    exec cosyllama "$@"
fi
[ $# -gt 0 ] && shift

model_dir=${COSYLLAMA_MODEL_DIR:-/models}
gguf=${COSYLLAMA_GGUF:-}
if [ -z "$gguf" ]; then
    found=$(find "$model_dir" -maxdepth 1 -name '*.gguf' 2>/dev/null | head -n 2)
    if [ -n "$found" ] && [ "$(printf '%s\n' "$found" | wc -l)" -eq 1 ]; then
        gguf=$found
    fi
fi
if [ -n "$gguf" ]; then
    set -- --gguf "$gguf" "$@"
fi
exec cosyllama serve --model-dir "$model_dir" --host 0.0.0.0 --port "${COSYLLAMA_PORT:-8000}" \
    --voices "${COSYLLAMA_VOICES:-/voices}" --wyoming "tcp://0.0.0.0:${COSYLLAMA_WYOMING_PORT:-10200}" "$@"
