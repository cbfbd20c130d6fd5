// y = x W^T for a few rows of x (float32, CPU): the product of a decode step, which is memory-bound. Each tile of
// 4 weight rows is read from memory once and multiplied by every row of x (x stays in cache), 16 floats at a time
// with GCC's vector extensions (AVX-512, AVX2 or SSE, whatever the build's -march gives), while the next tile's rows
// are prefetched: with several rows of x the multiplications take long enough that the hardware's own prefetch
// falls behind (docs/results.md, "Few-row matrix products on a CPU", measures what it saves).
// r2lm/ops/few_rows.py builds it and r2lm/ops/linear.py uses it where it measured faster than torch's own products.
#include <ATen/Parallel.h>
#include <torch/extension.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline float sum16(v16 v) {
  float s = 0;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

// out[m0 + i, n0 + j] for i < MB, j < NB: MB x NB accumulators over the 16-float chunks of k, then the tail
// (each output's sum is the same whatever the row count and the tile it falls in; the prefetch changes no result)
template <int NB, int MB>
static inline void tile(const float* x, const float* w, float* out, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) acc[i][j] = (v16){};
  const float* next = w + (n0 + NB + NB <= N ? n0 + NB : n0) * K;  // the next tile's rows (the last tile: its own)
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    v16 a[NB];
    for (int j = 0; j < NB; j++) {
      a[j] = load16(w + (n0 + j) * K + k);
      __builtin_prefetch(next + j * K + k, 0, 0);
    }
    for (int i = 0; i < MB; i++) {
      const v16 b = load16(x + (m0 + i) * K + k);
      for (int j = 0; j < NB; j++) acc[i][j] += a[j] * b;
    }
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) {
      float s = sum16(acc[i][j]);
      for (int64_t q = k; q < K; q++) s += w[(n0 + j) * K + q] * x[(m0 + i) * K + q];
      out[(m0 + i) * N + n0 + j] = s;
    }
}

template <int NB>
static void all_rows(const float* x, const float* w, float* out, int64_t M, int64_t n0, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<NB, 4>(x, w, out, m, n0, K, N);
  switch (M - m) {
    case 3: tile<NB, 3>(x, w, out, m, n0, K, N); break;
    case 2: tile<NB, 2>(x, w, out, m, n0, K, N); break;
    case 1: tile<NB, 1>(x, w, out, m, n0, K, N); break;
    default: break;
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
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) {
      const int64_t n0 = b * 4;
      if (n0 + 4 <= N) {
        all_rows<4>(X, W, O, M, n0, K, N);
      } else {
        for (int64_t n = n0; n < N; n++) all_rows<1>(X, W, O, M, n, K, N);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("few_rows", &few_rows, "x W^T for a few rows of x (float32, CPU)"); }
