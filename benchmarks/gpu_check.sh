#!/usr/bin/env bash
# One script for a GPU machine (made for an NVIDIA H200 with CuPy 14 / CUDA 13, PyTorch, h5py, pytest,
# hypothesis preinstalled and nothing else reachable), run from the repository root:
#
#   OUT=/path/to/report benchmarks/gpu_check.sh
#
# 1. Records the GPU, driver and package versions.
# 2. Installs qgcli from this checkout without dependencies (pip install --no-deps --no-build-isolation -e .;
#    PYTHONPATH=. as well, so a failed install still leaves the package importable).
# 3. pytest -m gpu (the xp-parametrised op tests on CuPy and the other GPU tests), then the remaining tests
#    whose names say cupy or gpu (-k "cupy or gpu" -m "not gpu"), each with a time limit.
# 4. The CLI with --device gpu against --device cpu on the shipped samples (outputs must be identical for
#    fake quant; batch norm to float32 rounding).
# 5. benchmarks/bench_gpu.py: bandwidth of every op on 1 GiB tensors against a device-to-device copy and
#    against PyTorch CUDA, and a bit-exactness check of CuPy against the CPU path.
#
# Dry run without a GPU: GPU_CHECK_DEVICE=cpu makes step 4 compare cpu with cpu; steps 3 and 5 then
# report skipped tests and a clear "needs CuPy" failure.
#
# Everything lands under $OUT (at most 8 files): gpu_check.log (all output), pip.log, pytest_gpu.xml,
# pytest_k.xml, bench_gpu.json, bench_gpu.txt, summary.txt.  Designed to end well inside 10 minutes
# (each step has its own time limit).  Exit code: 0 when every step passed, 1 otherwise.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T0=$(date +%s)
STATUS=()
step() { echo; echo "=== $* (at $(( $(date +%s) - T0 )) s)"; }
record() { STATUS+=("$1: $2"); echo "--- $1: $2"; }

main() {
step "environment"
date -u '+%Y-%m-%d %H:%M:%S UTC'
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || echo "nvidia-smi failed"
echo "host: $(nproc) CPUs, $(uname -m), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') $(git status --porcelain 2>/dev/null | wc -l) changed files"
"$PY" - <<'EOF'
import importlib, importlib.metadata, platform
print("python", platform.python_version())
for name in ["numpy", "cupy", "torch", "h5py", "click", "rich", "matplotlib", "ml_dtypes", "pytest", "hypothesis"]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(f"{name}: MISSING ({type(exc).__name__}: {exc})")
        continue
    dists = importlib.metadata.packages_distributions().get(name, [name])
    try:
        print(name, ", ".join(f"{d} {importlib.metadata.version(d)}" for d in dists))
    except importlib.metadata.PackageNotFoundError:
        print(name, "(version unknown)")
try:
    import cupy
    print("cupy CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion(),
          "devices", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    print("cupy device query failed:", exc)
EOF

step "install qgcli from the checkout (no dependencies)"
if timeout 120 "$PY" -m pip install --no-deps --no-build-isolation --no-input -e . >"$OUT/pip.log" 2>&1; then
    record install "ok (editable)"
else
    record install "pip failed (see pip.log); using PYTHONPATH=. only"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import qgcli, qgcli.ops; print('qgcli', qgcli.__version__, 'from', qgcli.__file__)" || record import FAILED
QGCLI=(qgcli)
command -v qgcli >/dev/null || QGCLI=("$PY" -m qgcli)

PYTEST_OPTS=(-q -rs -p no:cacheprovider)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_OPTS+=(--timeout 120)

# run_pytest LABEL SECONDS JUNIT ARGS...: records pytest's own summary line (counts of passed/skipped/failed).
run_pytest() {
    local label=$1 limit=$2 junit=$3 rc counts
    shift 3
    step "$label"
    timeout "$limit" "$PY" -m pytest "${PYTEST_OPTS[@]}" --junitxml="$OUT/$junit" "$@" tests | tee "$OUT/.pytest.txt"
    rc=${PIPESTATUS[0]}
    counts=$(grep -E '(passed|failed|skipped|error|deselected)' "$OUT/.pytest.txt" | tail -1 | sed 's/=//g; s/^ *//')
    rm -f "$OUT/.pytest.txt"
    if [[ $rc == 0 || $rc == 5 ]]; then
        record "$label" "passed (exit $rc): $counts"
    else
        record "$label" "FAILED (exit $rc$([[ $rc == 124 ]] && echo ', time limit')): $counts"
    fi
}
run_pytest "pytest -m gpu" 200 pytest_gpu.xml -m gpu
run_pytest "pytest -k 'cupy or gpu' -m 'not gpu'" 100 pytest_k.xml -k "cupy or gpu" -m "not gpu"

DEVICE=${GPU_CHECK_DEVICE:-gpu}  # GPU_CHECK_DEVICE=cpu dry-runs this step on a machine without a GPU
step "CLI: --device $DEVICE against --device cpu on samples/"
TMPD=$(mktemp -d)
cli_ok=1
for spec in "fakequant-grad samples/per_channel.h5" "fakequant samples/notebook.h5 --num-bits 2" \
            "fakequant-grad samples/notebook.h5" "bn-grad samples/batch_norm.h5"; do
    read -r -a words <<<"$spec"
    name=$(echo "$spec" | tr ' /.' '___')
    if timeout 60 "${QGCLI[@]}" "${words[@]}" --device "$DEVICE" -o "$TMPD/$name.gpu.h5" --quiet &&
       timeout 60 "${QGCLI[@]}" "${words[@]}" --device cpu -o "$TMPD/$name.cpu.h5" --quiet; then
        "$PY" - "$TMPD/$name.gpu.h5" "$TMPD/$name.cpu.h5" "$spec" <<'EOF' || cli_ok=0
import sys
import h5py
import numpy as np
gpu, cpu, spec = sys.argv[1:4]
bitwise = not spec.startswith("bn-grad")
bad = []
with h5py.File(gpu, "r") as a, h5py.File(cpu, "r") as b:
    for k in b:
        x, y = np.asarray(a[k][()], np.float32), np.asarray(b[k][()], np.float32)
        same = (x.view(np.uint32) == y.view(np.uint32)) | (np.isnan(x) & np.isnan(y))
        rel = float(np.max(np.abs(x.astype(np.float64) - y)) / max(float(np.max(np.abs(y))), 1e-30)) if y.size else 0.0
        print(f"  {spec}: {k} {int(same.sum())}/{same.size} bit-identical, max rel diff {rel:.1e}")
        if (bitwise and not same.all()) or rel > 1e-5:
            bad.append(k)
sys.exit(1 if bad else 0)
EOF
    else
        echo "  $spec: a qgcli run failed"
        cli_ok=0
    fi
done
rm -rf "$TMPD"
record "CLI --device $DEVICE vs cpu" "$([[ $cli_ok == 1 ]] && echo passed || echo FAILED)"

step "benchmarks/bench_gpu.py (1 GiB tensors)"
timeout 240 "$PY" benchmarks/bench_gpu.py --out "$OUT"
rc=$?
record "bench_gpu.py" "$([[ $rc == 0 ]] && echo "ran; exactness passed" || echo "FAILED or inexact (exit $rc)")"

step "summary"
{
    echo "gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(( $(date +%s) - T0 )) s"
    for s in "${STATUS[@]}"; do echo "$s"; done
} | tee "$OUT/summary.txt"
for s in "${STATUS[@]}"; do
    [[ $s == *FAILED* || $s == *"pip failed"* ]] && return 1
done
return 0
}

# A pipe, not exec > >(tee): the log is complete when the script returns.
main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
