// The CPU's C++ kernels: paged decode attention reading each sequence's K/V blocks where they lie,
// and the small ops around it fused (RMSNorm with the residual add; RoPE with the cache write).
//
// The torch path (paged_attention_torch.py) gathers every sequence's blocks into a contiguous copy
// and runs one SDPA per sequence: at batch 16 that is ~40% of a decode step in small ops. Here one
// call does the whole batch: work items are (sequence, KV head) pairs spread over torch's intra-op
// threads; each item's arithmetic is the same whatever the batch or the thread count (fixed lanes,
// fixed order), so a sequence's result is bit for bit the same alone and in any batch.
//
// q [B, Hq, D] float32; k_cache/v_cache [num_blocks, block_size, Hkv, D], float32, bfloat16 or int8 (then
// k_scale/v_scale [num_blocks, block_size, Hkv] float32: value = data * scale), the last dim
// contiguous, blocks at any stride; block_tables [B, W] int32; context_lens [B] int32 (the current
// token included). window > 0 keeps the last `window` keys; softcap > 0 caps scores as tanh(s/c)*c.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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

#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16(const c10::BFloat16* p) {  // a bfloat16 is a float32's upper half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
template <>
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// dot(q, k[t], n) for 16 rows k[t] at once, n a multiple of 16, with dot's float operations in dot's
// order (so the same bits): each row's 16 lane sums in a register, then its tree of lane j + lane
// j + width for widths 8, 4, 2, 1, run for the 16 rows together by pairing registers up. One dot
// alone spends most of its time in that tree (a reduction across a register); 16 share it.
template <typename T>
inline void dot16(const float* q, const T* const* k, int64_t n, float* out) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += kLanes) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(qv, load16(k[t] + d)));
  }
  __m512 half[8], quarter[4], eighth[2];
  for (int i = 0; i < 8; ++i)  // width 8: rows 2i, 2i+1 -> their 8 sums side by side
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                            _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // width 4: rows 4i .. 4i+3, 4 sums each, a row per 128-bit lane
    quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                               _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // width 2: lane l holds rows 8i + l and 8i + 4 + l, 2 sums each
    eighth[i] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // width 1: lane l holds rows l, 4 + l, 8 + l, 12 + l
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
}
#endif

// e^x for x <= 0 (scores minus their maximum), written so that the compiler vectorizes a loop of it:
// Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial), within 2 ulp of expf.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

template <typename T>
inline void add_scaled(float* out, float weight, const T* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] += weight * static_cast<float>(v[d]);
}

struct Cache {
  char* data;  // float32, bfloat16 or int8 rows
  at::ScalarType type;
  float* scale;  // int8 only: one per (block, offset, head)
  int64_t block_stride, row_stride, head_stride;  // in elements
  int64_t scale_block, scale_row, scale_head;

  template <typename T>
  T* row(int64_t block, int64_t offset, int64_t head) const {
    return reinterpret_cast<T*>(data) + block * block_stride + offset * row_stride + head * head_stride;
  }
  float* scale_at(int64_t block, int64_t offset, int64_t head) const {
    return scale + block * scale_block + offset * scale_row + head * scale_head;
  }
  float row_scale(int64_t block, int64_t offset, int64_t head) const {
    return scale ? *scale_at(block, offset, head) : 1.f;
  }
};

Cache cache_of(const at::Tensor& values, const c10::optional<at::Tensor>& scale) {
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

// One sequence's KV heads [first_head, last_head): q and out point at the sequence's [Hq, D] rows.
// Tokens are the outer loop, so each token's K (then V) row is read once, front to back, for all
// those heads; each head's numbers are computed alike whichever heads share the call.
template <typename T>
void attend(const float* q, float* out, const Cache& kc, const Cache& vc, const int32_t* table, int64_t start,
            int64_t length, int64_t block_size, int64_t first_head, int64_t last_head, int64_t group, int64_t dim,
            float scale, float softcap, std::vector<float>& scores) {
  const int64_t n = length - start, rows = (last_head - first_head) * group;  // query heads handled
  scores.resize(rows * n);
  int64_t t = start;
#if defined(__AVX512F__)
  if (dim % kLanes == 0) {  // 16 tokens at a time, the same bits as one by one below
    const T* keys[16];
    float dots[16], k_scales[16];
    for (; t + 16 <= length; t += 16)
      for (int64_t head = first_head; head < last_head; ++head) {
        for (int i = 0; i < 16; ++i) {
          const int64_t block = table[(t + i) / block_size], offset = (t + i) % block_size;
          keys[i] = kc.row<T>(block, offset, head);
          k_scales[i] = kc.row_scale(block, offset, head);
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = (head - first_head) * group + g;
          dot16(q + (head * group + g) * dim, keys, dim, dots);
          for (int i = 0; i < 16; ++i) {
            float s = dots[i] * k_scales[i] * scale;
            if (softcap > 0) s = std::tanh(s / softcap) * softcap;
            scores[row * n + t + i - start] = s;
          }
        }
      }
  }
#endif
  for (; t < length; ++t) {
    const int64_t block = table[t / block_size], offset = t % block_size;
    for (int64_t head = first_head; head < last_head; ++head) {
      const T* k = kc.row<T>(block, offset, head);
      const float k_scale = kc.row_scale(block, offset, head);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = (head - first_head) * group + g;
        float s = dot(q + (head * group + g) * dim, k, dim) * k_scale * scale;
        if (softcap > 0) s = std::tanh(s / softcap) * softcap;
        scores[row * n + t - start] = s;
      }
    }
  }
  std::vector<float> sums(rows);
  for (int64_t row = 0; row < rows; ++row) {
    float* p = scores.data() + row * n;
    const float top = *std::max_element(p, p + n);
    for (int64_t i = 0; i < n; ++i) p[i] = exp_nonpositive(p[i] - top);
    float sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += p[i];
    sums[row] = sum;
  }
  float* first_out = out + first_head * group * dim;
  std::fill(first_out, first_out + rows * dim, 0.f);
  for (int64_t t = start; t < length; ++t) {
    const int64_t block = table[t / block_size], offset = t % block_size;
    for (int64_t head = first_head; head < last_head; ++head) {
      const T* v = vc.row<T>(block, offset, head);
      const float v_scale = vc.row_scale(block, offset, head);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = (head - first_head) * group + g;
        add_scaled(first_out + row * dim, scores[row * n + t - start] * v_scale, v, dim);
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t d = 0; d < dim; ++d) first_out[row * dim + d] /= sums[row];
}

}  // namespace

namespace gpushare {

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                            const at::Tensor& block_tables_in, const at::Tensor& context_lens_in, double scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be float32 [batch, heads, dim]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens_in.to(at::kInt).contiguous();
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dim && q_heads % kv_heads == 0, "q and the KV cache disagree on heads or dim");
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one block table and length per sequence");
  const Cache kc = cache_of(k_cache, k_scale), vc = cache_of(v_cache, v_scale);
  const int64_t group = q_heads / kv_heads;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lp[b] > 0 && (lp[b] + block_size - 1) / block_size <= width, "a context length exceeds its block table");
  // Work items: whole sequences once there are enough to share among the threads, else (sequence,
  // KV head) pairs; the numbers are the same either way.
  const int64_t heads_per_item = batch >= at::get_num_threads() ? kv_heads : 1;
  const int64_t items_per_seq = kv_heads / heads_per_item;
  at::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq, first = (item % items_per_seq) * heads_per_item;
      const int64_t length = lp[b], start = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t offset = b * q_heads * dim;
      const auto run = [&](auto element) {
        attend<decltype(element)>(qp + offset, op + offset, kc, vc, tp + b * width, start, length, block_size, first,
                                  first + heads_per_item, group, dim, static_cast<float>(scale),
                                  static_cast<float>(softcap), scores);
      };
      if (kc.type == at::kChar)
        run(int8_t{});
      else if (kc.type == at::kBFloat16)
        run(c10::BFloat16{});
      else
        run(float{});
    }
  });
  return out;
}

}  // namespace gpushare

namespace {

// ---- the small ops around it, fused: one call where the torch path makes six to fifteen ----

// y = x / sqrt(mean(x^2) + eps) * weight per row of float32 x [T, H]; with `residual`, x + residual
// first, and that sum is returned too (the residual stream of the next block).
}  // namespace

namespace gpushare {

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
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * hidden;
      float* total = sp + r * hidden;
      if (add) {
        const float* other = rp + r * hidden;
        for (int64_t d = 0; d < hidden; ++d) total[d] = row[d] + other[d];
        row = total;
      }
      const float inv = 1.f / std::sqrt(dot(row, row, hidden) / static_cast<float>(hidden) + static_cast<float>(eps));
      float* o = op + r * hidden;
      for (int64_t d = 0; d < hidden; ++d) o[d] = row[d] * inv * wp[d];
    }
  });
  return {out, sum};
}

}  // namespace gpushare

namespace {

inline void rotate_half(float* x, const float* cos, const float* sin, int64_t dim, float* scratch) {
  // as the torch path: x * cos + cat(-x[half:], x[:half]) * sin, each product rounded on its own
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const float rotated = d < half ? -x[d + half] : x[d - half];
    const float a = x[d] * cos[d], b = rotated * sin[d];
    scratch[d] = a + b;
  }
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

namespace gpushare {

// qkv [T, (Hq + 2 Hkv) * D] float32, the fused projection's output: RoPE on its q and k heads in
// place, then k and v written to their cache slots. cos/sin [T, 1, D] (rows at any stride).
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
                    int64_t kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "qkv must be contiguous float32");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.stride(-1) == 1 &&
              sin.stride(-1) == 1 && cos.stride(0) == sin.stride(0), "cos and sin must be float32 rows");
  const int64_t dim = k_cache.size(3), tokens = qkv.size(0), block_size = k_cache.size(1);
  TORCH_CHECK(qkv.size(1) == (q_heads + 2 * kv_heads) * dim && k_cache.size(2) == kv_heads, "qkv, heads and cache disagree");
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  const Cache kc = cache_of(k_cache, k_scale), vc = cache_of(v_cache, v_scale);
  float* base = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t width = qkv.size(1), trig_stride = cos.stride(0);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(dim);
    for (int64_t t = begin; t < end; ++t) {
      float* row = base + t * width;
      const float *c = cp + t * trig_stride, *s = sp + t * trig_stride;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) rotate_half(row + h * dim, c, s, dim, scratch.data());
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        store_row(row + (q_heads + h) * dim, kc, block, offset, h, dim);
        store_row(row + (q_heads + kv_heads + h) * dim, vc, block, offset, h, dim);
      }
    }
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
