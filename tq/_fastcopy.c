/* Row copies for the TQ client and storage units, with the GIL released.
 *
 * copy_rows(dst, dst_starts, sources, src_idx, src_starts, sizes, row_span, pad)
 *   for every row i: memcpy(dst + dst_starts[i], sources[src_idx[i]] + src_starts[i], sizes[i]);
 *   when row_span > 0, the rest of the row up to row_span bytes is filled with the byte pattern `pad`.
 *   dst_starts None: the rows go back to back (row i at i * row_span, or packed when row_span is 0).
 * Every range is bounds-checked first (offsets may come from another process), so bad offsets raise
 * ValueError instead of touching memory they do not own. A pure-numpy fallback lives in tq/rowcopy.py.
 *
 * A destination of STREAM_BYTES or more is written with non-temporal (streaming) stores on x86-64,
 * of the widest vectors the CPU has (picked at import; set_stream_isa switches, for tests): a padded
 * batch of megabytes will not be read back from the cache before it is evicted, and plain stores
 * would first read every destination line (read-for-ownership) and evict what the caller's next
 * steps need. 1 MiB, the size of a core's L2 here: each field of an 8 MiB GRPO batch (0.8-6.3 MB
 * padded) streams; measured on the 2-vCPU VM, its padded get copies in 0.79 ms this way against
 * 1.0 ms with the 3.2 MB fields stored plainly.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define STREAM_BYTES ((Py_ssize_t)1 << 20)

static int get_i64(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void fill_pattern(char *p, Py_ssize_t n, const char *pat, Py_ssize_t plen) {
    if (n <= 0) return;
    int uniform = 1;
    for (Py_ssize_t k = 1; k < plen; k++) uniform &= (pat[k] == pat[0]);
    if (uniform) { memset(p, pat[0], (size_t)n); return; }
    Py_ssize_t done = plen < n ? plen : n;
    memcpy(p, pat, (size_t)done);
    while (done < n) {  /* doubling copies of what is already filled */
        Py_ssize_t step = done < n - done ? done : n - done;
        memcpy(p + done, p, (size_t)step);
        done += step;
    }
}

/* n bytes of the repeating pattern `pat` (plen bytes), starting `phase` bytes into it. */
static void fill_phase(char *p, size_t n, const char *pat, size_t plen, size_t phase) {
    for (size_t k = 0; k < n; k++) p[k] = pat[(phase + k) % plen];
}

#if HAVE_STREAM
/* Streaming copy and fill at vector width W, in 128-byte steps: the destination is aligned to W
 * first, so every store is a whole aligned vector; AVX-512's whole-cache-line stores fill the
 * write-combining buffers the fastest (measured: a padded 8 MiB batch 0.72-0.79 ms against
 * 1.16-1.52 ms with 16-byte stores on the same VM). */
#define DEFINE_STREAM(W, TARGET, VEC, LOAD, STORE)                                                      \
    TARGET static void stream_copy_##W(char *d, const char *s, size_t n) {                              \
        size_t head = (W - ((uintptr_t)d & (W - 1))) & (W - 1);                                         \
        if (head > n) head = n;                                                                         \
        memcpy(d, s, head);                                                                             \
        d += head; s += head; n -= head;                                                                \
        for (; n >= 128; n -= 128, d += 128, s += 128)                                                  \
            for (int j = 0; j < 128; j += W) STORE((void *)(d + j), LOAD((const void *)(s + j)));       \
        memcpy(d, s, n);                                                                                \
    }                                                                                                   \
    TARGET static void stream_fill_##W(char *p, size_t n, const char *pat, size_t plen) {               \
        if (W % plen != 0) { fill_phase(p, n, pat, plen, 0); return; }                                  \
        size_t head = (W - ((uintptr_t)p & (W - 1))) & (W - 1);                                         \
        if (head > n) head = n;                                                                         \
        fill_phase(p, head, pat, plen, 0);                                                              \
        char v[W];                                                                                      \
        fill_phase(v, W, pat, plen, head % plen);                                                       \
        VEC x = LOAD((const void *)v);                                                                  \
        size_t k = head;                                                                                \
        for (; k + 128 <= n; k += 128)                                                                  \
            for (int j = 0; j < 128; j += W) STORE((void *)(p + k + j), x);                             \
        fill_phase(p + k, n - k, pat, plen, k % plen);                                  \
    }

DEFINE_STREAM(16, , __m128i, _mm_loadu_si128, _mm_stream_si128)
#if defined(__GNUC__)
#include <immintrin.h>
#define HAVE_WIDE 1
DEFINE_STREAM(32, __attribute__((target("avx"))), __m256i, _mm256_loadu_si256, _mm256_stream_si256)
DEFINE_STREAM(64, __attribute__((target("avx512f"))), __m512i, _mm512_loadu_si512, _mm512_stream_si512)
#else
#define HAVE_WIDE 0
#endif

typedef void (*stream_copy_fn)(char *, const char *, size_t);
typedef void (*stream_fill_fn)(char *, size_t, const char *, size_t);
static const struct { const char *name; stream_copy_fn copy; stream_fill_fn fill; } ISAS[] = {
    {"sse2", stream_copy_16, stream_fill_16},
#if HAVE_WIDE
    {"avx", stream_copy_32, stream_fill_32},
    {"avx512f", stream_copy_64, stream_fill_64},
#endif
};
#define N_ISAS ((int)(sizeof(ISAS) / sizeof(ISAS[0])))
static int isa = 0;  /* the widest this CPU (and OS) supports, chosen at import */

static int isa_supported(int i) {
#if HAVE_WIDE
    __builtin_cpu_init();
    if (i == 1) return __builtin_cpu_supports("avx");
    if (i == 2) return __builtin_cpu_supports("avx512f");
#endif
    return i == 0;
}
#endif

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *dst_o, *dst_starts_o, *sources_o, *src_idx_o, *src_starts_o, *sizes_o;
    Py_ssize_t row_span;
    Py_buffer pad;
    if (!PyArg_ParseTuple(args, "OOOOOOny*", &dst_o, &dst_starts_o, &sources_o, &src_idx_o, &src_starts_o,
                          &sizes_o, &row_span, &pad))
        return NULL;
    PyObject *ret = NULL;
    Py_buffer dst = {0}, dst_starts = {0}, src_idx = {0}, src_starts = {0}, sizes = {0};
    Py_buffer *srcs = NULL;
    int64_t *own_starts = NULL;
    Py_ssize_t nsrc = 0, got_src = 0;
    PyObject *seq = PySequence_Fast(sources_o, "sources must be a sequence of buffers");
    if (!seq) goto done_pad;
    nsrc = PySequence_Fast_GET_SIZE(seq);
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_seq;
    if (dst_starts_o != Py_None && get_i64(dst_starts_o, &dst_starts, "dst_starts") < 0) goto done_dst;
    if (get_i64(src_idx_o, &src_idx, "src_idx") < 0) goto done_ds;
    if (get_i64(src_starts_o, &src_starts, "src_starts") < 0) goto done_si;
    if (get_i64(sizes_o, &sizes, "sizes") < 0) goto done_ss;
    Py_ssize_t n = sizes.len / 8;
    if (dst_starts_o == Py_None) {  /* back to back; overflow is caught by the bounds check below */
        if (!(own_starts = PyMem_Malloc((size_t)(n ? n : 1) * 8))) { PyErr_NoMemory(); goto done_sz; }
        const int64_t *z = sizes.buf;
        int64_t at = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            own_starts[i] = at;
            at += row_span > 0 ? row_span : (z[i] > 0 ? z[i] : 0);
        }
        dst_starts.buf = own_starts;
        dst_starts.len = n * 8;
    }
    if (dst_starts.len / 8 != n || src_idx.len / 8 != n || src_starts.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "dst_starts, src_idx, src_starts and sizes must have one length");
        goto done_sz;
    }
    if (row_span > 0 && pad.len < 1) {
        PyErr_SetString(PyExc_ValueError, "a pad pattern is needed when row_span > 0");
        goto done_sz;
    }
    srcs = PyMem_Calloc((size_t)(nsrc ? nsrc : 1), sizeof(Py_buffer));
    if (!srcs) { PyErr_NoMemory(); goto done_sz; }
    for (; got_src < nsrc; got_src++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got_src), &srcs[got_src], PyBUF_C_CONTIGUOUS) < 0) goto done_srcs;
    const int64_t *ds = dst_starts.buf, *si = src_idx.buf, *ss = src_starts.buf, *sz = sizes.buf;
    for (Py_ssize_t i = 0; i < n; i++) {  /* validate everything before copying anything */
        int64_t s = si[i];
        Py_ssize_t span = row_span > 0 ? row_span : sz[i];
        if (s < 0 || s >= nsrc || sz[i] < 0 || ss[i] < 0 || ds[i] < 0 || sz[i] > span ||
            ss[i] > srcs[s].len - sz[i] || ds[i] > dst.len - span) {
            PyErr_Format(PyExc_ValueError, "row %zd: copy out of bounds (source %lld, start %lld, size %lld)", i,
                         (long long)s, (long long)ss[i], (long long)sz[i]);
            goto done_srcs;
        }
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) total += row_span > 0 ? row_span : sz[i];
    Py_BEGIN_ALLOW_THREADS
    char *d = dst.buf;
#if HAVE_STREAM
    if (total >= STREAM_BYTES) {
        for (Py_ssize_t i = 0; i < n; i++) {
            ISAS[isa].copy(d + ds[i], (const char *)srcs[si[i]].buf + ss[i], (size_t)sz[i]);
            if (row_span > 0) ISAS[isa].fill(d + ds[i] + sz[i], (size_t)(row_span - sz[i]), pad.buf, (size_t)pad.len);
        }
        _mm_sfence();  /* streaming stores are weakly ordered: publish them before returning */
    } else
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(d + ds[i], (const char *)srcs[si[i]].buf + ss[i], (size_t)sz[i]);
        if (row_span > 0) fill_pattern(d + ds[i] + sz[i], row_span - sz[i], pad.buf, pad.len);
    }
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done_srcs:
    for (Py_ssize_t k = 0; k < got_src; k++) PyBuffer_Release(&srcs[k]);
    PyMem_Free(srcs);
done_sz:
    PyBuffer_Release(&sizes);
done_ss:
    PyBuffer_Release(&src_starts);
done_si:
    PyBuffer_Release(&src_idx);
done_ds:
    if (own_starts) PyMem_Free(own_starts);
    else if (dst_starts_o != Py_None) PyBuffer_Release(&dst_starts);
done_dst:
    PyBuffer_Release(&dst);
done_seq:
    Py_DECREF(seq);
done_pad:
    PyBuffer_Release(&pad);
    return ret;
}

/* ------------------------------------------------------------------ location tables
 * read_locations(table, cols, slots, incarnation, clears, units_version, out)
 *   A same-host reader's whole check-and-read of a partition's location table (tq/locations.py
 *   documents the protocol; the layout constants below mirror it and tq/locations.py asserts they
 *   match). Writes the offsets of the rows (cols x slots) to out[0:F*n] and their sizes to
 *   out[F*n:2*F*n] (int64) and returns (unit, frees, end, longest, totals): the one storage unit
 *   holding them, the frees count they were read under, the end of the furthest row, and per field
 *   its longest row and its bytes in all (tuples) - what a get needs to size its results.
 *   Returns None when the table cannot be trusted for them: retired, its controller's lease run out,
 *   another incarnation, clears count or units version, being written (seqlock), a slot or column
 *   out of range, a row not produced or on a down unit, or rows on several units. One C call, not a
 *   dozen numpy ones: it runs right after megabyte copies have evicted the interpreter's caches. */
enum { H_MAGIC, H_CAPACITY, H_COLUMNS, H_SEQ, H_FREES, H_INCARNATION, H_RETIRED, H_UNITS_VERSION,
       H_DOWN_UNITS, H_ALIVE_UNTIL, H_CLEARS, HEADER_WORDS = 16 };
enum { LOC_UNIT, LOC_BLOCK, LOC_ROW, LOC_NBYTES, LOC_OFFSET, LOC_COLUMNS };

static inline int64_t load_word(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static PyObject *read_locations(PyObject *self, PyObject *args) {
    Py_buffer table, out;
    PyObject *cols_o, *slots_o;
    long long incarnation, clears, units_version;
    if (!PyArg_ParseTuple(args, "y*OOLLLw*", &table, &cols_o, &slots_o, &incarnation, &clears, &units_version, &out))
        return NULL;
    PyObject *ret = NULL, *cols = NULL, *slots = NULL, *longest = NULL, *totals = NULL;
    int64_t *slot_at = NULL;  /* the slots as C ints, converted once for all fields */
    if (!(cols = PySequence_Fast(cols_o, "cols must be a sequence of ints"))) goto done;
    if (!(slots = PySequence_Fast(slots_o, "slots must be a sequence of ints"))) goto done;
    const int64_t *h = table.buf;
    Py_ssize_t F = PySequence_Fast_GET_SIZE(cols), n = PySequence_Fast_GET_SIZE(slots);
    if (table.len < HEADER_WORDS * 8) { PyErr_SetString(PyExc_ValueError, "not a location table"); goto done; }
    int64_t capacity = h[H_CAPACITY], ncols = h[H_COLUMNS];
    if (capacity < 0 || ncols < 0 || (ncols && capacity > (table.len / 8 - HEADER_WORDS) / LOC_COLUMNS / ncols)) {
        PyErr_SetString(PyExc_ValueError, "location table is truncated");
        goto done;
    }
    if (out.len < 2 * F * n * 8) { PyErr_SetString(PyExc_ValueError, "out holds fewer than 2 * cols * slots int64"); goto done; }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);  /* the clock of Python's time.monotonic_ns on Linux */
    int64_t seq = load_word(&h[H_SEQ]), frees = load_word(&h[H_FREES]);
    if ((seq & 1) || load_word(&h[H_RETIRED]) || load_word(&h[H_INCARNATION]) != incarnation ||
        load_word(&h[H_CLEARS]) != clears || load_word(&h[H_UNITS_VERSION]) != units_version ||
        (int64_t)now.tv_sec * 1000000000 + now.tv_nsec >= load_word(&h[H_ALIVE_UNTIL]))
        goto untrusted;
    int64_t down = load_word(&h[H_DOWN_UNITS]), unit = -1, end = 0;
    int64_t *offsets = out.buf, *sizes = offsets + F * n;
    const int64_t *locs = h + HEADER_WORDS;
    if (!(longest = PyTuple_New(F)) || !(totals = PyTuple_New(F))) goto done;
    if (!(slot_at = PyMem_Malloc((size_t)(n ? n : 1) * 8))) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long slot = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(slots, i));
        if (slot == -1 && PyErr_Occurred()) goto done;
        if (slot < 0 || slot >= capacity) goto untrusted;
        slot_at[i] = slot;
    }
    for (Py_ssize_t f = 0; f < F; f++) {
        int64_t most = 0, total = 0;
        long long c = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(cols, f));
        if (c == -1 && PyErr_Occurred()) goto done;
        if (c < 0 || c >= ncols) goto untrusted;
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t *rec = locs + (c * capacity + slot_at[i]) * LOC_COLUMNS;
            int64_t u = rec[LOC_UNIT], off = rec[LOC_OFFSET], nb = rec[LOC_NBYTES];
            if (u < 0 || (unit >= 0 && u != unit) || ((down >> (u < 62 ? u : 62)) & 1) || off < 0 || nb < 0)
                goto untrusted;  /* not produced, on another or a down unit, or torn */
            unit = u;
            offsets[f * n + i] = off;
            sizes[f * n + i] = nb;
            if (off + nb > end) end = off + nb;
            if (nb > most) most = nb;
            total += nb;
        }
        PyObject *a = PyLong_FromLongLong(most), *b = PyLong_FromLongLong(total);
        if (!a || !b) { Py_XDECREF(a); Py_XDECREF(b); goto done; }
        PyTuple_SET_ITEM(longest, f, a);
        PyTuple_SET_ITEM(totals, f, b);
    }
    /* The incarnation and clears are checked again after the records: slots are reused (new
     * incarnation) before their new keys' records are written. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (load_word(&h[H_SEQ]) != seq || load_word(&h[H_INCARNATION]) != incarnation || load_word(&h[H_CLEARS]) != clears)
        goto untrusted;
    ret = Py_BuildValue("(LLLOO)", (long long)unit, (long long)frees, (long long)end, longest, totals);
    goto done;
untrusted:
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyMem_Free(slot_at);
    Py_XDECREF(longest);
    Py_XDECREF(totals);
    Py_XDECREF(cols);
    Py_XDECREF(slots);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return ret;
}

static PyObject *table_layout(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
                         "H_MAGIC", H_MAGIC, "H_CAPACITY", H_CAPACITY, "H_COLUMNS", H_COLUMNS, "H_SEQ", H_SEQ,
                         "H_FREES", H_FREES, "H_INCARNATION", H_INCARNATION, "H_RETIRED", H_RETIRED,
                         "H_UNITS_VERSION", H_UNITS_VERSION, "H_DOWN_UNITS", H_DOWN_UNITS, "H_ALIVE_UNTIL", H_ALIVE_UNTIL,
                         "H_CLEARS", H_CLEARS, "HEADER_WORDS", HEADER_WORDS, "LOC_UNIT", LOC_UNIT,
                         "LOC_NBYTES", LOC_NBYTES, "LOC_OFFSET", LOC_OFFSET, "LOC_COLUMNS", LOC_COLUMNS,
                         "LOC_BLOCK", LOC_BLOCK);
}

static PyObject *set_stream_isa(PyObject *self, PyObject *arg) {
#if HAVE_STREAM
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (int i = 0; i < N_ISAS; i++)
        if (strcmp(name, ISAS[i].name) == 0 && isa_supported(i)) {
            const char *was = ISAS[isa].name;
            isa = i;
            return PyUnicode_FromString(was);
        }
#endif
    return PyErr_Format(PyExc_ValueError, "streaming stores with %R are not supported here", arg);
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS, "Copy byte rows between buffers, optionally padding each row."},
    {"read_locations", read_locations, METH_VARARGS, "Read a meta's rows out of a shared location table (see above)."},
    {"table_layout", table_layout, METH_NOARGS, "The location-table layout this module was built for."},
    {"set_stream_isa", set_stream_isa, METH_O,
     "Use the streaming stores of the named instruction set (one of STREAM_ISAS); returns the previous one."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *isas = PyList_New(0);
#if HAVE_STREAM
    for (int i = 0; isas && i < N_ISAS; i++)
        if (isa_supported(i)) {
            isa = i;
            PyObject *name = PyUnicode_FromString(ISAS[i].name);
            if (!name || PyList_Append(isas, name) < 0) Py_CLEAR(isas);
            Py_XDECREF(name);
        }
#endif
    if (!isas || PyModule_AddObject(m, "STREAM_ISAS", PyList_AsTuple(isas)) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_BYTES", HAVE_STREAM ? (long)STREAM_BYTES : -1) < 0) {
        Py_XDECREF(isas);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(isas);
    return m;
}
