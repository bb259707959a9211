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

static PyMethodDef methods[] = {
    {"same", py_same, METH_VARARGS, "True when two buffers hold the same bytes (memcmp)"},
    {"f32", py_f32, METH_VARARGS, "statistics of a float32 chunk pair (see the source)"},
    {"f64", py_f64, METH_VARARGS, "statistics of a float64 chunk pair (see the source)"},
    {"exit_on_sigbus", py_exit_on_sigbus, METH_VARARGS,
     "on SIGBUS, write the message to stderr and exit with status 2"},
    {"restore_sigbus", py_restore_sigbus, METH_NOARGS, "restore the SIGBUS handling before"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) {
    return PyModule_Create(&module);
}
