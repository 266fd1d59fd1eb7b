// Decode attention read straight from the paged KV cache on CPU: one query token per sequence.
//
// The torch backend gathers each sequence's keys and values into a contiguous [B, L, Hkv, D] copy
// before SDPA reads them again: three passes over the cache per layer and step. Here each sequence
// walks its block table once for the scores and once for the weighted values, reading each cached
// token's row of all KV heads front to back, so the cache is read twice and never copied. Scores
// accumulate in float32 whatever the cache dtype; the query heads that share a KV head are scored
// against the same loaded key.
//
// Per sequence, keys [start, end) are attended (end = context length; start > 0 for sliding windows).
// Optional tanh softcapping and per-head sink logits (an extra softmax term with no value) follow
// transformers' eager attention for Gemma 2 and gpt-oss.
//
// Registered as torch.ops.keepwarm_cpu.paged_decode_attention, with write_kv, which puts a step's new
// keys and values in their slots (attention/native.py builds and loads it).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "vec16.h"

namespace {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Widens one row of the cache to float32 (a no-op copy for float caches) so the inner loops vectorize.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// The inner loops of the common head dims (multiples of 16, up to 256, in vec16.h's 16-float vectors)
// keep a query head or an output head in registers across a block.
constexpr int64_t kMaxChunks = 16;

// Turns a head's raw scores into unnormalised softmax weights in place; returns their sum (with the
// sink's term when there is one, which has no value to weigh).
inline float softmax_weights(float* s, int64_t n, float scale, float cap, const float* sink) {
  float top = sink != nullptr ? *sink : -std::numeric_limits<float>::infinity();
  if (cap > 0.f) {
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::tanh(s[i] * scale / cap) * cap;
      top = std::max(top, s[i]);
    }
  } else {
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) {
      s[i] *= scale;
      top = std::max(top, s[i]);
    }
  }
  float sum = sink != nullptr ? std::exp(*sink - top) : 0.f;
  int64_t i = 0;
  vfloat partial{};
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat w = exp16(load(s + i) - top);
    store(s + i, w);
    partial += w;
  }
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - top);
    sum += s[i];
  }
  return sum + hsum(partial);
}

// One KV head over `count` keys (rows `stride` floats apart): scores[j * n + t] = q_j . k_t for the
// `group` query heads sharing it. C: the head dim in vfloats (0: any head dim, scalar loops).
template <int C>
void score_rows(const float* q, int64_t group, int64_t dim, const float* rows, int64_t stride, int64_t count,
                float* scores, int64_t n) {
  for (int64_t j = 0; j < group; ++j, q += dim) {
    if constexpr (C > 0) {
      vfloat qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load(q + c * kLanes);
      for (int64_t t = 0; t < count; ++t) {
        const float* k = rows + t * stride;
        vfloat acc = qv[0] * load(k);
        for (int c = 1; c < C; ++c) acc += qv[c] * load(k + c * kLanes);
        scores[j * n + t] = hsum(acc);
      }
    } else {
      for (int64_t t = 0; t < count; ++t) {
        const float* k = rows + t * stride;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < dim; ++d) acc += q[d] * k[d];
        scores[j * n + t] = acc;
      }
    }
  }
}

// One KV head over `count` values: out_j += sum_t weights[j * n + t] * v_t for its `group` query heads.
template <int C>
void accumulate_rows(const float* weights, int64_t group, int64_t dim, const float* rows, int64_t stride,
                     int64_t count, float* out, int64_t n) {
  for (int64_t j = 0; j < group; ++j, out += dim) {
    if constexpr (C > 0) {
      vfloat acc[C];
      for (int c = 0; c < C; ++c) acc[c] = load(out + c * kLanes);
      for (int64_t t = 0; t < count; ++t) {
        const float w = weights[j * n + t];
        const float* v = rows + t * stride;
        for (int c = 0; c < C; ++c) acc[c] += w * load(v + c * kLanes);
      }
      for (int c = 0; c < C; ++c) store(out + c * kLanes, acc[c]);
    } else {
      for (int64_t t = 0; t < count; ++t) {
        const float w = weights[j * n + t];
        const float* v = rows + t * stride;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] += w * v[d];
      }
    }
  }
}

using ScoreFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t);
using AccumulateFn = ScoreFn;

template <int C>
constexpr std::pair<ScoreFn, AccumulateFn> kernels_for() {
  return {&score_rows<C>, &accumulate_rows<C>};
}

// The inner loops for a head dim: unrolled for 64, 128 and 256, vectorised for other multiples of 16
// up to 256, scalar otherwise.
template <int... Cs>
std::pair<ScoreFn, AccumulateFn> pick(int64_t dim) {
  std::pair<ScoreFn, AccumulateFn> chosen = kernels_for<0>();
  ((dim == Cs * kLanes ? (void)(chosen = kernels_for<Cs>()) : (void)0), ...);
  return chosen;
}

std::pair<ScoreFn, AccumulateFn> kernels(int64_t dim) {
  return pick<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, kMaxChunks>(dim);
}

// Calls fn(first token, token count, offset of the first one's row in elements) for each run of keys
// in [first, last) that lies in one cache block, walking the block table.
template <typename Fn>
inline void for_each_block(const int32_t* table, int64_t block_size, int64_t row, int64_t first, int64_t last,
                           Fn&& fn) {
  for (int64_t t = first; t < last;) {
    const int64_t block = t / block_size, end = std::min(last, (block + 1) * block_size);
    fn(t, end - t, (int64_t(table[block]) * block_size + t % block_size) * row);
    t = end;
  }
}

// Splits the work items (sequence-major, `per_seq` per sequence) into `parts` contiguous runs of about
// equal cost (keys attended, plus one), as item indices [cuts[i], cuts[i + 1]). A split into equal
// counts would leave one thread waiting while another walks the long contexts.
std::vector<int64_t> balanced_cuts(const int64_t* starts, const int64_t* ends, int64_t B, int64_t per_seq,
                                   int64_t parts) {
  std::vector<int64_t> cost(B * per_seq + 1, 0);  // prefix sums
  for (int64_t item = 0; item < B * per_seq; ++item) {
    const int64_t b = item / per_seq;
    cost[item + 1] = cost[item] + std::max<int64_t>(ends[b] - starts[b], 0) + 1;
  }
  parts = std::max<int64_t>(1, std::min(parts, B * per_seq));
  std::vector<int64_t> cuts{0};
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t target = cost.back() * i / parts;
    const int64_t cut = std::lower_bound(cost.begin(), cost.end(), target) - cost.begin();
    cuts.push_back(std::max(cuts.back(), std::min(cut, B * per_seq)));
  }
  cuts.push_back(B * per_seq);
  return cuts;
}

template <typename scalar_t>
void decode_kernel(
    at::Tensor& out,                // [B, H, Dv]
    const at::Tensor& query,        // [B, H, Dk]
    const at::Tensor& k_cache,      // [num_blocks, block_size, Hkv, Dk]
    const at::Tensor& v_cache,      // [num_blocks, block_size, Hkv, Dv]
    const at::Tensor& block_tables, // [B, max_blocks] int32
    const at::Tensor& starts,       // [B] int64: first key attended
    const at::Tensor& ends,         // [B] int64: one past the last key attended
    double scale,
    double softcap,                 // <= 0: none
    const std::optional<at::Tensor>& sinks) {  // [H] float32
  const int64_t B = query.size(0), H = query.size(1), Dk = query.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  const int64_t group = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t k_row = Hkv * Dk, v_row = Hkv * Dv;  // elements per cached token
  // One work item is a sequence and a run of its KV heads: all of them when there are sequences
  // enough to keep every thread busy (a block's rows of all heads are then read front to back), one
  // when there are few (a lone long decode still uses every thread).
  const int64_t heads_per_item = B >= 2 * at::get_num_threads() ? Hkv : 1;
  const int64_t items_per_seq = Hkv / heads_per_item;
  const ScoreFn score = kernels(Dk).first;
  const AccumulateFn accumulate = kernels(Dv).second;

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* start_ptr = starts.data_ptr<int64_t>();
  const int64_t* end_ptr = ends.data_ptr<int64_t>();
  const float* sink_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const float cap = static_cast<float>(softcap), fscale = static_cast<float>(scale);
  constexpr bool is_float = std::is_same_v<scalar_t, float>;

  const std::vector<int64_t> cuts = balanced_cuts(start_ptr, end_ptr, B, items_per_seq, at::get_num_threads());

  at::parallel_for(0, int64_t(cuts.size()) - 1, 1, [&](int64_t first_part, int64_t last_part) {
    const int64_t heads = heads_per_item * group;  // query heads of one item
    std::vector<float> q(heads * Dk), acc(heads * Dv), total(heads), scores;
    // A block's rows of the item's heads, widened to float32 (caches of other dtypes only).
    std::vector<float> widened(is_float ? 0 : block_size * heads_per_item * std::max(Dk, Dv));
    for (int64_t item = cuts[first_part]; item < cuts[last_part]; ++item) {
      const int64_t b = item / items_per_seq, h0 = (item % items_per_seq) * heads_per_item;
      const int64_t first = start_ptr[b], last = end_ptr[b], n = std::max<int64_t>(last - first, 0);
      const int32_t* table = tables + b * max_blocks;
      widen(q_ptr + (b * H + h0 * group) * Dk, q.data(), heads * Dk);  // its heads are adjacent
      scores.resize(heads * std::max<int64_t>(n, 1));

      // The rows of head h0 + h of a run of `count` tokens, and the distance between them.
      auto rows = [&](const scalar_t* base, int64_t offset, int64_t count, int64_t row, int64_t dim)
          -> std::pair<const float*, int64_t> {
        if constexpr (is_float) {
          return {base + offset + h0 * dim, row};
        } else {
          for (int64_t t = 0; t < count; ++t)
            widen(base + offset + t * row + h0 * dim, widened.data() + t * heads_per_item * dim,
                  heads_per_item * dim);
          return {widened.data(), heads_per_item * dim};
        }
      };

      // Scores, head-major ([heads, n]).
      for_each_block(table, block_size, k_row, first, last, [&](int64_t t, int64_t count, int64_t offset) {
        const auto [keys, stride] = rows(k_ptr, offset, count, k_row, Dk);
        for (int64_t h = 0; h < heads_per_item; ++h)
          score(q.data() + h * group * Dk, group, Dk, keys + h * Dk, stride, count,
                scores.data() + h * group * n + (t - first), n);
      });

      // Softmax weights, unnormalised.
      for (int64_t j = 0; j < heads; ++j)
        total[j] = softmax_weights(scores.data() + j * n, n, fscale, cap,
                                   sink_ptr != nullptr ? sink_ptr + h0 * group + j : nullptr);

      // Weighted values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block(table, block_size, v_row, first, last, [&](int64_t t, int64_t count, int64_t offset) {
        const auto [values, stride] = rows(v_ptr, offset, count, v_row, Dv);
        for (int64_t h = 0; h < heads_per_item; ++h)
          accumulate(scores.data() + h * group * n + (t - first), group, Dv, values + h * Dv, stride,
                       count, acc.data() + h * group * Dv, n);
      });
      for (int64_t j = 0; j < heads; ++j) {
        const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
        scalar_t* o = o_ptr + (b * H + h0 * group + j) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<scalar_t>(acc[j * Dv + d] * inv);
      }
    }
  });
}

void paged_decode_attention(
    at::Tensor out,
    const at::Tensor& query,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& block_tables,
    const at::Tensor& starts,
    const at::Tensor& ends,
    double scale,
    double softcap,
    const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out are [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches are [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type()
                  && out.scalar_type() == query.scalar_type(),
              "query, caches and out share one dtype");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && out.size(2) == v_cache.size(3), "head dims disagree");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(starts.scalar_type() == at::kLong && ends.scalar_type() == at::kLong, "starts/ends: int64");
  TORCH_CHECK(starts.numel() == query.size(0) && ends.numel() == query.size(0), "one start/end per sequence");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->numel() == query.size(1)),
              "sinks: float32, one per head");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out, query, k_cache, v_cache, block_tables, starts, ends, scale, softcap, sinks);
  });
}

// Writes a step's new keys or values into their cache slots: row t of `rows` ([T, Hkv, D], each
// token's heads adjacent, the last dim contiguous) to slot slots[t] of `cache` ([slots, Hkv, D],
// contiguous). index_copy_ does the same element by element (28-90 us for 64 tokens of 6 x 64
// bfloat16 on a Xeon VM); this is a copy per token, or per head where the heads are not adjacent.
void write_kv(at::Tensor cache, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(cache.dim() == 3 && rows.dim() == 3, "cache is [slots, Hkv, D], rows [T, Hkv, D]");
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(cache.size(1) == rows.size(1) && cache.size(2) == rows.size(2), "cache and rows: Hkv, D differ");
  TORCH_CHECK(cache.scalar_type() == rows.scalar_type(), "cache and rows share one dtype");
  TORCH_CHECK(rows.stride(2) == 1, "rows: the last dim must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous()
                  && slots.numel() == rows.size(0),
              "slots: int64, one per row");
  const int64_t T = rows.size(0), H = rows.size(1), D = rows.size(2), n = cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < n, "slot ", slot[t], " out of range");
  const int64_t item = rows.element_size(), row_stride = rows.stride(0), head_stride = rows.stride(1);
  const char* src = static_cast<const char*>(rows.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const bool whole = head_stride == D || H == 1;  // a token's heads are one run of memory
  for (int64_t t = 0; t < T; ++t) {
    char* out = dst + slot[t] * H * D * item;
    const char* in = src + t * row_stride * item;
    if (whole) {
      std::memcpy(out, in, H * D * item);
    } else {
      for (int64_t h = 0; h < H; ++h) std::memcpy(out + h * D * item, in + h * head_stride * item, D * item);
    }
  }
}

}  // namespace

TORCH_LIBRARY(keepwarm_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor starts, Tensor ends, float scale, float softcap, Tensor? sinks) -> ()");
  m.def("write_kv(Tensor(a!) cache, Tensor slots, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(keepwarm_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
