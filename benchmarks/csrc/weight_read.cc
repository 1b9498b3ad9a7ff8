// What narrower weights can gain a 1-row product on this CPU (benchmarks/weight_read.py builds and runs this).
// A decode step's weights (shapes on the command line: "N,K" per weight, in step order) are read once per step by
// two threads (each half of every weight's rows), float32 and bfloat16 copies of the same shapes, in these forms:
//   read    - loads summed as integers, nothing else: the ceiling of any product over these bytes, this access order
//   kernel  - skinny_matmul's AVX2 1-row form: 4 weight rows at a time, 8 lanes of FMAs (bf16 widened by a shift)
//   evenodd - bf16 only: 16 weights per load, widened by a shift (even) and a mask (odd), 8 weight rows at a time
//             (the candidate form for the kernel: benchmarks/README.md)
// Forms alternate within each repeat, so load on a shared machine moves them together. One line of JSON per form.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define PJ_AVX2 __attribute__((target("avx2,fma")))

namespace {

using Fn = void (*)(const void* w, const float* x, float* y, int64_t n0, int64_t n1, int64_t K);

PJ_AVX2 float Hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename WT, int NB>
PJ_AVX2 void Read(const void* wp, const float*, float* y, int64_t n0, int64_t n1, int64_t K) {
  constexpr int64_t step = 32 / sizeof(WT);
  for (int64_t n = n0; n + NB <= n1; n += NB) {
    const WT* w = static_cast<const WT*>(wp) + n * K;
    __m256i acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += step)
      for (int b = 0; b < NB; ++b)
        acc[b] = _mm256_add_epi32(acc[b], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * K + k)));
    for (int b = 0; b < NB; ++b) y[n + b] = static_cast<float>(_mm256_extract_epi32(acc[b], 0));
  }
}

PJ_AVX2 inline __m256 Widen(const float* p) { return _mm256_loadu_ps(p); }
PJ_AVX2 inline __m256 Widen(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename WT, int NB>
PJ_AVX2 void Kernel(const void* wp, const float* x, float* y, int64_t n0, int64_t n1, int64_t K) {
  for (int64_t n = n0; n + NB <= n1; n += NB) {
    const WT* w = static_cast<const WT*>(wp) + n * K;
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      __m256 xv = _mm256_loadu_ps(x + k);
      for (int b = 0; b < NB; ++b) acc[b] = _mm256_fmadd_ps(Widen(w + b * K + k), xv, acc[b]);
    }
    for (int b = 0; b < NB; ++b) y[n + b] = Hsum(acc[b]);
  }
}

template <int NB>
PJ_AVX2 void EvenOdd(const void* wp, const float* x, float* y, int64_t n0, int64_t n1, int64_t K) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t n = n0; n + NB <= n1; n += NB) {
    const uint16_t* w = static_cast<const uint16_t*>(wp) + n * K;
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {  // x as [x0 x2 .. x14, x1 x3 .. x15] per 16 (timing only: not permuted)
      __m256 even = _mm256_loadu_ps(x + k), odd = _mm256_loadu_ps(x + k + 8);
      for (int b = 0; b < NB; ++b) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * K + k));
        acc[b] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), even, acc[b]);
        acc[b] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), odd, acc[b]);
      }
    }
    for (int b = 0; b < NB; ++b) y[n + b] = Hsum(acc[b]);
  }
}

// The calling thread takes the first half of a weight's rows, one spinning helper the second (a pool that never
// sleeps: its hand-off costs microseconds per weight, nothing beside the reads).
struct Pair {
  std::atomic<int> posted{0}, finished{0};
  Fn fn = nullptr;
  const void* w = nullptr;
  const float* x = nullptr;
  float* y = nullptr;
  int64_t N = 0, K = 0;
  bool stop = false;
  std::thread helper;

  int64_t Half() const { return N / 2 / 16 * 16; }
  Pair() {
    helper = std::thread([this] {
      for (int seen = 1;; ++seen) {
        while (posted.load(std::memory_order_acquire) < seen) _mm_pause();
        if (stop) return;
        fn(w, x, y, Half(), N, K);
        finished.fetch_add(1, std::memory_order_release);
      }
    });
  }
  ~Pair() {
    stop = true;
    posted.fetch_add(1, std::memory_order_release);
    helper.join();
  }
  void Run(Fn f, const void* w_, const float* x_, float* y_, int64_t N_, int64_t K_) {
    fn = f, w = w_, x = x_, y = y_, N = N_, K = K_;
    const int before = finished.load(std::memory_order_acquire);
    posted.fetch_add(1, std::memory_order_release);
    f(w, x, y, 0, Half(), K);
    while (finished.load(std::memory_order_acquire) == before) _mm_pause();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::fprintf(stderr, "usage: weight_read REPEATS N,K [N,K ...] (needs AVX2 + FMA)\n");
    return 2;
  }
  const int repeats = std::atoi(argv[1]);
  std::vector<std::pair<int64_t, int64_t>> shapes;
  int64_t max_k = 0, max_n = 0, weights = 0;
  for (int i = 2; i < argc; ++i) {
    long long n = 0, k = 0;
    if (std::sscanf(argv[i], "%lld,%lld", &n, &k) != 2 || n < 32 || k < 16 || k % 16) {
      std::fprintf(stderr, "bad shape %s: N >= 32, K a multiple of 16\n", argv[i]);
      return 2;
    }
    shapes.emplace_back(n, k);
    max_k = std::max<int64_t>(max_k, k), max_n = std::max<int64_t>(max_n, n), weights += n * k;
  }
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<uint16_t>> bf16;
  for (auto [n, k] : shapes) {
    f32.emplace_back(n * k);
    bf16.emplace_back(n * k);
    for (int64_t i = 0; i < n * k; ++i) {  // values in [0.5, 1): bf16 is their top half exactly
      f32.back()[i] = 0.5f + static_cast<float>(i % 251) / 512.f;
      bf16.back()[i] = static_cast<uint16_t>(0x3f00 + i % 128);
    }
  }
  std::vector<float> x(max_k, 0.5f), y(max_n);
  struct Form { const char* name; const char* dtype; Fn fn; };
  const Form forms[] = {{"read", "float32", Read<float, 4>}, {"kernel", "float32", Kernel<float, 4>},
                        {"read", "bfloat16", Read<uint16_t, 4>}, {"kernel", "bfloat16", Kernel<uint16_t, 4>},
                        {"evenodd", "bfloat16", EvenOdd<8>}};
  constexpr int kForms = sizeof(forms) / sizeof(forms[0]);
  std::vector<double> ms[kForms];
  Pair pair;
  for (int rep = -1; rep < repeats; ++rep)  // rep -1 warms up
    for (int f = 0; f < kForms; ++f) {
      const bool narrow = forms[f].dtype[0] == 'b';
      const auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < shapes.size(); ++i)
        pair.Run(forms[f].fn, narrow ? static_cast<const void*>(bf16[i].data()) : f32[i].data(), x.data(), y.data(),
                 shapes[i].first, shapes[i].second);
      const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - t0;
      if (rep >= 0) ms[f].push_back(took.count());
    }
  for (int f = 0; f < kForms; ++f) {
    std::sort(ms[f].begin(), ms[f].end());
    const double bytes = static_cast<double>(weights) * (forms[f].dtype[0] == 'b' ? 2 : 4);
    std::printf("{\"form\": \"%s\", \"dtype\": \"%s\", \"median_ms\": %.3f, \"min_ms\": %.3f, \"GB\": %.4f}\n",
                forms[f].name, forms[f].dtype, ms[f][ms[f].size() / 2], ms[f][0], bytes / 1e9);
  }
  return 0;
}
