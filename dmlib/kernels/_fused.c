/* One pass over a chunk of a float32 or float64 tensor pair: every statistic that
 * dmlib/kernels/stream.py computes with several numpy passes (add_aa + float_chunk).
 *
 * Optional: setup.py builds it when a C compiler is there; without it, dmlib uses the
 * numpy kernels (dmlib/kernels/stream.py says which one runs). The integer statistics
 * are the numpy kernels' exactly; the float sums (a.a, a.d, d.d) are float64 sums in
 * another order, so their last bits may differ from the numpy kernels' (both engines,
 * local and Dask, use the same kernel on one machine).
 *
 * same(a, b): memcmp of two buffers. f32(a, b, counts) / f64(a, b, counts): a and b are the chunks' bits (read-only
 * buffers of equal length, native byte order), counts a writable int64 buffer of
 * NBINS = 65538 bins that the ULP distance of every finite differing pair is counted
 * into (distances above 65536 in the last bin). Returns
 *   (aa, n_diff, first, max_abs, sad, sdd, max_ulp + 1, n_nan_payload, n_nan_vs_num,
 *    n_inf_mismatch)
 * with aa = sum a*a over pairs finite on both sides, first = index of the first
 * differing pair (-1: none), max_ulp + 1 = 0 when no finite pair differs (unsigned: a
 * float64 distance can pass 2^63), and sad, sdd =
 * sum a*d and sum d*d (d = b - a in float64) over finite differing pairs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <signal.h>
#ifndef _WIN32
#include <unistd.h>
#endif

#define NBINS 65538
#define ULP_EXACT 65536
#define BLOCK 4096

#define KERNEL(NAME, UINT, FLOAT, MAG, LIM)                                                  \
    static void NAME##_run(const UINT *a, const UINT *b, Py_ssize_t n, int64_t *counts,      \
                           double *out_f, int64_t *out_i, uint64_t *out_u) {                 \
        double aa = 0.0, sad = 0.0, sdd = 0.0, max_abs = 0.0;                                \
        int64_t n_diff = 0, first = -1, nan_payload = 0, nan_vs_num = 0;                    \
        uint64_t max_u1 = 0; /* the largest distance + 1; 0: no finite pair differs */       \
        int64_t inf_mismatch = 0;                                                            \
        int32_t idx[BLOCK];                                                                  \
        for (Py_ssize_t s = 0; s < n; s += BLOCK) {                                          \
            Py_ssize_t e = s + BLOCK < n ? s + BLOCK : n, m = e - s;                         \
            const UINT *pa = a + s, *pb = b + s;                                             \
            double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, chk[8] = {0, 0, 0, 0, 0, 0, 0, 0};    \
            Py_ssize_t i = 0;                                                                \
            /* a.a in 8 fixed lanes (vectorised; the order does not depend on the data);    \
             * b*0 is 0 unless b is inf or NaN, and a.a turns inf or NaN with a */            \
            for (; i + 8 <= m; i += 8) {                                                     \
                FLOAT xa[8], xb[8];                                                          \
                memcpy(xa, pa + i, sizeof xa);                                               \
                memcpy(xb, pb + i, sizeof xb);                                               \
                for (int k = 0; k < 8; k++) {                                                \
                    acc[k] += (double)xa[k] * (double)xa[k];                                 \
                    chk[k] += (double)xb[k] * 0.0;                                           \
                }                                                                            \
            }                                                                                \
            double tail = 0.0, tail_chk = 0.0; /* the last m % 8 pairs, in order */           \
            for (; i < m; i++) {                                                             \
                FLOAT fx, fy;                                                                \
                memcpy(&fx, pa + i, sizeof fx);                                              \
                memcpy(&fy, pb + i, sizeof fy);                                              \
                tail += (double)fx * (double)fx;                                             \
                tail_chk += (double)fy * 0.0;                                                \
            }                                                                                \
            double block = (((acc[0] + acc[1]) + (acc[2] + acc[3])) +                        \
                            ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;                 \
            double sum_chk = (((chk[0] + chk[1]) + (chk[2] + chk[3])) +                      \
                              ((chk[4] + chk[5]) + (chk[6] + chk[7]))) + tail_chk;           \
            if (!isfinite(block) || !isfinite(sum_chk)) {                                    \
                /* a NaN or inf in the block (or a.a overflowed): pairs finite on both sides, \
                 * summed in the same lanes */                                               \
                double rec[8] = {0, 0, 0, 0, 0, 0, 0, 0}, rtail = 0.0;                       \
                Py_ssize_t m8 = m / 8 * 8;                                                   \
                for (i = 0; i < m; i++) {                                                    \
                    UINT x = pa[i], y = pb[i];                                               \
                    FLOAT fx;                                                                \
                    memcpy(&fx, &x, sizeof fx);                                              \
                    if ((x & MAG) < LIM && (y & MAG) < LIM) {                                \
                        if (i < m8) rec[i % 8] += (double)fx * (double)fx;                    \
                        else rtail += (double)fx * (double)fx;                               \
                    }                                                                        \
                }                                                                            \
                block = (((rec[0] + rec[1]) + (rec[2] + rec[3])) +                           \
                         ((rec[4] + rec[5]) + (rec[6] + rec[7]))) + rtail;                   \
            }                                                                                \
            aa += block;                                                                     \
            /* any difference in the block (vectorised), then the differing pairs' places */ \
            UINT any = 0;                                                                    \
            for (i = 0; i < m; i++) any |= pa[i] ^ pb[i];                                    \
            if (!any) continue;                                                              \
            Py_ssize_t cnt = 0;                                                              \
            for (i = 0; i < m; i++) {                                                        \
                idx[cnt] = (int32_t)i;                                                       \
                cnt += pa[i] != pb[i];                                                       \
            }                                                                                \
            if (first < 0) first = s + idx[0];                                               \
            n_diff += cnt;                                                                   \
            double bsad = 0.0, bsdd = 0.0;                                                   \
            for (Py_ssize_t j = 0; j < cnt; j++) {                                           \
                UINT x = pa[idx[j]], y = pb[idx[j]];                                         \
                UINT mx = x & MAG, my = y & MAG;                                             \
                if (mx >= LIM || my >= LIM) { /* NaN or inf on a side: counted apart */       \
                    int na = mx > LIM, nb = my > LIM;                                        \
                    if (na && nb) nan_payload++;                                             \
                    else if (na || nb) nan_vs_num++;                                         \
                    else inf_mismatch++;                                                     \
                    continue;                                                                \
                }                                                                            \
                UINT u = ((x ^ y) & ~(UINT)MAG) ? mx + my : (mx > my ? mx - my : my - mx);   \
                if ((uint64_t)u + 1 > max_u1) max_u1 = (uint64_t)u + 1;                      \
                counts[u > ULP_EXACT ? ULP_EXACT + 1 : u]++;                                 \
                FLOAT fx, fy;                                                                \
                memcpy(&fx, &x, sizeof fx);                                                  \
                memcpy(&fy, &y, sizeof fy);                                                  \
                double dx = (double)fx, d = (double)fy - dx;                                 \
                double ad = fabs(d);                                                         \
                max_abs = ad > max_abs ? ad : max_abs;                                       \
                bsad += dx * d;                                                              \
                bsdd += d * d;                                                               \
            }                                                                                \
            sad += bsad;                                                                     \
            sdd += bsdd;                                                                     \
        }                                                                                    \
        out_f[0] = aa;                                                                       \
        out_f[1] = max_abs;                                                                  \
        out_f[2] = sad;                                                                      \
        out_f[3] = sdd;                                                                      \
        out_i[0] = n_diff;                                                                   \
        out_i[1] = first;                                                                    \
        *out_u = max_u1;                                                                     \
        out_i[3] = nan_payload;                                                              \
        out_i[4] = nan_vs_num;                                                               \
        out_i[5] = inf_mismatch;                                                             \
    }

KERNEL(f32, uint32_t, float, 0x7fffffffu, 0x7f800000u)
KERNEL(f64, uint64_t, double, 0x7fffffffffffffffull, 0x7ff0000000000000ull)

static PyObject *call(PyObject *args, Py_ssize_t width, int is64) {
    Py_buffer ba, bb, bc;
    if (!PyArg_ParseTuple(args, "y*y*w*", &ba, &bb, &bc)) return NULL;
    PyObject *res = NULL;
    if (ba.len != bb.len || ba.len % width) {
        PyErr_SetString(PyExc_ValueError, "chunks of different lengths, or not whole elements");
    } else if (bc.len != (Py_ssize_t)(NBINS * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "counts must be 65538 int64 bins");
    } else {
        double f[4];
        int64_t i[6];
        uint64_t u;
        Py_ssize_t n = ba.len / width;
        Py_BEGIN_ALLOW_THREADS
        if (is64)
            f64_run((const uint64_t *)ba.buf, (const uint64_t *)bb.buf, n, (int64_t *)bc.buf, f, i, &u);
        else
            f32_run((const uint32_t *)ba.buf, (const uint32_t *)bb.buf, n, (int64_t *)bc.buf, f, i, &u);
        Py_END_ALLOW_THREADS
        res = Py_BuildValue("(dLLdddKLLL)", f[0], (long long)i[0], (long long)i[1], f[1], f[2],
                            f[3], (unsigned long long)u, (long long)i[3], (long long)i[4],
                            (long long)i[5]);
    }
    PyBuffer_Release(&ba);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&bc);
    return res;
}

/* same(a, b): True when two read-only buffers hold the same bytes (memcmp, without the
 * interpreter lock) */
static PyObject *py_same(PyObject *self, PyObject *args) {
    Py_buffer ba, bb;
    if (!PyArg_ParseTuple(args, "y*y*", &ba, &bb)) return NULL;
    int equal = ba.len == bb.len;
    if (equal && ba.len) {
        Py_BEGIN_ALLOW_THREADS
        equal = memcmp(ba.buf, bb.buf, (size_t)ba.len) == 0;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&ba);
    PyBuffer_Release(&bb);
    return PyBool_FromLong(equal);
}

/* exit_on_sigbus(message): until restore_sigbus(), a SIGBUS (a memory-mapped file that
 * shrank under a read: the residual window of the "changed while reading" guards) writes
 * `message` to stderr and ends the process with exit status 2 instead of a crash. Only
 * async-signal-safe calls (write, _exit) run in the handler. */
#ifdef SIGBUS
static char sigbus_message[1024];
static size_t sigbus_length;
static struct sigaction sigbus_previous;
static int sigbus_installed;

static void on_sigbus(int sig) {
    (void)sig;
    if (sigbus_length) {
        ssize_t r = write(2, sigbus_message, sigbus_length);
        (void)r;
    }
    _exit(2);
}
#endif

static PyObject *py_exit_on_sigbus(PyObject *self, PyObject *args) {
    const char *text;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y#", &text, &n)) return NULL;
#ifdef SIGBUS
    if (n > (Py_ssize_t)sizeof(sigbus_message)) n = (Py_ssize_t)sizeof(sigbus_message);
    memcpy(sigbus_message, text, (size_t)n);
    sigbus_length = (size_t)n;
    if (!sigbus_installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_sigbus;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, &sigbus_previous) != 0) return PyErr_SetFromErrno(PyExc_OSError);
        sigbus_installed = 1;
    }
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *py_restore_sigbus(PyObject *self, PyObject *args) {
#ifdef SIGBUS
    if (sigbus_installed) {
        if (sigaction(SIGBUS, &sigbus_previous, NULL) != 0) return PyErr_SetFromErrno(PyExc_OSError);
        sigbus_installed = 0;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *py_f32(PyObject *self, PyObject *args) { return call(args, 4, 0); }
static PyObject *py_f64(PyObject *self, PyObject *args) { return call(args, 8, 1); }

/* topk(la, ia, lb, ib, kl_ab, kl_ba, overlap, n, ka, kb, fa, fb, wa, wb): the top-k
 * figures of n tokens in one pass per token (dmlib/stats/logprob_figures.py's topk_kl,
 * whose numpy path gives the same results up to the order of the float64 sums).
 * la [n, ka], lb [n, kb]: log-probs, C order, float32 (fa, fb = 4) or float64 (8);
 * ia [n, ka], ib [n, kb]: ids, int32 (wa, wb = 4) or int64 (8); kl_ab, kl_ba, overlap:
 * writable float64 [n]. Every length is checked against n, ka, kb and the widths.
 * An id a list holds twice counts once, with its first entry (a small hash table per
 * call, entries stamped with the token). Per token, over the ids both lists hold (A's
 * first entry x, B's first entry y, float64): ab = sum exp(x) (x - y) where exp(x) > 0,
 * ba = sum exp(y) (y - x) where exp(y) > 0, sa = sum exp(x), sb = sum exp(y); then with
 * rest = max(1 - s, 0) (NaN stays NaN) and bucket(p, q) = p (log p - log q) where p > 0
 * (else 0): kl_ab = ab + bucket(rest_a, rest_b), kl_ba = ba + bucket(rest_b, rest_a),
 * overlap = matched ids / max(1, min(ka, kb)). An optional last argument, true: the hash
 * table even where the AVX-512 comparisons would match (tests: both matchers checked).
 */
typedef struct {
    int64_t id;
    int64_t stamp;
    int32_t bcol;
    int32_t aseen;
} topk_slot;

static inline double load_f(const char *base, Py_ssize_t i, int width) {
    if (width == 4) {
        float v;
        memcpy(&v, base + i * 4, 4);
        return (double)v;
    }
    double v;
    memcpy(&v, base + i * 8, 8);
    return v;
}

static inline int64_t load_i(const char *base, Py_ssize_t i, int width) {
    if (width == 4) {
        int32_t v;
        memcpy(&v, base + i * 4, 4);
        return (int64_t)v;
    }
    int64_t v;
    memcpy(&v, base + i * 8, 8);
    return v;
}

static inline double topk_rest(double s) {
    double r = 1.0 - s;
    return r < 0.0 ? 0.0 : r; /* NaN stays NaN, as np.maximum */
}

static inline double topk_bucket(double p, double q) {
    return p > 0.0 ? p * (log(p) - log(q)) : 0.0;
}

static inline topk_slot *topk_find(topk_slot *table, uint64_t mask, int64_t id, int64_t t) {
    uint64_t h = (uint64_t)id ^ ((uint64_t)id >> 17); /* few collisions: the table is large */
    for (;;) {
        topk_slot *e = &table[h & mask];
        if (e->stamp != t || e->id == id) return e;
        h++;
    }
}

/* exp of every value of v[0..m) into e: 2^n p(r), x = n ln 2 + r, |r| <= ln2 / 2, p the
 * Taylor polynomial of degree 13 (its remainder below 1e-17 relative: the result within
 * about 2 ulp of exp), as one loop without branches (vectorised, in the widest vectors
 * the machine has where the compiler makes clones); values outside [-708, 709] (and NaN)
 * take the C library's exp afterwards. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TOPK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TOPK_CLONES
#endif

TOPK_CLONES static void topk_exp(const double *v, double *e, Py_ssize_t m) {
    const double shift = 6755399441055744.0; /* 1.5 * 2^52: adding it rounds to an integer */
    for (Py_ssize_t i = 0; i < m; i++) {
        double x = v[i];
        x = x < -708.0 ? -708.0 : x;
        x = x > 709.0 ? 709.0 : x;
        double t = x * 1.4426950408889634 + shift;
        double n = t - shift;
        double r = (x - n * 0.693145751953125) - n * 1.4286068203094173e-06;
        double p = 1.0 / 6227020800.0;
        p = p * r + 1.0 / 479001600.0;
        p = p * r + 1.0 / 39916800.0;
        p = p * r + 1.0 / 3628800.0;
        p = p * r + 1.0 / 362880.0;
        p = p * r + 1.0 / 40320.0;
        p = p * r + 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        uint64_t bits;
        memcpy(&bits, &t, 8);
        bits = (bits << 52) + ((uint64_t)1023 << 52);
        double scale;
        memcpy(&scale, &bits, 8);
        e[i] = p * scale;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (!(v[i] >= -708.0 && v[i] <= 709.0)) e[i] = exp(v[i]);
}

/* The tokens of one block: their matched pairs (A's first entry x, B's first entry y of
 * each id both hold, in A's order) into v (x, y, x, y, ...), their count into cnt. */
static void topk_match(const char *la, const char *ia, const char *lb, const char *ib,
                       Py_ssize_t t0, Py_ssize_t t1, Py_ssize_t ka, Py_ssize_t kb, int fa, int fb,
                       int wa, int wb, topk_slot *table, uint64_t mask, double *v, int32_t *cnt) {
    Py_ssize_t m = 0;
    for (Py_ssize_t t = t0; t < t1; t++) {
        const char *ta = ia + t * ka * wa, *tb = ib + t * kb * wb;
        for (Py_ssize_t j = 0; j < kb; j++) {
            int64_t id = load_i(tb, j, wb);
            topk_slot *e = topk_find(table, mask, id, t);
            if (e->stamp != t) {
                e->stamp = t;
                e->id = id;
                e->bcol = (int32_t)j;
                e->aseen = 0;
            }
        }
        const char *xa = la + t * ka * fa, *xb = lb + t * kb * fb;
        int32_t c = 0;
        for (Py_ssize_t i = 0; i < ka; i++) {
            int64_t id = load_i(ta, i, wa);
            topk_slot *e = topk_find(table, mask, id, t);
            if (e->stamp != t) { /* not in B: only its first A entry matters */
                e->stamp = t;
                e->id = id;
                e->bcol = -1;
                e->aseen = 1;
                continue;
            }
            if (e->aseen) continue;
            e->aseen = 1;
            if (e->bcol < 0) continue;
            v[2 * m] = load_f(xa, i, fa);
            v[2 * m + 1] = load_f(xb, e->bcol, fb);
            m++;
            c++;
        }
        cnt[t - t0] = c;
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define TOPK_AVX512 1
/* topk_match for lists of at most 64 ids on a machine with AVX-512: an id's entries in B
 * and A's entries before it as bit masks of 8-wide comparisons, B's first entry the
 * lowest bit (the same pairs as topk_match's table). */
__attribute__((target("avx512f"))) static void topk_match_512(
    const char *la, const char *ia, const char *lb, const char *ib, Py_ssize_t t0, Py_ssize_t t1,
    Py_ssize_t ka, Py_ssize_t kb, int fa, int fb, int wa, int wb, double *v, int32_t *cnt) {
    int64_t a[64], b[64];
    __m512i va[8], vb[8];
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    int na = (int)((ka + 7) / 8), nb = (int)((kb + 7) / 8);
    uint64_t bmask = kb == 64 ? ~(uint64_t)0 : ((uint64_t)1 << kb) - 1;
    Py_ssize_t m = 0;
    for (Py_ssize_t t = t0; t < t1; t++) {
        const char *ta = ia + t * ka * wa, *tb = ib + t * kb * wb;
        for (Py_ssize_t i = 0; i < ka; i++) a[i] = load_i(ta, i, wa);
        for (Py_ssize_t j = 0; j < kb; j++) b[j] = load_i(tb, j, wb);
        for (int q = 0; q < na; q++) va[q] = _mm512_loadu_si512((const void *)(a + 8 * q));
        for (int q = 0; q < nb; q++) vb[q] = _mm512_loadu_si512((const void *)(b + 8 * q));
        const char *xa = la + t * ka * fa, *xb = lb + t * kb * fb;
        int32_t c = 0;
        for (Py_ssize_t i = 0; i < ka; i++) {
            __m512i x = _mm512_set1_epi64(a[i]);
            uint64_t mb = 0, ma = 0;
            for (int q = 0; q < nb; q++)
                mb |= (uint64_t)_mm512_cmpeq_epi64_mask(vb[q], x) << (8 * q);
            mb &= bmask;
            if (!mb) continue;
            for (int q = 0; q < (int)((i + 7) / 8); q++)
                ma |= (uint64_t)_mm512_cmpeq_epi64_mask(va[q], x) << (8 * q);
            if (ma & (((uint64_t)1 << i) - 1)) continue; /* not A's first entry of the id */
            v[2 * m] = load_f(xa, i, fa);
            v[2 * m + 1] = load_f(xb, __builtin_ctzll(mb), fb);
            m++;
            c++;
        }
        cnt[t - t0] = c;
    }
}

/* topk_match_512 for int32 ids in both lists: 16-wide comparisons on the ids as stored
 * (masked loads: lanes past a list's end are neither read nor matched), no 64-bit copy
 * of the lists; the same pairs. */
static inline __mmask16 topk_lanes(Py_ssize_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)(((uint32_t)1 << left) - 1);
}

__attribute__((target("avx512f"))) static void topk_match_512_i32(
    const char *la, const char *ia, const char *lb, const char *ib, Py_ssize_t t0, Py_ssize_t t1,
    Py_ssize_t ka, Py_ssize_t kb, int fa, int fb, double *v, int32_t *cnt) {
    __m512i va[4], vb[4];
    int na = (int)((ka + 15) / 16), nb = (int)((kb + 15) / 16);
    Py_ssize_t m = 0;
    for (Py_ssize_t t = t0; t < t1; t++) {
        const char *ta = ia + t * ka * 4, *tb = ib + t * kb * 4;
        for (int q = 0; q < na; q++)
            va[q] = _mm512_maskz_loadu_epi32(topk_lanes(ka - 16 * q), ta + 64 * q);
        for (int q = 0; q < nb; q++)
            vb[q] = _mm512_maskz_loadu_epi32(topk_lanes(kb - 16 * q), tb + 64 * q);
        const char *xa = la + t * ka * fa, *xb = lb + t * kb * fb;
        int32_t c = 0;
        for (Py_ssize_t i = 0; i < ka; i++) {
            int32_t id;
            memcpy(&id, ta + 4 * i, 4);
            __m512i x = _mm512_set1_epi32(id);
            uint64_t mb = 0, ma = 0;
            for (int q = 0; q < nb; q++)
                mb |= (uint64_t)_mm512_mask_cmpeq_epi32_mask(topk_lanes(kb - 16 * q), vb[q], x)
                      << (16 * q);
            if (!mb) continue;
            for (int q = 0; q < (int)((i + 15) / 16); q++)
                ma |= (uint64_t)_mm512_cmpeq_epi32_mask(va[q], x) << (16 * q);
            if (ma & (((uint64_t)1 << i) - 1)) continue; /* not A's first entry of the id */
            v[2 * m] = load_f(xa, i, fa);
            v[2 * m + 1] = load_f(xb, __builtin_ctzll(mb), fb);
            m++;
            c++;
        }
        cnt[t - t0] = c;
    }
}
#endif

static void topk_run(const char *la, const char *ia, const char *lb, const char *ib, double *o_ab,
                     double *o_ba, double *o_ov, Py_ssize_t n, Py_ssize_t ka, Py_ssize_t kb, int fa,
                     int fb, int wa, int wb, topk_slot *table, uint64_t mask, Py_ssize_t block,
                     double *v, double *ev, int32_t *cnt, int table_only) {
    double k = (double)(ka < kb ? ka : kb);
    if (k < 1.0) k = 1.0;
    for (Py_ssize_t t0 = 0; t0 < n; t0 += block) {
        Py_ssize_t t1 = t0 + block < n ? t0 + block : n, m = 0;
#ifdef TOPK_AVX512
        if (ka <= 64 && kb <= 64 && !table_only && __builtin_cpu_supports("avx512f")) {
            if (wa == 4 && wb == 4)
                topk_match_512_i32(la, ia, lb, ib, t0, t1, ka, kb, fa, fb, v, cnt);
            else
                topk_match_512(la, ia, lb, ib, t0, t1, ka, kb, fa, fb, wa, wb, v, cnt);
        } else
#endif
            topk_match(la, ia, lb, ib, t0, t1, ka, kb, fa, fb, wa, wb, table, mask, v, cnt);
        for (Py_ssize_t t = t0; t < t1; t++) m += cnt[t - t0];
        topk_exp(v, ev, 2 * m);
        /* the terms summed as they are made (the sums' four chains of additions take the
         * time; the products and tests beside them cost nothing more): exp x, exp y,
         * exp(x) (x - y) (0 where exp x is not > 0), exp(y) (y - x) (0 where exp y is not
         * > 0), in the pairs' order */
        const double *pv = v, *pe = ev;
        for (Py_ssize_t t = t0; t < t1; t++) {
            double ab = 0.0, ba = 0.0, sa = 0.0, sb = 0.0;
            int32_t c = cnt[t - t0];
            for (int32_t j = 0; j < c; j++, pv += 2, pe += 2) {
                double pa = pe[0], pb = pe[1], d = pv[0] - pv[1];
                sa += pa;
                sb += pb;
                ab += pa > 0.0 ? pa * d : 0.0;
                ba += pb > 0.0 ? -(pb * d) : 0.0;
            }
            double ra = topk_rest(sa), rb = topk_rest(sb);
            o_ab[t] = ab + topk_bucket(ra, rb);
            o_ba[t] = ba + topk_bucket(rb, ra);
            o_ov[t] = (double)c / k;
        }
    }
}

static PyObject *py_topk(PyObject *self, PyObject *args) {
    Py_buffer b[7];
    Py_ssize_t n, ka, kb;
    int fa, fb, wa, wb, table_only = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*w*w*nnniiii|p", &b[0], &b[1], &b[2], &b[3], &b[4],
                          &b[5], &b[6], &n, &ka, &kb, &fa, &fb, &wa, &wb, &table_only))
        return NULL;
    PyObject *res = NULL;
    int ok = n >= 0 && ka > 0 && kb > 0 && ka < (1 << 30) && kb < (1 << 30) &&
             (fa == 4 || fa == 8) && (fb == 4 || fb == 8) && (wa == 4 || wa == 8) &&
             (wb == 4 || wb == 8) && n <= PY_SSIZE_T_MAX / 8 / (ka > kb ? ka : kb);
    if (ok)
        ok = b[0].len == n * ka * fa && b[1].len == n * ka * wa && b[2].len == n * kb * fb &&
             b[3].len == n * kb * wb && b[4].len == n * 8 && b[5].len == n * 8 &&
             b[6].len == n * 8;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "topk: buffers that do not match n, ka, kb and widths");
    } else {
        uint64_t size = 16;
        while (size < 4 * (uint64_t)(ka + kb)) size <<= 1;
        Py_ssize_t block = 8192 / ka > 1 ? 8192 / ka : 1; /* tokens per block */
        size_t pairs = (size_t)block * (size_t)ka;     /* at most ka pairs per token */
        topk_slot *table = PyMem_RawMalloc(size * sizeof(topk_slot));
        double *v = PyMem_RawMalloc(2 * pairs * sizeof(double));
        double *ev = PyMem_RawMalloc(2 * pairs * sizeof(double));
        int32_t *cnt = PyMem_RawMalloc((size_t)block * sizeof(int32_t));
        if (table == NULL || v == NULL || ev == NULL || cnt == NULL) {
            PyErr_NoMemory();
        } else {
            for (uint64_t i = 0; i < size; i++) table[i].stamp = -1;
            Py_BEGIN_ALLOW_THREADS
            topk_run(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[5].buf, b[6].buf, n, ka,
                     kb, fa, fb, wa, wb, table, size - 1, block, v, ev, cnt, table_only);
            Py_END_ALLOW_THREADS
            res = Py_None;
            Py_INCREF(res);
        }
        PyMem_RawFree(table);
        PyMem_RawFree(v);
        PyMem_RawFree(ev);
        PyMem_RawFree(cnt);
    }
    for (int i = 0; i < 7; i++) PyBuffer_Release(&b[i]);
    return res;
}

static PyMethodDef methods[] = {
    {"same", py_same, METH_VARARGS, "True when two buffers hold the same bytes (memcmp)"},
    {"f32", py_f32, METH_VARARGS, "statistics of a float32 chunk pair (see the source)"},
    {"f64", py_f64, METH_VARARGS, "statistics of a float64 chunk pair (see the source)"},
    {"exit_on_sigbus", py_exit_on_sigbus, METH_VARARGS,
     "on SIGBUS, write the message to stderr and exit with status 2"},
    {"restore_sigbus", py_restore_sigbus, METH_NOARGS, "restore the SIGBUS handling before"},
    {"topk", py_topk, METH_VARARGS, "the top-k KL both ways and overlap per token (see the source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) {
    return PyModule_Create(&module);
}
