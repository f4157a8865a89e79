// cpu_qmatmul.cpp's state, shared with the callers that split a linear's work among their own
// threads (cpu_decode.cpp's team): a linear is two phases, each row of its input quantized
// (quantize_row), then each group of its output channels computed against all the rows (run_group).
// A row's numbers are the same whoever runs which part.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace gpushare::qmatmul {

constexpr int64_t kBlock = 32;  // K elements per activation scale and per int4 weight group
constexpr int64_t kLanes = 16;  // output channels per tile
constexpr int kMaxRows = 4;     // rows per register tile
constexpr int kMaxTiles = 2;    // tiles per register tile: a group of output channels is 32

struct Activations {
  int64_t rows, k, blocks;
  std::vector<int8_t> q;          // [rows, k]
  std::vector<float> scale;       // [rows, blocks]
  std::vector<int32_t> sum;       // [rows, blocks]: a block's codes summed
  std::vector<float> scaled_sum;  // scale * sum: what a block's int4 mins multiply

  const int8_t* codes(int64_t row, int64_t block) const { return q.data() + row * k + block * kBlock; }
  int64_t at(int64_t row, int64_t block) const { return row * blocks + block; }
};

struct Weights {
  const uint8_t* codes;
  const float* scales;       // int8: [N]
  const void* group_scales;  // int4: [N/16][K/32][16], float16 or float32
  const void* group_mins;
  int64_t tile_bytes;  // one tile's codes
  int64_t blocks;
  bool int4, half_groups;
  int64_t n;  // output channels
  const uint8_t* tile(int64_t t) const { return codes + t * tile_bytes; }
  int64_t groups() const { return (n / kLanes + kMaxTiles - 1) / kMaxTiles; }
};

// Room for `rows` rows of K = k (a multiple of 32).
Activations activations_for(int64_t rows, int64_t k);

// Row r of a from x_row [k] (float32): int8 codes in blocks of 32, one scale per block.
void quantize_row(const float* x_row, Activations& a, int64_t r);

// The packed weights of an N x K linear (cpu_qmatmul.py's layout), checked.
Weights weights_of(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                   int64_t n, int64_t k, int64_t bits);

// Output channels [32 g, 32 g + 32) of every row into out [rows, w.n]; simd false: the portable loop.
void run_group(const Activations& a, const Weights& w, int64_t g, float* out, bool simd);

}  // namespace gpushare::qmatmul
