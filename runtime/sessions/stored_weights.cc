// ONNX Runtime CPU custom ops that multiply by weights kept as the checkpoint stores them (runtime/sessions/
// stored_weights.py rewrites an engine's graph to use them, and builds this file).
//
//   v4engine.cpu::E4m3MatMul(X [..., K] float, W [N, K] uint8 e4m3 bytes, S [N, K / block] float) -> [..., N]
//   v4engine.cpu::Bf16MatMul(X [..., K] float, W [N, K] uint16 bf16 bits)                          -> [..., N]
//   (and, below, v4engine.cpu::Mxfp4MoE for the routed experts, v4engine.cpu::HcSinkhorn for mHC's Sinkhorn and
//   v4engine.cpu::StoredRows for the embedding's rows, read from its file)
//
// With the attribute groups = G > 1, W's rows are G weights of N / G rows each (V4's grouped wo_a) and X is [G, M, K]
// (group g's rows) or [M, K] / [1, M, K] (every group's): Y [G, M, N / G], group g's rows times its weight.
//
// Y = X W^T with W widened exactly inside the kernel: an e4m3 value times its block's scale, or a bf16 value, is a
// float32 exactly, the very value ONNX Runtime's DequantizeLinear or Cast would have made, so only the order of the
// float32 sums differs from the stock MatMul over widened weights. ONNX Runtime's stock CPU kernels take float32
// weights only (MLAS's SGEMM): 4 bytes a weight read per token where the checkpoint stores 1 or 2.
//
// The output columns are split into tasks of about TASK_WEIGHTS weights over ONNX Runtime's intra-op pool
// (KernelContext_ParallelFor). Up to 8 rows of X (a decode, a verify at batch 1) multiply ROWS weight rows at a time
// as they widen, in vector accumulators: each stored byte is read once per call. Up to PANEL_FROM rows widen ROWS
// weight rows into a float32 buffer first, which ROWS_X rows of X at a time multiply as dot products; more (a batch's
// verify, a prefill chunk) widen PANEL weight rows into a panel transposed 16 x 16 in registers, which BLOCK_X rows
// of X at a time multiply as an SGEMM's kernel does (each input broadcast against a panel row). One widening serves
// every token of the call. Those products run at 0.5-1.05 times MLAS's SGEMM over float32 weights here (24 to 256
// rows): a prefill pays a little for what a decode saves.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <immintrin.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

namespace {

constexpr int64_t LANES = 16;     // floats in a vector
constexpr int64_t ROWS = 4;       // weight rows (output columns) widened together
constexpr int64_t ROWS_X = 6;     // rows of X per pass over a widened group: 6 x 4 accumulators in registers
constexpr int64_t PANEL_FROM = 16;   // more rows of X than this: transposed panels (their making pays from about here)
constexpr int64_t PANEL = 32;     // output columns widened together for many rows of X (two vectors)
constexpr int64_t BLOCK_X = 12;   // rows of X per pass over a panel: 12 x 2 accumulators in registers
constexpr int64_t TASK_WEIGHTS = 1 << 16;   // weights per task of the intra-op pool, about (fewer tasks, less overhead)

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint8_t vb __attribute__((vector_size(LANES)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float v) { return vf{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

// 16 e4m3 bytes (1 sign, 4 exponent bits of bias 7, 3 mantissa bits) as floats 2^-8 times their value: the bits
// moved into a half's places (5 exponent bits of bias 15, 10 mantissa bits) make a half of that value exactly, the
// subnormals (exponent 0, m 2^-9) included, and the CPU widens halves to floats exactly. The 2^8 goes into the
// block's scale. S.1111.111 (NaN) would read as 240: a weight holding it is not given to these kernels (the
// rewrite checks).
inline vf e4m3_over_256(const uint8_t* p) {
  vb bytes; std::memcpy(&bytes, p, sizeof bytes);
  vh b = __builtin_convertvector(bytes, vh);
  vh bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8);
  __m256i halves; std::memcpy(&halves, &bits, sizeof halves);
#if defined(__AVX512F__)
  return (vf)_mm512_maskz_cvtph_ps(0xFFFF, halves);        // (the unmasked forms trip a spurious GCC warning)
#else      // F16C: two halves of eight (GCC widens a _Float16 vector one lane at a time)
  __m256 low = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  __m256 high = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
  vf out; std::memcpy(&out, &low, 32); std::memcpy(reinterpret_cast<char*>(&out) + 32, &high, 32);
  return out;
#endif
}

inline float e4m3_scalar(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  float v = (b & 0x7F) == 0x7F ? NAN : e == 0 ? m / 512.0f : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

inline vf bf16(const uint16_t* p) {
  vh half; std::memcpy(&half, p, sizeof half);
  return (vf)(__builtin_convertvector(half, vi) << 16);
}

inline float from_bits(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

inline float bf16_scalar(uint16_t h) { return from_bits(uint32_t(h) << 16); }

// The weight rows of each format, 16 columns at a time (`chunk`, k a multiple of 16 inside one scale block) or one
// (`at`), widened to the float32 values DequantizeLinear or Cast makes.
struct E4m3Rows {
  const uint8_t* w;
  const float* scale;      // [N, blocks]
  int64_t K, block, blocks;
  vf chunk(int64_t n, int64_t k) const {
    return e4m3_over_256(w + n * K + k) * (scale[n * blocks + k / block] * 256.0f);
  }
  float at(int64_t n, int64_t k) const { return e4m3_scalar(w[n * K + k]) * scale[n * blocks + k / block]; }
};

struct Bf16Rows {
  const uint16_t* w;
  int64_t K;
  vf chunk(int64_t n, int64_t k) const { return bf16(w + n * K + k); }
  float at(int64_t n, int64_t k) const { return bf16_scalar(w[n * K + k]); }
};

// MXFP4: two e2m1 codes a byte, the low nibble first, and an E8M0 exponent e per 32 weights (scale 2^(e-127); the
// rewrite leaves weights holding e = 0 or 255 with the stock kernels). e2m1 codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6;
// 8-15 their negatives: a 16-entry table, looked up 16 lanes at once.
constexpr float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float e8m0_scale(uint8_t e) { return from_bits(uint32_t(e) << 23); }

struct Mxfp4Rows {
  const uint8_t* w;        // [N, K / 2]
  const uint8_t* e8m0;     // [N, K / 32]
  int64_t K;
  vf chunk(int64_t n, int64_t k) const {
    const uint8_t* p = w + (n * K + k) / 2;
    float scale = e8m0_scale(e8m0[(n * K + k) / 32]);
#if defined(__AVX512F__)
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(15));
    __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
    __m512i codes = _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_unpacklo_epi8(low, high));      // low nibble first
    return (vf)_mm512_maskz_permutexvar_ps(0xFFFF, codes, _mm512_loadu_ps(E2M1)) * scale;
#else
    vf out;
    for (int i = 0; i < LANES; ++i) out[i] = E2M1[(p[i / 2] >> (4 * (i % 2))) & 15] * scale;
    return out;
#endif
  }
  float at(int64_t n, int64_t k) const {
    int64_t i = n * K + k;
    return E2M1[(w[i / 2] >> (4 * (i % 2))) & 15] * e8m0_scale(e8m0[i / 32]);
  }
};

inline float sum(vf v) {
  float s = 0;
  for (int i = 0; i < LANES; ++i) s += v[i];
  return s;
}

// Y[m, n0 + j] for m < R, j < rows (at most J), the weights widened as they are read: X's R rows against J weight
// rows in R x J accumulators (at most 16 of the 32 vector registers). What a decode and a verify take (M <= 8).
template <int64_t R, int64_t J, class Rows>
void fused(const float* x, int64_t K, const Rows& w, int64_t n0, int64_t rows, float* y, int64_t N) {
  int64_t body = K - K % LANES;
  vf acc[R][J] = {};
  for (int64_t k = 0; k < body; k += LANES) {
    vf wk[J];
    for (int64_t j = 0; j < J; ++j) wk[j] = j < rows ? w.chunk(n0 + j, k) : vf{};
    for (int64_t r = 0; r < R; ++r) {
      vf xv = load(x + r * K + k);
      for (int64_t j = 0; j < J; ++j) acc[r][j] += xv * wk[j];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < rows; ++j) {
      float s = sum(acc[r][j]);
      for (int64_t k = body; k < K; ++k) s += x[r * K + k] * w.at(n0 + j, k);
      y[r * N + n0 + j] = s;
    }
}

// ROWS columns for R rows of X, R x ROWS accumulators at most 16: in one pass, or two of ROWS / 2 columns.
template <int64_t R, class Rows>
void fused_columns(const float* x, int64_t K, const Rows& w, int64_t n0, int64_t rows, float* y, int64_t N) {
  if constexpr (R * ROWS <= 16) {
    fused<R, ROWS>(x, K, w, n0, rows, y, N);
  } else {
    constexpr int64_t half = ROWS / 2;
    fused<R, half>(x, K, w, n0, std::min(rows, half), y, N);
    if (rows > half) fused<R, half>(x, K, w, n0 + half, rows - half, y, N);
  }
}

// ROWS output columns for 9 to PANEL_FROM rows of X (a verify at batch 2): the ROWS weight rows widened once into
// `wide` (stride K), then ROWS_X rows of X at a time against them, as dot products (no transposed panel to make).
template <int64_t R>
void buffered(const float* x, int64_t M, int64_t K, const float* wide, int64_t rows, float* y, int64_t N, int64_t n0) {
  int64_t body = K - K % LANES;
  int64_t m = 0;
  for (; m + R <= M; m += R) {
    vf acc[R][ROWS] = {};
    for (int64_t k = 0; k < body; k += LANES) {
      vf w[ROWS];
      for (int64_t j = 0; j < ROWS; ++j) w[j] = load(wide + j * K + k);
      for (int64_t r = 0; r < R; ++r) {
        vf xv = load(x + (m + r) * K + k);
        for (int64_t j = 0; j < ROWS; ++j) acc[r][j] += xv * w[j];
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < rows; ++j) {
        float s = sum(acc[r][j]);
        for (int64_t k = body; k < K; ++k) s += x[(m + r) * K + k] * wide[j * K + k];
        y[(m + r) * N + n0 + j] = s;
      }
  }
  if (m < M) buffered<1>(x + m * K, M - m, K, wide, rows, y + m * N, N, n0);
}

template <class Rows>
void widened(const float* x, int64_t M, int64_t K, const Rows& w, int64_t n0, int64_t rows, float* y, int64_t N) {
  thread_local std::vector<float> wide;
  if (int64_t(wide.size()) < ROWS * K) wide.resize(ROWS * K);
  int64_t body = K - K % LANES;
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t k = 0; k < body; k += LANES) store(wide.data() + j * K + k, w.chunk(n0 + j, k));
    for (int64_t k = body; k < K; ++k) wide[j * K + k] = w.at(n0 + j, k);
  }
  buffered<ROWS_X>(x, M, K, wide.data(), rows, y, N, n0);
}

// Columns [n0, n0 + cols), cols <= PANEL, for more than PANEL_FROM rows of X (a prefill chunk): the weight
// rows widened once into `panel`, transposed ([K, PANEL]: a row of it holds one input's weights for every column),
// then BLOCK_X rows of X at a time, each input broadcast against the panel's row into BLOCK_X x PANEL / 16 vector
// accumulators: every widened weight serves all M rows from the core's cache, as in an SGEMM.
template <int64_t R>
void panel_product(const float* x, int64_t K, const float* panel, int64_t cols, float* y, int64_t N, int64_t n0) {
  constexpr int64_t V = PANEL / LANES;
  vf acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    vf w[V];
    for (int64_t v = 0; v < V; ++v) w[v] = load(panel + k * PANEL + v * LANES);
    for (int64_t r = 0; r < R; ++r) {
      vf xv = splat(x[r * K + k]);
      for (int64_t v = 0; v < V; ++v) acc[r][v] += xv * w[v];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float out[PANEL];
    for (int64_t v = 0; v < V; ++v) store(out + v * LANES, acc[r][v]);
    std::memcpy(y + r * N + n0, out, sizeof(float) * cols);
  }
}

// A 16 x 16 block in registers transposed: r[i] lane j becomes r[j] lane i (three rounds of interleaving pairs:
// 32-bit elements, 64-bit pairs, then 128-bit quarters twice; lane by lane without AVX-512).
inline void transpose16(vf r[LANES]) {
  vf t[LANES];
#if defined(__AVX512F__)
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 2; ++h) {
      __m512d a = _mm512_castps_pd(t[4 * i + h]), b = _mm512_castps_pd(t[4 * i + h + 2]);
      r[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
#else
  for (int i = 0; i < LANES; ++i)
    for (int j = 0; j < LANES; ++j) t[i][j] = r[j][i];
  for (int i = 0; i < LANES; ++i) r[i] = t[i];
#endif
}

template <class Rows>
void paneled(const float* x, int64_t M, int64_t K, const Rows& w, int64_t n0, int64_t cols, float* y, int64_t N) {
  thread_local std::vector<float> panel;
  if (int64_t(panel.size()) < K * PANEL) panel.assign(K * PANEL, 0.0f);
  int64_t body = K - K % LANES;
  for (int64_t j0 = 0; j0 < PANEL; j0 += LANES) {      // 16 columns at a time, 16 inputs of each transposed at once
    for (int64_t k = 0; k < body; k += LANES) {
      vf block[LANES];
      for (int64_t j = 0; j < LANES; ++j)              // past the last column: zeros, never written out
        block[j] = j0 + j < cols ? w.chunk(n0 + j0 + j, k) : vf{};
      transpose16(block);
      for (int64_t i = 0; i < LANES; ++i) store(panel.data() + (k + i) * PANEL + j0, block[i]);
    }
    for (int64_t k = body; k < K; ++k)
      for (int64_t j = j0; j < j0 + LANES; ++j) panel[k * PANEL + j] = j < cols ? w.at(n0 + j, k) : 0.0f;
  }
  int64_t m = 0;
  for (; m + BLOCK_X <= M; m += BLOCK_X) panel_product<BLOCK_X>(x + m * K, K, panel.data(), cols, y + m * N, N, n0);
  x += m * K, y += m * N;
  switch (M - m) {        // the last M % BLOCK_X rows in one pass (one at a time, each would wait on its sums)
    case 0: return;
    case 1: return panel_product<1>(x, K, panel.data(), cols, y, N, n0);
    case 2: return panel_product<2>(x, K, panel.data(), cols, y, N, n0);
    case 3: return panel_product<3>(x, K, panel.data(), cols, y, N, n0);
    case 4: return panel_product<4>(x, K, panel.data(), cols, y, N, n0);
    case 5: return panel_product<5>(x, K, panel.data(), cols, y, N, n0);
    case 6: return panel_product<6>(x, K, panel.data(), cols, y, N, n0);
    case 7: return panel_product<7>(x, K, panel.data(), cols, y, N, n0);
    case 8: return panel_product<8>(x, K, panel.data(), cols, y, N, n0);
    case 9: return panel_product<9>(x, K, panel.data(), cols, y, N, n0);
    case 10: return panel_product<10>(x, K, panel.data(), cols, y, N, n0);
    default: return panel_product<11>(x, K, panel.data(), cols, y, N, n0);
  }
}

// ROWS output columns for up to 8 rows of X (a decode, a verify of k + 1 at batch 1).
template <class Rows>
void fused_rows(const float* x, int64_t M, int64_t K, const Rows& w, int64_t n0, int64_t rows, float* y, int64_t N) {
  switch (M) {
    case 1: return fused_columns<1>(x, K, w, n0, rows, y, N);
    case 2: return fused_columns<2>(x, K, w, n0, rows, y, N);
    case 3: return fused_columns<3>(x, K, w, n0, rows, y, N);
    case 4: return fused_columns<4>(x, K, w, n0, rows, y, N);
    case 5: return fused_columns<5>(x, K, w, n0, rows, y, N);
    case 6: return fused_columns<6>(x, K, w, n0, rows, y, N);
    case 7: return fused_columns<7>(x, K, w, n0, rows, y, N);
    default: return fused_columns<8>(x, K, w, n0, rows, y, N);
  }
}

template <class Rows>
void columns(const float* x, int64_t M, int64_t K, const Rows& w, int64_t first, int64_t last, float* y, int64_t N) {
  if (M > PANEL_FROM) {
    for (int64_t n0 = first; n0 < last; n0 += PANEL) paneled(x, M, K, w, n0, std::min(PANEL, last - n0), y, N);
    return;
  }
  for (int64_t n0 = first; n0 < last; n0 += ROWS) {
    int64_t rows = std::min(ROWS, last - n0);
    if (M > 8) widened(x, M, K, w, n0, rows, y, N);
    else fused_rows(x, M, K, w, n0, rows, y, N);
  }
}

struct Work {
  const float* x;
  float* y;
  int64_t M, K, N, span;          // span: output columns per task
  E4m3Rows e4m3;
  Bf16Rows bf16;
  bool is_e4m3;
};

// Output columns per task: about TASK_WEIGHTS weights, whole panels.
inline int64_t task_span(int64_t K) { return std::max<int64_t>(PANEL, TASK_WEIGHTS / K / PANEL * PANEL); }

// One task: `span` output columns.
void task(void* data, size_t index) {
  const Work& work = *static_cast<const Work*>(data);
  int64_t first = int64_t(index) * work.span, last = std::min(work.N, first + work.span);
  if (work.is_e4m3) columns(work.x, work.M, work.K, work.e4m3, first, last, work.y, work.N);
  else columns(work.x, work.M, work.K, work.bf16, first, last, work.y, work.N);
}

struct Kernel {
  bool is_e4m3;
  int64_t block = 0, groups = 1;

  Kernel(const OrtKernelInfo* info, bool e4m3) : is_e4m3(e4m3) {
    Ort::ConstKernelInfo kernel(info);
    if (e4m3) block = kernel.GetAttribute<int64_t>("block_size");
    try {
      groups = kernel.GetAttribute<int64_t>("groups");
    } catch (const Ort::Exception&) {     // not given: one group
    }
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    Ort::ConstValue X = context.GetInput(0), W = context.GetInput(1);
    std::vector<int64_t> xs = X.GetTensorTypeAndShapeInfo().GetShape(), ws = W.GetTensorTypeAndShapeInfo().GetShape();
    if (ws.size() != 2 || xs.empty() || xs.back() != ws[1] || groups < 1 || ws[0] % groups)
      ORT_CXX_API_THROW("v4engine.cpu matmul: X [..., K] and W [N, K] (N a multiple of groups) disagree",
                        ORT_INVALID_ARGUMENT);
    bool shared = groups == 1 || xs.size() == 2 || (xs.size() == 3 && xs[0] == 1);    // every group reads all of X
    if (groups > 1 && !shared && (xs.size() != 3 || xs[0] != groups))
      ORT_CXX_API_THROW("v4engine.cpu matmul: grouped X is not [groups, M, K], [M, K] or [1, M, K]",
                        ORT_INVALID_ARGUMENT);
    Work work{};
    work.K = ws[1];
    work.N = ws[0] / groups;
    work.M = 1;
    for (size_t i = groups > 1 && xs.size() == 3 ? 1 : 0; i + 1 < xs.size(); ++i) work.M *= xs[i];
    work.is_e4m3 = is_e4m3;
    int64_t blocks = 0;
    if (is_e4m3) {
      std::vector<int64_t> ss = context.GetInput(2).GetTensorTypeAndShapeInfo().GetShape();
      blocks = block > 0 ? (work.K + block - 1) / block : 0;
      if (block <= 0 || block % LANES || ss.size() != 2 || ss[0] != ws[0] || ss[1] != blocks)
        ORT_CXX_API_THROW("E4m3MatMul: block_size is not a multiple of 16, or S is not [N, ceil(K / block_size)]",
                          ORT_INVALID_ARGUMENT);
    }
    std::vector<int64_t> ys(xs.begin(), xs.end() - 1);
    if (groups > 1) ys = {groups, work.M};
    ys.push_back(work.N);
    Ort::UnownedValue Y = context.GetOutput(0, ys);
    if (work.M == 0 || work.N == 0) return;
    if (work.K == 0) {
      std::memset(Y.GetTensorMutableData<float>(), 0, sizeof(float) * groups * work.M * work.N);
      return;
    }
    work.span = task_span(work.K);
    size_t tasks = size_t((work.N + work.span - 1) / work.span);
    for (int64_t g = 0; g < groups; ++g) {       // group g: its rows of X (or all of X), its N rows of W
      work.x = X.GetTensorData<float>() + (shared ? 0 : g * work.M * work.K);
      work.y = Y.GetTensorMutableData<float>() + g * work.M * work.N;
      if (is_e4m3)
        work.e4m3 = {W.GetTensorData<uint8_t>() + g * work.N * work.K,
                     context.GetInput(2).GetTensorData<float>() + g * work.N * blocks, work.K, block, blocks};
      else
        work.bf16 = {W.GetTensorData<uint16_t>() + g * work.N * work.K, work.K};
      Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(raw, task, tasks, 0, &work));
    }
  }
};

// v4engine.cpu::Mxfp4MoE(X [T, D] float, mixing [T, E] float, then for each expert e: w1, s1, w3, s3, w2, s2) -> [T, D]
// V4's routed experts over MXFP4 weights as stored: w1, w3 [I, D] (gate, up) and w2 [D, I] as packed bytes (any
// integer type of the right size: uint16 [1, I, D / 4] as the engine holds them), s* their E8M0 bytes [1, rows, cols /
// 32]. Token t runs expert e where mixing[t, e] > 1e-8 (QMoE's rule), and Y[t] = sum over them of mixing[t, e] *
// w2 (silu(min(w1 x, L)) * clamp(w3 x, -L, L)), L = swiglu_limit. Every expert's tokens run together: the gate and up
// rows in one pass of tasks over (expert, columns), then the down rows in another.
struct Expert {
  Mxfp4Rows w1, w3, w2;
  std::vector<int64_t> tokens;
  std::vector<float> x, gate, up, out;       // its tokens' rows of X [m, D]; [m, I] twice; [m, D]
};

struct MoeWork {
  std::vector<Expert*> active;
  std::vector<std::array<int64_t, 3>> tasks;   // (expert in `active`, first column, last column)
  int64_t D, I;
  float limit;
  bool down;                                   // the second pass
};

void moe_task(void* data, size_t index) {
  const MoeWork& work = *static_cast<const MoeWork*>(data);
  auto [which, first, last] = work.tasks[index];
  Expert& e = *work.active[which];
  int64_t m = int64_t(e.tokens.size());
  if (!work.down) {
    columns(e.x.data(), m, work.D, e.w1, first, last, e.gate.data(), work.I);
    columns(e.x.data(), m, work.D, e.w3, first, last, e.up.data(), work.I);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = first; c < last; ++c) {
        float g = std::min(e.gate[r * work.I + c], work.limit), u = std::clamp(e.up[r * work.I + c], -work.limit,
                                                                               work.limit);
        e.gate[r * work.I + c] = g / (1.0f + std::exp(-g)) * u;
      }
  } else {
    columns(e.gate.data(), m, work.I, e.w2, first, last, e.out.data(), work.D);
  }
}

struct MoeKernel {
  float limit;

  explicit MoeKernel(const OrtKernelInfo* info)
      : limit(Ort::ConstKernelInfo(info).GetAttribute<float>("swiglu_limit")) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    Ort::ConstValue X = context.GetInput(0), mixing = context.GetInput(1);
    std::vector<int64_t> xs = X.GetTensorTypeAndShapeInfo().GetShape();
    std::vector<int64_t> ms = mixing.GetTensorTypeAndShapeInfo().GetShape();
    size_t inputs = context.GetInputCount();
    if (xs.size() != 2 || ms.size() != 2 || ms[0] != xs[0] || (inputs - 2) % 6 || int64_t(inputs - 2) / 6 != ms[1])
      ORT_CXX_API_THROW("Mxfp4MoE: X [T, D], mixing [T, E] and six weights per expert disagree", ORT_INVALID_ARGUMENT);
    int64_t T = xs[0], D = xs[1], E = ms[1];
    MoeWork work{};
    work.D = D;
    work.limit = limit;
    std::vector<Expert> experts(E);
    auto bytes = [&](size_t index, int64_t rows, int64_t cols, int64_t per_byte) {
      Ort::ConstValue v = context.GetInput(index);
      Ort::TensorTypeAndShapeInfo info = v.GetTensorTypeAndShapeInfo();
      int64_t count = int64_t(info.GetElementCount()), width = 0;
      switch (info.GetElementType()) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: width = 1; break;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: width = 2; break;
        default: ORT_CXX_API_THROW("Mxfp4MoE: weights must be 8- or 16-bit integers", ORT_INVALID_ARGUMENT);
      }
      if (count * width != rows * cols / per_byte)
        ORT_CXX_API_THROW("Mxfp4MoE: an expert's weight or scale has the wrong size", ORT_INVALID_ARGUMENT);
      return static_cast<const uint8_t*>(v.GetTensorRawData());
    };
    Ort::ConstValue first_w1 = context.GetInput(2);
    std::vector<int64_t> w1s = first_w1.GetTensorTypeAndShapeInfo().GetShape();
    work.I = w1s.size() == 3 ? w1s[1] : 0;
    int64_t I = work.I;
    if (I <= 0 || D % 32 || I % 32)
      ORT_CXX_API_THROW("Mxfp4MoE: the experts' widths must be multiples of 32", ORT_INVALID_ARGUMENT);
    for (int64_t e = 0; e < E; ++e) {
      size_t at = 2 + 6 * size_t(e);
      experts[e].w1 = {bytes(at, I, D, 2), bytes(at + 1, I, D, 32), D};
      experts[e].w3 = {bytes(at + 2, I, D, 2), bytes(at + 3, I, D, 32), D};
      experts[e].w2 = {bytes(at + 4, D, I, 2), bytes(at + 5, D, I, 32), I};
    }
    const float* x = X.GetTensorData<float>();
    const float* mix = mixing.GetTensorData<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        if (mix[t * E + e] > 1e-8f) experts[e].tokens.push_back(t);
    for (Expert& e : experts) {
      int64_t m = int64_t(e.tokens.size());
      if (!m) continue;
      e.x.resize(m * D);
      for (int64_t r = 0; r < m; ++r) std::memcpy(&e.x[r * D], x + e.tokens[r] * D, sizeof(float) * D);
      e.gate.resize(m * I);
      e.up.resize(m * I);
      e.out.resize(m * D);
      work.active.push_back(&e);
    }
    for (bool down : {false, true}) {
      int64_t N = down ? D : I, K = down ? I : D;
      int64_t span = task_span(K);
      work.tasks.clear();
      for (size_t a = 0; a < work.active.size(); ++a)
        for (int64_t c = 0; c < N; c += span) work.tasks.push_back({int64_t(a), c, std::min(N, c + span)});
      work.down = down;
      if (!work.tasks.empty())
        Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(raw, moe_task, work.tasks.size(), 0, &work));
    }
    float* y = context.GetOutput(0, xs).GetTensorMutableData<float>();
    std::memset(y, 0, sizeof(float) * T * D);
    for (Expert& e : experts)                  // expert by expert, as the stock kernel sums
      for (size_t r = 0; r < e.tokens.size(); ++r) {
        int64_t t = e.tokens[r];
        float weight = mix[t * E + (&e - experts.data())];
        for (int64_t c = 0; c < D; ++c) y[t * D + c] += weight * e.out[r * D + c];
      }
  }
};

struct MoeOp : Ort::CustomOpBase<MoeOp, MoeKernel> {
  void* CreateKernel(const OrtApi&, const OrtKernelInfo* info) const { return new MoeKernel(info); }
  const char* GetName() const { return "Mxfp4MoE"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index < 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index < 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_VARIADIC;
  }
  int GetVariadicInputMinArity() const { return 6; }
  bool GetVariadicInputHomogeneity() const { return false; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

MoeOp moe_op;

// v4engine.cpu::HcSinkhorn(comb [..., N, N] float) -> [..., N, N]: mHC's Sinkhorn (plugins/sinkhorn.py), `rounds`
// rounds of rows then columns, each divided by its sum + eps, in one node where the engine's function inlines to an
// ONNX Loop of six nodes a round (about 70 us a call at one token on this CPU, most of it the Loop's own).
struct SinkhornWork {
  float* y;
  int64_t n, matrices, span, rounds;
  float eps;
};

void sinkhorn_task(void* data, size_t index) {
  const SinkhornWork& work = *static_cast<const SinkhornWork*>(data);
  int64_t n = work.n, last = std::min(work.matrices, int64_t(index + 1) * work.span);
  for (int64_t m = int64_t(index) * work.span; m < last; ++m) {
    float* a = work.y + m * n * n;
    for (int64_t r = 0; r < work.rounds; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) sum += a[i * n + j];
        float den = sum + work.eps;
        for (int64_t j = 0; j < n; ++j) a[i * n + j] /= den;
      }
      for (int64_t j = 0; j < n; ++j) {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += a[i * n + j];
        float den = sum + work.eps;
        for (int64_t i = 0; i < n; ++i) a[i * n + j] /= den;
      }
    }
  }
}

struct SinkhornKernel {
  int64_t rounds;
  float eps;

  SinkhornKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel(info);
    rounds = kernel.GetAttribute<int64_t>("rounds");
    eps = kernel.GetAttribute<float>("eps");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    Ort::ConstValue X = context.GetInput(0);
    std::vector<int64_t> shape = X.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() < 2 || shape.back() != shape[shape.size() - 2] || rounds < 0)
      ORT_CXX_API_THROW("HcSinkhorn: comb is not [..., N, N], or rounds is negative", ORT_INVALID_ARGUMENT);
    SinkhornWork work{};
    work.n = shape.back();
    work.matrices = 1;
    for (size_t i = 0; i + 2 < shape.size(); ++i) work.matrices *= shape[i];
    work.rounds = rounds;
    work.eps = eps;
    Ort::UnownedValue Y = context.GetOutput(0, shape);
    work.y = Y.GetTensorMutableData<float>();
    size_t total = size_t(work.matrices * work.n * work.n);
    if (total == 0) return;
    std::memcpy(work.y, X.GetTensorData<float>(), sizeof(float) * total);
    work.span = 64;                 // matrices per task: a decode's few in one, a prefill chunk's over the pool
    size_t tasks = size_t((work.matrices + work.span - 1) / work.span);
    if (tasks == 1) sinkhorn_task(&work, 0);
    else Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(raw, sinkhorn_task, tasks, 0, &work));
  }
};

struct SinkhornOp : Ort::CustomOpBase<SinkhornOp, SinkhornKernel> {
  void* CreateKernel(const OrtApi&, const OrtKernelInfo* info) const { return new SinkhornKernel(info); }
  const char* GetName() const { return "HcSinkhorn"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

SinkhornOp sinkhorn_op;

// v4engine.cpu::StoredRows(ids int64 or int32 [...]) -> [..., columns] float: rows of a table (the embedding,
// float32 or bf16) that lies in a weight file at `offset`, read from the file with pread instead of through its
// memory map. A token touches one row of the table, but a page fault on a mapped file maps the pages around it too
// (the kernel's fault-around, 64 KiB), so after a few hundred distinct tokens most of the table is resident (26 of
// the slice's 32 MiB after four 200-token prompts); read here, a row costs a copy from the page cache and the table
// never enters the process. The file is opened once, and must be the very file the runtime's checks opened and
// mapped (`device`, `inode` and `file_bytes` as fstat gave them there: contract/engine_folder.py).
struct RowsKernel {
  int fd = -1;
  int64_t offset, rows, columns, type, row_bytes;

  explicit RowsKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel(info);
    std::string path = kernel.GetAttribute<std::string>("path");
    offset = kernel.GetAttribute<int64_t>("offset");
    rows = kernel.GetAttribute<int64_t>("rows");
    columns = kernel.GetAttribute<int64_t>("columns");
    type = kernel.GetAttribute<int64_t>("type");
    int64_t file_bytes = kernel.GetAttribute<int64_t>("file_bytes");
    int64_t device = kernel.GetAttribute<int64_t>("device"), inode = kernel.GetAttribute<int64_t>("inode");
    if ((type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) ||
        rows <= 0 || columns <= 0 || rows > (int64_t(1) << 31) || columns > (int64_t(1) << 24) || offset < 0)
      ORT_CXX_API_THROW("StoredRows: type, rows, columns or offset out of range", ORT_INVALID_ARGUMENT);
    row_bytes = columns * (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2);
    fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || int64_t(st.st_dev) != device || int64_t(st.st_ino) != inode ||
        st.st_size != file_bytes || offset > st.st_size || rows * row_bytes > st.st_size - offset) {
      if (fd >= 0) close(fd);
      ORT_CXX_API_THROW("StoredRows: " + path + " cannot be opened, is no longer the file the engine's checks "
                        "opened, or does not hold the table", ORT_INVALID_ARGUMENT);
    }
  }

  ~RowsKernel() { close(fd); }

  void read_row(int64_t row, char* to) const {
    for (int64_t done = 0; done < row_bytes;) {
      ssize_t got = pread(fd, to + done, size_t(row_bytes - done), off_t(offset + row * row_bytes + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) ORT_CXX_API_THROW("StoredRows: the table's file could not be read", ORT_FAIL);
      done += got;
    }
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    Ort::ConstValue ids = context.GetInput(0);
    Ort::TensorTypeAndShapeInfo info = ids.GetTensorTypeAndShapeInfo();
    std::vector<int64_t> shape = info.GetShape();
    size_t count = info.GetElementCount();
    bool wide = info.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    if (!wide && info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
      ORT_CXX_API_THROW("StoredRows: ids must be int64 or int32, as Gather's", ORT_INVALID_ARGUMENT);
    shape.push_back(columns);
    float* y = context.GetOutput(0, shape).GetTensorMutableData<float>();
    std::vector<uint16_t> halves(type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 ? columns : 0);
    for (size_t i = 0; i < count; ++i) {
      int64_t id = wide ? ids.GetTensorData<int64_t>()[i] : ids.GetTensorData<int32_t>()[i];
      int64_t row = id < 0 ? id + rows : id;                    // Gather's negative indices count from the end
      if (row < 0 || row >= rows) ORT_CXX_API_THROW("StoredRows: an index is out of the table", ORT_INVALID_ARGUMENT);
      float* out = y + i * columns;
      if (halves.empty()) {
        read_row(row, reinterpret_cast<char*>(out));
        continue;
      }
      read_row(row, reinterpret_cast<char*>(halves.data()));
      for (int64_t c = 0; c < columns; ++c) out[c] = bf16_scalar(halves[c]);
    }
  }
};

struct RowsOp : Ort::CustomOpBase<RowsOp, RowsKernel> {
  void* CreateKernel(const OrtApi&, const OrtKernelInfo* info) const { return new RowsKernel(info); }
  const char* GetName() const { return "StoredRows"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;              // int64 or int32, as Gather's (Compute checks)
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

RowsOp rows_op;

template <bool E4M3>
struct Op : Ort::CustomOpBase<Op<E4M3>, Kernel> {
  void* CreateKernel(const OrtApi&, const OrtKernelInfo* info) const { return new Kernel(info, E4M3); }
  const char* GetName() const { return E4M3 ? "E4m3MatMul" : "Bf16MatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return E4M3 ? 3 : 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    if (index == 1) return E4M3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

Op<true> e4m3_op;
Op<false> bf16_op;

}  // namespace

extern "C" __attribute__((visibility("default")))
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    Ort::CustomOpDomain domain{"v4engine.cpu"};
    domain.Add(&e4m3_op);
    domain.Add(&bf16_op);
    domain.Add(&moe_op);
    domain.Add(&sinkhorn_op);
    domain.Add(&rows_op);
    Ort::UnownedSessionOptions(options).Add(domain);
    domain.release();       // ONNX Runtime reads the domain for as long as sessions made with it live
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}
