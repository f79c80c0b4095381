/* Row copies for the TQ client and storage units, with the GIL released.
 *
 * copy_rows(dst, dst_starts, sources, src_idx, src_starts, sizes, row_span, pad[, threads])
 *   for every row i: memcpy(dst + dst_starts[i], sources[src_idx[i]] + src_starts[i], sizes[i]);
 *   when row_span > 0, the rest of the row up to row_span bytes is filled with the byte pattern `pad`.
 *   dst_starts None: the rows go back to back (row i at i * row_span, or packed when row_span is 0).
 * copy_fields(dst, jobs[, threads])
 *   several such copies into one destination, one per field of a get, each job a tuple
 *   (dst_start, sources, src_idx, src_starts, sizes, row_span, pad) whose rows go back to back from
 *   dst_start; int64 index arrays only. One call per get, not per field: the per-field costs (call,
 *   buffer exports, the GIL released and taken) are paid once, and the streaming decision below is
 *   made on the whole get - a get of 32 fields of 0.8 MB each is as large as one of 1 field of 24 MB.
 * Both return the number of threads the copy ran on: up to `threads` (default 1, at most
 * MAX_COPY_THREADS), one per SHARE_BYTES written, claiming chunks of about CHUNK_BYTES of rows.
 * Every range is bounds-checked first (offsets may come from another process), so bad offsets raise
 * ValueError instead of touching memory they do not own; nothing is written unless every job is
 * valid. A pure-numpy fallback lives in tq/rowcopy.py.
 *
 * A call writing STREAM_BYTES or more is written with non-temporal (streaming) stores on x86-64,
 * of the widest vectors the CPU has (picked at import; set_stream_isa switches, for tests): a padded
 * batch of megabytes will not be read back from the cache before it is evicted, and plain stores
 * would first read every destination line (read-for-ownership) and evict what the caller's next
 * steps need. 1 MiB, the size of a core's L2 here: each field of an 8 MiB GRPO batch (0.8-6.3 MB
 * padded) streams; measured on the 2-vCPU VM, its padded get copies in 0.79 ms this way against
 * 1.0 ms with the 3.2 MB fields stored plainly. A padded row is written as one stream - its bytes,
 * the vector where they end and the pad begins (assembled in a register), then the pad vectors -
 * so only the row's unaligned ends use plain stores, whatever the row's length.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define STREAM_BYTES ((Py_ssize_t)1 << 20)
#define SHARE_BYTES ((Py_ssize_t)4 << 20) /* the least a copy thread is started for */
#define MAX_COPY_THREADS 8
#define CHUNK_BYTES ((Py_ssize_t)1 << 20) /* the piece of a shared copy a thread claims at a time */
#define PAT_BYTES 192 /* a pad pattern expanded: PAT_BYTES bytes of it from its phase 0 */

static int get_i64(PyObject *obj, Py_buffer *view, const char *name, int strict) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (strict ? PyBUF_FORMAT : 0)) < 0) return -1;
    const char *f = strict && view->format ? view->format : "q";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (view->len % 8 != 0 || (strict && (view->itemsize != 8 || !(f[0] == 'q' || f[0] == 'l') || f[1]))) {
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

/* One copy (a field): its buffers held, its ranges checked, ready to run without the GIL. */
typedef struct {
    PyObject *seq;
    Py_buffer dst_starts, src_idx, src_starts, sizes, pad, *srcs;
    Py_ssize_t n, nsrc, got_src, row_span, bytes;
    int64_t *own_starts;
    int have_ds, have_si, have_ss, have_sz, have_pad;
    char pat[PAT_BYTES]; /* the pad pattern expanded, when its period is a power of two <= 16 */
    int pat_ok;
} job_t;

static void job_release(job_t *j) {
    for (Py_ssize_t k = 0; k < j->got_src; k++) PyBuffer_Release(&j->srcs[k]);
    PyMem_Free(j->srcs);
    if (j->have_sz) PyBuffer_Release(&j->sizes);
    if (j->have_ss) PyBuffer_Release(&j->src_starts);
    if (j->have_si) PyBuffer_Release(&j->src_idx);
    if (j->own_starts) PyMem_Free(j->own_starts);
    else if (j->have_ds) PyBuffer_Release(&j->dst_starts);
    if (j->have_pad) PyBuffer_Release(&j->pad);
    Py_XDECREF(j->seq);
    memset(j, 0, sizeof(*j));
}

#if HAVE_STREAM
/* A streaming writer: bytes are written as whole aligned W-byte vectors with streaming stores; the
 * vector being filled waits in `buf` (its first `lo` bytes not ours, bytes [lo, k) written so far)
 * until it is whole. Rows written back to back thus go out as one stream whatever their lengths:
 * a vector shared by the end of one row and the start of the next, or by a row's data and its pad,
 * is assembled here and stored once - a plain store there would first read the line from memory
 * and make the streaming stores to it evict it again. Only a run's two ends use plain stores. */
typedef struct { char *v; size_t k, lo; char buf[64]; } sw_t;
/* Byte masks: MASK + 64 - t selects the bytes from t on of a vector. */
static const unsigned char MASK[128] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255};
/* a where m is 0, b where it is all ones (bitwise; AVX without AVX2 has only the float forms) */
#define SEL16(a, b, m) _mm_or_si128(_mm_andnot_si128(m, a), _mm_and_si128(m, b))
#define SEL32(a, b, m) _mm256_castps_si256(_mm256_or_ps(_mm256_andnot_ps(_mm256_castsi256_ps(m), _mm256_castsi256_ps(a)), \
                                                        _mm256_and_ps(_mm256_castsi256_ps(m), _mm256_castsi256_ps(b))))
#define SEL64(a, b, m) _mm512_or_si512(_mm512_andnot_si512(m, a), _mm512_and_si512(m, b))

#define DEFINE_STREAM(W, TARGET, VEC, LOAD, STORE, SEL)                                                 \
    TARGET static inline void sw_full_##W(sw_t *w) {                                                    \
        if (w->lo == 0) STORE((void *)w->v, LOAD((const void *)w->buf));                                \
        else memcpy(w->v + w->lo, w->buf + w->lo, W - w->lo);                                           \
        w->v += W;                                                                                      \
        w->k = w->lo = 0;                                                                               \
    }                                                                                                   \
    /* m bytes from s, or (pad) of the pattern E from its phase 0: E[j] for j < W, then the W-byte   \
     * vector at E + (j & 63), the same for every j that is a multiple of W past the first */        \
    TARGET static inline void sw_put_##W(sw_t *w, const char *s, size_t m, int pad) {                   \
        size_t q = 0;                                                                                   \
        if (w->k) {                                                                                     \
            size_t t = W - w->k < m ? W - w->k : m;                                                     \
            memcpy(w->buf + w->k, s, t);                                                                \
            w->k += t;                                                                                  \
            q = t;                                                                                      \
            m -= t;                                                                                     \
            if (w->k < W) return;                                                                       \
            sw_full_##W(w);                                                                             \
        }                                                                                               \
        char *p = w->v;                                                                                 \
        if (pad) {                                                                                      \
            const char *e = s + (q & 63);                                                               \
            VEC x = LOAD((const void *)e);                                                              \
            for (; m >= 128; m -= 128, p += 128)                                                        \
                for (int j = 0; j < 128; j += W) STORE((void *)(p + j), x);                             \
            for (; m >= W; m -= W, p += W) STORE((void *)p, x);                                         \
            memcpy(w->buf, e, m);                                                                       \
        } else {                                                                                        \
            s += q;                                                                                     \
            for (; m >= 128; m -= 128, p += 128, s += 128)                                              \
                for (int j = 0; j < 128; j += W) STORE((void *)(p + j), LOAD((const void *)(s + j)));   \
            for (; m >= W; m -= W, p += W, s += W) STORE((void *)p, LOAD((const void *)s));             \
            memcpy(w->buf, s, m);                                                                       \
        }                                                                                               \
        w->v = p;                                                                                       \
        w->k = m;                                                                                       \
    }                                                                                                   \
    /* A row: m bytes from s, then padn bytes of the pad pattern E. The vector where the data ends  \
     * and the pad begins is blended in registers (no trip through buf, whose byte-wise writes a    \
     * vector load would wait for) when the source may be read a vector on (s_end) and the pad fills \
     * the rest of that vector. */                                                                  \
    TARGET static inline void sw_row_##W(sw_t *w, const char *s, size_t m, size_t padn, const char *E, const char *s_end) { \
        char *end = w->v + w->k + m;                                                                    \
        size_t tail = (uintptr_t)end & (W - 1);                                                         \
        if (tail && padn >= W - tail && end - tail >= w->v + (w->k ? W : 0) && s + m - tail + W <= s_end) { \
            sw_put_##W(w, s, m - tail, 0); /* leaves w->v at end - tail, nothing pending */              \
            VEC x = SEL(LOAD((const void *)(s + m - tail)), LOAD((const void *)(E + 64 - tail)),         \
                        LOAD((const void *)(MASK + 64 - tail)));                                        \
            STORE((void *)w->v, x);                                                                     \
            w->v += W;                                                                                  \
            sw_put_##W(w, E + (W - tail), padn - (W - tail), 1);                                        \
            return;                                                                                     \
        }                                                                                               \
        sw_put_##W(w, s, m, 0);                                                                         \
        if (padn) sw_put_##W(w, E, padn, 1);                                                            \
    }                                                                                                   \
    TARGET static void stream_job_##W(const job_t *j, char *d, Py_ssize_t i0, Py_ssize_t i1) {          \
        const int64_t *ds = j->dst_starts.buf, *si = j->src_idx.buf, *ss = j->src_starts.buf;          \
        const int64_t *sz = j->sizes.buf;                                                               \
        sw_t w = {0};                                                                                   \
        for (Py_ssize_t i = i0; i < i1; i++) {                                                          \
            char *r = d + ds[i];                                                                        \
            if (i == i0 || r != w.v + w.k) { /* not right after the previous row: a new run */          \
                if (w.k > w.lo) memcpy(w.v + w.lo, w.buf + w.lo, w.k - w.lo);                           \
                w.v = r - ((uintptr_t)r & (W - 1));                                                     \
                w.k = w.lo = (uintptr_t)r & (W - 1);                                                    \
            }                                                                                           \
            const Py_buffer *src = &j->srcs[si[i]];                                                     \
            sw_row_##W(&w, (const char *)src->buf + ss[i], (size_t)sz[i],                               \
                       j->row_span > 0 ? (size_t)(j->row_span - sz[i]) : 0, j->pat, (const char *)src->buf + src->len); \
        }                                                                                               \
        if (w.k > w.lo) memcpy(w.v + w.lo, w.buf + w.lo, w.k - w.lo);                                   \
    }

DEFINE_STREAM(16, , __m128i, _mm_loadu_si128, _mm_stream_si128, SEL16)
#if defined(__GNUC__)
#include <immintrin.h>
#define HAVE_WIDE 1
DEFINE_STREAM(32, __attribute__((target("avx"))), __m256i, _mm256_loadu_si256, _mm256_stream_si256, SEL32)
DEFINE_STREAM(64, __attribute__((target("avx512f"))), __m512i, _mm512_loadu_si512, _mm512_stream_si512, SEL64)
#else
#define HAVE_WIDE 0
#endif

typedef void (*stream_job_fn)(const job_t *, char *, Py_ssize_t, Py_ssize_t);
static const struct { const char *name; stream_job_fn job; } ISAS[] = {
    {"sse2", stream_job_16},
#if HAVE_WIDE
    {"avx", stream_job_32},
    {"avx512f", stream_job_64},
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

/* Hold a job's buffers and check every range against dst_len (dst_starts_o None: rows back to back
 * from `base`); on failure the job holds nothing and an exception is set. */
static int job_prepare(job_t *j, Py_ssize_t dst_len, PyObject *dst_starts_o, Py_ssize_t base, PyObject *sources_o,
                       PyObject *src_idx_o, PyObject *src_starts_o, PyObject *sizes_o, Py_ssize_t row_span, int strict) {
    if (!(j->seq = PySequence_Fast(sources_o, "sources must be a sequence of buffers"))) goto fail;
    j->nsrc = PySequence_Fast_GET_SIZE(j->seq);
    j->row_span = row_span;
    if (dst_starts_o != Py_None) {
        if (get_i64(dst_starts_o, &j->dst_starts, "dst_starts", strict) < 0) goto fail;
        j->have_ds = 1;
    }
    if (get_i64(src_idx_o, &j->src_idx, "src_idx", strict) < 0) goto fail;
    j->have_si = 1;
    if (get_i64(src_starts_o, &j->src_starts, "src_starts", strict) < 0) goto fail;
    j->have_ss = 1;
    if (get_i64(sizes_o, &j->sizes, "sizes", strict) < 0) goto fail;
    j->have_sz = 1;
    Py_ssize_t n = j->n = j->sizes.len / 8;
    const int64_t *z = j->sizes.buf;
    if (dst_starts_o == Py_None) {  /* back to back; overflow is caught by the bounds check below */
        if (!(j->own_starts = PyMem_Malloc((size_t)(n ? n : 1) * 8))) { PyErr_NoMemory(); goto fail; }
        int64_t at = base;
        for (Py_ssize_t i = 0; i < n; i++) {
            j->own_starts[i] = at;
            at += row_span > 0 ? row_span : (z[i] > 0 ? z[i] : 0);
        }
        j->dst_starts.buf = j->own_starts;
        j->dst_starts.len = n * 8;
    }
    if (j->dst_starts.len / 8 != n || j->src_idx.len / 8 != n || j->src_starts.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "dst_starts, src_idx, src_starts and sizes must have one length");
        goto fail;
    }
    if (row_span > 0 && j->pad.len < 1) {
        PyErr_SetString(PyExc_ValueError, "a pad pattern is needed when row_span > 0");
        goto fail;
    }
    if (row_span > 0 && j->pad.len <= 16 && !(j->pad.len & (j->pad.len - 1))) {
        for (int k = 0; k < PAT_BYTES; k++) j->pat[k] = ((const char *)j->pad.buf)[k % j->pad.len];
        j->pat_ok = 1;
    }
    if (!(j->srcs = PyMem_Calloc((size_t)(j->nsrc ? j->nsrc : 1), sizeof(Py_buffer)))) { PyErr_NoMemory(); goto fail; }
    for (; j->got_src < j->nsrc; j->got_src++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(j->seq, j->got_src), &j->srcs[j->got_src], PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
    const int64_t *ds = j->dst_starts.buf, *si = j->src_idx.buf, *ss = j->src_starts.buf;
    for (Py_ssize_t i = 0; i < n; i++) {  /* validate everything before copying anything */
        int64_t s = si[i];
        Py_ssize_t span = row_span > 0 ? row_span : z[i];
        if (s < 0 || s >= j->nsrc || z[i] < 0 || ss[i] < 0 || ds[i] < 0 || z[i] > span ||
            ss[i] > j->srcs[s].len - z[i] || ds[i] > dst_len - span) {
            PyErr_Format(PyExc_ValueError, "row %zd: copy out of bounds (source %lld, start %lld, size %lld)", i,
                         (long long)s, (long long)ss[i], (long long)z[i]);
            goto fail;
        }
        j->bytes += span;
    }
    return 0;
fail:
    job_release(j);
    return -1;
}

/* Run rows [i0, i1) of a prepared job into dst (no GIL). */
static void job_run(const job_t *j, char *d, int stream, Py_ssize_t i0, Py_ssize_t i1) {
    const int64_t *ds = j->dst_starts.buf, *si = j->src_idx.buf, *ss = j->src_starts.buf, *sz = j->sizes.buf;
    const Py_buffer *srcs = j->srcs;
#if HAVE_STREAM
    if (stream && (j->row_span == 0 || j->pat_ok)) {
        ISAS[isa].job(j, d, i0, i1);
        return;
    }
#endif
    (void)stream;
    for (Py_ssize_t i = i0; i < i1; i++) {
        memcpy(d + ds[i], (const char *)srcs[si[i]].buf + ss[i], (size_t)sz[i]);
        if (j->row_span > 0) fill_pattern(d + ds[i] + sz[i], j->row_span - sz[i], j->pad.buf, j->pad.len);
    }
}

/* A copy on several threads is cut, on row boundaries, into chunks of about CHUNK_BYTES that the
 * threads claim one at a time: a thread the OS leaves waiting (a busy machine) just takes fewer, so
 * the copy is not as slow as its slowest thread's fixed share. A run's partial vectors at either end
 * of a chunk are written byte-exactly (stream_job: plain stores of the bytes it owns), so two
 * threads never write the same byte. Chunk c runs from row bounds[c] to row bounds[c + 1], a row
 * counted across the jobs in order. */
typedef struct {
    const job_t *jobs;
    Py_ssize_t njobs, nchunks;
    const Py_ssize_t *first_row; /* the first row of each job, counted across the jobs */
    const Py_ssize_t *bounds;
    char *d;
    int stream;
    Py_ssize_t next; /* the next chunk to claim (atomic) */
} chunks_t;

/* Rows [from, to) counted across the jobs: the part of each job they cover. */
static void run_rows(const chunks_t *c, Py_ssize_t from, Py_ssize_t to) {
    Py_ssize_t k = 0;
    while (k + 1 < c->njobs && c->first_row[k + 1] <= from) k++;
    for (; k < c->njobs && c->first_row[k] < to; k++) {
        Py_ssize_t lo = from > c->first_row[k] ? from - c->first_row[k] : 0;
        Py_ssize_t hi = to - c->first_row[k] < c->jobs[k].n ? to - c->first_row[k] : c->jobs[k].n;
        if (hi > lo) job_run(&c->jobs[k], c->d, c->stream, lo, hi);
    }
}

static void *run_chunks(void *arg) {
    chunks_t *c = arg;
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED);
        if (i >= c->nchunks) break;
        run_rows(c, c->bounds[i], c->bounds[i + 1]);
    }
#if HAVE_STREAM
    if (c->stream) _mm_sfence();  /* streaming stores are weakly ordered: publish them before returning */
#endif
    return NULL;
}

/* Row bounds of chunks of about `chunk` bytes each (a chunk ends at the first row boundary at or past
 * its share; bounds strictly increase); returns the number of chunks, bounds[0..n] filled. */
static Py_ssize_t cut_chunks(const job_t *jobs, Py_ssize_t njobs, Py_ssize_t chunk, Py_ssize_t *first_row, Py_ssize_t *bounds) {
    Py_ssize_t n = 1, rows = 0, at = 0, next = chunk;
    bounds[0] = 0;
#define EMIT(b) do { if ((b) > bounds[n - 1]) bounds[n++] = (b); } while (0)
    for (Py_ssize_t k = 0; k < njobs; k++) {
        const job_t *j = &jobs[k];
        first_row[k] = rows;
        if (j->row_span > 0) { /* rows of one span: each chunk end found by arithmetic */
            while (at + j->bytes > next) {
                Py_ssize_t i = next <= at ? 0 : (next - at + j->row_span - 1) / j->row_span;
                EMIT(rows + i);
                next = at + i * j->row_span + chunk;
            }
        } else {
            const int64_t *z = j->sizes.buf;
            for (Py_ssize_t i = 0, a = at; i < j->n; i++) {
                a += z[i];
                if (a >= next) {
                    EMIT(rows + i + 1);
                    next = a + chunk;
                }
            }
        }
        at += j->bytes;
        rows += j->n;
    }
    EMIT(rows);
#undef EMIT
    return n - 1;
}

/* Run prepared jobs into dst with the GIL released: streaming when they write STREAM_BYTES or more;
 * on up to `threads` threads (one per SHARE_BYTES written), started for this call and joined before
 * it returns - no pool outlives a call, so a fork never inherits half a pool. Returns the number of
 * threads that ran it. */
static int run_jobs(const job_t *jobs, Py_ssize_t njobs, char *d, int threads) {
    Py_ssize_t total = 0, rows = 0;
    for (Py_ssize_t k = 0; k < njobs; k++) total += jobs[k].bytes, rows += jobs[k].n;
    int stream = total >= STREAM_BYTES;
    Py_ssize_t parts = total / SHARE_BYTES;
    if (parts > threads) parts = threads;
    if (parts > MAX_COPY_THREADS) parts = MAX_COPY_THREADS;
    Py_ssize_t *first_row = NULL, *bounds = NULL;
    if (parts > 1) {  /* at most one chunk per row, and one per CHUNK_BYTES (+ the ends) */
        Py_ssize_t most = total / CHUNK_BYTES + njobs + 2;  /* bounds strictly increase: also <= rows + 1 */
        if (most > rows + 1) most = rows + 1;
        first_row = PyMem_Malloc((size_t)njobs * sizeof(Py_ssize_t));
        bounds = PyMem_Malloc((size_t)(most + 1) * sizeof(Py_ssize_t));
        if (!first_row || !bounds) parts = 1;  /* no memory to plan with: one thread */
    }
    int ran = 1;
    Py_BEGIN_ALLOW_THREADS
    if (parts <= 1) {
        for (Py_ssize_t k = 0; k < njobs; k++) job_run(&jobs[k], d, stream, 0, jobs[k].n);
#if HAVE_STREAM
        if (stream) _mm_sfence();
#endif
    } else {
        chunks_t c = {jobs, njobs, 0, first_row, bounds, d, stream, 0};
        c.nchunks = cut_chunks(jobs, njobs, CHUNK_BYTES, first_row, bounds);
        if (parts > c.nchunks) parts = c.nchunks;  /* a thread per chunk at most: rows are never split */
        pthread_t tids[MAX_COPY_THREADS];
        int started[MAX_COPY_THREADS] = {0};
        for (Py_ssize_t p = 1; p < parts; p++) ran += started[p] = pthread_create(&tids[p], NULL, run_chunks, &c) == 0;
        run_chunks(&c);
        for (Py_ssize_t p = 1; p < parts; p++)
            if (started[p]) pthread_join(tids[p], NULL);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(first_row);
    PyMem_Free(bounds);
    return ran;
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *dst_o, *dst_starts_o, *sources_o, *src_idx_o, *src_starts_o, *sizes_o;
    job_t j = {0};
    Py_buffer dst;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOny*|i", &dst_o, &dst_starts_o, &sources_o, &src_idx_o, &src_starts_o, &sizes_o,
                          &j.row_span, &j.pad, &threads))
        return NULL;
    j.have_pad = 1;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&j.pad);
        return NULL;
    }
    PyObject *ret = NULL;
    if (job_prepare(&j, dst.len, dst_starts_o, 0, sources_o, src_idx_o, src_starts_o, sizes_o, j.row_span, 0) == 0) {
        int ran = run_jobs(&j, 1, dst.buf, threads);
        job_release(&j);
        ret = PyLong_FromLong(ran);
    }
    PyBuffer_Release(&dst);
    return ret;
}

static PyObject *copy_fields(PyObject *self, PyObject *args) {
    PyObject *dst_o, *jobs_o;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OO|i", &dst_o, &jobs_o, &threads)) return NULL;
    PyObject *jobs_seq = PySequence_Fast(jobs_o, "jobs must be a sequence of tuples");
    if (!jobs_seq) return NULL;
    Py_ssize_t njobs = PySequence_Fast_GET_SIZE(jobs_seq), ready = 0;
    PyObject *ret = NULL;
    Py_buffer dst;
    job_t *jobs = PyMem_Calloc((size_t)(njobs ? njobs : 1), sizeof(job_t));
    if (!jobs) { PyErr_NoMemory(); goto done_seq; }
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_jobs;
    for (; ready < njobs; ready++) {
        job_t *j = &jobs[ready];
        PyObject *sources_o, *src_idx_o, *src_starts_o, *sizes_o, *t = PySequence_Fast_GET_ITEM(jobs_seq, ready);
        Py_ssize_t base, row_span;
        if (!PyTuple_Check(t)) { PyErr_Format(PyExc_TypeError, "job %zd is not a tuple", ready); goto done_dst; }
        if (!PyArg_ParseTuple(t, "nOOOOny*", &base, &sources_o, &src_idx_o, &src_starts_o, &sizes_o, &row_span, &j->pad))
            goto done_dst;
        j->have_pad = 1;
        if (base < 0) {
            PyErr_Format(PyExc_ValueError, "job %zd: dst_start %zd is negative", ready, base);
            PyBuffer_Release(&j->pad);
            j->have_pad = 0;
            goto done_dst;
        }
        if (job_prepare(j, dst.len, Py_None, base, sources_o, src_idx_o, src_starts_o, sizes_o, row_span, 1) < 0) {
            PyObject *type, *value, *tb;  /* name the job in the error */
            PyErr_Fetch(&type, &value, &tb);
            PyErr_Format(type, "job %zd: %S", ready, value);
            Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
            goto done_dst;
        }
    }
    ret = PyLong_FromLong(run_jobs(jobs, njobs, dst.buf, threads));
done_dst:
    for (Py_ssize_t k = 0; k < ready; k++) job_release(&jobs[k]);
    PyBuffer_Release(&dst);
done_jobs:
    PyMem_Free(jobs);
done_seq:
    Py_DECREF(jobs_seq);
    return ret;
}

/* ------------------------------------------------------------------ location tables
 * read_locations(table, cols, slots, keys, incarnation, clears, units_version, out[, row_bytes, starts, views])
 *   keys: the fingerprints (key_fingerprints) of the keys the meta pairs with the slots, int64.
 *   A same-host reader's whole check-and-read of a partition's location table (tq/locations.py
 *   documents the protocol; the layout constants below mirror it and tq/locations.py asserts they
 *   match). Writes the offsets of the rows (cols x slots) to out[0:F*n], their sizes to
 *   out[F*n:2*F*n] and the blocks they lie in, one per run of rows in the same block, from
 *   out[2*F*n] on (int64; a borrowed get leases those blocks). With row_bytes (per field; 0: none)
 *   also writes to starts[f*(n+1):(f+1)*(n+1)] where each field's rows start, counted in its
 *   rows' units (tokens) from its first row, rows back to back - a jagged result's offsets - in
 *   the same pass (a get of long batches made them with two numpy passes more per field, after
 *   this one had evicted the sizes from the cache). With views (a borrowed get viewing the rows
 *   where they lie), a field read as one run gets only its first offset written, no sizes and no
 *   longest row (0): 16 of the 24 bytes a row it would write. Returns (unit, frees, end,
 *   longest, totals, adjacent, runs): the one storage unit holding them, the frees count they were
 *   read under, the end of the furthest row, per field its longest row, its bytes in all and
 *   whether its rows lie back to back in slot order (tuples) - what a get needs to size its
 *   results, and a borrowed get to view them - and the number of block runs written.
 *   Returns None when the table cannot be trusted for them: retired, its controller's lease run out,
 *   another incarnation, clears count or units version, being written (seqlock), a slot or column
 *   out of range, a slot whose key fingerprint is not its key's (a meta whose slots name other
 *   keys reads nothing of theirs), a row not produced or on a down unit, or rows on several units. One C call, not a
 *   dozen numpy ones: it runs right after megabyte copies have evicted the interpreter's caches. */
enum { H_MAGIC, H_CAPACITY, H_COLUMNS, H_SEQ, H_FREES, H_INCARNATION, H_RETIRED, H_UNITS_VERSION,
       H_DOWN_UNITS, H_ALIVE_UNTIL, H_CLEARS, H_PIN_EPOCH, H_SUCCESSOR, HEADER_WORDS = 16 };
enum { LOC_UNIT, LOC_BLOCK, LOC_ROW, LOC_NBYTES, LOC_OFFSET, LOC_RUN, LOC_COLUMNS };
enum { KEY_WORDS = 1 };  /* the key plane after the header: a fingerprint per slot */

static inline int64_t load_word(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* A key's fingerprint, as the controller writes it in the table's key plane (key_fingerprints) and a
 * reader checks it: a 64-bit hash of the key's UTF-8 bytes (word by word, then murmur3's finaliser),
 * never 0 - the plane's value where the controller wrote none, which then matches no key. Not a
 * defence against forgery (whoever reaches the table reads every arena anyway): it catches a meta
 * whose keys and slots disagree. */
static inline uint64_t fmix64(uint64_t k) {
    k ^= k >> 33, k *= 0xff51afd7ed558ccdULL, k ^= k >> 33, k *= 0xc4ceb9fe1a85ec53ULL;
    return k ^ (k >> 33);
}

static int key_fingerprint(PyObject *key, int64_t *out) {
    Py_ssize_t n;
    const char *p;
    if (PyUnicode_CheckExact(key) && PyUnicode_IS_COMPACT_ASCII(key))  /* most keys: their bytes, inline */
        p = (const char *)PyUnicode_DATA(key), n = PyUnicode_GET_LENGTH(key);
    else
        p = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &n) : NULL;
    if (!p) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "keys must be str");
        return -1;
    }
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (uint64_t)n, w;
    for (; n >= 8; p += 8, n -= 8) {  /* one multiply a word; the finaliser mixes the whole */
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdULL;
        h = (h << 29) | (h >> 35);
    }
    w = 0;
    for (Py_ssize_t i = 0; i < n; i++) w |= (uint64_t)(unsigned char)p[i] << (8 * i);  /* a call to memcpy costs more */
    h = fmix64(h ^ w ^ ((uint64_t)n << 56));
    *out = h ? (int64_t)h : 1;
    return 0;
}

static PyObject *key_fingerprints(PyObject *self, PyObject *args) {
    PyObject *keys_o;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Ow*", &keys_o, &out)) return NULL;
    PyObject *keys = PySequence_Fast(keys_o, "keys must be a sequence of str");
    PyObject *ret = NULL;
    if (!keys) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (out.len < n * 8) { PyErr_SetString(PyExc_ValueError, "out holds fewer int64 than there are keys"); goto done; }
    for (Py_ssize_t i = 0; i < n; i++)
        if (key_fingerprint(PySequence_Fast_GET_ITEM(keys, i), (int64_t *)out.buf + i) < 0) goto done;
    ret = Py_None;
    Py_INCREF(ret);
done:
    Py_XDECREF(keys);
    PyBuffer_Release(&out);
    return ret;
}

/* One field's records of a read_locations (its planes: P[w] is record word w of every slot): the rows'
 * offsets and sizes, the blocks they lie in (one per run, appended to blocks[*runs...]), the furthest
 * end, the longest row, the bytes in all and whether they lie back to back; with starts, the rows'
 * offsets laid back to back, in rows of row_bytes. Returns 0 if a record is not on ``unit`` (which also
 * catches one not produced) or is torn.
 * Consecutive slots (``first`` >= 0: slot i is first + i) whose records all carry one run id are rows
 * one commit laid back to back in one block, unchanged since (tq/locations.py): only their run and
 * offset words are read, sizes are the offsets' differences - 16 bytes a row, not the 40 of its
 * unit, block, size and offset (the table was just written by the controller on another core, so
 * every line read is a miss). Otherwise each record is read whole, branch-free, with no stores the
 * compiler must assume alias the records: it runs over every key of a borrowed get, tens of
 * thousands of records at large batches. */
static inline int read_field(const int64_t *const P[LOC_COLUMNS], const int64_t *restrict slot_at, int64_t first, Py_ssize_t n,
                             int64_t unit, int64_t *restrict offsets, int64_t *restrict sizes, int64_t *restrict blocks,
                             int64_t *runs_io, int64_t *end_io, int64_t *most_o, int64_t *total_o, int *adjacent_o,
                             int64_t *restrict starts, int64_t row_bytes, int views) {
    int64_t runs = *runs_io, end = *end_io, most = 0, total = 0, next = 0;
    int64_t last = runs ? blocks[runs - 1] : INT64_MIN;
    int bad = 0, adjacent = 1;
    /* rows of a power-of-two width (every dtype's itemsize times a power-of-two shape) are counted by a
     * shift in the loop; others in bytes, then divided */
    int pow2 = row_bytes > 0 && !(row_bytes & (row_bytes - 1)), shift = pow2 ? __builtin_ctzll((unsigned long long)row_bytes) : 0;
    const int64_t *restrict run = P[LOC_RUN], *restrict off_p = P[LOC_OFFSET];
    int one_run = first >= 0 && n > 0 && run[first] >= 0;
    for (Py_ssize_t i = 1; one_run && i < n; i++) one_run = run[first + i] == run[first];
    if (one_run) {
        int64_t s_last = first + n - 1, start = off_p[first], stop = off_p[s_last] + P[LOC_NBYTES][s_last];
        bad = (P[LOC_UNIT][first] != unit) | (start < 0) | (stop < off_p[s_last]);
        const int64_t *restrict o = off_p + first;
        offsets[0] = start;  /* views: only the view's start and (jagged) its offsets are written */
        for (Py_ssize_t i = 0; i < n && (starts || !views); i++) {
            int64_t nb = (i + 1 < n ? o[i + 1] : stop) - o[i];
            bad |= nb < 0;
            if (starts) starts[i] = (o[i] - start) >> shift;
            if (!views) {
                offsets[i] = o[i];
                sizes[i] = nb;
                most = nb > most ? nb : most;
            }
        }
        int64_t b = P[LOC_BLOCK][first];
        if (b != last) blocks[runs++] = b;
        total = stop - start;
        end = stop > end ? stop : end;
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = slot_at[i];
            int64_t u = P[LOC_UNIT][s], off = off_p[s], nb = P[LOC_NBYTES][s], b = P[LOC_BLOCK][s];
            bad |= (u != unit) | (off < 0) | (nb < 0);
            offsets[i] = off;
            sizes[i] = nb;
            if (starts) starts[i] = total >> shift;
            if (b != last) { blocks[runs++] = b; last = b; }
            adjacent &= (i == 0) | (off == next);
            next = off + nb;
            end = next > end ? next : end;
            most = nb > most ? nb : most;
            total += nb;
        }
    }
    if (starts) {
        starts[n] = total >> shift;
        if (!pow2)
            for (Py_ssize_t i = 0; i <= n; i++) starts[i] /= row_bytes;
    }
    *runs_io = runs, *end_io = end, *most_o = most, *total_o = total, *adjacent_o = adjacent;
    return !bad;
}

static PyObject *read_locations(PyObject *self, PyObject *args) {
    Py_buffer table, keys, out, starts_buf = {0};
    PyObject *cols_o, *slots_o, *row_bytes_o = Py_None;
    long long incarnation, clears, units_version;
    int views = 0;
    if (!PyArg_ParseTuple(args, "y*OOy*LLLw*|Ow*p", &table, &cols_o, &slots_o, &keys, &incarnation, &clears, &units_version, &out,
                          &row_bytes_o, &starts_buf, &views))
        return NULL;
    PyObject *ret = NULL, *cols = NULL, *slots = NULL, *longest = NULL, *totals = NULL, *adjacent = NULL, *row_bytes = NULL;
    int64_t *slot_at = NULL;  /* the slots as C ints, converted once for all fields */
    if (!(cols = PySequence_Fast(cols_o, "cols must be a sequence of ints"))) goto done;
    /* consecutive slots come as a range (tq.meta keeps them so): no int to convert per key */
    long long range_start = -1;
    Py_ssize_t n;
    if (PyRange_Check(slots_o)) {
        PyObject *start = PyObject_GetAttrString(slots_o, "start"), *step = PyObject_GetAttrString(slots_o, "step");
        long long st = start ? PyLong_AsLongLong(start) : -1, sp = step ? PyLong_AsLongLong(step) : 0;
        Py_XDECREF(start);
        Py_XDECREF(step);
        if (PyErr_Occurred() || (n = PyObject_Length(slots_o)) < 0) goto done;
        if (sp != 1 && n > 1) { PyErr_SetString(PyExc_ValueError, "a range of slots must have step 1"); goto done; }
        range_start = st;
    } else {
        if (!(slots = PySequence_Fast(slots_o, "slots must be a sequence of ints"))) goto done;
        n = PySequence_Fast_GET_SIZE(slots);
    }
    if (keys.len != n * 8) { PyErr_SetString(PyExc_ValueError, "keys and slots differ in length"); goto done; }
    const int64_t *h = table.buf;
    Py_ssize_t F = PySequence_Fast_GET_SIZE(cols);
    if (table.len < HEADER_WORDS * 8) { PyErr_SetString(PyExc_ValueError, "not a location table"); goto done; }
    int64_t capacity = h[H_CAPACITY], ncols = h[H_COLUMNS];
    if (capacity < 0 || ncols < 0 || capacity > (table.len / 8 - HEADER_WORDS) / (KEY_WORDS + LOC_COLUMNS * ncols)) {
        PyErr_SetString(PyExc_ValueError, "location table is truncated");
        goto done;
    }
    if (out.len < 3 * F * n * 8) { PyErr_SetString(PyExc_ValueError, "out holds fewer than 3 * cols * slots int64"); goto done; }
    if (row_bytes_o != Py_None) {
        if (!(row_bytes = PySequence_Fast(row_bytes_o, "row_bytes must be a sequence of ints"))) goto done;
        if (PySequence_Fast_GET_SIZE(row_bytes) != F) { PyErr_SetString(PyExc_ValueError, "row_bytes needs one entry per col"); goto done; }
        if (!starts_buf.buf || starts_buf.len < F * (n + 1) * 8) {
            PyErr_SetString(PyExc_ValueError, "starts holds fewer than cols * (slots + 1) int64");
            goto done;
        }
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);  /* the clock of Python's time.monotonic_ns on Linux */
    int64_t seq = load_word(&h[H_SEQ]), frees = load_word(&h[H_FREES]);
    if ((seq & 1) || load_word(&h[H_RETIRED]) || load_word(&h[H_INCARNATION]) != incarnation ||
        load_word(&h[H_CLEARS]) != clears || load_word(&h[H_UNITS_VERSION]) != units_version ||
        (int64_t)now.tv_sec * 1000000000 + now.tv_nsec >= load_word(&h[H_ALIVE_UNTIL]))
        goto untrusted;
    int64_t down = load_word(&h[H_DOWN_UNITS]), unit = -1, end = 0, runs = 0;
    int64_t *offsets = out.buf, *sizes = offsets + F * n, *blocks = sizes + F * n;
    const int64_t *key_plane = h + HEADER_WORDS, *locs = key_plane + capacity;
    if (!(longest = PyTuple_New(F)) || !(totals = PyTuple_New(F)) || !(adjacent = PyTuple_New(F))) goto done;
    if (!(slot_at = PyMem_Malloc((size_t)(n ? n : 1) * 8))) { PyErr_NoMemory(); goto done; }
    int consecutive = 1;  /* slot i is slot 0 + i: rows may be read as runs */
    if (!slots) {
        if (n && (range_start < 0 || range_start > capacity - n)) goto untrusted;
        for (Py_ssize_t i = 0; i < n; i++) slot_at[i] = range_start + i;
    }
    for (Py_ssize_t i = 0; slots && i < n; i++) {
        long long slot = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(slots, i));
        if (slot == -1 && PyErr_Occurred()) goto done;
        if (slot < 0 || slot >= capacity) goto untrusted;
        slot_at[i] = slot;
        consecutive &= slot == slot_at[0] + i;
    }
    const int64_t *fps = keys.buf;
    int64_t differ = 0;  /* each slot holds the meta's key, not another one */
    for (Py_ssize_t i = 0; i < n; i++) differ |= key_plane[slot_at[i]] ^ fps[i];
    if (differ) goto untrusted;
    for (Py_ssize_t f = 0; f < F; f++) {
        int64_t most, total;
        int back_to_back;
        long long c = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(cols, f));
        if (c == -1 && PyErr_Occurred()) goto done;
        if (c < 0 || c >= ncols) goto untrusted;
        const int64_t *P[LOC_COLUMNS];
        for (int w = 0; w < LOC_COLUMNS; w++) P[w] = locs + (c * LOC_COLUMNS + w) * capacity;
        if (n && unit < 0) unit = P[LOC_UNIT][slot_at[0]];
        long long rb = 0;
        if (row_bytes && (rb = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(row_bytes, f))) == -1 && PyErr_Occurred()) goto done;
        int64_t *starts = rb > 0 ? (int64_t *)starts_buf.buf + f * (n + 1) : NULL;
        if (!read_field(P, slot_at, n && consecutive ? slot_at[0] : -1, n, unit, offsets + f * n, sizes + f * n, blocks, &runs,
                        &end, &most, &total, &back_to_back, starts, rb, views))
            goto untrusted;
        PyObject *a = PyLong_FromLongLong(most), *b = PyLong_FromLongLong(total);
        if (!a || !b) { Py_XDECREF(a); Py_XDECREF(b); goto done; }
        PyTuple_SET_ITEM(longest, f, a);
        PyTuple_SET_ITEM(totals, f, b);
        PyObject *adj = back_to_back ? Py_True : Py_False;
        Py_INCREF(adj);
        PyTuple_SET_ITEM(adjacent, f, adj);
    }
    if (n && F && (unit < 0 || ((down >> (unit < 62 ? unit : 62)) & 1))) goto untrusted;  /* not produced, or a down unit */
    /* The incarnation and clears are checked again after the records: slots are reused (new
     * incarnation) before their new keys' records are written. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (load_word(&h[H_SEQ]) != seq || load_word(&h[H_INCARNATION]) != incarnation || load_word(&h[H_CLEARS]) != clears)
        goto untrusted;
    ret = Py_BuildValue("(LLLOOOL)", (long long)unit, (long long)frees, (long long)end, longest, totals, adjacent, (long long)runs);
    goto done;
untrusted:
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyMem_Free(slot_at);
    Py_XDECREF(longest);
    Py_XDECREF(totals);
    Py_XDECREF(adjacent);
    Py_XDECREF(cols);
    Py_XDECREF(slots);
    Py_XDECREF(row_bytes);
    PyBuffer_Release(&table);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    if (starts_buf.obj) PyBuffer_Release(&starts_buf);
    return ret;
}

/* Pins: leases of borrowed gets taken in shared memory, without a request (tq/pins.py documents the
 * protocol and mirrors this layout). A pin file is a header of PIN_HEADER words and slots of PIN_WORDS
 * words: lease id (0: free), deadline (CLOCK_MONOTONIC ns), unit, block count, blocks. The reader
 * publishes a pin, then re-reads the table's frees count; the controller bumps that count, then scans
 * the pins (bump_word, read_pins). With a full fence on each side between its store and its loads,
 * either the reader sees the bump (and gives its pin up) or the controller sees the pin (and keeps
 * the blocks) - never neither. */
enum { PIN_MAGIC_W, PIN_SLOTS_W, PIN_WORDS_W, PIN_OWNER_W, PIN_REVOKED_W, PIN_HEADER = 8 };
enum { P_LEASE, P_DEADLINE, P_UNIT, P_COUNT, P_BLOCKS, PIN_WORDS = 64 };

static int64_t *pin_slot(Py_buffer *pins, Py_ssize_t slot) {
    if (slot < 0 || pins->len < (Py_ssize_t)((PIN_HEADER + (slot + 1) * PIN_WORDS) * 8)) {
        PyErr_Format(PyExc_ValueError, "pin slot %zd is not in the pin file", slot);
        return NULL;
    }
    return (int64_t *)pins->buf + PIN_HEADER + slot * PIN_WORDS;
}

/* pin(pins, slot, lease, deadline_ns, unit, blocks, table, frees, incarnation, clears, epoch) -> bool
 * epoch: the pin board the file was registered with; a table of another (a controller started anew
 * without a journal: it never heard of the file) refuses the pin. */
static PyObject *pin(PyObject *self, PyObject *args) {
    Py_buffer pins, table;
    Py_ssize_t slot;
    long long lease, deadline, unit, frees, incarnation, clears, epoch;
    PyObject *blocks_o, *blocks = NULL, *ret = NULL;
    if (!PyArg_ParseTuple(args, "w*nLLLOy*LLLL", &pins, &slot, &lease, &deadline, &unit, &blocks_o, &table, &frees,
                          &incarnation, &clears, &epoch))
        return NULL;
    int64_t *s = pin_slot(&pins, slot);
    if (!s) goto done;
    if (lease == 0) { PyErr_SetString(PyExc_ValueError, "a pin's lease id must not be 0"); goto done; }
    if (table.len < HEADER_WORDS * 8) { PyErr_SetString(PyExc_ValueError, "not a location table"); goto done; }
    if (!(blocks = PySequence_Fast(blocks_o, "blocks must be a sequence of ints"))) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    if (n > PIN_WORDS - P_BLOCKS) { ret = Py_False; Py_INCREF(ret); goto done; }  /* too many: lease by request */
    if (__atomic_load_n(&s[P_LEASE], __ATOMIC_ACQUIRE) != 0) { PyErr_Format(PyExc_ValueError, "pin slot %zd is in use", slot); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long b = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(blocks, i));
        if (b == -1 && PyErr_Occurred()) goto done;
        s[P_BLOCKS + i] = b;
    }
    s[P_DEADLINE] = deadline, s[P_UNIT] = unit, s[P_COUNT] = n;
    __atomic_store_n(&s[P_LEASE], (int64_t)lease, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    const int64_t *h = table.buf;
    /* the file revoked (the controller stops reading it): this pin may go unseen */
    int held = !load_word((const int64_t *)pins.buf + PIN_REVOKED_W) && epoch && load_word(&h[H_PIN_EPOCH]) == epoch &&
               load_word(&h[H_FREES]) == frees && !load_word(&h[H_RETIRED]) && load_word(&h[H_INCARNATION]) == incarnation &&
               load_word(&h[H_CLEARS]) == clears;
    if (!held) __atomic_store_n(&s[P_LEASE], 0, __ATOMIC_RELEASE);
    ret = held ? Py_True : Py_False;
    Py_INCREF(ret);
done:
    Py_XDECREF(blocks);
    PyBuffer_Release(&pins);
    PyBuffer_Release(&table);
    return ret;
}

/* read_pins(pins) -> [(slot, lease, deadline_ns, unit, (blocks...)), ...] of the slots in use, each
 * read whole (its lease id the same before and after: a slot given up and taken again meanwhile is
 * read again). */
static PyObject *read_pins(PyObject *self, PyObject *args) {
    Py_buffer pins;
    if (!PyArg_ParseTuple(args, "y*", &pins)) return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t slots = pins.len / 8 < PIN_HEADER ? 0 : (pins.len / 8 - PIN_HEADER) / PIN_WORDS;
    for (Py_ssize_t i = 0; out && i < slots; i++) {
        const int64_t *s = (const int64_t *)pins.buf + PIN_HEADER + i * PIN_WORDS;
        for (int tries = 0; tries < 1000; tries++) {
            int64_t lease = __atomic_load_n(&s[P_LEASE], __ATOMIC_ACQUIRE);
            if (!lease) break;
            int64_t deadline = load_word(&s[P_DEADLINE]), unit = load_word(&s[P_UNIT]), n = load_word(&s[P_COUNT]);
            if (n < 0 || n > PIN_WORDS - P_BLOCKS) n = 0;
            int64_t blocks[PIN_WORDS];
            for (int64_t k = 0; k < n; k++) blocks[k] = load_word(&s[P_BLOCKS + k]);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(&s[P_LEASE], __ATOMIC_ACQUIRE) != lease) continue;
            PyObject *bt = PyTuple_New(n);
            for (int64_t k = 0; bt && k < n; k++) {
                PyObject *b = PyLong_FromLongLong(blocks[k]);
                if (!b) Py_CLEAR(bt);
                else PyTuple_SET_ITEM(bt, k, b);
            }
            PyObject *item = bt ? Py_BuildValue("(nLLLN)", i, (long long)lease, (long long)deadline, (long long)unit, bt) : NULL;
            if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
            Py_XDECREF(item);
            break;
        }
    }
    PyBuffer_Release(&pins);
    return out;
}

/* bump_word(buffer, index): buffer[index] += 1 (int64) as one atomic step, then a full fence: the
 * controller's side of the pin protocol (and of every frees count readers check). */
static PyObject *bump_word(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t index;
    if (!PyArg_ParseTuple(args, "w*n", &buf, &index)) return NULL;
    if (index < 0 || (index + 1) * 8 > buf.len || ((uintptr_t)buf.buf & 7)) {
        PyBuffer_Release(&buf);
        return PyErr_Format(PyExc_ValueError, "word %zd is not in the buffer", index);
    }
    int64_t v = __atomic_add_fetch((int64_t *)buf.buf + index, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    PyBuffer_Release(&buf);
    return PyLong_FromLongLong(v);
}

static PyObject *table_layout(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "KEY_WORDS", KEY_WORDS,
                         "H_PIN_EPOCH", H_PIN_EPOCH, "H_SUCCESSOR", H_SUCCESSOR, "H_MAGIC", H_MAGIC, "H_CAPACITY", H_CAPACITY, "H_COLUMNS", H_COLUMNS, "H_SEQ", H_SEQ,
                         "H_FREES", H_FREES, "H_INCARNATION", H_INCARNATION, "H_RETIRED", H_RETIRED,
                         "H_UNITS_VERSION", H_UNITS_VERSION, "H_DOWN_UNITS", H_DOWN_UNITS, "H_ALIVE_UNTIL", H_ALIVE_UNTIL,
                         "H_CLEARS", H_CLEARS, "HEADER_WORDS", HEADER_WORDS, "LOC_UNIT", LOC_UNIT,
                         "LOC_NBYTES", LOC_NBYTES, "LOC_OFFSET", LOC_OFFSET, "LOC_COLUMNS", LOC_COLUMNS,
                         "LOC_BLOCK", LOC_BLOCK, "LOC_RUN", LOC_RUN);
}

static PyObject *pin_layout(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "PIN_MAGIC_W", PIN_MAGIC_W, "PIN_SLOTS_W", PIN_SLOTS_W,
                         "PIN_WORDS_W", PIN_WORDS_W, "PIN_OWNER_W", PIN_OWNER_W, "PIN_REVOKED_W", PIN_REVOKED_W, "PIN_HEADER", PIN_HEADER, "P_LEASE", P_LEASE,
                         "P_DEADLINE", P_DEADLINE, "P_UNIT", P_UNIT, "P_COUNT", P_COUNT, "PIN_WORDS", PIN_WORDS);
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
    {"copy_fields", copy_fields, METH_VARARGS, "Several row copies (the fields of a get) into one buffer, in one call."},
    {"read_locations", read_locations, METH_VARARGS, "Read a meta's rows out of a shared location table (see above)."},
    {"table_layout", table_layout, METH_NOARGS, "The location-table layout this module was built for."},
    {"key_fingerprints", key_fingerprints, METH_VARARGS, "Write each key's fingerprint (the location table's key plane) to an int64 buffer."},
    {"pin", pin, METH_VARARGS, "Publish a pin in a slot and keep it if the table freed nothing since its read (see above)."},
    {"read_pins", read_pins, METH_VARARGS, "The pins in use in a pin file, each read whole."},
    {"bump_word", bump_word, METH_VARARGS, "Add 1 to an int64 word atomically, then a full fence."},
    {"pin_layout", pin_layout, METH_NOARGS, "The pin-file layout this module was built for."},
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
        PyModule_AddIntConstant(m, "STREAM_BYTES", HAVE_STREAM ? (long)STREAM_BYTES : -1) < 0 ||
        PyModule_AddIntConstant(m, "SHARE_BYTES", (long)SHARE_BYTES) < 0) {
        Py_XDECREF(isas);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(isas);
    return m;
}
