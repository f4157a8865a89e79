// cpu_qmatmul.cpp's 256-bit block kernel (AVX2, with AVX-VNNI where the build has it), included by it
// inside its anonymous namespace where GPUSHARE_SIMD256 is defined: Activations, Weights, kBlock and
// kLanes are its. A register holds half a tile (8 output channels); a block's integer products are
// exact either way, and the float operations are the portable loop's, in its order.
#pragma once

// a block's 8 scales or mins of half h of tile t as float32 (a float16's conversion is exact)
inline __m256 load_group8(const Weights& w, const void* base, int64_t t, int64_t b, int h) {
  const int64_t at = (t * w.blocks + b) * kLanes + h * 8;
  if (w.half_groups)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(base) + at)));
  return _mm256_loadu_ps(static_cast<const float*>(base) + at);
}

// x, as far as the compiler knows, changed: integer adds are associative, so GCC rewrote a block's
// running sums as trees over all its (fully unrolled) products, which it kept on the stack, 64
// stores and loads a block for four rows; pinned after each step the sums stay in registers.
inline void pinned(__m256i& x) { asm("" : "+x"(x)); }

inline __m256i broadcast4_256(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

// dot[r][h] = block b's sum of (code - 128) * x per channel, rows row0.., tile t (int8 weights).
template <int ROWS>
inline void int8_block_256(const Activations& a, int64_t row0, const Weights& w, int64_t t, int64_t b,
                           __m256i (&dot)[ROWS][2]) {
  for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#ifndef __AVXVNNI__
  const __m256i sign_bits = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
#endif
  for (int quad = 0; quad < kBlock / 4; ++quad) {
    __m256i codes[2];
    for (int h = 0; h < 2; ++h)
      codes[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.tile(t) + (b * 8 + quad) * 64 + h * 32));
#ifdef __AVXVNNI__
    for (int r = 0; r < ROWS; ++r) {
      const __m256i x = broadcast4_256(a.codes(row0 + r, b) + 4 * quad);
      for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], codes[h], x);
    }
#else
    __m256i weight[2], magnitude[2];  // the signed code, and |code| as an unsigned byte (128 for -128)
    for (int h = 0; h < 2; ++h) {
      weight[h] = _mm256_xor_si256(codes[h], sign_bits);
      magnitude[h] = _mm256_abs_epi8(weight[h]);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256i x = broadcast4_256(a.codes(row0 + r, b) + 4 * quad);
      for (int h = 0; h < 2; ++h) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(x, weight[h]));
        dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
        pinned(dot[r][h]);
      }
    }
#endif
  }
#ifdef __AVXVNNI__
  for (int r = 0; r < ROWS; ++r) {  // the codes were stored + 128
    const __m256i offset = _mm256_set1_epi32(-128 * a.sum[a.at(row0 + r, b)]);
    for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_add_epi32(dot[r][h], offset);
  }
#endif
}

// dot[r][h] = block b's sum of code * x per channel, rows row0.., tile t (int4 weights).
template <int ROWS>
inline void int4_block_256(const Activations& a, int64_t row0, const Weights& w, int64_t t, int64_t b,
                           __m256i (&dot)[ROWS][2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // without VNNI: 16-bit sums of 16 products of at most 15 x 127 each, 30,480 at most, widened once
  for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
  for (int v = 0; v < 4; ++v) {
    __m256i lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.tile(t) + (b * 4 + v) * 64 + h * 32));
      lo[h] = _mm256_and_si256(bytes, low4);
      hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    }
    for (int r = 0; r < ROWS; ++r) {
      const int8_t* x = a.codes(row0 + r, b);
      const __m256i xlo = broadcast4_256(x + 4 * v), xhi = broadcast4_256(x + 16 + 4 * v);
      for (int h = 0; h < 2; ++h) {
#ifdef __AVXVNNI__
        dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], lo[h], xlo);
        dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], hi[h], xhi);
#else
        dot[r][h] = _mm256_add_epi16(dot[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xlo),
                                                                 _mm256_maddubs_epi16(hi[h], xhi)));
        pinned(dot[r][h]);
#endif
      }
    }
  }
#ifndef __AVXVNNI__
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(dot[r][h], ones);
#endif
}

// ROWS rows against tile t, the float sums in registers.
template <int ROWS>
void tile_256(const Activations& a, int64_t row0, const Weights& w, int64_t t, float* out, int64_t ldo) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i dot[ROWS][2];
    if (w.int4) {
      int4_block_256<ROWS>(a, row0, w, t, b, dot);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = load_group8(w, w.group_scales, t, b, h), m = load_group8(w, w.group_mins, t, b, h);
        for (int r = 0; r < ROWS; ++r) {
          const __m256 xs = _mm256_set1_ps(a.scale[a.at(row0 + r, b)]);
          const __m256 xss = _mm256_set1_ps(a.scaled_sum[a.at(row0 + r, b)]);
          acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, xs)));
          acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(m, xss));
        }
      }
    } else {
      int8_block_256<ROWS>(a, row0, w, t, b, dot);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xs = _mm256_set1_ps(a.scale[a.at(row0 + r, b)]);
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][h]), xs));
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    float* column = out + t * kLanes + h * 8;
    if (w.int4) {
      for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(column + (row0 + r) * ldo, acc[r][h]);
    } else {
      const __m256 scale = _mm256_loadu_ps(w.scales + t * kLanes + h * 8);
      for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(column + (row0 + r) * ldo, _mm256_mul_ps(acc[r][h], scale));
    }
  }
}

void block_256(const Activations& a, int64_t row0, int64_t rows, const Weights& w, int64_t t0, int64_t tiles,
               float* out, int64_t ldo) {
  for (int64_t t = t0; t < t0 + tiles; ++t) switch (rows) {
      case 1: tile_256<1>(a, row0, w, t, out, ldo); break;
      case 2: tile_256<2>(a, row0, w, t, out, ldo); break;
      case 3: tile_256<3>(a, row0, w, t, out, ldo); break;
      default: tile_256<4>(a, row0, w, t, out, ldo); break;
    }
}
