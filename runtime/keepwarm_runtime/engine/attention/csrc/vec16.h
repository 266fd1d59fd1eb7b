// What keepwarm's CPU kernels share: a vector of 16 float32 lanes and the few operations on it that
// paged_decode.cpp, fused_ops.cpp and amx_linear.cpp need (load, store, a horizontal sum, e^x, SiLU,
// rounding to bfloat16).
//
// One AVX-512 register under -march of a CPU that has it; GCC splits the type into two ymm registers
// on AVX2, scalar code elsewhere. The functions are static inline: each kernel file gets its own copy,
// and nothing here is exported from the library. (attention/native.py hashes this header with the
// sources into the library's name.)

#pragma once

#include <cstdint>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vhalfword __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;

static inline vfloat load(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof v); }

// A tree of four shuffle-and-adds (a loop over the lanes would be a chain of 15 dependent adds).
static inline float hsum(vfloat v) {
  v += __builtin_shuffle(v, vint{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vint{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vint{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vint{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// e^x on [-87.3, 88] (clamped outside it): 2^n * e^r with n = round(x / ln 2) and Cephes' expf
// polynomial for e^r (relative error ~1e-7, as libm's expf). Below -87.3 it returns ~1e-38 rather
// than 0 (a softmax weight no sum can notice).
static inline vfloat exp16(vfloat x) {
  const vfloat zero{}, one = zero + 1.f;
  x = x < -87.3f ? zero - 87.3f : x;
  x = x > 88.f ? zero + 88.f : x;
  const vfloat y = x * 1.44269504088896341f + 0.5f;
  vfloat n = __builtin_convertvector(__builtin_convertvector(y, vint), vfloat);
  n -= n > y ? one : zero;  // conversion truncates towards zero: floor for negative y
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return p * __builtin_bit_cast(vfloat, bits);
}

// silu(g) = g / (1 + e^-g), as torch computes it: the SiLU-and-mul kernel and the AMX gate/up kernel
// share it, so that their results are the same bits.
static inline vfloat silu16(vfloat g) { return g / (1.f + exp16(-g)); }

// GELU's tanh form, 0.5 g (1 + tanh(k (g + 0.044715 g^3))) with k = sqrt(2 / pi), written as the
// sigmoid it equals, g / (1 + e^-2k(g + 0.044715 g^3)): no 1 + tanh to cancel where g is negative.
constexpr float kGeluTanhScale = 2.f * 0.7978845608028654f;  // 2k
static inline vfloat gelu_tanh16(vfloat g) {
  return g / (1.f + exp16(-kGeluTanhScale * (g + 0.044715f * g * g * g)));
}

// float32 to bfloat16 bits, rounded to nearest even, NaN kept a NaN: one instruction with AVX-512 BF16
// (which also reads a float32 subnormal, below 1.2e-38, as zero), integer operations elsewhere.
static inline vhalfword to_bfloat16(vfloat v) {
#ifdef __AVX512BF16__
  return __builtin_bit_cast(vhalfword, _mm512_cvtneps_pbh(__builtin_bit_cast(__m512, v)));
#else
  const vuint bits = __builtin_bit_cast(vuint, v);
  const vuint rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  return __builtin_convertvector(v != v ? vuint{} + 0x7fc0u : rounded, vhalfword);
#endif
}

// v rounded to bfloat16 and widened again: where a bfloat16 model stores an intermediate.
static inline vfloat round_bf16(vfloat v) {
  return __builtin_bit_cast(vfloat, __builtin_convertvector(to_bfloat16(v), vuint) << 16);
}
