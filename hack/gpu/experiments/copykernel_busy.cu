// The copy kernel beside a busy GPU: a batch of 4,096 x 16 KiB offloads while
// another stream runs a compute-like kernel that fills every SM for ~20 ms.
// Measured: the batch's time from enqueue to completion (copy engine, kernel
// on a default-priority stream, kernel on a high-priority stream) and the busy
// kernel's own time with and without the batch beside it.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <chrono>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%d %s: %s\n", __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)
struct kv_run { unsigned long long dst, src, bytes; };
struct kv_runs { kv_run r[1360]; };
extern "C" __global__ void __launch_bounds__(256) kv_copy_runs(const __grid_constant__ kv_runs p) {
  const kv_run &r = p.r[blockIdx.x];
  const uint4 *s = (const uint4 *)r.src; uint4 *d = (uint4 *)r.dst;
  for (unsigned long long i = threadIdx.x; i < r.bytes / 16; i += 256) d[i] = s[i];
}
// A compute-bound kernel: each block spins doing FMAs for `iters` rounds.
__global__ void busy(float *out, int iters) {
  float a = threadIdx.x, b = blockIdx.x;
  for (int i = 0; i < iters; i++) { a = a * 1.0000001f + b; b = b * 0.9999999f + a; }
  if (a == 12345.f) out[0] = b;
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  CK(cudaSetDevice(0)); CK(cudaFree(0));
  const int n = 4096; const size_t sz = 16384;
  size_t bytes = (size_t)n * 2 * sz;
  char *h = (char *)mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(h, 1, bytes); CK(cudaHostRegister(h, bytes, cudaHostRegisterPortable));
  char *d; CK(cudaMalloc(&d, bytes)); float *o; CK(cudaMalloc(&o, 4));
  int lo, hi; CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t sb, sc, sp; CK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&sc, cudaStreamNonBlocking)); CK(cudaStreamCreateWithPriority(&sp, cudaStreamNonBlocking, hi));
  std::vector<kv_run> runs(n);
  for (int i = 0; i < n; i++) runs[i] = kv_run{(unsigned long long)(h + (size_t)((i * 7) % n) * 2 * sz), (unsigned long long)(d + (size_t)i * 2 * sz), sz};
  auto batch = [&](int m, cudaStream_t s) {
    if (m == 0) {
      for (int start = 0, piece = 64, calls = 0; start < n; calls++) {
        int k = std::min(piece, n - start);
        std::vector<void *> ds(k), ss(k); std::vector<size_t> zs(k, sz);
        for (int i = 0; i < k; i++) { ds[i] = (void *)runs[start + i].dst; ss[i] = (void *)runs[start + i].src; }
        cudaMemcpyAttributes at; memset(&at, 0, sizeof at); at.srcAccessOrder = cudaMemcpySrcAccessOrderStream; size_t idx = 0;
        CK(cudaMemcpyBatchAsync(ds.data(), ss.data(), zs.data(), k, &at, &idx, 1, s));
        start += k; if (calls >= 1 && piece < 512) piece *= 2;
      }
    } else {
      static kv_runs p;
      for (int start = 0; start < n; start += 1360) { int k = std::min(1360, n - start); memcpy(p.r, &runs[start], k * sizeof(kv_run)); kv_copy_runs<<<k, 256, 0, s>>>(p); }
    }
  };
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int waves : {1, 200}) {
  // calibrate the busy kernel to ~20 ms with `waves` x 132*8 blocks of 256 threads
  int iters = 20000 / waves; int blocks = 132 * 8 * waves;
  for (int k = 0; k < 3; k++) {
    CK(cudaEventRecord(e0, sc)); busy<<<blocks, 256, 0, sc>>>(o, iters); CK(cudaEventRecord(e1, sc)); CK(cudaStreamSynchronize(sc));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); iters = (int)(iters * 20.0 / ms);
  }
  printf("\npriority range %d..%d; busy kernel %d blocks x 256 threads (%d waves), %d iters\n", lo, hi, blocks, waves, iters);
  const char *names[] = {"copy engine (batch)", "copy kernel, default priority", "copy kernel, high priority"};
  printf("| batch path | batch ms, GPU idle | batch ms, GPU busy | busy kernel ms alone | busy kernel ms with the batch |\n| --- | --- | --- | --- | --- |\n");
  for (int m = 0; m < 3; m++) {
    cudaStream_t s = m == 2 ? sp : sb;
    std::vector<double> idle, busyb, alone, with;
    for (int rep = 0; rep < 7; rep++) {
      double t0 = now(); batch(m == 0 ? 0 : 1, s); CK(cudaStreamSynchronize(s)); idle.push_back((now() - t0) * 1e3);
      CK(cudaEventRecord(e0, sc)); busy<<<blocks, 256, 0, sc>>>(o, iters); CK(cudaEventRecord(e1, sc)); CK(cudaStreamSynchronize(sc));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); alone.push_back(ms);
      CK(cudaEventRecord(e0, sc)); busy<<<blocks, 256, 0, sc>>>(o, iters); CK(cudaEventRecord(e1, sc));
      // start the batch 2 ms into the busy kernel
      double tb = now(); while (now() - tb < 0.002) {}
      t0 = now(); batch(m == 0 ? 0 : 1, s); CK(cudaStreamSynchronize(s)); busyb.push_back((now() - t0) * 1e3);
      CK(cudaStreamSynchronize(sc)); CK(cudaEventElapsedTime(&ms, e0, e1)); with.push_back(ms);
    }
    auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", names[m], med(idle), med(busyb), med(alone), med(with));
  }
  }
  return 0;
}
