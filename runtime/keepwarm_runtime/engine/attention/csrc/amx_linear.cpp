// A bfloat16 linear layer on AMX tiles, reading the weight where it lies: out = x @ weight^T (+ bias).
//
// A decode step multiplies a few dozen rows by every weight of the model once, so its linear layers
// are bound by how fast the weights stream from memory. oneDNN's bfloat16 kernels wanted the weight
// reordered into their blocked layout (a private copy as large as the layers, made in the background:
// engine/cpu_linear.py) and still read it at half of one thread's sequential rate at 64 rows.
//
// Here the operands swap places: the weight is AMX's left operand, whose tiles are 16 rows of 32
// consecutive elements, exactly a [N, K] row-major weight's layout, so it is loaded in place (the
// attached, shared weights of the node cache, no copy, nothing to pack). The activation, a few rows,
// is the right operand, rearranged per call into AMX's pair-interleaved layout (M x K elements,
// against N x K of weight). A tile product then gives 16 output features x 16 tokens in float32; they
// are transposed into the output as they are rounded to bfloat16 (round to nearest even).
//
// Blocking, all eight tiles: up to 32 tokens, 32 features at a time (two weight tiles, two activation
// tiles, four accumulators); 33 to 64 tokens, 16 features at a time over four accumulators, so each
// weight tile is read from memory once and feeds four tile products (more tokens loop over pairs of
// token blocks, the weight block then read again from the cache; engine/cpu_linear.py sends steps of
// over 64 tokens to oneDNN, as fast there). While a block computes, the next block's weight rows are
// prefetched into L2: the weight is read once per call, so the tile loads would otherwise wait on
// memory. Feature blocks are split over torch's intra-op threads. Sums accumulate in float32 in the
// tile unit's own order, so a result may differ from oneDNN's by a unit in the last place of
// bfloat16; AMX treats bfloat16 subnormal inputs as zero, as oneDNN's AMX kernels do.
//
// Needs K a multiple of 32 and N of 16 (every layer of the models keepwarm generates and of the usual
// checkpoints; engine/cpu_linear.py sends other shapes to torch). Built where the compiler targets AMX
// (-march=native on a CPU with amx_bf16); the process asks Linux for the tile state once
// (arch_prctl ARCH_REQ_XCOMP_PERM), and amx_linear_available says whether both held.
//
// A gated MLP's first half, silu(x @ gate^T) * (x @ up^T), is one operator (amx_gate_up_silu): the
// gate and up rows of a feature block are the two weight tiles of the same loops, the activation is
// interleaved once for both, and the epilogue rounds each product to bfloat16 and applies SiLU-and-mul
// as fused_ops.cpp does (silu16 from vec16.h), so its bits are those of the three separate calls.
//
// Registered as torch.ops.keepwarm_cpu.{amx_linear, amx_gate_up_silu, amx_linear_available}
// (attention/native.py builds it into one library with the attention and fused kernels).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "linear_operands.h"  // check_linear_shapes, float_bias, rows_and_output: shared with avx512_linear.cpp

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KEEPWARM_AMX 1
#include <immintrin.h>

#include "vec16.h"  // silu16, round_bf16, to_bfloat16: the gate/up epilogue rounds as fused_ops.cpp
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(KEEPWARM_AMX)

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data component

// Tile numbers: accumulators (feature block f, token block t), weight tiles, activation tiles.
#define C00 0
#define C10 1
#define C01 2
#define C11 3
#define W0 4
#define W1 5
#define X0 6
#define X1 7

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Every tile 16 rows x 64 bytes: accumulators 16 features x 16 float32 tokens, weight tiles 16
// features x 32 bfloat16, activation tiles 16 pairs of k x 16 tokens x 2 bfloat16.
void configure_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.colsb[tile] = 64, config.rows[tile] = 16;
  _tile_loadconfig(&config);
}

// r[i][j] <- r[j][i] for 16 vectors of 16 32-bit lanes: unpack within 128-bit lanes, then exchange
// 128-bit lanes, in four rounds of sixteen shuffles.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// The activation's rows in AMX's right-operand layout: per block of 16 tokens, per pair of k, the 16
// tokens' two elements side by side; tokens past M are zeros.
void interleave(const uint32_t* x, int64_t M, int64_t pairs, uint32_t* packed) {
  const int64_t blocks = (M + 15) / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* block = packed + b * pairs * 16;
    const int64_t tokens = std::min<int64_t>(16, M - b * 16);
    const uint32_t* rows = x + b * 16 * pairs;
    // 16 pairs of 16 tokens at a time: a 16 x 16 transpose of 32-bit elements in registers
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const int64_t width = std::min<int64_t>(16, pairs - p0);
      const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1);
      __m512i r[16];
      for (int t = 0; t < 16; ++t)
        r[t] = t < tokens ? _mm512_maskz_loadu_epi32(lanes, rows + t * pairs + p0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t p = 0; p < width; ++p) _mm512_storeu_si512(block + (p0 + p) * 16, r[p]);
    }
  }
}

// Accumulator tile (16 features x 16 tokens, float32, stored at `sums`) into out's rows: transposed in
// registers, so that each token's 16 features are one vector to round and store.
inline void store_block(const float* sums, const float* bias, int64_t tokens, c10::BFloat16* out, int64_t N) {
  __m512i r[16];
  for (int f = 0; f < 16; ++f) r[f] = _mm512_load_si512(sums + f * 16);
  transpose16(r);
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t t = 0; t < tokens; ++t) {
    const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[t]), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * N), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// A gate tile and an up tile (16 features x 16 tokens each) into out's rows as T(silu(T(gate))) *
// T(up), rounded as the separate layers and the SiLU-and-mul kernel round (the same bits).
inline void store_silu_block(const float* gate, const float* up, int64_t tokens, c10::BFloat16* out, int64_t N) {
  __m512i g[16], u[16];
  for (int f = 0; f < 16; ++f) g[f] = _mm512_load_si512(gate + f * 16), u[f] = _mm512_load_si512(up + f * 16);
  transpose16(g);
  transpose16(u);
  for (int64_t t = 0; t < tokens; ++t) {
    const vfloat gate_t = round_bf16(__builtin_bit_cast(vfloat, g[t]));
    const vhalfword h = to_bfloat16(round_bf16(silu16(gate_t)) * round_bf16(__builtin_bit_cast(vfloat, u[t])));
    std::memcpy(out + t * N, &h, sizeof h);
  }
}

// `lines` lines of the next block's weight rows per k step, fetched into L2 while this block computes.
inline void prefetch_share(const char* ahead, int64_t s, int lines) {
  if (ahead == nullptr) return;
  const char* at = ahead + s * lines * 64;
  for (int line = 0; line < lines; ++line) _mm_prefetch(at + line * 64, _MM_HINT_T1);
}

// The 2 x 2 block's four accumulators into sums: weight rows w0 (and w1 when two_features, 16 each)
// times the token blocks at x0 (and x1 when two_tokens), over K; per k step, `lines` lines of each of
// ahead0 and ahead1 (either may be null: nothing to fetch) are fetched into L2.
void pair_sums(const c10::BFloat16* w0, const c10::BFloat16* w1, bool two_features, const uint32_t* x0,
               const uint32_t* x1, bool two_tokens, int64_t K, const char* ahead0, const char* ahead1, int lines,
               float (*sums)[256]) {
  const int64_t steps = K / 32, w_stride = K * 2;
  _tile_zero(C00);
  _tile_zero(C10);
  _tile_zero(C01);
  _tile_zero(C11);
  for (int64_t s = 0; s < steps; ++s) {
    prefetch_share(ahead0, s, lines);
    prefetch_share(ahead1, s, lines);
    _tile_loadd(W0, w0 + s * 32, w_stride);
    _tile_loadd(X0, x0 + s * 256, 64);
    _tile_dpbf16ps(C00, W0, X0);
    if (two_features) {
      _tile_loadd(W1, w1 + s * 32, w_stride);
      _tile_dpbf16ps(C10, W1, X0);
    }
    if (two_tokens) {
      _tile_loadd(X1, x1 + s * 256, 64);
      _tile_dpbf16ps(C01, W0, X1);
      if (two_features) _tile_dpbf16ps(C11, W1, X1);
    }
  }
  _tile_stored(C00, sums[0], 64);
  _tile_stored(C10, sums[1], 64);
  _tile_stored(C01, sums[2], 64);
  _tile_stored(C11, sums[3], 64);
}

// Features [f0, f0 + 32) (or 16) for every token, 32 tokens at a time.
void feature_block(const c10::BFloat16* w, const uint32_t* xs, const float* bias, c10::BFloat16* out, int64_t M,
                   int64_t N, int64_t K, int64_t f0, bool two_features) {
  const int64_t token_blocks = (M + 15) / 16, xb = (K / 2) * 16;
  const c10::BFloat16* w0 = w + f0 * K;
  alignas(64) float sums[4][256];
  for (int64_t tb = 0; tb < token_blocks; tb += 2) {
    const bool two_tokens = tb + 1 < token_blocks;
    // The next block's weight rows (K lines), fetched into L2 while this one computes, during the first
    // pass over the tokens only: later passes find this block's rows in the cache.
    const char* ahead = tb == 0 && f0 + 64 <= N ? reinterpret_cast<const char*>(w + (f0 + 32) * K) : nullptr;
    pair_sums(w0, w0 + 16 * K, two_features, xs + tb * xb, xs + (tb + 1) * xb, two_tokens, K, ahead, nullptr, 32,
              sums);
    for (int tokens_half = 0; tokens_half < (two_tokens ? 2 : 1); ++tokens_half) {
      const int64_t t0 = (tb + tokens_half) * 16;
      const int64_t tokens = std::min<int64_t>(16, M - t0);
      for (int features_half = 0; features_half < (two_features ? 2 : 1); ++features_half) {
        const int64_t f = f0 + features_half * 16;
        store_block(sums[tokens_half * 2 + features_half], bias != nullptr ? bias + f : nullptr, tokens,
                    out + t0 * N + f, N);
      }
    }
  }
}

// The sums of 16 weight rows (from w0) x 33..64 tokens in one pass: four accumulators over one weight
// tile, so each weight tile is read from memory once and feeds four tile products.
void wide_sums(const c10::BFloat16* w0, const uint32_t* xs, int64_t K, int64_t token_blocks, const char* ahead,
               float (*sums)[256]) {
  const int64_t steps = K / 32, w_stride = K * 2, xb = (K / 2) * 16;
  const bool four = token_blocks == 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    prefetch_share(ahead, s, 16);
    _tile_loadd(4, w0 + s * 32, w_stride);
    _tile_loadd(5, xs + s * 256, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, xs + xb + s * 256, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, xs + 2 * xb + s * 256, 64);
    _tile_dpbf16ps(2, 4, 7);
    if (four) {
      _tile_loadd(5, xs + 3 * xb + s * 256, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
}

// 16 features x 33..64 tokens.
void feature_tile_wide(const c10::BFloat16* w, const uint32_t* xs, const float* bias, c10::BFloat16* out,
                       int64_t M, int64_t N, int64_t K, int64_t f0) {
  const int64_t token_blocks = (M + 15) / 16;
  const char* ahead = f0 + 32 <= N ? reinterpret_cast<const char*>(w + (f0 + 16) * K) : nullptr;
  alignas(64) float sums[4][256];
  wide_sums(w + f0 * K, xs, K, token_blocks, ahead, sums);
  for (int64_t tb = 0; tb < token_blocks; ++tb) {
    const int64_t t0 = tb * 16;
    store_block(sums[tb], bias != nullptr ? bias + f0 : nullptr, std::min<int64_t>(16, M - t0), out + t0 * N + f0, N);
  }
}

// silu(x @ gate[f0, f0 + 16)^T) * (x @ up[f0, f0 + 16)^T) for every token: the MLP's two projections
// and its activation in one pass over the activation's interleaved rows, the output written once.
// Up to 32 tokens (and past 64), the gate and up rows are the two weight tiles of a 2 x 2 block; for
// 33..64 tokens, each takes the four-accumulator pass in turn.
void gate_up_block(const c10::BFloat16* gate, const c10::BFloat16* up, const uint32_t* xs, c10::BFloat16* out,
                   int64_t M, int64_t N, int64_t K, int64_t f0) {
  const int64_t token_blocks = (M + 15) / 16, xb = (K / 2) * 16;
  const c10::BFloat16* g0 = gate + f0 * K;
  const c10::BFloat16* u0 = up + f0 * K;
  const bool more = f0 + 32 <= N;  // a next block, to fetch ahead
  const char* gate_ahead = more ? reinterpret_cast<const char*>(g0 + 16 * K) : nullptr;
  const char* up_ahead = more ? reinterpret_cast<const char*>(u0 + 16 * K) : nullptr;
  alignas(64) float sums[8][256];
  if (M > 32 && M <= 64) {
    wide_sums(g0, xs, K, token_blocks, gate_ahead, sums);
    wide_sums(u0, xs, K, token_blocks, up_ahead, sums + 4);
    for (int64_t tb = 0; tb < token_blocks; ++tb)
      store_silu_block(sums[tb], sums[4 + tb], std::min<int64_t>(16, M - tb * 16), out + tb * 16 * N + f0, N);
    return;
  }
  for (int64_t tb = 0; tb < token_blocks; tb += 2) {
    const bool two_tokens = tb + 1 < token_blocks;
    const bool first = tb == 0;  // later passes find the rows in the cache
    pair_sums(g0, u0, true, xs + tb * xb, xs + (tb + 1) * xb, two_tokens, K, first ? gate_ahead : nullptr,
              first ? up_ahead : nullptr, 16, sums);
    for (int half = 0; half < (two_tokens ? 2 : 1); ++half) {
      const int64_t t0 = (tb + half) * 16;
      store_silu_block(sums[half * 2], sums[half * 2 + 1], std::min<int64_t>(16, M - t0), out + t0 * N + f0, N);
    }
  }
}

#endif  // KEEPWARM_AMX

bool amx_linear_available() {
#if defined(KEEPWARM_AMX)
  return tiles_granted();
#else
  return false;
#endif
}

// The checks both operators make: bfloat16, x [..., K], contiguous weights [N, K] with whole tiles.
void check_operands(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(amx_linear_available(), op, ": this build or CPU has no AMX bfloat16 tiles");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, op, ": bfloat16 only");
  check_linear_shapes(op, x, weight);
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(K > 0 && K % 32 == 0 && N > 0 && N % 16 == 0, op,
              ": K must be a multiple of 32 and N of 16, got K=", K, " N=", N);
}

#if defined(KEEPWARM_AMX)
// The M rows of the contiguous activation in the right-operand layout, in a buffer of the calling
// thread's kept between calls (a step's layers reuse it). The buffer starts on a cache line: a tile
// row of 64 bytes then loads from one line, not two (the allocator's 16-byte alignment left 3 of 4
// processes on straddling rows, 10-12% slower over a step's layers at 40-64 tokens).
const uint32_t* interleaved_rows(const at::Tensor& rows, int64_t M, int64_t K) {
  constexpr int64_t kLine = 64 / sizeof(uint32_t);  // elements per cache line
  const int64_t pairs = K / 2;
  thread_local std::vector<uint32_t> packed;
  packed.resize((M + 15) / 16 * 16 * pairs + kLine);
  const uintptr_t address = reinterpret_cast<uintptr_t>(packed.data());
  uint32_t* start = packed.data() + (kLine - address % 64 / sizeof(uint32_t)) % kLine;
  interleave(reinterpret_cast<const uint32_t*>(rows.data_ptr<c10::BFloat16>()), M, pairs, start);
  return start;
}

// fn(first, last) over the blocks [0, count) on torch's intra-op threads, each with its tiles configured.
template <typename Fn>
void on_tiles(int64_t count, Fn&& fn) {
  at::parallel_for(0, count, 4, [&](int64_t first, int64_t last) {
    configure_tiles();
    fn(first, last);
    _tile_release();
  });
}
#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_operands("amx_linear", x, weight);
  const int64_t N = weight.size(0);
  const std::optional<at::Tensor> bias32 = float_bias("amx_linear", bias, N);
  const RowsAndOutput call = rows_and_output(x, N);
  const int64_t M = call.M;
  if (M == 0) return call.out;
#if defined(KEEPWARM_AMX)
  const int64_t K = x.size(-1);
  const uint32_t* xs = interleaved_rows(call.rows, M, K);
  const c10::BFloat16* w = weight.data_ptr<c10::BFloat16>();
  const float* b = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  c10::BFloat16* o = call.out.data_ptr<c10::BFloat16>();
  on_tiles((N + 31) / 32, [&](int64_t first, int64_t last) {
    for (int64_t fb = first; fb < last; ++fb) {
      const int64_t f0 = fb * 32;
      if (M > 32 && M <= 64) {
        feature_tile_wide(w, xs, b, o, M, N, K, f0);
        if (f0 + 32 <= N) feature_tile_wide(w, xs, b, o, M, N, K, f0 + 16);
        continue;
      }
      feature_block(w, xs, b, o, M, N, K, f0, f0 + 32 <= N);
    }
  });
#endif
  return call.out;
}

// silu(x @ gate^T) * (x @ up^T), rounded where the two layers and SiLU-and-mul would round: a gated
// MLP's first half in one operator (engine/cpu_fused.py), the activation interleaved once.
at::Tensor amx_gate_up_silu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up) {
  check_operands("amx_gate_up_silu", x, gate);
  check_operands("amx_gate_up_silu", x, up);
  TORCH_CHECK(gate.sizes() == up.sizes(), "amx_gate_up_silu: gate ", gate.sizes(), " and up ", up.sizes(),
              " differ");
  const int64_t N = gate.size(0);
  const RowsAndOutput call = rows_and_output(x, N);
  const int64_t M = call.M;
  if (M == 0) return call.out;
#if defined(KEEPWARM_AMX)
  const int64_t K = x.size(-1);
  const uint32_t* xs = interleaved_rows(call.rows, M, K);
  const c10::BFloat16* g = gate.data_ptr<c10::BFloat16>();
  const c10::BFloat16* u = up.data_ptr<c10::BFloat16>();
  c10::BFloat16* o = call.out.data_ptr<c10::BFloat16>();
  on_tiles(N / 16, [&](int64_t first, int64_t last) {
    for (int64_t fb = first; fb < last; ++fb) gate_up_block(g, u, xs, o, M, N, K, fb * 16);
  });
#endif
  return call.out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(keepwarm_cpu, m) {
  m.def("amx_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("amx_gate_up_silu(Tensor x, Tensor gate, Tensor up) -> Tensor");
  m.def("amx_linear_available() -> bool", &amx_linear_available);  // no tensors: one kernel for every key
}

TORCH_LIBRARY_IMPL(keepwarm_cpu, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_gate_up_silu", &amx_gate_up_silu);
}
