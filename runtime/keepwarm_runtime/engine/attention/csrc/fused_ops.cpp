// Fused elementwise kernels for a decoder layer on CPU: RMSNorm (alone and after a residual add),
// Gemma's RMSNorm (scaled by 1 + w in float32, rounded once; alone, after a residual add, and Gemma 2's
// and 3's norm-add-norm sandwich between sublayers), SiLU-and-mul (a gated MLP's
// act(gate) * up, from two tensors or from the halves of one gate-and-up product), GELU-tanh-and-mul
// (Gemma's MLP) and rotary position embedding (over the whole head or its first dims, as halves or, GLM's,
// as pairs; DeepSeek-V3's pairs written out as halves).
//
// Each replaces a chain of torch operators that read and write the whole activation once per operator
// (RMSNorm alone is a cast, pow, mean, add, rsqrt, mul, cast and mul) with one pass over each row.
// They round where transformers' modules round, so in bfloat16 and float16 the only differences left
// are the order of RMSNorm's sum of squares and the activations' exp (a float32 polynomial, ~1e-7
// relative, where torch uses Sleef): a result one unit in the last place apart, rarely. In float32 those
// differ by a few units in the last place of float32 (engine/cpu_fused.py says what that does to a
// model's output); GELU's tanh form is computed as the sigmoid it equals, which is exact where torch's
// 1 + tanh cancels (large negative inputs), so there its float32 results differ from torch's by the
// error of torch's form, at most 2e-7 of the input in absolute terms.
//
// Vectorised with vec16.h's 16-float vector type, as paged_decode.cpp (one zmm register under AVX-512,
// two ymm under AVX2, scalar code elsewhere); bfloat16 is widened with integer vector operations and
// rounded (to nearest even) by AVX-512 BF16's conversion where the CPU has it, by integer operations
// elsewhere; float16 goes through c10::Half. Rows are split over torch's intra-op threads when there are enough of
// them to pay for it.
//
// Registered as torch.ops.keepwarm_cpu.{rms_norm, add_rms_norm, gemma_rms_norm, add_gemma_rms_norm,
// gemma_norm_add, gemma_norm_add_norm, silu_and_mul, silu_and_mul_halves, gelu_tanh_and_mul,
// rotary_embedding, rotary_embedding_pairs, rotary_embedding_interleave}
// (attention/native.py builds it into one library with paged_decode.cpp).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "vec16.h"  // vfloat, kLanes, hsum, exp16, silu16, gelu_tanh16, to_bfloat16, round_bf16: shared

namespace {

// Elements per parallel_for grain: below this a kernel stays on the calling thread.
constexpr int64_t kGrainElements = 1 << 15;

// 16 elements of T widened to float32, and float32 rounded back to T (round to nearest even, NaN kept).
template <typename T>
inline vfloat load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    vfloat v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vhalfword h;
    std::memcpy(&h, p, sizeof h);
    const vuint bits = __builtin_convertvector(h, vuint) << 16;
    return __builtin_bit_cast(vfloat, bits);
  } else {
    vfloat v;
    for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
    return v;
  }
}

template <typename T>
inline void store16(T* p, vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const vhalfword h = to_bfloat16(v);
    std::memcpy(p, &h, sizeof h);
  } else {
    for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(v[i]);
  }
}

// x rounded to T and widened again: where transformers' module stores an intermediate in the model's
// dtype. For float32 the value passes through memory by an empty asm (any ISA: a 16-float vector is
// two registers under AVX2), so the compiler cannot contract a * b + c into one fused multiply-add
// across it (torch's separate operators round twice); elsewhere (the exp polynomial, the sum of
// squares) it may.
template <typename T>
inline vfloat round_to(vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    asm("" : "+m"(v));
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(v);
  } else {
    alignas(64) T tmp[kLanes];
    store16(tmp, v);
    return load16(tmp);
  }
}

template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) asm("" : "+m"(v));
  return static_cast<float>(static_cast<T>(v));
}

// 1 / sqrt(mean(x^2) + eps) of one row, the sum of squares in float32 (both RMSNorms' scale).
template <typename T>
inline float rms_scale(const T* x, int64_t n, float eps) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat v = load16(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// One row of RMSNorm, as LlamaRMSNorm: y = w * T(x * rsqrt(mean(x^2) + eps)), the sum in float32.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float r = rms_scale(x, n, eps);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    store16(out + i, load16(w + i) * round_to<T>(load16(x + i) * r));
  for (; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(static_cast<float>(x[i]) * r));
}

// One row of Gemma's RMSNorm: y = T((float(x) * rsqrt(mean(x^2) + eps)) * (1 + float(w))), every
// step in float32 and one rounding to T at the end (GemmaRMSNorm, and Gemma 2's and 3's, which are it).
template <typename T>
inline void gemma_rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float r = rms_scale(x, n, eps);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    store16(out + i, round_to<float>(load16(x + i) * r) * (1.f + load16(w + i)));
  for (; i < n; ++i)
    out[i] = static_cast<T>(round_to<float>(static_cast<float>(x[i]) * r) * (1.f + static_cast<float>(w[i])));
}

// Either RMSNorm of one row, by the norm's kind.
template <bool Gemma, typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  if constexpr (Gemma)
    gemma_rms_norm_row(x, w, out, n, eps);
  else
    rms_norm_row(x, w, out, n, eps);
}

// One row of residual + x (rounded to T, stored in `sum`), then RMSNorm of that sum into `out`.
template <typename T>
inline void add_row(const T* x, const T* residual, T* sum, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store16(sum + i, load16(residual + i) + load16(x + i));
  for (; i < n; ++i) sum[i] = static_cast<T>(static_cast<float>(residual[i]) + static_cast<float>(x[i]));
}

// One row of residual + T(gemma_rms_norm(x)) (rounded to T, into `sum`): Gemma 2's and 3's norm after a
// sublayer and the residual add after it, each rounded where the modules round.
template <typename T>
inline void gemma_norm_add_row(const T* x, const T* w, const T* residual, T* sum, int64_t n, float eps) {
  const float r = rms_scale(x, n, eps);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat normed = round_to<T>(round_to<float>(load16(x + i) * r) * (1.f + load16(w + i)));
    store16(sum + i, load16(residual + i) + normed);
  }
  for (; i < n; ++i) {
    const float normed = round_to<T>(round_to<float>(static_cast<float>(x[i]) * r) * (1.f + static_cast<float>(w[i])));
    sum[i] = static_cast<T>(static_cast<float>(residual[i]) + normed);
  }
}

// The gated MLPs' activations, each as a vector and a scalar function of the same formula.
struct Silu {
  static vfloat vec(vfloat g) { return silu16(g); }
  static float one(float g) { return g / (1.f + std::exp(-g)); }
};
struct GeluTanh {
  static vfloat vec(vfloat g) { return gelu_tanh16(g); }
  static float one(float g) { return g / (1.f + std::exp(-kGeluTanhScale * (g + 0.044715f * g * g * g))); }
};

// One row of T(act(gate)) * up, rounded where torch's act and mul round.
template <typename Act, typename T>
inline void act_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store16(out + i, round_to<T>(Act::vec(load16(gate + i))) * load16(up + i));
  for (; i < n; ++i) out[i] = static_cast<T>(round_to<T>(Act::one(static_cast<float>(gate[i]))) * static_cast<float>(up[i]));
}

// One head's row of rotary embedding, as transformers' apply_rotary_pos_emb (rotate_half layout):
// out = T(T(x * cos) + T(rotate_half(x) * sin)), rotate_half(x) = cat(-x2, x1).
template <typename T>
inline void rotary_row(const T* x, const T* c, const T* s, T* out, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t i = 0;
  if (half % kLanes == 0) {
    for (; i < half; i += kLanes) {
      const vfloat x1 = load16(x + i), x2 = load16(x + half + i);
      const vfloat c1 = load16(c + i), c2 = load16(c + half + i);
      const vfloat s1 = load16(s + i), s2 = load16(s + half + i);
      store16(out + i, round_to<T>(x1 * c1) + round_to<T>(-x2 * s1));
      store16(out + half + i, round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
    }
    return;
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    const float c1 = static_cast<float>(c[i]), c2 = static_cast<float>(c[half + i]);
    const float s1 = static_cast<float>(s[i]), s2 = static_cast<float>(s[half + i]);
    out[i] = static_cast<T>(round_to<T>(x1 * c1) + round_to<T>(-x2 * s1));
    out[half + i] = static_cast<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
}

// One head's row whose rotary dims are pairs (x[2i], x[2i + 1]) turned by angle i, as GLM's
// apply_rotary_pos_emb: cos and sin are cat(freqs, freqs), of which it repeats the first half for each
// pair; out = T(T(x * cos) + T(rotate_pairs(x) * sin)), rotate_pairs(x)[2i, 2i + 1] = (-x[2i + 1], x[2i]).
template <typename T>
inline void rotary_pairs_row(const T* x, const T* c, const T* s, T* out, int64_t dim) {
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float x1 = static_cast<float>(x[2 * i]), x2 = static_cast<float>(x[2 * i + 1]);
    const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
    out[2 * i] = static_cast<T>(round_to<T>(x1 * ci) + round_to<T>(-x2 * si));
    out[2 * i + 1] = static_cast<T>(round_to<T>(x2 * ci) + round_to<T>(x1 * si));
  }
}

// One head's row whose dims come in pairs (x[2i], x[2i + 1]) turned by angle i and leave as halves
// (DeepSeek-V3's apply_rotary_pos_emb_interleave: the pairs' first elements turned make the first half
// of the output, their second elements the second half): out[i] = T(T(x[2i] * cos[i]) - T(x[2i + 1] *
// sin[i])), out[dim / 2 + i] = T(T(x[2i + 1] * cos[i]) + T(x[2i] * sin[i])), cos's first half alone.
template <typename T>
inline void rotary_pairs_to_halves_row(const T* x, const T* c, const T* s, T* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[2 * i]), x2 = static_cast<float>(x[2 * i + 1]);
    const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
    out[i] = static_cast<T>(round_to<T>(x1 * ci) + round_to<T>(-x2 * si));
    out[half + i] = static_cast<T>(round_to<T>(x2 * ci) + round_to<T>(x1 * si));
  }
}

// How a rotary kernel reads and writes a head's rotary dims.
enum class RotaryLayout { kHalves, kPairs, kPairsToHalves };

// Rows of a [rows, n] view: row r starts at r * stride (the last dim contiguous).
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, ": the last dim must be contiguous");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

int64_t grain(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)); }

// Both RMSNorms: x's rows into out, Llama's (w * T(norm(x))) or Gemma's (T(norm(x) * (1 + w))).
void norm_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(), "weight: [hidden], contiguous");
  TORCH_CHECK(out.sizes() == x.sizes(), "out and x have one shape");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type(),
              "x, weight and out share one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        if (gemma)
          gemma_rms_norm_row(xp + r * n, wp, op + r * n, n, float(eps));
        else
          rms_norm_row(xp + r * n, wp, op + r * n, n, float(eps));
      }
    });
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm_rows(out, x, weight, eps, false);
}

void gemma_rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm_rows(out, x, weight, eps, true);
}

// The tensors of a residual step: x, residual, sum (and out, when given) of one shape and dtype, with
// [hidden] weights.
void check_residual_step(const at::Tensor* out, const at::Tensor& sum, const at::Tensor& x,
                         const at::Tensor& residual, std::initializer_list<const at::Tensor*> weights) {
  check_rows(sum, "sum");
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t n = x.size(-1);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(sum.sizes() == x.sizes() && residual.sizes() == x.sizes(), "sum, x and residual have one shape");
  TORCH_CHECK(sum.scalar_type() == dtype && residual.scalar_type() == dtype, "x, residual and sum share one dtype");
  if (out != nullptr) {
    check_rows(*out, "out");
    TORCH_CHECK(out->sizes() == x.sizes() && out->scalar_type() == dtype, "out: x's shape and dtype");
  }
  for (const at::Tensor* w : weights)
    TORCH_CHECK(w->dim() == 1 && w->size(0) == n && w->is_contiguous() && w->scalar_type() == dtype,
                "weight: [hidden], contiguous, x's dtype");
}

// sum = T(residual + x), then out = RMSNorm(sum): Llama's (or Gemma's, `Gemma`) residual add and the
// norm after it, in one pass over each row.
template <bool Gemma>
void add_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& residual,
              const at::Tensor& weight, double eps) {
  check_residual_step(&out, sum, x, residual, {&weight});
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        add_row(xp + r * n, rp + r * n, sp + r * n, n);
        norm_row<Gemma>(sp + r * n, wp, op + r * n, n, float(eps));
      }
    });
  });
}

void add_rms_norm(at::Tensor out, at::Tensor sum, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps) {
  add_norm<false>(out, sum, x, residual, weight, eps);
}

void add_gemma_rms_norm(at::Tensor out, at::Tensor sum, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  add_norm<true>(out, sum, x, residual, weight, eps);
}

// sum = T(residual + gemma_rms_norm(x, weight)) and, when `next` is given, out = gemma_rms_norm(sum,
// next): the sandwich of Gemma 2's and 3's layers (the norm after a sublayer, the residual add, and the
// norm before the next sublayer), each row read once.
void gemma_norm_add_rows(at::Tensor* out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& residual,
                         const at::Tensor& weight, double eps, const at::Tensor* next, double next_eps) {
  if (next != nullptr)
    check_residual_step(out, sum, x, residual, {&weight, next});
  else
    check_residual_step(nullptr, sum, x, residual, {&weight});
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemma_norm_add", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* np = next != nullptr ? next->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = next != nullptr ? out->data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        gemma_norm_add_row(xp + r * n, wp, rp + r * n, sp + r * n, n, float(eps));
        if (np != nullptr) gemma_rms_norm_row(sp + r * n, np, op + r * n, n, float(next_eps));
      }
    });
  });
}

void gemma_norm_add(at::Tensor sum, const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                    double eps) {
  gemma_norm_add_rows(nullptr, sum, x, residual, weight, eps, nullptr, 0.0);
}

void gemma_norm_add_norm(at::Tensor out, at::Tensor sum, const at::Tensor& x, const at::Tensor& residual,
                         const at::Tensor& weight, double eps, const at::Tensor& next_weight, double next_eps) {
  gemma_norm_add_rows(&out, sum, x, residual, weight, eps, &next_weight, next_eps);
}

// out = T(act(gate)) * up, row by row.
template <typename Act>
void act_and_mul(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  check_rows(out, "out");
  TORCH_CHECK(gate.sizes() == up.sizes() && out.sizes() == gate.sizes(), "gate, up and out have one shape");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() && out.scalar_type() == gate.scalar_type(),
              "gate, up and out share one dtype");
  const int64_t n = gate.size(-1), rows = n ? gate.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "act_and_mul", [&] {
    const scalar_t* gp = gate.data_ptr<scalar_t>();
    const scalar_t* up_ = up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) act_mul_row<Act>(gp + r * n, up_ + r * n, op + r * n, n);
    });
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate, const at::Tensor& up) { act_and_mul<Silu>(out, gate, up); }

void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& gate, const at::Tensor& up) {
  act_and_mul<GeluTanh>(out, gate, up);
}

// gate_up: [..., 2n], each row the gate then the up (Phi-3's and GLM's gate_up_proj); out: [..., n].
void silu_and_mul_halves(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  const int64_t n2 = gate_up.size(-1), n = n2 / 2, rows = n2 ? gate_up.numel() / n2 : 0;
  TORCH_CHECK(n2 % 2 == 0, "gate_up: an even last dim, the gate then the up");
  TORCH_CHECK(out.dim() == gate_up.dim() && out.size(-1) == n
                  && out.sizes().slice(0, out.dim() - 1) == gate_up.sizes().slice(0, gate_up.dim() - 1),
              "out: gate_up's shape with half its last dim");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "gate_up and out share one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul_halves", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n2), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) act_mul_row<Silu>(gp + r * n2, gp + r * n2 + n, op + r * n, n);
    });
  });
}

// q, k: [B, H, T, D] (any strides but the last; q and k may have different head counts), cos and sin:
// [B, T, R] (the last dim contiguous), R even and at most D: each head's first R dims are rotated, the
// rest passed through (partial rotary, Phi-3's apply_rotary_pos_emb); q_out and k_out: q's and k's
// shapes, written.
// layout: the rotary dims turned as halves (Llama's, Phi-3's), in pairs (GLM's), or in pairs written
// out as halves (DeepSeek-V3's, whose rotary covers the whole head).
void rotary_heads(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& cos, const at::Tensor& sin, RotaryLayout layout) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.dim() == 3,
              "q and k are [B, H, T, D], cos and sin [B, T, D]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.strides() == sin.strides(), "cos and sin: one layout");
  TORCH_CHECK(q_out.sizes() == q.sizes() && k_out.sizes() == k.sizes(), "outputs have their inputs' shapes");
  const int64_t B = q.size(0), T = q.size(2), D = q.size(3), R = cos.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(2) == T && k.size(3) == D && cos.size(0) == B && cos.size(1) == T,
              "q, k, cos and sin disagree on batch, tokens or head dim");
  TORCH_CHECK(R % 2 == 0 && R <= D, "the rotary dims (cos's last) must be even and at most the head dim");
  TORCH_CHECK(layout != RotaryLayout::kPairsToHalves || R == D, "pairs to halves: cos must span the head");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &cos, &sin, &q_out, &k_out})
    TORCH_CHECK(t->stride(-1) == 1, "the last dim must be contiguous");
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &cos, &sin, &q_out, &k_out})
    TORCH_CHECK(t->scalar_type() == dtype, "q, k, cos, sin and the outputs share one dtype");
  const int64_t Hq = q.size(1), Hk = k.size(1), rows = B * T * (Hq + Hk);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rotary_embedding", [&] {
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    // Per tensor (q, k): input, output and their strides over (b, h, t).
    const scalar_t* in[2] = {q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>()};
    scalar_t* out[2] = {q_out.data_ptr<scalar_t>(), k_out.data_ptr<scalar_t>()};
    const at::Tensor* ins[2] = {&q, &k};
    const at::Tensor* outs[2] = {&q_out, &k_out};
    int64_t in_stride[2][3], out_stride[2][3];
    for (int w = 0; w < 2; ++w)
      for (int d = 0; d < 3; ++d) in_stride[w][d] = ins[w]->stride(d), out_stride[w][d] = outs[w]->stride(d);
    const int64_t cs_b = cos.stride(0), cs_t = cos.stride(1);
    at::parallel_for(0, rows, grain(D), [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        // row = ((b * T + t) * (Hq + Hk) + h): the heads of one token together, q's before k's.
        const int64_t h = row % (Hq + Hk), bt = row / (Hq + Hk), b = bt / T, t = bt % T;
        const int w = h < Hq ? 0 : 1;
        const int64_t head = w == 0 ? h : h - Hq;
        const int64_t* is = in_stride[w];
        const int64_t* os = out_stride[w];
        const int64_t cs_at = b * cs_b + t * cs_t;
        const scalar_t* x = in[w] + b * is[0] + head * is[1] + t * is[2];
        scalar_t* y = out[w] + b * os[0] + head * os[1] + t * os[2];
        if (layout == RotaryLayout::kPairs)
          rotary_pairs_row(x, cp + cs_at, sp + cs_at, y, R);
        else if (layout == RotaryLayout::kPairsToHalves)
          rotary_pairs_to_halves_row(x, cp + cs_at, sp + cs_at, y, R);
        else
          rotary_row(x, cp + cs_at, sp + cs_at, y, R);
        if (R < D) std::memcpy(y + R, x + R, (D - R) * sizeof(scalar_t));
      }
    });
  });
}

void rotary_embedding(at::Tensor q_out, at::Tensor k_out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos, const at::Tensor& sin) {
  rotary_heads(q_out, k_out, q, k, cos, sin, RotaryLayout::kHalves);
}

void rotary_embedding_pairs(at::Tensor q_out, at::Tensor k_out, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& cos, const at::Tensor& sin) {
  rotary_heads(q_out, k_out, q, k, cos, sin, RotaryLayout::kPairs);
}

void rotary_embedding_interleave(at::Tensor q_out, at::Tensor k_out, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& cos, const at::Tensor& sin) {
  rotary_heads(q_out, k_out, q, k, cos, sin, RotaryLayout::kPairsToHalves);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(keepwarm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps) -> ()");
  m.def("gemma_rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "add_gemma_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps) -> ()");
  m.def("gemma_norm_add(Tensor(a!) sum, Tensor x, Tensor residual, Tensor weight, float eps) -> ()");
  m.def(
      "gemma_norm_add_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps, "
      "Tensor next_weight, float next_eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  m.def("silu_and_mul_halves(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) q_out, Tensor(b!) k_out, Tensor q, Tensor k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "rotary_embedding_pairs(Tensor(a!) q_out, Tensor(b!) k_out, Tensor q, Tensor k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "rotary_embedding_interleave(Tensor(a!) q_out, Tensor(b!) k_out, Tensor q, Tensor k, Tensor cos, Tensor sin) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(keepwarm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("gemma_rms_norm", &gemma_rms_norm);
  m.impl("add_gemma_rms_norm", &add_gemma_rms_norm);
  m.impl("gemma_norm_add", &gemma_norm_add);
  m.impl("gemma_norm_add_norm", &gemma_norm_add_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("silu_and_mul_halves", &silu_and_mul_halves);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rotary_embedding_pairs", &rotary_embedding_pairs);
  m.impl("rotary_embedding_interleave", &rotary_embedding_interleave);
}
