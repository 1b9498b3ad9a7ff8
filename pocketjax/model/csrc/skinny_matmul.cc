// y[rows, out] = x[rows, in] @ w[out, in]^T for a float32 or bfloat16 weight in HF's [out, in] layout, any row
// count, as an XLA FFI handler for the CPU (pocketjax/model/cpu_kernels.py compiles it at first use and registers
// it). pocketjax's CPU product for every float weight on one device.
//
// Why, twice. (1) Batch invariance (issue 43): XLA:CPU picks a different algorithm, and so a different summation
// order, for 1 row than for 2 and for a prefill chunk than for a decode batch, so a request's bits depended on who
// shared its step. Here every output element is the same sequence of operations whatever the row count, the row's
// place in a block or the thread that runs it: lanes of FMAs along `in` in order, a fixed horizontal tree, the tail.
// (2) Speed: XLA:CPU's bf16 dot reads a bf16 weight at a fraction of the memory's bandwidth at 1-8 rows. Each
// weight row is read ONCE for up to 8 x rows (register-blocked); more rows run in blocks of 8 against a chunk of
// weight rows kept in cache. bf16 -> f32 by a 16-bit shift (exact), f32 FMAs into f32 accumulators. x is float32
// or bfloat16 (converted to f32 once, exactly); y is x's dtype (bf16 rounded to nearest even, as XLA's convert).
// Output features are split over XLA's intra-op thread pool.
//
// Quantized weights (`PocketjaxQuantizedMatmul`), quant.py's forms: int8 values [out, in] or int4 values uint8
// [out, in/2] (in each group of `gs` columns byte j holds column j in its low nibble and column j + gs/2 in its high
// one), scale float32 and zero int8 [out, in/gs]. int8: each weight is dequantized in registers as (q - zero) *
// scale, two roundings as XLA computes quant.dequantize, and multiplied exactly as the float32 path multiplies that
// dequantized weight (the same lanes, order and horizontal sum): the result is bitwise the float32 kernel's on
// `dequantize(w)`, reading 8 bits per weight instead of 32. Up to kMaxRows rows run in one register block (each
// weight dequantized once for all of them); over kMaxRows (prefill) each chunk is dequantized once into a per-thread
// float32 buffer kept in L2 and the float32 code runs on it. int4: an integer product (`Int4Rows`): each x row
// rounded once to 16-bit integers (one scale per row), the nibbles multiplied in int16 pairs with exact int32 sums,
// the group's scale applied per 32 columns; 5.25 bits per weight read (groups of 32). int4 values may be tiled
// (quant.tile_rows, attribute `tiled`): each block of kTileRows weight rows stored as [in / 32][kTileRows][16 bytes],
// so a block's 32-column chunks are one 64-byte line, read as one sequential stream (row-major, a block is kTileRows
// streams of a few hundred bytes; tiled, the 0.6B's 196 layer products ran 1.16 / 1.13 / 1.17x faster at 1 / 2 / 4
// rows, its decode step 1.05 / 1.04 / 1.10 / 1.00x at 1 / 2 / 4 / 8 requests: benchmarks/bench_tiles.py); the sums
// are the same, so the bits are. Row streams (attribute `streams`, cpu_kernels.py's default; the vector paths): a
// register block's NB weight rows are the same row of NB runs of the chunk, NB long sequential streams, instead of NB
// adjacent rows (`Blocks`): the 0.6B's step of products 1.15-1.27x (float32), 1.13-1.33x (bf16) faster at 1-8 rows,
// int8 1.23x at 1 row on a Zen 3 (benchmarks/bench_streams.py); the same bits. int8 runs on the float32 code's ISA
// (AVX-512 where the CPU has it: on a Zen 5, 1.45 / 1.60 / 1.77x the AVX2 path's products at 2 / 4 / 8 rows), and so
// does the float32 code on its dequantized chunks, so a row's bits never depend on how many rows share the call;
// int4's AVX-512 path (two x rows per register), AVX2 path and portable loop give the same bits.
//
// ISA, chosen at run time (__builtin_cpu_supports): for a bf16 x AVX512_BF16's vdpbf16ps (32 products per
// instruction: at 2-8 rows an FMA path is compute bound on a slow core), else AVX-512 (F+BW+VL) or AVX2+FMA, else
// a portable loop the compiler vectorizes for the base ISA (e.g. aarch64 NEON). The `isa` attribute forces one
// (tests, benchmarks): 0 auto, 1 portable, 2 AVX2, 3 AVX-512, 4 AVX512_BF16; one the CPU lacks falls back to the
// next below it (AVX512_BF16 -> AVX-512 -> portable, AVX2 -> portable).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

// POCKETJAX_PORTABLE_ONLY: the build a non-x86 host gets, on x86 (tests/test_cpu_kernels.py compiles it).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(POCKETJAX_PORTABLE_ONLY)
#define PJ_X86 1
#include <immintrin.h>
#else
#define PJ_X86 0
#endif

namespace ffi = xla::ffi;

#ifndef POCKETJAX_BUILD_KEY
#define POCKETJAX_BUILD_KEY "unknown"
#endif
// The hash of the sources and flags this library was built from: cpu_kernels.py finds it in the file's bytes before
// loading a cached library, so a stale or foreign file under the expected name is rebuilt, never loaded.
extern "C" const char pocketjax_build_key[] = "pocketjax-build-key:" POCKETJAX_BUILD_KEY;

namespace {

constexpr int kMaxRows = 8;
constexpr int kBlockRows = 4;  // rows per register block (the row loop's step)
constexpr int kTileRows = 4;   // int4 weight rows per tile (quant.TILE_ROWS)

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// One job: output features [n0, n1) of y for x rows [0, R), each an f32 sum written in y's dtype.
struct Job {
  const float* x;     // [R, K] f32 (the FMA paths)
  const uint16_t* xb;  // [R, K] bf16 bits when x is bf16 (the dot-product path reads it as is), else null
  const void* w;      // [N, K] bf16 bits or float32 (WT of the code path)
  void* y;            // [R, N] f32 or bf16 (y_bf16)
  bool y_bf16;
  int64_t R, K, N;
  // Quantized weights instead of w: values [N, K * bits / 8], scale f32 [N, G], zero s8 [N, G], groups of gs columns
  // (int4: a multiple of 32, in two runs of gs / 2, the low then the high nibbles; int8: a multiple of 8).
  const uint8_t* qv = nullptr;
  const float* scale = nullptr;
  const int8_t* zero = nullptr;
  int64_t gs = 0;
  int bits = 0;
  // int4 only: x as 16-bit integers [R, K] in the nibble order, each row's scale [R] and its integers' sum per group
  // [R, G] (`Int4Rows`).
  const int16_t* xq = nullptr;
  const float* xs = nullptr;
  const float* xsum = nullptr;
  bool has_zero = false;
  bool tiled = false;  // int4 values in tiles of kTileRows rows (see the top)
  bool streams = false;  // a register block's rows as NB sequential streams (`Blocks`; the AVX2 paths)

  // int4: the 16 bytes of weight row n's 32-column chunk c (the chunk at offset 16 * (c % (gs / 32)) of group
  // c / (gs / 32)'s half-size run).
  inline const uint8_t* Int4Chunk(int64_t n, int64_t c) const {
    const int64_t KB = K / 2;
    if (tiled) return qv + (n - n % kTileRows) * KB + c * 16 * kTileRows + (n % kTileRows) * 16;
    return qv + n * KB + 16 * c;
  }

  // int4: sum over groups of scale * zero * xsum for x row r, weight row n: the zeros' share of the product, taken
  // out once per output instead of from every weight (8 lanes over groups in order, Tree8, the rest in order).
  inline float ZeroShare(int64_t r, int64_t n) const;

  // int8 weight row n's columns [k, k + 8) of group g at offset o, dequantized (portable form): out[l].
  inline void Dequant8(int64_t n, int64_t g, int64_t o, float* out) const {
    const int8_t* v = reinterpret_cast<const int8_t*>(qv) + n * K + g * gs + o;
    const float s = scale[n * (K / gs) + g], z = static_cast<float>(zero[n * (K / gs) + g]);
    for (int l = 0; l < 8; ++l) out[l] = (static_cast<float>(v[l]) - z) * s;
  }

  inline void Store(int64_t r, int64_t n, float v) const {
    if (y_bf16)
      static_cast<uint16_t*>(y)[r * N + n] = F32ToBf16(v);
    else
      static_cast<float*>(y)[r * N + n] = v;
  }
};

// ---- portable: lanes of partial sums, so the compiler vectorizes without reassociating a scalar sum ------------
inline float ToF32(uint16_t b) { return Bf16ToF32(b); }
inline float ToF32(float f) { return f; }

template <typename WT, int R>
void RowsPortable(const Job& j, int64_t n0, int64_t n1) {
  constexpr int L = 8;
  const int64_t K = j.K, kv = K / L * L;
  for (int64_t n = n0; n < n1; ++n) {
    const WT* wr = static_cast<const WT*>(j.w) + n * K;
    float acc[R][L] = {};
    for (int64_t k = 0; k < kv; k += L) {
      float wf[L];
      for (int l = 0; l < L; ++l) wf[l] = ToF32(wr[k + l]);
      for (int r = 0; r < R; ++r)
        for (int l = 0; l < L; ++l) acc[r][l] += wf[l] * j.x[r * K + k + l];
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int l = 0; l < L; ++l) s += acc[r][l];
      for (int64_t k = kv; k < K; ++k) s += ToF32(wr[k]) * j.x[r * K + k];
      j.Store(r, n, s);
    }
  }
}

// Quantized weights, portable: RowsPortable<float>'s lanes and order over the weight dequantized 8 columns at a time.
template <int R>
void RowsQuantPortable(const Job& j, int64_t n0, int64_t n1) {
  const int64_t K = j.K, gs = j.gs;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R][8] = {};
    for (int64_t g = 0; g < K / gs; ++g)
      for (int64_t o = 0; o < gs; o += 8) {
        float wf[8];
        j.Dequant8(n, g, o, wf);
        const float* xk = j.x + g * gs + o;
        for (int r = 0; r < R; ++r)
          for (int l = 0; l < 8; ++l) acc[r][l] += wf[l] * xk[r * K + l];
      }
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int l = 0; l < 8; ++l) s += acc[r][l];
      j.Store(r, n, s);
    }
  }
}

inline float Tree8(const float* f) {  // HsumAvx2's order
  const float a0 = f[0] + f[4], a1 = f[1] + f[5], a2 = f[2] + f[6], a3 = f[3] + f[7];
  return (a0 + a2) + (a1 + a3);
}

inline float Job::ZeroShare(int64_t r, int64_t n) const {
  if (!has_zero) return 0.f;
  const int64_t G = K / gs;
  const float* s = scale + n * G;
  const int8_t* z = zero + n * G;
  const float* xr = xsum + r * G;
  float lanes[8] = {};
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = std::fma(s[g + l] * static_cast<float>(z[g + l]), xr[g + l], lanes[l]);
  float c = Tree8(lanes);
  for (; g < G; ++g) c = std::fma(s[g] * static_cast<float>(z[g]), xr[g], c);
  return c;
}

// ---- int4: an integer product against 16-bit activations --------------------------------------------------------
// Dequantizing 8 nibbles costs ~6 vector ops before the FMA, so the exact path above was compute bound at 1-2 rows
// (0.6x llama.cpp's Q4_0). Here each x row is rounded once per call to 16-bit integers, xi = rint(x * 32767 / amax)
// (amax = max |x| of the row; a real Qwen row's outlier channels cost nothing measurable: quant.py's two-digit
// measurement), and each 32 weight columns cost one unpack shared by every row and per row two vpmaddwd (int16
// pairs summed exactly in int32), a conversion and one FMA with the group's scale; the zeros come out once per
// output (`ZeroShare`, G products instead of K subtractions):
//   y = sx * (sum over 32-column chunks of scale[g] * float(sum q * xi) - sum over groups of scale[g] * zero[g] *
//   sum xi),  sx = amax / 32767.
// Every integer sum is exact, the float steps are one fixed sequence per output element (8 lanes of FMAs in chunk
// order, HsumAvx2's tree, one product by sx), so a row's bits depend on nothing but the row and the weight, at any
// row count, and the portable path computes the same bits (std::fma, the same tree).
// Lanes of one chunk (16 bytes at offset o of group g's half-size run, h = gs / 2; byte i holds column o + i in its
// low nibble, h + o + i in its high one): lane l sums columns o + 2l, o + 2l + 1, h + o + 2l and h + o + 2l + 1 (of
// the group), what the bytes zero-extended to int16 (low nibbles: a mask; high: a shift) give two vpmaddwd against
// x's chunk stored as its 16 columns of the first half, then its 16 of the second (`Int4Rows`).

constexpr float kInt16Max = 32767.f;

// x rows [R, K] f32 -> xq [R, K] int16 in the kernel's order, xs [R] and xsum [R, K / gs]: per 32-column chunk, its
// 16 columns of the group's first half, then its 16 of the second (the nibbles' order in the chunk's bytes). A row
// holding a NaN or an infinity gets scale NaN (its outputs are NaN) and zeros.
void Int4Rows(const float* x, int64_t R, int64_t K, int64_t gs, int16_t* xq, float* xs, float* xsum) {
  const int64_t h = gs / 2;
  for (int64_t r = 0; r < R; ++r, x += K, xq += K, xsum += K / gs) {
    float amax = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      const float a = std::fabs(x[k]);
      finite &= a <= std::numeric_limits<float>::max();
      amax = a > amax ? a : amax;
    }
    xs[r] = finite ? amax / kInt16Max : std::numeric_limits<float>::quiet_NaN();
    if (!finite) {
      std::fill(xq, xq + K, int16_t{0});
      std::fill(xsum, xsum + K / gs, 0.f);
      continue;
    }
    const float inv = amax > 0.f ? kInt16Max / amax : 0.f;
    for (int64_t g = 0; g < K / gs; ++g) {
      int64_t sum = 0;
      for (int64_t o = 0; o < h; o += 16) {
        int16_t* out = xq + g * gs + 2 * o;
        for (int half = 0; half < 2; ++half)
          for (int i = 0; i < 16; ++i) {
            float v = std::nearbyint(x[g * gs + half * h + o + i] * inv);
            v = v > kInt16Max ? kInt16Max : (v < -kInt16Max ? -kInt16Max : v);
            out[half * 16 + i] = static_cast<int16_t>(v);
            sum += static_cast<int64_t>(v);
          }
      }
      xsum[g] = static_cast<float>(sum);
    }
  }
}

// Int4Rows' xq [R, K] in row pairs for the AVX-512 int4 path: per pair and 32-column chunk, [row a's 16 first-half
// integers | row b's | a's 16 second-half | b's]; an odd row count pairs the last row with a row of zeros.
void Int4PairRows(const int16_t* xq, int64_t R, int64_t K, int16_t* out) {
  constexpr size_t kHalf = 16 * sizeof(int16_t);
  for (int64_t a = 0; a < R; a += 2, out += 2 * K) {
    const int16_t* ra = xq + a * K;
    const int16_t* rb = a + 1 < R ? ra + K : nullptr;
    for (int64_t c = 0; c < K / 32; ++c) {
      int16_t* o = out + 64 * c;
      std::memcpy(o, ra + 32 * c, kHalf);
      std::memcpy(o + 32, ra + 32 * c + 16, kHalf);
      if (rb) {
        std::memcpy(o + 16, rb + 32 * c, kHalf);
        std::memcpy(o + 48, rb + 32 * c + 16, kHalf);
      } else {
        std::memset(o + 16, 0, kHalf);
        std::memset(o + 48, 0, kHalf);
      }
    }
  }
}

template <int R>
void RowsInt4Portable(const Job& j, int64_t n0, int64_t n1) {
  const int64_t K = j.K, gs = j.gs, h = gs / 2, G = K / gs;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R][8] = {};
    for (int64_t g = 0; g < G; ++g) {
      const float s = j.scale[n * G + g];
      for (int64_t o = 0; o < h; o += 16) {
        const uint8_t* v = j.Int4Chunk(n, (g * h + o) / 16);
        int q[32];  // the kernel's order: the 16 low nibbles, then the 16 high ones
        for (int i = 0; i < 16; ++i) q[i] = v[i] & 15, q[16 + i] = v[i] >> 4;
        for (int r = 0; r < R; ++r) {
          const int16_t* xi = j.xq + r * K + g * gs + 2 * o;
          for (int l = 0; l < 8; ++l) {
            const int e = q[2 * l] * xi[2 * l] + q[2 * l + 1] * xi[2 * l + 1] + q[16 + 2 * l] * xi[16 + 2 * l] +
                          q[17 + 2 * l] * xi[17 + 2 * l];
            acc[r][l] = std::fma(static_cast<float>(e), s, acc[r][l]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) j.Store(r, n, (Tree8(acc[r]) - j.ZeroShare(r, n)) * j.xs[r]);
  }
}

// Weight rows [n0, n1) dequantized into out [n1 - n0, K] (a chunk's buffer), 8 columns at a time as above.
void DequantRowsPortable(const Job& j, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n, out += j.K)
    for (int64_t g = 0; g < j.K / j.gs; ++g)
      for (int64_t o = 0; o < j.gs; o += 8) j.Dequant8(n, g, o, out + g * j.gs + o);
}

// Which weight rows share a register block of NB rows. Adjacent rows (n, n + 1, ...) are NB streams one row long
// (in = 1024: 4 KiB float32, 2 KiB bf16, 1 KiB int8) that the hardware prefetcher starts over at every block, so
// 1-4-row products read below the memory's bandwidth. With `streams` a chunk's rows are cut into NB runs and a block
// takes the same row of each run, `apart` rows apart: NB sequential streams through the chunk (Zen 3: 1.1-1.5x the
// 1-4-row products at in = 1024, benchmarks/README.md "Row streams"). Which rows share a block changes no sum: each
// output is the same sequence of operations in every block.
struct Blocks {
  int64_t count, step, apart, tail;  // full blocks at n0 + i * step (i < count), rows apart; then [tail, n1) singly
};

template <int NB>
inline Blocks BlocksOf(const Job& j, int64_t n0, int64_t n1) {
  const int64_t count = (n1 - n0) / NB;
  if (j.streams && NB > 1) return {count, 1, count, n0 + NB * count};
  return {count, NB, 1, n0 + NB * count};
}

#if PJ_X86
// The vector paths: NB weight rows at a time (adjacent, or NB streams apart: `Blocks`), each loaded once per k step
// and multiplied with every x row; NB * R accumulators stay in registers (all loops below unroll: R, NB are constants,
// and only local pointers are read inside the k loop, so nothing aliases the accumulators).

// ---- AVX2 + FMA: 8 lanes, scalar tail ------------------------------------------------------------------------
#define PJ_AVX2 __attribute__((target("avx2,fma")))
PJ_AVX2 inline __m256 LoadAvx2(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PJ_AVX2 inline __m256 LoadAvx2(const float* p) { return _mm256_loadu_ps(p); }

PJ_AVX2 inline float HsumAvx2(__m256 v) {  // the fixed horizontal tree
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  return _mm_cvtss_f32(s4);
}

// Narrow weights are read with a software prefetch one block ahead (`PrefetchNext`): a block's NB weight rows are
// NB streams of a few KiB or less (in = 1024: 2 KiB bf16, 1 KiB int8, 512 B int4), too short for the hardware's
// stream prefetcher, which starts over at every row. A line of each of the next block's rows per 64 bytes read made
// 1-row products 1.12x (bf16) to 1.4x (int8, int4) faster on a Zen 3 (benchmarks/README.md, "Software prefetch").
// float32 rows (4 KiB) gained nothing at 1 row and lost at 64 rows; the quantized kernels turn compute bound with
// more rows, where the extra loads cost (int8 over kBlockRows rows 0.93x; int4 over 2 rows: 1.08x in products,
// 0.94x in the 4-request engine step): those read as before. A prefetch changes no sum: the bits are the same.
// The next block's rows: the NB rows after this block's (adjacent) or the next row of each stream (apart > 1).
template <int NB>
inline void PrefetchNext(const void* block, int64_t row_bytes, int64_t apart, int64_t at) {
  const char* next = static_cast<const char*>(block) + (apart > 1 ? 1 : NB) * row_bytes + at;  // past the end: ignored
  for (int b = 0; b < NB; ++b) _mm_prefetch(next + b * apart * row_bytes, _MM_HINT_T0);
}

template <typename WT, int R, int NB>
PJ_AVX2 void BlockAvx2(const Job& j, int64_t n, int64_t apart) {
  const int64_t K = j.K, kv = K / 8 * 8, rs = apart * K;
  const WT* __restrict w = static_cast<const WT*>(j.w) + n * K;
  const float* __restrict x = j.x;
  __m256 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kv; k += 8) {
    if (sizeof(WT) == 2 && (k & 31) == 0) PrefetchNext<NB>(w, 2 * K, apart, 2 * k);
    __m256 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = LoadAvx2(w + b * rs + k);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm256_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  float sums[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) {
      float s = HsumAvx2(acc[b][r]);
      for (int64_t k = kv; k < K; ++k) s += ToF32(w[b * rs + k]) * x[r * K + k];
      sums[b][r] = s;
    }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b * apart, sums[b][r]);
}

template <typename WT, int R>
PJ_AVX2 void RowsAvx2(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = R <= 2 ? 4 : (R <= 4 ? 3 : 1);  // NB * R accumulators + NB weights + 1 x within 16 ymm
  const Blocks b = BlocksOf<NB>(j, n0, n1);
  for (int64_t i = 0, n = n0; i < b.count; ++i, n += b.step) BlockAvx2<WT, R, NB>(j, n, b.apart);
  for (int64_t n = b.tail; n < n1; ++n) BlockAvx2<WT, R, 1>(j, n, 1);
}

// 8 dequantized int8 weights at v, (q - zero) * scale, two roundings.
// Zero false: a symmetric weight (every zero 0), whose (q - 0) is q: the same bits without the subtraction.
template <bool Zero>
PJ_AVX2 inline __m256 DequantAvx2(const uint8_t* v, __m256 zv, __m256 sv) {
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
  return _mm256_mul_ps(Zero ? _mm256_sub_ps(f, zv) : f, sv);
}

// int8 weights: BlockAvx2<float>'s lanes, order and tree over the weight dequantized in registers, 8 per load.
template <bool Zero, int R, int NB>
PJ_AVX2 void BlockQuantAvx2(const Job& j, int64_t n, int64_t apart) {
  const int64_t K = j.K, gs = j.gs, G = K / gs, rs = apart * K;
  const uint8_t* __restrict v = j.qv + n * K;
  const float* __restrict x = j.x;
  __m256 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 sv[NB], zv[NB];
    for (int b = 0; b < NB; ++b) {
      sv[b] = _mm256_set1_ps(j.scale[(n + b * apart) * G + g]);
      zv[b] = _mm256_set1_ps(static_cast<float>(j.zero[(n + b * apart) * G + g]));
    }
    for (int64_t o = 0; o < gs; o += 8) {
      if (R <= kBlockRows && ((g * gs + o) & 63) == 0) PrefetchNext<NB>(v, K, apart, g * gs + o);
      __m256 wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = DequantAvx2<Zero>(v + b * rs + g * gs + o, zv[b], sv[b]);
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(x + r * K + g * gs + o);
        for (int b = 0; b < NB; ++b) acc[b][r] = _mm256_fmadd_ps(wv[b], xv, acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b * apart, HsumAvx2(acc[b][r]));
}

template <bool Zero>
PJ_AVX2 void DequantRowsAvx2(const Job& j, int64_t n0, int64_t n1, float* out) {
  const int64_t K = j.K, gs = j.gs, G = K / gs;
  for (int64_t n = n0; n < n1; ++n, out += K)
    for (int64_t g = 0; g < G; ++g) {
      const __m256 sv = _mm256_set1_ps(j.scale[n * G + g]);
      const __m256 zv = _mm256_set1_ps(static_cast<float>(j.zero[n * G + g]));
      for (int64_t o = 0; o < gs; o += 8)
        _mm256_storeu_ps(out + g * gs + o, DequantAvx2<Zero>(j.qv + n * K + g * gs + o, zv, sv));
    }
}

// NB weight rows per block: 4 at 1-2 x rows, else 2 (NB * R accumulators + NB weights, scales, zeros + 1 x; at 5-6
// rows a few spill, and still 1.2-1.3x one weight row per block). 7-8 rows would spill more (NB 2: 0.88x): the block
// runs rows 0-3, then the rest against its weight rows again, now in L1 (1.04-1.06x one row per block;
// benchmarks/kernel_ab.py, benchmarks/README.md "int8 at 5-8 rows"). Each output's operations are the same.
template <bool Zero, int R>
PJ_AVX2 void RowsQuantAvx2(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = R <= 2 ? 4 : 2;
  constexpr int R1 = R <= 6 ? R : 4, R2 = R > R1 ? R - R1 : 1;
  Job rest = j;  // x rows R1.. and their outputs
  rest.x = j.x + R1 * j.K;
  rest.y = static_cast<char*>(j.y) + R1 * j.N * (j.y_bf16 ? 2 : 4);
  rest.R = R2;
  const Blocks b = BlocksOf<NB>(j, n0, n1);
  for (int64_t i = 0, n = n0; i < b.count; ++i, n += b.step) {
    BlockQuantAvx2<Zero, R1, NB>(j, n, b.apart);
    if (R > R1) BlockQuantAvx2<Zero, R2, NB>(rest, n, b.apart);
  }
  for (int64_t n = b.tail; n < n1; ++n) {
    BlockQuantAvx2<Zero, R1, 1>(j, n, 1);
    if (R > R1) BlockQuantAvx2<Zero, R2, 1>(rest, n, 1);
  }
}

PJ_AVX2 inline float FmaAvx2(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

// Job::ZeroShare's lanes and order, vectorized, for a block's NB weight rows (n, `apart` rows apart) and x row r at
// once: NB independent FMA chains where one output at a time waited on its own (~15% of a 1-row product), x's sums
// loaded once for the NB rows. Each output is the same sequence of operations as alone: the same bits.
template <int NB>
PJ_AVX2 inline void ZeroSharesAvx2(const Job& j, int64_t r, int64_t n, int64_t apart, float* out) {
  if (!j.has_zero) {
    for (int b = 0; b < NB; ++b) out[b] = 0.f;
    return;
  }
  const int64_t G = j.K / j.gs;
  const float* s = j.scale + n * G;
  const int8_t* z = j.zero + n * G;
  const float* xr = j.xsum + r * G;
  const int64_t step = apart * G;
  __m256 lanes[NB];
  for (int b = 0; b < NB; ++b) lanes[b] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m256 xv = _mm256_loadu_ps(xr + g);
    for (int b = 0; b < NB; ++b) {
      const __m128i zb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + b * step + g));
      const __m256 zf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(zb));
      lanes[b] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + b * step + g), zf), xv, lanes[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    float c = HsumAvx2(lanes[b]);
    for (int64_t t = g; t < G; ++t) c = FmaAvx2(s[b * step + t] * static_cast<float>(z[b * step + t]), xr[t], c);
    out[b] = c;
  }
}

// int4 against 16-bit x (see Int4Rows): 16 bytes zero-extended to int16, a mask (low nibbles) and a shift (high
// ones; 1.1x a 1-row product over a broadcast, two variable shifts and two masks: benchmarks/README.md "The int4
// kernel's loop"); per x row two vpmaddwd, an add, a conversion and an FMA per 32 columns. Tiled (Tiled true): the
// NB rows at n lie in one tile, whose chunk c is the line at 64 * c, row b's 16 bytes at 16 * b within it.
template <int R, int NB, bool Tiled>
PJ_AVX2 void BlockInt4Avx2(const Job& j, int64_t n, int64_t apart) {  // (tiled: apart 1)
  const int64_t K = j.K, gs = j.gs, h = gs / 2, G = K / gs, KB = K / 2;
  const uint8_t* __restrict v = j.Int4Chunk(n, 0);
  const int64_t row_step = Tiled ? 16 : KB * apart, chunk_step = Tiled ? 16 * kTileRows : 16;
  const int16_t* __restrict x = j.xq;
  const __m256i mask = _mm256_set1_epi16(15);
  __m256 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  // One loop over the K / 32 chunks, the group counted alongside (at gs = 32 a loop per group ran its inner chunk
  // loop once: the loop's overhead and a reload of the scale pointer per group were ~20% of a 1-row product).
  const float* __restrict s = j.scale + n * G;
  const int64_t s_step = apart * G, per_group = h / 16;
  for (int64_t c = 0, g = 0, left = per_group; c < K / 32; ++c) {
    if (R <= 2 && Tiled)  // the next tile's line for this chunk (a tile is one stream)
      _mm_prefetch(reinterpret_cast<const char*>(v) + kTileRows * KB + c * chunk_step, _MM_HINT_T0);
    else if (R <= 2 && (c & 3) == 0)
      PrefetchNext<NB>(v, KB, apart, 16 * c);
    for (int b = 0; b < NB; ++b) {
      const __m256 sv = _mm256_set1_ps(s[b * s_step + g]);
      const __m256i w = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + b * row_step + c * chunk_step)));
      const __m256i qa = _mm256_and_si256(w, mask), qb = _mm256_srli_epi16(w, 4);
      for (int r = 0; r < R; ++r) {
        const int16_t* xr = x + r * K + 32 * c;
        const __m256i e = _mm256_add_epi32(
            _mm256_madd_epi16(qa, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))),
            _mm256_madd_epi16(qb, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16))));
        acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), sv, acc[b][r]);
      }
    }
    if (--left == 0) ++g, left = per_group;
  }
  for (int r = 0; r < R; ++r) {
    float zs[NB];
    ZeroSharesAvx2<NB>(j, r, n, apart, zs);
    for (int b = 0; b < NB; ++b) j.Store(r, n + b * apart, (HsumAvx2(acc[b][r]) - zs[b]) * j.xs[r]);
  }
}

// 8 columns of x at p times inv, rounded to int32 within +-32767.
PJ_AVX2 inline __m256i RoundedAvx2(const float* p, __m256 inv) {
  const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(p), inv), _mm256_set1_ps(-kInt16Max)),
                                 _mm256_set1_ps(kInt16Max));
  return _mm256_cvtps_epi32(v);
}

// 16 columns as int32 (a: the first 8, b: the next) -> int16 in order (packs works within 128-bit halves).
PJ_AVX2 inline __m256i PackedAvx2(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

// Int4Rows vectorized, the same bits: cvtps rounds to nearest even as nearbyint does (the default rounding mode).
PJ_AVX2 void Int4RowsAvx2(const float* x, int64_t R, int64_t K, int64_t gs, int16_t* xq, float* xs, float* xsum) {
  const int64_t h = gs / 2, G = K / gs;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  for (int64_t r = 0; r < R; ++r, x += K, xq += K, xsum += G) {
    __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude);
      amax = _mm256_max_ps(amax, a);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));  // > the largest float, or NaN
    }
    if (_mm256_movemask_ps(bad)) {
      xs[r] = std::numeric_limits<float>::quiet_NaN();
      std::fill(xq, xq + K, int16_t{0});
      std::fill(xsum, xsum + G, 0.f);
      continue;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float largest_abs = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    xs[r] = largest_abs / kInt16Max;
    const __m256 inv = _mm256_set1_ps(largest_abs > 0.f ? kInt16Max / largest_abs : 0.f);
    for (int64_t g = 0; g < G; ++g) {
      __m256i sum = _mm256_setzero_si256();
      for (int64_t o = 0; o < h; o += 16) {
        const float* p = x + g * gs + o;
        const __m256i a = RoundedAvx2(p, inv), b = RoundedAvx2(p + 8, inv), c = RoundedAvx2(p + h, inv),
                      d = RoundedAvx2(p + h + 8, inv);
        __m256i* out = reinterpret_cast<__m256i*>(xq + g * gs + 2 * o);
        _mm256_storeu_si256(out, PackedAvx2(a, b));
        _mm256_storeu_si256(out + 1, PackedAvx2(c, d));
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d)));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      xsum[g] = static_cast<float>(_mm_cvtsi128_si32(s4));
    }
  }
}

template <int R>
PJ_AVX2 void RowsInt4Avx2(const Job& j, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (j.tiled) {  // blocks that divide a tile (n0 is a multiple of 16, so of kTileRows): a tile per pass up to 2 rows
    constexpr int NB = R <= 2 ? kTileRows : (R <= 4 ? 2 : 1);  // (Block never passes over kBlockRows rows)
    for (; n + NB <= n1; n += NB) BlockInt4Avx2<R, NB, true>(j, n, 1);
    for (; n < n1; ++n) BlockInt4Avx2<R, 1, true>(j, n, 1);
    return;
  }
  constexpr int NB = R <= 1 ? 4 : (R <= 2 ? 3 : (R <= 4 ? 2 : 1));
  const Blocks b = BlocksOf<NB>(j, n0, n1);
  for (int64_t i = 0; i < b.count; ++i, n += b.step) BlockInt4Avx2<R, NB, false>(j, n, b.apart);
  for (n = b.tail; n < n1; ++n) BlockInt4Avx2<R, 1, false>(j, n, 1);
}

// ---- AVX-512 (F, BW, VL): 16 lanes, masked tail ---------------------------------------------------------------
#define PJ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))  // (fma: the AVX2 helpers inline)
PJ_AVX512 inline __m512 LoadAvx512(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PJ_AVX512 inline __m512 LoadAvx512(const float* p) { return _mm512_loadu_ps(p); }
PJ_AVX512 inline __m512 MaskLoadAvx512(__mmask16 m, const uint16_t* p) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PJ_AVX512 inline __m512 MaskLoadAvx512(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }

template <typename WT, int R, int NB>
PJ_AVX512 void BlockAvx512(const Job& j, int64_t n, int64_t apart) {
  const int64_t K = j.K, kv = K / 16 * 16, rs = apart * K;
  const WT* __restrict w = static_cast<const WT*>(j.w) + n * K;
  const float* __restrict x = j.x;
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kv; k += 16) {
    if (sizeof(WT) == 2 && (k & 31) == 0) PrefetchNext<NB>(w, 2 * K, apart, 2 * k);
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = LoadAvx512(w + b * rs + k);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  if (kv < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - kv)) - 1);
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = MaskLoadAvx512(m, w + b * rs + kv);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + kv);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  float sums[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) sums[b][r] = _mm512_reduce_add_ps(acc[b][r]);
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b * apart, sums[b][r]);
}

template <typename WT, int R>
PJ_AVX512 void RowsAvx512(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = 4;  // NB * R accumulators + NB weights + 1 x (8 weight rows at 1-2 x rows: no faster)
  const Blocks b = BlocksOf<NB>(j, n0, n1);
  for (int64_t i = 0, n = n0; i < b.count; ++i, n += b.step) BlockAvx512<WT, R, NB>(j, n, b.apart);
  for (int64_t n = b.tail; n < n1; ++n) BlockAvx512<WT, R, 1>(j, n, 1);
}

// 16 dequantized int8 weights at v, as DequantAvx2 (the same two roundings per weight: the same floats).
template <bool Zero>
PJ_AVX512 inline __m512 DequantAvx512(const uint8_t* v, __m512 zv, __m512 sv) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
  return _mm512_mul_ps(Zero ? _mm512_sub_ps(f, zv) : f, sv);
}

// int8 weights: BlockAvx512<float>'s lanes, order and tree over the weight dequantized in registers, 16 per load
// (groups of a multiple of 16 columns; others: BlockQuantOddAvx512), so its bits are the float32 AVX-512 code's on the
// dequantized weight. No split at 7-8 rows as the AVX2 path's (see RowsQuantAvx512).
template <bool Zero, int R, int NB>
PJ_AVX512 void BlockQuantAvx512(const Job& j, int64_t n, int64_t apart) {
  const int64_t K = j.K, gs = j.gs, G = K / gs, rs = apart * K;
  const uint8_t* __restrict v = j.qv + n * K;
  const float* __restrict x = j.x;
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 sv[NB], zv[NB];
    for (int b = 0; b < NB; ++b) {
      sv[b] = _mm512_set1_ps(j.scale[(n + b * apart) * G + g]);
      zv[b] = _mm512_set1_ps(static_cast<float>(j.zero[(n + b * apart) * G + g]));
    }
    for (int64_t o = 0; o < gs; o += 16) {
      if (R <= kBlockRows && ((g * gs + o) & 63) == 0) PrefetchNext<NB>(v, K, apart, g * gs + o);
      __m512 wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = DequantAvx512<Zero>(v + b * rs + g * gs + o, zv[b], sv[b]);
      for (int r = 0; r < R; ++r) {
        __m512 xv = _mm512_loadu_ps(x + r * K + g * gs + o);
        for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b * apart, _mm512_reduce_add_ps(acc[b][r]));
}

// 8 dequantized int8 weights of row n at column k, with its group's scale and zero (DequantAvx2).
template <bool Zero>
PJ_AVX512 inline __m256 Dequant8Avx512(const Job& j, int64_t n, int64_t k) {
  const int64_t G = j.K / j.gs, g = k / j.gs;
  return DequantAvx2<Zero>(j.qv + n * j.K + k, _mm256_set1_ps(static_cast<float>(j.zero[n * G + g])),
                           _mm256_set1_ps(j.scale[n * G + g]));
}

// BlockQuantAvx512 for groups of 8 (mod 16) columns: each 16-column step dequantized as two halves of their own
// groups, the last 8 columns (in = 8 mod 16) as the float32 code's masked tail (zeros above). Rare (quant.py's int8
// is per channel) and slower; the same bits.
template <bool Zero, int R, int NB>
PJ_AVX512 void BlockQuantOddAvx512(const Job& j, int64_t n, int64_t apart) {
  const int64_t K = j.K;
  const float* __restrict x = j.x;
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const bool tail = k + 16 > K;
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) {
      const __m256 lo = Dequant8Avx512<Zero>(j, n + b * apart, k);
      const __m256 hi = tail ? _mm256_setzero_ps() : Dequant8Avx512<Zero>(j, n + b * apart, k + 8);
      wv[b] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail ? 0x00ff : 0xffff, x + r * K + k);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b * apart, _mm512_reduce_add_ps(acc[b][r]));
}

template <bool Zero, int R>
PJ_AVX512 void RowsQuantAvx512(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = 4;  // NB * R accumulators + NB weights, scales, zeros + 1 x: some spill at 5-8 rows, still
                         // 1.2-1.5x NB 2 (kernel_ab.py)
  const Blocks b = BlocksOf<NB>(j, n0, n1);
  if (j.gs % 16) {
    for (int64_t i = 0, n = n0; i < b.count; ++i, n += b.step) BlockQuantOddAvx512<Zero, R, NB>(j, n, b.apart);
    for (int64_t n = b.tail; n < n1; ++n) BlockQuantOddAvx512<Zero, R, 1>(j, n, 1);
    return;
  }
  for (int64_t i = 0, n = n0; i < b.count; ++i, n += b.step) BlockQuantAvx512<Zero, R, NB>(j, n, b.apart);
  for (int64_t n = b.tail; n < n1; ++n) BlockQuantAvx512<Zero, R, 1>(j, n, 1);
}

// int4 on AVX-512: two x rows per register, each half exactly BlockInt4Avx2's 8 lanes for its row (the same
// weight nibbles broadcast to both halves, the same vpmaddwd pairs, add, conversion and FMA with the group's scale), so
// the bits are the AVX2 and the portable path's while a 32-column chunk costs one pass of 5 instructions per two rows
// instead of per row. x rows in pairs: `Int4PairRows`.
template <int R, int NB, bool Tiled>
PJ_AVX512 void BlockInt4Avx512(const Job& j, int64_t n, int64_t apart) {  // (tiled: apart 1)
  constexpr int P = (R + 1) / 2;  // row pairs
  const int64_t K = j.K, gs = j.gs, h = gs / 2, G = K / gs, KB = K / 2;
  const uint8_t* __restrict v = j.Int4Chunk(n, 0);
  const int64_t row_step = Tiled ? 16 : KB * apart, chunk_step = Tiled ? 16 * kTileRows : 16;
  const int16_t* __restrict x = j.xq;  // pair layout
  const __m512i mask = _mm512_set1_epi16(15);
  __m512 acc[NB][P];
  for (int b = 0; b < NB; ++b)
    for (int q = 0; q < P; ++q) acc[b][q] = _mm512_setzero_ps();
  const float* __restrict s = j.scale + n * G;
  const int64_t s_step = apart * G, per_group = h / 16;
  for (int64_t c = 0, g = 0, left = per_group; c < K / 32; ++c) {
    if (R <= 2 && Tiled)
      _mm_prefetch(reinterpret_cast<const char*>(v) + kTileRows * KB + c * chunk_step, _MM_HINT_T0);
    else if (R <= 2 && (c & 3) == 0)
      PrefetchNext<NB>(v, KB, apart, 16 * c);
    for (int b = 0; b < NB; ++b) {
      const __m512 sv = _mm512_set1_ps(s[b * s_step + g]);
      const __m512i w = _mm512_broadcast_i64x4(_mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + b * row_step + c * chunk_step))));
      const __m512i qa = _mm512_and_si512(w, mask), qb = _mm512_srli_epi16(w, 4);
      for (int q = 0; q < P; ++q) {
        const int16_t* xp = x + 2 * q * K + 64 * c;
        const __m512i e = _mm512_add_epi32(_mm512_madd_epi16(qa, _mm512_loadu_si512(xp)),
                                           _mm512_madd_epi16(qb, _mm512_loadu_si512(xp + 32)));
        acc[b][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), sv, acc[b][q]);
      }
    }
    if (--left == 0) ++g, left = per_group;
  }
  for (int r = 0; r < R; ++r) {
    float zs[NB];
    ZeroSharesAvx2<NB>(j, r, n, apart, zs);
    for (int b = 0; b < NB; ++b) {
      const __m512 a = acc[b][r / 2];
      const __m256 half = r % 2 ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))
                                : _mm512_castps512_ps256(a);
      j.Store(r, n + b * apart, (HsumAvx2(half) - zs[b]) * j.xs[r]);
    }
  }
}

template <int R>
PJ_AVX512 void RowsInt4Avx512(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = 4;  // NB * R / 2 accumulators + NB x (weights, scale) + 2 x within 32 zmm
  int64_t n = n0;
  if (j.tiled) {  // a tile per pass (n0 is a multiple of 16; Block never passes over kBlockRows rows)
    for (; n + kTileRows <= n1; n += kTileRows) BlockInt4Avx512<R, kTileRows, true>(j, n, 1);
    for (; n < n1; ++n) BlockInt4Avx512<R, 1, true>(j, n, 1);
    return;
  }
  const Blocks b = BlocksOf<NB>(j, n0, n1);
  for (int64_t i = 0; i < b.count; ++i, n += b.step) BlockInt4Avx512<R, NB, false>(j, n, b.apart);
  for (n = b.tail; n < n1; ++n) BlockInt4Avx512<R, 1, false>(j, n, 1);
}

// ---- AVX512_BF16 (bf16 x only): vdpbf16ps multiplies 32 bf16 pairs into 16 f32 sums per instruction, the weight
// and x used as stored (no conversion). Products of two bf16 are exact in f32, so this is f32 summation in another
// order (pairs of neighbours first); like every AVX512_BF16 op it treats bf16 denormals as zero.
#define PJ_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
template <int R, int NB>
PJ_BF16 void BlockBf16(const Job& j, int64_t n, int64_t apart) {
  const int64_t K = j.K, kv = K / 32 * 32, rs = apart * K;
  const uint16_t* __restrict w = static_cast<const uint16_t*>(j.w) + n * K;
  const uint16_t* __restrict x = j.xb;
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kv; k += 32) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) {
      // 512 bytes ahead in each of the NB rows: 7-10% faster 1-row products than the hardware prefetcher alone
      // (Qwen3-0.6B shapes, 16 cold weights, quiet box; 1 and 2 KiB ahead measured no better). A prefetch past the
      // weight's end cannot fault.
      _mm_prefetch(reinterpret_cast<const char*>(w + b * rs + k + 256), _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(w + b * rs + k);
    }
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  }
  if (kv < K) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (K - kv)) - 1);
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + b * rs + kv);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + kv);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  }
  float sums[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) sums[b][r] = _mm512_reduce_add_ps(acc[b][r]);
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b * apart, sums[b][r]);
}

template <int R>
PJ_BF16 void RowsBf16(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = 4;  // (8 weight rows at 1-2 x rows: 0.87x)
  const Blocks b = BlocksOf<NB>(j, n0, n1);
  for (int64_t i = 0, n = n0; i < b.count; ++i, n += b.step) BlockBf16<R, NB>(j, n, b.apart);
  for (int64_t n = b.tail; n < n1; ++n) BlockBf16<R, 1>(j, n, 1);
}
#endif

using RowsFn = void (*)(const Job&, int64_t, int64_t);

// A row-count table {fn<..., 1>, ..., fn<..., 8>}: PJ_RTABLE(RowsAvx2<float,) or PJ_RTABLE(RowsBf16<).
#define PJ_RTABLE(...) {__VA_ARGS__ 1>, __VA_ARGS__ 2>, __VA_ARGS__ 3>, __VA_ARGS__ 4>, __VA_ARGS__ 5>, \
                        __VA_ARGS__ 6>, __VA_ARGS__ 7>, __VA_ARGS__ 8>}

// The code path for `requested` (0 auto): 4 AVX512_BF16 (bf16 x and bf16 w only), 3 AVX-512, 2 AVX2, 1 portable.
int ResolveIsa(int32_t requested, bool x_bf16, bool w_bf16) {
#if PJ_X86
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
  bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16") && x_bf16 && w_bf16;
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (requested == 0) return bf16 ? 4 : (avx512 ? 3 : (avx2 ? 2 : 1));
  if (requested == 4 && bf16) return 4;
  if (requested >= 3 && avx512) return 3;
  if (requested == 2 && avx2) return 2;
#else
  (void)requested;
  (void)x_bf16;
  (void)w_bf16;
#endif
  return 1;
}

RowsFn Select(int isa, bool w_bf16, int rows) {
  static const RowsFn portable[2][kMaxRows] = {PJ_RTABLE(RowsPortable<float,), PJ_RTABLE(RowsPortable<uint16_t,)};
#if PJ_X86
  static const RowsFn avx2[2][kMaxRows] = {PJ_RTABLE(RowsAvx2<float,), PJ_RTABLE(RowsAvx2<uint16_t,)};
  static const RowsFn avx512[2][kMaxRows] = {PJ_RTABLE(RowsAvx512<float,), PJ_RTABLE(RowsAvx512<uint16_t,)};
  static const RowsFn bf16[kMaxRows] = PJ_RTABLE(RowsBf16<);
  if (isa == 4) return bf16[rows - 1];
  if (isa == 3) return avx512[w_bf16][rows - 1];
  if (isa == 2) return avx2[w_bf16][rows - 1];
#endif
  return portable[w_bf16][rows - 1];
}

// Quantized weights on the float32 code's ISA: int8 gives the same bits as that code on the dequantized weight (a
// chunk dequantized for more than kMaxRows rows runs that code itself); int4's AVX-512, AVX2 and portable paths give
// the same bits (RowsInt4Portable).
int QuantIsa(int32_t requested) { return ResolveIsa(requested, false, false); }

using DequantFn = void (*)(const Job&, int64_t, int64_t, float*);

DequantFn SelectDequant(int isa, bool zero) {
#if PJ_X86
  if (isa >= 2) return zero ? DequantRowsAvx2<true> : DequantRowsAvx2<false>;  // the same floats at either width
#endif
  (void)isa;
  (void)zero;
  return DequantRowsPortable;
}

RowsFn SelectQuant(int isa, int bits, bool zero, int rows) {
  static const RowsFn portable[2][kMaxRows] = {PJ_RTABLE(RowsQuantPortable<), PJ_RTABLE(RowsInt4Portable<)};
#if PJ_X86
  static const RowsFn avx2[3][kMaxRows] = {PJ_RTABLE(RowsQuantAvx2<false,), PJ_RTABLE(RowsQuantAvx2<true,),
                                           PJ_RTABLE(RowsInt4Avx2<)};
  static const RowsFn avx512[3][kMaxRows] = {PJ_RTABLE(RowsQuantAvx512<false,), PJ_RTABLE(RowsQuantAvx512<true,),
                                             PJ_RTABLE(RowsInt4Avx512<)};
  if (isa == 3) return avx512[bits == 4 ? 2 : zero][rows - 1];
  if (isa == 2) return avx2[bits == 4 ? 2 : zero][rows - 1];
#else
  (void)isa;
  (void)zero;
#endif
  return portable[bits == 4][rows - 1];
}

// Work shared by the calling thread and pool tasks: chunks of output features claimed from an atomic counter, so
// the caller never waits for a task that has not started (a busy pool cannot deadlock it), and a task that starts
// after the work is gone touches nothing but this state (kept alive by its shared_ptr). A chunk runs every row
// block against its weight rows, so with many rows (prefill) the chunk's weights are reused from cache. Which
// block or chunk a row or feature falls in never changes its sum: each is the same sequence of operations.
struct Shared {
  Job job;  // all rows; R is the row count
  RowsFn fns[kMaxRows];    // for the job's weights
  RowsFn dense[kMaxRows];  // quantized, over kMaxRows rows: float32 rows over the chunk dequantized
  DequantFn dequant = nullptr;
  int64_t chunk, chunks;

  // Rows per pass over a chunk's weights: all of them for quantized weights up to kMaxRows (each weight dequantized
  // or unpacked once in registers for every row), else kBlockRows; int4 always in blocks of kMaxRows (its integer
  // rows never take the float32 code), tiled int4 in blocks of kBlockRows (a tile's rows in halves then, the
  // chunk re-read from L2: over 4 rows, 1 row of a tile per pass measured 0.88x the row-major product).
  int64_t Block() const {
    const int64_t most = job.tiled ? kBlockRows : kMaxRows;
    if (job.qv && (job.R <= kMaxRows || job.bits == 4)) return job.R < most ? job.R : most;
    return kBlockRows;
  }
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    const int64_t ystride = job.N * (job.y_bf16 ? 2 : 4);
    // Up to 4 rows in one block: each weight row is read once from memory. More rows in blocks of 4 against a
    // weight chunk kept in L2: 4 x rows stay in L1 and 4 x 3 accumulators fill the registers (8 rows x 1 weight
    // row was load bound: 1.8x XLA's time at 8 rows of a [1024, 3072] weight, 0.6x XLA's prefill throughput).
    // Quantized weights: up to 8 rows in one block (the dequantization, not the loads, is what a pass costs).
    const int64_t block = Block();
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      int64_t n0 = c * chunk, n1 = n0 + chunk < job.N ? n0 + chunk : job.N;
      Job base = job;
      const RowsFn* table = fns;
      if (job.qv && job.bits == 8 && job.R > block) {  // int8: dequantize the chunk once, float32 rows over it
        thread_local std::vector<float> buffer;
        if (static_cast<int64_t>(buffer.size()) < (n1 - n0) * job.K) buffer.resize((n1 - n0) * job.K);
        dequant(job, n0, n1, buffer.data());
        base.qv = nullptr;
        base.w = buffer.data();
        base.y = static_cast<char*>(job.y) + n0 * (job.y_bf16 ? 2 : 4);
        n1 -= n0;
        n0 = 0;
        table = dense;
      }
      for (int64_t r0 = 0; r0 < job.R; r0 += block) {
        const int64_t R = job.R - r0 < block ? job.R - r0 : block;
        Job rows = base;
        rows.x = job.x + r0 * job.K;
        rows.xb = job.xb ? job.xb + r0 * job.K : nullptr;
        rows.xq = job.xq ? job.xq + r0 * job.K : nullptr;
        rows.xs = job.xs ? job.xs + r0 : nullptr;
        rows.xsum = job.xsum ? job.xsum + r0 * (job.K / job.gs) : nullptr;
        rows.y = static_cast<char*>(base.y) + r0 * ystride;
        rows.R = R;
        table[R - 1](rows, n0, n1);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// x as float32: the buffer itself, or (bf16 x, unless the AVX512_BF16 path reads it as is) an exact f32 copy,
// rows * in floats reused across calls on this thread.
const float* FloatRows(ffi::AnyBuffer x, bool copy) {
  thread_local std::vector<float> xf;
  if (!copy) return static_cast<const float*>(x.untyped_data());
  const int64_t n = x.dimensions()[0] * x.dimensions()[1];
  if (static_cast<int64_t>(xf.size()) < n) xf.resize(n);
  const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
  for (int64_t i = 0; i < n; ++i) xf[i] = Bf16ToF32(xb[i]);
  return xf.data();
}

// Runs s's job on the caller and XLA's intra-op pool. ~4 chunks per thread (load balance on a shared machine), each
// a multiple of 16 features and >= 64 KiB of weight as stored (`row_bytes` per feature); with more than one row
// block, at most ~256 KiB of weight as the row blocks re-read it (`cached_row_bytes`: it stays in L2 between them).
void Run(ffi::ThreadPool& pool, const std::shared_ptr<Shared>& s, int64_t row_bytes, int64_t cached_row_bytes) {
  const int64_t threads = pool.num_threads() > 0 ? pool.num_threads() : 1, N = s->job.N;
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  const int64_t min_chunk = (65536 + row_bytes - 1) / row_bytes;
  chunk = chunk < min_chunk ? min_chunk : chunk;
  if (s->job.R > s->Block()) {
    const int64_t max_chunk = 262144 / cached_row_bytes;
    chunk = chunk > max_chunk ? max_chunk : chunk;
  }
  chunk = (chunk + 15) / 16 * 16;
  s->chunk = chunk;
  s->chunks = (N + chunk - 1) / chunk;
  const int64_t helpers = (threads < s->chunks ? threads : s->chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([s] { s->Work(); });
  s->Work();
  while (s->done.load(std::memory_order_acquire) < s->chunks) std::this_thread::yield();
}

bool FloatRowsType(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error SkinnyMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                        int32_t isa, bool streams) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("pocketjax skinny_matmul: expects x [rows, in], w [out, in], y [rows, out]");
  const ffi::DataType xt = x.element_type(), yt = y->element_type(), wt = w.element_type();
  if (!FloatRowsType(xt) || yt != xt)
    return ffi::Error::InvalidArgument("pocketjax skinny_matmul: x and y must both be float32 or bfloat16");
  if (!FloatRowsType(wt))
    return ffi::Error::InvalidArgument("pocketjax skinny_matmul: w must be float32 or bfloat16");
  const int64_t rows = xd[0], K = xd[1], N = wd[0];
  if (rows == 0 || N == 0) return ffi::Error::Success();
  const bool w_bf16 = wt == ffi::DataType::BF16, x_bf16 = xt == ffi::DataType::BF16;
  const int resolved = ResolveIsa(isa, x_bf16, w_bf16);
  auto s = std::make_shared<Shared>();
  const uint16_t* xb = x_bf16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  s->job = Job{FloatRows(x, x_bf16 && resolved != 4), xb, w.untyped_data(), y->untyped_data(), x_bf16, rows, K, N};
  s->job.streams = streams;
  for (int r = 1; r <= kMaxRows; ++r) s->fns[r - 1] = Select(resolved, w_bf16, r);
  Run(pool, s, K * (w_bf16 ? 2 : 4), K * (w_bf16 ? 2 : 4));
  return ffi::Error::Success();
}

// A quantized weight [N, K] in quant.py's form (values, scale and zero [N, G]) for `RunQuantized`.
struct Quantized {
  const uint8_t* qv;
  const float* scale;
  const int8_t* zero;
  int64_t N, G;
  int bits;
  bool has_zero, tiled;
};

// y [rows, N] (bf16 when y_bf16) = x [rows, K] (float32) @ W^T for quantized W on code path `resolved`
// (QuantizedMatmul's body, shared with the experts' pairs: the same bits for a row wherever it is computed).
void RunQuantized(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t K, const Quantized& q, void* y,
                  bool y_bf16, int resolved, bool streams) {
  const int64_t N = q.N, G = q.G;
  const int bits = q.bits;
  const bool has_zero = q.has_zero, tiled = q.tiled;
  auto s = std::make_shared<Shared>();
  s->job = Job{x, nullptr, nullptr, y, y_bf16, rows, K, N};
  s->job.qv = q.qv;
  s->job.scale = q.scale;
  s->job.zero = q.zero;
  s->job.gs = K / G;
  s->job.bits = bits;
  s->job.streams = streams;
  for (int r = 1; r <= kMaxRows; ++r) {
    s->fns[r - 1] = SelectQuant(resolved, bits, has_zero, r);
    s->dense[r - 1] = Select(resolved, false, r);
  }
  s->dequant = SelectDequant(resolved, has_zero);
  if (bits == 4) {  // x rounded to int16 once per call (Int4Rows), kept per thread like FloatRows' copy
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> xs;
    const int64_t floats = rows * (1 + G);
    if (static_cast<int64_t>(xq.size()) < rows * K) xq.resize(rows * K);
    if (static_cast<int64_t>(xs.size()) < floats) xs.resize(floats);
#if PJ_X86
    if (resolved >= 2)
      Int4RowsAvx2(s->job.x, rows, K, s->job.gs, xq.data(), xs.data(), xs.data() + rows);
    else
#endif
      Int4Rows(s->job.x, rows, K, s->job.gs, xq.data(), xs.data(), xs.data() + rows);
    s->job.xq = xq.data();
    if (resolved == 3) {  // the AVX-512 path reads x rows in pairs (blocks start at even rows: Block() is even)
      thread_local std::vector<int16_t> pairs;
      if (static_cast<int64_t>(pairs.size()) < (rows + 1) / 2 * 2 * K) pairs.resize((rows + 1) / 2 * 2 * K);
      Int4PairRows(xq.data(), rows, K, pairs.data());
      s->job.xq = pairs.data();
    }
    s->job.xs = xs.data();
    s->job.xsum = xs.data() + rows;
    s->job.has_zero = has_zero;
    s->job.tiled = tiled;
  }
  Run(pool, s, K * bits / 8 + G * 5, bits == 4 ? K / 2 + G * 5 : K * 4);
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::AnyBuffer scale,
                           ffi::AnyBuffer zero, ffi::Result<ffi::AnyBuffer> y, int32_t isa, bool has_zero, bool tiled,
                           bool streams) {
  auto xd = x.dimensions(), vd = values.dimensions(), sd = scale.dimensions(), zd = zero.dimensions(),
       yd = y->dimensions();
  const int bits = values.element_type() == ffi::DataType::U8 ? 4 : 8;
  if (xd.size() != 2 || vd.size() != 2 || sd.size() != 2 || zd.size() != 2 || yd.size() != 2 ||
      vd[1] * 8 / bits != xd[1] || sd[0] != vd[0] || zd[0] != vd[0] || zd[1] != sd[1] || yd[0] != xd[0] ||
      yd[1] != vd[0] || sd[1] == 0 || xd[1] % sd[1] != 0 || (xd[1] / sd[1]) % (bits == 4 ? 32 : 8) != 0)
    return ffi::Error::InvalidArgument("pocketjax quantized_matmul: expects x [rows, in], values [out, in * bits / 8], "
                                       "scale and zero [out, in / gs] (gs a multiple of 32 for int4, 8 for int8), "
                                       "y [rows, out]");
  if (tiled && (bits != 4 || vd[0] % kTileRows != 0))
    return ffi::Error::InvalidArgument("pocketjax quantized_matmul: tiled values are int4 with out a multiple of 4");
  const ffi::DataType xt = x.element_type();
  if (!FloatRowsType(xt) || y->element_type() != xt ||
      (values.element_type() != ffi::DataType::U8 && values.element_type() != ffi::DataType::S8) ||
      scale.element_type() != ffi::DataType::F32 || zero.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("pocketjax quantized_matmul: x, y float32 or bfloat16 alike; values uint8 "
                                       "(int4) or int8; scale float32, zero int8");
  const int64_t rows = xd[0], K = xd[1], N = vd[0];
  if (rows == 0 || N == 0) return ffi::Error::Success();
  const bool x_bf16 = xt == ffi::DataType::BF16;
  const Quantized q{static_cast<const uint8_t*>(values.untyped_data()), static_cast<const float*>(scale.untyped_data()),
                    static_cast<const int8_t*>(zero.untyped_data()), N, sd[1], bits, has_zero, tiled};
  RunQuantized(pool, FloatRows(x, x_bf16), rows, K, q, y->untyped_data(), x_bf16, QuantIsa(isa), streams);
  return ffi::Error::Success();
}

// Pairs grouped by expert, stably: pairs order[start[e]] .. order[start[e + 1] - 1] chose expert e. False for an id
// outside [0, E).
bool GroupByExpert(const int32_t* ids, int64_t P, int64_t E, std::vector<int64_t>& start, std::vector<int64_t>& order) {
  start.assign(E + 1, 0);
  order.resize(P);
  for (int64_t p = 0; p < P; ++p) {
    if (ids[p] < 0 || ids[p] >= E) return false;
    ++start[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> at(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[at[ids[p]]++] = p;
  return true;
}

// Mixture-of-experts pairs (`PocketjaxExpertMatmul`, model/moe.py): y[p] = x[p] @ w[ids[p]]^T for stacked experts
// w [E, N, K] in place (no gathered copy of any weight). The pairs are grouped by expert (a stable counting sort),
// each group's x rows copied side by side, and each group runs as one SkinnyMatmul job against its expert's weight:
// every weight row of a chosen expert is read once for all the pairs routed to it, experts no pair chose are never
// read (a decode step reads its rows' k experts only), and a pair's bits are the bits of its row multiplied alone
// (a row's sum never depends on the rows beside it: see the top), so they never depend on the other pairs.
ffi::Error ExpertMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> y, int32_t isa, bool streams) {
  auto xd = x.dimensions(), wd = w.dimensions(), id = ids.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || id.size() != 1 || yd.size() != 2 || xd[1] != wd[2] || id[0] != xd[0] ||
      yd[0] != xd[0] || yd[1] != wd[1])
    return ffi::Error::InvalidArgument("pocketjax expert_matmul: expects x [P, in], w [E, out, in], ids [P], "
                                       "y [P, out]");
  const ffi::DataType xt = x.element_type(), yt = y->element_type(), wt = w.element_type();
  if (!FloatRowsType(xt) || yt != xt || !FloatRowsType(wt))
    return ffi::Error::InvalidArgument("pocketjax expert_matmul: x and y float32 or bfloat16 alike, w float32 or "
                                       "bfloat16");
  const int64_t P = xd[0], K = xd[1], E = wd[0], N = wd[1];
  if (P == 0 || N == 0) return ffi::Error::Success();
  std::vector<int64_t> start, order;
  if (!GroupByExpert(ids.typed_data(), P, E, start, order))
    return ffi::Error::InvalidArgument("pocketjax expert_matmul: an expert id outside [0, E)");
  const bool w_bf16 = wt == ffi::DataType::BF16, x_bf16 = xt == ffi::DataType::BF16;
  const int resolved = ResolveIsa(isa, x_bf16, w_bf16);
  const float* xf = FloatRows(x, x_bf16 && resolved != 4);
  const uint16_t* xb = x_bf16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  const bool dot_bf16 = x_bf16 && resolved == 4;  // the AVX512_BF16 path reads the bf16 rows, the others floats
  std::vector<float> xs(dot_bf16 ? 0 : P * K);
  std::vector<uint16_t> xbs(dot_bf16 ? P * K : 0);
  for (int64_t i = 0; i < P; ++i) {
    if (dot_bf16)
      std::memcpy(xbs.data() + i * K, xb + order[i] * K, K * 2);
    else
      std::memcpy(xs.data() + i * K, xf + order[i] * K, K * 4);
  }
  const int64_t ysize = x_bf16 ? 2 : 4, wsize = w_bf16 ? 2 : 4;
  std::vector<char> ys(P * N * ysize);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = start[e], rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    auto s = std::make_shared<Shared>();
    s->job = Job{dot_bf16 ? nullptr : xs.data() + r0 * K, dot_bf16 ? xbs.data() + r0 * K : nullptr,
                 static_cast<const char*>(w.untyped_data()) + e * N * K * wsize, ys.data() + r0 * N * ysize, x_bf16,
                 rows, K, N};
    s->job.streams = streams;
    for (int r = 1; r <= kMaxRows; ++r) s->fns[r - 1] = Select(resolved, w_bf16, r);
    Run(pool, s, K * wsize, K * wsize);
  }
  char* out = static_cast<char*>(y->untyped_data());
  for (int64_t i = 0; i < P; ++i) std::memcpy(out + order[i] * N * ysize, ys.data() + i * N * ysize, N * ysize);
  return ffi::Error::Success();
}


// The experts' pairs for quantized experts (`PocketjaxExpertQuantizedMatmul`): values [E, N, K * bits / 8], scale and
// zero [E, N, G], each expert quant.py's form in place; grouped as ExpertMatmul, each group QuantizedMatmul's job
// (`RunQuantized`) on its expert, so a pair's bits are its row's alone against that expert.
ffi::Error ExpertQuantizedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::AnyBuffer scale,
                                 ffi::AnyBuffer zero, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> y,
                                 int32_t isa, bool has_zero, bool streams) {
  auto xd = x.dimensions(), vd = values.dimensions(), sd = scale.dimensions(), zd = zero.dimensions(),
       id = ids.dimensions(), yd = y->dimensions();
  const int bits = values.element_type() == ffi::DataType::U8 ? 4 : 8;
  if (xd.size() != 2 || vd.size() != 3 || sd.size() != 3 || zd.size() != 3 || id.size() != 1 || yd.size() != 2 ||
      vd[2] * 8 / bits != xd[1] || sd[0] != vd[0] || sd[1] != vd[1] || zd[0] != vd[0] || zd[1] != vd[1] ||
      zd[2] != sd[2] || id[0] != xd[0] || yd[0] != xd[0] || yd[1] != vd[1] || sd[2] == 0 || xd[1] % sd[2] != 0 ||
      (xd[1] / sd[2]) % (bits == 4 ? 32 : 8) != 0)
    return ffi::Error::InvalidArgument("pocketjax expert_quantized_matmul: expects x [P, in], values [E, out, in * "
                                       "bits / 8], scale and zero [E, out, in / gs] (gs a multiple of 32 for int4, 8 "
                                       "for int8), ids [P], y [P, out]");
  const ffi::DataType xt = x.element_type();
  if (!FloatRowsType(xt) || y->element_type() != xt ||
      (values.element_type() != ffi::DataType::U8 && values.element_type() != ffi::DataType::S8) ||
      scale.element_type() != ffi::DataType::F32 || zero.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("pocketjax expert_quantized_matmul: x, y float32 or bfloat16 alike; values "
                                       "uint8 (int4) or int8; scale float32, zero int8");
  const int64_t P = xd[0], K = xd[1], E = vd[0], N = vd[1], G = sd[2];
  if (P == 0 || N == 0) return ffi::Error::Success();
  std::vector<int64_t> start, order;
  if (!GroupByExpert(ids.typed_data(), P, E, start, order))
    return ffi::Error::InvalidArgument("pocketjax expert_quantized_matmul: an expert id outside [0, E)");
  const bool x_bf16 = xt == ffi::DataType::BF16;
  const float* xf = FloatRows(x, x_bf16);
  std::vector<float> xs(P * K);
  for (int64_t i = 0; i < P; ++i) std::memcpy(xs.data() + i * K, xf + order[i] * K, K * 4);
  const int64_t ysize = x_bf16 ? 2 : 4, vrow = K * bits / 8;
  std::vector<char> ys(P * N * ysize);
  const int resolved = QuantIsa(isa);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = start[e], rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    const Quantized q{static_cast<const uint8_t*>(values.untyped_data()) + e * N * vrow,
                      static_cast<const float*>(scale.untyped_data()) + e * N * G,
                      static_cast<const int8_t*>(zero.untyped_data()) + e * N * G, N, G, bits, has_zero, false};
    RunQuantized(pool, xs.data() + r0 * K, rows, K, q, ys.data() + r0 * N * ysize, x_bf16, resolved, streams);
  }
  char* out = static_cast<char*>(y->untyped_data());
  for (int64_t i = 0; i < P; ++i) std::memcpy(out + order[i] * N * ysize, ys.data() + i * N * ysize, N * ysize);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PocketjaxSkinnyMatmul, SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("isa")
                                  .Attr<bool>("streams"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PocketjaxQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("isa")
                                  .Attr<bool>("has_zero")
                                  .Attr<bool>("tiled")
                                  .Attr<bool>("streams"));

// For tests and the benchmark: the code path `isa` (0 = auto) resolves to on this CPU for x's and w's dtypes.
extern "C" int PocketjaxSkinnyMatmulIsa(int32_t requested, int32_t x_bf16, int32_t w_bf16) {
  return ResolveIsa(requested, x_bf16, w_bf16);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PocketjaxExpertMatmul, ExpertMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("isa")
                                  .Attr<bool>("streams"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PocketjaxExpertQuantizedMatmul, ExpertQuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("isa")
                                  .Attr<bool>("has_zero")
                                  .Attr<bool>("streams"));
