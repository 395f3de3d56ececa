// moestream CPU decode layer: one call per decoder layer of a CPU decode step (models/cpu_decode.py).
//
// A CPU-only decode step of a small model is mostly per-operation overhead when every norm, projection,
// rotary, cache write and attention is its own torch call from Python (SmolLM2-135M: ~15 ms of kernels in a
// ~47 ms step on 2 cores). ms_decode_layer does one attention decoder layer for B decode rows (one token per
// sequence) without returning to Python:
//   x = norm_in(h); q|k|v = x @ Wqkv.T (ms_qmatmul on the stored GGUF bytes or 16-bit rows; float32 rows here);
//   per head: q/k RMSNorm (optional), rotary (neox layout, first `rd` channels, tables cos/sin [pos, rd]);
//   k, v written to the KV pool at the row's slot; attention of q over the sequence's slots (softmax in
//   float32, max subtracted); optional output gate (Qwen3.5: q rows are [query | gate] per head, sigmoid);
//   h += o_proj(attn); x = norm_post(h) (returned for a MoE block computed by the caller);
//   with a dense MLP: h += down(silu(gate x) * up x) (ms_moe_layer with one group: one parallel region).
// ms_gdn_decode does one Gated DeltaNet layer (layers/gdn.py) for B decode rows: x = norm_in(h); the in-projections
// [q|k|v | z | b | a]; the causal depthwise conv over each row's conv window (state pool, moved on in place), SiLU;
// q, k L2-normed (q * Dk^-1/2), a key head shared by Hv/Hk value heads; beta = sigmoid(b), g = -exp(A_log) *
// softplus(a + dt_bias); S <- exp(g) S, u = beta (v - S^T k), S += k u^T, o = S^T q on the float32 state in place;
// the gated RMSNorm of o times silu(z); h += out_proj(o); x = norm_post(h).
// ms_moe_decode does the MoE block after either: router, top-k, routed experts, shared expert (unfused, or the
// fused [router | shared gate | up | shared_expert_gate] GEMM of models/fuse.py), h += their sum.
// Numerics: float32 throughout, the same quantized-activation products as the per-op path (the same
// ms_qmatmul / ms_moe_layer); norms, rotary, softmax and the recurrence differ from torch's only in summation order.
// Plain C ABI, the layer described by an int64 array (the D_* slots below) and a float64 array (eps).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MS_DECODE_AVX2 1
#endif

extern "C" int ms_qmatmul(const float* xf, int64_t n, int64_t K, const uint8_t* wp, int64_t N, int64_t ws,
                          int64_t type, float* op, int64_t os, int nthreads, int force_scalar);
extern "C" int ms_qmatmul_segs(const float* xf, int64_t n, int64_t K, int64_t nseg, const int64_t* segs, float* op,
                               int64_t os, int nthreads, int force_scalar);
extern "C" int ms_dequant_rows(const uint8_t* w, int64_t N, int64_t ws, int64_t type, int64_t K, const int64_t* ids,
                               int64_t n, float* out, int nthreads);
extern "C" int ms_moe_layer(const void* x, int64_t xdtype, int64_t nx, int64_t H, int64_t I, int64_t G,
                            const int64_t* wptr, const int64_t* wtype, const int64_t* gstart, const int64_t* prow,
                            const float* pw, const int64_t* pdst, float* out, int64_t nout, int64_t os,
                            int64_t hmode, int64_t flags, int nthreads, int force_scalar);

namespace {

// the layer description (models/cpu_decode.py writes the same slots)
enum : int {
  D_H, D_NH, D_NKV, D_HD, D_RD, D_FLAGS,
  D_IN_NORM, D_POST_NORM, D_Q_NORM, D_K_NORM,       // float32 vectors (q/k norms: [head_dim]); 0 = none
  D_NSEG,                                           // projection segments of q|k|v (1: fused, 3: separate)
  D_SEG0, D_SEG_END = D_SEG0 + 9,                   // per segment: weight address, ggml type, row stride
  D_WO = D_SEG_END, D_TO, D_SO,                     // o_proj: address, type, row stride
  D_KC, D_VC,                                       // this layer's K and V pool, float32 [slots, nkv, hd]
  D_COS, D_SIN,                                     // rotary tables, float32 [positions, rd]
  D_MLP_I,                                          // dense MLP intermediate size (0: no MLP here)
  D_WG, D_TG, D_WU, D_TU, D_WD, D_TD,               // dense MLP gate / up / down: address, type
  D_COUNT
};
// F_KV_F16 / F_KV_FP8: the KV pool holds float16 / e4m3fn (else float32); F_OUT_TILED: a Gated DeltaNet out_proj's
// input columns are its value heads in tiled order (stored head j = r * HK + k is the layer's head k * rep + r: a
// GGUF's, kept as stored)
enum : int64_t { F_ZERO_CENTERED = 1, F_OUT_GATE = 2, F_KV_F16 = 4, F_OUT_TILED = 8, F_KV_FP8 = 16 };
// a KV pool's element type, from the flags
enum KvKind : int { KV_F32 = 0, KV_F16 = 1, KV_FP8 = 2 };
inline KvKind kv_kind(int64_t flags) { return flags & F_KV_FP8 ? KV_FP8 : flags & F_KV_F16 ? KV_F16 : KV_F32; }
constexpr int64_t kv_bytes(int kind) { return kind == KV_F32 ? 4 : kind == KV_F16 ? 2 : 1; }

// a MoE block's description for ms_moe_decode (models/cpu_decode.py writes the same slots)
enum : int {
  X_H, X_E, X_K, X_NORMALIZE, X_I,
  X_RW, X_RT, X_RS,                                 // router weight [E, H]: address, ggml type (0 float32), row stride
  X_TABLE, X_TG, X_TU, X_TD,                        // [E, 3] gate/up/down addresses of every expert; their types
  X_SI, X_SG, X_STG, X_SU, X_STU, X_SD, X_STD,      // shared expert (X_SI = 0: none): I, gate/up/down address, type
  X_SGATE,                                          // the shared expert's float32 gate vector [H] (0: ungated)
  X_FW, X_FT, X_FS,                                 // fused shared_in [router E? | gate I | up I | gate 1] (0: none)
  X_FROUTER,                                        // 1: the router's E rows lead X_FW (X_RW unused)
  X_SDS,                                            // fused block: the shared down_proj's row stride (X_SD, X_STD)
  X_COUNT
};

// a Gated DeltaNet layer's description for ms_gdn_decode (models/cpu_decode.py writes the same slots)
enum : int {
  G_H, G_HK, G_HV, G_DK, G_DV, G_KW,                // hidden; key / value heads and head dims; conv kernel width
  G_FLAGS, G_IN_NORM, G_POST_NORM,                  // F_ZERO_CENTERED; the decoder's input / post-attention norms
  G_NSEG,                                           // in-projection segments (1: fused; 4: qkv, z, b, a)
  G_SEG0, G_SEG_END = G_SEG0 + 12,                  // per segment: weight address, ggml type, row stride
  G_WO = G_SEG_END, G_TO, G_SO,                     // out_proj: address, type, row stride
  G_CONV_W, G_A_LOG, G_DT_BIAS, G_NORM_W,           // float32: conv [conv_dim, K], A_log, dt_bias [Hv], norm [Dv]
  G_CONV, G_REC,                                    // this layer's float32 state pools [slots, conv_dim, K-1] and
                                                    // [slots, Hv, Dk, Dv]
  G_COUNT
};

// ---- per-part wall-clock profile of decode steps (ms_decode_profile; benchmarks/cpu_step_profile.py)
// Off unless asked: one load and branch per part. On, each part's seconds and count add up on the calling thread
// (the parts are timed between the calling thread's marks, so a parallel part includes its region's start and
// its last barrier).
enum : int {
  P_EMBED, P_NORM, P_QKV, P_PREP, P_ATTN, P_O, P_ROUTER, P_TOPK, P_EXPERTS, P_SHARED, P_RESID, P_GDN_PROJ, P_GDN_REC,
  P_GDN_OUT, P_MLP, P_HEAD, P_COUNT
};
int g_prof = 0;
double g_prof_s[P_COUNT];
int64_t g_prof_n[P_COUNT];

inline double prof_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The time since t (a previous mark) is part `part`'s; t becomes now. Nothing when profiling is off.
inline void lap(int part, double& t) {
  if (!g_prof) return;
  const double n = prof_now();
  g_prof_s[part] += n - t, g_prof_n[part] += 1, t = n;
}

inline double mark() { return g_prof ? prof_now() : 0.0; }

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef MS_DECODE_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float v = e == 0 ? std::ldexp((float)m, -24)
                         : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 0x400), (int)e - 25);
  return (h & 0x8000) ? -v : v;
#endif
}

// float -> float16 bits, rounded to nearest even (overflow to infinity, NaN kept a NaN)
inline uint16_t to_fp16(float f) {
#ifdef MS_DECODE_AVX2
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
  if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds past the largest half
  if (ax < 0x38800000) {  // a subnormal half (or zero): value / 2^-24, rounded to nearest even
    float a;
    std::memcpy(&a, &ax, 4);
    return (uint16_t)(sign | (uint32_t)std::nearbyint(a * 16777216.0f));
  }
  const uint32_t m = ax + 0xfff + ((ax >> 13) & 1);  // round the 13 dropped bits to nearest even
  return (uint16_t)(sign | ((m - 0x38000000) >> 13));
#endif
}

// e4m3fn code -> float (the NaN codes 0x7f / 0xff are never written)
inline float from_fp8(uint8_t b) {
  const uint32_t mag = b & 0x7f;
  float v;
  if (mag >= 8) {
    const uint32_t bits = (mag << 20) + (120u << 23);  // exponent rebiased 7 -> 127
    std::memcpy(&v, &bits, 4);
  } else {
    v = (float)mag * 0.001953125f;  // subnormal: m * 2^-9
  }
  return (b & 0x80) ? -v : v;
}

// float -> e4m3fn code, saturated at +-448 and rounded to nearest even: what torch's
// `clamp(-448, 448).to(torch.float8_e4m3fn)` writes (layers/attention.py kv_write; tests/test_cpu_decode.py)
inline uint8_t to_fp8(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 24) & 0x80;
  const float a = std::min(std::fabs(f), 448.0f);
  uint32_t code;
  if (a < 0.015625f) {
    code = (uint32_t)std::nearbyint(a * 512.0f);  // multiples of 2^-9, ties to even (the default rounding mode)
  } else {
    uint32_t ab;
    std::memcpy(&ab, &a, 4);
    code = ((ab + 0x7ffff + ((ab >> 20) & 1)) >> 20) - (120u << 3);  // mantissa to 3 bits, ties to even
  }
  return (uint8_t)(sign | std::min<uint32_t>(code, 126));
}

// y = x / rms(x) * w (zero_centered: * (1 + w)); y may be x. The sum of squares in double, 8 partial sums (AVX2:
// two vectors of 4) added at the end: no chain of n dependent adds.
void rms_norm(const float* x, const float* w, int64_t n, double eps, bool zc, float* y) {
  double ss = 0;
  int64_t i = 0;
#ifdef MS_DECODE_AVX2
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0), a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  alignas(32) double part[4];
  _mm256_store_pd(part, _mm256_add_pd(a0, a1));
  ss = (part[0] + part[1]) + (part[2] + part[3]);
#endif
  for (; i < n; ++i) ss += (double)x[i] * x[i];
  const float r = 1.0f / std::sqrt((float)(ss / n) + (float)eps);
  if (zc)
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * (1.0f + w[i]);
  else
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// neox rotary of the first rd channels of one head vector v [hd] at table row c, s
void rotate(float* v, const float* c, const float* s, int64_t rd) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * c[i] - b * s[i];
    v[i + half] = b * c[i + half] + a * s[i + half];
  }
}

// row `at` (in elements) of a KV pool of float32, float16 or e4m3fn (kind) := src [n] (rounded to nearest even; e4m3fn
// saturated at +-448)
void store_row(void* pool, int64_t at, const float* src, int64_t n, int kind) {
  if (kind == KV_F32) {
    std::memcpy((float*)pool + at, src, n * sizeof(float));
    return;
  }
  if (kind == KV_FP8) {
    uint8_t* dst = (uint8_t*)pool + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = to_fp8(src[i]);
    return;
  }
  uint16_t* dst = (uint16_t*)pool + at;
  int64_t i = 0;
#ifdef MS_DECODE_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = to_fp16(src[i]);
}

// row `at` of a KV pool as float32: the row itself, or (a float16 / e4m3fn pool) its values widened into tmp [n]
const float* load_row(const void* pool, int64_t at, int64_t n, int kind, float* tmp) {
  if (kind == KV_F32) return (const float*)pool + at;
  if (kind == KV_FP8) {
    const uint8_t* src = (const uint8_t*)pool + at;
    for (int64_t i = 0; i < n; ++i) tmp[i] = from_fp8(src[i]);
    return tmp;
  }
  const uint16_t* src = (const uint16_t*)pool + at;
  int64_t i = 0;
#ifdef MS_DECODE_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
  for (; i < n; ++i) tmp[i] = fp16((const uint8_t*)(src + i));
  return tmp;
}

// e^(v - m) for n floats in place, and their sum (softmax's numerator and denominator; v <= m). AVX2: v - m = k ln2
// + r (|r| <= ln2 / 2, ln2 in two parts), e^r by its degree-6 Taylor polynomial (truncation < 1.3e-7 relative),
// times 2^k through the exponent bits; below -87.3 (under FLT_MIN) 0. Scalar: std::exp. Summed in index order.
float exp_sum(float* v, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0;
#ifdef MS_DECODE_AVX2
  const __m256 log2e = _mm256_set1_ps(1.44269504f), ln2hi = _mm256_set1_ps(0.693145752f),
               ln2lo = _mm256_set1_ps(1.42860677e-6f), lo = _mm256_set1_ps(-87.3f), vm = _mm256_set1_ps(m);
  const float c[7] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720};
  for (; i + 8 <= n; i += 8) {
    const __m256 x0 = _mm256_sub_ps(_mm256_loadu_ps(v + i), vm);
    const __m256 x = _mm256_max_ps(x0, lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(k, ln2lo, _mm256_fnmadd_ps(k, ln2hi, x));
    __m256 p = _mm256_set1_ps(c[6]);
    for (int j = 5; j >= 0; --j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[j]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    _mm256_storeu_ps(v + i, _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x0, lo, _CMP_LT_OQ)));
    for (int j = 0; j < 8; ++j) sum += v[i + j];
  }
#endif
  for (; i < n; ++i) sum += (v[i] = std::exp(v[i] - m));
  return sum;
}

// a . b summed in index order, each product rounded before it is added (contraction off here and in dots8, so the
// two give the same floats whatever the compiler would fuse)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
float dot(const float* a, const float* b, int64_t n) {
  float d = 0;
  for (int64_t i = 0; i < n; ++i) d += a[i] * b[i];
  return d;
}

#ifdef MS_DECODE_AVX2
// r[c] lane j <- r[j] lane c
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int j = 0; j < 8; j += 2) t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]), t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  for (int j = 0; j < 8; j += 4) {
    u[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j)
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20), r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
}

// sc[g * S + s0 + j] = scale * q_g . k_j for 8 keys k_j (j = 0..7) and grp <= 16 query heads, a key per lane: each
// lane sums its products in index order, as `dot` does, so the floats are the same; the keys' rows are read once
// for the whole group. hd % 8 == 0.
void dots8(const float* q, int64_t grp, const float* const* k, int64_t hd, float scale, float* sc, int64_t S,
           int64_t s0) {
  __m256 acc[16];
  for (int64_t g = 0; g < grp; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t i = 0; i < hd; i += 8) {
    __m256 r[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(k[j] + i);
    transpose8(r);
    for (int64_t g = 0; g < grp; ++g)
      for (int c = 0; c < 8; ++c) acc[g] = _mm256_add_ps(acc[g], _mm256_mul_ps(_mm256_set1_ps(q[g * hd + i + c]), r[c]));
  }
  for (int64_t g = 0; g < grp; ++g) _mm256_storeu_ps(sc + g * S + s0, _mm256_mul_ps(acc[g], _mm256_set1_ps(scale)));
}
#endif
#pragma GCC pop_options

#ifdef MS_DECODE_AVX2
// 8 values of row `at` of a KV pool as float32 (a float16 or e4m3fn pool widened in the register: e4m3fn by integer
// arithmetic, as from_fp8)
template <int KV>
inline __m256 kv8(const void* pool, int64_t at) {
  if constexpr (KV == KV_F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)pool + at)));
  } else if constexpr (KV == KV_FP8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)pool + at)));
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.001953125f));
    const __m256 isnorm = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7)));
    const __m256 v = _mm256_blendv_ps(sub, normal, isnorm);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
  } else {
    return _mm256_loadu_ps((const float*)pool + at);
  }
}

inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// attend_chunk for a KV head's group of G query heads (G = nh / nkv <= 8), hd % 8 == 0, with the group's
// accumulators in registers: each position's key row is read once into 8-lane partial dot products of all G heads
// (fused multiply-adds, one horizontal sum a head and position), and each value row's 8 or 16 columns are added
// to all G heads' outputs at once, the outputs staying in registers over the chunk's positions (the plain loop
// loads and stores each head's output for every position). Summation order differs from `dot`'s (lanes, then
// across them): the floats differ from the per-op path's by rounding (tests/test_cpu_decode.py bounds them).
constexpr int64_t KV_AHEAD = 4;  // positions a key row (into L1) and its value row (into L2) are asked for ahead

template <int G, int KV>
void attend_group(const float* q, int64_t nkv, int64_t hd, const void* kc, const void* vc, const int64_t* idx,
                  int64_t S, float scale, float* sc, float* o) {
  const int64_t row_bytes = nkv * hd * kv_bytes(KV);
  for (int64_t s = 0; s < S; ++s) {  // positions in order, all kv heads of one together: the pool's row order
    if (s + KV_AHEAD < S) {  // the key row KV_AHEAD positions on, asked for now (its page may be anywhere)
      const char* nxt = (const char*)kc + idx[s + KV_AHEAD] * row_bytes;
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(nxt + b, _MM_HINT_T0);
      const char* vn = (const char*)vc + idx[s + KV_AHEAD] * row_bytes;  // its value row too, for the second pass
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(vn + b, _MM_HINT_T1);
    }
    for (int64_t kvh = 0; kvh < nkv; ++kvh) {
      const float* qg = q + kvh * G * hd;
      float* scg = sc + kvh * G * S;
      const int64_t at = (idx[s] * nkv + kvh) * hd;
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t i = 0; i < hd; i += 8) {
        const __m256 k = kv8<KV>(kc, at + i);
        for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * hd + i), k, acc[g]);
      }
      for (int g = 0; g < G; ++g) scg[g * S + s] = hsum8(acc[g]) * scale;
    }
  }
}

template <int G, int KV>
void accumulate_group(int64_t nkv, int64_t hd, const void* vc, const int64_t* idx, int64_t S, const float* sc,
                      float* o) {
  constexpr int W = G <= 4 ? 2 : 1;  // 8-column vectors per head held at once: 2G + 2 + 1 of 16 registers
  const int64_t step = hd % (8 * W) == 0 ? 8 * W : 8;
  for (int64_t kvh = 0; kvh < nkv; ++kvh) {
    const float* scg = sc + kvh * G * S;
    for (int64_t i0 = 0; i0 < hd; i0 += step) {
      const int w = (int)(step / 8);
      __m256 acc[G][W];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < W; ++c) acc[g][c] = _mm256_setzero_ps();
      for (int64_t s = 0; s < S; ++s) {
        if (s + 4 * KV_AHEAD < S)
          _mm_prefetch((const char*)vc + ((idx[s + 4 * KV_AHEAD] * nkv + kvh) * hd + i0) * kv_bytes(KV), _MM_HINT_T0);
        const int64_t at = (idx[s] * nkv + kvh) * hd + i0;
        __m256 v[W];
        for (int c = 0; c < W; ++c) v[c] = c < w ? kv8<KV>(vc, at + 8 * c) : _mm256_setzero_ps();
        for (int g = 0; g < G; ++g) {
          const __m256 p = _mm256_broadcast_ss(scg + g * S + s);
          for (int c = 0; c < W; ++c) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < w; ++c) _mm256_storeu_ps(o + (kvh * G + g) * hd + i0 + 8 * c, acc[g][c]);
    }
  }
}

template <int G>
bool attend_blocked_g(int kind, const float* q, int64_t nkv, int64_t hd, const void* kc, const void* vc,
                      const int64_t* idx, int64_t S, float scale, float* sc, float* m, float* l, float* o) {
  if (kind == KV_F16) attend_group<G, KV_F16>(q, nkv, hd, kc, vc, idx, S, scale, sc, o);
  else if (kind == KV_FP8) attend_group<G, KV_FP8>(q, nkv, hd, kc, vc, idx, S, scale, sc, o);
  else attend_group<G, KV_F32>(q, nkv, hd, kc, vc, idx, S, scale, sc, o);
  for (int64_t h = 0; h < G * nkv; ++h) {
    float* row = sc + h * S;
    m[h] = *std::max_element(row, row + S);
    l[h] = exp_sum(row, S, m[h]);
  }
  if (kind == KV_F16) accumulate_group<G, KV_F16>(nkv, hd, vc, idx, S, sc, o);
  else if (kind == KV_FP8) accumulate_group<G, KV_FP8>(nkv, hd, vc, idx, S, sc, o);
  else accumulate_group<G, KV_F32>(nkv, hd, vc, idx, S, sc, o);
  return true;
}

// the blocked chunk where it applies (AVX2 build, 1 <= nh / nkv <= 8, hd % 8 == 0); false: the caller's loop
bool attend_blocked(const float* q, int64_t nh, int64_t nkv, int64_t hd, const void* kc, const void* vc, int kind,
                    const int64_t* idx, int64_t S, float scale, float* sc, float* m, float* l, float* o) {
  if (nkv <= 0 || nh % nkv || hd % 8 || S <= 0) return false;
  switch (nh / nkv) {
    case 1: return attend_blocked_g<1>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    case 2: return attend_blocked_g<2>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    case 3: return attend_blocked_g<3>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    case 4: return attend_blocked_g<4>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    case 5: return attend_blocked_g<5>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    case 6: return attend_blocked_g<6>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    case 7: return attend_blocked_g<7>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    case 8: return attend_blocked_g<8>(kind, q, nkv, hd, kc, vc, idx, S, scale, sc, m, l, o);
    default: return false;
  }
}
#endif

// One chunk of a row's cached positions (slots idx [S]) for every query head: q [nh, hd] (head h reads kv head
// h / grp of a float32, float16 or e4m3fn (kind) pool of nkv heads) -> per head the chunk's largest score m[h], the sum of
// e^(score - m[h]) l[h] and the unnormalised output o[nh, hd] (sum of e^(score - m[h]) v). Positions are read in
// order and all kv heads of a position together (rows are contiguous in the pool), 8 keys per vector where it
// can; a float16 / e4m3fn row is widened once. sc: scratch [nh, S].
void attend_chunk(const float* q, int64_t nh, int64_t nkv, int64_t hd, const void* kc, const void* vc, int kind,
                  const int64_t* idx, int64_t S, float scale, float* sc, float* m, float* l, float* o) {
#ifdef MS_DECODE_AVX2
  if (attend_blocked(q, nh, nkv, hd, kc, vc, kind, idx, S, scale, sc, m, l, o)) return;
#endif
  const int64_t grp = nh / nkv;
  std::vector<float> tmp(8 * hd);
  int64_t s = 0;
#ifdef MS_DECODE_AVX2
  if (hd % 8 == 0 && grp <= 16)
    for (; s + 8 <= S; s += 8)
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        const float* k[8];
        for (int j = 0; j < 8; ++j) k[j] = load_row(kc, (idx[s + j] * nkv + kvh) * hd, hd, kind, tmp.data() + j * hd);
        dots8(q + kvh * grp * hd, grp, k, hd, scale, sc + kvh * grp * S, S, s);
      }
#endif
  for (; s < S; ++s)
    for (int64_t kvh = 0; kvh < nkv; ++kvh) {
      const float* k = load_row(kc, (idx[s] * nkv + kvh) * hd, hd, kind, tmp.data());
      for (int64_t g = 0; g < grp; ++g) sc[(kvh * grp + g) * S + s] = dot(q + (kvh * grp + g) * hd, k, hd) * scale;
    }
  for (int64_t h = 0; h < nh; ++h) {
    float* row = sc + h * S;
    m[h] = *std::max_element(row, row + S);
    l[h] = exp_sum(row, S, m[h]);
  }
  std::fill(o, o + nh * hd, 0.0f);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t kvh = 0; kvh < nkv; ++kvh) {
      const float* v = load_row(vc, (idx[s] * nkv + kvh) * hd, hd, kind, tmp.data());
      for (int64_t g = 0; g < grp; ++g) {
        const int64_t h = kvh * grp + g;
        const float p = sc[h * S + s];
        float* oh = o + h * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) oh[i] += p * v[i];
      }
    }
}

// out[b, i] (rows os apart) = x[b] . W[i] for float32 weights W [N, K] (rows ws bytes apart): ggml type 0, which
// ms_qmatmul does not read (an HF checkpoint's projections kept in float32)
// Loops hand their iterations out in chunks (OpenMP dynamic schedules, about 8 per thread), as qmatmul.cpp's
// par_for does: a thread the OS holds back takes fewer instead of keeping the others at the region's end.
inline int64_t chunk_of(int64_t n, int threads) { return std::max<int64_t>(1, n / (8 * (int64_t)threads)); }

void matmul_f32(const float* x, int64_t B, int64_t K, const float* w, int64_t N, int64_t ws, float* out, int64_t os,
                int nt) {
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(nt, N * K / 16384));
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk_of(N, threads))
  for (int64_t i = 0; i < N; ++i) {
    const float* wr = (const float*)((const char*)w + i * ws);
    for (int64_t b = 0; b < B; ++b) {
      const float* xr = x + b * K;
      float acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * wr[k];
      out[b * os + i] = acc;
    }
  }
}

// out = x @ W.T for a weight of ggml type `type` (0: float32 rows; otherwise ms_qmatmul's types)
int matmul(const float* x, int64_t B, int64_t K, const void* w, int64_t N, int64_t ws, int64_t type, float* out,
           int64_t os, int nt) {
  if (type == 0) {
    matmul_f32(x, B, K, (const float*)w, N, ws, out, os, nt);
    return 0;
  }
  return ms_qmatmul(x, B, K, (const uint8_t*)w, N, ws, type, out, os, nt, 0);
}

// out [B, sum rows] = x @ [W_0; ...; W_{ns-1}].T for ns weights given as (address, type, row stride) triples at w
// (3 apart) with rows[s] rows each: one ms_qmatmul_segs call (x quantized once, one parallel region) where no weight
// is float32 rows, else one matmul per weight. The columns are the same either way.
int matmul_segs(const float* x, int64_t B, int64_t K, const int64_t* w, int64_t ns, const int64_t* rows, float* out,
                int64_t os, int nt) {
  bool f32 = false;
  for (int64_t s = 0; s < ns; ++s) f32 = f32 || w[3 * s + 1] == 0;
  if (ns > 1 && !f32) {
    int64_t segs[4 * 16];
    if (ns > 16) return -1;
    for (int64_t s = 0; s < ns; ++s)
      segs[4 * s] = w[3 * s], segs[4 * s + 1] = w[3 * s + 1], segs[4 * s + 2] = w[3 * s + 2], segs[4 * s + 3] = rows[s];
    return ms_qmatmul_segs(x, B, K, ns, segs, out, os, nt, 0);
  }
  int64_t col = 0;
  for (int64_t s = 0; s < ns; ++s) {
    const int rc = matmul(x, B, K, (const void*)w[3 * s], rows[s], w[3 * s + 2], w[3 * s + 1], out + col, os, nt);
    if (rc) return rc;
    col += rows[s];
  }
  return 0;
}

int64_t seg_rows(const int64_t* d, int64_t qrows, int64_t kvrows, int s) {
  if (d[D_NSEG] == 1) return qrows + 2 * kvrows;
  return s == 0 ? qrows : kvrows;
}

// q|k|v for B rows of x: qkv [B, qrows + 2 kvrows]
int project_qkv(const int64_t* d, const float* x, int64_t B, int64_t H, int64_t qrows, int64_t kvrows, float* qkv,
                int nt) {
  int64_t rows[3];
  for (int s = 0; s < d[D_NSEG]; ++s) rows[s] = seg_rows(d, qrows, kvrows, s);
  return matmul_segs(x, B, H, d + D_SEG0, d[D_NSEG], rows, qkv, qrows + 2 * kvrows, nt);
}

// q/k norms, rotary and the KV write for row b; q_out [nh, hd] (gate split off), gate [nh, hd] or null
void prep_row(const int64_t* d, double eps, const float* qkv_row, int64_t pos, int64_t slot, float* q_out,
              float* gate) {
  const int64_t nh = d[D_NH], nkv = d[D_NKV], hd = d[D_HD], rd = d[D_RD];
  const bool zc = d[D_FLAGS] & F_ZERO_CENTERED, og = d[D_FLAGS] & F_OUT_GATE;
  const float* c = (const float*)d[D_COS] + pos * rd;
  const float* s = (const float*)d[D_SIN] + pos * rd;
  const float *qn = (const float*)d[D_Q_NORM], *kn = (const float*)d[D_K_NORM];
  const int64_t qrows = nh * hd * (og ? 2 : 1);
  for (int64_t h = 0; h < nh; ++h) {
    float* q = q_out + h * hd;
    const float* src = qkv_row + h * hd * (og ? 2 : 1);
    std::memcpy(q, src, hd * sizeof(float));
    if (og) std::memcpy(gate + h * hd, src + hd, hd * sizeof(float));
    if (qn) rms_norm(q, qn, hd, eps, zc, q);
    rotate(q, c, s, rd);
  }
  std::vector<float> k(hd);
  for (int64_t h = 0; h < nkv; ++h) {
    std::memcpy(k.data(), qkv_row + qrows + h * hd, hd * sizeof(float));
    if (kn) rms_norm(k.data(), kn, hd, eps, zc, k.data());
    rotate(k.data(), c, s, rd);
    const int64_t at = (slot * nkv + h) * hd;
    const int kind = kv_kind(d[D_FLAGS]);
    store_row((void*)d[D_KC], at, k.data(), hd, kind);
    store_row((void*)d[D_VC], at, qkv_row + qrows + nkv * hd + h * hd, hd, kind);
  }
}

// Positions per attention work item: chunks of a row's positions split the work over the threads whatever the
// heads (flash-decoding's split: each chunk's softmax is local, the chunks are combined by their maxima).
constexpr int64_t ATT_CHUNK = 64;

// attention of every row over its cached positions: att [B, nh * hd]. Work items are (row, chunk of up to
// ATT_CHUNK positions); per head the chunks combine as sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M the
// largest m_c (one chunk: o / l, the plain softmax).
void attention(const int64_t* d, int64_t B, const float* q, const int64_t* kvidx, const int64_t* kvoff, float* att,
               int nt) {
  const int64_t nh = d[D_NH], nkv = d[D_NKV], hd = d[D_HD];
  const float scale = 1.0f / std::sqrt((float)hd);
  const int kind = kv_kind(d[D_FLAGS]);
  std::vector<int64_t> first(B + 1, 0);  // the rows' first work items
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t S = kvoff[b + 1] - kvoff[b];
    first[b + 1] = first[b] + std::max<int64_t>(1, (S + ATT_CHUNK - 1) / ATT_CHUNK);
    work += S;
  }
  const int64_t items = first[B];
  std::vector<float> m(items * nh), l(items * nh), o(items * nh * hd);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)nt, items, work * nh * hd / 16384}));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> sc(nh * ATT_CHUNK);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1, c = it - first[b];
      const int64_t s0 = c * ATT_CHUNK, S = std::min(kvoff[b + 1] - kvoff[b] - s0, ATT_CHUNK);
      attend_chunk(q + b * nh * hd, nh, nkv, hd, (const void*)d[D_KC], (const void*)d[D_VC], kind,
                   kvidx + kvoff[b] + s0, S, scale, sc.data(), m.data() + it * nh, l.data() + it * nh,
                   o.data() + it * nh * hd);
    }
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nh; ++h) {
      float mx = -INFINITY, den = 0;
      for (int64_t it = first[b]; it < first[b + 1]; ++it) mx = std::max(mx, m[it * nh + h]);
      float* out = att + (b * nh + h) * hd;
      std::fill(out, out + hd, 0.0f);
      for (int64_t it = first[b]; it < first[b + 1]; ++it) {
        const float w = first[b + 1] - first[b] == 1 ? 1.0f : std::exp(m[it * nh + h] - mx);
        den += w * l[it * nh + h];
        const float* oc = o.data() + (it * nh + h) * hd;
        for (int64_t i = 0; i < hd; ++i) out[i] += w * oc[i];
      }
      const float inv = 1.0f / den;
      for (int64_t i = 0; i < hd; ++i) out[i] *= inv;
    }
}

int dense_mlp(const int64_t* d, const float* x, int64_t B, int64_t H, float* h, int nt) {
  const int64_t I = d[D_MLP_I];
  const int64_t wptr[3] = {d[D_WG], d[D_WU], d[D_WD]}, wtype[3] = {d[D_TG], d[D_TU], d[D_TD]};
  const int64_t gstart[2] = {0, B};
  std::vector<int64_t> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  std::vector<float> y(B * H);
  const int rc = ms_moe_layer(x, 0, B, H, I, 1, wptr, wtype, gstart, rows.data(), nullptr, rows.data(), y.data(), B,
                              H, 0, 0, nt, 0);
  if (rc) return rc;
  for (int64_t i = 0; i < B * H; ++i) h[i] += y[i];
  return 0;
}


// sum over one Q8_0 block (fp16 d, 32 int8 q) of q_j * x_j, for NR activation rows (float32, exact products)
template <int NR>
inline void q8_block(const uint8_t* blk, const float* const* x, int64_t off, float* acc) {
  const float d = fp16(blk);
  const int8_t* q = (const int8_t*)(blk + 2);
#ifdef MS_DECODE_AVX2
  __m256 w[4];
  for (int j = 0; j < 4; ++j)
    w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * j))));
  for (int r = 0; r < NR; ++r) {
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(x[r] + off));
    for (int j = 1; j < 4; ++j) t = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x[r] + off + 8 * j), t);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
    acc[r] += d * _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
#else
  for (int r = 0; r < NR; ++r) {
    float t = 0;
    for (int j = 0; j < 32; ++j) t += (float)q[j] * x[r][off + j];
    acc[r] += d * t;
  }
#endif
}

template <int NR>
void q8_rows(const uint8_t* w, int64_t nb, const float* const* x, float* out) {
  float acc[NR] = {};
  for (int64_t b = 0; b < nb; ++b) q8_block<NR>(w + b * 34, x, b * 32, acc);
  for (int r = 0; r < NR; ++r) out[r] = acc[r];
}

// Q6_K rows (210-byte blocks of 256 values: low nibbles ql[128], high bit pairs qh[64], int8 scales[16] of 16 values,
// fp16 d) against float32 activations, value by value (builds without AVX2; with it, q6k_rows_i16). The order of a
// chunk's 32 values and their scales is dot_k's (qmatmul.cpp).
template <int NR>
void q6k_rows(const uint8_t* w, int64_t nb, const float* const* x, float* out) {  // builds without AVX2
  float acc[NR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const float d = fp16(blk + 208);
    const int8_t* sc = (const int8_t*)(blk + 192);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int j = 0; j < 32; ++j) {
          const int s8 = 4 * h + k;
          const uint8_t lb = blk[64 * h + 32 * (k % 2) + j], hb = blk[128 + 32 * h + j];
          const int q = (((k / 2 ? lb >> 4 : lb) & 15) | (((hb >> (2 * k)) & 3) << 4)) - 32;
          const float v = d * sc[2 * s8 + j / 16] * (float)q;
          for (int r = 0; r < NR; ++r) acc[r] += v * x[r][b * 256 + 32 * s8 + j];
        }
  }
  for (int r = 0; r < NR; ++r) out[r] = acc[r];
}

#ifdef MS_DECODE_AVX2
// The same product with the activations as int16 per 256-value block (x ~ xs * xq, |xq| <= 32767: ~2^-16 of the
// block's largest value, against int8's 2^-8 — the head's near-ties stay where float32 puts them) and the codes
// times their scale as int16 (|q * sc| <= 4096): pmaddwd pairs into int32 lanes, 64 values summed exactly (8
// products a lane, < 2^31), then float. ~3x fewer instructions a value than widening the codes to float.
template <int NR>
void q6k_rows_i16(const uint8_t* w, int64_t nb, const int16_t* const* xq, const float* const* xs, float* out) {
  const __m256i m0f = _mm256_set1_epi8(0x0F), m03 = _mm256_set1_epi8(0x03), m32 = _mm256_set1_epi8(32);
  __m256 va[NR], vb[NR];
  __m256i vi[NR];
  for (int r = 0; r < NR; ++r) va[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = (const int8_t*)(blk + 192);
    for (int r = 0; r < NR; ++r) vb[r] = _mm256_setzero_ps(), vi[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
      for (int k = 0; k < 4; ++k) {
        const int s8 = 4 * h + k;
        const __m256i l = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32 * (k % 2)));
        __m256i q = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(l, 4) : l, m0f);
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m03), 4));
        q = _mm256_sub_epi8(q, m32);
        const __m256i wl = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
                                              _mm256_set1_epi16(sc[2 * s8]));
        const __m256i wh = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)),
                                              _mm256_set1_epi16(sc[2 * s8 + 1]));
        const int64_t off = b * 256 + 32 * s8;
        for (int r = 0; r < NR; ++r) {
          const __m256i pl = _mm256_madd_epi16(wl, _mm256_loadu_si256((const __m256i*)(xq[r] + off)));
          const __m256i ph = _mm256_madd_epi16(wh, _mm256_loadu_si256((const __m256i*)(xq[r] + off + 16)));
          vi[r] = _mm256_add_epi32(vi[r], _mm256_add_epi32(pl, ph));
        }
        if (k % 2)
          for (int r = 0; r < NR; ++r)
            vb[r] = _mm256_add_ps(vb[r], _mm256_cvtepi32_ps(vi[r])), vi[r] = _mm256_setzero_si256();
      }
    }
    const float d = fp16(blk + 208);
    for (int r = 0; r < NR; ++r) va[r] = _mm256_fmadd_ps(vb[r], _mm256_set1_ps(d * xs[r][b]), va[r]);
  }
  for (int r = 0; r < NR; ++r) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(va[r]), _mm256_extractf128_ps(va[r], 1));
    const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
}

// x [K] -> int16 per 256-value block and the blocks' scales (x ~ xs[b] * xq), rounded to nearest
void quantize_i16(const float* x, int64_t K, int16_t* xq, float* xs) {
  for (int64_t b = 0; b < K / 256; ++b) {
    float amax = 0;
    for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(x[b * 256 + j]));
    const float s = amax / 32767.0f, inv = amax > 0 ? 32767.0f / amax : 0.0f;
    xs[b] = s;
    for (int j = 0; j < 256; ++j) xq[b * 256 + j] = (int16_t)std::lrintf(x[b * 256 + j] * inv);
  }
}
#endif

// softmax over E logits, the k largest probabilities (descending; ties: lowest id first), optionally
// renormalised to sum 1: as triton_ops.route_topk_torch
void route_row(const float* logits, int64_t E, int64_t k, bool normalize, int64_t* ids, float* w) {
  float mx = -INFINITY;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
  std::vector<float> p(E);
  float sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[e] - mx));
  for (int64_t e = 0; e < E; ++e) p[e] /= sum;
  float tot = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (p[e] >= 0 && (best < 0 || p[e] > p[best])) best = e;
    ids[j] = best, w[j] = p[best], tot += p[best];
    p[best] = -1.0f;
  }
  if (normalize)
    for (int64_t j = 0; j < k; ++j) w[j] /= tot;
}

// the routed experts of B rows: acc [B, H] = sum over each row's k experts (in expert order) of w * mlp(x)
int routed(const int64_t* m, int64_t B, const float* x, const int64_t* ids, const float* w, float* acc, int nt) {
  const int64_t H = m[X_H], K = m[X_K], P = B * K;
  std::vector<int64_t> order(P);
  for (int64_t p = 0; p < P; ++p) order[p] = p;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<int64_t> gstart, wptr, prow(P), pdst(P);
  std::vector<float> pw(P);
  const int64_t* table = (const int64_t*)m[X_TABLE];
  for (int64_t i = 0; i < P; ++i) {
    const int64_t p = order[i], e = ids[p];
    if (i == 0 || e != ids[order[i - 1]]) {
      gstart.push_back(i);
      for (int j = 0; j < 3; ++j) wptr.push_back(table[3 * e + j]);
    }
    prow[i] = p / K, pw[i] = w[p], pdst[i] = i;
  }
  gstart.push_back(P);
  const int64_t wtype[3] = {m[X_TG], m[X_TU], m[X_TD]};
  std::vector<float> y(P * H);
  const int rc = ms_moe_layer(x, 0, B, H, m[X_I], (int64_t)gstart.size() - 1, wptr.data(), wtype, gstart.data(),
                              prow.data(), pw.data(), pdst.data(), y.data(), P, H, 0, 0, nt, 0);
  if (rc) return rc;
  std::fill(acc, acc + B * H, 0.0f);
  for (int64_t i = 0; i < P; ++i)
    for (int64_t c = 0; c < H; ++c) acc[prow[i] * H + c] += y[i * H + c];
  return 0;
}

// acc [B, H] += sigmoid(x . gate) * shared_mlp(x) (ungated: weight 1)
int shared(const int64_t* m, int64_t B, const float* x, float* acc, int nt) {
  const int64_t H = m[X_H];
  const int64_t wptr[3] = {m[X_SG], m[X_SU], m[X_SD]}, wtype[3] = {m[X_STG], m[X_STU], m[X_STD]};
  const int64_t gstart[2] = {0, B};
  std::vector<int64_t> rows(B);
  std::vector<float> pw(B, 1.0f), y(B * H);
  for (int64_t b = 0; b < B; ++b) {
    rows[b] = b;
    if (m[X_SGATE]) {
      float g = 0;
      matmul_f32(x + b * H, 1, H, (const float*)m[X_SGATE], 1, H * 4, &g, 1, 1);
      pw[b] = 1.0f / (1.0f + std::exp(-g));
    }
  }
  const int rc = ms_moe_layer(x, 0, B, H, m[X_SI], 1, wptr, wtype, gstart, rows.data(), pw.data(), rows.data(),
                              y.data(), B, H, 0, 0, nt, 0);
  if (rc) return rc;
  for (int64_t i = 0; i < B * H; ++i) acc[i] += y[i];
  return 0;
}

// the fused block's shared expert from its GEMM's product f [B, N] (columns: router E if fused | gate I | up I |
// shared-expert gate 1): acc [B, H] += sigmoid(gate) * down(silu(gate) * up), down a matmul of its own weight (as
// the per-op path: silu_mul, then the down projection's kernel on the product)
int fused_shared(const int64_t* m, int64_t B, const float* f, int64_t N, float* acc, int nt) {
  const int64_t H = m[X_H], I = m[X_SI], e = m[X_FROUTER] ? m[X_E] : 0;
  std::vector<float> act(B * I), y(B * H);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < I; ++i) {
      const float g = f[b * N + e + i];
      act[b * I + i] = g / (1.0f + std::exp(-g)) * f[b * N + e + I + i];
    }
  const int rc = matmul(act.data(), B, I, (const void*)m[X_SD], H, m[X_SDS], m[X_STD], y.data(), H, nt);
  if (rc) return rc;
  for (int64_t b = 0; b < B; ++b) {
    const float s = 1.0f / (1.0f + std::exp(-f[b * N + e + 2 * I]));
    for (int64_t c = 0; c < H; ++c) acc[b * H + c] += s * y[b * H + c];
  }
  return 0;
}

// router logits [B, E]: from the fused GEMM's first E columns, or the router's own product
int router_logits(const int64_t* m, int64_t B, const float* x, const float* f, int64_t N, float* logits, int nt) {
  const int64_t H = m[X_H], E = m[X_E];
  if (!(m[X_FW] && m[X_FROUTER])) return matmul(x, B, H, (const void*)m[X_RW], E, m[X_RS], m[X_RT], logits, E, nt);
  for (int64_t b = 0; b < B; ++b) std::memcpy(logits + b * E, f + b * N, E * sizeof(float));
  return 0;
}

// ---- Gated DeltaNet (layers/gdn.py GatedDeltaNet's decode step) ----
struct GdnDims {
  int64_t H, hk, hv, dk, dv, kw, kd, vd, cd, P;  // kd, vd: key / value width; cd: conv channels; P: projection
};

GdnDims gdn_dims(const int64_t* g) {
  GdnDims n{g[G_H], g[G_HK], g[G_HV], g[G_DK], g[G_DV], g[G_KW], 0, 0, 0, 0};
  n.kd = n.hk * n.dk, n.vd = n.hv * n.dv, n.cd = 2 * n.kd + n.vd, n.P = n.cd + n.vd + 2 * n.hv;
  return n;
}

// the in-projections of B rows: proj [B, P], columns [mixed q|k|v (cd) | z (vd) | b (Hv) | a (Hv)]
int gdn_project(const int64_t* g, const GdnDims& n, const float* x, int64_t B, float* proj, int nt) {
  int64_t rows[4] = {n.cd, n.vd, n.hv, n.hv};
  if (g[G_NSEG] == 1) rows[0] = n.P;
  return matmul_segs(x, B, n.H, g + G_SEG0, g[G_NSEG], rows, proj, n.P, nt);
}

// one row's causal depthwise conv over its window (the K-1 stored inputs, then this one; the window moves on
// by one in the pool), SiLU, then q and k L2-normed per key head (q also scaled by dk^-1/2): cv [cd]
void gdn_conv_row(const int64_t* g, const GdnDims& n, const float* mixed, int64_t slot, float* cv) {
  const int64_t kw = n.kw;
  float* st = (float*)g[G_CONV] + slot * n.cd * (kw - 1);
  const float* w = (const float*)g[G_CONV_W];
  for (int64_t c = 0; c < n.cd; ++c) {
    float* s = st + c * (kw - 1);
    const float* wc = w + c * kw;
    float acc = 0;
    for (int64_t j = 0; j < kw - 1; ++j) acc += s[j] * wc[j];
    acc += mixed[c] * wc[kw - 1];
    for (int64_t j = 0; j + 2 < kw; ++j) s[j] = s[j + 1];
    s[kw - 2] = mixed[c];
    cv[c] = acc / (1.0f + std::exp(-acc));
  }
  const float qscale = 1.0f / std::sqrt((float)n.dk);
  for (int64_t i = 0; i < 2 * n.hk; ++i) {  // q heads, then k heads
    float* v = cv + i * n.dk;
    float ss = 0;
    for (int64_t d = 0; d < n.dk; ++d) ss += v[d] * v[d];
    const float r = 1.0f / std::sqrt(ss + 1e-6f);
    for (int64_t d = 0; d < n.dk; ++d) v[d] = i < n.hk ? v[d] * r * qscale : v[d] * r;
  }
}

// value head j of one row (its key head j / (Hv / Hk)): the state S [dk, dv] decays by exp(gl), takes the
// delta-rule write u = beta (v - S^T k), S += k u^T, is read o = S^T q; then the gated RMSNorm with silu(z): out [dv]
void gdn_head(const int64_t* g, const GdnDims& n, double eps, const float* cv, const float* z, float gl, float beta,
              int64_t slot, int64_t j, float* u, float* out) {
  const int64_t kh = j / (n.hv / n.hk), dk = n.dk, dv = n.dv;
  const float *q = cv + kh * dk, *k = cv + n.kd + kh * dk, *v = cv + 2 * n.kd + j * dv;
  float* S = (float*)g[G_REC] + (slot * n.hv + j) * dk * dv;
  const float decay = std::exp(gl);
  std::fill(u, u + dv, 0.0f);
  for (int64_t a = 0; a < dk; ++a) {
    float* row = S + a * dv;
    for (int64_t c = 0; c < dv; ++c) row[c] *= decay, u[c] += row[c] * k[a];
  }
  for (int64_t c = 0; c < dv; ++c) u[c] = (v[c] - u[c]) * beta;
  std::fill(out, out + dv, 0.0f);
  for (int64_t a = 0; a < dk; ++a) {
    float* row = S + a * dv;
    for (int64_t c = 0; c < dv; ++c) row[c] += k[a] * u[c], out[c] += row[c] * q[a];
  }
  rms_norm(out, (const float*)g[G_NORM_W], dv, eps, false, out);
  for (int64_t c = 0; c < dv; ++c) out[c] *= z[c] / (1.0f + std::exp(-z[c]));
}

// every (row, value head): gates from the projection's b, a columns (beta = sigmoid(b), gl = -exp(A_log) *
// softplus(a + dt_bias), torch's threshold 20), then gdn_head: o [B, vd]
void gdn_heads(const int64_t* g, const GdnDims& n, double eps, int64_t B, const float* proj, const float* cv,
               const int64_t* slots, float* o, int nt) {
  const float *alog = (const float*)g[G_A_LOG], *dtb = (const float*)g[G_DT_BIAS];
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(nt, B * n.hv * n.dk * n.dv / 16384));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> u(n.dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t jj = 0; jj < B * n.hv; ++jj) {
      const int64_t b = jj / n.hv, j = jj % n.hv;
      const float* pr = proj + b * n.P;
      const float bv = pr[n.cd + n.vd + j], av = pr[n.cd + n.vd + n.hv + j] + dtb[j];
      const float sp = av > 20.0f ? av : std::log1p(std::exp(av));
      gdn_head(g, n, eps, cv + b * n.cd, pr + n.cd + j * n.dv, -std::exp(alog[j]) * sp, 1.0f / (1.0f + std::exp(-bv)),
               slots[b], j, u.data(), o + b * n.vd + j * n.dv);
    }
  }
}

}  // namespace

extern "C" {

// One MoE block for B decode rows (the description `m`: X_* slots): router logits (float32 or stored rows),
// softmax top-k, the routed experts' pairs in one ms_moe_layer call, the optional (gated) shared expert, and
// h [B, H] += their sum. A fused block (X_FW: models/fuse.py's shared_in) computes [router | shared gate | up |
// shared-expert gate] as one GEMM first. x [B, H]: the block's input (the post-attention norm). ids [B, k]
// receives the route (the runtime books it). Returns 0 or the failing kernel's code.
int ms_moe_decode(const int64_t* m, int64_t B, const float* x, float* h, int64_t* ids, int nthreads) {
  const int64_t H = m[X_H], E = m[X_E], K = m[X_K];
  const int64_t N = m[X_FW] ? (m[X_FROUTER] ? E : 0) + 2 * m[X_SI] + 1 : 0;
  double t = mark();
  std::vector<float> logits(B * E), w(B * K), acc(B * H), f(B * N);
  int rc = N ? matmul(x, B, H, (const void*)m[X_FW], N, m[X_FS], m[X_FT], f.data(), N, nthreads) : 0;
  if (rc || (rc = router_logits(m, B, x, f.data(), N, logits.data(), nthreads))) return rc;
  lap(P_ROUTER, t);
  for (int64_t b = 0; b < B; ++b) route_row(logits.data() + b * E, E, K, m[X_NORMALIZE], ids + b * K, w.data() + b * K);
  lap(P_TOPK, t);
  rc = routed(m, B, x, ids, w.data(), acc.data(), nthreads);
  if (rc) return rc;
  lap(P_EXPERTS, t);
  if (N) rc = fused_shared(m, B, f.data(), N, acc.data(), nthreads);
  else if (m[X_SI]) rc = shared(m, B, x, acc.data(), nthreads);
  if (rc) return rc;
  lap(P_SHARED, t);
  for (int64_t i = 0; i < B * H; ++i) h[i] += acc[i];
  lap(P_RESID, t);
  return 0;
}

// out [n, N] (rows os apart) = x [n, K] @ W.T for weights W of ggml type `type`, 8 (Q8_0) or 14 (Q6_K), N rows ws bytes
// apart, without ms_qmatmul's int8 rounding of x: Q8_0 against float32 x as it is, Q6_K against x as int16 per 256
// values (q6k_rows_i16; float32 without AVX2). For a vocabulary head, whose logits pick the tokens. Returns 0, -1 for another type or a K that
// is not a multiple of the type's block.
int ms_float_act_matmul(const float* x, int64_t n, int64_t K, const uint8_t* w, int64_t N, int64_t ws, float* out,
                        int64_t os, int64_t type, int nthreads) {
  const int64_t bs = type == 8 ? 32 : type == 14 ? 256 : 0;
  if (!bs || K % bs) return -1;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, N * K / 65536));
#ifdef MS_DECODE_AVX2
  if (type == 14) {  // Q6_K: int16 activations (q6k_rows_i16)
    std::vector<int16_t> xq(n * K);
    std::vector<float> xsc(n * (K / 256));
    for (int64_t r = 0; r < n; ++r) quantize_i16(x + r * K, K, xq.data() + r * K, xsc.data() + r * (K / 256));
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk_of(N, threads))
    for (int64_t i = 0; i < N; ++i) {
      const uint8_t* wr = w + i * ws;
      for (int64_t r0 = 0; r0 < n; r0 += 4) {
        const int16_t* q[4];
        const float* sx[4];
        float o[4];
        const int nr = (int)std::min<int64_t>(4, n - r0);
        for (int r = 0; r < nr; ++r) q[r] = xq.data() + (r0 + r) * K, sx[r] = xsc.data() + (r0 + r) * (K / 256);
        switch (nr) {
          case 4: q6k_rows_i16<4>(wr, K / 256, q, sx, o); break;
          case 3: q6k_rows_i16<3>(wr, K / 256, q, sx, o); break;
          case 2: q6k_rows_i16<2>(wr, K / 256, q, sx, o); break;
          default: q6k_rows_i16<1>(wr, K / 256, q, sx, o); break;
        }
        for (int r = 0; r < nr; ++r) out[(r0 + r) * os + i] = o[r];
      }
    }
    return 0;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk_of(N, threads))
  for (int64_t i = 0; i < N; ++i) {
    const uint8_t* wr = w + i * ws;
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      const float* xs[4];
      float o[4];
      const int nr = (int)std::min<int64_t>(4, n - r0);
      for (int r = 0; r < nr; ++r) xs[r] = x + (r0 + r) * K;
      if (type == 8) switch (nr) {
        case 4: q8_rows<4>(wr, K / 32, xs, o); break;
        case 3: q8_rows<3>(wr, K / 32, xs, o); break;
        case 2: q8_rows<2>(wr, K / 32, xs, o); break;
        default: q8_rows<1>(wr, K / 32, xs, o); break;
      }
      else switch (nr) {
        case 4: q6k_rows<4>(wr, K / 256, xs, o); break;
        case 3: q6k_rows<3>(wr, K / 256, xs, o); break;
        case 2: q6k_rows<2>(wr, K / 256, xs, o); break;
        default: q6k_rows<1>(wr, K / 256, xs, o); break;
      }
      for (int r = 0; r < nr; ++r) out[(r0 + r) * os + i] = o[r];
    }
  }
  return 0;
}

// One decoder layer for B decode rows (module comment). h [B, H] float32: the residual stream, updated in place;
// x [B, H]: receives norm_post(h) after the attention (the MoE block's input when the layer has no dense MLP;
// scratch otherwise). pos, slot [B]: each row's position and KV write slot; kvidx: the slots of every row's
// sequence (positions 0..total-1, this token's included), row b's at kvidx[kvoff[b] .. kvoff[b+1]).
// Returns 0, or the failing kernel's code (-1 an unsupported weight type or shape).
int ms_decode_layer(const int64_t* d, const double* fd, int64_t B, float* h, float* x, const int64_t* pos,
                    const int64_t* slot, const int64_t* kvidx, const int64_t* kvoff, int nthreads) {
  const int64_t H = d[D_H], nh = d[D_NH], nkv = d[D_NKV], hd = d[D_HD];
  const bool zc = d[D_FLAGS] & F_ZERO_CENTERED, og = d[D_FLAGS] & F_OUT_GATE;
  const double eps = fd[0];
  const int64_t qrows = nh * hd * (og ? 2 : 1), kvrows = nkv * hd;
  double t = mark();
  for (int64_t b = 0; b < B; ++b) rms_norm(h + b * H, (const float*)d[D_IN_NORM], H, eps, zc, x + b * H);
  std::vector<float> qkv(B * (qrows + 2 * kvrows)), q(B * nh * hd), gate(og ? B * nh * hd : 0), att(B * nh * hd);
  lap(P_NORM, t);
  int rc = project_qkv(d, x, B, H, qrows, kvrows, qkv.data(), nthreads);
  if (rc) return rc;
  lap(P_QKV, t);
  for (int64_t b = 0; b < B; ++b)
    prep_row(d, eps, qkv.data() + b * (qrows + 2 * kvrows), pos[b], slot[b], q.data() + b * nh * hd,
             og ? gate.data() + b * nh * hd : nullptr);
  lap(P_PREP, t);
  attention(d, B, q.data(), kvidx, kvoff, att.data(), nthreads);
  if (og)
    for (int64_t i = 0; i < B * nh * hd; ++i) att[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  std::vector<float> o(B * H);
  lap(P_ATTN, t);
  rc = matmul(att.data(), B, nh * hd, (const void*)d[D_WO], H, d[D_SO], d[D_TO], o.data(), H, nthreads);
  if (rc) return rc;
  lap(P_O, t);
  for (int64_t i = 0; i < B * H; ++i) h[i] += o[i];
  for (int64_t b = 0; b < B; ++b) rms_norm(h + b * H, (const float*)d[D_POST_NORM], H, eps, zc, x + b * H);
  lap(P_NORM, t);
  rc = d[D_MLP_I] ? dense_mlp(d, x, B, H, h, nthreads) : 0;
  lap(P_MLP, t);
  return rc;
}

// One Gated DeltaNet decoder layer for B decode rows: x = norm_in(h); [q|k|v | z | b | a] = x @ W.T; per row the
// conv window (conv pool, updated), SiLU, q/k L2 norms; per value head the gated delta rule on the float32 state
// (rec pool, updated in place) and the gated RMSNorm; h += out_proj(o); x = norm_post(h). fd: [the decoder
// norms' eps, the gated norm's eps]; slots [B]: each row's state slot. Returns 0 or the failing kernel's code.
int ms_gdn_decode(const int64_t* g, const double* fd, int64_t B, float* h, float* x, const int64_t* slots,
                  int nthreads) {
  const GdnDims n = gdn_dims(g);
  const bool zc = g[G_FLAGS] & F_ZERO_CENTERED;
  double t = mark();
  for (int64_t b = 0; b < B; ++b) rms_norm(h + b * n.H, (const float*)g[G_IN_NORM], n.H, fd[0], zc, x + b * n.H);
  std::vector<float> proj(B * n.P), cv(B * n.cd), o(B * n.vd), y(B * n.H);
  lap(P_NORM, t);
  int rc = gdn_project(g, n, x, B, proj.data(), nthreads);
  if (rc) return rc;
  lap(P_GDN_PROJ, t);
  for (int64_t b = 0; b < B; ++b) gdn_conv_row(g, n, proj.data() + b * n.P, slots[b], cv.data() + b * n.cd);
  gdn_heads(g, n, fd[1], B, proj.data(), cv.data(), slots, o.data(), nthreads);
  lap(P_GDN_REC, t);
  if (g[G_FLAGS] & F_OUT_TILED) {  // the heads into out_proj's stored order
    const int64_t hk = g[G_HK], hv = g[G_HV], rep = hv / hk, dv = g[G_DV];
    std::vector<float> t(n.vd);
    for (int64_t b = 0; b < B; ++b) {
      float* ob = o.data() + b * n.vd;
      for (int64_t j = 0; j < hv; ++j)
        std::memcpy(t.data() + j * dv, ob + ((j % hk) * rep + j / hk) * dv, dv * sizeof(float));
      std::memcpy(ob, t.data(), n.vd * sizeof(float));
    }
  }
  rc = matmul(o.data(), B, n.vd, (const void*)g[G_WO], n.H, g[G_SO], g[G_TO], y.data(), n.H, nthreads);
  if (rc) return rc;
  lap(P_GDN_OUT, t);
  for (int64_t i = 0; i < B * n.H; ++i) h[i] += y[i];
  for (int64_t b = 0; b < B; ++b) rms_norm(h + b * n.H, (const float*)g[G_POST_NORM], n.H, fd[0], zc, x + b * n.H);
  lap(P_NORM, t);
  return 0;
}

// The whole decoder stack of a decode step in one call (models/cpu_decode.py: every layer described): layer l is
// ms_decode_layer (kinds[l] 1: descs[l], fds[l] its eps) or ms_gdn_decode (kinds[l] 2), then the MoE block
// moes[l] (0: none, the layer's MLP being in its call) with its route written to ids + l * B * k_stride. With
// final_norm (a float32 [H] vector, 0: none) x = that RMSNorm of h at the end (eps fd_final[0], zero-centered
// per final_zc), the vocabulary head's input. Returns 0, or the failing call's code with *failed = its layer.
int ms_decode_stack(int64_t L, const int64_t* kinds, const int64_t* descs, const int64_t* fds, const int64_t* moes,
                    int64_t k_stride, int64_t B, float* h, float* x, const int64_t* pos, const int64_t* slot,
                    const int64_t* kvidx, const int64_t* kvoff, const int64_t* states, int64_t* ids,
                    int64_t final_norm, const double* fd_final, int64_t final_zc, int64_t H, int64_t* failed,
                    int nthreads) {
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* d = (const int64_t*)descs[l];
    const double* fd = (const double*)fds[l];
    int rc = kinds[l] == 1 ? ms_decode_layer(d, fd, B, h, x, pos, slot, kvidx, kvoff, nthreads)
             : kinds[l] == 2 ? ms_gdn_decode(d, fd, B, h, x, states, nthreads) : -2;
    if (!rc && moes[l]) rc = ms_moe_decode((const int64_t*)moes[l], B, x, h, ids + l * B * k_stride, nthreads);
    if (rc) {
      *failed = l;
      return rc;
    }
  }
  double t = mark();
  if (final_norm)
    for (int64_t b = 0; b < B; ++b) rms_norm(h + b * H, (const float*)final_norm, H, fd_final[0], final_zc, x + b * H);
  lap(P_NORM, t);
  return 0;
}

// A whole decode step of B rows from token ids to logits in one call: h = the embedding rows of tokens (io[IO_EMB]:
// float32 rows, type 0, copied; or ms_dequant_rows' types), ms_decode_stack (its arguments as there; x = the final
// norm of h), logits [B, head N] = x @ head.T (io[IO_HEAD]: ms_qmatmul's types, or minus a type ms_float_act_matmul reads: its
// rows against float32 activations). The embedding and the head give the floats the per-op path's QuantEmbedding /
// nn.Embedding and QuantLinear give (the same kernels). Returns 0, -3 for a token out of range, the embedding's or
// the head's code (*failed = -1), or the stack's.
enum : int { IO_EMB_W, IO_EMB_T, IO_EMB_S, IO_EMB_N, IO_TOKENS, IO_HEAD_W, IO_HEAD_T, IO_HEAD_S, IO_HEAD_N, IO_LOGITS };
int ms_decode_logits(int64_t L, const int64_t* kinds, const int64_t* descs, const int64_t* fds, const int64_t* moes,
                     int64_t k_stride, int64_t B, float* h, float* x, const int64_t* pos, const int64_t* slot,
                     const int64_t* kvidx, const int64_t* kvoff, const int64_t* states, int64_t* ids,
                     int64_t final_norm, const double* fd_final, int64_t final_zc, int64_t H, int64_t* failed,
                     const int64_t* io, int nthreads) {
  const int64_t* tokens = (const int64_t*)io[IO_TOKENS];
  *failed = -1;
  for (int64_t b = 0; b < B; ++b)
    if (tokens[b] < 0 || tokens[b] >= io[IO_EMB_N]) return -3;
  int rc = 0;
  double t = mark();
  if (io[IO_EMB_T] == 0)
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(h + b * H, (const char*)io[IO_EMB_W] + tokens[b] * io[IO_EMB_S], H * sizeof(float));
  else
    rc = ms_dequant_rows((const uint8_t*)io[IO_EMB_W], io[IO_EMB_N], io[IO_EMB_S], io[IO_EMB_T], H, tokens, B, h,
                         nthreads);
  if (rc) return rc;
  lap(P_EMBED, t);
  rc = ms_decode_stack(L, kinds, descs, fds, moes, k_stride, B, h, x, pos, slot, kvidx, kvoff, states, ids, final_norm,
                       fd_final, final_zc, H, failed, nthreads);
  if (rc) return rc;
  *failed = -1;
  const int64_t N = io[IO_HEAD_N];
  float* logits = (float*)io[IO_LOGITS];
  t = mark();
  if (io[IO_HEAD_T] < 0)  // -(ggml type): rows against float32 activations
    rc = ms_float_act_matmul(x, B, H, (const uint8_t*)io[IO_HEAD_W], N, io[IO_HEAD_S], logits, N, -io[IO_HEAD_T],
                             nthreads);
  else
    rc = ms_qmatmul(x, B, H, (const uint8_t*)io[IO_HEAD_W], N, io[IO_HEAD_S], io[IO_HEAD_T], logits, N, nthreads, 0);
  lap(P_HEAD, t);
  return rc;
}

int ms_decode_desc_size() { return D_COUNT; }

// For tests (tests/test_cpu_decode.py): src [n] written into a KV pool row of `kind` (store_row: 0 float32, 1 float16,
// 2 e4m3fn), then read back as float32 by load_row into back [n] and, in an AVX2 build with n % 8 == 0, by the
// attention's in-register widening (kv8) into back8 [n] (left as it is otherwise). Returns 1 if back8 was written.
int ms_kv_roundtrip(int kind, const float* src, int64_t n, void* pool, float* back, float* back8) {
  store_row(pool, 0, src, n, kind);
  std::vector<float> tmp(n);
  const float* r = load_row(pool, 0, n, kind, tmp.data());
  std::memcpy(back, r, n * sizeof(float));
#ifdef MS_DECODE_AVX2
  if (n % 8 == 0) {
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(back8 + i, kind == KV_FP8 ? kv8<KV_FP8>(pool, i) : kind == KV_F16 ? kv8<KV_F16>(pool, i)
                                                                                          : kv8<KV_F32>(pool, i));
    return 1;
  }
#endif
  return 0;
}

// The per-part profile of the decode calls (the P_* parts): on 1 starts it from zero, on 0 stops it; seconds and
// counts [P_COUNT] are copied out when non-null. Returns P_COUNT.
int ms_decode_profile(int on, double* seconds, int64_t* counts) {
  if (seconds) std::memcpy(seconds, g_prof_s, sizeof g_prof_s);
  if (counts) std::memcpy(counts, g_prof_n, sizeof g_prof_n);
  if (on) std::memset(g_prof_s, 0, sizeof g_prof_s), std::memset(g_prof_n, 0, sizeof g_prof_n);
  g_prof = on;
  return P_COUNT;
}

}  // extern "C"
