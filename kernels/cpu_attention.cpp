// The CPU's paged attention: every query row attends to its own sequence's cached keys up to its
// position, reading K/V blocks where they lie. A decode row and a prompt row are the same computation
// (a prompt's row r is its sequence at length r + 1), so a token's numbers are the same whether its
// step decoded it or prefilled it, alone or in any batch, with its prefix cached or computed afresh.
//
// The torch path (paged_attention_torch.py) gathers every sequence's blocks into a contiguous copy and
// runs one SDPA per sequence: at batch 16 that is ~40% of a decode step in small ops, and SDPA's
// blocking rounds a prompt's rows differently from the decode rows that follow them. Here one call does
// the whole batch: work items are rows, or (row, KV head) pairs while there are fewer rows than
// threads, claimed by torch's intra-op threads as they come free; each item's arithmetic is the same
// whatever the batch or the thread count (fixed lanes, fixed order).
//
// q [R, Hq, D] float32; k_cache/v_cache [num_blocks, block_size, Hkv, D], float32, bfloat16 or int8 (then
// k_scale/v_scale [num_blocks, block_size, Hkv] float32: value = data * scale), the last dim contiguous,
// blocks at any stride; block_tables [R, W] int32 (row r's sequence's table); context_lens [R] int32
// (row r's position + 1). window > 0 keeps the last `window` keys; softcap > 0 caps scores as tanh(s/c)*c.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_rows.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using gpushare::rows::Cache;
using gpushare::rows::dot;
using gpushare::rows::kLanes;

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

// out[g][0, 16 C) = the sum over t, in t's order, of weights[g][t] * values[t], for G rows of weights at
// once (sharing each value row's loads): add_scaled's float operations (each element's products added
// one by one from zero), the G x C sums held in registers across all of t.
template <int C, int G, typename T>
inline void weighted_sum(const float* const* weights, const T* const* values, int64_t n, float* const* out) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(values[t] + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g][t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_add_ps(acc[g][c], _mm512_mul_ps(w, v[c]));
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[g] + c * kLanes, acc[g][c]);
}

// weighted_sum for `rows` rows, as many at a time as the registers hold.
template <int C, typename T>
inline void weighted_sums(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                          int64_t rows) {
  constexpr int kAtOnce = C == 4 ? 3 : C == 8 ? 2 : 1;
  int64_t r = 0;
  for (; r + kAtOnce <= rows; r += kAtOnce) weighted_sum<C, kAtOnce>(weights + r, values, n, out + r);
  for (; r < rows; ++r) weighted_sum<C, 1>(weights + r, values, n, out + r);
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

// p[i] = e^(p[i] - max p) for i < n: exp_nonpositive's float operations, 16 at a time where AVX-512 is.
inline void exponentiate(float* p, int64_t n) {
  float top = -INFINITY;  // max is exact: any order finds the same value
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(p);
    for (i = 16; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(p + i));
    top = _mm512_reduce_max_ps(m);
  }
#endif
  for (; i < n; ++i) top = std::max(top, p[i]);
  i = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(top), floor_at = _mm512_set1_ps(-87.3f);
  for (; i + 16 <= n; i += 16) {
    // as exp_nonpositive, operation for operation: std::max(x, c) is max_ps(c, x) (x when not below c)
    const __m512 x = _mm512_max_ps(floor_at, _mm512_sub_ps(_mm512_loadu_ps(p + i), t));
    const __m512 k = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(k, _mm512_set1_ps(2.12194440e-4f)));
    __m512 q = _mm512_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
      q = _mm512_add_ps(_mm512_mul_ps(q, r), _mm512_set1_ps(c));
    const __m512 e = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(q, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
    _mm512_storeu_ps(p + i, _mm512_mul_ps(e, _mm512_castsi512_ps(bits)));
  }
#endif
  for (; i < n; ++i) p[i] = exp_nonpositive(p[i] - top);
}

template <typename T>
inline void add_scaled(float* out, float weight, const T* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] += weight * static_cast<float>(v[d]);
}

// Scratch kept by a thread across its items.
struct Scratch {
  std::vector<float> scores, sums, weights;
  std::vector<const void*> values;
  std::vector<int64_t> k_at, k_scale_at, v_at, v_scale_at;
};

// Where tokens [start, length) of a sequence lie in a cache, for head 0: the element offsets of their
// rows and (int8) of their scales, walking the block table (a division per token cost as much as
// the dot products of a short row).
void locate(const Cache& c, const int32_t* table, int64_t start, int64_t length, int64_t block_size,
            std::vector<int64_t>& rows, std::vector<int64_t>& scales) {
  const int64_t n = length - start;
  rows.resize(n);
  if (c.scale) scales.resize(n);
  int64_t index = start / block_size, offset = start % block_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = table[index];
    rows[i] = block * c.block_stride + offset * c.row_stride;
    if (c.scale) scales[i] = block * c.scale_block + offset * c.scale_row;
    if (++offset == block_size) offset = 0, ++index;
  }
}

// One row's KV heads [first_head, last_head): q and out point at the row's [Hq, D]. Keys [start, length).
// Tokens are the outer loop of the scores, so each K row is read once, front to back, for all those
// heads; each head's numbers are computed alike whichever heads share the call.
template <typename T>
void attend(const float* q, float* out, const Cache& kc, const Cache& vc, const int32_t* table, int64_t start,
            int64_t length, int64_t block_size, int64_t first_head, int64_t last_head, int64_t group, int64_t dim,
            float scale, float softcap, Scratch& scratch) {
  const int64_t n = length - start, rows = (last_head - first_head) * group;  // query heads handled
  std::vector<float>& scores = scratch.scores;
  scores.resize(rows * n);
  locate(kc, table, start, length, block_size, scratch.k_at, scratch.k_scale_at);
  locate(vc, table, start, length, block_size, scratch.v_at, scratch.v_scale_at);
  const T* const k_data = reinterpret_cast<const T*>(kc.data);
  const T* const v_data = reinterpret_cast<const T*>(vc.data);
  const auto k_row = [&](int64_t t, int64_t head) { return k_data + scratch.k_at[t - start] + head * kc.head_stride; };
  const auto v_row = [&](int64_t t, int64_t head) { return v_data + scratch.v_at[t - start] + head * vc.head_stride; };
  const auto k_scale = [&](int64_t t, int64_t head) {
    return kc.scale ? kc.scale[scratch.k_scale_at[t - start] + head * kc.scale_head] : 1.f;
  };
  const auto v_scale = [&](int64_t t, int64_t head) {
    return vc.scale ? vc.scale[scratch.v_scale_at[t - start] + head * vc.scale_head] : 1.f;
  };
  int64_t t = start;
#if defined(__AVX512F__)
  if (dim % kLanes == 0) {  // 16 tokens at a time, the same bits as one by one below
    const T* keys[16];
    float dots[16], k_scales[16];
    for (; t + 16 <= length; t += 16)
      for (int64_t head = first_head; head < last_head; ++head) {
        for (int i = 0; i < 16; ++i) {
          keys[i] = k_row(t + i, head);
          k_scales[i] = k_scale(t + i, head);
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
    for (int64_t head = first_head; head < last_head; ++head) {
      const T* k = k_row(t, head);
      const float row_scale = k_scale(t, head);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = (head - first_head) * group + g;
        float s = dot(q + (head * group + g) * dim, k, dim) * row_scale * scale;
        if (softcap > 0) s = std::tanh(s / softcap) * softcap;
        scores[row * n + t - start] = s;
      }
    }
  }
  std::vector<float>& sums = scratch.sums;
  sums.assign(rows, 0.f);
  for (int64_t row = 0; row < rows; ++row) exponentiate(scores.data() + row * n, n);
  // Each row's sum in token order, the rows interleaved: independent chains, not one long one.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t row = 0; row < rows; ++row) sums[row] += scores[row * n + i];
  float* first_out = out + first_head * group * dim;
#if defined(__AVX512F__)
  const int64_t chunks = dim / kLanes;
  if (dim % kLanes == 0 && (chunks == 4 || chunks == 8 || chunks == 16)) {
    std::vector<float>& weights = scratch.weights;
    std::vector<const void*>& values = scratch.values;
    weights.resize(group * n);
    values.resize(n);
    std::vector<const float*> weight_rows(group);
    std::vector<float*> out_rows(group);
    for (int64_t head = first_head; head < last_head; ++head) {
      for (int64_t t = start; t < length; ++t) values[t - start] = v_row(t, head);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = (head - first_head) * group + g;
        const float* p = scores.data() + row * n;
        if (vc.scale) {  // int8: each token's probability times its value scale (else times 1: itself)
          float* w = weights.data() + g * n;
          for (int64_t t = start; t < length; ++t) w[t - start] = p[t - start] * v_scale(t, head);
          p = w;
        }
        weight_rows[g] = p;
        out_rows[g] = first_out + row * dim;
      }
      const T* const* v = reinterpret_cast<const T* const*>(values.data());
      if (chunks == 4)
        weighted_sums<4>(weight_rows.data(), v, n, out_rows.data(), group);
      else if (chunks == 8)
        weighted_sums<8>(weight_rows.data(), v, n, out_rows.data(), group);
      else
        weighted_sums<16>(weight_rows.data(), v, n, out_rows.data(), group);
    }
  } else
#endif
  {
    std::fill(first_out, first_out + rows * dim, 0.f);
    for (int64_t t = start; t < length; ++t) {
      for (int64_t head = first_head; head < last_head; ++head) {
        const T* v = v_row(t, head);
        const float row_scale = v_scale(t, head);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = (head - first_head) * group + g;
          add_scaled(first_out + row * dim, scores[row * n + t - start] * row_scale, v, dim);
        }
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
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be float32 [rows, heads, dim]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens_in.to(at::kInt).contiguous();
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dim && q_heads % kv_heads == 0, "q and the KV cache disagree on heads or dim");
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one block table and length per row");
  const Cache kc = rows::cache_of(k_cache, k_scale), vc = rows::cache_of(v_cache, v_scale);
  const int64_t group = q_heads / kv_heads;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lp[b] > 0 && (lp[b] + block_size - 1) / block_size <= width, "a context length exceeds its block table");
  if (batch == 0) return out;
  // Work items: whole rows once there are enough to share among the threads, else (row, KV head)
  // pairs; the numbers are the same either way. Threads claim items as they come free: a prompt's
  // later rows cost more than its first, and a thread the OS preempts holds up one item, not a share.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = batch >= threads ? kv_heads : 1;
  const int64_t items_per_row = kv_heads / heads_per_item, items = batch * items_per_row;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
      const int64_t b = item / items_per_row, first = (item % items_per_row) * heads_per_item;
      const int64_t length = lp[b], start = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t offset = b * q_heads * dim;
      const auto run = [&](auto element) {
        attend<decltype(element)>(qp + offset, op + offset, kc, vc, tp + b * width, start, length, block_size, first,
                                  first + heads_per_item, group, dim, static_cast<float>(scale),
                                  static_cast<float>(softcap), scratch);
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
