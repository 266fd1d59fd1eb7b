// A float32 linear layer for steps of few tokens on AVX-512, reading the weight where it lies and
// writing the output in rows: out = x @ weight^T (+ bias).
//
// A decode step of a float32 model multiplies a few dozen rows by every weight once. MKL's sgemm,
// asked for the product either way round, streamed a weight that had left the caches at about a
// third of one thread's sequential rate (100M Llama's projections, one thread, Xeon with AVX-512: 7
// GB/s at 16 rows, 120 GFLOPS at 64 against 180 with the weights in L3), and the faster of the two
// ways (weight-major, engine/cpu_linear.py) left its output transposed, to be copied into rows.
//
// Here each output is a dot product along K, the contiguous dimension of both operands, so neither
// is rearranged: a tile of 4 weight rows x 6 tokens holds 24 accumulators of 16 lanes, each k step
// loads 4 weight and 6 activation vectors for 24 FMAs, and a tile's lanes are totalled at the end in
// a shuffle tree that leaves each token's 4 features side by side for one store. Features go in
// blocks of 32 rows; within a block the tokens go 6 at a time (the block's rows stay in L1 and L2
// while the activation streams from L2), and while a block computes, the next block's rows are
// prefetched into L2, spread over its tiles, so the weight arrives at the rate memory gives it rather
// than when a load misses. K goes in chunks of 1024 (a tile's 4 rows of a chunk, 16 KiB, stay in L1),
// their totals added in the output.
//
// The sums run in a fixed order that depends only on K: a token's outputs are the same whatever the
// other tokens of the step, and differ from MKL's (whose order depends on the number of rows) by
// float32 rounding, about 1e-6 relative. Needs N a multiple of 4 (engine/cpu_linear.py sends other
// shapes to torch); any K. Built where the compiler targets AVX-512 (-march=native on such a CPU);
// f32_linear_available says whether this build has it.
//
// Registered as torch.ops.keepwarm_cpu.{f32_linear, f32_linear_available} (attention/native.py builds
// it into one library with the other kernels).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "linear_operands.h"  // check_linear_shapes, float_bias, rows_and_output: shared with amx_linear.cpp

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define KEEPWARM_F32_LINEAR 1
#include <immintrin.h>
#endif

namespace {

#if defined(KEEPWARM_F32_LINEAR)

constexpr int kTokens = 6;             // activation rows per tile
constexpr int kFeatures = 4;           // weight rows per tile
constexpr int64_t kBlockFeatures = 32;  // weight rows per block (and per unit of work between threads)
constexpr int64_t kChunkK = 1024;       // elements of K per pass over a block

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

// Where a tile's sums go: out's rows (stride N), to be added to what a previous K chunk left there
// (accumulate), plus the bias's 4 features on the last chunk (bias, else null).
struct TileOut {
  float* out;
  int64_t N;
  bool accumulate;
  const float* bias;
};

// 16 elements at p (those in `lanes`, the rest zeros: a K tail).
template <bool Tail>
inline __m512 load16(const float* p, __mmask16 lanes) {
  return Tail ? _mm512_maskz_loadu_ps(lanes, p) : _mm512_loadu_ps(p);
}

// One k step of a tile: 16 elements of T tokens and 4 weight rows into acc.
template <int T, bool Tail>
inline void step(const float* w, const float* x, int64_t K, __mmask16 lanes, __m512 (&acc)[T][kFeatures]) {
  __m512 xv[T];
  for (int t = 0; t < T; ++t) xv[t] = load16<Tail>(x + t * K, lanes);
  for (int f = 0; f < kFeatures; ++f) {
    const __m512 wv = load16<Tail>(w + f * K, lanes);
    for (int t = 0; t < T; ++t) acc[t][f] = _mm512_fmadd_ps(wv, xv[t], acc[t][f]);
  }
}

// Rows of the next block a tile fetches into L2, a line of each per k step, at the tile's k.
struct Ahead {
  const float* rows;  // the first row, at the tile's k (null: nothing to fetch)
  int count;
};

// T tokens (rows of x, stride K) x 4 weight rows (stride K) over kn elements of K.
template <int T>
void tile(const float* w, const float* x, int64_t K, int64_t kn, Ahead ahead, TileOut to) {
  __m512 acc[T][kFeatures];
  for (int t = 0; t < T; ++t)
    for (int f = 0; f < kFeatures; ++f) acc[t][f] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= kn; k += 16) {  // whole vectors, then the tail
    for (int r = 0; r < ahead.count; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead.rows + r * K + k), _MM_HINT_T1);
    step<T, false>(w + k, x + k, K, 0, acc);
  }
  if (k < kn) step<T, true>(w + k, x + k, K, static_cast<__mmask16>((1u << (kn - k)) - 1), acc);
  for (int t = 0; t < T; ++t) {
    float* row = to.out + t * to.N;
    __m128 sums = totals4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
    if (to.accumulate) sums = _mm_add_ps(_mm_loadu_ps(row), sums);
    if (to.bias != nullptr) sums = _mm_add_ps(sums, _mm_loadu_ps(to.bias));
    _mm_storeu_ps(row, sums);
  }
}

using Tile = void (*)(const float*, const float*, int64_t, int64_t, Ahead, TileOut);
constexpr Tile kTiles[kTokens + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Features [n0, n1) of every token. While they compute, the next block's rows (those of this K chunk)
// are fetched into L2, spread over the tiles: a line per k step per tile once there are 32 tiles or
// more (6 tokens per pass: from 19 tokens), more lines each where there are fewer, so the fetches run
// beside the block's work instead of queueing at its start.
void feature_block(const float* w, const float* x, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
  const int64_t next = n0 + kBlockFeatures, next_rows = std::max<int64_t>(0, std::min(N, next + kBlockFeatures) - next);
  const int64_t tiles = (M + kTokens - 1) / kTokens * ((n1 - n0) / kFeatures);
  const int64_t per_tile = (next_rows + tiles - 1) / tiles;
  for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
    const int64_t kn = std::min(kChunkK, K - k0);
    const bool last_chunk = k0 + kn == K;
    int64_t fetched = 0;  // rows of the next block fetched so far in this chunk
    for (int64_t m0 = 0; m0 < M; m0 += kTokens) {
      const Tile tile_fn = kTiles[std::min<int64_t>(kTokens, M - m0)];
      for (int64_t n = n0; n < n1; n += kFeatures) {
        const int count = static_cast<int>(std::min(per_tile, next_rows - fetched));
        const Ahead ahead{count > 0 ? w + (next + fetched) * K + k0 : nullptr, std::max(count, 0)};
        fetched += ahead.count;
        const TileOut to{out + m0 * N + n, N, k0 > 0, last_chunk && bias != nullptr ? bias + n : nullptr};
        tile_fn(w + n * K + k0, x + m0 * K + k0, K, kn, ahead, to);
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

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(f32_linear_available(), "f32_linear: this build or CPU has no AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "f32_linear: float32 only");
  check_linear_shapes("f32_linear", x, weight);
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(N > 0 && N % 4 == 0, "f32_linear: N must be a positive multiple of 4, got ", N);
  const std::optional<at::Tensor> bias32 = float_bias("f32_linear", bias, N);
  const RowsAndOutput call = rows_and_output(x, N);
  at::Tensor out = call.out;
  const int64_t M = call.M;
  if (M == 0) return out;
  if (K == 0) return bias32.has_value() ? out.copy_(bias32->expand_as(out)) : out.zero_();
#if defined(KEEPWARM_F32_LINEAR)
  const float* xs = call.rows.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (N + kBlockFeatures - 1) / kBlockFeatures, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t n0 = block * kBlockFeatures;
      feature_block(w, xs, b, o, M, N, K, n0, std::min(N, n0 + kBlockFeatures));
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(keepwarm_cpu, m) {
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("f32_linear_available() -> bool", &f32_linear_available);  // no tensors: one kernel for every key
}

TORCH_LIBRARY_IMPL(keepwarm_cpu, CPU, m) { m.impl("f32_linear", &f32_linear); }
