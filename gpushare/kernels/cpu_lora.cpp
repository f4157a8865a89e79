// Batched LoRA on the CPU: each row's own adapter added to a linear's output in one call, row by row,
// from float32 or bfloat16 stacks with float32 sums (kernels/lora_torch.py has the layout and is the
// reference). Per row t of slot s >= 0: shrink x[t] by
// A[s] into `rank` floats, then y[t, o] += scale[s] * sum_r shrunk[r] * B[s, r, o] for each output
// column o (B is stored transposed, [rank, out]: the expand runs along a rank's contiguous columns).
//
// Why row by row rather than one matmul per adapter: a step's rows mix adapters, and a gather, two
// matmuls and a scatter per adapter cost more in dispatch than the few thousand multiply-adds a row's
// adapter is. A decode row's whole call stays under the parallel grain, so it runs inline on the
// calling thread (no wake of the pool); many rows split over rows (shrink) and output tiles (expand).
// Each shrunk value is one fixed-order dot (rows::dot) and each output column sums the rank in rank
// order, one multiply and one add at a time (the build's -ffp-contract=off forbids fusing them), whatever
// the thread count or ISA: the same bits. The expand's inner loop is over a tile's columns, which the
// compiler vectorizes without reordering any column's sum.
//
// y may be a column slice of a wider row-major tensor (the fused qkv or gate_up output): only its
// last dim need be contiguous, so the caller passes y.narrow(1, start, width) without a copy.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_rows.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using gpushare::rows::dot;

constexpr int64_t kColumns = 64;        // output columns per expand task
constexpr int64_t kGrainMacs = 32768;   // multiply-adds below which a loop is not worth a thread's wake

// A row of x as float32: itself, or converted into `scratch`.
const float* float_row(const at::Tensor& x, int64_t t, std::vector<float>& scratch) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>() + t * x.stride(0);
  const c10::BFloat16* row = x.data_ptr<c10::BFloat16>() + t * x.stride(0);
  for (size_t d = 0; d < scratch.size(); ++d) scratch[d] = static_cast<float>(row[d]);
  return scratch.data();
}

// y[o] += delta for `n` columns, as torch's `y += delta.to(y.dtype)`: for bfloat16 y the delta is
// rounded to bfloat16 first, then the sum.
template <typename T>
void add_columns(T* y, const float* delta, int64_t n) {
  for (int64_t o = 0; o < n; ++o) {
    if constexpr (std::is_same_v<T, float>) {
      y[o] += delta[o];
    } else {
      y[o] = c10::BFloat16(static_cast<float>(y[o]) + static_cast<float>(c10::BFloat16(delta[o])));
    }
  }
}

// The shrink and the expand of every adapter row, on stacks of float32 or bfloat16 W (widened to float32
// as they load; every sum in float32).
template <typename W>
void apply_stacks(const at::Tensor& y, const at::Tensor& x, const W* ap, const W* bp, int64_t rank,
                  const int32_t* slot, const float* scale) {
  const int64_t rows = y.size(0), out = y.size(1), in = x.size(1);
  std::vector<float> shrunk(rows * rank);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainMacs / std::max<int64_t>(1, rank * in)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(x.scalar_type() == at::kFloat ? 0 : in);
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      const float* xr = float_row(x, t, scratch);
      const W* as = ap + slot[t] * rank * in;
      for (int64_t r = 0; r < rank; ++r) shrunk[t * rank + r] = dot(xr, as + r * in, in);
    }
  });

  const int64_t tiles = (out + kColumns - 1) / kColumns;
  at::parallel_for(0, rows * tiles, std::max<int64_t>(1, kGrainMacs / (kColumns * rank)),
                   [&](int64_t begin, int64_t end) {
    float delta[kColumns];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / tiles, first = task % tiles * kColumns, n = std::min(kColumns, out - first);
      if (slot[t] < 0) continue;
      const float* sr = shrunk.data() + t * rank;
      const W* bs = bp + slot[t] * rank * out + first;
      std::fill(delta, delta + n, 0.0f);
      for (int64_t r = 0; r < rank; ++r) {
        const float s = sr[r];
        const W* br = bs + r * out;
        for (int64_t o = 0; o < n; ++o) delta[o] += s * static_cast<float>(br[o]);
      }
      for (int64_t o = 0; o < n; ++o) delta[o] *= scale[slot[t]];
      if (y.scalar_type() == at::kFloat) {
        add_columns(y.data_ptr<float>() + t * y.stride(0) + first, delta, n);
      } else {
        add_columns(y.data_ptr<c10::BFloat16>() + t * y.stride(0) + first, delta, n);
      }
    }
  });
}

}  // namespace

namespace gpushare {

void lora_apply(const at::Tensor& y, const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& b_in,
                const at::Tensor& slot_of_row_in, const at::Tensor& scale_of_slot_in) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "lora_apply: y must be float32 or bfloat16 [rows, out] with contiguous columns");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == y.size(0) &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "lora_apply: x must be float32 or bfloat16 [rows, in], a row per row of y");
  TORCH_CHECK(a_in.dim() == 3 && b_in.dim() == 3 && a_in.scalar_type() == b_in.scalar_type() &&
                  (a_in.scalar_type() == at::kFloat || a_in.scalar_type() == at::kBFloat16) &&
                  a_in.size(0) == b_in.size(0) && a_in.size(1) == b_in.size(1) && a_in.size(2) == x_in.size(1) &&
                  b_in.size(2) == y.size(1),
              "lora_apply: a_stack [slots, rank, in] and b_stack [slots, rank, out], both float32 or both "
              "bfloat16, must fit x and y");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const at::Tensor slots = slot_of_row_in.to(at::kInt).contiguous();
  const at::Tensor scales = scale_of_slot_in.to(at::kFloat).contiguous();
  const int64_t rows = y.size(0), slot_count = a.size(0);
  const int32_t* slot = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] < slot_count, "lora_apply: row ", t, " has slot ", slot[t], " of ", slot_count);
  if (rows == 0 || a.size(1) == 0) return;
  if (a.scalar_type() == at::kFloat) {
    apply_stacks(y, x, a.data_ptr<float>(), b.data_ptr<float>(), a.size(1), slot, scales.data_ptr<float>());
  } else {
    apply_stacks(y, x, a.data_ptr<c10::BFloat16>(), b.data_ptr<c10::BFloat16>(), a.size(1), slot,
                 scales.data_ptr<float>());
  }
}

}  // namespace gpushare

TORCH_LIBRARY_FRAGMENT(gpushare, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor a_stack, Tensor b_stack, Tensor slot_of_row, "
        "Tensor scale_of_slot) -> ()");
}

TORCH_LIBRARY_IMPL(gpushare, CPU, m) { m.impl("lora_apply", &gpushare::lora_apply); }
