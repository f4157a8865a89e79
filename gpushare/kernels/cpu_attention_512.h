// cpu_attention.cpp's AVX-512 helpers, included by it inside its anonymous namespace where the build
// has AVX-512 (kLanes is cpu_rows.h's). Each gives the portable loop's float operations in its order.
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
template <int C, int G, typename T>
inline void weighted_sum(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                         bool resume) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = resume ? _mm512_loadu_ps(out[g] + c * kLanes) : _mm512_setzero_ps();
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
                          int64_t rows, bool resume) {
  constexpr int kAtOnce = C == 4 ? 3 : C == 8 ? 2 : 1;
  int64_t r = 0;
  if constexpr (C == 4)  // a prompt block's many rows: 24 sums, 4 values and a weight fill 29 registers
    for (; r + 6 <= rows; r += 6) weighted_sum<C, 6>(weights + r, values, n, out + r, resume);
  for (; r + kAtOnce <= rows; r += kAtOnce) weighted_sum<C, kAtOnce>(weights + r, values, n, out + r, resume);
  for (; r < rows; ++r) weighted_sum<C, 1>(weights + r, values, n, out + r, resume);
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

template <typename T>
inline void value_sums(const float* const* weights, const T* const* values, int64_t n, float* const* out,
                       int64_t rows, int64_t dim, bool resume = false) {
  const int64_t chunks = dim / kLanes;
  if (chunks == 4)
    weighted_sums<4>(weights, values, n, out, rows, resume);
  else if (chunks == 8)
    weighted_sums<8>(weights, values, n, out, rows, resume);
  else
    weighted_sums<16>(weights, values, n, out, rows, resume);
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
