#!/usr/bin/env bash
# Time the qgcli CLI end to end (load HDF5, compute, save HDF5) against TensorFlow doing the same, and
# time qgcli's start-up against a bare Python.
#
#   benchmarks/bench_cli.sh [--tf-python PATH] [--repeats N] [--startup-repeats N] [--size big|small]
#
# 1. Writes HDF5 bundles of the seeded tensors of benchmarks/bench_ops.py (default: the big
#    (32, 56, 56, 256) float32 NHWC shape): per-channel and per-tensor fake-quant (inputs, gradients, min,
#    max) and batch norm (y_backprop, x, scale, reserve_space_1/2).
# 2. Wall time, median of --repeats (5) rounds, and peak RSS of `qgcli fakequant-grad BUNDLE.h5 -o OUT.h5`
#    (both bundles) and `qgcli bn-grad BUNDLE.h5 -o OUT.h5 --epsilon 1e-3`, each against its I/O floor
#    (benchmarks/io_floor.py: the same datasets read, an output as large written, fsynced, renamed) and
#    benchmarks/tf_load_op_save.py under --tf-python (default /tmp/tfvenv/bin/python when it exists;
#    skipped otherwise): qgcli and the floor alternated in each round (benchmarks/paired.py), TensorFlow in
#    rounds of its own afterwards (its runs disturbed the pairs they shared a round with).  The TF figure
#    includes importing TensorFlow, as qgcli's includes its imports; the TF import alone is timed too.
#    The outputs of qgcli and TF are compared afterwards.
# 3. Start-up, median of --startup-repeats (10): `qgcli --help` and `qgcli fakequant-grad --help` against
#    `python -c pass` with the interpreter qgcli's entry point runs (goal: within 150 ms).
#
# Environment: QGCLI (the qgcli executable; default: the real console script behind any pyenv shim),
# TMPDIR (where the ~0.6 GB of bundles go; removed at the end).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TF_PY=""
[[ -x /tmp/tfvenv/bin/python ]] && TF_PY=/tmp/tfvenv/bin/python
REPEATS=5
STARTUP_REPEATS=10
SIZE=big
while [[ $# -gt 0 ]]; do
    case "$1" in
        --tf-python) TF_PY="$2"; shift 2 ;;
        --no-tf) TF_PY=""; shift ;;
        --repeats) REPEATS="$2"; shift 2 ;;
        --startup-repeats) STARTUP_REPEATS="$2"; shift 2 ;;
        --size) SIZE="$2"; shift 2 ;;
        -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench_cli.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done

# The real console script: a pyenv shim costs tens of ms of bash before Python even starts.
SHIM=""
if [[ -z "${QGCLI:-}" ]]; then
    QGCLI=$(command -v qgcli || true)
    if [[ -n "$QGCLI" ]] && command -v pyenv >/dev/null && [[ "$QGCLI" == *"/shims/"* ]]; then
        SHIM=$QGCLI
        QGCLI=$(pyenv which qgcli)
    fi
fi
if [[ -z "$QGCLI" ]]; then
    echo "bench_cli.sh: qgcli is not installed (pip install -e . first)" >&2
    exit 2
fi
PY=$(head -1 "$QGCLI" | sed -n 's/^#! *//p' | cut -d' ' -f1)
[[ -x "$PY" ]] || PY=$(command -v python3)
if [[ -n "$TF_PY" && ! -x "$TF_PY" ]]; then
    echo "note: --tf-python $TF_PY is not executable; TensorFlow skipped" >&2
    TF_PY=""
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/qgcli_bench_cli.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

now_us() { echo $(( $(date +%s%N) / 1000 )); }

# median_ms N CLEAN CMD...: median wall time in ms (one decimal) of N runs of CMD; CLEAN (a path or "")
# is removed before each run, outside the timing.  Exits the script with the command's stderr on failure.
median_ms() {
    local n=$1 clean=$2 i t0 t1
    shift 2
    local times=()
    for ((i = 0; i < n; i++)); do
        [[ -n "$clean" ]] && rm -f "$clean"
        t0=$(now_us)
        if ! "$@" >/dev/null 2>"$WORK/stderr"; then
            echo "FAILED: $*" >&2
            cat "$WORK/stderr" >&2
            return 1
        fi
        t1=$(now_us)
        times+=($((t1 - t0)))
    done
    printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR] = $1} END {m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%.1f\n", m / 1000}'
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }

echo "# bench_cli.sh: $(date '+%Y-%m-%d %H:%M:%S'), $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# qgcli: $QGCLI (python $PY, qgcli $("$PY" -c 'import qgcli; print(qgcli.__version__)'))"
[[ -n "$TF_PY" ]] && echo "# TensorFlow: $TF_PY ($("$TF_PY" -c 'import os; os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"; import tensorflow as tf; print(tf.__version__)' 2>/dev/null))"

"$PY" - "$WORK" "$SIZE" "$ROOT" <<'EOF'
import os, sys
import h5py
import numpy as np
work, size, root = sys.argv[1:4]
sys.path.insert(0, os.path.join(root, "benchmarks"))
from bench_ops import SIZES, make_arrays
d = make_arrays(size)
with h5py.File(os.path.join(work, "per_channel.h5"), "w") as f:
    f["inputs"], f["gradients"], f["min"], f["max"] = d["x"], d["g"], d["pc_min"], d["pc_max"]
with h5py.File(os.path.join(work, "per_tensor.h5"), "w") as f:
    f["inputs"], f["gradients"] = d["x"], d["g"]
    f["min"], f["max"] = np.float32(-6.0), np.float32(6.0)
with h5py.File(os.path.join(work, "bn.h5"), "w") as f:
    f["y_backprop"], f["x"], f["scale"] = d["g"], d["x"], d["bn_scale"]
    f["reserve_space_1"], f["reserve_space_2"] = d["bn_mean"], d["bn_var"]
shape = SIZES[size]
print(f"# bundles: float32 NHWC {shape} ({np.prod(shape) * 4 / 1e6:.1f} MB per tensor), two full-size tensors each")
EOF

# End-to-end runs see the bytecode cached, as an installed qgcli does (PYTHONDONTWRITEBYTECODE would make
# every run compile qgcli's modules again); the floor script runs under the same interpreter and settings.
CACHED=(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$WORK/pycache")
echo
echo "## End to end (HDF5 in, HDF5 out) against the I/O floor, seconds, median of $REPEATS rounds"
echo
echo "Each round runs qgcli and benchmarks/io_floor.py (the same datasets read with h5py, an output as large"
echo "plus the small ones written to a temporary file, fsynced, renamed) one after the other, so that a passing"
echo "load weighs on both alike$( [[ -n "$TF_PY" ]] && echo "; TensorFlow runs in rounds of its own after them").  Peak RSS: the largest of the runs; in + out: the"
echo "bytes of the tensors read and written (goals: qgcli/floor <= 1.3, qgcli RSS <= in + out + 64 MB)."
echo
printf '| %-36s | %8s | %8s | %11s | %12s | %12s | %11s |%s\n' "command" "qgcli s" "floor s" "qgcli/floor" \
    "qgcli RSS MB" "floor RSS MB" "in + out MB" "$( [[ -n "$TF_PY" ]] && printf ' %8s | %8s |' "TF s" "qgcli/TF")"
printf '|%s|%s|%s|%s|%s|%s|%s|%s\n' "$(printf -- '-%.0s' {1..38})" "----------" "----------" "-------------" \
    "--------------" "--------------" "-------------" "$( [[ -n "$TF_PY" ]] && echo '----------|----------|')"
tensor_mb() {  # bundle, output, the bundle's large inputs (a,b): MB of those inputs plus every output
    "$PY" - "$1" "$2" "$3" <<'EOF'
import sys
import h5py
size = 0
for path, names in ((sys.argv[1], sys.argv[3].split(",")), (sys.argv[2], None)):
    with h5py.File(path, "r") as fh:
        size += sum(fh[n].size * fh[n].dtype.itemsize for n in (names or list(fh)))
print(f"{size / 1e6:.0f}")
EOF
}
run_case() {  # label, bundle, floor options, "--", qgcli args..., "--", tf args...
    local label=$1 bundle=$2 floor_opts=$3 q f t qr fr t_cell="" c
    shift 4
    local qargs=() targs=() cmds=() lines=()
    while [[ $1 != "--" ]]; do qargs+=("$1"); shift; done
    shift
    targs=("$@")
    cmds=("$(printf '%q ' "${CACHED[@]}" "$QGCLI" "${qargs[@]}" -o "$WORK/out.h5" --force -q)"
          "$(printf '%q ' "${CACHED[@]}" "$PY" "$ROOT/benchmarks/io_floor.py" "$bundle" "$WORK/out_floor.h5") $floor_opts")
    local tf_cmd="$(printf '%q ' "$TF_PY" "$ROOT/benchmarks/tf_load_op_save.py" "${targs[@]}" "$WORK/out_tf.h5")"
    for c in "${cmds[@]}"; do bash -c "$c" >/dev/null 2>&1 || true; done  # warm-up: page cache, bytecode
    mapfile -t lines < <("$PY" "$ROOT/benchmarks/paired.py" "$REPEATS" "${cmds[@]}")
    [[ ${#lines[@]} -ge 2 ]] || { echo "bench_cli.sh: $label failed" >&2; return 1; }
    read -r q qr <<<"${lines[0]}"
    read -r f fr <<<"${lines[1]}"
    if [[ -n "$TF_PY" ]]; then
        # Timed in rounds of its own, after the pairs: each TensorFlow run leaves gigabytes of memory for the
        # kernel to reclaim, which disturbed the qgcli and floor runs of the rounds it shared.
        bash -c "$tf_cmd" >/dev/null 2>&1 || true
        read -r t _ < <("$PY" "$ROOT/benchmarks/paired.py" "$REPEATS" "$tf_cmd")
        t_cell=$(printf ' %8s | %8s |' "$t" "$(ratio "$q" "$t")")
    fi
    printf '| %-36s | %8s | %8s | %11s | %12s | %12s | %11s |%s\n' "$label" "$q" "$f" "$(ratio "$q" "$f")" "$qr" "$fr" \
        "$(tensor_mb "$bundle" "$WORK/out.h5" "$(sed 's/--read \([^ ]*\).*/\1/' <<<"$floor_opts")")" "$t_cell"
    [[ -n "$TF_PY" ]] && "$PY" - "$WORK/out.h5" "$WORK/out_tf.h5" >>"$WORK/checks" <<'EOF'
import sys
import h5py
import numpy as np
with h5py.File(sys.argv[1], "r") as a, h5py.File(sys.argv[2], "r") as b:
    parts = []
    for k in b:
        x, y = np.asarray(a[k][()], np.float32), np.asarray(b[k][()], np.float32)
        same = int(np.count_nonzero(x.view(np.uint32) == y.view(np.uint32)))
        rel = float(np.max(np.abs(x.astype(np.float64) - y)) / max(float(np.max(np.abs(y))), 1e-30))
        parts.append(f"{k} {same}/{y.size} bit-identical (max rel diff {rel:.1e})")
    print("; ".join(parts))
EOF
    [[ -n "$TF_PY" ]] && sed -i "\$s/^/  $label: /" "$WORK/checks"
    return 0
}
PC_FLOOR="--read inputs,gradients --big backprops_wrt_input --small backprop_wrt_min,backprop_wrt_max"
PT_FLOOR="--read inputs,gradients --big backprops_wrt_input --scalars backprop_wrt_min,backprop_wrt_max"
BN_FLOOR="--read y_backprop,x --big x_backprop --small scale_backprop,offset_backprop"
run_case "fakequant-grad per-channel bundle" "$WORK/per_channel.h5" "$PC_FLOOR" -- \
    fakequant-grad "$WORK/per_channel.h5" -- fakequant-grad "$WORK/per_channel.h5"
run_case "fakequant-grad per-tensor bundle" "$WORK/per_tensor.h5" "$PT_FLOOR" -- \
    fakequant-grad "$WORK/per_tensor.h5" -- fakequant-grad "$WORK/per_tensor.h5"
run_case "bn-grad (training, NHWC, eps 1e-3)" "$WORK/bn.h5" "$BN_FLOOR" -- \
    bn-grad "$WORK/bn.h5" --epsilon 1e-3 -- bn-grad "$WORK/bn.h5" --epsilon 1e-3
if [[ -n "$TF_PY" ]]; then
    ti=$(median_ms "$REPEATS" "" "$TF_PY" -c 'import os; os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"; import tensorflow, h5py')
    echo
    echo "TF figures include 'import tensorflow, h5py': $ti ms alone (median of $REPEATS)."
    echo "Outputs, qgcli vs TF:"
    cat "$WORK/checks"
fi

echo
echo "## Start-up, ms, median of $STARTUP_REPEATS"
echo
verdict() { awk -v d="$1" 'BEGIN { print (d <= 150) ? "within 150 ms" : "OVER 150 ms" }'; }
minus() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", a - b }'; }
printf '| %-28s | %-32s | %8s | %16s | %-14s |\n' "bytecode" "command" "ms" "- python -c pass" "goal"
printf '|%s|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..30})" "$(printf -- '-%.0s' {1..34})" "----------" "------------------" "----------------"
# A pip install compiles .pyc files; with PYTHONDONTWRITEBYTECODE set (as in some sandboxes) every start
# compiles qgcli's command modules again.  Both are measured: cached bytecode in a private prefix (what
# an installed qgcli sees) and none at all.
startup() {  # label, then env assignments for the interpreter
    local label=$1 base h1 h2 d1 d2
    shift
    env "$@" "$PY" -c pass; env "$@" "$QGCLI" --help >/dev/null; env "$@" "$QGCLI" fakequant-grad --help >/dev/null
    base=$(median_ms "$STARTUP_REPEATS" "" env "$@" "$PY" -c pass)
    h1=$(median_ms "$STARTUP_REPEATS" "" env "$@" "$QGCLI" --help)
    h2=$(median_ms "$STARTUP_REPEATS" "" env "$@" "$QGCLI" fakequant-grad --help)
    d1=$(minus "$h1" "$base")
    d2=$(minus "$h2" "$base")
    printf '| %-28s | %-32s | %8s | %16s | %-14s |\n' "$label" "python -c pass" "$base" "" ""
    printf '| %-28s | %-32s | %8s | %16s | %-14s |\n' "$label" "qgcli --help" "$h1" "$d1" "$(verdict "$d1")"
    printf '| %-28s | %-32s | %8s | %16s | %-14s |\n' "$label" "qgcli fakequant-grad --help" "$h2" "$d2" "$(verdict "$d2")"
}
startup "cached (as installed)" -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$WORK/pycache"
startup "none (compiled every start)" PYTHONDONTWRITEBYTECODE=1
if [[ -n "$SHIM" ]]; then
    hs=$(median_ms "$STARTUP_REPEATS" "" env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$WORK/pycache" "$SHIM" --help)
    echo
    echo "Through the pyenv shim $SHIM, 'qgcli --help' takes $hs ms (bytecode cached; the shim's bash adds the rest)."
fi
