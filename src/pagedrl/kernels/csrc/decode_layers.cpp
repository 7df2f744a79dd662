// A decode step's decoder layers in one call (`decode_layers`): what `engine/cpu_decode.py`'s
// program runs from Python, op for op, in the same order, on the same tensors: so the same bits.
//
// Why: a layer is some 16 op calls (two norms, the products, the rotary, the cache write, the attention,
// views and two adds), each 2-6 us of Python and of the dispatcher's boxing around kernels that, at one
// row, take a few microseconds themselves. In a single stream's Q8_0 step (8-bit activations, one
// thread, AVX2) that was about 40% of the program's time. Here each op is called through its typed
// handle (no boxing, no Python), looked up once.
//
// The projections' kernels are chosen per projection by the caller (`kinds`), as the program chooses them
// (a float32 weight's by the step's row count, `float_product`; a bf16 one's k-pairs copy); a layer's q, k
// and v (its gate and up) on 8-bit activations go in one `gguf_linear_int8_many` call, and a bf16 layer's
// gate and up in one `pair_silu_mul` where the program fuses them, as the program makes them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using Tensor = at::Tensor;
using Bias = c10::optional<Tensor>;
using Biases = c10::List<c10::optional<Tensor>>;

// How a projection is computed (the caller's choice, `cpu_decode.Kind`).
enum Kind : int64_t {
  kFloatLinear = 0,  // `float_linear` (a float32 weight, a few rows)
  kFloatGemm = 1,    // `float_gemm` (a float32 weight, up to a prefill chunk's rows)
  kTorchLinear = 2,  // `at::linear` (MKL's, above)
  kInt8 = 3,         // `gguf_linear_int8` (GGUF blocks, 8-bit activations)
  kGGUF = 4,         // `gguf_linear` (GGUF blocks, float32 activations, a few rows)
  kPairs = 5,        // `pair_linear` (a bf16 weight's k-pairs copy; its type entry: the output features)
  kGateUp = 6,       // gate and up: `pair_silu_mul` of the gate entry's interleaved copy (bf16)
};

constexpr int kProjections = 7;  // q, k, v, o, gate, up, down

template <class F>
c10::TypedOperatorHandle<F> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      handle<Tensor(const Tensor&, const Tensor&, double)>("pagedrl_cpu::rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)> silu_mul =
      handle<Tensor(const Tensor&, const Tensor&)>("pagedrl_cpu::silu_mul");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>
      rope = handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
          "pagedrl_cpu::rope");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)> store_kv =
      handle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("pagedrl_cpu::store_kv");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, const Tensor&, double, bool, int64_t, double,
                                                      const c10::optional<Tensor>&)>
      attention = handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const Tensor&, double, bool, int64_t, double,
                                                    const c10::optional<Tensor>&)>("pagedrl_cpu::paged_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Bias&)> float_linear =
      handle<Tensor(const Tensor&, const Tensor&, const Bias&)>("pagedrl_cpu::float_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Bias&)> float_gemm =
      handle<Tensor(const Tensor&, const Tensor&, const Bias&)>("pagedrl_cpu::float_gemm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Bias&)> int8 =
      handle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Bias&)>("pagedrl_cpu::gguf_linear_int8");
  c10::TypedOperatorHandle<std::vector<Tensor>(const Tensor&, at::TensorList, at::IntArrayRef, int64_t, const Biases&)>
      int8_many = handle<std::vector<Tensor>(const Tensor&, at::TensorList, at::IntArrayRef, int64_t, const Biases&)>(
          "pagedrl_cpu::gguf_linear_int8_many");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Bias&)> gguf =
      handle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Bias&)>("pagedrl_cpu::gguf_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, const Bias&)> pairs =
      handle<Tensor(const Tensor&, const Tensor&, int64_t, const Bias&)>("pagedrl_cpu::pair_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)> pair_silu_mul =
      handle<Tensor(const Tensor&, const Tensor&)>("pagedrl_cpu::pair_silu_mul");
};

const Ops& ops() {
  static const Ops instance;  // the handles, looked up on first use (every op is registered by then)
  return instance;
}

// The layer's arguments for projection p (0-6), as the program's `float_product` passes them.
struct Layer {
  at::TensorList weights;
  const Biases& biases;
  at::IntArrayRef kinds, types;
  int64_t first;  // index of the layer's q in the flat lists

  Tensor product(int p, const Tensor& x) const {
    const int64_t at = first + p;
    const Bias bias = biases.get(at);
    const Tensor& w = weights[at];
    switch (kinds[at]) {
      case kFloatLinear: return ops().float_linear.call(x, w, bias);
      case kFloatGemm: return ops().float_gemm.call(x, w, bias);
      case kTorchLinear: return at::linear(x, w, bias);
      case kInt8: return ops().int8.call(x, w, types[at], x.size(1), bias);
      case kGGUF: return ops().gguf.call(x, w, types[at], x.size(1), bias);
      case kPairs: return ops().pairs.call(x, w, types[at], bias);
      default: TORCH_CHECK(false, "decode_layers: projection ", at, " has kind ", kinds[at],
                            ", not one product's (0-5; 6, gate and up together, only at a layer's gate)");
    }
  }

  bool int8(int p) const { return kinds[first + p] == kInt8; }

  // Projections [p, p + count) of one input: one `gguf_linear_int8_many` call where all are on 8-bit
  // activations (the program's `shared_input`), else one product each.
  std::vector<Tensor> shared(int p, int count, const Tensor& x) const {
    bool all = true;
    for (int i = 0; i < count; ++i) all = all && int8(p + i);
    if (!all) {
      std::vector<Tensor> out;
      for (int i = 0; i < count; ++i) out.push_back(product(p + i, x));
      return out;
    }
    Biases biases_of;
    for (int i = 0; i < count; ++i) biases_of.push_back(biases.get(first + p + i));
    return ops().int8_many.call(x, weights.slice(first + p, count), types.slice(first + p, count), x.size(1),
                                biases_of);
  }
};

// x [n, hidden] (the step's embedded tokens) through every layer; then the final norm. Per layer, in the
// flat lists: norms[2 l], norms[2 l + 1] (input and post-attention), and norms[2 L] the final one;
// qk_norms[2 l], [2 l + 1] (q and k, or none); weights, biases, kinds and types[7 l + p] for q, k, v, o,
// gate, up and down; windows[l] (0: none).
Tensor decode_layers(const Tensor& x0, const Tensor& cos, const Tensor& sin, at::TensorList norms,
                     const Biases& qk_norms, at::TensorList weights, const Biases& biases, at::IntArrayRef kinds,
                     at::IntArrayRef types, at::TensorList key_caches, at::TensorList value_caches,
                     const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens, double scale,
                     at::IntArrayRef windows, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == layers && static_cast<int64_t>(windows.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers + 1 &&
                  static_cast<int64_t>(qk_norms.size()) == 2 * layers &&
                  static_cast<int64_t>(weights.size()) == kProjections * layers &&
                  static_cast<int64_t>(biases.size()) == kProjections * layers &&
                  static_cast<int64_t>(kinds.size()) == kProjections * layers &&
                  static_cast<int64_t>(types.size()) == kProjections * layers,
              "decode_layers: ", layers, " layers' caches, ", windows.size(), " windows, ", norms.size(), " norms, ",
              qk_norms.size(), " q/k norms, ", weights.size(), " weights, ", biases.size(), " biases, ", kinds.size(),
              " kinds, ", types.size(), " types");
  const Ops& op = ops();
  const int64_t n = x0.size(0);
  const Tensor no_rows = at::empty({0}, at::kLong);  // row r is sequence r
  Tensor x = x0;
  for (int64_t l = 0; l < layers; ++l) {
    const Layer layer{weights, biases, kinds, types, kProjections * l};
    Tensor h = op.rms_norm.call(x, norms[2 * l], eps);
    std::vector<Tensor> qkv = layer.shared(0, 3, h);
    Tensor q = qkv[0].view({1, n, heads, head_dim}), k = qkv[1].view({1, n, kv_heads, head_dim});
    const Tensor v = qkv[2].view({n, kv_heads, head_dim});
    const c10::optional<Tensor> q_norm = qk_norms.get(2 * l), k_norm = qk_norms.get(2 * l + 1);
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_layers: layer ", l, " has a ",
                q_norm.has_value() ? "query" : "key", " norm without the other");
    if (q_norm.has_value()) {
      q = op.rms_norm.call(q, *q_norm, eps);
      k = op.rms_norm.call(k, *k_norm, eps);
    }
    std::tie(q, k) = op.rope.call(q, k, cos, sin);
    op.store_kv.call(k[0], v, key_caches[l], value_caches[l], slot_mapping);
    const Tensor out = std::get<0>(op.attention.call(q[0], key_caches[l], value_caches[l], block_tables, no_rows,
                                                     seq_lens, scale, false, windows[l], 0.0, c10::nullopt));
    x = x + layer.product(3, out.view({n, heads * head_dim}));
    h = op.rms_norm.call(x, norms[2 * l + 1], eps);
    Tensor hidden;
    if (kinds[kProjections * l + 4] == kGateUp) {
      hidden = op.pair_silu_mul.call(h, weights[kProjections * l + 4]);
    } else {
      std::vector<Tensor> gate_up = layer.shared(4, 2, h);
      hidden = op.silu_mul.call(gate_up[0], gate_up[1]);
    }
    x = x + layer.product(6, hidden);
  }
  return op.rms_norm.call(x, norms[2 * layers], eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, Tensor?[] qk_norms, Tensor[] weights, "
        "Tensor?[] biases, int[] kinds, int[] types, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, int[] windows, int heads, "
        "int kv_heads, int head_dim, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
