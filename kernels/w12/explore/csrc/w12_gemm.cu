// y = x @ W.T for W in W12 form and 16 < M <= 64 rows of x (CUDA C++, mma.sync m16n8k16 bf16).
//
// Each CTA owns 128 rows of W (8 warps x 16 rows) and one K range (split K). The weights go straight
// from global memory into registers, 16 bytes per plane and row per lane, one step ahead of their use, and
// are decoded in registers directly into the MMA's A fragments: the GEMM sums over k, so the k slots of an
// MMA may be any 16 columns, and lane t's slots {2t, 2t+1, 2t+8, 2t+9} are taken to be four consecutive
// columns 16t + 4u .. 16t + 4u + 3 of the step — the four weights one decode produces. x's step tile
// (both halves of the row, all M rows) is staged in shared memory by cp.async, double-buffered, with a
// 16-byte-chunk XOR swizzle so the B-fragment reads (16 bytes per lane) are free of bank conflicts, and
// is read by all 8 warps. Escaped weights read as 2^(2*base-127) in the planes; the first K range adds
// x[:, col] * w_true and x[:, col] * -w_planes for each of its rows' escapes (exact products, fp32 sums).
// Split K: each range writes fp32 partials; the last range to arrive sums them in a fixed order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

// Passed by value to the kernel; its layout is mirrored by cuda.Params in Python.
struct Params {
  const uint8_t* low;        // [N, 2*half]
  const uint8_t* codes;      // [N, half]
  const uint8_t* base;       // [N]
  const int32_t* esc_ptr;    // [N + 1]
  const int32_t* esc_col;    // [escapes]
  const int16_t* esc_bits;   // [escapes]
  float* partials;           // [splits, kMaxM, N] when splits > 1
  int32_t* counters;         // [row blocks], zero between launches
  int32_t n, k, half, splits, stages;
};

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kWarps * 16;      // rows of W per CTA
constexpr int kStep = 64;               // half-columns per step: 64 low-half + 64 high-half weights per row
constexpr int kChunks = 16;             // 16-byte chunks per staged x row (128 bf16)
constexpr int kMaxM = 64;


__device__ __forceinline__ void decode4(uint32_t low, uint32_t nib, uint32_t base4, bool high, uint32_t& p0,
                                        uint32_t& p1) {
  // nib byte = sign << 3 | code (low nibble: low-half column, high nibble: high-half column)
  uint32_t t = high ? ((nib >> 4) & 0x07070707u) : (nib & 0x07070707u);
  uint32_t h = high ? (nib & 0x80808080u) : ((nib << 4) & 0x80808080u);
  h |= t + base4;                      // sign << 7 | (base + code): no carries, base + 7 <= 127
  p0 = __byte_perm(low, h, 0x5140);    // bf16 pair (w0, w1): low0 hi0 low1 hi1
  p1 = __byte_perm(low, h, 0x7362);    // bf16 pair (w2, w3)
}

__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#ifndef W12_L2_PREFETCH
#define W12_L2_PREFETCH 256
#endif
#define W12_STR2(x) #x
#define W12_STR(x) W12_STR2(x)

__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
  uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#if W12_L2_PREFETCH == 0
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
#else
  asm volatile("cp.async.cg.shared.global.L2::" W12_STR(W12_L2_PREFETCH) "B [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
#endif
}

__device__ __forceinline__ uint32_t word(const uint4& v, int u) {
  return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w;
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

template <int NT>
struct Tile {   // one pipeline stage in shared memory
  static constexpr int kWBytes = 3 * kRows * 64;               // [plane: low, high, codes][row][64 bytes]
  static constexpr int kXBytes = NT * 8 * kChunks * 16;        // [n][16 chunks], chunk c at c ^ (n & 7)
  static constexpr int kBytes = kWBytes + kXBytes;
};

template <int NT>
__device__ __forceinline__ void issue_step(uint8_t* stage, const Params& p, const __nv_bfloat16* x, long ldx, int m,
                                           int row0, int j0) {
  const size_t stride = 2 * static_cast<size_t>(p.half);
  for (int i = threadIdx.x; i < 3 * kRows * 4; i += kThreads) {
    const int plane = i / (kRows * 4), row = (i / 4) % kRows, c = i % 4;
    const size_t r = min(row0 + row, p.n - 1);
    const uint8_t* src = plane == 2 ? p.codes + r * p.half + j0 + 16 * c
                                    : p.low + r * stride + (plane ? p.half : 0) + j0 + 16 * c;
    cp_async16(stage + (plane * kRows + row) * 64 + 16 * c, src);
  }
  uint4* xs = reinterpret_cast<uint4*>(stage + Tile<NT>::kWBytes);
  for (int i = threadIdx.x; i < m * kChunks; i += kThreads) {
    const int n = i / kChunks, c = i % kChunks;
    const int col = (c < 8 ? j0 : p.half + j0) + (c & 7) * 8;
    cp_async16(xs + n * kChunks + (c ^ (n & 7)), x + n * ldx + col);
  }
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void wait_pending() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int NT, int STAGES>
__global__ void __launch_bounds__(kThreads, 1)
    w12_gemm_kernel(const Params p, const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int m,
                    long ldx, long ldy) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int arrived;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row_block = blockIdx.x, split = blockIdx.y;
  const int row0 = row_block * kRows;
  const int rg = row0 + warp * 16 + g;
  const int r0 = min(rg, p.n - 1), r8 = min(rg + 8, p.n - 1);
  const uint32_t base0 = p.base[r0] * 0x01010101u, base8 = p.base[r8] * 0x01010101u;

  // x rows m .. NT*8-1 of every stage stay zero (cp.async never writes them)
  const int pad = (NT * 8 - m) * kChunks;
  for (int i = threadIdx.x; i < STAGES * pad; i += kThreads) {
    uint4* xs = reinterpret_cast<uint4*>(smem + (i / pad) * Tile<NT>::kBytes + Tile<NT>::kWBytes);
    xs[m * kChunks + i % pad] = make_uint4(0, 0, 0, 0);
  }

  const int steps = p.half / kStep;
  const int per = (steps + p.splits - 1) / p.splits;
  const int s_begin = min(steps, split * per), s_end = min(steps, s_begin + per);

  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (s_begin + i < s_end) issue_step<NT>(smem + i * Tile<NT>::kBytes, p, x, ldx, m, row0, (s_begin + i) * kStep);
    commit();
  }
  const int wrow = warp * 16 + g;
  for (int s = s_begin; s < s_end; ++s) {
    const int idx = s - s_begin;
    wait_pending<STAGES - 2>();
    __syncthreads();   // this step's tile is in; every warp is done with the stage refilled below
    const int ahead = s + STAGES - 1;
    if (ahead < s_end)
      issue_step<NT>(smem + ((idx + STAGES - 1) % STAGES) * Tile<NT>::kBytes, p, x, ldx, m, row0, ahead * kStep);
    commit();
    const uint8_t* stage = smem + (idx % STAGES) * Tile<NT>::kBytes;
    const uint4* xs = reinterpret_cast<const uint4*>(stage + Tile<NT>::kWBytes);
    const uint4 cd0 = *reinterpret_cast<const uint4*>(stage + (2 * kRows + wrow) * 64 + 16 * t);
    const uint4 cd8 = *reinterpret_cast<const uint4*>(stage + (2 * kRows + wrow + 8) * 64 + 16 * t);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint4 lo0 = *reinterpret_cast<const uint4*>(stage + (hh * kRows + wrow) * 64 + 16 * t);
      const uint4 lo8 = *reinterpret_cast<const uint4*>(stage + (hh * kRows + wrow + 8) * 64 + 16 * t);
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        uint32_t a[2][4];
#pragma unroll
        for (int uu = 0; uu < 2; ++uu) {
          const int u = 2 * pair + uu;
          decode4(word(lo0, u), word(cd0, u), base0, hh, a[uu][0], a[uu][2]);
          decode4(word(lo8, u), word(cd8, u), base8, hh, a[uu][1], a[uu][3]);
        }
        const int chunk = hh * 8 + 2 * t + pair;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int n = nt * 8 + g;
          const uint4 b = xs[n * kChunks + (chunk ^ (n & 7))];
          mma(acc[nt], a[0][0], a[0][1], a[0][2], a[0][3], b.x, b.y);
          mma(acc[nt], a[1][0], a[1][1], a[1][2], a[1][3], b.z, b.w);
        }
      }
    }
  }
  wait_pending<0>();

  if (split == 0) {   // escapes: acc[row][n] += x[n, col] * w_true - x[n, col] * w_planes
#pragma unroll
    for (int half_row = 0; half_row < 2; ++half_row) {
      const int r = rg + 8 * half_row;
      if (r >= p.n) continue;
      const float w_planes = bf16_bits_to_float(static_cast<uint32_t>(p.base[r]) << 8);
      for (int e = p.esc_ptr[r]; e < p.esc_ptr[r + 1]; ++e) {
        const int col = p.esc_col[e];
        const float w_true = bf16_bits_to_float(static_cast<uint16_t>(p.esc_bits[e]));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int cc = 0; cc < 2; ++cc) {
            const int n = nt * 8 + 2 * t + cc;
            if (n < m) {
              const float xv = __bfloat162float(x[n * ldx + col]);
              float& c = acc[nt][2 * half_row + cc];
              c = fmaf(xv, w_true, c);
              c = fmaf(xv, -w_planes, c);
            }
          }
        }
      }
    }
  }

  if (p.splits == 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = nt * 8 + 2 * t + (i & 1), r = rg + 8 * (i >> 1);
        if (n < m && r < p.n) y[n * ldy + r] = __float2bfloat16_rn(acc[nt][i]);
      }
    return;
  }
  float* part = p.partials;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = nt * 8 + 2 * t + (i & 1), r = rg + 8 * (i >> 1);
      if (n < m && r < p.n) __stcg(part + (static_cast<size_t>(split) * kMaxM + n) * p.n + r, acc[nt][i]);
    }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) arrived = atomicAdd(p.counters + row_block, 1);
  __syncthreads();
  if (arrived != p.splits - 1) return;
  __threadfence();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = nt * 8 + 2 * t + (i & 1), r = rg + 8 * (i >> 1);
      if (n < m && r < p.n) {
        float total = 0.f;
        for (int s = 0; s < p.splits; ++s) total += __ldcg(part + (static_cast<size_t>(s) * kMaxM + n) * p.n + r);
        y[n * ldy + r] = __float2bfloat16_rn(total);
      }
    }
  if (threadIdx.x == 0) p.counters[row_block] = 0;
}

template <int NT, int STAGES>
cudaError_t launch(const Params& p, const void* x, void* y, int m, long ldx, long ldy, cudaStream_t stream) {
  constexpr int bytes = STAGES * Tile<NT>::kBytes;
  static bool sized = false;   // the dynamic shared-memory limit is raised once per instantiation
  if (!sized) {
    const cudaError_t err =
        cudaFuncSetAttribute(w12_gemm_kernel<NT, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    sized = true;
  }
  dim3 grid((p.n + kRows - 1) / kRows, p.splits);
  w12_gemm_kernel<NT, STAGES><<<grid, kThreads, bytes, stream>>>(p, static_cast<const __nv_bfloat16*>(x),
                                                                 static_cast<__nv_bfloat16*>(y), m, ldx, ldy);
  return cudaGetLastError();
}

template <int NT>
cudaError_t launch_stages(const Params& p, const void* x, void* y, int m, long ldx, long ldy, cudaStream_t stream) {
  switch (p.stages) {
    case 2: return launch<NT, 2>(p, x, y, m, ldx, ldy, stream);
    case 3: return launch<NT, 3>(p, x, y, m, ldx, ldy, stream);
    case 4: return launch<NT, 4>(p, x, y, m, ldx, ldy, stream);
    case 5: return launch<NT, 5>(p, x, y, m, ldx, ldy, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

int w12_params_size() { return sizeof(Params); }

// 0 on success, else a cudaError_t; 1000 for an M outside 1..64.
int w12_gemm(const Params* p, const void* x, void* y, int m, long ldx, long ldy, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (m <= 8) return launch_stages<1>(*p, x, y, m, ldx, ldy, s);
  if (m <= 16) return launch_stages<2>(*p, x, y, m, ldx, ldy, s);
  if (m <= 32) return launch_stages<4>(*p, x, y, m, ldx, ldy, s);
  if (m <= 48) return launch_stages<6>(*p, x, y, m, ldx, ldy, s);
  if (m <= 64) return launch_stages<8>(*p, x, y, m, ldx, ldy, s);
  return 1000;
}

const char* w12_error_string(int code) { return code == 1000 ? "M outside 1..64" : cudaGetErrorString((cudaError_t)code); }
}
