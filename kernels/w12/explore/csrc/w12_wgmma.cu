// y = x @ W.T for W in W12 form, 1 <= M <= 64 (issue #18 item 2, exploration): w12_tma.cu's stream-K kernel and TMA
// ring with wgmma. Each unit is 64 rows x 128 half-columns; warpgroup h (4 warps, 16 rows each) takes half h. Per
// 16-column K step a lane loads its rows' low and code bytes at columns 2t, 2t+1 and 2t+8, 2t+9 (16-bit shared loads),
// so that the decoded words are wgmma's register A fragment in the standard K order, and x, TMA-loaded with the
// 128-byte swizzle, is the shared-memory B operand (K-major, read through a descriptor). A unit's 8 K steps go out
// as two groups of 4 asynchronous wgmmas, each group's decode overlapping the other's MMAs. Escapes accumulate in
// registers of their own, added to the wgmma accumulators at the end of a piece. Each unit's 64 base bytes and (up to
// 252 of) its escape entries come into its stage by bulk copies; the escape pointers of the CTA's units are read into
// shared memory once, at the start.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>

struct Args {
  const uint8_t* low;
  const uint8_t* codes;
  const uint8_t* base;
  const int32_t* esc_ptr;
  const uint32_t* esc;
  const __nv_bfloat16* x;
  __nv_bfloat16* y;
  float* ws;
  int32_t* counters;
  int32_t n, half, m, ldx, ldy, grid;
  int32_t probe;
};

struct Params {
  CUtensorMap low_map, codes_map, x_map;
  const uint8_t* base;
  const int32_t* esc_ptr;    // [units * 8 + 1]: escapes of unit u and warp w at [u * 8 + w, u * 8 + w + 1)
  const uint32_t* esc;       // row in tile | column in unit << 7 | the weight's bf16 bits << 16
  __nv_bfloat16* y;          // [m, N], row stride ldy
  float* ws;                 // partial tiles: [grid][kPiece]
  int32_t* counters;         // [tiles], zero between launches (the completing CTA resets its tile's)
  int32_t n, half, m, ldy, grid;
  int32_t probe;             // timing ablations, wrong results: 1 = loads only (no decode, MMA or escapes), 2 = return
                             // at once, 4 = no end of piece (no K-group sum, fix-up or store), 8 = no loads
};

namespace {

constexpr int kBN = 64;      // rows per tile: 4 row groups of one m16 tile
constexpr int kBKh = 128;    // half-columns per K step
constexpr int kThreads = 256;
constexpr int kBox = kBN * 128;   // one plane box: 64 rows x 128 bytes
constexpr int kEscCap = 252;     // escape entries staged per unit (more are read from global memory)
constexpr int kMaxUnits = 128;   // units per CTA (their escape pointers are staged at the start)

template <int NT>
struct Cfg {
  static constexpr int kMp = NT * 8;
  static constexpr int kXBox = kMp * 128;          // 64 bf16 columns of kMp tokens
  static constexpr int kBase = 3 * kBox + 4 * kXBox;      // the tile's 64 base bytes
  static constexpr int kEsc = kBase + 64;                 // up to kEscCap escape entries of the unit
  static constexpr int kStage = (kEsc + 4 * kEscCap + 1023) / 1024 * 1024;
  static constexpr int kAcc = NT * 4;
  static constexpr int kPiece = 4 * 32 * kAcc;
  static constexpr int kFree = 200 * 1024 - kPiece * 4 - 1024;
#ifndef W12_MAXSTAGES
#define W12_MAXSTAGES 6
#endif
  static constexpr int kStages = kFree / kStage < W12_MAXSTAGES ? kFree / kStage : W12_MAXSTAGES;
  static constexpr int kSmem = 1024 + kStages * kStage + kPiece * 4 + 4 * (8 * kMaxUnits + 1);   // 1024: alignment
  static_assert(kStages >= 2, "a stage too large");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes));
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      "@!P bra WAIT;\n}\n" ::"r"(smem_addr(bar)), "r"(parity));
}
__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void decode4(uint32_t low, uint32_t nib, uint32_t base4, int shift, uint32_t& p0,
                                        uint32_t& p1) {
  const uint32_t h = (((nib >> shift) & 0x07070707u) + base4) | ((nib << (4 - shift)) & 0x80808080u);
  p0 = __byte_perm(low, h, 0x5140);
  p1 = __byte_perm(low, h, 0x7362);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// A K-major operand in shared memory with the 128-byte swizzle (rows 128 bytes apart, 8-row groups 1024 apart).
__device__ __forceinline__ uint64_t sw128_desc(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}

template <int NT>
__device__ __forceinline__ void wgmma(float* d, const uint32_t* a, uint64_t desc);
template <>
__device__ __forceinline__ void wgmma<1>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma<2>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma<4>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma<8>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ int owner(int64_t u, int64_t units, int grid) {
  int c = static_cast<int>(u * grid / units);
  while (c + 1 < grid && (c + 1) * units / grid <= u) ++c;
  while (c > 0 && c * units / grid > u) --c;
  return c;
}

// 16-byte chunk c of row r in a 128-byte-swizzled box of 128-byte rows.
__device__ __forceinline__ int at(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

template <int NT>
struct Kernel {
  using C = Cfg<NT>;
  const Params& p;
  uint8_t* stages;
  const int* ptrs;   // escape pointers of this CTA's units: ptrs[(u - start) * 8 + w]
  int tid, warp, lane, g, t, rg, h, ks, start;
  int64_t units;

  __device__ Kernel(const Params& p_, uint8_t* stages_, const int* ptrs_, int start_)
      : p(p_), stages(stages_), ptrs(ptrs_), start(start_) {
    tid = threadIdx.x;
    warp = tid >> 5;
    lane = tid & 31;
    g = lane >> 2;
    t = lane & 3;
    rg = warp & 3;
    h = warp >> 2;
    ks = p.half / kBKh;
    units = static_cast<int64_t>((p.n + kBN - 1) / kBN) * ks;
  }

  __device__ uint8_t* stage(int u) const { return stages + (u % C::kStages) * C::kStage; }
  __device__ int row_of(int hr) const { return rg * 16 + g + 8 * hr; }

  __device__ void load(int u, uint64_t* bar) const {   // one thread
    uint8_t* s = stage(u);
    const int row0 = (u / ks) * kBN, j0 = (u % ks) * kBKh;
    const int* up = ptrs + (u - start) * 8;
    const int e0 = up[0] & ~3, staged = min(up[8] - e0, kEscCap);
    const uint32_t esc_bytes = staged > 0 ? 4 * ((staged + 3) & ~3) : 0;
    bar_expect(bar, 3 * kBox + 4 * C::kXBox + 64 + esc_bytes);
    bulk_copy(s + C::kBase, p.base + row0, 64, bar);
    if (esc_bytes) bulk_copy(s + C::kEsc, p.esc + e0, esc_bytes, bar);
    tma_2d(s, &p.low_map, j0, row0, bar);
    tma_2d(s + kBox, &p.low_map, p.half + j0, row0, bar);
    tma_2d(s + 2 * kBox, &p.codes_map, j0, row0, bar);
#pragma unroll
    for (int b = 0; b < 4; ++b)
      tma_2d(s + 3 * kBox + b * C::kXBox, &p.x_map, (b >> 1) * p.half + j0 + (b & 1) * 64, 0, bar);
  }

  __device__ void bases(int u, uint32_t* b) const {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) b[hr] = static_cast<uint32_t>(stage(u)[C::kBase + row_of(hr)]) * 0x01010101u;
  }

  // K steps 4q .. 4q + 3 of unit u (q = 0, 1: the unit's two 64-column boxes of this warpgroup's half): decoded into
  // a, then four asynchronous wgmmas into acc.
  __device__ void mma_half(int u, int q, float (*acc)[4], uint32_t (*a)[4], const uint32_t* b) const {
    const uint8_t* s = stage(u);
    const uint8_t* lows = s + h * kBox;
    const uint8_t* codes = s + 2 * kBox;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int c = 4 * q + kk;   // 16-byte chunk of the 128-byte box row
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = row_of(hr);
        const int at0 = at(row, c) + 2 * t;
        const uint32_t lo = __byte_perm(*reinterpret_cast<const uint16_t*>(lows + at0),
                                        *reinterpret_cast<const uint16_t*>(lows + at0 + 8), 0x5410);
        const uint32_t cd = __byte_perm(*reinterpret_cast<const uint16_t*>(codes + at0),
                                        *reinterpret_cast<const uint16_t*>(codes + at0 + 8), 0x5410);
        decode4(lo, cd, b[hr], 4 * h, a[kk][hr], a[kk][2 + hr]);
      }
    }
    const uint8_t* xs = s + 3 * kBox + (2 * h + q) * C::kXBox;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma<NT>(&acc[0][0], a[kk], sw128_desc(xs + 32 * kk));
    wgmma_commit();
  }

  __device__ void escapes(int u, float (*acc)[4], const uint32_t* b) const {
    const uint8_t* xs = stage(u) + 3 * kBox;
    const uint32_t* staged = reinterpret_cast<const uint32_t*>(stage(u) + C::kEsc);
    const int* up = ptrs + (u - start) * 8;
    const int e0 = up[0] & ~3, last = up[warp + 1];
    for (int e = up[warp]; e < last; ++e) {
      const uint32_t ent = e - e0 < kEscCap ? staged[e - e0] : __ldg(p.esc + e);
      const int row = ent & 127, col = (ent >> 7) & 255;
      const float w = __uint_as_float(ent & 0xFFFF0000u);
      const uint8_t* box = xs + (col >> 6) * C::kXBox;   // (half, sub-step) = col >> 7, (col >> 6) & 1
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        if (row != row_of(hr)) continue;
        const float wp = __uint_as_float((b[hr] & 0xFFu) << 24);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int cc = 0; cc < 2; ++cc) {
            const int n = nt * 8 + 2 * t + cc;
            const float xv = __bfloat162float(
                *reinterpret_cast<const __nv_bfloat16*>(box + at(n, (col & 63) >> 3) + (col & 7) * 2));
            float& v = acc[nt][2 * hr + cc];
            v = fmaf(xv, w, v);
            v = fmaf(xv, -wp, v);
          }
      }
    }
  }

  __device__ void store(int tile, float (*acc)[4]) const {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = tile * kBN + row_of(i >> 1), n = nt * 8 + 2 * t + (i & 1);
        if (row < p.n && n < p.m) p.y[static_cast<size_t>(n) * p.ldy + row] = __float2bfloat16_rn(acc[nt][i]);
        acc[nt][i] = 0.f;
      }
  }

  __device__ void finish(int tile, int from, int to, float (*acc)[4], float4* redbuf) const {
    float4* red = redbuf + (rg * 32 + lane) * (C::kAcc / 4);
    float4* a4 = reinterpret_cast<float4*>(&acc[0][0]);
    if (h == 1) {
#pragma unroll
      for (int i = 0; i < C::kAcc / 4; ++i) red[i] = a4[i], a4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncthreads();
    if (h == 0) {
#pragma unroll
      for (int i = 0; i < C::kAcc / 4; ++i) {
        const float4 v = red[i];
        a4[i].x += v.x, a4[i].y += v.y, a4[i].z += v.z, a4[i].w += v.w;
      }
    }
    if (from == tile * ks && to == (tile + 1) * ks) {
      if (h == 0) store(tile, acc);
      return;
    }
    // Split tile: the CTA holding its first K step (c0, for which it is the last tile of its range) sums the pieces,
    // in CTA order; every other piece (the first tile of its CTA's range, done early) is left in the CTA's workspace
    // slot and counted without waiting.
    const int c0 = owner(static_cast<int64_t>(tile) * ks, units, p.grid);
    const int c1 = owner(static_cast<int64_t>(tile + 1) * ks - 1, units, p.grid);
    const int lane_at = (rg * 32 + lane) * (C::kAcc / 4);
    if (static_cast<int>(blockIdx.x) != c0) {
      if (h == 0) {
        float4* slot = reinterpret_cast<float4*>(p.ws) + blockIdx.x * (C::kPiece / 4);
#pragma unroll
        for (int i = 0; i < C::kAcc / 4; ++i) __stcg(slot + lane_at + i, a4[i]), a4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      __syncthreads();
      if (tid == 0) {
        __threadfence();
        atomicAdd(p.counters + tile, 1);
      }
      return;
    }
    if (tid == 0) {
      int arrived;
      do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(arrived) : "l"(p.counters + tile) : "memory");
      } while (arrived < c1 - c0);
      p.counters[tile] = 0;
    }
    __syncthreads();
    if (h == 0) {
      for (int c = c0 + 1; c <= c1; ++c) {
        const float4* slot = reinterpret_cast<const float4*>(p.ws) + c * (C::kPiece / 4);
#pragma unroll
        for (int i = 0; i < C::kAcc / 4; ++i) {
          const float4 v = __ldcg(slot + lane_at + i);
          a4[i].x += v.x, a4[i].y += v.y, a4[i].z += v.z, a4[i].w += v.w;
        }
      }
      store(tile, acc);
    }
  }
};

template <int NT>
__global__ void __launch_bounds__(kThreads) w12_wgmma_kernel(const __grid_constant__ Params p) {
  using C = Cfg<NT>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[C::kStages];
  uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float4* red = reinterpret_cast<float4*>(stages + C::kStages * C::kStage);
  int* ptrs = reinterpret_cast<int*>(red + C::kPiece / 4);
  if (p.probe & 2) return;
  const int64_t units = static_cast<int64_t>(p.n / kBN) * (p.half / kBKh);
  const int start = static_cast<int>(blockIdx.x * units / p.grid);
  const int end = static_cast<int>((blockIdx.x + 1) * units / p.grid);
  Kernel<NT> k(p, stages, ptrs, start);
  for (int i = k.tid; i <= (end - start) * 8; i += kThreads) ptrs[i] = __ldg(p.esc_ptr + start * 8 + i);
  if (k.tid == 0) {
    for (int s = 0; s < C::kStages; ++s) bar_init(full + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::);
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.low_map)));
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.codes_map)));
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.x_map)));
  }
  __syncthreads();
  if (k.tid == 0 && !(p.probe & 8))
    for (int s = 0; s < C::kStages - 1 && start + s < end; ++s) k.load(start + s, full + (start + s) % C::kStages);
  float acc[NT][4], esc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = esc[nt][i] = 0.f;
  uint32_t a0[4][4], a1[4][4], b[2];
  int from = start;
  for (int u = start; u < end; ++u) {
    if (!(p.probe & 8)) bar_wait(full + u % C::kStages, ((u - start) / C::kStages) & 1);
    if (!(p.probe & 1)) {
      k.bases(u, b);
      wgmma_wait<1>();   // unit u - 1's first half is done: a0 is free
      k.mma_half(u, 0, acc, a0, b);
      wgmma_wait<1>();   // unit u - 1 is done: a1 is free and its stage no longer read
      k.mma_half(u, 1, acc, a1, b);
      k.escapes(u, esc, b);
    }
    __syncthreads();   // every warp is done with unit u - 1, whose stage the next load takes
    if (!(p.probe & 8) && k.tid == 0 && u + C::kStages - 1 < end)
      k.load(u + C::kStages - 1, full + (u + C::kStages - 1) % C::kStages);
    if (!(p.probe & 4) && (u + 1 == end || (u + 1) % k.ks == 0)) {
      wgmma_wait<0>();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] += esc[nt][i], esc[nt][i] = 0.f;
      k.finish(u / k.ks, from, u + 1, acc, red);
      from = u + 1;
    }
  }
  wgmma_wait<0>();
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    void* f = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }
  return fn;
}

// A 2D map over [rows, cols] elements (row stride `stride` bytes), boxes of box_rows x box_cols, 128-byte swizzle.
bool map_2d(CUtensorMap* map, CUtensorMapDataType type, int elem, const void* ptr, uint64_t rows, uint64_t cols,
            uint64_t stride, uint32_t box_rows, uint32_t box_cols) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {stride};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t estr[2] = {1, 1};
  (void)elem;
  return encode_fn()(map, type, 2, const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int NT>
int launch(const Args& a, cudaStream_t stream) {
  using C = Cfg<NT>;
  static bool sized = false;
  if (!sized) {
    const cudaError_t err = cudaFuncSetAttribute(w12_wgmma_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
    if (err != cudaSuccess) return err;
    sized = true;
  }
  Params p;
  if (!encode_fn()) return 1001;
  if (!map_2d(&p.low_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.low, a.n, 2 * a.half, 2 * a.half, kBN, 128) ||
      !map_2d(&p.codes_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.codes, a.n, a.half, a.half, kBN, 128) ||
      !map_2d(&p.x_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a.x, a.m, 2 * a.half, 2 * a.ldx, C::kMp, 64))
    return 1002;
  p.base = a.base;
  p.esc_ptr = a.esc_ptr;
  p.esc = a.esc;
  p.y = a.y;
  p.ws = a.ws;
  p.counters = a.counters;
  p.n = a.n, p.half = a.half, p.m = a.m, p.ldy = a.ldy, p.grid = a.grid, p.probe = a.probe;
  w12_wgmma_kernel<NT><<<a.grid, kThreads, C::kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <int NT>
int ctas_per_sm() {
  int n = 0;
  cudaFuncSetAttribute(w12_wgmma_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg<NT>::kSmem);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, w12_wgmma_kernel<NT>, kThreads, Cfg<NT>::kSmem);
  return n;
}

}  // namespace

extern "C" {

int w12_stream_params_size() { return sizeof(Args); }
int w12_stream_piece_floats(int m) { return m <= 16 ? Cfg<2>::kPiece : m <= 32 ? Cfg<4>::kPiece : Cfg<8>::kPiece; }

int w12_stream_ctas_per_sm(int m) {
  return m <= 8 ? ctas_per_sm<1>() : m <= 16 ? ctas_per_sm<2>() : m <= 32 ? ctas_per_sm<4>() : ctas_per_sm<8>();
}

int w12_stream_gemm(const Args* a, void* stream) {
  const int64_t units = static_cast<int64_t>((a->n + kBN - 1) / kBN) * (a->half / kBKh);
  if (a->m < 1 || a->m > 64 || a->half % kBKh != 0 || a->n % kBN != 0 || a->ldx % 8 != 0 || a->grid < 1 ||
      a->grid > units || (units + a->grid - 1) / a->grid > kMaxUnits)
    return 1000;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a->m <= 8) return launch<1>(*a, s);
  if (a->m <= 16) return launch<2>(*a, s);
  if (a->m <= 32) return launch<4>(*a, s);
  return launch<8>(*a, s);
}

const char* w12_stream_error(int code) {
  return code == 1000   ? "shape not taken (M in 1..64, half a multiple of 128, N of 64, x rows 16-byte aligned, grid <= units, "
                          "units per CTA <= 128)"
         : code == 1001 ? "cuTensorMapEncodeTiled not found"
         : code == 1002 ? "a tensor map was refused"
                        : cudaGetErrorString(static_cast<cudaError_t>(code));
}
}
