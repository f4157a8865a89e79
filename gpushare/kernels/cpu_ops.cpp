// The CPU's small C++ kernels around attention (cpu_attention.cpp), fused: one call where the torch
// path makes six to fifteen. RMSNorm with the residual add; RoPE with the cache write. Also where the
// library's ops are declared (the other files add theirs as fragments). Plain loops, which the compiler
// vectorizes for the build's ISA (kernels/cpu_ops.py) without changing an operation (no fused
// multiply-adds, no reassociation: the same bits on every ISA).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using gpushare::rows::Cache;
using gpushare::rows::dot;

}  // namespace

namespace gpushare::ops {

void rms_norm_row(const float* row, const float* residual, const float* weight, int64_t hidden, float eps,
                  float* out, float* sum) {
  if (residual != nullptr) {
    for (int64_t d = 0; d < hidden; ++d) sum[d] = row[d] + residual[d];
    row = sum;
  }
  const float inv = 1.f / std::sqrt(dot(row, row, hidden) / static_cast<float>(hidden) + eps);
  for (int64_t d = 0; d < hidden; ++d) out[d] = row[d] * inv * weight[d];
}

}  // namespace gpushare::ops

namespace gpushare {

// y = x / sqrt(mean(x^2) + eps) * weight per row of float32 x [T, H]; with `residual`, x + residual
// first, and that sum is returned too (the residual stream of the next block).
std::vector<at::Tensor> rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in,
                                 const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat,
              "rms_norm takes float32 [rows, hidden]");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor sum = residual_in.has_value() ? at::empty_like(x) : x;
  const at::Tensor residual = residual_in.has_value() ? residual_in->contiguous() : x;
  at::Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  const bool add = residual_in.has_value();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      ops::rms_norm_row(xp + r * hidden, add ? rp + r * hidden : nullptr, wp, hidden, static_cast<float>(eps),
                        op + r * hidden, sp + r * hidden);
  });
  return {out, sum};
}

}  // namespace gpushare

namespace {

inline void rotate_half(float* x, const float* cos, const float* sin, int64_t dim, float* scratch) {
  // as the torch path: x * cos + cat(-x[half:], x[:half]) * sin, each product rounded on its own; two
  // loops without a branch, which the compiler vectorizes for the build's ISA
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) scratch[d] = x[d] * cos[d] + -x[d + half] * sin[d];
  for (int64_t d = half; d < dim; ++d) scratch[d] = x[d] * cos[d] + x[d - half] * sin[d];
  std::copy(scratch, scratch + dim, x);
}

void store_row(const float* row, const Cache& c, int64_t block, int64_t offset, int64_t head, int64_t dim) {
  if (c.scale) {  // symmetric int8 per token and head, as paged_attention_torch._store
    float top = 0;
    for (int64_t d = 0; d < dim; ++d) top = std::max(top, std::fabs(row[d]));
    const float scale = std::max(top, 1e-12f) / 127.f;
    int8_t* out = c.row<int8_t>(block, offset, head);
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<int8_t>(std::nearbyint(row[d] / scale));
    *c.scale_at(block, offset, head) = scale;
  } else if (c.type == at::kBFloat16) {  // rounded to nearest even, as torch's .to(torch.bfloat16)
    c10::BFloat16* out = c.row<c10::BFloat16>(block, offset, head);
    for (int64_t d = 0; d < dim; ++d) out[d] = c10::BFloat16(row[d]);
  } else {
    std::copy(row, row + dim, c.row<float>(block, offset, head));
  }
}

}  // namespace

namespace gpushare::ops {

Rope rope_of(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads, int64_t kv_heads,
             const at::Tensor& k_cache, const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
             const c10::optional<at::Tensor>& v_scale, const at::Tensor& slot_mapping) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "qkv must be contiguous float32");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.stride(-1) == 1 &&
              sin.stride(-1) == 1 && cos.stride(0) == sin.stride(0), "cos and sin must be float32 rows");
  Rope r;
  r.dim = k_cache.size(3), r.block_size = k_cache.size(1), r.q_heads = q_heads, r.kv_heads = kv_heads;
  TORCH_CHECK(qkv.size(1) == (q_heads + 2 * kv_heads) * r.dim && k_cache.size(2) == kv_heads,
              "qkv, heads and cache disagree");
  r.slots = slot_mapping.to(at::kLong).contiguous();
  r.kc = rows::cache_of(k_cache, k_scale), r.vc = rows::cache_of(v_cache, v_scale);
  r.base = qkv.data_ptr<float>();
  r.cos = cos.data_ptr<float>(), r.sin = sin.data_ptr<float>();
  r.width = qkv.size(1), r.trig_stride = cos.stride(0);
  return r;
}

void rope_row(const Rope& r, int64_t t, float* scratch) {
  float* row = r.base + t * r.width;
  const float *c = r.cos + t * r.trig_stride, *s = r.sin + t * r.trig_stride;
  for (int64_t h = 0; h < r.q_heads + r.kv_heads; ++h) rotate_half(row + h * r.dim, c, s, r.dim, scratch);
  const int64_t slot = r.slots.data_ptr<int64_t>()[t];
  const int64_t block = slot / r.block_size, offset = slot % r.block_size;
  for (int64_t h = 0; h < r.kv_heads; ++h) {
    store_row(row + (r.q_heads + h) * r.dim, r.kc, block, offset, h, r.dim);
    store_row(row + (r.q_heads + r.kv_heads + h) * r.dim, r.vc, block, offset, h, r.dim);
  }
}

}  // namespace gpushare::ops

namespace gpushare {

// qkv [T, (Hq + 2 Hkv) * D] float32, the fused projection's output: RoPE on its q and k heads in
// place, then k and v written to their cache slots. cos/sin [T, 1, D] (rows at any stride).
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
                    int64_t kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& slot_mapping) {
  const ops::Rope rope = ops::rope_of(qkv, cos, sin, q_heads, kv_heads, k_cache, v_cache, k_scale, v_scale,
                                      slot_mapping);
  at::parallel_for(0, qkv.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(rope.dim);
    for (int64_t t = begin; t < end; ++t) ops::rope_row(rope, t, scratch.data());
  });
}

}  // namespace gpushare

TORCH_LIBRARY(gpushare, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor context_lens, float scale, int window, float softcap) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]");
  m.def("rope_and_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, int q_heads, int kv_heads, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor(d!)? k_scale, Tensor(e!)? v_scale, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(gpushare, CPU, m) {
  m.impl("decode_attention", &gpushare::decode_attention);
  m.impl("rms_norm", &gpushare::rms_norm);
  m.impl("rope_and_cache", &gpushare::rope_and_cache);
}
