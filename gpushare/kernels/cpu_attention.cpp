// The CPU's paged attention: every query row attends to its own sequence's cached keys up to its
// position, reading K/V blocks where they lie. A decode row and a prompt row are the same computation
// (a prompt's row r is its sequence at length r + 1), so a token's numbers are the same whether its
// step decoded it or prefilled it, alone or in any batch, with its prefix cached or computed afresh.
//
// The torch path (paged_attention_torch.py) gathers every sequence's blocks into a contiguous copy and
// runs one SDPA per sequence: at batch 16 that is ~40% of a decode step in small ops, and SDPA's
// blocking rounds a prompt's rows differently from the decode rows that follow them. Here one call does
// the whole batch: work items are rows, or (row, KV head) pairs while there are fewer rows than
// threads, or blocks of a prompt's consecutive rows and one KV head (cpu_attention_prompt.h), claimed
// by torch's intra-op threads as they come free; each row's arithmetic is the same whatever the
// batch, the item it is in or the thread count (fixed lanes, fixed order). Where the build has AVX-512 or AVX2
// (kernels/cpu_ops.py picks its ISA), scores run 16 or 8 keys at a time and the softmax and value sums
// a register at a time (cpu_attention_512.h, cpu_attention_256.h), each in the plain loop's float order.
//
// q [R, Hq, D] float32; k_cache/v_cache [num_blocks, block_size, Hkv, D], float32, bfloat16 or int8 (then
// k_scale/v_scale [num_blocks, block_size, Hkv] float32: value = data * scale), the last dim contiguous,
// blocks at any stride; block_tables [R, W] int32 (row r's sequence's table); context_lens [R] int32
// (row r's position + 1). window > 0 keeps the last `window` keys; softcap > 0 caps scores as tanh(s/c)*c.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "cpu_rows.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using gpushare::rows::Cache;
using gpushare::rows::dot;
using gpushare::rows::kLanes;

#include "cpu_attention_rows.h"

// Scratch kept by a thread across its items.
struct Scratch {
  std::vector<float> scores, sums, weights, queries, tile_scores;  // queries: rounded rows (pairs)
  gpushare::rows::AlignedVector<float> wide_keys;
  std::vector<uint16_t> query_bits;
  std::vector<const float*> query_rows;
  std::vector<const uint16_t*> query_bit_rows;
  std::vector<float*> tile_score_rows;
  std::vector<const void*> values;
  gpushare::rows::AlignedVector<float> wide_values;  // a prompt block's value tile in float32 (cpu_attention_256.h)
  std::vector<int64_t> k_at, k_scale_at, v_at, v_scale_at;
  std::vector<int64_t> lengths;      // a prompt block's vectors' keys
  std::vector<float*> outputs;       // and their output rows
  std::vector<uint32_t> value_pairs, weight_pairs;  // a value tile's, packed (cpu_attention_512.h)
  std::vector<const uint32_t*> weight_pair_rows;
  // Per KV head, the pair arithmetic's key tiles (pair_tile) and value tiles (interleave_pairs) of the
  // prompt whose blocks this thread ran last, from token 0: its next block reads them again.
  struct KeptTiles {
    int64_t prompt = -1, keys = 0, values = 0, wide_values = 0;  // tokens kept
    gpushare::rows::AlignedVector<float> key_tiles;
    std::vector<uint32_t> value_tiles;
    gpushare::rows::AlignedVector<float> wide_value_tiles;  // the values in float32 (cpu_attention_256.h's wide_value_sums)
  };
  std::vector<KeptTiles> kept;
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
  const bool pairs = by_pairs<T>(dim);
  if (pairs) {  // each query head's row for the pair arithmetic
    scratch.queries.resize(rows * dim);
    scratch.query_bits.resize(rows * dim);
    for (int64_t head = first_head; head < last_head; ++head)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = (head - first_head) * group + g;
        pair_query(q + (head * group + g) * dim, dim, scratch.queries.data() + row * dim,
                   scratch.query_bits.data() + row * dim);
      }
  }
  const auto pair_row = [&](int64_t head, int64_t g) { return scratch.queries.data() + ((head - first_head) * group + g) * dim; };
  int64_t t = start;
#if defined(GPUSHARE_ATTENTION_SIMD)
  if (pairs) {  // a tile of kKeysAtOnce keys at a time, the last one filled up with zero keys
    const c10::BFloat16* keys[kKeysAtOnce];
    auto& tile = scratch.wide_keys;
    tile.resize(kKeysAtOnce * dim);
    std::vector<float>& dots = scratch.tile_scores;
    std::vector<const float*>& q_rows = scratch.query_rows;
    std::vector<const uint16_t*>& q_bits = scratch.query_bit_rows;
    std::vector<float*>& out_rows = scratch.tile_score_rows;
    dots.resize(group * kKeysAtOnce), q_rows.resize(group), q_bits.resize(group), out_rows.resize(group);
    for (; t < length; t += kKeysAtOnce)
      for (int64_t head = first_head; head < last_head; ++head) {
        for (int i = 0; i < kKeysAtOnce; ++i)
          keys[i] = t + i < length ? reinterpret_cast<const c10::BFloat16*>(k_row(t + i, head))
                                   : reinterpret_cast<const c10::BFloat16*>(kZeroKey);
        pair_tile(keys, dim, tile.data());
        const bool whole = t + kKeysAtOnce <= length;  // a full tile's scores go straight to their rows
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = (head - first_head) * group + g;
          q_rows[g] = pair_row(head, g), q_bits[g] = scratch.query_bits.data() + row * dim;
          out_rows[g] = whole ? scores.data() + row * n + t - start : dots.data() + g * kKeysAtOnce;
        }
        pair_scores_of(group, q_rows.data(), q_bits.data(), tile.data(), dim, scale, out_rows.data());
        if (!whole)
          for (int64_t g = 0; g < group; ++g)
            std::copy(out_rows[g], out_rows[g] + (length - t), scores.data() + ((head - first_head) * group + g) * n + t - start);
      }
    for (int64_t row = 0; row < rows; ++row) cap_scores(scores.data() + row * n, n, softcap);
  } else if (dim % kLanes == 0) {  // kKeysAtOnce tokens at a time, the same bits as one by one below
    const T* keys[kKeysAtOnce];
    float dots[kKeysAtOnce], k_scales[kKeysAtOnce];
    // Keys stored narrower than float32 are widened once for their head's whole query group (the same
    // values load16 gives, so the same bits): converting them per query head cost as much as the dots.
    constexpr bool narrow = !std::is_same_v<T, float>;
    const bool widen_once = narrow && group > 1;
    auto& wide = scratch.wide_keys;
    const float* wide_keys[kKeysAtOnce];
    if (widen_once) {
      wide.resize(kKeysAtOnce * dim);
      for (int i = 0; i < kKeysAtOnce; ++i) wide_keys[i] = wide.data() + i * dim;
    }
    for (; t + kKeysAtOnce <= length; t += kKeysAtOnce)
      for (int64_t head = first_head; head < last_head; ++head) {
        for (int i = 0; i < kKeysAtOnce; ++i) {
          keys[i] = k_row(t + i, head);
          k_scales[i] = k_scale(t + i, head);
          if (widen_once) widen(keys[i], dim, wide.data() + i * dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = (head - first_head) * group + g;
          if (widen_once)
            dot_keys(q + (head * group + g) * dim, wide_keys, dim, dots);
          else
            dot_keys(q + (head * group + g) * dim, keys, dim, dots);
          for (int i = 0; i < kKeysAtOnce; ++i) {
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
        float s = pairs ? pair_score(pair_row(head, g), reinterpret_cast<const c10::BFloat16*>(k), dim) * scale
                        : dot(q + (head * group + g) * dim, k, dim) * row_scale * scale;
        if (softcap > 0) s = std::tanh(s / softcap) * softcap;
        scores[row * n + t - start] = s;
      }
    }
  }
  std::vector<float>& sums = scratch.sums;
  sums.resize(rows);
  for (int64_t row = 0; row < rows; ++row) {
    exponentiate(scores.data() + row * n, n);
    sums[row] = row_sum(scores.data() + row * n, n, pairs);
  }
  float* first_out = out + first_head * group * dim;
#if defined(GPUSHARE_ATTENTION_SIMD)
  if (values_fit(dim)) {
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
      if (pairs)
        value_sums<true>(weight_rows.data(), reinterpret_cast<const c10::BFloat16* const*>(values.data()), n,
                         out_rows.data(), group, dim);
      else
        value_sums(weight_rows.data(), reinterpret_cast<const T* const*>(values.data()), n, out_rows.data(), group,
                   dim);
    }
  } else
#endif
  {
    std::fill(first_out, first_out + rows * dim, 0.f);
    for (int64_t i = start; i < length; ++i) {
      const int64_t t = pairs ? start + pair_order(i - start, length - start) : i;
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

#if defined(GPUSHARE_ATTENTION_SIMD)
#include "cpu_attention_prompt.h"
#endif

// Whether row b + 1 continues row b's prompt: the same sequence (tables that agree on every key row b
// reads) one or more tokens on.
bool continues(const gpushare::attention::Call& c, int64_t b) {
  const int64_t blocks = (c.lp[b] + c.block_size - 1) / c.block_size;
  return c.lp[b + 1] >= c.lp[b] &&
         std::memcmp(c.tp + b * c.width, c.tp + (b + 1) * c.width, blocks * sizeof(int32_t)) == 0;
}

// The call's work items: blocks of a prompt's consecutive rows, a KV head each, first (the longest
// work, so no thread is left with one at the end); then single rows, whole once there are enough to
// share among the threads, else a (row, KV head) pair each. The numbers are the same either way.
std::vector<gpushare::attention::Item> work_items(const gpushare::attention::Call& c, int64_t threads) {
  std::vector<gpushare::attention::Item> blocks, singles;
  bool by_block = false;
#if defined(GPUSHARE_ATTENTION_SIMD)
  by_block = c.window == 0 && c.dim % kLanes == 0 && values_fit(c.dim);
#endif
  const int64_t heads_per_item = c.batch >= threads ? c.kv_heads : 1;
  int64_t prompt = -1;
  bool last_was_block = false;
  for (int64_t b = 0; b < c.batch;) {
    int64_t end = b + 1;
#if defined(GPUSHARE_ATTENTION_SIMD)
    if (by_block) {
      const int64_t most = block_rows(c.lp[b] + kMaxBlockRows, c.group);
      while (end < c.batch && end - b < most && continues(c, end - 1)) ++end;
    }
#endif
    const bool block = end - b > 1;
    if (block && !(last_was_block && continues(c, b - 1))) ++prompt;
    if (block)
      for (int64_t head = 0; head < c.kv_heads; ++head) blocks.push_back({b, end - b, head, 1, prompt});
    else
      for (int64_t head = 0; head < c.kv_heads; head += heads_per_item) singles.push_back({b, 1, head, heads_per_item, -1});
    last_was_block = block;
    b = end;
  }
  blocks.insert(blocks.end(), singles.begin(), singles.end());
  return blocks;
}

}  // namespace

namespace gpushare::attention {

Call prepare(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
             const at::Tensor& block_tables_in, const at::Tensor& context_lens_in, double scale, int64_t window,
             double softcap, int64_t threads) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be float32 [rows, heads, dim]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  Call c;
  c.q = q_in.contiguous();
  c.tables = block_tables_in.to(at::kInt).contiguous();
  c.lens = context_lens_in.to(at::kInt).contiguous();
  c.batch = c.q.size(0), c.q_heads = c.q.size(1), c.dim = c.q.size(2);
  c.block_size = k_cache.size(1), c.kv_heads = k_cache.size(2), c.width = c.tables.size(1);
  TORCH_CHECK(k_cache.size(3) == c.dim && c.q_heads % c.kv_heads == 0, "q and the KV cache disagree on heads or dim");
  TORCH_CHECK(k_cache.scalar_type() != at::kBFloat16 || c.dim <= kMaxPairDim, "bfloat16 caches take head dims up to ",
              kMaxPairDim);
  TORCH_CHECK(c.tables.size(0) == c.batch && c.lens.size(0) == c.batch, "one block table and length per row");
  c.kc = rows::cache_of(k_cache, k_scale), c.vc = rows::cache_of(v_cache, v_scale);
  c.group = c.q_heads / c.kv_heads;
  c.out = at::empty_like(c.q);
  c.tp = c.tables.data_ptr<int32_t>(), c.lp = c.lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < c.batch; ++b)
    TORCH_CHECK(c.lp[b] > 0 && (c.lp[b] + c.block_size - 1) / c.block_size <= c.width,
                "a context length exceeds its block table");
  // Threads claim items as they come free: a prompt's later rows cost more than its first, and a
  // thread the OS preempts holds up one item, not a share.
  c.window = window, c.scale = static_cast<float>(scale), c.softcap = static_cast<float>(softcap);
  c.work = work_items(c, threads);
  c.items = static_cast<int64_t>(c.work.size());
  return c;
}

void run_items(const Call& c, std::atomic<int64_t>& next) {
  Scratch scratch;
  const float* qp = c.q.data_ptr<float>();
  float* op = c.out.data_ptr<float>();
  for (int64_t index = next.fetch_add(1); index < c.items; index = next.fetch_add(1)) {
    const Item& item = c.work[index];
    const int64_t b = item.row, length = c.lp[b], offset = b * c.q_heads * c.dim;
    const int64_t start = c.window > 0 ? std::max<int64_t>(0, length - c.window) : 0;
    const auto run = [&](auto element) {
      using T = decltype(element);
#if defined(GPUSHARE_ATTENTION_SIMD)
      if (item.rows > 1) {
        const int64_t last = b + item.rows - 1;  // the longest row's table holds every key the block reads
        attend_block<T>(qp + offset, op + offset, c.kc, c.vc, c.tp + last * c.width, c.lp + b, item.rows,
                        c.block_size, item.first_head, c.q_heads, c.group, c.dim, c.scale, c.softcap, item.prompt,
                        scratch);
        return;
      }
#endif
      attend<T>(qp + offset, op + offset, c.kc, c.vc, c.tp + b * c.width, start, length, c.block_size,
                item.first_head, item.first_head + item.heads, c.group, c.dim, c.scale, c.softcap, scratch);
    };
    if (c.kc.type == at::kChar)
      run(int8_t{});
    else if (c.kc.type == at::kBFloat16)
      run(c10::BFloat16{});
    else
      run(float{});
  }
}

}  // namespace gpushare::attention

namespace gpushare {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap) {
  const int64_t threads = at::get_num_threads();
  const attention::Call call = attention::prepare(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                                  scale, window, softcap, threads);
  if (call.items == 0) return call.out;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, call.items), 1, [&](int64_t, int64_t) { attention::run_items(call, next); });
  return call.out;
}

}  // namespace gpushare
