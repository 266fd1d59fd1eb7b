// What keepwarm's two linear operators (amx_linear.cpp, avx512_linear.cpp) share before their loops: the
// shape checks of x [..., K] against a contiguous weight [N, K], the bias as float32, and the
// operands as the loops take them (x's M rows, contiguous, and an empty output shaped as x with its
// last dimension N). Messages name the operator. static inline, as vec16.h: each file its own copy.
// (attention/native.py hashes this header with the sources into the library's name.)

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

// x [..., K] and a contiguous weight [N, K] of the same K.
static inline void check_linear_shapes(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && weight.is_contiguous(), op,
              ": x [..., K] and a contiguous weight [N, K]");
  TORCH_CHECK(weight.size(1) == x.size(-1), op, ": x has ", x.size(-1), " features, the weight ", weight.size(1));
}

// The bias [N] in float32, contiguous (nullopt without one).
static inline std::optional<at::Tensor> float_bias(const char* op, const std::optional<at::Tensor>& bias,
                                                   int64_t N) {
  if (!bias.has_value()) return std::nullopt;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias [N]");
  return bias->to(at::kFloat).contiguous();
}

struct RowsAndOutput {
  at::Tensor rows, out;
  int64_t M;
};

// N > 0 (both operators check it).
static inline RowsAndOutput rows_and_output(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor out = x.new_empty(sizes);
  const int64_t M = out.numel() / N;
  return {x.contiguous(), out, M};
}
