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
// ISA, chosen at run time (__builtin_cpu_supports): for a bf16 x AVX512_BF16's vdpbf16ps (32 products per
// instruction: at 2-8 rows an FMA path is compute bound on a slow core), else AVX-512 (F+BW+VL) or AVX2+FMA, else
// a portable loop the compiler vectorizes for the base ISA (e.g. aarch64 NEON). The `isa` attribute forces one
// (tests, benchmarks): 0 auto, 1 portable, 2 AVX2, 3 AVX-512, 4 AVX512_BF16; one the CPU lacks falls back to the
// next below it (AVX512_BF16 -> AVX-512 -> portable, AVX2 -> portable).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
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

#if PJ_X86
// The vector paths: NB weight rows (contiguous in [out, in]) at a time, each loaded once per k step and multiplied
// with every x row; NB * R accumulators stay in registers (all loops below unroll: R, NB are constants, and only
// local pointers are read inside the k loop, so nothing aliases the accumulators).

// ---- AVX2 + FMA: 8 lanes, scalar tail ------------------------------------------------------------------------
#define PJ_AVX2 __attribute__((target("avx2,fma")))
PJ_AVX2 inline __m256 LoadAvx2(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PJ_AVX2 inline __m256 LoadAvx2(const float* p) { return _mm256_loadu_ps(p); }

template <typename WT, int R, int NB>
PJ_AVX2 void BlockAvx2(const Job& j, int64_t n) {
  const int64_t K = j.K, kv = K / 8 * 8;
  const WT* __restrict w = static_cast<const WT*>(j.w) + n * K;
  const float* __restrict x = j.x;
  __m256 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kv; k += 8) {
    __m256 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = LoadAvx2(w + b * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm256_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  float sums[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) {
      __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[b][r]), _mm256_extractf128_ps(acc[b][r], 1));
      s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
      float s = _mm_cvtss_f32(s4);
      for (int64_t k = kv; k < K; ++k) s += ToF32(w[b * K + k]) * x[r * K + k];
      sums[b][r] = s;
    }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b, sums[b][r]);
}

template <typename WT, int R>
PJ_AVX2 void RowsAvx2(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = R <= 2 ? 4 : (R <= 4 ? 3 : 1);  // NB * R accumulators + NB weights + 1 x within 16 ymm
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) BlockAvx2<WT, R, NB>(j, n);
  for (; n < n1; ++n) BlockAvx2<WT, R, 1>(j, n);
}

// ---- AVX-512 (F, BW, VL): 16 lanes, masked tail ---------------------------------------------------------------
#define PJ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
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
PJ_AVX512 void BlockAvx512(const Job& j, int64_t n) {
  const int64_t K = j.K, kv = K / 16 * 16;
  const WT* __restrict w = static_cast<const WT*>(j.w) + n * K;
  const float* __restrict x = j.x;
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kv; k += 16) {
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = LoadAvx512(w + b * K + k);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  if (kv < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - kv)) - 1);
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = MaskLoadAvx512(m, w + b * K + kv);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + kv);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  float sums[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) sums[b][r] = _mm512_reduce_add_ps(acc[b][r]);
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b, sums[b][r]);
}

template <typename WT, int R>
PJ_AVX512 void RowsAvx512(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = R <= 2 ? 8 : (R <= 4 ? 4 : 2);  // NB * R accumulators + NB weights + 1 x within 32 zmm
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) BlockAvx512<WT, R, NB>(j, n);
  for (; n < n1; ++n) BlockAvx512<WT, R, 1>(j, n);
}

// ---- AVX512_BF16 (bf16 x only): vdpbf16ps multiplies 32 bf16 pairs into 16 f32 sums per instruction, the weight
// and x used as stored (no conversion). Products of two bf16 are exact in f32, so this is f32 summation in another
// order (pairs of neighbours first); like every AVX512_BF16 op it treats bf16 denormals as zero.
#define PJ_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
template <int R, int NB>
PJ_BF16 void BlockBf16(const Job& j, int64_t n) {
  const int64_t K = j.K, kv = K / 32 * 32;
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
      _mm_prefetch(reinterpret_cast<const char*>(w + b * K + k + 256), _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(w + b * K + k);
    }
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  }
  if (kv < K) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (K - kv)) - 1);
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + b * K + kv);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + kv);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  }
  float sums[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) sums[b][r] = _mm512_reduce_add_ps(acc[b][r]);
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) j.Store(r, n + b, sums[b][r]);
}

template <int R>
PJ_BF16 void RowsBf16(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NB = R <= 2 ? 8 : (R <= 4 ? 4 : 2);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) BlockBf16<R, NB>(j, n);
  for (; n < n1; ++n) BlockBf16<R, 1>(j, n);
}
#endif

using RowsFn = void (*)(const Job&, int64_t, int64_t);

#define PJ_TABLE(fn, WT) {fn<WT, 1>, fn<WT, 2>, fn<WT, 3>, fn<WT, 4>, fn<WT, 5>, fn<WT, 6>, fn<WT, 7>, fn<WT, 8>}

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
  static const RowsFn portable[2][kMaxRows] = {PJ_TABLE(RowsPortable, float), PJ_TABLE(RowsPortable, uint16_t)};
#if PJ_X86
  static const RowsFn avx2[2][kMaxRows] = {PJ_TABLE(RowsAvx2, float), PJ_TABLE(RowsAvx2, uint16_t)};
  static const RowsFn avx512[2][kMaxRows] = {PJ_TABLE(RowsAvx512, float), PJ_TABLE(RowsAvx512, uint16_t)};
  static const RowsFn bf16[kMaxRows] = {RowsBf16<1>, RowsBf16<2>, RowsBf16<3>, RowsBf16<4>,
                                        RowsBf16<5>, RowsBf16<6>, RowsBf16<7>, RowsBf16<8>};
  if (isa == 4) return bf16[rows - 1];
  if (isa == 3) return avx512[w_bf16][rows - 1];
  if (isa == 2) return avx2[w_bf16][rows - 1];
#endif
  return portable[w_bf16][rows - 1];
}

// Work shared by the calling thread and pool tasks: chunks of output features claimed from an atomic counter, so
// the caller never waits for a task that has not started (a busy pool cannot deadlock it), and a task that starts
// after the work is gone touches nothing but this state (kept alive by its shared_ptr). A chunk runs every row
// block against its weight rows, so with many rows (prefill) the chunk's weights are reused from cache. Which
// block or chunk a row or feature falls in never changes its sum: each is the same sequence of operations.
struct Shared {
  Job job;  // all rows; R is the row count
  RowsFn fns[kMaxRows];
  int64_t chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    const int64_t ystride = job.N * (job.y_bf16 ? 2 : 4);
    // Up to 4 rows in one block: each weight row is read once from memory. More rows in blocks of 4 against a
    // weight chunk kept in L2: 4 x rows stay in L1 and 4 x 3 accumulators fill the registers (8 rows x 1 weight
    // row was load bound: 1.8x XLA's time at 8 rows of a [1024, 3072] weight, 0.6x XLA's prefill throughput).
    const int64_t block = kBlockRows;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      int64_t n0 = c * chunk, n1 = n0 + chunk < job.N ? n0 + chunk : job.N;
      for (int64_t r0 = 0; r0 < job.R; r0 += block) {
        const int64_t R = job.R - r0 < block ? job.R - r0 : block;
        Job rows = job;
        rows.x = job.x + r0 * job.K;
        rows.xb = job.xb ? job.xb + r0 * job.K : nullptr;
        rows.y = static_cast<char*>(job.y) + r0 * ystride;
        rows.R = R;
        fns[R - 1](rows, n0, n1);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SkinnyMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                        int32_t isa) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("pocketjax skinny_matmul: expects x [rows, in], w [out, in], y [rows, out]");
  const ffi::DataType xt = x.element_type(), yt = y->element_type(), wt = w.element_type();
  if ((xt != ffi::DataType::F32 && xt != ffi::DataType::BF16) || yt != xt)
    return ffi::Error::InvalidArgument("pocketjax skinny_matmul: x and y must both be float32 or bfloat16");
  if (wt != ffi::DataType::F32 && wt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("pocketjax skinny_matmul: w must be float32 or bfloat16");
  const int64_t rows = xd[0], K = xd[1], N = wd[0];
  if (rows == 0 || N == 0) return ffi::Error::Success();
  const bool w_bf16 = wt == ffi::DataType::BF16;
  const int resolved = ResolveIsa(isa, xt == ffi::DataType::BF16, w_bf16);

  // An f32 copy of a bf16 x (exact): rows * in floats; reused across calls on this thread.
  thread_local std::vector<float> xf;
  const float* x32 = static_cast<const float*>(x.untyped_data());
  if (xt == ffi::DataType::BF16 && resolved != 4) {
    if (static_cast<int64_t>(xf.size()) < rows * K) xf.resize(rows * K);
    const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t i = 0; i < rows * K; ++i) xf[i] = Bf16ToF32(xb[i]);
    x32 = xf.data();
  }
  auto s = std::make_shared<Shared>();
  const uint16_t* xb = xt == ffi::DataType::BF16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  s->job = Job{x32, xb, w.untyped_data(), y->untyped_data(), yt == ffi::DataType::BF16, rows, K, N};
  for (int r = 1; r <= kMaxRows; ++r) s->fns[r - 1] = Select(resolved, w_bf16, r);
  const int64_t threads = pool.num_threads() > 0 ? pool.num_threads() : 1;
  const int64_t wbytes = w_bf16 ? 2 : 4;
  // ~4 chunks per thread (load balance on a shared machine), each a multiple of 16 features and >= 64 KiB of
  // weight; with more than one row block, at most ~256 KiB of weight (it stays in L2 across the row blocks).
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  const int64_t min_chunk = (65536 / wbytes + K - 1) / K;
  chunk = chunk < min_chunk ? min_chunk : chunk;
  if (rows > kBlockRows) {  // several row blocks: the chunk's weights stay in L2 between them
    const int64_t max_chunk = (262144 / wbytes) / K;
    chunk = chunk > max_chunk ? max_chunk : chunk;
  }
  chunk = (chunk + 15) / 16 * 16;
  s->chunk = chunk;
  s->chunks = (N + chunk - 1) / chunk;
  const int64_t helpers = (threads < s->chunks ? threads : s->chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([s] { s->Work(); });
  s->Work();
  while (s->done.load(std::memory_order_acquire) < s->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PocketjaxSkinnyMatmul, SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("isa"));

// For tests and the benchmark: the code path `isa` (0 = auto) resolves to on this CPU for x's and w's dtypes.
extern "C" int PocketjaxSkinnyMatmulIsa(int32_t requested, int32_t x_bf16, int32_t w_bf16) {
  return ResolveIsa(requested, x_bf16, w_bf16);
}
