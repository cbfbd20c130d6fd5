// y = x W^T for a few rows of x (float32, CPU): the product of a decode step, which is memory-bound. Each tile of
// NB weight rows is read from memory once and multiplied by every row of x (x stays in cache), a vector register's
// floats at a time with GCC's vector extensions, while the next tile's rows are prefetched: with several rows of x
// the multiplications take long enough that the hardware's own prefetch falls behind (docs/results.md, "Few-row
// matrix products on a CPU", measures what it saves).
// A tile's accumulators (NB weight rows x MB input rows of vectors) and its NB weight vectors must fit the vector
// registers, or its multiply-adds spill to the stack and the kernel turns compute-bound: its cost then grows with
// the rows, which is what it exists to avoid (as 4 x 4 tiles of 16-float vectors did on an AVX2 machine, whose 16
// registers hold 8 floats each: docs/results.md, "The few-row kernel on an AVX2 machine"). So the
// build's -march chooses the vector and the tile: AVX-512 has 32 registers (16 accumulators, 4 weight vectors, an
// input's), AVX and SSE 16 (12 accumulators and 4 weight vectors; the input a memory operand of each multiply-add).
// r2lm/ops/few_rows.py builds it and r2lm/ops/linear.py uses it where it measured faster than torch's own products.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // (x86 only: elsewhere, e.g. on ARM, the plain vector code below)
#endif

#if defined(__AVX512F__)
constexpr int LANES = 16, MB = 4;
#elif defined(__AVX__)
constexpr int LANES = 8, MB = 3;
#else
constexpr int LANES = 4, MB = 3;
#endif
constexpr int NB = 4;

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// acc + a * b, fused where the CPU has FMA, in every tile shape alike: the build's -ffp-contract=off keeps GCC from
// fusing (or not) by its own per-loop judgement (r2lm/ops/few_rows.py FLAGS), so this is the one place products fuse
static inline vec madd(vec a, vec b, vec acc) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, acc);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, acc);  // (FMA comes with AVX: 8 lanes)
#else
  return acc + a * b;
#endif
}

static inline float sum(vec v) {
  float s = 0;
  for (int i = 0; i < LANES; i++) s += v[i];
  return s;
}

// out[m0 + i, n0 + j] for i < ROWS, j < COLS: ROWS x COLS accumulators over k's chunks of LANES floats, then the
// tail (each output's sum is the same whatever the row count and the tile it falls in; the prefetch changes no result)
template <int COLS, int ROWS>
static inline void tile(const float* x, const float* w, float* out, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  vec acc[ROWS][COLS];
  for (int i = 0; i < ROWS; i++)
    for (int j = 0; j < COLS; j++) acc[i][j] = (vec){};
  const float* next = w + (n0 + COLS + COLS <= N ? n0 + COLS : n0) * K;  // the next tile's rows (the last: its own)
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    vec a[COLS];
    for (int j = 0; j < COLS; j++) {
      a[j] = load(w + (n0 + j) * K + k);
      __builtin_prefetch(next + j * K + k, 0, 0);
    }
    for (int i = 0; i < ROWS; i++) {
      const vec b = load(x + (m0 + i) * K + k);
      for (int j = 0; j < COLS; j++) acc[i][j] = madd(a[j], b, acc[i][j]);
    }
  }
  for (int i = 0; i < ROWS; i++)
    for (int j = 0; j < COLS; j++) {
      float s = sum(acc[i][j]);
      for (int64_t q = k; q < K; q++) s += w[(n0 + j) * K + q] * x[(m0 + i) * K + q];
      out[(m0 + i) * N + n0 + j] = s;
    }
}

// the rows of x MB at a time, then the ROWS < MB left (ROWS counts down to the remainder: one tile, no loop)
template <int COLS, int ROWS = MB>
static void all_rows(const float* x, const float* w, float* out, int64_t M, int64_t m, int64_t n0, int64_t K,
                     int64_t N) {
  if constexpr (ROWS == MB)
    for (; m + MB <= M; m += MB) tile<COLS, MB>(x, w, out, m, n0, K, N);
  if constexpr (ROWS > 1) {
    if (M - m == ROWS - 1) return tile<COLS, ROWS - 1>(x, w, out, m, n0, K, N);
    all_rows<COLS, ROWS - 1>(x, w, out, M, m, n0, K, N);
  }
}

torch::Tensor few_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "few_rows: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "few_rows: contiguous CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, (N + NB - 1) / NB, 64 / NB, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) {
      const int64_t n0 = b * NB;
      if (n0 + NB <= N) {
        all_rows<NB>(X, W, O, M, 0, n0, K, N);
      } else {
        for (int64_t n = n0; n < N; n++) all_rows<1>(X, W, O, M, 0, n, K, N);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("few_rows", &few_rows, "x W^T for a few rows of x (float32, CPU)"); }
