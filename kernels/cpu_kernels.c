/* Native CPU kernels, loaded by kernels/cpu_kernels.py.
 *
 * Paged attention: every single-token sequence of a step (decode) and every longer
 * chunk (prefill, below DEFINE_PREFILL) attends over its cached K/V read in place through
 * its block table (no gather, no padding).
 *
 * One task per sequence walks its pages once. For each page it takes every KV head in
 * turn, the head's GROUP query heads together, so each K/V row is read once per group and
 * a page's K and V are read as two contiguous spans; the spans of the pages PREFETCH_AHEAD
 * further on are requested ahead (a sequence's pages sit anywhere in the cache, which the
 * hardware prefetchers cannot follow). Per query head, positions go page by page: the
 * page's scores, then an online-softmax update (running max and sum, accumulator
 * rescaled when the max grows), then the page's V rows weighted into the accumulator.
 * Everything is accumulated in float32; bf16 inputs are widened on load (a bf16 is the
 * top half of a float32) and the output is rounded to nearest even.
 *
 * Built by kernels/cpu_kernels.py with -O3 -fopenmp, the target kernels/cpu_capability.py
 * gives (-march=native, or x86-64-v3/-v4/baseline when forced down; the widest vectors
 * preferred) and the value-safe parts of -ffast-math (finite math, reassociation), so the
 * inner loops over head_dim and the page's exponentials vectorize. Every AVX-512 block has
 * a portable equivalent that any target compiles (AVX2 vectorizes the same loops). The running max starts at a
 * large negative finite value instead of -inf (finite math assumes no infinities); every
 * sequence has at least one position, so it is always replaced.
 *
 * Also here: greedy argmax over bf16 logits rows (torch's bf16 argmax on CPU is slower
 * than widening first), and the bf16 add-RMSNorm, rotary and SiLU-and-mul of a layer.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_PAGE 256
#define MAX_HEADS 128

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* e^x for x <= 0, written so that loops over it vectorize (glibc's expf does not here):
 * 2^(x log2 e) split into an integer power, put in the exponent bits, and 2^f for
 * f in [-1/2, 1/2] by its degree-6 Taylor polynomial (relative error below 2e-7). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float y = x * 1.44269504088896341f;
    const float n = floorf(y + 0.5f);
    const float f = y - n;
    float p = 1.5403530393381609e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* One row's online-softmax step over a new block of scores sc[0 .. width): the first n
 * count (the rest become 0). sc becomes the block's weights e^(s - max), the running max
 * and sum are updated, and the row's accumulator acc[0 .. head_dim) is rescaled when the
 * max grew. */
static inline void online_softmax(float* sc, int n, int width, float* mx, float* sum, float* acc, int head_dim) {
    float m = *mx;
    for (int j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
    const float shrink = exp_nonpositive(*mx - m);
    float add = 0.0f;
    #pragma omp simd reduction(+:add)
    for (int j = 0; j < width; j++) {
        sc[j] = j < n ? exp_nonpositive(sc[j] - m) : 0.0f;
        add += sc[j];
    }
    *sum = *sum * shrink + add;
    *mx = m;
    if (shrink != 1.0f) {
        #pragma omp simd
        for (int d = 0; d < head_dim; d++) acc[d] *= shrink;
    }
}

#define LOAD_float(p) (p)
#define LOAD_bf16(p) bf16_to_float(p)
#define STORE_float(f) (f)
#define STORE_bf16(f) float_to_bf16(f)

/* A page's scores q.k for every query head of the group, with AVX512-BF16 when the
 * compiler targets it (with page_values_bf16 below; other targets and dtypes run the
 * portable loops): 32 bf16 products per instruction, accumulated in float32, and the
 * 16 positions' horizontal sums done together by a transpose tree (4 shuffle levels)
 * instead of one reduction per dot product. Returns 0 when not applicable (the caller
 * runs the portable loop). */
#if defined(__AVX512F__) && defined(__AVX512BF16__)

static inline __m512 sum16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane L of e holds the sum of a[j] for j = 0,4,8,12,1,5,... (derived once by
     * simulating the shuffles); put sum j in lane j */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}

static inline int page_scores_bf16(const bf16* q, int group, int head_dim, const bf16* kp, int64_t row_elems,
                                   int n, float scale, float sc[][MAX_PAGE]) {
    if (head_dim % 32) return 0;
    const int chunks = head_dim / 32;
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int m = n - j0 < 16 ? n - j0 : 16;
        for (int g = 0; g < group; g++) {
            __m512 parts[16];
            for (int j = 0; j < 16; j++) {
                __m512 acc = _mm512_setzero_ps();
                if (j < m) {
                    const bf16* krow = kp + (int64_t)(j0 + j) * row_elems;
                    for (int c = 0; c < chunks; c++)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + g * head_dim + 32 * c),
                                               (__m512bh)_mm512_loadu_si512(krow + 32 * c));
                }
                parts[j] = acc;
            }
            _mm512_storeu_ps(&sc[g][j0], _mm512_mul_ps(sum16(parts), scale_v));
        }
    }
    return 1;
}
/* The page's V rows weighted into the accumulators: for each 16-float slice of the head,
 * up to four query heads' accumulators stay in registers across the page's positions,
 * and each V slice is widened once for all of them. */
static inline int page_values_bf16(float sc[][MAX_PAGE], int group, int head_dim, const bf16* vp, int64_t row_elems,
                                   int n, float acc[][MAX_HEAD_DIM]) {
    if (head_dim % 16) return 0;
    for (int c = 0; c < head_dim; c += 16) {
        for (int g0 = 0; g0 < group; g0 += 4) {
            const int gn = group - g0 < 4 ? group - g0 : 4;
            __m512 a0 = _mm512_loadu_ps(&acc[g0][c]);
            __m512 a1 = gn > 1 ? _mm512_loadu_ps(&acc[g0 + 1][c]) : _mm512_setzero_ps();
            __m512 a2 = gn > 2 ? _mm512_loadu_ps(&acc[g0 + 2][c]) : _mm512_setzero_ps();
            __m512 a3 = gn > 3 ? _mm512_loadu_ps(&acc[g0 + 3][c]) : _mm512_setzero_ps();
            for (int j = 0; j < n; j++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(vp + (int64_t)j * row_elems + c));
                const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[g0][j]), v, a0);
                if (gn > 1) a1 = _mm512_fmadd_ps(_mm512_set1_ps(sc[g0 + 1][j]), v, a1);
                if (gn > 2) a2 = _mm512_fmadd_ps(_mm512_set1_ps(sc[g0 + 2][j]), v, a2);
                if (gn > 3) a3 = _mm512_fmadd_ps(_mm512_set1_ps(sc[g0 + 3][j]), v, a3);
            }
            _mm512_storeu_ps(&acc[g0][c], a0);
            if (gn > 1) _mm512_storeu_ps(&acc[g0 + 1][c], a1);
            if (gn > 2) _mm512_storeu_ps(&acc[g0 + 2][c], a2);
            if (gn > 3) _mm512_storeu_ps(&acc[g0 + 3][c], a3);
        }
    }
    return 1;
}
#define PAGE_SCORES_bf16 page_scores_bf16
#define PAGE_VALUES_bf16 page_values_bf16
#else
#define PAGE_SCORES_bf16(...) 0
#define PAGE_VALUES_bf16(...) 0
#endif
#define PAGE_SCORES_float(...) 0
#define PAGE_VALUES_float(...) 0

/* `bytes` from p requested into L2: the pages a sequence reads next sit anywhere in the
 * cache, so the hardware prefetchers cannot see the jump to them. */
static inline void prefetch_span(const void* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + off, 0, 2);
}

#define PREFETCH_AHEAD 2 /* pages */

/* q, out: [tokens, num_heads, head_dim] with row stride q_stride / out_stride (elements);
 * caches: [num_blocks, page, num_kv_heads, head_dim], contiguous; block_tables:
 * [num_seqs, bt_stride] int32; rows[s]: sequence s's token row in q and out. Returns 0,
 * or -1 when a size exceeds the kernel's fixed limits (the caller checks first) or the
 * per-thread state could not be allocated.
 *
 * One task per sequence walks its pages once, every KV head of a page in turn, so each
 * page's K and V are read as two contiguous spans (the next pages' spans prefetched). */
#define DEFINE_DECODE(NAME, T)                                                                  \
int NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,                     \
         const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,              \
         const int64_t* rows, T* out, int64_t out_stride, int num_seqs, int num_heads,         \
         int num_kv_heads, int head_dim, int page, float scale, int num_threads) {             \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || page > MAX_PAGE || num_heads > MAX_HEADS) \
        return -1;                                                                              \
    const int64_t row_elems = (int64_t)num_kv_heads * head_dim;                                 \
    const int64_t page_elems = (int64_t)page * row_elems;                                       \
    int failed = 0;                                                                             \
    _Pragma("omp parallel num_threads(num_threads)")                                            \
    {                                                                                           \
        /* per thread: every query head's scaled query and accumulator */                       \
        float (*qf)[MAX_HEAD_DIM] = malloc(sizeof(float) * MAX_HEAD_DIM * num_heads);           \
        float (*acc)[MAX_HEAD_DIM] = malloc(sizeof(float) * MAX_HEAD_DIM * num_heads);          \
        if (!qf || !acc) {                                                                      \
            _Pragma("omp atomic write")                                                         \
            failed = 1;                                                                         \
        }                                                                                       \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int s = 0; s < num_seqs; s++) {                                                    \
            if (!qf || !acc) continue;                                                          \
            float sc[MAX_GROUP][MAX_PAGE];                                                      \
            float mx[MAX_HEADS], sum[MAX_HEADS];                                                \
            float row[MAX_HEAD_DIM]; /* one K or V row, widened */                              \
            const T* qrow = q + rows[s] * q_stride;                                             \
            for (int h = 0; h < num_heads; h++) {                                               \
                for (int d = 0; d < head_dim; d++) {                                            \
                    qf[h][d] = LOAD_##T(qrow[h * head_dim + d]) * scale;                       \
                    acc[h][d] = 0.0f;                                                           \
                }                                                                               \
                mx[h] = -1e30f;                                                                 \
                sum[h] = 0.0f;                                                                  \
            }                                                                                   \
            const int len = seq_lens[s];                                                        \
            const int32_t* table = block_tables + (int64_t)s * bt_stride;                      \
            const int num_pages = (len + page - 1) / page;                                      \
            for (int ahead = 1; ahead < PREFETCH_AHEAD && ahead < num_pages; ahead++) {         \
                prefetch_span(k_cache + (int64_t)table[ahead] * page_elems, page_elems * (int64_t)sizeof(T)); \
                prefetch_span(v_cache + (int64_t)table[ahead] * page_elems, page_elems * (int64_t)sizeof(T)); \
            }                                                                                   \
            for (int pg = 0; pg < num_pages; pg++) {                                            \
                const int start = pg * page;                                                    \
                const int n = len - start < page ? len - start : page;                          \
                if (pg + PREFETCH_AHEAD < num_pages) {                                          \
                    const int64_t ahead = (int64_t)table[pg + PREFETCH_AHEAD] * page_elems;     \
                    prefetch_span(k_cache + ahead, page_elems * (int64_t)sizeof(T));            \
                    prefetch_span(v_cache + ahead, page_elems * (int64_t)sizeof(T));            \
                }                                                                               \
                for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                  \
                    const int64_t base = (int64_t)table[pg] * page_elems + kvh * head_dim;      \
                    const T* kp = k_cache + base;                                               \
                    const T* vp = v_cache + base;                                               \
                    const int h0 = kvh * group;                                                 \
                    if (!PAGE_SCORES_##T(qrow + h0 * head_dim, group, head_dim, kp, row_elems, n, scale, sc)) { \
                        for (int j = 0; j < n; j++) {                                           \
                            const T* krow = kp + j * row_elems;                                 \
                            _Pragma("omp simd")                                                 \
                            for (int d = 0; d < head_dim; d++) row[d] = LOAD_##T(krow[d]);      \
                            for (int g = 0; g < group; g++) {                                   \
                                float dot = 0.0f;                                               \
                                _Pragma("omp simd reduction(+:dot)")                            \
                                for (int d = 0; d < head_dim; d++) dot += qf[h0 + g][d] * row[d]; \
                                sc[g][j] = dot;                                                 \
                            }                                                                   \
                        }                                                                       \
                    }                                                                           \
                    for (int g = 0; g < group; g++)                                             \
                        online_softmax(sc[g], n, n, &mx[h0 + g], &sum[h0 + g], acc[h0 + g], head_dim); \
                    if (!PAGE_VALUES_##T(sc, group, head_dim, vp, row_elems, n, acc + h0)) {    \
                        for (int j = 0; j < n; j++) {                                           \
                            const T* vrow = vp + j * row_elems;                                 \
                            _Pragma("omp simd")                                                 \
                            for (int d = 0; d < head_dim; d++) row[d] = LOAD_##T(vrow[d]);      \
                            for (int g = 0; g < group; g++) {                                   \
                                const float p = sc[g][j];                                       \
                                _Pragma("omp simd")                                             \
                                for (int d = 0; d < head_dim; d++) acc[h0 + g][d] += p * row[d]; \
                            }                                                                   \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            T* orow = out + rows[s] * out_stride;                                               \
            for (int h = 0; h < num_heads; h++) {                                               \
                const float inv = 1.0f / sum[h];                                                \
                for (int d = 0; d < head_dim; d++) orow[h * head_dim + d] = STORE_##T(acc[h][d] * inv); \
            }                                                                                   \
        }                                                                                       \
        free(qf);                                                                               \
        free(acc);                                                                              \
    }                                                                                           \
    return failed ? -1 : 0;                                                                     \
}


DEFINE_DECODE(paged_decode_attention_f32, float)
DEFINE_DECODE(paged_decode_attention_bf16, bf16)

/* ---- Prefill attention: each sequence's chunk of q_lens[s] new tokens (rows rows[s] ..
 * rows[s] + q_lens[s] - 1 of q and out) attends causally over its seq_lens[s] positions,
 * the chunk's own K/V already stored in the cache. Same arguments and limits as decode,
 * plus q_lens; head_dim must be a multiple of 16.
 *
 * One task per (sequence, tile of PREFILL_TILE query positions, KV head): its rows are
 * the tile's positions times the head's GROUP query heads (GQA without repeating K/V),
 * and it walks the keys the tile's last position can see in chunks of 16 positions (never
 * crossing a page), widened to float32 once per chunk for all rows: the chunk's K
 * transposed ([head_dim][16], so the scores of 16 keys are one 16-wide multiply-add per
 * dimension) and its V rows. Scores, softmax and the accumulators are float32, with the
 * same online softmax as decode; rows go four at a time, so each K or V vector loaded
 * serves four rows. The last tiles of a sequence see the most keys: they are handed out
 * first. */
#define PREFILL_TILE 16
#define ROW_BLOCK 4
#define KEY_CHUNK 16

/* Four rows' scores against a chunk's 16 keys: s[i][j] = q_i . k_j, kt = the chunk's K
 * transposed ([head_dim][16]); and four rows' accumulators (16-float slices) += their
 * probabilities times the chunk's n V rows. The AVX-512 versions keep the accumulators in
 * registers (the compiler spilled them to the stack on every step of the loop). */
#if defined(__AVX512F__)
static inline void scores4(const float* q0, int head_dim, const float kt[][KEY_CHUNK], float s[][KEY_CHUNK]) {
    const float *q1 = q0 + head_dim, *q2 = q1 + head_dim, *q3 = q2 + head_dim;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const __m512 k = _mm512_loadu_ps(kt[d]);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), k, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(q1[d]), k, a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(q2[d]), k, a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(q3[d]), k, a3);
    }
    _mm512_storeu_ps(s[0], a0); _mm512_storeu_ps(s[1], a1); _mm512_storeu_ps(s[2], a2); _mm512_storeu_ps(s[3], a3);
}

static inline void values4(float* acc0, int head_dim, const float p[][KEY_CHUNK], const float vb[][MAX_HEAD_DIM], int n) {
    for (int c = 0; c < head_dim; c += 16) {
        float *o0 = acc0 + c, *o1 = o0 + head_dim, *o2 = o1 + head_dim, *o3 = o2 + head_dim;
        __m512 a0 = _mm512_loadu_ps(o0), a1 = _mm512_loadu_ps(o1), a2 = _mm512_loadu_ps(o2), a3 = _mm512_loadu_ps(o3);
        for (int j = 0; j < n; j++) {
            const __m512 v = _mm512_loadu_ps(vb[j] + c);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[0][j]), v, a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[1][j]), v, a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(p[2][j]), v, a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(p[3][j]), v, a3);
        }
        _mm512_storeu_ps(o0, a0); _mm512_storeu_ps(o1, a1); _mm512_storeu_ps(o2, a2); _mm512_storeu_ps(o3, a3);
    }
}
#else
static inline void scores4(const float* q0, int head_dim, const float kt[][KEY_CHUNK], float s[][KEY_CHUNK]) {
    for (int i = 0; i < ROW_BLOCK; i++) {
        const float* qi = q0 + (int64_t)i * head_dim;
        float a[KEY_CHUNK] = {0};
        for (int d = 0; d < head_dim; d++) {
            _Pragma("omp simd")
            for (int j = 0; j < KEY_CHUNK; j++) a[j] += qi[d] * kt[d][j];
        }
        for (int j = 0; j < KEY_CHUNK; j++) s[i][j] = a[j];
    }
}

static inline void values4(float* acc0, int head_dim, const float p[][KEY_CHUNK], const float vb[][MAX_HEAD_DIM], int n) {
    for (int i = 0; i < ROW_BLOCK; i++) {
        float* o = acc0 + (int64_t)i * head_dim;
        for (int j = 0; j < n; j++) {
            const float pj = p[i][j];
            _Pragma("omp simd")
            for (int d = 0; d < head_dim; d++) o[d] += pj * vb[j][d];
        }
    }
}
#endif

#define DEFINE_PREFILL(NAME, T)                                                                 \
int NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,                     \
         const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,              \
         const int64_t* rows, const int32_t* q_lens, T* out, int64_t out_stride, int num_seqs,  \
         int num_heads, int num_kv_heads, int head_dim, int page, float scale, int num_threads) { \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % 16 || page > MAX_PAGE)      \
        return -1;                                                                              \
    const int64_t row_elems = (int64_t)num_kv_heads * head_dim;                                 \
    const int64_t page_elems = (int64_t)page * row_elems;                                       \
    /* tasks: (sequence, tile) pairs in order, times the KV heads */                            \
    int64_t num_tiles = 0;                                                                      \
    for (int s = 0; s < num_seqs; s++) num_tiles += (q_lens[s] + PREFILL_TILE - 1) / PREFILL_TILE; \
    int32_t* tile_seq = malloc(sizeof(int32_t) * (num_tiles + 1));                             \
    int32_t* tile_start = malloc(sizeof(int32_t) * (num_tiles + 1));                           \
    if (!tile_seq || !tile_start) { free(tile_seq); free(tile_start); return -1; }              \
    int64_t t_i = 0;                                                                            \
    for (int s = 0; s < num_seqs; s++)                                                          \
        for (int i = 0; i < q_lens[s]; i += PREFILL_TILE) { tile_seq[t_i] = s; tile_start[t_i++] = i; } \
    const int max_rows = (PREFILL_TILE * group + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;         \
    int failed = 0;                                                                             \
    _Pragma("omp parallel num_threads(num_threads)")                                            \
    {                                                                                           \
        float* qf = malloc(sizeof(float) * max_rows * head_dim);                                \
        float* acc = malloc(sizeof(float) * max_rows * head_dim);                               \
        if (!qf || !acc) {                                                                      \
            _Pragma("omp atomic write")                                                         \
            failed = 1;                                                                         \
        }                                                                                       \
        float kt[MAX_HEAD_DIM][KEY_CHUNK], vb[KEY_CHUNK][MAX_HEAD_DIM];                         \
        float sc[PREFILL_TILE * MAX_GROUP + ROW_BLOCK][KEY_CHUNK];                              \
        float mx[PREFILL_TILE * MAX_GROUP + ROW_BLOCK], sum[PREFILL_TILE * MAX_GROUP + ROW_BLOCK]; \
        int last[PREFILL_TILE * MAX_GROUP + ROW_BLOCK]; /* each row's last visible key */       \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int64_t task = num_tiles * num_kv_heads - 1; task >= 0; task--) {                  \
            if (!qf || !acc) continue;                                                          \
            const int64_t tile = task / num_kv_heads;                                           \
            const int kvh = (int)(task % num_kv_heads);                                         \
            const int s = tile_seq[tile], i0 = tile_start[tile];                                \
            const int nq = q_lens[s] - i0 < PREFILL_TILE ? q_lens[s] - i0 : PREFILL_TILE;       \
            const int ctx = seq_lens[s] - q_lens[s];                                            \
            const int nrows = nq * group;                                                       \
            const int padded = (nrows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;                 \
            /* row r = position r / group of the tile, query head kvh * group + r % group */    \
            for (int r = 0; r < padded; r++) {                                                  \
                float* qr = qf + (int64_t)r * head_dim;                                         \
                float* ar = acc + (int64_t)r * head_dim;                                        \
                const int rr = r < nrows ? r : nrows - 1; /* padding repeats the last row */    \
                const T* src = q + (rows[s] + i0 + rr / group) * q_stride                       \
                               + (int64_t)(kvh * group + rr % group) * head_dim;                \
                for (int d = 0; d < head_dim; d++) { qr[d] = LOAD_##T(src[d]) * scale; ar[d] = 0.0f; } \
                mx[r] = -1e30f;                                                                 \
                sum[r] = 0.0f;                                                                  \
                last[r] = ctx + i0 + rr / group;                                                \
            }                                                                                   \
            const int32_t* table = block_tables + (int64_t)s * bt_stride;                      \
            const int end = ctx + i0 + nq; /* keys 0 .. end - 1 are seen by some row */         \
            for (int k0 = 0, n = 0; k0 < end; k0 += n) {                                        \
                const int in_page = page - k0 % page; /* a chunk never crosses a page */        \
                n = end - k0 < KEY_CHUNK ? end - k0 : KEY_CHUNK;                                \
                n = n < in_page ? n : in_page;                                                  \
                const int64_t base = (int64_t)table[k0 / page] * page_elems + (int64_t)(k0 % page) * row_elems \
                                     + (int64_t)kvh * head_dim;                                 \
                for (int j = 0; j < KEY_CHUNK; j++) {                                           \
                    const T* kr = k_cache + base + (int64_t)j * row_elems;                      \
                    const T* vr = v_cache + base + (int64_t)j * row_elems;                      \
                    if (j < n) {                                                                \
                        for (int d = 0; d < head_dim; d++) { kt[d][j] = LOAD_##T(kr[d]); vb[j][d] = LOAD_##T(vr[d]); } \
                    } else {                                                                    \
                        for (int d = 0; d < head_dim; d++) { kt[d][j] = 0.0f; vb[j][d] = 0.0f; } \
                    }                                                                           \
                }                                                                               \
                for (int r = 0; r < padded; r += ROW_BLOCK)                                     \
                    scores4(qf + (int64_t)r * head_dim, head_dim, kt, sc + r);                  \
                for (int r = 0; r < padded; r++) {                                              \
                    const int seen = last[r] - k0 + 1 < n ? last[r] - k0 + 1 : n; /* >= 0 keys */ \
                    online_softmax(sc[r], seen, KEY_CHUNK, &mx[r], &sum[r], acc + (int64_t)r * head_dim, head_dim); \
                }                                                                               \
                for (int r = 0; r < padded; r += ROW_BLOCK)                                     \
                    values4(acc + (int64_t)r * head_dim, head_dim, sc + r, vb, n);              \
            }                                                                                   \
            for (int r = 0; r < nrows; r++) {                                                   \
                T* dst = out + (rows[s] + i0 + r / group) * out_stride                          \
                         + (int64_t)(kvh * group + r % group) * head_dim;                       \
                const float inv = 1.0f / sum[r];                                                \
                const float* ar = acc + (int64_t)r * head_dim;                                  \
                for (int d = 0; d < head_dim; d++) dst[d] = STORE_##T(ar[d] * inv);             \
            }                                                                                   \
        }                                                                                       \
        free(qf);                                                                               \
        free(acc);                                                                              \
    }                                                                                           \
    free(tile_seq);                                                                             \
    free(tile_start);                                                                           \
    return failed ? -1 : 0;                                                                     \
}

DEFINE_PREFILL(paged_prefill_attention_f32, float)
DEFINE_PREFILL(paged_prefill_attention_bf16, bf16)

/* ---- Elementwise kernels of a layer (bf16), rounding where the torch references round,
 * so each matches its reference bit for bit except for the order of a float32 sum
 * (RMSNorm) and the exponential's last bits (SiLU). Rows run in parallel once a call
 * has enough of them to pay for the threads. */

#define PARALLEL_MIN_ELEMS 32768

static inline float exp_any(float x) { /* e^x, x clamped to [-87, 88] */
    x = x > 88.0f ? 88.0f : x;
    if (x <= 0.0f) return exp_nonpositive(x);
    return 1.0f / exp_nonpositive(-x);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* h = x + residual (rounded), out = weight * bf16(h * rsqrt(mean(h^2) + eps)).
 * residual may be NULL (h = x); res_out (may alias residual) receives h when non-NULL. */
#define MAX_NORM_DIM 16384

int add_rms_norm_bf16(const bf16* x, const bf16* residual, const bf16* weight, bf16* out, bf16* res_out,
                      int64_t rows, int dim, float eps, int num_threads) {
    if (dim > MAX_NORM_DIM) return -1;
    const int threads = rows * dim >= PARALLEL_MIN_ELEMS ? num_threads : 1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float h[MAX_NORM_DIM];
        const bf16* xr = x + r * dim;
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int d = 0; d < dim; d++) {
            float v = bf16_to_float(xr[d]);
            if (residual) v = round_bf16(v + bf16_to_float(residual[r * dim + d]));
            h[d] = v;
            ss += v * v;
        }
        if (res_out) {
            #pragma omp simd
            for (int d = 0; d < dim; d++) res_out[r * dim + d] = float_to_bf16(h[d]);
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        bf16* o = out + r * dim;
        #pragma omp simd
        for (int d = 0; d < dim; d++) o[d] = float_to_bf16(bf16_to_float(weight[d]) * round_bf16(h[d] * inv));
    }
    return 0;
}

/* Rotate-half RoPE in place on `heads` heads of each token: x [tokens, stride] with the
 * heads contiguous from the row start; cos/sin [tokens, head_dim] (bf16, model dtype). */
void rotary_bf16(bf16* x, int64_t stride, int64_t tokens, int heads, int head_dim,
                 const bf16* cos, const bf16* sin, int num_threads) {
    const int half = head_dim / 2;
    const int threads = tokens * heads * head_dim >= PARALLEL_MIN_ELEMS ? num_threads : 1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tokens; t++) {
        const bf16* c = cos + t * head_dim;
        const bf16* s = sin + t * head_dim;
        for (int h = 0; h < heads; h++) {
            bf16* row = x + t * stride + (int64_t)h * head_dim;
            #pragma omp simd
            for (int i = 0; i < half; i++) {
                const float x1 = bf16_to_float(row[i]), x2 = bf16_to_float(row[i + half]);
                const float a = round_bf16(x1 * bf16_to_float(c[i])) + round_bf16(-x2 * bf16_to_float(s[i]));
                const float b = round_bf16(x2 * bf16_to_float(c[i + half])) + round_bf16(x1 * bf16_to_float(s[i + half]));
                row[i] = float_to_bf16(a);
                row[i + half] = float_to_bf16(b);
            }
        }
    }
}

/* out [rows, width] = bf16(silu(gate)) * up, rounded; gate_up [rows, 2 * width]. */
void silu_and_mul_bf16(const bf16* gate_up, bf16* out, int64_t rows, int width, int num_threads) {
    const int threads = rows * width >= PARALLEL_MIN_ELEMS ? num_threads : 1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const bf16* g = gate_up + r * 2 * width;
        const bf16* u = g + width;
        bf16* o = out + r * width;
        #pragma omp simd
        for (int i = 0; i < width; i++) {
            const float gv = bf16_to_float(g[i]);
            const float silu = round_bf16(gv / (1.0f + exp_any(-gv)));
            o[i] = float_to_bf16(silu * bf16_to_float(u[i]));
        }
    }
}

/* out[r] = the index of the first largest value of row r of x [rows, cols] (row stride
 * `stride` elements), as torch.argmax; rows holding NaN are not covered (finite math). */
void argmax_rows_bf16(const bf16* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out, int num_threads) {
    const int threads = rows * cols >= PARALLEL_MIN_ELEMS ? num_threads : 1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const bf16* row = x + r * stride;
        float m = bf16_to_float(row[0]);
        #pragma omp simd reduction(max:m)
        for (int64_t c = 0; c < cols; c++) {
            const float v = bf16_to_float(row[c]);
            m = v > m ? v : m;
        }
        int64_t best = 0;
        while (best + 1 < cols && bf16_to_float(row[best]) != m) best++;
        out[r] = best;
    }
}
