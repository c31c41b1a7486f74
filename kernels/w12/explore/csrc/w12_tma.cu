// y = x @ W.T for W in W12 form, 1 <= M <= 64 (issue #18 item 2, exploration): the stream-K kernel of
// w12_stream.cu with its loads done by the tensor memory accelerator. Per unit (64 rows x 128 half-columns), one
// thread issues 2D TMA boxes — the low plane's two halves, the code plane, x's four 64-column boxes (rows past M
// zero-filled) — into a 128-byte-swizzled stage, completing on the stage's mbarrier; kStages - 1 units ahead.
// A lane's tile row g is physical row (g & 1) << 2 | g >> 1, so that the 8 lanes of a shared-memory phase read
// rows 4 apart, which the 128-byte swizzle puts in different banks.
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
                             // at once, 4 = no end of piece (no K-group sum, fix-up or store), 8 = no loads, 16 = no MMA, 32 = no
                             // decode
};

namespace {

#ifndef W12_PROBES
#define W12_PROBES 0   // 1: compile the ablations 16 and 32 (their branches cost registers and time)
#endif
constexpr int kBN = 64;      // rows per tile: 4 row groups of one m16 tile
constexpr int kBKh = 128;    // half-columns per K step
constexpr int kThreads = 256;
constexpr int kBox = kBN * 128;   // one plane box: 64 rows x 128 bytes

template <int NT>
struct Cfg {
  static constexpr int kMp = NT * 8;
  static constexpr int kXBox = kMp * 128;          // 64 bf16 columns of kMp tokens
  static constexpr int kStage = 3 * kBox + 4 * kXBox;
  static constexpr int kAcc = NT * 4;
  static constexpr int kPiece = 4 * 32 * kAcc;
  static constexpr int kFree = 200 * 1024 - kPiece * 4 - 1024;
#ifndef W12_MAXSTAGES
#define W12_MAXSTAGES 6
#endif
  static constexpr int kStages = kFree / kStage < W12_MAXSTAGES ? kFree / kStage : W12_MAXSTAGES;
  static constexpr int kSmem = 1024 + kStages * kStage + kPiece * 4;   // 1024: alignment slack
  static_assert(kStages >= 2, "a stage too large");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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

__device__ __forceinline__ uint32_t word(const uint4& v, int u) {
  return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w;
}

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
  int tid, warp, lane, g, t, rg, h, ks;
  int64_t units;

  __device__ Kernel(const Params& p_, uint8_t* stages_) : p(p_), stages(stages_) {
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
  __device__ int row_of(int hr) const { return rg * 16 + (((g & 1) << 2) | (g >> 1)) + 8 * hr; }

  __device__ void load(int u, uint64_t* bar) const {   // one thread
    uint8_t* s = stage(u);
    const int row0 = (u / ks) * kBN, j0 = (u % ks) * kBKh;
    bar_expect(bar, 3 * kBox + 4 * C::kXBox);
    tma_2d(s, &p.low_map, j0, row0, bar);
    tma_2d(s + kBox, &p.low_map, p.half + j0, row0, bar);
    tma_2d(s + 2 * kBox, &p.codes_map, j0, row0, bar);
#pragma unroll
    for (int b = 0; b < 4; ++b)
      tma_2d(s + 3 * kBox + b * C::kXBox, &p.x_map, (b >> 1) * p.half + j0 + (b & 1) * 64, 0, bar);
  }

  __device__ void bases(int tile, uint32_t* b) const {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      b[hr] = static_cast<uint32_t>(__ldg(p.base + min(tile * kBN + row_of(hr), p.n - 1))) * 0x01010101u;
  }

  __device__ void compute(int u, float (*acc)[4], const uint32_t* b) const {
    const uint8_t* s = stage(u);
    const uint8_t* lows = s + h * kBox;
    const uint8_t* codes = s + 2 * kBox;
#pragma unroll
    for (int ss = 0; ss < 2; ++ss) {
      uint32_t a[4][4];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = row_of(hr);
        const uint4 lo = *reinterpret_cast<const uint4*>(lows + at(row, ss * 4 + t));
        const uint4 cd = *reinterpret_cast<const uint4*>(codes + at(row, ss * 4 + t));
#if W12_PROBES
        if (p.probe & 32) {   // ablation: the raw plane words as the A fragments
#pragma unroll
          for (int w = 0; w < 4; ++w) a[w][hr] = word(lo, w), a[w][2 + hr] = word(cd, w);
          continue;
        }
#endif
#pragma unroll
        for (int w = 0; w < 4; ++w) decode4(word(lo, w), word(cd, w), b[hr], 4 * h, a[w][hr], a[w][2 + hr]);
      }
      const uint8_t* xs = s + 3 * kBox + (2 * h + ss) * C::kXBox;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int n = nt * 8 + g;
        const uint4 x0 = *reinterpret_cast<const uint4*>(xs + at(n, 2 * t));
        const uint4 x1 = *reinterpret_cast<const uint4*>(xs + at(n, 2 * t + 1));
#if W12_PROBES
        if (p.probe & 16) {   // ablation: no MMA (its inputs kept live)
          acc[nt][0] += __uint_as_float(a[0][0] ^ a[1][1] ^ a[2][2] ^ a[3][3] ^ x0.x ^ x0.w ^ x1.y ^ x1.z);
          continue;
        }
#endif
        mma(acc[nt], a[0], x0.x, x0.y);
        mma(acc[nt], a[1], x0.z, x0.w);
        mma(acc[nt], a[2], x1.x, x1.y);
        mma(acc[nt], a[3], x1.z, x1.w);
      }
    }
  }

  __device__ void escapes(int u, int first, int count, uint32_t mine, float (*acc)[4], const uint32_t* b) const {
    const uint8_t* xs = stage(u) + 3 * kBox;
    for (int e = 0; e < count; ++e) {
      uint32_t ent = __shfl_sync(0xffffffffu, mine, e & 31);
      if (e >= 32) ent = __ldg(p.esc + first + e);
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
__global__ void __launch_bounds__(kThreads) w12_tma_kernel(const __grid_constant__ Params p) {
  using C = Cfg<NT>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[C::kStages];
  uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float4* red = reinterpret_cast<float4*>(stages + C::kStages * C::kStage);
  if (p.probe & 2) return;
  Kernel<NT> k(p, stages);
  const int start = static_cast<int>(blockIdx.x * k.units / p.grid);
  const int end = static_cast<int>((blockIdx.x + 1) * k.units / p.grid);
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
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  uint32_t b[2], bn[2];
  k.bases(start / k.ks, b);
  if (start + 1 < end && (start + 1) % k.ks == 0) k.bases((start + 1) / k.ks, bn);
  const int* ptr = p.esc_ptr + k.warp;
  int first = __ldg(ptr + start * 8), count = __ldg(ptr + start * 8 + 1) - first;
  uint32_t mine = k.lane < count ? __ldg(p.esc + first + k.lane) : 0u;
  int nfirst = 0, nlast = 0;
  if (start + 1 < end) nfirst = __ldg(ptr + (start + 1) * 8), nlast = __ldg(ptr + (start + 1) * 8 + 1);
  int from = start;
  for (int u = start; u < end; ++u) {
    __syncthreads();   // every warp is done with unit u - 1, whose stage the next load takes
    if (!(p.probe & 8)) {
      if (k.tid == 0 && u + C::kStages - 1 < end) k.load(u + C::kStages - 1, full + (u + C::kStages - 1) % C::kStages);
      bar_wait(full + u % C::kStages, ((u - start) / C::kStages) & 1);
    }
    if (!(p.probe & 1)) {
      k.compute(u, acc, b);
      k.escapes(u, first, count, mine, acc, b);
    }
    if (!(p.probe & 4) && (u + 1 == end || (u + 1) % k.ks == 0)) {
      k.finish(u / k.ks, from, u + 1, acc, red);
      from = u + 1;
    }
    if (u + 1 < end) {
      if ((u + 1) % k.ks == 0) b[0] = bn[0], b[1] = bn[1];
      if (u + 2 < end && (u + 2) % k.ks == 0) k.bases((u + 2) / k.ks, bn);
      first = nfirst;
      count = nlast - nfirst;
      mine = k.lane < count ? __ldg(p.esc + first + k.lane) : 0u;
      if (u + 2 < end) nfirst = __ldg(ptr + (u + 2) * 8), nlast = __ldg(ptr + (u + 2) * 8 + 1);
    }
  }
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
    const cudaError_t err = cudaFuncSetAttribute(w12_tma_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
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
  w12_tma_kernel<NT><<<a.grid, kThreads, C::kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <int NT>
int ctas_per_sm() {
  int n = 0;
  cudaFuncSetAttribute(w12_tma_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg<NT>::kSmem);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, w12_tma_kernel<NT>, kThreads, Cfg<NT>::kSmem);
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
  if (a->m < 1 || a->m > 64 || a->half % kBKh != 0 || a->ldx % 8 != 0 || a->grid < 1 || a->grid > units) return 1000;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a->m <= 8) return launch<1>(*a, s);
  if (a->m <= 16) return launch<2>(*a, s);
  if (a->m <= 32) return launch<4>(*a, s);
  return launch<8>(*a, s);
}

const char* w12_stream_error(int code) {
  return code == 1000   ? "shape not taken (M in 1..64, half a multiple of 128, x rows 16-byte aligned, grid <= units)"
         : code == 1001 ? "cuTensorMapEncodeTiled not found"
         : code == 1002 ? "a tensor map was refused"
                        : cudaGetErrorString(static_cast<cudaError_t>(code));
}
}
