// Causal GQA attention over the slotted KV cache with a FIXED reduction order, as an XLA FFI handler for the CPU
// (pocketjax/model/cpu_kernels.py compiles it at first use beside the product kernel and registers it).
//
// Why: XLA:CPU's dots and reductions pick their summation order from the shapes they see (the row count, the
// kv-length bucket): a query's output then changed with the batch it ran in, the prefill chunk it fell in and the
// bucket its neighbours forced (issue 43). Here every query row is computed by the same code whatever else is in
// the call: its scores over keys 0..pos (pos = starts[b] + i, its position) in key order, each a dot over the head
// dim in 8 fixed lanes then a fixed tree; its max; exp and the denominator summed in key order; P @ V accumulated in
// key order per output element. Nothing depends on the row count, the query chunk, the cache length read or the
// cache row, so decode, verify and prefill compute a position alike, bit for bit.
//
// Numerics follow pallas_kernels.reference (the XLA path): products in the compute dtype (the cache's, or q's for
// a quantized cache) summed in float32; a quantized cache's key scales multiply the scores, its value scales P's
// columns; P is rounded to the compute dtype before P @ V (bf16) as the reference casts it. The code has no ISA
// specific arithmetic and is built with -ffp-contract=off: a vectorizing compiler keeps each element's operations
// as written, so every x86/ARM build gives the same bits. On x86 the same source is also compiled for AVX2 (`Unit`,
// chosen at run time: 8-lane vectors for the baseline's 4, the same operations in the same order, the same bits),
// and a float32 cache is read in place, 4 rows ahead prefetched: 28 layers of Qwen3-0.6B's decode attention over
// 161 cold keys per row ~1.45x faster at 1-8 rows (benchmarks/kernel_ab.py --weights attention; benchmarks/README.md
// "Decode attention"). Prefill rows (8 or more per unit) take explicit AVX2 forms of the same operations (`Dot8`,
// `WeightedRow`: the same bits), and exp is `ExpF`, vectorized, not libm's: one layer's prefill attention over 2,048
// positions 262 -> 185 -> 159 ms (Qwen3-0.6B's heads, float32, a Zen 5).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <atomic>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(POCKETJAX_PORTABLE_ONLY)
#define PJ_ATTN_AVX2 1
#include <immintrin.h>
#else
#define PJ_ATTN_AVX2 0
#endif
#define PJ_INLINE inline __attribute__((always_inline))  // into either ISA's Unit

namespace {

constexpr int kLanes = 8;      // the head-dim dot's partial sums
constexpr int kQueryBlock = 16;  // query rows of one (row, kv head) handled per pass over the keys

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

PJ_INLINE float RoundBf16(float f) {  // to nearest even, as XLA's convert; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Fp8E4m3ToF32(uint8_t b) {  // float8_e4m3fn: no infinities, 0x7f / 0xff are NaN
  const int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 0x7;
  float v;
  if (exp == 0xf && man == 0x7) return std::nanf("");
  if (exp == 0)
    v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man / 8 * 2^-6
  else
    v = std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -v : v;
}

enum class Kind { kF32, kBf16, kS8, kFp8 };

// Reads element j of a cache row as float32 (exact for every kind).
struct CacheReader {
  const void* base;
  Kind kind;
  const float* fp8;  // the 256-entry table for kFp8

  // Element row at `offset` as float32: a float32 cache in place, any other kind converted into `out`.
  PJ_INLINE const float* Row(int64_t offset, int64_t d, float* out) const {
    switch (kind) {
      case Kind::kF32:
        return static_cast<const float*>(base) + offset;
      case Kind::kBf16: {
        const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
        for (int64_t j = 0; j < d; ++j) out[j] = Bf16ToF32(p[j]);
        break;
      }
      case Kind::kS8: {
        const int8_t* p = static_cast<const int8_t*>(base) + offset;
        for (int64_t j = 0; j < d; ++j) out[j] = static_cast<float>(p[j]);
        break;
      }
      case Kind::kFp8: {
        const uint8_t* p = static_cast<const uint8_t*>(base) + offset;
        for (int64_t j = 0; j < d; ++j) out[j] = fp8[p[j]];
        break;
      }
    }
    return out;
  }
};

// exp(x) for x <= 0 (a score less its row's max) as a fixed sequence of float32 operations, so that a loop of it
// vectorizes on every ISA with the same bits: Cephes' expf (x = n ln 2 + r, ln 2 in two parts; a degree-5 polynomial
// in r; times 2^n built in the exponent bits), within 2 ulp of exp; 0 below -87.3 (where exp leaves the normal
// range); NaN stays NaN. libm's expf, a call per score, was a quarter of a 2,048-position prefill's attention.
// tests/test_cpu_kernels.py's `expf_model` is this, in numpy.
PJ_INLINE float ExpF(float x) {
  constexpr float kBig = 0x1.8p23f;                         // adding it rounds to an integer, to nearest even
  const float shifted = x * 0x1.715476p+0f + kBig, n = shifted - kBig;  // x / ln 2 rounded: n
  float r = x - n * 0x1.63p-1f;                               // x - n ln 2, ln 2's leading bits
  r = r - n * -0x1.bd0106p-13f;                               // and the rest
  float p = 0x1.a0d2cep-13f;
  p = p * r + 0x1.6e879cp-10f;
  p = p * r + 0x1.11121p-7f;
  p = p * r + 0x1.555382p-5f;
  p = p * r + 0x1.555554p-3f;
  p = p * r + 0x1p-1f;
  p = p * (r * r) + r;
  p = p + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &shifted, 4);                            // n in the low mantissa bits of n + kBig
  bits = (bits - 0x4B400000u + 127u) << 23;                   // 2^n
  float scale;
  std::memcpy(&scale, &bits, 4);
  // below the cut (x < -87.3, -inf included, a NaN not): zero, chosen on the bits (a float compare kept GCC from
  // vectorizing the loop: it may trap)
  uint32_t xb, yb;
  std::memcpy(&xb, &x, 4);
  const float y = p * scale;
  std::memcpy(&yb, &y, 4);
  yb &= xb > 0xC2AE999Au && xb <= 0xFF800000u ? 0u : ~0u;
  float out;
  std::memcpy(&out, &yb, 4);
  return out;
}

// The head-dim dot in kLanes partial sums (lane l: elements l, l + 8, ...), then a fixed tree, then the tail.
PJ_INLINE float Dot(const float* a, const float* b, int64_t d) {
  float acc[kLanes] = {};
  const int64_t dv = d / kLanes * kLanes;
  for (int64_t j = 0; j < dv; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[j + l] * b[j + l];
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (int64_t j = dv; j < d; ++j) s += a[j] * b[j];
  return s;
}

// float32 cache rows prefetched ahead of the one read: 1.14-1.16x at 1-8 rows (2 ahead: 1.07-1.12x, 8: 1.12-1.15x)
constexpr int64_t kAhead = 4;

constexpr int64_t kKeyBlock = 64;  // P @ V: keys per pass over each row's output (their values stay in L1)

#if PJ_ATTN_AVX2
// The explicit AVX2 forms of `Dot` and P @ V, the same operations on the same operands (so the same bits): 8 query
// rows' dots with one key at once, their 8 trees done across registers; a row's output held in registers over a
// block of keys. The compiled loops ran one dot's 16 dependent adds and its tree in scalar, and loaded and stored
// the output per key: prefill attention over 2,048 keys was most of a long prompt's time.
#define PJ_ATTN_AVX2_FN __attribute__((target("avx2")))  // called, not inlined, from the ISA-neutral UnitBody

// out[r] = Dot(q + r * D, key, D) for r < 8.
PJ_ATTN_AVX2_FN void Dot8(const float* q, const float* key, int64_t D, float* out) {
  const int64_t dv = D / kLanes * kLanes;
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < dv; j += kLanes) {
    const __m256 k = _mm256_loadu_ps(key + j);
    for (int r = 0; r < 8; ++r) a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(_mm256_loadu_ps(q + r * D + j), k));
  }
  // Dot's tree ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) for all 8 at once: halves, then pairs, then the two
  __m256 b[4], c[2];
  for (int i = 0; i < 4; ++i)  // [row 2i: l0+l4, l1+l5, l2+l6, l3+l7 | row 2i+1: the same]
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // per row: (l0+l4) + (l2+l6), (l1+l5) + (l3+l7); low half rows 4i, 4i+2, high 4i+1, 4i+3
    c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  alignas(32) float sums[8];  // rows 0, 2, 4, 6, 1, 3, 5, 7
  _mm256_store_ps(sums, _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1))));
  for (int r = 0; r < 8; ++r) {
    float s = sums[r % 2 * 4 + r / 2];
    for (int64_t j = dv; j < D; ++j) s += q[r * D + j] * key[j];
    out[r] = s;
  }
}

// o[0, 8 NV) += sum over keys t < n, in order, of w[t] * v[t * D + (0, 8 NV)].
template <int NV>
PJ_ATTN_AVX2_FN inline __attribute__((always_inline)) void Weighted(const float* v, int64_t D, const float* w,
                                                                      int64_t n, float* o) {
  __m256 a[NV];
  for (int u = 0; u < NV; ++u) a[u] = _mm256_loadu_ps(o + 8 * u);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 wt = _mm256_set1_ps(w[t]);
    for (int u = 0; u < NV; ++u) a[u] = _mm256_add_ps(a[u], _mm256_mul_ps(wt, _mm256_loadu_ps(v + t * D + 8 * u)));
  }
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(o + 8 * u, a[u]);
}

// A row's output over keys [0, n) of the values at v (rows D apart), weights w: Weighted's passes, then the tail.
PJ_ATTN_AVX2_FN void WeightedRow(const float* v, int64_t D, const float* w, int64_t n, float* o) {
  const int64_t dv = D / 8 * 8;
  for (int64_t j = 0; j < dv; j += 64) {
    switch ((dv - j) / 8 < 8 ? (dv - j) / 8 : 8) {
      case 1: Weighted<1>(v + j, D, w, n, o + j); break;
      case 2: Weighted<2>(v + j, D, w, n, o + j); break;
      case 3: Weighted<3>(v + j, D, w, n, o + j); break;
      case 4: Weighted<4>(v + j, D, w, n, o + j); break;
      case 5: Weighted<5>(v + j, D, w, n, o + j); break;
      case 6: Weighted<6>(v + j, D, w, n, o + j); break;
      case 7: Weighted<7>(v + j, D, w, n, o + j); break;
      default: Weighted<8>(v + j, D, w, n, o + j); break;
    }
  }
  for (int64_t j = dv; j < D; ++j)
    for (int64_t t = 0; t < n; ++t) o[j] += w[t] * v[t * D + j];
}
#endif

struct Problem {
  const void* q;
  bool q_bf16;
  CacheReader k, v;
  const float *k_scale, *v_scale;  // [S, Hkv, T] or null
  const int32_t *slots, *starts, *q_lengths;
  void* out;
  int64_t B, Tq, Hq, Hkv, S, T, D;
  float sm_scale;
  bool compute_bf16;  // products in bfloat16 (inputs and P rounded to it), sums in float32
};

// One unit: query rows [i0, i1) of row b, every query head of kv head hk. kAvx2: the explicit forms above.
template <bool kAvx2>
PJ_INLINE void UnitBody(const Problem& p, int64_t b, int64_t hk, int64_t i0, int64_t i1) {
  const int64_t G = p.Hq / p.Hkv, D = p.D, rows = (i1 - i0) * G;
  const int64_t slot = p.slots[b], start = p.starts[b], qlen = p.q_lengths[b];
  thread_local std::vector<float> qf, scores, acc, kv_row, denom, values, weights;
  thread_local std::vector<int64_t> visible;
  qf.resize(rows * D);
  acc.assign(rows * D, 0.0f);
  denom.assign(rows, 0.0f);
  kv_row.resize(D);
  // Each query row's visible keys: 0..pos, clipped to the cache; none for padding rows.
  int64_t n_max = 0;
  visible.resize(i1 - i0);
  for (int64_t i = i0; i < i1; ++i) {
    int64_t n = i < qlen ? start + i + 1 : 0;
    n = n < 0 ? 0 : (n > p.T ? p.T : n);
    visible[i - i0] = n;
    n_max = n > n_max ? n : n_max;
  }
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t src = ((b * p.Tq + i) * p.Hq + hk * G + g) * D;
      float* dst = &qf[((i - i0) * G + g) * D];
      for (int64_t j = 0; j < D; ++j) {
        float x = p.q_bf16 ? Bf16ToF32(static_cast<const uint16_t*>(p.q)[src + j]) : static_cast<const float*>(p.q)[src + j];
        dst[j] = p.compute_bf16 ? RoundBf16(x) : x;
      }
    }
  scores.resize(rows * (n_max > 0 ? n_max : 1));
  const int64_t cache_row = (slot * p.Hkv + hk) * p.T;
  for (int64_t t = 0; t < n_max; ++t) {  // scores, key by key (the key is read once for every query row)
    const float* key = p.k.Row((cache_row + t) * D, D, kv_row.data());
    if (t + kAhead < n_max && p.k.kind == Kind::kF32)
      for (int64_t l = 0; l < D; l += 16) __builtin_prefetch(key + kAhead * D + l);
    const float ks = p.k_scale ? p.k_scale[cache_row + t] : 1.0f;
    int64_t r = 0;
#if PJ_ATTN_AVX2
    if constexpr (kAvx2) {
      for (; r + 8 <= rows; r += 8) {
        float dots[8];
        Dot8(&qf[r * D], key, D, dots);
        for (int i = 0; i < 8; ++i) {
          if (t >= visible[(r + i) / G]) continue;
          float s = dots[i] * p.sm_scale;
          if (p.k_scale) s = s * ks;
          scores[(r + i) * n_max + t] = s;
        }
      }
    }
#endif
    for (; r < rows; ++r) {
      if (t >= visible[r / G]) continue;
      float s = Dot(&qf[r * D], key, D) * p.sm_scale;
      if (p.k_scale) s = s * ks;
      scores[r * n_max + t] = s;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // softmax in key order: the max is exact in any order, the sum is not
    const int64_t n = visible[r / G];
    if (n == 0) continue;
    float* s = &scores[r * n_max];
    float m = s[0];
    for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < n; ++t) s[t] = ExpF(s[t] - m);  // (vectorized)
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) sum += s[t];
    denom[r] = sum;
  }
#if PJ_ATTN_AVX2
  // P @ V per row, a block of keys at a time, each output element summing in key order; with fewer rows than one
  // Dot8 (decode) the key-by-key loop below, which reads each value row once for all rows, is faster (1.09-1.19x)
  if (kAvx2 && rows >= 8) {
    const float* vals = static_cast<const float*>(p.v.base) + cache_row * D;  // a float32 cache in place
    if (p.v.kind != Kind::kF32) {
      values.resize(n_max * D);
      for (int64_t t = 0; t < n_max; ++t) p.v.Row((cache_row + t) * D, D, &values[t * D]);
      vals = values.data();
    }
    weights.resize(n_max);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = visible[r / G];
      for (int64_t t = 0; t < n; ++t) {
        float w = scores[r * n_max + t];
        if (p.v_scale) w = w * p.v_scale[cache_row + t];
        weights[t] = p.compute_bf16 ? RoundBf16(w) : w;
      }
      for (int64_t t0 = 0; t0 < n; t0 += kKeyBlock)
        WeightedRow(vals + t0 * D, D, &weights[t0], n - t0 < kKeyBlock ? n - t0 : kKeyBlock, &acc[r * D]);
    }
  } else
#endif
  for (int64_t t = 0; t < n_max; ++t) {  // P @ V, key by key: each output element sums in key order
    const float* value = p.v.Row((cache_row + t) * D, D, kv_row.data());
    if (t + kAhead < n_max && p.v.kind == Kind::kF32)
      for (int64_t l = 0; l < D; l += 16) __builtin_prefetch(value + kAhead * D + l);
    const float vs = p.v_scale ? p.v_scale[cache_row + t] : 1.0f;
    for (int64_t r = 0; r < rows; ++r) {
      if (t >= visible[r / G]) continue;
      float w = scores[r * n_max + t];
      if (p.v_scale) w = w * vs;
      if (p.compute_bf16) w = RoundBf16(w);
      float* o = &acc[r * D];
      for (int64_t j = 0; j < D; ++j) o[j] += w * value[j];
    }
  }
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (i - i0) * G + g;
      const int64_t dst = ((b * p.Tq + i) * p.Hq + hk * G + g) * D;
      for (int64_t j = 0; j < D; ++j) {
        const float o = denom[r] > 0.0f ? acc[r * D + j] / denom[r] : 0.0f;
        if (p.q_bf16)
          static_cast<uint16_t*>(p.out)[dst + j] = F32ToBf16Bits(o);
        else
          static_cast<float*>(p.out)[dst + j] = o;
      }
    }
}

void UnitBase(const Problem& p, int64_t b, int64_t hk, int64_t i0, int64_t i1) { UnitBody<false>(p, b, hk, i0, i1); }
#if PJ_ATTN_AVX2
__attribute__((target("avx2"))) void UnitAvx2(const Problem& p, int64_t b, int64_t hk, int64_t i0, int64_t i1) {
  UnitBody<true>(p, b, hk, i0, i1);
}
#endif

using UnitFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

// The same bits either way (no contraction, the same operations per element): AVX2 where the CPU has it.
UnitFn Unit() {
#if PJ_ATTN_AVX2
  static const UnitFn chosen = __builtin_cpu_supports("avx2") ? UnitAvx2 : UnitBase;
  return chosen;
#else
  return UnitBase;
#endif
}

struct Shared {
  Problem problem;
  int64_t blocks_per_row, units;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    const UnitFn unit = Unit();
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      const int64_t per_b = problem.Hkv * blocks_per_row;
      const int64_t b = u / per_b, hk = (u % per_b) / blocks_per_row, blk = u % blocks_per_row;
      const int64_t i0 = blk * kQueryBlock, i1 = i0 + kQueryBlock < problem.Tq ? i0 + kQueryBlock : problem.Tq;
      unit(problem, b, hk, i0, i1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

bool KindOf(ffi::DataType t, Kind* kind) {
  switch (t) {
    case ffi::DataType::F32: *kind = Kind::kF32; return true;
    case ffi::DataType::BF16: *kind = Kind::kBf16; return true;
    case ffi::DataType::S8: *kind = Kind::kS8; return true;
    case ffi::DataType::F8E4M3FN: *kind = Kind::kFp8; return true;
    default: return false;
  }
}

const float* Fp8Table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = Fp8E4m3ToF32(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> q_lengths, ffi::Result<ffi::AnyBuffer> out,
                     float sm_scale, bool quantized, bool compute_bf16) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[3] != kd[3] || qd[2] % kd[1] != 0 ||
      v.dimensions().size() != 4 || v.dimensions()[0] != kd[0] || v.dimensions()[1] != kd[1] ||
      v.dimensions()[2] != kd[2] || v.dimensions()[3] != kd[3])
    return ffi::Error::InvalidArgument("pocketjax attention: q [B, Tq, Hq, D], k and v [S, Hkv, T, D]");
  const ffi::DataType qt = q.element_type();
  if ((qt != ffi::DataType::F32 && qt != ffi::DataType::BF16) || out->element_type() != qt)
    return ffi::Error::InvalidArgument("pocketjax attention: q and out must both be float32 or bfloat16");
  Problem p{};
  if (!KindOf(k.element_type(), &p.k.kind) || !KindOf(v.element_type(), &p.v.kind))
    return ffi::Error::InvalidArgument("pocketjax attention: cache of float32, bfloat16, int8 or float8_e4m3fn");
  p.B = qd[0], p.Tq = qd[1], p.Hq = qd[2], p.D = qd[3], p.S = kd[0], p.Hkv = kd[1], p.T = kd[2];
  if (slots.element_count() != p.B || starts.element_count() != p.B || q_lengths.element_count() != p.B)
    return ffi::Error::InvalidArgument("pocketjax attention: slots, starts and q_lengths are [B]");
  if (quantized && (k_scale.element_count() != p.S * p.Hkv * p.T || v_scale.element_count() != p.S * p.Hkv * p.T))
    return ffi::Error::InvalidArgument("pocketjax attention: scales are [S, Hkv, T]");
  p.q = q.untyped_data();
  p.q_bf16 = qt == ffi::DataType::BF16;
  p.k.base = k.untyped_data();
  p.v.base = v.untyped_data();
  p.k.fp8 = p.v.fp8 = Fp8Table();
  p.k_scale = quantized ? k_scale.typed_data() : nullptr;
  p.v_scale = quantized ? v_scale.typed_data() : nullptr;
  p.slots = slots.typed_data();
  p.starts = starts.typed_data();
  p.q_lengths = q_lengths.typed_data();
  p.out = out->untyped_data();
  p.sm_scale = sm_scale;
  p.compute_bf16 = compute_bf16;
  for (int64_t b = 0; b < p.B; ++b)
    if (p.slots[b] < 0 || p.slots[b] >= p.S) return ffi::Error::InvalidArgument("pocketjax attention: slot out of range");
  if (p.B == 0 || p.Tq == 0) return ffi::Error::Success();

  auto s = std::make_shared<Shared>();
  s->problem = p;
  s->blocks_per_row = (p.Tq + kQueryBlock - 1) / kQueryBlock;
  s->units = p.B * p.Hkv * s->blocks_per_row;
  const int64_t threads = pool.num_threads() > 0 ? pool.num_threads() : 1;
  const int64_t helpers = (threads < s->units ? threads : s->units) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([s] { s->Work(); });
  s->Work();
  while (s->done.load(std::memory_order_acquire) < s->units) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PocketjaxAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("quantized")
                                  .Attr<bool>("compute_bf16"));
