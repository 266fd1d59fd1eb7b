// Linear layers for steps of up to a few hundred tokens on AVX-512, float32 and bfloat16, reading the
// weight where it lies and writing the output in rows: out = x @ weight^T (+ bias).
//
// A decode step of a float32 model multiplies a few dozen rows by every weight once. MKL's sgemm,
// asked for the product either way round, streamed a weight that had left the caches at about a
// third of one thread's sequential rate (100M Llama's projections, one thread, Xeon with AVX-512: 7
// GB/s at 16 rows, 120 GFLOPS at 64 against 180 with the weights in L3), and the faster of the two
// ways (weight-major, engine/cpu_linear.py) left its output transposed, to be copied into rows. On a
// CPU with AVX-512 BF16 but no AMX tiles (amx_linear.cpp), a bfloat16 step went to oneDNN, which read
// its packed weight at 9 GB/s for one row and, from 16 rows on, was held to VDPBF16PS's rate: about 75
// GFLOPS where two float32 FMAs a cycle make 175 (Xeon with avx512_bf16 and no AMX, one thread).
//
// Here each output is a dot product along K, the contiguous dimension of both operands, so neither
// is rearranged: a tile of 4 weight rows x T tokens holds 4T accumulators of 16 float32 lanes, each k
// step loads a 64-byte line of each of the 4 weight rows and the T tokens' activations for 4T (float32)
// or 8T (bfloat16, widened: Dot below) FMAs, and a tile's lanes are totalled at the end in a shuffle
// tree that leaves each token's 4 features side by side for one store. Features go in blocks of 32
// rows; within a block the tokens go T at a time (the block's rows stay in L1 and L2 while the
// activation streams from L2), and while a block computes, the next block's rows are prefetched into
// L2, spread over its tiles, so the weight arrives at the rate memory gives it rather than when a load
// misses. K goes in chunks of 4 KiB of a row (a tile's 4 rows of a chunk, 16 KiB, stay in L1), their
// totals added in float32: in the output for float32, in a block of float32 sums for bfloat16, rounded
// to bfloat16 (nearest even) once K is done.
//
// The sums run in a fixed order that depends only on K: a token's outputs are the same whatever the
// other tokens of the step. They differ from MKL's (whose order depends on the number of rows) by
// float32 rounding, about 1e-6 relative; a bfloat16 output may differ from oneDNN's by a unit in its
// last place (about as often as oneDNN's own kernels differ from the exactly rounded product). Needs N
// a multiple of 4 (engine/cpu_linear.py sends other shapes to torch); any K. Built where the compiler
// targets AVX-512 (-march=native on such a CPU), bfloat16 where it targets AVX-512 BF16 too (the CPUs
// whose bfloat16 oneDNN runs natively, the only ones engine/cpu_linear.py sends it);
// f32_linear_available and bf16_linear_available say what this build has.
//
// Registered as torch.ops.keepwarm_cpu.{f32_linear, bf16_linear, f32_linear_available,
// bf16_linear_available} (attention/native.py builds it into one library with the other kernels).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "linear_operands.h"  // check_linear_shapes, float_bias, rows_and_output: shared with amx_linear.cpp

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define KEEPWARM_F32_LINEAR 1
#include <immintrin.h>
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define KEEPWARM_BF16_LINEAR 1
#include "vec16.h"  // load, to_bfloat16: rounding as the other kernels round
#endif
#endif

namespace {

#if defined(KEEPWARM_F32_LINEAR)

constexpr int kFeatures = 4;            // weight rows per tile
constexpr int64_t kBlockFeatures = 32;  // weight rows per block (and per unit of work between threads)
constexpr int64_t kChunkBytes = 4096;   // bytes of a weight row's K per pass over a block
// bfloat16: tokens staged as float32 at a time (a slab's activations, 256 x K x 4 bytes, stay a few MB
// for the largest layers; each slab reads the weight again, which from 16 tokens costs less than the
// arithmetic)
constexpr int64_t kSlabTokens = 256;

// The totals of four 16-lane sums, in lanes 0..3: pairs of lanes, then pairs of pairs, within each
// 128-bit lane, then the four 128-bit lanes.
inline __m128 totals4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// A weight element type: kStep elements per 64-byte line, tiles of kTokens tokens (as many as the
// registers hold beside the 4 x kTokens accumulators), and one k step of a tile: a line of each of the
// 4 weight rows (stride K, the first `tail` elements only where Tail) multiplied into the float32
// activations of T tokens (stride x_stride) and added to acc.
template <typename E>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int64_t kStep = 16;
  static constexpr int kTokens = 6;  // 24 accumulators, 6 activation vectors and a weight vector

  template <int T, bool Tail>
  static void step(const float* w, const float* x, int64_t K, int64_t x_stride, int64_t tail,
                   __m512 (&acc)[T][kFeatures]) {
    const __mmask16 lanes = Tail ? __mmask16((1u << tail) - 1) : 0;
    __m512 xv[T];
    for (int t = 0; t < T; ++t)
      xv[t] = Tail ? _mm512_maskz_loadu_ps(lanes, x + t * x_stride) : _mm512_loadu_ps(x + t * x_stride);
    for (int f = 0; f < kFeatures; ++f) {
      const __m512 wv = Tail ? _mm512_maskz_loadu_ps(lanes, w + f * K) : _mm512_loadu_ps(w + f * K);
      for (int t = 0; t < T; ++t) acc[t][f] = _mm512_fmadd_ps(wv, xv[t], acc[t][f]);
    }
  }
};

#if defined(KEEPWARM_BF16_LINEAR)
// bfloat16 weights widened to float32 (a bfloat16 is a float32's upper half) and multiplied with
// float32 FMAs: on the Xeon measured, VDPBF16PS (64 flops) retired one per 0.85 ns and an FMA (32
// flops) one per 0.18 ns, so a step of many tokens, bound by arithmetic, can run twice as fast this
// way. A line of 32 weights becomes its even elements (shifted up) and its odd ones (masked), and each
// token's activations are staged as float32 in the same order (stage_bf16), so the products are exact
// and their sums float32.
// A line of 32 bfloat16 as float32: its 16 even elements shifted up, its 16 odd ones with the even
// bits masked off. The weights' tiles and the staged activations (stage_bf16) both take this order.
inline void widen(__m512i line, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(line, _mm512_set1_epi32(int(0xffff0000u))));
}

template <>
struct Dot<c10::BFloat16> {
  static constexpr int64_t kStep = 32;
  static constexpr int kTokens = 5;  // 20 accumulators, 8 widened weight vectors, 2 activation vectors

  template <int T, bool Tail>
  static void step(const c10::BFloat16* w, const float* x, int64_t K, int64_t x_stride, int64_t tail,
                   __m512 (&acc)[T][kFeatures]) {
    __m512 even[kFeatures], odd[kFeatures];
    for (int f = 0; f < kFeatures; ++f)
      widen(Tail ? _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << tail) - 1), w + f * K)
                 : _mm512_loadu_si512(w + f * K),
            even[f], odd[f]);
    for (int t = 0; t < T; ++t) {
      const __m512 x_even = _mm512_loadu_ps(x + t * x_stride), x_odd = _mm512_loadu_ps(x + t * x_stride + 16);
      for (int f = 0; f < kFeatures; ++f)
        acc[t][f] = _mm512_fmadd_ps(odd[f], x_odd, _mm512_fmadd_ps(even[f], x_even, acc[t][f]));
    }
  }
};

// x's M rows of K bfloat16 as float32, each line of 32 as its 16 even elements then its 16 odd ones
// (the widened weight's order), K padded with zeros to whole lines: rows of x_stride elements.
std::vector<float> stage_bf16(const c10::BFloat16* x, int64_t M, int64_t K, int64_t x_stride) {
  std::vector<float> staged(M * x_stride);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 lanes = K - k >= 32 ? ~__mmask32(0) : __mmask32((uint64_t(1) << (K - k)) - 1);
      __m512 even, odd;
      widen(_mm512_maskz_loadu_epi16(lanes, x + m * K + k), even, odd);
      float* to = staged.data() + m * x_stride + k;
      _mm512_storeu_ps(to, even);
      _mm512_storeu_ps(to + 16, odd);
    }
  }
  return staged;
}
#endif

// Where a tile's float32 sums go: rows `stride` apart (the output's for float32, a block of sums for
// bfloat16), to be added to what a previous K chunk left there (accumulate), plus the bias's 4
// features on the last chunk (bias, else null).
struct TileOut {
  float* out;
  int64_t stride;
  bool accumulate;
  const float* bias;
};

// Rows of the next block a tile fetches into L2, a line of each per k step, at the tile's k.
template <typename E>
struct Ahead {
  const E* rows;  // the first row, at the tile's k (null: nothing to fetch)
  int count;
};

// T tokens (float32 rows of x, stride x_stride) x 4 weight rows (stride K) over kn elements of K.
template <typename E, int T>
void tile(const E* w, const float* x, int64_t K, int64_t x_stride, int64_t kn, Ahead<E> ahead, TileOut to) {
  constexpr int64_t kStep = Dot<E>::kStep;
  __m512 acc[T][kFeatures];
  for (int t = 0; t < T; ++t)
    for (int f = 0; f < kFeatures; ++f) acc[t][f] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= kn; k += kStep) {  // whole lines, then the tail
    for (int r = 0; r < ahead.count; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead.rows + r * K + k), _MM_HINT_T1);
    Dot<E>::template step<T, false>(w + k, x + k, K, x_stride, 0, acc);
  }
  if (k < kn) Dot<E>::template step<T, true>(w + k, x + k, K, x_stride, kn - k, acc);
  for (int t = 0; t < T; ++t) {
    float* row = to.out + t * to.stride;
    __m128 sums = totals4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
    if (to.accumulate) sums = _mm_add_ps(_mm_loadu_ps(row), sums);
    if (to.bias != nullptr) sums = _mm_add_ps(sums, _mm_loadu_ps(to.bias));
    _mm_storeu_ps(row, sums);
  }
}

template <typename E>
using Tile = void (*)(const E*, const float*, int64_t, int64_t, int64_t, Ahead<E>, TileOut);

template <typename E, size_t... T>
constexpr std::array<Tile<E>, sizeof...(T)> tiles_of(std::index_sequence<T...>) {
  return {tile<E, int(T) + 1>...};
}

// The tile of 1..kTokens tokens, at [tokens - 1].
template <typename E>
constexpr std::array<Tile<E>, Dot<E>::kTokens> kTiles = tiles_of<E>(std::make_index_sequence<Dot<E>::kTokens>());

// Features [n0, n1) of every token, their float32 sums written from `out` (feature n0 of token 0) in
// rows `stride` apart. While they compute, the next block's rows (those of this K chunk) are fetched
// into L2, spread over the tiles: a line per k step per tile once there are 32 tiles or more, more
// lines each where there are fewer, so the fetches run beside the block's work instead of queueing at
// its start.
template <typename E>
void feature_block(const E* w, const float* x, int64_t x_stride, const float* bias, float* out, int64_t stride,
                   int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t kChunkK = kChunkBytes / int64_t(sizeof(E));
  constexpr int64_t kTokens = Dot<E>::kTokens;
  const int64_t next = n0 + kBlockFeatures, next_rows = std::max<int64_t>(0, std::min(N, next + kBlockFeatures) - next);
  const int64_t tiles = (M + kTokens - 1) / kTokens * ((n1 - n0) / kFeatures);
  const int64_t per_tile = (next_rows + tiles - 1) / tiles;
  for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
    const int64_t kn = std::min(kChunkK, K - k0);
    const bool last_chunk = k0 + kn == K;
    int64_t fetched = 0;  // rows of the next block fetched so far in this chunk
    for (int64_t m0 = 0; m0 < M; m0 += kTokens) {
      const Tile<E> tile_fn = kTiles<E>[std::min(kTokens, M - m0) - 1];
      for (int64_t n = n0; n < n1; n += kFeatures) {
        const int count = static_cast<int>(std::min(per_tile, next_rows - fetched));
        const Ahead<E> ahead{count > 0 ? w + (next + fetched) * K + k0 : nullptr, std::max(count, 0)};
        fetched += ahead.count;
        const TileOut to{out + m0 * stride + (n - n0), stride, k0 > 0,
                         last_chunk && bias != nullptr ? bias + n : nullptr};
        tile_fn(w + n * K + k0, x + m0 * x_stride + k0, K, x_stride, kn, ahead, to);
      }
    }
  }
}

#endif  // KEEPWARM_F32_LINEAR

bool f32_linear_available() {
#if defined(KEEPWARM_F32_LINEAR)
  return true;
#else
  return false;
#endif
}

bool bf16_linear_available() {
#if defined(KEEPWARM_BF16_LINEAR)
  return true;
#else
  return false;
#endif
}

// The checks and operands both operators share; `done` where the output is already whole (no rows,
// or K == 0: the bias, or zeros).
struct Call {
  RowsAndOutput operands;
  std::optional<at::Tensor> bias;  // float32
  int64_t M, K, N;
  bool done;
};

// x and weight in `dtype` (called `dtype_name` in the message).
Call prepare(const char* op, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
             at::ScalarType dtype, const char* dtype_name) {
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype, op, ": ", dtype_name, " only");
  check_linear_shapes(op, x, weight);
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(N > 0 && N % 4 == 0, op, ": N must be a positive multiple of 4, got ", N);
  Call call{rows_and_output(x, N), float_bias(op, bias, N), 0, K, N, false};
  call.M = call.operands.M;
  call.done = call.M == 0 || K == 0;
  if (call.M > 0 && K == 0) {
    at::Tensor out = call.operands.out;
    call.bias.has_value() ? out.copy_(call.bias->expand_as(out)) : out.zero_();
  }
  return call;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(f32_linear_available(), "f32_linear: this build or CPU has no AVX-512");
  const Call call = prepare("f32_linear", x, weight, bias, at::kFloat, "float32");
  at::Tensor out = call.operands.out;
  if (call.done) return out;
  const int64_t M = call.M, K = call.K, N = call.N;
#if defined(KEEPWARM_F32_LINEAR)
  const float* xs = call.operands.rows.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = call.bias.has_value() ? call.bias->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (N + kBlockFeatures - 1) / kBlockFeatures, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t n0 = block * kBlockFeatures;
      feature_block(w, xs, K, b, o + n0, N, M, N, K, n0, std::min(N, n0 + kBlockFeatures));
    }
  });
#endif
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_linear_available(), "bf16_linear: this build or CPU has no AVX-512 BF16");
  const Call call = prepare("bf16_linear", x, weight, bias, at::kBFloat16, "bfloat16");
  at::Tensor out = call.operands.out;
  if (call.done) return out;
  const int64_t M = call.M, K = call.K, N = call.N;
#if defined(KEEPWARM_BF16_LINEAR)
  using bf16 = c10::BFloat16;
  const int64_t x_stride = (K + 31) / 32 * 32;
  const bf16* w = weight.data_ptr<bf16>();
  const float* b = call.bias.has_value() ? call.bias->data_ptr<float>() : nullptr;
  for (int64_t m0 = 0; m0 < M; m0 += kSlabTokens) {  // a prefill chunk's rows a slab at a time
    const int64_t rows = std::min(kSlabTokens, M - m0);
    const std::vector<float> xs = stage_bf16(call.operands.rows.data_ptr<bf16>() + m0 * K, rows, K, x_stride);
    bf16* o = out.data_ptr<bf16>() + m0 * N;
    at::parallel_for(0, (N + kBlockFeatures - 1) / kBlockFeatures, 1, [&](int64_t first, int64_t last) {
      std::vector<float> sums(rows * kBlockFeatures);  // a block's float32 sums, token-major
      for (int64_t block = first; block < last; ++block) {
        const int64_t n0 = block * kBlockFeatures, width = std::min(N, n0 + kBlockFeatures) - n0;
        feature_block(w, xs.data(), x_stride, b, sums.data(), kBlockFeatures, rows, N, K, n0, n0 + width);
        const __mmask16 low = __mmask16((1u << std::min<int64_t>(16, width)) - 1);
        const __mmask16 high = width > 16 ? __mmask16((1u << (width - 16)) - 1) : 0;
        for (int64_t m = 0; m < rows; ++m) {  // rounded to bfloat16 into the output's row
          const float* s = sums.data() + m * kBlockFeatures;
          bf16* row = o + m * N + n0;
          _mm256_mask_storeu_epi16(row, low, __builtin_bit_cast(__m256i, to_bfloat16(load(s))));
          if (high) _mm256_mask_storeu_epi16(row + 16, high, __builtin_bit_cast(__m256i, to_bfloat16(load(s + 16))));
        }
      }
    });
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(keepwarm_cpu, m) {
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // no tensors: one kernel for every key
  m.def("f32_linear_available() -> bool", &f32_linear_available);
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
}

TORCH_LIBRARY_IMPL(keepwarm_cpu, CPU, m) {
  m.impl("f32_linear", &f32_linear);
  m.impl("bf16_linear", &bf16_linear);
}
