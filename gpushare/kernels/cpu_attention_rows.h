// cpu_attention.cpp's arithmetic of one row, included by it inside its anonymous namespace (Cache, dot
// and kLanes are cpu_rows.h's): the pair arithmetic of bfloat16 caches, the softmax's exponent and
// denominator, and the ISA helpers (cpu_attention_512.h, cpu_attention_256.h) that do each a register
// at a time in the same float order. Every path of the kernel (a row, a row's KV head, a prompt's
// block) computes a row's numbers with these, so they are the same whichever path ran it.
#pragma once

// The pair arithmetic of bfloat16 caches (head dims a multiple of kPairChunk), what vdpbf16ps computes:
// a query row and a row's probabilities are rounded to bfloat16 (to nearest even; a value below
// float32's normal range becomes zero, as vdpbf16ps flushes it), and a product of two bfloat16 is
// exact in float32. A score adds, pair by pair of dims, the product of dims 2p + 1, then of dims 2p
// (pair_score); a value sum adds, pair by pair of tokens from the row's first key, token t + 1's
// product, then token t's (an odd last token alone). Where the CPU has vdpbf16ps (AVX-512 BF16) it
// does a pair in one instruction on the cache's bits as they lie, for 16 keys or 16 dims at once;
// elsewhere the same float operations give the same bits, but for a product or partial sum below
// float32's normal range (~1e-38), which vdpbf16ps flushes to zero. A tile's keys lie one per lane
// (pair_tile), so a score needs no reduction across a register. Long prompts are attention-bound:
// this does twice the multiply-adds an instruction of float32's (docs/benchmarks.md).
constexpr int64_t kPairChunk = 32;
constexpr int64_t kMaxPairDim = 512;  // prepare() refuses larger head dims of bfloat16 caches

template <typename T>
inline bool by_pairs(int64_t dim) {
  return std::is_same_v<T, c10::BFloat16> && dim % kPairChunk == 0;
}

inline float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits & 0x7F800000u) == 0 ? bits & 0x80000000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, sizeof(bits));
  return x;
}

// The token a pair-ordered value sum over n tokens adds i-th: t + 1, then t, pair by pair (an odd last
// token alone).
inline int64_t pair_order(int64_t i, int64_t n) {
  return i % 2 == 0 ? (i + 1 < n ? i + 1 : i) : i - 1;
}

// Query row x [dim] for the pair arithmetic: rounded, into `rounded` (float32) and `bits` (its bfloat16
// bits, what vdpbf16ps reads).
inline void pair_query(const float* x, int64_t dim, float* rounded, uint16_t* bits) {
  for (int64_t d = 0; d < dim; ++d) {
    rounded[d] = round_bf16(x[d]);
    uint32_t u;
    std::memcpy(&u, &rounded[d], sizeof(u));
    bits[d] = static_cast<uint16_t>(u >> 16);
  }
}

// One key's pair score from a rounded query row. One add a dim: GCC 12's -O3 vectorizer reorders a
// loop that adds the two products of a pair as two statements (wrong sums, seen here).
inline float pair_score(const float* q, const c10::BFloat16* k, int64_t dim) {
  float sum = 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const int64_t i = d ^ 1;  // dims 2p + 1, then 2p
    sum += q[i] * static_cast<float>(k[i]);
  }
  return sum;
}

// What a tile's missing keys read past a row's last key: zeros.
const uint16_t kZeroKey[kMaxPairDim] = {};

// How many of `left` rows to take at once, at most `most`: `most` while that leaves none or enough for
// another call, else about half. A row's sum is one chain of dependent instructions, so a call over
// one or two rows waits out their latency: 30 rows went as 8 + 8 + 8 + 4 + 1 + 1, now 8 + 8 + 7 + 7.
inline int64_t rows_at_once(int64_t left, int64_t most) {
  return left <= most || left >= 2 * most ? std::min(left, most) : (left + 1) / 2;
}

// f.template operator()<N>() for N = min(n, Most), at least 1: a count known at run time as a template's.
template <int Most, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (Most > 1)
    if (n < Most) return with_count<Most - 1>(n, f);
  f.template operator()<Most>();
}

#if defined(__AVX512F__)
#include "cpu_attention_512.h"
#define GPUSHARE_ATTENTION_SIMD 1
#elif defined(__AVX2__)
#include "cpu_attention_256.h"
#define GPUSHARE_ATTENTION_SIMD 1
#endif

#if defined(GPUSHARE_ATTENTION_SIMD)
// pair_scores for `count` query rows against one tile, as many at a time as the registers hold.
inline void pair_scores_of(int64_t count, const float* const* q, const uint16_t* const* bits, const float* tile,
                           int64_t dim, float scale, float* const* out) {
  for (int64_t v = 0, take = 0; v < count; v += take) {
    take = rows_at_once(count - v, 8);
    with_count<8>(take, [&]<int V>() { pair_scores<V>(q + v, bits + v, tile, dim, scale, out + v); });
  }
}

// A row's scores as pair_scores left them (times the scale) through the soft cap, in place.
inline void cap_scores(float* s, int64_t n, float softcap) {
  if (softcap > 0)
    for (int64_t i = 0; i < n; ++i) s[i] = std::tanh(s[i] / softcap) * softcap;
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

// p[i] = e^(p[i] - max p) for i < n: exp_nonpositive's float operations, a register at a time where
// the build has SIMD.
inline void exponentiate(float* p, int64_t n) {
  float top = -INFINITY;  // max is exact: any order finds the same value
  int64_t i = 0;
#if defined(GPUSHARE_ATTENTION_SIMD)
  i = max_simd(p, n, top);
#endif
  for (; i < n; ++i) top = std::max(top, p[i]);
  i = 0;
#if defined(GPUSHARE_ATTENTION_SIMD)
  i = exponentiate_simd(p, n, top);
#endif
  for (; i < n; ++i) p[i] = exp_nonpositive(p[i] - top);
}

// The sum of p[0, n) in dot's order (16 lane sums, its tree, then the last n % 16 in order), which the
// compiler vectorizes: a softmax's denominator, the same for a row whatever path computes it.
// Rounded: p rounded to bfloat16 first, in place (the pair arithmetic's probabilities).
template <bool Rounded>
inline float row_sum(float* p, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      if (Rounded) p[i + j] = round_bf16(p[i + j]);
      lanes[j] += p[i + j];
    }
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  float sum = lanes[0];
  for (; i < n; ++i) {
    if (Rounded) p[i] = round_bf16(p[i]);
    sum += p[i];
  }
  return sum;
}

inline float row_sum(float* p, int64_t n, bool rounded) {
  return rounded ? row_sum<true>(p, n) : row_sum<false>(p, n);
}

template <typename T>
inline void add_scaled(float* out, float weight, const T* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] += weight * static_cast<float>(v[d]);
}
