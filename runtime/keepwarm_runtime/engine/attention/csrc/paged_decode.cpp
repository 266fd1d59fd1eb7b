// Decode attention read straight from the paged KV cache on CPU: one query token per sequence.
//
// The torch backend gathers each sequence's keys and values into a contiguous [B, L, Hkv, D] copy
// before SDPA reads them again: three passes over the cache per layer and step. Here each sequence
// walks its block table once for the scores and once for the weighted values, reading each cached
// token's row of all KV heads front to back, so the cache is read twice and never copied. Scores
// accumulate in float32 whatever the cache dtype; the query heads that share a KV head are scored
// against the same loaded key. On AVX-512, bfloat16 and float16 rows are widened in registers as they
// are loaded (elsewhere a block is widened into a float32 buffer first).
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
#include <optional>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "vec16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
    // In vectors: a scalar running max is a chain of dependent instructions, a twentieth of a decode
    // call's time. Lane by lane as std::max (a NaN score never becomes the max); the max of the lanes'
    // maxima is the same number (at most a zero's sign differs, which no s - top can tell).
    vfloat lanes = vfloat{} + top;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const vfloat v = load(s + i) * scale;
      store(s + i, v);
      lanes = lanes < v ? v : lanes;
    }
    for (int64_t lane = 0; lane < kLanes; ++lane) top = std::max(top, lanes[lane]);
    for (; i < n; ++i) {
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// ---- 16-bit caches read where they lie (AVX-512) ----
//
// The loops above read float32 rows, so a bfloat16 or float16 block is first widened into a buffer:
// a store and a reload of every element, which made a bfloat16 cache no faster to attend than a float32
// one of twice its bytes. Here each key and value row is loaded and widened in registers, once for all
// the query heads of its group. bfloat16 keys are scored by AVX-512 BF16's pair dot products where the
// CPU has them (the products are exact in float32, as are the widened ones; the sums run in another
// order). The weighted values are accumulated as above, the same fused multiply-adds in the same order.
#define KEEPWARM_IN_PLACE_16BIT 1

constexpr __mmask16 kAll16 = 0xFFFF;
constexpr __mmask32 kAll32 = 0xFFFFFFFFu;

inline __mmask16 lanes_mask(int64_t left) { return left >= 16 ? kAll16 : __mmask16((1u << left) - 1); }

// 16 cache elements (the first lanes of `mask`, zeros elsewhere) widened to float32.
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 mask) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)); }

// The lane sums of 16 vectors, as one vector (lane i: the sum of v[i]'s lanes): four rounds that each
// halve the vectors, pairing lanes by two-source permutes, 15 adds in all instead of 16 reductions.
inline __m512 sum16(__m512* v) {
  static const __m512i lo[4] = {
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
      _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
      _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)};
  static const __m512i hi[4] = {
      _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31),
      _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31),
      _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31),
      _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)};
#pragma GCC unroll 4
  for (int round = 0, count = 16; count > 1; ++round, count /= 2)
#pragma GCC unroll 8
    for (int i = 0; i < count / 2; ++i)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], lo[round], v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], hi[round], v[2 * i + 1]));
  return v[0];
}

// scores[j * n + t] = the lane sum of dot_for(j)(row t), for `count` rows `stride` apart and `group`
// query heads: dot_for(j) holds head j's query in registers; runs of 16 rows' products unrolled into 16
// registers and summed together by sum16, the rest one by one. (Through a lambda of (t, j) called in a
// loop, the products went to memory and back: a fifth of a bfloat16 decode call in cache.)
template <typename T, typename DotFor>
inline void score_keys(int64_t group, const T* rows, int64_t stride, int64_t count, float* scores, int64_t n,
                       DotFor&& dot_for) {
  for (int64_t j = 0; j < group; ++j) {
    const auto dot = dot_for(j);
    float* s = scores + j * n;
    int64_t t = 0;
    for (; t + 16 <= count; t += 16) {
      __m512 partial[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) partial[i] = dot(rows + (t + i) * stride);
      _mm512_storeu_ps(s + t, sum16(partial));
    }
    for (; t < count; ++t) s[t] = _mm512_reduce_add_ps(dot(rows + t * stride));
  }
}

// Scores of one KV head's `count` keys (rows `stride` elements apart) for its `group` query heads:
// q holds them widened, C * 16 floats each (zeros past the head dim).
template <typename T, int C>
void score_in_place(const float* q, int64_t group, int64_t dim, const T* keys, int64_t stride, int64_t count,
                    float* scores, int64_t n) {
  const __mmask16 tail = lanes_mask(dim - (C - 1) * 16);
  score_keys(group, keys, stride, count, scores, n, [&](int64_t j) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + (j * C + c) * 16);
    return [=](const T* k) {
      __m512 acc = _mm512_mul_ps(qv[0], load16(k, C == 1 ? tail : kAll16));
#pragma GCC unroll 16
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k + c * 16, c == C - 1 ? tail : kAll16), acc);
      return acc;
    };
  });
}

#if defined(__AVX512BF16__)
// The same for bfloat16 keys by pair dot products: q holds the heads as bfloat16, C2 * 32 each.
template <int C2>
void score_dot_bf16(const c10::BFloat16* q, int64_t group, int64_t dim, const c10::BFloat16* keys, int64_t stride,
                    int64_t count, float* scores, int64_t n) {
  const int64_t left = dim - (C2 - 1) * 32;
  const __mmask32 tail = left >= 32 ? kAll32 : __mmask32((1ull << left) - 1);
  score_keys(group, keys, stride, count, scores, n, [&](int64_t j) {
    __m512bh qv[C2];
    for (int c = 0; c < C2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + (j * C2 + c) * 32);
    return [=](const c10::BFloat16* k) {
      __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < C2; ++c)
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_maskz_loadu_epi16(c == C2 - 1 ? tail : kAll32, k + c * 32));
      return acc;
    };
  });
}
#endif

// out_j += sum_t weights[j * n + t] * v_t for H query heads at once (their accumulators in registers);
// out holds C * 16 floats per head.
template <typename T, int C, int H>
void accumulate_heads(const float* weights, int64_t dim, const T* values, int64_t stride, int64_t count, float* out,
                      int64_t n) {
  const __mmask16 tail = lanes_mask(dim - (C - 1) * 16);
  __m512 acc[H][C];
  for (int j = 0; j < H; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = _mm512_loadu_ps(out + (j * C + c) * 16);
  for (int64_t t = 0; t < count; ++t) {
    const T* v = values + t * stride;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + c * 16, c == C - 1 ? tail : kAll16);
    for (int j = 0; j < H; ++j) {
      const __m512 w = _mm512_set1_ps(weights[j * n + t]);
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(w, vv[c], acc[j][c]);
    }
  }
  for (int j = 0; j < H; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (j * C + c) * 16, acc[j][c]);
}

// The group's heads in runs of 4, 2 and 1, as many accumulators as the registers hold.
template <typename T, int C>
void accumulate_in_place(const float* weights, int64_t group, int64_t dim, const T* values, int64_t stride,
                         int64_t count, float* out, int64_t n) {
  int64_t j = 0;
  if constexpr (C <= 4)
    for (; j + 4 <= group; j += 4)
      accumulate_heads<T, C, 4>(weights + j * n, dim, values, stride, count, out + j * C * 16, n);
  if constexpr (C <= 8)
    for (; j + 2 <= group; j += 2)
      accumulate_heads<T, C, 2>(weights + j * n, dim, values, stride, count, out + j * C * 16, n);
  for (; j < group; ++j) accumulate_heads<T, C, 1>(weights + j * n, dim, values, stride, count, out + j * C * 16, n);
}
#endif

// Calls fn(first token, token count, offset of the first one's row in elements, the next run's offset
// or -1, its token count) for each run of keys in [first, last) that lies in one cache block, walking
// the block table.
template <typename Fn>
inline void for_each_block(const int32_t* table, int64_t block_size, int64_t row, int64_t first, int64_t last,
                           Fn&& fn) {
  for (int64_t t = first; t < last;) {
    const int64_t block = t / block_size, end = std::min(last, (block + 1) * block_size);
    const int64_t next = end < last ? int64_t(table[block + 1]) * block_size * row : -1;
    fn(t, end - t, (int64_t(table[block]) * block_size + t % block_size) * row, next,
       std::min(last, end + block_size) - end);
    t = end;
  }
}

// The offset in elements of the first of a sequence's cache rows [first, last) (first < last), keys or
// values alike, and the token count of the run of them in that row's block: what for_each_block's
// first call is given.
inline std::pair<int64_t, int64_t> first_run(const int32_t* table, int64_t block_size, int64_t row, int64_t first,
                                             int64_t last) {
  const int64_t block = first / block_size;
  return {(int64_t(table[block]) * block_size + first % block_size) * row,
          std::min(last, (block + 1) * block_size) - first};
}

// Asks for `count` rows of `dim` elements, `row` elements apart, ahead of their use. A sequence's blocks
// lie anywhere in the cache, so no hardware prefetcher sees where its walk goes next, and a decode
// step's caches have left the CPU's caches by the time the next step comes back to a layer. Into L2
// (prefetcht1, as the linear kernels' fetches): a block's rows are more lines than L1 can have in
// flight, and on an AMD EPYC (Zen 4) fetching them into L1 (prefetcht0) left the cold kernel at a
// third of the memory's rate, against 85-95% into L2 (docs/performance.md).
template <typename T>
inline void fetch_ahead(const T* first, int64_t count, int64_t row, int64_t dim) {
  const int64_t bytes = dim * int64_t(sizeof(T));
  for (int64_t t = 0; t < count; ++t) {
    const char* p = reinterpret_cast<const char*>(first + t * row);
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);  // read, into L2
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

// How a kernel reads a cache's rows (R) and holds the query heads (Q): its two inner loops, and the
// elements each query head and each output head take in the per-thread buffers (the head dims,
// padded to whole vectors where the loops load whole vectors).
template <typename R, typename Q>
struct RowKernels {
  void (*score)(const Q* q, int64_t group, int64_t dim, const R* rows, int64_t stride, int64_t count, float* scores,
                int64_t n);
  void (*accumulate)(const float* weights, int64_t group, int64_t dim, const R* rows, int64_t stride, int64_t count,
                     float* out, int64_t n);
  int64_t q_width, out_width;
};

struct Problem {
  int64_t B, H, Dk, Dv, block_size, Hkv, max_blocks;
  float scale, cap;
};

// Copies (Q = T) or widens (Q = float) n elements.
template <typename T, typename Q>
inline void fill(const T* src, Q* dst, int64_t n) {
  if constexpr (std::is_same_v<T, Q>)
    std::memcpy(dst, src, n * sizeof(T));
  else
    widen(src, dst, n);
}

template <typename scalar_t, typename R, typename Q>
void decode_items(const Problem& p, const RowKernels<R, Q>& kernels, scalar_t* o_ptr, const scalar_t* q_ptr,
                  const scalar_t* k_ptr, const scalar_t* v_ptr, const int32_t* tables, const int64_t* start_ptr,
                  const int64_t* end_ptr, const float* sink_ptr) {
  const int64_t group = p.H / p.Hkv, Dk = p.Dk, Dv = p.Dv, block_size = p.block_size;
  const int64_t k_row = p.Hkv * Dk, v_row = p.Hkv * Dv;  // elements per cached token
  // One work item is a sequence and a run of its KV heads: all of them when there are sequences
  // enough to keep every thread busy (a block's rows of all heads are then read front to back), one
  // when there are few (a lone long decode still uses every thread).
  const int64_t heads_per_item = p.B >= 2 * at::get_num_threads() ? p.Hkv : 1;
  const int64_t items_per_seq = p.Hkv / heads_per_item;
  // Rows read where they lie, or first widened to float32 (R = float for a cache of another dtype).
  constexpr bool in_place = std::is_same_v<R, scalar_t>;

  const std::vector<int64_t> cuts = balanced_cuts(start_ptr, end_ptr, p.B, items_per_seq, at::get_num_threads());

  at::parallel_for(0, int64_t(cuts.size()) - 1, 1, [&](int64_t first_part, int64_t last_part) {
    const int64_t heads = heads_per_item * group;  // query heads of one item
    std::vector<Q> q(heads * kernels.q_width, Q(0.f));
    std::vector<float> acc(heads * kernels.out_width), total(heads), scores;
    std::vector<float> widened(in_place ? 0 : block_size * heads_per_item * std::max(Dk, Dv));
    for (int64_t item = cuts[first_part]; item < cuts[last_part]; ++item) {
      const int64_t b = item / items_per_seq, h0 = (item % items_per_seq) * heads_per_item;
      const int64_t first = start_ptr[b], last = end_ptr[b], n = std::max<int64_t>(last - first, 0);
      const int32_t* table = tables + b * p.max_blocks;
      for (int64_t j = 0; j < heads; ++j)  // the item's heads are adjacent in the query
        fill(q_ptr + (b * p.H + h0 * group + j) * Dk, q.data() + j * kernels.q_width, Dk);
      scores.resize(heads * std::max<int64_t>(n, 1));

      // The rows of head h0 + h of a run of `count` tokens, and the distance between them.
      auto rows = [&](const scalar_t* base, int64_t offset, int64_t count, int64_t row, int64_t dim)
          -> std::pair<const R*, int64_t> {
        if constexpr (in_place) {
          return {base + offset + h0 * dim, row};
        } else {
          for (int64_t t = 0; t < count; ++t)
            widen(base + offset + t * row + h0 * dim, widened.data() + t * heads_per_item * dim,
                  heads_per_item * dim);
          return {widened.data(), heads_per_item * dim};
        }
      };

      // Scores, head-major ([heads, n]).
      // While a block's rows of a head are read, the same head's rows of the next block are fetched;
      // while the last block's are, those of the values' first block, where the next pass starts
      // (and, in the values' pass, the next item's first block of keys): the first block of each
      // pass came cold from memory before (the 100M Llama in bfloat16, `bench/throughput.py` with the
      // builds alternated: 1-2% more tokens/s at 64 x 128, 3% in the mixed workload).
      const auto [v_first, v_first_count] =
          n > 0 ? first_run(table, block_size, v_row, first, last) : std::pair<int64_t, int64_t>{0, 0};
      for_each_block(table, block_size, k_row, first, last,
                     [&](int64_t t, int64_t count, int64_t offset, int64_t next, int64_t next_count) {
        const auto [keys, stride] = rows(k_ptr, offset, count, k_row, Dk);
        for (int64_t h = 0; h < heads_per_item; ++h) {
          if (next >= 0)
            fetch_ahead(k_ptr + next + (h0 + h) * Dk, next_count, k_row, Dk);
          else
            fetch_ahead(v_ptr + v_first + (h0 + h) * Dv, v_first_count, v_row, Dv);
          kernels.score(q.data() + h * group * kernels.q_width, group, Dk, keys + h * Dk, stride, count,
                        scores.data() + h * group * n + (t - first), n);
        }
      });

      // Softmax weights, unnormalised.
      for (int64_t j = 0; j < heads; ++j)
        total[j] = softmax_weights(scores.data() + j * n, n, p.scale, p.cap,
                                   sink_ptr != nullptr ? sink_ptr + h0 * group + j : nullptr);

      // Weighted values.
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t next_item = item + 1;  // this thread's, if it is before cuts[last_part]
      const int64_t nb = next_item / items_per_seq, nh0 = (next_item % items_per_seq) * heads_per_item;
      const bool next_keys = next_item < cuts[last_part] && end_ptr[nb] > start_ptr[nb];
      const auto [k_next, k_next_count] = next_keys
                                              ? first_run(tables + nb * p.max_blocks, block_size, k_row, start_ptr[nb],
                                                          end_ptr[nb])
                                              : std::pair<int64_t, int64_t>{0, 0};
      for_each_block(table, block_size, v_row, first, last,
                     [&](int64_t t, int64_t count, int64_t offset, int64_t next, int64_t next_count) {
        const auto [values, stride] = rows(v_ptr, offset, count, v_row, Dv);
        for (int64_t h = 0; h < heads_per_item; ++h) {
          if (next >= 0)
            fetch_ahead(v_ptr + next + (h0 + h) * Dv, next_count, v_row, Dv);
          else if (next_keys)
            fetch_ahead(k_ptr + k_next + (nh0 + h) * Dk, k_next_count, k_row, Dk);
          kernels.accumulate(scores.data() + h * group * n + (t - first), group, Dv, values + h * Dv, stride, count,
                             acc.data() + h * group * kernels.out_width, n);
        }
      });
      for (int64_t j = 0; j < heads; ++j) {
        const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
        scalar_t* o = o_ptr + (b * p.H + h0 * group + j) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<scalar_t>(acc[j * kernels.out_width + d] * inv);
      }
    }
  });
}

#ifdef KEEPWARM_IN_PLACE_16BIT
// The in-place loops for a 16-bit cache whose head dims fit them (up to 256); nullopt otherwise.
constexpr int64_t kMaxInPlaceChunks = 16;

template <typename T, int... Cs>
void pick_in_place(int64_t dk, int64_t dv, RowKernels<T, float>& k, int& found) {
  ((dk <= Cs * 16 && dk > (Cs - 1) * 16 ? (void)(k.score = &score_in_place<T, Cs>, k.q_width = Cs * 16, ++found)
                                        : (void)0),
   ...);
  ((dv <= Cs * 16 && dv > (Cs - 1) * 16
        ? (void)(k.accumulate = &accumulate_in_place<T, Cs>, k.out_width = Cs * 16, ++found)
        : (void)0),
   ...);
}

template <typename T>
std::optional<RowKernels<T, float>> in_place_kernels(int64_t dk, int64_t dv) {
  RowKernels<T, float> k{};
  int found = 0;
  pick_in_place<T, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, kMaxInPlaceChunks>(dk, dv, k, found);
  if (found != 2) return std::nullopt;
  return k;
}

#ifdef __AVX512BF16__
// bfloat16 keys scored by pair dot products, the query heads kept as bfloat16.
template <int... Cs>
std::optional<RowKernels<c10::BFloat16, c10::BFloat16>> dot_kernels(int64_t dk, int64_t dv) {
  const auto in_place = in_place_kernels<c10::BFloat16>(dk, dv);
  if (!in_place) return std::nullopt;
  RowKernels<c10::BFloat16, c10::BFloat16> k{nullptr, in_place->accumulate, 0, in_place->out_width};
  ((dk <= Cs * 32 && dk > (Cs - 1) * 32 ? (void)(k.score = &score_dot_bf16<Cs>, k.q_width = Cs * 32) : (void)0),
   ...);
  if (k.score == nullptr) return std::nullopt;
  return k;
}
#endif
#endif

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
  const Problem p{query.size(0), query.size(1), query.size(2), v_cache.size(3), k_cache.size(1), k_cache.size(2),
                  block_tables.size(1), static_cast<float>(scale), static_cast<float>(softcap)};
  const auto run = [&](const auto& kernels) {
    decode_items(p, kernels, out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                 v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(), starts.data_ptr<int64_t>(),
                 ends.data_ptr<int64_t>(), sinks.has_value() ? sinks->data_ptr<float>() : nullptr);
  };
#ifdef KEEPWARM_IN_PLACE_16BIT
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (const auto dot = dot_kernels<1, 2, 3, 4, 5, 6, 7, 8>(p.Dk, p.Dv)) return run(*dot);
    }
#endif
    if (const auto in_place = in_place_kernels<scalar_t>(p.Dk, p.Dv)) return run(*in_place);
  }
#endif
  run(RowKernels<float, float>{kernels(p.Dk).first, kernels(p.Dv).second, p.Dk, p.Dv});
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
