// The row RMSNorm operator (csrc/kernels/row_norm.h): a transformer layer's RMSNorm, or the
// per-head q/k norms of a fused qkv row in place, in one launch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>

#include "check.h"
#include "kernels/row_norm.h"
#include "mmha_ops.h"

namespace mmha {
namespace {

bool float_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

void check_rows(const at::Tensor& t, const char* name) {
  MMHA_CHECK(float_dtype(t.scalar_type()), name, " must have dtype float16, bfloat16 or float32, got ",
             t.scalar_type());
  MMHA_CHECK(t.dim() == 2, name, " must be 2-D [rows, width], got shape ", shape_str(t));
  MMHA_CHECK(t.size(1) <= 1 || t.stride(1) == 1, name, " must have unit stride along its width, got strides ",
             list_str(t.strides()));
  MMHA_CHECK(t.size(0) < (int64_t{1} << 31) / 64 && t.size(1) < (int64_t{1} << 31), name,
             " is too large, got shape ", shape_str(t));
}

}  // namespace

void rms_norm(const at::Tensor& x, const at::Tensor& out, at::TensorList weights, c10::IntArrayRef layout,
              c10::ArrayRef<double> eps, double offset, bool cast_first) {
  MMHA_CHECK(x.is_cuda(), "x must be a CUDA tensor, got a tensor on ", x.device());
  const c10::Device device = x.device();
  check_rows(x, "x");
  MMHA_CHECK(out.is_cuda() && out.device() == device, "out must be on ", device, ", got ", out.device());
  check_rows(out, "out");
  MMHA_CHECK(out.scalar_type() == x.scalar_type(), "out must have x's dtype ", x.scalar_type(), ", got ",
             out.scalar_type());
  MMHA_CHECK(out.sizes() == x.sizes(), "out must have x's shape ", shape_str(x), ", got ", shape_str(out));
  const int64_t segments = static_cast<int64_t>(weights.size());
  MMHA_CHECK(segments >= 1 && segments <= kMaxNormSegments, "weights must hold 1 to ", kMaxNormSegments,
             " tensors, got ", segments);
  MMHA_CHECK(static_cast<int64_t>(layout.size()) == 3 * segments, "layout must hold (col_offset, heads, cols) for "
             "each of the ", segments, " weights, got ", list_str(layout));
  MMHA_CHECK(static_cast<int64_t>(eps.size()) == segments, "eps must hold one value for each of the ", segments,
             " weights, got ", eps.size());
  MMHA_CHECK(std::isfinite(offset), "offset must be finite, got ", offset);
  RowNormParams p{};
  for (int64_t s = 0; s < segments; ++s) {
    const at::Tensor& w = weights[s];
    const std::string name = msg("weights[", s, "]");
    const int64_t col_offset = layout[3 * s], heads = layout[3 * s + 1], cols = layout[3 * s + 2];
    MMHA_CHECK(col_offset >= 0 && heads >= 1 && cols >= 1 && col_offset + heads * cols <= x.size(1), "layout's segment ",
               s, " (col_offset ", col_offset, ", heads ", heads, ", cols ", cols, ") must lie within x's width ",
               x.size(1));
    MMHA_CHECK(w.is_cuda() && w.device() == device, name, " must be on ", device, ", got ", w.device());
    MMHA_CHECK(float_dtype(w.scalar_type()), name, " must have dtype float16, bfloat16 or float32, got ",
               w.scalar_type());
    MMHA_CHECK(w.scalar_type() == weights[0].scalar_type(), name, " must have weights[0]'s dtype ",
               weights[0].scalar_type(), ", got ", w.scalar_type());
    check_contiguous(w, name.c_str());
    MMHA_CHECK(w.numel() == cols || w.numel() == heads * cols, name, " must hold ", cols, " values (one for all ",
               heads, " heads) or ", heads * cols, " (one row per head), got shape ", shape_str(w));
    MMHA_CHECK(std::isfinite(eps[s]) && eps[s] >= 0, "eps[", s, "] must be finite and >= 0, got ", eps[s]);
    p.segments[s] = NormSegment{w.data_ptr(), static_cast<int>(col_offset), static_cast<int>(heads),
                                static_cast<int>(cols), w.numel() == cols ? 0 : static_cast<int>(cols),
                                static_cast<float>(eps[s])};
  }
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.x_row_stride = x.stride(0);
  p.out_row_stride = out.stride(0);
  p.rows = static_cast<int>(x.size(0));
  p.num_segments = static_cast<int>(segments);
  p.offset = static_cast<float>(offset);
  p.cast_first = cast_first;
  p.dtype = to_dtype(x.scalar_type());
  p.weight_dtype = to_dtype(weights[0].scalar_type());
  refuse_build_check();
  const cudaError_t err = run_row_norm(p, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  MMHA_CHECK(err == cudaSuccess, "mmha rms_norm launch failed: ", cudaGetErrorString(err));
}

}  // namespace mmha
