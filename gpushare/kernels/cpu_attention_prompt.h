// cpu_attention.cpp's path for a prompt's rows, included by it inside its anonymous namespace after
// `attend` where the build has SIMD: a block of consecutive rows of one sequence, one KV head at a time.
//
// By row, each of a long prompt's rows streams its whole prefix of K and V (at 8,000 tokens, ~3 MB a
// KV head in bfloat16) through the cache and widens every key again; the block reads each 16-key tile
// and each value tile once for all its rows' query heads, from L1. Every number is computed as `attend`
// computes it for that row: the same dot products per key (dot_keys over full tiles from token 0, `dot`
// for a row's last keys; bfloat16 caches: pair_scores over tiles from token 0, the last filled up with
// zero keys), the same softmax over the row's own scores, and the same value sums in token order
// (resumed tile after tile from the floats stored between them), so a row's bits do not depend on
// which path ran it. Rows with a window (whose tiles start at each row's own first key) go by row.
#pragma once

constexpr int64_t kValueTile = 64;  // tokens of V a block's rows share while they sit in L1
constexpr int64_t kBlockScoreFloats = 256 << 10;  // a block's scores, within a core's L2 (1 MiB here)
constexpr int64_t kMaxBlockRows = 32;
constexpr int64_t kPairTileFloats = kPairInstruction ? kKeysAtOnce / 2 : kKeysAtOnce;  // pair_tile's, per dim

// How many rows a block of a prompt whose rows attend up to `length` keys holds.
inline int64_t block_rows(int64_t length, int64_t group) {
  return std::clamp<int64_t>(kBlockScoreFloats / (group * length), 2, kMaxBlockRows);
}

// Rows [first_row, first_row + count) of one sequence (their tables agree on every key each reads,
// their lengths do not decrease), KV head `head`.
template <typename T>
void attend_block(const float* q, float* out, const Cache& kc, const Cache& vc, const int32_t* table,
                  const int32_t* lens, int64_t count, int64_t block_size, int64_t head, int64_t q_heads,
                  int64_t group, int64_t dim, float scale, float softcap, int64_t prompt, Scratch& scratch) {
  const int64_t longest = lens[count - 1], vectors = count * group;  // query heads handled
  locate(kc, table, 0, longest, block_size, scratch.k_at, scratch.k_scale_at);
  locate(vc, table, 0, longest, block_size, scratch.v_at, scratch.v_scale_at);
  const T* const k_data = reinterpret_cast<const T*>(kc.data);
  const T* const v_data = reinterpret_cast<const T*>(vc.data);
  const auto k_row = [&](int64_t t) { return k_data + scratch.k_at[t] + head * kc.head_stride; };
  const auto k_scale = [&](int64_t t) { return kc.scale ? kc.scale[scratch.k_scale_at[t] + head * kc.scale_head] : 1.f; };
  const auto v_scale = [&](int64_t t) { return vc.scale ? vc.scale[scratch.v_scale_at[t] + head * vc.scale_head] : 1.f; };
  const auto query = [&](int64_t v) { return q + (v / group) * q_heads * dim + (head * group + v % group) * dim; };
  // each vector's length and output row once: a division per vector per tile cost as much as its dots
  std::vector<int64_t>& lengths = scratch.lengths;
  std::vector<float*>& outputs = scratch.outputs;
  lengths.resize(vectors), outputs.resize(vectors);
  for (int64_t v = 0; v < vectors; ++v) {
    lengths[v] = lens[v / group];
    outputs[v] = out + (v / group) * q_heads * dim + (head * group + v % group) * dim;
  }
  const auto output = [&](int64_t v) { return outputs[v]; };
  const auto length = [&](int64_t v) { return lengths[v]; };
  std::vector<float>& scores = scratch.scores;
  scores.resize(vectors * longest);
  const auto capped = [&](float dot, float key_scale) {
    float s = dot * key_scale * scale;
    return softcap > 0 ? std::tanh(s / softcap) * softcap : s;
  };
  const bool pairs = by_pairs<T>(dim);
  if (pairs) {  // each vector's query for the pair arithmetic
    scratch.queries.resize(vectors * dim);
    scratch.query_bits.resize(vectors * dim);
    for (int64_t v = 0; v < vectors; ++v)
      pair_query(query(v), dim, scratch.queries.data() + v * dim, scratch.query_bits.data() + v * dim);
  }
  const auto pair_row = [&](int64_t v) { return scratch.queries.data() + v * dim; };
  auto& wide = scratch.wide_keys;
  wide.resize(kKeysAtOnce * dim);
  // the pair arithmetic's tiles this thread made for the prompt's earlier blocks (Scratch::KeptTiles)
  Scratch::KeptTiles* kept = nullptr;
  if (pairs) {
    scratch.kept.resize(std::max<int64_t>(scratch.kept.size(), head + 1));
    kept = &scratch.kept[head];
    if (kept->prompt != prompt) *kept = Scratch::KeptTiles{prompt};
  }
  if (pairs) {  // tiles of kKeysAtOnce keys from token 0, the last one filled up with zero keys
    const int64_t tile_floats = kPairTileFloats * dim;
    if (kept->key_tiles.size() < static_cast<size_t>(longest / kKeysAtOnce * tile_floats))
      kept->key_tiles.resize(longest / kKeysAtOnce * tile_floats);
    const c10::BFloat16* keys[kKeysAtOnce];
    std::vector<float>& dots = scratch.tile_scores;
    std::vector<const float*>& q_rows = scratch.query_rows;
    std::vector<const uint16_t*>& q_bits = scratch.query_bit_rows;
    std::vector<float*>& out_rows = scratch.tile_score_rows;
    dots.resize(vectors * kKeysAtOnce), q_rows.resize(vectors), q_bits.resize(vectors), out_rows.resize(vectors);
    // The tiles below `shared` are read whole by every vector (lengths rise with v): one list of rows for
    // all of them, whose score pointers step a tile at a time. Choosing the rows anew per tile and
    // vector took ~2% of prompt attention's time at 8k tokens (perf, AVX2).
    const int64_t shared = length(0) / kKeysAtOnce * kKeysAtOnce;
    for (int64_t v = 0; v < vectors; ++v)
      q_rows[v] = pair_row(v), q_bits[v] = scratch.query_bits.data() + v * dim, out_rows[v] = scores.data() + v * longest;
    for (int64_t t = 0; t < longest; t += kKeysAtOnce) {
      const bool full = t + kKeysAtOnce <= longest;
      float* tile = full ? kept->key_tiles.data() + t / kKeysAtOnce * tile_floats : wide.data();
      if (!full || t >= kept->keys) {
        for (int i = 0; i < kKeysAtOnce; ++i)
          keys[i] = t + i < longest ? reinterpret_cast<const c10::BFloat16*>(k_row(t + i))
                                    : reinterpret_cast<const c10::BFloat16*>(kZeroKey);
        pair_tile(keys, dim, tile);
        if (full) kept->keys = t + kKeysAtOnce;
      }
      if (t < shared) {
        pair_scores_of(vectors, q_rows.data(), q_bits.data(), tile, dim, scale, out_rows.data());
        for (int64_t v = 0; v < vectors; ++v) out_rows[v] += kKeysAtOnce;
        continue;
      }
      int64_t reading = 0;  // the vectors whose rows reach this tile; a full tile's scores go to their row
      for (int64_t v = 0; v < vectors; ++v)
        if (length(v) > t) {
          q_rows[reading] = pair_row(v), q_bits[reading] = scratch.query_bits.data() + v * dim;
          out_rows[reading] = length(v) >= t + kKeysAtOnce ? scores.data() + v * longest + t
                                                           : dots.data() + v * kKeysAtOnce;
          ++reading;
        }
      pair_scores_of(reading, q_rows.data(), q_bits.data(), tile, dim, scale, out_rows.data());
      for (int64_t v = 0; v < vectors; ++v)
        if (length(v) > t && length(v) < t + kKeysAtOnce)
          std::copy(dots.data() + v * kKeysAtOnce, dots.data() + v * kKeysAtOnce + (length(v) - t),
                    scores.data() + v * longest + t);
    }
    for (int64_t v = 0; v < vectors; ++v) cap_scores(scores.data() + v * longest, length(v), softcap);
  } else {
    // Scores: full tiles of kKeysAtOnce keys from token 0, widened once for every vector that reads them
    const float* wide_keys[kKeysAtOnce];
    float dots[kKeysAtOnce], k_scales[kKeysAtOnce];
    for (int i = 0; i < kKeysAtOnce; ++i) wide_keys[i] = wide.data() + i * dim;
    for (int64_t t = 0; t + kKeysAtOnce <= longest; t += kKeysAtOnce) {
      for (int i = 0; i < kKeysAtOnce; ++i) {
        widen(k_row(t + i), dim, wide.data() + i * dim);
        k_scales[i] = k_scale(t + i);
      }
      for (int64_t v = 0; v < vectors; ++v) {
        if (length(v) < t + kKeysAtOnce) continue;
        dot_keys(query(v), wide_keys, dim, dots);
        float* __restrict row_scores = scores.data() + v * longest + t;
        if (softcap > 0)
          for (int i = 0; i < kKeysAtOnce; ++i) row_scores[i] = capped(dots[i], k_scales[i]);
        else if (kc.scale)  // capped's products, in its order, for the compiler to vectorize
          for (int i = 0; i < kKeysAtOnce; ++i) row_scores[i] = dots[i] * k_scales[i] * scale;
        else  // a key scale of 1 leaves a product as it is: the same floats
          for (int i = 0; i < kKeysAtOnce; ++i) row_scores[i] = dots[i] * scale;
      }
    }
    for (int64_t v = 0; v < vectors; ++v)  // each row's keys past its last full tile, one by one
      for (int64_t t = length(v) / kKeysAtOnce * kKeysAtOnce; t < length(v); ++t)
        scores[v * longest + t] = capped(dot(query(v), k_row(t), dim), k_scale(t));
  }
  for (int64_t v = 0; v < vectors; ++v) exponentiate(scores.data() + v * longest, length(v));
  std::vector<float>& sums = scratch.sums;
  sums.resize(vectors);
  for (int64_t v = 0; v < vectors; ++v) sums[v] = row_sum(scores.data() + v * longest, length(v), pairs);
  if (vc.scale)  // int8: each token's probability times its value scale, as attend's weights
    for (int64_t v = 0; v < vectors; ++v)
      for (int64_t t = 0; t < length(v); ++t) scores[v * longest + t] *= v_scale(t);
  // Value sums, a tile of tokens at a time: the vectors that read the whole tile together, then each
  // row's last tokens alone, every sum resumed from the tile before.
  std::vector<const void*>& values = scratch.values;
  values.resize(longest);
  for (int64_t t = 0; t < longest; ++t) values[t] = v_data + scratch.v_at[t] + head * vc.head_stride;
  std::vector<const float*> weight_rows(vectors);
  std::vector<float*> out_rows(vectors);
  for (int64_t t0 = 0; t0 < longest; t0 += kValueTile) {
    const int64_t t1 = std::min(longest, t0 + kValueTile);
    const T* const* tile = reinterpret_cast<const T* const*>(values.data()) + t0;
    int64_t whole = 0;
    for (int64_t v = 0; v < vectors; ++v)
      if (length(v) >= t1) weight_rows[whole] = scores.data() + v * longest + t0, out_rows[whole++] = output(v);
    // (the pair arithmetic's pairs start at token 0: a tile starts at an even token)
    const auto sums_of = [&](const float* const* weights, int64_t count, float* const* outs, int64_t rows) {
      if (pairs)
        value_sums<true>(weights, reinterpret_cast<const c10::BFloat16* const*>(tile), count, outs, rows, dim, t0 > 0);
      else
        value_sums(weights, tile, count, outs, rows, dim, t0 > 0);
    };
#if defined(GPUSHARE_PACKED_PAIRS)
    const int64_t chunks = dim / kLanes;
    if (whole && pairs && (t1 - t0) % 2 == 0 && (chunks == 4 || chunks == 8 || chunks == 16)) {
      const int64_t count = (t1 - t0) / 2;
      // a full tile's interleaved values are kept for the prompt's next blocks, a last short one is not
      const bool keep = t1 - t0 == kValueTile;
      if (keep && kept->value_tiles.size() < static_cast<size_t>(t1 * dim / 2)) kept->value_tiles.resize(t1 * dim / 2);
      if (!keep) scratch.value_pairs.resize(count * dim);
      uint32_t* value_pairs = keep ? kept->value_tiles.data() + t0 * dim / 2 : scratch.value_pairs.data();
      const bool interleaved = keep && t0 < kept->values;
      scratch.weight_pairs.resize(whole * count);
      scratch.weight_pair_rows.resize(whole);
      for (int64_t r = 0; r < whole; ++r) {
        pack_pairs(weight_rows[r], t1 - t0, scratch.weight_pairs.data() + r * count);
        scratch.weight_pair_rows[r] = scratch.weight_pairs.data() + r * count;
      }
      const auto* bf16_tile = reinterpret_cast<const c10::BFloat16* const*>(tile);
      const auto packed = [&]<int C>() {
        if (!interleaved) interleave_pairs<C>(bf16_tile, t1 - t0, value_pairs);
        if (keep && !interleaved) kept->values = t1;
        packed_pair_sums<C>(scratch.weight_pair_rows.data(), value_pairs, count, out_rows.data(), whole, t0 > 0);
      };
      if (chunks == 4)
        packed.template operator()<4>();
      else if (chunks == 8)
        packed.template operator()<8>();
      else
        packed.template operator()<16>();
    } else
#endif
#if defined(GPUSHARE_WIDE_VALUES)
    if (whole > 1) {  // the tile's values widened once for all its rows (exactly: the values load8 gives)
      const int64_t count = t1 - t0;
      // A full tile's widened values are kept for the prompt's next blocks, as its key tiles are: widening
      // the whole prefix again for each block, from the paged cache, took ~7% of an 8k prompt (perf).
      const bool keep = pairs && count == kValueTile;
      if (keep && kept->wide_value_tiles.size() < static_cast<size_t>(t1 * dim)) kept->wide_value_tiles.resize(t1 * dim);
      if (!keep) scratch.wide_values.resize(count * dim);
      float* wide_tile = keep ? kept->wide_value_tiles.data() + t0 * dim : scratch.wide_values.data();
      if (!keep || t0 >= kept->wide_values)
        for (int64_t i = 0; i < count; ++i) widen(tile[i], dim, wide_tile + i * dim);
      if (keep && t0 == kept->wide_values) kept->wide_values = t1;  // kept from token 0 without a gap
      if (pairs)
        wide_value_sums<true>(weight_rows.data(), wide_tile, count, out_rows.data(), whole, dim, t0 > 0);
      else
        wide_value_sums<false>(weight_rows.data(), wide_tile, count, out_rows.data(), whole, dim, t0 > 0);
    } else
#endif
    if (whole) sums_of(weight_rows.data(), t1 - t0, out_rows.data(), whole);
    for (int64_t v = 0; v < vectors; ++v) {
      if (length(v) <= t0 || length(v) >= t1) continue;
      const float* weights = scores.data() + v * longest + t0;
      float* row_out = output(v);
      sums_of(&weights, length(v) - t0, &row_out, 1);
    }
  }
  for (int64_t v = 0; v < vectors; ++v) {
    float* row_out = output(v);
    for (int64_t d = 0; d < dim; ++d) row_out[d] /= sums[v];
  }
}
