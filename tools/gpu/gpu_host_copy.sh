#!/bin/bash
# On one GPU, once the parts of tools/README.md are in /tmp/vlens-parts:
# bench/host_copy.py (how each way of moving kept rows to the host slows the GPU), and the graph
# tier's CUDA tests for the architectures named in ARCHS, with their tracebacks, once as they run
# and once with the host stream turned off (the cache handed back after the call instead).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/vlens-host-copy-out}
mkdir -p "$OUT"
source "$root/tools/gpu/gpu_setup.sh" || exit 1
for shape in decode prefill; do
  timeout 150 python3 "$root/bench/host_copy.py" --shape $shape 2>&1 \
    | tee -a "$OUT/host_copy.log" | grep "^\[host_copy\]\|^|\|Error"
done
mkdir -p /tmp/vlens-plugins
cat > /tmp/vlens-plugins/no_host_stream.py <<'PY'
from vlens.runtime.transfer.host_stream import HostStream
HostStream.available = staticmethod(lambda device: False)
PY
graph() {  # $1: label, then pytest arguments
  TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-graph \
    VLENS_TEST_ENGINE_ARGS='{"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 1073741824}' \
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -p no:cacheprovider --tb=short -q \
    -k "traced_as_eager and (${ARCHS:-deepseek or gemma})" "${@:2}" \
    "$root/tests/engine/test_compiled.py" > "$OUT/graph-$1.log" 2>&1
  echo "graph $1: exit $?"; tail -1 "$OUT/graph-$1.log"
  grep -h "^FAILED\|^E  " "$OUT/graph-$1.log" | head -20
}
graph streamed
PYTHONPATH=/tmp/vlens-plugins:$PYTHONPATH graph handed-back -p no_host_stream
