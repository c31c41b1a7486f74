// y = x @ W.T for W in W12 form (format version 4 planes), 1 <= M <= 64, on sm_90a: a
// warp-specialized stream-K kernel. One producer thread issues TMA loads into a ring of stages guarded by full and
// empty mbarriers; two consumer warpgroups take 64 rows each of the CTA's 128-row tile and never meet at a CTA
// barrier. A unit is 128 rows x 64 half-columns (64 columns of each half of K), its planes contiguous (one bulk
// copy) and in wgmma's K order (FORMAT.md: within every 64 columns, a lane's four K steps of one row are 16
// contiguous bytes), so a lane reads its A fragments with one 16-byte shared load per plane and row and decodes them
// in registers; x, TMA-loaded with the 128-byte swizzle, is the shared-memory B operand. Each consumer keeps two
// units in flight: it decodes unit u while unit u - 1's wgmmas run, and frees u - 1's stage once they are done.
// Escapes (grouped by unit and consumer warp, ws.py escape_table) are scalar multiply-adds by the lanes holding the
// escape's row, into accumulators of their own. Split tiles are summed by the CTA holding the tile's first unit, in
// CTA order: the result does not depend on timing. The CTAs' ranges of units and each tile's first and last CTA come
// from a table made with the plan (ws.cta_ranges), not from 64-bit divisions at every split tile's end.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#ifndef W12_STAGES
#define W12_STAGES 8
#endif

struct Args {
  const uint8_t* planes;   // [units][128 rows][first-half low 64 | second-half low 64 | codes 64], wgmma K order
  const uint8_t* base;     // [n]
  const int32_t* esc_ptr;  // [units * 8 + 1]: escapes of unit u and consumer warp w at [u * 8 + w, u * 8 + w + 1)
  const uint32_t* esc;     // row in tile | column in unit << 7 | the weight's bf16 bits << 16; 4 entries of padding
  const __nv_bfloat16* x;  // [m][ldx], columns 0..cols-1
  __nv_bfloat16* y;        // [m][ldy]
  float* ws;               // split tiles' pieces: w12_ws_slot_floats() per CTA
  int32_t* counters;       // 2 per row tile, zero between launches
  const int32_t* ranges;   // [grid + 1]: CTA c's units are [ranges[c], ranges[c + 1]); then per tile its first and
                           // last CTA
  int32_t n, half, cols, m, ldx, ldy, grid;
  int32_t pdl;             // 1: launched as a programmatic dependent of the kernel before it in the stream
};

struct Params {
  CUtensorMap x_map;
  const uint8_t* planes;
  const uint8_t* base;
  const int32_t* esc_ptr;
  const uint32_t* esc;
  __nv_bfloat16* y;
  float* ws;
  int32_t* counters;
  const int32_t* ranges;
  int32_t n, half, m, ldy, grid, ks;
};

namespace {

constexpr int kBN = 128;       // rows per tile: two consumer warpgroups of 64
constexpr int kBKh = 64;       // half-columns per unit
constexpr int kThreads = 384;  // warpgroup 0: the producer (one thread works), 1 and 2: consumers
constexpr int kRow = 3 * kBKh;        // a unit's bytes of one row: both halves' low bytes, then the codes
constexpr int kPlanes = kBN * kRow;   // a unit's planes, contiguous in global memory: one bulk copy
constexpr int kEscCap = 252;          // escape entries staged per unit (more are read from global memory)
constexpr int kMaxUnits = 128;        // units per CTA (their escape pointers are staged at the start)
constexpr int kMaxDevices = 64;

template <int NT>
struct Cfg {
  static constexpr int kMp = NT * 8;
  static constexpr int kXBox = kMp * 128;   // 64 bf16 columns of kMp tokens, 128-byte swizzle
  static constexpr int kPlanesAt = 2 * kXBox;
  static constexpr int kEscAt = kPlanesAt + kPlanes;
  static constexpr int kBaseAt = kEscAt + 4 * kEscCap;   // the tile's 128 bases, in a tile's first unit here
  static constexpr int kStage = (kBaseAt + kBN + 1023) / 1024 * 1024;
  static constexpr int kBytes = 2 * kXBox + kPlanes;
  static constexpr int kAcc = NT * 4;
  static constexpr int kSlot = 64 * kMp;    // one warpgroup's piece of a tile, floats
  static constexpr int kFit = (220 * 1024) / kStage;
  static constexpr int kStages = kFit < W12_STAGES ? kFit : W12_STAGES;
  static constexpr int kPtrBytes = 4 * (8 * kMaxUnits + 4);   // the CTA's escape pointers, then its tiles' CTAs
  static constexpr int kSmem = 1024 + kStages * kStage + kPtrBytes + 8 * kMaxUnits;
  static_assert(kStages >= 3, "a stage too large");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      "@!P bra WAIT;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}
// Shared memory is read through 32-bit shared addresses: generic loads of it are slower, and ptxas cannot always
// tell that a generic pointer is shared.
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds_u32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds_u16(uint32_t a) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds_u8(uint32_t a) {
  unsigned short v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=h"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ void sts_u32(uint32_t a, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
}
// Programmatic dependent launch (no-ops in a kernel launched without it): `grid_wait` returns once the kernels before
// this one in the stream have completed and their writes are visible; before it, only the weight (written before its
// plan was made: ws.WsPlan synchronizes) may be read, and nothing may be written. `grid_launch_dependents` lets the
// next kernel launch now: its CTAs take an SM as one of ours leaves it (ours fill the SM) and load their weights
// while our last CTAs finish.
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void grid_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }
__device__ __forceinline__ void group_sync(int wg) {   // the 128 threads of consumer warpgroup wg
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

// Four weights of one half (shift 0: the first, 4: the second) from their 4 low bytes and 4 code bytes (FORMAT.md,
// "Decoding four weights at a time"), as two bf16x2 registers.
__device__ __forceinline__ void decode4(uint32_t low, uint32_t nib, uint32_t base4, int shift, uint32_t& p0,
                                        uint32_t& p1) {
  const uint32_t h = (((nib >> shift) & 0x07070707u) + base4) | ((nib << (4 - shift)) & 0x80808080u);
  p0 = __byte_perm(low, h, 0x5140);
  p1 = __byte_perm(low, h, 0x7362);
}

template <int N>
__device__ __forceinline__ void pin(float* v) {   // keeps the compiler from moving accumulator reads across a wait
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(v[i])::"memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// A K-major operand in shared memory with the 128-byte swizzle (rows 128 bytes apart, 8-row groups 1024 apart).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t shared_addr) {
  const uint64_t addr = shared_addr;
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

// The bf16 at token row r, column c (0..63) of a 128-byte-swizzled x box.
__device__ __forceinline__ float x_at(uint32_t box, int r, int c) {
  return __uint_as_float(lds_u16(box + r * 128 + (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2) << 16);
}

// ptrs: the shared address of the escape pointers of the CTA's units, [(u - start) * 8 + w] (staged at the start).
// The weight's side of unit u (planes, escape entries, the tile's bases) into stage s, whose full barrier is told to
// expect x's two boxes too.
template <int NT>
__device__ __forceinline__ void load_weight(const Params& p, uint8_t* st, uint64_t* bar, uint32_t ptrs, int u,
                                            int start) {
  using C = Cfg<NT>;
  const int i = u - start;
  // the unit's escape entries from a 16-byte boundary, in whole 16-byte chunks (escape_table pads by 4 entries)
  const int e0 = lds_u32(ptrs + 32 * i) & ~3;
  const int staged = min(static_cast<int>(lds_u32(ptrs + 32 * i + 32)) - e0, kEscCap);
  const uint32_t esc_bytes = staged > 0 ? 4 * ((staged + 3) & ~3) : 0;
  const bool first = u == start || u % p.ks == 0;
  bar_expect(bar, C::kBytes + esc_bytes + (first ? kBN : 0));
  if (first) bulk_copy(st + C::kBaseAt, p.base + (u / p.ks) * kBN, kBN, bar);
  bulk_copy(st + C::kPlanesAt, p.planes + static_cast<size_t>(u) * kPlanes, kPlanes, bar);
  if (esc_bytes) bulk_copy(st + C::kEscAt, p.esc + e0, esc_bytes, bar);
}

template <int NT>
__device__ __forceinline__ void load_x(const Params& p, uint8_t* st, uint64_t* bar, int u) {
  const int j0 = (u % p.ks) * kBKh;
  tma_2d(st, &p.x_map, j0, 0, bar);
  tma_2d(st + Cfg<NT>::kXBox, &p.x_map, p.half + j0, 0, bar);
}

// The ring's first stages get their weight before the kernels ahead in the stream are done (x waits for them).
template <int NT>
__device__ __forceinline__ void producer(const Params& p, uint8_t* stages, uint64_t* full, uint64_t* empty,
                                         uint32_t ptrs, int start, int end) {
  using C = Cfg<NT>;
  const int ahead = min(C::kStages, end - start);
  for (int i = 0; i < ahead; ++i) load_weight<NT>(p, stages + i * C::kStage, full + i, ptrs, start + i, start);
  grid_wait();
  for (int i = 0; i < ahead; ++i) load_x<NT>(p, stages + i * C::kStage, full + i, start + i);
  for (int u = start + ahead; u < end; ++u) {
    const int i = u - start, s = i % C::kStages;
    bar_wait(empty + s, ((i / C::kStages) - 1) & 1);
    uint8_t* st = stages + s * C::kStage;
    load_weight<NT>(p, st, full + s, ptrs, u, start);
    load_x<NT>(p, st, full + s, u);
  }
}

template <int NT>
struct Consumer {
  using C = Cfg<NT>;
  const Params& p;
  uint32_t stages;   // shared-memory addresses (32-bit: ld.shared, not generic loads)
  uint64_t *full, *empty;
  uint32_t ptrs;
  uint32_t tile_ctas;   // shared: the first and last CTA of each tile from tile_first on
  int tile_first;
  int wg, warp, lane, g, t, start, end;
  uint32_t b4[2];
  int slot, prev;    // the stage of the unit in hand and of the one before it
  uint32_t phase;
  int tile, tile_end, c0, c1;   // the tile in hand, its end here, its first and last CTA

  __device__ uint32_t stage() const { return stages + slot * C::kStage; }
  __device__ int row_in_tile(int hr) const { return wg * 64 + warp * 16 + g + 8 * hr; }

  __device__ void bases() {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) b4[hr] = lds_u8(stage() + C::kBaseAt + row_in_tile(hr)) * 0x01010101u;
  }

  // The unit in hand's planes into a (the register A operand of its 8 K steps: 4 of each half), then its 8 wgmmas.
  __device__ void mma(float* acc, uint32_t (*a)[4]) const {
    const uint32_t s = stage();
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const uint32_t at = s + C::kPlanesAt + row_in_tile(hr) * kRow + 16 * t;
      const uint4 l0 = lds128(at), l1 = lds128(at + kBKh), cd = lds128(at + 2 * kBKh);
      const uint32_t lo0[4] = {l0.x, l0.y, l0.z, l0.w}, lo1[4] = {l1.x, l1.y, l1.z, l1.w};
      const uint32_t c[4] = {cd.x, cd.y, cd.z, cd.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        decode4(lo0[k], c[k], b4[hr], 0, a[k][hr], a[k][2 + hr]);
        decode4(lo1[k], c[k], b4[hr], 4, a[4 + k][hr], a[4 + k][2 + hr]);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 8; ++k) wgmma<NT>(acc, a[k], sw128_desc(s + (k >> 2) * C::kXBox + 32 * (k & 3)));
    wgmma_commit();
  }

  // esc += x[:, col] * (w - w_planes) for the escapes of unit u in this warp's 16 rows (w_planes = base << 8 as
  // bf16 bits: what the planes decode an escape to).
  __device__ void escapes(int u, float* esc) const {
    const uint32_t s = stage();
    const uint32_t up = ptrs + 4 * (u - start) * 8;
    const int e0 = lds_u32(up) & ~3;
    const int first = lds_u32(up + 4 * (wg * 4 + warp)), last = lds_u32(up + 4 * (wg * 4 + warp + 1));
    for (int e = first; e < last; ++e) {
      const uint32_t ent = e - e0 < kEscCap ? lds_u32(s + C::kEscAt + 4 * (e - e0)) : __ldg(p.esc + e);
      const int row = ent & 127, col = (ent >> 7) & 127;
      const float w = __uint_as_float(ent & 0xFFFF0000u);
      const uint32_t box = s + (col >> 6) * C::kXBox;
      // Every lane computes; only the lanes holding the row keep it (a select, not a branch: no divergent path
      // before the next wgmma).
      const bool hr1 = row == row_in_tile(1), mine = hr1 || row == row_in_tile(0);
      const float wp = __uint_as_float(((hr1 ? b4[1] : b4[0]) & 0xFFu) << 24);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const float xv = x_at(box, nt * 8 + 2 * t + cc, col & 63);
          float& v0 = esc[nt * 4 + cc];
          float& v1 = esc[nt * 4 + 2 + cc];
          const float v = fmaf(xv, -wp, fmaf(xv, w, hr1 ? v1 : v0));
          v0 = mine && !hr1 ? v : v0;
          v1 = hr1 ? v : v1;
        }
    }
  }

  // Lane-dependent conditions below are predicates in PTX, not branches: a divergent path anywhere in the consumer
  // makes ptxas serialize every wgmma (C7518).
  __device__ void store(int tile, float* acc) const {
#pragma unroll
    for (int i = 0; i < C::kAcc; ++i) {
      const int row = tile * kBN + row_in_tile((i >> 1) & 1), n = (i >> 2) * 8 + 2 * t + (i & 1);
      const unsigned short bits = __bfloat16_as_ushort(__float2bfloat16_rn(acc[i]));
      asm volatile("{\n.reg .pred q;\nsetp.lt.s32 q, %0, %1;\n@q st.global.b16 [%2], %3;\n}\n"
                   ::"r"(n), "r"(p.m), "l"(p.y + static_cast<size_t>(n) * p.ldy + row), "h"(bits) : "memory");
    }
  }

  // Tile `tile`, units from..to of it done here: store it, or leave this piece for the CTA that holds the tile's first
  // unit (for which the tile is the last of its range; it sums the pieces in CTA order), counted without waiting.
  // (A "last to arrive sums" variant, which needs every piece written and an atomic's answer at every split tile
  // end, was slower on the H200.)
  __device__ void finish(int tile, int from, int to, float* acc) const {
    if (from == tile * p.ks && to == (tile + 1) * p.ks) {
      store(tile, acc);
      return;
    }
    const int me = (warp * 32 + lane) * C::kAcc;
    float4* a4 = reinterpret_cast<float4*>(acc);
    int* counter = p.counters + tile * 2 + wg;
    if (static_cast<int>(blockIdx.x) != c0) {
      float4* slot = reinterpret_cast<float4*>(p.ws + (blockIdx.x * 2 + wg) * C::kSlot + me);
#pragma unroll
      for (int i = 0; i < C::kAcc / 4; ++i) __stcg(slot + i, a4[i]);
      group_sync(wg);   // then one release at GPU scope covers the warpgroup's stores
      asm volatile("{\n.reg .pred q;\nsetp.eq.s32 q, %0, 0;\n@q red.release.gpu.global.add.s32 [%1], 1;\n}\n"
                   ::"r"(warp | lane), "l"(counter) : "memory");
      return;
    }
    // Every lane spins (a uniform loop, no divergent path) until the c1 - c0 later CTAs have left their pieces,
    // then one lane resets the counter for the next launch.
    asm volatile(
        "{\n.reg .pred q;\n.reg .b32 v;\nSPIN:\n"
        "ld.acquire.gpu.global.b32 v, [%0];\n"
        "setp.lt.s32 q, v, %1;\n"
        "@q bra SPIN;\n}\n" ::"l"(counter), "r"(c1 - c0) : "memory");
    group_sync(wg);
    asm volatile("{\n.reg .pred q;\nsetp.eq.s32 q, %0, 0;\n@q st.global.b32 [%1], 0;\n}\n"
                 ::"r"(warp | lane), "l"(counter) : "memory");
#pragma unroll 4
    for (int c = c0 + 1; c <= c1; ++c) {
      const float4* slot = reinterpret_cast<const float4*>(p.ws + (c * 2 + wg) * C::kSlot + me);
#pragma unroll
      for (int i = 0; i < C::kAcc / 4; ++i) {
        const float4 v = __ldcg(slot + i);
        a4[i].x += v.x, a4[i].y += v.y, a4[i].z += v.z, a4[i].w += v.w;
      }
    }
    store(tile, acc);
  }

  __device__ void release(int stage_slot) const {
    __syncwarp();
    if (lane == 0) bar_arrive(empty + stage_slot);
  }

  // Unit u with A buffer a: wait for its stage, decode and issue its wgmmas, add its escapes, then free unit u - 1's
  // stage once its wgmmas are done; at the end of a tile, wait for all and finish it.
  __device__ void step(int u, int& from, float* acc, float* esc, uint32_t (*a)[4]) {
    bar_wait(full + slot, phase);
    if (u == from) {
      tile = u / p.ks;
      tile_end = min(end, (tile + 1) * p.ks);
      bases();
      c0 = __shfl_sync(0xffffffffu, lds_u32(tile_ctas + 8 * (tile - tile_first)), 0);
      c1 = __shfl_sync(0xffffffffu, lds_u32(tile_ctas + 8 * (tile - tile_first) + 4), 0);
    }
    mma(acc, a);
    escapes(u, esc);
    wgmma_wait<1>();
    if (u > from) release(prev);
    prev = slot;
    if (++slot == C::kStages) slot = 0, phase ^= 1;
    if (u + 1 == tile_end) {
      wgmma_wait<0>();
      pin<C::kAcc>(acc);
      release(prev);
#pragma unroll
      for (int i = 0; i < C::kAcc; ++i) acc[i] += esc[i], esc[i] = 0.f;
      finish(tile, from, u + 1, acc);
#pragma unroll
      for (int i = 0; i < C::kAcc; ++i) acc[i] = 0.f;
      from = u + 1;
    }
  }

  // Two A buffers, alternating: unit u's decode fills one while unit u - 1's wgmmas still read the other. The shape
  // of this loop is what lets ptxas (13.0) keep that overlap. With `if (u + 1 < end) step(a1)` it sees a path from
  // one a0 step to the next one's decode with the first one's wgmmas in flight and serializes every wgmma (C7513);
  // without the explicit waits on the two ways out (no-ops: a CTA's last unit ends a tile, and step waits there) it
  // injects a wait for all wgmmas before the exit test, on every pair's path (C7517).
  __device__ void run() {
    grid_wait();   // before anything of ours is written (y, the pieces, the counters)
    float acc[C::kAcc], esc[C::kAcc];
#pragma unroll
    for (int i = 0; i < C::kAcc; ++i) acc[i] = esc[i] = 0.f;
    uint32_t a0[8][4], a1[8][4];
    int from = start;
    for (int u = start; u < end; u += 2) {
      step(u, from, acc, esc, a0);
      if (u + 1 == end) {
        wgmma_wait<0>();
        break;
      }
      step(u + 1, from, acc, esc, a1);
    }
    wgmma_wait<0>();
  }
};

template <int NT>
__global__ void __launch_bounds__(kThreads, 1) w12_ws_kernel(const __grid_constant__ Params p) {
  using C = Cfg<NT>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[C::kStages], empty[C::kStages];
  uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  int* ptrs = reinterpret_cast<int*>(stages + C::kStages * C::kStage);
  int* tile_ctas = reinterpret_cast<int*>(stages + C::kStages * C::kStage + C::kPtrBytes);
  const int start = __shfl_sync(0xffffffffu, __ldg(p.ranges + blockIdx.x), 0);
  const int end = __shfl_sync(0xffffffffu, __ldg(p.ranges + blockIdx.x + 1), 0);
  const int tile_first = start / p.ks, tiles = (end - 1) / p.ks - tile_first + 1;
  const int tid = threadIdx.x;
  const int warp_idx = __shfl_sync(0xffffffffu, tid >> 5, 0);   // warp-uniform to the compiler, like the roles below
  for (int i = tid; i <= (end - start) * 8; i += kThreads)
    sts_u32(smem_addr(ptrs + i), __ldg(p.esc_ptr + start * 8 + i));
  for (int i = tid; i < 2 * tiles; i += kThreads)
    sts_u32(smem_addr(tile_ctas + i), __ldg(p.ranges + p.grid + 1 + 2 * tile_first + i));
  if (tid == 0) {
    for (int s = 0; s < C::kStages; ++s) bar_init(full + s, 1), bar_init(empty + s, 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::);
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.x_map)));
  }
  __syncthreads();
  if (tid == 0) grid_launch_dependents();
  if (warp_idx < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) producer<NT>(p, stages, full, empty, smem_addr(ptrs), start, end);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int lane = tid & 31;
  Consumer<NT> c{p, smem_addr(stages), full, empty, smem_addr(ptrs), smem_addr(tile_ctas), tile_first,
                 (warp_idx - 4) >> 2, warp_idx & 3, lane, lane >> 2, lane & 3, start, end, {0u, 0u}, 0, 0, 0u, 0, 0,
                 0, 0};
  c.run();
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

// x's map: `cols` columns wide, so that TMA fills the columns a padded weight has beyond them with zeros (and the
// rows from m up to the box's with zeros too).
bool map_2d(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, uint64_t rows, uint64_t cols,
            uint64_t stride, uint32_t box_rows, uint32_t box_cols, CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {stride};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t estr[2] = {1, 1};
  return encode_fn()(map, type, 2, const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int NT>
int launch(const Args& a, cudaStream_t stream) {
  using C = Cfg<NT>;
  static bool sized[kMaxDevices] = {};   // the shared-memory attribute is set per device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices) return 1003;
  if (!sized[device]) {
    err = cudaFuncSetAttribute(w12_ws_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
    if (err != cudaSuccess) return err;
    sized[device] = true;
  }
  Params p;
  if (!encode_fn()) return 1001;
  if (!map_2d(&p.x_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a.x, a.m, a.cols, 2 * static_cast<uint64_t>(a.ldx), C::kMp,
              64, CU_TENSOR_MAP_SWIZZLE_128B))
    return 1002;
  p.planes = a.planes;
  p.base = a.base;
  p.esc_ptr = a.esc_ptr;
  p.esc = a.esc;
  p.y = a.y;
  p.ws = a.ws;
  p.counters = a.counters;
  p.ranges = a.ranges;
  p.n = a.n, p.half = a.half, p.m = a.m, p.ldy = a.ldy, p.grid = a.grid, p.ks = a.half / kBKh;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(a.grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = C::kSmem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = a.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, w12_ws_kernel<NT>, p);
}

}  // namespace

extern "C" {

int w12_ws_params_size() { return sizeof(Args); }
int w12_ws_slot_floats() { return 2 * Cfg<8>::kSlot; }
int w12_ws_max_units() { return kMaxUnits; }
int w12_ws_stages(int m) {
  return m <= 8 ? Cfg<1>::kStages : m <= 16 ? Cfg<2>::kStages : m <= 32 ? Cfg<4>::kStages : Cfg<8>::kStages;
}

int w12_ws_gemm(const Args* a, void* stream) {
  const int64_t units = static_cast<int64_t>(a->n / kBN) * (a->half / kBKh);
  const uintptr_t aligned = reinterpret_cast<uintptr_t>(a->planes) | reinterpret_cast<uintptr_t>(a->base) |
                            reinterpret_cast<uintptr_t>(a->esc) | reinterpret_cast<uintptr_t>(a->x);
  const uintptr_t words = reinterpret_cast<uintptr_t>(a->ranges) | reinterpret_cast<uintptr_t>(a->counters);
  if (a->m < 1 || a->m > 64 || a->half < kBKh || a->half % kBKh != 0 || a->n < kBN || a->n % kBN != 0 ||
      a->cols < 1 || a->cols > 2 * a->half || a->ldx < a->cols || a->ldx % 8 != 0 || aligned % 16 != 0 ||
      a->grid < 1 || a->grid > units || (units + a->grid - 1) / a->grid > kMaxUnits || (a->pdl & ~1) ||
      !a->ranges || !a->counters || words % 4 != 0)
    return 1000;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a->m <= 8) return launch<1>(*a, s);
  if (a->m <= 16) return launch<2>(*a, s);
  if (a->m <= 32) return launch<4>(*a, s);
  return launch<8>(*a, s);
}

const char* w12_ws_error(int code) {
  return code == 1000   ? "arguments not taken (M in 1..64, half a multiple of 64, N of 128, cols <= 2 * half, x "
                          "rows 16-byte aligned and at least cols wide, planes/base/esc/x 16-byte aligned, grid <= "
                          "units, units per CTA <= 128, pdl 0 or 1, ranges and counters given)"
         : code == 1001 ? "cuTensorMapEncodeTiled not found"
         : code == 1002 ? "a tensor map was refused"
         : code == 1003 ? "device index beyond the kernel's table of 64"
                        : cudaGetErrorString(static_cast<cudaError_t>(code));
}
}
