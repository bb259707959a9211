/* The capture's compiled loops (dmlib.localize.capture): the hot paths of recording a
 * forward pass, apart from the comparison's kernels (dmlib/kernels/_fused.c).
 *
 * Optional: setup.py builds it as dmlib.localize.capture._capture where a C compiler is;
 * without it (or with DMLIB_KERNELS=numpy) the capture takes its Python loops, which give
 * the same digests and the same manifest text (tests/test_localize_treehash.py,
 * tests/test_localize_capture_fastpath.py, tests/test_kernels_jsonenc.py).
 *
 * - gather(src, dst): a strided array copied into C order;
 * - request_blocks / hash_boundary: every host digest of a boundary (whole, per index of
 *   axis 0, per request and block) in one call; use_xxh3: XXH3-128 called directly;
 * - encode_json / encode_json_lines: the manifest's JSON text.
 *
 * Callers are library users too: a hasher is Python code run in the middle of these
 * loops. Whatever it does (changes the span list, keeps the memoryview it was handed),
 * the module reads only memory it holds a reference to
 * (tests/test_localize_capture_hostile.py; `make asan` runs them under AddressSanitizer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifndef _WIN32
#include <dlfcn.h>
#endif

/* gather(src, dst): copy the array src (any strides, as numpy exports them) into dst, a
 * C-contiguous writable buffer of as many bytes, in src's C order: what
 * numpy.ascontiguousarray does, at memory speed for the small tensors a capture reads
 * (numpy and torch spend ~10 us on the strided copy of a 25 KB attention tensor). Dims
 * whose strides chain are merged; the innermost is one memcpy where its items are
 * adjacent, else a loop over items of 1, 2, 4 or 8 bytes. Returns None. */
#define GATHER_MAX_DIMS 16
static PyObject *py_gather(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj;
    if (!PyArg_ParseTuple(args, "OO", &src_obj, &dst_obj)) return NULL;
    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES) < 0) return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t isz = src.itemsize, nd = 0;
    Py_ssize_t shape[GATHER_MAX_DIMS], strides[GATHER_MAX_DIMS];
    if (src.len != dst.len || src.ndim > GATHER_MAX_DIMS || isz <= 0) {
        PyErr_SetString(PyExc_ValueError, "gather: the buffers differ in size (or over 16 dims)");
        goto done;
    }
    if (!src.len) goto ok;
    /* drop dims of size 1, then merge a dim into the one inside it where it steps over it */
    for (int i = 0; i < src.ndim; i++) {
        if (src.shape[i] == 1) continue;
        if (nd && strides[nd - 1] == src.strides[i] * src.shape[i]) {
            strides[nd - 1] = src.strides[i];
            shape[nd - 1] *= src.shape[i];
        } else {
            shape[nd] = src.shape[i];
            strides[nd] = src.strides[i];
            nd++;
        }
    }
    if (!nd) { /* one item */
        memcpy(dst.buf, src.buf, (size_t)isz);
        goto ok;
    }
    {
        Py_ssize_t n = shape[nd - 1], st = strides[nd - 1], run = n * isz;
        Py_ssize_t idx[GATHER_MAX_DIMS] = {0};
        const char *base = (const char *)src.buf;
        char *out = (char *)dst.buf, *end = out + dst.len;
        if (st != isz && isz != 1 && isz != 2 && isz != 4 && isz != 8) {
            PyErr_SetString(PyExc_ValueError, "gather: strided items of an odd size");
            goto done;
        }
        /* the dim outside the innermost stepped by pointer, the rest by an odometer */
        Py_ssize_t m = nd >= 2 ? shape[nd - 2] : 1, mst = nd >= 2 ? strides[nd - 2] : 0;
        int outer = nd >= 2 ? (int)nd - 2 : 0;
        Py_BEGIN_ALLOW_THREADS
        while (out < end) {
            Py_ssize_t off = 0;
            for (int d = 0; d < outer; d++) off += idx[d] * strides[d];
            const char *p = base + off;
            for (Py_ssize_t k = 0; k < m; k++, p += mst, out += run) {
                if (st == isz) {
                    switch (run) { /* fixed sizes inline: a head's row is most often one */
                    case 32: memcpy(out, p, 32); break;
                    case 64: memcpy(out, p, 64); break;
                    case 128: memcpy(out, p, 128); break;
                    case 256: memcpy(out, p, 256); break;
                    default: memcpy(out, p, (size_t)run);
                    }
                } else if (isz == 4) {
                    for (Py_ssize_t j = 0; j < n; j++) memcpy(out + 4 * j, p + j * st, 4);
                } else if (isz == 8) {
                    for (Py_ssize_t j = 0; j < n; j++) memcpy(out + 8 * j, p + j * st, 8);
                } else if (isz == 2) {
                    for (Py_ssize_t j = 0; j < n; j++) memcpy(out + 2 * j, p + j * st, 2);
                } else {
                    for (Py_ssize_t j = 0; j < n; j++) out[j] = p[j * st];
                }
            }
            for (int d = outer - 1; d >= 0; d--) { /* the next index, last dim fastest */
                if (++idx[d] < shape[d]) break;
                idx[d] = 0;
            }
        }
        Py_END_ALLOW_THREADS
    }
ok:
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* request_blocks(hasher, buf, row_bytes, spans, block_rows, tag, piece, digest_size): the
 * tree digests (blake3-tree-v1, xxh3-128-tree-v1) of requests on consecutive rows of one
 * contiguous buffer, the loop of dmlib.localize.capture.Recorder._request_digests without
 * the interpreter (per block, a slice, a hash object and a hex string cost more than
 * hashing a few KiB). hasher: called on a read-only memoryview of each block, it returns
 * the digest as bytes (xxhash.xxh3_128_digest) or an object whose digest() does (the
 * blake3 constructor); every digest is digest_size bytes (1 to 64). spans: a sequence of
 * (first row, rows); tag: the tree's domain tag. Per span: (digest, [block digests]) as
 * hex, a block being `block_rows` rows (the last one shorter), the digest the one
 * block's, or with several the hasher's digest of tag, (rows, block_rows) as
 * little-endian u64 and the blocks' raw digests. None when a block is over `piece` bytes
 * (the caller's piece logic applies). A span outside the buffer: ValueError. */
static PyObject *digest_name;

static int put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
    return 8;
}

static PyObject *hex_of(const unsigned char *d, Py_ssize_t n) {
    static const char digits[] = "0123456789abcdef";
    PyObject *out = PyUnicode_New(2 * n, 127);
    if (!out) return NULL;
    Py_UCS1 *o = PyUnicode_1BYTE_DATA(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        o[2 * i] = (Py_UCS1)digits[d[i] >> 4];
        o[2 * i + 1] = (Py_UCS1)digits[d[i] & 15];
    }
    return out;
}

/* XXH3-128 called where the xxhash package's compiled module defines it (its exported
 * XXH3_128bits), without a Python call per digest: set by use_xxh3(), which checks it
 * against the package's own xxh3_128_digest before it is used. `direct_for` is that
 * Python function: digest_of() takes the direct path only for it. */
typedef struct {
    uint64_t low64, high64;
} xxh128_t;
typedef xxh128_t (*xxh3_128_fn)(const void *, size_t);
static xxh3_128_fn direct128 = NULL;
static PyObject *direct_for = NULL;

static void canonical128(xxh128_t h, unsigned char *out) { /* big-endian high, then low */
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
}

/* Where the bytes a hasher reads come from. A memoryview handed to a Python hasher must
 * not outlive its memory (a hasher may keep it): with `obj` (the exporter of the caller's
 * buffer, whose bytes start at `base`) each block is a slice of one memoryview over `obj`,
 * made at the first call, which keeps the exporter's buffer alive as long as any slice
 * lives; without (memory of this call's own), the hasher gets a bytes copy it owns. */
typedef struct {
    PyObject *obj;
    const char *base;
    PyObject *view; /* memoryview over obj cast to bytes, made when first needed */
} src_t;

static PyObject *view_of(src_t *s, const char *p, Py_ssize_t n) {
    if (!s || !s->obj) return PyBytes_FromStringAndSize(p, n);
    if (!s->view) {
        PyObject *mv = PyMemoryView_FromObject(s->obj);
        if (!mv) return NULL;
        s->view = PyObject_CallMethod(mv, "cast", "s", "B");
        Py_DECREF(mv);
        if (!s->view) return NULL;
    }
    Py_ssize_t at = (Py_ssize_t)(p - s->base);
    if (at < 0 || n < 0 || at > PyMemoryView_GET_BUFFER(s->view)->len - n) {
        PyErr_SetString(PyExc_ValueError, "a block outside its buffer");
        return NULL;
    }
    PyObject *lo = PyLong_FromSsize_t(at), *hi = PyLong_FromSsize_t(at + n);
    PyObject *sl = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    if (!sl) return NULL;
    PyObject *out = PyObject_GetItem(s->view, sl);
    Py_DECREF(sl);
    return out;
}

/* the `size`-byte digest of `n` bytes at `p` (inside `src`'s buffer, or with src NULL
 * memory of the caller's own), into `out`; -1 with an exception set */
static int digest_of(PyObject *hasher, src_t *src, const char *p, Py_ssize_t n,
                     unsigned char *out, Py_ssize_t size) {
    if (direct128 && hasher == direct_for && size == 16) {
        /* read once, under the lock: use_xxh3 may change it while the lock is released */
        xxh3_128_fn fn = direct128;
        xxh128_t h;
        if (n >= (1 << 20)) { /* a long read: other threads run meanwhile (the caller holds
                                 the buffer, so its memory stays) */
            Py_BEGIN_ALLOW_THREADS
            h = fn(p, (size_t)n);
            Py_END_ALLOW_THREADS
        } else {
            h = fn(p, (size_t)n);
        }
        canonical128(h, out);
        return 0;
    }
    PyObject *mv = view_of(src, p, n);
    if (!mv) return -1;
    PyObject *h = PyObject_CallOneArg(hasher, mv);
    Py_DECREF(mv);
    if (!h) return -1;
    PyObject *d = h;
    if (!PyBytes_Check(h)) {  /* a hash object: its digest() */
        d = PyObject_CallMethodNoArgs(h, digest_name);
        Py_DECREF(h);
        if (!d) return -1;
    }
    if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) != size) {
        Py_DECREF(d);
        PyErr_Format(PyExc_ValueError, "the hasher's digest is not %zd bytes", size);
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(d), (size_t)size);
    Py_DECREF(d);
    return 0;
}

static PyObject *one_span(PyObject *hasher, src_t *src, Py_ssize_t start, Py_ssize_t rows,
                          Py_ssize_t row_bytes, Py_ssize_t block_rows, const char *tag,
                          Py_ssize_t tag_len, Py_ssize_t size) {
    Py_ssize_t n_blocks = rows ? (rows + block_rows - 1) / block_rows : 0;
    Py_ssize_t head = tag_len + 16;
    unsigned char *all = PyMem_Malloc((size_t)(head + size * (n_blocks ? n_blocks : 1)));
    PyObject *blocks = PyList_New(n_blocks), *digest = NULL, *res = NULL;
    if (!all || !blocks) goto done;
    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        Py_ssize_t r0 = i * block_rows, r1 = r0 + block_rows < rows ? r0 + block_rows : rows;
        unsigned char *d = all + head + size * i;
        if (digest_of(hasher, src, src->base + (start + r0) * row_bytes, (r1 - r0) * row_bytes,
                      d, size) < 0)
            goto done;
        PyObject *hx = hex_of(d, size);
        if (!hx) goto done;
        PyList_SET_ITEM(blocks, i, hx);
    }
    if (n_blocks == 1) {
        digest = PyList_GET_ITEM(blocks, 0);
        Py_INCREF(digest);
    } else {
        unsigned char d[64];
        memcpy(all, tag, (size_t)tag_len);
        put_u64(all + tag_len, (uint64_t)rows);
        put_u64(all + tag_len + 8, (uint64_t)block_rows);
        if (digest_of(hasher, NULL, (const char *)all, head + size * n_blocks, d, size) < 0)
            goto done;
        digest = hex_of(d, size);
        if (!digest) goto done;
    }
    res = PyTuple_Pack(2, digest, blocks);
done:
    Py_XDECREF(digest);
    Py_XDECREF(blocks);
    PyMem_Free(all);
    if (!all && !PyErr_Occurred()) PyErr_NoMemory();
    return res;
}

static PyObject *py_request_blocks(PyObject *self, PyObject *args) {
    PyObject *hasher, *spans;
    Py_buffer buf;
    Py_ssize_t row_bytes, block_rows, piece, tag_len, size;
    const char *tag;
    if (!PyArg_ParseTuple(args, "Oy*nOny#nn", &hasher, &buf, &row_bytes, &spans, &block_rows,
                          &tag, &tag_len, &piece, &size))
        return NULL;
    PyObject *seq = NULL, *out = NULL;
    src_t src = {buf.obj, (const char *)buf.buf, NULL};
    if (row_bytes < 1 || block_rows < 1 || block_rows > PY_SSIZE_T_MAX / row_bytes) {
        PyErr_SetString(PyExc_ValueError, "row_bytes and block_rows must be positive");
        goto done;
    }
    if (size < 1 || size > 64 || tag_len > 1024) {
        PyErr_SetString(PyExc_ValueError, "digest_size must be 1 to 64 bytes, the tag at most 1 KiB");
        goto done;
    }
    if (block_rows * row_bytes > piece) {  /* a block over one piece: the caller's logic */
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    /* a copy: the hasher runs Python code, which may change the caller's list meanwhile */
    seq = PySequence_Tuple(spans);
    if (!seq) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(seq), total = buf.len / row_bytes;
    out = PyList_New(n);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t start, rows;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "nn", &start, &rows)) {
            Py_CLEAR(out);
            goto done;
        }
        if (start < 0 || rows < 0 || start > total || rows > total - start) {
            PyErr_Format(PyExc_ValueError, "span (%zd, %zd) outside the buffer's %zd rows", start,
                         rows, total);
            Py_CLEAR(out);
            goto done;
        }
        PyObject *r = one_span(hasher, &src, start, rows, row_bytes, block_rows, tag, tag_len,
                               size);
        if (!r) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, r);
    }
done:
    Py_XDECREF(seq);
    Py_XDECREF(src.view);
    PyBuffer_Release(&buf);
    return out;
}

/* hash_boundary(hasher, whole, n_lead, rows, row_bytes, spans, block_rows, tag, piece,
 * digest_size): every host digest of one capture boundary in one call (the hot path of
 * dmlib.localize.capture.Recorder, once per recorded tensor). whole: the tensor's bytes
 * in C order; n_lead >= 0: also the digest of each of n_lead equal slices of whole (the
 * per-index digests of axis 0), -1: none; rows: the buffer the requests' rows are read
 * from (whole itself, or the tensor with its batch and position axes moved first), or
 * None; spans: a sequence of (request id, first row, rows), each read as request_blocks
 * reads a span. Returns (whole digest, [slice digests] or None, {request id: {"digest",
 * "n_rows", "blocks"}} or None), every digest as hex; None where whole or a block is
 * over `piece` bytes (the caller's piece logic applies). */
static PyObject *key_digest, *key_n_rows, *key_blocks;

static PyObject *request_entry(PyObject *pair, Py_ssize_t rows) {
    /* {"digest": pair[0], "n_rows": rows, "blocks": pair[1]} from one_span's (digest, blocks) */
    PyObject *d = PyDict_New(), *n = PyLong_FromSsize_t(rows);
    if (!d || !n || PyDict_SetItem(d, key_digest, PyTuple_GET_ITEM(pair, 0)) < 0 ||
        PyDict_SetItem(d, key_n_rows, n) < 0 ||
        PyDict_SetItem(d, key_blocks, PyTuple_GET_ITEM(pair, 1)) < 0) {
        Py_XDECREF(d);
        Py_XDECREF(n);
        return NULL;
    }
    Py_DECREF(n);
    return d;
}

static PyObject *hash_requests(PyObject *hasher, src_t *src, Py_ssize_t len, Py_ssize_t row_bytes,
                               PyObject *spans, Py_ssize_t block_rows, const char *tag,
                               Py_ssize_t tag_len, Py_ssize_t size) {
    PyObject *seq = PySequence_Tuple(spans);  /* a copy: the hasher may change the list */
    if (!seq) return NULL;
    PyObject *out = PyDict_New();
    Py_ssize_t n = PyTuple_GET_SIZE(seq), total = len / row_bytes;
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *rid;
        Py_ssize_t start, count;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "Onn", &rid, &start, &count)) {
            Py_CLEAR(out);
            break;
        }
        if (start < 0 || count < 1 || start > total || count > total - start) {
            PyErr_Format(PyExc_ValueError, "span (%zd, %zd) outside the buffer's %zd rows", start,
                         count, total);
            Py_CLEAR(out);
            break;
        }
        PyObject *pair = one_span(hasher, src, start, count, row_bytes, block_rows, tag, tag_len,
                                  size);
        PyObject *entry = pair ? request_entry(pair, count) : NULL;
        Py_XDECREF(pair);
        if (!entry || PyDict_SetItem(out, rid, entry) < 0) Py_CLEAR(out);
        Py_XDECREF(entry);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *py_hash_boundary(PyObject *self, PyObject *args) {
    PyObject *hasher, *rows_obj, *spans;
    Py_buffer whole, rows = {0};
    Py_ssize_t n_lead, row_bytes, block_rows, piece, tag_len, size;
    const char *tag;
    if (!PyArg_ParseTuple(args, "Oy*nOnOny#nn", &hasher, &whole, &n_lead, &rows_obj, &row_bytes,
                          &spans, &block_rows, &tag, &tag_len, &piece, &size))
        return NULL;
    PyObject *digest = NULL, *lead = Py_None, *reqs = Py_None, *out = NULL;
    src_t wsrc = {whole.obj, (const char *)whole.buf, NULL};
    Py_INCREF(lead);
    Py_INCREF(reqs);
    int have_rows = rows_obj != Py_None;
    if (have_rows && PyObject_GetBuffer(rows_obj, &rows, PyBUF_SIMPLE) < 0) {
        have_rows = 0;
        goto done;
    }
    if (size < 1 || size > 64 || tag_len > 1024 || block_rows < 1 ||
        (have_rows && (row_bytes < 1 || block_rows > PY_SSIZE_T_MAX / row_bytes)) ||
        (n_lead > 0 && whole.len % n_lead)) {
        PyErr_SetString(PyExc_ValueError, "hash_boundary: inconsistent sizes");
        goto done;
    }
    if (whole.len > piece || (have_rows && block_rows * row_bytes > piece)) {
        out = Py_None;  /* over one piece: the caller's logic */
        Py_INCREF(out);
        goto done;
    }
    unsigned char d[64];
    if (digest_of(hasher, &wsrc, (const char *)whole.buf, whole.len, d, size) < 0) goto done;
    if (!(digest = hex_of(d, size))) goto done;
    if (n_lead >= 0) {
        Py_ssize_t rb = n_lead ? whole.len / n_lead : 0;
        Py_SETREF(lead, PyList_New(n_lead));
        if (!lead) goto done;
        for (Py_ssize_t i = 0; i < n_lead; i++) {
            PyObject *hx = NULL;
            if (digest_of(hasher, &wsrc, (const char *)whole.buf + i * rb, rb, d, size) < 0 ||
                !(hx = hex_of(d, size)))
                goto done;
            PyList_SET_ITEM(lead, i, hx);
        }
    }
    if (have_rows) {
        src_t rsrc = {rows.obj, (const char *)rows.buf, NULL};
        Py_SETREF(reqs, hash_requests(hasher, &rsrc, rows.len, row_bytes, spans, block_rows, tag,
                                      tag_len, size));
        Py_XDECREF(rsrc.view);
        if (!reqs) goto done;
    }
    out = PyTuple_Pack(3, digest, lead, reqs);
done:
    Py_XDECREF(digest);
    Py_XDECREF(lead);
    Py_XDECREF(reqs);
    if (have_rows) PyBuffer_Release(&rows);
    Py_XDECREF(wsrc.view);
    PyBuffer_Release(&whole);
    return out;
}

/* use_xxh3(path, hasher): take XXH3_128bits from the shared library at `path` (the xxhash
 * package's compiled module, already loaded) for digests asked of `hasher` (its
 * xxh3_128_digest). It is used only after its digests equal the hasher's on lengths 0 to
 * 300 and a few larger ones (every code path of XXH3-128). Returns True when in use; a
 * check that fails leaves the function registered before in use. */
static PyObject *py_use_xxh3(PyObject *self, PyObject *args) {
    const char *path;
    PyObject *hasher;
    if (!PyArg_ParseTuple(args, "sO", &path, &hasher)) return NULL;
    if (direct128 && hasher == direct_for) Py_RETURN_TRUE;
#ifdef _WIN32
    Py_RETURN_FALSE;
#else
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) Py_RETURN_FALSE;
    /* the runtime-dispatched entry (AVX2/AVX-512 where the CPU has them: 55 GB/s here, where
     * the plain one, built for any x86-64, gives 29 GB/s; measured) where the module has it */
    xxh3_128_fn fn = (xxh3_128_fn)dlsym(lib, "XXH3_128bits_dispatch");
    if (!fn) fn = (xxh3_128_fn)dlsym(lib, "XXH3_128bits");
    dlclose(lib); /* RTLD_NOLOAD: the module stays loaded while Python holds it */
    if (!fn) Py_RETURN_FALSE;
    static const Py_ssize_t lengths[] = {1000, 1024, 4096, 100003};
    /* each length is read at offsets 0 to 6 (unaligned starts): room for the longest there
     * (AddressSanitizer found the reads 6 bytes past a buffer of 100003) */
    const Py_ssize_t room = 100003 + 7;
    unsigned char *buf = PyMem_Malloc((size_t)room);
    if (!buf) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < room; i++) buf[i] = (unsigned char)(i * 2654435761u >> 13);
    int ok = 1;
    xxh3_128_fn before = direct128; /* the check calls the hasher itself, through Python */
    direct128 = NULL;
    for (Py_ssize_t k = 0; ok && k < 301 + 4; k++) {
        Py_ssize_t n = k < 301 ? k : lengths[k - 301];
        unsigned char want[16], got[16];
        if (digest_of(hasher, NULL, (const char *)buf + (k % 7), n, want, 16) < 0) {
            direct128 = before;
            PyMem_Free(buf);
            return NULL;
        }
        canonical128(fn(buf + (k % 7), (size_t)n), got);
        ok = memcmp(want, got, 16) == 0;
    }
    PyMem_Free(buf);
    if (!ok) { /* the registration before stays */
        direct128 = before;
        Py_RETURN_FALSE;
    }
    direct128 = fn;
    Py_INCREF(hasher);
    Py_XSETREF(direct_for, hasher);
    Py_RETURN_TRUE;
#endif
}

/* encode_json(obj): json.dumps(obj, separators=(",", ":")) (ASCII out, NaN and Infinity as
 * Python writes them) for plain data: dict with str keys, list, tuple, str, int, float, bool
 * and None, each of exactly that type, nested at most 64 deep; None for anything else (the
 * caller's json encoder then writes it). A capture's manifest is thousands of small dicts
 * of hex digests, where the json module's encoder spends its time on string fragments. */
typedef struct { /* a dict written before in this call: where its text lies in the buffer */
    PyObject *key;
    Py_ssize_t start, len;
} jmemo_slot;

typedef struct {
    char *p;
    Py_ssize_t n, cap;
    jmemo_slot *memo; /* encode_json_lines only: open addressing by address, or NULL */
    Py_ssize_t memo_cap, memo_used;
} jbuf;

static jmemo_slot *memo_find(jbuf *b, PyObject *key) { /* its slot, or the empty one it takes */
    size_t mask = (size_t)b->memo_cap - 1, i = (((uintptr_t)key >> 4) * 0x9E3779B97F4A7C15ULL) & mask;
    while (b->memo[i].key && b->memo[i].key != key) i = (i + 1) & mask;
    return &b->memo[i];
}

static void memo_add(jbuf *b, PyObject *key, Py_ssize_t start) { /* best effort: no room, no memo */
    if (2 * (b->memo_used + 1) > b->memo_cap) {
        Py_ssize_t cap = b->memo_cap ? 2 * b->memo_cap : 256;
        jmemo_slot *old = b->memo, *fresh = PyMem_Calloc((size_t)cap, sizeof *fresh);
        if (!fresh) return;
        Py_ssize_t old_cap = b->memo_cap;
        b->memo = fresh;
        b->memo_cap = cap;
        for (Py_ssize_t i = 0; i < old_cap; i++)
            if (old[i].key) *memo_find(b, old[i].key) = old[i];
        PyMem_Free(old);
    }
    jmemo_slot *slot = memo_find(b, key);
    slot->key = key;
    slot->start = start;
    slot->len = b->n - start;
    b->memo_used++;
}

static int jb_reserve(jbuf *b, Py_ssize_t n) { /* room for n more bytes */
    if (b->n + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        char *q = PyMem_Realloc(b->p, (size_t)cap);
        if (!q) {
            PyErr_NoMemory();
            return -1;
        }
        b->p = q;
        b->cap = cap;
    }
    return 0;
}

static int jb_put(jbuf *b, const char *s, Py_ssize_t n) {
    if (jb_reserve(b, n) < 0) return -1;
    memcpy(b->p + b->n, s, (size_t)n);
    b->n += n;
    return 0;
}

/* whether any of the 8 ASCII bytes in v is below ' ', '"', '\\' or DEL (ensure_ascii escapes
 * them); exact for bytes under 0x80 (an ASCII str has no others): a byte x has its high bit
 * set in (x - c) & ~x & 0x80 for c = 0x01 exactly when x == 0, and for c = 0x20 when x < 0x20 */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
static inline uint64_t zero8(uint64_t v) { return (v - ONES) & ~v & HIGHS; }
static inline int needs_escape8(uint64_t v) {
    uint64_t low = (v - ONES * 0x20) & ~v & HIGHS;
    return (low | zero8(v ^ (ONES * '"')) | zero8(v ^ (ONES * '\\')) | zero8(v ^ (ONES * 0x7f))) != 0;
}

static int jb_str(jbuf *b, PyObject *o) { /* a str, escaped as ensure_ascii does */
    static const char hex[] = "0123456789abcdef";
    Py_ssize_t len = PyUnicode_GET_LENGTH(o);
    int kind = PyUnicode_KIND(o);
    const void *data = PyUnicode_DATA(o);
    if (PyUnicode_IS_ASCII(o)) { /* most often nothing to escape (hex digests, names): one copy */
        const unsigned char *a = (const unsigned char *)data;
        Py_ssize_t i = 0;
        for (; i + 8 <= len; i += 8) { /* 8 bytes at a time: any that needs escaping? */
            uint64_t v;
            memcpy(&v, a + i, 8);
            if (needs_escape8(v)) break;
        }
        while (i < len && a[i] >= ' ' && a[i] <= '~' && a[i] != '\\' && a[i] != '"') i++;
        if (i == len) {
            if (jb_reserve(b, len + 2) < 0) return -1;
            b->p[b->n] = '"';
            memcpy(b->p + b->n + 1, a, (size_t)len);
            b->p[b->n + 1 + len] = '"';
            b->n += len + 2;
            return 0;
        }
    }
    if (jb_put(b, "\"", 1) < 0) return -1;
    for (Py_ssize_t i = 0; i < len; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        char e[12];
        Py_ssize_t k = 0;
        if (c >= ' ' && c <= '~' && c != '\\' && c != '"') {
            e[k++] = (char)c;
        } else if (c == '\\' || c == '"') {
            e[k++] = '\\';
            e[k++] = (char)c;
        } else if (c == '\b' || c == '\f' || c == '\n' || c == '\r' || c == '\t') {
            e[k++] = '\\';
            e[k++] = c == '\b' ? 'b' : c == '\f' ? 'f' : c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
        } else {
            Py_UCS4 units[2];
            int m = 0;
            if (c >= 0x10000) {
                Py_UCS4 v = c - 0x10000;
                units[m++] = 0xd800 | ((v >> 10) & 0x3ff);
                units[m++] = 0xdc00 | (v & 0x3ff);
            } else {
                units[m++] = c;
            }
            for (int j = 0; j < m; j++) {
                e[k++] = '\\';
                e[k++] = 'u';
                e[k++] = hex[(units[j] >> 12) & 15];
                e[k++] = hex[(units[j] >> 8) & 15];
                e[k++] = hex[(units[j] >> 4) & 15];
                e[k++] = hex[units[j] & 15];
            }
        }
        if (jb_put(b, e, k) < 0) return -1;
    }
    return jb_put(b, "\"", 1);
}

static int jb_text(jbuf *b, PyObject *text) { /* an ASCII str from repr() */
    if (!text) return -1;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    int r = s ? jb_put(b, s, n) : -1;
    Py_DECREF(text);
    return r;
}

/* 0: written; 1: not plain data (nothing to report); -1: an exception is set */
static int jb_value(jbuf *b, PyObject *o, int depth) {
    if (depth > 64) return 1;
    if (o == Py_None) return jb_put(b, "null", 4);
    if (o == Py_True) return jb_put(b, "true", 4);
    if (o == Py_False) return jb_put(b, "false", 5);
    if (PyUnicode_CheckExact(o)) return jb_str(b, o);
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) { /* over 64 bits: Python's digits */
            PyErr_Clear();
            return jb_text(b, PyLong_Type.tp_repr(o));
        }
        char d[24], *q = d + sizeof d; /* digits from the right (snprintf: 3x the time) */
        unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
        do {
            *--q = (char)('0' + u % 10);
            u /= 10;
        } while (u);
        if (v < 0) *--q = '-';
        return jb_put(b, q, d + sizeof d - q);
    }
    if (PyFloat_CheckExact(o)) {
        double d = PyFloat_AS_DOUBLE(o);
        if (Py_IS_NAN(d)) return jb_put(b, "NaN", 3);
        if (Py_IS_INFINITY(d)) return d > 0 ? jb_put(b, "Infinity", 8) : jb_put(b, "-Infinity", 9);
        return jb_text(b, PyFloat_Type.tp_repr(o));
    }
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o)) {
        PyObject *seq = o;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (jb_put(b, "[", 1) < 0) return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* a list may not change under us: every item is read by index, once */
            if (i && jb_put(b, ",", 1) < 0) return -1;
            if (i >= PySequence_Fast_GET_SIZE(seq)) return 1;
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            Py_INCREF(item);
            int r = jb_value(b, item, depth + 1);
            Py_DECREF(item);
            if (r) return r;
        }
        return jb_put(b, "]", 1);
    }
    if (PyDict_CheckExact(o)) {
        PyObject *key, *value;
        Py_ssize_t pos = 0, first = 1, start = b->n;
        /* a dict inside an item (a request's digests shared by several boundaries), written
         * before in this call: its text copied. Nothing can change it meanwhile (no Python
         * code runs here) and the items hold it alive, so its address names it. */
        int memo = b->memo_cap && depth >= 2 && PyDict_GET_SIZE(o) >= 2;
        if (memo) {
            jmemo_slot *slot = memo_find(b, o);
            if (slot->key) {
                if (jb_reserve(b, slot->len) < 0) return -1;
                memcpy(b->p + b->n, b->p + slot->start, (size_t)slot->len);
                b->n += slot->len;
                return 0;
            }
        }
        if (jb_put(b, "{", 1) < 0) return -1;
        while (PyDict_Next(o, &pos, &key, &value)) {
            if (!PyUnicode_CheckExact(key)) return 1;
            if (!first && jb_put(b, ",", 1) < 0) return -1;
            first = 0;
            Py_INCREF(key);
            Py_INCREF(value);
            int r = jb_str(b, key);
            if (!r) r = jb_put(b, ":", 1);
            if (!r) r = jb_value(b, value, depth + 1);
            Py_DECREF(key);
            Py_DECREF(value);
            if (r) return r;
        }
        if (jb_put(b, "}", 1) < 0) return -1;
        if (memo) memo_add(b, o, start);
        return 0;
    }
    return 1;
}

static PyObject *jb_result(jbuf *b, int r) {
    PyObject *out = NULL;
    if (r == 0) {
        out = PyUnicode_New(b->n, 127);
        if (out) memcpy(PyUnicode_1BYTE_DATA(out), b->p, (size_t)b->n);
    } else if (r == 1) {
        out = Py_None;
        Py_INCREF(out);
    }
    PyMem_Free(b->p);
    PyMem_Free(b->memo);
    return out;
}

/* encode_json_lines(list): the items of a list, each as encode_json writes it, joined by
 * ",\n" (a manifest's boundaries, one per line); None where an item is not plain data. A
 * dict met again inside the items (the same object) is written once and its text copied. */
static PyObject *py_encode_json_lines(PyObject *self, PyObject *obj) {
    if (!PyList_CheckExact(obj)) Py_RETURN_NONE;
    jbuf b = {NULL, 0, 0, NULL, 0, 0};
    b.memo = PyMem_Calloc(256, sizeof *b.memo);
    if (!b.memo) return PyErr_NoMemory();
    b.memo_cap = 256;
    int r = 0;
    for (Py_ssize_t i = 0; !r && i < PyList_GET_SIZE(obj); i++) {
        if (i) r = jb_put(&b, ",\n", 2);
        if (r) break;
        PyObject *item = PyList_GET_ITEM(obj, i);
        Py_INCREF(item);
        r = jb_value(&b, item, 1);
        Py_DECREF(item);
    }
    return jb_result(&b, r);
}

static PyObject *py_encode_json(PyObject *self, PyObject *obj) {
    jbuf b = {NULL, 0, 0, NULL, 0, 0};
    int r = jb_value(&b, obj, 0);
    return jb_result(&b, r);
}

static PyMethodDef methods[] = {
    {"gather", py_gather, METH_VARARGS, "copy a strided array into a C-contiguous buffer"},
    {"request_blocks", py_request_blocks, METH_VARARGS,
     "tree digests of requests on consecutive rows (see the source)"},
    {"encode_json", py_encode_json, METH_O,
     "json.dumps(obj, separators=(',', ':')) for plain data, else None (see the source)"},
    {"encode_json_lines", py_encode_json_lines, METH_O,
     "a list's items as encode_json writes them, joined by ',\\n' (see the source)"},
    {"use_xxh3", py_use_xxh3, METH_VARARGS,
     "call XXH3_128bits of the xxhash package's module directly (see the source)"},
    {"hash_boundary", py_hash_boundary, METH_VARARGS,
     "every host digest of one capture boundary (see the source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_capture", NULL, -1, methods};

PyMODINIT_FUNC PyInit__capture(void) {
    digest_name = PyUnicode_InternFromString("digest");
    key_digest = PyUnicode_InternFromString("digest");
    key_n_rows = PyUnicode_InternFromString("n_rows");
    key_blocks = PyUnicode_InternFromString("blocks");
    if (!digest_name || !key_digest || !key_n_rows || !key_blocks) return NULL;
    return PyModule_Create(&module);
}
