/* The capture's compiled loops (dmlib.localize.capture): the hot paths of recording a
 * forward pass, apart from the comparison's kernels (dmlib/kernels/_fused.c).
 *
 * Optional: setup.py builds it as dmlib.localize.capture._capture where a C compiler is;
 * without it (or with DMLIB_KERNELS=numpy) the capture takes its Python loops, which give
 * the same digests (tests/test_localize_treehash.py, tests/test_localize_capture_fastpath.py).
 *
 * - gather(src, dst): a strided array copied into C order;
 * - request_blocks / hash_boundary: every host digest of a boundary (whole, per index of
 *   axis 0, per request and block) in one call; use_xxh3: XXH3-128 called directly.
 * (The manifest's JSON, once written here too, is orjson's: as fast, see jsonenc.py.)
 *
 * Callers are library users too: a hasher is Python code run in the middle of these
 * loops. Whatever it does (changes the span list, keeps the memoryview it was handed),
 * the module reads only memory it holds a reference to
 * (tests/test_localize_capture_hostile.py; `make asan` runs them under AddressSanitizer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

/* Measured (benchmarks/bench_capture_json.py, 21 alternating runs, a tiny Llama's ops
 * capture on one layer, batch 5 x 80): the capture's cost over the plain forward 35.4 ms with
 * XXH3 called directly, 40.5 ms (+14%) with one Python call of xxh3_128_digest per digest;
 * the direct call is kept for that. (On a hidden-512 capture, with fewer and larger blocks,
 * the difference is within the run-to-run noise.)
 *
 * use_xxh3(path, hasher): take XXH3_128bits from the shared library at `path` (the xxhash
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

static PyMethodDef methods[] = {
    {"gather", py_gather, METH_VARARGS, "copy a strided array into a C-contiguous buffer"},
    {"request_blocks", py_request_blocks, METH_VARARGS,
     "tree digests of requests on consecutive rows (see the source)"},
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
