// The CPU kernels one C++ file calls from another (cpu_decode.cpp runs the others layer after layer).
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu_rows.h"

#include <atomic>
#include <vector>

namespace gpushare {

namespace attention {  // decode_attention in the two parts a team of threads shares (cpu_decode.cpp)

// A work item: `rows` rows from `row` (more than one: a block of one prompt's rows, cpu_attention_prompt.h)
// and KV heads [first_head, first_head + heads).
struct Item {
  int64_t row, rows, first_head, heads;
  int64_t prompt;  // blocks (rows > 1): which prompt of the call, its blocks numbered alike
};

// One call's arguments, checked, and its work items.
struct Call {
  at::Tensor q, tables, lens, out;
  rows::Cache kc, vc;
  const int32_t *tp, *lp;
  int64_t batch, q_heads, dim, block_size, kv_heads, width, group, items, window;
  std::vector<Item> work;
  float scale, softcap;
};

Call prepare(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
             const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
             double softcap, int64_t threads);

// Runs items claimed from `next` (shared by the threads that run them) until none are left.
void run_items(const Call& call, std::atomic<int64_t>& next);

}  // namespace attention

// cpu_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap);

// cpu_lora.cpp
void lora_apply(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_stack, const at::Tensor& b_stack,
                const at::Tensor& slot_of_row, const at::Tensor& scale_of_slot);

// cpu_ops.cpp, and its rows for a team of threads (cpu_decode.cpp)
namespace ops {

void rms_norm_row(const float* row, const float* residual, const float* weight, int64_t hidden, float eps,
                  float* out, float* sum);

// One rope_and_cache call's arguments, checked.
struct Rope {
  at::Tensor slots;
  rows::Cache kc, vc;
  float* base;
  const float *cos, *sin;
  int64_t dim, block_size, q_heads, kv_heads, width, trig_stride;
};

Rope rope_of(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads, int64_t kv_heads,
             const at::Tensor& k_cache, const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
             const c10::optional<at::Tensor>& v_scale, const at::Tensor& slot_mapping);

// Token t's RoPE and cache write; scratch holds dim floats.
void rope_row(const Rope& rope, int64_t t, float* scratch);

}  // namespace ops

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps);
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
                    int64_t kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& slot_mapping);

// cpu_qmatmul.cpp
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, int64_t n, int64_t bits, bool portable);

}  // namespace gpushare
