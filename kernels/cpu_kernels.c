/* Native CPU kernels, loaded by kernels/cpu_kernels.py.
 *
 * Paged decode attention: every single-token sequence of a step attends over
 * its cached K/V read in place through its block table (no gather, no padding).
 *
 * One task per (sequence, KV head) handles that head's GROUP query heads together, so
 * each K/V row is read once per group. Positions go page by page: the page's scores for
 * every query head, then an online-softmax update (running max and sum, accumulator
 * rescaled when the max grows), then the page's V rows weighted into the accumulator.
 * Everything is accumulated in float32; bf16 inputs are widened on load (a bf16 is the
 * top half of a float32) and the output is rounded to nearest even.
 *
 * Built by kernels/cpu_kernels.py with -O3 -march=native -fopenmp -ffast-math (512-bit
 * vectors preferred), so the inner loops over head_dim and the page's exponentials
 * vectorize. The running max
 * starts at a large negative finite value instead of -inf (fast-math assumes no
 * infinities); every sequence has at least one position, so it is always replaced.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

typedef uint16_t bf16;

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_PAGE 256

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

#define LOAD_float(p) (p)
#define LOAD_bf16(p) bf16_to_float(p)
#define STORE_float(f) (f)
#define STORE_bf16(f) float_to_bf16(f)

/* q, out: [tokens, num_heads, head_dim] with row stride q_stride / out_stride (elements);
 * caches: [num_blocks, page, num_kv_heads, head_dim], contiguous; block_tables:
 * [num_seqs, bt_stride] int32; rows[s]: sequence s's token row in q and out. Returns 0,
 * or -1 when a size exceeds the kernel's fixed limits (the caller checks first). */
#define DEFINE_DECODE(NAME, T)                                                                  \
int NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,                     \
         const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,              \
         const int64_t* rows, T* out, int64_t out_stride, int num_seqs, int num_heads,         \
         int num_kv_heads, int head_dim, int page, float scale, int num_threads) {             \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || page > MAX_PAGE) return -1;             \
    const int64_t row_elems = (int64_t)num_kv_heads * head_dim;                                 \
    const int64_t page_elems = (int64_t)page * row_elems;                                       \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")       \
    for (int s = 0; s < num_seqs; s++) {                                                        \
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                          \
            float qf[MAX_GROUP][MAX_HEAD_DIM];                                                  \
            float acc[MAX_GROUP][MAX_HEAD_DIM];                                                 \
            float sc[MAX_GROUP][MAX_PAGE];                                                      \
            float mx[MAX_GROUP], sum[MAX_GROUP];                                                \
            float row[MAX_HEAD_DIM]; /* one K or V row, widened */                              \
            const T* qrow = q + rows[s] * q_stride + (int64_t)kvh * group * head_dim;           \
            for (int g = 0; g < group; g++) {                                                   \
                for (int d = 0; d < head_dim; d++) {                                            \
                    qf[g][d] = LOAD_##T(qrow[g * head_dim + d]) * scale;                       \
                    acc[g][d] = 0.0f;                                                           \
                }                                                                               \
                mx[g] = -1e30f;                                                                 \
                sum[g] = 0.0f;                                                                  \
            }                                                                                   \
            const int len = seq_lens[s];                                                        \
            const int32_t* table = block_tables + (int64_t)s * bt_stride;                      \
            for (int start = 0; start < len; start += page) {                                   \
                const int n = len - start < page ? len - start : page;                          \
                const int64_t base = (int64_t)table[start / page] * page_elems + kvh * head_dim;\
                const T* kp = k_cache + base;                                                   \
                const T* vp = v_cache + base;                                                   \
                for (int j = 0; j < n; j++) {                                                   \
                    const T* krow = kp + j * row_elems;                                         \
                    _Pragma("omp simd")                                                         \
                    for (int d = 0; d < head_dim; d++) row[d] = LOAD_##T(krow[d]);              \
                    for (int g = 0; g < group; g++) {                                           \
                        float dot = 0.0f;                                                       \
                        _Pragma("omp simd reduction(+:dot)")                                    \
                        for (int d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];            \
                        sc[g][j] = dot;                                                         \
                    }                                                                           \
                }                                                                               \
                for (int g = 0; g < group; g++) {                                               \
                    float m = mx[g];                                                            \
                    for (int j = 0; j < n; j++) m = sc[g][j] > m ? sc[g][j] : m;                \
                    const float shrink = exp_nonpositive(mx[g] - m);                                       \
                    float add = 0.0f;                                                           \
                    _Pragma("omp simd reduction(+:add)")                                        \
                    for (int j = 0; j < n; j++) {                                               \
                        sc[g][j] = exp_nonpositive(sc[g][j] - m);                                          \
                        add += sc[g][j];                                                        \
                    }                                                                           \
                    sum[g] = sum[g] * shrink + add;                                             \
                    mx[g] = m;                                                                  \
                    if (shrink != 1.0f) {                                                       \
                        _Pragma("omp simd")                                                     \
                        for (int d = 0; d < head_dim; d++) acc[g][d] *= shrink;                 \
                    }                                                                           \
                }                                                                               \
                for (int j = 0; j < n; j++) {                                                   \
                    const T* vrow = vp + j * row_elems;                                         \
                    _Pragma("omp simd")                                                         \
                    for (int d = 0; d < head_dim; d++) row[d] = LOAD_##T(vrow[d]);              \
                    for (int g = 0; g < group; g++) {                                           \
                        const float p = sc[g][j];                                               \
                        _Pragma("omp simd")                                                     \
                        for (int d = 0; d < head_dim; d++) acc[g][d] += p * row[d];             \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            T* orow = out + rows[s] * out_stride + (int64_t)kvh * group * head_dim;             \
            for (int g = 0; g < group; g++) {                                                   \
                const float inv = 1.0f / sum[g];                                                \
                for (int d = 0; d < head_dim; d++) orow[g * head_dim + d] = STORE_##T(acc[g][d] * inv); \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    return 0;                                                                                   \
}


DEFINE_DECODE(paged_decode_attention_f32, float)
DEFINE_DECODE(paged_decode_attention_bf16, bf16)

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
