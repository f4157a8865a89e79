// cpu_attention.cpp's AVX-512 helpers, included by cpu_attention_rows.h inside its anonymous namespace where
// the build has AVX-512 (kLanes is cpu_rows.h's). Each gives the portable loop's float operations in its order.
#pragma once

constexpr int kKeysAtOnce = 16;  // dot_keys' keys

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
// one by one from zero), the G x C sums held in registers across all of t. `resume`: the sums go on
// from those already in out (a float stored and loaded is the same float: the same bits as one run).
// Pairs: the pair arithmetic's order without vdpbf16ps (cpu_attention.cpp's pair_order): token t + 1's
// product, then t's.
template <int C, int G, bool Pairs = false, typename T>
inline void weighted_sum(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                         bool resume) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = resume ? _mm512_loadu_ps(out[g] + c * kLanes) : _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = Pairs ? pair_order(i, n) : i;
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

// k[0, n) widened to float32 into out, n a multiple of 16: load16's values, stored.
template <typename T>
inline void widen(const T* k, int64_t n, float* out) {
  for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(out + d, load16(k + d));
}

// dot16 under the name attend calls.
template <typename T>
inline void dot_keys(const float* q, const T* const* k, int64_t n, float* out) {
  dot16(q, k, n, out);
}

// Whether value_sums takes a head dim.
inline bool values_fit(int64_t dim) {
  const int64_t chunks = dim / kLanes;
  return dim % kLanes == 0 && (chunks == 4 || chunks == 8 || chunks == 16);
}

// The max of p[0, i) into top for the largest multiple i of 16 <= n (max is exact: any order finds
// the same value); returns i.
inline int64_t max_simd(const float* p, int64_t n, float& top) {
  if (n < 16) return 0;
  __m512 m = _mm512_loadu_ps(p);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(p + i));
  top = _mm512_reduce_max_ps(m);
  return i;
}

// p[i] = exp_nonpositive(p[i] - top), operation for operation, for i below the largest multiple of 16
// <= n; returns that multiple.
inline int64_t exponentiate_simd(float* p, int64_t n, float top) {
  int64_t i = 0;
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
  return i;
}

// ---- the pair arithmetic of bfloat16 caches (cpu_attention.cpp's pair_score) ----

// 16 rows of 16 32-bit lanes -> 16 columns: out[j] lane i = r[i] lane j.
inline void transpose16(const __m512i (&r)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + m]: 128-bit lane L holds column 4L + m of rows 4i .. 4i + 3
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)  // rows 8h .. 8h + 7: v[8h + 2m] columns m, m + 8; v[8h + 2m + 1] m + 4, m + 12
    for (int m = 0; m < 4; ++m) {
      v[8 * h + 2 * m] = _mm512_shuffle_i32x4(u[8 * h + m], u[8 * h + m + 4], 0x88);
      v[8 * h + 2 * m + 1] = _mm512_shuffle_i32x4(u[8 * h + m], u[8 * h + m + 4], 0xDD);
    }
  for (int m = 0; m < 4; ++m) {
    out[m] = _mm512_shuffle_i32x4(v[2 * m], v[8 + 2 * m], 0x88);
    out[m + 8] = _mm512_shuffle_i32x4(v[2 * m], v[8 + 2 * m], 0xDD);
    out[m + 4] = _mm512_shuffle_i32x4(v[2 * m + 1], v[9 + 2 * m], 0x88);
    out[m + 12] = _mm512_shuffle_i32x4(v[2 * m + 1], v[9 + 2 * m], 0xDD);
  }
}

#if defined(__AVX512BF16__)
constexpr bool kPairInstruction = true;  // vdpbf16ps: the pair arithmetic in one instruction
#else
constexpr bool kPairInstruction = false;
#endif

// A tile of 16 keys for pair_scores, into `tile` (16 x dim floats of room): for each dim pair p, the
// keys' 32-bit pairs (dims 2p, 2p + 1) side by side (vdpbf16ps); without it, their dims 2p + 1 then
// their dims 2p, widened to float32.
inline void pair_tile(const c10::BFloat16* const* k, int64_t dim, float* tile) {
  for (int64_t c = 0; c < dim / kPairChunk; ++c) {
    __m512i rows[16], columns[16];
    for (int i = 0; i < 16; ++i) rows[i] = _mm512_loadu_si512(k[i] + c * kPairChunk);
    transpose16(rows, columns);
    for (int j = 0; j < 16; ++j) {
      const int64_t p = c * 16 + j;
      if (kPairInstruction) {
        _mm512_storeu_si512(tile + 16 * p, columns[j]);
      } else {
        _mm512_storeu_si512(tile + 32 * p, _mm512_and_si512(columns[j], _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
        _mm512_storeu_si512(tile + 32 * p + 16, _mm512_slli_epi32(columns[j], 16));
      }
    }
  }
}

// The pair scores of V query rows against a tile's 16 keys (a key per lane, so no reduction across
// lanes): pair_score's float operations for every key at once, times `scale`.
template <int V>
inline void pair_scores(const float* const* q, const uint16_t* const* bits, const float* tile, int64_t dim,
                        float scale, float* const* out) {
  __m512 acc[V];
  for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
#if defined(__AVX512BF16__)
    const __m512bh column = (__m512bh)_mm512_loadu_si512(tile + 16 * p);
    for (int v = 0; v < V; ++v) {
      uint32_t pair;
      std::memcpy(&pair, bits[v] + 2 * p, sizeof(pair));
      acc[v] = _mm512_dpbf16_ps(acc[v], (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)), column);
    }
#else
    const __m512 odd = _mm512_loadu_ps(tile + 32 * p), even = _mm512_loadu_ps(tile + 32 * p + 16);
    for (int v = 0; v < V; ++v) {
      acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(_mm512_set1_ps(q[v][2 * p + 1]), odd));
      acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(_mm512_set1_ps(q[v][2 * p]), even));
    }
#endif
  }
  for (int v = 0; v < V; ++v) _mm512_storeu_ps(out[v], _mm512_mul_ps(acc[v], _mm512_set1_ps(scale)));
}

#if defined(__AVX512BF16__)
// The pair value sums of G rows of weights (each rounded to bfloat16 already) over C registers of 16
// dims: a pair of tokens' values interleaved (token t in the low half of a 32-bit lane, t + 1 in the
// high) for vdpbf16ps, which adds t + 1's product, then t's. An odd last token pairs with zeros.
template <int C, int G>
inline void pair_sum(const float* const* weights, const c10::BFloat16* const* values, int64_t n, float* const* out,
                     bool resume) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = resume ? _mm512_loadu_ps(out[g] + c * kLanes) : _mm512_setzero_ps();
  const __m512i interleave = _mm512_set_epi16(  // word 2m: first's m, word 2m + 1: second's m
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const auto weight_pair = [](const float* w, int64_t t, bool lone) {
    uint32_t low, high = 0;
    std::memcpy(&low, w + t, 4);
    if (!lone) std::memcpy(&high, w + t + 1, 4);
    return _mm512_set1_epi32(static_cast<int32_t>((high & 0xFFFF0000u) | (low >> 16)));
  };
  for (int64_t t = 0; t < n; t += 2) {
    const bool lone = t + 1 == n;
    __m512i v[C];
    for (int c = 0; c < C; ++c) {
      const __m512i first = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[t] + c * kLanes)));
      const __m512i second = lone ? _mm512_setzero_si512()
                                  : _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[t + 1] + c * kLanes)));
      v[c] = _mm512_permutex2var_epi16(first, interleave, second);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)weight_pair(weights[g], t, lone);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, (__m512bh)v[c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[g] + c * kLanes, acc[g][c]);
}

// pair_sum for a prompt block's full value tiles, with its two per-pair preparations done once per
// tile instead of once per group of rows: the values interleaved (interleave_pairs, shared by every
// group) and each row's weights packed into their 32-bit pairs (pack_pairs, a load to broadcast). The
// same vdpbf16ps in the same order, so the same bits. Building a pair's weights in scalar registers
// and interleaving its values again for each group of six rows took about a third of pair_sum's time.
#define GPUSHARE_PACKED_PAIRS 1

// n (even) tokens' values, dim = 16 C: for each pair (t, t + 1), C registers as pair_sum interleaves them.
template <int C>
inline void interleave_pairs(const c10::BFloat16* const* values, int64_t n, uint32_t* out) {
  const __m512i interleave = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t t = 0; t < n; t += 2)
    for (int c = 0; c < C; ++c) {
      const __m512i first = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[t] + c * kLanes)));
      const __m512i second = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[t + 1] + c * kLanes)));
      _mm512_storeu_si512(out + (t / 2 * C + c) * kLanes, _mm512_permutex2var_epi16(first, interleave, second));
    }
}

// Weights w[0, n) (n even, each a bfloat16 already) as pair_sum's pairs: out[i] holds w[2i + 1]'s
// upper half above w[2i]'s.
inline void pack_pairs(const float* w, int64_t n, uint32_t* out) {
  const __m512i uppers = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                          27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  int64_t t = 0;
  for (; t + 32 <= n; t += 32)
    _mm512_storeu_si512(out + t / 2, _mm512_permutex2var_epi16(_mm512_loadu_si512(w + t), uppers,
                                                                _mm512_loadu_si512(w + t + 16)));
  for (; t < n; t += 2) {
    uint32_t low, high;
    std::memcpy(&low, w + t, 4);
    std::memcpy(&high, w + t + 1, 4);
    out[t / 2] = (high & 0xFFFF0000u) | (low >> 16);
  }
}

template <int C, int G>
inline void packed_pair_sum(const uint32_t* const* pairs, const uint32_t* values, int64_t count, float* const* out,
                            bool resume) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = resume ? _mm512_loadu_ps(out[g] + c * kLanes) : _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i)
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pairs[g][i]));
      for (int c = 0; c < C; ++c)
        acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, (__m512bh)_mm512_loadu_si512(values + (i * C + c) * kLanes));
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[g] + c * kLanes, acc[g][c]);
}

// packed_pair_sum for `rows` rows, as many at a time as the registers hold (weighted_sums' counts).
template <int C>
inline void packed_pair_sums(const uint32_t* const* pairs, const uint32_t* values, int64_t count, float* const* out,
                             int64_t rows, bool resume) {
  constexpr int kMost = C == 4 ? 6 : C == 8 ? 2 : 1;
  for (int64_t r = 0, take = 0; r < rows; r += take) {
    take = rows_at_once(rows - r, kMost);
    with_count<kMost>(take, [&]<int G>() { packed_pair_sum<C, G>(pairs + r, values, count, out + r, resume); });
  }
}
#else
// The pair value sums without vdpbf16ps: the same float operations, one by one.
template <int C, int G>
inline void pair_sum(const float* const* weights, const c10::BFloat16* const* values, int64_t n, float* const* out,
                     bool resume) {
  weighted_sum<C, G, true>(weights, values, n, out, resume);
}
#endif

// weighted_sum (Pairs: pair_sum) for `rows` rows, as many at a time as the registers hold.
template <int C, bool Pairs, typename T>
inline void weighted_sums(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                          int64_t rows, bool resume) {
  const auto sum = [&]<int G>(int64_t r) {
    if constexpr (Pairs)
      pair_sum<C, G>(weights + r, values, n, out + r, resume);
    else
      weighted_sum<C, G>(weights + r, values, n, out + r, resume);
  };
  constexpr int kAtOnce = C == 4 ? 3 : C == 8 ? 2 : 1;
  int64_t r = 0;
  if constexpr (C == 4)  // a prompt block's many rows: 24 sums, 4 values and a weight fill 29 registers
    for (; r + 6 <= rows; r += 6) sum.template operator()<6>(r);
  for (; r + kAtOnce <= rows; r += kAtOnce) sum.template operator()<kAtOnce>(r);
  for (; r < rows; ++r) sum.template operator()<1>(r);
}

// Pairs: the pair arithmetic's value sums (values bfloat16, weights rounded to it), pairs from token 0.
template <bool Pairs = false, typename T>
inline void value_sums(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                       int64_t rows, int64_t dim, bool resume = false) {
  const int64_t chunks = dim / kLanes;
  if (chunks == 4)
    weighted_sums<4, Pairs>(weights, values, n, out, rows, resume);
  else if (chunks == 8)
    weighted_sums<8, Pairs>(weights, values, n, out, rows, resume);
  else
    weighted_sums<16, Pairs>(weights, values, n, out, rows, resume);
}
