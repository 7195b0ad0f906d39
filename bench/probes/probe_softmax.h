// The probes' softmax stand-in over a warpgroup's scores (a thread's N values, 4 lanes a column
// pair as the kernel's): the running max, two shuffles, exp2 and the sums in place of the scores
// (exponentiate), then P packed as the V product's A fragments (pack_p). Apart, so that a loop
// that overlaps P V with the softmax packs P only after P V's wait: registers a product reads may
// not be defined while any product runs, or ptxas serialises the products (C7513).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

template <int N>
__device__ __forceinline__ void exponentiate(float (&s)[N], float (&m)[2], float (&l)[2]) {
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int i = 0; i < N; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    m[h] = mx[h];
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    s[i] = exp2f(s[i] - mx[(i >> 1) & 1]);
    l[(i >> 1) & 1] += s[i];
  }
}

template <int N>
__device__ __forceinline__ void pack_p(const float (&s)[N], uint32_t (&pa)[N / 8][4]) {
#pragma unroll
  for (int kb = 0; kb < N / 8; ++kb) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const __half2 h = __floats2half2_rn(s[8 * kb + 2 * w], s[8 * kb + 2 * w + 1]);
      pa[kb][w] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
}

template <int N>
__device__ __forceinline__ void softmax(float (&s)[N], float (&m)[2], float (&l)[2], uint32_t (&pa)[N / 8][4]) {
  exponentiate(s, m, l);
  pack_p(s, pa);
}
