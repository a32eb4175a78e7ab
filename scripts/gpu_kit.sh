#!/usr/bin/env bash
# Measure cost curves on an NVIDIA GPU machine that has no network and no models, from a machine
# that has both but no GPU: a CUDA build of llama-cpp-python and the models' headers travel, the
# weights are made there (`gguf_twin.py`: a pass costs what its tensors' shapes and types make it
# cost), and `measure_curve.py` writes one machine file per pair, which `replay_policy.py
# replay --costs` reads.
#
#   bash scripts/gpu_kit.sh build [ARCH]  # here: llama-cpp-python with CUDA for ARCH (default 90, Hopper)
#   bash scripts/gpu_kit.sh pack          # here: KIT/site.tar.xz (that build, gguf, diskcache), KIT/heads.tar.xz
#   bash scripts/gpu_kit.sh measure       # there, from the repository root with KIT beside it: files in $OUT
#
# `measure` writes the curves of the default pair, a 32B-shaped and a 7B-shaped pair, what reading a
# prompt with the draft model beside the target's decoding hides (`measure_overlap.py`), and two live
# runs with the default pair's twins.
#
# `build` needs CUDA's nvcc here (the one the GPU machine's driver runs: 13.x for driver 580) but no
# GPU and no cuBLAS: cuBLAS comes from its PyPI wheel, and the driver library is linked against a
# stand-in (the GPU machine's own is loaded there). The CPU part is built for AVX2, which any x86-64
# GPU server runs. About 30 minutes on 2 cores; the wheel lands in WORK/wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.gpu}                       # what travels (keep it out of git: .git/info/exclude)
WORK=${WORK:-${TMPDIR:-/tmp}/gpu-kit}  # what does not

build() {
    local arch=${1:-90} nvcc cuda_version version
    version=$(python3 -c "import llama_cpp; print(llama_cpp.__version__)")  # the version installed here, as a CUDA build
    nvcc=$(command -v nvcc) || { echo "build: nvcc not found" >&2; exit 1; }
    cuda_version=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
    mkdir -p "$WORK/cublas" "$WORK/stub" "$WORK/wheel"
    local package=nvidia-cublas  # CUDA 13's name; 12.x's carries its major version
    [ "${cuda_version%%.*}" = 12 ] && package=nvidia-cublas-cu12
    python3 -m pip download -q --no-deps -d "$WORK/cublas" "$package==${cuda_version}.*"
    (cd "$WORK/cublas" && python3 -m zipfile -e nvidia_cublas*.whl .)
    local blas; blas=$(dirname "$(find "$WORK/cublas" -name 'libcublas.so.*' | head -1)")
    ln -sf "$blas/libcublas.so."* "$blas/libcublas.so"; ln -sf "$blas/libcublasLt.so."* "$blas/libcublasLt.so"
    # Link-time stand-in for libcuda.so.1: the names ggml-cuda calls in the driver API.
    printf '#define S(f) int f(void) { return 999; }\n%s\n' \
        "S(cuDeviceGet) S(cuDeviceGetAttribute) S(cuGetErrorString) S(cuMemAddressFree) S(cuMemAddressReserve) S(cuMemCreate) S(cuMemGetAllocationGranularity) S(cuMemMap) S(cuMemRelease) S(cuMemSetAccess) S(cuMemUnmap)" \
        > "$WORK/stub/cuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/stub/libcuda.so" "$WORK/stub/cuda.c"
    local cpu="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    for off in AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AVX_VNNI AMX_TILE AMX_INT8 AMX_BF16; do cpu+=" -DGGML_$off=OFF"; done
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$arch -DLLAVA_BUILD=OFF $cpu \
-DCMAKE_CUDA_FLAGS=-I$(dirname "$blas")/include -DCUDA_cublas_LIBRARY=$blas/libcublas.so \
-DCUDA_cublasLt_LIBRARY=$blas/libcublasLt.so -DCUDA_cuda_driver_LIBRARY=$WORK/stub/libcuda.so" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        python3 -m pip wheel --no-deps --no-binary llama-cpp-python --no-cache-dir -w "$WORK/wheel" \
        --config-settings=build-dir="$WORK/build" "llama-cpp-python==$version"
}

pack() {
    local site="$WORK/site" models=${SPECLLM_CACHE:-$HOME/.cache/specllm}/models twin="python3 scripts/gguf_twin.py" model
    local wheels=("$WORK"/wheel/llama_cpp_python-*.whl)
    [ -f "${wheels[0]}" ] || { echo "pack: no llama-cpp-python wheel in $WORK/wheel (made by build)" >&2; exit 1; }
    [ ${#wheels[@]} = 1 ] || { echo "pack: ${#wheels[@]} wheels in $WORK/wheel: keep the one to pack" >&2; exit 1; }
    for model in qwen2.5-coder-1.5b-instruct-q4_k_m qwen2.5-coder-0.5b-instruct-q4_k_m; do
        [ -f "$models/$model.gguf" ] || { echo "pack: no $models/$model.gguf ('specllm pull qwen2.5-coder' fetches the pair)" >&2; exit 1; }
    done
    python3 -c "import diskcache, gguf" 2>/dev/null || { echo "pack: python3 cannot import diskcache and gguf (llama-cpp-python's and specllm's)" >&2; exit 1; }
    rm -rf "$site" "$WORK/heads"; mkdir -p "$site/fallback" "$WORK/heads" "$KIT"
    python3 -m pip install -q --no-deps --no-compile --target "$site" "${wheels[0]}"
    rm -rf "$site/lib" "$site/include" "$site/bin"  # the wheel's second copy of the libraries
    for lib in "$site"/llama_cpp/lib/*.so; do rm -f "$lib".0.* "$lib"; ln -s "$(basename "$lib").0" "$lib"; done  # one copy each
    python3 - "$site" <<'EOF'
import os, shutil, sys
import diskcache, gguf
for module in (diskcache, gguf):
    shutil.copytree(os.path.dirname(module.__file__), os.path.join(sys.argv[1], module.__name__), ignore=shutil.ignore_patterns("__pycache__"))
EOF
    cp "$(gcc -print-file-name=libgomp.so.1)" "$site/fallback/"  # llama.cpp's OpenMP, if the image lacks it
    tar -C "$site" -cf - . | xz -T0 > "$KIT/site.tar.xz"
    $twin header "$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" "$WORK/heads/q15"
    $twin header "$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" "$WORK/heads/q05"
    $twin resize "$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" "$WORK/heads/q7" --layers 28 --embd 3584 --ffn 18944 --heads 28 --kv-heads 4
    $twin resize "$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" "$WORK/heads/q32" --layers 64 --embd 5120 --ffn 27648 --heads 40 --kv-heads 8
    tar -C "$WORK/heads" -cJf "$KIT/heads.tar.xz" .
    du -sh "$KIT"/*.tar.xz
}

measure() {
    set +eo pipefail  # one pair failing leaves the others to measure
    OUT=${OUT:-$WORK/out}; mkdir -p "$OUT"
    local log=$OUT/times.txt site=$WORK/site heads=$WORK/heads models=$WORK/models t0=$SECONDS
    say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
    local part
    for part in site heads; do
        [ -f "$KIT/$part.tar.xz" ] || { echo "measure: no $KIT/$part.tar.xz (made by build and pack, on a machine with nvcc)" >&2; exit 1; }
    done
    [ -d $site/llama_cpp ] || { mkdir -p $site && tar -xJf "$KIT/site.tar.xz" -C $site; }
    mkdir -p $heads $models && tar -xJf "$KIT/heads.tar.xz" -C $heads
    local blas; blas=$(find /usr/local /opt /usr/lib -name 'libcublas.so.1*' 2>/dev/null | head -1)
    export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 SPECLLM_CACHE=$WORK/cache HF_HUB_OFFLINE=1
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${blas:+$(dirname "$blas"):}${LD_LIBRARY_PATH:-}:$site/fallback
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$log" 2>&1 || true
    python3 -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 3)" >> "$log" 2>&1
    case $? in
        0) ;;
        3) say "measure: this build does not offload here (no GPU, or the driver's libcuda.so.1 not found; see $log)" >&2
           ldd $site/llama_cpp/lib/libggml-cuda.so.0 >> "$log" 2>&1; exit 1 ;;
        *) say "measure: python3 cannot import llama_cpp from $site (its error and ldd's in $log)" >&2
           ldd $site/llama_cpp/lib/libggml-cuda.so.0 >> "$log" 2>&1; exit 1 ;;
    esac
    local gpu stack="llama-cpp-python $(python3 -c 'import llama_cpp; print(llama_cpp.__version__)'), CUDA build, every layer offloaded"
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    twin() {  # expand writes beside the file and renames it when whole: one standing here is whole
        [ -f $models/$1.gguf ] || python3 scripts/gguf_twin.py expand $heads/$1 $models/$1.gguf >> "$log" 2>&1
        if [ -f $models/$1.gguf ]; then say "twin $1 written"; else say "twin $1 NOT written (see $log)"; fi
    }
    curve() {  # TARGET FILE WHAT [SECONDS]
        timeout "${4:-240}" python3 scripts/measure_curve.py $models/$1.gguf $models/q05.gguf --machine "$gpu: $3; $stack" \
            > "$OUT/$2.json" 2>> "$OUT/errors.txt"
        say "measured $2: exit $?"
    }
    overlap() {  # TARGET PROMPT: the draft's prompt reading beside the target's decoding
        echo "== $1, a prompt of $2 tokens" >> "$OUT/overlap.txt"
        timeout 120 python3 scripts/measure_overlap.py $models/$1.gguf $models/q05.gguf --prompt $2 --rounds 5 \
            >> "$OUT/overlap.txt" 2>> "$OUT/errors.txt"
        say "overlap $1: exit $?"
    }
    twin q05; twin q15
    curve q15 gpu-default-pair "twins of the default pair (Qwen2.5-Coder 1.5B target, 0.5B draft, Q4_K_M)"
    twin q32
    curve q32 gpu-32b-shaped-pair "a 32B-shaped twin target (Qwen2.5 32B shapes, Q4_K_M's types) with the 0.5B twin" 300
    overlap q32 3300; overlap q15 2048
    twin q7
    curve q7 gpu-7b-shaped-pair "a 7B-shaped twin target (Qwen2.5 7B shapes, Q4_K_M's types) with the 0.5B twin"
    # The engine's own loop around those passes (twin weights: the text means nothing, its timing does).
    for spec in off auto; do
        timeout 120 python3 -m specllm run -m $models/q15.gguf --draft $models/q05.gguf --spec $spec -n 128 --temp 0 --json \
            -p "Write a Python function that parses a CSV file and returns its rows as dictionaries." \
            > "$OUT/live-$spec.json" 2>> "$OUT/errors.txt"
        say "live $spec: exit $?"
    done
}

case ${1:-} in
    build) build "${2:-90}" ;;
    pack) pack ;;
    measure) measure ;;
    *) sed -n '2,/^[^#]/{/^#/p}' "$0" >&2; exit 2 ;;
esac
