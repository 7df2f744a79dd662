#!/usr/bin/env bash
# Every figure docs/benchmarks.md states per CPU class, measured on this machine in one run: what a class
# with no figures yet (`avx2`: AVX2-only; `avx512`: AVX512 without bf16) needs, in the commands
# bench/RESULTS.md records. Run it from the checkout, nothing else of yours running (the machine's other
# tenants are named by the load average each log starts with):
#
#   bash bench/vllm_cpu_env.sh; bash bench/llamacpp_env.sh      # the peers, once (vLLM's first start ~4 min)
#   bash bench/class_figures.sh [OUT]                            # default runs/class-figures/<class>
#   PARTS="peers demo" bash bench/class_figures.sh               # some parts: copy peers transformers demo grpo
#
# Each part writes OUT/<part>.log, headed by the CPU class and the load average; about 90 minutes on 2
# cores for all of them. As run on a wider CPU under `python -m pagedrl.kernels.isa run avx2 --` (the
# peers' probes capped too; LLAMA_CPP_DIR naming a llama.cpp built by `LLAMA_CPP_ISA=avx2 bash
# bench/llamacpp_env.sh DIR`), it measures that CPU's memory and caches, not an AVX2-only CPU's.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
class=$($py -c "from pagedrl.kernels import isa; print(isa.cpu_class())")
out="${1:-runs/class-figures/$class}"
parts="${PARTS:-copy peers transformers demo grpo}"
for part in $parts; do
  case "$part" in copy|peers|transformers|demo|grpo) ;;
    *) echo "unknown part '$part' (parts: copy peers transformers demo grpo)" >&2; exit 2 ;; esac
done
mkdir -p "$out"

head_log() {  # the class, the CPU and the load, above each part's figures
  { echo "# $1 ($(date -u +%FT%TZ))"; $py -m pagedrl.kernels.isa; grep -m1 'model name' /proc/cpuinfo || true
    echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"; echo; } > "$out/$1.log"
}

for part in $parts; do
  head_log "$part"
  case "$part" in
    copy)  # the memory copy bandwidth a single stream is held against, and the projections' GB/s
      $py bench/bench_float_linear.py --rows 1,64 --threads 2 --rounds 3 >> "$out/copy.log" 2>&1 ;;
    peers)  # float32 against vLLM's float32; GGUF kept quantized against llama.cpp; pagedrl's own float32
      $py bench/bench_vllm_cpu.py --sides vllm-float32,pagedrl-float32,vllm-bf16 --rounds 2 --threads 2 \
        --log "$out/vllm-workers.log" >> "$out/peers.log" 2>&1
      $py bench/bench_vllm_cpu.py --sides pagedrl-q4_1-a8,llamacpp-q4_1,pagedrl-q8_0-a8,llamacpp-q8_0,pagedrl-float32 \
        --workloads single,64x128 --rounds 2 --threads 1 --log "$out/llamacpp-workers.log" >> "$out/peers.log" 2>&1 ;;
    transformers)  # transformers' static batches, 64 requests at half scale, one thread
      $py bench/bench_engine.py --num-requests 64 --scale 0.5 --parts throughput --dtypes float32 --threads 1 \
        --no-fit >> "$out/transformers.log" 2>&1 ;;
    demo)  # the quick demo's minutes and verdicts, seeds 0 and 1
      for seed in 0 1; do
        /usr/bin/time -f "seed $seed: %e s" .venv/bin/pagedrl demo --quick --seed "$seed" \
          --output-dir "$out/demo-seed$seed" 2>&1 | tr '\r' '\n' | { grep -v 'demo \[' || true; } >> "$out/demo.log"
      done ;;
    grpo)  # the GRPO example: held-out accuracy at every second step against training minutes
      .venv/bin/pagedrl grpo examples/grpo_arithmetic.yaml eval_steps=2 seed=0 max_steps=14 \
        output_dir="$out/grpo" >> "$out/grpo.log" 2>&1 ;;
  esac
  echo "$part: $out/$part.log"
done
