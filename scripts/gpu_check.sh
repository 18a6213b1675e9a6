#!/usr/bin/env bash
# One call on a fresh CUDA machine (no network), inside ~8 minutes: install what scripts/gpu_prepare.sh
# put in WHEELS, run the GPU tests and the GPU benchmark rows, and write their results to OUTDIR.
#
#   scripts/gpu_check.sh OUTDIR [WHEELS=.whl]
#
# Needs: python3 with a CUDA PyTorch (>= 2.4), nvcc + cmake + ninja for the llama.cpp CUDA build.
# What it does, in order (each step time-boxed, [limit in s]; a failed step is logged and the next one runs):
#   0. a CUDA build of llama-cpp-python from the carried source, in the background at low priority
#      (one GPU architecture, CUDA_ARCH, default 90 = Hopper), while the GPU work below runs;
#      before step 1: the full-size random model, made once [180];
#   1. pytest -m gpu (every stage on CUDA against the golden fixtures, the CUDA-graph LLM included) [240];
#   2. cosyllama bench --device cuda: torch LLM rows (fp32 parity, bf16), flow, vocoder, pipeline [240];
#   2b. bench's flow-batch part: N = 1..16 concurrent non-streaming flows, one after another vs one
#      batch, bf16 then fp32: does batching concurrent flows pay on this GPU? [150; expected ~70 s: at
#      the H200's 0.4 s per 10 s flow solve, the serialized side of one round for N = 1+2+4+8+16 is
#      ~12 s per precision];
#   3. aggregate LLM decode of 1, 4 and 16 concurrent streams (scheduler over the CUDA-graph backend) [2 x 120];
#   4. first streamed audio for a registered, warmed voice [120];
#   5. the HTTP server under 1 and 16 concurrent streaming requests [180];
#   6. once the llama.cpp build is done: its GPU tests and its Q8_0 LLM and pipeline rows [120 + 240].
# The limits are ceilings for a step that hangs, not the expected times; they sum past 8 minutes.
# OUTDIR ends with at most 6 files: gpu-check.log, gpu-tests.json, bench-cuda.json, bench-llamacpp-cuda.json,
# gpu-check.json (everything else merged) and llama-build.log.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [WHEELS]}
wheels=${2:-.whl}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
exec > >(tee "$out/gpu-check.log") 2>&1
t0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }
step() {  # step SECONDS NAME CMD...: run with a time limit, log the outcome, never stop the script
  local limit=$1 name=$2; shift 2
  say "$name"
  timeout "$limit" "$@"
  local rc=$?
  [ $rc -eq 0 ] || say "$name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)')"
  return 0
}
export PYTHONUNBUFFERED=1
tmp=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# Dependencies: the carried wheels into a private site directory; the package from this checkout.
site=$tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
  || say "some wheels did not install"
export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

# 0. llama.cpp with CUDA, built beside the GPU work (nice 19: the timed runs below keep their cores).
sdist=$(ls "$wheels"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)
llama_site=$tmp/llama-site
if [ -n "$sdist" ]; then
  say "building llama-cpp-python with CUDA (arch ${CUDA_ARCH:-90}) in the background"
  (CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=off -DGGML_NATIVE=on" \
     CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) nice -n 19 python3 -m pip install --no-index --no-deps \
     --no-build-isolation --no-cache-dir --target "$llama_site" "$sdist" > "$tmp/llama-build.log" 2>&1 \
     && touch "$tmp/llama-ok"; tail -c 200000 "$tmp/llama-build.log" > "$out/llama-build.log") &
fi

# The full-size random model the benchmarks use (made once, ~1 min).
step 180 "full-size random model" python3 -c "from cosyllama.tools.bench_setup import ensure_full_model; ensure_full_model(print)"
model=$(python3 -c "from cosyllama.tools.bench_setup import ensure_full_model; print(ensure_full_model(lambda *_: None))")

step 240 "1. GPU tests" env COSYLLAMA_GPU_REPORT="$out/gpu-tests.json" \
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_gpu_llm.py
step 240 "2. bench --device cuda" python3 -m cosyllama.cli bench --device cuda --model-dir "$model" \
  --parts llm,flow,vocoder,pipeline --llm-types Q8_0 --json "$out/bench-cuda.json"
step 150 "2b. concurrent flows, serialized vs batched" python3 -m cosyllama.cli bench --device cuda \
  --model-dir "$model" --parts flow-batch --flow-precisions bf16,fp32 --batch-sizes 1,2,4,8,16 --repeat 2 \
  --json "$tmp/flow-batch.json"
for p in fp32 bf16; do
  step 120 "3. concurrent decode, torch $p" python3 scripts/bench_concurrency.py --model-dir "$model" \
    --device cuda --llm-precision "$p" --streams 1,4,16 --tokens 200 --repeat 1 --json "$tmp/concurrency-$p.json"
done
step 120 "4. first streamed audio, warmed voice" python3 scripts/bench_first_audio.py --llm torch --device cuda \
  --llm-precision bf16 --prompt-cache-mb 512 --warm --requests 5 --json "$tmp/first-audio.jsonl"
step 180 "5. server, 1 and 16 concurrent streams" python3 scripts/load_test.py --model-dir "$model" --device cuda \
  --llm-precision bf16 --parallel 16 --concurrency 1,16 --requests 32 --time-limit 40 --json "$tmp/load.json"

if [ -n "$sdist" ]; then
  say "waiting for the llama.cpp build"
  wait
  if [ -f "$tmp/llama-ok" ]; then
    export PYTHONPATH="$llama_site:$PYTHONPATH"
    step 120 "6a. llama.cpp GPU tests" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_llm.py -k llamacpp
    step 240 "6b. llama.cpp rows on the GPU" python3 -m cosyllama.cli bench --device cuda --model-dir "$model" \
      --parts llm,pipeline --llm-types Q8_0 --json "$out/bench-llamacpp-cuda.json"
  else
    say "the llama.cpp CUDA build failed: see llama-build.log"
  fi
fi

python3 - "$tmp" "$out/gpu-check.json" <<'EOF'
import json, pathlib, sys
tmp, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
merged = {}
for f in sorted(tmp.glob("*.json")):
    merged[f.stem] = json.loads(f.read_text())
for f in sorted(tmp.glob("*.jsonl")):
    merged[f.stem] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
pathlib.Path(dest).write_text(json.dumps(merged, indent=1))
print("merged", ", ".join(merged) or "nothing", "->", dest)
EOF
say "done"
