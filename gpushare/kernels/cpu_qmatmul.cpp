// Quantized linears for the CPU: y = x @ w.T for int8 weights (one scale per output channel) or int4
// weights (groups of 32 along K with a scale and a min each: GGUF's Q4_0, Q4_1 and Q4_K exactly),
// against activations quantized to int8 in blocks of 32 along K, one scale per block, as llama.cpp's
// Q8 dot products do. One scale per row cost 6.4% perplexity on SmolLM2, whose hidden states carry
// outliers of ~25,000; a block of 32 keeps an outlier's coarse steps inside its own block.
//
// A block's integer dot product is exact; the float sums over blocks run in one fixed order (blocks
// in K order, one lane per output channel) whatever the number of rows or threads, so a row's result
// is bit for bit the same alone and in any batch. A block's products are, by the build's ISA
// (kernels/cpu_ops.py): AVX-512 VNNI vpdpbusd (unsigned weight bytes times signed activation bytes,
// 16 channels a register); AVX-VNNI's VEX vpdpbusd, 8 channels a register; AVX2 vpmaddubsw/vpmaddwd
// (pairs of products summed in 16 bits, where they cannot saturate: int4 codes are at most 15, and
// int8 codes are multiplied as |w| times x with w's sign, at most 2 x 128 x 127); elsewhere a
// portable loop. Each gives the same integers, and then the same float operations in the same order,
// so the same bits (gpushare/models/cpu_kernels.py measures which kernel wins on the CPU at hand).
//
// Weight layouts, packed at load (cpu_qmatmul.py), in tiles of 16 output channels:
// - int8: [N/16][K/4][16][4] bytes, each the code + 128; y[n] = scale[n] * sum over blocks.
// - int4: [N/16][K/32][4][16][4] bytes: byte (v, c, i) of a block holds channel c's code for
//   k = 4v + i in its low nibble and for k = 16 + 4v + i in its high one; scales and mins
//   [N/16][K/32][16], float16 where that holds them exactly (GGUF's Q4_0 and Q4_1 store them so:
//   0.625 bytes per weight, as the file) or float32; w = scale * code + min.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_qmatmul.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define GPUSHARE_VNNI512 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define GPUSHARE_SIMD256 1
#endif

namespace {

using gpushare::qmatmul::Activations;
using gpushare::qmatmul::kBlock;
using gpushare::qmatmul::kLanes;
using gpushare::qmatmul::kMaxRows;
using gpushare::qmatmul::kMaxTiles;
using gpushare::qmatmul::Weights;

// a block's 16 scales or mins of tile t as float32 (a float16's conversion is exact)
void group_of(const Weights& w, const void* base, int64_t t, int64_t b, float* out) {
  const int64_t at = (t * w.blocks + b) * kLanes;
  if (w.half_groups)
    for (int64_t c = 0; c < kLanes; ++c) out[c] = static_cast<const c10::Half*>(base)[at + c];
  else
    std::memcpy(out, static_cast<const float*>(base) + at, kLanes * sizeof(float));
}

// ---- the portable kernel: one row and one tile at a time, the same float operations in the same order ----

void tile_portable(const Activations& a, int64_t row, const Weights& w, int64_t t, float* out) {
  float acc[kLanes] = {0};
  const uint8_t* codes = w.tile(t);
  for (int64_t b = 0; b < w.blocks; ++b) {
    int32_t dot[kLanes] = {0};
    const int8_t* x = a.codes(row, b);
    if (w.int4) {
      for (int64_t v = 0; v < 4; ++v) {
        const uint8_t* bytes = codes + (b * 4 + v) * 64;
        for (int64_t c = 0; c < kLanes; ++c)
          for (int64_t i = 0; i < 4; ++i) {
            const int32_t byte = bytes[c * 4 + i];
            dot[c] += (byte & 15) * x[4 * v + i] + (byte >> 4) * x[16 + 4 * v + i];
          }
      }
      const float xs = a.scale[a.at(row, b)], xss = a.scaled_sum[a.at(row, b)];
      float d[kLanes], m[kLanes];
      group_of(w, w.group_scales, t, b, d);
      group_of(w, w.group_mins, t, b, m);
      for (int64_t c = 0; c < kLanes; ++c) {
        acc[c] = acc[c] + static_cast<float>(dot[c]) * (d[c] * xs);
        acc[c] = acc[c] + m[c] * xss;
      }
    } else {
      for (int64_t quad = 0; quad < kBlock / 4; ++quad) {
        const uint8_t* bytes = codes + (b * 8 + quad) * 64;
        for (int64_t c = 0; c < kLanes; ++c)
          for (int64_t i = 0; i < 4; ++i) dot[c] += static_cast<int32_t>(bytes[c * 4 + i]) * x[quad * 4 + i];
      }
      const int32_t offset = -128 * a.sum[a.at(row, b)];  // the codes were stored + 128
      const float xs = a.scale[a.at(row, b)];
      for (int64_t c = 0; c < kLanes; ++c) acc[c] = acc[c] + static_cast<float>(dot[c] + offset) * xs;
    }
  }
  for (int64_t c = 0; c < kLanes; ++c) out[c] = w.int4 ? acc[c] : acc[c] * w.scales[t * kLanes + c];
}

#ifdef GPUSHARE_VNNI512

inline __m512 load_group(const Weights& w, const void* base, int64_t t, int64_t b) {
  const int64_t at = (t * w.blocks + b) * kLanes;
  if (w.half_groups)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const c10::Half*>(base) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(base) + at);
}

inline __m512i broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm512_set1_epi32(four);
}

// ROWS rows against TILES tiles, all accumulators in registers.
template <int ROWS, int TILES>
void tiles_vnni(const Activations& a, int64_t row0, const Weights& w, int64_t t0, float* out, int64_t ldo) {
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i dot[ROWS][TILES];
    for (int r = 0; r < ROWS; ++r)
      for (int t = 0; t < TILES; ++t) dot[r][t] = _mm512_setzero_si512();
    if (w.int4) {
      for (int v = 0; v < 4; ++v) {
        __m512i lo[TILES], hi[TILES];
        for (int t = 0; t < TILES; ++t) {
          const __m512i bytes = _mm512_loadu_si512(w.tile(t0 + t) + (b * 4 + v) * 64);
          lo[t] = _mm512_and_si512(bytes, low4);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        }
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* x = a.codes(row0 + r, b);
          const __m512i xlo = broadcast4(x + 4 * v), xhi = broadcast4(x + 16 + 4 * v);
          for (int t = 0; t < TILES; ++t) {
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo[t], xlo);
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi[t], xhi);
          }
        }
      }
      for (int t = 0; t < TILES; ++t) {
        const __m512 d = load_group(w, w.group_scales, t0 + t, b);
        const __m512 m = load_group(w, w.group_mins, t0 + t, b);
        for (int r = 0; r < ROWS; ++r) {
          const __m512 xs = _mm512_set1_ps(a.scale[a.at(row0 + r, b)]);
          const __m512 xss = _mm512_set1_ps(a.scaled_sum[a.at(row0 + r, b)]);
          acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][t]), _mm512_mul_ps(d, xs)));
          acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(m, xss));
        }
      }
    } else {
      for (int quad = 0; quad < kBlock / 4; ++quad) {
        __m512i codes[TILES];
        for (int t = 0; t < TILES; ++t) codes[t] = _mm512_loadu_si512(w.tile(t0 + t) + (b * 8 + quad) * 64);
        for (int r = 0; r < ROWS; ++r) {
          const __m512i x = broadcast4(a.codes(row0 + r, b) + 4 * quad);
          for (int t = 0; t < TILES; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], codes[t], x);
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m512i offset = _mm512_set1_epi32(-128 * a.sum[a.at(row0 + r, b)]);
        const __m512 xs = _mm512_set1_ps(a.scale[a.at(row0 + r, b)]);
        for (int t = 0; t < TILES; ++t)
          acc[r][t] = _mm512_add_ps(acc[r][t],
                                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][t], offset)), xs));
      }
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const __m512 scale = w.int4 ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(w.scales + (t0 + t) * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      // int4 rows are complete already; a multiply by 1 changes nothing
      _mm512_storeu_ps(out + (row0 + r) * ldo + (t0 + t) * kLanes, _mm512_mul_ps(acc[r][t], scale));
    }
  }
}

template <int ROWS>
void rows_vnni(const Activations& a, int64_t row0, const Weights& w, int64_t t0, int64_t tiles, float* out,
               int64_t ldo) {
  if (tiles == 2)
    tiles_vnni<ROWS, 2>(a, row0, w, t0, out, ldo);
  else
    tiles_vnni<ROWS, 1>(a, row0, w, t0, out, ldo);
}

void block_vnni(const Activations& a, int64_t row0, int64_t rows, const Weights& w, int64_t t0, int64_t tiles,
                float* out, int64_t ldo) {
  switch (rows) {
    case 1: rows_vnni<1>(a, row0, w, t0, tiles, out, ldo); break;
    case 2: rows_vnni<2>(a, row0, w, t0, tiles, out, ldo); break;
    case 3: rows_vnni<3>(a, row0, w, t0, tiles, out, ldo); break;
    default: rows_vnni<4>(a, row0, w, t0, tiles, out, ldo); break;
  }
}

#endif

#ifdef GPUSHARE_SIMD256
#include "cpu_qmatmul_256.h"
#endif

// The block kernel's instructions in this build.
std::string kernel_name() {
#if defined(GPUSHARE_VNNI512)
  return "avx512-vnni";
#elif defined(GPUSHARE_SIMD256) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(GPUSHARE_SIMD256)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

namespace gpushare::qmatmul {

Activations activations_for(int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  return Activations{rows, k, blocks, std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
                     std::vector<int32_t>(rows * blocks), std::vector<float>(rows * blocks)};
}

void quantize_row(const float* x_row, Activations& a, int64_t r) {
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* src = x_row + b * kBlock;
    int8_t* dst = a.q.data() + r * a.k + b * kBlock;
    float top = 0;
    for (int64_t i = 0; i < kBlock; ++i) top = std::max(top, std::fabs(src[i]));
    const bool finite = std::isfinite(top);
    const float scale = finite ? top / 127.f : NAN;  // not finite: the rows' outputs are NaN, as a float matmul's
    const float inverse = finite && top > 0 ? 127.f / top : 0.f;
    int32_t total = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      dst[i] = static_cast<int8_t>(std::nearbyint(finite ? src[i] * inverse : 0.f));
      total += dst[i];
    }
    a.scale[a.at(r, b)] = scale;
    a.sum[a.at(r, b)] = total;
    a.scaled_sum[a.at(r, b)] = scale * static_cast<float>(total);
  }
}

Weights weights_of(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                   int64_t n, int64_t k, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  TORCH_CHECK(scales.is_contiguous(), "scales must be contiguous");
  TORCH_CHECK(k % kBlock == 0 && n % kLanes == 0, "K must be a multiple of 32 and N of 16");
  TORCH_CHECK(codes.numel() == n * k * bits / 8, "codes do not hold N x K weights of that width");
  const int64_t blocks = k / kBlock;
  const bool half_groups = scales.scalar_type() == at::kHalf;
  Weights w{codes.data_ptr<uint8_t>(), nullptr, nullptr, nullptr, k * kLanes * bits / 8, blocks, bits == 4,
            half_groups, n};
  if (bits == 4) {
    TORCH_CHECK((half_groups || scales.scalar_type() == at::kFloat) && mins.has_value() && mins->is_contiguous() &&
                    mins->scalar_type() == scales.scalar_type() && scales.numel() == n * blocks &&
                    mins->numel() == n * blocks,
                "int4 needs scales and mins of one dtype (float16 or float32), one per channel per block");
    w.group_scales = scales.data_ptr();
    w.group_mins = mins->data_ptr();
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == n, "int8 needs a float32 scale per channel");
    w.scales = scales.data_ptr<float>();
  }
  return w;
}

void run_group(const Activations& a, const Weights& w, int64_t g, float* out, [[maybe_unused]] bool simd) {
  const int64_t tiles = w.n / kLanes, t0 = g * kMaxTiles, count = std::min<int64_t>(kMaxTiles, tiles - t0);
  for (int64_t row = 0; row < a.rows; row += kMaxRows) {
    const int64_t height = std::min<int64_t>(kMaxRows, a.rows - row);
#if defined(GPUSHARE_VNNI512)
    if (simd) {
      block_vnni(a, row, height, w, t0, count, out, w.n);
      continue;
    }
#elif defined(GPUSHARE_SIMD256)
    if (simd) {
      block_256(a, row, height, w, t0, count, out, w.n);
      continue;
    }
#endif
    for (int64_t r = row; r < row + height; ++r)
      for (int64_t t = t0; t < t0 + count; ++t) tile_portable(a, r, w, t, out + r * w.n + t * kLanes);
  }
}

}  // namespace gpushare::qmatmul

namespace gpushare {

// x [M, K] float32; codes as packed above; bits 8 or 4; portable: the portable kernel even where a SIMD one is.
at::Tensor quantized_matmul(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, int64_t n, int64_t bits, bool portable) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 [rows, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  const Weights w = qmatmul::weights_of(codes, scales, mins, n, k, bits);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  Activations a = qmatmul::activations_for(rows, k);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) qmatmul::quantize_row(xp + r * k, a, r);
  });
  float* op = out.data_ptr<float>();
  // Threads split the output channels: each reads its share of the weights once, every row against it.
  at::parallel_for(0, w.groups(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) qmatmul::run_group(a, w, g, op, !portable);
  });
  return out;
}

// Rows `ids` (int64, any shape) of an int8 weight as packed above, float32 [*ids.shape, k]: the tied
// embedding's lookup, (code - 128) * the row's scale. One call instead of eight torch ops, each a
// dispatch of its own between two reads of the whole model (served at batch 1, the step's start, this
// lookup with the RoPE rows, took ~0.3 ms).
at::Tensor int8_rows(const at::Tensor& codes, const at::Tensor& scales, int64_t k, const at::Tensor& ids_in) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && ids_in.scalar_type() == at::kLong && k % 4 == 0,
              "int8_rows takes packed uint8 codes, float32 scales and int64 ids");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = scales.numel(), count = ids.numel();
  TORCH_CHECK(codes.numel() == n * k && n % qmatmul::kLanes == 0, "int8_rows: codes do not hold ", n, " rows of ", k);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, scales.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < n, "int8_rows: id ", id[i], " out of range");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // [N/16, K/4, 16, 4]: row r's four codes at K/4 step j sit at tile r/16, step j, lane r%16
      const uint8_t* lane = cp + (id[i] / qmatmul::kLanes) * k * qmatmul::kLanes + (id[i] % qmatmul::kLanes) * 4;
      const float scale = sp[id[i]];
      for (int64_t j = 0; j < k / 4; ++j)
        for (int64_t b = 0; b < 4; ++b)
          op[i * k + 4 * j + b] = (static_cast<float>(lane[j * qmatmul::kLanes * 4 + b]) - 128.0f) * scale;
    }
  });
  return out;
}

}  // namespace gpushare

TORCH_LIBRARY_FRAGMENT(gpushare, m) {
  m.def("int8_rows(Tensor codes, Tensor scales, int k, Tensor ids) -> Tensor");
  m.def("quantized_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int n, int bits, bool portable) -> Tensor");
  m.def("quantized_matmul_kernel() -> str", &kernel_name);
}

TORCH_LIBRARY_IMPL(gpushare, CPU, m) {
  m.impl("quantized_matmul", &gpushare::quantized_matmul);
  m.impl("int8_rows", &gpushare::int8_rows);
}
