// moestream CPU kernels: y[n, N] = x[n, K] @ W.T with W in GGUF block formats, read from its stored bytes.
//
// Block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): each activation row is quantized
// once per call to int8 in blocks of 32 (one float scale per block, plus that scale times the sum of
// the block's int8 values), then every weight sub-block of 32 is unpacked to small integers q with
// value = a * q + b, and the dot product is a * dx * sum(q * xq) + b * dx * sum(xq): integer products
// (AVX2: _mm256_maddubs_epi16 + _mm256_madd_epi16; AVX512-VNNI: _mm256_dpbusd_epi32), one float
// multiply-add per 32 values per row. K-quants (Q4_K, Q5_K, Q6_K) take activations with one scale per 256
// values (QActK): integer sums over the whole super-block, one float multiply-add per 256 values per row.
// Codebook formats: IQ4_NL and MXFP4 (blocks of 32, one fp16 / e8m0 scale, 4-bit codes into the IQ4_NL
// levels / doubled e2m1 values) are signed blocks like Q8_0 once the nibbles are looked up (one
// _mm256_shuffle_epi8); IQ4_XS (the IQ4_NL levels, 6-bit sub-block scales) and IQ3_S (9-bit indices into a
// 512 x 4 grid, sign bits, 4-bit sub-block scales) take QActK rows like the K-quants: per sub-block |q| times
// x carrying q's sign, times the integer sub-block scale, one float multiply-add per 256 values per row.
// HF safetensors FP4 (ModelOpt NVFP4: e2m1 pairs, an e4m3 scale per 16 values and an fp32 global scale; gpt-oss
// MXFP4: e2m1 pairs, an e8m0 scale per 32): the codes and the scales are separate arrays (a Mat), the nibbles
// looked up as MXFP4's, against activations rounded to int8 per 16 in "pair order" (see the HF FP4 section).
// ms_moe_layer: a MoE layer's pairs in one call (gate/up, SiLU, down, routing weight), one OpenMP region.
// F16 / BF16 weights multiply float32 activations directly (no activation quantization), and so do HF FP8
// weights (ms_fp8_matmul).
//
// Every kernel has a scalar twin (portable C++); `force_scalar` selects it at run time, so the tests
// check both paths from one build. Rows of W are handed out in chunks to `nthreads` OpenMP threads (the caller
// passes torch.get_num_threads(); torch's own libgomp serves them); each weight row is read once for all x rows.
// Plain C ABI, no torch headers: the first build takes seconds, not the minute torch/extension.h costs.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <dlfcn.h>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MS_AVX2 1
// AVX512-VNNI (built only where the CPU has it, see cpu_quant._ISAS): the int8 dot products of the 32-value
// blocks become one vpdpbusd instead of vpmaddubsw + vpmaddwd; the integer sums are the same.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MS_VNNI 1
#endif
#endif

namespace {

// ------------------------------------------------------------------ threads
// The kernels' own thread pool, or OpenMP (the default; ms_set_threading). Why a pool of our own: a decode
// step calls a kernel every few tens of microseconds (a CPU-only model's linears) or once per MoE layer
// between GPU work (the cpu/hybrid bridge); a team must start hot each time. The pool's workers spin for
// `spin_us` after a job before they sleep (condition variable), the caller is thread 0, and barriers inside a
// job spin and then yield (a 2-core machine with other work stays usable). OpenMP's runtime decides its own
// spinning (libgomp: next to none once it manages more threads than there are CPUs) and is shared with every
// other OpenMP user of the process. One job at a time: a caller that finds the pool busy (another Python
// thread inside a kernel) runs its job on OpenMP instead; results do not depend on which ran it.
struct Pool {
  std::vector<std::thread> workers;
  std::mutex run_mu;                 // one job at a time
  std::mutex mu;                     // sleeping workers
  std::condition_variable cv;
  std::atomic<uint64_t> gen{0};      // job generation: a worker runs each generation once
  std::atomic<int> pending{0};       // participating workers still inside the job
  std::atomic<int> sleepers{0};
  std::atomic<int> bar_count{0};
  std::atomic<uint64_t> bar_gen{0};
  std::atomic<int64_t> spin_ns{300000};
  std::atomic<int> hold{0};          // > 0: idle workers keep spinning (a CPU bridge step is under way)
  const std::function<void(int, int)>* job = nullptr;
  int nt = 1;
  bool stop = false;

  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
      gen.fetch_add(1);
    }
    cv.notify_all();
    for (auto& w : workers) w.join();
  }

  static void relax() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_ia32_pause();
#endif
  }

  void worker(int id) {
    uint64_t seen = 0;
    for (;;) {
      // wait for a new generation: spin, then sleep
      const auto t0 = std::chrono::steady_clock::now();
      int k = 0;
      while (gen.load(std::memory_order_acquire) == seen) {
        relax();
        if (++k % 256 != 0) continue;
        if (hold.load(std::memory_order_relaxed) > 0) {  // spin through a bridge step; let others have the core
          if (k % 4096 == 0) std::this_thread::yield();
          continue;
        }
        if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() >
            spin_ns.load(std::memory_order_relaxed)) {
          std::unique_lock<std::mutex> lk(mu);
          sleepers.fetch_add(1);
          cv.wait(lk, [&] { return gen.load() != seen; });
          sleepers.fetch_sub(1);
          break;
        }
      }
      seen = gen.load(std::memory_order_acquire);
      if (stop) return;
      if (id < nt) {
        (*job)(id, nt);
        pending.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  // f(t, T) on T threads (the caller is t = 0); false if the pool is busy (nothing ran).
  bool run(int T, const std::function<void(int, int)>& f) {
    std::unique_lock<std::mutex> busy(run_mu, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    while ((int)workers.size() < T - 1) {
      const int id = (int)workers.size() + 1;
      workers.emplace_back([this, id] { worker(id); });
    }
    job = &f;
    nt = T;
    bar_count.store(0);
    pending.store(T - 1);
    gen.fetch_add(1);  // seq_cst: ordered before the sleepers check below
    if (sleepers.load() > 0) {
      std::lock_guard<std::mutex> lk(mu);
      cv.notify_all();
    }
    f(0, T);
    int k = 0;
    while (pending.load(std::memory_order_acquire) > 0)
      if (++k % 1024 == 0) std::this_thread::yield(); else relax();
    return true;
  }

  void barrier(int T) {
    const uint64_t g = bar_gen.load(std::memory_order_acquire);
    if (bar_count.fetch_add(1, std::memory_order_acq_rel) == T - 1) {
      bar_count.store(0, std::memory_order_relaxed);
      bar_gen.fetch_add(1, std::memory_order_release);
      return;
    }
    int k = 0;
    while (bar_gen.load(std::memory_order_acquire) == g)
      if (++k % 1024 == 0) std::this_thread::yield(); else relax();
  }
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: workers may outlive static destruction order at exit
  return *p;
}

std::atomic<int> g_use_pool{0};
thread_local int tl_use_pool = -1;  // this thread's calls: -1 follow g_use_pool, 0 OpenMP, 1 the pool

// body(t, T, barrier) on up to nt threads: the pool, or OpenMP when it is off or busy.
template <class B>
void parallel(int nt, B&& body) {
  if (nt <= 1) {
    body(0, 1, [] {});
    return;
  }
  if (tl_use_pool >= 0 ? tl_use_pool > 0 : g_use_pool.load(std::memory_order_relaxed)) {
    Pool& p = pool();
    const std::function<void(int, int)> f = [&](int t, int T) { body(t, T, [&p, T] { p.barrier(T); }); };
    if (p.run(nt, f)) return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  body(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
  });
#else
  body(0, 1, [] {});
#endif
}

// Work is handed out in chunks, several per thread, from an atomic counter (not split once into one part per
// thread): a thread that the OS holds back (another thread of the process on its core: the launching thread,
// the CUDA driver's, a second core that is not always ours on a small VM) computes fewer chunks instead of
// keeping every other thread waiting at the end of the region. Which thread computes an item never changes
// its numbers.
constexpr int64_t CHUNKS_PER_THREAD = 8;

// The MoE layer call's work split and read-ahead, settable at run time (ms_set_layer_tuning) so one process can time
// several settings on a machine (the defaults were tuned on a 2-core VM; a 16-core host's memory system may want
// fewer, longer chunks a thread or more read ahead): chunks per thread, the least weight bytes a chunk, how many
// interleaved 8-row groups ahead a thread asks for (0: none), and how many rows ahead for the other types (for
// matrices of PREFETCH_MIN_BYTES or more). Results do not depend on them.
// g_layer_chunk_bytes 0 (the default): max(32 KiB, 8 KiB x the call's threads) — 32 KiB up to 4 threads (the 2-core VM's
// tuning), 128 KiB at 16: on two 16-core H100 hosts 128 KiB read 8 random Q4_K_M experts a call 3 % and 12 % faster than
// 32 KiB (benchmarks/RESULTS.md, 2026-12-06: 95.1 vs 92.4 GB/s, alternating rounds; 63.2 vs 56.5).
std::atomic<int64_t> g_layer_chunks{CHUNKS_PER_THREAD}, g_layer_chunk_bytes{0}, g_x8_ahead{0}, g_rows_ahead{2};
// flow 1: a decode call's down rows of an expert start as soon as that expert's gate/up rows are done (counted per
// expert), instead of after a barrier on every expert's: the threads that finish the gate/up rows first do not wait
// for the last chunk (the tail of one of the call's two phases; a 16-core host's call of 8 experts takes ~40 us
// beyond its bytes; the 2-core VM: within its noise, −2 % to +5 % a call, a quarter-size Qwen3-30B-A3B's decode
// +1.3 %; a 16-core H100 host, 2026-12-06: 92.4 vs 89.6 GB/s a call of 8 experts, the `cpu` backend's decode 63.5 / 66.2
// vs 61.4 / 63.1 tok/s alternating). 1 is the default; 0: the barrier. Same products either way.
std::atomic<int64_t> g_layer_flow{1};
// tail S > 1: each of a phase's last `threads` chunks is split into S (a phase ends when its last chunk does: with chunks
// of 128 KiB a thread of a 16-core host reads ~30 us a chunk, and the threads that finish early wait that long for the
// last one). 1 (the default): no split. Same products either way.
std::atomic<int64_t> g_layer_tail{1};

// Where a layer call's time goes (ms_layer_profile; off unless asked, for benchmarks/cpu_layer_tuning.py): per call,
// seconds from entry to the first thread's start, from then to the first and the last thread done with the gate/up rows,
// to the first and the last done with the down rows, and entry to return, summed over the calls profiled.
std::atomic<int> g_layer_prof{0};
std::mutex g_layer_prof_mu;
double g_layer_prof_sum[7] = {0, 0, 0, 0, 0, 0, 0};  // calls, setup, p1 first, p1 last, p2 first, p2 last, total
inline double prof_clock() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// the calling thread's read-ahead for its layer calls (-1: g_x8_ahead / g_rows_ahead); ms_bridge_step sets them
thread_local int64_t tl_x8_ahead = -1, tl_rows_ahead = -1;

// Chunk numbers 0, 1, ..., n - 1, each handed to whichever thread asks next (next() is false once all are out).
struct Chunks {
  std::atomic<int64_t> c{0};
  int64_t n;
  explicit Chunks(int64_t chunks) : n(chunks) {}
  bool next(int64_t& k) {
    k = c.fetch_add(1, std::memory_order_relaxed);
    return k < n;
  }
};

// f(begin, end) over [0, n) on up to nt threads, in chunks of at least `grain` items.
template <class F>
void par_for(int64_t n, int64_t grain, int nt, F&& f) {
  grain = std::max<int64_t>(1, grain);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nt, n / grain));
  if (parts == 1) {
    f((int64_t)0, n);
    return;
  }
  Chunks chunks(std::max<int64_t>(parts, std::min<int64_t>(parts * CHUNKS_PER_THREAD, n / grain)));
  parallel((int)parts, [&](int, int, auto&&) {
    for (int64_t c; chunks.next(c);) f(c * n / chunks.n, (c + 1) * n / chunks.n);
  });
}

// ggml type ids (the ones this file computes)
enum : int64_t { T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
                 T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ4_XS = 23,
                 T_BF16 = 30, T_MXFP4 = 39 };
// HF safetensors formats the kernels read (not ggml ids; cpu_quant.HF_TYPES): codes and scales in separate arrays
enum : int64_t { T_HF_NVFP4 = 1001, T_HF_MXFP4 = 1002, T_HF_FP8 = 1003 };
// This library's own layouts (not ggml ids): Q4_K, Q4_0, Q4_1, Q6_K and Q8_0 with 8 rows interleaved (ms_repack_x8,
// the "8 rows interleaved" section)
enum : int64_t { T_Q4_K8 = 1012, T_Q4_0X8 = 1013, T_Q4_1X8 = 1014, T_Q6_K8 = 1015, T_Q8_0X8 = 1016 };
inline bool is_x8_type(int64_t type) {
  return type == T_Q4_K8 || type == T_Q4_0X8 || type == T_Q4_1X8 || type == T_Q6_K8 || type == T_Q8_0X8;
}
inline bool is_hf_fp4(int64_t type) { return type == T_HF_NVFP4 || type == T_HF_MXFP4; }
inline bool is_hf_fp8(int64_t type) { return type == T_HF_FP8; }

// Non-linear 4-bit codebooks (format constants, as int8): the IQ4_NL / IQ4_XS levels, and the e2m1 values
// doubled (MXFP4; its block scale is then half the e8m0 scale, e8m0_half).
alignas(16) constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
alignas(16) constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The IQ3_S codebook: 512 entries of 4 unsigned values (odd, 1..15), one uint32 each (value i in byte i).
// Not a rule but data: set at load from the gguf package's table (ms_set_iq3s_grid); until then IQ3_S is
// refused (row_bytes -1).
uint32_t g_iq3s_grid[512];
std::atomic<int> g_iq3s_ready{0};

// 2^(e - 128): half the e8m0 scale 2^(e - 127), as float bits (e < 2: subnormal).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr int QB = 32;  // activation block

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef MS_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = std::ldexp((float)man, -24);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// The quantized activations: n rows of K int8, with per-32 scale d and d * sum(q).
struct QAct {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> si;  // each block's sum of its int8 values (s = d * si)
  int64_t K = 0, nb = 0;
  const int8_t* qr(int64_t r) const { return q.data() + r * K; }
  const float* dr(int64_t r) const { return d.data() + r * nb; }
  const float* sr(int64_t r) const { return s.data() + r * nb; }
  const int32_t* sir(int64_t r) const { return si.data() + r * nb; }
  void resize(int64_t n) { q.resize(n * K), d.resize(n * nb), s.resize(n * nb), si.resize(n * nb); }
  void quantize(const float* x, int64_t r);
};

void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* si) {
  for (int64_t b = 0; b < K / QB; ++b) {
    const float* xb = x + b * QB;
    float amax = 0.f;
    for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
    int sum = 0;
    for (int i = 0; i < QB; ++i) {
      const int v = (int)std::nearbyint(xb[i] * id);
      q[b * QB + i] = (int8_t)v;
      sum += v;
    }
    d[b] = db;
    s[b] = db * (float)sum;
    si[b] = sum;
  }
}

void QAct::quantize(const float* x, int64_t r) {
  quantize_row(x, K, q.data() + r * K, d.data() + r * nb, s.data() + r * nb, si.data() + r * nb);
}

// K-quant activations (llama.cpp's "Q8_K" idea): int8 with ONE float scale per 256 values and the sums of
// every 16 int8 values, so a K-quant block's dot product is integer sums across its sub-blocks, multiplied
// by the sub-block scales as integers, and one float multiply-add per 256 values per row.
constexpr int KB = 256;
struct QActK {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bs;
  int64_t K = 0, nb = 0;
  void resize(int64_t n, int64_t K_) {
    K = K_, nb = K_ / KB;
    q.resize(n * K), d.resize(n * nb), bs.resize(n * (K / 16));
  }
  const int8_t* qr(int64_t r) const { return q.data() + r * K; }
  const float* dr(int64_t r) const { return d.data() + r * nb; }
  const int16_t* br(int64_t r) const { return bs.data() + r * (K / 16); }
};

void quantize_row_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bs) {
  for (int64_t b = 0; b < K / KB; ++b) {
    const float* xb = x + b * KB;
    float amax = 0.f;
    for (int i = 0; i < KB; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
    for (int g = 0; g < KB / 16; ++g) {
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        const int v = (int)std::nearbyint(xb[i] * id);
        q[b * KB + i] = (int8_t)v;
        sum += v;
      }
      bs[b * (KB / 16) + g] = (int16_t)sum;
    }
    d[b] = db;
  }
}

// HF FP4 activations (see the HF FP4 section): int8 with one scale per 16 values (d = amax / 127 of the 16),
// stored per 32-block in pair order (element 2i at position i, 2i + 1 at 16 + i); per 32-block the 8 lane
// scales (d0, d0, d1, d1, d0, d0, d1, d1) its 8 int32 sums take (d0 of elements 0-15, d1 of 16-31), and the
// 8 lane offsets -12 * (sum of the lane's 4 int8 values) that undo the AVX2 kernel's +12 on every code.
struct QActF4 {
  std::vector<int8_t> q;
  std::vector<float> dl;
  std::vector<int32_t> off;
  int64_t K = 0;
  void resize(int64_t n, int64_t K_) {
    K = K_;
    q.resize(n * K), dl.resize(n * (K / 32) * 8), off.resize(n * (K / 32) * 8);
  }
  const int8_t* qr(int64_t r) const { return q.data() + r * K; }
  const float* dr(int64_t r) const { return dl.data() + r * (K / 32) * 8; }
  const int32_t* offr(int64_t r) const { return off.data() + r * (K / 32) * 8; }
  void quantize(const float* x, int64_t r);
};

void quantize_row_fp4(const float* x, int64_t K, int8_t* q, float* dl, int32_t* off) {
  for (int64_t b = 0; b < K / 16; ++b) {
    const float* xb = x + b * 16;
    float amax = 0.f;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
    const int h = (int)(b % 2);  // which half of its 32-block
    for (int i = 0; i < 16; ++i) {
      const int e = 16 * h + i;  // the element's index in the 32-block
      q[32 * (b / 2) + (e & 1) * 16 + e / 2] = (int8_t)(int)std::nearbyint(xb[i] * id);
    }
    float* l = dl + 8 * (b / 2);
    l[2 * h] = l[2 * h + 1] = l[2 * h + 4] = l[2 * h + 5] = db;
  }
  for (int64_t j = 0; j < K / 32 * 8; ++j)  // lane j % 8 of block j / 8: positions 4 (j % 8) .. + 3
    off[j] = -12 * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
}

void QActF4::quantize(const float* x, int64_t r) {
  quantize_row_fp4(x, K, q.data() + r * K, dl.data() + r * (K / 32) * 8, off.data() + r * (K / 32) * 8);
}

// Activation rows one pass over a weight row reads against: 8 where AVX-512 gives 32 vector registers (the
// accumulators of 8 rows stay in registers, and a weight row is unpacked once per 8 rows instead of per 4), else 4.
// Each row's sums are the same whichever pass computes it.
#if defined(MS_VNNI)
constexpr int XR_ROWS = 8;
#else
constexpr int XR_ROWS = 4;
#endif

// Up to XR_ROWS quantized activation rows, by pointer (rows of one QAct / QActK / QActF4, or pairs gathered from them).
struct XR {
  const int8_t* q[XR_ROWS];
  const float* d[XR_ROWS];
  const float* s[XR_ROWS];
  const int32_t* si[XR_ROWS];  // QAct rows only
  const int16_t* bs[XR_ROWS];  // QActK rows only
  const int32_t* off[XR_ROWS];  // QActF4 rows only
};

inline XR xrows(const QAct& a, const int64_t* rows, int nr) {
  XR x{};
  for (int r = 0; r < nr; ++r)
    x.q[r] = a.qr(rows[r]), x.d[r] = a.dr(rows[r]), x.s[r] = a.sr(rows[r]), x.si[r] = a.sir(rows[r]);
  return x;
}

inline XR xrows(const QActK& a, const int64_t* rows, int nr) {
  XR x{};
  for (int r = 0; r < nr; ++r) x.q[r] = a.qr(rows[r]), x.d[r] = a.dr(rows[r]), x.bs[r] = a.br(rows[r]);
  return x;
}

inline XR xrows(const QActF4& a, const int64_t* rows, int nr) {  // d: the lane scales, 8 per 32-block
  XR x{};
  for (int r = 0; r < nr; ++r) x.q[r] = a.qr(rows[r]), x.d[r] = a.dr(rows[r]), x.off[r] = a.offr(rows[r]);
  return x;
}

QAct quantize(const float* x, int64_t n, int64_t K, int nt) {
  QAct a;
  a.K = K;
  a.nb = K / QB;
  a.resize(n);
  par_for(n, 16, nt, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) a.quantize(x + r * K, r);
  });
  return a;
}

// ------------------------------------------------------------------ scalar unpackers
// unpack(w, K, f) calls f(j, q[32], a0, a1, b) for each sub-block j of 32 values of one weight row:
// value_i = (i < 16 ? a0 : a1) * q_i + b.
struct Sub {
  int q[QB];
  float a0, a1, b;
};

inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {  // Q4_K / Q5_K 6-bit pairs
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// IQ4_NL / MXFP4 blocks of 32: 4-bit codes into a codebook (low nibbles values 0-15, high nibbles 16-31),
// one scale: fp16 d + 16 bytes (IQ4_NL), or an e8m0 byte + 16 bytes (MXFP4, doubled e2m1 codes).
template <class F>
void unpack_lut4_scalar(bool mx, const uint8_t* w, int64_t K, Sub& u, F&& f) {
  const int8_t* lut = mx ? kE2M1x2 : kIQ4NL;
  for (int64_t j = 0; j < K / 32; ++j, w += mx ? 17 : 18) {
    const uint8_t* qs = w + (mx ? 1 : 2);
    u.a0 = u.a1 = mx ? e8m0_half(w[0]) : half_to_float(w), u.b = 0.f;
    for (int i = 0; i < 16; ++i) u.q[i] = lut[qs[i] & 0x0F], u.q[i + 16] = lut[qs[i] >> 4];
    f(j, u);
  }
}

template <class F>
void unpack_scalar(int64_t type, const uint8_t* w, int64_t K, F&& f) {
  Sub u;
  switch (type) {
    case T_Q8_0:
      for (int64_t j = 0; j < K / 32; ++j, w += 34) {
        u.a0 = u.a1 = half_to_float(w), u.b = 0.f;
        for (int i = 0; i < 32; ++i) u.q[i] = (int8_t)w[2 + i];
        f(j, u);
      }
      break;
    case T_Q4_0:
    case T_Q4_1: {
      const bool has_min = type == T_Q4_1;
      const int qo = has_min ? 4 : 2;
      for (int64_t j = 0; j < K / 32; ++j, w += has_min ? 20 : 18) {
        const float d = half_to_float(w);
        u.a0 = u.a1 = d, u.b = has_min ? half_to_float(w + 2) : -8.f * d;
        for (int i = 0; i < 16; ++i) u.q[i] = w[qo + i] & 0x0F, u.q[i + 16] = w[qo + i] >> 4;
        f(j, u);
      }
      break;
    }
    case T_Q5_0:
    case T_Q5_1: {
      const bool has_min = type == T_Q5_1;
      const int ho = has_min ? 4 : 2;
      for (int64_t j = 0; j < K / 32; ++j, w += has_min ? 24 : 22) {
        const float d = half_to_float(w);
        uint32_t qh;
        std::memcpy(&qh, w + ho, 4);
        u.a0 = u.a1 = d, u.b = has_min ? half_to_float(w + 2) : -16.f * d;
        for (int i = 0; i < 16; ++i) {
          u.q[i] = (w[ho + 4 + i] & 0x0F) | (((qh >> i) & 1) << 4);
          u.q[i + 16] = (w[ho + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        }
        f(j, u);
      }
      break;
    }
    case T_IQ4_NL:
    case T_MXFP4:
      unpack_lut4_scalar(type == T_MXFP4, w, K, u, f);
      break;
    case T_Q4_K:
    case T_Q5_K: {
      const bool five = type == T_Q5_K;
      for (int64_t blk = 0; blk < K / 256; ++blk, w += five ? 176 : 144) {
        const float d = half_to_float(w), dmin = half_to_float(w + 2);
        const uint8_t* qh = w + 16;
        const uint8_t* qs = w + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          k_scale_min(w + 4, j, sc, m);
          u.a0 = u.a1 = d * sc, u.b = -dmin * m;
          const uint8_t* c = qs + 32 * (j / 2);
          for (int i = 0; i < 32; ++i) {
            u.q[i] = (j & 1) ? c[i] >> 4 : c[i] & 0x0F;
            if (five) u.q[i] |= ((qh[i] >> j) & 1) << 4;
          }
          f(blk * 8 + j, u);
        }
      }
      break;
    }
    case T_Q6_K:
      for (int64_t blk = 0; blk < K / 256; ++blk, w += 210) {
        const float d = half_to_float(w + 208);
        const int8_t* sc = (const int8_t*)(w + 192);
        for (int s = 0; s < 8; ++s) {
          const int h = s / 4, k = s % 4;
          const uint8_t* ql = w + 64 * h + 32 * (k % 2);
          const uint8_t* qh = w + 128 + 32 * h;
          u.a0 = d * sc[2 * s], u.a1 = d * sc[2 * s + 1], u.b = 0.f;
          for (int i = 0; i < 32; ++i)
            u.q[i] = (((k / 2) ? ql[i] >> 4 : ql[i] & 0x0F) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32;
          f(blk * 8 + s, u);
        }
      }
      break;
  }
}

template <int NR>
void dot_scalar(int64_t type, const uint8_t* w, int64_t K, const XR& x, float* out) {
  double acc[NR] = {};
  unpack_scalar(type, w, K, [&](int64_t j, const Sub& u) {
    for (int r = 0; r < NR; ++r) {
      const int8_t* xq = x.q[r] + j * QB;
      int s0 = 0, s1 = 0;
      for (int i = 0; i < 16; ++i) s0 += u.q[i] * xq[i], s1 += u.q[i + 16] * xq[i + 16];
      acc[r] += (double)x.d[r][j] * (u.a0 * s0 + u.a1 * s1) + (double)u.b * x.s[r][j];
    }
  });
  for (int r = 0; r < NR; ++r) out[r] = (float)acc[r];
}

// The 8 6-bit scales and mins of a Q4_K/Q5_K block (12 bytes at s) as bytes, k_scale_min's rule done
// four bytes at a time: sub-blocks 0-3 are the low 6 bits of bytes 0-3 (scales) / 4-7 (mins); sub-blocks
// 4-7 take their low 4 bits from a nibble of bytes 8-11 and their top 2 bits from bits 6-7 of bytes 0-3 /
// 4-7 (per-byte shifts within a 32-bit word: the masks drop what crosses a byte boundary).
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  uint32_t a0, a1, a2;
  std::memcpy(&a0, s, 4);
  std::memcpy(&a1, s + 4, 4);
  std::memcpy(&a2, s + 8, 4);
  const uint32_t sc_lo = a0 & 0x3f3f3f3fu, mn_lo = a1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &mn_lo, 4);
  std::memcpy(mn + 4, &mn_hi, 4);
}

// K-quant weights against QActK rows: per 256-block integer sums, one float product per block and row.
template <int NR>
void dot_k_scalar(int64_t type, const uint8_t* w, int64_t K, const XR& x, float* out) {
  double acc[NR] = {};
  const int64_t tb = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
  for (int64_t blk = 0; blk < K / KB; ++blk, w += tb) {
    if (type == T_Q6_K) {
      const float d = half_to_float(w + 208);
      const int8_t* sc = (const int8_t*)(w + 192);
      for (int r = 0; r < NR; ++r) {
        const int8_t* xq = x.q[r] + blk * KB;
        int isum = 0;
        for (int s8 = 0; s8 < 8; ++s8) {  // sub-blocks of 32 as dot_avx2 lays them out
          const int h = s8 / 4, k = s8 % 4;
          const uint8_t* ql = w + 64 * h + 32 * (k % 2);
          const uint8_t* qh = w + 128 + 32 * h;
          for (int half = 0; half < 2; ++half) {
            int sum = 0;
            for (int i = 16 * half; i < 16 * half + 16; ++i) {
              const int q = (((k / 2) ? ql[i] >> 4 : ql[i] & 0x0F) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32;
              sum += q * xq[32 * s8 + i];
            }
            isum += sc[2 * s8 + half] * sum;
          }
        }
        acc[r] += (double)d * x.d[r][blk] * isum;
      }
    } else {
      const bool five = type == T_Q5_K;
      const float d = half_to_float(w), dmin = half_to_float(w + 2);
      uint8_t sc[8], mn[8];
      k_scales(w + 4, sc, mn);
      const uint8_t* qh = w + 16;
      const uint8_t* qs = w + (five ? 48 : 16);
      for (int r = 0; r < NR; ++r) {
        const int8_t* xq = x.q[r] + blk * KB;
        const int16_t* bs = x.bs[r] + blk * (KB / 16);
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
          const uint8_t* c = qs + 32 * (j / 2);
          int sum = 0;
          for (int i = 0; i < 32; ++i) {
            int q = (j & 1) ? c[i] >> 4 : c[i] & 0x0F;
            if (five) q |= ((qh[i] >> j) & 1) << 4;
            sum += q * xq[32 * j + i];
          }
          isum += sc[j] * sum;
          msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
        }
        acc[r] += (double)x.d[r][blk] * ((double)d * isum - (double)dmin * msum);
      }
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = (float)acc[r];
}

// One IQ4_XS / IQ3_S super-block of 256 as signed integers q (int8) and one integer scale per 32 values:
// value i = d * sc[i / 32] * q[i]; returns d. IQ4_XS: fp16 d, 16-bit high and 4 bytes of low scale bits
// (6-bit scale - 32), 128 bytes of codes into the IQ4_NL levels (per 32: 16 bytes, low nibbles first).
// IQ3_S: fp16 d, 64 low bytes + 8 bytes of high bits of 9-bit grid indices (4 values each), 32 bytes of sign
// bits (bit i: value i negative), 4 bytes of 4-bit scales (1 + 2 s).
inline float iq_block_scalar(int64_t type, const uint8_t* w, int8_t* q, int* sc) {
  if (type == T_IQ4_XS) {
    const int sh = w[2] | (w[3] << 8);
    for (int j = 0; j < 8; ++j) {
      sc[j] = (((w[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
      const uint8_t* qs = w + 8 + 16 * j;
      for (int i = 0; i < 16; ++i) q[32 * j + i] = kIQ4NL[qs[i] & 15], q[32 * j + 16 + i] = kIQ4NL[qs[i] >> 4];
    }
  } else {
    const uint8_t *qs = w + 2, *qh = w + 66, *sg = w + 74, *scb = w + 106;
    for (int j = 0; j < 8; ++j) {
      sc[j] = 1 + 2 * ((scb[j / 2] >> (4 * (j % 2))) & 15);
      for (int g = 0; g < 8; ++g) {
        const uint32_t e = g_iq3s_grid[qs[8 * j + g] | (((qh[j] >> g) & 1) << 8)];
        for (int b = 0; b < 4; ++b) {
          const int i = 32 * j + 4 * g + b, v = (int)((e >> (8 * b)) & 0xFF);
          q[i] = (int8_t)(((sg[i / 8] >> (i % 8)) & 1) ? -v : v);
        }
      }
    }
  }
  return half_to_float(w);
}

// IQ4_XS / IQ3_S weights against QActK rows: integer sums per sub-block times its integer scale, one float
// product per 256 values and row.
template <int NR>
void dot_iq_scalar(int64_t type, const uint8_t* w, int64_t K, const XR& x, float* out) {
  double acc[NR] = {};
  int8_t q[KB];
  int sc[8];
  for (int64_t blk = 0; blk < K / KB; ++blk, w += type == T_IQ4_XS ? 136 : 110) {
    const float d = iq_block_scalar(type, w, q, sc);
    for (int r = 0; r < NR; ++r) {
      const int8_t* xq = x.q[r] + blk * KB;
      int isum = 0;
      for (int j = 0; j < 8; ++j) {
        int sum = 0;
        for (int i = 32 * j; i < 32 * j + 32; ++i) sum += q[i] * xq[i];
        isum += sc[j] * sum;
      }
      acc[r] += (double)d * x.d[r][blk] * isum;
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = (float)acc[r];
}

template <int NR>
void dot_float_scalar(bool bf16, const uint8_t* w, const float* const* x, int64_t off, int64_t K, float* out) {
  double acc[NR] = {};
  for (int64_t i = 0; i < K; ++i) {
    float v;
    if (bf16) {
      const uint32_t bits = (uint32_t)(w[2 * i] | (w[2 * i + 1] << 8)) << 16;
      std::memcpy(&v, &bits, 4);
    } else {
      v = half_to_float(w + 2 * i);
    }
    for (int r = 0; r < NR; ++r) acc[r] += (double)v * x[r][off + i];
  }
  for (int r = 0; r < NR; ++r) out[r] = (float)acc[r];
}

#ifdef MS_AVX2
// ------------------------------------------------------------------ AVX2 unpackers
// unpack_avx2<T>(w, K, f) calls f(j, q, a, b) per sub-block j of 32: q 32 bytes (unsigned 0..63, or
// signed for Q8_0/Q6_K), a the per-lane float scale of the 8 int32 partial sums (lanes 0-3 hold
// values 0-15, lanes 4-7 values 16-31), b the per-value offset.

inline __m256i nibbles(const uint8_t* p) {  // 16 bytes -> 32: low nibbles, then high nibbles
  const __m128i v = _mm_loadu_si128((const __m128i*)p);
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

inline __m256i bits_mask(uint32_t x) {  // byte i = 0xFF if bit i of x is set, else 0
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x),
                                  _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                   2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));  // all bits but bit (i % 8)
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

inline __m256i bits_to_0x10(uint32_t x) {  // byte i = 0x10 if bit i of x is set, else 0
  return _mm256_and_si256(bits_mask(x), _mm256_set1_epi8(0x10));
}

inline __m256i lut16(const int8_t* t) {  // a 16-entry int8 table in both lanes (for _mm256_shuffle_epi8)
  return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)t));
}

template <int NR, bool SIGNED>
struct Acc {
  __m256 v[NR];
  float off[NR];
  const XR& x;
  Acc(const XR& x_) : x(x_) {
    for (int r = 0; r < NR; ++r) v[r] = _mm256_setzero_ps(), off[r] = 0.f;
  }
  inline void add(int64_t j, __m256i q, __m256 a, float b) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i qa = SIGNED ? _mm256_sign_epi8(q, q) : q;
    for (int r = 0; r < NR; ++r) {
      const __m256i xq = _mm256_loadu_si256((const __m256i*)(x.q[r] + j * QB));
#ifdef MS_VNNI
      (void)ones;
      const __m256 s = _mm256_cvtepi32_ps(
          _mm256_dpbusd_epi32(_mm256_setzero_si256(), qa, SIGNED ? _mm256_sign_epi8(xq, q) : xq));
#else
      const __m256i p = _mm256_maddubs_epi16(qa, SIGNED ? _mm256_sign_epi8(xq, q) : xq);
      const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
#endif
      v[r] = _mm256_fmadd_ps(s, _mm256_mul_ps(a, _mm256_set1_ps(x.d[r][j])), v[r]);
      if (!SIGNED) off[r] += b * x.s[r][j];
    }
  }
  void store(float* out) const {
    for (int r = 0; r < NR; ++r) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v[r]), _mm256_extractf128_ps(v[r], 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      out[r] = _mm_cvtss_f32(s) + off[r];
    }
  }
};

// IQ4_NL / MXFP4 (unpack_lut4_scalar's layout): the nibbles looked up in the codebook by one byte shuffle.
template <int NR>
void dot_lut4_avx2(bool mx, const uint8_t* w, int64_t K, const XR& x, float* out) {
  const __m256i lut = lut16(mx ? kE2M1x2 : kIQ4NL);
  Acc<NR, true> acc(x);
  for (int64_t j = 0; j < K / 32; ++j, w += mx ? 17 : 18)
    acc.add(j, _mm256_shuffle_epi8(lut, nibbles(w + (mx ? 1 : 2))),
            _mm256_set1_ps(mx ? e8m0_half(w[0]) : half_to_float(w)), 0.f);
  acc.store(out);
}

template <int NR>
void dot_avx2(int64_t type, const uint8_t* w, int64_t K, const XR& x, float* out) {
  const __m256i m0f = _mm256_set1_epi8(0x0F), m01 = _mm256_set1_epi8(0x01), m03 = _mm256_set1_epi8(0x03);
  switch (type) {
    case T_IQ4_NL:
    case T_MXFP4:
      dot_lut4_avx2<NR>(type == T_MXFP4, w, K, x, out);
      return;
    case T_Q8_0: {
      Acc<NR, true> acc(x);
      for (int64_t j = 0; j < K / 32; ++j, w += 34)
        acc.add(j, _mm256_loadu_si256((const __m256i*)(w + 2)), _mm256_set1_ps(half_to_float(w)), 0.f);
      acc.store(out);
      return;
    }
    case T_Q4_0:
    case T_Q4_1: {
      const bool has_min = type == T_Q4_1;
      Acc<NR, false> acc(x);
      for (int64_t j = 0; j < K / 32; ++j, w += has_min ? 20 : 18) {
        const float d = half_to_float(w);
        acc.add(j, nibbles(w + (has_min ? 4 : 2)), _mm256_set1_ps(d), has_min ? half_to_float(w + 2) : -8.f * d);
      }
      acc.store(out);
      return;
    }
    case T_Q5_0:
    case T_Q5_1: {
      const bool has_min = type == T_Q5_1;
      const int ho = has_min ? 4 : 2;
      Acc<NR, false> acc(x);
      for (int64_t j = 0; j < K / 32; ++j, w += has_min ? 24 : 22) {
        const float d = half_to_float(w);
        uint32_t qh;
        std::memcpy(&qh, w + ho, 4);
        const __m256i q = _mm256_or_si256(nibbles(w + ho + 4), bits_to_0x10(qh));
        acc.add(j, q, _mm256_set1_ps(d), has_min ? half_to_float(w + 2) : -16.f * d);
      }
      acc.store(out);
      return;
    }
    case T_Q4_K:
    case T_Q5_K: {
      const bool five = type == T_Q5_K;
      Acc<NR, false> acc(x);
      for (int64_t blk = 0; blk < K / 256; ++blk, w += five ? 176 : 144) {
        const float d = half_to_float(w), dmin = half_to_float(w + 2);
        const uint8_t* qs = w + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i*)(w + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
          for (int h = 0; h < 2; ++h) {
            const int j = 2 * c + h;
            __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m0f);
            if (five)  // bit j of each qh byte becomes bit 4 (masked before the shift: no carry between bytes)
              q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), m01), 4));
            int sc, m;
            k_scale_min(w + 4, j, sc, m);
            acc.add(blk * 8 + j, q, _mm256_set1_ps(d * sc), -dmin * m);
          }
        }
      }
      acc.store(out);
      return;
    }
    case T_Q6_K: {
      Acc<NR, true> acc(x);
      const __m256i m32 = _mm256_set1_epi8(32);
      for (int64_t blk = 0; blk < K / 256; ++blk, w += 210) {
        const float d = half_to_float(w + 208);
        const int8_t* sc = (const int8_t*)(w + 192);
        for (int h = 0; h < 2; ++h) {
          const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * h));
          for (int k = 0; k < 4; ++k) {
            const int s = 4 * h + k;
            const __m256i l = _mm256_loadu_si256((const __m256i*)(w + 64 * h + 32 * (k % 2)));
            __m256i q = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(l, 4) : l, m0f);
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m03), 4));
            const __m256 a = _mm256_set_m128(_mm_set1_ps(d * sc[2 * s + 1]), _mm_set1_ps(d * sc[2 * s]));
            acc.add(blk * 8 + s, _mm256_sub_epi8(q, m32), a, 0.f);
          }
        }
      }
      acc.store(out);
      return;
    }
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int NR>
void dot_k_avx2(int64_t type, const uint8_t* w, int64_t K, const XR& x, float* out) {
  const __m256i m0f = _mm256_set1_epi8(0x0F), m01 = _mm256_set1_epi8(0x01), m03 = _mm256_set1_epi8(0x03);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  if (type == T_Q6_K) {
    for (int64_t blk = 0; blk < K / KB; ++blk, w += 210) {
      const float d = half_to_float(w + 208);
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192)));
      __m256i isum[NR];
      for (int r = 0; r < NR; ++r)  // the -32 offset of every value: 32 * sum_s sc_s * bsum_s, subtracted
        isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
            _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x.bs[r] + blk * 16)), sc16), 5));
      for (int h = 0; h < 2; ++h) {
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * h));
        for (int k = 0; k < 4; ++k) {
          const int s8 = 4 * h + k;
          const __m256i l = _mm256_loadu_si256((const __m256i*)(w + 64 * h + 32 * (k % 2)));
          __m256i q = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(l, 4) : l, m0f);
          q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m03), 4));
          const int8_t* sc = (const int8_t*)(w + 192);
          const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * s8 + 1]), _mm_set1_epi16(sc[2 * s8]));
          for (int r = 0; r < NR; ++r) {
            const __m256i xq = _mm256_loadu_si256((const __m256i*)(x.q[r] + blk * KB + 32 * s8));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), scv));
          }
        }
      }
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * x.d[r][blk]), acc[r]);
    }
  } else {
    const bool five = type == T_Q5_K;
    for (int64_t blk = 0; blk < K / KB; ++blk, w += five ? 176 : 144) {
      const float d = half_to_float(w), dmin = half_to_float(w + 2);
      alignas(16) uint8_t sc[16], mn[16];
      k_scales(w + 4, sc, mn);
      // each min twice: it multiplies the two 16-value sums of its sub-block
      const __m128i mv = _mm_loadl_epi64((const __m128i*)mn);
      const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
      const uint8_t* qs = w + (five ? 48 : 16);
      const __m256i qh = five ? _mm256_loadu_si256((const __m256i*)(w + 16)) : _mm256_setzero_si256();
      __m256i isum[NR];
      for (int r = 0; r < NR; ++r) isum[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, m0f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
        if (five) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), m01), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), m01), 4));
        }
        const __m256i sl = _mm256_set1_epi16(sc[2 * c]), sh = _mm256_set1_epi16(sc[2 * c + 1]);
        for (int r = 0; r < NR; ++r) {
          const int8_t* xq = x.q[r] + blk * KB + 64 * c;
          const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xq));
          const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xq + 32)));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(pl, sl), _mm256_madd_epi16(ph, sh)));
        }
      }
      for (int r = 0; r < NR; ++r) {
        const float dx = x.d[r][blk];
        const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x.bs[r] + blk * 16)), mins16);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * dx), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(dmin * dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]);
}

// The 8 integer sub-block scales of an IQ4_XS (6 bits - 32) or IQ3_S (1 + 2 * 4 bits) super-block.
inline void iq_scales(bool iq3, const uint8_t* w, int16_t* sc) {
  const int sh = w[2] | (w[3] << 8);
  for (int j = 0; j < 8; ++j)
    sc[j] = iq3 ? (int16_t)(1 + 2 * ((w[106 + j / 2] >> (4 * (j % 2))) & 15))
                : (int16_t)((((w[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32);
}

// Sub-blocks 2c and 2c + 1 (64 values) of an IQ4_XS / IQ3_S super-block for dot_iq_avx2: qa[h] the magnitudes
// (unsigned), sg[h] a byte per value carrying the value's sign (the activations take it by _mm256_sign_epi8).
template <bool IQ3>
inline void iq_pair_avx2(const uint8_t* w, int c, const __m256i& lut, __m256i* qa, __m256i* sg) {
  if (!IQ3) {  // 32 bytes = two sub-blocks of 16 bytes: low nibbles values 0-15, high nibbles 16-31
    const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 8 + 32 * c)), m = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m));
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    sg[0] = _mm256_permute2x128_si256(lo, hi, 0x20), sg[1] = _mm256_permute2x128_si256(lo, hi, 0x31);
    qa[0] = _mm256_sign_epi8(sg[0], sg[0]), qa[1] = _mm256_sign_epi8(sg[1], sg[1]);
    return;
  }
  for (int h = 0; h < 2; ++h) {  // 8 grid entries of 4 values by 9-bit index (8 low bytes, 1 high byte)
    const int j = 2 * c + h;
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 2 + 8 * j)));
    const __m256i hi = _mm256_sllv_epi32(_mm256_set1_epi32(w[66 + j]), _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1));
    const __m256i idx = _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi32(256)));  // bit g of qh -> 256
    qa[h] = _mm256_i32gather_epi32((const int*)g_iq3s_grid, idx, 4);
    uint32_t bits;
    std::memcpy(&bits, w + 74 + 4 * j, 4);
    sg[h] = _mm256_or_si256(bits_mask(bits), _mm256_set1_epi8(1));  // -1 where the sign bit is set, else +1
  }
}

// IQ4_XS / IQ3_S against QActK rows: per sub-block |q| * (x with q's sign) as int16 pairs, times the integer
// scale into int32 sums; one float multiply-add per 256 values and row.
template <int NR, bool IQ3>
void dot_iq_avx2(const uint8_t* w, int64_t K, const XR& x, float* out) {
  const __m256i lut = lut16(kIQ4NL);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / KB; ++blk, w += IQ3 ? 110 : 136) {
    int16_t sc[8];
    iq_scales(IQ3, w, sc);
    __m256i isum[NR];
    for (int r = 0; r < NR; ++r) isum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i qa[2], sg[2];
      iq_pair_avx2<IQ3>(w, c, lut, qa, sg);
      for (int h = 0; h < 2; ++h) {
        const __m256i scv = _mm256_set1_epi16(sc[2 * c + h]);
        for (int r = 0; r < NR; ++r) {
          const __m256i xq = _mm256_loadu_si256((const __m256i*)(x.q[r] + blk * KB + 64 * c + 32 * h));
          const __m256i p = _mm256_maddubs_epi16(qa[h], _mm256_sign_epi8(xq, sg[h]));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scv));
        }
      }
    }
    const float d = half_to_float(w);
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * x.d[r][blk]), acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]);
}

// F16 / BF16 rows against float32 activations. Every product is exact in float32 and summed into float32 lanes;
// U independent accumulators a row (U * NR chains), since one chain of dependent FMAs (4-cycle latency) runs at
// a quarter of the FMA units' rate: with one row that chain, not memory, was the limit (4.7 GB/s a [512, 2048]
// BF16 matrix on 2 cores against 21.5 of read). With AVX-512F: 16 lanes a step.
template <int NR>
void dot_float_avx2(bool bf16, const uint8_t* w, const float* const* x, int64_t K, float* out) {
  constexpr int U = NR == 1 ? 4 : (NR == 2 ? 2 : 1);
  int64_t i = 0;
  float part[NR] = {};
#if defined(__AVX512F__)
  {
    __m512 acc[NR][U];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    for (; i + 16 * U <= K; i += 16 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256i h = _mm256_loadu_si256((const __m256i*)(w + 2 * (i + 16 * u)));
        const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                              : _mm512_cvtph_ps(h);
        for (int r = 0; r < NR; ++r) acc[r][u] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x[r] + i + 16 * u), acc[r][u]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      __m512 a = acc[r][0];
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
      part[r] = _mm512_reduce_add_ps(a);
    }
  }
#endif
  __m256 acc[NR][U];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
  for (; i + 8 * U <= K; i += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const __m128i h = _mm_loadu_si128((const __m128i*)(w + 2 * (i + 8 * u)));
      const __m256 v = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                            : _mm256_cvtph_ps(h);
      for (int r = 0; r < NR; ++r) acc[r][u] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x[r] + i + 8 * u), acc[r][u]);
    }
  }
  for (; i + 8 <= K; i += 8) {
    const __m128i h = _mm_loadu_si128((const __m128i*)(w + 2 * i));
    const __m256 v = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
    for (int r = 0; r < NR; ++r) acc[r][0] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x[r] + i), acc[r][0]);
  }
  float tail[NR] = {};
  if (i < K) dot_float_scalar<NR>(bf16, w + 2 * i, x, i, K - i, tail);
  for (int r = 0; r < NR; ++r) {
    __m256 a = acc[r][0];
    for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[r][u]);
    alignas(32) float t[8];
    _mm256_store_ps(t, a);
    out[r] = part[r] + (t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7]) + tail[r];
  }
}
#endif

// ------------------------------------------------------------------ HF FP4 (NVFP4, MXFP4 safetensors)
// The checkpoints' own bytes: two e2m1 codes per byte, element 2i in the low nibble and 2i + 1 in the high one
// (GGUF MXFP4 instead holds a block's values 0-15 in the low nibbles), the scales in an array of their own:
// NVFP4 (ModelOpt) one e4m3 byte per 16 values and one fp32 global scale per matrix, MXFP4 (gpt-oss) one e8m0
// byte per 32. The codes are looked up as the doubled e2m1 values (kE2M1x2), the scales halved, as GGUF MXFP4;
// the AVX2 path looks up those values plus 12 (unsigned bytes: they multiply the signed activations directly,
// where signed codes need two vpsignb a block) and starts each block's integer sums from QActF4's lane offsets,
// -12 times the activations' sums, so the sums are the signed codes' exactly.
// Activations (QActF4): int8 with one scale per 16 values, stored per 32-block in *pair order*: the even elements
// at positions 0-15, the odd ones at 16-31. A block's 16 code bytes as nibbles() lays them out (low nibbles, then
// high ones) then meet their activations position by position: one table shuffle per 32 values and no interleave
// of the weights (that would be two unpacks and a second shuffle per block and weight row). Measured on the
// 2-core AVX512-VNNI EPYC (one thread, a [2048, 2048] weight in L3, 1 row): NVFP4 30.6 G values/s, MXFP4 29.9,
// GGUF MXFP4's kernel 27.3, these kernels with signed codes and the sign trick 26.5 / 27.3.
// Elements 0-15 of a block then sit at positions 0-7 and 16-23, elements 16-31 at 8-15 and 24-31, so of the
// block's 8 int32 lane sums (4 positions each) lanes 0, 1, 4, 5 hold elements 0-15 and lanes 2, 3, 6, 7 elements
// 16-31: NVFP4's two e4m3 scales become the lane scales (s0, s0, s1, s1, s0, s0, s1, s1), and so do the two
// activation scales. Two integer sub-sums, one float multiply-add per block and row, as a Q8_0 block.
// Why activation scales per 16 rather than per 32 (Q8_0's): at the same cost (a lane-scale vector is loaded
// where a scale is broadcast), the rounding step is the amax of 16 values, not 32; on tests/test_hf_quant.py's
// tiny NVFP4 / MXFP4 models (hidden states with outlier channels) per-32 rounding put the logits 3-12x further
// from the float path's (11-40% of their norm against 3.2-3.5%).
// The global scale multiplies each output once. NaN scale codes (e4m3 0x7F / 0xFF, e8m0 0xFF; checkpoints hold
// none) are not kept: e4m3 NaN reads 480 on the AVX2 path (NaN on the scalar one), e8m0 0xFF 2^127.

// One weight matrix as the row kernels read it: row i at w + i * ws; HF FP4 also row i's scale bytes at
// s + i * ss and the global scale g (NVFP4; 1 otherwise).
struct Mat {
  int64_t type = 0;
  bool prefetch = false;  // rows (groups) read ahead into L2: a matrix of at least PREFETCH_MIN_BYTES
  int64_t x8_ahead = 0;   // an interleaved type with prefetch: the group this many groups on is asked for
  int64_t rows_ahead = 2;  // another type with prefetch: the row this many rows on (PREFETCH_ROWS)
  const uint8_t* w = nullptr;
  int64_t ws = 0;
  const uint8_t* s = nullptr;
  int64_t ss = 0;
  float g = 1.f;
  int64_t bn = 1, bk = 1;  // HF FP8: a scale per bn rows x bk columns, ss scales per scale row
  bool sbf16 = false;      // HF FP8: bf16 scales (else float32)
};

// An HF FP4 matrix in ms_moe_layer's wptr is the address of one of these (moe/cpu_moe.py builds them; rows
// contiguous): the codes, the scales, and the address of NVFP4's float32 global scale (0: none).
struct FP4Desc {
  int64_t w, s, g;
};

// e4m3fn code -> float (the scalar path's table, built from the bit rule; NaN for 0x7F / 0xFF)
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      float f = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp((float)m, -9) : std::ldexp(8.f + m, e - 10);
      v[c] = c & 0x80 ? -f : f;
    }
    return v;
  }();
  return t;
}

template <int NR>
void dot_fp4_scalar(bool nv, const uint8_t* w, const uint8_t* s, int64_t K, const XR& x, float* out) {
  const std::array<float, 256>& e4 = e4m3_table();
  double acc[NR] = {};
  for (int64_t j = 0; j < K / QB; ++j, w += 16) {
    // the halved weight scales of elements 0-15 (code bytes 0-7) and 16-31 (bytes 8-15)
    const double a0 = nv ? 0.5 * e4[s[2 * j]] : (double)e8m0_half(s[j]), a1 = nv ? 0.5 * e4[s[2 * j + 1]] : a0;
    for (int r = 0; r < NR; ++r) {
      const int8_t* xq = x.q[r] + j * QB;  // pair order: element 2i at i, 2i + 1 at 16 + i
      int s0 = 0, s1 = 0;
      for (int i = 0; i < 16; ++i) {
        const int p = kE2M1x2[w[i] & 15] * xq[i] + kE2M1x2[w[i] >> 4] * xq[16 + i];
        if (i < 8) s0 += p; else s1 += p;
      }
      const float* dl = x.d[r] + 8 * j;  // lane scales: dl[0] of elements 0-15, dl[2] of 16-31
      acc[r] += a0 * dl[0] * s0 + a1 * dl[2] * s1;
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = (float)acc[r];
}

#ifdef MS_AVX2
// The doubled e2m1 values plus 12 (0..24): unsigned, so a code byte multiplies a signed activation byte directly
// (vpdpbusd / vpmaddubsw take u8 x s8), without the sign trick's two vpsignb; the lane offsets of QActF4 take the
// 12 * x back out of the integer sums.
alignas(16) constexpr int8_t kE2M1x2p12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// 8 int32 lane sums of 4 adjacent products u_i * x_i (u unsigned, x signed), plus acc.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i x) {
#ifdef MS_VNNI
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

// 16 code bytes -> 32 nibbles (low nibbles, then high ones, as nibbles()): the bytes broadcast to both lanes by
// the load, the high lane shifted by 4.
inline __m256i nibbles_bcast(const uint8_t* p) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

// 8 e4m3 codes -> 8 floats, each half its code's value (e4m3x16's move into a half's bits, then * 2^8 / 2: exact)
inline __m256 e4m3x8_half(const uint8_t* p) {
  const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(128.f));
}

// One block j's codes (looked up as values + 12) against NR rows, weighted by the lane scales a.
template <int NR>
inline void fp4_block_avx2(const uint8_t* w, int64_t j, __m256i lut, __m256 a, const XR& x, __m256* acc) {
  const __m256i u = _mm256_shuffle_epi8(lut, nibbles_bcast(w + 16 * j));
  for (int r = 0; r < NR; ++r) {
    const __m256i xq = _mm256_loadu_si256((const __m256i*)(x.q[r] + j * QB));
    const __m256i isum = dot_u8s8(_mm256_loadu_si256((const __m256i*)(x.off[r] + 8 * j)), u, xq);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(a, _mm256_loadu_ps(x.d[r] + 8 * j)), acc[r]);
  }
}

template <int NR>
void dot_fp4_avx2(bool nv, const uint8_t* w, const uint8_t* s, int64_t K, const XR& x, float* out) {
  const __m256i lut = lut16(kE2M1x2p12);
  const int64_t nb = K / QB;
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  if (!nv) {
    for (int64_t j = 0; j < nb; ++j) fp4_block_avx2<NR>(w, j, lut, _mm256_set1_ps(e8m0_half(s[j])), x, acc);
  } else {
    // NVFP4: the 8 scales of 4 blocks converted at once; block jj of them takes lanes (2jj, 2jj, 2jj+1, 2jj+1) twice
    __m256i pick[4];
    for (int jj = 0; jj < 4; ++jj)
      pick[jj] = _mm256_setr_epi32(2 * jj, 2 * jj, 2 * jj + 1, 2 * jj + 1, 2 * jj, 2 * jj, 2 * jj + 1, 2 * jj + 1);
    for (int64_t j0 = 0; j0 < nb; j0 += 4) {
      const int nj = (int)std::min<int64_t>(4, nb - j0);
      uint8_t part[8] = {};
      const uint8_t* sp = s + 2 * j0;
      if (nj < 4) std::memcpy(part, sp, 2 * nj), sp = part;  // the row's last blocks: no read past its scales
      const __m256 sv = e4m3x8_half(sp);
      for (int jj = 0; jj < nj; ++jj)
        fp4_block_avx2<NR>(w, j0 + jj, lut, _mm256_permutevar8x32_ps(sv, pick[jj]), x, acc);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]);
}
#endif

template <int NR>
inline void fp4_rows_dot(bool nv, bool scalar, const uint8_t* w, const uint8_t* s, int64_t K, const XR& x,
                         float* out) {
#ifdef MS_AVX2
  if (!scalar) return dot_fp4_avx2<NR>(nv, w, s, K, x, out);
#endif
  dot_fp4_scalar<NR>(nv, w, s, K, x, out);
}

// ------------------------------------------------------------------ FP8 (HF checkpoints)
// float8_e4m3fn weights (one byte per value, bias 7, S.1111.111 NaN) times float32 scales in blocks of
// bn rows x bk columns (scale of row i, column k: s[(i / bn) * srs + k / bk]; block FP8 128 x 128, a per-row
// scale is bn = 1, bk = K, srs = 1; one scale for all rows: bn = N, srs = 0), against float32 activations:
// no activation rounding (like F16/BF16); per column block a float32 partial sum, times its scale.

template <int NR>
void dot_fp8_scalar(const uint8_t* w, int64_t K, const float* srow, int64_t bk, const float* const* x, float* out) {
  const std::array<float, 256>& t = e4m3_table();
  double acc[NR] = {};
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += bk, ++b) {
    float part[NR] = {};
    for (int64_t k = k0; k < std::min(K, k0 + bk); ++k)
      for (int r = 0; r < NR; ++r) part[r] += t[w[k]] * x[r][k];
    for (int r = 0; r < NR; ++r) acc[r] += (double)srow[b] * part[r];
  }
  for (int r = 0; r < NR; ++r) out[r] = (float)acc[r];
}

#ifdef MS_AVX2
// 16 e4m3 codes -> 16 floats / 256: the code's magnitude bits moved into a half's exponent and mantissa
// (e4m3 exponent e, bias 7, read as a half's exponent, bias 15: the value times 2^-8, subnormals too), the
// sign bit to the half's sign bit, then F16C. NaN codes read as 480 (checkpoints hold none).
inline void e4m3x16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

template <int NR>
void dot_fp8_avx2(const uint8_t* w, int64_t K, const float* srow, int64_t bk, const float* const* x, float* out) {
  if (bk % 16) return dot_fp8_scalar<NR>(w, K, srow, bk, x, out);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k0 = 0, b = 0;
  for (; k0 + bk <= K; k0 += bk, ++b) {
    __m256 part[NR];
    for (int r = 0; r < NR; ++r) part[r] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + bk; k += 16) {
      __m256 lo, hi;
      e4m3x16(w + k, lo, hi);
      for (int r = 0; r < NR; ++r)
        part[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x[r] + k + 8), _mm256_fmadd_ps(lo, _mm256_loadu_ps(x[r] + k), part[r]));
    }
    const __m256 sb = _mm256_set1_ps(srow[b] * 256.f);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(part[r], sb, acc[r]);
  }
  float tail[NR] = {};
  if (k0 < K) {  // a partial last column block (K not a multiple of bk)
    const float* xt[NR];
    for (int r = 0; r < NR; ++r) xt[r] = x[r] + k0;
    dot_fp8_scalar<NR>(w + k0, K - k0, srow + b, bk, xt, tail);
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]) + tail[r];
}
#endif

template <int NR>
inline void fp8_rows_dot(bool scalar, const uint8_t* w, int64_t K, const float* srow, int64_t bk,
                         const float* const* x, float* out) {
#ifdef MS_AVX2
  if (!scalar) return dot_fp8_avx2<NR>(w, K, srow, bk, x, out);
#endif
  dot_fp8_scalar<NR>(w, K, srow, bk, x, out);
}

// An HF FP8 matrix in ms_moe_layer's wptr is the address of one of these (moe/cpu_moe.py builds them; rows
// contiguous): its codes, its scales (float32, or bf16 where sbf16) and their layout as ms_fp8_matmul takes it
// (rows bn and columns bk per scale, srs scales per scale row).
struct FP8Desc {
  int64_t w, s, bn, bk, srs, sbf16;
};

int64_t row_bytes(int64_t type, int64_t K) {
  switch (type) {
    case T_F16: case T_BF16: return 2 * K;
    case T_Q8_0: return K / 32 * 34;
    case T_Q4_0: return K / 32 * 18;
    case T_Q4_1: return K / 32 * 20;
    case T_Q5_0: return K / 32 * 22;
    case T_Q5_1: return K / 32 * 24;
    case T_Q4_K: return K / 256 * 144;
    case T_Q4_K8: return K / 256 * 148;  // per row: 8 rows share a 1,184-byte block per 256 columns
    case T_Q4_0X8: return K / 32 * 18;   // 8 rows share 144 bytes per 32 columns
    case T_Q4_1X8: return K / 32 * 20;   // 8 rows share 160 bytes per 32 columns
    case T_Q6_K8: return K / 256 * 210;  // 8 rows share 1,680 bytes per 256 columns
    case T_Q8_0X8: return K / 32 * 34;   // 8 rows share 272 bytes per 32 columns
    case T_Q5_K: return K / 256 * 176;
    case T_Q6_K: return K / 256 * 210;
    case T_IQ4_NL: return K / 32 * 18;
    case T_MXFP4: return K / 32 * 17;
    case T_IQ4_XS: return K / 256 * 136;
    case T_IQ3_S: return g_iq3s_ready.load(std::memory_order_acquire) ? K / 256 * 110 : -1;
    case T_HF_NVFP4: return K / 2 + K / 16;  // codes and scales: a row's cost (a Mat addresses the two)
    case T_HF_MXFP4: return K / 2 + K / 32;
    case T_HF_FP8: return K;
  }
  return -1;
}

int64_t block_size(int64_t type) {
  switch (type) {
    case T_F16: case T_BF16: return 1;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_IQ3_S: case T_Q4_K8: case T_Q6_K8: return 256;
    case T_HF_FP8: return 1;
  }
  return 32;
}

inline bool is_float_type(int64_t type) { return type == T_F16 || type == T_BF16; }
// the types whose activations are float32 rows
inline bool is_float_act(int64_t type) { return is_float_type(type) || is_hf_fp8(type); }
inline bool is_iq_k(int64_t type) { return type == T_IQ4_XS || type == T_IQ3_S; }
// the types whose activations are QActK rows (one scale per 256 values)
inline bool is_k_type(int64_t type) {
  return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K || type == T_Q4_K8 || type == T_Q6_K8 || is_iq_k(type);
}

// Matrix `type` of ms_moe_layer's wptr entry `ptr`, rows of K values: GGUF (or F16/BF16) rows back to back, or
// the FP4Desc of an HF FP4 matrix.
inline Mat layer_mat(int64_t type, int64_t ptr, int64_t K) {
  Mat m;
  m.type = type;
  if (is_hf_fp8(type)) {
    const FP8Desc& d = *(const FP8Desc*)ptr;
    m.w = (const uint8_t*)d.w, m.ws = K;
    m.s = (const uint8_t*)d.s, m.bn = d.bn, m.bk = d.bk, m.ss = d.srs, m.sbf16 = d.sbf16 != 0;
    return m;
  }
  if (!is_hf_fp4(type)) {
    m.w = (const uint8_t*)ptr, m.ws = row_bytes(type, K);
    return m;
  }
  const FP4Desc& d = *(const FP4Desc*)ptr;
  m.w = (const uint8_t*)d.w, m.ws = K / 2;
  m.s = (const uint8_t*)d.s, m.ss = K / (type == T_HF_NVFP4 ? 16 : 32);
  if (d.g) std::memcpy(&m.g, (const void*)d.g, 4);
  return m;
}

// Row i (K values) of m against NR <= 4 activation rows: xq (block and FP4 types) or xf (F16/BF16 weights).
template <int NR>
inline void rows_dot(const Mat& m, int64_t i, bool scalar, int64_t K, const XR& xq, const float* const* xf,
                     float* out) {
  const int64_t type = m.type;
  const uint8_t* w = m.w + i * m.ws;
  if (is_hf_fp4(type)) {
    fp4_rows_dot<NR>(type == T_HF_NVFP4, scalar, w, m.s + i * m.ss, K, xq, out);
    for (int r = 0; r < NR; ++r) out[r] *= m.g;
    return;
  }
  if (is_hf_fp8(type)) {
    const int64_t r = (i / m.bn) * m.ss;
    if (!m.sbf16) return fp8_rows_dot<NR>(scalar, w, K, (const float*)m.s + r, m.bk, xf, out);
    // bf16 scales: this row's (K / bk of them, exact in float32) widened first
    const int64_t nb = (K + m.bk - 1) / m.bk;
    float small[64];
    std::vector<float> big(nb > 64 ? nb : 0);
    float* sc = nb > 64 ? big.data() : small;
    for (int64_t j = 0; j < nb; ++j) {
      uint16_t b;
      std::memcpy(&b, m.s + 2 * (r + j), 2);
      const uint32_t u = (uint32_t)b << 16;
      std::memcpy(sc + j, &u, 4);
    }
    return fp8_rows_dot<NR>(scalar, w, K, sc, m.bk, xf, out);
  }
#ifdef MS_AVX2
  if (!scalar) {
    if (is_float_type(type)) dot_float_avx2<NR>(type == T_BF16, w, xf, K, out);
    else if (type == T_IQ4_XS) dot_iq_avx2<NR, false>(w, K, xq, out);
    else if (type == T_IQ3_S) dot_iq_avx2<NR, true>(w, K, xq, out);
    else if (is_k_type(type)) dot_k_avx2<NR>(type, w, K, xq, out);
    else dot_avx2<NR>(type, w, K, xq, out);
    return;
  }
#endif
  if (is_float_type(type)) dot_float_scalar<NR>(type == T_BF16, w, xf, 0, K, out);
  else if (is_iq_k(type)) dot_iq_scalar<NR>(type, w, K, xq, out);
  else if (is_k_type(type)) dot_k_scalar<NR>(type, w, K, xq, out);
  else dot_scalar<NR>(type, w, K, xq, out);
}

// n activation rows (rows[] of qa / qp / qk / xf, whichever `type` reads; qp: the HF FP4 types' QActF4) as chunks
// of up to XR_ROWS row pointers, built once per call or expert group and shared by every weight row.
struct XSet {
  int64_t n = 0;
  std::vector<XR> q;
  std::vector<std::array<const float*, XR_ROWS>> f;
};

inline void make_xset(XSet& xs, int64_t type, const QAct& qa, const QActF4& qp, const QActK& qk, const float* xf,
                      int64_t K, const int64_t* rows, int64_t n) {
  const int64_t nc = (n + XR_ROWS - 1) / XR_ROWS;
  xs.n = n;
  xs.q.assign(nc, XR{});
  xs.f.assign(nc, std::array<const float*, XR_ROWS>{});
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t r0 = XR_ROWS * c;
    const int nr = (int)std::min<int64_t>(XR_ROWS, n - r0);
    if (is_float_act(type)) {
      for (int k = 0; k < nr; ++k) xs.f[c][k] = xf + rows[r0 + k] * K;
    } else if (is_k_type(type)) {
      xs.q[c] = xrows(qk, rows + r0, nr);
    } else if (is_hf_fp4(type)) {
      xs.q[c] = xrows(qp, rows + r0, nr);
    } else {
      xs.q[c] = xrows(qa, rows + r0, nr);
    }
  }
}

// rows_dot<nr> for a run-time nr in 1..NR.
template <int NR>
inline void rows_dot_n(int nr, const Mat& m, int64_t i, bool scalar, int64_t K, const XR& xq, const float* const* xf,
                       float* out) {
  if (nr == NR) {
    rows_dot<NR>(m, i, scalar, K, xq, xf, out);
  } else if constexpr (NR > 1) {
    rows_dot_n<NR - 1>(nr, m, i, scalar, K, xq, xf, out);
  }
}

// ------------------------------------------------------------------ Q4_K8: Q4_K, 8 rows interleaved
// A one-row product of Q4_K (dot_k_avx2<1>) spends most of its instructions per row on the block's bookkeeping:
// unpacking the 12 bytes of 6-bit scales, broadcasting each scale, one horizontal sum. Interleaved, 8 rows share
// it and the integer products come out one row per 32-bit lane (what llama.cpp's repacked "q4_K_8x8" layout
// does, laid out here our own way). ms_repack_x8 writes groups of 8 rows; per group and 256 columns, 1,184 bytes:
//   [0, 16)     d of rows 0..7 (fp16)            [16, 32)   dmin of rows 0..7 (fp16)
//   [32, 96)    scale of sub-block j, row r at 32 + 8 j + r (6-bit values as bytes)
//   [96, 160)   min of sub-block j, row r at 96 + 8 j + r
//   [160, 1184) codes: for pair c (sub-blocks 2c, 2c + 1: Q4_K's 32 bytes at 16 + 32 c) and 4-byte group g,
//               32 bytes at 160 + 256 c + 32 g: row r's bytes 4g..4g+3 of that pair at + 4 r
// (148 bytes per row and 256 columns, 2.8% over Q4_K's 144). Products against QActK rows: per pair and row, the
// low nibbles' and the high nibbles' integer sums (an activation's 4 bytes broadcast to the 8 lanes), times the
// sub-blocks' integer scales; minus sum_j min_j * (activation sum of sub-block j); then per 256 columns
// acc += tot * (d * dx), acc -= mins * (dmin * dx) as fused multiply-adds — integers exact, so the scalar twin
// gives the same floats. (Not Q4_K's float order: dot_k_avx2 keeps 8 float lanes per row.)
constexpr int64_t Q4K8_BLOCK = 1184;

// 8 rows of Q4_K (ws bytes apart, K columns) -> K / 256 blocks of Q4K8_BLOCK bytes at out
void repack_q4_k8(const uint8_t* w, int64_t ws, int64_t K, uint8_t* out) {
  for (int64_t b = 0; b < K / KB; ++b) {
    uint8_t* o = out + b * Q4K8_BLOCK;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = w + r * ws + b * 144;
      std::memcpy(o + 2 * r, blk, 2);
      std::memcpy(o + 16 + 2 * r, blk + 2, 2);
      alignas(16) uint8_t sc[16], mn[16];
      k_scales(blk + 4, sc, mn);
      for (int j = 0; j < 8; ++j) o[32 + 8 * j + r] = sc[j], o[96 + 8 * j + r] = mn[j];
      for (int c = 0; c < 4; ++c)
        for (int g = 0; g < 8; ++g) std::memcpy(o + 160 + 256 * c + 32 * g + 4 * r, blk + 16 + 32 * c + 4 * g, 4);
    }
  }
}

// out[r] (r < 8) = row r of the group at w . one QActK row (q, d, bs)
void dot_q4_k8_scalar(const uint8_t* w, int64_t K, const int8_t* xq, const float* xd, const int16_t* xbs,
                      float* out) {
  float acc[8] = {};
  for (int64_t b = 0; b < K / KB; ++b, w += Q4K8_BLOCK) {
    const int8_t* xb = xq + b * KB;
    for (int r = 0; r < 8; ++r) {
      int32_t tot = 0, mins = 0;
      for (int c = 0; c < 4; ++c) {
        int32_t lo = 0, hi = 0;
        for (int g = 0; g < 8; ++g)
          for (int k = 0; k < 4; ++k) {
            const uint8_t v = w[160 + 256 * c + 32 * g + 4 * r + k];
            lo += (v & 15) * xb[64 * c + 4 * g + k], hi += (v >> 4) * xb[64 * c + 32 + 4 * g + k];
          }
        tot += lo * w[32 + 8 * (2 * c) + r] + hi * w[32 + 8 * (2 * c + 1) + r];
        const int16_t* bs = xbs + b * 16 + 4 * c;
        mins += w[96 + 8 * (2 * c) + r] * (bs[0] + bs[1]) + w[96 + 8 * (2 * c + 1) + r] * (bs[2] + bs[3]);
      }
      const float dx = xd[b];
      acc[r] = std::fma((float)tot, half_to_float(w + 2 * r) * dx, acc[r]);
      acc[r] = std::fma(-(float)mins, half_to_float(w + 16 + 2 * r) * dx, acc[r]);
    }
  }
  for (int r = 0; r < 8; ++r) out[r] = acc[r];
}

#ifdef MS_AVX2
// 32 interleaved code bytes (4 per row of 8) against two activations' 4 bytes, each broadcast to the 8 lanes: the low
// nibbles' integer products added to lo, the high nibbles' to hi, one row per 32-bit lane (lo and hi may be one sum)
inline void x8_nibble_dots(const uint8_t* q, const int8_t* xl, const int8_t* xh, __m256i& lo, __m256i& hi) {
  const __m256i m0f = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256((const __m256i*)q);
  int32_t a, h;
  std::memcpy(&a, xl, 4);
  std::memcpy(&h, xh, 4);
  const __m256i vl = _mm256_and_si256(v, m0f), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
  lo = dot_u8s8(lo, vl, _mm256_set1_epi32(a));  // u4 * s8 pairs fit int16 (2 * 15 * 127) without VNNI
  hi = dot_u8s8(hi, vh, _mm256_set1_epi32(h));
}

void dot_q4_k8_avx2(const uint8_t* w, int64_t K, const int8_t* xq, const float* xd, const int16_t* xbs, float* out) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / KB; ++b, w += Q4K8_BLOCK) {
    const int8_t* xb = xq + b * KB;
    __m256i tot = _mm256_setzero_si256(), mins = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
      const uint8_t* q = w + 160 + 256 * c;
      for (int g = 0; g < 8; ++g) {
        x8_nibble_dots(q + 32 * g, xb + 64 * c + 4 * g, xb + 64 * c + 32 + 4 * g, lo, hi);
      }
      const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 32 + 16 * c)));
      const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 40 + 16 * c)));
      tot = _mm256_add_epi32(tot, _mm256_add_epi32(_mm256_mullo_epi32(lo, s0), _mm256_mullo_epi32(hi, s1)));
      const __m256i n0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 96 + 16 * c)));
      const __m256i n1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 104 + 16 * c)));
      const int16_t* bs = xbs + b * 16 + 4 * c;
      mins = _mm256_add_epi32(mins, _mm256_add_epi32(_mm256_mullo_epi32(n0, _mm256_set1_epi32(bs[0] + bs[1])),
                                                     _mm256_mullo_epi32(n1, _mm256_set1_epi32(bs[2] + bs[3]))));
    }
    const __m256 dx = _mm256_set1_ps(xd[b]);
    const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w)), dx);
    const __m256 dm = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16))), dx);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), d, acc);
    acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), dm, acc);
  }
  _mm256_storeu_ps(out, acc);
}
#endif

// Q4_0X8 / Q4_1X8: Q4_0 / Q4_1 with 8 rows interleaved, per group of 8 rows and block of 32 columns: the fp16 d of
// rows 0..7 (16 bytes), Q4_1's fp16 m of rows 0..7 (16 bytes), then the codes: for 4-byte group g (0..3) of the
// block's 16 code bytes, 32 bytes at + 32 g: row r's bytes 4g..4g+3 at + 4 r (a byte's low nibble is value i, its
// high nibble value i + 16, as in Q4_0 / Q4_1). 144 / 160 bytes: the same bytes as 8 rows of Q4_0 / Q4_1. Against one
// QAct row (int8 per 32, scale dx, sx = dx * sum of the block's int8): per block and row, the integer sum of codes
// times activations (the activation's 4 bytes broadcast, every row in its own lane), then acc += isum * (d * dx) and
// accm += m * sx (Q4_0: m = -8 d) as fused multiply-adds; the row's value is acc + accm.
template <bool MIN>
void repack_q4x8(const uint8_t* w, int64_t ws, int64_t K, uint8_t* out) {
  const int64_t tb = MIN ? 20 : 18, gb = MIN ? 160 : 144, qo = MIN ? 32 : 16;
  for (int64_t b = 0; b < K / QB; ++b) {
    uint8_t* o = out + b * gb;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = w + r * ws + b * tb;
      std::memcpy(o + 2 * r, blk, 2);
      if (MIN) std::memcpy(o + 16 + 2 * r, blk + 2, 2);
      for (int g = 0; g < 4; ++g) std::memcpy(o + qo + 32 * g + 4 * r, blk + (MIN ? 4 : 2) + 4 * g, 4);
    }
  }
}

template <bool MIN>
void dot_q4x8_scalar(const uint8_t* w, int64_t K, const int8_t* xq, const float* xd, const float* xs, float* out) {
  const int64_t gb = MIN ? 160 : 144, qo = MIN ? 32 : 16;
  float acc[8] = {}, accm[8] = {};
  for (int64_t b = 0; b < K / QB; ++b, w += gb) {
    const int8_t* xb = xq + b * QB;
    for (int r = 0; r < 8; ++r) {
      int32_t isum = 0;
      for (int g = 0; g < 4; ++g)
        for (int k = 0; k < 4; ++k) {
          const uint8_t v = w[qo + 32 * g + 4 * r + k];
          isum += (v & 15) * xb[4 * g + k] + (v >> 4) * xb[16 + 4 * g + k];
        }
      const float d = half_to_float(w + 2 * r), m = MIN ? half_to_float(w + 16 + 2 * r) : d * -8.f;
      acc[r] = std::fma((float)isum, d * xd[b], acc[r]);
      accm[r] = std::fma(m, xs[b], accm[r]);
    }
  }
  for (int r = 0; r < 8; ++r) out[r] = acc[r] + accm[r];
}

#ifdef MS_AVX2
template <bool MIN>
void dot_q4x8_avx2(const uint8_t* w, int64_t K, const int8_t* xq, const float* xd, const float* xs, float* out) {
  const int64_t gb = MIN ? 160 : 144, qo = MIN ? 32 : 16;
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QB; ++b, w += gb) {
    const int8_t* xb = xq + b * QB;
    __m256i isum = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      x8_nibble_dots(w + qo + 32 * g, xb + 4 * g, xb + 16 + 4 * g, isum, isum);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
    const __m256 m = MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16))) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(xd[b])), acc);
    accm = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[b]), accm);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(acc, accm));
}
#endif

// Q8_0X8: Q8_0 with 8 rows interleaved, per group of 8 rows and block of 32 columns: the fp16 d of rows 0..7 (16
// bytes), then the int8 codes: for 4-byte group g (0..7) of the block, 32 bytes at 16 + 32 g: row r's codes 4g..4g+3
// at + 4 r. 272 bytes: the same bytes as 8 rows of Q8_0. Against one QAct row (int8 per 32, scale dx, si = the
// block's int8 sum): per block and row the integer sum of codes times activations — with VNNI the codes flipped to
// unsigned (q + 128) for vpdpbusd against the activation's 4 bytes broadcast, then 128 * si taken off: the exact
// sum of q * x; without VNNI (vpmaddubsw would saturate on byte products) |q| against x signed by q — then
// acc += isum * (d * dx) as one fused multiply-add a block, as the scalar twin does.
void repack_q8x8(const uint8_t* w, int64_t ws, int64_t K, uint8_t* out) {
  for (int64_t b = 0; b < K / QB; ++b) {
    uint8_t* o = out + b * 272;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = w + r * ws + b * 34;
      std::memcpy(o + 2 * r, blk, 2);
      for (int g = 0; g < 8; ++g) std::memcpy(o + 16 + 32 * g + 4 * r, blk + 2 + 4 * g, 4);
    }
  }
}

void dot_q8x8_scalar(const uint8_t* w, int64_t K, const int8_t* xq, const float* xd, float* out) {
  float acc[8] = {};
  for (int64_t b = 0; b < K / QB; ++b, w += 272) {
    const int8_t* xb = xq + b * QB;
    for (int r = 0; r < 8; ++r) {
      int32_t isum = 0;
      for (int g = 0; g < 8; ++g)
        for (int k = 0; k < 4; ++k) isum += (int8_t)w[16 + 32 * g + 4 * r + k] * xb[4 * g + k];
      acc[r] = std::fma((float)isum, half_to_float(w + 2 * r) * xd[b], acc[r]);
    }
  }
  for (int r = 0; r < 8; ++r) out[r] = acc[r];
}

#ifdef MS_AVX2
// Rows r0 .. r0 + NR - 1 of x against a Q8_0X8 group: out[8 r + j]
template <int NR>
void dot_q8x8_rows_avx2(const uint8_t* w, int64_t K, const XR& x, int r0, float* out) {
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QB; ++b, w += 272) {
    __m256i isum[NR];
    for (int r = 0; r < NR; ++r) isum[r] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 16 + 32 * g));
#ifdef MS_VNNI
      const __m256i u = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));  // q + 128
#else
      const __m256i u = _mm256_sign_epi8(v, v);  // |q|
#endif
      for (int r = 0; r < NR; ++r) {
        int32_t a;
        std::memcpy(&a, x.q[r0 + r] + b * QB + 4 * g, 4);
#ifdef MS_VNNI
        isum[r] = _mm256_dpbusd_epi32(isum[r], u, _mm256_set1_epi32(a));
#else
        const __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(_mm256_set1_epi32(a), v));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
    for (int r = 0; r < NR; ++r) {
#ifdef MS_VNNI
      isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(128 * x.si[r0 + r][b]));
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[r0 + r][b])), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}
#endif

// Q6_K8: Q6_K, 8 rows interleaved. Per group of 8 rows and 256 columns, 1,680 bytes (8 x 210, Q6_K's own size):
//   [0, 16)      d of rows 0..7 (fp16)
//   [16, 144)    scale of sub-block j (16 values), row r at 16 + 8 j + r (int8)
//   [144, 1168)  low 4 bits: chunk k (0..31) is 32 bytes at 144 + 32 k, row r's 4 at + 4 r; byte b's low nibble is
//                value 4 k + b's, its high nibble value 128 + 4 k + b's
//   [1168, 1680) high 2 bits: chunk h (0..15) is 32 bytes at 1168 + 32 h, row r's 4 at + 4 r; byte b's bits 2 t,
//                2 t + 1 are value 64 t + 4 h + b's (t = 0..3)
// Codes q (0..63, the value d * sc * (q - 32)) against QActK rows: per sub-block j and row the integer sum of q times
// the activations (an activation's 4 bytes broadcast, one row per 32-bit lane), tot = sum_j sc_j * sum_j -
// 32 * sum_j sc_j * bs_j (the second by madd_epi16 over sub-block pairs), then acc += tot * (d * dx) as one fused
// multiply-add a block: integers exact (|tot| < 2^29), so the scalar twin gives the same floats. Not Q6_K's order.
constexpr int64_t Q6K8_BLOCK = 1680;

// The 256 codes (0..63) of one Q6_K block (ggml's layout: ql[128], qh[64], sc[16], d)
inline void q6_k_codes(const uint8_t* blk, uint8_t* q) {
  for (int s = 0; s < 8; ++s) {
    const int h = s / 4, k = s % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (k % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int i = 0; i < 32; ++i)
      q[32 * s + i] = (uint8_t)(((k / 2) ? ql[i] >> 4 : ql[i] & 0x0F) | (((qh[i] >> (2 * k)) & 3) << 4));
  }
}

void repack_q6_k8(const uint8_t* w, int64_t ws, int64_t K, uint8_t* out) {
  for (int64_t b = 0; b < K / KB; ++b) {
    uint8_t* o = out + b * Q6K8_BLOCK;
    std::memset(o + 1168, 0, 512);
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = w + r * ws + b * 210;
      uint8_t q[256];
      q6_k_codes(blk, q);
      std::memcpy(o + 2 * r, blk + 208, 2);
      for (int j = 0; j < 16; ++j) o[16 + 8 * j + r] = blk[192 + j];
      for (int k = 0; k < 32; ++k)
        for (int c = 0; c < 4; ++c)
          o[144 + 32 * k + 4 * r + c] = (uint8_t)((q[4 * k + c] & 15) | (q[128 + 4 * k + c] & 15) << 4);
      for (int h = 0; h < 16; ++h)
        for (int c = 0; c < 4; ++c)
          for (int t = 0; t < 4; ++t) o[1168 + 32 * h + 4 * r + c] |= (uint8_t)((q[64 * t + 4 * h + c] >> 4) << (2 * t));
    }
  }
}

// out[r] (r < 8) = row r of the group at w . one QActK row (q, d, bs)
void dot_q6_k8_scalar(const uint8_t* w, int64_t K, const int8_t* xq, const float* xd, const int16_t* xbs, float* out) {
  float acc[8] = {};
  for (int64_t b = 0; b < K / KB; ++b, w += Q6K8_BLOCK) {
    const int8_t* xb = xq + b * KB;
    for (int r = 0; r < 8; ++r) {
      int32_t tot = 0, off = 0;
      for (int j = 0; j < 16; ++j) {
        int32_t isum = 0;
        for (int i = 16 * j; i < 16 * j + 16; ++i) {
          const int m = i / 4, c = i % 4;  // quad m = 16 t + h
          const uint8_t lo = w[144 + 32 * (m % 32) + 4 * r + c];
          const uint8_t hi = w[1168 + 32 * (m % 16) + 4 * r + c];
          const int q = (m < 32 ? lo & 15 : lo >> 4) | ((hi >> (2 * (m / 16))) & 3) << 4;
          isum += q * xb[i];
        }
        const int sc = (int8_t)w[16 + 8 * j + r];
        tot += sc * isum, off += sc * xbs[b * 16 + j];
      }
      tot -= 32 * off;
      acc[r] = std::fma((float)tot, half_to_float(w + 2 * r) * xd[b], acc[r]);
    }
  }
  for (int r = 0; r < 8; ++r) out[r] = acc[r];
}

#ifdef MS_AVX2
// Rows r0 .. r0 + NR - 1 of x against one Q6_K8 group: out[8 r + j] (the one-row product is NR = 1)
template <int NR>
void dot_q6_k8_rows_avx2(const uint8_t* w, int64_t K, const XR& x, int r0, float* out) {
  const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / KB; ++b, w += Q6K8_BLOCK) {
    __m256i tot[NR];
    for (int r = 0; r < NR; ++r) tot[r] = _mm256_setzero_si256();
    const int64_t xo = b * KB;
    for (int jj = 0; jj < 4; ++jj) {  // sub-blocks jj, jj + 4, jj + 8, jj + 12: quads 4 jj .. 4 jj + 3 (+ 16 t)
      __m256i s[4][NR];
      for (int t = 0; t < 4; ++t)
        for (int r = 0; r < NR; ++r) s[t][r] = _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u) {
        const int k = 4 * jj + u;
        const __m256i la = _mm256_loadu_si256((const __m256i*)(w + 144 + 32 * k));
        const __m256i lb = _mm256_loadu_si256((const __m256i*)(w + 144 + 32 * (k + 16)));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 1168 + 32 * k));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(la, m0f), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        q[1] = _mm256_or_si256(_mm256_and_si256(lb, m0f), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), m0f), _mm256_and_si256(qh, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), m0f),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        for (int r = 0; r < NR; ++r)
          for (int t = 0; t < 4; ++t) {
            int32_t a;
            std::memcpy(&a, x.q[r0 + r] + xo + 4 * (k + 16 * t), 4);
            s[t][r] = dot_u8s8(s[t][r], q[t], _mm256_set1_epi32(a));  // u6 * s8 pairs fit int16 (2 * 63 * 127)
          }
      }
      for (int t = 0; t < 4; ++t) {
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + 16 + 8 * (jj + 4 * t))));
        for (int r = 0; r < NR; ++r) tot[r] = _mm256_add_epi32(tot[r], _mm256_mullo_epi32(s[t][r], sc));
      }
    }
    __m256i scp[8];  // lane j: (scale of sub-block 2 i, of 2 i + 1) of row j, as int16
    for (int i = 0; i < 8; ++i)
      scp[i] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)(w + 16 + 16 * i)),
                                                      _mm_loadl_epi64((const __m128i*)(w + 24 + 16 * i))));
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
    for (int r = 0; r < NR; ++r) {
      const int16_t* bs = x.bs[r0 + r] + b * 16;
      __m256i off = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        int32_t pair;
        std::memcpy(&pair, bs + 2 * i, 4);
        off = _mm256_add_epi32(off, _mm256_madd_epi16(scp[i], _mm256_set1_epi32(pair)));
      }
      const __m256i t = _mm256_sub_epi32(tot[r], _mm256_slli_epi32(off, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d8, _mm256_set1_ps(x.d[r0 + r][b])), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}
#endif

#ifdef MS_AVX2
// Several activation rows against one interleaved group (a prefill's rows of an expert or a dense projection): each
// 32-byte load of codes and its nibble masks serve NR rows, and so do the group's scale / min / d vectors. Per row
// the integer sums and the float operations are dot_q4_k8_avx2's / dot_q4x8_avx2's, in the same order, so a row's 8
// outputs are bit-equal to the one-row kernel's whatever rows share the call. out[8 r + j]: row j of the group
// against activation row r. The mins' sums as madd_epi16 of (min of sub-block 2c, min of 2c + 1) pairs against the
// activations' pair (bs sums of 16 values: |.| <= 2032 each, so a pair's sum fits int16): the same integers as
// one-row's vpmulld.
template <int NR>
void dot_q4_k8_rows_avx2(const uint8_t* w, int64_t K, const XR& x, int r0, float* out) {
  const __m256i m0f = _mm256_set1_epi8(0x0F);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / KB; ++b, w += Q4K8_BLOCK) {
    __m256i tot[NR];
    for (int r = 0; r < NR; ++r) tot[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      const uint8_t* q = w + 160 + 256 * c;
      const int64_t xo = b * KB + 64 * c;
      for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * g));
        const __m256i vl = _mm256_and_si256(v, m0f), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
        for (int r = 0; r < NR; ++r) {
          int32_t a, h;
          std::memcpy(&a, x.q[r0 + r] + xo + 4 * g, 4);
          std::memcpy(&h, x.q[r0 + r] + xo + 32 + 4 * g, 4);
          lo[r] = dot_u8s8(lo[r], vl, _mm256_set1_epi32(a));
          hi[r] = dot_u8s8(hi[r], vh, _mm256_set1_epi32(h));
        }
      }
      const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 32 + 16 * c)));
      const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 40 + 16 * c)));
      for (int r = 0; r < NR; ++r)
        tot[r] = _mm256_add_epi32(tot[r], _mm256_add_epi32(_mm256_mullo_epi32(lo[r], s0), _mm256_mullo_epi32(hi[r], s1)));
    }
    __m256i mn[4];  // lane j: (min of sub-block 2c, min of 2c + 1) of row j, as int16
    for (int c = 0; c < 4; ++c)
      mn[c] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)(w + 96 + 16 * c)),
                                                     _mm_loadl_epi64((const __m128i*)(w + 104 + 16 * c))));
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
    const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16)));
    for (int r = 0; r < NR; ++r) {
      const int16_t* bs = x.bs[r0 + r] + b * 16;
      __m256i mins = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const uint32_t pair = (uint16_t)(bs[4 * c] + bs[4 * c + 1]) | (uint32_t)(uint16_t)(bs[4 * c + 2] + bs[4 * c + 3]) << 16;
        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mn[c], _mm256_set1_epi32((int32_t)pair)));
      }
      const __m256 dx = _mm256_set1_ps(x.d[r0 + r][b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[r]), _mm256_mul_ps(d8, dx), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dm8, dx), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

template <bool MIN, int NR>
void dot_q4x8_rows_avx2(const uint8_t* w, int64_t K, const XR& x, int r0, float* out) {
  const int64_t gb = MIN ? 160 : 144, qo = MIN ? 32 : 16;
  const __m256i m0f = _mm256_set1_epi8(0x0F);
  __m256 acc[NR], accm[NR];
  for (int r = 0; r < NR; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QB; ++b, w += gb) {
    __m256i isum[NR];
    for (int r = 0; r < NR; ++r) isum[r] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + qo + 32 * g));
      const __m256i vl = _mm256_and_si256(v, m0f), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
      for (int r = 0; r < NR; ++r) {
        int32_t a, h;
        std::memcpy(&a, x.q[r0 + r] + b * QB + 4 * g, 4);
        std::memcpy(&h, x.q[r0 + r] + b * QB + 16 + 4 * g, 4);
        isum[r] = dot_u8s8(isum[r], vl, _mm256_set1_epi32(a));
        isum[r] = dot_u8s8(isum[r], vh, _mm256_set1_epi32(h));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
    const __m256 m = MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16))) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    for (int r = 0; r < NR; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[r0 + r][b])), acc[r]);
      accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[r0 + r][b]), accm[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], accm[r]));
}

// Rows r0 .. r0 + NR - 1 of x against the group w (AVX2 only).
template <int NR>
inline void dot_x8_rows_avx2(int64_t type, const uint8_t* w, int64_t K, const XR& x, int r0, float* out) {
  if (type == T_Q4_K8) dot_q4_k8_rows_avx2<NR>(w, K, x, r0, out);
  else if (type == T_Q6_K8) dot_q6_k8_rows_avx2<NR>(w, K, x, r0, out);
  else if (type == T_Q4_1X8) dot_q4x8_rows_avx2<true, NR>(w, K, x, r0, out);
  else if (type == T_Q8_0X8) dot_q8x8_rows_avx2<NR>(w, K, x, r0, out);
  else dot_q4x8_rows_avx2<false, NR>(w, K, x, r0, out);
}
#endif

// 8 rows of group w against one activation row of xs (its QAct or QActK form, as the type reads) -> out[8]
inline void dot_x8(int64_t type, bool scalar, const uint8_t* w, int64_t K, const XR& x, int k, float* out) {
#ifdef MS_AVX2
  if (!scalar) {
    if (type == T_Q4_K8) dot_q4_k8_avx2(w, K, x.q[k], x.d[k], x.bs[k], out);
    else if (type == T_Q6_K8) dot_q6_k8_rows_avx2<1>(w, K, x, k, out);
    else if (type == T_Q4_1X8) dot_q4x8_avx2<true>(w, K, x.q[k], x.d[k], x.s[k], out);
    else if (type == T_Q8_0X8) dot_q8x8_rows_avx2<1>(w, K, x, k, out);
    else dot_q4x8_avx2<false>(w, K, x.q[k], x.d[k], x.s[k], out);
    return;
  }
#endif
  if (type == T_Q4_K8) dot_q4_k8_scalar(w, K, x.q[k], x.d[k], x.bs[k], out);
  else if (type == T_Q6_K8) dot_q6_k8_scalar(w, K, x.q[k], x.d[k], x.bs[k], out);
  else if (type == T_Q4_1X8) dot_q4x8_scalar<true>(w, K, x.q[k], x.d[k], x.s[k], out);
  else if (type == T_Q8_0X8) dot_q8x8_scalar(w, K, x.q[k], x.d[k], out);
  else dot_q4x8_scalar<false>(w, K, x.q[k], x.d[k], x.s[k], out);
}

// Activation rows multi-row passes over an interleaved group take at once (X8_ROWS accumulators of each kind stay in
// registers with AVX-512's 32; AVX2's 16 hold fewer).
#if defined(MS_VNNI)
constexpr int X8_ROWS = 4;
#else
constexpr int X8_ROWS = 2;
#endif

// The nr (<= XR_ROWS) rows of x against group w: out[8 r + j]. Bit-equal to dot_x8 row by row.
inline void dot_x8_n(int64_t type, bool scalar, const uint8_t* w, int64_t K, const XR& x, int nr, float* out) {
#ifdef MS_AVX2
  if (!scalar) {
    int r = 0;
    for (; r + X8_ROWS <= nr; r += X8_ROWS) dot_x8_rows_avx2<X8_ROWS>(type, w, K, x, r, out + 8 * r);
    if constexpr (X8_ROWS > 2) {
      if (r + 2 <= nr) dot_x8_rows_avx2<2>(type, w, K, x, r, out + 8 * r), r += 2;
    }
    if (r < nr) dot_x8_rows_avx2<1>(type, w, K, x, r, out + 8 * r);  // at most one left
    return;
  }
#endif
  for (int r = 0; r < nr; ++r) dot_x8(type, scalar, w, K, x, r, out + 8 * r);
}

// Rows (or groups of 8) are prefetched this far ahead into L2 while one is computed: more reads in flight than the
// hardware's own prefetch keeps (a decode MoE layer of Q8_0 experts, 2 threads, 2-core VM: 16.3 -> 22.3 GB/s of the
// VM's ~25; benchmarks/cpu_layer_ab.py). A hint: past a matrix's end it reads nothing that matters, and never faults.
// Only for matrices of PREFETCH_MIN_BYTES or more: a tiny model's (a few hundred KB, cache-resident between steps)
// ran 5% slower with it. Not for interleaved groups: the next group's ~10 KB asked for at once (1 or 2 groups ahead)
// made interleaved experts read from memory ~10% slower than without (the quarter-size Qwen3-30B-A3B MoE of
// cpu_vs_llama.py, decode 40.2 / 39.9 vs 44.3 tok/s), where the hardware's own prefetch of the one stream keeps up.
constexpr int64_t PREFETCH_ROWS = 2, PREFETCH_MIN_BYTES = 512 << 10;

// Row i (K values) of m against every row of xs: out[r], r < xs.n. Not for the interleaved types (block_dots).
inline void row_dots(const Mat& m, int64_t i, bool scalar, int64_t K, const XSet& xs, float* out) {
#ifdef MS_AVX2
  if (m.prefetch && !is_hf_fp4(m.type)) {  // a row ahead, into L2 while this one is computed
    const char* ahead = (const char*)m.w + (i + m.rows_ahead) * m.ws;
    for (int64_t b = 0; b < m.ws; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
  }
#endif
  for (size_t c = 0; c < xs.q.size(); ++c) {
    const int64_t r0 = XR_ROWS * (int64_t)c;
    rows_dot_n<XR_ROWS>((int)std::min<int64_t>(XR_ROWS, xs.n - r0), m, i, scalar, K, xs.q[c], xs.f[c].data(),
                        out + r0);
  }
}

// Rows i .. i + nb - 1 of m against every row of xs: out[r * nb + j] for row i + j and activation row r. An
// interleaved type is read a whole group at a time (nb must be 8 and i a multiple of 8): one dot_x8 per activation
// row; other types go row by row (row_dots, o: scratch of xs.n floats).
inline void block_dots(const Mat& m, int64_t i, int64_t nb, bool scalar, int64_t K, const XSet& xs, float* out,
                       float* o) {
  if (is_x8_type(m.type)) {  // no prefetch by default: see PREFETCH_ROWS (g_x8_ahead > 0: that many groups ahead)
    const uint8_t* w = m.w + i * m.ws;
#ifdef MS_AVX2
    const int64_t ahead = m.prefetch ? m.x8_ahead : 0;
    if (ahead > 0) {  // the group `ahead` groups on, into L2 (a hint: past the matrix's end it reads nothing)
      const char* a = (const char*)w + ahead * 8 * m.ws;
      for (int64_t b = 0; b < 8 * m.ws; b += 64) _mm_prefetch(a + b, _MM_HINT_T1);
    }
#endif
    for (size_t c = 0; c < xs.q.size(); ++c) {
      const int64_t r0 = XR_ROWS * (int64_t)c;
      dot_x8_n(m.type, scalar, w, K, xs.q[c], (int)std::min<int64_t>(XR_ROWS, xs.n - r0), out + 8 * r0);
    }
    return;
  }
  for (int64_t j = 0; j < nb; ++j) {
    row_dots(m, i + j, scalar, K, xs, o);
    for (int64_t r = 0; r < xs.n; ++r) out[r * nb + j] = o[r];
  }
}

// ------------------------------------------------------------------ the MoE layer call
// float32 -> bf16 / f16 -> float32, round to nearest even (what torch's .to(dtype) does for finite values)
inline float round_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7f800000u) == 0x7f800000u) return f;  // inf / nan as they are
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &b, 4);
  return f;
}

inline float round_f16(float f) {
#ifdef MS_AVX2
  return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  if (!std::isfinite(f)) return f;
  const float a = std::fabs(f);
  if (a >= 65520.f) return std::copysign(INFINITY, f);  // rounds past the largest half (65504)
  int e;
  std::frexp(a, &e);                       // a = m * 2^e, m in [0.5, 1)
  const int ulp_exp = std::max(e - 11, -24);  // 11 significant bits; subnormals step 2^-24
  const float ulp = std::ldexp(1.f, ulp_exp);
  return std::copysign(std::nearbyint(a / ulp) * ulp, f);  // exact: a / ulp and the product are powers-of-2 scalings
#endif
}

inline float round_act(float v, int64_t mode) {
  return mode == 1 ? round_bf16(v) : mode == 2 ? round_f16(v) : v;
}

inline float act_to_float(const void* x, int64_t dtype, int64_t i) {
  if (dtype == 0) return ((const float*)x)[i];
  const uint16_t h = ((const uint16_t*)x)[i];
  if (dtype == 2) return half_to_float((const uint8_t*)&h);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Static share [b, e) of thread t over items weighted by cost(i) (prefix sums `cum`, cum[0] = 0).
// Item bounds of `chunks` chunks of equal cost over G groups of `rows` items, group g's items costing c[g] each:
// chunk k is items [b[k], b[k + 1]) (item g * rows + i is row i of group g). Any bounds give the same numbers.
// tail_n, tail_s: the last tail_n of the chunks are each cut into tail_s of equal cost (g_layer_tail).
std::vector<int64_t> cost_chunks(const std::vector<double>& c, int64_t rows, int64_t chunks, int64_t tail_n = 0,
                                 int64_t tail_s = 1) {
  const int64_t G = (int64_t)c.size();
  std::vector<double> cg(G + 1, 0.0);
  for (int64_t g = 0; g < G; ++g) cg[g + 1] = cg[g] + c[g] * (double)rows;
  tail_n = tail_s > 1 ? std::min(tail_n, chunks) : 0;
  const int64_t head = chunks - tail_n, total = head + tail_n * std::max<int64_t>(1, tail_s);
  std::vector<int64_t> b(total + 1, 0);
  b[total] = G * rows;
  for (int64_t k = 1; k < total; ++k) {
    // chunk boundary k at the cost fraction of `chunks` equal chunks, the tail's in steps of 1 / tail_s of one
    const double frac = k <= head ? (double)k : (double)head + (double)(k - head) / (double)tail_s;
    const double at = cg[G] * frac / (double)chunks;
    const int64_t g = std::min<int64_t>(G - 1, std::upper_bound(cg.begin(), cg.end(), at) - cg.begin() - 1);
    const int64_t i = c[g] > 0 ? std::min<int64_t>(rows, (int64_t)std::ceil((at - cg[g]) / c[g])) : rows;
    b[k] = std::max(b[k - 1], g * rows + i);
  }
  return b;
}

int ms_moe_layer_impl(const void* x, int64_t xdtype, int64_t nx, int64_t H, int64_t I, int64_t G,
                      const int64_t* wptr, const int64_t* wtype, const int64_t* gstart, const int64_t* prow,
                      const float* pw, const int64_t* pdst, float* out, int64_t nout, int64_t os, int64_t hmode,
                      int64_t flags, int nthreads, int scalar) {
  const int64_t tg = wtype[0], tu = wtype[1], td = wtype[2];
  for (int p = 0; p < 3; ++p)
    if (row_bytes(wtype[p], p < 2 ? H : I) <= 0 || (p < 2 ? H : I) % block_size(wtype[p]) ||
        (is_x8_type(wtype[p]) && (p < 2 ? I : H) % 8))
      return -1;
  if (xdtype < 0 || xdtype > 2 || hmode < 0 || hmode > 2 || nx < 0 || G < 0) return -2;
  const int64_t P = G ? gstart[G] : 0;
  for (int64_t g = 0; g < G; ++g)
    if (gstart[g + 1] < gstart[g]) return -2;
  for (int64_t p = 0; p < P; ++p)
    if (prow[p] < 0 || prow[p] >= nx || pdst[p] < 0 || pdst[p] >= nout) return -3;
  if (P == 0) return 0;
  const bool round_mm = flags & 1;  // dense experts (PairMlp): every matmul output rounded to the act dtype
  const int64_t rbg = row_bytes(tg, H), rbu = row_bytes(tu, H), rbd = row_bytes(td, I);
  // the cost of one output row of group g: its weight bytes, plus compute per activation row
  std::vector<double> c1(G), c3(G);
  double bytes = 0;
  for (int64_t g = 0; g < G; ++g) {
    const double n = (double)(gstart[g + 1] - gstart[g]);
    c1[g] = n ? (double)(rbg + rbu) * (1.0 + 0.25 * n) : 0.0, c3[g] = n ? (double)rbd * (1.0 + 0.25 * n) : 0.0;
    bytes += c1[g] * (double)I + c3[g] * (double)H;
  }
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, (int64_t)(bytes / (64 << 10))));
  // gate/up and down rows in chunks of at least ~32 KiB of weights, up to CHUNKS_PER_THREAD per thread (the tuning)
  const int64_t x8a = tl_x8_ahead >= 0 ? tl_x8_ahead : g_x8_ahead.load(std::memory_order_relaxed);
  const int64_t rows_ahead =
      std::max<int64_t>(1, tl_rows_ahead > 0 ? tl_rows_ahead : g_rows_ahead.load(std::memory_order_relaxed));
  const int64_t per_thread = std::max<int64_t>(1, g_layer_chunks.load(std::memory_order_relaxed));
  const int64_t kb_set = g_layer_chunk_bytes.load(std::memory_order_relaxed);
  const double chunk_bytes = (double)(kb_set > 0 ? kb_set : std::max<int64_t>(32 << 10, (int64_t)nt * (8 << 10)));
  const bool flow = g_layer_flow.load(std::memory_order_relaxed) != 0;
  auto nchunks = [&](const std::vector<double>& c, int64_t rows) {
    double b = 0;
    for (double v : c) b += v * (double)rows;
    return std::max<int64_t>(nt, std::min<int64_t>(nt * per_thread, (int64_t)(b / chunk_bytes)));
  };
  const int64_t tail = std::max<int64_t>(1, g_layer_tail.load(std::memory_order_relaxed));
  std::vector<int64_t> b1 = cost_chunks(c1, I, nchunks(c1, I), nt, tail), b3 = cost_chunks(c3, H, nchunks(c3, H), nt, tail);
  if (is_x8_type(tg) || is_x8_type(tu))  // an interleaved group of 8 rows within one chunk (I % 8 == 0: checked)
    for (int64_t& k : b1) k -= k % 8;
  if (is_x8_type(td))
    for (int64_t& k : b3) k -= k % 8;
  Chunks ch1((int64_t)b1.size() - 1), ch3((int64_t)b3.size() - 1);
  // the activation forms the types read: int8 per 32 (QAct), per 256 (QActK), HF FP4's (QActF4), float
  auto blocks32 = [](int64_t t) { return !is_float_act(t) && !is_k_type(t) && !is_hf_fp4(t); };
  const bool q_x = blocks32(tg) || blocks32(tu), q_h = blocks32(td);
  const bool p_x = is_hf_fp4(tg) || is_hf_fp4(tu), p_h = is_hf_fp4(td);
  const bool k_x = is_k_type(tg) || is_k_type(tu), k_h = is_k_type(td);
  std::vector<float> xf(nx * H), hbuf(P * I);
  QAct xq;
  QActK xk;
  QActF4 xp;
  xq.K = H, xq.nb = H / QB;
  if (q_x) xq.resize(nx);
  if (k_x) xk.resize(nx, H);
  if (p_x) xp.resize(nx, H);
  auto x_row = [&](int64_t r) {  // x row r to float32, quantized once for every expert that reads it
    float* xr = xf.data() + r * H;
    for (int64_t i = 0; i < H; ++i) xr[i] = act_to_float(x, xdtype, r * H + i);
    if (q_x) xq.quantize(xr, r);
    if (p_x) xp.quantize(xr, r);
    if (k_x) quantize_row_k(xr, H, xk.q.data() + r * H, xk.d.data() + r * xk.nb, xk.bs.data() + r * (H / 16));
  };
  // A decode call's few x rows are prepared here, before the threads start: one barrier less.
  const bool x_here = nx * H <= (1 << 16);
  if (x_here)
    for (int64_t r = 0; r < nx; ++r) x_row(r);
  // flow (g_layer_flow): gate/up rows of each expert done so far; an expert's down rows wait for all I of them
  std::unique_ptr<std::atomic<int64_t>[]> done1(flow ? new std::atomic<int64_t>[G] : nullptr);
  if (flow)
    for (int64_t g = 0; g < G; ++g) done1[g].store(0, std::memory_order_relaxed);
  const bool prof = g_layer_prof.load(std::memory_order_relaxed) != 0;
  // per thread: its start, phase 1 done, phase 2 done (the region starts at the first thread's start: a thread may
  // be scheduled late, after others finished their first phase)
  std::vector<double> pt(prof ? 3 * (size_t)nt : 0, 0.0);
  const double t_entry = prof ? prof_clock() : 0.0;

  parallel(nt, [&](const int t, const int T, auto&& barrier) {
    if (prof) pt[3 * t] = prof_clock();
    if (!x_here) {
      for (int64_t r = t; r < nx; r += T) x_row(r);
      barrier();
    }
    // gate and up rows of every expert, h = silu(g) * u rounded to the activations' dtype; rows in blocks of 8
    // where either matrix is interleaved (the chunks' bounds are then multiples of 8), else one by one
    {
      const int64_t nb = is_x8_type(tg) || is_x8_type(tu) ? 8 : 1;
      std::vector<float> go, uo, o;
      XSet sg, su;
      Mat mg, mu;
      int64_t cur = -1, made = 0;  // (flow: this expert's rows computed and not yet counted in done1)
      auto count = [&] {
        if (flow && made) done1[cur].fetch_add(made, std::memory_order_release);
        made = 0;
      };
      for (int64_t c; ch1.next(c); count())
        for (int64_t k = b1[c]; k < b1[c + 1]; k += nb) {
          const int64_t g = k / I, i = k % I, p0 = gstart[g], n = gstart[g + 1] - p0;
          if (!n) continue;
          if (g != cur) {  // this expert's matrices and x rows, once for all its weight rows
            count();
            cur = g;
            go.resize(n * nb), uo.resize(n * nb), o.resize(n);
            mg = layer_mat(tg, wptr[3 * g], H), mu = layer_mat(tu, wptr[3 * g + 1], H);
            mg.prefetch = mu.prefetch = I * mg.ws >= PREFETCH_MIN_BYTES;
            mg.x8_ahead = mu.x8_ahead = x8a;
            mg.rows_ahead = mu.rows_ahead = rows_ahead;
            make_xset(sg, tg, xq, xp, xk, xf.data(), H, prow + p0, n);
            make_xset(su, tu, xq, xp, xk, xf.data(), H, prow + p0, n);
          }
          block_dots(mg, i, nb, scalar, H, sg, go.data(), o.data());
          block_dots(mu, i, nb, scalar, H, su, uo.data(), o.data());
          for (int64_t r = 0; r < n; ++r)
            for (int64_t j = 0; j < nb; ++j) {
              float gv = go[r * nb + j], uv = uo[r * nb + j];
              if (round_mm) gv = round_act(gv, hmode), uv = round_act(uv, hmode);
              hbuf[(p0 + r) * I + i + j] = round_act(gv / (1.f + std::exp(-gv)) * uv, hmode);
            }
          made += nb;
        }
    }
    if (prof) pt[3 * t + 1] = prof_clock();
    if (!flow || !x_here) barrier();
    // down rows, times the routing weight, into each pair's output row. Each thread quantizes the h rows of the
    // experts it reaches into its own buffers (a few rows of I values: cheaper than a barrier after a shared pass).
    {
      const int64_t nb = is_x8_type(td) ? 8 : 1;
      std::vector<float> yo, o;
      std::vector<int64_t> hrow;
      QAct hq;
      QActK hk;
      QActF4 hp;
      hq.K = I, hq.nb = I / QB;
      XSet sd;
      Mat md;
      int64_t cur = -1;
      for (int64_t c; ch3.next(c);)
        for (int64_t k = b3[c]; k < b3[c + 1]; k += nb) {
          const int64_t g = k / H, j = k % H, p0 = gstart[g], n = gstart[g + 1] - p0;
          if (!n) continue;
          if (g != cur) {
            cur = g;
            if (flow && x_here) {  // this expert's h complete (its gate/up chunks are out: no thread waits on them)
              int spins = 0;
              while (done1[g].load(std::memory_order_acquire) < I)
                if (++spins % 1024 == 0) std::this_thread::yield(); else Pool::relax();
            }
            yo.resize(n * nb), o.resize(n);
            md = layer_mat(td, wptr[3 * g + 2], I);
            md.prefetch = H * md.ws >= PREFETCH_MIN_BYTES;
            md.x8_ahead = x8a;
            md.rows_ahead = rows_ahead;
            const float* h = hbuf.data() + p0 * I;
            if (q_h) hq.resize(n);
            if (k_h) hk.resize(n, I);
            if (p_h) hp.resize(n, I);
            hrow.resize(n);
            for (int64_t r = 0; r < n; ++r) {
              const float* hr = h + r * I;
              hrow[r] = r;
              if (q_h) hq.quantize(hr, r);
              if (p_h) hp.quantize(hr, r);
              if (k_h) quantize_row_k(hr, I, hk.q.data() + r * I, hk.d.data() + r * hk.nb, hk.bs.data() + r * (I / 16));
            }
            make_xset(sd, td, hq, hp, hk, h, I, hrow.data(), n);
          }
          block_dots(md, j, nb, scalar, I, sd, yo.data(), o.data());
          for (int64_t r = 0; r < n; ++r)
            for (int64_t jj = 0; jj < nb; ++jj) {
              const float y = round_mm ? round_act(yo[r * nb + jj], hmode) : yo[r * nb + jj];
              out[pdst[p0 + r] * os + j + jj] = pw ? y * pw[p0 + r] : y;
            }
        }
    }
    if (prof) pt[3 * t + 2] = prof_clock();
  });
  if (prof) {
    const double t_end = prof_clock();
    double t0 = 1e30, p1[2] = {1e30, 0}, p2[2] = {1e30, 0};
    for (int t = 0; t < nt; ++t) {
      if (pt[3 * t] == 0.0) continue;  // (a team smaller than nt)
      t0 = std::min(t0, pt[3 * t]);
      p1[0] = std::min(p1[0], pt[3 * t + 1]), p1[1] = std::max(p1[1], pt[3 * t + 1]);
      p2[0] = std::min(p2[0], pt[3 * t + 2]), p2[1] = std::max(p2[1], pt[3 * t + 2]);
    }
    std::lock_guard<std::mutex> lk(g_layer_prof_mu);
    const double add[7] = {1, t0 - t_entry, p1[0] - t0, p1[1] - t0, p2[0] - t0, p2[1] - t0, t_end - t_entry};
    for (int i = 0; i < 7; ++i) g_layer_prof_sum[i] += add[i];
  }
  return 0;
}

// One segment of matmul_segs: N rows of m, written to output columns col .. col + N - 1.
struct Seg {
  Mat m;
  int64_t N = 0, col = 0;
};

// out [n, sum N] (rows os floats apart) = x [n, K] @ [W_0; W_1; ...].T for segments of possibly different types
// (a layer's q, k and v of a Q4_K_M file): x quantized once per activation form the types read, one parallel region
// over all the rows. Each output is the product a one-segment call gives (the same rows, the same activations).
void matmul_segs(std::vector<Seg> segs, const float* xf, int64_t n, int64_t K, float* op, int64_t os,
                 int nthreads, bool scalar) {
  bool want_q = false, want_k = false, want_f4 = false;
  int64_t rows_total = 0, rb = 1;
  for (Seg& g : segs) {
    const int64_t t = g.m.type;
    g.m.prefetch = g.N * g.m.ws >= PREFETCH_MIN_BYTES;
    if (is_k_type(t)) want_k = true;
    else if (is_hf_fp4(t)) want_f4 = true;
    else if (!is_float_act(t)) want_q = true;
    rows_total += g.N, rb = std::max(rb, row_bytes(t, K));
  }
  QAct qx;
  QActK qk;
  QActF4 qf;
  qx.K = K;
  if (want_k) {
    qk.resize(n, K);
    par_for(n, 16, nthreads, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quantize_row_k(xf + r * K, K, qk.q.data() + r * K, qk.d.data() + r * qk.nb, qk.bs.data() + r * (K / 16));
    });
  }
  if (want_f4) {
    qf.resize(n, K);
    par_for(n, 16, nthreads, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) qf.quantize(xf + r * K, r);
    });
  }
  if (want_q) qx = quantize(xf, n, K, nthreads);
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, rb * std::max<int64_t>(1, n / 4)));
  std::vector<int64_t> rows(n), first(segs.size() + 1, 0);
  for (int64_t r = 0; r < n; ++r) rows[r] = r;
  std::vector<XSet> xs(segs.size());
  for (size_t j = 0; j < segs.size(); ++j) {
    make_xset(xs[j], segs[j].m.type, qx, qf, qk, xf, K, rows.data(), n);
    first[j + 1] = first[j] + segs[j].N;
  }
  // interleaved types compute 8 rows at once: hand out whole groups where every segment is made of them
  bool grouped = true, any8 = false;
  for (const Seg& g : segs) grouped = grouped && g.N % 8 == 0, any8 = any8 || is_x8_type(g.m.type);
  const int64_t rg = grouped && any8 ? 8 : 1;
  par_for(rows_total / rg, std::max<int64_t>(1, grain / rg), nthreads, [&](int64_t g0, int64_t g1) {
    std::vector<float> o(n), ob(n * 8);
    const int64_t i0 = g0 * rg, i1 = g1 * rg;
    size_t j = std::upper_bound(first.begin(), first.end(), i0) - first.begin() - 1;
    int64_t done = -1;  // ungrouped: the interleaved group whose rows ob holds (its first row's index)
    for (int64_t i = i0; i < i1; i += rg) {
      while (i >= first[j + 1]) ++j;
      const Seg& g = segs[j];
      const int64_t li = i - first[j];
      if (rg == 1 && is_x8_type(g.m.type)) {  // a row of an interleaved group: the group once per chunk
        if (done != i - li % 8) block_dots(g.m, li - li % 8, 8, scalar, K, xs[j], ob.data(), o.data());
        done = i - li % 8;
        for (int64_t k = 0; k < n; ++k) op[k * os + g.col + li] = ob[k * 8 + li % 8];
        continue;
      }
      block_dots(g.m, li, rg, scalar, K, xs[j], ob.data(), o.data());
      for (int64_t k = 0; k < n; ++k)
        for (int64_t r = 0; r < rg; ++r) op[k * os + g.col + li + r] = ob[k * rg + r];
    }
  });
}

// Whether ms_qmatmul reads N rows of `type` with K columns (HF FP4 is ms_fp4_matmul's; interleaved types come in
// whole groups of 8 rows).
inline bool qmatmul_reads(int64_t type, int64_t K, int64_t N) {
  return row_bytes(type, K) > 0 && K % block_size(type) == 0 && !is_hf_fp4(type) && N >= 0 &&
         !(is_x8_type(type) && N % 8);
}

// out [n, N] (rows os floats apart) = x [n, K] @ W.T for the N rows of m: x quantized once in the form m's type
// reads, W's rows split over the threads (at least ~32 KiB of weights each, so the start-up stays small).
void matmul(const Mat& m, const float* xf, int64_t n, int64_t K, int64_t N, float* op, int64_t os, int nthreads,
            bool scalar) {
  Seg g;
  g.m = m, g.N = N;
  matmul_segs({g}, xf, n, K, op, os, nthreads, scalar);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One weight row of K values, dequantized from the unpackers' (a, q, b) per sub-block exactly as the torch
// decoders of quant/gguf_formats.py compute it (the product rounded before an offset is added: no fused
// multiply-add), F16 / BF16 widened. Returns false for a type without a scalar unpacker.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
bool dequant_row(int64_t type, const uint8_t* w, int64_t K, float* out) {
  if (is_float_type(type)) {
    for (int64_t i = 0; i < K; ++i) {
      uint16_t v;
      std::memcpy(&v, w + 2 * i, 2);
      if (type == T_F16) out[i] = half_to_float(w + 2 * i);
      else {
        const uint32_t bits = (uint32_t)v << 16;
        std::memcpy(out + i, &bits, 4);
      }
    }
    return true;
  }
  if (is_iq_k(type) || is_hf_fp4(type) || is_x8_type(type) || row_bytes(type, K) <= 0) return false;
  // as the torch decoders: Q4_0 / Q5_0 scale the centred code, d * (q - 8 | 16); the types with a minimum add
  // it after the product; the others are the product alone (so zeros keep their sign, as the gguf package's)
  const int shift = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0;
  const bool offset = type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
  unpack_scalar(type, w, K, [&](int64_t j, const Sub& u) {
    float* o = out + j * QB;
    for (int i = 0; i < QB; ++i) {
      const float p = (i < 16 ? u.a0 : u.a1) * (float)(u.q[i] - shift);
      o[i] = offset ? p + u.b : p;
    }
  });
  return true;
}
#pragma GCC pop_options

}  // namespace

extern "C" {

// out [n, K] float32 = rows ids[0..n) of a weight of `type` (rows `ws` bytes apart): an embedding lookup of
// GGUF bytes. Returns 0, -1 for a type this file has no scalar unpacker for (IQ4_XS, IQ3_S: the torch path) or
// a bad K, -3 for an id out of [0, N).
int ms_dequant_rows(const uint8_t* w, int64_t N, int64_t ws, int64_t type, int64_t K, const int64_t* ids, int64_t n,
                    float* out, int nthreads) {
  if (row_bytes(type, K) <= 0 || K % block_size(type) || is_iq_k(type) || is_hf_fp4(type) || is_x8_type(type))
    return -1;
  for (int64_t r = 0; r < n; ++r)
    if (ids[r] < 0 || ids[r] >= N) return -3;
  par_for(n, 8, nthreads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(type, w + ids[r] * ws, K, out + r * K);
  });
  return 0;
}

// x: float32 [n, K] rows contiguous; w: N rows of row_bytes(type, K) bytes, `wstride` bytes apart;
// out: float32 [n, N], rows `ostride` floats apart. Writes out = x @ W.T. Returns 0, or -1 for an
// unsupported type or K.
int ms_qmatmul(const float* xf, int64_t n, int64_t K, const uint8_t* wp, int64_t N, int64_t ws, int64_t type,
               float* op, int64_t os, int nthreads, int force_scalar) {
  if (!qmatmul_reads(type, K, N)) return -1;
  Mat m;
  m.type = type, m.w = wp, m.ws = ws;
  matmul(m, xf, n, K, N, op, os, nthreads, force_scalar);
  return 0;
}

// Several weights of K columns against the same x (a layer's separate q, k and v, of any types ms_qmatmul reads):
// segs [nseg][4] = (address, type, row stride in bytes, rows N) each; out [n, sum N] (rows os floats apart) takes
// the segments' columns in order. x is quantized once per activation form and all rows share one parallel region;
// each segment's columns are what ms_qmatmul gives it. Returns 0, or -1 for a segment ms_qmatmul would refuse.
int ms_qmatmul_segs(const float* xf, int64_t n, int64_t K, int64_t nseg, const int64_t* segs, float* op, int64_t os,
                    int nthreads, int force_scalar) {
  std::vector<Seg> v(nseg);
  int64_t col = 0;
  for (int64_t j = 0; j < nseg; ++j) {
    const int64_t* s = segs + 4 * j;
    if (!qmatmul_reads(s[1], K, s[3])) return -1;
    v[j].m.type = s[1], v[j].m.w = (const uint8_t*)s[0], v[j].m.ws = s[2], v[j].N = s[3], v[j].col = col;
    col += s[3];
  }
  matmul_segs(v, xf, n, K, op, os, nthreads, force_scalar);
  return 0;
}

// w: N rows of Q4_K, Q4_0, Q4_1, Q6_K or Q8_0 (`type`, K columns), `ws` bytes apart -> out: the same matrix with 8
// rows interleaved (Q4_K8 / Q4_0X8 / Q4_1X8 / Q6_K8 / Q8_0X8, this library's own type ids 1012-1016; N / 8 groups, row_bytes of the
// new type per row; see the "8 rows interleaved" sections). Returns the new type's id, or -1 for another type, N not a
// multiple of 8 or K not a multiple of the block.
int ms_repack_x8(const uint8_t* w, int64_t N, int64_t K, int64_t ws, int64_t type, uint8_t* out, int nthreads) {
  const int64_t to = type == T_Q4_K ? T_Q4_K8 : type == T_Q4_0 ? T_Q4_0X8 : type == T_Q4_1 ? T_Q4_1X8
                     : type == T_Q6_K ? T_Q6_K8 : type == T_Q8_0 ? T_Q8_0X8 : -1;
  if (to < 0 || N % 8 || K <= 0 || K % block_size(to) || ws < row_bytes(type, K)) return -1;
  const int64_t gs = 8 * row_bytes(to, K);  // bytes per group of 8 rows
  par_for(N / 8, 16, nthreads, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* src = w + 8 * g * ws;
      if (to == T_Q4_K8) repack_q4_k8(src, ws, K, out + g * gs);
      else if (to == T_Q6_K8) repack_q6_k8(src, ws, K, out + g * gs);
      else if (to == T_Q4_1X8) repack_q4x8<true>(src, ws, K, out + g * gs);
      else if (to == T_Q8_0X8) repack_q8x8(src, ws, K, out + g * gs);
      else repack_q4x8<false>(src, ws, K, out + g * gs);
    }
  });
  return (int)to;
}

// HF FP4 weights (type 1001 NVFP4, 1002 MXFP4; see the HF FP4 section): x float32 [n, K] rows contiguous; w: N
// rows of K / 2 code bytes, `ws` bytes apart; s: their scale bytes (K / 16 e4m3 or K / 32 e8m0 per row), rows
// `ss` bytes apart; g: NVFP4's float32 global scale (null: 1); out float32 [n, N], rows `os` floats apart.
// Writes out = x @ W.T with x rounded to int8 per 32. Returns 0, or -1 for another type or K not a multiple of 32.
int ms_fp4_matmul(const float* xf, int64_t n, int64_t K, int64_t type, const uint8_t* w, int64_t N, int64_t ws,
                  const uint8_t* s, int64_t ss, const float* g, float* op, int64_t os, int nthreads,
                  int force_scalar) {
  if (!is_hf_fp4(type) || K <= 0 || K % QB) return -1;
  Mat m;
  m.type = type, m.w = w, m.ws = ws, m.s = s, m.ss = ss, m.g = g ? *g : 1.f;
  matmul(m, xf, n, K, N, op, os, nthreads, force_scalar);
  return 0;
}

// x: float32 [n, K] rows contiguous; w: N rows of K float8_e4m3fn bytes, `ws` bytes apart; s: float32 scales
// (row i, column k: s[(i / bn) * srs + k / bk], see the FP8 section); out: float32 [n, N], rows `os` floats
// apart. Writes out = x @ (W * S).T. Returns 0, or -1 for bad block sizes.
int ms_fp8_matmul(const float* xf, int64_t n, int64_t K, const uint8_t* wp, int64_t N, int64_t ws, const float* s,
                  int64_t bn, int64_t bk, int64_t srs, float* op, int64_t os, int nthreads, int force_scalar) {
  if (bn <= 0 || bk <= 0 || K <= 0 || srs < 0) return -1;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, K * std::max<int64_t>(1, n / 4)));
  par_for(N, grain, nthreads, [&](int64_t i0, int64_t i1) {
    std::vector<float> o(4);
    for (int64_t i = i0; i < i1; ++i) {
      const float* srow = s + (i / bn) * srs;
      for (int64_t c = 0; c < n; c += 4) {
        const float* xr[4] = {};
        const int nr = (int)std::min<int64_t>(4, n - c);
        for (int r = 0; r < nr; ++r) xr[r] = xf + (c + r) * K;
        switch (nr) {
          case 4: fp8_rows_dot<4>(force_scalar, wp + i * ws, K, srow, bk, xr, o.data()); break;
          case 3: fp8_rows_dot<3>(force_scalar, wp + i * ws, K, srow, bk, xr, o.data()); break;
          case 2: fp8_rows_dot<2>(force_scalar, wp + i * ws, K, srow, bk, xr, o.data()); break;
          case 1: fp8_rows_dot<1>(force_scalar, wp + i * ws, K, srow, bk, xr, o.data()); break;
        }
        for (int r = 0; r < nr; ++r) op[(c + r) * os + i] = o[r];
      }
    }
  });
  return 0;
}

// A MoE layer's (token, expert) pairs in one call. x: nx activation rows [nx, H] (xdtype 0 float32, 1 bf16,
// 2 f16); G experts, pairs grouped by expert: group g is pairs [gstart[g], gstart[g+1]), pair p reads x row
// prow[p] and writes out row pdst[p] (`os` floats apart). wptr[3g + 0/1/2]: addresses of expert g's gate
// [I, H], up [I, H] and down [H, I] matrices (rows contiguous), of ggml types wtype[0/1/2]. Per pair:
//   g = W_gate x, u = W_up x (float32; flags & 1: rounded to hmode's dtype), h = silu(g) * u rounded to
//   hmode's dtype (0 float32, 1 bf16, 2 f16), y = W_down h (flags & 1: rounded), out = y * pw[p] (pw may be 0).
// x rows are quantized once for all experts, h once per pair. Threads: one parallel region; the gate/up rows
// of all experts, then the down rows, are split over the threads by bytes (+ a share per activation row).
// Returns 0, -1 for a type/shape the kernels lack, -2 for bad groups or dtypes, -3 for a row out of range.
int ms_moe_layer(const void* x, int64_t xdtype, int64_t nx, int64_t H, int64_t I, int64_t G, const int64_t* wptr,
                 const int64_t* wtype, const int64_t* gstart, const int64_t* prow, const float* pw,
                 const int64_t* pdst, float* out, int64_t nout, int64_t os, int64_t hmode, int64_t flags,
                 int nthreads, int force_scalar) {
  return ms_moe_layer_impl(x, xdtype, nx, H, I, G, wptr, wtype, gstart, prow, pw, pdst, out, nout, os, hmode, flags,
                           nthreads, force_scalar);
}

// The CPU bridge's worker for one decode step (moe/bridge.py), every MoE layer in order, without Python:
// for layer i, wait until req[i] == seq (the GPU's post; *cancel >= seq: return -4, timeout_s: -5), group
// layer i's CPU pairs (ids[i, p] >= 0 of its meta[i] = (T, P') pairs) by expert, compute them with
// ms_moe_layer (x rows hx[i] of dtype xdtype, h rounded to it; out rows hy[i, p], float32) from expert e's
// matrices at wbase[i, j] + e * wstep[i, j] (ggml types wtype[i, j], j = gate / up / down; lflags[i] & 1:
// PairMlp's dense rounding), then done[i] = seq (release). Per layer: experts_out[i] = distinct experts,
// secs_out[i] = seconds in the layer call (0 experts: no call; moe/share.py fits a line to the calls);
// wait_out[2 i] = seconds waiting for the layer's request, wait_out[2 i + 1] = seconds from seeing it to the call
// (grouping the pairs) plus answering after it (where a step's time between the GPU and the worker goes).
// seconds. A layer call error (negative) is returned after every layer was answered.
int ms_bridge_step(int64_t L, int64_t seq, const int64_t* req, int64_t* done, const int64_t* meta,
                   const int64_t* ids, const float* hw, const void* hx, int64_t xdtype, float* hy, int64_t P,
                   int64_t H, int64_t I, const int64_t* wbase, const int64_t* wstep, const int64_t* wtype,
                   const int64_t* lflags, int64_t* experts_out, double* secs_out, double* wait_out,
                   const int64_t* cancel,
                   double timeout_s, int nthreads, int hold_pool, int64_t x8_ahead, int64_t rows_ahead) {
  const int64_t esize = xdtype == 0 ? 4 : 2;
  // hold_pool: the layer calls run on the pool, whose workers spin from this step's first call to its end instead
  // of sleeping between layers. The GPU's part of a layer (~0.1-2 ms) outlasts any fixed spin worth having on a
  // shared machine, and waking a sleeping team costs each layer call 100-200 us (the fit of moe/share.py on a
  // 16-core host: OpenMP's threads, with a second team in the process, sleep after ~1000 polls).
  struct Hold {
    int on;
    explicit Hold(int h) : on(h) {
      if (on) tl_use_pool = 1, pool().hold.fetch_add(1);
    }
    ~Hold() {
      if (on) tl_use_pool = -1, pool().hold.fetch_sub(1);
    }
  } hold(hold_pool);
  // x8_ahead >= 0 / rows_ahead > 0: this step's layer calls read interleaved groups / rows that far ahead (-1: the
  // library's settings)
  struct Ahead {
    Ahead(int64_t a, int64_t r) { tl_x8_ahead = a, tl_rows_ahead = r; }
    ~Ahead() { tl_x8_ahead = tl_rows_ahead = -1; }
  } ahead(x8_ahead, rows_ahead);
  std::vector<int64_t> pairs, gstart, prow, pdst, wptr;
  std::vector<float> pw;
  int rc_all = 0;
  for (int64_t i = 0; i < L; ++i) {
    const double t_wait = now_s();
    int64_t spins = 0;
    while (__atomic_load_n(&req[i], __ATOMIC_ACQUIRE) != seq) {
      if (__atomic_load_n(cancel, __ATOMIC_ACQUIRE) >= seq) return -4;
      if (++spins < 20000) {
        Pool::relax();
      } else {
        std::this_thread::yield();
        if (spins % 1024 == 0 && now_s() - t_wait > timeout_s) return -5;
      }
    }
    const double t_seen = now_s();
    wait_out[2 * i] = t_seen - t_wait;
    const int64_t T = meta[2 * i], Pn = meta[2 * i + 1];
    const int64_t* id = ids + i * P;
    pairs.clear();
    for (int64_t p = 0; p < Pn && p < P; ++p)
      if (id[p] >= 0) pairs.push_back(p);
    experts_out[i] = 0;
    secs_out[i] = 0.0;
    if (!pairs.empty() && T > 0) {
      std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
      gstart.assign(1, 0);
      wptr.clear();
      prow.resize(pairs.size());
      pdst.resize(pairs.size());
      pw.resize(pairs.size());
      const int64_t k = std::max<int64_t>(1, Pn / T);
      for (size_t q = 0; q < pairs.size(); ++q) {
        const int64_t p = pairs[q];
        if (q == 0 || id[p] != id[pairs[q - 1]]) {
          if (q) gstart.push_back((int64_t)q);
          for (int j = 0; j < 3; ++j) wptr.push_back(wbase[3 * i + j] + id[p] * wstep[3 * i + j]);
        }
        prow[q] = p / k, pdst[q] = p, pw[q] = hw[i * P + p];
      }
      gstart.push_back((int64_t)pairs.size());
      const int64_t G = (int64_t)gstart.size() - 1;
      const double t0 = now_s();
      const int rc = ms_moe_layer_impl((const char*)hx + i * P * H * esize, xdtype, T, H, I, G, wptr.data(),
                                       wtype + 3 * i, gstart.data(), prow.data(), pw.data(), pdst.data(),
                                       hy + i * P * H, P, H, xdtype, lflags[i] & 1, nthreads, 0);
      const double dt = now_s() - t0;
      if (rc && !rc_all) rc_all = rc;
      experts_out[i] = G;
      secs_out[i] = dt;
    }
    __atomic_store_n(&done[i], seq, __ATOMIC_RELEASE);
    wait_out[2 * i + 1] = now_s() - t_seen - secs_out[i];
  }
  return rc_all;
}

// The IQ3_S codebook (512 entries of 4 byte values, 2048 bytes: entry g's value i at 4 g + i), from the gguf
// package's table (cpu_quant.py); IQ3_S rows are refused until it is set.
void ms_set_iq3s_grid(const uint8_t* grid) {
  std::memcpy(g_iq3s_grid, grid, sizeof g_iq3s_grid);
  g_iq3s_ready.store(1, std::memory_order_release);
}

// Frees the calling thread's OpenMP team: its idle threads exit (libgomp's omp_pause_resource on the host; the next
// parallel region of this thread starts a new team). Why: libgomp's idle team threads spin ~3 ms before they sleep,
// but next to none (~100 spins) while the process holds more OpenMP threads, in all teams together, than there are
// CPUs. A GPU process whose main thread once ran torch's CPU ops in parallel (loading a checkpoint does) keeps that
// thread's team of one thread a core; the cpu/hybrid bridge worker's own team on top makes twice the CPUs, so the
// worker's team sleeps between layer calls and every call waits for its threads' wake-up (a 2-core VM: a fork/join
// 1.0 us without the main thread's team, 34-65 us with it). The main thread releases its team before the bridge's
// steps (CpuBridge.begin_step, MOESTREAM_OMP_RELEASE). Returns 0 when done, -1 where the runtime cannot.
// Looked up at run time (OpenMP 5.0: libgomp of GCC 9+, LLVM's libomp): GCC still reports _OPENMP 201511 and an older
// omp.h has no declaration, while the runtime loaded is torch's, whatever compiled this file.
int ms_omp_release_team() {
  using pause_fn = int (*)(int);
  static const pause_fn pause_all = reinterpret_cast<pause_fn>(dlsym(RTLD_DEFAULT, "omp_pause_resource_all"));
  return pause_all != nullptr && pause_all(1 /* omp_pause_soft */) == 0 ? 0 : -1;
}

// Threads of the kernels: use_pool 1 the library's own pool, whose idle workers spin spin_us microseconds
// before they sleep; 0 (default) OpenMP.
void ms_set_threading(int use_pool, int64_t spin_us) {
  g_use_pool.store(use_pool ? 1 : 0);
  pool().spin_ns.store(std::max<int64_t>(0, spin_us) * 1000);
}

// The MoE layer call's tuning (see g_layer_chunks): values < 0 (chunks, rows ahead: <= 0) leave a setting as it is;
// chunk bytes 0: by the thread count (g_layer_chunk_bytes).
void ms_set_layer_tuning(int64_t chunks_per_thread, int64_t chunk_bytes, int64_t x8_ahead, int64_t rows_ahead,
                         int64_t flow, int64_t tail) {
  if (tail > 0) g_layer_tail.store(tail);
  if (chunks_per_thread > 0) g_layer_chunks.store(chunks_per_thread);
  if (chunk_bytes >= 0) g_layer_chunk_bytes.store(chunk_bytes);
  if (x8_ahead >= 0) g_x8_ahead.store(x8_ahead);
  if (rows_ahead > 0) g_rows_ahead.store(rows_ahead);
  if (flow >= 0) g_layer_flow.store(flow ? 1 : 0);
}

// The tuning in force: out[0..5] = chunks per thread, chunk bytes, interleaved groups ahead, rows ahead, flow, tail.
void ms_get_layer_tuning(int64_t* out) {
  out[0] = g_layer_chunks.load(), out[1] = g_layer_chunk_bytes.load(), out[2] = g_x8_ahead.load();
  out[3] = g_rows_ahead.load(), out[4] = g_layer_flow.load(), out[5] = g_layer_tail.load();
}

// The layer call's profile (g_layer_prof): on 1 / 0 from now; out (may be null) gets the sums since the last read
// (calls, setup, phase 1 first / last done, phase 2 first / last done, total; seconds), which are then cleared.
void ms_layer_profile(int on, double* out) {
  std::lock_guard<std::mutex> lk(g_layer_prof_mu);
  if (out)
    for (int i = 0; i < 7; ++i) out[i] = g_layer_prof_sum[i];
  for (double& v : g_layer_prof_sum) v = 0.0;
  g_layer_prof.store(on ? 1 : 0);
}

// The SIMD level this library was built for: 0 portable, 1 AVX2, 2 AVX2 + AVX512-VNNI dot products.
int ms_isa() {
#if defined(MS_VNNI)
  return 2;
#elif defined(MS_AVX2)
  return 1;
#else
  return 0;
#endif
}

int ms_has_avx2() {
#ifdef MS_AVX2
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
