// The probes' check of a CUDA runtime call: on an error, where and what, then exit(1).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// The fastest of `runs` launches after the first, in ms; launch(r) issues run r (the ring probes
// give each run its own half of a buffer, so no launch finds the last one's tiles in L2).
template <class Launch>
float best_of_runs(Launch launch, int runs = 6) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int r = 0; r < runs; ++r) {
    CHECK(cudaEventRecord(a));
    launch(r);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r > 0) best = ms < best ? ms : best;
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return best;
}

// Random halves in [-1, 1) (a hash of the index) over a buffer of `bytes`: tensor cores draw less
// power on zeros, and a GPU held at its power limit clocks higher for them, so a product over
// zeros overstates its rate (the ring probes: 6-11 % on an H200).
__global__ void fill_random_kernel(__half* x, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2half(static_cast<float>((h >> 8) & 0xFFFF) * (1.f / 32768.f) - 1.f);
  }
}

inline void fill_random(void* buf, size_t bytes) {
  fill_random_kernel<<<1024, 256>>>(static_cast<__half*>(buf), bytes / 2);
  CHECK(cudaGetLastError());
}
