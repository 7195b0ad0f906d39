// How long does one block take to read a split merge's partials that other blocks have just
// written? W writer blocks each write one split's accumulators (C columns x D floats) and count
// their arrival (a release atomic); one reader block waits for all W (acquire), then reads every
// split's C x D floats and sums them, timed on the GPU's global timer. The reading forms:
//   ldcg    a thread per (column, 4 floats), 16 splits' float4 loads in flight (merge_weights_first)
//   cpasync 16-byte cp.async.cg (L2::128B hint) into shared memory, all in flight, then
//           cp.async.wait_all, a barrier and the sum from shared memory (the staged form of
//           docs/patches/merge_partials_staged.diff, which ran 5-10 us slower than ldcg in the
//           decode timing: 2026-11-30)
//   cpnohint the same without the L2 prefetch hint
// each over freshly written partials and over partials written a launch before (the writers
// then only count). Prints the median ns of 50 launches per form.
// Measured on an H200 (2026-11-30; docs/data/ab_merge_reads_h200.md): ldcg 3.2 us against cp.async
// 0.83 us for 16 splits x 4 columns. The kernel's whole merge took 1.74 us with ldcg loads, and a
// staged form of it did not beat them, so this probe's ldcg form does not model the kernel's
// reads (its loads are issued differently); the decode timing decides, not this probe.
//
// Build and run on an sm_90 GPU:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/merge_reads \
//     bench/probes/merge_reads.cu && /tmp/merge_reads [SPLITS COLUMNS]   (default 16 4)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int D = 128;  // floats per column: a head dim of 128
constexpr int THREADS = 128;

enum Form { kLdcg = 0, kCpAsync = 1, kCpNoHint = 2 };

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool hint) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (hint) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  }
}

// Blocks 0 .. splits - 1 write (fresh) and count; block `splits` reads. partials: [columns][splits][D].
__global__ void merge_reads(float* partials, int* counter, float* sink, unsigned long long* ns, int splits,
                            int columns, int form, int fresh, int launch) {
  extern __shared__ __align__(16) float staged[];
  const int tid = threadIdx.x;
  if (static_cast<int>(blockIdx.x) < splits) {
    if (fresh) {
      for (int i = tid; i < columns * D; i += THREADS) {
        const int c = i / D;
        partials[(static_cast<size_t>(c) * splits + blockIdx.x) * D + i % D] = static_cast<float>(launch + i);
      }
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicAdd(counter, 1);
    }
    return;
  }
  if (tid == 0) {
    while (atomicAdd(counter, 0) < splits) {
    }
    __threadfence();
    *counter = 0;
  }
  __syncthreads();
  const unsigned long long t0 = global_ns();
  constexpr int C4 = D / 4;
  float total = 0.f;
  if (form == kLdcg) {
    for (int idx = tid; idx < columns * C4; idx += THREADS) {
      const int c = idx / C4, q = idx % C4;
      const float4* base = reinterpret_cast<const float4*>(partials + static_cast<size_t>(c) * splits * D) + q;
      for (int s = 0; s < splits; s += 16) {
        float4 v[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) v[u] = s + u < splits ? __ldcg(base + (s + u) * C4) : make_float4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 16; ++u) total += v[u].x + v[u].y + v[u].z + v[u].w;
      }
    }
  } else {
    const int chunks = columns * splits * C4;
    for (int i = tid; i < chunks; i += THREADS) cp_async16(staged + 4 * i, partials + 4 * static_cast<size_t>(i), form == kCpAsync);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    for (int idx = tid; idx < columns * C4; idx += THREADS) {
      const int c = idx / C4, q = idx % C4;
      for (int s = 0; s < splits; ++s) {
        const float4 v = reinterpret_cast<const float4*>(staged + (static_cast<size_t>(c) * splits + s) * D)[q];
        total += v.x + v.y + v.z + v.w;
      }
    }
  }
  __syncthreads();
  if (tid == 0) *ns = global_ns() - t0;
  sink[tid] = total;
}

int main(int argc, char** argv) {
  const int splits = argc > 1 ? std::atoi(argv[1]) : 16;
  const int columns = argc > 2 ? std::atoi(argv[2]) : 4;
  const size_t bytes = static_cast<size_t>(splits) * columns * D * sizeof(float);
  float *partials, *sink;
  int* counter;
  unsigned long long* ns;
  cudaMalloc(&partials, bytes);
  cudaMalloc(&sink, THREADS * sizeof(float));
  cudaMalloc(&counter, sizeof(int));
  cudaMalloc(&ns, sizeof(unsigned long long));
  cudaMemset(counter, 0, sizeof(int));
  cudaMemset(partials, 0, bytes);
  cudaFuncSetAttribute(merge_reads, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  if (bytes > 200 * 1024) {
    std::printf("%zu bytes of partials do not fit one block's shared memory\n", bytes);
    return 1;
  }
  const char* names[] = {"ldcg", "cpasync", "cpnohint"};
  std::printf("%d splits x %d columns x %d floats: %zu bytes read by one block\n", splits, columns, D, bytes);
  int launch = 0;
  for (int fresh = 1; fresh >= 0; --fresh) {
    for (int form = 0; form < 3; ++form) {
      std::vector<unsigned long long> got;
      for (int r = 0; r < 55; ++r) {
        merge_reads<<<splits + 1, THREADS, form == kLdcg ? 0 : bytes>>>(partials, counter, sink, ns, splits, columns,
                                                                       form, fresh, ++launch);
        unsigned long long t = 0;
        cudaMemcpy(&t, ns, sizeof(t), cudaMemcpyDeviceToHost);
        if (r >= 5) got.push_back(t);
      }
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) {
        std::printf("%s: %s\n", names[form], cudaGetErrorString(err));
        return 1;
      }
      std::sort(got.begin(), got.end());
      std::printf("%-9s %s partials: %6llu ns (median of %zu)\n", names[form], fresh ? "fresh" : "older",
                  got[got.size() / 2], got.size());
    }
  }
  return 0;
}
