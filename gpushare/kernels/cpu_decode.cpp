// Layers in one call: a step's rows through the layers given (a few of a Llama-shaped model whose
// linears are all cpu_qmatmul's), calling the same kernels in the same order as the Python path
// (gpushare/models/llama.py), so the numbers are bit for bit the same. Each row attends as a decode
// row (block_tables and context_lens per row: its sequence's table, its position + 1), prompt rows too.
//
// Why: a decode step at batch 1 is ~150 parallel regions (five a layer), each a few tens of
// microseconds. Between two regions run from Python, the intra-op thread waits out its short spin
// (GOMP_SPINCOUNT, kept short so that idle workers leave the cores to the API and other models)
// and falls asleep, so each region pays a futex wake: ~18 us of a ~45 us matmul. Here, without
// adapters, the call's threads run every kernel as one team (cpu_team.h) and never fall asleep
// inside it; with adapters each kernel is its own region, the gaps between them a few microseconds.
//
// Per layer i, weights are norms[2i] (input), norms[2i+1] (post-attention) and, for the linears
// qkv, o, gate_up, down (j = 4i .. 4i+3), codes[j], scales[j], mins[j] (None: int8, else int4)
// and out_features[j]. The caches are per layer: k_caches[i], v_caches[i], with int8 scales or None.
// LoRA (none when lora_a is empty): each row's adapter (lora_slots, -1: none) is added after each
// target linear by cpu_lora.cpp, as the Python path does: targets q, k, v, o, gate, up, down of layer
// i are lora_a/lora_b[7i .. 7i+6], q, k and v (gate and up) column ranges of the fused output in order.
// The head (a call that ends with the model's last layer, head_rows given): the final norm (head_norm)
// and the LM head (head_codes, head_scales, head_mins, head_features) of rows head_rows, the rows that
// sample, as the Python path's norm then lm_head; the third output, empty without a head. Why here: at
// batch 1 the LM head read alone, after the call's team had gone to sleep, took ~1.1 ms of a ~6.7 ms
// step, against ~0.6 ms back to back.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <omp.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_qmatmul.h"
#include "cpu_team.h"

#include <atomic>
#include <exception>
#include <tuple>
#include <optional>
#include <vector>

namespace {

namespace qm = gpushare::qmatmul;

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

// A decode_layers call's arguments, as the op's schema orders them.
struct DecodeArgs {
  const at::Tensor& x;
  at::TensorList norms, codes, scales;
  const c10::List<std::optional<at::Tensor>>& mins;
  at::IntArrayRef out_features;
  at::TensorList k_caches, v_caches;
  const c10::List<std::optional<at::Tensor>>&k_scales, &v_scales;
  const at::Tensor &cos, &sin, &slot_mapping, &block_tables, &context_lens;
  int64_t q_heads, kv_heads;
  double eps, attn_scale;
  at::IntArrayRef windows;
  double softcap;
  at::TensorList lora_a, lora_b;
  const c10::optional<at::Tensor>&lora_slots, &lora_scales, &pause;
  const c10::optional<at::Tensor>&head_norm, &head_codes, &head_scales, &head_mins;
  int64_t head_features;
  const c10::optional<at::Tensor>& head_rows;
};

using Ran = std::tuple<at::Tensor, int64_t, at::Tensor>;  // x after the layers run, how many, the head's logits

// The head's rows and weights, checked, with its output allocated (an empty one without a head).
struct Head {
  std::vector<int64_t> rows;
  std::optional<qm::Weights> weights;
  const float* norm = nullptr;
  at::Tensor logits;
};

Head head_of(const DecodeArgs& args, int64_t rows, int64_t hidden) {
  Head head;
  if (!args.head_rows.has_value()) {
    head.logits = at::empty({0}, args.x.options());
    return head;
  }
  TORCH_CHECK(args.head_norm.has_value() && args.head_codes.has_value() && args.head_scales.has_value() &&
                  args.head_norm->is_contiguous() && args.head_norm->scalar_type() == at::kFloat &&
                  args.head_rows->scalar_type() == at::kLong && args.head_rows->dim() == 1,
              "decode_layers' head needs a contiguous float32 norm, the LM head's weights and int64 rows");
  const at::Tensor ids = args.head_rows->contiguous();
  head.rows.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  for (const int64_t r : head.rows) TORCH_CHECK(r >= 0 && r < rows, "decode_layers' head row out of range");
  head.weights = qm::weights_of(*args.head_codes, *args.head_scales, args.head_mins, args.head_features, hidden,
                                args.head_mins.has_value() ? 4 : 8);
  head.norm = args.head_norm->data_ptr<float>();
  head.logits = at::empty({static_cast<int64_t>(head.rows.size()), args.head_features}, args.x.options());
  return head;
}

// Whether the call stops after layer i of `layers`: the pause flag set (models/pause_signal.py),
// read as another thread writes it, and a layer left to run.
bool pause_after(const DecodeArgs& args, size_t i, size_t layers) {
  if (!args.pause.has_value() || i + 1 >= layers) return false;
  return std::atomic_ref<uint8_t>(*args.pause->data_ptr<uint8_t>()).load(std::memory_order_relaxed) != 0;
}

// One layer's kernels, prepared (checked, their outputs allocated) before the team starts: nothing in
// the parallel region may throw, or a thread would leave the others waiting at a barrier.
struct TeamLayer {
  qm::Weights qkv, o, gate_up, down;
  gpushare::ops::Rope rope;
  gpushare::attention::Call attention;
  const float *input_norm, *post_norm;
};

// decode_layers without adapters, by a team (cpu_team.h): per layer ten phases, each row's or each
// channel group's work claimed by whichever thread comes first, a barrier after each. The kernels'
// row functions are the ones their own calls run, so the numbers are theirs.
Ran layers_by_team(const DecodeArgs& args) {
  const auto& [x_in, norms, codes, scales, mins, out_features, k_caches, v_caches, k_scales, v_scales, cos, sin,
               slot_mapping, block_tables, context_lens, q_heads, kv_heads, eps, attn_scale, windows, softcap,
               lora_a, lora_b, lora_slots, lora_scales, pause, head_norm, head_codes, head_scales, head_mins,
               head_features, head_rows] = args;
  const size_t layers = k_caches.size();
  const at::Tensor x0 = x_in.contiguous();
  const int64_t rows = x0.size(0), hidden = x0.size(1), dim = k_caches[0].size(3);
  const int64_t qkv_width = out_features[0], inter = out_features[2] / 2, threads = at::get_num_threads();
  TORCH_CHECK(x0.scalar_type() == at::kFloat && out_features[2] % 2 == 0, "decode_layers takes float32 rows");
  const auto options = x0.options();
  at::Tensor normed = at::empty({rows, hidden}, options), qkv = at::empty({rows, qkv_width}, options);
  at::Tensor q = at::empty({rows, q_heads, dim}, options), h = at::empty({rows, hidden}, options);
  at::Tensor sum = at::empty({rows, hidden}, options), gate_up = at::empty({rows, out_features[2]}, options);
  at::Tensor act = at::empty({rows, inter}, options), down = at::empty({rows, hidden}, options);
  at::Tensor x = at::empty({rows, hidden}, options);
  std::vector<TeamLayer> plan;
  for (size_t i = 0; i < layers; ++i) {
    const auto weights = [&](size_t which, int64_t k) {
      const size_t j = 4 * i + which;
      const std::optional<at::Tensor> m = mins.get(j);
      return qm::weights_of(codes[j], scales[j], m, out_features[j], k, m.has_value() ? 4 : 8);
    };
    TORCH_CHECK(out_features[4 * i] == qkv_width && out_features[4 * i + 2] == 2 * inter &&
                    out_features[4 * i + 1] == hidden && out_features[4 * i + 3] == hidden,
                "decode_layers' layers must share their shapes");
    TORCH_CHECK(norms[2 * i].is_contiguous() && norms[2 * i + 1].is_contiguous() &&
                    norms[2 * i].scalar_type() == at::kFloat && norms[2 * i + 1].scalar_type() == at::kFloat,
                "norm weights must be contiguous float32");
    plan.push_back(TeamLayer{weights(0, hidden), weights(1, q_heads * dim), weights(2, hidden), weights(3, inter),
                             gpushare::ops::rope_of(qkv, cos, sin, q_heads, kv_heads, k_caches[i], v_caches[i],
                                                    k_scales.get(i), v_scales.get(i), slot_mapping),
                             gpushare::attention::prepare(q, k_caches[i], v_caches[i], k_scales.get(i),
                                                          v_scales.get(i), block_tables, context_lens, attn_scale,
                                                          windows[i], softcap, threads),
                             norms[2 * i].data_ptr<float>(), norms[2 * i + 1].data_ptr<float>()});
  }
  qm::Activations hidden_rows = qm::activations_for(rows, hidden), attended_rows = qm::activations_for(rows, q_heads * dim);
  qm::Activations inter_rows = qm::activations_for(rows, inter);
  Head head = head_of(args, rows, hidden);
  const int64_t head_count = static_cast<int64_t>(head.rows.size());
  qm::Activations head_acts = qm::activations_for(head_count, hidden);
  std::vector<float> head_normed(head_count * hidden);
  float* logits_p = head.weights ? head.logits.data_ptr<float>() : nullptr;
  std::atomic<int64_t> head_next[2] = {0, 0};
  constexpr int64_t kRunsPerThread = 4;
  constexpr int kPhases = 10;  // nine a layer's, the last the final residual sum
  std::vector<std::atomic<int64_t>> next(kPhases * layers);
  float *normed_p = normed.data_ptr<float>(), *qkv_p = qkv.data_ptr<float>(), *q_p = q.data_ptr<float>();
  float *h_p = h.data_ptr<float>(), *sum_p = sum.data_ptr<float>(), *gate_up_p = gate_up.data_ptr<float>();
  float *down_p = down.data_ptr<float>(), *x_p = x.data_ptr<float>();
  const float* x0_p = x0.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  std::vector<char> stop(layers, 0);  // after layer i: the pause flag as thread 0 read it
  const auto ran = [layers](const std::vector<char>& after) {
    for (size_t i = 0; i < layers; ++i)
      if (after[i]) return i + 1;
    return layers;
  };
  std::optional<gpushare::team::SpinBarrier> barrier;
  std::exception_ptr failure;
  const at::ThreadLocalState caller;  // inference mode and the like, for torch's ops on the team's threads
#pragma omp parallel num_threads(threads)
  {
    const at::ThreadLocalStateGuard as_caller(caller);
#pragma omp single
    barrier.emplace(omp_get_num_threads());
    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
    std::vector<float> scratch(dim);
    // A linear's output groups are claimed in runs, about four a thread: a thread then streams its
    // weights in long stretches the prefetchers follow. One group at a time (9 KB of SmolLM2's qkv,
    // the threads alternating) read the weights at about two thirds of the machine's bandwidth:
    // batch-1 steps took a median 6.5 ms so against 5.9 (9-15 runs each; batch 16 unchanged).
    const auto run = [team](const qm::Weights& w) {
      return std::max<int64_t>(1, w.groups() / (team * kRunsPerThread));
    };
    for (size_t i = 0; i < layers; ++i) {
      const TeamLayer& layer = plan[i];
      std::atomic<int64_t>* counter = next.data() + kPhases * i;
      const float* residual = i == 0 ? x0_p : x_p;
      // 1: the residual stream (the last layer's sum + down), its norm, quantized for qkv
      gpushare::team::claim(counter[0], rows, [&](int64_t r) {
        if (i > 0)
          for (int64_t d = 0; d < hidden; ++d) x_p[r * hidden + d] = sum_p[r * hidden + d] + down_p[r * hidden + d];
        gpushare::ops::rms_norm_row(residual + r * hidden, nullptr, layer.input_norm, hidden, epsilon,
                                    normed_p + r * hidden, nullptr);
        qm::quantize_row(normed_p + r * hidden, hidden_rows, r);
      });
      barrier->wait();
      gpushare::team::claim_runs(counter[1], layer.qkv.groups(), run(layer.qkv), [&](int64_t g) { qm::run_group(hidden_rows, layer.qkv, g, qkv_p, true); });
      barrier->wait();
      gpushare::team::claim(counter[2], rows, [&](int64_t t) {  // RoPE and the cache, q to its own rows
        gpushare::ops::rope_row(layer.rope, t, scratch.data());
        std::copy(qkv_p + t * qkv_width, qkv_p + t * qkv_width + q_heads * dim, q_p + t * q_heads * dim);
      });
      barrier->wait();
      gpushare::attention::run_items(layer.attention, counter[3]);
      barrier->wait();
      const float* attended = layer.attention.out.data_ptr<float>();
      gpushare::team::claim(counter[4], rows, [&](int64_t r) {
        qm::quantize_row(attended + r * q_heads * dim, attended_rows, r);
      });
      barrier->wait();
      gpushare::team::claim_runs(counter[5], layer.o.groups(), run(layer.o), [&](int64_t g) { qm::run_group(attended_rows, layer.o, g, h_p, true); });
      barrier->wait();
      gpushare::team::claim(counter[6], rows, [&](int64_t r) {
        gpushare::ops::rms_norm_row(residual + r * hidden, h_p + r * hidden, layer.post_norm, hidden, epsilon,
                                    normed_p + r * hidden, sum_p + r * hidden);
        qm::quantize_row(normed_p + r * hidden, hidden_rows, r);
      });
      barrier->wait();
      gpushare::team::claim_runs(counter[7], layer.gate_up.groups(), run(layer.gate_up), [&](int64_t g) {
        qm::run_group(hidden_rows, layer.gate_up, g, gate_up_p, true);
      });
      barrier->wait();
      {  // silu(gate) * up by torch's own kernels (the layer-by-layer path's), a share of whole rows each
        const int64_t first = rows * me / team, last = rows * (me + 1) / team;
        if (first < last) {
          try {
            const at::Tensor gate = gate_up.narrow(0, first, last - first).narrow(1, 0, inter);
            const at::Tensor up = gate_up.narrow(0, first, last - first).narrow(1, inter, inter);
            at::Tensor share = act.narrow(0, first, last - first);
            at::silu_out(share, gate);
            share.mul_(up);
          } catch (...) {
#pragma omp critical
            failure = std::current_exception();
          }
          const float* act_p = act.data_ptr<float>();
          for (int64_t r = first; r < last; ++r) qm::quantize_row(act_p + r * inter, inter_rows, r);
        }
      }
      barrier->wait();
      gpushare::team::claim_runs(counter[8], layer.down.groups(), run(layer.down), [&](int64_t g) { qm::run_group(inter_rows, layer.down, g, down_p, true); });
      if (me == 0) stop[i] = pause_after(args, i, layers);  // one thread reads the flag; the barrier shows all
      barrier->wait();
      if (stop[i]) break;
    }
    const size_t last = ran(stop);
    gpushare::team::claim(next[kPhases * (last - 1) + 9], rows, [&](int64_t r) {
      for (int64_t d = 0; d < hidden; ++d) x_p[r * hidden + d] = sum_p[r * hidden + d] + down_p[r * hidden + d];
    });
    if (head.weights && last == layers) {  // the final norm of the rows that sample, then the LM head
      barrier->wait();
      gpushare::team::claim(head_next[0], head_count, [&](int64_t j) {
        gpushare::ops::rms_norm_row(x_p + head.rows[j] * hidden, nullptr, head.norm, hidden, epsilon,
                                    head_normed.data() + j * hidden, nullptr);
        qm::quantize_row(head_normed.data() + j * hidden, head_acts, j);
      });
      barrier->wait();
      gpushare::team::claim_runs(head_next[1], head.weights->groups(), run(*head.weights), [&](int64_t g) {
        qm::run_group(head_acts, *head.weights, g, logits_p, true);
      });
    }
  }
  if (failure) std::rethrow_exception(failure);
  const int64_t ran_layers = static_cast<int64_t>(ran(stop));
  return {x, ran_layers, ran_layers == static_cast<int64_t>(layers) ? head.logits : at::empty({0}, options)};
}

Ran layers_by_kernel(const DecodeArgs& args) {
  const auto& [x_in, norms, codes, scales, mins, out_features, k_caches, v_caches, k_scales, v_scales, cos, sin,
               slot_mapping, block_tables, context_lens, q_heads, kv_heads, eps, attn_scale, windows, softcap,
               lora_a, lora_b, lora_slots, lora_scales, pause, head_norm, head_codes, head_scales, head_mins,
               head_features, head_rows] = args;
  const size_t layers = k_caches.size();
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
    const at::Tensor down = linear(at::silu(halves[0]).mul(halves[1]), codes, scales, mins, out_features, lora, i, 3);
    x = normed_and_sum[1].add(down);
    if (pause_after(args, i, layers)) return {x, static_cast<int64_t>(i + 1), at::empty({0}, x.options())};
  }
  const Head head = head_of(args, x.size(0), x.size(1));
  if (!head.weights) return {x, static_cast<int64_t>(layers), head.logits};
  const at::Tensor normed = gpushare::rms_norm(x.index_select(0, *head_rows), std::nullopt, *head_norm, eps)[0];
  return {x, static_cast<int64_t>(layers),
          gpushare::quantized_matmul(normed, *head_codes, *head_scales, head_mins, head_features,
                                     head_mins.has_value() ? 4 : 8, false)};
}

Ran decode_layers(const at::Tensor& x, at::TensorList norms, at::TensorList codes, at::TensorList scales,
                         const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef out_features,
                         at::TensorList k_caches, at::TensorList v_caches,
                         const c10::List<std::optional<at::Tensor>>& k_scales,
                         const c10::List<std::optional<at::Tensor>>& v_scales, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t q_heads, int64_t kv_heads, double eps,
                         double attn_scale, at::IntArrayRef windows, double softcap, at::TensorList lora_a,
                         at::TensorList lora_b, const c10::optional<at::Tensor>& lora_slots,
                         const c10::optional<at::Tensor>& lora_scales, const c10::optional<at::Tensor>& pause,
                         const c10::optional<at::Tensor>& head_norm, const c10::optional<at::Tensor>& head_codes,
                         const c10::optional<at::Tensor>& head_scales, const c10::optional<at::Tensor>& head_mins,
                         int64_t head_features, const c10::optional<at::Tensor>& head_rows) {
  TORCH_CHECK(!pause.has_value() || (pause->scalar_type() == at::kByte && pause->numel() == 1),
              "decode_layers' pause flag is one uint8");
  const DecodeArgs args{x, norms, codes, scales, mins, out_features, k_caches, v_caches, k_scales, v_scales, cos, sin,
                        slot_mapping, block_tables, context_lens, q_heads, kv_heads, eps, attn_scale, windows,
                        softcap, lora_a, lora_b, lora_slots, lora_scales, pause, head_norm, head_codes, head_scales,
                        head_mins, head_features, head_rows};
  const size_t layers = k_caches.size();
  TORCH_CHECK(v_caches.size() == layers && k_scales.size() == layers && v_scales.size() == layers &&
                  windows.size() == layers && norms.size() == 2 * layers && codes.size() == 4 * layers &&
                  scales.size() == 4 * layers && mins.size() == 4 * layers && out_features.size() == 4 * layers,
              "decode_layers needs 2 norms, 4 linears, a K and a V cache and a window per layer");
  // Adapters run kernel by kernel (cpu_lora.cpp's regions); so does a call the team cannot take whole.
  if (!lora_a.empty() || k_caches.empty() || x.size(0) == 0 || x.dim() != 2)
    return layers_by_kernel(args);
  return layers_by_team(args);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpushare, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, Tensor[] codes, Tensor[] scales, Tensor?[] mins, int[] out_features, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor?[] k_scales, Tensor?[] v_scales, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int q_heads, int kv_heads, "
        "float eps, float attn_scale, int[] windows, float softcap, Tensor[] lora_a, Tensor[] lora_b, "
        "Tensor? lora_slots, Tensor? lora_scales, Tensor? pause=None, Tensor? head_norm=None, "
        "Tensor? head_codes=None, Tensor? head_scales=None, Tensor? head_mins=None, int head_features=0, "
        "Tensor? head_rows=None) -> (Tensor, int, Tensor)");
}

TORCH_LIBRARY_IMPL(gpushare, CPU, m) { m.impl("decode_layers", &decode_layers); }
