// What an offset kept in the V product's sums costs: int4 V codes reach the mma as fp16 halves
// offset + code (the lop3 form gives 1024 + code for a byte's low nibble, 64 + code for its high
// one), and the consumer takes the offset off each half (an hsub2) before P V. Kept in the sums
// instead, acc = sum(P (offset + code)) over the row's keys and offset * sum(P) comes off at the
// end, exact in arithmetic; the question is what the mma's fp32 accumulation (its rounding as the
// sum grows beside products of the codes' size) leaves of sum(P code) after a row of N keys.
//
// One warp runs N / 16 m16n8k16 steps (A = V^T: 16 channels x 16 keys of random codes 0..15 plus
// the offset, exact in fp16; B = P^T: 16 keys x 8 columns of random fp16 weights in [0, 1), as the
// consumer's P' = 2^(s - m) v_scale / v_unit), in three forms:
//   chain   acc = mma(A, B, acc) every step (the consumer's form)
//   fresh   d = mma(A, B, 0) every step, acc += d in fp32 adds (the offset's bits kept exact in d)
// and reports, per offset and N, the error of (acc - offset * sum P) / sum P against the fp64
// sum(P code) / sum P over the 128 outputs (code units of the weighted mean: what the output's
// error is in units of the V scale): the largest |error| and the mean signed error (a bias the
// mma's rounding leaves does not average out). For scale: an int4 code's own rounding error is
// up to 0.5 a key, ~0.29 / sqrt(keys) on a uniform average.
//
// Build and run on an sm_80+ GPU:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/mma_offset_sums \
//     bench/probes/mma_offset_sums.cu && /tmp/mma_offset_sums
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../../csrc/kernels/ptx.cuh"  // the kernels' own mma wrapper

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

__device__ __forceinline__ uint32_t pack2(const __half* p) {
  return *reinterpret_cast<const uint32_t*>(p);  // two consecutive halves
}

// a: [steps][16 rows][16 k] halves (row-major); bt: [steps][8 n][16 k] halves (B column-major, so a
// column's k pairs are adjacent); out: [16][8] floats.
__global__ void offset_sums(const __half* a, const __half* bt, int steps, bool fresh, float* out) {
  const int lane = threadIdx.x;
  const int g = lane / 4, tq = lane % 4;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < steps; ++s) {
    const __half* as = a + static_cast<size_t>(s) * 256;
    const __half* bs = bt + static_cast<size_t>(s) * 128;
    const uint32_t af[4] = {pack2(as + g * 16 + 2 * tq), pack2(as + (g + 8) * 16 + 2 * tq),
                            pack2(as + g * 16 + 2 * tq + 8), pack2(as + (g + 8) * 16 + 2 * tq + 8)};
    const uint32_t b0 = pack2(bs + g * 16 + 2 * tq), b1 = pack2(bs + g * 16 + 2 * tq + 8);
    if (fresh) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mmha::mma_16816<__half>(d, af, b0, b1);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] += d[e];
    } else {
      mmha::mma_16816<__half>(acc, af, b0, b1);
    }
  }
  out[g * 8 + 2 * tq] = acc[0];
  out[g * 8 + 2 * tq + 1] = acc[1];
  out[(g + 8) * 8 + 2 * tq] = acc[2];
  out[(g + 8) * 8 + 2 * tq + 1] = acc[3];
}

int main() {
  const int offsets[] = {0, 16, 64, 1024};
  const int lengths[] = {1024, 8192, 32768, 131072};
  std::mt19937 rng(20261203);
  std::printf("offset  keys    form   max|err|     mean err     (code units of the weighted mean)\n");
  for (int keys : lengths) {
    const int steps = keys / 16;
    // The same codes and weights for every offset and form.
    std::vector<int> codes(static_cast<size_t>(steps) * 256);
    std::vector<__half> bt(static_cast<size_t>(steps) * 128);
    std::uniform_int_distribution<int> code_of(0, 15);
    std::uniform_real_distribution<float> weight_of(0.f, 1.f);
    for (auto& c : codes) c = code_of(rng);
    for (auto& w : bt) w = __float2half_rn(weight_of(rng));
    // fp64: sum over keys of P * code per (row, column), and sum P per column.
    std::vector<double> exact(16 * 8, 0.0), psum(8, 0.0);
    for (int s = 0; s < steps; ++s) {
      for (int n = 0; n < 8; ++n) {
        for (int k = 0; k < 16; ++k) {
          const double p = __half2float(bt[static_cast<size_t>(s) * 128 + n * 16 + k]);
          psum[n] += p;
          for (int r = 0; r < 16; ++r) exact[r * 8 + n] += p * codes[static_cast<size_t>(s) * 256 + r * 16 + k];
        }
      }
    }
    __half* d_a = nullptr;
    __half* d_bt = nullptr;
    float* d_out = nullptr;
    CHECK(cudaMalloc(&d_a, codes.size() * sizeof(__half)));
    CHECK(cudaMalloc(&d_bt, bt.size() * sizeof(__half)));
    CHECK(cudaMalloc(&d_out, 128 * sizeof(float)));
    CHECK(cudaMemcpy(d_bt, bt.data(), bt.size() * sizeof(__half), cudaMemcpyHostToDevice));
    for (int offset : offsets) {
      std::vector<__half> a(codes.size());
      for (size_t i = 0; i < codes.size(); ++i) a[i] = __float2half_rn(static_cast<float>(offset + codes[i]));
      CHECK(cudaMemcpy(d_a, a.data(), a.size() * sizeof(__half), cudaMemcpyHostToDevice));
      for (int fresh = 0; fresh < 2; ++fresh) {
        offset_sums<<<1, 32>>>(d_a, d_bt, steps, fresh != 0, d_out);
        CHECK(cudaGetLastError());
        std::vector<float> out(128);
        CHECK(cudaMemcpy(out.data(), d_out, 128 * sizeof(float), cudaMemcpyDeviceToHost));
        double worst = 0.0, mean = 0.0;
        for (int r = 0; r < 16; ++r) {
          for (int n = 0; n < 8; ++n) {
            const double got = static_cast<double>(out[r * 8 + n]) - offset * psum[n];
            const double err = (got - exact[r * 8 + n]) / psum[n];
            worst = std::fmax(worst, std::fabs(err));
            mean += err / 128.0;
          }
        }
        std::printf("%6d  %6d  %-5s  %.3e    %+.3e\n", offset, keys, fresh ? "fresh" : "chain", worst, mean);
      }
    }
    CHECK(cudaFree(d_a));
    CHECK(cudaFree(d_bt));
    CHECK(cudaFree(d_out));
  }
  return 0;
}
