// Prototype: small-run copies by a kernel (host memory read/written in place
// through UVA) against cuMemcpyBatchAsync in pieces, same buffers, same run.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <chrono>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)

struct kv_run { unsigned long long dst, src, bytes; };
#ifndef KV_RUNS
#define KV_RUNS 170
#endif
struct kv_runs4k { kv_run r[170]; };
struct kv_runs32k { kv_run r[1360]; };

template <int T>
__device__ __forceinline__ void copy_run(const kv_run &r) {
  const uint4 *__restrict__ s = (const uint4 *)r.src;
  uint4 *__restrict__ d = (uint4 *)r.dst;
  unsigned long long n = r.bytes >> 4;
  unsigned long long i = threadIdx.x;
  for (; i + 3 * T < n; i += 4 * T) {
    uint4 a = s[i], b = s[i + T], c = s[i + 2 * T], e = s[i + 3 * T];
    d[i] = a; d[i + T] = b; d[i + 2 * T] = c; d[i + 3 * T] = e;
  }
  for (; i < n; i += T) d[i] = s[i];
}

extern "C" __global__ void __launch_bounds__(256) kv_copy_runs(const __grid_constant__ kv_runs4k p) { copy_run<256>(p.r[blockIdx.x]); }
extern "C" __global__ void __launch_bounds__(256) kv_copy_runs_big(const __grid_constant__ kv_runs32k p) { copy_run<256>(p.r[blockIdx.x]); }

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int main(int argc, char **argv) {
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  const size_t HOST = 512ull << 20, DEV = 1024ull << 20;
  // memfd-like shared mapping, as the agent's chunks are
  char *h = (char *)mmap(nullptr, HOST, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(h, 1, HOST);
  CK(cudaHostRegister(h, HOST, cudaHostRegisterPortable));
  void *hd = nullptr;
  cudaError_t ge = cudaHostGetDevicePointer(&hd, h, 0);
  printf("host %p device pointer %p (%s)\n", h, hd, cudaGetErrorString(ge));
  char *d; CK(cudaMalloc(&d, DEV));
  CK(cudaMemset(d, 2, DEV));
  char *big; CK(cudaMalloc(&big, 256ull << 20));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // floor: one 256 MiB copy each way
  double fl[2];
  for (int dir = 0; dir < 2; dir++) {
    double best = 1e9;
    for (int k = 0; k < 5; k++) {
      double t0 = now();
      if (dir == 0) CK(cudaMemcpyAsync(h, big, 256ull << 20, cudaMemcpyDeviceToHost, s));
      else CK(cudaMemcpyAsync(big, h, 256ull << 20, cudaMemcpyHostToDevice, s));
      CK(cudaStreamSynchronize(s));
      best = std::min(best, now() - t0);
    }
    fl[dir] = (256ull << 20) / best / 1e9;
  }
  printf("floor DtoH %.1f GB/s HtoD %.1f GB/s\n", fl[0], fl[1]);
  printf("| run | n | dir | copy engine GB/s | kernel 4K params GB/s | kernel 32K params GB/s | enqueue ms CE/k4/k32 | ok |\n");
  size_t sizes[] = {4096, 16384, 32768, 65536};
  for (size_t sz : sizes) {
    int n = 4096;
    if (sz >= 65536) n = 2048;
    // device pages: stride 2*sz (no two continue each other); host: permuted
    std::vector<int> perm(n);
    for (int i = 0; i < n; i++) perm[i] = i;
    srand(7); for (int i = n - 1; i > 0; i--) std::swap(perm[i], perm[rand() % (i + 1)]);
    for (int dir = 0; dir < 2; dir++) {
      std::vector<kv_run> runs(n);
      for (int i = 0; i < n; i++) {
        unsigned long long dv = (unsigned long long)(d + (size_t)i * 2 * sz), hv = (unsigned long long)(h + (size_t)perm[i] * 2 * sz);
        runs[i] = dir == 0 ? kv_run{hv, dv, sz} : kv_run{dv, hv, sz};
      }
      double gbs[3] = {0, 0, 0}, enq[3] = {0, 0, 0};
      bool ok = true;
      for (int m = 0; m < 3; m++) {
        double best = 1e9, bestEnq = 0;
        for (int rep = 0; rep < 6; rep++) {
          // fill sources with a pattern, poison destinations
          unsigned char pat = (unsigned char)(rep * 31 + m * 7 + dir + 3);
          if (dir == 0) { CK(cudaMemset(d, pat, (size_t)n * 2 * sz)); memset(h, 0xEE, (size_t)n * 2 * sz); }
          else { memset(h, pat, (size_t)n * 2 * sz); CK(cudaMemset(d, 0xEE, (size_t)n * 2 * sz)); }
          CK(cudaDeviceSynchronize());
          double t0 = now();
          if (m == 0) {
            int start = 0, piece = 64, calls = 0;
            while (start < n) {
              int k = std::min(piece, n - start);
              std::vector<void *> dsts(k), srcs(k); std::vector<size_t> szs(k);
              for (int i = 0; i < k; i++) { dsts[i] = (void *)runs[start + i].dst; srcs[i] = (void *)runs[start + i].src; szs[i] = sz; }
              cudaMemcpyAttributes attr; memset(&attr, 0, sizeof attr);
              attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
              size_t idx = 0;
              CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), szs.data(), k, &attr, &idx, 1, s));
              start += k; calls++;
              if (calls >= 2 && piece < 512) piece *= 2;
            }
          } else {
            int per = m == 1 ? 170 : 1360;
            for (int start = 0; start < n; start += per) {
              int k = std::min(per, n - start);
              if (m == 1) { kv_runs4k p; memcpy(p.r, &runs[start], k * sizeof(kv_run)); kv_copy_runs<<<k, 256, 0, s>>>(p); }
              else { static kv_runs32k p; memcpy(p.r, &runs[start], k * sizeof(kv_run)); kv_copy_runs_big<<<k, 256, 0, s>>>(p); }
            }
            CK(cudaGetLastError());
          }
          double t1 = now();
          CK(cudaStreamSynchronize(s));
          double t = now() - t0;
          if (t < best) { best = t; bestEnq = t1 - t0; }
          // verify every byte of every run, and that gaps stayed poisoned
          if (rep > 0) continue;
          std::vector<unsigned char> back((size_t)n * 2 * sz);
          if (dir == 0) memcpy(back.data(), h, back.size()); else CK(cudaMemcpy(back.data(), d, back.size(), cudaMemcpyDeviceToHost));
          for (int i = 0; i < n && ok; i++) {
            size_t off = (size_t)(dir == 0 ? perm[i] : i) * 2 * sz;
            for (size_t b = 0; b < sz; b++) if (back[off + b] != pat) { ok = false; printf("mismatch m%d run %d byte %zu\n", m, i, b); break; }
            for (size_t b = sz; b < 2 * sz; b++) if (back[off + b] != 0xEE) { ok = false; printf("overwrite m%d run %d byte %zu\n", m, i, b); break; }
          }
        }
        gbs[m] = (double)n * sz / best / 1e9; enq[m] = bestEnq * 1e3;
      }
      printf("| %zu KiB | %d | %s | %.1f (%.2f) | %.1f (%.2f) | %.1f (%.2f) | %.2f/%.2f/%.2f | %s |\n", sz >> 10, n, dir == 0 ? "DtoH" : "HtoD",
             gbs[0], gbs[0] / fl[dir], gbs[1], gbs[1] / fl[dir], gbs[2], gbs[2] / fl[dir], enq[0], enq[1], enq[2], ok ? "yes" : "NO");
    }
  }
  return 0;
}
