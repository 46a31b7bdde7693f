/* The paged forward pass's CPU kernels, float32 (compiled and loaded by paged_kernels.py).
 *
 * What torch runs as several kernels with a tensor between each (a norm is six, the attention
 * two embedding bags and a softmax), each function here does in one pass over its rows. The
 * attention is vLLM's PagedAttention idea on a CPU: every cached key and value is read once
 * per key head, in place through the block table, and used by all the query heads sharing it.
 * The matrix product keeps its weight in panels of 32 columns, read front to back, so a decode
 * step's few rows stream each weight once while the next panel is already on its way.
 * The product and the attention split their work over OpenMP's threads (torch's own pool:
 * the library is loaded after torch, so it binds to torch's libgomp); the rest runs in one.
 *
 * Layouts (minirl/runtime/paged_ops.py): one layer's keys are [Hkv, NB, D, bs] (transposed within
 * a block), its values [Hkv, NB, bs, D]; slot = block * bs + offset.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define W 16                                                           /* floats in one vector */
typedef float vec __attribute__((vector_size(4 * W)));                 /* a GCC/Clang vector of W floats */
static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }
static inline void prefetch(const float *p, int64_t n) { for (int64_t i = 0; i < n; i += W) __builtin_prefetch(p + i); }

#define NR 32                                                          /* a panel's columns: two vectors */
#define MR 8                                                           /* rows computed together */
/* acc[r] += row r < R of x (rows K apart) times a panel [K, NR]; with `ahead`, `step` floats of the
 * memory from there on are also asked for into L2 at each k (one line, or two when step > W). R is a
 * constant where this is inlined for a full tile, so the 2 x R sums stay in registers. */
static inline __attribute__((always_inline)) void panel_sums(
        const int R, vec acc[][2], const float *x, const float *panel, const float *ahead, int64_t step, int64_t K) {
    for (int64_t k = 0; k < K; k++) {
        vec b0 = load(panel + k * NR), b1 = load(panel + k * NR + W);
        if (ahead) {
            __builtin_prefetch(ahead + k * step, 0, 1);
            if (step > W) __builtin_prefetch(ahead + k * step + W, 0, 1);
        }
        for (int r = 0; r < R; r++) { acc[r][0] += x[r * K + k] * b0; acc[r][1] += x[r * K + k] * b1; }
    }
}

/* out [M, N] = x [M, K] @ w (+ bias) (+ out when accumulate): w packed in panels [N / NR, K, NR]
 * (panel j holds columns j*NR .. j*NR+NR-1, row k of it contiguous). Per panel, MR rows at a
 * time; the panel stays in L1/L2 for every row tile, and each of the T row tiles asks for its
 * 1/T of the next panel from memory, a little at every k, so that the loads spread over the
 * whole panel's arithmetic (asking for all of it in the first tile stalls on memory). */
void linear(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t K, int64_t N,
            int accumulate) {
    int64_t tiles = (M + MR - 1) / MR, step = NR / tiles > 0 ? NR / tiles : 1;   /* floats asked for per k */
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        const float *panel = w + n0 * K, *next = n0 + NR < N ? panel + NR * K : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int64_t mr = M - m0 < MR ? M - m0 : MR;
            const float *ahead = next && (m0 / MR) * K * step < NR * K ? next + (m0 / MR) * K * step : NULL;
            vec acc[MR][2];
            for (int r = 0; r < MR; r++) {
                acc[r][0] = bias ? load(bias + n0) : (vec){0};
                acc[r][1] = bias ? load(bias + n0 + W) : (vec){0};
            }
            if (mr == MR)
                panel_sums(MR, acc, x + m0 * K, panel, ahead, step, K);
            else
                panel_sums(mr, acc, x + m0 * K, panel, ahead, step, K);
            for (int r = 0; r < mr; r++) {
                float *o = out + (m0 + r) * N + n0;
                if (accumulate) { acc[r][0] += load(o); acc[r][1] += load(o + W); }
                store(o, acc[r][0]);
                store(o + W, acc[r][1]);
            }
        }
    }
}

/* HF's RMSNorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for T rows of n. */
void rms_norm(const float *x, const float *w, float *out, int64_t T, int64_t n, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float *ot = out + t * n, ss = 0.f;
        for (int64_t i = 0; i < n; i++) ss += xt[i] * xt[i];
        float r = 1.f / sqrtf(ss / n + eps);
        for (int64_t i = 0; i < n; i++) ot[i] = w[i] * (xt[i] * r);
    }
}

/* The SwiGLU MLP's middle: out[t] = silu(gate[t]) * up[t]; gate_up [T, 2m] holds gate then up. */
void silu_mul(const float *gate_up, float *out, int64_t T, int64_t m) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * m, *u = g + m;
        float *o = out + t * m;
        for (int64_t i = 0; i < m; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Rotary embedding, in place: x [T, heads, D] with rows row_stride floats apart; cos, ssin [T, D]:
 * each token's rotary rows, ssin = cat(-sin1, sin2), so that x' = x * cos + cat(x2, x1) * ssin
 * (HF's rotate-half). */
void rotate(float *x, int64_t row_stride, const float *cos, const float *ssin, int64_t T, int64_t heads, int64_t D) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = ssin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + t * row_stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                float a = xh[i], b = xh[i + half];
                xh[i] = a * c[i] + b * s[i];
                xh[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* The step's new keys and values into their slots. kv: token t's Hkv keys then Hkv values [2 Hkv, D]
 * at kv + t * row_stride; keys [Hkv, NB, D, bs], values [Hkv, NB, bs, D]: one layer's cache. */
void write_kv(const float *kv, int64_t row_stride, const int64_t *slots, float *keys, float *values,
              int64_t T, int64_t Hkv, int64_t D, int64_t NB, int64_t bs) {
    for (int64_t t = 0; t < T; t++) {
        int64_t block = slots[t] / bs, offset = slots[t] % bs;
        for (int64_t h = 0; h < Hkv; h++) {
            const float *k = kv + t * row_stride + h * D, *v = k + Hkv * D;
            float *kb = keys + (h * NB + block) * bs * D, *vb = values + (h * NB + block) * bs * D;
            for (int64_t d = 0; d < D; d++) kb[d * bs + offset] = k[d];
            for (int64_t d = 0; d < D; d++) vb[offset * D + d] = v[d];
        }
    }
}

/* Attention of the R query heads of one key head of one sequence (see decode_attention). R is a
 * constant where this is inlined, so the R x U sums stay in registers: U splits each sum in parts
 * (R * U >= 8: two FMA units, four cycles each), so that no sum waits on the one before. */
static inline __attribute__((always_inline)) void attend(
        const int R, const float *qh, const float *keys, const float *values, const int64_t *table, int64_t n,
        float *oh, float *scores, int64_t bs, int64_t D, int64_t L, float scale) {
    const int U = R >= 8 ? 1 : 8 / R;
    int64_t block_elems = bs * D;
    for (int64_t b = 0; b * bs < n; b++) {                              /* scores = q . k, a block at a time */
        const float *k = keys + table[b] * block_elems;                 /* [D, bs] */
        const float *next = (b + 1) * bs < n ? keys + table[b + 1] * block_elems : k;
        const float *v = values + table[b] * block_elems;              /* for the second pass */
        for (int64_t t0 = 0; t0 < bs; t0 += W) {
            vec acc[R][U];
            for (int r = 0; r < R; r++) for (int u = 0; u < U; u++) acc[r][u] = (vec){0};
            for (int64_t d = 0; d < D; d += U)
                for (int u = 0; u < U; u++) {
                    if (t0 == 0) {                  /* the next block's keys and this one's values, a row per d */
                        prefetch(next + (d + u) * bs, bs);
                        prefetch(v + (d + u) * bs, bs);
                    }
                    vec kd = load(k + (d + u) * bs + t0);
                    for (int r = 0; r < R; r++) acc[r][u] += qh[r * D + d + u] * kd;
                }
            for (int r = 0; r < R; r++) {
                vec sum = acc[r][0];
                for (int u = 1; u < U; u++) sum += acc[r][u];
                store(scores + r * L + b * bs + t0, sum * scale);
            }
        }
    }
    for (int r = 0; r < R; r++) {                                       /* softmax over positions < n */
        float *sc = scores + r * L, max = sc[0], sum = 0.f;
        for (int64_t i = 1; i < n; i++) max = sc[i] > max ? sc[i] : max;
        for (int64_t i = 0; i < n; i++) { sc[i] = expf(sc[i] - max); sum += sc[i]; }
        for (int64_t i = 0; i < n; i++) sc[i] /= sum;
        for (int64_t i = n; i < L; i++) sc[i] = 0.f;                   /* unseen positions of the last block */
    }
    for (int64_t d0 = 0; d0 < D; d0 += W) {                             /* out = p . v */
        vec acc[R][U];
        for (int r = 0; r < R; r++) for (int u = 0; u < U; u++) acc[r][u] = (vec){0};
        for (int64_t b = 0; b * bs < n; b++) {
            const float *v = values + table[b] * block_elems + d0;      /* [bs, D] */
            const float *p = scores + b * bs;
            for (int64_t t = 0; t < bs; t += U)
                for (int u = 0; u < U; u++) {
                    vec vt = load(v + (t + u) * D);
                    for (int r = 0; r < R; r++) acc[r][u] += p[r * L + t + u] * vt;
                }
        }
        for (int r = 0; r < R; r++) {
            vec sum = acc[r][0];
            for (int u = 1; u < U; u++) sum += acc[r][u];
            store(oh + r * D + d0, sum);
        }
    }
}

/* One query per sequence over its cached keys and values, read in place through its block tables.
 * q: sequence s's H query heads at q + s * q_stride ([H, D]); tables [S, B]; lengths [S]: the
 * sequence sees positions 0 .. lengths[s] - 1. out [S, H, D]. Query head h reads key head
 * h / n_rep; the n_rep heads of one key head are computed together, so each block of keys and
 * values is loaded once for all of them. The softmax runs over the visible positions only.
 * bs and D are multiples of W, n_rep at most 8 (paged_ops checks). */
void decode_attention(const float *q, int64_t q_stride, const float *keys, const float *values, const int64_t *tables,
                      const int64_t *lengths, float *out, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                      int64_t NB, int64_t bs, int64_t B, float scale) {
    int64_t n_rep = H / Hkv, L = B * bs;
    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * n_rep * L);              /* [n_rep, L], one per thread */
        #pragma omp for schedule(static) collapse(2)
        for (int64_t s = 0; s < S; s++)
            for (int64_t h = 0; h < Hkv; h++) {
                const float *qh = q + s * q_stride + h * n_rep * D, *k = keys + h * NB * bs * D;
                const float *v = values + h * NB * bs * D;
                const int64_t *table = tables + s * B;
                float *oh = out + (s * H + h * n_rep) * D;
                switch (n_rep) {                                        /* one copy of `attend` per n_rep */
                    case 1: attend(1, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                    case 2: attend(2, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                    case 3: attend(3, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                    case 4: attend(4, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                    case 5: attend(5, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                    case 6: attend(6, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                    case 7: attend(7, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                    default: attend(8, qh, k, v, table, lengths[s], oh, scores, bs, D, L, scale); break;
                }
            }
        free(scores);
    }
}

/* The calls queued by paged_kernels.queued(), run one after another with no Python between them (the
 * CPU's counterpart of replaying a CUDA graph). Call c is calls[c * ARGS .. c * ARGS + ARGS - 1]: its
 * kernel's number (the order below, KERNELS in paged_kernels.py), then its arguments, one 64-bit slot
 * each: pointers and integers as they are, floats in the low 32 bits. With `seconds`, each kernel's
 * wall time is added to seconds[its number] (paged_kernels.recorded). */
#define ARGS 16
typedef union { int64_t i; float f; } slot;
void run_calls(const int64_t *calls, int64_t n, double *seconds) {
    for (int64_t c = 0; c < n; c++) {
        const int64_t *a = calls + c * ARGS;
        struct timespec t0, t1;
        if (seconds) clock_gettime(CLOCK_MONOTONIC, &t0);
        #define P(i) ((void *)a[i])
        #define F(i) (((const slot *)&a[i])->f)
        switch (a[0]) {
            case 0: linear(P(1), P(2), P(3), P(4), a[5], a[6], a[7], (int)a[8]); break;
            case 1: rms_norm(P(1), P(2), P(3), a[4], a[5], F(6)); break;
            case 2: silu_mul(P(1), P(2), a[3], a[4]); break;
            case 3: rotate(P(1), a[2], P(3), P(4), a[5], a[6], a[7]); break;
            case 4: write_kv(P(1), a[2], P(3), P(4), P(5), a[6], a[7], a[8], a[9], a[10]); break;
            case 5: decode_attention(P(1), a[2], P(3), P(4), P(5), P(6), P(7), a[8], a[9], a[10], a[11], a[12],
                                     a[13], a[14], F(15)); break;
        }
        if (seconds) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            seconds[a[0]] += (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
        }
    }
}
