// cpu_attention.cpp's AVX2 helpers (8 floats a register), included by cpu_attention_rows.h inside its
// anonymous namespace where the build has AVX2 but not AVX-512 (kLanes is cpu_rows.h's): the same functions as
// cpu_attention_512.h, each with the portable loop's float operations in its order.
#pragma once

constexpr int kKeysAtOnce = 8;  // dot_keys' keys

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8(const c10::BFloat16* p) {  // a bfloat16 is a float32's upper half
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
template <>
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// acc + a * b where the product is exact (two bfloat16 values: 16 significant bits of float32's 24), so
// one rounding, a fused multiply-add's, gives add(acc, mul(a, b))'s bits. The pair arithmetic's sums
// are all such. One instruction, not two: with sum_rows' values in registers, its loop alone ran ~25%
// faster than as a multiply and an add (Zen 3); pair_scores measured the same either way. (A product
// below float32's normal range, ~1e-38, is no longer rounded on its own: the pair arithmetic's
// exception against vdpbf16ps, which flushes it, already covers it.)
inline __m256 exact_product_add(__m256 acc, __m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, acc); }

// k[0, n) widened to float32 into out, n a multiple of 8: load8's values, stored.
template <typename T>
inline void widen(const T* k, int64_t n, float* out) {
  for (int64_t d = 0; d < n; d += 8) _mm256_storeu_ps(out + d, load8(k + d));
}

// For 4 keys k[t], n a multiple of 16: dot's 16 lane sums as two registers (lanes 0-7, 8-15), then its
// width-8 step, lane j + lane j + 8: sums[t] holds key t's 8 partial sums.
template <typename T>
inline void four_keys(const float* q, const T* const* k, int64_t n, __m256 (&sums)[4]) {
  __m256 low[4], high[4];
  for (int t = 0; t < 4; ++t) low[t] = high[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += kLanes) {
    const __m256 q_low = _mm256_loadu_ps(q + d), q_high = _mm256_loadu_ps(q + d + 8);
    for (int t = 0; t < 4; ++t) {
      low[t] = _mm256_add_ps(low[t], _mm256_mul_ps(q_low, load8(k[t] + d)));
      high[t] = _mm256_add_ps(high[t], _mm256_mul_ps(q_high, load8(k[t] + d + 8)));
    }
  }
  for (int t = 0; t < 4; ++t) sums[t] = _mm256_add_ps(low[t], high[t]);
}

// four_keys' sums through dot's widths 4 and 2: 128-bit half h holds key h's two sums in lanes 0-1 and
// key 2 + h's in lanes 2-3.
inline __m256 widths_4_and_2(const __m256 (&s)[4]) {
  // width 4: keys 0 and 1 (then 2 and 3), 4 sums each, a key per 128-bit half
  const __m256 a = _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20), _mm256_permute2f128_ps(s[0], s[1], 0x31));
  const __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(s[2], s[3], 0x20), _mm256_permute2f128_ps(s[2], s[3], 0x31));
  // width 2: in each half, lanes 0-1 from a, 2-3 from b
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

// dot(q, k[t], n) for 8 rows k[t] at once, n a multiple of 16, in dot's order (so the same bits): the
// trees of 8 keys run together by pairing registers up, as cpu_attention_512.h's dot16 does for 16.
template <typename T>
inline void dot_keys(const float* q, const T* const* k, int64_t n, float* out) {
  __m256 first[4], second[4];
  four_keys(q, k, n, first);
  four_keys(q, k + 4, n, second);
  const __m256 a = widths_4_and_2(first), b = widths_4_and_2(second);
  // width 1: lanes of half h hold keys h, 2 + h, 4 + h, 6 + h
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// out[g][8 c0, 8 (c0 + C)) = the sum over t, in t's order, of weights[g][t] * values_of(t)'s there, for
// G rows of weights at once: add_scaled's float operations, the G x C sums in registers across all of
// t. `resume`: the sums go on from those already in out (the same bits as one run). Pairs: the pair
// arithmetic's order (cpu_attention.cpp's pair_order), walked two tokens at a time: token t + 1's
// product, then t's (an odd last token alone), with no index to look up per token.
template <int C, int G, bool Pairs, typename ValuesOf>
inline void sum_rows(const float* const* weights, ValuesOf values_of, int64_t n, float* const* out, int64_t c0,
                     bool resume) {
  __m256 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = resume ? _mm256_loadu_ps(out[g] + (c0 + c) * 8) : _mm256_setzero_ps();
  // A register of values at a time, used by every row at once: loading a token's C registers first (GCC
  // then loaded two tokens' at once for tile_sum<4, 2>) left too few of AVX2's 16 registers for the G x C
  // sums, and two of them went to the stack, each step waiting on a store and a load.
  const auto add = [&](int64_t t) {
    const auto* row = values_of(t);
    __m256 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm256_set1_ps(weights[g][t]);
    for (int c = 0; c < C; ++c) {
      __m256 v = load8(row + (c0 + c) * 8);
      // in a register for all G rows: GCC otherwise loads it again into each row's multiply-add, twice
      // the loads (as a multiply and an add, the folded loads measured a little faster)
      if constexpr (Pairs && G > 1) asm("" : "+x"(v));
      for (int g = 0; g < G; ++g) acc[g][c] = Pairs ? exact_product_add(acc[g][c], w[g], v)
                                                    : _mm256_add_ps(acc[g][c], _mm256_mul_ps(w[g], v));
    }
  };
  int64_t t = 0;
  if constexpr (Pairs)
    for (; t + 1 < n; t += 2) add(t + 1), add(t);
  for (; t < n; ++t) add(t);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[g] + (c0 + c) * 8, acc[g][c]);
}

// sum_rows over one pointer per token (a paged cache's rows).
template <int C, int G, bool Pairs, typename T>
inline void weighted_sum(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                         int64_t c0, bool resume) {
  sum_rows<C, G, Pairs>(weights, [values](int64_t t) { return values[t]; }, n, out, c0, resume);
}

// weighted_sum over `chunks` registers of columns, C at a time, for `rows` rows, as many as the
// registers hold (the 16 of AVX2: G x C sums and C values).
template <int C, bool Pairs, typename T>
inline void slabs(const float* const* weights, const T* const* values, int64_t n, float* const* out, int64_t rows,
                  int64_t chunks, bool resume) {
  constexpr int kAtOnce = C <= 2 ? 4 : C <= 4 ? 2 : 1;
  for (int64_t c0 = 0; c0 < chunks; c0 += C) {
    int64_t r = 0;
    for (; r + kAtOnce <= rows; r += kAtOnce)
      weighted_sum<C, kAtOnce, Pairs>(weights + r, values, n, out + r, c0, resume);
    for (; r < rows; ++r) weighted_sum<C, 1, Pairs>(weights + r, values, n, out + r, c0, resume);
  }
}

// Whether value_sums takes a head dim.
inline bool values_fit(int64_t dim) { return dim % 8 == 0; }

template <bool Pairs = false, typename T>
inline void value_sums(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                       int64_t rows, int64_t dim, bool resume = false) {
  const int64_t chunks = dim / 8;
  int64_t width = std::min<int64_t>(8, chunks);  // the widest slab that divides the columns
  while (chunks % width != 0) --width;
  switch (width) {
    case 8: slabs<8, Pairs>(weights, values, n, out, rows, chunks, resume); break;
    case 7: slabs<7, Pairs>(weights, values, n, out, rows, chunks, resume); break;
    case 6: slabs<6, Pairs>(weights, values, n, out, rows, chunks, resume); break;
    case 5: slabs<5, Pairs>(weights, values, n, out, rows, chunks, resume); break;
    case 4: slabs<4, Pairs>(weights, values, n, out, rows, chunks, resume); break;
    case 3: slabs<3, Pairs>(weights, values, n, out, rows, chunks, resume); break;
    case 2: slabs<2, Pairs>(weights, values, n, out, rows, chunks, resume); break;
    default: slabs<1, Pairs>(weights, values, n, out, rows, chunks, resume); break;
  }
}

// sum_rows over a contiguous float32 tile of n tokens, row stride `dim`.
template <int C, int G, bool Pairs>
inline void tile_sum(const float* const* weights, const float* values, int64_t n, int64_t dim, float* const* out,
                     int64_t c0, bool resume) {
  sum_rows<C, G, Pairs>(weights, [values, dim](int64_t t) { return values + t * dim; }, n, out, c0, resume);
}

// value_sums over a prompt block's value tile widened to float32 once for all its rows (contiguous, row
// stride `dim`, a multiple of 16): two rows and four registers of columns at once (four rows and two
// for the last columns of a dim that is not a multiple of 32), so each value is loaded once for both
// rows. The same float operations as value_sums, in the same order; the conversions that value_sums
// makes per row were as many instructions as its multiplies and adds.
#define GPUSHARE_WIDE_VALUES 1
template <bool Pairs>
inline void wide_value_sums(const float* const* weights, const float* values, int64_t n, float* const* out,
                            int64_t rows, int64_t dim, bool resume) {
  const int64_t chunks = dim / 8;
  int64_t c0 = 0;
  for (; c0 + 4 <= chunks; c0 += 4) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) tile_sum<4, 2, Pairs>(weights + r, values, n, dim, out + r, c0, resume);
    if (r < rows) tile_sum<4, 1, Pairs>(weights + r, values, n, dim, out + r, c0, resume);
  }
  if (c0 < chunks) {  // two registers left
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) tile_sum<2, 4, Pairs>(weights + r, values, n, dim, out + r, c0, resume);
    for (; r < rows; ++r) tile_sum<2, 1, Pairs>(weights + r, values, n, dim, out + r, c0, resume);
  }
}

// ---- the pair arithmetic of bfloat16 caches (cpu_attention.cpp's pair_score), in float operations ----

constexpr bool kPairInstruction = false;

// 8 rows of 8 32-bit lanes -> 8 columns: out[j] lane i = r[i] lane j.
inline void transpose8(const __m256i (&r)[8], __m256i (&out)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[2 * i]), _mm256_castsi256_ps(r[2 * i + 1]));
    t[2 * i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[2 * i]), _mm256_castsi256_ps(r[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + m]: 128-bit half h holds column 4h + m of rows 4i .. 4i + 3
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int m = 0; m < 4; ++m) {
    out[m] = _mm256_castps_si256(_mm256_permute2f128_ps(u[m], u[m + 4], 0x20));
    out[m + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(u[m], u[m + 4], 0x31));
  }
}

// A tile of 8 keys for pair_scores, into `tile` (8 x dim floats of room): for each dim pair p, the
// keys' dims 2p + 1, then their dims 2p, widened to float32.
inline void pair_tile(const c10::BFloat16* const* k, int64_t dim, float* tile) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t c = 0; c < dim / 16; ++c) {
    __m256i rows[8], columns[8];
    for (int i = 0; i < 8; ++i) rows[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[i] + c * 16));
    transpose8(rows, columns);
    for (int j = 0; j < 8; ++j) {
      const int64_t p = c * 8 + j;
      _mm256_storeu_ps(tile + 16 * p, _mm256_castsi256_ps(_mm256_and_si256(columns[j], odd)));
      _mm256_storeu_ps(tile + 16 * p + 8, _mm256_castsi256_ps(_mm256_slli_epi32(columns[j], 16)));
    }
  }
}

// The pair scores of V query rows against a tile's 8 keys, a key per lane: pair_score's float operations,
// times `scale`.
template <int V>
inline void pair_scores(const float* const* q, const uint16_t* const*, const float* tile, int64_t dim,
                        float scale, float* const* out) {
  __m256 acc[V];
  for (int v = 0; v < V; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
    const __m256 odd = _mm256_loadu_ps(tile + 16 * p), even = _mm256_loadu_ps(tile + 16 * p + 8);
    for (int v = 0; v < V; ++v) {
      acc[v] = exact_product_add(acc[v], _mm256_set1_ps(q[v][2 * p + 1]), odd);
      acc[v] = exact_product_add(acc[v], _mm256_set1_ps(q[v][2 * p]), even);
    }
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(out[v], _mm256_mul_ps(acc[v], _mm256_set1_ps(scale)));
}

// The max of p[0, i) into top for the largest multiple i of 8 <= n (max is exact: any order finds the
// same value); returns i.
inline int64_t max_simd(const float* p, int64_t n, float& top) {
  if (n < 8) return 0;
  __m256 m = _mm256_loadu_ps(p);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  top = *std::max_element(lanes, lanes + 8);
  return i;
}

// p[i] = exp_nonpositive(p[i] - top), operation for operation, for i below the largest multiple of 8
// <= n; returns that multiple.
inline int64_t exponentiate_simd(float* p, int64_t n, float top) {
  int64_t i = 0;
  const __m256 t = _mm256_set1_ps(top), floor_at = _mm256_set1_ps(-87.3f);
  for (; i + 8 <= n; i += 8) {
    // std::max(x, c) is max_ps(c, x) (x when not below c)
    const __m256 x = _mm256_max_ps(floor_at, _mm256_sub_ps(_mm256_loadu_ps(p + i), t));
    const __m256 k = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                   _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(k, _mm256_set1_ps(2.12194440e-4f)));
    __m256 q = _mm256_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
      q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(c));
    const __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(q, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(p + i, _mm256_mul_ps(e, _mm256_castsi256_ps(bits)));
  }
  return i;
}
