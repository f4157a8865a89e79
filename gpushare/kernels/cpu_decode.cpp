// Layers in one call: a step's rows through the layers given (a few of a Llama-shaped model whose
// linears are all cpu_qmatmul's), calling the same kernels in the same order as the Python path
// (gpushare/models/llama.py), so the numbers are bit for bit the same. Each row attends as a decode
// row (block_tables and context_lens per row: its sequence's table, its position + 1), prompt rows too.
//
// Why: a decode step at batch 1 is ~150 parallel regions (five a layer), each a few tens of
// microseconds. Between two regions run from Python, the intra-op thread waits out its short spin
// (GOMP_SPINCOUNT, kept short so that idle workers leave the cores to the API and other models)
// and falls asleep, so each region pays a futex wake: ~18 us of a ~45 us matmul. Here the gaps
// between regions are a few microseconds of C++, inside the spin.
//
// Per layer i, weights are norms[2i] (input), norms[2i+1] (post-attention) and, for the linears
// qkv, o, gate_up, down (j = 4i .. 4i+3), codes[j], scales[j], mins[j] (None: int8, else int4)
// and out_features[j]. The caches are per layer: k_caches[i], v_caches[i], with int8 scales or None.
// LoRA (none when lora_a is empty): each row's adapter (lora_slots, -1: none) is added after each
// target linear by cpu_lora.cpp, as the Python path does: targets q, k, v, o, gate, up, down of layer
// i are lora_a/lora_b[7i .. 7i+6], q, k and v (gate and up) column ranges of the fused output in order.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_kernels.h"

namespace {

// Each linear's first target and number of targets: qkv (q, k, v), o, gate_up (gate, up), down.
constexpr size_t kTargetsPerLayer = 7;
constexpr size_t kFirstTarget[4] = {0, 3, 4, 6}, kTargets[4] = {3, 1, 2, 1};

struct Adapters {
  at::TensorList a, b;
  const c10::optional<at::Tensor>& slot_of_row;
  const c10::optional<at::Tensor>& scale_of_slot;
};

// Linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer i on x, with its rows' adapters added.
at::Tensor linear(const at::Tensor& x, at::TensorList codes, at::TensorList scales,
                  const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef out_features,
                  const Adapters& lora, size_t i, size_t which) {
  const size_t j = 4 * i + which;
  const std::optional<at::Tensor> m = mins.get(j);
  at::Tensor y = gpushare::quantized_matmul(x, codes[j], scales[j], m, out_features[j], m.has_value() ? 4 : 8, false);
  if (lora.a.empty()) return y;
  int64_t start = 0;
  const size_t first = kTargetsPerLayer * i + kFirstTarget[which];
  for (size_t t = first; t < first + kTargets[which]; ++t) {
    const int64_t width = lora.b[t].size(2);
    gpushare::lora_apply(y.narrow(1, start, width), x, lora.a[t], lora.b[t], *lora.slot_of_row, *lora.scale_of_slot);
    start += width;
  }
  return y;
}

at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList norms,
                         at::TensorList codes, at::TensorList scales,
                         const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef out_features,
                         at::TensorList k_caches, at::TensorList v_caches,
                         const c10::List<std::optional<at::Tensor>>& k_scales,
                         const c10::List<std::optional<at::Tensor>>& v_scales, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t q_heads, int64_t kv_heads, double eps,
                         double attn_scale, at::IntArrayRef windows, double softcap, at::TensorList lora_a,
                         at::TensorList lora_b, const c10::optional<at::Tensor>& lora_slots,
                         const c10::optional<at::Tensor>& lora_scales) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(v_caches.size() == layers && k_scales.size() == layers && v_scales.size() == layers &&
                  windows.size() == layers && norms.size() == 2 * layers && codes.size() == 4 * layers &&
                  scales.size() == 4 * layers && mins.size() == 4 * layers && out_features.size() == 4 * layers,
              "decode_layers needs 2 norms, 4 linears, a K and a V cache and a window per layer");
  TORCH_CHECK(lora_a.empty() ? lora_b.empty() : lora_a.size() == kTargetsPerLayer * layers &&
                  lora_b.size() == lora_a.size() && lora_slots.has_value() && lora_scales.has_value(),
              "decode_layers' LoRA needs an A and a B stack per target (7 a layer), the rows' slots and the scales");
  const Adapters lora{lora_a, lora_b, lora_slots, lora_scales};
  const int64_t rows = x_in.size(0), dim = k_caches.empty() ? 0 : k_caches[0].size(3);
  at::Tensor x = x_in;
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor normed = gpushare::rms_norm(x, std::nullopt, norms[2 * i], eps)[0];
    const at::Tensor qkv = linear(normed, codes, scales, mins, out_features, lora, i, 0);
    gpushare::rope_and_cache(qkv, cos, sin, q_heads, kv_heads, k_caches[i], v_caches[i], k_scales.get(i),
                             v_scales.get(i), slot_mapping);
    const at::Tensor q = qkv.narrow(1, 0, q_heads * dim).view({rows, q_heads, dim});
    const at::Tensor attended = gpushare::decode_attention(q, k_caches[i], v_caches[i], k_scales.get(i),
                                                           v_scales.get(i), block_tables, context_lens, attn_scale,
                                                           windows[i], softcap);
    const at::Tensor h = linear(attended.view({rows, q_heads * dim}), codes, scales, mins, out_features, lora, i, 1);
    const std::vector<at::Tensor> normed_and_sum = gpushare::rms_norm(x, h, norms[2 * i + 1], eps);
    const at::Tensor gate_up = linear(normed_and_sum[0], codes, scales, mins, out_features, lora, i, 2);
    const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    const at::Tensor down = linear(at::silu(halves[0]) * halves[1], codes, scales, mins, out_features, lora, i, 3);
    x = normed_and_sum[1] + down;
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpushare, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, Tensor[] codes, Tensor[] scales, Tensor?[] mins, int[] out_features, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor?[] k_scales, Tensor?[] v_scales, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int q_heads, int kv_heads, "
        "float eps, float attn_scale, int[] windows, float softcap, Tensor[] lora_a, Tensor[] lora_b, "
        "Tensor? lora_slots, Tensor? lora_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpushare, CPU, m) { m.impl("decode_layers", &decode_layers); }
