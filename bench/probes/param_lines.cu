// What a block's first reads of its kernel parameters cost. A launch's parameters (a
// __grid_constant__ struct about as large as MmhaParams with its two tensor maps) are read through
// the SM's constant cache, which holds none of them when a block starts. Thread 0 of every block
// reads one 32-bit word from each of LINES 64-byte lines of the struct in a chain (each read's
// address depends on the value read before, as a pointer loaded from the parameters is needed
// before the load through it), timed with clock64:
//   cold    the block's first reads;
//   warmed  after LINES lanes of the warp have read one word each at once (the lines fetched
//           together, one latency);
//   again   the same chain a second time (every line cached).
// Prints the median over blocks of cycles per read for each. One block per SM, then four.
// Build and run (GPU machine):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/pl bench/probes/param_lines.cu && /tmp/pl
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

constexpr int kLines = 14;  // 896 bytes of words, then the output pointer

struct Params {
  int w[kLines * 16];
  long long* out;
};

// Thread 0's chain over the lines; the words are all zero, so each address is i * 16 plus a
// value that must arrive first.
__device__ __forceinline__ long long chain(const Params& p, int& idx) {
  const long long t0 = clock64();
#pragma unroll
  for (int i = 0; i < kLines; ++i) idx = p.w[idx + i * 16];
  return clock64() - t0 + (idx != 0);
}

__global__ void probe(const __grid_constant__ Params p, int warm) {
  const int lane = threadIdx.x;
  if (warm && lane < kLines) {
    const int v = reinterpret_cast<const int*>(&p)[lane * 16];
    asm volatile("" ::"r"(v));
  }
  __syncwarp();
  if (lane == 0) {
    int idx = 0;
    if (warm) {  // wait for the warm-up's reads: the chain then starts with them in the cache
      const long long t = clock64();
      while (clock64() - t < 4000) {
      }
    }
    const long long first = chain(p, idx);
    const long long second = chain(p, idx);
    p.out[2 * blockIdx.x] = first;
    p.out[2 * blockIdx.x + 1] = second;
  }
}

double median(std::vector<long long> v) {
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[v.size() / 2]);
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int per_sm : {1, 4}) {
    const int blocks = sms * per_sm;
    Params p{};
    cudaMalloc(&p.out, sizeof(long long) * 2 * blocks);
    for (int warm : {0, 1}) {
      std::vector<long long> first, second;
      for (int rep = 0; rep < 20; ++rep) {
        probe<<<blocks, 32>>>(p, warm);
        std::vector<long long> got(2 * blocks);
        cudaMemcpy(got.data(), p.out, sizeof(long long) * got.size(), cudaMemcpyDeviceToHost);
        for (int b = 0; b < blocks; ++b) {
          first.push_back(got[2 * b]);
          second.push_back(got[2 * b + 1]);
        }
      }
      std::printf("%d block(s) per SM, %-6s: %6.1f cycles a read (%d reads), again %5.1f\n", per_sm,
                  warm ? "warmed" : "cold", median(first) / kLines, kLines, median(second) / kLines);
    }
    cudaFree(p.out);
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
