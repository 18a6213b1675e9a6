// Attention over bfloat16 q/k/v on CPUs with AVX512-BF16, for the flow's DiT.
//
// Why it exists: PyTorch's CPU flash kernel runs bf16 attention no faster than float32 on a CPU that has
// AVX512-BF16 but no AMX (~115 GFLOP/s on 2 Zen 4 cores, against ~440 for the same CPU's bf16 matrix
// products), and at the flow's real sizes attention is then ~40 % of an int8 Euler step. This kernel
// computes both of attention's products with the CPU's bf16 dot products (vdpbf16ps: pairs of bf16
// multiplied, summed into float32) and keeps what lies between them in float32:
//
//   scores = (q . k) * scale        bf16 inputs, float32 sums
//   p      = softmax(scores)        float32, over the keys each query row may see
//   out    = (p rounded to bf16) . v / sum(p)   float32 sums, rounded to bf16 once
//
// which is the arithmetic of PyTorch's flash kernel on bf16 inputs (float32 scores and softmax, the
// probabilities rounded to bf16 for the second product), so its error against a float32 attention of the
// same bf16 inputs is of the same size (tests/test_native_attention.py states the bound).
//
// Keys and values may come in two segments: keys 0 .. n0-1 from (k0, v0), keys n0 .. n-1 from (k, v) (a
// streaming call's cached frames and its new ones, read where they lie instead of joined by a copy first).
//
// The mask is a row-prefix: query row i sees keys 0 .. row_len[i]-1 (every key where row_len is null).
// That covers both masks the solver uses: the block-causal chunk mask of a streaming call (a prefix per
// row) and none at all. Keys are never padded here: the padding PyTorch's BLAS wanted (fast_dit.KEY_ALIGN)
// is not needed.
//
// Work is split by (batch, head): each thread repacks one head's keys and values into the layouts the dot
// products read, then walks its query rows in tiles of QB rows. The threads are PyTorch's own OpenMP team
// where the caller passes libgomp's GOMP_parallel (the entry point GCC's `omp parallel` compiles to): the
// team PyTorch's products just ran on, awake, with no second set of threads for its spinning workers to
// take the cores from (pthreads started per call, the other route, ran a solve's attention ~1.5x slower
// on 2 cores than the same calls timed alone). A tile's scores are kept whole
// (QB x keys, float32) so the softmax is exact, not the running rescale of a flash kernel: at the flow's
// lengths (a few thousand keys at most) a tile's row fits in the L2 cache.
//
// Built by cosyllama.flow.native_attention with the system's C++ compiler at first use; plain C ABI,
// called through ctypes, no PyTorch headers.

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int QB = 6;        // query rows per tile
constexpr int KT = 4;        // 16-key vectors per score tile (64 keys); a row's last tile may have fewer

struct Args {
    const uint16_t *q, *k, *v, *k0, *v0;
    uint16_t *o;
    int b, h, m, n, n0, d;                                // n keys in all, the first n0 of them in k0/v0
    int64_t qs[3], ks[3], vs[3], k0s[3], v0s[3], os[3];  // strides in elements: batch, head, row
    const int32_t *row_len;              // m entries, or null
    float scale;
    std::atomic<int> next;
    std::atomic<int> failed;
};

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

inline uint32_t load_pair(const uint16_t *p) {
    uint32_t x;
    std::memcpy(&x, p, 4);
    return x;
}

// exp(x) for float32 x (x <= 0 here; -inf and anything below -100 give 0 or a negligible value that
// the caller's mask removes): 2^t with t = x log2(e) split into a whole part n and f in [-0.5, 0.5];
// 2^f from its Taylor series to degree 5 (error < 2.5e-6 relative on that interval, far below the 2^-9
// of the bf16 rounding the probabilities then take), then scaled by 2^n.
inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// Lanes j0 .. j0+15 that lie below len.
inline __mmask16 below(int j0, int len) {
    const int k = len - j0;
    return k >= 16 ? (__mmask16)0xFFFF : k <= 0 ? (__mmask16)0 : (__mmask16)((1u << k) - 1u);
}

struct Scratch {
    uint16_t *kp = nullptr;  // keys: per 16-key block, per channel pair, 16 keys x 2 channels
    uint16_t *vp = nullptr;  // values: per key pair, per channel, 2 keys
    float *s = nullptr;      // one tile's scores: QB rows x np keys
    uint16_t *p = nullptr;   // one tile's probabilities in bf16: QB rows x np keys
    float sum[QB];
    bool ok = false;

    Scratch(int np, int d) {
        const size_t kv = (size_t)np * d * sizeof(uint16_t);
        kp = (uint16_t *)std::aligned_alloc(64, (kv + 63) / 64 * 64);
        vp = (uint16_t *)std::aligned_alloc(64, (kv + 63) / 64 * 64);
        s = (float *)std::aligned_alloc(64, ((size_t)QB * np * sizeof(float) + 63) / 64 * 64);
        p = (uint16_t *)std::aligned_alloc(64, ((size_t)QB * np * sizeof(uint16_t) + 63) / 64 * 64);
        ok = kp && vp && s && p;
    }
    ~Scratch() {
        std::free(kp);
        std::free(vp);
        std::free(s);
        std::free(p);
    }
};

// Row j of one head's keys or values: from the first segment below n0, else from the second.
struct Rows {
    const uint16_t *first, *second;
    int64_t first_stride, second_stride;
    int n0;
    const uint16_t *operator()(int j) const {
        return j < n0 ? first + (int64_t)j * first_stride : second + (int64_t)(j - n0) * second_stride;
    }
};

// One head's keys into kp (zero past n, up to np) and values into vp (zero past n).
void repack(const Args &a, const Rows &k, const Rows &v, int np, Scratch &w) {
    const int d = a.d, pairs = d / 2;
    uint32_t *kp = (uint32_t *)w.kp;
    for (int blk = 0; blk < np / 16; ++blk) {
        for (int jj = 0; jj < 16; ++jj) {
            const int j = blk * 16 + jj;
            if (j < a.n) {
                const uint16_t *row = k(j);
                for (int c = 0; c < pairs; ++c) kp[((size_t)blk * pairs + c) * 16 + jj] = load_pair(row + 2 * c);
            } else {
                for (int c = 0; c < pairs; ++c) kp[((size_t)blk * pairs + c) * 16 + jj] = 0;
            }
        }
    }
    // value pair (j, j+1), channel c -> vp[(j/2 * d + c) * 2 + {0, 1}]
    for (int j = 0; j < np; j += 2) {
        uint32_t *dst = (uint32_t *)(w.vp + (size_t)j * d);
        const uint16_t *r0 = j < a.n ? v(j) : nullptr;
        const uint16_t *r1 = j + 1 < a.n ? v(j + 1) : nullptr;
        for (int c = 0; c < d; c += 16) {
            const __m512i lo = r0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + c)))
                                  : _mm512_setzero_si512();
            const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r1 + c)))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// Scores of QB query rows against keys kb .. kb+16*KT-1, scaled, into w.s.
template <int KT>
inline void score_tile(const uint16_t *const *qrow, const Scratch &w, int kb, int pairs, int np, float scale) {
    __m512 acc[QB][KT];
    for (int r = 0; r < QB; ++r)
        for (int t = 0; t < KT; ++t) acc[r][t] = _mm512_setzero_ps();
    const uint16_t *base = w.kp + (size_t)(kb / 16) * pairs * 32;
    for (int c = 0; c < pairs; ++c) {
        __m512bh kv[KT];
        for (int t = 0; t < KT; ++t) kv[t] = as_bh(_mm512_load_si512(base + ((size_t)t * pairs + c) * 32));
        for (int r = 0; r < QB; ++r) {
            const __m512bh qb = as_bh(_mm512_set1_epi32((int)load_pair(qrow[r] + 2 * c)));
            for (int t = 0; t < KT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qb, kv[t]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < QB; ++r)
        for (int t = 0; t < KT; ++t) _mm512_store_ps(w.s + (size_t)r * np + kb + 16 * t, _mm512_mul_ps(acc[r][t], sc));
}

// Accumulate QB rows' p . v over key pairs 0 .. jp-1 for channels c0 .. c0+16*DV-1; write out / sum.
template <int DV>
inline void value_tile(const Scratch &w, uint16_t *const *orow, int rows, int c0, int d, int np, int jp) {
    __m512 acc[QB][DV];
    for (int r = 0; r < QB; ++r)
        for (int t = 0; t < DV; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int j = 0; j < jp; ++j) {
        __m512bh vv[DV];
        const uint16_t *src = w.vp + ((size_t)j * d + c0) * 2;
        for (int t = 0; t < DV; ++t) vv[t] = as_bh(_mm512_load_si512(src + 32 * t));
        for (int r = 0; r < QB; ++r) {
            const __m512bh pb = as_bh(_mm512_set1_epi32((int)load_pair(w.p + (size_t)r * np + 2 * j)));
            for (int t = 0; t < DV; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], pb, vv[t]);
        }
    }
    for (int r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(w.sum[r] > 0.0f ? 1.0f / w.sum[r] : 0.0f);
        for (int t = 0; t < DV; ++t) {
            const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][t], inv));
            _mm256_storeu_si256((__m256i *)(orow[r] + c0 + 16 * t), (__m256i)y);
        }
    }
}

void one_head(const Args &a, int bh, Scratch &w, int np) {
    const int bi = bh / a.h, hi = bh % a.h, d = a.d, pairs = d / 2;
    const uint16_t *q = a.q + bi * a.qs[0] + hi * a.qs[1];
    const Rows k{a.k0 + bi * a.k0s[0] + hi * a.k0s[1], a.k + bi * a.ks[0] + hi * a.ks[1], a.k0s[2], a.ks[2], a.n0};
    const Rows v{a.v0 + bi * a.v0s[0] + hi * a.v0s[1], a.v + bi * a.vs[0] + hi * a.vs[1], a.v0s[2], a.vs[2], a.n0};
    uint16_t *o = a.o + bi * a.os[0] + hi * a.os[1];
    repack(a, k, v, np, w);
    for (int i0 = 0; i0 < a.m; i0 += QB) {
        const int rows = a.m - i0 < QB ? a.m - i0 : QB;
        const uint16_t *qrow[QB];
        uint16_t *orow[QB];
        int len[QB];
        int lmax = 0;
        for (int r = 0; r < QB; ++r) {
            const int i = i0 + (r < rows ? r : rows - 1);  // a short last tile repeats its last row
            qrow[r] = q + (int64_t)i * a.qs[2];
            orow[r] = o + (int64_t)i * a.os[2];
            int l = a.row_len ? a.row_len[i] : a.n;
            len[r] = l < 0 ? 0 : l > a.n ? a.n : l;
            if (len[r] > lmax) lmax = len[r];
        }
        const int span = (lmax + 15) / 16 * 16;  // keys scored: whole 16-key vectors, <= np
        int kb = 0;
        for (; kb + 16 * KT <= span; kb += 16 * KT) score_tile<KT>(qrow, w, kb, pairs, np, a.scale);
        switch ((span - kb) / 16) {
            case 3: score_tile<3>(qrow, w, kb, pairs, np, a.scale); break;
            case 2: score_tile<2>(qrow, w, kb, pairs, np, a.scale); break;
            case 1: score_tile<1>(qrow, w, kb, pairs, np, a.scale); break;
            default: break;
        }
        // softmax per row over its own keys; probabilities zero past them, up to an even count
        const int pspan = (lmax + 31) / 32 * 32;
        for (int r = 0; r < QB; ++r) {
            const float *s = w.s + (size_t)r * np;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < len[r]; j += 16) mx = _mm512_mask_max_ps(mx, below(j, len[r]), mx, _mm512_load_ps(s + j));
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 sum = _mm512_setzero_ps();
            uint16_t *p = w.p + (size_t)r * np;
            for (int j = 0; j < pspan; j += 32) {
                const __mmask16 m0 = below(j, len[r]), m1 = below(j + 16, len[r]);
                const __m512 e0 = _mm512_maskz_mov_ps(m0, exp_ps(_mm512_sub_ps(_mm512_load_ps(s + j), top)));
                const __m512 e1 = m1 ? _mm512_maskz_mov_ps(m1, exp_ps(_mm512_sub_ps(_mm512_load_ps(s + j + 16), top)))
                                     : _mm512_setzero_ps();
                sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                _mm512_store_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
            w.sum[r] = len[r] > 0 ? _mm512_reduce_add_ps(sum) : 0.0f;
        }
        const int jp = pspan / 2;
        int c0 = 0;
        for (; c0 + 64 <= d; c0 += 64) value_tile<4>(w, orow, rows, c0, d, np, jp);
        switch ((d - c0) / 16) {
            case 3: value_tile<3>(w, orow, rows, c0, d, np, jp); break;
            case 2: value_tile<2>(w, orow, rows, c0, d, np, jp); break;
            case 1: value_tile<1>(w, orow, rows, c0, d, np, jp); break;
            default: break;
        }
    }
}

void *worker(void *p) {
    Args &a = *(Args *)p;
    const int np = (a.n + 31) / 32 * 32;  // keys padded for the bf16 probabilities' 32-key stores
    Scratch w(np, a.d);
    if (!w.ok) {
        a.failed.store(1);
        return nullptr;
    }
    for (int bh = a.next.fetch_add(1); bh < a.b * a.h; bh = a.next.fetch_add(1)) one_head(a, bh, w, np);
    return nullptr;
}

void team_worker(void *p) { worker(p); }  // GOMP_parallel's signature: returns nothing

}  // namespace

extern "C" {

// Version of this interface: the loader refuses a library that answers otherwise.
int cosyllama_attention_version(void) { return 3; }

// libgomp's GOMP_parallel: runs fn(data) on the calling thread and num_threads - 1 workers of its team.
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

// out[b, h, i, :] = softmax over j < row_len[i] of (q[b, h, i, :] . key j) * scale, applied to the values, where
// keys and values j < n0 are k0[b, h, j, :] and v0[b, h, j, :], the others k[b, h, j - n0, :] and v[b, h, j - n0, :]
// (n0 = 0: k0 and v0 are not read). Strides in elements (batch, head, row); the channel stride is 1. d a multiple
// of 16. gomp_parallel: libgomp's GOMP_parallel to run on the caller's OpenMP team, or null for threads of its
// own. Returns 0, or 1 for shapes it does not take, 2 when memory ran out.
int cosyllama_attention_bf16(const uint16_t *q, const uint16_t *k0, const uint16_t *v0, const uint16_t *k,
                             const uint16_t *v, uint16_t *out, int b, int h, int m, int n0, int n, int d,
                             const int64_t *q_strides, const int64_t *k0_strides, const int64_t *v0_strides,
                             const int64_t *k_strides, const int64_t *v_strides, const int64_t *o_strides,
                             const int32_t *row_len, float scale, int threads, void *gomp_parallel) {
    if (b <= 0 || h <= 0 || m <= 0 || n <= 0 || n0 < 0 || n0 > n || d <= 0 || d % 16 != 0 || threads <= 0) return 1;
    if (n0 > 0 && (!k0 || !v0)) return 1;
    Args a;
    a.q = q, a.k = k, a.v = v, a.k0 = n0 ? k0 : k, a.v0 = n0 ? v0 : v, a.o = out;
    a.b = b, a.h = h, a.m = m, a.n = n, a.n0 = n0, a.d = d;
    for (int i = 0; i < 3; ++i) {
        a.qs[i] = q_strides[i], a.ks[i] = k_strides[i], a.vs[i] = v_strides[i], a.os[i] = o_strides[i];
        a.k0s[i] = n0 ? k0_strides[i] : k_strides[i], a.v0s[i] = n0 ? v0_strides[i] : v_strides[i];
    }
    a.row_len = row_len;
    a.scale = scale;
    a.next.store(0);
    a.failed.store(0);
    if (threads > b * h) threads = b * h;
    if (gomp_parallel) {
        ((gomp_parallel_fn)gomp_parallel)(team_worker, &a, (unsigned)threads, 0);
        return a.failed.load() ? 2 : 0;
    }
    pthread_t extra[64];
    int started = 0;
    for (int t = 1; t < threads && t <= 64; ++t) {
        if (pthread_create(&extra[started], nullptr, worker, &a) != 0) break;  // fewer threads, same result
        ++started;
    }
    worker(&a);
    for (int t = 0; t < started; ++t) pthread_join(extra[t], nullptr);
    return a.failed.load() ? 2 : 0;
}

}  // extern "C"
