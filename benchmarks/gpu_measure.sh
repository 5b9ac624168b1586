#!/usr/bin/env bash
# Measure specdec on a CUDA machine, offline: build llama-cpp-python with CUDA from its
# source distribution into a prefix, run specdec from this checkout, build the benchmark
# pairs and run `specdec bench` on them. What benchmarks/README.md's section "On a GPU"
# was measured with.
#
#   benchmarks/gpu_measure.sh [STAGE ...]        # from the repository root
#
# Stages, in order (default: all of them): build info stories qwen2 cpu curve trees
#   build    llama-cpp-python from $SDIST into $SITE with -DGGML_CUDA=on (skipped when
#            $SITE already imports a CUDA build), plus the wheels in $ASSETS/whl
#   info     specdec --version, --list-devices, info; nvidia-smi
#   stories  make_wide_target.py, then bench -k $KS --tree off,auto (all on GPU)
#   qwen2    make_vocab_pair.py on the Qwen2 vocabulary, then the same bench
#   cpu      the stories pair with -ngl 0 -ngld 0 against the default (full offload)
#   curve    each target's cost of decoding n tokens with logits for all, three ways:
#            the same n over and over ("steady"), the 1st, 2nd and 3rd pass of n right
#            after one-token passes (bench's cost measurement timed the 2nd before
#            commit 4a65cae, which is where llama.cpp's CUDA backend captures a CUDA
#            graph, and the 3rd since), and
#            costmodel.measure_costs itself. On 2026-11-25 (H100) this stage died
#            with a segmentation fault before its first line of output, cause not
#            found; the other stages ran
#   trees    fixed trees against chains: bench -k 4 --tree off,8,16 on both pairs
#
# Environment (defaults in brackets):
#   SDIST     llama-cpp-python 0.3.36 sdist [$ASSETS/llama_cpp_python-0.3.36.tar.gz]
#   ASSETS    folder with stories260K.gguf, ggml-vocab-qwen2.gguf, whl/ (diskcache,
#             platformdirs, gguf wheels, installed first) and whl_fallback/ (typer,
#             huggingface_hub and what they need, installed only if specdec does not
#             start with what the Python already has) [.gpu]
#   SITE      prefix for the build and the wheels (added to PYTHONPATH) [/tmp/site]
#   OUT       where logs and --json files go [./gpu-out]
#   CUDA_ARCH CMAKE_CUDA_ARCHITECTURES [90]
#   BUDGET    seconds this invocation may take; a stage that cannot finish is cut by
#             `timeout` [570]
#   N, REPEAT tokens per generation and repeats of the prompt set for the benches [128, 3]
#   KS        the -k list of the stories and qwen2 benches [1,2,4,8,auto]
# To measure a commit while the working tree changes: git archive COMMIT specdec_cli
# benchmarks tests/ggufgen.py into .gpu/tree, copy this script and gpu_budget.sh in, cd
# there and set ASSETS to the checkout's .gpu (make_wide_target.py imports tests/ggufgen.py).
# The machine needs nvcc (CUDA toolkit), cmake, ninja, scikit-build-core, numpy, typer,
# rich, psutil, huggingface-hub, jinja2 in the python3 on PATH; no network.
set -uo pipefail

ASSETS=${ASSETS:-.gpu}
SDIST=${SDIST:-$ASSETS/llama_cpp_python-0.3.36.tar.gz}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-./gpu-out}
CUDA_ARCH=${CUDA_ARCH:-90}
BUDGET=${BUDGET:-570}
N=${N:-128}
REPEAT=${REPEAT:-3}
KS=${KS:-1,2,4,8,auto}
STAGES=${*:-build info stories qwen2 cpu curve trees}

. "$(dirname "${BASH_SOURCE[0]}")/gpu_budget.sh"
mkdir -p "$OUT" "$SITE"
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/specdec-xdg-cache}  # costs measured afresh
PY=${PY:-python3}
SPECDEC="$PY -m specdec_cli"
TARGET=benchmarks/out/wide-target-q8_0.gguf
DRAFT=$ASSETS/stories260K.gguf
QT=benchmarks/out/qwen2-target-q8_0.gguf
QD=benchmarks/out/qwen2-draft-q8_0.gguf

stage_build() {
    if ls "$SITE"/llama_cpp/lib/libggml-cuda* >/dev/null 2>&1; then
        say "llama-cpp-python already in $SITE"
    else
        say "pip install wheels from $ASSETS/whl"
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ASSETS"/whl/*.whl || return 1
        say "nvcc: $(command -v nvcc) $(nvcc --version | tail -1)"
        say "building llama-cpp-python from $SDIST (CUDA arch $CUDA_ARCH); log in $OUT/build.log"
        export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DLLAVA_BUILD=off"
        export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
        guarded $PY -m pip install -v --no-index --no-deps --no-build-isolation \
            --target "$SITE" "$SDIST" >"$OUT/build.log" 2>&1
        local rc=$?
        if ((rc != 0)); then tail -40 "$OUT/build.log"; say "build failed ($rc)"; return 1; fi
        say "built"
    fi
    $PY -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, llama_cpp.__file__)" || return 1
    if ! $SPECDEC --version; then
        say "specdec does not start with this Python's packages; adding $ASSETS/whl_fallback"
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$ASSETS"/whl_fallback/*.whl || return 1
        $SPECDEC --version || return 1
    fi
}

stage_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $SPECDEC --version
    $SPECDEC --list-devices
    $SPECDEC info
    $PY -m pip list 2>/dev/null | grep -iE "^(typer|huggingface.hub|numpy|rich|click) "
    nproc
}

stage_stories() {
    [ -f "$TARGET" ] || guarded $PY benchmarks/make_wide_target.py "$DRAFT" || return 1
    guarded $SPECDEC bench -m "$TARGET" -d "$DRAFT" -k "$KS" --tree off,auto \
        -n "$N" --repeat "$REPEAT" --json "$OUT/stories.json"
}

stage_qwen2() {
    [ -f "$QT" ] || guarded $PY benchmarks/make_vocab_pair.py "$ASSETS/ggml-vocab-qwen2.gguf" \
        --out benchmarks/out || return 1
    guarded $SPECDEC bench -m "$QT" -d "$QD" -k "$KS" --tree off,auto \
        -n "$N" --repeat "$REPEAT" --json "$OUT/qwen2.json"
}

stage_cpu() {
    [ -f "$TARGET" ] || guarded $PY benchmarks/make_wide_target.py "$DRAFT" || return 1
    guarded $SPECDEC bench -m "$TARGET" -d "$DRAFT" -k auto -n 64 --repeat 3 \
        -ngl 0 -ngld 0 --json "$OUT/cpu.json"
    guarded $SPECDEC bench -m "$TARGET" -d "$DRAFT" -k auto -n 64 --repeat 3 \
        --json "$OUT/gpu.json"
}

CURVE_PY='
import statistics, sys
from pathlib import Path
from specdec_cli.decoding.costmodel import measure_costs
from specdec_cli.llamacpp.llama import Context, ContextParams, Model, ModelParams, init_backend

init_backend()

SIZES = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 20, 24, 32, 33]
POS, REPS = 64, 15
for path in sys.argv[1:]:
    model = Model(Path(path), ModelParams())
    ctx = Context(model, ContextParams(512, 16, "off", n_seq_max=1))
    tok = max(model.bos, 0)
    ctx.decode([tok] * POS, 0)

    def once(n):
        before = ctx.decode_seconds
        ctx.decode([tok] * n, POS, n_logits=n)
        ctx.rewind(POS)
        return ctx.decode_seconds - before

    def steady(n):
        ts = [once(n) for _ in range(REPS + 3)][3:]
        return statistics.median(ts)

    def paired(n):  # after three one-token passes, three passes of n: each timed
        firsts, seconds, thirds = [], [], []
        for _ in range(REPS):
            once(1); once(1); once(1)
            a, b, c = once(n), once(n), once(n)
            firsts.append(a); seconds.append(b); thirds.append(c)
        return [statistics.median(x) for x in (firsts, seconds, thirds)]

    st = {n: steady(n) for n in SIZES}
    print(f"## {Path(path).name}  (ms; ratio to one token)")
    print("steady   " + " ".join(f"{n}:{st[n]*1e3:.3f}/{st[n]/st[1]:.2f}" for n in SIZES))
    pr = {n: paired(n) for n in SIZES}
    for i, what in enumerate(("1st", "2nd", "3rd")):
        print(f"{what} pass after a shape change " + " ".join(
            f"{n}:{v[i]*1e3:.3f}/{v[i]/pr[1][i]:.2f}" for n, v in pr.items()))
    perf0, sec0 = ctx.perf_seconds(), ctx.decode_seconds
    for _ in range(50):
        once(1)
    print(f"one-token x50: ours {(ctx.decode_seconds-sec0)/50*1e3:.3f} ms, llama.cpp clock {(ctx.perf_seconds()-perf0)/50*1e3:.3f} ms")
    ctx.rewind(0)
    c = measure_costs(ctx, None, range(1, 34), reps=5, position=POS)
    print(f"measure_costs: one token {c.target_seconds*1e3:.3f} ms, switch {c.switch:.3f}, verify "
          + " ".join(f"{n}:{v:.2f}" for n, v in sorted(c.verify.items()) if n in SIZES))
    ctx.close()
'

stage_curve() {
    [ -f "$TARGET" ] || guarded $PY benchmarks/make_wide_target.py "$DRAFT" || return 1
    [ -f "$QT" ] || guarded $PY benchmarks/make_vocab_pair.py "$ASSETS/ggml-vocab-qwen2.gguf" \
        --out benchmarks/out || return 1
    say "\$ python3 -c \"\$CURVE_PY\" $TARGET $QT"
    guarded_quiet $PY -X faulthandler -c "$CURVE_PY" "$TARGET" "$QT" 2>&1 | grep -v "^ggml_cuda_init\|^  Device"
}

stage_trees() {
    [ -f "$TARGET" ] || guarded $PY benchmarks/make_wide_target.py "$DRAFT" || return 1
    guarded $SPECDEC bench -m "$TARGET" -d "$DRAFT" -k 4 --tree off,8,16 \
        -n "$N" --repeat "$REPEAT" --json "$OUT/trees-stories.json"
    [ -f "$QT" ] || return 0
    guarded $SPECDEC bench -m "$QT" -d "$QD" -k 4 --tree off,8,16 \
        -n "$N" --repeat "$REPEAT" --json "$OUT/trees-qwen2.json"
}

for s in $STAGES; do
    say "stage $s"
    "stage_$s" || { say "stage $s failed"; [ "$s" = build ] && exit 1; }
done
say "done"
