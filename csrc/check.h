// Argument checks of the torch operators: messages read "<arg> must <rule>, got <value>" (tests
// match them), assembled without std::ostream (streaming an integer into one from this library
// crashed, std::ostream::_M_insert<long>, with torch 2.11 + g++ 13 on the device, while torch's
// own operator<< for Device and ScalarType is fine).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

#include "kernels/mmha_params.h"

namespace mmha {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <typename T>
void append(std::string& s, const T& v) {
  if constexpr (std::is_arithmetic_v<T>) {
    s += std::to_string(v);
  } else {
    s += c10::str(v);
  }
}
template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

#define MMHA_CHECK(cond, ...) TORCH_CHECK(cond, ::mmha::msg(__VA_ARGS__))

inline std::string list_str(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

inline std::string shape_str(const at::Tensor& t) { return list_str(t.sizes()); }

inline void check_cuda(const at::Tensor& t, const char* name, const c10::Device& device) {
  MMHA_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got a tensor on ", t.device());
  MMHA_CHECK(t.device() == device, name, " must be on the same device as qkv (", device, "), got ", t.device());
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  MMHA_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  MMHA_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", list_str(t.strides()), " for shape ",
             shape_str(t));
}

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    case at::kChar: return DType::kInt8;
    case at::kByte: return DType::kInt4;  // an int4 cache's codes, two a byte
    default: return DType::kFloat32;
  }
}

// A build check (setup.py, MMHA_BUILD_CHECK=1) holds unoptimised PTX, compiled to be checked,
// not run: its operators stop before any launch.
inline void refuse_build_check() {
#ifdef MMHA_BUILD_CHECK
  MMHA_CHECK(false, "this mmha is a build check (MMHA_BUILD_CHECK=1: unoptimised PTX, not for running kernels); "
             "reinstall without it: pip install --no-build-isolation -e .");
#endif
}

}  // namespace mmha
