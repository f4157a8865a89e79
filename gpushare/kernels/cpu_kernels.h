// The CPU kernels one C++ file calls from another (cpu_decode.cpp runs the others layer after layer).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace gpushare {

// cpu_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap);

// cpu_lora.cpp
void lora_apply(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_stack, const at::Tensor& b_stack,
                const at::Tensor& slot_of_row, const at::Tensor& scale_of_slot);

// cpu_ops.cpp
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
