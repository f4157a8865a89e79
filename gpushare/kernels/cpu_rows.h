// What the CPU's C++ kernels share: a dot product in a fixed order (so a row's numbers never depend on
// what else a call holds) and a paged KV cache's layout.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <new>
#include <vector>

namespace gpushare::rows {

// std::vector's allocator for buffers read a register at a time: 64-byte (cache-line) aligned, so no
// 256- or 512-bit load straddles two lines. malloc's 16-byte alignment split every other AVX2 load of
// a prompt's widened value tiles, and their sums ran ~20% slower (Zen 3).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

constexpr int64_t kLanes = 16;  // independent partial sums: the compiler vectorizes them, in fixed order

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += q[d + j] * static_cast<float>(k[d + j]);
  for (int64_t width = kLanes / 2; width > 0; width /= 2)  // a fixed tree: a few shuffles, not 16 serial adds
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  float sum = lanes[0];
  for (; d < n; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

// One layer's K or V cache: [num_blocks, block_size, Hkv, D] rows of float32, bfloat16 or int8 (then a
// float32 scale per block, offset and head: value = data * scale), the last dim contiguous.
struct Cache {
  char* data;
  at::ScalarType type;
  float* scale;  // int8 only
  int64_t block_stride, row_stride, head_stride;  // in elements
  int64_t scale_block, scale_row, scale_head;

  template <typename T>
  T* row(int64_t block, int64_t offset, int64_t head) const {
    return reinterpret_cast<T*>(data) + block * block_stride + offset * row_stride + head * head_stride;
  }
  float* scale_at(int64_t block, int64_t offset, int64_t head) const {
    return scale + block * scale_block + offset * scale_row + head * scale_head;
  }
};

inline Cache cache_of(const at::Tensor& values, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(values.dim() == 4 && values.stride(3) == 1, "a KV cache is [blocks, block_size, heads, dim], dim contiguous");
  Cache c{static_cast<char*>(values.data_ptr()), values.scalar_type(), nullptr, values.stride(0), values.stride(1),
          values.stride(2), 0, 0, 0};
  if (values.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->dim() == 3,
                "an int8 KV cache needs float32 scales [blocks, block_size, heads]");
    c.scale = scale->data_ptr<float>();
    c.scale_block = scale->stride(0), c.scale_row = scale->stride(1), c.scale_head = scale->stride(2);
  } else {
    TORCH_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kBFloat16,
                "the KV cache must be float32, bfloat16 or int8");
  }
  return c;
}

}  // namespace gpushare::rows
