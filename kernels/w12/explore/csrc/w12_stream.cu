// y = x @ W.T for W in W12 form, 1 <= M <= 64 (issue #18 item 2, exploration): a persistent stream-K kernel.
//
// One CTA per SM walks a contiguous range of work units; a unit is one tile of W12_BN (128) weight rows by one K step
// of W12_BKH (64) half-columns (j0..j0+63 of the first half and of the second, as the code plane pairs them). Every
// unit's planes (24 KB) and its x columns (M x 128 bf16) go global -> shared memory by cp.async, kStages - 1 units
// ahead. 8 warps: 4 row groups of 32 rows (two m16 tiles sharing each x fragment) x 2 K groups (the two halves).
// A warp decodes its rows' 4-weight words from shared memory straight into mma.sync A fragments (lane t's k slots
// {2t, 2t+1, 2t+8, 2t+9} taken as 4 consecutive columns, x's B fragments permuted the same way) and adds the
// unit's escapes (a list per unit and warp, made at load; one unit ahead in registers) in registers with x from
// shared memory. At the end of a tile's piece the K groups are summed through shared memory; a tile covered by one
// CTA is stored from registers, else every piece goes to a workspace slot and the CTA that completes the tile (a
// counter per tile) sums the pieces in CTA order — deterministic — and stores y. (w12_tma.cu replaces the loads by
// TMA and this blocking fix-up by one that waits only in the CTA that sums.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

struct Params {
  const uint8_t* low;        // [N, 2*half]
  const uint8_t* codes;      // [N, half]
  const uint8_t* base;       // [N]
  const int32_t* esc_ptr;    // [units * 8 + 1]: escapes of unit u (= tile * ksteps + kstep) and warp w at u * 8 + w
  const uint32_t* esc;       // row in tile | column in unit << 7 | the weight's bf16 bits << 16
  const __nv_bfloat16* x;    // [m, 2*half], row stride ldx
  __nv_bfloat16* y;          // [m, N], row stride ldy
  float* ws;                 // partial tiles: [grid][2][4 * 32 * kAcc]
  int32_t* counters;         // [tiles], zero between launches (the completing CTA resets its tile's)
  int32_t n, half, m, ldx, ldy, grid;
  int32_t probe;             // timing ablation, wrong results: 1 = loads only (no decode, MMA or escapes)
};

namespace {

#ifndef W12_BN
#define W12_BN 128
#endif
#ifndef W12_BKH
#define W12_BKH 64
#endif
#ifndef W12_HINT
#define W12_HINT 0
#endif
constexpr int kBN = W12_BN;        // rows per tile: 4 row groups of kMt m16 tiles
constexpr int kBKh = W12_BKH;      // half-columns per K step
constexpr int kMt = kBN / 64;
constexpr int kSub = kBKh / 64;    // 64-column sub-steps per warp and unit
constexpr int kThreads = 256;
constexpr int kCodeChunks = kBKh / 16;

template <int NT>
struct Cfg {
  static constexpr int kMp = NT * 8;
  static constexpr int kLow = kBN * 2 * kBKh;     // [row][128 B]: first half's 64 bytes, then the second's
  static constexpr int kCodes = kBN * kBKh;       // [row][64 B]
  static constexpr int kX = kMp * 4 * kBKh;       // [token][128 bf16]
  static constexpr int kStage = kLow + kCodes + kX;
  static constexpr int kAcc = kMt * NT * 4;        // accumulator floats per lane
  static constexpr int kPiece = 4 * 32 * kAcc;    // floats per partial tile
  static constexpr int kStages = (200 * 1024 - kPiece * 4) / kStage < 6 ? (200 * 1024 - kPiece * 4) / kStage : 6;
  static constexpr int kSmem = kStages * kStage + kPiece * 4;
  static_assert(kStages >= 2, "a stage too large");
};

__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
}
__device__ __forceinline__ void cp_async16_planes(void* smem, const void* global) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#if W12_HINT == 128
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
#elif W12_HINT == 256
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
#endif
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t word(const uint4& v, int u) {
  return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w;
}

// Four weights: low bytes `low`, code bytes `nib` (this half's nibble at bit `shift`), the row's base in every byte.
__device__ __forceinline__ void decode4(uint32_t low, uint32_t nib, uint32_t base4, int shift, uint32_t& p0,
                                        uint32_t& p1) {
  const uint32_t h = (((nib >> shift) & 0x07070707u) + base4) | ((nib << (4 - shift)) & 0x80808080u);
  p0 = __byte_perm(low, h, 0x5140);
  p1 = __byte_perm(low, h, 0x7362);
}

__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The CTA that holds unit u (CTA c holds units [c*U/G, (c+1)*U/G)).
__device__ __forceinline__ int owner(int64_t u, int64_t units, int grid) {
  int c = static_cast<int>(u * grid / units);
  while (c + 1 < grid && (c + 1) * units / grid <= u) ++c;
  while (c > 0 && c * units / grid > u) --c;
  return c;
}

template <int NT>
struct Kernel {
  using C = Cfg<NT>;
  const Params& p;
  uint8_t* smem;
  int tid, warp, lane, g, t, rg, h, ks;
  int64_t units;

  __device__ Kernel(const Params& p_, uint8_t* smem_) : p(p_), smem(smem_) {
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

  __device__ uint8_t* stage(int u) const { return smem + (u % C::kStages) * C::kStage; }
  __device__ static int row_of(int mt, int hr, int rg_, int g_) { return rg_ * (kBN / 4) + mt * 16 + g_ + 8 * hr; }

  __device__ void load(int u) const {
    uint8_t* s = stage(u);
    const int tile = u / ks, j0 = (u % ks) * kBKh;
    const size_t ld = 2 * static_cast<size_t>(p.half);
    constexpr int kLowChunks = kBKh / 8;   // per row: both halves
#pragma unroll
    for (int i = tid; i < kBN * kLowChunks; i += kThreads) {
      const int row = i / kLowChunks, c = i % kLowChunks;
      const size_t r = min(tile * kBN + row, p.n - 1);
      const int col = c < kCodeChunks ? j0 + 16 * c : p.half + j0 + 16 * (c - kCodeChunks);
      cp_async16_planes(s + row * 2 * kBKh + ((c ^ ((row & 1) << 2)) << 4), p.low + r * ld + col);
    }
#pragma unroll
    for (int i = tid; i < kBN * kCodeChunks; i += kThreads) {
      const int row = i / kCodeChunks, c = i % kCodeChunks;
      const size_t r = min(tile * kBN + row, p.n - 1);
      cp_async16_planes(s + C::kLow + row * kBKh + ((c ^ (((row & 1) << 2) & (kCodeChunks - 1))) << 4),
                        p.codes + r * p.half + j0 + 16 * c);
    }
    constexpr int kXChunks = kBKh / 4;     // per token: both halves
    for (int i = tid; i < p.m * kXChunks; i += kThreads) {
      const int n = i / kXChunks, c = i % kXChunks;
      const int col = c < kXChunks / 2 ? j0 + 8 * c : p.half + j0 + 8 * (c - kXChunks / 2);
      cp_async16(s + C::kLow + C::kCodes + n * 4 * kBKh + ((c ^ (n & 1)) << 4),
                 p.x + static_cast<size_t>(n) * p.ldx + col);
    }
  }

  // The base of each of the lane's rows (m16 tile, upper/lower 8) in tile `tile`, in every byte.
  __device__ void bases(int tile, uint32_t (*b)[2]) const {
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        b[mt][hr] = static_cast<uint32_t>(__ldg(p.base + min(tile * kBN + row_of(mt, hr, rg, g), p.n - 1))) *
                    0x01010101u;
  }

  __device__ void compute(int u, float (*acc)[NT][4], const uint32_t (*b)[2]) const {
    const uint8_t* s = stage(u);
    const uint8_t* xs = s + C::kLow + C::kCodes;
#pragma unroll
    for (int ss = 0; ss < kSub; ++ss) {
      uint32_t a[kMt][4][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = row_of(mt, hr, rg, g);
          const int lc = h * kCodeChunks + ss * 4 + t, cc = ss * 4 + t;
          const uint4 lo = *reinterpret_cast<const uint4*>(s + row * 2 * kBKh + ((lc ^ ((row & 1) << 2)) << 4));
          const uint4 cd = *reinterpret_cast<const uint4*>(
              s + C::kLow + row * kBKh + ((cc ^ (((row & 1) << 2) & (kCodeChunks - 1))) << 4));
#pragma unroll
          for (int w = 0; w < 4; ++w)
            decode4(word(lo, w), word(cd, w), b[mt][hr], 4 * h, a[mt][w][hr], a[mt][w][2 + hr]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int n = nt * 8 + g;
        const int c0 = h * (kBKh / 8) + ss * 8 + 2 * t;
        const uint4 x0 = *reinterpret_cast<const uint4*>(xs + n * 4 * kBKh + ((c0 ^ (n & 1)) << 4));
        const uint4 x1 = *reinterpret_cast<const uint4*>(xs + n * 4 * kBKh + (((c0 + 1) ^ (n & 1)) << 4));
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          mma(acc[mt][nt], a[mt][0], x0.x, x0.y);
          mma(acc[mt][nt], a[mt][1], x0.z, x0.w);
          mma(acc[mt][nt], a[mt][2], x1.x, x1.y);
          mma(acc[mt][nt], a[mt][3], x1.z, x1.w);
        }
      }
    }
  }

  // acc[row][token] += x[token, col] * (w - w_planes) for the unit's escapes in this warp's rows and half: `count`
  // entries from `first`, the first 32 already in the lanes' `mine`.
  __device__ void escapes(int u, int first, int count, uint32_t mine, float (*acc)[NT][4],
                          const uint32_t (*b)[2]) const {
    const uint8_t* xs = stage(u) + C::kLow + C::kCodes;
    for (int e = 0; e < count; ++e) {
      uint32_t ent = __shfl_sync(0xffffffffu, mine, e & 31);
      if (e >= 32) ent = __ldg(p.esc + first + e);
      const int row = ent & 127, col = (ent >> 7) & 255;
      const float w = __uint_as_float(ent & 0xFFFF0000u);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          if (row != row_of(mt, hr, rg, g)) continue;
          const float wp = __uint_as_float((b[mt][hr] & 0xFFu) << 24);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
              const int n = nt * 8 + 2 * t + cc;
              const float xv = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(
                  xs + n * 4 * kBKh + ((((col >> 3) ^ (n & 1))) << 4) + (col & 7) * 2));
              float& v = acc[mt][nt][2 * hr + cc];
              v = fmaf(xv, w, v);
              v = fmaf(xv, -wp, v);
            }
        }
    }
  }

  __device__ void store(int tile, float (*acc)[NT][4]) const {
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = tile * kBN + row_of(mt, i >> 1, rg, g), n = nt * 8 + 2 * t + (i & 1);
          if (row < p.n && n < p.m) p.y[static_cast<size_t>(n) * p.ldy + row] = __float2bfloat16_rn(acc[mt][nt][i]);
          acc[mt][nt][i] = 0.f;
        }
  }

  // The end of this CTA's piece [from, to) of tile `tile`.
  __device__ void finish(int tile, int from, int to, float (*acc)[NT][4], int* last) const {
    float4* red = reinterpret_cast<float4*>(smem + C::kStages * C::kStage) + (rg * 32 + lane) * (C::kAcc / 4);
    float4* a4 = reinterpret_cast<float4*>(&acc[0][0][0]);
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
    const int first_tile = static_cast<int>(blockIdx.x * units / p.grid) / ks;
    const int lane_at = (rg * 32 + lane) * (C::kAcc / 4);
    if (h == 0) {
      float4* slot = reinterpret_cast<float4*>(p.ws) + (blockIdx.x * 2 + (tile != first_tile)) * (C::kPiece / 4);
#pragma unroll
      for (int i = 0; i < C::kAcc / 4; ++i) __stcg(slot + lane_at + i, a4[i]), a4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __threadfence();
    __syncthreads();
    const int c0 = owner(static_cast<int64_t>(tile) * ks, units, p.grid);
    const int c1 = owner(static_cast<int64_t>(tile + 1) * ks - 1, units, p.grid);
    if (tid == 0) *last = atomicAdd(p.counters + tile, 1) == c1 - c0;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    if (h == 0) {
      for (int c = c0; c <= c1; ++c) {
        const int ft = static_cast<int>(c * units / p.grid) / ks;
        const float4* slot = reinterpret_cast<const float4*>(p.ws) + (c * 2 + (tile != ft)) * (C::kPiece / 4);
#pragma unroll
        for (int i = 0; i < C::kAcc / 4; ++i) {
          const float4 v = __ldcg(slot + lane_at + i);
          a4[i].x += v.x, a4[i].y += v.y, a4[i].z += v.z, a4[i].w += v.w;
        }
      }
      store(tile, acc);
    }
    if (tid == 0) p.counters[tile] = 0;
  }
};

template <int NT>
__global__ void __launch_bounds__(kThreads, 1) w12_stream_kernel(const Params p) {
  using C = Cfg<NT>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int last;
  Kernel<NT> k(p, smem);
  const int start = static_cast<int>(blockIdx.x * k.units / p.grid);
  const int end = static_cast<int>((blockIdx.x + 1) * k.units / p.grid);
  float acc[kMt][NT][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (start + s < end) k.load(start + s);
    commit();
  }
  // Per warp, one unit ahead in registers: the bases of the next unit's rows, its escape range and (up to 32 of)
  // its entries; two units ahead, the escape range's pointers. Loaded at the end of an iteration, used in the next.
  uint32_t b[kMt][2], bn[kMt][2];
  k.bases(start / k.ks, b);
  if (start + 1 < end && (start + 1) % k.ks == 0) k.bases((start + 1) / k.ks, bn);
  const int* ptr = p.esc_ptr + k.warp;
  int first = __ldg(ptr + start * 8), count = __ldg(ptr + start * 8 + 1) - first;
  uint32_t mine = k.lane < count ? __ldg(p.esc + first + k.lane) : 0u;
  int nfirst = 0, nlast = 0;
  if (start + 1 < end) nfirst = __ldg(ptr + (start + 1) * 8), nlast = __ldg(ptr + (start + 1) * 8 + 1);
  int from = start;
  for (int u = start; u < end; ++u) {
    wait_groups<C::kStages - 2>();
    __syncthreads();
    if (u + C::kStages - 1 < end) k.load(u + C::kStages - 1);
    commit();
    if (!(p.probe & 1)) {
      k.compute(u, acc, b);
      k.escapes(u, first, count, mine, acc, b);
    }
    if (u + 1 == end || (u + 1) % k.ks == 0) {
      k.finish(u / k.ks, from, u + 1, acc, &last);
      from = u + 1;
    }
    if (u + 1 < end) {
      if ((u + 1) % k.ks == 0) {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) b[mt][0] = bn[mt][0], b[mt][1] = bn[mt][1];
      }
      if (u + 2 < end && (u + 2) % k.ks == 0) k.bases((u + 2) / k.ks, bn);
      first = nfirst;
      count = nlast - nfirst;
      mine = k.lane < count ? __ldg(p.esc + first + k.lane) : 0u;
      if (u + 2 < end) nfirst = __ldg(ptr + (u + 2) * 8), nlast = __ldg(ptr + (u + 2) * 8 + 1);
    }
  }
}

template <int NT>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  static bool sized = false;
  if (!sized) {
    const cudaError_t err = cudaFuncSetAttribute(w12_stream_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 Cfg<NT>::kSmem);
    if (err != cudaSuccess) return err;
    sized = true;
  }
  w12_stream_kernel<NT><<<p.grid, kThreads, Cfg<NT>::kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

int w12_stream_params_size() { return sizeof(Params); }
int w12_stream_piece_floats(int m) { return m <= 16 ? Cfg<2>::kPiece : m <= 32 ? Cfg<4>::kPiece : Cfg<8>::kPiece; }

// 0 on success, else a cudaError_t; 1000: a shape this kernel does not take.
int w12_stream_gemm(const Params* p, void* stream) {
  const int64_t units = static_cast<int64_t>((p->n + kBN - 1) / kBN) * (p->half / kBKh);
  if (p->m < 1 || p->m > 64 || p->half % kBKh != 0 || p->ldx % 8 != 0 || p->grid < 1 || p->grid > units) return 1000;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p->m <= 16) return launch<2>(*p, s);
  if (p->m <= 32) return launch<4>(*p, s);
  return launch<8>(*p, s);
}

const char* w12_stream_error(int code) {
  return code == 1000 ? "shape not taken (M in 1..64, half a multiple of 64, x rows 16-byte aligned, grid <= units)"
                      : cudaGetErrorString(static_cast<cudaError_t>(code));
}
}
