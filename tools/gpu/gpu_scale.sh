#!/bin/bash
# The compiled engine at scale, once the parts of tools/README.md are in /tmp/vlens-parts: `tp*` on two
# GPUs, `one` on one (or two); writes logs and benchmark results under $OUT.
#   tp:  compiled TP=2 Qwen3-MoE and Llama against one eager rank (tests/engine/test_tensor_parallel.py;
#        TEST_K selects), then the TP=2 benchmark of the compiled engine (Qwen3-8B shape): about 10
#        minutes on a fresh machine; tp-tests and tp-bench run each half alone (the tests ~4-5
#        minutes with Triton's cache empty, the benchmark ~5.5)
#   one: the one-GPU benchmark of the compiled engine on GPU 0 (every layer's capture streamed to the
#        host), and on GPU 1 at the same time (or after it, on a one-GPU machine) the graph
#        tier's tests (tests/engine/test_host_stream.py, tests/engine/test_compiled.py; TEST_K selects);
#        BENCH_SKIP=eager,hf,transformer_lens also measures one layer and steering (about 4-6 min);
#        BENCH_ARGS adds arguments of bench/run.py (--executor mp: the worker in a process of its
#        own, as under TP); TEST_FILES (relative to the repository) replaces the tests, and
#        TEST_ENGINE_ARGS (JSON) their engines' arguments
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-scale-out}
mkdir -p "$OUT"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
export NCCL_NVLS_ENABLE=0  # NVLink multicast (NVLS) stays off
tests() {  # fp32 parity between compiled and eager: Triton's dots in IEEE precision
  TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-$1 \
    VLENS_TEST_ENGINE_ARGS=${TEST_ENGINE_ARGS:-'{"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 1073741824}'} \
    timeout "$2" python3 -m pytest -q -p no:cacheprovider "${@:3}" > "$OUT/tests-$1.log" 2>&1
  echo "tests $1: exit $?"; tail -1 "$OUT/tests-$1.log"
  grep -h "^FAILED\|^E " "$OUT/tests-$1.log" | head -10
}
bench() {  # tools/gpu/bench.sh without setting up again
  mkdir -p "$OUT/$1"
  python3 "$root/bench/run.py" --preset gpu --out "$OUT/$1" --profile "${@:2}" 2>&1 \
    | tee "$OUT/$1/bench.log" | grep -E "^\[bench\]|^\||Error|error" || true
}
case "${1:-}" in
  tp|tp-tests|tp-bench)  # tp-tests and tp-bench: each half alone
    if [[ $1 != tp-bench ]]; then
      tests tp "${TEST_TIMEOUT:-200}" -k "${TEST_K:-compiled_two_ranks and (qwen3_moe or llama)}" \
        "$root/tests/engine/test_tensor_parallel.py"
    fi
    if [[ $1 != tp-tests ]]; then
      bench bench-tp --tensor-parallel-size 2 \
        --skip eager,hf,transformer_lens --reps 2 --timeouts compiled=150,graph_1=200,graph_all=200
    fi
    ;;
  one)  # the tests on GPU 1 during the benchmark where there is one, else after it
    gpus=$(nvidia-smi -L | wc -l)
    graph_tests() {
      local files=(${TEST_FILES:-tests/engine/test_host_stream.py tests/engine/test_compiled.py})
      CUDA_VISIBLE_DEVICES=$((gpus > 1)) tests graph "${TEST_TIMEOUT:-280}" \
        "${files[@]/#/$root/}" ${TEST_K:+-k "$TEST_K"}
    }
    if ((gpus > 1)); then graph_tests & fi
    CUDA_VISIBLE_DEVICES=0 bench bench-one --skip "${BENCH_SKIP:-eager,hf,transformer_lens,graph_1}" \
      --reps 2 --timeouts compiled=150,graph_1=200,graph_all=250 ${BENCH_ARGS:-}
    if ((gpus > 1)); then wait; else graph_tests; fi
    ;;
  *) echo "usage: gpu_scale.sh tp|tp-tests|tp-bench|one"; exit 2 ;;
esac
