/*
 * ems._memcopy: one batched gather/scatter call for the SDK's data path.
 *
 * copy_segments(dst, src, lengths, threads=0, nontemporal=-1) takes three 1-D,
 * C-contiguous buffer-protocol objects of equal length whose items are 8-byte
 * integers (numpy uint64 or int64 arrays) and performs, for every i,
 *
 *     memcpy((void *)dst[i], (void *)src[i], lengths[i])
 *
 * The values are raw process addresses: the caller (ems.layout) has checked
 * that every range lies inside memory it owns (a registered tensor and the
 * mapped pool). Segments must not overlap one another's destinations.
 *
 * Design:
 * - All validation (formats, shapes, negative lengths, null addresses)
 *   happens with the GIL held and before any byte moves; then the GIL is
 *   released for the copy loop, so other Python threads (the asyncio loop
 *   talking to the daemon) keep running while hundreds of MiB are copied.
 * - Big batches are split over a few threads. The split is by bytes, not by
 *   segments, and may cut a segment in two, so one huge segment is split as
 *   well as many small ones: into pieces of about PIECE_BYTES that the
 *   threads take in turn (an atomic counter), so that a thread that starts
 *   late or loses its core for a while does not hold the copy up (an equal
 *   share per thread did). threads=0 picks automatically: one thread below
 *   BIG_BATCH_BYTES, else min(MAX_AUTO_THREADS, CPUs in the affinity mask).
 * - Copies use non-temporal (streaming) stores on x86-64: the destination
 *   is not read first (no read-for-ownership), so a copy costs two passes
 *   over memory instead of three, and a batch far larger than the caches does
 *   not evict the working set. Each segment's head up to a 64-byte boundary
 *   and its tail go through memcpy, so streaming stores only ever write whole
 *   cache lines; segments below NT_MIN_SEGMENT use memcpy. An sfence ends
 *   every thread's part so the data is globally visible once the call
 *   returns. nontemporal=-1 (the default) streams, 0 forces memcpy, 1
 *   streams. Other architectures always use memcpy. Small copies gain too:
 *   on the VM below, one cold 64 KiB block out of the pool took 24-43 us
 *   with memcpy and 7-9 us streamed (16 KiB: 7-12 and 3-5 us; into the pool
 *   9-10 and 6-8 us; 1-2 KiB alike), so streaming is no longer kept for
 *   batches of BIG_BATCH_BYTES and more.
 * - The streaming loop also reads its source with non-temporal prefetches
 *   (PREFETCHNTA, NT_PREFETCH bytes ahead), so that tens of MiB read once do
 *   not flush the L2 and L3 caches: the code and data of whatever runs next
 *   (the daemon answering the COMMIT that follows a save, the caller's own
 *   Python) stay cached. Same copy speed; measured on the VM below, the
 *   daemon's RESERVE handler for 32 blocks (run in one process with the
 *   copy) took 0.45-0.55 ms right after a 64 MiB streaming copy without the
 *   prefetches, 0.32-0.34 ms with them, 0.2 ms with hot caches.
 *
 * Measured on a 2-core AMD EPYC VM, a cold 128 MiB batch of 4096 scattered
 * 32 KiB segments: memcpy 10-11 GB/s on one thread, 15-16.5 GB/s on two;
 * streaming stores 16.5 GB/s on one, 20-21 GB/s on two. Two threads start to
 * pay off between 2 and 4 MiB. benchmarks/bench_copy.py re-measures a host.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#define HAVE_NT 1
#else
#define HAVE_NT 0
#endif

#define MAX_THREADS 8
#define MAX_AUTO_THREADS 4 /* a few threads saturate the memory bus; more only contend */
#define BIG_BATCH_BYTES ((uint64_t)4 << 20) /* more than one copy thread pays off above this */
#define NT_MIN_SEGMENT 1024                 /* shorter segments: plain memcpy */
#define NT_PREFETCH 1024                    /* bytes ahead of the source read by PREFETCHNTA */
#define PIECE_BYTES ((uint64_t)1 << 20)     /* threads take a big copy in pieces of about this */
#define MAX_PIECES 256

typedef struct {
    const uint64_t *dst;
    const uint64_t *src;
    const uint64_t *len;
    int nontemporal;      /* use streaming stores for long segments */
    Py_ssize_t first;     /* first segment index */
    uint64_t first_skip;  /* bytes of segment `first` already handled by the previous part */
    Py_ssize_t last;      /* last segment index (inclusive) */
    uint64_t last_take;   /* bytes of segment `last` handled here, counted from its start */
} part_t;

#if HAVE_NT
/* memcpy with streaming stores for the whole 64-byte lines of the destination; the source is
 * prefetched with the non-temporal hint (a prefetch past the end of the source is harmless: it
 * never faults). */
static void copy_stream(char *d, const char *s, size_t n) {
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n) {
        head = n;
    }
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        _mm_prefetch(s + NT_PREFETCH, _MM_HINT_NTA);
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}
#endif

/* Copy one contiguous byte range of the concatenated segments. */
static void copy_part(const part_t *p) {
    for (Py_ssize_t i = p->first; i <= p->last; i++) {
        uint64_t begin = (i == p->first) ? p->first_skip : 0;
        uint64_t end = (i == p->last) ? p->last_take : p->len[i];
        if (end <= begin) {
            continue;
        }
        char *d = (char *)(uintptr_t)p->dst[i] + begin;
        const char *s = (const char *)(uintptr_t)p->src[i] + begin;
        size_t n = (size_t)(end - begin);
#if HAVE_NT
        if (p->nontemporal && n >= NT_MIN_SEGMENT) {
            copy_stream(d, s, n);
            continue;
        }
#endif
        memcpy(d, s, n);
    }
#if HAVE_NT
    if (p->nontemporal) {
        _mm_sfence(); /* order the streaming stores before anything that follows */
    }
#endif
}

/*
 * Cut the byte stream [0, total) into `nparts` ranges of nearly equal size and
 * describe each as a part_t. Requires n >= 1 and total > 0.
 */
static void split_parts(const uint64_t *dst, const uint64_t *src, const uint64_t *len, Py_ssize_t n,
                        uint64_t total, int nparts, int nontemporal, part_t *parts) {
    Py_ssize_t i = 0;
    uint64_t seg_start = 0; /* byte position of segment i in the stream */
    for (int k = 0; k < nparts; k++) {
        uint64_t lo = total / nparts * k;
        uint64_t hi = (k == nparts - 1) ? total : total / nparts * (k + 1);
        part_t *p = &parts[k];
        p->dst = dst;
        p->src = src;
        p->len = len;
        p->nontemporal = nontemporal;
        while (seg_start + len[i] <= lo && i < n - 1) {
            seg_start += len[i];
            i++;
        }
        p->first = i;
        p->first_skip = lo - seg_start;
        Py_ssize_t j = i;
        uint64_t s = seg_start;
        while (s + len[j] < hi && j < n - 1) {
            s += len[j];
            j++;
        }
        p->last = j;
        p->last_take = hi - s;
    }
}

/* CPUs this process may run on (its affinity mask, e.g. a container's cpuset). */
static int usable_cpus(void) {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        return CPU_COUNT(&set);
    }
#endif
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cpus < 1 ? 1 : (int)cpus;
}

static int auto_threads(uint64_t total) {
    if (total < BIG_BATCH_BYTES) {
        return 1;
    }
    int cpus = usable_cpus();
    return cpus > MAX_AUTO_THREADS ? MAX_AUTO_THREADS : (cpus < 1 ? 1 : cpus);
}

/* The pieces of one copy and the next one to take; every thread takes pieces until none is left. */
typedef struct {
    const part_t *parts;
    int nparts;
    atomic_int next;
} queue_t;

static void *take_pieces(void *arg) {
    queue_t *q = (queue_t *)arg;
    int k;
    while ((k = atomic_fetch_add(&q->next, 1)) < q->nparts) {
        copy_part(&q->parts[k]);
    }
    return NULL;
}

/*
 * Run the copy over `nthreads` threads (the caller's thread is one of them). The bytes are cut
 * into pieces of about PIECE_BYTES that the threads take in turn, so a thread that starts late
 * or is preempted (another process on its core) leaves its share to the others instead of
 * holding the whole copy up.
 */
static int run_copy(const uint64_t *dst, const uint64_t *src, const uint64_t *len, Py_ssize_t n,
                    uint64_t total, int nthreads, int nontemporal) {
    part_t parts[MAX_PIECES];
    pthread_t tids[MAX_THREADS];
    int started = 0;
    if (nthreads <= 1 || n == 0 || total == 0) {
        part_t whole = {dst, src, len, nontemporal, 0, 0, n - 1, n > 0 ? len[n - 1] : 0};
        if (n > 0) {
            copy_part(&whole);
        }
        return 0;
    }
    uint64_t pieces = total / PIECE_BYTES;
    if (pieces > MAX_PIECES) {
        pieces = MAX_PIECES;
    }
    if (pieces < (uint64_t)nthreads) {
        pieces = (uint64_t)nthreads;
    }
    if (pieces > total) {
        pieces = total;
    }
    split_parts(dst, src, len, n, total, (int)pieces, nontemporal, parts);
    queue_t q = {parts, (int)pieces, 0};
    for (int k = 1; k < nthreads; k++) {
        if (pthread_create(&tids[k], NULL, take_pieces, &q) != 0) {
            break; /* the threads that did start (and this one) take every piece */
        }
        started = k;
    }
    take_pieces(&q);
    for (int k = 1; k <= started; k++) {
        pthread_join(tids[k], NULL);
    }
    return 0;
}

/* Accept 1-D C-contiguous buffers of 8-byte integers; returns 0 or -1 with an exception set. */
static int get_u64_buffer(PyObject *obj, const char *name, Py_buffer *view, int *is_signed) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s must be a C-contiguous buffer of 8-byte integers (numpy uint64/int64), got %s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    /* Skip a byte-order prefix that means native order ('<' or '>' only when it is). */
    if (*fmt == '@' || *fmt == '=' || *fmt == (PY_LITTLE_ENDIAN ? '<' : '>')) {
        fmt++;
    }
    int ok_fmt = fmt[0] != '\0' && fmt[1] == '\0' && strchr("qQlLnN", fmt[0]) != NULL;
    if (!ok_fmt || view->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "%s must hold 8-byte integers (uint64/int64), got format '%s'",
                     name, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    if (view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be 1-dimensional, got %d dimensions", name,
                     view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    *is_signed = (fmt[0] == 'q' || fmt[0] == 'l' || fmt[0] == 'n');
    return 0;
}

static PyObject *copy_segments(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "src", "lengths", "threads", "nontemporal", NULL};
    PyObject *dst_obj, *src_obj, *len_obj;
    int threads = 0;
    int nontemporal = -1;
    Py_buffer bufs[3];
    int signs[3];
    int nbufs = 0;
    PyObject *result = NULL;
    (void)self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|ii:copy_segments", kwlist, &dst_obj,
                                     &src_obj, &len_obj, &threads, &nontemporal)) {
        return NULL;
    }
    if (threads < 0 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in [0, %d], got %d", MAX_THREADS, threads);
        return NULL;
    }
    if (nontemporal < -1 || nontemporal > 1) {
        PyErr_Format(PyExc_ValueError, "nontemporal must be -1 (auto), 0 or 1, got %d", nontemporal);
        return NULL;
    }
    PyObject *objs[3] = {dst_obj, src_obj, len_obj};
    const char *names[3] = {"dst", "src", "lengths"};
    for (; nbufs < 3; nbufs++) {
        if (get_u64_buffer(objs[nbufs], names[nbufs], &bufs[nbufs], &signs[nbufs]) != 0) {
            goto done;
        }
    }
    Py_ssize_t n = bufs[0].shape ? bufs[0].shape[0] : bufs[0].len / 8;
    for (int k = 1; k < 3; k++) {
        Py_ssize_t nk = bufs[k].shape ? bufs[k].shape[0] : bufs[k].len / 8;
        if (nk != n) {
            PyErr_Format(PyExc_ValueError,
                         "dst, src and lengths must have equal length, got %zd, %zd and %zd",
                         bufs[0].len / 8, bufs[1].len / 8, bufs[2].len / 8);
            goto done;
        }
    }
    const uint64_t *dst = (const uint64_t *)bufs[0].buf;
    const uint64_t *src = (const uint64_t *)bufs[1].buf;
    const uint64_t *len = (const uint64_t *)bufs[2].buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (signs[2] && (int64_t)len[i] < 0) {
            PyErr_Format(PyExc_ValueError, "lengths[%zd] is negative: %lld", i, (long long)len[i]);
            goto done;
        }
        if (len[i] != 0 && (dst[i] == 0 || src[i] == 0)) {
            PyErr_Format(PyExc_ValueError, "segment %zd has a null address", i);
            goto done;
        }
        total += len[i];
    }
    int nthreads = threads == 0 ? auto_threads(total) : threads;
    if ((uint64_t)nthreads > total) {
        nthreads = 1;
    }
    int nt = nontemporal == -1 ? 1 : nontemporal; /* auto: streaming wherever segments are long */
    Py_BEGIN_ALLOW_THREADS
    run_copy(dst, src, len, n, total, nthreads, nt);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);

done:
    for (int k = 0; k < nbufs; k++) {
        PyBuffer_Release(&bufs[k]);
    }
    return result;
}

PyDoc_STRVAR(copy_segments_doc,
             "copy_segments(dst, src, lengths, threads=0, nontemporal=-1)\n--\n\n"
             "For every i: memcpy(dst[i], src[i], lengths[i]). The three arguments are 1-D\n"
             "C-contiguous buffers of 8-byte integers (numpy uint64/int64) of equal length,\n"
             "holding raw addresses and byte counts. The GIL is released during the copy.\n"
             "threads=0 chooses the number of copy threads automatically (1 for small\n"
             "batches); nontemporal=-1 or 1 uses streaming stores for segments of 1 KiB and\n"
             "more where the CPU has them, 0 never. Raises TypeError for a wrong buffer type or format and ValueError\n"
             "for unequal lengths, negative lengths or null addresses; nothing is copied then.");

static PyObject *max_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(MAX_THREADS);
}

static PyMethodDef methods[] = {
    {"copy_segments", (PyCFunction)(void (*)(void))copy_segments, METH_VARARGS | METH_KEYWORDS,
     copy_segments_doc},
    {"max_threads", max_threads, METH_NOARGS, "The largest accepted `threads` value."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ems._memcopy",
    .m_doc = "Batched memcpy over raw address arrays for the ems SDK's data path.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__memcopy(void) { return PyModule_Create(&module); }
